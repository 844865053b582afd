"""Modulo vs managed id spaces on a later day: the same model built both ways, each
refreshed live by its day-D embedding delta, measured on day D's held-out rows.

    python -m bench.delta_compare                   # make delta-compare: small, small-hashed, small-half; day 1
    python -m bench.delta_compare --profiles tiny   # a quick run

``small`` has a row for every id of its click logs (ids 0..rows-1 on day 0), so modulo
collides only the new ids of later days; ``small-hashed`` is the same click logs with
every id a 63-bit hash of it, as raw logs carry ids (:func:`serve.model.data.hash_ids`),
so ``id % rows`` folds ids at random from day 0 on (tables as large as the id space);
``small-half`` serves small's click logs with tables of half as many rows, the production
regime (more ids than rows), where modulo folds two ids into every row from day 0 on. For each profile and each mapping (``modulo``: row = id % rows; ``managed``: the id map of
:mod:`serve.runtime.idmap`, admission and eviction decided by training):

1. build the day-0 version (``python -m serve.model.pipeline --mapping M``; skipped when
   that version is in the model store already), same profile, seed and click logs;
2. build its day-D delta (``python -m serve.model.delta --day D``) in a work folder of
   this benchmark (``build/delta-compare/``), so ``make delta``'s own chains are left alone;
3. start a service of its own serving that version (TorchServe + sidecar on free
   ports, shipped defaults: batching 2/2 ms, 2 workers, the tuner on) and run
   :func:`serve.ops.delta_check.run_check`: day D's AUC before (``python -m
   serve.ops.evaluate``'s measurement: held-out rows through the inference API), the
   delta POSTed while closed-loop clients send requests, the AUC after;
4. ``unknown_ratio``: the share of day D's held-out lookups that have no row of their
   own after the delta: for modulo, ids whose row ``id % rows`` another id of those rows
   also reads; for managed, ids outside the version's id map after the delta (they read
   the fallback row). Counted offline from the data and the delta's rebuilt artifact.

Writes ``bench/results/delta_compare.json``::

    {"runs": [{"profile", "mapping": "modulo" | "managed", "version", "auc_before", "auc_after",
               "unknown_ratio", "delta_rows", "delta_bytes", "apply_s", "assigned",
               "evicted", "served", "failed", "post_status"}, ...],
     "state": {...what was measured: profile, day, seed, batching, workers, tuner, load},
     "managed_minus_modulo_auc_after": {profile: ...},
     "checks": {"managed_gain_<profile>": ..., "no_failed_requests": ...}, "ok": bool}

and prints the table. Exit 1 when a check fails: managed ``auc_after`` at least
``--min-gain`` (0.005) above modulo's, 0 failed requests in each run, each POST applied.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "delta_compare.json"
WORK = REPO / "build" / "delta-compare"
MAPPINGS = ("modulo", "managed")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.delta_compare",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="small,small-hashed,small-half",
                    help="model profiles, comma-separated (default small,small-hashed,small-half)")
    ap.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    ap.add_argument("--day", type=int, default=1, help="the later day (default 1)")
    ap.add_argument("--model-store", type=Path, default=REPO / "model_store")
    ap.add_argument("--clients", type=int, default=4, help="load clients during the POST (4)")
    ap.add_argument("--instances", type=int, default=512, help="instances per load request (512)")
    ap.add_argument("--after-s", type=float, default=10.0,
                    help="seconds of load after the POST answered (10)")
    ap.add_argument("--min-gain", type=float, default=0.005,
                    help="managed AUC after its delta over modulo's (0.005)")
    ap.add_argument("--fallback-share", type=float, default=None,
                    help="managed builds: share of each table's rows that unadmitted ids "
                         "share by id %% k (default: the build's default); given, the "
                         "version is named ...-managed-fb<percent>")
    ap.add_argument("--out", type=Path, default=OUT, help=f"output (default {OUT})")
    return ap


def version_name(profile: str, seed: int, mapping: str) -> str:
    """The version each mapping builds, as ``make model`` names it:
    ``<profile>-int8-s<seed>[-managed]``."""
    from serve.store.repository import default_version

    return default_version(profile, seed=seed, mapping=mapping)


def _run(cmd: list[str]) -> str:
    """Run a build step, its progress on our stderr; its stdout returned."""
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"delta_compare: {' '.join(cmd)} failed with exit {proc.returncode}")
    return proc.stdout


def build(args: argparse.Namespace, profile: str, mapping: str) -> tuple[str, Path]:
    """The day-0 version (built if missing) and its day-D delta (built afresh)."""
    version = version_name(profile, args.seed, mapping)
    extra: list[str] = []
    if mapping == "managed" and args.fallback_share is not None:
        version += f"-fb{round(args.fallback_share * 100)}"
        extra = ["--fallback-share", str(args.fallback_share)]
    _run([sys.executable, "-m", "serve.model.pipeline", "--profile", profile,
          "--seed", str(args.seed), "--version", version, "--model-store", str(args.model_store),
          "--mapping", mapping, "--if-missing", *extra])
    work = WORK / version
    shutil.rmtree(work, ignore_errors=True)
    out = _run([sys.executable, "-m", "serve.model.delta", "--day", str(args.day),
                "--version", version, "--model-store", str(args.model_store),
                "--work-root", str(work)])
    return version, Path(out.strip().splitlines()[-1])


def unknown_ratio(artifact_path: Path, profile: str, day: int) -> float:
    """Share of day ``day``'s held-out lookups without a row of their own under the
    artifact's mapping (module docstring, step 4)."""
    import torch

    from serve.model.data import ensure_day_data, load_split
    from serve.profiles import get_profile
    from serve.runtime.artifact import load_artifact

    art = load_artifact(artifact_path)
    split = load_split(ensure_day_data(get_profile(profile), day), "eval")
    ids = np.asarray(split.sparse)                       # (n, F, M)
    n, nf, m = ids.shape
    lengths = (np.asarray(split.lengths) if getattr(split, "lengths", None) is not None
               else np.ones((n, nf), dtype=np.uint8))
    valid = np.arange(m)[None, None, :] < lengths[:, :, None]
    unknown = total = 0
    for f, t in enumerate(art.schema.feature_tables):
        spec = art.schema.tables[t]
        v = ids[:, f, :][valid[:, f, :]].astype(np.int64)
        total += v.size
        if spec.mapping == "managed":
            _, found = art.id_maps[spec.name].lookup_with_hits(torch.from_numpy(v))
            unknown += int((~found).sum())
        else:
            unknown += shared_row_lookups(v, spec.rows)
    return unknown / max(total, 1)


def shared_row_lookups(ids: np.ndarray, rows: int) -> int:
    """Lookups of ``ids`` (int64 (k,), >= 0) without a row of their own under modulo: the
    id's row ``id % rows`` is also the row of another id among ``ids`` (dense ids: the
    ids beyond the table and the ids they fold onto; hashed ids: any two with equal
    ``id % rows``)."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    _, row_of, per_row = np.unique(uniq % rows, return_inverse=True, return_counts=True)
    return int((per_row[row_of] > 1)[inverse].sum())


def measure(args: argparse.Namespace, profile: str, mapping: str, version: str,
            delta: Path) -> dict[str, Any]:
    """Serve ``version``, apply ``delta`` live under load, AUC before and after."""
    from serve.ops.delta_check import run_check
    from serve.ops.launcher import running_service

    root = WORK / "service" / version
    shutil.rmtree(root, ignore_errors=True)
    with running_service(root, args.model_store, version) as (cfg, _client):
        check = argparse.Namespace(
            delta=str(delta), url=cfg.inference_url, sidecar=cfg.sidecar_write_url,
            token_file=str(cfg.token_file), day=args.day, profile=profile,
            clients=args.clients, instances=args.instances, after_s=args.after_s,
            min_gain=-1.0, json=None)
        res = run_check(check)
    apply_s = max(res["apply_seconds_per_worker"].values(), default=None)
    return {"profile": profile, "mapping": mapping, "version": version,
            "auc_before": res["auc_before"], "auc_after": res["auc_after"],
            "unknown_ratio": round(unknown_ratio(delta.parent / "artifact.pt",
                                                 profile, args.day), 6),
            "delta_rows": res["delta_rows"], "delta_bytes": res["delta_bytes"],
            "apply_s": apply_s, "assigned": res["delta_assigned"],
            "evicted": res["delta_evicted"], "served": res["load"]["served"],
            "failed": res["load"]["failed"], "post_status": res["post_status"],
            "eval_rows": res["eval_rows"]}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the service a measurement started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    profiles = [p for p in args.profiles.split(",") if p]
    state = {"profiles": profiles, "seed": args.seed, "day": args.day,
             "service": "shipped defaults: batching 2/2 ms, 2 workers, tuner on, cache off (CPU)",
             "load": f"{args.clients} closed-loop clients x {args.instances} instances"}
    print(f"delta-compare: {state}", flush=True)
    from serve.ops.machine import announce

    machine = announce()
    runs, gains = [], {}
    for profile in profiles:
        built = {m: build(args, profile, m) for m in MAPPINGS}
        got = {m: measure(args, profile, m, *built[m]) for m in MAPPINGS}
        runs += [got[m] for m in MAPPINGS]
        gains[profile] = round(got["managed"]["auc_after"] - got["modulo"]["auc_after"], 6)
    checks = {f"managed_gain_{p}": g >= args.min_gain for p, g in gains.items()}
    checks["no_failed_requests"] = all(r["failed"] == 0 and r["served"] > 0 for r in runs)
    checks["posts_applied"] = all(r["post_status"] == 200 for r in runs)
    result = {"runs": runs, "state": state, "machine": machine,
              "managed_minus_modulo_auc_after": gains,
              "checks": checks, "ok": all(checks.values()),
              "seconds": round(time.time() - t0, 1),
              "command": "python -m bench.delta_compare " + " ".join(argv or sys.argv[1:])}
    print(f"\nstate: {state}")
    print(f"| profile | mapping | day-{args.day} AUC before | after | unknown ratio | delta rows "
          "| delta bytes | ids assigned | evicted | apply s | served | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['profile']} | {r['mapping']} | {r['auc_before']:.4f} | {r['auc_after']:.4f} | "
              f"{r['unknown_ratio']:.4f} | {r['delta_rows']:,} | {r['delta_bytes']:,} | "
              f"{r['assigned']:,} | {r['evicted']:,} | {r['apply_s']} | {r['served']:,} | "
              f"{r['failed']} |")
    for p, g in gains.items():
        print(f"{p}: managed - modulo AUC after the delta: {g:+.4f} (needs >= {args.min_gain})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"checks: {checks} -> {'ok' if result['ok'] else 'FAILED'}; wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
