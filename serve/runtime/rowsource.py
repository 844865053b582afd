"""Where a cache's missed rows come from: the row sources under the table tiers.

Shapes: R rows of all tables concatenated (global rows), ``row_bytes`` (rb) the widest
table's row width (the store's one width; narrower tables' rows come up zero-padded),
n rows asked in one call.

A :class:`RowSource` is what :class:`serve.runtime.cache.EmbeddingCache` reads its
misses from (its ``host``): ``fetch(global rows) -> uint8 (n, rb)`` and
``write(rows, data)`` for a delta. Implementations:

* :class:`serve.runtime.hostmem.HostRows`: every row in one host table (in memory);
* :class:`DiskRows`: the version's table files on local disk, read with ``os.pread``
  from a thread pool (many reads in flight, the GIL released in each), never through
  the mapping (a page fault at a time);
* :class:`MappedRows`: the copy-on-write mapped table files (the page cache shares
  their pages between the workers of a pod: the "all in memory" mode, nothing copied);
* :class:`serve.runtime.tiers.OnDevice`: a tier below (the host tier) seen from the
  device cache above it.

The two file sources keep an :class:`Overlay` of the rows deltas changed (per worker, in
memory; consulted before any read), so a version's table files are never written and
never copied. Each also answers ``lookup(rows, counts, n_ids)`` like a cache, so it can
be the top of a stack of tiers (:class:`serve.runtime.tiers.RowTiers`).

:class:`MissClock` times the fetches of a tier's misses from the tier below (per batch:
sum, count, and counts per bucket of ``serve.metrics.STAGE_DURATION_BUCKETS``);
:class:`TierCounters` is one tier's cumulative counters as the runtime reports them.
"""
from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from serve.errors import ArtifactError, ConfigError
from serve.metrics import STAGE_DURATION_BUCKETS
from serve.store.tablefiles import TableFiles

__all__ = ["DISK_READ_THREADS", "MISS_SECONDS_BUCKETS", "DiskRows", "MappedRows", "MissClock",
           "Overlay", "RowSource", "TierCounters"]

#: Threads reading rows from the table files in parallel (default): at ~70 us per 4 KB
#: random read at queue depth 1, 16 reads in flight keep a local SSD busy.
DISK_READ_THREADS = 16
#: Fewest rows per read task: below it one thread reads them all (a task costs ~20 us).
_MIN_ROWS_PER_TASK = 32
#: Upper bounds (seconds) of the miss-time buckets (+Inf last, implicit): the stage
#: buckets of the handler metrics, so the counts map onto ``dlrm_tier_miss_seconds``.
MISS_SECONDS_BUCKETS: tuple[float, ...] = STAGE_DURATION_BUCKETS


class RowSource(Protocol):
    """What an :class:`serve.runtime.cache.EmbeddingCache` reads its misses from."""

    @property
    def row_bytes(self) -> int: ...
    @property
    def total_rows(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def pinned_bytes(self) -> int: ...
    @property
    def device_readable(self) -> bool: ...

    def source(self) -> torch.Tensor: ...
    def fetch(self, rows: torch.Tensor) -> torch.Tensor: ...
    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TierCounters:
    """One tier's cumulative counters (``serve.runtime.engine.RuntimeStats.tiers``).

    Attributes:
        lookups: ids looked up at this tier (for a tier under a cache: the unique rows
            the cache above missed, one id each).
        hits: of them, ids found resident in the tier (``misses = lookups - hits``).
        miss_rows: distinct rows fetched from the tier below (for "host": rows read from
            the table files).
        read_bytes: bytes fetched from the tier below (for "host": bytes read from disk,
            at each table's own row width).
        miss_seconds_sum, miss_seconds_count: wall seconds spent fetching misses from
            below, and the fetches (at most one per batch).
        miss_seconds_bins: fetches per bucket of :data:`MISS_SECONDS_BUCKETS` (first
            bound >= the seconds; the last entry is +Inf), not cumulative.
        capacity_bytes: the tier's row budget in bytes (0: no such tier).
    """

    lookups: int = 0
    hits: int = 0
    miss_rows: int = 0
    read_bytes: int = 0
    miss_seconds_sum: float = 0.0
    miss_seconds_count: int = 0
    miss_seconds_bins: tuple[int, ...] = field(
        default_factory=lambda: (0,) * (len(MISS_SECONDS_BUCKETS) + 1))
    capacity_bytes: int = 0

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    def plus(self, other: TierCounters) -> TierCounters:
        """Both tiers' counts added (a worker's runtimes summed)."""
        return TierCounters(
            self.lookups + other.lookups, self.hits + other.hits,
            self.miss_rows + other.miss_rows, self.read_bytes + other.read_bytes,
            self.miss_seconds_sum + other.miss_seconds_sum,
            self.miss_seconds_count + other.miss_seconds_count,
            tuple(a + b for a, b in zip(self.miss_seconds_bins, other.miss_seconds_bins,
                                        strict=True)),
            self.capacity_bytes + other.capacity_bytes)


class MissClock:
    """Times a tier's fetches of misses from the tier below: sum, count, per bucket."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self.rows = 0
        self.bins = [0] * (len(MISS_SECONDS_BUCKETS) + 1)

    def observe(self, seconds: float, rows: int) -> None:
        """One fetch of ``rows`` distinct rows that took ``seconds``."""
        self.seconds += seconds
        self.count += 1
        self.rows += rows
        self.bins[bisect.bisect_left(MISS_SECONDS_BUCKETS, seconds)] += 1

    def counters(self, lookups: int, hits: int, read_bytes: int,
                 capacity_bytes: int) -> TierCounters:
        return TierCounters(lookups, hits, self.rows, read_bytes, self.seconds, self.count,
                            tuple(self.bins), capacity_bytes)


class Overlay:
    """The rows deltas changed, per worker, in memory: sorted unique int64 global rows
    ``keys`` (k,) and their bytes ``data`` uint8 (k, row_bytes).

    Cost: 8 + row_bytes bytes per changed row (``nbytes``), and each :meth:`merge`
    rewrites the overlay (O(k log k)). It grows with every delta until the version is
    rebuilt: fold it into a new version (a full build or import) once it holds a
    noticeable share of the rows (say 5%) or of the worker's memory budget.
    """

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.keys = np.zeros(0, dtype=np.int64)
        self.data = np.zeros((0, row_bytes), dtype=np.uint8)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.data.nbytes)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def merge(self, rows: np.ndarray, data: np.ndarray) -> None:
        """Add or replace rows (int64 (n,) unique) with ``data`` uint8 (n, row_bytes)."""
        keys = np.concatenate((self.keys, rows.astype(np.int64, copy=False)))
        order = np.argsort(keys, kind="stable")      # new rows after old ones of a key
        keys = keys[order]
        last = np.ones(keys.shape[0], dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        pick = order[last]
        self.keys = keys[last]
        self.data = np.concatenate((self.data, data))[pick]

    def find(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, at)``: bool (n,) whether each row is in the overlay, and int64 (n,)
        its index in ``data`` (meaningful where found)."""
        if not len(self):
            return np.zeros(rows.shape[0], dtype=bool), np.zeros(rows.shape[0], np.int64)
        at = np.searchsorted(self.keys, rows).clip(max=len(self) - 1)
        return self.keys[at] == rows, at


class _FileLevel:
    """What the two file sources share: the global row layout, the overlay, the
    counters of a source used as the top of a stack (:meth:`lookup`)."""

    def __init__(self, rows: list[int], widths: list[int]) -> None:
        self.table_rows = rows
        self.widths = np.asarray(widths, dtype=np.int64)
        self.row_bytes = int(max(widths))
        self.total_rows = int(sum(rows))
        self.ends = np.cumsum(np.asarray(rows, dtype=np.int64))
        self.starts = self.ends - np.asarray(rows, dtype=np.int64)
        self.overlay = Overlay(self.row_bytes)
        self.clock = MissClock()
        self.ids = 0            # ids looked up through lookup() (the top of a stack)
        self.overlay_ids = 0    # ... of them served from the overlay
        self.read_bytes = 0

    pinned_bytes = 0
    device_readable = False

    @property
    def nbytes(self) -> int:
        """Host bytes this source holds of its own (the overlay)."""
        return self.overlay.nbytes

    def source(self) -> torch.Tensor:
        raise RuntimeError("table files are not readable by the device; the fixed-shape "
                           "cache path is off over them")

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 (n,) table of each global row and its row in that table."""
        t = np.searchsorted(self.ends, rows, side="right")
        return t, rows - self.starts[t]

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Record new bytes of ``rows`` (int64 (n,) unique global rows; uint8
        (n, row_bytes)) in the overlay: every later fetch sees them."""
        self.overlay.merge(rows.cpu().numpy(), data.cpu().numpy())

    def update_rows(self, rows: torch.Tensor, data: torch.Tensor) -> int:
        """:meth:`write` (a cache's name for it); returns 0 (nothing resident)."""
        self.write(rows, data)
        return 0

    def fetch(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 (n, row_bytes) on the CPU: the bytes of ``rows`` (int64 (n,) global
        rows), overlay first."""
        return self._fetch(rows)[0]

    def _fetch(self, rows: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        """:meth:`fetch`, and bool (n,) which rows came from the overlay (None: it is
        empty), so :meth:`lookup` counts them without searching it again."""
        idx = rows.cpu().numpy().astype(np.int64, copy=False)
        out = np.empty((idx.shape[0], self.row_bytes), dtype=np.uint8)
        if not len(self.overlay):
            if idx.size:
                self.read(idx, out)
            return torch.from_numpy(out), None
        found, at = self.overlay.find(idx)
        if found.any():
            out[found] = self.overlay.data[at[found]]
            rest = np.flatnonzero(~found)
            if rest.size:
                out[rest] = self.read(idx[rest])
        elif idx.size:
            self.read(idx, out)
        return torch.from_numpy(out), found

    def read(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def lookup(self, rows: torch.Tensor, counts: torch.Tensor | None = None,
               n_ids: int | None = None) -> torch.Tensor:
        """:meth:`fetch` as the top of a stack: ``rows`` distinct, ``counts`` their ids."""
        t0 = time.perf_counter()
        out, found = self._fetch(rows)
        n = rows.numel()
        self.clock.observe(time.perf_counter() - t0, n)
        self.ids += n_ids if n_ids is not None else (
            int(counts.sum()) if counts is not None else n)
        if found is not None and n:
            self.overlay_ids += (int(counts.cpu().numpy()[found].sum()) if counts is not None
                                 else int(found.sum()))
        return out

    def close(self) -> None:
        return None


class DiskRows(_FileLevel):
    """The rows of a version's table files, read with ``os.pread`` (``TableFiles.fd``).

    A fetch reads the distinct rows missing from the overlay, one ``preadv`` per row
    straight into the result, split over a pool of ``threads`` threads (the GIL is
    released in each read, so up to ``threads`` reads are in flight); a table of
    narrower rows fills the first bytes of its rows and the rest is zero. The mapping is
    never touched. Thread-safe for reads; :meth:`write` between batches.

    Args:
        files: the open table files (kept open by the caller).
        threads: reads in flight at most (1..256).
    """

    def __init__(self, files: TableFiles, threads: int = DISK_READ_THREADS) -> None:
        super().__init__([t.rows for t in files.tables], [t.row_bytes for t in files.tables])
        if not 1 <= threads <= 256:
            raise ConfigError(f"disk_read_threads {threads} must be in 1..256 (reads in "
                              "flight per worker)")
        self.files = files
        self.threads = threads
        self.fds = np.asarray([files.fd(i) for i in range(len(files.tables))], dtype=np.int64)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        #: rows read from the files so far.
        self.read_rows = 0

    def read(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 (n, row_bytes): ``rows`` (int64 (n,) global rows) read from the files.

        Raises:
            ArtifactError: a file is shorter than its manifest says.
        """
        n = int(rows.shape[0])
        if out is None:
            out = np.empty((n, self.row_bytes), dtype=np.uint8)
        t, local = self.locate(rows)
        widths = self.widths[t]
        if (widths != self.row_bytes).any():
            out.fill(0)
        args = (self.fds[t].tolist(), (local * widths).tolist(), widths.tolist(),
                out.reshape(-1).data, self.row_bytes)
        tasks = min(self.threads, max(1, n // _MIN_ROWS_PER_TASK))
        if tasks == 1:
            _read_span(*args, 0, n)
        else:
            bounds = [n * k // tasks for k in range(tasks + 1)]
            pool = self._executor()
            for f in [pool.submit(_read_span, *args, lo, hi)
                      for lo, hi in itertools.pairwise(bounds)]:
                f.result()
        self.read_rows += n
        self.read_bytes += int(widths.sum())
        return out

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dlrm-pread")
            return self._pool

    def close(self) -> None:
        """Stop the read threads (idempotent); the files stay open (the caller's)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _read_span(fds: list[int], offsets: list[int], widths: list[int], out: memoryview,
               rb: int, lo: int, hi: int) -> None:
    """Read rows ``lo..hi`` of a fetch: row j from ``fds[j]`` at ``offsets[j]``,
    ``widths[j]`` bytes, into ``out[j * rb : j * rb + widths[j]]``."""
    preadv = os.preadv
    for j in range(lo, hi):
        w = widths[j]
        got = preadv(fds[j], [out[j * rb : j * rb + w]], offsets[j])
        if got != w:
            raise ArtifactError(f"table file (fd {fds[j]}): read {got} of {w} bytes at "
                                f"offset {offsets[j]}; the file is shorter than its "
                                "manifest: the version is damaged, rebuild or re-import it")


class MappedRows(_FileLevel):
    """The rows of the copy-on-write mapped table files (``Artifact.tables[i].data``):
    the unbounded mode. Nothing is copied: a fetch gathers from the mappings (page faults
    fill the page cache, whose pages every worker of the pod shares) and pads narrower
    rows; deltas go to the overlay, never into the mapping.

    Args:
        tables: uint8 (rows_t, row_bytes_t) per table, CPU (mapped).
    """

    def __init__(self, tables: list[torch.Tensor]) -> None:
        super().__init__([int(t.shape[0]) for t in tables], [int(t.shape[1]) for t in tables])
        self.tables = tables
        #: bytes of the mapped files (the tier's capacity: all of them).
        self.file_bytes = sum(t.numel() for t in tables)

    def read(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        n = int(rows.shape[0])
        if out is None:
            out = np.empty((n, self.row_bytes), dtype=np.uint8)
        t, local = self.locate(rows)
        res = torch.from_numpy(out)
        for i in np.unique(t).tolist():
            at = np.flatnonzero(t == i)
            w = int(self.widths[i])
            got = self.tables[i].index_select(0, torch.from_numpy(local[at]))
            dst = torch.from_numpy(at)
            if w < self.row_bytes:
                res.index_copy_(0, dst, torch.nn.functional.pad(got, (0, self.row_bytes - w)))
            else:
                res.index_copy_(0, dst, got)
        return out
