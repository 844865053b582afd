"""The CPU budget of this process, and how many torch threads each worker gets.

In a Kubernetes pod ``os.sched_getaffinity`` returns every core of the node unless the
static CPU manager pins the pod; what the pod may really use is its cgroup CPU quota
(``resources.limits.cpu``). Sizing threads from the affinity alone oversubscribes: two
workers on a 64-core node each started 32 threads inside a 4-CPU limit, and the kernel
throttled them (docs/stack.md: up to 10x slowdowns from oversubscription).

* :func:`cpu_quota` reads the quota: cgroup v2 ``cpu.max`` (``"400000 100000"`` = 4.0
  CPUs, ``"max 100000"`` = no limit), else cgroup v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us`` under ``cpu/`` or ``cpu,cpuacct/`` (quota ``-1`` = no limit).
* :func:`available_cpus` = min(affinity count, ceil(quota)), at least 1.
* :func:`choose_threads` decides a worker's intra-op threads, first match wins:

  1. ``handler.num_threads`` in the archive's model-config.yaml (the model's own,
     deliberate setting);
  2. the ``OMP_NUM_THREADS`` environment variable, when set and not empty (an
     operator's override for every model of the process; with a comma list, its first
     entry, the outermost OpenMP level);
  3. ``max(1, available_cpus // workers)``.

Why ceil for a fractional quota (1.5 CPUs -> 2): the quota is CPU *time* per period, not
a count of cores. ``ceil(q)`` is the fewest threads that can use all of it: 1 thread under
a 1.5-CPU quota can never use more than 1.0 (a third of what the pod pays for idles),
while 2 threads use all of it and are throttled for at most (2 - 1.5) / 2 of each period.
The JVM (container support) and Go (GOMAXPROCS from the CPU limit) round up the same
way. The Deployment's limits are whole CPUs, where both roundings agree.

No torch import: this module is shared ground (the handler, ``serve.api.config``,
benchmarks), and the caller applies the result (``torch.set_num_threads``).
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from serve.common.validate import positive_int
from serve.errors import ConfigError
from serve.settings import OMP_NUM_THREADS

__all__ = [
    "CGROUP_ROOT",
    "ThreadChoice",
    "affinity_cpus",
    "available_cpus",
    "choose_threads",
    "cpu_quota",
    "threads_per_worker",
]

log = logging.getLogger(__name__)

#: Where the cgroup filesystem is mounted (inside a container: the container's own cgroup).
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 mounts the cpu controller under one of these names (co-mounted with cpuacct).
_V1_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _read(path: Path) -> str | None:
    """The stripped text of ``path``; None when it is missing or unreadable."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_v2(text: str, path: Path) -> float | None:
    """``cpu.max``: ``"$MAX $PERIOD"``; ``max`` = no limit."""
    parts = text.split()
    if len(parts) == 2 and parts[0] == "max":
        return None
    try:
        quota, period = (int(p) for p in parts)
    except ValueError:
        quota = period = 0
    if len(parts) != 2 or quota <= 0 or period <= 0:
        log.warning("%s holds %r, not '<quota> <period>' or 'max <period>'; ignoring the "
                    "CPU quota (threads follow the CPU affinity)", path, text)
        return None
    return quota / period


def _quota_v1(quota_text: str, period_text: str, folder: Path) -> float | None:
    """``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; a quota of -1 = no limit."""
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        quota = period = 0
    if quota == -1 and period > 0:
        return None
    if quota <= 0 or period <= 0:
        log.warning("%s: cpu.cfs_quota_us=%r, cpu.cfs_period_us=%r are not a quota (> 0 or "
                    "-1) and a period (> 0); ignoring the CPU quota (threads follow the CPU "
                    "affinity)", folder, quota_text, period_text)
        return None
    return quota / period


def cpu_quota(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup CPU quota in CPUs (e.g. 4.0, 1.5); None without a limit.

    cgroup v2 (``<root>/cpu.max``) first, then cgroup v1 (``<root>/cpu/`` or
    ``<root>/cpu,cpuacct/``: ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``). None also
    when no file is there (not Linux, no cgroup mount) or a file does not parse (logged):
    the caller then falls back to the CPU affinity.

    Args:
        cgroup_root: where the cgroup filesystem is mounted; tests pass a folder of fake
            files.
    """
    root = Path(cgroup_root)
    v2 = root / "cpu.max"
    text = _read(v2)
    if text is not None:
        return _quota_v2(text, v2)
    for name in _V1_DIRS:
        folder = root / name
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return _quota_v1(quota, period, folder)
    return None


def affinity_cpus() -> int:
    """CPUs this process may be scheduled on (``os.sched_getaffinity``, else
    ``os.cpu_count``): in a pod without the static CPU manager, every core of the node."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def available_cpus(cgroup_root: Path = CGROUP_ROOT, affinity: int | None = None) -> int:
    """CPUs this process can really use: min(affinity, ceil(quota)), at least 1.

    Args:
        cgroup_root: see :func:`cpu_quota`.
        affinity: the affinity count to use instead of :func:`affinity_cpus` (tests).
    """
    return _combine(affinity if affinity is not None else affinity_cpus(),
                    cpu_quota(cgroup_root))


def _combine(affinity: int, quota: float | None) -> int:
    """min(affinity, ceil(quota)), at least 1."""
    positive_int("affinity", affinity,
                 then=" (CPUs the process may run on) or None to read it from the OS")
    cpus = affinity if quota is None else min(affinity, math.ceil(quota))
    return max(1, cpus)


def threads_per_worker(workers: int, cpus: int) -> int:
    """``cpus // workers``, at least 1: the workers together never use more threads
    than CPUs (except when there are more workers than CPUs)."""
    for name, v in (("workers", workers), ("cpus", cpus)):
        positive_int(name, v)
    return max(1, cpus // workers)


@dataclass(frozen=True)
class ThreadChoice:
    """A worker's intra-op thread count and where it came from.

    Attributes:
        threads: torch intra-op threads for the worker.
        source: ``handler.num_threads``, ``OMP_NUM_THREADS`` or ``cpu budget``.
        cpus: CPUs the process can use (:func:`available_cpus`), computed in every case
            so that the log shows what an explicit setting overrides.
        quota: the cgroup quota in CPUs; None without a limit.
        affinity: the CPU affinity count.
        workers: workers of the model that share the CPUs.
    """

    threads: int
    source: str
    cpus: int
    quota: float | None
    affinity: int
    workers: int

    @property
    def oversubscribed(self) -> bool:
        """True when the workers' threads together exceed the usable CPUs (only an
        explicit setting can do that, or more workers than CPUs)."""
        return self.threads * self.workers > self.cpus

    def describe(self) -> str:
        """One log line: ``2 threads per worker from cpu budget (4 CPUs = min(affinity 64,
        ceil(quota 4)) / 2 workers)``."""
        if self.quota is None:
            budget = f"{self.cpus} CPUs = affinity {self.affinity} (no cgroup CPU quota)"
        else:
            budget = (f"{self.cpus} CPUs = min(affinity {self.affinity}, ceil(quota "
                      f"{self.quota:g}))")
        split = f"{budget} / {self.workers} worker{'s' if self.workers != 1 else ''}"
        if self.source == "cpu budget":
            how = split
        else:
            how = (f"explicit; the cpu budget would give "
                   f"{threads_per_worker(self.workers, self.cpus)}: {split}")
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        line = f"{threads} per worker from {self.source} ({how})"
        if self.oversubscribed:
            line += (f"; OVERSUBSCRIBED: {self.workers} x {self.threads} threads on {self.cpus} "
                     "CPUs")
        return line


def _omp_threads(environ: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as a count; None when unset or empty."""
    raw = environ.get(OMP_NUM_THREADS.name)
    if raw is None or not raw.strip():
        return None
    first = raw.split(",", 1)[0].strip()
    if not (first.isascii() and first.isdigit()) or int(first) < 1:
        raise ConfigError(f"{OMP_NUM_THREADS}={raw!r} must be a positive integer (threads per "
                          "worker); unset it to size threads from the CPU quota, or set "
                          "handler.num_threads in the model config")
    return int(first)


def choose_threads(workers: int, configured: int | None = None, *,
                   environ: Mapping[str, str] | None = None,
                   cgroup_root: Path = CGROUP_ROOT,
                   affinity: int | None = None) -> ThreadChoice:
    """A worker's torch intra-op threads: ``configured``, else ``OMP_NUM_THREADS``, else
    the CPU budget split over the workers (see the module docstring).

    Args:
        workers: workers of the model (the model config's ``maxWorkers``).
        configured: ``handler.num_threads`` (None: not set).
        environ: the environment to read ``OMP_NUM_THREADS`` from (default ``os.environ``).
        cgroup_root: see :func:`cpu_quota`.
        affinity: see :func:`available_cpus`.
    Raises:
        ConfigError: ``workers`` or ``configured`` is not an integer >= 1, or
            ``OMP_NUM_THREADS`` is set to something other than a positive integer.
    """
    env = os.environ if environ is None else environ
    aff = affinity if affinity is not None else affinity_cpus()
    quota = cpu_quota(cgroup_root)
    cpus = _combine(aff, quota)
    budget = threads_per_worker(workers, cpus)
    if configured is not None:
        positive_int("handler.num_threads", configured,
                     then=" or null (null: from the CPU budget)")
        threads, source = configured, "handler.num_threads"
    else:
        omp = _omp_threads(env)
        threads, source = (omp, "OMP_NUM_THREADS") if omp is not None else (budget, "cpu budget")
    return ThreadChoice(threads=threads, source=source, cpus=cpus, quota=quota, affinity=aff,
                        workers=workers)
