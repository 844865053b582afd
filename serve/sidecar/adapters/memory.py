"""Memory for a version switch: the limit, what is in use, what a new version will need,
and the peak a switch reached.

A switch runs the old and the new version's workers side by side until the old one has
drained, so for a while the pod holds two copies of the model. Where that would not fit
the memory limit the switch is refused *before* anything loads (an OOM kill would fail
every request in flight); :func:`check_fits` decides, :class:`PeakTracker` measures what
a switch really took, so the estimate can be judged against it.

Sources, each injectable so tests pass fake files and a fake ``rss``:

* the limit: ``memory_limit_bytes`` when given (TorchServe in another container than the
  sidecar: pass its ``limits.memory``), else the cgroup's ``memory.max`` (v2) or
  ``memory/memory.limit_in_bytes`` (v1) under ``cgroup_root``; "max" or a v1 value near
  2^63 means no limit, and then nothing is refused.
* in use: the cgroup's working set when the limit is the cgroup's: ``memory.current``
  (v1 ``memory/memory.usage_in_bytes``) less the inactive file cache of ``memory.stat``
  (``inactive_file``, v1 ``total_inactive_file``), which the kernel reclaims before it
  kills anything (kubelet counts the same way); else the RSS sum of TorchServe's workers
  (the JVM frontend is not counted: its heap is bounded by ``-Xmx``; the headroom covers
  it).
* the delta folder (``--delta-dir``), when it is memory-backed (tmpfs: a Kubernetes
  emptyDir ``medium: Memory``, detected from ``/proc/self/mounts`` by
  :func:`is_memory_backed`): its files are memory no process's RSS shows, the deltas
  stored and the shared tables of versions no live worker maps. Added to the usage when
  the usage is the workers' RSS (``held``); the cgroup's working set already includes
  the tmpfs pages charged to it. On a disk-backed folder they are page cache, which the
  kernel reclaims, and are not counted.
* a worker's RSS: psutil, only for a process that is a TorchServe worker
  (``model_service_worker`` in its command line: in a pod without
  ``shareProcessNamespace`` the pid may name another process or none); else the
  ``memoryUsage`` TorchServe last reported for that worker, if any.

Example::

    probe = MemoryProbe(CgroupMemory(Path("/sys/fs/cgroup")))
    check = check_fits(probe, target="v2_b8d5w2", pids=[101, 102],
                       per_worker=[2 << 30, 2 << 30], archive_bytes=1 << 30, workers=2)
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.errors import InsufficientMemory

__all__ = [
    "CgroupMemory",
    "MemoryCheck",
    "MemoryProbe",
    "PeakTracker",
    "check_fits",
    "is_memory_backed",
    "worker_rss",
]

_log = logging.getLogger(__name__)
# cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712).
_V1_UNLIMITED = 1 << 62
_MIB = float(1 << 20)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


class CgroupMemory:
    """The memory limit and usage of the cgroup mounted at ``root`` (v2, else v1).

    Args:
        root: the cgroup filesystem, ``/sys/fs/cgroup`` in a container; a test passes a
            folder holding ``memory.max`` and ``memory.current`` (or v1's files).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _files(self) -> tuple[Path, Path, Path, str]:
        """limit, usage, stat file and the stat key of the inactive file cache."""
        v2 = self.root / "memory.max"
        if v2.exists():
            return v2, self.root / "memory.current", self.root / "memory.stat", "inactive_file"
        v1 = self.root / "memory"
        return (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes",
                v1 / "memory.stat", "total_inactive_file")

    def limit(self) -> tuple[int | None, str]:
        """(bytes, the file read); bytes is None when there is no limit or no file."""
        path = self._files()[0]
        value = _read_int(path)
        if value is not None and value >= _V1_UNLIMITED:
            value = None
        return value, str(path)

    def current(self) -> int | None:
        """The working set in bytes: usage less the inactive file cache (None: no file)."""
        _, usage_file, stat_file, key = self._files()
        usage = _read_int(usage_file)
        if usage is None:
            return None
        try:
            stat = dict(line.split()[:2] for line in stat_file.read_text().splitlines()
                        if len(line.split()) >= 2)
            inactive = int(stat.get(key, 0))
        except (OSError, ValueError):
            inactive = 0
        return max(0, usage - inactive)


def worker_rss(pid: int) -> int | None:
    """RSS in bytes of TorchServe worker ``pid``; None when it is not visible as one."""
    import psutil  # TorchServe's own dependency; lazy to keep the import light

    try:
        proc = psutil.Process(pid)
        if not any("model_service_worker" in part for part in proc.cmdline()):
            return None
        return int(proc.memory_info().rss)
    except (psutil.Error, OSError):
        return None


_MEMORY_FS = frozenset({"tmpfs", "ramfs"})


def is_memory_backed(path: Path, mounts: Path = Path("/proc/self/mounts")) -> bool:
    """Whether ``path`` lives on a memory filesystem (tmpfs, ramfs): the mount with the
    longest mount point that holds it (False when the mount table cannot be read)."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return False
    target = str(Path(path).resolve())
    best, fstype = "", ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype in _MEMORY_FS


class MemoryProbe:
    """Reads the limit, the usage and workers' RSS (see the module docstring).

    Args:
        cgroup: the cgroup's files.
        limit_bytes: the limit when it is not the cgroup's (TorchServe's container limit).
        rss: bytes of one worker pid, or None when unknown (default: :func:`worker_rss`).
        held: bytes held in memory that no RSS shows (a memory-backed delta folder);
            added to an RSS-based usage (module docstring). None: nothing.
    """

    def __init__(self, cgroup: CgroupMemory, limit_bytes: int | None = None,
                 rss: Callable[[int], int | None] = worker_rss,
                 held: Callable[[], int] | None = None) -> None:
        self.cgroup = cgroup
        self.limit_bytes = limit_bytes
        self.rss = rss
        self.held = held

    def limit(self) -> tuple[int | None, str]:
        """(bytes or None for no limit, where it comes from)."""
        if self.limit_bytes is not None:
            return self.limit_bytes, "--memory-limit-bytes"
        return self.cgroup.limit()

    def worker_bytes(self, pids: Iterable[int],
                     reported: Mapping[int, int] | None = None) -> list[int]:
        """The RSS of each worker whose memory is known (psutil, else TorchServe's report)."""
        out = []
        for pid in pids:
            value = self.rss(pid)
            if value is None and reported:
                value = reported.get(pid) or None
            if value:
                out.append(int(value))
        return out

    def usage(self, pids: Iterable[int], reported: Mapping[int, int] | None = None
              ) -> tuple[int, str]:
        """(bytes in use, how measured): the cgroup's when the limit is the cgroup's."""
        if self.limit_bytes is None:
            current = self.cgroup.current()
            if current is not None:
                return current, "cgroup working set"
        rss = sum(self.worker_bytes(pids, reported))
        held = self._held()
        if held:
            return rss + held, (f"RSS of TorchServe's workers + {held / _MIB:.0f} MiB in "
                                f"the memory-backed delta folder")
        return rss, "RSS of TorchServe's workers"

    def _held(self) -> int:
        if self.held is None:
            return 0
        try:
            return int(self.held())
        except OSError as e:  # a folder being cleaned: counted at the next check
            _log.warning("delta folder size not read: %s", e)
            return 0


@dataclass(frozen=True)
class MemoryCheck:
    """The numbers behind a switch's go/no-go, all in bytes."""

    limit_bytes: int
    usage_bytes: int
    need_bytes: int
    headroom: float
    limit_source: str
    usage_basis: str
    need_basis: str

    @property
    def fits(self) -> bool:
        return self.usage_bytes + self.need_bytes <= self.limit_bytes * self.headroom

    def to_json(self) -> dict[str, Any]:
        return {"limit_bytes": self.limit_bytes, "usage_bytes": self.usage_bytes,
                "need_bytes": self.need_bytes, "headroom": self.headroom,
                "limit_source": self.limit_source, "fits": self.fits}

    def refusal(self, target: str) -> str:
        total = self.usage_bytes + self.need_bytes
        at_least = total / self.headroom
        return (f"switch to {target} refused: it needs about {self.need_bytes / _MIB:.0f} MiB "
                f"({self.need_basis}) on top of {self.usage_bytes / _MIB:.0f} MiB in use "
                f"({self.usage_basis}), {total / _MIB:.0f} MiB > {self.headroom:.0%} of the "
                f"memory limit {self.limit_bytes / _MIB:.0f} MiB ({self.limit_source}): the "
                f"old and the new version would not fit side by side. Raise the memory "
                f"limit of TorchServe's container to at least {at_least / _MIB:.0f} MiB, or "
                f"declare fewer workers")


#: Bytes per host tier slot besides its row: its last use and its row (int64 each).
SLOT_OVERHEAD_BYTES = 16
#: Bytes per table row of a host tier's row -> slot map (int32).
ROW_MAP_BYTES = 4


@dataclass(frozen=True)
class TableMemory:
    """What a version's tables hold in memory: ``per_pod`` (the mapped files' pages, in
    the page cache once for every worker) and ``per_worker`` (a bounded host tier's
    slots and its row map, in each worker's own memory); ``basis`` says which."""

    per_pod: int
    per_worker: int
    basis: str


def table_memory(table_bytes: int, rows: int, row_bytes: int, *, host_bytes: int | None,
                 host_fraction: float | None) -> TableMemory:
    """The memory of tables on disk (``table_bytes`` in ``rows`` rows, the widest
    ``row_bytes`` wide) under the workers' host budget (serve.runtime.tiers): no budget
    = the mapped files, once per pod; a budget = per worker, its slots (row + 16 B) and
    a 4-byte row map entry per table row."""
    if table_bytes <= 0:
        return TableMemory(0, 0, "")
    budget = (host_bytes if host_bytes is not None else
              int(host_fraction * table_bytes) if host_fraction is not None else None)
    if budget is None:
        return TableMemory(table_bytes, 0, f"tables {table_bytes / _MIB:.0f} MiB mapped "
                                           "once per pod")
    slots = min(rows, budget // max(row_bytes, 1))
    per_worker = slots * (row_bytes + SLOT_OVERHEAD_BYTES) + ROW_MAP_BYTES * rows
    return TableMemory(0, per_worker, f"host tier {per_worker / _MIB:.0f} MiB per worker "
                                      f"(budget {budget / _MIB:.0f} MiB of "
                                      f"{table_bytes / _MIB:.0f} MiB tables)")


def check_fits(probe: MemoryProbe, *, target: str, pids: Iterable[int], per_worker: list[int],
               archive_bytes: int, workers: int, headroom: float = 0.9,
               reported: Mapping[int, int] | None = None,
               tables: TableMemory | None = None) -> MemoryCheck | None:
    """Whether ``workers`` workers of ``target`` fit beside what runs now.

    The new version's need is estimated from the serving workers' RSS (``per_worker``,
    their mean, times ``workers``), but never below the model's bytes (``tables``: the
    mapped tables once per pod, or each worker's host tier, + ``archive_bytes`` per
    worker): a larger model than the serving one, or nothing serving yet.

    Returns:
        the check (None when there is no limit to respect).

    Raises:
        InsufficientMemory: usage + need > ``headroom`` x limit; the message gives the
            numbers and what to do.
    """
    limit, source = probe.limit()
    if limit is None:
        return None
    usage, usage_basis = probe.usage(pids, reported)
    t = tables or TableMemory(0, 0, "")
    by_archive = (archive_bytes + t.per_worker) * workers + t.per_pod
    need, basis = by_archive, f"archive {archive_bytes / _MIB:.0f} MiB x {workers} workers"
    if t.basis:
        basis = f"{t.basis} + archive {archive_bytes / _MIB:.0f} MiB, {workers} workers"
    if per_worker:
        mean = sum(per_worker) / len(per_worker)
        if mean * workers > by_archive:
            need = int(mean * workers)
            basis = f"serving workers' RSS {mean / _MIB:.0f} MiB x {workers} workers"
    check = MemoryCheck(limit_bytes=limit, usage_bytes=usage, need_bytes=need,
                        headroom=headroom, limit_source=source, usage_basis=usage_basis,
                        need_basis=basis)
    if not check.fits:
        raise InsufficientMemory(check.refusal(target))
    return check


class PeakTracker:
    """The highest memory seen across samples taken during a switch.

    ``peak_bytes`` is the cgroup's usage when the cgroup is readable (everything the
    kernel charges toward the limit), else the workers' RSS sum; ``peak_rss_bytes`` is
    always the workers' RSS sum (every registered version's workers).
    """

    def __init__(self, probe: MemoryProbe) -> None:
        self.probe = probe
        self.reset()

    def reset(self) -> None:
        self.peak_cgroup_bytes: int | None = None
        self.peak_rss_bytes: int | None = None
        self.samples = 0

    def sample(self, pids: Iterable[int], reported: Mapping[int, int] | None = None) -> None:
        rss = self.probe.worker_bytes(pids, reported)
        if rss:
            self.peak_rss_bytes = max(self.peak_rss_bytes or 0, sum(rss))
        current = self.probe.cgroup.current() if self.probe.limit_bytes is None else None
        if current is not None:
            self.peak_cgroup_bytes = max(self.peak_cgroup_bytes or 0, current)
        self.samples += 1

    @property
    def peak_bytes(self) -> int | None:
        return self.peak_cgroup_bytes if self.peak_cgroup_bytes is not None \
            else self.peak_rss_bytes
