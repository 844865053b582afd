"""The serving runtime: a quantized DLRM artifact served with stock PyTorch.

Shapes: B batch, F sparse features (26), D embedding dim, N dense features (13),
nnz = number of sparse ids in a batch, U = distinct global rows among them.

Pipeline of one ``predict``:

1. validate the inputs on the host (negative ids -> ``InvalidInput`` naming the feature);
2. global row = table offset + the table's row of the id: ``id % rows`` for a modulo
   table (ids >= rows wrap, documented rule), the version's id map for a managed one
   (:mod:`serve.runtime.idmap`: admitted ids own a row, every other id reads the
   fallback row 0, counted per feature in ``RuntimeStats.fallback``;
   :mod:`serve.runtime.rowmap`);
3. embedding, asked of the :class:`serve.runtime.tables.TableStore` (steps 2-3 are its
   business): either a direct gather from the tables on the device (no cache: every row
   resident), or ``torch.unique`` -> :class:`serve.runtime.cache.EmbeddingCache` (hot rows
   on the device, all rows pinned in host memory) -> dequantize the U rows once -> pool;
4. dense part (:class:`serve.runtime.dense.DenseDLRM`, as TorchRec's DLRM) -> sigmoid
   (one-hot batches with ``cuda_graphs``: the whole predict as one replay,
   :mod:`serve.runtime.graphs`).

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
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from serve.common.validate import int_at_least, int_in_range, number_in_range, positive_int
from serve.constants import STAGES
from serve.errors import ArtifactError, ConfigError, InvalidInput
from serve.runtime.artifact import Artifact, DLRMDense, load_artifact
from serve.runtime.cache import POLICIES, EmbeddingCache, resolve_decay_every
from serve.runtime.dense import PRECISIONS, DenseDLRM, ExportedDenseModule, convert_precision
from serve.runtime.graphs import GraphRunner
from serve.runtime.hostmem import MISS_PATHS, device_guard
from serve.runtime.idmap import IdMap
from serve.runtime.rowsource import DISK_READ_THREADS, TierCounters
from serve.runtime.shared import SharedTables
from serve.runtime.tables import TableStore, TierSettings
from serve.schema import ModelSchema

__all__ = ["DEFAULT_MAX_FORWARD_INSTANCES", "STAGES", "Runtime", "RuntimeConfig",
           "RuntimeStats", "SparseBatch", "expand_shared"]

log = logging.getLogger(__name__)

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
        host_cache_bytes: tables on disk only (``Artifact.files``): the host tier's
            budget in bytes, PER WORKER (each TorchServe worker is its own process with
            its own tier; a pod holds workers x this): ``host_cache_bytes // row_bytes``
            rows of the widest table's width stay in process memory (policy
            ``cache_policy``), the others are read from the table files with ``pread``.
            0 = every lookup reads the files; None (and no fraction) = no bound: serve
            straight from the mapped files, shared by every worker through the page cache
            (serve.runtime.tiers). Ignored for tables in memory.
        host_cache_fraction: the same budget as a fraction (0..1) of the table bytes on
            disk; give at most one of the two.
        disk_read_threads: reads of missed rows in flight per runtime (1..256).
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
    host_cache_bytes: int | None = None
    host_cache_fraction: float | None = None
    disk_read_threads: int = DISK_READ_THREADS

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
        _check_host_budget(self.host_cache_bytes, self.host_cache_fraction,
                           self.disk_read_threads)


@dataclass(frozen=True)
class SparseBatch:
    """Sparse ids in KeyedJaggedTensor layout, feature-major.

    Attributes:
        values: int64 (nnz,): feature 0's ids for all B samples, then feature 1's ...
        lengths: int32 (F, B): ids per (feature, sample); 1 everywhere = one-hot.
    """

    values: torch.Tensor
    lengths: torch.Tensor
    #: Features looked up once per request (a ranking request's context): for feature
    #: ``shared[k]``, sample s reads the pooled bag of sample ``bag_of[k, s]`` (int64
    #: (S, B); the bag's own sample reads itself, every other sample of the request has
    #: length 0 there). Empty / None: every sample has its own bag (the usual batch).
    shared: tuple[int, ...] = ()
    bag_of: torch.Tensor | None = None


@dataclass
class RuntimeStats:
    """Cumulative since load.

    ``lookups`` counts sparse ids; ``hits`` those whose row was on the device when the
    batch arrived; ``misses`` those fetched from host memory; ``evictions`` rows pushed
    out of the cache. Without a cache every lookup is a hit. ``device_bytes``: quantized
    rows on the compute device plus the cache's maps; ``host_bytes``: the full host copy
    behind a cache (0 without one; over tables on disk: this worker's host tier, its
    index and the deltas' overlay). ``stage_seconds``: wall seconds per stage.
    ``forwards``: model forwards (a batch split by ``max_forward_instances`` counts one per
    chunk); ``samples``: samples predicted. ``wrapped``: per feature (``feature_names``
    order), ids that were >= the table's rows and wrapped modulo rows (new ids outgrowing
    a table show up here first; modulo tables only). ``fallback``: per feature, ids of a
    managed table that were not in its id map and read the fallback row (0 for modulo
    tables). ``tiers``: per tier ("device", "host"), its counters
    (:class:`serve.runtime.rowsource.TierCounters`: lookups, hits, rows and bytes
    fetched from the tier below, the seconds those fetches took, the tier's capacity).
    ``predict_cpu_seconds``: CPU seconds spent in :meth:`Runtime.predict` (the calling
    thread's clock with one torch thread, the process's with more).
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
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    predict_cpu_seconds: float = 0.0


def _check_host_budget(host_bytes: int | None, fraction: float | None, threads: int) -> None:
    """RuntimeConfig's host tier settings.

    Raises:
        ConfigError: a budget out of range, both forms given, threads out of 1..256.
    """
    if host_bytes is not None:
        int_at_least("host_cache_bytes", host_bytes, 0,
                     then=" (host tier bytes per worker; 0 = read every row from disk), "
                          "or None for no bound")
    if fraction is not None:
        number_in_range("host_cache_fraction", fraction, 0, 1,
                        then=" (a fraction of the table bytes), or None")
    if host_bytes is not None and fraction is not None:
        raise ConfigError(f"host_cache_bytes={host_bytes} and host_cache_fraction={fraction} "
                          "are both set; give one of the two")
    int_in_range("disk_read_threads", threads, 1, 256,
                 then=" (reads of missed rows in flight per runtime)")


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


def _dense_part(artifact: Artifact, config: RuntimeConfig, dev: torch.device) -> torch.nn.Module:
    """The artifact's dense part on ``dev`` at ``config.dense_precision`` (compiled when
    ``config.compile``): ``(x (B, N), emb) -> logits (B,)``."""
    dense: torch.nn.Module
    if isinstance(artifact.dense, DLRMDense):
        dlrm = DenseDLRM(artifact.dense.dense_arch, artifact.dense.over_arch,
                         len(artifact.feature_names))
        dense = convert_precision(dlrm.to(dev).eval(), config.dense_precision, dev)
    else:
        if config.dense_precision == "int8":
            raise ConfigError("dense_precision 'int8' applies to the built-in DLRM only; "
                              "this model's dense part is an exported program: serve it "
                              "with 'fp32' or 'bf16'")
        dense = ExportedDenseModule(artifact.dense.program, dev, config.dense_precision)
    if config.compile:
        dense = torch.compile(dense, dynamic=True)  # type: ignore[assignment]
    return dense


def _check_batch(dense: torch.Tensor, sparse: SparseBatch, feature_names: list[str],
                 num_dense: int, table_rows: list[int],
                 feature_tables: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """Validate a batch on the host: ``(lengths (F, B), B)``. ``table_rows``,
    ``feature_tables``: rows per table, table of each feature (for the message of a
    negative id).

    Raises:
        InvalidInput: shapes/dtypes off, lengths not matching values, negative ids.
    """
    nf = len(feature_names)
    if not isinstance(dense, torch.Tensor) or dense.dim() != 2 \
            or dense.shape[1] != num_dense:
        shape = tuple(dense.shape) if isinstance(dense, torch.Tensor) else type(dense).__name__
        raise InvalidInput(f"dense must be a (B, {num_dense}) float tensor, got {shape}")
    if not dense.is_floating_point():
        raise InvalidInput(f"dense must hold floats, got {dense.dtype}")
    b = dense.shape[0]
    lengths, values = sparse.lengths, sparse.values
    if lengths.dim() != 2 or tuple(lengths.shape) != (nf, b):
        raise InvalidInput(f"sparse lengths must be ({nf}, B={b}) (one row per feature "
                           f"{feature_names[0]}..{feature_names[-1]}), "
                           f"got {tuple(lengths.shape)}")
    if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
        raise InvalidInput(f"sparse values must be a 1-d int64 tensor, got {values.dtype} "
                           f"{tuple(values.shape)}")
    if lengths.numel() and int(lengths.min()) < 0:
        f = int((lengths < 0).any(1).nonzero()[0])
        raise InvalidInput(f"sparse feature {feature_names[f]}: negative length; "
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
        raise InvalidInput(f"sparse feature {feature_names[f]}: id {int(values[first])} "
                           f"(sample {s}) is negative; ids must be integers >= 0 (ids >= "
                           f"the table's {table_rows[feature_tables[f]]} rows wrap modulo rows)")
    if sparse.shared or sparse.bag_of is not None:
        _check_shared(sparse, lengths, feature_names)
    return lengths, b


def _check_shared(sparse: SparseBatch, lengths: torch.Tensor, feature_names: list[str]) -> None:
    """A batch's shared bags (:attr:`SparseBatch.bag_of`) are well formed: every sample
    reads an earlier (or its own) sample's bag, that sample reads itself, and a sample
    reading another's bag has no ids of its own there; so the pooled rows it gets are
    those of the ids the request sent once.

    Raises:
        InvalidInput: the shapes or any of those rules off.
    """
    nf, b = lengths.shape
    bag_of, shared = sparse.bag_of, sparse.shared
    if bag_of is None or bag_of.dtype != torch.int64 or tuple(bag_of.shape) != (len(shared), b):
        got = None if bag_of is None else (bag_of.dtype, tuple(bag_of.shape))
        raise InvalidInput(f"shared bags: bag_of must be int64 ({len(shared)}, B={b}), one row "
                           f"per shared feature; got {got}")
    if len(set(shared)) != len(shared) or not all(0 <= f < nf for f in shared):
        raise InvalidInput(f"shared bags: features {list(shared)} must be distinct indices in "
                           f"0..{nf - 1}")
    if not b:
        return
    mine = lengths.index_select(0, torch.tensor(shared, dtype=torch.int64))   # (S, B)
    if int(bag_of.min()) == 0 == int(bag_of.max()):
        # one request (the usual case): every sample reads sample 0's bag
        borrowed = mine[:, 1:] != 0
    else:
        own = torch.arange(b)
        if bool((bag_of < 0).any()) or bool((bag_of > own).any()):
            raise InvalidInput("shared bags: a sample must read its own bag or an earlier "
                               "sample's (0 <= bag_of[k, s] <= s)")
        if bool((bag_of.gather(1, bag_of) != bag_of).any()):
            raise InvalidInput("shared bags: a bag read by other samples must be its own "
                               "sample's (bag_of[k, bag_of[k, s]] == bag_of[k, s])")
        borrowed = (bag_of != own) & (mine != 0)
    if bool(borrowed.any()):
        k = int(borrowed.any(1).nonzero()[0])
        raise InvalidInput(f"shared bags: feature {feature_names[shared[k]]}: a sample that "
                           "reads another sample's bag must send no ids of its own (length 0)")


def expand_shared(sparse: SparseBatch) -> SparseBatch:
    """The same batch with every shared bag copied to the samples that read it (the
    request sent as independent instances): values feature-major (nnz',), lengths (F, B),
    nothing shared. For splitting a batch across forwards, and as the exactness reference."""
    if not sparse.shared:
        return sparse
    lengths = sparse.lengths.clone()
    nf, b = lengths.shape
    pos = torch.zeros(nf * b + 1, dtype=torch.int64)
    torch.cumsum(sparse.lengths.reshape(-1).long(), 0, out=pos[1:])
    src = torch.arange(b).repeat(nf, 1)                     # (F, B): whose bag each cell reads
    for k, f in enumerate(sparse.shared):
        src[f] = sparse.bag_of[k]                           # type: ignore[index]
        lengths[f] = sparse.lengths[f].index_select(0, src[f])
    cells = (torch.arange(nf).unsqueeze(1) * b + src).reshape(-1)
    starts, counts = pos[cells], lengths.reshape(-1).long()
    first = torch.cumsum(counts, 0) - counts
    take = torch.repeat_interleave(starts - first, counts) + torch.arange(int(counts.sum()))
    return SparseBatch(sparse.values.index_select(0, take), lengths)


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


def _equal_runs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Runs of equal consecutive rows of ``x`` (B, N): (the first row of each run, int64
    (U,); the run of each row, int64 (B,)), or None when no two consecutive rows are equal."""
    b = x.shape[0]
    if b < 2:
        return None
    same = (x[1:] == x[:-1]).all(1)
    if not bool(same.any()):
        return None
    starts = torch.ones(b, dtype=torch.bool, device=x.device)
    starts[1:] = ~same
    return starts.nonzero().squeeze(1), torch.cumsum(starts, 0) - 1


def _bags(sparse: SparseBatch) -> dict[int, torch.Tensor] | None:
    """feature -> int64 (B,) bag each sample reads, for the shared features; None: none."""
    if not sparse.shared or sparse.bag_of is None:
        return None
    return {f: sparse.bag_of[k] for k, f in enumerate(sparse.shared)}


class Runtime:
    """Serves one artifact on one device. Not thread-safe: one caller at a time.

    Owns the loading, the input checks, the dense part and the forward; the rows of a
    batch come from its :class:`serve.runtime.tables.TableStore` (``store``: tables or
    cache, id maps, their counters), whole CUDA-graph predicts from its
    :class:`serve.runtime.graphs.GraphRunner` (``graphs``, used with ``cuda_graphs`` on CUDA).
    """

    def __init__(self, artifact: Artifact, config: RuntimeConfig,
                 shared: SharedTables | None = None) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        _check_tables(artifact)
        self.schema: ModelSchema = artifact.schema
        self.feature_names: list[str] = list(artifact.feature_names)
        self.num_dense: int = artifact.num_dense
        #: The tables' one dim and dtype, or 0 and "mixed" (then see ``schema.tables``).
        self.dim = artifact.embedding_dim
        self.dtype = artifact.dtype
        self._dense_dtype = torch.bfloat16 if config.dense_precision == "bf16" else torch.float32
        with device_guard(self.device):
            self.store = TableStore(
                artifact, self.device, shared, load_factor=config.cache_load_factor,
                cache_bytes=config.cache_bytes, cache_on_cpu=config.cache_on_cpu,
                policy=config.cache_policy, miss_path=config.cache_miss_path,
                lfu_decay_every=config.lfu_decay_every,
                tiers=TierSettings(config.host_cache_bytes, config.host_cache_fraction,
                                   config.disk_read_threads))
            self.dense: torch.nn.Module = _dense_part(artifact, config, self.device)
        #: The pod-wide shared tables when they serve the rows (the store's), else None:
        #: the worker and the delta follower take their locks.
        self.shared: SharedTables | None = self.store.shared
        self.graphs = GraphRunner(self.store, self.dense, self._dense_dtype, self.num_dense,
                                  self.device)
        # The built-in DLRM on CPU runs its bottom MLP once per run of equal dense rows
        # (a ranking request's shared dense vector): the rows are compared, not the form,
        # so a request sent as instances computes exactly what its context form does.
        self._dense_runs = isinstance(artifact.dense, DLRMDense) and self.device.type == "cpu"
        self._graphed = config.cuda_graphs and self.device.type == "cuda"
        self._stage = {s: 0.0 for s in STAGES}
        self._forwards = self._samples = 0
        # CPU seconds inside predict: the calling thread's own clock when torch runs one
        # thread (a worker's other threads, the delta follower, are not the model's
        # work), the process's when its intra-op threads share the work.
        self._cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        self._cpu_s = 0.0
        cache = self.store.cache
        log.info("runtime on %s: %d tables, %d features, %d rows, %s rows of %d bytes; %s",
                 self.device, len(self.table_rows), len(self.feature_names), self.total_rows,
                 self.dtype, max(t.data.shape[1] for t in artifact.tables),
                 f"cache {cache.capacity} slots ({config.cache_policy})" if cache
                 else "no cache")

    @classmethod
    def from_artifact(cls, artifact: Artifact | str | os.PathLike[str],
                      config: RuntimeConfig = RuntimeConfig(),
                      shared: SharedTables | None = None,
                      tables_path: Sequence[str | os.PathLike[str]] | None = None
                      ) -> Runtime:
        """Load (path: memory-mapped read) and prepare an artifact for ``config.device``.

        ``shared``: on CPU without a cache, serve the rows from this pod-wide shared copy
        instead of a private one (ignored where a cache or a device holds the rows).
        ``tables_path``: where a format-3 artifact's tables folder may be
        (:func:`serve.runtime.artifact.load_artifact`).
        """
        if not isinstance(artifact, Artifact):
            artifact = load_artifact(artifact, tables_path=tables_path)
        return cls(artifact, config, shared)

    def close(self) -> None:
        """Release what outlives Python's collector: the captured CUDA graphs (first: a
        graph with the cache step reads the host table on replay), then the cache's
        page-locked host table (``cudaHostUnregister``). Idempotent; a runtime with a
        cache answers no predict afterwards (the cache refuses lookups)."""
        self.graphs.clear()
        self.store.close()

    # -- the store's tables, as callers read them ------------------------------------------
    @property
    def cache(self) -> EmbeddingCache | None:
        """The embedding cache serving the rows, or None (every row on the device)."""
        return self.store.cache

    @property
    def table(self) -> torch.Tensor | None:
        """uint8 (R, row_bytes) every row on the device, or None (served by the cache)."""
        return self.store.table

    @property
    def table_rows(self) -> list[int]:
        """Rows per table (``schema.tables`` order); a table may serve several features."""
        return self.store.table_rows

    @property
    def total_rows(self) -> int:
        return self.store.total_rows

    @property
    def feature_rows(self) -> list[int]:
        """Rows of each feature's table (request order)."""
        return [self.store.table_rows[t] for t in self.schema.feature_tables]

    @property
    def row_bytes(self) -> int:
        """Bytes per stored row (the artifact's row format)."""
        return self.store.row_bytes

    @property
    def id_maps(self) -> dict[int, IdMap]:
        """The managed tables' maps (table index -> map; views, valid until the next
        change)."""
        return self.store.ids.id_maps

    @property
    def id_probe(self) -> str | None:
        """How the managed maps are probed (:attr:`serve.runtime.idmap.MapIndex.probe`:
        ``"compiled"`` or ``"ops"``); None without managed tables."""
        return self.store.ids.id_probe

    # -- embedding deltas ----------------------------------------------------------------
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
        self.store.update_rows(table, ids, rows)

    def check_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`update_rows`'s checks, nothing written (so a delta's every table is
        checked before any is written); returns ``rows`` as they will be stored.

        Raises:
            ConfigError: a table index, a row shape or dtype, or an id out of range.
        """
        return self.store.check_rows(table, ids, rows)

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
        return self.store.ids.changed_id_map(table, assign_ids, assign_rows, evict_ids)

    def set_id_map(self, table: int, id_map: IdMap) -> None:
        """Serve ``id_map`` for managed table ``table`` from the next predict on (written in
        place: with the pod-wide shared tables every worker sees it, so one writes it, under
        the shared write lock, like rows)."""
        self.store.ids.set_id_map(table, id_map)

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
        c0 = self._cpu_clock()
        try:
            lengths, b = _check_batch(dense, sparse, self.feature_names, self.num_dense,
                                      self.store.table_rows, self.schema.feature_tables)
            if b == 0:
                return torch.zeros(0, dtype=torch.float32)
            cap = self.config.max_forward_instances
            with device_guard(self.device):
                if cap is None or b <= cap:
                    return self._forward(dense, sparse, lengths, b)
                # a chunk may start inside a request: its shared bags are copied out first
                whole = expand_shared(sparse)
                return torch.cat([self._forward(d, s, s.lengths, d.shape[0])
                                  for d, s in _split_batch(dense, whole, cap)])
        finally:
            self._cpu_s += self._cpu_clock() - c0

    def _forward(self, dense: torch.Tensor, sparse: SparseBatch, lengths: torch.Tensor,
                 b: int) -> torch.Tensor:
        """One forward of a validated batch: (B, N) dense + F features -> (B,) on the CPU."""
        t0 = time.perf_counter()
        if self._graphed and self.graphs.fits(sparse.values, lengths, b):
            out = self.graphs.predict(dense, sparse.values, b)
            self._stage["dense"] += time.perf_counter() - t0
        else:
            emb = self.store.embed(sparse.values, lengths, b, _bags(sparse))
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
        runs = _equal_runs(x) if self._dense_runs else None
        expand = None
        if runs is not None:
            first, expand = runs
            x = x.index_select(0, first)                               # (U, N)
        if rows != b:
            emb = torch.nn.functional.pad(emb, (0, 0) * (emb.dim() - 1) + (0, rows - b))
            if expand is None:
                x = torch.nn.functional.pad(x, (0, 0, 0, rows - b))
            else:
                u = x.shape[0]
                x = torch.nn.functional.pad(x, (0, 0, 0, self.dense_rows(u) - u))
                expand = torch.nn.functional.pad(expand, (0, rows - b))
        logits: torch.Tensor = (self.dense(x, emb) if expand is None
                                else self.dense(x, emb, expand))
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

    def record_stage(self, name: str, seconds: float) -> None:
        """Add wall seconds to a stage (the handler reports "decode")."""
        if name not in self._stage:
            raise ConfigError(f"stage {name!r} is not one of {STAGES}")
        self._stage[name] += float(seconds)

    def predict_arrays(self, dense: np.ndarray, values: np.ndarray,
                       lengths: np.ndarray, shared: tuple[int, ...] = (),
                       bag_of: np.ndarray | None = None) -> np.ndarray:
        """:meth:`predict` on numpy arrays, as the request decoder makes them (zero-copy
        views: float32 (B, N) dense, int64 (nnz,) values, int32 (F, B) lengths; shared
        features and int64 (S, B) ``bag_of`` as :class:`SparseBatch`); (B,) float32
        probabilities as numpy."""
        return self.predict(torch.from_numpy(dense),
                            SparseBatch(values=torch.from_numpy(values),
                                        lengths=torch.from_numpy(lengths), shared=shared,
                                        bag_of=None if bag_of is None
                                        else torch.from_numpy(bag_of))).numpy()

    def stats(self) -> RuntimeStats:
        """A snapshot of the cumulative counters (one device sync with a cache)."""
        c = self.store.counts()
        return RuntimeStats(lookups=c.lookups, hits=c.hits, misses=c.misses,
                            evictions=c.evictions,
                            hit_ratio=c.hits / c.lookups if c.lookups else 0.0,
                            device_bytes=c.device_bytes, host_bytes=c.host_bytes,
                            stage_seconds=dict(self._stage), forwards=self._forwards,
                            predict_cpu_seconds=self._cpu_s,
                            samples=self._samples, wrapped=c.wrapped, fallback=c.fallback,
                            tiers=c.tiers)
