"""Do the default guards decide right? Repeated canaries of a good, a bad and a slow
candidate under ranking traffic, each decided by the guards alone.

    make rollout-trials [TRIALS=20 BAD_TRIALS=20 SLOW_TRIALS=2]
    python -m bench.rollout_trials --trials 20 --bad-trials 20 --slow-trials 2

It starts its own service (TorchServe + sidecar through :mod:`serve.ops.launcher`, free
loopback ports, ``config.properties`` and every sidecar default as shipped: the workers
and batching of :mod:`serve.state`, the batching tuner on) serving ``--stable``, and
drives it with ``--clients`` closed-loop clients sending ``make loadtest``'s ranking traffic
(:mod:`loadtest.traffic`: 100-700 instances per request, ~10% singles, Zipf ids through
the training permutation) for the whole run. Then, one after the other, each trial
declares a canary of its candidate at ``--weight`` for ``--bake`` seconds with the
**default guards** (nothing in ``rollout.guards``) and waits until the guards decide:

``good``
    ``--good`` (default ``small-int8-s7``: same data, another seed): must be promoted;
``bad``
    ``--bad`` (default ``small-int8-s8-shuffled``: trained on permuted labels, AUC ~0.5):
    must be rolled back;
``slow``
    ``--good`` again, in a second service whose workers run the candidate's forward
    ``--slowdown`` times slower (the test-only ``DLRM_DEBUG_CANDIDATE_SLOWDOWN``): must be
    rolled back.

Each trial's ``rollout.attempt`` is its number, so a candidate decided before is tried
again (a decided rollout is never re-baked otherwise). Between trials the stable version
is declared again (after a promotion that is a version switch). Every answer of the load
is checked (HTTP 200): a failed request fails the run.

Prints one row per trial (outcome, seconds from the declaration to the decision and from
the first weight to the decision, evaluations, the deciding reason) and a summary per
kind; writes ``bench/results/rollout_trials.json``. Exit code 0 when every good trial
but at most ``--allowed-good-misses`` was promoted, every bad and slow one rolled back,
and no request failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from serve import settings
from serve.ops.loadgen import BackgroundLoad
from serve.ops.state_client import StateClient
from serve.state import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_DELAY_MS, DEFAULT_WORKERS

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "rollout_trials.json"
SLOWDOWN_ENV = settings.DLRM_DEBUG_CANDIDATE_SLOWDOWN.name


@contextlib.contextmanager
def _service(root: Path, store: Path, stable: str, extra_env: dict[str, str]
             ) -> Iterator[tuple[str, StateClient]]:
    """A service on free ports serving ``stable`` (shipped defaults), stopped at the end."""
    from serve.ops.launcher import running_service

    with running_service(root, store, stable, extra_env) as (cfg, client):
        yield f"{cfg.inference_url}/predictions/dlrm", client


def _bodies(clients: int) -> tuple[list[bytes], float]:
    """``make loadtest``'s ranking bodies (JSON, columnar) and their mean instances."""
    from loadtest.traffic import RequestPool, TrafficConfig
    from serve.profiles import get_profile

    pool = RequestPool(TrafficConfig(profile=get_profile("small"), body_format="columnar",
                                     pool_size=64, seed=clients))
    return [r.body for r in pool.requests], pool.mean_instances


def _trial(client: StateClient, stable: dict[str, Any], kind: str, candidate: str,
           attempt: int, args: argparse.Namespace) -> dict[str, Any]:
    """One canary decided by the guards; the stable version declared again after it."""
    rollout = {"candidate": candidate, "mode": "canary", "weight": args.weight,
               "bake_s": args.bake, "attempt": attempt}
    t0 = time.monotonic()
    r = client.put_state({**stable, "rollout": rollout})
    if r.status_code != 202:
        raise SystemExit(f"PUT /state answered {r.status_code}: {r.text}")
    serving = client.wait_rollout(serving=True, timeout_s=args.timeout)
    t_serving = time.monotonic()
    body = None
    deadline = t0 + args.timeout + args.bake * 4
    while time.monotonic() < deadline:
        body = client.state()
        phase = (body.get("rollout") or {}).get("phase")
        if phase in ("promoted", "rolled_back"):
            break
        time.sleep(0.5)
    t_decided = time.monotonic()
    ro = (body or {}).get("rollout") or {}
    row = {"kind": kind, "candidate": candidate, "attempt": attempt,
           "outcome": ro.get("phase", "undecided"),
           "decided_after_declare_s": round(t_decided - t0, 1),
           "decided_after_serving_s": round(t_decided - t_serving, 1),
           "load_s": round(t_serving - t0, 1), "evaluations": ro.get("evaluations"),
           "reason": ro.get("reason"), "revision": ro.get("revision"),
           "guards": {g["name"]: {"value": g["value"], "status": g["status"]}
                      for g in ro.get("guards", [])},
           "serving_rollout": (serving.get("rollout") or {}).get("serving_version")}
    if row["outcome"] == "undecided":
        client.rollout_action("rollback")
    client.put_state(stable)
    client.wait_converged(stable, timeout_s=args.timeout)
    return row


def _run_kind(url: str, client: StateClient, bodies: list[bytes], plan: list[tuple[str, str]],
              args: argparse.Namespace, rows: list[dict[str, Any]], loads: list[dict[str, Any]]
              ) -> None:
    stable = client.state()["desired"]
    with BackgroundLoad(url, bodies, clients=args.clients, timeout_s=120) as load:
        load.wait_for(2 * args.clients, timeout_s=120)
        for i, (kind, cand) in enumerate(plan, 1):
            row = _trial(client, stable, kind, cand, len(rows) + 1, args)
            rows.append(row)
            print(f"  {len(rows):3d} {kind:5s} {cand:24s} {row['outcome']:12s} "
                  f"{row['decided_after_serving_s']:6.1f} s after serving "
                  f"({row['evaluations']} evaluations) {row['reason'] or ''}"[:200],
                  flush=True)
            if i % 5 == 0:
                print(f"      load so far: {load.served} served, {load.failed} failed",
                      flush=True)
        loads.append({"served": load.served, "failed": load.failed,
                      "failures": load.failures[:5]})


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("good", "bad", "slow"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        times = sorted(r["decided_after_serving_s"] for r in rs)
        out[kind] = {"trials": len(rs),
                     "promoted": sum(r["outcome"] == "promoted" for r in rs),
                     "rolled_back": sum(r["outcome"] == "rolled_back" for r in rs),
                     "undecided": sum(r["outcome"] == "undecided" for r in rs),
                     "decided_after_serving_s": {"min": times[0], "median": times[len(times) // 2],
                                                 "max": times[-1]}}
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout_trials", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stable", default="small-int8-s0")
    ap.add_argument("--good", default="small-int8-s7")
    ap.add_argument("--bad", default="small-int8-s8-shuffled")
    ap.add_argument("--trials", type=int, default=20, help="good trials (default 20)")
    ap.add_argument("--bad-trials", type=int, default=20, help="bad trials (default 20)")
    ap.add_argument("--slow-trials", type=int, default=2, help="slow trials (default 2)")
    ap.add_argument("--slowdown", type=float, default=1.5,
                    help="the slow candidate's forward time factor (default 1.5)")
    ap.add_argument("--weight", type=float, default=0.2, help="canary weight (default 0.2)")
    ap.add_argument("--bake", type=float, default=60.0, help="bake seconds (default 60)")
    ap.add_argument("--clients", type=int, default=3, help="closed-loop clients (default 3)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a version switch may take")
    ap.add_argument("--allowed-good-misses", type=int, default=1,
                    help="good trials that may be rolled back (default 1: 19 of 20)")
    ap.add_argument("--model-store", default=str(REPO / "model_store"))
    ap.add_argument("--out", default=str(OUT))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the service of a trial is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    store = Path(args.model_store)
    bodies, mean = _bodies(args.clients)
    # good and bad interleaved: drift of the machine over the run hits both kinds alike
    plan: list[tuple[str, str]] = []
    for i in range(max(args.trials, args.bad_trials)):
        plan += [("good", args.good)] if i < args.trials else []
        plan += [("bad", args.bad)] if i < args.bad_trials else []
    state = {"stable": args.stable, "weight": args.weight, "bake_s": args.bake,
             "guards": "defaults", "clients": args.clients,
             "traffic": f"make loadtest ranking bodies, mean {mean:.0f} instances",
             "batching": f"shipped ({DEFAULT_BATCH_SIZE}/{DEFAULT_MAX_BATCH_DELAY_MS} ms, "
                         "tuner on)", "workers": DEFAULT_WORKERS}
    print("rollout trials: " + ", ".join(f"{k}={v}" for k, v in state.items()), flush=True)
    rows: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rollout-trials-") as tmp:
        if plan:
            with _service(Path(tmp) / "a", store, args.stable, {}) as (url, client):
                _run_kind(url, client, bodies, plan, args, rows, loads)
        if args.slow_trials:
            env = {SLOWDOWN_ENV: str(args.slowdown)}
            with _service(Path(tmp) / "b", store, args.stable, env) as (url, client):
                _run_kind(url, client, bodies, [("slow", args.good)] * args.slow_trials,
                          args, rows, loads)
    summary = _summary(rows)
    failed = sum(x["failed"] for x in loads)
    served = sum(x["served"] for x in loads)
    ok = (failed == 0
          and summary.get("good", {}).get("promoted", 0) >= args.trials - args.allowed_good_misses
          and summary.get("bad", {}).get("rolled_back", 0) == args.bad_trials
          and summary.get("slow", {}).get("rolled_back", 0) == args.slow_trials)
    print(f"\n{'kind':5s} {'trials':>6s} {'promoted':>8s} {'rolled back':>11s} "
          f"{'decision s after serving (min/median/max)':>42s}")
    for kind, s in summary.items():
        t = s["decided_after_serving_s"]
        print(f"{kind:5s} {s['trials']:6d} {s['promoted']:8d} {s['rolled_back']:11d} "
              f"{t['min']:>20.1f} / {t['median']:.1f} / {t['max']:.1f}")
    print(f"requests: {served} served, {failed} failed; {time.monotonic() - t0:.0f} s; "
          f"{'OK' if ok else 'NOT OK'}")
    result = {"created_at": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": "python -m bench.rollout_trials " + " ".join(argv or sys.argv[1:]),
              "state": state, "summary": summary, "served": served, "failed": failed,
              "failures": [f for x in loads for f in x["failures"]][:5], "ok": ok,
              "trials": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
