"""Where to put the click-quality gates' limits: offline numbers on held-out rows.

    python -m bench.quality_calibration                      # the small models (~1 min)
    python -m bench.quality_calibration --seeds 50 --rows 20000   # quicker

Scores the held-out (``eval``) rows of the stable model's data in process
(``serve.runtime.engine.Runtime``, CPU, one thread) with each model: the stable one
(``small-int8-s0``), a good retrain (``small-int8-s7``, same click logs, other seed),
a shuffled-label model where one exists (``small-int8-s8-shuffled`` in the model store;
else the tiny pair of the test cache, ``--tiny-stable``/``--tiny-shuffled``, scored on the
tiny data), and two synthetic broken candidates built from the stable's own scores:
``permuted`` (the scores shuffled across rows: the same score distribution, no
information, AUC 0.5) and ``base_rate`` (every score = the observed CTR: calibrated, no
information, NE 1), and one miscalibrated candidate, ``overpredict`` (the stable's
scores x 1.25, capped at 0.999: as informative, but 25% too many clicks predicted).
The artifacts are read from the ``.mar`` archives (``artifact.pt``).

Then it replays canary splits: for each ``labels`` per arm and each seed, ``2 x labels``
distinct held-out rows are drawn at random, the first half labelled for the stable arm,
the second for the candidate, their sums go through
:func:`serve.sidecar.control.quality_gates.evaluate_quality` at the default limits
(``serve.constants.QUALITY_*``, judging from that many labels), and it counts the
breaches of each gate, also at the other limits of ``NE_GRID`` and ``CAL_GRID`` (the same
lower bounds against other thresholds). ``A/A`` is the
stable model against itself (the false-alarm rate). Prints a table and writes
``bench/results/quality_calibration.json`` (rows, seeds and the default limits included).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from serve.common.quality import logloss, summarize
from serve.constants import (
    QUALITY_MAX_CALIBRATION_GAP,
    QUALITY_MAX_NE_INCREASE,
    QUALITY_Z,
)
from serve.model.data import columnar_rows
from serve.sidecar.control.quality_gates import (
    QualityCounts,
    QualityLimits,
    QualitySnapshot,
    evaluate_quality,
)
from serve.store.repository import extract_artifact

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "quality_calibration.json"
LABELS = (500, 1000, 2000, 5000, 10000)
#: Other limits whose breach rates are reported beside the defaults' (same replays).
NE_GRID = (0.0, 0.01, 0.02, 0.03, 0.05)
CAL_GRID = (0.0, 0.05, 0.1, 0.2)


def _artifact(mar: Path, tmp: Path) -> Path:
    """The artifact.pt inside a .mar (a zip), extracted to ``tmp/<archive stem>/`` beside a
    link to the tables folder it references (format 3: the rows stay in the repository)."""
    return extract_artifact(mar, tmp / mar.stem)


def score(artifact: Path, data_dir: Path, rows: int | None, batch: int = 2048) -> tuple[
        np.ndarray, np.ndarray]:
    """(labels uint8 (n,), scores float32 (n,)) of the eval split, scored in process."""
    import torch

    from serve.model.data import load_split
    from serve.runtime.engine import Runtime

    torch.set_num_threads(1)
    rt = Runtime.from_artifact(artifact)
    data = load_split(data_dir, "eval")
    n = len(data) if rows is None else min(rows, len(data))
    out = np.empty(n, dtype=np.float32)
    for start in range(0, n, batch):
        stop = min(start + batch, n)
        out[start:stop] = rt.predict_arrays(*columnar_rows(data, start, stop))
    return np.asarray(data.labels[:n], dtype=np.uint8), out


def _counts(y: np.ndarray, p: np.ndarray, ll: np.ndarray) -> QualityCounts:
    return QualityCounts(n=int(y.shape[0]), clicks=int(y.sum()), score_sum=float(p.sum()),
                         ll_sum=float(ll.sum()), ll_sq_sum=float((ll * ll).sum()))


def replay(y: np.ndarray, stable: np.ndarray, candidate: np.ndarray, labels: int, seeds: int,
           limits: QualityLimits) -> dict[str, Any]:
    """Breach rates and value quantiles of both gates over ``seeds`` random splits of
    ``labels`` rows per arm (disjoint rows per arm, as a random canary split gives)."""
    ll_s, ll_c = logloss(y, stable), logloss(y, candidate)
    values: dict[str, list[float]] = {"ne_increase": [], "calibration_gap": []}
    breached = dict.fromkeys(values, 0)
    # judge at exactly this many labels
    limits = QualityLimits(**{**limits.model_dump(), "min_labels": labels})
    for seed in range(seeds):
        idx = np.random.default_rng(seed).choice(y.shape[0], size=2 * labels, replace=False)
        a, b = idx[:labels], idx[labels:]
        q = QualitySnapshot(_counts(y[a], stable[a], ll_s[a]),
                            _counts(y[b], candidate[b], ll_c[b]))
        for r in evaluate_quality(q, limits):
            if r.value is not None:
                values[r.name].append(r.value)
            breached[r.name] += r.status == "breached"
    out: dict[str, Any] = {"labels_per_arm": labels, "seeds": seeds}
    grids = {"ne_increase": NE_GRID, "calibration_gap": CAL_GRID}
    for name, v in values.items():
        arr = np.asarray(v) if v else np.full(1, np.nan)
        out[name] = {"breach_rate": breached[name] / seeds, "judged": len(v),
                     "breach_rate_at": {str(t): float(np.mean(arr > t)) for t in grids[name]},
                     "lower_bound_p01": round(float(np.quantile(arr, 0.01)), 4),
                     "lower_bound_median": round(float(np.median(arr)), 4),
                     "lower_bound_p99": round(float(np.quantile(arr, 0.99)), 4)}
    return out


def offline(y: np.ndarray, p: np.ndarray) -> dict[str, Any]:
    s = summarize(y, p)
    return {"rows": s.rows, "auc": None if s.auc is None else round(s.auc, 4),
            "ne": None if s.ne is None else round(s.ne, 4), "logloss": round(s.logloss, 4),
            "observed_ctr": round(s.observed_ctr, 4),
            "calibration_ratio": round(s.calibration_ratio, 4)}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.quality_calibration",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-store", type=Path, default=REPO / "model_store")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="the stable's held-out data (default: <repo>/build/small-s0/data, "
                         "else /work/main/build/small-s0/data)")
    ap.add_argument("--tiny-stable", type=Path, default=None,
                    help="a tiny build folder (test cache) for the real shuffled-label pair")
    ap.add_argument("--tiny-shuffled", type=Path, default=None)
    ap.add_argument("--rows", type=int, default=None, help="held-out rows (default all)")
    ap.add_argument("--seeds", type=int, default=500, help="random splits per point")
    ap.add_argument("--json", type=Path, default=OUT)
    return ap


def _score_small(args: argparse.Namespace, data_dir: Path, models: dict[str, Any]
                 ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The held-out labels (n,) and each small version's scores (n,) found in the model
    store; their offline figures go into ``models``."""
    with tempfile.TemporaryDirectory(prefix="qcal-") as tmp:
        scored: dict[str, np.ndarray] = {}
        y = np.zeros(0, np.uint8)
        for version in ("small-int8-s0", "small-int8-s7", "small-int8-s8-shuffled"):
            mar = args.model_store / f"dlrm-{version}.mar"
            if not mar.is_file():
                print(f"({mar} not found: skipped)", file=sys.stderr)
                continue
            y, scored[version] = score(_artifact(mar, Path(tmp)), data_dir, args.rows)
            models[version] = offline(y, scored[version])
            print(f"scored {version}: {models[version]}", file=sys.stderr, flush=True)
    return y, scored


def _pairs(args: argparse.Namespace, y: np.ndarray, scored: dict[str, np.ndarray],
           models: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The (labels, stable, candidate) pairs to replay: A/A, the real candidates, the
    synthetic ones made from the stable, and the tiny pair when given."""
    pairs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # name: y, stable, cand
    stable = scored["small-int8-s0"]
    rng = np.random.default_rng(0)
    synthetic = {"permuted": rng.permutation(stable),
                 "base_rate": np.full_like(stable, float(y.mean())),
                 "overpredict": np.minimum(stable * 1.25, 0.999).astype(np.float32)}
    for name, p in synthetic.items():
        models[f"small-int8-s0 {name}"] = offline(y, p)
    pairs["A/A small-int8-s0"] = (y, stable, stable)
    for version in ("small-int8-s7", "small-int8-s8-shuffled"):
        if version in scored:
            pairs[f"{version} vs s0"] = (y, stable, scored[version])
    for name, p in synthetic.items():
        pairs[f"s0 {name} vs s0"] = (y, stable, p)
    if args.tiny_stable and args.tiny_shuffled:
        ty, ts = score(args.tiny_stable / "artifact.pt", args.tiny_stable / "data", None)
        _, tb = score(args.tiny_shuffled / "artifact.pt", args.tiny_stable / "data", None)
        models["tiny-int8-s0"], models["tiny-int8-s0-shuffled"] = offline(ty, ts), offline(ty, tb)
        pairs["A/A tiny-int8-s0"] = (ty, ts, ts)
        pairs["tiny-int8-s0-shuffled vs tiny s0"] = (ty, ts, tb)
    return pairs


def _print_tables(models: dict[str, Any], results: list[dict[str, Any]], seeds: int) -> None:
    print(f"{'model':34} {'auc':>7} {'ne':>7} {'cal':>7}")
    for name, m in models.items():
        print(f"{name:34} {m['auc'] if m['auc'] is not None else float('nan'):7.4f} "
              f"{m['ne']:7.4f} {m['calibration_ratio']:7.4f}")
    print(f"\nbreach rates at the defaults (ne_increase > {QUALITY_MAX_NE_INCREASE}, "
          f"calibration_gap > {QUALITY_MAX_CALIBRATION_GAP}) over {seeds} splits; "
          "lb = the gate's lower bound, quantiles p01/median/p99; ne@ = breach rate at "
          f"max_ne_increase {NE_GRID}")
    print(f"{'pair':34} {'labels':>6} {'ne':>6} {'ne lb p01/med/p99':>26} {'ne@':>30} "
          f"{'cal':>6} {'cal lb p01/med/p99':>26}")
    for r in results:
        ne, cal = r["ne_increase"], r["calibration_gap"]
        at = "/".join(f"{x:.3f}" for x in ne["breach_rate_at"].values())
        print(f"{r['pair']:34} {r['labels_per_arm']:6d} {ne['breach_rate']:6.3f} "
              f"{ne['lower_bound_p01']:8.4f}/{ne['lower_bound_median']:.4f}/"
              f"{ne['lower_bound_p99']:.4f} {at:>30} {cal['breach_rate']:6.3f} "
              f"{cal['lower_bound_p01']:8.4f}/{cal['lower_bound_median']:.4f}/"
              f"{cal['lower_bound_p99']:.4f}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    limits = QualityLimits()
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = next((d for d in (REPO / "build/small-s0/data",
                                     Path("/work/main/build/small-s0/data"))
                         if (d / "meta.json").is_file()), REPO / "build/small-s0/data")
    t0 = time.perf_counter()
    models: dict[str, Any] = {}
    y, scored = _score_small(args, data_dir, models)
    pairs = _pairs(args, y, scored, models)
    results: list[dict[str, Any]] = []
    for name, (py, ps, pc) in pairs.items():
        for labels in LABELS:
            if 2 * labels > py.shape[0]:
                continue
            r = replay(py, ps, pc, labels, args.seeds, limits)
            results.append({"pair": name, **r})
    doc = {"data_dir": str(data_dir), "rows": int(y.shape[0]), "seeds": args.seeds,
           "seeds_are": "numpy default_rng(seed) for seed in 0..seeds-1, per point",
           "limits": {"max_ne_increase": QUALITY_MAX_NE_INCREASE,
                      "max_calibration_gap": QUALITY_MAX_CALIBRATION_GAP, "z": QUALITY_Z},
           "tiny_pair": [str(args.tiny_stable), str(args.tiny_shuffled)]
           if args.tiny_stable and args.tiny_shuffled else None,
           "models": models, "replay": results,
           "seconds": round(time.perf_counter() - t0, 1)}
    _print_tables(models, results, args.seeds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.json} ({doc['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
