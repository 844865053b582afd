"""Runtime: a ranking batch whose context features are looked up once (SparseBatch.shared /
bag_of) gives bit for bit the probabilities of the same requests sent as independent
instances: plain tables, every cache policy and size, split forwards, mean pooling.
Random tiny models built in-test (fast, CPU)."""
import pytest
import torch

from serve.errors import InvalidInput
from serve.model.export import artifact_from_quantized_dlrm
from serve.profiles import get_profile
from serve.runtime.artifact import row_bytes
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch, expand_shared

F = 26


@pytest.fixture(scope="module")
def tiny_artifact():
    import copy

    from torchrec.inference.modules import quantize_inference_model

    from serve.model.dlrm import build_dlrm

    model = build_dlrm(get_profile("tiny"), seed=0).eval()
    with torch.no_grad():
        for t in model.sparse_arch.embedding_bag_collection.embedding_bags.values():
            t.weight.mul_(20.0)
    q = quantize_inference_model(copy.deepcopy(model), quantization_dtype=torch.int8).eval()
    return artifact_from_quantized_dlrm(q, "int8")


def ranking_batch(seed: int, sizes: list[int], context: list[tuple[int, ...]],
                  multi_hot: bool = True, max_id: int = 3000):
    """R requests of ``sizes[r]`` candidates; request r sends features ``context[r]`` once.

    Returns (dense (B, 13), shared SparseBatch, the same requests expanded)."""
    g = torch.Generator().manual_seed(seed)
    b = sum(sizes)
    hi = 4 if multi_hot else 2
    lo = 0 if multi_hot else 1
    cells = [[None] * b for _ in range(F)]         # ids of (feature, sample), expanded
    own = [[True] * b for _ in range(F)]           # whether the sample holds its bag
    bag = torch.arange(b).repeat(F, 1)
    start = 0
    for n, ctx in zip(sizes, context, strict=True):
        for f in range(F):
            if f in ctx:
                ids = torch.randint(0, max_id, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                    generator=g)
                for s in range(start, start + n):
                    cells[f][s] = ids
                    own[f][s] = s == start
                    bag[f, s] = start
            else:
                for s in range(start, start + n):
                    k = int(torch.randint(lo, hi, (1,), generator=g))
                    cells[f][s] = torch.randint(0, max_id, (k,), generator=g)
        start += n
    dense = torch.randn(b, 13, generator=g)
    lengths = torch.tensor([[len(c) for c in row] for row in cells], dtype=torch.int32)
    values = torch.cat([c for row in cells for c in row]).long()
    expanded = SparseBatch(values, lengths)
    shared = tuple(sorted({f for ctx in context for f in ctx}))
    s_len = torch.tensor([[len(cells[f][s]) if own[f][s] else 0 for s in range(b)]
                          for f in range(F)], dtype=torch.int32)
    s_val = torch.cat([cells[f][s] for f in range(F) for s in range(b) if own[f][s]]).long()
    return dense, SparseBatch(s_val, s_len, shared, bag[list(shared)].contiguous()), expanded


CTX = tuple(range(13))      # the user half of the features


@pytest.mark.parametrize("multi_hot", [True, False])
def test_context_equals_expanded(tiny_artifact, multi_hot):
    rt = Runtime.from_artifact(tiny_artifact)
    for seed in range(3):
        dense, shared, expanded = ranking_batch(seed, [7, 1, 30], [CTX, CTX, (0, 5, 20)],
                                                multi_hot)
        assert shared.values.numel() < expanded.values.numel()
        got = rt.predict(dense, shared)
        assert torch.equal(got, rt.predict(dense, expanded)), seed
        again = expand_shared(shared)
        assert torch.equal(again.values, expanded.values)
        assert torch.equal(again.lengths, expanded.lengths)


@pytest.mark.parametrize("multi_hot", [True, False])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", [1, 40, None])
def test_context_with_the_cache(tiny_artifact, policy, slots, multi_hot):
    rb = row_bytes("int8", tiny_artifact.embedding_dim)
    plain = Runtime.from_artifact(tiny_artifact)
    cached = Runtime.from_artifact(tiny_artifact, RuntimeConfig(
        cache_on_cpu=True, cache_policy=policy, cache_load_factor=0.2 if slots is None else None,
        cache_bytes=None if slots is None else slots * rb))
    for seed in range(4):
        dense, shared, expanded = ranking_batch(10 + seed, [5, 9], [CTX, CTX], multi_hot)
        assert torch.equal(cached.predict(dense, shared), plain.predict(dense, expanded)), seed


def test_a_split_forward_copies_the_shared_bags(tiny_artifact):
    """Chunks of 4 cut requests in the middle: the shared bags are expanded first."""
    whole = Runtime.from_artifact(tiny_artifact)
    split = Runtime.from_artifact(tiny_artifact, RuntimeConfig(max_forward_instances=4))
    dense, shared, expanded = ranking_batch(3, [6, 3, 5], [CTX, (), CTX])
    assert torch.equal(split.predict(dense, shared), split.predict(dense, expanded))
    assert torch.allclose(split.predict(dense, shared), whole.predict(dense, shared),
                          rtol=0, atol=1e-6)


def test_context_counts_its_lookups_once(tiny_artifact):
    rt = Runtime.from_artifact(tiny_artifact)
    dense, shared, expanded = ranking_batch(4, [20], [CTX])
    rt.predict(dense, shared)
    once = rt.stats().lookups
    rt.predict(dense, expanded)
    assert once == shared.values.numel() < rt.stats().lookups - once == expanded.values.numel()


@pytest.mark.parametrize("change,rule", [
    (lambda s: SparseBatch(s.values, s.lengths, s.shared, None), "bag_of must be int64"),
    (lambda s: SparseBatch(s.values, s.lengths, s.shared, s.bag_of.int()), "bag_of must be int64"),
    (lambda s: SparseBatch(s.values, s.lengths, (0, 0) + s.shared[2:], s.bag_of), "distinct"),
    (lambda s: SparseBatch(s.values, s.lengths, s.shared, s.bag_of.flip(1).contiguous()),
     "earlier sample"),
    (lambda s: SparseBatch(s.values, s.lengths, s.shared,
                           torch.where(s.bag_of == 3, 2, s.bag_of)), "its own sample"),
])
def test_bad_shared_bags_are_refused(tiny_artifact, change, rule):
    rt = Runtime.from_artifact(tiny_artifact)
    dense, shared, _ = ranking_batch(5, [3, 4], [CTX, CTX])
    with pytest.raises(InvalidInput, match=rule):
        rt.predict(dense, change(shared))


def test_a_borrowing_sample_with_ids_is_refused(tiny_artifact):
    rt = Runtime.from_artifact(tiny_artifact)
    dense, _, expanded = ranking_batch(6, [3], [(0,)], multi_hot=False)
    # the expanded ids and lengths with a bag_of saying samples 1, 2 borrow sample 0's C1
    bad = SparseBatch(expanded.values, expanded.lengths, (0,), torch.zeros((1, 3), dtype=torch.int64))
    with pytest.raises(InvalidInput, match="C1: a sample that reads another"):
        rt.predict(dense, bad)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_a_shared_dense_vector_runs_the_bottom_mlp_once_and_exactly(tiny_artifact, precision):
    """Candidates of one request share the dense vector: the bottom MLP runs once per run
    of equal rows, the same for the context form and its expanded instances (the rows are
    compared, not the form), and within rounding of running it per row."""
    rt = Runtime.from_artifact(tiny_artifact, RuntimeConfig(dense_precision=precision))
    dense, shared, expanded = ranking_batch(8, [6, 1, 9], [CTX, CTX, CTX])
    dense = torch.cat([dense[:1].repeat(6, 1), dense[6:7], dense[7:8].repeat(9, 1)])
    got = rt.predict(dense, shared)
    assert torch.equal(got, rt.predict(dense, expanded))
    rt._dense_runs = False       # the reference: the bottom MLP on every row
    per_row = rt.predict(dense, expanded)
    tol = 1e-6 if precision == "fp32" else 2e-2
    assert torch.allclose(got, per_row, rtol=0, atol=tol)


@pytest.mark.parametrize("cache", [False, True])
def test_after_a_delta_the_context_reads_the_new_rows(tiny_artifact, cache):
    """A delta rewrites the rows a context feature reads: the context form sees them at
    once (cache on and off) and still equals its expanded instances."""
    rt = Runtime.from_artifact(tiny_artifact, RuntimeConfig(
        cache_on_cpu=cache, cache_load_factor=0.2 if cache else None))
    dense, shared, expanded = ranking_batch(9, [12, 5], [CTX, CTX])
    before = rt.predict(dense, shared)
    table = rt.schema.feature_tables[0]                       # C1's table, in the context
    rows = rt.table_rows[table]
    ids = torch.unique(shared.values[:int(shared.lengths[0].sum())] % rows)
    new = torch.randint(0, 256, (ids.numel(), rt.row_bytes), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1))
    rt.update_rows(table, ids, new)
    after = rt.predict(dense, shared)
    assert not torch.equal(after, before)
    assert torch.equal(after, rt.predict(dense, expanded))
