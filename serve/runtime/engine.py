"""The serving runtime: a quantized DLRM artifact served with stock PyTorch.

Shapes: B batch, F sparse features (26), D embedding dim, N dense features (13),
nnz = number of sparse ids in a batch, U = distinct global rows among them.

Pipeline of one ``predict``:

1. validate the inputs on the host (negative ids -> ``InvalidInput`` naming the feature);
2. global row = table offset + the table's row of the id: ``id % rows`` for a modulo
   table (ids >= rows wrap, documented rule), the version's id map for a managed one
   (:mod:`serve.runtime.idmap`: admitted ids own a row, every other id reads the
   fallback row 0, counted per feature in ``RuntimeStats.fallback``);
3. embedding: either a direct gather from the tables on the device (no cache: every row
   resident), or ``torch.unique`` -> :class:`serve.runtime.cache.EmbeddingCache` (hot rows on the
   device, all rows pinned in host memory) -> dequantize the U rows once -> pool;
4. dense part (:class:`serve.runtime.dense.DenseDLRM`, as TorchRec's DLRM) -> sigmoid.

When the cache is used: on CUDA whenever its capacity is below the table rows; on CPU
only with ``cache_on_cpu=True``, because there device memory *is* host memory and the
cache would only cost time (the tests turn it on to cover its logic on CPU).

A batch above ``max_forward_instances`` samples is split into consecutive chunks of at
most that many, one forward each, and the probabilities are concatenated: the buffers
that grow with a forward (the dequantization scratch, the cache's miss gather, the
allocator's blocks) stay bounded by the cap, not by the largest TorchServe batch.
On CPU the chunks give the same probabilities as one forward up to float rounding: each
sample's arithmetic is the same, but MKL picks its GEMM kernel and blocking by the batch
height, which can change the summation order of a dot product (measured: at most a few
float32 ulp, see tests/test_runtime.py).

Every CUDA call of a runtime (tables and cache set-up, predict, graph capture and replay,
staging copies and their events) runs under ``torch.cuda.device(self.device)``, so a
runtime on ``cuda:1`` uses cuda:1's current stream whatever device is current.

Example::

    rt = Runtime.from_artifact("build/small/artifact.pt", RuntimeConfig(device="cuda"))
    probs = rt.predict(dense, SparseBatch(values, lengths))   # (B,) float32 on CPU
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from serve.common.validate import number_in_range, positive_int
from serve.constants import STAGES
from serve.errors import ArtifactError, ConfigError, InvalidInput
from serve.rowformat import row_bytes
from serve.runtime.artifact import Artifact, DLRMDense, dequantize_rows, load_artifact
from serve.runtime.cache import (
    MISS_PATHS,
    POLICIES,
    EmbeddingCache,
    capacity_for,
    device_guard,
    page_exclusive_empty,
    resolve_decay_every,
)
from serve.runtime.dense import PRECISIONS, DenseDLRM, ExportedDenseModule, convert_precision
from serve.runtime.idmap import IdMap, MapIndex
from serve.runtime.shared import IdRegion, SharedTables
from serve.schema import ModelSchema

__all__ = ["DEFAULT_MAX_FORWARD_INSTANCES", "STAGES", "Runtime", "RuntimeConfig",
           "RuntimeStats", "SparseBatch"]

log = logging.getLogger(__name__)

#: A captured CUDA graph for one batch size and its buffers: the graph, its static
#: inputs (ids, dense) and output on the device, and the pinned host copies of all three.
_GraphEntry = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor,
                    torch.Tensor, torch.Tensor, torch.Tensor]

#: bf16 on CPU: the dense part runs on a multiple of this many rows (``_dense_forward``),
#: and warm-up builds the kernels of every such size up to ``DENSE_WARM_ROWS`` (two
#: ranking requests of up to 700 pairs each).
DENSE_PAD_ROWS = 64
DENSE_WARM_ROWS = 1408

#: Default cap on samples per forward (``RuntimeConfig.max_forward_instances``): 8192
#: one-hot samples are 213k ids, so the per-forward buffers stay in the tens of MB.
DEFAULT_MAX_FORWARD_INSTANCES = 8192


@dataclass(frozen=True)
class RuntimeConfig:
    """How to serve an artifact.

    Attributes:
        device: "cpu", "cuda" or "cuda:N".
        cache_load_factor: fraction of all table rows kept on the device (0 < x <= 1);
            1.0 keeps every row there (no cache). Ignored when ``cache_bytes`` is set.
        cache_bytes: device bytes for cached row payload (overrides the load factor).
        cache_policy: "lru" or "lfu" (see serve/runtime/cache.py).
        lfu_decay_every: LFU aging: every count is halved after this many sparse ids
            looked up (0 = never; None = ``cache.LFU_DECAY_PER_ROW`` (8) x the table rows,
            the default). Ignored by LRU.
        num_threads: torch intra-op threads for this process (None: leave as is). Set it
            deliberately when several workers share a host: oversubscription costs up to 10x.
        cache_on_cpu: run the cache on CPU too (tests; it only costs time there).
        cache_miss_path: "host" (host gather into pinned memory + one async copy) or
            "mapped" (the GPU reads missed rows straight from the pinned host table;
            opt-in until measured faster on the target GPU; see bench/gpu_check.py).
        dense_precision: "fp32" (exact, default), or the lossy opt-in levers "bf16" and
            "int8" (CPU dynamic quantization of the Linear layers).
        compile: ``torch.compile`` the dense part (same numerics up to float reordering).
        cuda_graphs: on CUDA with one id per feature, replay the whole predict as a CUDA
            graph captured once per batch size (cuts launch overhead at small batches).
            With a cache this needs the LRU policy, ``cache_miss_path="mapped"`` and
            capacity >= 2 x F x B (EmbeddingCache.static_ok); otherwise eager.
        max_forward_instances: most samples in one forward; ``predict`` splits a larger
            batch into chunks of at most this many (default 8192; None = no cap). A
            TorchServe batch can hold batch_size x max_instances samples.
    """

    device: str = "cpu"
    cache_load_factor: float | None = 0.2
    cache_bytes: int | None = None
    cache_policy: str = "lru"
    num_threads: int | None = None
    cache_on_cpu: bool = False
    cache_miss_path: str = "host"
    dense_precision: str = "fp32"
    compile: bool = False
    cuda_graphs: bool = False
    lfu_decay_every: int | None = None
    max_forward_instances: int | None = DEFAULT_MAX_FORWARD_INSTANCES

    def __post_init__(self) -> None:
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device {self.device!r} is not a torch device; use 'cpu', "
                              "'cuda' or 'cuda:N'") from None
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device {self.device!r}: only 'cpu' and 'cuda[:N]' are supported")
        if self.cache_load_factor is not None:
            number_in_range("cache_load_factor", self.cache_load_factor, 0, 1, lo_open=True,
                            then=" (a fraction of all table rows); use 1.0 to keep every row "
                                 "on the device")
        if self.cache_bytes is not None:
            positive_int("cache_bytes", self.cache_bytes)
        if self.cache_policy not in POLICIES:
            raise ConfigError(f"cache_policy {self.cache_policy!r} is not one of {POLICIES}")
        if self.num_threads is not None:
            positive_int("num_threads", self.num_threads)
        if self.cache_miss_path not in MISS_PATHS:
            raise ConfigError(f"cache_miss_path {self.cache_miss_path!r} is not one of "
                              f"{MISS_PATHS}")
        if self.dense_precision not in PRECISIONS:
            raise ConfigError(f"dense_precision {self.dense_precision!r} is not one of "
                              f"{PRECISIONS}")
        resolve_decay_every(self.lfu_decay_every, 1)    # raises ConfigError if malformed
        if self.max_forward_instances is not None:
            positive_int("max_forward_instances", self.max_forward_instances,
                         then=" (samples per forward; larger batches are split), or None "
                              "for no cap")


@dataclass(frozen=True)
class SparseBatch:
    """Sparse ids in KeyedJaggedTensor layout, feature-major.

    Attributes:
        values: int64 (nnz,): feature 0's ids for all B samples, then feature 1's ...
        lengths: int32 (F, B): ids per (feature, sample); 1 everywhere = one-hot.
    """

    values: torch.Tensor
    lengths: torch.Tensor


@dataclass
class RuntimeStats:
    """Cumulative since load.

    ``lookups`` counts sparse ids; ``hits`` those whose row was on the device when the
    batch arrived; ``misses`` those fetched from host memory; ``evictions`` rows pushed
    out of the cache. Without a cache every lookup is a hit. ``device_bytes``: quantized
    rows on the compute device plus the cache's maps; ``host_bytes``: the full host copy
    behind a cache (0 without one). ``stage_seconds``: wall seconds per stage.
    ``forwards``: model forwards (a batch split by ``max_forward_instances`` counts one per
    chunk); ``samples``: samples predicted. ``wrapped``: per feature (``feature_names``
    order), ids that were >= the table's rows and wrapped modulo rows (new ids outgrowing
    a table show up here first; modulo tables only). ``fallback``: per feature, ids of a
    managed table that were not in its id map and read the fallback row (0 for modulo
    tables).
    """

    lookups: int
    hits: int
    misses: int
    evictions: int
    hit_ratio: float
    device_bytes: int
    host_bytes: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    forwards: int = 0
    samples: int = 0
    wrapped: tuple[int, ...] = ()
    fallback: tuple[int, ...] = ()


def _resolve_device(name: str) -> torch.device:
    """The config's device; CUDA must be there, and a bare "cuda" gets its index (streams,
    events and graphs are per device, and the current device may differ at predict)."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; "
                          "use device='cpu'")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_tables(artifact: Artifact) -> None:
    if not artifact.tables:
        raise ArtifactError("artifact has no embedding tables")


@dataclass
class _Group:
    """Features whose tables share a row format (dtype, dim) and a pooling: embedded by one
    gather, one dequantization and one pooling. A model of one dim, dtype and pooling (our
    built-in DLRM) is one group of every feature, in order.

    Tensors on the runtime's device unless ``_h``; F_g = len(features).
    """

    features: tuple[int, ...]       # feature indices, request order
    dtype: str
    dim: int
    mode: str                       # "sum" | "mean" (F.embedding_bag's mode)
    rows_d: torch.Tensor            # int64 (F_g,) rows of each feature's table
    offsets_d: torch.Tensor         # int64 (F_g,) global row of each feature's table
    ids_d: torch.Tensor             # arange(F_g)
    features_d: torch.Tensor        # int64 (F_g,) = features (for per-feature counters)
    rows_h: torch.Tensor            # int64 (F_g, 1) on the host
    modulo_d: torch.Tensor          # int64 (F_g,) 1 where the feature's table is modulo
    managed: tuple[tuple[int, int], ...]   # (j in the group, table) of managed features
    managed_j: torch.Tensor                # int64 (M,) the j of ``managed``
    managed_f: torch.Tensor                # int64 (M,) their feature indices
    managed_tables: tuple[int, ...]        # (M,) their tables
    scratch: torch.Tensor | None = None


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


def _split_batch(dense: torch.Tensor, sparse: SparseBatch,
                 cap: int) -> list[tuple[torch.Tensor, SparseBatch]]:
    """Consecutive chunks of at most ``cap`` samples of a validated batch.

    Args:
        dense: (B, N); sparse: values (nnz,) feature-major, lengths (F, B).
    Returns:
        ``(dense (b, N), SparseBatch(values (nnz_c,), lengths (F, b)))`` per chunk, in
        order; each chunk's values are feature-major again (feature 0's ids of its
        samples, then feature 1's ...).
    """
    lengths = sparse.lengths
    nf, b = lengths.shape
    pos = torch.zeros(nf * b + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1).long(), 0, out=pos[1:])
    starts = list(range(0, b, cap)) + [b]
    # pos[f * B + s]: where (feature f, sample s) starts in values; one small gather for
    # the chunk bounds of every feature: (F, chunks + 1).
    idx = torch.arange(nf).unsqueeze(1) * b + torch.tensor(starts).unsqueeze(0)
    bounds = pos[idx].tolist()
    out = []
    for c, (i, j) in enumerate(itertools.pairwise(starts)):
        values = torch.cat([sparse.values[bounds[f][c] : bounds[f][c + 1]] for f in range(nf)])
        out.append((dense[i:j], SparseBatch(values, lengths[:, i:j].contiguous())))
    return out


class Runtime:
    """Serves one artifact on one device. Not thread-safe: one caller at a time."""

    def __init__(self, artifact: Artifact, config: RuntimeConfig,
                 shared: SharedTables | None = None) -> None:
        self.config = config
        self.shared: SharedTables | None = None   # set by _place_rows when it serves them
        self.device = _resolve_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        _check_tables(artifact)
        with device_guard(self.device):
            self._setup(artifact, config, shared)

    def _setup(self, artifact: Artifact, config: RuntimeConfig,
               shared: SharedTables | None) -> None:
        """Tables or cache, and the dense part, on ``self.device`` (under its guard)."""
        self.schema: ModelSchema = artifact.schema
        self.feature_names: list[str] = list(artifact.feature_names)
        self.num_dense: int = artifact.num_dense
        #: The tables' one dim and dtype, or 0 and "mixed" (then see ``schema.tables``).
        self.dim = artifact.embedding_dim
        self.dtype = artifact.dtype
        #: Rows per table (``schema.tables`` order); a table may serve several features.
        self.table_rows = [t.rows for t in artifact.tables]
        self.total_rows = sum(self.table_rows)
        offsets = [0]
        for r in self.table_rows[:-1]:
            offsets.append(offsets[-1] + r)
        self._offsets = offsets
        dev = self.device
        #: Managed tables (index -> rows); their maps are in ``_map_index`` (_place_rows).
        self._managed: dict[int, int] = {i: t.rows for i, t in enumerate(self.schema.tables)
                                         if t.mapping == "managed"}
        self._fallback_rows = {i: self.schema.tables[i].fallback_rows for i in self._managed}
        ftab = self.schema.feature_tables
        #: Rows of each feature's table (request order).
        self.feature_rows = [self.table_rows[t] for t in ftab]
        self._groups = self._make_groups(ftab, offsets)
        self._single = len(self._groups) == 1
        nf = len(self.feature_names)
        self._wrapped_d = torch.zeros(nf, dtype=torch.int64, device=dev)
        # The CUDA-graph path (one group) counts wrapped ids on the host (the graph wraps
        # them itself); it also uses the one group's per-feature rows and offsets.
        self._wrapped_h = torch.zeros(nf, dtype=torch.int64)
        self._fallback_d = torch.zeros(nf, dtype=torch.int64, device=dev)
        g0 = self._groups[0]
        self._rows_d, self._offsets_d, self._rows_h = g0.rows_d, g0.offsets_d, g0.rows_h
        self.cache: EmbeddingCache | None
        self.table: torch.Tensor | None
        self.cache, self.table = self._place_rows(artifact, config, shared)

        self._dense_dtype = torch.bfloat16 if config.dense_precision == "bf16" else torch.float32
        self.dense: torch.nn.Module
        if isinstance(artifact.dense, DLRMDense):
            dense = DenseDLRM(artifact.dense.dense_arch, artifact.dense.over_arch, nf)
            self.dense = convert_precision(dense.to(dev).eval(), config.dense_precision, dev)
        else:
            if config.dense_precision == "int8":
                raise ConfigError("dense_precision 'int8' applies to the built-in DLRM only; "
                                  "this model's dense part is an exported program: serve it "
                                  "with 'fp32' or 'bf16'")
            self.dense = ExportedDenseModule(artifact.dense.program, dev, config.dense_precision)
        if config.compile:
            self.dense = torch.compile(self.dense, dynamic=True)  # type: ignore[assignment]
        self._graphs: dict[int, _GraphEntry] = {}
        self._capture_stream: torch.cuda.Stream | None = None
        self._lookups = self._hits = 0
        self._stage = {s: 0.0 for s in STAGES}
        self._forwards = self._samples = 0
        log.info("runtime on %s: %d tables, %d features, %d rows, %s rows of %d bytes; %s",
                 dev, len(self.table_rows), nf, self.total_rows, self.dtype,
                 max(t.data.shape[1] for t in artifact.tables),
                 f"cache {self.cache.capacity} slots ({config.cache_policy})" if self.cache
                 else "no cache")

    def _make_groups(self, ftab: tuple[int, ...], offsets: list[int]) -> list[_Group]:
        """One :class:`_Group` per (dtype, dim, pooling), in order of first feature."""
        keyed: dict[tuple[str, int, str], list[int]] = {}
        for f, t in enumerate(ftab):
            spec = self.schema.tables[t]
            keyed.setdefault((spec.dtype, spec.dim, spec.pooling), []).append(f)
        dev = self.device
        groups = []
        for (dtype, dim, pooling), feats in keyed.items():
            rows = [self.table_rows[ftab[f]] for f in feats]
            managed = tuple((j, ftab[f]) for j, f in enumerate(feats) if ftab[f] in self._managed)
            groups.append(_Group(
                tuple(feats), dtype, dim, pooling,
                torch.tensor(rows, dtype=torch.int64, device=dev),
                torch.tensor([offsets[ftab[f]] for f in feats], dtype=torch.int64, device=dev),
                torch.arange(len(feats), device=dev),
                torch.tensor(feats, dtype=torch.int64, device=dev),
                torch.tensor(rows, dtype=torch.int64).unsqueeze(1),
                torch.tensor([0 if ftab[f] in self._managed else 1 for f in feats],
                             dtype=torch.int64, device=dev),
                managed,
                torch.tensor([j for j, _ in managed], dtype=torch.int64, device=dev),
                torch.tensor([feats[j] for j, _ in managed], dtype=torch.int64, device=dev),
                tuple(t for _, t in managed)))
        return groups

    def _place_rows(self, artifact: Artifact, config: RuntimeConfig, shared: SharedTables | None
                    ) -> tuple[EmbeddingCache | None, torch.Tensor | None]:
        """``(cache, None)`` when the rows are served through a cache (hot rows on the
        device, all in host memory), else ``(None, table)`` with every row on the device.

        The tables (memory-mapped when loaded from a file) are copied once, straight into
        the memory that serves them: the device table, or the host table in memory of its
        own pages that the cache page-locks in place (exactly its bytes, no second copy).
        Tables of different row widths are stored at the widest (narrower rows padded).
        """
        tables = [t.data for t in artifact.tables]
        rb = max(int(t.shape[1]) for t in tables)
        cap = capacity_for(self.total_rows, rb, load_factor=config.cache_load_factor,
                           cache_bytes=config.cache_bytes)
        use_cache = (config.cache_on_cpu if self.device.type == "cpu"
                     else cap < self.total_rows)
        # The managed tables' maps: written into a region of their own here (on the
        # device), or, with the pod-wide shared tables, into the shared file beside them.
        id_maps = {i: artifact.id_maps[self.schema.tables[i].name] for i in self._managed}

        def fresh_maps() -> MapIndex:
            # built on the host; on CUDA only its region is used (copied to the device,
            # probed there with tensor ops), so it needs no compiled probe
            maps = MapIndex(self._managed, fallback=self._fallback_rows,
                            probe="auto" if self.device.type == "cpu" else "ops")
            for i, m in id_maps.items():
                maps.write(i, m)
            return maps

        if not use_cache and self.device.type == "cpu" and shared is not None:
            # One copy for every worker of the pod (serve.runtime.shared); the region is
            # built (every id hashed) only by the worker that writes the file.
            self.shared = shared
            region = (IdRegion(MapIndex.size(self._managed),
                               MapIndex.identity(self._managed, id_maps),
                               lambda: fresh_maps().region) if self._managed else None)
            table = shared.open(_widen(tables), region)
            self._map_index = (MapIndex(self._managed, shared.id_region,
                                        fallback=self._fallback_rows)
                               if shared.id_region is not None else fresh_maps())
            return None, table
        maps = fresh_maps()
        self._map_index = (maps if self.device.type == "cpu"
                           else MapIndex(self._managed, maps.region.to(self.device),
                                         fallback=self._fallback_rows))
        if not use_cache:
            if (self.device.type == "cpu" and len(tables) == 1 and tables[0].is_contiguous()
                    and tables[0].shape[1] == rb):
                return None, tables[0]
            return None, _concat_rows(tables, torch.empty((self.total_rows, rb),
                                                          dtype=torch.uint8, device=self.device))
        host = _concat_rows(tables, page_exclusive_empty(self.total_rows, rb))
        return EmbeddingCache(host, cap, config.cache_policy, self.device,
                              miss_path=config.cache_miss_path,
                              lfu_decay_every=config.lfu_decay_every), None

    def close(self) -> None:
        """Release what outlives Python's collector: the captured CUDA graphs (first: a
        graph with the cache step reads the host table on replay), then the cache's
        page-locked host table (``cudaHostUnregister``). Idempotent; a runtime with a
        cache answers no predict afterwards (the cache refuses lookups)."""
        self._graphs.clear()
        if self.cache is not None:
            self.cache.close()

    @classmethod
    def from_artifact(cls, artifact: Artifact | str | os.PathLike[str],
                      config: RuntimeConfig = RuntimeConfig(),
                      shared: SharedTables | None = None) -> Runtime:
        """Load (path: memory-mapped read) and prepare an artifact for ``config.device``.

        ``shared``: on CPU without a cache, serve the rows from this pod-wide shared copy
        instead of a private one (ignored where a cache or a device holds the rows).
        """
        if not isinstance(artifact, Artifact):
            artifact = load_artifact(artifact)
        return cls(artifact, config, shared)

    def update_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite rows of one table (an embedding delta): host rows and, with a cache,
        the copies resident on the device, so the next predict is exact.

        Args:
            table: index in ``schema.tables`` order (every feature reading the table sees
                the new rows).
            ids: int64 (n,) unique row ids in 0..rows-1 of that table.
            rows: uint8 (n, row_bytes(dtype, dim)) in the table's row format (or already
                padded to the stored width, the widest table's, when tables differ).

        Not thread-safe, like predict: call it between batches. With a shared table, the
        caller holds its write lock (serve.runtime.follower does).
        """
        if not 0 <= table < len(self.table_rows):
            raise ConfigError(f"table {table} is not in 0..{len(self.table_rows) - 1}")
        n = int(ids.shape[0])
        if n == 0:
            return
        rb = self.row_bytes
        spec = self.schema.tables[table]
        own = row_bytes(spec.dtype, spec.dim)
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != n \
                or rows.shape[1] not in (own, rb):
            raise ConfigError(f"rows must be uint8 ({n}, {own}) (table {spec.name}: "
                              f"{spec.dtype}, dim {spec.dim}), got {rows.dtype} "
                              f"{tuple(rows.shape)}")
        if rows.shape[1] != rb:   # stored at the widest table's width, zero-padded
            rows = torch.cat((rows, torch.zeros((n, rb - own), dtype=torch.uint8)), dim=1)
        if int(ids.min()) < 0 or int(ids.max()) >= self.table_rows[table]:
            raise ConfigError(f"ids must be in 0..{self.table_rows[table] - 1} for table "
                              f"{self.schema.tables[table].name}")
        g = ids.to(torch.int64) + self._offsets[table]
        with device_guard(self.device):
            if self.cache is not None:
                self.cache.update_rows(g, rows)
            else:
                t = self._table()
                t.index_copy_(0, g.to(t.device), rows.to(t.device))

    def update_ids(self, table: int, assign_ids: torch.Tensor, assign_rows: torch.Tensor,
                   evict_ids: torch.Tensor) -> None:
        """Change a managed table's id map (a delta's admissions and evictions): evicted ids
        read the fallback row from the next predict on, assigned ids their row. The rows'
        bytes come with the same delta (:meth:`update_rows`, which also refreshes the
        device cache's copies), so call both between the same two batches.

        Args:
            table: index in ``schema.tables`` order; the table must be managed.
            assign_ids, assign_rows: int64 (k,) raw ids and their rows in 1..rows-1.
            evict_ids: int64 (e,) raw ids to remove (each must be in the map).
        Raises:
            ConfigError: a modulo table, or a change the map refuses (IdMap.apply).
        """
        self.set_id_map(table, self.changed_id_map(table, assign_ids, assign_rows, evict_ids))

    def changed_id_map(self, table: int, assign_ids: torch.Tensor, assign_rows: torch.Tensor,
                       evict_ids: torch.Tensor) -> IdMap:
        """What :meth:`update_ids` would make the table's map, without changing it (so a
        delta's every change is checked before any is applied)."""
        if table not in self._managed:
            raise ConfigError(f"table {table} is not one of the managed tables "
                              f"{sorted(self._managed)}; only managed tables take id changes")
        return self._map_index.map(table).apply(assign_ids, assign_rows, evict_ids)

    def set_id_map(self, table: int, id_map: IdMap) -> None:
        """Serve ``id_map`` for managed table ``table`` from the next predict on (written in
        place: with the pod-wide shared tables every worker sees it, so one writes it, under
        the shared write lock, like rows)."""
        if table not in self._managed or id_map.table_rows != self.table_rows[table]:
            raise ConfigError(f"table {table} is not a managed table of {id_map.table_rows} "
                              "rows")
        self._map_index.write(table, id_map)

    @property
    def id_maps(self) -> dict[int, IdMap]:
        """The managed tables' maps (table index -> map; views, valid until the next
        change)."""
        return {t: self._map_index.map(t) for t in self._managed}

    @property
    def id_probe(self) -> str | None:
        """How the managed maps are probed (:attr:`serve.runtime.idmap.MapIndex.probe`:
        ``"compiled"`` or ``"ops"``); None without managed tables."""
        return self._map_index.probe if self._managed else None

    @property
    def row_bytes(self) -> int:
        """Bytes per stored row (the artifact's row format)."""
        if self.cache is not None:
            return self.cache.row_bytes
        return int(self._table().shape[1])

    # -- validation ----------------------------------------------------------------------
    def _check(self, dense: torch.Tensor, sparse: SparseBatch) -> tuple[torch.Tensor, int]:
        nf = len(self.feature_names)
        if not isinstance(dense, torch.Tensor) or dense.dim() != 2 \
                or dense.shape[1] != self.num_dense:
            shape = tuple(dense.shape) if isinstance(dense, torch.Tensor) else type(dense).__name__
            raise InvalidInput(f"dense must be a (B, {self.num_dense}) float tensor, got {shape}")
        if not dense.is_floating_point():
            raise InvalidInput(f"dense must hold floats, got {dense.dtype}")
        b = dense.shape[0]
        lengths, values = sparse.lengths, sparse.values
        if lengths.dim() != 2 or tuple(lengths.shape) != (nf, b):
            raise InvalidInput(f"sparse lengths must be ({nf}, B={b}) (one row per feature "
                               f"{self.feature_names[0]}..{self.feature_names[-1]}), "
                               f"got {tuple(lengths.shape)}")
        if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
            raise InvalidInput(f"sparse values must be a 1-d int64 tensor, got {values.dtype} "
                               f"{tuple(values.shape)}")
        if lengths.numel() and int(lengths.min()) < 0:
            f = int((lengths < 0).any(1).nonzero()[0])
            raise InvalidInput(f"sparse feature {self.feature_names[f]}: negative length; "
                               "lengths count ids per sample and must be >= 0")
        total = int(lengths.sum())
        if total != values.numel():
            raise InvalidInput(f"sparse lengths sum to {total} but values hold {values.numel()} "
                               "ids; they must match")
        if values.numel() and int(values.min()) < 0:
            first = int((values < 0).nonzero()[0])
            per_value = torch.cumsum(lengths.reshape(-1).long(), 0)
            seg = int(torch.searchsorted(per_value, first, right=True))
            f, s = divmod(seg, b)
            raise InvalidInput(f"sparse feature {self.feature_names[f]}: id {int(values[first])} "
                               f"(sample {s}) is negative; ids must be integers >= 0 (ids >= "
                               f"the table's {self.feature_rows[f]} rows wrap modulo rows)")
        return lengths, b

    # -- embedding -----------------------------------------------------------------------
    def _global_rows(self, g: _Group, values: torch.Tensor, lengths: torch.Tensor,
                     one_hot: bool) -> torch.Tensor:
        """int64 (nnz_g,) global rows on the device of one group's ids: offset[f] + id % rows[f].

        Computed on the device (``output_size`` avoids a sync): at batch 32768 the
        host-side version cost milliseconds per batch. One-hot batches broadcast per
        feature instead: CPU ``repeat_interleave`` opens a thread-parallel region even
        for 26 elements, which stalled batch-1 calls for milliseconds on a busy host.
        """
        dev = self.device
        v = values.to(dev, non_blocking=True).long()
        if one_hot:
            vv = v.view(len(g.features), -1)
            if len(g.managed) == len(g.features):   # every table managed: no wraps, no %
                local, found = self._map_index.lookup_features(vv, g.managed_tables)
                if self._single:
                    self._fallback_d += (~found).sum(1)
                else:
                    self._fallback_d.index_add_(0, g.managed_f, (~found).sum(1))
                return (local + g.offsets_d.unsqueeze(1)).view(-1)
            rows = g.rows_d.unsqueeze(1)
            wrapped = (vv >= rows).sum(1)
            if g.managed:
                wrapped.mul_(g.modulo_d)
            if self._single:
                self._wrapped_d += wrapped
            else:
                self._wrapped_d.index_add_(0, g.features_d, wrapped)
            local = vv % rows
            if g.managed:
                got, found = self._map_index.lookup_features(
                    vv.index_select(0, g.managed_j), g.managed_tables)     # (M, B)
                local.index_copy_(0, g.managed_j, got)
                self._fallback_d.index_add_(0, g.managed_f, (~found).sum(1))
            return (local + g.offsets_d.unsqueeze(1)).view(-1)
        per_feature = lengths.sum(1).to(dev, non_blocking=True)
        feat = torch.repeat_interleave(g.ids_d, per_feature, output_size=v.numel())
        rows = g.rows_d.index_select(0, feat)
        over = (v >= rows).long()
        if g.managed:
            over.mul_(g.modulo_d.index_select(0, feat))
        self._wrapped_d.index_add_(0, feat if self._single else g.features_d.index_select(0, feat),
                                   over)
        local = v % rows
        if g.managed:
            bounds = [0, *itertools.accumulate(lengths.sum(1).tolist())]
            for j, t in g.managed:   # few multi-hot features: one lookup each
                lo, hi = bounds[j], bounds[j + 1]
                if hi > lo:
                    got, found = self._map_index.lookup(v[lo:hi], [(t, 0, hi - lo)])
                    local[lo:hi] = got
                    self._fallback_d[g.features[j]] += (~found).sum()
        return local + g.offsets_d.index_select(0, feat)

    def _embed(self, sparse: SparseBatch, lengths: torch.Tensor, b: int) -> torch.Tensor:
        """Pooled embeddings on the device, float32: (B, F, D) for a model of one group
        (one dim, dtype and pooling), else (B, sum_f D_f) in feature order."""
        if self._single:
            return self._embed_group(self._groups[0], sparse.values, lengths, b)
        # Each feature's ids are one slice of the feature-major values.
        bounds = [0, *itertools.accumulate(lengths.sum(1).tolist())]
        parts: list[torch.Tensor | None] = [None] * len(self.feature_names)
        for g in self._groups:
            vals = torch.cat([sparse.values[bounds[f] : bounds[f + 1]] for f in g.features])
            lens = lengths[list(g.features)]
            emb = self._embed_group(g, vals, lens, b)                  # (B, F_g, D_g)
            for j, f in enumerate(g.features):
                parts[f] = emb[:, j]
        return torch.cat(parts, dim=1)  # type: ignore[arg-type]

    def _embed_group(self, g: _Group, values: torch.Tensor, lengths: torch.Tensor,
                     b: int) -> torch.Tensor:
        """One group's pooled embeddings (B, F_g, D_g) float32 on the device.

        Args:
            values: int64 (nnz_g,) the group's ids, feature-major; lengths: (F_g, B).
        """
        nf, d = len(g.features), g.dim
        one_hot = values.numel() == nf * b and bool((lengths == 1).all())
        rows = self._global_rows(g, values, lengths, one_hot)
        if self.cache is None:
            emb = self._dequantize(g, self._table().index_select(0, rows))   # (nnz, D)
            self._hits += rows.numel()
            bag_index = None
        else:
            uniq, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
            emb = self._dequantize(g, self.cache.lookup(uniq, counts, n_ids=rows.numel()))
            bag_index = inverse                                             # emb: (U, D)
        self._lookups += rows.numel()
        if one_hot:   # one id per bag: the pooled value is the row (sum and mean alike)
            if bag_index is not None:
                emb = emb.index_select(0, bag_index)
            return emb.view(nf, b, d).transpose(0, 1)
        offsets = torch.zeros(nf * b + 1, dtype=torch.int64)
        torch.cumsum(lengths.reshape(-1).long(), 0, out=offsets[1:])
        if bag_index is None:
            bag_index = torch.arange(rows.numel(), device=self.device)
        pooled = F.embedding_bag(bag_index, emb, offsets.to(self.device), mode=g.mode,
                                 include_last_offset=True)                      # (F*B, D)
        return pooled.view(nf, b, d).transpose(0, 1)

    def _dequantize(self, g: _Group, rows: torch.Tensor) -> torch.Tensor:
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

    # -- public --------------------------------------------------------------------------
    @torch.inference_mode()
    def predict(self, dense: torch.Tensor, sparse: SparseBatch) -> torch.Tensor:
        """Click probabilities.

        Args:
            dense: (B, N) float32 dense features (already transformed as in training).
            sparse: ids of the F features in ``feature_names`` order.
        Returns:
            (B,) float32 probabilities on the CPU.
        Raises:
            InvalidInput: shapes/dtypes off, lengths not matching values, negative ids.
        """
        lengths, b = self._check(dense, sparse)
        if b == 0:
            return torch.zeros(0, dtype=torch.float32)
        cap = self.config.max_forward_instances
        with device_guard(self.device):
            if cap is None or b <= cap:
                return self._forward(dense, sparse, lengths, b)
            return torch.cat([self._forward(d, s, s.lengths, d.shape[0])
                              for d, s in _split_batch(dense, sparse, cap)])

    def _forward(self, dense: torch.Tensor, sparse: SparseBatch, lengths: torch.Tensor,
                 b: int) -> torch.Tensor:
        """One forward of a validated batch: (B, N) dense + F features -> (B,) on the CPU."""
        t0 = time.perf_counter()
        nf = len(self.feature_names)
        if (self.config.cuda_graphs and self.device.type == "cuda" and self._single
                and not self._managed and (self.cache is None or self.cache.static_ok(nf * b))
                and sparse.values.numel() == nf * b and bool((lengths == 1).all())):
            out = self._predict_graph(dense, sparse, b)
            self._stage["dense"] += time.perf_counter() - t0
        else:
            emb = self._embed(sparse, lengths, b)
            t1 = time.perf_counter()
            x = dense.to(self.device, dtype=self._dense_dtype, non_blocking=True)
            logits = self._dense_forward(x, emb.to(self._dense_dtype))
            out = torch.sigmoid(logits.float()).cpu()
            self._stage["embedding"] += t1 - t0
            self._stage["dense"] += time.perf_counter() - t1
        self._forwards += 1
        self._samples += b
        return out

    def _dense_forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``self.dense(x (B, N), emb)`` -> logits (B,); in bf16 on CPU the rows are padded
        with zeros up to a multiple of :data:`DENSE_PAD_ROWS` (:meth:`dense_rows`).

        Why: oneDNN builds a bf16 GEMM kernel per shape, and ranking requests bring a new
        B almost every time: measured on the DLRM-v2 example (one thread), 57.9 ms per 270
        pairs for shapes it had not seen against 21.3 ms for the same shapes again. Padded,
        a pod sees a few dozen shapes, all built at warm-up (:meth:`dense_shapes`). Each
        row's logit depends on that row only, so the padding is sliced off unread."""
        b = x.shape[0]
        rows = self.dense_rows(b)
        if rows != b:
            x = torch.nn.functional.pad(x, (0, 0, 0, rows - b))
            emb = torch.nn.functional.pad(emb, (0, 0) * (emb.dim() - 1) + (0, rows - b))
        logits: torch.Tensor = self.dense(x, emb)
        return logits[:b]

    def dense_rows(self, b: int) -> int:
        """Rows the dense part runs for a batch of ``b``: ``b``, or in bf16 on CPU ``b``
        rounded up to a multiple of :data:`DENSE_PAD_ROWS`."""
        if self._dense_dtype != torch.bfloat16 or self.device.type != "cpu":
            return b
        return -(-b // DENSE_PAD_ROWS) * DENSE_PAD_ROWS

    def dense_shapes(self, up_to: int = DENSE_WARM_ROWS) -> list[int]:
        """The padded batch sizes up to ``up_to`` (capped by ``max_forward_instances``) that
        warm-up builds kernels for: none unless the rows are padded."""
        if self.dense_rows(1) == 1:
            return []
        cap = self.config.max_forward_instances
        top = min(up_to, cap) if cap is not None else up_to
        return list(range(DENSE_PAD_ROWS, top + 1, DENSE_PAD_ROWS))

    def _predict_graph(self, dense: torch.Tensor, sparse: SparseBatch, b: int) -> torch.Tensor:
        """Whole predict as one CUDA-graph replay (no cache, one id per feature).

        Inputs go through pinned host buffers so each needs one async copy; the wrap
        rule (id % rows + offset) runs inside the graph on static per-position tensors.
        Called under this runtime's device guard (``predict``), so the copies and the
        replay go to this device's current stream.
        """
        entry = self._graphs.get(b)
        if entry is None:
            entry = self._capture(b)
            self._graphs[b] = entry
        graph, s_vals, s_dense, s_out, h_vals, h_dense, h_out = entry
        # The graph wraps ids itself; count the wrapped ones here, on the host.
        self._wrapped_h += (sparse.values.view(len(self.feature_names), -1) >= self._rows_h).sum(1)
        h_vals.copy_(sparse.values)
        h_dense.copy_(dense)
        s_vals.copy_(h_vals, non_blocking=True)
        s_dense.copy_(h_dense, non_blocking=True)
        graph.replay()
        h_out.copy_(s_out, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        if self.cache is None:   # the cache counts its own lookups inside the graph
            n = h_vals.numel()
            self._lookups += n
            self._hits += n
        return h_out.clone()

    def _table(self) -> torch.Tensor:
        if self.table is None:
            raise RuntimeError("no device table: this runtime serves through its cache")
        return self.table

    def _graph_body(self, vals: torch.Tensor, dense: torch.Tensor, rows_rep: torch.Tensor,
                    offs_rep: torch.Tensor, b: int) -> torch.Tensor:
        nf, d = len(self.feature_names), self.dim
        g = vals % rows_rep + offs_rep
        raw = (self._table().index_select(0, g) if self.cache is None
               else self.cache.lookup_static(g))
        emb = dequantize_rows(raw, self._groups[0].dtype, d)  # fresh tensors: they live in the graph pool
        emb = emb.view(nf, b, d).transpose(0, 1)
        return torch.sigmoid(self.dense(dense.to(self._dense_dtype),
                                        emb.to(self._dense_dtype)).float())

    def _capture(self, b: int) -> _GraphEntry:
        """Capture ``_graph_body`` for batch ``b`` on a side stream of this runtime's device.

        The stream is explicit: ``torch.cuda.graph``'s default capture stream is created
        once per process on whichever device was current, so a runtime on cuda:1 would
        otherwise capture nothing of its own kernels.
        """
        dev = self.device
        nf = len(self.feature_names)
        rows_rep = self._rows_d.repeat_interleave(b)       # (F*B,) rows of each position
        offs_rep = self._offsets_d.repeat_interleave(b)
        s_vals = torch.zeros((nf * b,), dtype=torch.int64, device=dev)
        s_dense = torch.zeros((b, self.num_dense), dtype=torch.float32, device=dev)
        # Warm-up runs really look up (row 0 of each table): keep the counters exact.
        saved = self.cache._count.clone() if self.cache is not None else None
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm up kernels/allocator outside the capture
                self._graph_body(s_vals, s_dense, rows_rep, offs_rep, b)
        torch.cuda.current_stream(dev).wait_stream(stream)
        if self.cache is not None and saved is not None:
            self.cache._count.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            s_out = self._graph_body(s_vals, s_dense, rows_rep, offs_rep, b)
        h_vals = torch.empty((nf * b,), dtype=torch.int64, pin_memory=True)
        h_dense = torch.empty((b, self.num_dense), dtype=torch.float32, pin_memory=True)
        h_out = torch.empty((b,), dtype=torch.float32, pin_memory=True)
        log.info("captured a CUDA graph for batch %d", b)
        return graph, s_vals, s_dense, s_out, h_vals, h_dense, h_out

    def record_stage(self, name: str, seconds: float) -> None:
        """Add wall seconds to a stage (the handler reports "decode")."""
        if name not in self._stage:
            raise ConfigError(f"stage {name!r} is not one of {STAGES}")
        self._stage[name] += float(seconds)

    def predict_arrays(self, dense: np.ndarray, values: np.ndarray,
                       lengths: np.ndarray) -> np.ndarray:
        """:meth:`predict` on numpy arrays, as the request decoder makes them (zero-copy
        views: float32 (B, N) dense, int64 (nnz,) values, int32 (F, B) lengths); (B,)
        float32 probabilities as numpy."""
        return self.predict(torch.from_numpy(dense),
                            SparseBatch(values=torch.from_numpy(values),
                                        lengths=torch.from_numpy(lengths))).numpy()

    def stats(self) -> RuntimeStats:
        """A snapshot of the cumulative counters (one device sync with a cache)."""
        if self.cache is not None:
            c = self.cache.counters
            lookups, hits, misses, ev = c.lookups, c.hits, c.misses, c.evictions
            dev_b, host_b = self.cache.device_bytes, self.cache.host_bytes
        else:
            lookups, hits, misses, ev = self._lookups, self._hits, 0, 0
            dev_b, host_b = self._table().numel(), 0
        return RuntimeStats(lookups=lookups, hits=hits, misses=misses, evictions=ev,
                            hit_ratio=hits / lookups if lookups else 0.0,
                            device_bytes=dev_b, host_bytes=host_b,
                            stage_seconds=dict(self._stage), forwards=self._forwards,
                            samples=self._samples,
                            wrapped=tuple(int(x) for x in
                                          (self._wrapped_d.cpu() + self._wrapped_h).tolist()),
                            fallback=tuple(int(x) for x in self._fallback_d.cpu().tolist()))
