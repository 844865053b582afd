"""The table store: where a model's embedding rows live, and the pooled embeddings of a batch.

Shapes: B batch, F sparse features, D embedding dim (D_g of one feature group), R rows of
all tables concatenated, nnz ids of a batch, U distinct global rows among them.

The runtime asks :meth:`TableStore.embed` for the pooled embeddings of a batch and gets
them; where the rows come from is the store's business:

* every row on the device (one uint8 (R, row_bytes) table; on CPU possibly the pod-wide
  shared copy, :mod:`serve.runtime.shared`): a direct gather of the nnz rows;
* or an :class:`serve.runtime.cache.EmbeddingCache` (hot rows on the device, all rows
  in host memory): ``torch.unique`` -> the cache's U rows -> dequantize once -> pool.
* or, when the version's tables are on disk (``Artifact.files``), the tiers of
  :mod:`serve.runtime.tiers` (device cache -> bounded host tier -> ``pread`` from the
  table files; deltas in a per-worker overlay): ``torch.unique`` -> the top tier's U
  rows -> dequantize once -> pool. No table is copied and no row read at load.

Ids become global rows through :class:`serve.runtime.rowmap.RowMapper` (modulo tables,
the managed tables' id maps). The store's counters (lookups, hits, the cache's misses
and evictions, wrapped and fallback ids) are its metrics: :meth:`TableStore.counts`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serve.errors import ConfigError
from serve.rowformat import row_bytes
from serve.runtime.artifact import Artifact, dequantize_rows
from serve.runtime.cache import EmbeddingCache, capacity_for
from serve.runtime.hostmem import device_guard, page_exclusive_empty
from serve.runtime.idmap import MapIndex
from serve.runtime.rowmap import FeatureGroup, RowMapper
from serve.runtime.rowsource import DISK_READ_THREADS, TierCounters
from serve.runtime.shared import IdRegion, SharedTables
from serve.runtime.tiers import RowTiers

__all__ = ["StoreCounts", "TableStore", "TierSettings"]


@dataclass(frozen=True)
class StoreCounts:
    """Cumulative counters of a store (see ``serve.runtime.engine.RuntimeStats``)."""

    lookups: int
    hits: int
    misses: int
    evictions: int
    device_bytes: int
    host_bytes: int
    wrapped: tuple[int, ...]
    fallback: tuple[int, ...]
    tiers: dict[str, TierCounters]


def _concat_rows(tables: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the tables, one after the other, into ``out`` (R, row_bytes) and return it:
    one copy per table straight into its destination, no intermediate. A table of narrower
    rows (another dim or dtype) fills the first bytes of its rows; the rest stays zero."""
    lo = 0
    for t in tables:
        dst = out[lo : lo + t.shape[0]]
        if t.shape[1] < out.shape[1]:
            dst[:, t.shape[1]:].zero_()
            dst = dst[:, : t.shape[1]]
        dst.copy_(t)
        lo += t.shape[0]
    return out


def _widen(tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tables of mixed row widths as tables of the widest rows (zero-padded copies of the
    narrower ones; tables already that wide are passed through, not copied)."""
    rb = max(int(t.shape[1]) for t in tables)
    return [t if t.shape[1] == rb else _concat_rows([t], torch.empty((t.shape[0], rb),
                                                                     dtype=torch.uint8))
            for t in tables]


_Placed = tuple[EmbeddingCache | None, torch.Tensor | None, SharedTables | None, MapIndex]


@dataclass(frozen=True)
class TierSettings:
    """The host tier's settings over disk-backed tables (``RuntimeConfig`` documents
    them): a budget per worker in bytes or as a fraction of the table bytes (neither: no
    bound, serve the mapped files), and the disk reads in flight."""

    host_bytes: int | None = None
    host_fraction: float | None = None
    threads: int = DISK_READ_THREADS


def _fresh_maps(artifact: Artifact, device: torch.device) -> MapIndex:
    """The managed tables' id maps in a region of their own (on the device)."""
    schema = artifact.schema
    managed = {i: t.rows for i, t in enumerate(schema.tables) if t.mapping == "managed"}
    fallback_rows = {i: schema.tables[i].fallback_rows for i in managed}
    # built on the host; on CUDA only its region is used (copied to the device, probed
    # there with tensor ops), so it needs no compiled probe
    maps = MapIndex(managed, fallback=fallback_rows,
                    probe="auto" if device.type == "cpu" else "ops")
    for i in managed:
        maps.write(i, artifact.id_maps[schema.tables[i].name])
    if device.type != "cpu":
        maps = MapIndex(managed, maps.region.to(device), fallback=fallback_rows)
    return maps


def _place_tiers(artifact: Artifact, device: torch.device, tiers: TierSettings, *,
                 load_factor: float | None, cache_bytes: int | None, cache_on_cpu: bool,
                 policy: str, lfu_decay_every: int | None) -> RowTiers:
    """The tiers of disk-backed tables (``artifact.files``; serve.runtime.tiers): a
    device cache on CUDA (or on CPU with ``cache_on_cpu``) over the host tier over the
    files. Reads no row."""
    files = artifact.files
    if files is None:
        raise RuntimeError("_place_tiers needs an artifact whose tables are on disk")
    total = sum(t.rows for t in artifact.tables)
    rb = max(int(t.data.shape[1]) for t in artifact.tables)
    use_device = cache_on_cpu or device.type != "cpu"
    cap = (capacity_for(total, rb, load_factor=load_factor, cache_bytes=cache_bytes)
           if use_device else None)
    return RowTiers(files, [t.data for t in artifact.tables], device, device_capacity=cap,
                    host_bytes=tiers.host_bytes, host_fraction=tiers.host_fraction,
                    policy=policy, lfu_decay_every=lfu_decay_every, threads=tiers.threads)


def _place_rows(artifact: Artifact, device: torch.device, shared: SharedTables | None, *,
                load_factor: float | None, cache_bytes: int | None, cache_on_cpu: bool,
                policy: str, miss_path: str, lfu_decay_every: int | None) -> _Placed:
    """``(cache, None, None, maps)`` when the rows are served through a cache (hot rows on
    the device, all in host memory), else ``(None, table, shared or None, maps)`` with
    every row on the device; ``maps``: the managed tables' id maps, where they are served.

    The tables (memory-mapped when loaded from a file) are copied once, straight into
    the memory that serves them: the device table, or the host table in memory of its
    own pages that the cache page-locks in place (exactly its bytes, no second copy).
    Tables of different row widths are stored at the widest (narrower rows padded).
    """
    schema = artifact.schema
    tables = [t.data for t in artifact.tables]
    total = sum(t.rows for t in artifact.tables)
    rb = max(int(t.shape[1]) for t in tables)
    cap = capacity_for(total, rb, load_factor=load_factor, cache_bytes=cache_bytes)
    use_cache = cache_on_cpu if device.type == "cpu" else cap < total
    managed = {i: t.rows for i, t in enumerate(schema.tables) if t.mapping == "managed"}
    fallback_rows = {i: schema.tables[i].fallback_rows for i in managed}
    # The managed tables' maps: written into a region of their own here (on the
    # device), or, with the pod-wide shared tables, into the shared file beside them.
    id_maps = {i: artifact.id_maps[schema.tables[i].name] for i in managed}

    def fresh_maps() -> MapIndex:
        return _fresh_maps(artifact, torch.device("cpu"))

    if not use_cache and device.type == "cpu" and shared is not None:
        # One copy for every worker of the pod (serve.runtime.shared); the region is
        # built (every id hashed) only by the worker that writes the file.
        region = (IdRegion(MapIndex.size(managed), MapIndex.identity(managed, id_maps),
                           lambda: fresh_maps().region) if managed else None)
        table = shared.open(_widen(tables), region)
        return None, table, shared, (MapIndex(managed, shared.id_region, fallback=fallback_rows)
                                     if shared.id_region is not None else fresh_maps())
    maps = _fresh_maps(artifact, device)
    if not use_cache:
        if (device.type == "cpu" and len(tables) == 1 and tables[0].is_contiguous()
                and tables[0].shape[1] == rb):
            return None, tables[0], None, maps
        return None, _concat_rows(tables, torch.empty((total, rb), dtype=torch.uint8,
                                                      device=device)), None, maps
    host = _concat_rows(tables, page_exclusive_empty(total, rb))
    return EmbeddingCache(host, cap, policy, device, miss_path=miss_path,
                          lfu_decay_every=lfu_decay_every), None, None, maps


class TableStore:
    """A model's embedding tables on one device, and the pooled embeddings of a batch.

    Build it under ``device_guard(device)`` (the runtime does). Not thread-safe: one
    caller at a time, like the runtime.

    Args:
        artifact: the model (its tables are copied once, into the memory that serves them).
        device: where the rows are served (the cache's slots when there is one).
        shared: on CPU without a cache, serve the rows from this pod-wide shared copy
            (ignored when the tables are on disk, ``artifact.files``: each worker then
            serves them through its own tiers, deltas in its own overlay).
        tiers: the host tier's settings when the tables are on disk (default: no bound).
        load_factor, cache_bytes, cache_on_cpu, policy, miss_path, lfu_decay_every: the
            cache's settings (``serve.runtime.engine.RuntimeConfig`` documents them).
    """

    def __init__(self, artifact: Artifact, device: torch.device,
                 shared: SharedTables | None = None, *, load_factor: float | None = 0.2,
                 cache_bytes: int | None = None, cache_on_cpu: bool = False,
                 policy: str = "lru", miss_path: str = "host",
                 lfu_decay_every: int | None = None,
                 tiers: TierSettings | None = None) -> None:
        self.device = device
        self.schema = artifact.schema
        #: Rows per table (``schema.tables`` order); a table may serve several features.
        self.table_rows = [t.rows for t in artifact.tables]
        self.total_rows = sum(self.table_rows)
        self._offsets = [0, *itertools.accumulate(self.table_rows[:-1])]
        self.cache: EmbeddingCache | None
        self.table: torch.Tensor | None
        #: The pod-wide shared tables when they serve the rows, else None.
        self.shared: SharedTables | None
        #: The tiers of disk-backed tables (serve.runtime.tiers), else None.
        self.tiers: RowTiers | None = None
        if artifact.files is not None:
            self.tiers = _place_tiers(
                artifact, device, tiers or TierSettings(), load_factor=load_factor,
                cache_bytes=cache_bytes, cache_on_cpu=cache_on_cpu, policy=policy,
                lfu_decay_every=lfu_decay_every)
            self.cache, self.table, self.shared = self.tiers.device_cache, None, None
            maps = _fresh_maps(artifact, device)
        else:
            self.cache, self.table, self.shared, maps = _place_rows(
                artifact, device, shared, load_factor=load_factor, cache_bytes=cache_bytes,
                cache_on_cpu=cache_on_cpu, policy=policy, miss_path=miss_path,
                lfu_decay_every=lfu_decay_every)
        #: Ids -> global rows; owns the managed tables' id maps (deltas change them there).
        self.ids = RowMapper(self.schema, self.table_rows, self._offsets, maps, device)
        self._lookups = self._hits = 0

    @property
    def row_bytes(self) -> int:
        """Bytes per stored row (the artifact's row format, the widest table's)."""
        if self.tiers is not None:
            return self.tiers.row_bytes
        if self.cache is not None:
            return self.cache.row_bytes
        return int(self._table().shape[1])

    def _table(self) -> torch.Tensor:
        if self.table is None:
            raise RuntimeError("no device table: this runtime serves through its cache")
        return self.table

    # -- one batch -----------------------------------------------------------------------
    def embed(self, values: torch.Tensor, lengths: torch.Tensor, b: int,
              bags: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Pooled embeddings on the device, float32: (B, F, D) for a model of one group
        (one dim, dtype and pooling), else (B, sum_f D_f) in feature order.

        Args:
            values: int64 (nnz,) ids, feature-major; lengths: int (F, B) ids per bag.
            bags: feature -> int64 (B,) the sample whose bag each sample reads, for the
                features a request sent once (looked up and pooled once, then copied to
                its samples); None: every sample pools its own bag.
        """
        groups = self.ids.groups
        if self.ids.single:
            return self._embed_group(groups[0], values, lengths, b, bags)
        # Each feature's ids are one slice of the feature-major values.
        bounds = [0, *itertools.accumulate(lengths.sum(1).tolist())]
        parts: list[torch.Tensor | None] = [None] * lengths.shape[0]
        for g in groups:
            vals = torch.cat([values[bounds[f] : bounds[f + 1]] for f in g.features])
            lens = lengths[list(g.features)]
            emb = self._embed_group(g, vals, lens, b, bags)            # (B, F_g, D_g)
            for j, f in enumerate(g.features):
                parts[f] = emb[:, j]
        return torch.cat(parts, dim=1)  # type: ignore[arg-type]

    def _embed_group(self, g: FeatureGroup, values: torch.Tensor, lengths: torch.Tensor,
                     b: int, bags: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """One group's pooled embeddings (B, F_g, D_g) float32 on the device.

        Args:
            values: int64 (nnz_g,) the group's ids, feature-major; lengths: (F_g, B).
            bags: as :meth:`embed` (keys: feature indices of the whole schema).
        """
        read = None
        if bags:
            # (F_g, B): the sample whose cell each (feature, sample) reads
            read = torch.arange(b).repeat(len(g.features), 1)
            for j, f in enumerate(g.features):
                if f in bags:
                    read[j] = bags[f]
        return self._pool_group(g, values, lengths, b, read).transpose(0, 1)

    def _pool_group(self, g: FeatureGroup, values: torch.Tensor, lengths: torch.Tensor,
                    b: int, read: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_embed_group` as (F_g, B, D_g); ``read`` (F_g, B): the sample whose bag
        each cell reads (None: its own). A shared bag is looked up and pooled once and its
        pooled row copied to the cells that read it: the same bits they would get from
        their own copy of the ids (one id per bag: the row itself, else the same bag)."""
        nf, d = len(g.features), g.dim
        at = None   # one-hot with shared bags: where each cell's one id is among the ids
        if read is None:
            one_hot = values.numel() == nf * b and bool((lengths == 1).all())
        else:
            # one id in every cell read (the borrowing cells are empty, checked upstream)
            one_hot = bool((lengths.gather(1, read) == 1).all())
            if one_hot:
                flat = lengths.reshape(-1).long()
                starts = torch.cumsum(flat, 0) - flat
                at = starts.view(nf, b).gather(1, read).reshape(-1)
        rows = self.ids.global_rows(g, values, lengths, one_hot and at is None)
        serve = self.tiers if self.tiers is not None else self.cache
        if serve is None:
            emb = self._dequantize(g, self._table().index_select(0, rows))   # (nnz, D)
            self._hits += rows.numel()
            bag_index = None
        else:
            uniq, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
            emb = self._dequantize(g, serve.lookup(uniq, counts, n_ids=rows.numel()))
            bag_index = inverse                                             # emb: (U, D)
        self._lookups += rows.numel()
        if at is not None:  # each cell's row is its read cell's one id
            at = at.to(emb.device)
            if bag_index is not None:
                at = bag_index.index_select(0, at)
            return emb.index_select(0, at).view(nf, b, d)
        if one_hot:   # one id per bag: the pooled value is the row (sum and mean alike)
            if bag_index is not None:
                emb = emb.index_select(0, bag_index)
            return emb.view(nf, b, d)
        offsets = torch.zeros(nf * b + 1, dtype=torch.int64)
        torch.cumsum(lengths.reshape(-1).long(), 0, out=offsets[1:])
        if bag_index is None:
            bag_index = torch.arange(rows.numel(), device=self.device)
        pooled = F.embedding_bag(bag_index, emb, offsets.to(self.device), mode=g.mode,
                                 include_last_offset=True)                      # (F*B, D)
        pooled = pooled.view(nf, b, d)
        if read is not None:
            # the same pooled bits the bag's own sample got: exact by construction
            flat = (torch.arange(nf).unsqueeze(1) * b + read).reshape(-1).to(pooled.device)
            pooled = pooled.reshape(nf * b, d).index_select(0, flat).view(nf, b, d)
        return pooled

    @staticmethod
    def _dequantize(g: FeatureGroup, rows: torch.Tensor) -> torch.Tensor:
        """uint8 (n, row_bytes) -> float32 (n, D), the same arithmetic as
        ``serve.runtime.artifact.dequantize_rows`` (q * scale + bias), written into the
        group's reused buffer: fresh multi-MB tensors per call cost page faults that
        dominated batch 4096 on CPU (measured 89 ms vs a few ms)."""
        if g.dtype != "int8":
            return dequantize_rows(rows, g.dtype, g.dim)
        n, d = rows.shape[0], g.dim
        if g.scratch is None or g.scratch.shape[0] < n:
            with torch.inference_mode(False):  # a normal tensor: writable in and out of it
                g.scratch = torch.empty((max(n, 1024), d), dtype=torch.float32,
                                        device=rows.device)
        out = g.scratch[:n]
        out.copy_(rows[:, 4 : 4 + d])                                  # uint8 -> float32
        sb = rows[:, :4].contiguous().view(torch.float16).float()      # (n, 2) scale, bias
        # (A mixed uint8 * float32 mul into `out` measured 25% slower than copy + mul_.)
        return out.mul_(sb[:, 0:1]).add_(sb[:, 1:2])

    # -- the fixed-shape path (CUDA graphs) ----------------------------------------------
    def static_ok(self, n: int) -> bool:
        """Whether :meth:`embed_static` may serve a one-hot batch of ``n`` ids: one group,
        no managed table, tables in memory (not on disk), and a cache (if any) whose
        fixed-shape lookup takes ``n``."""
        return (self.ids.single and not self.ids.managed and self.tiers is None
                and (self.cache is None or self.cache.static_ok(n)))

    def static_positions(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 (F * B,) rows and offsets of each position of a one-hot batch of ``b``."""
        g = self.ids.groups[0]
        return g.rows_d.repeat_interleave(b), g.offsets_d.repeat_interleave(b)

    def embed_static(self, vals: torch.Tensor, rows_rep: torch.Tensor,
                     offs_rep: torch.Tensor, b: int) -> torch.Tensor:
        """:meth:`embed` of a one-hot batch with no host sync (CUDA-graph capturable):
        ``vals`` int64 (F * B,) on the device; (B, F, D) float32. Counters: the cache's
        count inside; the rest by :meth:`count_static` outside the graph."""
        g = self.ids.groups[0]
        rows = vals % rows_rep + offs_rep
        raw = (self._table().index_select(0, rows) if self.cache is None
               else self.cache.lookup_static(rows))
        emb = dequantize_rows(raw, g.dtype, g.dim)  # fresh tensors: they live in the graph pool
        return emb.view(len(g.features), b, g.dim).transpose(0, 1)

    def count_static(self, values: torch.Tensor) -> None:
        """Count a batch :meth:`embed_static` served (``values``: its ids on the host)."""
        self.ids.count_wrapped_host(values)
        if self.cache is None:   # the cache counts its own lookups inside the graph
            n = values.numel()
            self._lookups += n
            self._hits += n

    # -- deltas --------------------------------------------------------------------------
    def check_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """What :meth:`update_rows` would write, checked and nothing written: ``rows`` as
        stored (uint8 (n, row_bytes), zero-padded to the widest table's width).

        Raises:
            ConfigError: a table index, a row shape or dtype, or an id out of range.
        """
        if not 0 <= table < len(self.table_rows):
            raise ConfigError(f"table {table} is not in 0..{len(self.table_rows) - 1}")
        n = int(ids.shape[0])
        if n == 0:
            return rows
        rb = self.row_bytes
        spec = self.schema.tables[table]
        own = row_bytes(spec.dtype, spec.dim)
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != n \
                or rows.shape[1] not in (own, rb):
            raise ConfigError(f"rows must be uint8 ({n}, {own}) (table {spec.name}: "
                              f"{spec.dtype}, dim {spec.dim}), got {rows.dtype} "
                              f"{tuple(rows.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.table_rows[table]:
            raise ConfigError(f"ids must be in 0..{self.table_rows[table] - 1} for table "
                              f"{self.schema.tables[table].name}")
        if rows.shape[1] != rb:   # stored at the widest table's width, zero-padded
            rows = torch.cat((rows, torch.zeros((n, rb - own), dtype=torch.uint8)), dim=1)
        return rows

    def update_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite rows of one table: host rows and, with a cache, the copies resident on
        the device (``serve.runtime.engine.Runtime.update_rows`` documents the arguments)."""
        rows = self.check_rows(table, ids, rows)
        if int(ids.shape[0]) == 0:
            return
        g = ids.to(torch.int64) + self._offsets[table]
        with device_guard(self.device):
            if self.tiers is not None:
                self.tiers.update_rows(g, rows)
            elif self.cache is not None:
                self.cache.update_rows(g, rows)
            else:
                t = self._table()
                t.index_copy_(0, g.to(t.device), rows.to(t.device))

    # -- metrics -------------------------------------------------------------------------
    def counts(self) -> StoreCounts:
        """A snapshot of the cumulative counters (one device sync with a cache)."""
        if self.tiers is not None:
            tiers = self.tiers.counters()
            top = tiers["device"] if self.tiers.device_cache is not None else tiers["host"]
            ev = self.cache.counters.evictions if self.cache is not None else 0
            return StoreCounts(top.lookups, top.hits, top.misses, ev, self.tiers.device_bytes,
                               self.tiers.host_bytes, self.ids.wrapped(), self.ids.fallback(),
                               tiers)
        if self.cache is not None:
            c = self.cache.counters
            lookups, hits, misses, ev = c.lookups, c.hits, c.misses, c.evictions
            dev_b, host_b = self.cache.device_bytes, self.cache.host_bytes
        else:
            lookups, hits, misses, ev = self._lookups, self._hits, 0, 0
            dev_b, host_b = self._table().numel(), 0
        return StoreCounts(lookups, hits, misses, ev, dev_b, host_b, self.ids.wrapped(),
                           self.ids.fallback(), self._memory_tiers())

    def _memory_tiers(self) -> dict[str, TierCounters]:
        """The tier counters of tables in memory: the device cache over the full host
        table; or every row resident (on CPU: the "host" tier, on CUDA: "device")."""
        if self.cache is not None:
            c, clock = self.cache.counters, self.cache.clock
            rb = self.cache.row_bytes
            dev = clock.counters(c.lookups, c.hits, clock.rows * rb, self.cache.capacity * rb)
            host = TierCounters(clock.rows, clock.rows, capacity_bytes=self.cache.host_bytes)
            return {"device": dev, "host": host}
        every = TierCounters(self._lookups, self._hits, capacity_bytes=self._table().numel())
        if self.device.type == "cpu":
            return {"device": TierCounters(), "host": every}
        return {"device": every, "host": TierCounters()}

    def close(self) -> None:
        """Unregister the cache's page-locked host table, stop the tiers' disk readers
        (idempotent)."""
        if self.tiers is not None:
            self.tiers.close()
        elif self.cache is not None:
            self.cache.close()
