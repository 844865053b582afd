"""Where a query's CPU goes: CPU seconds of each part of the service over a window,
read from ``/proc``, per query answered.

A load test on a shared machine says how fast the service is, not why. This splits the
machine's CPU time over one window (a benchmark trial) between:

- ``frontend``: TorchServe's Java frontend (HTTP, queueing, batching, worker IPC, its
  JIT compiler and GC);
- ``workers``: the Python model workers (TorchServe's protocol, decode, forward,
  response, metrics, prediction log);
- ``sidecar``: the FastAPI sidecar (state, metrics scrapes, the tuner);
- ``client``: the load generator (this process);
- ``other``: whatever else the machine ran in that window (the machine's busy time from
  ``/proc/stat`` minus the above: the kernel's interrupts, other programs).

The service's processes are found through the process groups the launcher records in
``<run dir>/pids.json`` (``{"torchserve": pgid, "sidecar": pgid}``, see
:func:`serve.ops.launcher.start`): the TorchServe group holds the Java frontend and its
workers, told apart by their command lines. Times come from psutil (the project's
process library: per process user + system time, and the machine's
``psutil.cpu_times()``; the client's own from ``time.process_time()``, finer than
``/proc``'s ticks); a process that ends within the window is not counted in it (it is
a benchmark, not an audit).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["GROUPS", "CpuSnapshot", "cpu_ms_per_query", "service_processes", "snapshot"]

#: The parts a query's CPU is split between, in the order tables print them.
GROUPS = ("client", "frontend", "workers", "sidecar", "other")

_WORKER = "model_service_worker"


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far: ``by_pid`` (user + system) of the processes watched and
    ``machine_busy_s`` (all CPUs, everything but idle and iowait)."""

    by_pid: Mapping[int, float]
    machine_busy_s: float


def _recorded_groups(run_dir: Path | None) -> dict[int, str]:
    """pgid -> group of the service's process groups in ``run_dir/pids.json`` (empty
    without one)."""
    if run_dir is None:
        return {}
    try:
        recorded = json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {recorded[name]: group
            for name, group in (("torchserve", "frontend"), ("sidecar", "sidecar"))
            if isinstance(recorded.get(name), int)}


def service_processes(run_dir: Path | None, *, self_pid: int | None = None) -> dict[int, str]:
    """pid -> group (:data:`GROUPS`) of the processes to watch: this process as the
    ``client`` and, when ``run_dir/pids.json`` names the service's process groups, every
    live process of those groups (``frontend``, ``workers``, ``sidecar``). Without a run
    dir, or for a service elsewhere, only the client is watched (the rest is ``other``).
    """
    out = {self_pid if self_pid is not None else os.getpid(): "client"}
    pgids = _recorded_groups(run_dir)
    if not pgids:
        return out
    for p in psutil.process_iter(["cmdline"]):
        try:
            found = pgids.get(os.getpgid(p.pid))
        except OSError:             # gone since the listing
            continue
        if found is None or p.pid in out:
            continue
        cmd = " ".join(p.info["cmdline"] or ())
        out[p.pid] = "workers" if found == "frontend" and _WORKER in cmd else found
    return out


def snapshot(pids: Mapping[int, str]) -> CpuSnapshot:
    """CPU seconds so far of each of ``pids`` that is alive, and of the machine."""
    by_pid = {}
    me = os.getpid()
    for pid in pids:
        if pid == me:
            # this process's own clock has ns resolution; /proc's 10 ms ticks round a
            # short trial's client CPU (10 queries at ~1 ms each) down to 0
            by_pid[pid] = time.process_time()
            continue
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:        # gone: not counted in this window
            continue
        by_pid[pid] = t.user + t.system
    m = psutil.cpu_times()
    # busy = all but idle and iowait; guest time is already inside user time
    not_busy = m.idle + sum(getattr(m, k, 0.0) for k in ("iowait", "guest", "guest_nice"))
    return CpuSnapshot(by_pid, sum(m) - not_busy)


def cpu_ms_per_query(pids: Mapping[int, str], before: CpuSnapshot, after: CpuSnapshot,
                     queries: int, seconds: float) -> dict[str, float]:
    """CPU milliseconds per query of each group (:data:`GROUPS`) between two snapshots,
    plus ``total`` (the machine's busy time per query) and ``busy_cores`` (the machine's
    busy CPU seconds per second of the window). ``other`` may come out slightly negative
    when tick rounding outweighs it; it is clamped at 0."""
    if queries <= 0 or seconds <= 0:
        raise ValueError(f"queries ({queries}) and seconds ({seconds}) must be > 0")
    used = dict.fromkeys(GROUPS, 0.0)
    for pid, group in pids.items():
        used[group] += max(0.0, after.by_pid.get(pid, 0.0) - before.by_pid.get(pid, 0.0))
    busy = max(0.0, after.machine_busy_s - before.machine_busy_s)
    used["other"] = max(0.0, busy - sum(v for k, v in used.items() if k != "other"))
    out = {k: round(v / queries * 1e3, 3) for k, v in used.items()}
    out["total"] = round(max(busy, sum(used.values())) / queries * 1e3, 3)
    out["busy_cores"] = round(busy / seconds, 3)
    return out
