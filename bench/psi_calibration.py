"""Where the ``score_psi`` guard's limit belongs: the PSI of same-data retrains against the
stable version, and of a shuffled-label model, on the traffic the guard sees.

    make psi-calibration [PSI_ARGS="--instances 60000 --draws 50"]
    python -m bench.psi_calibration --stable small-int8-s0

The guard compares the candidate arm's score histogram (``SCORE_BUCKETS``) with the stable
arm's over one window of live traffic. Its limit must sit above every plain retrain
(same data, another seed: a good candidate) and below a broken model (trained on
shuffled labels, AUC ~0.5). This measures both on:

1. ``loadtest``: instances drawn like ``make loadtest``'s ranking traffic
   (:mod:`loadtest.traffic`: Zipf ids through the training permutation, softplus-normal
   dense features), which is what a rollout bakes under here;
2. ``heldout``: the held-out rows of the build (the score histograms in each version's
   report, ``baseline.score_counts``), i.e. the training distribution itself.

For ``loadtest`` it also draws what one guard evaluation sees: the two arms are disjoint
random parts of the same traffic, the candidate with ``n`` instances and the stable with
``n * (1 - w) / w`` (canary weight ``w``), ``--draws`` times per ``n``; the table gives the
mean, p95 and max PSI per ``n``. Every model runs in process on the CPU
(:class:`serve.runtime.engine.Runtime`, the serving runtime), one thread per forward.

Prints a table and writes ``bench/results/psi_calibration.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from serve.common.histograms import psi
from serve.metrics import SCORE_BUCKETS
from serve.profiles import get_profile
from serve.store.repository import SHUFFLED_SUFFIX, ModelRepository, extract_artifact

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "psi_calibration.json"  # --traffic example: *_example.json


def _example_traffic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n instances of ``example_request`` (what the tests and ``bench_rollout`` send): ids
    uniform over [0, 2^31), so mostly rows training rarely touched."""
    import orjson

    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.api.json_body import example_request

    cfg = HandlerConfig()
    dense, lengths, values = [], [], []
    for k, start in enumerate(range(0, n, 4096)):
        p = parse_body(orjson.dumps(example_request(min(4096, n - start), seed=seed * 1000 + k)),
                       cfg)
        dense.append(p.dense)
        lengths.append(p.lengths)
        values.append(p.values)
    # values are feature-major per chunk: regroup them feature-major over all n
    per_feature: list[list[np.ndarray]] = [[] for _ in range(lengths[0].shape[0])]
    for lo, va in zip(lengths, values, strict=True):
        counts = lo.sum(axis=1)
        for j, part in enumerate(np.split(va, np.cumsum(counts)[:-1])):
            per_feature[j].append(part)
    return (np.concatenate(dense).astype(np.float32),
            np.concatenate([np.concatenate(f) for f in per_feature]).astype(np.int64),
            np.concatenate(lengths, axis=1).astype(np.int32))


def _traffic(profile_name: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n instances like ``make loadtest``'s: float32 (n, N) dense, int64 values, int32 (F, n)
    lengths (one id per feature)."""
    from loadtest.traffic import IdSampler, dense_features

    p = get_profile(profile_name)
    rng = np.random.default_rng([seed, 2024])
    sampler = IdSampler(p, 1.05)
    dense = dense_features(rng, n).astype(np.float32)
    values = np.concatenate([sampler.ids(rng, j, n) for j in range(p.num_sparse)])
    lengths = np.ones((p.num_sparse, n), dtype=np.int32)
    return dense, values.astype(np.int64), lengths


def _scores(mar: Path, data: tuple[np.ndarray, np.ndarray, np.ndarray], chunk: int = 4096
            ) -> np.ndarray:
    """(n,) probabilities of the version in ``mar`` over ``data``."""
    from serve.runtime.engine import Runtime, RuntimeConfig

    dense, values, lengths = data
    with tempfile.TemporaryDirectory(prefix="psi-") as tmp:
        # the artifact and a link to its tables folder (format 3: mapped in place)
        rt = Runtime.from_artifact(extract_artifact(mar, tmp), RuntimeConfig())
    n, out = dense.shape[0], []
    starts = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))])  # feature offsets
    inner = np.concatenate([np.zeros((lengths.shape[0], 1), dtype=np.int64),
                            np.cumsum(lengths, axis=1)], axis=1)   # (F, n+1) per feature
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        lo = np.ascontiguousarray(lengths[:, start:stop])
        vals = np.concatenate([values[starts[j] + inner[j, start]:starts[j] + inner[j, stop]]
                               for j in range(lo.shape[0])])
        out.append(rt.predict_arrays(np.ascontiguousarray(dense[start:stop]), vals, lo))
    return np.concatenate(out)


def _bins(scores: np.ndarray) -> np.ndarray:
    """Per-bin counts over SCORE_BUCKETS (upper edges, then +Inf), as the workers bin."""
    edges = np.asarray(SCORE_BUCKETS, dtype=np.float64)
    idx = np.searchsorted(edges, scores.astype(np.float64), side="left")
    return np.bincount(idx, minlength=len(edges) + 1)


def _window_psi(stable: np.ndarray, cand: np.ndarray, n: int, weight: float, draws: int,
                rng: np.random.Generator) -> dict[str, float]:
    """PSI over ``draws`` guard windows: disjoint random instances, n for the candidate."""
    m = round(n * (1 - weight) / weight)
    total = stable.shape[0]
    if n + m > total:
        raise SystemExit(f"--instances {total} is too few for a window of {n} + {m}")
    values = []
    for _ in range(draws):
        perm = rng.permutation(total)
        values.append(psi(_bins(stable[perm[n:n + m]]).tolist(), _bins(cand[perm[:n]]).tolist()))
    v = np.asarray(values)
    return {"n_candidate": n, "n_stable": m, "mean": round(float(v.mean()), 4),
            "p95": round(float(np.quantile(v, 0.95)), 4), "max": round(float(v.max()), 4)}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.psi_calibration", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stable", default="small-int8-s0", help="the stable version")
    ap.add_argument("--candidates", nargs="*", default=None,
                    help="versions compared with it (default: every other small-int8-s* of "
                         "the repository, shuffled ones included)")
    ap.add_argument("--model-store", default=str(REPO / "model_store"))
    ap.add_argument("--traffic", choices=("loadtest", "example"), default="loadtest",
                    help="loadtest: make loadtest's ranking traffic; example: example_request "
                         "bodies (uniform ids; what the tests and bench_rollout send)")
    ap.add_argument("--instances", type=int, default=60_000,
                    help="loadtest-like instances scored by every version (default 60000)")
    ap.add_argument("--windows", type=int, nargs="*", default=[500, 2000, 12_000],
                    help="candidate instances per simulated guard window")
    ap.add_argument("--weight", type=float, default=0.2, help="canary weight of the windows")
    ap.add_argument("--draws", type=int, default=50, help="windows drawn per size")
    ap.add_argument("--seed", type=int, default=0, help="traffic and draw seed")
    ap.add_argument("--out", default=None, help=f"default {OUT.relative_to(REPO)} (loadtest), "
                                                 "psi_calibration_example.json (example)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.out is None:
        args.out = str(OUT if args.traffic == "loadtest"
                       else OUT.with_name("psi_calibration_example.json"))
    import torch

    torch.set_num_threads(1)
    repo = ModelRepository([Path(args.model_store)])
    if not repo.exists(args.stable):
        print(f"error: {args.stable} is not in {args.model_store}; make model", file=sys.stderr)
        return 2
    stable_report = repo.report(args.stable)
    prefix = args.stable.rsplit("-s", 1)[0] + "-s"
    cands = args.candidates if args.candidates is not None else [
        v for v in repo.versions() if v.startswith(prefix) and v != args.stable
        and "-day" not in v]
    profile = str(stable_report.get("profile", "small"))
    data = (_traffic(profile, args.instances, args.seed) if args.traffic == "loadtest"
            else _example_traffic(args.instances, args.seed))
    t0 = time.monotonic()
    stable_scores = _scores(repo.archive(args.stable), data)
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    held_s = [*stable_report["baseline"]["score_counts"], 0]
    for v in cands:
        report = repo.report(v)
        scores = _scores(repo.archive(v), data)
        held_c = [*report["baseline"]["score_counts"], 0]
        row = {"candidate": v, "kind": "shuffled" if v.endswith(SHUFFLED_SUFFIX) else "retrain",
               "auc_heldout": round(float(report.get("auc_quantized", float("nan"))), 4),
               "psi_heldout": round(psi(held_s, held_c), 4),
               "psi_loadtest": round(psi(_bins(stable_scores).tolist(), _bins(scores).tolist()), 4),
               "mean_score_loadtest": round(float(scores.mean()), 4),
               "windows": [_window_psi(stable_scores, scores, n, args.weight, args.draws, rng)
                           for n in args.windows]}
        rows.append(row)
        print(f"  {v}: done", flush=True)
    result = {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.psi_calibration " + " ".join(argv or sys.argv[1:]),
        "state": {"stable": args.stable, "instances": args.instances, "traffic": {
                  "loadtest": "loadtest (Zipf 1.05 ids through the training permutation, "
                              "softplus-normal dense)",
                  "example": "example_request (ids uniform over [0, 2^31))"}[args.traffic],
                  "weight": args.weight, "draws": args.draws, "seed": args.seed,
                  "bins": "SCORE_BUCKETS + (1, inf)"},
        "stable_mean_score_loadtest": round(float(stable_scores.mean()), 4),
        "seconds": round(time.monotonic() - t0, 1), "rows": rows}
    _print(result, args.windows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _print(result: dict[str, Any], windows: list[int]) -> None:
    st = result["state"]
    print(f"\nscore PSI against {st['stable']} (weight {st['weight']}, {st['draws']} draws per "
          f"window, {st['instances']} instances of {st['traffic'].split(' ')[0]} traffic)")
    head = f"{'candidate':28s} {'kind':8s} {'AUC':>6s} {'held-out':>9s} {'loadtest':>9s}"
    for n in windows:
        head += f" {'n=' + str(n) + ' mean/max':>20s}"
    print(head)
    for r in result["rows"]:
        line = (f"{r['candidate']:28s} {r['kind']:8s} {r['auc_heldout']:6.3f} "
                f"{r['psi_heldout']:9.4f} {r['psi_loadtest']:9.4f}")
        for w in r["windows"]:
            line += f" {w['mean']:9.3f}/{w['max']:<10.3f}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
