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
workers, told apart by their command lines. Times come from ``/proc/<pid>/stat``
(utime + stime, clock ticks) and ``/proc/stat``'s first line; a process that ends within
the window loses its last ticks (it is a benchmark, not an audit).

Linux only. ``proc`` is injectable so tests can point it at a fake ``/proc``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(proc: Path, pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces and
    parentheses), or None when the process is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _cmdline(proc: Path, pid: int) -> str:
    try:
        return (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def service_processes(run_dir: Path | None, *, proc: Path = Path("/proc"),
                      self_pid: int | None = None) -> dict[int, str]:
    """pid -> group (:data:`GROUPS`) of the processes to watch: this process as the
    ``client`` and, when ``run_dir/pids.json`` names the service's process groups, every
    live process of those groups (``frontend``, ``workers``, ``sidecar``). Without a run
    dir, or for a service elsewhere, only the client is watched (the rest is ``other``).
    """
    out = {self_pid if self_pid is not None else os.getpid(): "client"}
    pgids: dict[int, str] = {}
    if run_dir is not None:
        try:
            recorded = json.loads((run_dir / "pids.json").read_text())
        except (OSError, ValueError):
            recorded = {}
        if isinstance(recorded, dict):
            for name, group in (("torchserve", "frontend"), ("sidecar", "sidecar")):
                if isinstance(recorded.get(name), int):
                    pgids[recorded[name]] = group
    if not pgids:
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = _stat_fields(proc, pid)
        if fields is None or len(fields) < 13:
            continue
        found = pgids.get(int(fields[2]))        # field 5 of stat: the process group
        if found is None or pid in out:
            continue
        out[pid] = ("workers" if found == "frontend" and _WORKER in _cmdline(proc, pid)
                    else found)
    return out


def snapshot(pids: Mapping[int, str], *, proc: Path = Path("/proc")) -> CpuSnapshot:
    """CPU seconds so far of each of ``pids`` (0 for one that is gone) and of the machine."""
    tick = _ticks()
    by_pid = {}
    for pid in pids:
        fields = _stat_fields(proc, pid)
        # utime, stime: fields 14 and 15 of stat, 11 and 12 after the name
        by_pid[pid] = (int(fields[11]) + int(fields[12])) / tick if fields else 0.0
    first = (proc / "stat").read_text().splitlines()[0].split()
    if first[0] != "cpu":
        raise ValueError(f"{proc / 'stat'}: first line starts {first[0]!r}, not 'cpu'")
    vals = [int(v) for v in first[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    # guest time is already inside user time: count the first 8 fields only
    return CpuSnapshot(by_pid, (sum(vals[:8]) - idle) / tick)


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
