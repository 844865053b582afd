"""Measure a live endpoint on a day's held-out click logs: AUC over HTTP, as JSON.

    python -m serve.ops.evaluate --url http://127.0.0.1:8080 --day 1

sends the held-out (``eval``) rows of day ``--day`` of the profile's click logs
(``serve.model.data``: deterministic from the profile's seed; generated into
``build/<profile>-data/day<N>`` on first use) through the inference API in binary
columnar requests of ``--batch`` instances, ``--clients`` at a time, and prints ONE JSON
line last::

    {"auc": 0.8712, "rows": 100000, "day": 1, "profile": "small", "observed_ctr": ...,
     "predicted_ctr": ..., "versions": {"small-int8-s0": 196}, "requests": 196,
     "seconds": 3.4, "url": "http://127.0.0.1:8080/predictions/dlrm"}

``versions`` counts the requests answered by each model version (the response's
``X-DLRM-Model-Version``): a rollout in progress shows up there. Progress goes to stderr.
Any non-200 answer stops the run with exit code 1 (an AUC over part of the rows would
mislead); a bad argument exits 2. Anyone can measure a deployed model on the same data as
the build with it (the freshness check of ``make delta`` in docs/deltas.md uses it before and
after a delta).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from serve.errors import ConfigError, ServeError
from serve.profiles import PROFILES, get_profile

__all__ = ["evaluate", "main", "predict_url"]


def predict_url(url: str, model: str) -> str:
    """``url`` itself when it already names ``/predictions/<model>``, else the model's
    predict URL under it."""
    base = url.rstrip("/")
    if "/predictions/" in base:
        return base
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--url {url!r} must start with http:// or https:// "
                          "(e.g. http://127.0.0.1:8080)")
    return f"{base}/predictions/{model}"


def evaluate(url: str, data_dir: Path, *, rows: int | None = None, batch: int = 512,
             clients: int = 4, progress: bool = True) -> dict[str, Any]:
    """Score the eval split of ``data_dir`` on ``url`` (a predict URL); the result JSON.

    Raises:
        ConfigError: no data there; UpstreamUnavailable: a request not answered 200.
    """
    from serve.common.quality import roc_auc
    from serve.model.data import load_split
    from serve.ops.heldout import score_split

    split = load_split(data_dir, "eval")
    n = len(split) if rows is None else min(rows, len(split))
    t0 = time.perf_counter()
    last = [0.0]

    def say(done: int, total: int) -> None:
        now = time.perf_counter()
        if progress and (now - last[0] > 2.0 or done == total):
            last[0] = now
            print(f"evaluate: {done:,}/{total:,} rows ({done / max(now - t0, 1e-9):,.0f} "
                  "rows/s)", file=sys.stderr, flush=True)

    answers = score_split(url, data_dir, "eval", rows=n, batch=batch, clients=clients,
                          progress=say)
    seconds = time.perf_counter() - t0
    scores = np.concatenate([a.scores for a in answers]) if answers else np.zeros(0, np.float32)
    labels = np.asarray(split.labels[:n], dtype=np.float64)
    return {"auc": round(float(roc_auc(labels, scores)), 6), "rows": int(n),
            "day": int(split.meta.get("day", 0)), "profile": split.meta.get("profile"),
            "observed_ctr": round(float(labels.mean()), 6) if n else None,
            "predicted_ctr": round(float(scores.mean()), 6) if n else None,
            "versions": dict(Counter(a.version or "unknown" for a in answers)),
            "requests": len(answers), "seconds": round(seconds, 3), "url": url}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.ops.evaluate",
        description="Send a day's held-out click logs through a live endpoint's HTTP API and "
                    "print the AUC as one JSON line (the last line of stdout).")
    ap.add_argument("--url", required=True,
                    help="the inference endpoint, e.g. http://127.0.0.1:8080 (or a full "
                         ".../predictions/<model> URL)")
    ap.add_argument("--day", type=int, default=0,
                    help="which day of click logs (0 = the build's; 1, 2 ... = later days whose "
                         "signal has drifted); default 0")
    ap.add_argument("--profile", default="small",
                    help=f"profile of the served model ({', '.join(PROFILES)}); default small")
    ap.add_argument("--model", default="dlrm", help="TorchServe model name (default dlrm)")
    ap.add_argument("--data", default=None,
                    help="data folder to read instead (default build/<profile>-data/day<N>, "
                         "generated when missing)")
    ap.add_argument("--rows", type=int, default=None,
                    help="score only the first N held-out rows (default all)")
    ap.add_argument("--batch", type=int, default=512, help="instances per request (default 512)")
    ap.add_argument("--clients", type=int, default=4,
                    help="concurrent requests (default 4)")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.day < 0:
            raise ConfigError(f"--day {args.day} must be >= 0")
        for name in ("batch", "clients"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name} {getattr(args, name)} must be >= 1")
        if args.rows is not None and args.rows < 1:
            raise ConfigError(f"--rows {args.rows} must be >= 1")
        url = predict_url(args.url, args.model)
        if args.data is not None:
            data_dir = Path(args.data)
        else:
            from serve.model.data import ensure_day_data

            data_dir = ensure_day_data(get_profile(args.profile), args.day,
                                       say=lambda s: print(s, file=sys.stderr, flush=True))
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    try:
        res = evaluate(url, data_dir, rows=args.rows, batch=args.batch, clients=args.clients)
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    line = json.dumps(res)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
