"""The table tiers of a version whose tables are on disk: device cache -> host memory
(bounded) -> local disk (the version's table files), exact at every budget.

Shapes: R rows of all tables (global rows), rb the widest table's row width, U distinct
rows of a batch.

A stack, top first, each tier reading its misses from the one below:

* **device** (optional): an :class:`serve.runtime.cache.EmbeddingCache` on the device
  (CUDA always; on CPU only with ``cache_on_cpu``), its capacity by
  ``cache_load_factor`` / ``cache_bytes`` as before. Over disk-backed rows its misses
  come from the host tier (:class:`OnDevice`); the fixed-shape CUDA-graph path
  (``miss_path="mapped"``) needs a full pinned host table, so it is off here.
* **host**: bounded by ``host_cache_bytes`` (or ``host_cache_fraction`` of the table
  bytes), **per worker**: each TorchServe worker is its own process with its own host
  tier, so a pod holds workers x the budget (plus 4 bytes per table row per worker for
  the row -> slot map, 8 with LFU's counts). The budget buys ``budget // rb`` slots of
  the widest row (narrower rows padded) in an :class:`EmbeddingCache` on the CPU
  (policy lru or lfu, as the device cache's) over the disk source below. Budget 0: no
  slots, every lookup reads the files. Budget None: no bound and no host slots: rows are
  served straight from the copy-on-write mapped files (:class:`MappedRows`, the page
  cache's pages shared by every worker): the "all in memory" mode.
* **disk**: :class:`serve.runtime.rowsource.DiskRows`: ``os.pread`` from a thread pool,
  never through the mapping.

Deltas: :meth:`RowTiers.update_rows` writes the new bytes into the disk source's
overlay (per worker, in memory; see :class:`serve.runtime.rowsource.Overlay` for its
cost and when to fold it into a new version) and overwrites the copies resident in the
host and device tiers, so the next batch is exact. The table files are never written.

Building the stack reads no row (the identity of the tables is their manifest's).
"""
from __future__ import annotations

import dataclasses

import torch

from serve.errors import ConfigError
from serve.runtime.cache import EmbeddingCache
from serve.runtime.rowsource import DiskRows, MappedRows, TierCounters
from serve.store.tablefiles import TableFiles

__all__ = ["OnDevice", "RowTiers", "host_capacity"]


def host_capacity(total_rows: int, row_bytes: int, table_bytes: int, *,
                  host_bytes: int | None, host_fraction: float | None) -> int | None:
    """Host tier slots: ``host_bytes // row_bytes``, or ``host_fraction`` of the table
    bytes // row_bytes; at most ``total_rows``; None: no bound (serve the mapped files).

    Raises:
        ConfigError: both set.
    """
    if host_bytes is not None and host_fraction is not None:
        raise ConfigError(f"host_cache_bytes={host_bytes} and host_cache_fraction="
                          f"{host_fraction} are both set; give one of the two")
    if host_fraction is not None:
        host_bytes = int(host_fraction * table_bytes)
    if host_bytes is None:
        return None
    return min(total_rows, host_bytes // row_bytes)


class OnDevice:
    """A tier below seen by the device cache above it (its row source): fetches go to
    the tier's ``lookup`` (one id per row) and land on ``device``; writes go to its
    ``update_rows``.

    Args:
        level: an :class:`EmbeddingCache` on the CPU, or a file source (DiskRows,
            MappedRows): ``lookup(rows) -> uint8 (n, rb)`` on the CPU.
        device: where the device cache lives.
    """

    def __init__(self, level: EmbeddingCache | DiskRows | MappedRows,
                 device: torch.device) -> None:
        self.level = level
        self.device = device
        self.row_bytes = int(level.row_bytes)
        self.total_rows = int(level.total_rows)

    pinned_bytes = 0
    device_readable = False

    @property
    def nbytes(self) -> int:
        return 0   # the tier below reports its own bytes

    def source(self) -> torch.Tensor:
        raise RuntimeError("the rows below this device cache are not readable by the "
                           "device; the fixed-shape cache path is off over them")

    def fetch(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 (n, rb) on the device: ``rows`` (distinct global rows) from below."""
        got = self.level.lookup(rows.cpu())
        return got.to(self.device, non_blocking=False)

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        self.level.update_rows(rows.cpu(), data.cpu())

    def close(self) -> None:
        self.level.close()


class RowTiers:
    """The tiers of disk-backed tables (module docstring): device cache (optional) ->
    host tier -> disk, and their counters.

    Args:
        files: the version's open table files; ``mapped``: their mapped arrays, uint8
            (rows_t, row_bytes_t) per table (``Artifact.tables[i].data``).
        device: the runtime's device.
        device_capacity: device cache slots (None: no device tier; CPU without
            ``cache_on_cpu``).
        host_bytes, host_fraction: the host tier's budget per worker (one of the two, or
            neither: no bound, serve the mapped files).
        policy, lfu_decay_every: both caches' policy settings.
        threads: disk reads in flight (``DiskRows``).
    """

    def __init__(self, files: TableFiles, mapped: list[torch.Tensor], device: torch.device,
                 *, device_capacity: int | None, host_bytes: int | None,
                 host_fraction: float | None, policy: str, lfu_decay_every: int | None,
                 threads: int) -> None:
        rb = max(t.row_bytes for t in files.tables)
        total = sum(t.rows for t in files.tables)
        cap = host_capacity(total, rb, files.nbytes, host_bytes=host_bytes,
                            host_fraction=host_fraction)
        self.row_bytes, self.total_rows = rb, total
        self.bottom: DiskRows | MappedRows = (MappedRows(mapped) if cap is None
                                              else DiskRows(files, threads))
        self.host: EmbeddingCache | None = (
            EmbeddingCache(self.bottom, cap, policy, "cpu", lfu_decay_every=lfu_decay_every)
            if cap else None)
        level = self.host if self.host is not None else self.bottom
        self.device_cache: EmbeddingCache | None = (
            EmbeddingCache(OnDevice(level, device), device_capacity, policy, device,
                           lfu_decay_every=lfu_decay_every)
            if device_capacity is not None else None)
        self.top = self.device_cache if self.device_cache is not None else level

    def lookup(self, rows: torch.Tensor, counts: torch.Tensor, n_ids: int) -> torch.Tensor:
        """uint8 (U, rb) on the device: the bytes of ``rows`` (int64 (U,) distinct global
        rows on the device; ``counts`` their ids in the batch, ``n_ids`` their sum)."""
        return self.top.lookup(rows, counts, n_ids=n_ids)

    def update_rows(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """New bytes of ``rows`` (int64 (n,) unique global rows; uint8 (n, rb)): into
        the overlay and every resident copy (the top's update reaches every tier below)."""
        self.top.update_rows(rows, data)

    @property
    def device_bytes(self) -> int:
        return self.device_cache.device_bytes if self.device_cache is not None else 0

    @property
    def host_bytes(self) -> int:
        """Host bytes of this worker's own: host slots and their index, the overlay."""
        own = self.bottom.nbytes
        if self.host is not None:
            own += self.host.device_bytes   # the host tier's "device" is the CPU
        return own

    def counters(self) -> dict[str, TierCounters]:
        """Each tier's cumulative counters, ``{"device": ..., "host": ...}`` (a tier that
        is not there: zeros)."""
        dev = TierCounters()
        if self.device_cache is not None:
            c, clock = self.device_cache.counters, self.device_cache.clock
            dev = clock.counters(c.lookups, c.hits, clock.rows * self.row_bytes,
                                 self.device_cache.capacity * self.row_bytes)
        b = self.bottom
        if self.host is not None:
            c = self.host.counters
            host = self.host.clock.counters(c.lookups, c.hits, b.read_bytes,
                                            self.host.capacity * self.row_bytes)
        elif isinstance(b, DiskRows):   # budget 0: hits are the overlay's rows
            host = b.clock.counters(b.ids, b.overlay_ids, b.read_bytes, 0)
        else:                           # no bound: every row is in (mapped) memory
            host = TierCounters(b.ids, b.ids, capacity_bytes=b.file_bytes)
        if isinstance(b, DiskRows):     # rows read from the files, whoever asked
            host = dataclasses.replace(host, miss_rows=b.read_rows)
        return {"device": dev, "host": host}

    def close(self) -> None:
        """Stop the read threads (idempotent)."""
        if self.device_cache is not None:
            self.device_cache.close()
        elif self.host is not None:
            self.host.close()
        self.bottom.close()
