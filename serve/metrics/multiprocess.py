"""Hygiene of prometheus_client's multiprocess directory: :func:`clean_dead_worker_files`
removes dead workers' live gauges and folds their counters and histograms into one merged
file per type, so the directory stays bounded and the pod's sums never go backwards.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Protocol

from prometheus_client.multiprocess import mark_process_dead

__all__ = [
    "CleanupReport",
    "clean_dead_worker_files",
]


class CleanupReport:
    """What :func:`clean_dead_worker_files` did in one multiprocess directory.

    Attributes:
        dead_pids: pids named by files whose process no longer exists.
        gauges_removed: live-gauge files removed (``mark_process_dead``).
        merged: counter/histogram/summary files folded into ``<type>_merged.db`` and
            removed.
        files_before: ``*.db`` files before the clean-up.
        files_after: ``*.db`` files after it.
    """

    __slots__ = ("dead_pids", "files_after", "files_before", "gauges_removed", "merged")

    def __init__(self, dead_pids: tuple[int, ...] = (), gauges_removed: tuple[str, ...] = (),
                 merged: tuple[str, ...] = (), files_before: int = 0,
                 files_after: int = 0) -> None:
        self.dead_pids = dead_pids
        self.gauges_removed = gauges_removed
        self.merged = merged
        self.files_before = files_before
        self.files_after = files_after

    def __repr__(self) -> str:
        return (f"CleanupReport(dead_pids={self.dead_pids}, gauges_removed="
                f"{self.gauges_removed}, merged={self.merged}, files_before="
                f"{self.files_before}, files_after={self.files_after})")

    def describe(self) -> str:
        """One log line: ``2 dead workers (pids 41, 57): 2 live-gauge files removed, 4
        counter/histogram files merged; 12 -> 8 files``."""
        if not self.dead_pids:
            return f"no dead workers' files; {self.files_after} files"
        return (f"{len(self.dead_pids)} dead workers (pids "
                f"{', '.join(map(str, self.dead_pids))}): {len(self.gauges_removed)} "
                f"live-gauge files removed, {len(self.merged)} counter/histogram files "
                f"merged; {self.files_before} -> {self.files_after} files")


#: Types whose values of dead workers stay in the sums: folded into ``<type>_merged.db``.
_CUMULATIVE_TYPES = ("counter", "histogram", "summary")
_LOCK_NAME = ".dlrm-cleanup.lock"  # not *.db: the collector never reads it


class _IsAlive(Protocol):
    def __call__(self, pid: int, /) -> bool: ...


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists in this pid namespace (``os.kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _file_pid(name: str) -> int | None:
    """The pid in a prometheus_client file name (``counter_123.db``,
    ``gauge_livesum_123.db``); None for other names (``counter_merged.db``)."""
    last = name.removesuffix(".db").rsplit("_", 1)[-1]
    return int(last) if last.isascii() and last.isdigit() and int(last) > 0 else None



def _files_by_pid(files: list[Path]) -> dict[int, list[Path]]:
    """The files named after a pid (:func:`_file_pid`), by pid, in ``files`` order."""
    by_pid: dict[int, list[Path]] = {}
    for f in files:
        pid = _file_pid(f.name)
        if pid is not None:
            by_pid.setdefault(pid, []).append(f)
    return by_pid


def _remove_live_gauges(folder: Path, dead: tuple[int, ...],
                        by_pid: dict[int, list[Path]]) -> list[str]:
    """``mark_process_dead`` each dead pid; return the names of its live-gauge files."""
    gauges: list[str] = []
    for pid in dead:
        gauges += [f.name for f in by_pid[pid] if f.name.startswith("gauge_live")]
        with contextlib.suppress(FileNotFoundError):  # the sidecar's reap removed it meanwhile
            mark_process_dead(pid, str(folder))
    return gauges


def _merge_files(folder: Path, typ: str, sources: list[Path]) -> None:
    """Add the values of ``sources`` (files of type ``typ``) into ``<typ>_merged.db``
    (created if missing) through a temporary file renamed over it, then remove them."""
    from prometheus_client.mmap_dict import MmapedDict

    target = folder / f"{typ}_merged.db"
    totals: dict[str, float] = {}
    for f in ([target] if target.exists() else []) + sources:
        for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(f)):
            totals[key] = totals.get(key, 0.0) + value
    tmp = folder / f".{typ}_merged.tmp"  # not *.db: invisible to the collector
    tmp.unlink(missing_ok=True)
    out = MmapedDict(str(tmp))
    try:
        for key, value in totals.items():
            out.write_value(key, value, 0.0)
    finally:
        out.close()
    os.replace(tmp, target)
    for f in sources:
        f.unlink(missing_ok=True)


def clean_dead_worker_files(path: str | os.PathLike[str], *,
                            is_alive: _IsAlive = _pid_alive,
                            own_pid: int | None = None) -> CleanupReport:
    """Clean the prometheus_client multiprocess directory of workers that have died.

    A TorchServe worker runs this at start, before its
    :class:`~serve.metrics.worker.HandlerMetrics` exist.
    Every worker that ever ran leaves files named after its pid (``counter_<pid>.db``,
    ``histogram_<pid>.db``, ``gauge_livesum_<pid>.db``); workers restart on every version
    switch and on every crash, and the pod's directory is a 64 MiB tmpfs, so without a
    clean-up the files pile up until writes fail.

    For every pid in a file name that is not alive (``os.kill(pid, 0)`` raises
    ProcessLookupError):

    * **live gauges**: ``mark_process_dead(pid, path)`` removes them; a ``livesum`` gauge
      is the sum over live workers, so a dead worker's value must go.
    * **counters, histograms, summaries**: their values are added into one accumulated
      file per type, ``<type>_merged.db``, and the worker's files are removed. Removing
      them without merging would make every summed counter (``dlrm_requests_total``, a
      histogram's ``_count``) go backwards, which Prometheus reads as a counter reset of
      the whole pod (a false ``rate()`` spike, and the HPA's request rate with it).
      Keeping them would keep the totals but grow without bound. Merged, the sums
      exposed are unchanged (up to float rounding of ``_sum`` values) and the directory
      holds the live workers' files plus at most one merged file per type.
    * files of other gauge modes (``all``, ``max``, ``min``, ``sum``, ``mostrecent``) are
      left alone: their dead workers' values are part of what those modes mean.
      ``HandlerMetrics`` writes none.

    Trade-offs: the merged file is written to a temporary name and renamed over the old
    one (atomic), then the merged workers' files are removed; a scrape between those two
    steps (microseconds) counts those workers twice once, and a crash between them would
    keep them counted twice (a one-time rise, never a fall). Workers starting together
    serialize on a lock file in the directory (``flock``), so no file is merged twice.
    Liveness is checked in this process's pid namespace, which holds for the workers of
    one TorchServe container; a dead worker's pid reused by a live process keeps its
    files until that process is gone too (a new worker on a reused pid continues the
    old counts, as prometheus_client reads existing files). The sidecar's own reaping
    (:meth:`serve.metrics.aggregate.HandlerAggregateCollector.reap`) also removes live
    gauges and does not conflict. Files are read and written with prometheus_client's
    ``MmapedDict`` (the format its collector reads; checked against 0.26.0 by
    ``tests/test_metrics.py``).

    Args:
        path: the multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``). A missing
            directory has nothing to clean.
        is_alive: pid -> whether that process exists (tests inject one).
        own_pid: this process's pid, never treated as dead (default ``os.getpid()``).
    Returns:
        What was removed and merged (:class:`CleanupReport`; ``describe()`` for a log
        line).
    """
    import fcntl

    folder = Path(path)
    if not folder.is_dir():
        return CleanupReport()
    me = os.getpid() if own_pid is None else own_pid
    with open(folder / _LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        files = sorted(folder.glob("*.db"))
        by_pid = _files_by_pid(files)
        dead = tuple(sorted(pid for pid in by_pid if pid != me and not is_alive(pid)))
        gauges = _remove_live_gauges(folder, dead, by_pid)
        merged: list[str] = []
        for typ in _CUMULATIVE_TYPES:
            sources = [f for pid in dead for f in by_pid[pid] if f.name.startswith(typ + "_")]
            if sources:
                _merge_files(folder, typ, sources)
                merged += [f.name for f in sources]
        after = len(list(folder.glob("*.db")))
    return CleanupReport(dead_pids=dead, gauges_removed=tuple(gauges), merged=tuple(merged),
                         files_before=len(files), files_after=after)
