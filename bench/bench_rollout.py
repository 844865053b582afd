"""What a rollout costs and what its guards see: a 10% canary and a 10% shadow against a
single version, and the guards of a good and of a bad candidate, under load.

    make up && make model SEED=7 && make model SEED=8 LABEL_SHUFFLE=1
    python -m bench.bench_rollout [--clients 8] [--instances 512] [--seconds 30]

Against the service `make up` started, with ``--clients`` closed-loop clients posting
``--instances``-instance requests (binary form), it measures throughput over ``--seconds``
in each of:

1. ``single``: the declared version alone (no rollout);
2. ``canary``: a canary of ``--candidate`` at weight ``--weight`` (default 0.1): each
   TorchServe batch split into one forward per arm;
3. ``shadow``: the same candidate in shadow mode at ``--weight``: every request answered
   by the stable version, the sampled share also scored by the candidate.

The rollouts bake for an hour (they must not end during the measurement); each guard's
value at the end of the window is recorded, then they are rolled back by hand. With
``--bad`` (default: the newest ``*-shuffled`` version in the repository) a fourth run
declares a canary of that candidate with the default guards and records how long the
guards took to roll it back, and their values.

Prints a table, writes ``bench/results/rollout.json``; exit code 1 if any request failed,
a rollout did not start, or the bad candidate was not rolled back within ``--timeout``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from serve.api.binary import example_binary
from serve.api.request import BINARY_MEDIA_TYPE
from serve.constants import DEFAULT_SIDECAR_WRITE_PORT, DEFAULT_TOKEN_FILE
from serve.errors import UpstreamUnavailable
from serve.ops.loadgen import BackgroundLoad
from serve.ops.machine import machine_info
from serve.ops.state_client import StateClient

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "rollout.json"
LONG_BAKE_S = 3600.0


def _guards(body: dict[str, Any]) -> dict[str, Any]:
    r = body.get("rollout") or {}
    return {g["name"]: {"value": g["value"], "threshold": g["threshold"], "status": g["status"]}
            for g in r.get("guards", [])}


def _workers_rss_mib() -> float:
    """RSS of every TorchServe worker on this machine (MiB), steady state."""
    import psutil

    from serve.sidecar.adapters.memory import worker_rss

    total = sum(worker_rss(p) or 0 for p in psutil.pids())
    return round(total / (1 << 20), 1)


def _measure(client: StateClient, url: str, bodies: list[bytes], clients: int,
             seconds: float, instances: int) -> dict[str, Any]:
    """Throughput over ``seconds`` after a warm-up of 2 answers per client."""
    with BackgroundLoad(url, bodies, clients=clients, content_type=BINARY_MEDIA_TYPE,
                        timeout_s=120) as load:
        load.wait_for(2 * clients, timeout_s=120)
        n0, t0 = load.served, time.monotonic()
        time.sleep(seconds)
        n1, t1 = load.served, time.monotonic()
        state = client.state()
        rss = _workers_rss_mib()
    rate = (n1 - n0) / (t1 - t0)
    return {"requests_per_s": round(rate, 2), "instances_per_s": round(rate * instances, 1),
            "served": load.served, "failed": load.failed, "failures": load.failures[:3],
            "by_version": {str(k): v for k, v in load.versions().items()},
            "workers_rss_mib": rss, "guards": _guards(state)}


def _declare(client: StateClient, desired: dict[str, Any], timeout_s: float) -> None:
    r = client.put_state(desired)
    if r.status_code != 202:
        raise SystemExit(f"PUT /state answered {r.status_code}: {r.text}")
    if desired.get("rollout"):
        client.wait_rollout(phase="baking", serving=True, timeout_s=timeout_s)
    else:
        client.wait_converged(desired, timeout_s=timeout_s)


def _end(client: StateClient, timeout_s: float) -> None:
    r = client.rollout_action("rollback")
    if r.status_code != 200:
        raise SystemExit(f"POST /state/rollout/rollback answered {r.status_code}: {r.text}")
    client.wait_rollout(phase="rolled_back", converged=True, timeout_s=timeout_s)


def _bad_run(client: StateClient, url: str, bodies: list[bytes], start: dict[str, Any],
             bad: str, args: argparse.Namespace) -> dict[str, Any]:
    """A canary of the bad candidate with the default guards: until rolled back."""
    rollout = {"candidate": bad, "mode": "canary", "weight": args.weight, "bake_s": 600}
    with BackgroundLoad(url, bodies, clients=args.clients, content_type=BINARY_MEDIA_TYPE,
                        timeout_s=120) as load:
        load.wait_for(2 * args.clients, timeout_s=120)
        _declare(client, {**start, "rollout": rollout}, args.timeout)
        t0 = time.monotonic()
        body = client.wait_rollout(phase="rolled_back", timeout_s=args.timeout)
        took = time.monotonic() - t0
        client.wait_rollout(phase="rolled_back", converged=True, timeout_s=args.timeout)
    r = body["rollout"]
    return {"run": f"bad canary {args.weight:g} ({bad})", "rolled_back_after_s": round(took, 1),
            "evaluations": r["evaluations"], "guard_interval_s": r["guard_interval_s"],
            "reason": r["reason"], "guards": _guards(body), "served": load.served,
            "failed": load.failed, "failures": load.failures[:3]}


def _print(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["instances_per_s"]
    print("| run | instances/s | vs single | workers RSS MiB | served | failed | error_ratio "
          "| latency_ratio | score_psi |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = r.get("guards", {})
        vals = [g.get(k, {}).get("value") for k in ("error_ratio", "latency_ratio", "score_psi")]
        cells = ["-" if v is None else f"{v:.4g}" for v in vals]
        ips = r.get("instances_per_s")
        rel = f"{ips / base:.3f}" if ips else "-"
        print(f"| {r['run']} | {ips if ips else '-'} "
              f"{r.get('instances_per_s_rounds', '')} | {rel} | {r.get('workers_rss_mib', '-')} "
              f"| {r['served']} | {r['failed']} | "
              + " | ".join(cells) + " |")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_rollout", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inference-url", default="http://127.0.0.1:8080")
    ap.add_argument("--sidecar-url", default=f"http://127.0.0.1:{DEFAULT_SIDECAR_WRITE_PORT}",
                    help="the sidecar's write API (its --write-port)")
    ap.add_argument("--token-file", default=DEFAULT_TOKEN_FILE,
                    help="the sidecar's bearer token (make up writes it)")
    ap.add_argument("--candidate", default=None,
                    help="the good candidate (default: the newest other version that is not "
                         "*-shuffled)")
    ap.add_argument("--bad", default=None,
                    help="a bad candidate for the guard run (default: the newest *-shuffled "
                         "version; none: skipped)")
    ap.add_argument("--weight", type=float, default=0.1, help="canary/shadow share")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    ap.add_argument("--instances", type=int, default=512, help="instances per request")
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement window per run")
    ap.add_argument("--rounds", type=int, default=2,
                    help="the three runs are repeated this many times, interleaved (machine "
                         "noise drifts); the table shows the median per run")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a state change (or the bad candidate's rollback) may take")
    ap.add_argument("--out", default=str(OUT))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    client = StateClient(args.sidecar_url, (REPO / args.token_file).read_text().strip(),
                         timeout_s=30)
    url = f"{args.inference_url.rstrip('/')}/predictions/dlrm"
    st = client.state()
    start = st["desired"]
    if start is None or not st["converged"] or start.get("rollout"):
        raise SystemExit(f"the service is not converged on a state without a rollout: "
                         f"{json.dumps(st)}")
    v0 = start["model"]["version"]
    others = [v for v in st["available_versions"] if v != v0]
    good = args.candidate or next((v for v in reversed(others)
                                   if not v.endswith("-shuffled")), None)
    bad = args.bad or next((v for v in reversed(others) if v.endswith("-shuffled")), None)
    if good is None:
        raise SystemExit(f"only {v0} in the repository; build a candidate: make model SEED=7")
    bodies = [example_binary(args.instances, seed=s) for s in range(8)]
    rows: list[dict[str, Any]] = []
    rounds: dict[str, list[dict[str, Any]]] = {}
    try:
        for k in range(args.rounds):
            for name, rollout in (("single", None),
                                  ("canary", {"candidate": good, "mode": "canary"}),
                                  ("shadow", {"candidate": good, "mode": "shadow"})):
                label = name if rollout is None else f"{name} {args.weight:g} ({good})"
                print(f"==> round {k + 1}/{args.rounds}: {label}", flush=True)
                if rollout is not None:
                    rollout = {**rollout, "weight": args.weight, "bake_s": LONG_BAKE_S}
                _declare(client, {**start, "rollout": rollout}, args.timeout)
                row = _measure(client, url, bodies, args.clients, args.seconds, args.instances)
                if rollout is None:  # GET /state still shows the last rollout's guards
                    row["guards"] = {}
                print(f"    {row['instances_per_s']} instances/s, {row['failed']} failed",
                      flush=True)
                rounds.setdefault(label, []).append(row)
                if rollout is not None:
                    _end(client, args.timeout)
        for label, runs in rounds.items():
            median = sorted(runs, key=lambda r: r["instances_per_s"])[(len(runs) - 1) // 2]
            rows.append({"run": label, **median,
                         "instances_per_s_rounds": [r["instances_per_s"] for r in runs],
                         "served": sum(r["served"] for r in runs),
                         "failed": sum(r["failed"] for r in runs)})
        if bad is not None:
            print(f"==> bad canary ({bad})", flush=True)
            rows.append(_bad_run(client, url, bodies, start, bad, args))
    except UpstreamUnavailable as e:
        raise SystemExit(e.message) from None
    finally:
        if client.state().get("desired") != start:
            client.put_state(start)
    _print(rows)
    doc = {"clients": args.clients, "instances": args.instances, "seconds": args.seconds,
           "rounds": args.rounds,
           "weight": args.weight, "stable": v0, "candidate": good, "bad": bad, "rows": rows,
           "machine": machine_info(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"-> {args.out}")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
