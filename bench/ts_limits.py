"""TorchServe's frontend limits under oversized bodies: does it stay up and keep serving?

    python -m bench.ts_limits [--seconds 60] [--big-clients 64] [--body-mib 31]
                              [--model-store model_store] [--out bench/results/ts_limits.json]

``make ts-limits`` runs it for 60 s. It starts its own TorchServe (``serve.ops.launcher``,
the repo's config.properties as shipped: max_request_size, job_queue_size, -Xmx) on free
loopback ports with the newest archive of ``--model-store``, and for ``--seconds``:

- ``--big-clients`` threads each post a ``--body-mib`` MiB body (Content-Length set, the
  whole body sent with ``http.client``) to the predictions endpoint, again and again;
- one closed-loop client posts valid single-instance JSON requests
  (``serve.api.json_body.example_request``) the whole time.

It holds when: TorchServe's process and its workers are the same at the end (same pids:
no restart, no worker death), at least 99% of the valid requests were answered 200, and
every big body got TorchServe's 413 (or its connection was closed after a 413 while the
client was still sending: STACK.md). Prints a table, writes the figures to ``--out``, exit
code 0 only when it holds. tests/test_ts_security.py runs the same :func:`run` for a few
seconds against its own TorchServe.
"""
from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import orjson
import psutil

from serve.api.json_body import example_request
from serve.ops.machine import machine_info

__all__ = ["LimitsRun", "main", "run", "service_pids"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "ts_limits.json"
MIB = 1024 * 1024


@dataclass
class LimitsRun:
    """What one run saw; ``ok`` says whether it held."""

    seconds: float
    big_clients: int
    body_bytes: int
    big: Counter = field(default_factory=Counter)       # outcome -> count
    valid: Counter = field(default_factory=Counter)     # status or error -> count
    valid_latency_s: list[float] = field(default_factory=list)
    pids_before: dict[str, Any] = field(default_factory=dict)
    pids_after: dict[str, Any] = field(default_factory=dict)

    @property
    def valid_ok_ratio(self) -> float:
        total = sum(self.valid.values())
        return self.valid.get("200", 0) / total if total else 0.0

    @property
    def ok(self) -> bool:
        big_clean = set(self.big) <= {"413", "closed after 413", "reset while sending"}
        return (self.pids_before == self.pids_after and self.valid_ok_ratio >= 0.99
                and sum(self.valid.values()) > 0 and self.big.get("413", 0) > 0 and big_clean)

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.valid_latency_s)
        p99 = lat[int(0.99 * (len(lat) - 1))] if lat else None
        return {"ok": self.ok, "seconds": self.seconds, "big_clients": self.big_clients,
                "body_bytes": self.body_bytes, "big_by_outcome": dict(self.big),
                "big_bodies_posted_gib": round(self.big.total() * self.body_bytes / 2**30, 1),
                "valid_by_status": dict(self.valid),
                "valid_ok_pct": round(100 * self.valid_ok_ratio, 2),
                "valid_p99_s": round(p99, 3) if p99 is not None else None,
                "pids_unchanged": self.pids_before == self.pids_after,
                "pids_before": self.pids_before, "pids_after": self.pids_after}


def service_pids(ts_pid: int, management_url: str, model: str = "dlrm") -> dict[str, Any]:
    """TorchServe's java pid (under the launcher's process ``ts_pid``) and its workers'
    pids from the management API."""
    try:
        tree = [psutil.Process(ts_pid), *psutil.Process(ts_pid).children(recursive=True)]
        java = sorted(p.pid for p in tree if "java" in p.name())
    except psutil.Error:
        java = []
    r = httpx.get(f"{management_url}/models/{model}", timeout=30)
    r.raise_for_status()
    workers = sorted(int(w["pid"]) for m in r.json() for w in m.get("workers", []) if w.get("pid"))
    return {"java": java, "workers": workers}


def _big_one(host: str, port: int, path: str, body: bytes) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError):
            # TorchServe answered 413 on the headers and closed while we still sent: read it
            try:
                return "closed after 413" if conn.getresponse().status == 413 else "reset"
            except (OSError, http.client.HTTPException):
                return "reset while sending"
        try:
            r = conn.getresponse()
            r.read()
            return str(r.status)
        except (OSError, http.client.HTTPException) as e:
            return type(e).__name__
    finally:
        conn.close()


def run(inference_url: str, management_url: str, ts_pid: int, *, seconds: float,
        big_clients: int = 64, body_mib: float = 31, model: str = "dlrm") -> LimitsRun:
    """Oversized bodies from ``big_clients`` threads beside one valid closed-loop client,
    for ``seconds``; see the module doc."""
    u = urlparse(inference_url)
    host, port, path = u.hostname or "127.0.0.1", int(u.port or 80), f"/predictions/{model}"
    body = b"x" * int(body_mib * MIB)
    out = LimitsRun(seconds=seconds, big_clients=big_clients, body_bytes=len(body))
    out.pids_before = service_pids(ts_pid, management_url, model)
    lock = threading.Lock()
    stop = threading.Event()

    def big() -> None:
        while not stop.is_set():
            outcome = _big_one(host, port, path, body)
            with lock:
                out.big[outcome] += 1

    def valid() -> None:
        payload = orjson.dumps(example_request(1, seed=3))
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    status = str(c.post(f"{inference_url}{path}", content=payload,
                                        headers={"Content-Type": "application/json"}).status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                with lock:
                    out.valid[status] += 1
                    out.valid_latency_s.append(time.monotonic() - t0)

    threads = [threading.Thread(target=big, daemon=True) for _ in range(big_clients)]
    threads.append(threading.Thread(target=valid, daemon=True))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    out.pids_after = service_pids(ts_pid, management_url, model)
    return out


def served_state(management_url: str, model: str, conf: Path) -> dict[str, Any]:
    """What the run measures: the served version's batching and workers (TorchServe's
    describe) and the frontend limits of the rendered config."""
    desc = httpx.get(f"{management_url}/models/{model}", timeout=10).json()[0]
    props = dict(line.split("=", 1) for line in conf.read_text().splitlines()
                 if "=" in line and not line.lstrip().startswith("#"))
    return {"model_version": desc.get("modelVersion"), "batch_size": desc.get("batchSize"),
            "max_batch_delay_ms": desc.get("maxBatchDelay"),
            "workers": len(desc.get("workers", [])), "sidecar": False, "tuner": "off (no sidecar)",
            **{k: props.get(k) for k in ("max_request_size", "job_queue_size", "vmargs")}}


def print_table(doc: dict[str, Any]) -> None:
    st = doc.get("state", {})
    print(f"state: version {doc.get('version')}, batch {st.get('batch_size')} / "
          f"{st.get('max_batch_delay_ms')} ms, {st.get('workers')} workers, {st.get('tuner')}; "
          f"max_request_size {st.get('max_request_size')}, job_queue_size "
          f"{st.get('job_queue_size')}, vmargs {st.get('vmargs')!r}")
    print("| ok | seconds | big clients | body MiB | big outcomes | valid | valid 200 % "
          "| valid p99 s | pids unchanged |")
    print("|---|---:|---:|---:|---|---|---:|---:|---|")
    print(f"| {'yes' if doc['ok'] else 'NO'} | {doc['seconds']} | {doc['big_clients']} | "
          f"{doc['body_bytes'] / MIB:.0f} | {doc['big_by_outcome']} | {doc['valid_by_status']} | "
          f"{doc['valid_ok_pct']} | {doc['valid_p99_s']} | {doc['pids_unchanged']} |")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.ts_limits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--big-clients", type=int, default=64)
    ap.add_argument("--body-mib", type=float, default=31.0)
    ap.add_argument("--model-store", default="model_store")
    ap.add_argument("--out", default=str(OUT))
    return ap


def main(argv: list[str] | None = None) -> int:
    from serve.ops.faults import stable_version
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launch_ports import free_port_settings
    from serve.ops.launcher import start

    args = _parser().parse_args(argv)
    # SIGTERM unwinds like an exception, so the service a run started is stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.seconds <= 0 or args.big_clients < 1 or args.body_mib <= 0:
        raise SystemExit("--seconds, --big-clients and --body-mib must be > 0")
    store = Path(args.model_store).resolve()
    version = stable_version(store)  # the version `make up` would serve
    root = Path(tempfile.mkdtemp(prefix="dlrm-ts-limits-"))
    cfg = LaunchConfig(**free_port_settings(), model_store=store, mar_name=f"dlrm-{version}.mar", sidecar=False,
                       run_dir=root / "run", log_dir=root / "logs", ready_timeout_s=300)
    svc = start(cfg)
    try:
        state = served_state(cfg.management_url, cfg.model_name,
                             cfg.path(cfg.run_dir) / "torchserve" / "config.properties")
        result = run(cfg.inference_url, cfg.management_url, svc.torchserve.pid,
                     seconds=args.seconds, big_clients=args.big_clients, body_mib=args.body_mib)
    finally:
        svc.stop()
    doc = {**result.as_dict(), "version": version, "state": state, "machine": machine_info(),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "ts_config": "config.properties as shipped"}
    print_table(doc)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"-> {args.out}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
