"""Online calibration end to end: held-out rows through the service, their true labels
back through ``POST /feedback``, and the online AUC and calibration ratio the sidecar
exports compared with the build-time baseline in the version's report.

With ``make up`` running (or ``make feedback-check``, which runs this)::

    python -m serve.ops.feedback_check            # every held-out row of the served version
    python -m serve.ops.feedback_check --rows 20000 --json bench/results/feedback.json

Steps: (1) ``GET /state`` names the served version; its report gives the baseline and the
data folder it was built from; (2) the held-out (``eval``) rows go to the inference API,
512 per request, as binary columnar bodies; each answer's ``x-request-id`` is kept;
(3) their labels are posted to ``POST /feedback`` (bearer token), 50,000 per body;
(4) ``GET /feedback`` gives the stable arm's online AUC and calibration ratio.

Pass: |online AUC - baseline AUC| <= 0.01 and |online calibration - baseline calibration|
<= 0.05 (the issue's bars). The online window must hold only this run's labels for the
figures to be the held-out set's: the check reads the counts it added, and says so when
the window held other labels too. Prints a table; writes JSON; exits 1 on a failed check.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serve.common.quality import summarize
from serve.constants import DEFAULT_SIDECAR_WRITE_PORT
from serve.errors import ServeError
from serve.ops.heldout import ScoredRequest, data_dir_of, score_split
from serve.store.repository import ModelRepository

__all__ = ["CheckRow", "compare", "label_triples", "main", "post_labels"]

REPO = Path(__file__).resolve().parents[2]
AUC_TOLERANCE = 0.01
CALIBRATION_TOLERANCE = 0.05
LABELS_PER_POST = 50_000


CheckRow = dict[str, Any]


def label_triples(answers: Sequence[ScoredRequest], labels: np.ndarray
                  ) -> list[tuple[str, int, int]]:
    """(request id, instance index, label) of every instance the answers scored: the
    body of ``POST /feedback`` for held-out rows (``labels``: the split's, by row)."""
    return [(a.request_id, k, int(labels[a.start + k]))
            for a in answers for k in range(a.stop - a.start)]


def post_labels(sidecar_url: str, token: str, triples: list[tuple[str, int, int]],
                per_post: int = LABELS_PER_POST, timeout_s: float = 120.0) -> dict[str, int]:
    """POST /feedback in bodies of ``per_post`` labels; returns the summed result counts."""
    totals: dict[str, int] = {}
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for i in range(0, len(triples), per_post):
            body = {"labels": [{"request_id": r, "index": k, "label": y}
                               for r, k, y in triples[i:i + per_post]]}
            res = client.post(f"{sidecar_url}/feedback", json=body,
                              headers={"Authorization": f"Bearer {token}"})
            if res.status_code != 200:
                raise ServeError(f"POST {sidecar_url}/feedback answered {res.status_code}: "
                                 f"{res.text[:300]}")
            for k, v in res.json().items():
                if isinstance(v, int):
                    totals[k] = totals.get(k, 0) + v
    return totals


def compare(online: dict[str, Any], baseline: dict[str, Any]) -> list[CheckRow]:
    """The two checks: online AUC and calibration ratio against the baseline's."""
    rows = []
    for name, key, tol in (("AUC", "auc", AUC_TOLERANCE),
                           ("calibration ratio", "calibration_ratio", CALIBRATION_TOLERANCE)):
        got, want = online.get(key), baseline.get(key)
        ok = (got is not None and want is not None and not math.isnan(got)
              and abs(got - want) <= tol)
        rows.append({"check": name, "online": got, "baseline": want,
                     "difference": None if got is None or want is None else got - want,
                     "tolerance": tol, "ok": bool(ok)})
    return rows


def _fmt(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.ops.feedback_check",
        description="Send a version's held-out rows through the service, post their labels "
                    "to POST /feedback, and compare the online AUC and calibration ratio "
                    "with the build-time baseline (|dAUC| <= 0.01, |dcalibration| <= 0.05).")
    p.add_argument("--url", default="http://127.0.0.1:8080/predictions/dlrm",
                   help="the inference endpoint")
    p.add_argument("--sidecar", default=f"http://127.0.0.1:{DEFAULT_SIDECAR_WRITE_PORT}",
                   help="the sidecar's write API (--write-port)")
    p.add_argument("--token-file", default=str(REPO / ".run" / "sidecar-token"),
                   help="the sidecar's bearer token (POST /feedback needs it)")
    p.add_argument("--repository", action="append", default=None,
                   help="model repository folder(s) with the version's report "
                        "(default: model_store)")
    p.add_argument("--version", default=None,
                   help="the version to check (default: the one GET /state says is served)")
    p.add_argument("--data-dir", default=None,
                   help="the data folder (default: <report build_dir>/data)")
    p.add_argument("--rows", type=int, default=None, help="held-out rows to send (default all)")
    p.add_argument("--batch", type=int, default=512, help="instances per request")
    p.add_argument("--clients", type=int, default=4, help="concurrent requests")
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "feedback.json"),
                   help="where to write the result")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except ServeError as e:
        print(f"feedback_check: {e.message}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"feedback_check: cannot reach the service ({e}); is it running (make up)?",
              file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    token = Path(args.token_file).read_text().strip()
    version = args.version
    if version is None:
        st = httpx.get(f"{args.sidecar}/state", timeout=10, trust_env=False).json()
        version = ((st.get("desired") or {}).get("model") or {}).get("version")
        if not version:
            raise ServeError(f"GET {args.sidecar}/state names no served version; pass --version")
    repo = ModelRepository([Path(r) for r in (args.repository or [REPO / "model_store"])])
    report = repo.report(version)
    baseline = report.get("baseline")
    if not baseline:
        raise ServeError(f"version {version}'s report has no baseline (built before "
                         "baselines existed); build a version with `make model` and serve it")
    data_dir = Path(args.data_dir) if args.data_dir else data_dir_of(report, REPO)
    print(f"version {version}: held-out rows from {data_dir}", flush=True)
    t0 = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.perf_counter() - last[0] > 5 or done == total:
            last[0] = time.perf_counter()
            print(f"  scored {done:,}/{total:,} rows", flush=True)

    answers = score_split(args.url, data_dir, rows=args.rows, batch=args.batch,
                          clients=args.clients, progress=progress)
    score_s = time.perf_counter() - t0
    from serve.model.data import load_split  # offline data format

    labels = np.asarray(load_split(data_dir, "eval").labels)
    triples = label_triples(answers, labels)
    served_by = sorted({(a.version, a.arm) for a in answers}, key=str)
    # What the client saw: the same join done here, the reference for the sidecar's.
    n = answers[-1].stop if answers else 0
    client_side = summarize(labels[:n], np.concatenate([a.scores for a in answers]))
    before = httpx.get(f"{args.sidecar}/feedback", timeout=30, trust_env=False).json()
    t1 = time.perf_counter()
    counts = post_labels(args.sidecar, token, triples)
    post_s = time.perf_counter() - t1
    status = httpx.get(f"{args.sidecar}/feedback", timeout=30, trust_env=False).json()
    arm = next((a for a in status["arms"] if a["version"] == version and a["arm"] == "stable"),
               None)
    if arm is None or arm["online"] is None:
        raise ServeError(f"GET /feedback has no stable-arm window for {version} after "
                         f"posting {len(triples):,} labels (results {counts}); is the "
                         "prediction log configured (DLRM_PREDICTION_LOG_DIR)?")
    online = arm["online"]
    prior = next((a["online"]["rows"] for a in before.get("arms", [])
                  if a["version"] == version and a["arm"] == "stable" and a["online"]), 0)
    rows = compare(online, baseline)
    result = {
        "version": version, "rows_sent": n, "requests": len(answers),
        "served_by": [list(x) for x in served_by], "feedback": counts,
        "window_rows": online["rows"], "window_rows_before": prior,
        "score_seconds": round(score_s, 2), "feedback_seconds": round(post_s, 2),
        "online": online, "baseline": {k: baseline.get(k) for k in
                                       ("rows", "observed_ctr", "predicted_ctr",
                                        "calibration_ratio", "auc")},
        "client_side": {k: v for k, v in client_side.to_dict().items()
                        if not k.startswith("score_")},
        "checks": rows, "ok": all(r["ok"] for r in rows),
    }
    print(f"\nsent {n:,} held-out rows in {len(answers):,} requests ({score_s:.1f} s); "
          f"posted {len(triples):,} labels ({post_s:.1f} s): {counts}")
    if prior:
        print(f"note: the window already held {prior:,} labelled predictions of {version} "
              "before this run; the online figures include them")
    print(f"\n{'check':<18} {'online':>8} {'baseline':>9} {'client':>8} {'diff':>8} "
          f"{'tol':>6}  ok")
    for r in rows:
        key = "auc" if r["check"] == "AUC" else "calibration_ratio"
        print(f"{r['check']:<18} {_fmt(r['online']):>8} {_fmt(r['baseline']):>9} "
              f"{_fmt(result['client_side'][key]):>8} {_fmt(r['difference']):>8} "
              f"{r['tolerance']:>6}  {'yes' if r['ok'] else 'NO'}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
