"""Live changes of the declared serving state under load: how long, how much memory, lost?

    make up && python -m bench.bench_switch [--to VERSION] [--clients 8] [--instances 512]

Against the service `make up` started (sidecar writes on :8091, TorchServe on :8080), with
``--clients`` closed-loop clients posting ``--instances``-instance requests (binary form)
the whole time, it runs three changes through ``PUT /state`` and waits for ``GET /state``
to report ``converged`` on each:

1. batch size: the declared batch size -> ``--batch-size`` (default twice it; same version);
2. model version: -> ``--to`` (default: the newest other version in the repository);
3. back to what was declared at the start.

For each change it prints and records: seconds until converged, the switch's own seconds
and peak memory (``last_switch`` in GET /state: RSS of TorchServe's workers, and the
cgroup's usage where there is one), requests served and failed during the change, and the
answers per ``X-DLRM-Model-Version``. It also checks that a fixed input's predictions
differ between the two versions. Results -> ``bench/results/switch.json``. Exit code 1 if
any request failed or a change did not converge within ``--timeout``.

The state it measures is declared beside the figures (printed and in the JSON): the
version, batching and workers declared at the start, and the batching tuner, which it
turns off for the run (a tuner switch in the middle of a change would be measured as part
of it) and turns back on at the end if it was on.

Needs two versions in the repository: ``make model`` and ``make model SEED=7``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from serve.api.binary import example_binary
from serve.api.json_body import example_request
from serve.api.request import BINARY_MEDIA_TYPE
from serve.constants import DEFAULT_SIDECAR_WRITE_PORT, DEFAULT_TOKEN_FILE
from serve.errors import UpstreamUnavailable
from serve.ops.loadgen import VERSION_HEADER, BackgroundLoad
from serve.ops.machine import machine_info
from serve.ops.state_client import StateClient, tuner_paused

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "switch.json"


class Service:
    """The service under test: its state API and one fixed-input predict."""

    def __init__(self, inference: str, sidecar: str, token: str) -> None:
        self.predict_url = f"{inference.rstrip('/')}/predictions/dlrm"
        self.client = StateClient(sidecar, token)

    def state(self) -> dict[str, Any]:
        return self.client.state()

    def declare(self, desired: dict[str, Any], timeout_s: float) -> float:
        """PUT /state and wait for converged on it; seconds taken (exits on a failure)."""
        try:
            return self.client.declare(desired, timeout_s=timeout_s)
        except UpstreamUnavailable as e:
            raise SystemExit(e.message) from None

    def probe(self) -> tuple[list[float], str | None]:
        r = httpx.post(self.predict_url, json=example_request(4, seed=123), timeout=30)
        r.raise_for_status()
        return list(r.json()["predictions"]), r.headers.get(VERSION_HEADER)


def _change(svc: Service, name: str, desired: dict[str, Any], bodies: list[bytes],
            clients: int, timeout_s: float) -> dict[str, Any]:
    with BackgroundLoad(svc.predict_url, bodies, clients=clients,
                        content_type=BINARY_MEDIA_TYPE, timeout_s=120) as load:
        load.wait_for(2 * clients, timeout_s=120)
        start_served = load.served
        seconds = svc.declare(desired, timeout_s)
        load.wait_for(load.served + 2 * clients, timeout_s=120)
    last = svc.state().get("last_switch") or {}
    mib = 1 << 20
    row = {
        "change": name, "converged_s": round(seconds, 2),
        "switch_s": last.get("seconds"), "from": last.get("from"), "to": last.get("to"),
        "peak_memory_mib": round(last["peak_memory_bytes"] / mib, 1)
        if last.get("peak_memory_bytes") else None,
        "peak_workers_rss_mib": round(last["peak_workers_rss_bytes"] / mib, 1)
        if last.get("peak_workers_rss_bytes") else None,
        "served": load.served, "served_during_change": load.served - start_served,
        "failed": load.failed, "failures": load.failures[:3],
        "by_version": {str(k): v for k, v in load.versions().items()},
    }
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    head = ("change", "converged s", "switch s", "peak MiB", "workers RSS MiB", "served",
            "failed", "answers by version")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        by = ", ".join(f"{k}: {v}" for k, v in r["by_version"].items())
        print(f"| {r['change']} | {r['converged_s']} | {r['switch_s']} | {r['peak_memory_mib']} "
              f"| {r['peak_workers_rss_mib']} | {r['served']} | {r['failed']} | {by} |")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_switch", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inference-url", default="http://127.0.0.1:8080")
    ap.add_argument("--sidecar-url", default=f"http://127.0.0.1:{DEFAULT_SIDECAR_WRITE_PORT}",
                    help="the sidecar's write API (its --write-port)")
    ap.add_argument("--token-file", default=DEFAULT_TOKEN_FILE,
                    help="the sidecar's bearer token (make up writes it)")
    ap.add_argument("--to", default=None, help="version to switch to (default: newest other)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="batch size of change 1 (default: twice the declared one, so the "
                         "change is never a no-op)")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    ap.add_argument("--instances", type=int, default=512, help="instances per request")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds a change may take to converge (the issue's bound: 60)")
    ap.add_argument("--out", default=str(OUT))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    token = (REPO / args.token_file).read_text().strip()
    svc = Service(args.inference_url, args.sidecar_url, token)
    st = svc.state()
    start = st["desired"]
    if start is None or not st["converged"]:
        raise SystemExit(f"the service is not converged on a declared state: {json.dumps(st)}")
    v0 = start["model"]["version"]
    others = [v for v in st["available_versions"] if v != v0]
    v1 = args.to or (others[-1] if others else None)
    if v1 is None:
        raise SystemExit(f"only {v0} in the repository; build another: make model SEED=7")
    client = svc.client
    try:
        with tuner_paused(client, settle=lambda: client.wait_declared_batching(
                args.timeout)) as tuner_was:
            return _run(args, svc, start, v0, v1, tuner_was)
    except UpstreamUnavailable as e:
        raise SystemExit(e.message) from None


def _run(args: argparse.Namespace, svc: Service, start: dict[str, Any], v0: str, v1: str,
         tuner_was: bool | None) -> int:
    declared = {"version": v0, "batching": start["batching"], "workers": start["workers"],
                "tuner": "off for the run" + (" (was on; turned back on after)" if tuner_was
                                              else " (was off)" if tuner_was is False
                                              else " (no tuner)")}
    print(f"state at the start: {json.dumps(declared)}; {args.clients} clients x "
          f"{args.instances} instances (binary)", flush=True)
    bodies = [example_binary(args.instances, seed=s) for s in range(8)]
    p0, h0 = svc.probe()
    b0 = start["batching"]["batch_size"]
    b1 = args.batch_size or min(2 * b0, 4096)
    batch = {**start, "batching": {**start["batching"], "batch_size": b1}}
    changes = [(f"batch {b0} -> {b1}", batch),
               (f"version {v0} -> {v1}", {**batch, "model": {"version": v1}}),
               (f"back to {v0}, batch {b0}", start)]
    rows = []
    for name, desired in changes:
        print(f"==> {name}", flush=True)
        rows.append(_change(svc, name, desired, bodies, args.clients, args.timeout))
        if desired["model"]["version"] == v1 and not any(r.get("probe") for r in rows):
            p1, h1 = svc.probe()
            rows[-1]["probe"] = {"version": h1, "differs_from": h0, "max_abs_diff": max(
                abs(a - b) for a, b in zip(p0, p1, strict=True))}
    _print(rows)
    probe = rows[1].get("probe", {})
    print(f"fixed input: {h0} vs {probe.get('version')}: max |Δp| = "
          f"{probe.get('max_abs_diff', float('nan')):.4g}")
    doc = {"clients": args.clients, "instances": args.instances, "state": declared, "rows": rows,
           "machine": machine_info(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"-> {args.out}")
    bad = any(r["failed"] for r in rows) or not probe.get("max_abs_diff")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
