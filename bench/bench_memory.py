"""Pod memory with 2 and 4 workers, each with its own copy of the tables vs one shared copy.

    python -m bench.bench_memory [--version small-int8-s0] [--workers 2 4] [--requests 64]

For each worker count and each table mode (``DLRM_SHARED_TABLES=0``: every worker copies
the tables into its own memory, what the service did before; ``1``: the workers map one
shared file, :mod:`serve.runtime.shared`), it starts the real service (launcher:
TorchServe + sidecar, on free loopback ports, its own run folder), waits until every
worker is READY, sends ``--requests`` requests of 512 instances (so every page a forward
touches is resident), then reads ``/proc/<pid>/smaps_rollup`` of every process of the pod
(TorchServe's frontend and its workers, and the sidecar):

* ``rss_mb``: the sum of RSS, what ``ps`` shows: a shared page counts once per process;
* ``pss_mb``: the sum of PSS (each shared page split between the processes mapping it):
  the pod's real footprint in pages, the figure to compare;
* ``workers_pss_mb``: the workers' part of it.

Results: a table on stdout and ``bench/results/memory.json``. Needs the version in
``model_store/`` (``make model``) and no service on the default ports is required
(free ports are used).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from serve import settings
from serve.api.binary import example_binary
from serve.api.request import BINARY_MEDIA_TYPE
from serve.ops.machine import announce
from serve.ops.state_client import StateClient
from serve.state import parse_state, write_state
from serve.store.repository import DEFAULT_PROFILE, default_version

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "memory.json"


def _rollup(pid: int) -> dict[str, int]:
    """Rss and Pss of one process in bytes (0 when it is gone)."""
    out = {"rss": 0, "pss": 0}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key.lower()] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def measure_pod(ts_pid: int, sidecar_pid: int | None) -> dict[str, Any]:
    """RSS/PSS sums over TorchServe's process tree and the sidecar."""
    ts = psutil.Process(ts_pid)
    workers = [p.pid for p in ts.children(recursive=True)
               if "model_service_worker" in " ".join(p.cmdline())]
    procs = [ts_pid, *(p.pid for p in ts.children(recursive=True))]
    if sidecar_pid is not None:
        procs.append(sidecar_pid)
    roll = {pid: _rollup(pid) for pid in procs}
    mb = 1 << 20
    return {"processes": len(procs), "workers": len(workers),
            "rss_mb": round(sum(r["rss"] for r in roll.values()) / mb, 1),
            "pss_mb": round(sum(r["pss"] for r in roll.values()) / mb, 1),
            "workers_rss_mb": round(sum(roll[p]["rss"] for p in workers) / mb, 1),
            "workers_pss_mb": round(sum(roll[p]["pss"] for p in workers) / mb, 1)}


def run_one(version: str, workers: int, shared: bool, requests: int) -> dict[str, Any]:
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launch_ports import free_port_settings
    from serve.ops.launcher import start

    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        root = Path(tmp)
        write_state(root / "state.yaml", parse_state({"model": {"version": version},
                                                      "workers": workers}))
        cfg = LaunchConfig(
            **free_port_settings(), model_store=REPO / "model_store", state_file=root / "state.yaml",
            run_dir=root / "run", log_dir=root / "logs", sidecar=True, ready_timeout_s=300,
            extra_env={settings.DLRM_SHARED_TABLES.name: "1" if shared else "0"})
        t0 = time.monotonic()
        svc = start(cfg)
        try:
            token = cfg.token_file.read_text().strip()
            StateClient(cfg.sidecar_write_url, token, timeout_s=30).wait_converged(timeout_s=300)
            ready_s = time.monotonic() - t0
            url = f"{cfg.inference_url}/predictions/dlrm"
            with httpx.Client(timeout=60) as c:
                for i in range(requests):
                    r = c.post(url, content=example_binary(512, seed=i),
                               headers={"Content-Type": BINARY_MEDIA_TYPE})
                    if r.status_code != 200:
                        raise SystemExit(f"request {i} answered {r.status_code}: {r.text[:200]}")
            time.sleep(1.0)
            m = measure_pod(svc.torchserve.pid, svc.sidecar.pid if svc.sidecar else None)
        finally:
            svc.stop()
    return {"version": version, "workers": workers, "tables": "shared" if shared else "per worker",
            "ready_s": round(ready_s, 1), **m}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_memory", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--version", default=default_version(DEFAULT_PROFILE),
                    help="model version (default: what `make model` builds, "
                         f"{default_version(DEFAULT_PROFILE)})")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4],
                    help="worker counts to measure (default 2 4)")
    ap.add_argument("--requests", type=int, default=64,
                    help="512-instance requests sent before measuring (default 64)")
    ap.add_argument("--out", default=str(OUT), help=f"JSON output (default {OUT})")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like an exception, so the service a run started is stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    machine = announce()
    rows = []
    for w in args.workers:
        for shared in (False, True):
            print(f"measuring {args.version}: {w} workers, tables "
                  f"{'shared' if shared else 'per worker'} ...", file=sys.stderr, flush=True)
            rows.append(run_one(args.version, w, shared, args.requests))
    hdr = ("workers", "tables", "rss_mb", "pss_mb", "workers_rss_mb", "workers_pss_mb", "ready_s")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in hdr) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "machine": machine}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
