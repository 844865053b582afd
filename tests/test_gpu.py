"""The runtime's CUDA-only paths, each checked against the CPU result.

The paths (serve/runtime/cache.py, serve/runtime/engine.py):

* the host table page-locked in place (``cudaHostRegister``: exactly its bytes, not
  through PyTorch's power-of-two caching host allocator) and unregistered on close;
* the host miss path's two small pinned staging buffers (host gather in chunks, async
  copies, reuse only after the previous copy out of a buffer is done);
* the mapped miss path (``cache_miss_path="mapped"``: the GPU reads the registered table);
* LFU counts and their aging on the device;
* CUDA-graph capture and replay of a whole predict at several batch sizes, without and
  with the cache, and a batch split by ``max_forward_instances``;
* all of it on ``cuda:1`` when there are two devices (streams, events and graphs are
  per device: a runtime there must not lean on the current device, cuda:0).

Each test takes the device as a parameter. The ``cpu`` variant runs in the default suite
and covers the same tensor program where that means something; the CUDA variants carry
the ``gpu`` marker and skip themselves without CUDA (no conftest needed). On the GPU
machine (stock PyTorch + pytest, no TorchRec/TorchServe/orjson) ``make gpu-check`` runs::

    python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider --noconftest -q

so this module imports only torch and serve.runtime / serve.errors (the last test
checks that).

Inputs: the carried tiny int8 artifact and batches of ``bench/gpu_fixture`` (sizes 1 and
64 one-hot, 7 and 256 multi-hot, ids beyond the table rows). References are computed
here by the CPU runtime without a cache. Comparisons:

* row bytes, cache state (resident rows, counters) and one-hot embeddings: exact
  (``torch.equal``) on every device: gathers, and dequantization as one float32 multiply
  and one add per element, round alike everywhere;
* multi-hot pooled embeddings: exact on CPU; ``EMB_TOL`` on CUDA (the bag sum may run in
  another order there);
* probabilities: exact on CPU (the same arithmetic as the reference); ``PROB_TOL`` on
  CUDA (cuBLAS and MKL sum the MLP products in different orders).
"""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from serve.errors import ConfigError
from serve.runtime.artifact import Artifact, dequantize_rows, load_artifact, row_bytes
from serve.runtime.cache import EmbeddingCache
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.runtime.hostmem import host_mapped_view, page_exclusive_empty

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "bench" / "gpu_fixture"

HAS_CUDA = torch.cuda.is_available()
_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
_MARKS: dict[str, list[Any]] = {
    "cpu": [],
    "cuda": _GPU,
    "cuda:1": [*_GPU, pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2,
                                         reason="needs two CUDA devices")],
}


def _on(*devices: str) -> list[Any]:
    """``device`` parameters, the CUDA ones marked ``gpu`` and skipped without CUDA."""
    return [pytest.param(d, marks=_MARKS[d], id=d.replace(":", "")) for d in devices]


DEVICES = _on("cpu", "cuda", "cuda:1")
CUDA_DEVICES = _on("cuda", "cuda:1")

# = bench.gpu_check.CPU_GPU_TOL: the MLPs' GEMMs and the interaction's bmm sum in another
# order on cuBLAS than on MKL/oneDNN. Measured on the fixture, the CPU's float32 answer is
# within 4.2e-7 of a float64 evaluation of the same network (logits within 2e-6), so two
# float32 orders differ by about 1e-6 at most: 1e-5 leaves a 10x margin.
PROB_TOL = 1e-5
# Multi-hot bags of the fixture hold <= MAX_BAG ids of |value| <= MAX_ABS (both checked
# below), so every partial sum is < 64, where one float32 ulp is 2^-18 = 3.8e-6. Any order
# is within MAX_BAG - 1 = 2 roundings of half an ulp of the exact sum, so two orders
# differ by at most 2 ulp = 7.6e-6 < 1e-5.
EMB_TOL = 1e-5
MAX_BAG, MAX_ABS = 3, 16.0
F = 26


# -- fixtures and helpers --------------------------------------------------------------

@pytest.fixture(scope="module")
def art() -> Artifact:
    return load_artifact(FIXTURE / "tiny_int8.pt", mmap=False)


@pytest.fixture(scope="module")
def batches() -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = torch.load(FIXTURE / "expected.pt",
                                                    weights_only=True)["batches"]
    return out


@pytest.fixture(scope="module")
def cpu_ref(art: Artifact, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Per fixture batch: the CPU runtime's probabilities and pooled embeddings (no cache)."""
    assert max(dequantize_rows(t.data, t.dtype, t.dim).abs().max().item()
               for t in art.tables) <= MAX_ABS           # premises of EMB_TOL
    assert max(int(bt["lengths"].max()) for bt in batches) <= MAX_BAG
    rt = Runtime.from_artifact(art, RuntimeConfig(cache_load_factor=1.0))
    out = []
    for bt in batches:
        sparse = _sparse(bt)
        with torch.inference_mode():
            emb = rt.store.embed(sparse.values, sparse.lengths, bt["dense"].shape[0]).clone()
        out.append({"p": rt.predict(bt["dense"], sparse), "emb": emb,
                    "one_hot": bool((bt["lengths"] == 1).all())})
    return out


def _sparse(bt: dict[str, torch.Tensor]) -> SparseBatch:
    return SparseBatch(bt["values"], bt["lengths"])


def _random_table(rows: int, row_bytes_: int, seed: int) -> torch.Tensor:
    """Random bytes in memory of its own pages (as the runtime allocates host tables), so
    a CUDA cache page-locks it in place."""
    g = torch.Generator().manual_seed(seed)
    out = page_exclusive_empty(rows, row_bytes_)
    out.copy_(torch.randint(0, 256, (rows, row_bytes_), dtype=torch.uint8, generator=g))
    return out


def _host_allocator_bytes() -> int | None:
    """Bytes PyTorch's caching host allocator holds (None where this torch has no stats)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    return int(stats().get("allocated_bytes.current", 0))


def _zipf_rows(n_rows: int, draws: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows of ``draws`` Zipf(1.1) ids (hot rows repeat: hits), with counts."""
    probs = 1.0 / torch.arange(1, n_rows + 1, dtype=torch.float64) ** 1.1
    ids = torch.multinomial(probs, draws, replacement=True, generator=g)
    rows, counts = torch.unique(ids, return_counts=True)
    return rows, counts


def _assert_close_to_cpu(got: torch.Tensor, want: torch.Tensor, device: str,
                         tol: float) -> None:
    """Exact on CPU (same arithmetic as the reference); within ``tol`` on CUDA."""
    assert got.device.type == "cpu" and got.dtype == want.dtype and got.shape == want.shape
    if torch.device(device).type == "cpu":
        assert torch.equal(got, want), (got - want).abs().max().item()
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


def _same_state(a: EmbeddingCache, b: EmbeddingCache) -> None:
    assert torch.equal(a.resident_rows(), b.resident_rows())
    assert a.counters == b.counters


# -- the host miss path: pinned staging buffer ------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_host_miss_path_is_exact_through_its_staging_buffer(device):
    """Batches of growing and shrinking miss counts through staging buffers of 1000 rows
    (the 40k-id batch has ~6300 distinct rows: 7 chunks, alternating buffers): every row
    exact, and on CUDA the same admissions, evictions and counters as the same cache on
    CPU, with the two pinned buffers never grown."""
    table = _random_table(20_000, 20, seed=0)
    cache = EmbeddingCache(table, capacity=64, policy="lru", device=device, miss_path="host",
                           staging_bytes=20 * 1000)
    ref = EmbeddingCache(table, capacity=64, policy="lru", device="cpu")
    g = torch.Generator().manual_seed(1)
    for draws in (3, 300, 4096, 9000, 50, 40_000, 200):
        rows, counts = _zipf_rows(20_000, draws, g)
        got = cache.lookup(rows.to(cache.device), counts.to(cache.device))
        assert got.device == cache.device
        assert torch.equal(got.cpu(), table[rows]), draws
        ref.lookup(rows, counts)
    c = cache.counters
    assert c.hits > 0 and c.evictions > 0 and c.hits + c.misses == c.lookups
    if cache.device.type == "cuda":
        _same_state(cache, ref)
        assert cache.host.table.is_pinned()
        assert len(cache.host._staging) == 2
        assert all(b.is_pinned() and b.shape == (1000, 20) for b in cache.host._staging)
    else:
        assert cache.host._staging == []             # CPU: host memory is device memory


@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_host_miss_path_waits_before_reusing_its_staging_buffer(device):
    """Back-to-back gathers into the one pinned buffer with host-side ids, so nothing
    syncs the device in between: each host gather must wait until the previous async
    copy out of the buffer is done (the event recorded on the cache device's stream),
    or rows in flight are overwritten. 400k rows x 68 B: the copy takes ~0.5 ms while
    the next gather writes the buffer from many threads at once."""
    table = _random_table(1_000_000, 68, seed=2)
    cache = EmbeddingCache(table, capacity=1, policy="lru", device=device, miss_path="host")
    g = torch.Generator().manual_seed(3)
    outs = []
    for _ in range(4):
        rows = torch.randint(0, table.shape[0], (400_000,), generator=g)
        outs.append((rows, cache.host.fetch(rows)))     # CPU rows: no device sync here
    for rows, out in outs:
        assert out.device == cache.device
        assert torch.equal(out.cpu(), table[rows])


# -- the host table: page-locked in place, exactly its size ----------------------------

@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_host_table_is_page_locked_in_place(device):
    """A pageable table of 3,000,001 x 20 bytes (60 MB, not a power of two): the cache
    registers that memory itself (same pointer, no copy), page-locks exactly its bytes and
    nothing through PyTorch's caching host allocator; two caches share one registration;
    the last close unregisters it. Lookups through both miss paths stay exact."""
    table = _random_table(3_000_001, 20, seed=8)
    assert not table.is_pinned()
    torch.cuda.init()
    before = _host_allocator_bytes()
    mapped = EmbeddingCache(table, capacity=256, policy="lru", device=device, miss_path="mapped")
    assert mapped.host.table.data_ptr() == table.data_ptr()          # in place
    assert table.is_pinned() and mapped.pinned_bytes == table.numel() == 60_000_020
    if before is not None:
        assert _host_allocator_bytes() == before                     # not the caching allocator
    host = EmbeddingCache(table, capacity=256, policy="lru", device=device, miss_path="host")
    assert host.pinned_bytes == table.numel()                        # one shared registration
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        rows, counts = _zipf_rows(3_000_001, 5000, g)
        rd = rows.to(mapped.device)
        assert torch.equal(mapped.lookup(rd, counts.to(rd.device)).cpu(), table[rows])
        assert torch.equal(host.lookup(rd, counts.to(rd.device)).cpu(), table[rows])
    if before is not None:   # the host path's two staging buffers: small, fixed
        assert _host_allocator_bytes() - before <= 2 * 2 * (4 << 20)
    mapped.close()
    assert table.is_pinned() and host.pinned_bytes == table.numel()  # host still uses it
    rows = torch.tensor([0, 3_000_000, 17])
    assert torch.equal(host.lookup(rows.to(host.device)).cpu(), table[rows])
    host.close()
    assert not table.is_pinned() and host.pinned_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        mapped.lookup(rows.to(host.device))


@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_runtime_pins_exactly_its_table(art, batches, cpu_ref, device):
    """A cached runtime: the host table is page-locked at exactly the artifact's table
    bytes (no pinned copy rounded to a power of two, no pageable copy kept), answers as
    the CPU does through the mapped miss path, and ``close`` unregisters it."""
    torch.cuda.init()
    before = _host_allocator_bytes()
    rt = Runtime.from_artifact(art, RuntimeConfig(device=device, cache_load_factor=0.2,
                                                  cache_miss_path="mapped"))
    assert rt.cache is not None and rt.cache.host.miss_path == "mapped"
    table = rt.cache.host.table
    assert table.is_pinned() and rt.cache.pinned_bytes == art.table_bytes == rt.stats().host_bytes
    if before is not None:
        assert _host_allocator_bytes() == before
    for bt, ref in zip(batches, cpu_ref, strict=True):
        _assert_close_to_cpu(rt.predict(bt["dense"], _sparse(bt)), ref["p"], device, PROB_TOL)
    rt.close()
    assert not table.is_pinned() and rt.cache.pinned_bytes == 0


# -- LFU on the device -------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_lfu_counts_and_aging_match_cpu(device):
    """LFU with its counts halved every 500 ids (about every other batch): the same
    counts, residents, counters and bytes on the device as on CPU."""
    table = _random_table(5000, 20, seed=10)
    cache = EmbeddingCache(table, capacity=128, policy="lfu", device=device,
                           lfu_decay_every=500)
    ref = EmbeddingCache(table, capacity=128, policy="lfu", device="cpu", lfu_decay_every=500)
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        rows, counts = _zipf_rows(5000, 300, g)
        got = cache.lookup(rows.to(cache.device), counts.to(cache.device))
        assert torch.equal(got.cpu(), table[rows])
        ref.lookup(rows, counts)
    assert cache.index.row_freq is not None and ref.index.row_freq is not None
    assert torch.equal(cache.index.row_freq.cpu(), ref.index.row_freq)
    _same_state(cache, ref)
    assert cache.counters.lfu_decays == 20 * 300 // 500


# -- the mapped miss path ---------------------------------------------------------------

@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_mapped_miss_path_reads_the_pinned_table_in_place(device):
    """The GPU gathers misses from the pinned host table itself: the same bytes and the
    same cache state as the host path on the device and as the cache on CPU, for the
    dynamic lookup and the fixed-shape (CUDA-graph) one."""
    table = _random_table(5000, 20, seed=4)
    mapped = EmbeddingCache(table, capacity=64, policy="lru", device=device, miss_path="mapped")
    host = EmbeddingCache(table, capacity=64, policy="lru", device=device, miss_path="host")
    ref = EmbeddingCache(table, capacity=64, policy="lru", device="cpu")
    assert mapped.host.miss_path == "mapped" and mapped.host.mapped is not None
    assert mapped.host.mapped.device == mapped.device
    assert mapped.host.mapped.data_ptr() == mapped.host.table.data_ptr()   # zero-copy alias
    g = torch.Generator().manual_seed(5)
    for step in range(12):
        rows, counts = _zipf_rows(5000, 40 + 60 * step, g)
        rd, cd = rows.to(mapped.device), counts.to(mapped.device)
        got = mapped.lookup(rd, cd)
        assert torch.equal(got.cpu(), table[rows]), step
        assert torch.equal(got, host.lookup(rd, cd))
        ref.lookup(rows, counts)
    _same_state(mapped, ref)
    _same_state(host, ref)
    for _ in range(5):   # fixed shape: duplicates, hits, misses read over the bus
        ids = torch.multinomial(1.0 / torch.arange(1, 5001).double(), F, replacement=True,
                                generator=g)
        assert mapped.static_ok(ids.numel())
        got = mapped.lookup_static(ids.to(mapped.device))
        assert torch.equal(got.cpu(), table[ids])
        assert torch.equal(got.cpu(), ref.lookup_static(ids))
    _same_state(mapped, ref)


def test_mapped_miss_path_on_cpu_is_the_host_path():
    """CPU has no mapped path: the option falls back to host gathers, and the view that
    backs it refuses memory the GPU could not read."""
    table = _random_table(100, 8, seed=6)
    cache = EmbeddingCache(table, capacity=4, policy="lru", device="cpu", miss_path="mapped")
    assert cache.host.miss_path == "host" and cache.host.mapped is None
    rows = torch.tensor([3, 50, 99])
    assert torch.equal(cache.lookup(rows), table[rows])
    with pytest.raises(ConfigError, match=r"^host_mapped_view needs a pinned 2-d uint8 tensor$"):
        host_mapped_view(table, torch.device("cuda"))          # pageable memory
    with pytest.raises(ConfigError, match=r"^host_mapped_view needs a pinned 2-d uint8 tensor$"):
        host_mapped_view(table.float(), torch.device("cuda"))


# -- whole runtimes on the fixture ------------------------------------------------------

RUNTIME_CONFIGS: dict[str, dict[str, Any]] = {
    "no cache": {"cache_load_factor": 1.0},
    "lru 1 slot, host misses": {"cache_bytes": row_bytes("int8", 16), "cache_on_cpu": True},
    "lfu 20%, host misses": {"cache_load_factor": 0.2, "cache_policy": "lfu",
                             "cache_on_cpu": True},
    "lru 20%, mapped misses": {"cache_load_factor": 0.2, "cache_miss_path": "mapped",
                               "cache_on_cpu": True},
}


# "no cache" on CPU is the reference itself: not a case.
RUNTIME_CASES = [pytest.param(c, d, marks=_MARKS[d], id=f"{c}-{d}") for c in RUNTIME_CONFIGS
                 for d in ("cpu", "cuda", "cuda:1") if (c, d) != ("no cache", "cpu")]


@pytest.mark.parametrize("config,device", RUNTIME_CASES)
def test_runtime_matches_cpu(art, batches, cpu_ref, device, config):
    """Every fixture batch, twice (cold, then warm cache): pooled embeddings and
    probabilities against the CPU runtime without a cache."""
    rt = Runtime.from_artifact(art, RuntimeConfig(device=device, **RUNTIME_CONFIGS[config]))
    where = rt.cache.slots if rt.cache is not None else rt.table
    assert where is not None and where.device == rt.device
    if rt.cache is not None and rt.device.type == "cuda":
        assert rt.cache.host.miss_path == RUNTIME_CONFIGS[config].get("cache_miss_path", "host")
    for _ in range(2):
        for bt, ref in zip(batches, cpu_ref, strict=True):
            sparse = _sparse(bt)
            with torch.inference_mode():
                emb = rt.store.embed(sparse.values, sparse.lengths, bt["dense"].shape[0]).cpu()
            if ref["one_hot"]:
                assert torch.equal(emb, ref["emb"])
            else:
                _assert_close_to_cpu(emb, ref["emb"], device, EMB_TOL)
            _assert_close_to_cpu(rt.predict(bt["dense"], sparse), ref["p"], device, PROB_TOL)
    st = rt.stats()
    assert st.hits + st.misses == st.lookups > 0


# -- an imported model's layout: tables of different dims and dtypes, a shared table ---

MIXED_TABLES = (("t_user", 300, 32, "sum", "int8"), ("t_item", 500, 16, "sum", "fp16"),
                ("t_tag", 40, 8, "mean", "int8"))
MIXED_FEATURES = (("user_id", "t_user", 1), ("item_id", "t_item", 1),
                  ("history", "t_item", 6), ("tags", "t_tag", 3))


class _Head(torch.nn.Module):
    """A plain MLP over [dense (B, 4), pooled (B, 32 + 16 + 16 + 8)] -> logits (B,)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat((dense, pooled), 1)).reshape(-1)


@pytest.fixture(scope="module")
def mixed_art() -> Artifact:
    """Random tables in the layout above and a ``torch.export`` dense part, both made here
    with stock PyTorch (the GPU machine has no TorchRec; an exported program is loaded by
    the torch that made it)."""
    import io

    from serve.runtime.artifact import ExportedDense, QuantTable, quantize_rows_reference
    from serve.schema import FeatureSpec, ModelSchema, TableSpec

    schema = ModelSchema(4, tuple(TableSpec(*t) for t in MIXED_TABLES),
                         tuple(FeatureSpec(*f) for f in MIXED_FEATURES))
    g = torch.Generator().manual_seed(0)
    tables = [QuantTable(t.name, t.rows, t.dim, t.dtype, quantize_rows_reference(
        (torch.rand((t.rows, t.dim), generator=g) - 0.5) * 0.4, t.dtype)) for t in schema.tables]
    torch.manual_seed(0)
    head = _Head(4 + schema.pooled_dim).eval()
    b = torch.export.Dim("B", min=1, max=1 << 16)
    ep = torch.export.export(head, (torch.zeros(2, 4), torch.zeros(2, schema.pooled_dim)),
                             dynamic_shapes=({0: b}, {0: b}), strict=False)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    program = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return Artifact(schema, tables, ExportedDense(program))


def _mixed_batch(b: int, seed: int) -> tuple[torch.Tensor, SparseBatch]:
    """Lengths 0..max_ids per feature (1 for the one-hot ones), ids up to twice the rows
    (wrapping), feature-major."""
    g = torch.Generator().manual_seed(seed)
    rows = {t[0]: t[1] for t in MIXED_TABLES}
    lengths = torch.stack([torch.randint(1 if m == 1 else 0, m + 1, (b,), generator=g,
                                         dtype=torch.int32) for _, _, m in MIXED_FEATURES])
    values = torch.cat([torch.randint(0, 2 * rows[t], (int(lengths[f].sum()),), generator=g)
                        for f, (_, t, _) in enumerate(MIXED_FEATURES)])
    return torch.randn(b, 4, generator=g), SparseBatch(values, lengths)


MIXED_CASES = [pytest.param(c, d, marks=_MARKS[d], id=f"{c}-{d}") for c in RUNTIME_CONFIGS
               if c != "lru 1 slot, host misses"
               for d in ("cpu", "cuda", "cuda:1") if (c, d) != ("no cache", "cpu")]


@pytest.mark.parametrize("config,device", MIXED_CASES)
def test_mixed_dims_and_shared_table_match_cpu(mixed_art, device, config):
    """Two rounds (cold, warm) of batches 1, 7 and 64: pooled embeddings (B, 72) and
    probabilities against the CPU runtime without a cache; exact on CPU (a cache changes
    nothing), within EMB_TOL / PROB_TOL on CUDA."""
    ref = Runtime(mixed_art, RuntimeConfig(cache_load_factor=1.0))
    rt = Runtime(mixed_art, RuntimeConfig(device=device, **RUNTIME_CONFIGS[config]))
    assert len(rt.store.ids.groups) == 3 and not rt.store.ids.single
    for _ in range(2):
        for b, seed in ((1, 1), (7, 2), (64, 3)):
            dense, sparse = _mixed_batch(b, seed)
            with torch.inference_mode():
                want_emb = ref.store.embed(sparse.values, sparse.lengths, b).clone()
                emb = rt.store.embed(sparse.values, sparse.lengths, b).cpu()
            assert emb.shape == (b, 72)
            _assert_close_to_cpu(emb, want_emb, device, EMB_TOL)
            _assert_close_to_cpu(rt.predict(dense, sparse), ref.predict(dense, sparse), device,
                                 PROB_TOL)
    st = rt.stats()
    assert st.hits + st.misses == st.lookups > 0
    rt.close()


# -- CUDA graphs ------------------------------------------------------------------------

GRAPH_CONFIGS: dict[str, dict[str, Any]] = {
    "no cache": {"cache_load_factor": 1.0},
    # 40% of the fixture's 9011 rows = 3605 slots >= 2 x 26 ids x 64: static_ok at batch 64
    "lru 40%, mapped misses": {"cache_load_factor": 0.4, "cache_miss_path": "mapped",
                               "cache_on_cpu": True},
}


def _one_hot(b: int, seed: int) -> tuple[torch.Tensor, SparseBatch]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 3000, (F * b,), generator=g)   # beyond the rows too: wrap
    return torch.randn(b, 13, generator=g), SparseBatch(values, torch.ones((F, b),
                                                                           dtype=torch.int32))


def _graph_predict(rt: Runtime, dense: torch.Tensor, sparse: SparseBatch) -> torch.Tensor:
    """A predict through the CUDA-graph path; on CPU its body run eagerly (the same tensor
    program the graph records, fixed-shape cache step included)."""
    b = dense.shape[0]
    if rt.device.type == "cuda":
        out = rt.predict(dense, sparse)
        assert b in rt.graphs.captured, "predict did not go through a CUDA graph"
        return out
    with torch.inference_mode():
        return rt.graphs.body(sparse.values, dense, *rt.store.static_positions(b), b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", list(GRAPH_CONFIGS))
def test_cuda_graph_capture_and_replay_match_cpu(art, device, config):
    """One capture per batch size, then replays with fresh inputs (a stale static input
    would answer the previous batch): each against the CPU runtime. The same batch twice
    hits the cache for every id the second time (capacity >= 2 x ids, LRU), so the
    graph really updates the cache on replay; counters stay exact (the capture's warm-up
    lookups are not counted)."""
    rt = Runtime.from_artifact(art, RuntimeConfig(device=device, cuda_graphs=True,
                                                  **GRAPH_CONFIGS[config]))
    ref = Runtime.from_artifact(art, RuntimeConfig(cache_load_factor=1.0))
    for b in (1, 7, 64):
        if rt.cache is not None:
            assert rt.cache.static_ok(F * b)
        for seed in range(3):
            dense, sparse = _one_hot(b, seed=100 * b + seed)
            want = ref.predict(dense, sparse)
            before = rt.stats()
            _assert_close_to_cpu(_graph_predict(rt, dense, sparse), want, device, PROB_TOL)
            mid = rt.stats()
            _assert_close_to_cpu(_graph_predict(rt, dense, sparse), want, device, PROB_TOL)
            after = rt.stats()
            if rt.cache is not None or rt.device.type == "cuda":
                assert mid.lookups - before.lookups == F * b
                assert (after.lookups - mid.lookups, after.hits - mid.hits) == (F * b, F * b)
    if rt.device.type == "cuda":
        assert sorted(rt.graphs.captured) == [1, 7, 64]
        multi = SparseBatch(torch.arange(2 * F), torch.full((F, 1), 2, dtype=torch.int32))
        dense = torch.randn(1, 13)
        _assert_close_to_cpu(rt.predict(dense, multi), ref.predict(dense, multi), device,
                             PROB_TOL)   # multi-hot: eager, no new graph
        assert sorted(rt.graphs.captured) == [1, 7, 64]


@pytest.mark.parametrize("device", DEVICES)
def test_forward_cap_splits_a_batch_on_the_device(art, device):
    """A batch of 3 x 64 + 5 one-hot samples through a runtime capped at 64 per forward:
    four forwards (on CUDA three replays of the batch-64 graph and one batch-5 capture,
    with the cache's fixed-shape step), the probabilities of the CPU runtime split alike
    (on CPU chunks and one forward can differ by an ulp: tests/test_runtime.py)."""
    rt = Runtime.from_artifact(art, RuntimeConfig(
        device=device, cuda_graphs=True, max_forward_instances=64, cache_load_factor=0.4,
        cache_miss_path="mapped", cache_on_cpu=True))
    ref = Runtime.from_artifact(art, RuntimeConfig(cache_load_factor=1.0,
                                                   max_forward_instances=64))
    dense, sparse = _one_hot(3 * 64 + 5, seed=12)
    _assert_close_to_cpu(rt.predict(dense, sparse), ref.predict(dense, sparse), device, PROB_TOL)
    st = rt.stats()
    assert (st.forwards, st.samples, st.lookups) == (4, 3 * 64 + 5, F * (3 * 64 + 5))
    if rt.device.type == "cuda":
        assert sorted(rt.graphs.captured) == [5, 64]


# -- a second device --------------------------------------------------------------------

@pytest.mark.parametrize("device", _on("cuda:1"))
def test_runtime_on_cuda1_leaves_cuda0_alone(art, batches, cpu_ref, device):
    """With cuda:0 current, runtimes on cuda:1 (host and mapped misses, CUDA graphs, a
    batch split by the forward cap) keep every tensor there, allocate nothing on cuda:0,
    leave the current device as it was, and answer as the CPU does."""
    torch.cuda.set_device(0)
    gc.collect()
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    host = Runtime.from_artifact(art, RuntimeConfig(device=device, cache_load_factor=0.2,
                                                    max_forward_instances=16))
    graphs = Runtime.from_artifact(art, RuntimeConfig(
        device=device, cache_load_factor=0.4, cache_miss_path="mapped", cuda_graphs=True))
    for rt in (host, graphs):
        assert rt.device == torch.device("cuda", 1) and rt.cache is not None
        assert rt.cache.slots.device == rt.device and rt.cache.index.row_to_slot.device == rt.device
        for bt, ref in zip(batches, cpu_ref, strict=True):
            got = rt.predict(bt["dense"], _sparse(bt))
            _assert_close_to_cpu(got, ref["p"], device, PROB_TOL)
    assert sorted(graphs.graphs.captured) == [1, 64]     # the one-hot fixture batches
    assert host.stats().forwards > len(batches)   # the batches of 64 and 256 were split
    for rt in (host, graphs):
        rt.close()
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert torch.cuda.memory_allocated(0) == before


# -- what the GPU machine has -----------------------------------------------------------

def test_gpu_tests_import_only_what_the_gpu_machine_has():
    """The GPU machine has torch, numpy, pytest, prometheus-client and pyyaml only: this
    module and bench.gpu_check must import without TorchRec, FBGEMM, TorchServe, orjson,
    httpx or FastAPI (run in a fresh interpreter with those imports refused)."""
    code = (
        "import importlib.abc, sys\n"
        "BLOCK = {'torchrec', 'fbgemm_gpu', 'ts', 'orjson', 'httpx', 'fastapi', 'starlette',"
        " 'uvicorn', 'pydantic', 'locust', 'requests'}\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCK:\n"
        "            raise ImportError(f'not on the GPU machine: {name}')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import tests.test_gpu, bench.gpu_check\n"
        "print('imported')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", proc.stderr[-2000:]
