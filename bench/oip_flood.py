"""The Open Inference Protocol's port under a flood: does the pod stay up and keep serving?

    python -m bench.oip_flood [--seconds 60] [--stallers 150] [--posters 8]
                              [--model-store model_store] [--version V]
                              [--out bench/results/oip_flood.json]

``make oip-flood`` runs it for 60 s (the review's N1 test, issue 54 item 1). It starts the
pod's three containers as processes (:func:`pod`: TorchServe, the sidecar with ``--oip-mode
external`` and the OIP process, shipped defaults, free loopback ports), each started inside
cgroups like its container's (cgroup v1, as root): TorchServe's tree in
``--torchserve-memory``, the sidecar in 1 GiB and a 500m CPU quota, the OIP process in
512 MiB and 1 core (k8s/deployment.yaml). It serves ``--version`` (default: the version
``make up`` declares in a new state, ``LaunchConfig.initial_version``). Then, for
``--seconds``:

- ``--stallers`` connections each send ``POST /v2/models/dlrm/infer`` with
  ``Content-Length: 8388608``, 8 MiB - 1 byte of it, and stall; a connection the OIP
  answers (429 past its budget, 408 past its body deadline) is opened again
  ``--reconnect-s`` later (1 s, what the 429 asks; 0 makes a reconnect storm);
- ``--posters`` clients post bad 8 MiB JSON bodies (C1 INT64 with ~4.2M ids, the last
  one ``1.5``) in a loop;
- a separate process polls the sidecar's ``/readyz`` and ``/healthz`` (every 0.5 s, the
  probe's 2 s timeout) and posts single-instance predicts to TorchServe's 8080.

It holds when: no OOM kill in any cgroup, every process the same at the end (no
restart), ``/readyz`` p99 < 500 ms with no timeout, predict on 8080 answered 200 every
time, and the OIP's refusals (429/503) answered in < 100 ms at p99. Prints a table, writes
``--out`` (with the served state, the OIP's bounds and the machine), exit code 0 only when
it holds. tests/test_oip_flood.py runs the same :func:`run_flood` for a few seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import psutil

from serve.api.binary import example_binary
from serve.api.request import BINARY_MEDIA_TYPE
from serve.ops.machine import machine_info

__all__ = ["FloodResult", "bad_body", "main", "run_flood"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "oip_flood.json"
MIB = 1024 * 1024
#: What a staller announces (8 MiB, the OIP's limit) and sends (one byte less).
STALL_LENGTH = 8 * MIB
CHUNK = 256 * 1024
INFER = "/v2/models/dlrm/infer"
#: The pod's containers (k8s/deployment.yaml): memory bytes, CPU quota in cores.
SIDECAR_LIMITS = (1024 * MIB, 0.5)
OIP_LIMITS = (512 * MIB, 1.0)


def bad_body(size: int = 8 * MIB, per_input: int = 4096 * 64) -> bytes:
    """A JSON infer body of at most ``size`` bytes that is parsed to its end and refused
    there: INT64 inputs ``C1``, ``C2``... of ``per_input`` ids each (the most a dimension
    may declare, so every one passes the shape check and becomes an array), the very last
    id ``1.5``. The review's worst case was one input of ~4.2M ids (0.79 CPU-s and +131 MB
    in the old sidecar); a dimension that large is now refused on its shape."""
    def tensor(i: int, n: int, last: bytes) -> bytes:
        return (b'{"name":"C%d","datatype":"INT64","shape":[%d],"data":[' % (i, n)
                + b"1," * (n - 1) + last + b"]}")
    parts: list[bytes] = []
    room = size - len(b'{"inputs":[]}')
    while room > len(tensor(len(parts) + 1, per_input, b"1")) + 200:
        parts.append(tensor(len(parts) + 1, per_input, b"1"))
        room -= len(parts[-1]) + 1
    n = min(per_input, (room - 100) // 2)
    parts.append(tensor(len(parts) + 1, n, b"1.5"))
    body = b'{"inputs":[' + b",".join(parts) + b"]}"
    if len(body) > size:
        raise ValueError(f"bad body of {len(body)} bytes is over {size}")
    return body


@dataclass
class FloodResult:
    """What one flood saw (latencies in seconds)."""

    seconds: float
    oip_status: Counter[str] = field(default_factory=Counter)
    refusal_latency_s: list[float] = field(default_factory=list)
    probes: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float]) -> dict[str, float | None]:
            if not xs:
                return {"p50_ms": None, "p99_ms": None, "max_ms": None}
            a = np.asarray(xs) * 1000
            return {"p50_ms": round(float(np.percentile(a, 50)), 1),
                    "p99_ms": round(float(np.percentile(a, 99)), 1),
                    "max_ms": round(float(a.max()), 1)}
        return {"seconds": self.seconds, "oip_answers": dict(self.oip_status),
                "oip_refusals": len(self.refusal_latency_s),
                "oip_refusal_latency": pct(self.refusal_latency_s), **self.probes}


# --------------------------------------------------------------------------- the flood


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's error (a reset while sending is an answer here)."""
    if not task.cancelled():
        task.exception()


async def _one(host: str, port: int, head: bytes, body: bytes, end: float,
               result: FloodResult) -> bool:
    """One request on a new connection: ``head`` then ``body`` (all of it), then wait
    for the status line until ``end``. Records its status and, for a refusal (429/503),
    the seconds from the head sent to the status line. False when ``end`` came first."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        result.oip_status["connect error"] += 1
        await asyncio.sleep(0.05)
        return True
    t0 = time.monotonic()
    status_line = asyncio.ensure_future(reader.readline())
    status_line.add_done_callback(_consume)
    try:
        writer.write(head)
        view = memoryview(body)
        for at in range(0, len(body), CHUNK):
            if status_line.done():
                break
            writer.write(view[at:at + CHUNK])
            drain = asyncio.ensure_future(writer.drain())
            drain.add_done_callback(_consume)
            await asyncio.wait({drain, status_line}, return_when=asyncio.FIRST_COMPLETED,
                               timeout=max(0.01, end - time.monotonic()))
            if not drain.done():
                drain.cancel()
                if time.monotonic() >= end:
                    break
        line = await asyncio.wait_for(status_line, max(0.01, end - time.monotonic()))
    except TimeoutError:
        status_line.cancel()
        return False
    except (ConnectionError, OSError):
        line = b""
        if status_line.done() and not status_line.cancelled() and not status_line.exception():
            line = status_line.result()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    latency = time.monotonic() - t0
    parts = line.split()
    status = parts[1].decode() if len(parts) >= 2 else "reset"
    result.oip_status[status] += 1
    if status in ("429", "503"):
        result.refusal_latency_s.append(latency)
    return True


async def _loop(host: str, port: int, head: bytes, body: bytes, end: float,
                result: FloodResult, pause_s: float = 0.0) -> None:
    """Requests one after another until ``end``, ``pause_s`` apart."""
    while time.monotonic() < end and await _one(host, port, head, body, end, result):
        await asyncio.sleep(min(pause_s, max(0.0, end - time.monotonic())))


def _head(host: str, length: int) -> bytes:
    return (f"POST {INFER} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _refusal_probe(oip_url: str, timeout_s: float) -> tuple[str, float]:
    """One 8 MiB infer's head alone, on a new connection: the status the OIP answers it
    before its body (429 while the budget is spent) and the seconds to the status line;
    ("admitted", t) when no answer comes within ``timeout_s`` (it waits for the body)."""
    u = urlparse(oip_url)
    host = u.hostname or "127.0.0.1"
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, u.port or 80), timeout=timeout_s) as s:
            s.sendall(_head(host, STALL_LENGTH))
            line = s.makefile("rb").readline()
    except TimeoutError:
        return "admitted", time.monotonic() - t0
    except OSError:
        return "reset", time.monotonic() - t0
    parts = line.split()
    return (parts[1].decode() if len(parts) >= 2 else "reset"), time.monotonic() - t0


def _poll(sidecar_url: str, predict_url: str, oip_url: str, seconds: float,
          interval_s: float, timeout_s: float) -> dict[str, Any]:
    """In a process of its own (its latencies are not the flood's event loop's): the
    sidecar's probes and an OIP refusal probe (:func:`_refusal_probe`) every
    ``interval_s`` with the probe's timeout, and closed-loop single-instance predicts to
    TorchServe."""
    body = example_binary(1, seed=1)
    out: dict[str, Any] = {}
    lat: dict[str, list[float]] = {"readyz": [], "healthz": [], "predict": []}
    refusals: list[float] = []
    probe_status: Counter[str] = Counter()
    fails: Counter[str] = Counter()
    end = time.monotonic() + seconds
    next_probe = time.monotonic()
    with httpx.Client() as c:
        while time.monotonic() < end:
            if time.monotonic() >= next_probe:
                for name in ("readyz", "healthz"):
                    t0 = time.monotonic()
                    try:
                        r = c.get(f"{sidecar_url}/{name}", timeout=timeout_s)
                        lat[name].append(time.monotonic() - t0)
                        if r.status_code != 200:
                            fails[f"{name} {r.status_code}"] += 1
                    except httpx.TimeoutException:
                        fails[f"{name} timeout"] += 1
                    except httpx.HTTPError as e:
                        fails[f"{name} {type(e).__name__}"] += 1
                status, took = _refusal_probe(oip_url, timeout_s)
                probe_status[status] += 1
                if status in ("429", "503"):
                    refusals.append(took)
                next_probe += interval_s
            t0 = time.monotonic()
            try:
                r = c.post(predict_url, content=body, timeout=10,
                           headers={"Content-Type": BINARY_MEDIA_TYPE})
                lat["predict"].append(time.monotonic() - t0)
                if r.status_code != 200:
                    fails[f"predict {r.status_code}"] += 1
            except httpx.HTTPError as e:
                fails[f"predict {type(e).__name__}"] += 1
            time.sleep(0.05)
    for name, xs in lat.items():
        a = np.asarray(xs or [float("nan")]) * 1000
        out[name] = {"n": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 1),
                     "p99_ms": round(float(np.percentile(a, 99)), 1),
                     "max_ms": round(float(a.max()), 1),
                     "timeouts": fails[f"{name} timeout"],
                     "failures": sum(v for k, v in fails.items() if k.startswith(name + " "))}
    out["predict"]["ok"] = len(lat["predict"]) - sum(
        v for k, v in fails.items() if k.startswith("predict ") and k[8:].isdigit())
    out["failures"] = dict(fails)
    a = np.asarray(refusals or [float("nan")]) * 1000
    out["oip_refusal_probe"] = {
        "answers": dict(probe_status), "p50_ms": round(float(np.percentile(a, 50)), 1),
        "p99_ms": round(float(np.percentile(a, 99)), 1), "max_ms": round(float(a.max()), 1)}
    return out


def run_flood(oip_url: str, sidecar_url: str, predict_url: str, *, seconds: float,
              stallers: int = 150, posters: int = 8, reconnect_s: float = 1.0,
              poll_interval_s: float = 0.5, probe_timeout_s: float = 2.0) -> FloodResult:
    """Flood ``oip_url`` for ``seconds`` (see the module) while a separate process polls
    ``sidecar_url``'s probes and posts to ``predict_url``. A staller whose connection
    is answered opens the next one ``reconnect_s`` later (what the 429 asks; 0: at
    once); the posters post back to back."""
    u = urlparse(oip_url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    result = FloodResult(seconds=seconds)
    stall_body = b" " * (STALL_LENGTH - 1)
    bad = bad_body()

    async def go() -> None:
        end = time.monotonic() + seconds
        tasks = [_loop(host, port, _head(host, STALL_LENGTH), stall_body, end, result,
                       reconnect_s) for _ in range(stallers)]
        tasks += [_loop(host, port, _head(host, len(bad)), bad, end, result)
                  for _ in range(posters)]
        await asyncio.gather(*tasks)

    with ProcessPoolExecutor(1) as pool:
        polled = pool.submit(_poll, sidecar_url, predict_url, oip_url, seconds,
                             poll_interval_s, probe_timeout_s)
        asyncio.run(go())
        result.probes = polled.result(timeout=seconds + 60)
    return result


# --------------------------------------------------------------------------- cgroups


def _own(controller: str) -> Path:
    rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text()
               .splitlines() if controller in line.split(":", 2)[1].split(","))
    return Path("/sys/fs/cgroup") / controller / rel.lstrip("/")


@contextlib.contextmanager
def cgroups(name: str, memory_bytes: int, cpus: float | None) -> Iterator[dict[str, Path]]:
    """A v1 memory group of ``memory_bytes`` and, with
    ``cpus``, a cpu group with that CFS quota, below this process's own; removed on exit
    (their processes moved back first)."""
    made: dict[str, Path] = {}
    try:
        mem = _own("memory") / name
        mem.mkdir(exist_ok=True)
        (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
        made["memory"] = mem
        if cpus is not None:
            cpu = _own("cpu") / name
            cpu.mkdir(exist_ok=True)
            (cpu / "cpu.cfs_period_us").write_text("100000")
            (cpu / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
            made["cpu"] = cpu
        yield made
    finally:
        for group in made.values():
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (group.parent / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()


def _move(pid: int, groups: dict[str, Path]) -> None:
    for group in groups.values():
        (group / "cgroup.procs").write_text(str(pid))


def _memory(groups: dict[str, Path]) -> dict[str, int]:
    mem = groups["memory"]
    oom = dict(line.split() for line in (mem / "memory.oom_control").read_text().splitlines())
    return {"peak_bytes": int((mem / "memory.max_usage_in_bytes").read_text()),
            "limit_bytes": int((mem / "memory.limit_in_bytes").read_text()),
            "oom_kill": int(oom.get("oom_kill", 0)),
            "failcnt": int((mem / "memory.failcnt").read_text())}


def _cpu(groups: dict[str, Path]) -> dict[str, float] | None:
    """The cpu group's throttling over the run: periods throttled, seconds throttled."""
    cpu = groups.get("cpu")
    if cpu is None:
        return None
    stat = dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())
    return {"nr_periods": int(stat.get("nr_periods", 0)),
            "nr_throttled": int(stat.get("nr_throttled", 0)),
            "throttled_s": round(int(stat.get("throttled_time", 0)) / 1e9, 2)}


def _delta(after: dict[str, float] | None, before: dict[str, float] | None
           ) -> dict[str, float] | None:
    if after is None or before is None:
        return None
    return {k: round(after[k] - before[k], 2) for k in after}


def vm_hwm_bytes(pid: int) -> int:
    """Peak RSS (VmHWM) of ``pid``, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmHWM for pid {pid}")


def oip_child(sidecar_pid: int) -> int:
    """The pid of the OIP process the sidecar started."""
    kids = [p for p in psutil.Process(sidecar_pid).children()
            if "serve.sidecar.http.oip_server" in " ".join(p.cmdline())]
    if len(kids) != 1:
        raise RuntimeError(f"the sidecar {sidecar_pid} has {len(kids)} OIP processes")
    return kids[0].pid


# --------------------------------------------------------------------------- the run


def verdict(doc: dict[str, Any]) -> list[str]:
    """What failed (empty: it holds)."""
    bad = []
    for name, c in doc.get("cgroups", {}).items():
        if c["oom_kill"]:
            bad.append(f"{name}: {c['oom_kill']} OOM kills")
    if doc["restarts"]:
        bad.append(f"restarts: {doc['restarts']}")
    r = doc["flood"]["readyz"]
    if r["timeouts"] or r["failures"] or not r["p99_ms"] < 500:
        bad.append(f"/readyz: p99 {r['p99_ms']} ms, {r['timeouts']} timeouts, "
                   f"{r['failures']} failures")
    p = doc["flood"]["predict"]
    if p["failures"] or not p["ok"]:
        bad.append(f"predict on 8080: {p['failures']} failures of {p['n']}")
    for what in ("oip_refusal_latency", "oip_refusal_probe"):
        lat = doc["flood"][what]["p99_ms"]
        if lat is None or not lat < 100:
            bad.append(f"{what} p99 {lat} ms (goal < 100 ms)")
    return bad


def print_table(doc: dict[str, Any]) -> None:
    f, st = doc["flood"], doc["state"]
    print(f"state: version {st.get('version')} ({st.get('serving_version')}), OIP bounds "
          f"{doc['oip_bounds']}; {f['seconds']:.0f} s, {doc['stallers']} stallers "
          f"(reconnecting after {doc['reconnect_s']:g} s) + {doc['posters']} bad-body "
          f"posters; load average {doc['load_average'][0]:.1f} on {os.cpu_count()} cores")
    rows = [("what", "n", "p50 ms", "p99 ms", "max ms", "timeouts", "failures")]
    for name in ("readyz", "healthz", "predict"):
        x = f[name]
        rows.append((f"/{name}" if name != "predict" else "predict 8080", x["n"],
                     x["p50_ms"], x["p99_ms"], x["max_ms"], x["timeouts"], x["failures"]))
    lat = f["oip_refusal_latency"]
    rows.append(("OIP refusals (flood)", f["oip_refusals"], lat["p50_ms"], lat["p99_ms"],
                 lat["max_ms"], "-", "-"))
    probe = f["oip_refusal_probe"]
    rows.append(("OIP refusals (probe)", sum(probe["answers"].values()), probe["p50_ms"],
                 probe["p99_ms"], probe["max_ms"], "-", "-"))
    for row in rows:
        print("  ".join(f"{v!s:>20}" if i == 0 else f"{v!s:>9}"
                        for i, v in enumerate(row)))
    print(f"OIP answers: {f['oip_answers']}")
    for name, c in doc.get("cgroups", {}).items():
        print(f"cgroup {name}: peak {c['peak_bytes'] / MIB:.0f} MiB of "
              f"{c['limit_bytes'] / MIB:.0f} MiB, OOM kills {c['oom_kill']}")
    for name, c in doc.get("cpu_throttling", {}).items():
        if c:
            print(f"cpu {name}: throttled in {c['nr_throttled']} of {c['nr_periods']} "
                  f"periods, {c['throttled_s']} s")
    print(f"OIP process VmHWM {doc['oip_vm_hwm_bytes'] / MIB:.0f} MiB; restarts "
          f"{doc['restarts']}; predict 200s {f['predict']['ok']}")
    bad = verdict(doc)
    print("HOLDS" if not bad else "FAILS: " + "; ".join(bad))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.oip_flood", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="flood duration")
    ap.add_argument("--stallers", type=int, default=150,
                    help="connections each sending 8 MiB - 1 byte and stalling")
    ap.add_argument("--posters", type=int, default=8, help="clients posting bad 8 MiB bodies")
    ap.add_argument("--reconnect-s", type=float, default=1.0,
                    help="a staller answered (429, 408) opens its next connection this "
                         "many seconds later (0: at once, a reconnect storm)")
    ap.add_argument("--model-store", default="model_store", type=Path)
    ap.add_argument("--version", default=None,
                    help="version to serve (default: the one `make up` would)")
    ap.add_argument("--torchserve-memory", type=int, default=4096 * MIB,
                    help="TorchServe's memory cgroup, bytes (the pod's is 16Gi)")
    ap.add_argument("--out", type=Path, default=OUT)
    return ap


@contextlib.contextmanager
def inside(groups: dict[str, Path]) -> Iterator[None]:
    """This process inside ``groups`` meanwhile: what it starts stays there after."""
    _move(os.getpid(), groups)
    try:
        yield
    finally:
        for group in groups.values():
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))


@contextlib.contextmanager
def pod(root: Path, store: Path, version: str, groups: dict[str, dict[str, Path]]
        ) -> Iterator[tuple[Any, dict[str, int]]]:
    """The pod's three containers as processes, each started inside its cgroups:
    TorchServe, the sidecar (``--oip-mode external``, as in k8s/deployment.yaml) and the
    OIP process (its shipped bounds); ``version`` declared as ``make up`` declares it.
    Yields the launch config and the pids; stops all three on exit."""
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launch_ports import free_port_settings
    from serve.ops.launch_processes import start_sidecar, start_torchserve
    from serve.ops.launch_state import default_state
    from serve.ops.launcher import wait_ready
    from serve.ops.process_groups import stop_group
    from serve.ops.state_client import StateClient
    from serve.sidecar.http.oip_options import OipOptions
    from serve.state import write_state

    cfg = LaunchConfig(**free_port_settings(), model_store=store,
                       state_file=root / "state.yaml", run_dir=root / "run",
                       log_dir=root / "logs", sidecar=True, ready_timeout_s=300,
                       sidecar_args=("--oip-mode", "external"))
    write_state(root / "state.yaml", default_state(cfg.repository(), version))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with inside(groups["torchserve"]):
            procs.append(start_torchserve(cfg))
        with inside(groups["sidecar"]):
            sidecar = start_sidecar(cfg)
        if sidecar is None:
            raise RuntimeError("the launch config has no sidecar")
        procs.append(sidecar)
        options = OipOptions(port=cfg.sidecar_oip_port, model_name=cfg.model_name,
                             inference_url=cfg.inference_url, sidecar_url=cfg.sidecar_url,
                             repositories=tuple(cfg.repository_dirs), log_level="warning")
        with inside(groups["oip"]), open(root / "oip.log", "ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "serve.sidecar.http.oip_server", *options.argv()],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        wait_ready(cfg, procs[:2])
        StateClient(cfg.sidecar_write_url, cfg.token_file.read_text().strip(),
                    timeout_s=30).wait_converged(timeout_s=300)
        httpx.get(f"{cfg.oip_url}/v2/health/live", timeout=30).raise_for_status()
        yield cfg, dict(zip(("torchserve", "sidecar", "oip"), (p.pid for p in procs),
                            strict=True))
    finally:
        for proc in reversed(procs):
            stop_group(proc.pid, proc)


def main(argv: list[str] | None = None) -> int:
    from serve.ops.launch_config import LaunchConfig

    args = _parser().parse_args(argv)
    store = args.model_store.resolve()
    version = args.version or LaunchConfig().initial_version  # what `make up` declares
    tag = os.getpid()
    with tempfile.TemporaryDirectory(prefix="oip-flood-") as tmp, \
            cgroups(f"oip-flood-ts-{tag}", args.torchserve_memory, None) as ts_g, \
            cgroups(f"oip-flood-sidecar-{tag}", *SIDECAR_LIMITS) as sc_g, \
            cgroups(f"oip-flood-oip-{tag}", *OIP_LIMITS) as oip_g:
        groups = {"torchserve": ts_g, "sidecar": sc_g, "oip": oip_g}
        with pod(Path(tmp), store, version, groups) as (cfg, before):
            for g in groups.values():
                (g["memory"] / "memory.max_usage_in_bytes").write_text("0")
            cpu0 = {k: _cpu(g) for k, g in groups.items()}
            state = httpx.get(f"{cfg.sidecar_url}/state", timeout=30).json()
            flood = run_flood(cfg.oip_url, cfg.sidecar_url,
                              f"{cfg.inference_url}/predictions/{cfg.model_name}",
                              seconds=args.seconds, stallers=args.stallers,
                              posters=args.posters, reconnect_s=args.reconnect_s)
            alive = {k: psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                     for k, p in before.items()}
            doc: dict[str, Any] = {
                "flood": flood.summary(), "stallers": args.stallers, "posters": args.posters,
                "reconnect_s": args.reconnect_s,
                "restarts": sum(not a for a in alive.values()), "pids": before,
                "cgroups": {k: _memory(g) for k, g in groups.items()},
                "cpu_throttling": {k: _delta(_cpu(g), cpu0[k]) for k, g in groups.items()},
                "cpu_quota_cores": {"sidecar": SIDECAR_LIMITS[1], "oip": OIP_LIMITS[1],
                                    "torchserve": None},
                "oip_vm_hwm_bytes": vm_hwm_bytes(before["oip"]) if alive["oip"] else None,
                "oip_bounds": _oip_bounds(before["oip"]),
                "state": _state(state, version), "machine": machine_info(),
                "command": " ".join(["python -m bench.oip_flood", *(argv or sys.argv[1:])]),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "load_average": os.getloadavg()}
    doc["verdict"] = verdict(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print_table(doc)
    print(f"wrote {args.out}")
    return 0 if not doc["verdict"] else 1


def _oip_bounds(pid: int) -> dict[str, str]:
    """The OIP process's bounds, from its command line (what it ran with)."""
    cmd = psutil.Process(pid).cmdline()
    keys = ("--max-parses", "--max-inflight-bytes", "--body-deadline-s", "--max-requests",
            "--limit-concurrency", "--ready-cache-s")
    return {k.lstrip("-"): cmd[cmd.index(k) + 1] for k in keys if k in cmd}


def _state(state: Any, version: str) -> dict[str, Any]:
    obs = (state or {}).get("observed", {}) if isinstance(state, dict) else {}
    return {"version": version, "serving_version": obs.get("serving_version"),
            "batching": obs.get("batching"), "workers": obs.get("workers")}


if __name__ == "__main__":
    sys.exit(main())

