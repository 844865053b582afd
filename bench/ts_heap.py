"""TorchServe's heap under in-limit bodies: many connections trickling, two queues full.

    python -m bench.ts_heap [--seconds 60] [--tricklers 200] [--body-bytes N]
                            [--fillers 64] [--set KEY=VALUE ...]
                            [--out bench/results/ts_heap.json]

``make ts-heap`` runs it for 60 s (review F8). It builds a tiny random DLRM (the test
fixtures' ``tiny`` profile, int8), packs it as versions 1.0 and 2.0 (batch 4 / 5 ms, one
worker each), starts its own TorchServe (``serve.ops.launcher``, the repo's
config.properties as shipped unless ``--set`` overrides a key, free loopback ports) serving
1.0, and for ``--seconds``:

- first, for 5 s, 8 connections send bodies of 8 MiB - 1 byte (under the 8 MiB TorchServe
  once allowed): over today's ``max_request_size`` each must be answered 413 from its
  headers, never held (``over_limit`` in the figures);
- ``--tricklers`` connections each send a POST's headers with ``Content-Length:
  --body-bytes`` (default the config's ``max_request_size`` - 1: the most each connection
  can make TorchServe hold), then
  the body at ``--trickle-kib-s`` KiB/s (0: as fast as the socket takes it), all but its
  last byte, and hold the connection open until the end: what each such connection makes
  netty aggregate stays allocated;
- one client posts valid single-instance JSON requests (``example_request``) at
  ``--valid-rps`` to ``/predictions/dlrm`` the whole time (a new connection per request
  is not needed: one kept-alive client);
- after a third of the run, a version switch as the sidecar makes it: register 2.0
  (synchronous), set it default, and ``--fillers`` clients per version post
  ``--filler-bytes`` bodies (default the same size) to ``/predictions/dlrm/1.0`` and
  ``/predictions/dlrm/2.0`` in closed loops until the end: both versions' job queues full,
  each queued job holding its body.

It holds when: TorchServe's JVM and version 1.0's worker have the same pids at the end
(no JVM exit, no worker death), ``ts_log.log`` has no ``OutOfMemoryError`` (heap or
direct), at least 99% of the valid requests were answered 200, and every over-limit body
was answered 413. Use ``--set max_request_size=N`` (and the body sizes) to measure other
limits: at 8 MiB the 200 connections exhausted direct memory (config.properties). Prints the state it
measured and a table, writes the figures to ``--out``; exit code 0 only when it holds.
``tests/test_ts_heap.py`` runs the same :func:`run` for a few seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
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

from bench.ts_limits import served_state
from serve.api.json_body import example_request
from serve.ops.machine import machine_info

__all__ = ["HeapRun", "build_store", "main", "run"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "ts_heap.json"
MIB = 1024 * 1024
CHUNK = 64 * 1024
OOM_MARKERS = ("OutOfMemoryError", "OutOfDirectMemoryError")


@dataclass
class HeapRun:
    """What one run saw; ``ok`` says whether it held."""

    seconds: float
    tricklers: int
    body_bytes: int
    fillers: int
    filler_bytes: int
    trickle: Counter = field(default_factory=Counter)   # outcome -> connections
    fill: Counter = field(default_factory=Counter)      # "version status" -> count
    valid: Counter = field(default_factory=Counter)     # status or error -> count
    valid_latency_s: list[float] = field(default_factory=list)
    switch: dict[str, Any] = field(default_factory=dict)
    pids_before: dict[str, Any] = field(default_factory=dict)
    pids_after: dict[str, Any] = field(default_factory=dict)
    java_rss_max_bytes: int = 0
    oom_lines: list[str] = field(default_factory=list)

    @property
    def valid_ok_ratio(self) -> float:
        total = sum(self.valid.values())
        return self.valid.get("200", 0) / total if total else 0.0

    @property
    def ok(self) -> bool:
        return (bool(self.pids_before.get("java")) and self.pids_before == self.pids_after
                and not self.oom_lines and sum(self.valid.values()) > 0
                and self.valid_ok_ratio >= 0.99)

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.valid_latency_s)
        p99 = lat[int(0.99 * (len(lat) - 1))] if lat else None
        return {"ok": self.ok, "seconds": self.seconds, "tricklers": self.tricklers,
                "body_bytes": self.body_bytes, "fillers_per_version": self.fillers,
                "filler_bytes": self.filler_bytes, "trickle_by_outcome": dict(self.trickle),
                "fill_by_status": dict(self.fill), "valid_by_status": dict(self.valid),
                "valid_ok_pct": round(100 * self.valid_ok_ratio, 2),
                "valid_p99_s": round(p99, 3) if p99 is not None else None,
                "switch": self.switch, "java_rss_max_mib": round(self.java_rss_max_bytes / MIB),
                "oom_lines": self.oom_lines[:5],
                "pids_unchanged": self.pids_before == self.pids_after,
                "pids_before": self.pids_before, "pids_after": self.pids_after}


def _pids(ts_pid: int, management_url: str, model: str, version: str) -> dict[str, Any]:
    """The JVM's pid (under the launcher's process) and ``version``'s worker pids."""
    try:
        tree = [psutil.Process(ts_pid), *psutil.Process(ts_pid).children(recursive=True)]
        java = sorted(p.pid for p in tree if "java" in p.name())
    except psutil.Error:
        java = []
    try:
        r = httpx.get(f"{management_url}/models/{model}/{version}", timeout=30)
        workers = sorted(int(w["pid"]) for m in r.json() for w in m.get("workers", [])
                         if w.get("pid"))
    except (httpx.HTTPError, ValueError, TypeError):
        workers = []
    return {"java": java, "workers": workers}


def _trickle(host: str, port: int, path: str, length: int, rate: float,
             stop: threading.Event) -> str:
    """One connection: headers, ``length - 1`` body bytes at ``rate`` B/s (0: at once),
    then held until ``stop``. Returns what became of it."""
    try:
        s = socket.create_connection((host, port), timeout=30)
    except OSError as e:
        return f"connect {type(e).__name__}"
    try:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {length}\r\n\r\n".encode())
        sent, t0, chunk = 0, time.monotonic(), b"x" * CHUNK
        try:
            while sent < length - 1 and not stop.is_set():
                n = min(CHUNK, length - 1 - sent)
                s.sendall(chunk[:n])
                sent += n
                if rate > 0:
                    time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
        except OSError as e:   # refused from its headers (413) while we still sent?
            return _answer(s) or f"{type(e).__name__} while sending"
        return _answer(s, stop) or ("held to the end" if sent == length - 1
                                    else "held (still sending)")
    except OSError as e:
        return f"{type(e).__name__} while sending"
    finally:
        s.close()


def _answer(s: socket.socket, stop: threading.Event | None = None) -> str | None:
    """What the server said on ``s`` ("answered 413", "closed by server"), waiting until
    ``stop`` (or 0.5 s without one); None while it says nothing (the connection is held)."""
    s.settimeout(0.5)
    while True:
        try:
            got = s.recv(256)
        except TimeoutError:
            if stop is None or stop.is_set():
                return None
            continue
        except OSError:
            return None
        if not got:
            return "closed by server"
        parts = got.split(b" ", 2)
        return f"answered {parts[1].decode(errors='replace')}" if len(parts) > 1 else "answered"


def _post(host: str, port: int, path: str, body: bytes) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return str(r.status)
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        conn.close()


def _switch(management_url: str, model: str, mar: str, stop: threading.Event,
            fill: Any) -> dict[str, Any]:
    """Register 2.0 beside 1.0, make it default, start the fillers of both versions."""
    t0 = time.monotonic()
    r = httpx.post(f"{management_url}/models", timeout=300, params={
        "url": mar, "model_name": model, "initial_workers": 1, "synchronous": "true"})
    out: dict[str, Any] = {"register_status": r.status_code,
                           "register_s": round(time.monotonic() - t0, 2)}
    r = httpx.put(f"{management_url}/models/{model}/2.0/set-default", timeout=60)
    out["set_default_status"] = r.status_code
    if not stop.is_set():
        fill()
    return out


def run(inference_url: str, management_url: str, ts_pid: int, *, seconds: float,
        tricklers: int = 200, body_bytes: int = 8 * MIB - 1, trickle_kib_s: float = 0,
        fillers: int = 64, filler_bytes: int = 8 * MIB - 1, valid_rps: float = 50,
        second_mar: str | None = "dlrm-2.0.mar", model: str = "dlrm",
        ts_log: Path | None = None) -> HeapRun:
    """The load of the module doc against a running TorchServe serving ``model`` 1.0
    (``second_mar`` in its store is version 2.0; None: no switch and no fillers)."""
    u = urlparse(inference_url)
    host, port = u.hostname or "127.0.0.1", int(u.port or 80)
    out = HeapRun(seconds, tricklers, body_bytes, fillers, filler_bytes)
    out.pids_before = _pids(ts_pid, management_url, model, "1.0")
    lock, stop = threading.Lock(), threading.Event()
    threads: list[threading.Thread] = []

    def start(target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        threads.append(t)
        t.start()

    def trickler() -> None:
        outcome = _trickle(host, port, f"/predictions/{model}", body_bytes,
                           trickle_kib_s * 1024, stop)
        with lock:
            out.trickle[outcome] += 1

    def filler(version: str) -> None:
        body = b"x" * filler_bytes
        while not stop.is_set():
            status = _post(host, port, f"/predictions/{model}/{version}", body)
            with lock:
                out.fill[f"{version} {status}"] += 1

    def valid() -> None:
        payload = orjson.dumps(example_request(1, seed=3))
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    status = str(c.post(f"{inference_url}/predictions/{model}", content=payload,
                                        headers={"Content-Type": "application/json"}
                                        ).status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                dt = time.monotonic() - t0
                with lock:
                    out.valid[status] += 1
                    out.valid_latency_s.append(dt)
                time.sleep(max(0.0, 1 / valid_rps - dt))

    def fill() -> None:
        for version in ("1.0", "2.0"):
            for _ in range(fillers):
                start(filler, version)

    def switch() -> None:
        stop.wait(seconds / 3)
        if not stop.is_set() and second_mar is not None:
            out.switch = _switch(management_url, model, second_mar, stop, fill)

    java = [psutil.Process(p) for p in out.pids_before["java"]]
    start(valid)
    for _ in range(tricklers):
        start(trickler)
    start(switch)
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for p in java:
            with contextlib.suppress(psutil.Error):
                out.java_rss_max_bytes = max(out.java_rss_max_bytes, p.memory_info().rss)
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=150)
    out.pids_after = _pids(ts_pid, management_url, model, "1.0")
    if ts_log is not None and ts_log.is_file():
        out.oom_lines = [line.strip()[:300] for line in ts_log.read_text(errors="replace")
                         .splitlines() if any(m in line for m in OOM_MARKERS)]
    return out


def build_store(store: Path, seed: int = 0) -> None:
    """``store/dlrm-1.0.mar`` and ``store/dlrm-2.0.mar``: a tiny random DLRM (int8,
    TorchRec-quantized), batch 4 / 5 ms, one worker, as the test fixtures build it."""
    import copy

    import torch
    from torchrec.inference.modules import quantize_inference_model

    from serve.model.archive import build_mar
    from serve.model.dlrm import build_dlrm
    from serve.model.export import artifact_from_quantized_dlrm
    from serve.profiles import get_profile
    from serve.runtime.artifact import save_artifact

    store.mkdir(parents=True, exist_ok=True)
    model = build_dlrm(get_profile("tiny"), seed=seed)
    q = quantize_inference_model(copy.deepcopy(model), quantization_dtype=torch.int8)
    art = store.parent / "artifact.pt"
    save_artifact(artifact_from_quantized_dlrm(q, "int8", meta={"profile": "tiny",
                                                                "seed": seed}), art)
    for version in ("1.0", "2.0"):
        build_mar(art, store, model_name="dlrm", version=version, batch_size=4,
                  max_batch_delay_ms=5, min_workers=1, max_workers=1, response_timeout_s=60,
                  file_name=f"dlrm-{version}.mar",
                  handler_config={"num_threads": 1, "cache_load_factor": 1.0})


def print_table(doc: dict[str, Any]) -> None:
    st = doc.get("state", {})
    print(f"state: tiny random DLRM 1.0 (then 2.0 registered and default), batch "
          f"{st.get('batch_size')} / {st.get('max_batch_delay_ms')} ms, {st.get('workers')} "
          f"worker, no sidecar; max_request_size {st.get('max_request_size')}, job_queue_size "
          f"{st.get('job_queue_size')}, vmargs {st.get('vmargs')!r}; overrides "
          f"{doc.get('overrides') or 'none'}")
    print("| ok | s | tricklers x bytes | trickle outcomes | fill (per version) | valid | "
          "valid 200 % | valid p99 s | JVM RSS max MiB | OOM lines | pids unchanged |")
    print("|---|---:|---|---|---|---|---:|---:|---:|---:|---|")
    print(f"| {'yes' if doc['ok'] else 'NO'} | {doc['seconds']} | {doc['tricklers']} x "
          f"{doc['body_bytes']} | {doc['trickle_by_outcome']} | {doc['fill_by_status']} | "
          f"{doc['valid_by_status']} | {doc['valid_ok_pct']} | {doc['valid_p99_s']} | "
          f"{doc['java_rss_max_mib']} | {len(doc['oom_lines'])} | {doc['pids_unchanged']} |")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.ts_heap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--tricklers", type=int, default=200)
    ap.add_argument("--body-bytes", type=int, default=None,
                    help="Content-Length of each trickling body (default max_request_size - 1)")
    ap.add_argument("--trickle-kib-s", type=float, default=0,
                    help="each trickler's send rate (0: as fast as the socket takes it)")
    ap.add_argument("--fillers", type=int, default=64, help="queue fillers per version")
    ap.add_argument("--filler-bytes", type=int, default=None,
                    help="each queue filler's body (default max_request_size - 1)")
    ap.add_argument("--valid-rps", type=float, default=50)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config.properties key for this run (to find limits)")
    ap.add_argument("--out", default=str(OUT))
    return ap


def main(argv: list[str] | None = None) -> int:
    from serve.common.net import free_ports
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launcher import start

    args = _parser().parse_args(argv)
    if args.seconds <= 0 or args.tricklers < 0 or args.fillers < 0 \
            or (args.body_bytes or 2) < 2 or (args.filler_bytes or 1) < 1:
        raise SystemExit("--seconds must be > 0, --tricklers/--fillers >= 0, --body-bytes >= 2")
    overrides = dict(s.split("=", 1) for s in args.set)
    root = Path(tempfile.mkdtemp(prefix="dlrm-ts-heap-"))
    build_store(root / "store")
    inf, mgmt, met, side, gi, gm = free_ports(6)
    cfg = LaunchConfig(inference_port=inf, management_port=mgmt, metrics_port=met,
                       sidecar_port=side, grpc_inference_port=gi, grpc_management_port=gm,
                       model_store=root / "store", mar_name="dlrm-1.0.mar", sidecar=False,
                       run_dir=root / "run", log_dir=root / "logs", ready_timeout_s=300,
                       ts_overrides=overrides,
                       extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    svc = start(cfg)
    try:
        state = served_state(cfg.management_url, cfg.model_name,
                             cfg.path(cfg.run_dir) / "torchserve" / "config.properties")
        limit = int(state["max_request_size"])
        ts_log = cfg.path(cfg.log_dir) / "ts_log.log"
        over = run(cfg.inference_url, cfg.management_url, svc.torchserve.pid, seconds=5,
                   tricklers=8, body_bytes=8 * MIB - 1, second_mar=None, valid_rps=5)
        result = run(cfg.inference_url, cfg.management_url, svc.torchserve.pid,
                     seconds=args.seconds, tricklers=args.tricklers,
                     body_bytes=args.body_bytes or limit - 1,
                     trickle_kib_s=args.trickle_kib_s, fillers=args.fillers,
                     filler_bytes=args.filler_bytes or limit - 1, valid_rps=args.valid_rps,
                     ts_log=ts_log)
    finally:
        svc.stop()
    over_ok = limit >= 8 * MIB - 1 or dict(over.trickle) == {"answered 413": 8}
    doc = {**result.as_dict(), "state": state, "overrides": overrides,
           "over_limit": {"connections": 8, "body_bytes": 8 * MIB - 1,
                          "outcomes": dict(over.trickle), "ok": over_ok},
           "machine": machine_info(),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "ts_config": "config.properties as shipped" + (" + overrides" if overrides else "")}
    doc["ok"] = result.ok and over_ok
    print_table(doc)
    print(f"8 connections x {8 * MIB - 1} bytes (over the limit): {dict(over.trickle)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"-> {args.out}")
    return 0 if result.ok and over_ok else 1


if __name__ == "__main__":
    sys.exit(main())
