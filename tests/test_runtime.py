"""Runtime: exact against TorchRec's quantized DLRM, cache-exact at any capacity, stats,
input errors, determinism. Random tiny models built in-test (fast, CPU)."""
import copy
import dataclasses

import pytest
import torch

from serve.errors import ConfigError, InvalidInput
from serve.model.export import artifact_from_float_dlrm, artifact_from_quantized_dlrm
from serve.profiles import get_profile
from serve.runtime.artifact import row_bytes, save_artifact
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

F = 26
# Float reordering between FBGEMM's kernel and ours, or between GEMMs of different batch
# sizes: a few ulp. Paths with the same arithmetic (cached vs uncached, the CUDA-graph body
# vs predict, on one device and batch) are compared with torch.equal instead.
EXACT_TOL = 1e-6


@pytest.fixture(scope="module")
def tiny_models():
    """(TorchRec float DLRM, TorchRec int8 DLRM, int8 artifact, fp32 artifact)."""
    from torchrec.inference.modules import quantize_inference_model

    from serve.model.dlrm import build_dlrm

    profile = get_profile("tiny")
    model = build_dlrm(profile, seed=0).eval()
    # Default init is tiny; spread the tables so interactions matter in the output.
    with torch.no_grad():
        for t in model.sparse_arch.embedding_bag_collection.embedding_bags.values():
            t.weight.mul_(20.0)
    qmodel = quantize_inference_model(copy.deepcopy(model), quantization_dtype=torch.int8).eval()
    return (profile, model, qmodel, artifact_from_quantized_dlrm(qmodel, "int8"),
            artifact_from_float_dlrm(model))


def _batch(seed: int, b: int, multi_hot: bool, max_id: int = 3000, alpha: float = 1.2):
    """Zipf-skewed ids (so caches hit), some >= the table rows (wrap), dense ~ N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(0, 4, (F, b), generator=g, dtype=torch.int32) if multi_hot
               else torch.ones((F, b), dtype=torch.int32))
    probs = 1.0 / torch.arange(1, max_id + 1).double() ** alpha
    values = torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)
    return torch.randn(b, 13, generator=g), SparseBatch(values, lengths)


def _torchrec_predict(profile, model, dense, sparse):
    from serve.model.dlrm import make_kjt

    per_feature = sparse.lengths.sum(1)
    rows = torch.tensor(profile.cardinalities).repeat_interleave(per_feature)
    vals = (sparse.values % rows).split(per_feature.tolist())   # our documented wrap rule
    kjt = make_kjt(profile.feature_names, list(vals), list(sparse.lengths))
    with torch.no_grad():
        return torch.sigmoid(model(dense, kjt).squeeze(1))


@pytest.mark.parametrize("multi_hot", [False, True])
def test_matches_torchrec_quantized_model(tiny_models, multi_hot):
    profile, model, qmodel, art, fart = tiny_models
    rt = Runtime.from_artifact(art)
    frt = Runtime.from_artifact(fart)
    worst_q = worst_f = 0.0
    for seed in range(3):
        dense, sparse = _batch(seed, 64, multi_hot)
        ours = rt.predict(dense, sparse)
        assert ours.shape == (64,) and ours.dtype == torch.float32 and ours.device.type == "cpu"
        worst_q = max(worst_q, (ours - _torchrec_predict(profile, qmodel, dense, sparse)).abs().max().item())
        # fp32 artifact vs TorchRec's float model: same code path, no quantization.
        fp = _torchrec_predict(profile, model, dense, sparse)
        assert (frt.predict(dense, sparse) - fp).abs().max().item() <= EXACT_TOL
        worst_f = max(worst_f, (ours - fp).abs().max().item())
    assert worst_q <= EXACT_TOL
    # int8 tables vs fp32: a real, bounded quantization error (reported, not exactness).
    print(f"max |p_int8 - p_fp32| = {worst_f:.3g}; max |ours - torchrec int8| = {worst_q:.3g}")
    assert 0 < worst_f < 0.05


def _cfg(policy: str, slots: int | None, rb: int, lf: float | None = None) -> RuntimeConfig:
    return RuntimeConfig(cache_on_cpu=True, cache_policy=policy,
                         cache_load_factor=lf, cache_bytes=None if slots is None else slots * rb)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots,lf", [(1, None), (40, None), (None, 0.2), (None, 1.0)])
def test_cached_equals_uncached(tiny_models, policy, slots, lf):
    """Any capacity (1 slot; fewer than one batch's unique ids; 20%; all) and policy."""
    _, _, _, art, _ = tiny_models
    rb = row_bytes("int8", art.embedding_dim)
    plain = Runtime.from_artifact(art)
    cached = Runtime.from_artifact(art, _cfg(policy, slots, rb, lf))
    for step in range(6):
        dense, sparse = _batch(100 + step, 48, multi_hot=step % 2 == 1)
        # Same rows, same dequantization, same bag order, same batch: bit-identical.
        assert torch.equal(cached.predict(dense, sparse), plain.predict(dense, sparse)), step
    st = cached.stats()
    assert st.hits + st.misses == st.lookups > 0
    if slots is not None:   # the small caches are full and really miss
        assert cached.cache.resident_rows().numel() == slots and st.misses > st.hits
    if lf == 1.0:
        assert st.evictions == 0 and st.hits > 0


def test_deterministic(tiny_models):
    _, _, _, art, _ = tiny_models
    cfg = RuntimeConfig(cache_on_cpu=True, cache_load_factor=0.05, cache_policy="lfu")
    a, b = Runtime.from_artifact(art, cfg), Runtime.from_artifact(art, cfg)
    for step in range(4):
        dense, sparse = _batch(7 + step, 32, multi_hot=True)
        assert torch.equal(a.predict(dense, sparse), b.predict(dense, sparse))
    assert torch.equal(a.cache.resident_rows(), b.cache.resident_rows())
    sa, sb = a.stats(), b.stats()
    assert (sa.hits, sa.misses, sa.evictions) == (sb.hits, sb.misses, sb.evictions)


def test_stats_on_a_hand_made_sequence(tiny_models):
    _, _, _, art, _ = tiny_models
    rb = row_bytes("int8", art.embedding_dim)
    total = sum(t.rows for t in art.tables)
    rt = Runtime.from_artifact(art, _cfg("lru", 26, rb))   # exactly one row per table fits
    dense = torch.zeros(2, 13)
    ones = torch.ones((F, 2), dtype=torch.int32)
    zeros_ids = SparseBatch(torch.zeros(2 * F, dtype=torch.int64), ones)
    rt.predict(dense, zeros_ids)     # 52 ids, 26 rows: all miss, all admitted
    rt.predict(dense, zeros_ids)     # all hit
    rt.predict(dense, SparseBatch(torch.ones(2 * F, dtype=torch.int64), ones))  # miss, evict 26
    rt.record_stage("decode", 0.25)
    st = rt.stats()
    assert (st.lookups, st.hits, st.misses, st.evictions) == (156, 52, 104, 26)
    assert st.hit_ratio == pytest.approx(52 / 156)
    assert (st.forwards, st.samples) == (3, 6)
    assert st.host_bytes == total * rb
    assert st.device_bytes == 27 * rb + (total + 1) * 4 + 27 * 8 + 27 * 8   # + dump entries
    assert st.stage_seconds["decode"] == 0.25
    assert st.stage_seconds["embedding"] > 0 and st.stage_seconds["dense"] > 0
    # CPU inside predict (the worker's dlrm_predict_cpu_seconds_total): it moves with
    # each predict and never by a read
    assert st.predict_cpu_seconds > 0
    assert rt.stats().predict_cpu_seconds == st.predict_cpu_seconds
    rt.predict(dense, zeros_ids)
    assert rt.stats().predict_cpu_seconds > st.predict_cpu_seconds
    plain = Runtime.from_artifact(art)
    plain.predict(dense, zeros_ids)
    ps = plain.stats()
    assert (ps.lookups, ps.hits, ps.misses, ps.hit_ratio) == (52, 52, 0, 1.0)
    assert (ps.device_bytes, ps.host_bytes) == (total * rb, 0)


def test_ids_beyond_rows_wrap_modulo(tiny_models):
    _, _, _, art, _ = tiny_models
    rt = Runtime.from_artifact(art)
    dense, sparse = _batch(3, 8, multi_hot=False)
    rows = torch.tensor([t.rows for t in art.tables]).repeat_interleave(8)
    shifted = SparseBatch(sparse.values + 7 * rows, sparse.lengths)
    assert torch.equal(rt.predict(dense, sparse), rt.predict(dense, shifted))


def test_negative_id_is_rejected_naming_the_feature(tiny_models):
    _, _, _, art, _ = tiny_models
    rt = Runtime.from_artifact(art, RuntimeConfig(cache_on_cpu=True))
    dense, sparse = _batch(4, 4, multi_hot=False)
    values = sparse.values.clone()
    values[2 * 4 + 3] = -5          # feature C3, sample 3
    with pytest.raises(InvalidInput, match=r"^sparse feature C3: id -5 \(sample 3\) is negative; "
                       r"ids must be integers >= 0 \(ids >= the table's 500 rows wrap modulo rows\)$"):
        rt.predict(dense, SparseBatch(values, sparse.lengths))
    assert rt.stats().forwards == 0


def test_malformed_inputs(tiny_models):
    _, _, _, art, _ = tiny_models
    rt = Runtime.from_artifact(art)
    dense, sparse = _batch(5, 4, multi_hot=True)
    with pytest.raises(InvalidInput, match=r"dense must be a \(B, 13\) float tensor, got \(4, 12\)"):
        rt.predict(dense[:, :12], sparse)
    with pytest.raises(InvalidInput, match=r"sparse lengths must be \(26, B=4\) .*got \(26, 3\)"):
        rt.predict(dense, SparseBatch(sparse.values, sparse.lengths[:, :3]))
    with pytest.raises(InvalidInput, match=r"sparse lengths sum to \d+ but values hold \d+ ids"):
        rt.predict(dense, SparseBatch(sparse.values[:-1], sparse.lengths))
    assert rt.predict(torch.zeros(0, 13), SparseBatch(torch.zeros(0, dtype=torch.int64),
                                                      torch.zeros((F, 0), dtype=torch.int32))).shape == (0,)


def test_config_validation():
    with pytest.raises(ConfigError, match=r"cache_load_factor=0 must be a number in \(0, 1\]"):
        RuntimeConfig(cache_load_factor=0)
    with pytest.raises(ConfigError, match=r"cache_policy 'fifo' is not one of"):
        RuntimeConfig(cache_policy="fifo")
    with pytest.raises(ConfigError, match=r"device 'tpu' is not a torch device; use 'cpu'"):
        RuntimeConfig(device="tpu")
    with pytest.raises(ConfigError, match=r"device 'meta': only 'cpu' and 'cuda\[:N\]'"):
        RuntimeConfig(device="meta")
    with pytest.raises(ConfigError, match=r"dense_precision 'fp8' is not one of"):
        RuntimeConfig(dense_precision="fp8")


def test_loads_from_a_saved_artifact(tiny_models, tmp_path):
    _, _, _, art, _ = tiny_models
    save_artifact(art, tmp_path / "a.pt")
    dense, sparse = _batch(6, 16, multi_hot=True)
    assert torch.equal(Runtime.from_artifact(tmp_path / "a.pt").predict(dense, sparse),
                       Runtime.from_artifact(art).predict(dense, sparse))


@pytest.mark.parametrize("precision,tol", [("bf16", 2e-2), ("int8", 0.1)])
def test_lossy_dense_levers_are_bounded(tiny_models, precision, tol):
    """Opt-in levers: measured error against the exact fp32 dense path."""
    _, _, _, art, _ = tiny_models
    exact = Runtime.from_artifact(art)
    lossy = Runtime.from_artifact(art, RuntimeConfig(dense_precision=precision))
    dense, sparse = _batch(8, 64, multi_hot=False)
    diff = (lossy.predict(dense, sparse) - exact.predict(dense, sparse)).abs().max().item()
    print(f"{precision}: max |dp| = {diff:.3g}")
    assert diff <= tol


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RuntimeConfig().device = "cuda"  # type: ignore[misc]


# -- the CPU-runnable parts of the GPU check (bench/gpu_check.py) ------------------------

def test_gpu_check_exits_2_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the check would really run")
    from bench import gpu_check

    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_check_fixture_matches_the_cpu_runtime():
    """The carried expectations are what today's CPU runtime computes, in every config
    the GPU check serves them with (a stale fixture fails here, not on the GPU)."""
    from pathlib import Path

    from bench import gpu_check

    rows = gpu_check.check_exactness("cpu", Path("bench/gpu_fixture"))
    assert [r["config"] for r in rows] == [
        "no cache", "cache lru 20%", "cache lfu 20%", "cache lru 1 slot",
        "cache lfu 20%, aging every 100 ids, 16 per forward"]
    # A tolerance, not torch.equal: the carried probabilities were computed on the machine
    # that made the fixture (another MKL kernel/thread split), so even "no cache" differs
    # by an ulp here; cached vs uncached in one process is pinned exactly above.
    for r in rows:
        assert r["max_abs_diff_vs_cpu"] <= gpu_check.CACHE_TOL, r


def test_gpu_check_random_artifact_and_traffic_on_cpu():
    from bench import gpu_check

    art = gpu_check.build_random_artifact("tiny", torch.device("cpu"), chunk_rows=64)
    assert [t.rows for t in art.tables] == list(get_profile("tiny").cardinalities)
    rt = Runtime.from_artifact(art)
    z = gpu_check.ZipfTraffic([t.rows for t in art.tables], 1.05, torch.device("cpu"))
    ids = z.sample(256)
    assert ids.shape == (F, 256) and int(ids.min()) >= 0
    assert bool((ids < torch.tensor([t.rows for t in art.tables]).unsqueeze(1)).all())
    p = rt.predict(torch.rand(256, 13), SparseBatch(ids.reshape(-1),
                                                    torch.ones((F, 256), dtype=torch.int32)))
    assert p.shape == (256,) and bool(((p > 0) & (p < 1)).all())
    assert 0 < z.ideal_hit_ratio(10) < z.ideal_hit_ratio(1000) <= 1.0 + 1e-9


def test_graph_body_matches_predict_on_cpu(tiny_models):
    """The CUDA-graph body (wrap rule on static per-position tensors) is plain tensor code;
    run it eagerly on CPU against the normal path."""
    _, _, _, art, _ = tiny_models
    rt = Runtime.from_artifact(art)
    dense, sparse = _batch(9, 16, multi_hot=False)
    with torch.inference_mode():
        out = rt.graphs.body(sparse.values, dense, *rt.store.static_positions(16), 16)
    # dequantize_rows and the runtime's in-place dequantization round alike (one mul, one
    # add per element); the dense part is the same module on the same batch.
    assert torch.equal(out, rt.predict(dense, sparse))


def test_trained_tiny_model(tiny_build):
    """The pipeline's trained tiny model: cached == uncached on its eval split, and the
    int8-vs-fp32 gap in predictions and AUC is small."""
    import numpy as np

    from serve.common.quality import roc_auc
    from serve.model.data import load_split

    split = load_split(tiny_build.workdir / "data", "eval")
    n = min(len(split), 2048)
    dense = torch.from_numpy(np.array(split.dense[:n], dtype=np.float32))
    ids = torch.from_numpy(np.array(split.sparse[:n], dtype=np.int64))      # (n, F, M)
    if split.lengths is None:
        lengths = torch.ones((n, F), dtype=torch.int32)
    else:
        lengths = torch.from_numpy(np.array(split.lengths[:n], dtype=np.int32))
    mask = torch.arange(ids.shape[2]) < lengths.unsqueeze(2)                   # (n, F, M)
    values = ids.transpose(0, 1)[mask.transpose(0, 1)]                          # feature-major
    sparse = SparseBatch(values, lengths.t().contiguous())
    labels = np.asarray(split.labels[:n])
    q = Runtime.from_artifact(tiny_build.artifact)
    fp = Runtime.from_artifact(tiny_build.float_artifact)
    cached = Runtime.from_artifact(tiny_build.artifact,
                                   RuntimeConfig(cache_on_cpu=True, cache_load_factor=0.05))
    pq, pf = q.predict(dense, sparse), fp.predict(dense, sparse)
    pc = torch.cat([_slice_predict(cached, dense, sparse, i, 256) for i in range(0, n, 256)])
    # Cached vs uncached on the same 256-sample slices: the same arithmetic, bit-identical.
    pq_sliced = torch.cat([_slice_predict(q, dense, sparse, i, 256) for i in range(0, n, 256)])
    assert torch.equal(pc, pq_sliced)
    # Slices of 256 vs one batch of n: GEMMs of another height may block and sum in
    # another order (MKL picks kernels by shape): a few ulp, hence the tolerance.
    assert (pc - pq).abs().max().item() <= EXACT_TOL
    diff = (pq - pf).abs().max().item()
    auc_q, auc_f = roc_auc(labels, pq.numpy()), roc_auc(labels, pf.numpy())
    print(f"trained tiny: max |p_int8 - p_fp32| = {diff:.3g}; AUC int8 {auc_q:.4f} fp32 {auc_f:.4f}")
    assert diff < 0.05 and abs(auc_q - auc_f) < 0.01


def _slice_predict(rt: Runtime, dense: torch.Tensor, sparse: SparseBatch, i: int, b: int):
    """Predict samples i..i+b of a feature-major batch (re-slicing the jagged values)."""
    lengths = sparse.lengths
    per_sample_start = torch.cumsum(lengths.reshape(-1).long(), 0) - lengths.reshape(-1)
    starts = per_sample_start.view(lengths.shape)
    parts = []
    for f in range(lengths.shape[0]):
        j = min(i + b, lengths.shape[1])
        lo = int(starts[f, i])
        hi = int(starts[f, j - 1] + lengths[f, j - 1])
        parts.append(sparse.values[lo:hi])
    return rt.predict(dense[i:i + b], SparseBatch(torch.cat(parts), lengths[:, i:i + b].contiguous()))


def test_gpu_check_flow_dry_run_on_cpu(tmp_path):
    """The whole gpu_check flow (exactness, random tables, traffic, throughput, latency,
    JSON) on CPU with tiny sizes, so the GPU machine does not find its bugs first."""
    import json

    from bench import gpu_check

    out = tmp_path / "gc.json"
    rc = gpu_check.main(["--device", "cpu", "--quick", "--profile", "tiny", "--samples", "1500",
                         "--batches", "1,64", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["throughput"]] == [1, 64]
    assert all(r["ok"] for r in res["exactness"])
    assert 0 < res["cache"]["hit_ratio_overall"] <= 1
    assert set(res["latency_batch1"]) >= {"all on device, eager", "cache lf 0.2, eager"}
    # On CPU nothing runs as a CUDA graph: no row may claim it did.
    assert not [k for k in res["latency_batch1"] if "CUDA graph" in k], res["latency_batch1"]


def test_cached_graph_body_matches_predict_on_cpu(tiny_models):
    """The cached CUDA-graph body (fixed-shape cache lookup) run eagerly on CPU."""
    _, _, _, art, _ = tiny_models
    plain = Runtime.from_artifact(art)
    rt = Runtime.from_artifact(art, RuntimeConfig(cache_on_cpu=True, cache_load_factor=0.1))
    assert rt.cache is not None and rt.cache.static_ok(F * 8)
    with torch.inference_mode():
        for step in range(5):
            dense, sparse = _batch(40 + step, 8, multi_hot=False)
            out = rt.graphs.body(sparse.values, dense, *rt.store.static_positions(8), 8)
            assert torch.equal(out, plain.predict(dense, sparse)), step
    st = rt.stats()
    assert st.lookups == 5 * 8 * F and st.hits > 0


# -- forward cap: a large batch in chunks --------------------------------------------------

@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("cap", [3, 100, 512])
def test_forward_cap_gives_the_predictions_of_one_forward(tiny_models, cap, multi_hot):
    """B = 3 x cap + 5 samples through a runtime capped at ``cap`` per forward: the
    probabilities of one uncapped forward, within EXACT_TOL, not bit for bit. Each
    sample's arithmetic is the same, but MKL picks its GEMM blocking and its split over
    threads by the batch height, which can change a dot product's summation order.
    Measured on this CPU (AVX-512) with this model: with 2 threads, at any cap (16..8192,
    the default 8192 included) typically 1 sample of 1.5k-25k differs, by at most 2e-7;
    with 1 thread, caps that are multiples of 32 were bit-identical (next test)."""
    _, _, _, art, _ = tiny_models
    one = Runtime.from_artifact(art, RuntimeConfig(max_forward_instances=None))
    capped = Runtime.from_artifact(art, RuntimeConfig(max_forward_instances=cap))
    b = 3 * cap + 5
    dense, sparse = _batch(60 + cap, b, multi_hot)
    want, got = one.predict(dense, sparse), capped.predict(dense, sparse)
    assert got.shape == (b,)
    assert (got - want).abs().max().item() <= EXACT_TOL
    st = capped.stats()
    assert (st.forwards, st.samples, st.lookups) == (-(-b // cap), b, sparse.values.numel())
    # The chunks are re-sliced feature-major batches: bit-identical to predicting the same
    # slices one by one (same arithmetic, same batch heights).
    sliced = torch.cat([_slice_predict(one, dense, sparse, i, cap) for i in range(0, b, cap)])
    assert torch.equal(got, sliced)


@pytest.mark.parametrize("cap", [64, 512])
def test_forward_cap_on_one_thread_at_a_multiple_of_32(tiny_models, cap):
    """One intra-op thread and a cap that is a multiple of 32: the chunks are bit-identical
    to predicting the same slices one by one, and within EXACT_TOL of one forward.

    Bit-identical to one forward too on some CPUs (MKL's single-thread kernels block the
    batch in panels whose height divides 32: measured for 32..8192 on the CI machine of
    2026-11-30), but not on all: on an AVX512-FP16 Xeon (2026-12-01) the one-forward
    result differs in the last bits. So that is not asserted; the chunks' own arithmetic is.
    """
    _, _, _, art, _ = tiny_models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = Runtime.from_artifact(art, RuntimeConfig(max_forward_instances=None))
        capped = Runtime.from_artifact(art, RuntimeConfig(max_forward_instances=cap))
        for multi_hot in (False, True):
            dense, sparse = _batch(90 + cap, 3 * cap + 5, multi_hot)
            got = capped.predict(dense, sparse)
            sliced = torch.cat([_slice_predict(one, dense, sparse, i, cap)
                                for i in range(0, dense.shape[0], cap)])
            assert torch.equal(got, sliced)
            assert (got - one.predict(dense, sparse)).abs().max().item() <= EXACT_TOL
    finally:
        torch.set_num_threads(threads)


def test_forward_cap_with_a_cache_is_cached_equals_uncached(tiny_models):
    _, _, _, art, _ = tiny_models
    plain = Runtime.from_artifact(art, RuntimeConfig(max_forward_instances=16))
    cached = Runtime.from_artifact(art, RuntimeConfig(max_forward_instances=16, cache_on_cpu=True,
                                                      cache_load_factor=0.05, cache_policy="lfu"))
    for step in range(3):
        dense, sparse = _batch(70 + step, 16 * 3 + 5, multi_hot=step == 1)
        assert torch.equal(cached.predict(dense, sparse), plain.predict(dense, sparse))
    st = cached.stats()
    assert st.forwards == 3 * 4 and st.hits + st.misses == st.lookups


def test_forward_cap_default_matches_the_handler_config():
    from serve.api.config import HandlerConfig
    from serve.runtime.engine import DEFAULT_MAX_FORWARD_INSTANCES

    assert RuntimeConfig().max_forward_instances == DEFAULT_MAX_FORWARD_INSTANCES == 8192
    assert HandlerConfig().max_forward_instances == DEFAULT_MAX_FORWARD_INSTANCES
    assert HandlerConfig(max_forward_instances=None).max_forward_instances is None
    for bad in (0, True, 2.0):
        with pytest.raises(ConfigError, match=r"^handler.max_forward_instances=.* must be an "
                                               r"integer >= 1 or null$"):
            HandlerConfig(max_forward_instances=bad)


def test_new_config_fields_are_validated():
    with pytest.raises(ConfigError, match=r"^max_forward_instances=0 must be an integer >= 1 "):
        RuntimeConfig(max_forward_instances=0)
    with pytest.raises(ConfigError, match=r"^max_forward_instances=True must be an integer"):
        RuntimeConfig(max_forward_instances=True)
    with pytest.raises(ConfigError, match=r"^lfu_decay_every=-5 must be an integer >= 0"):
        RuntimeConfig(lfu_decay_every=-5)
    assert RuntimeConfig(max_forward_instances=None, lfu_decay_every=0).lfu_decay_every == 0


def test_lfu_decay_reaches_the_cache(tiny_models):
    from serve.runtime.cache import LFU_DECAY_PER_ROW

    _, _, _, art, _ = tiny_models
    total = sum(t.rows for t in art.tables)
    cfg = RuntimeConfig(cache_on_cpu=True, cache_policy="lfu", lfu_decay_every=500)
    rt = Runtime.from_artifact(art, cfg)
    assert rt.cache is not None and rt.cache.lfu_decay_every == 500
    dense, sparse = _batch(80, 64, multi_hot=False)      # 64 x 26 = 1664 ids: 3 halvings
    rt.predict(dense, sparse)
    assert rt.cache.counters.lfu_decays == 3
    default = Runtime.from_artifact(art, RuntimeConfig(cache_on_cpu=True, cache_policy="lfu"))
    assert default.cache is not None and default.cache.lfu_decay_every == LFU_DECAY_PER_ROW * total


def test_closed_runtime_refuses_to_predict(tiny_models):
    _, _, _, art, _ = tiny_models
    rt = Runtime.from_artifact(art, RuntimeConfig(cache_on_cpu=True))
    dense, sparse = _batch(81, 4, multi_hot=False)
    rt.predict(dense, sparse)
    rt.close()
    rt.close()
    with pytest.raises(RuntimeError, match=r"EmbeddingCache is closed"):
        rt.predict(dense, sparse)
