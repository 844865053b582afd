"""The capacity advisor's sampler (serve.common.reuse): exact LRU stack depths against a
brute-force reference on seeded Zipf streams, the sampled and fixed-size variants, and
the hit ratio curve its histogram predicts against a simulated LRU cache; the worker's
hook (serve.worker.recording.ReuseRecorder) on a real tiny model."""
from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from serve.api.config import HandlerConfig
from serve.api.json_body import example_request
from serve.api.request import JSON_MEDIA_TYPE
from serve.common.reuse import HASH_SPACE, ReuseSampler, lru_stack_depths, row_hashes
from serve.common.zipf import zeta_cdf, zipf_ranks
from serve.constants import ARTIFACT_NAME
from serve.errors import ConfigError
from serve.metrics.worker import HandlerMetrics, ReuseMetrics
from serve.ops.cache_advice import parse_reuse
from serve.worker import Worker, WorkerRequest
from serve.worker.recording import reuse_sample_from_env
from tests.fixtures.torchserve import tiny_random_artifact


def _stream(seed: int, n: int, rows: int, tables: int, alpha: float = 1.05
            ) -> tuple[np.ndarray, np.ndarray]:
    """(table int64 (n,), id int64 (n,)): Zipf ids over ``tables`` tables of ``rows`` rows,
    the hot ids spread by a permutation per table."""
    rng = np.random.default_rng(seed)
    cdf = zeta_cdf(rows, alpha)
    table = rng.integers(0, tables, n)
    perms = [np.random.default_rng([seed, t]).permutation(rows) for t in range(tables)]
    ranks = zipf_ranks(rng, n, rows, alpha, cdf)
    ids = np.empty(n, dtype=np.int64)
    for t in range(tables):
        ids[table == t] = perms[t][ranks[table == t]]
    return table, ids


def _feed(sampler: ReuseSampler, table: np.ndarray, ids: np.ndarray, batch: int
          ) -> tuple[list[float], int]:
    depths: list[float] = []
    first = 0
    for i in range(0, ids.size, batch):
        out = sampler.observe(table[i:i + batch], ids[i:i + batch])
        depths += out.depths.tolist()
        first += out.first
    return depths, first


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_sampling_gives_the_exact_lru_stack_depths(seed):
    table, ids = _stream(seed, 6000, 3000, 3)
    # A short timestamp span: the renumbering runs many times on the way.
    sampler = ReuseSampler(1.0, max_rows=10_000, timestamps=20_000)
    depths, first = _feed(sampler, table, ids, batch=512)
    ref = lru_stack_depths(row_hashes(table, ids).tolist())
    assert first == sum(d is None for d in ref)
    assert depths == [float(d) for d in ref if d is not None]


def test_compaction_keeps_the_depths_exact():
    table, ids = _stream(3, 5000, 500, 1)
    sampler = ReuseSampler(1.0, max_rows=600, timestamps=1200)  # renumbers every ~600
    depths, _ = _feed(sampler, table, ids, batch=97)
    ref = lru_stack_depths(row_hashes(table, ids).tolist())
    assert depths == [float(d) for d in ref if d is not None]


def test_sampled_depths_are_the_sampled_streams_scaled_by_one_over_r():
    table, ids = _stream(4, 20_000, 5000, 2)
    rate = 0.1
    sampler = ReuseSampler(rate, max_rows=100_000)
    depths, first = _feed(sampler, table, ids, batch=1000)
    keys = row_hashes(table, ids)
    kept = keys[(keys >> np.uint64(32)) < np.uint64(sampler.threshold)].tolist()
    ref = lru_stack_depths(kept)
    assert first == sum(d is None for d in ref)
    expect = [(d - 1) / sampler.rate + 1 for d in ref if d is not None]
    np.testing.assert_allclose(depths, expect, rtol=1e-12)
    # A row is either always or never sampled; about R of the rows are.
    distinct = np.unique(keys)
    share = np.mean((distinct >> np.uint64(32)) < np.uint64(sampler.threshold))
    assert abs(share - rate) < 0.02


def test_fixed_size_lowers_the_rate_and_bounds_the_rows_tracked():
    table, ids = _stream(5, 50_000, 100_000, 2)
    sampler = ReuseSampler(0.5, max_rows=2000)
    _feed(sampler, table, ids, batch=4096)
    assert sampler.tracked <= 2000
    assert sampler.rate < 0.5
    assert sampler.threshold < HASH_SPACE // 2


def test_bad_rates_are_refused_with_the_rule():
    with pytest.raises(ValueError, match=r"rate=0 must be in \(0, 1\]; 0 turns the sampler off"):
        ReuseSampler(0)
    with pytest.raises(ValueError, match=r"timestamps=10 must be >= 2 x max_rows=8"):
        ReuseSampler(0.1, max_rows=8, timestamps=10)


def _lru_hit_ratio(keys: list[int], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(keys)


@pytest.mark.parametrize(("alpha", "rate", "max_rows"), [(1.05, 0.1, 100_000),
                                                         (0.9, 0.1, 100_000),
                                                         (1.05, 0.5, 3000)])
def test_predicted_hit_ratio_is_within_0_03_of_a_simulated_lru(alpha, rate, max_rows):
    """200k accesses over 2 tables x 50k rows; the histogram goes through the worker's
    metric (weighted buckets) and the advisor's parser, as in production. The last case
    starts at R = 0.5 and lets the fixed-size sampler lower it (to ~0.04)."""
    table, ids = _stream(7, 200_000, 50_000, 2, alpha)
    sampler = ReuseSampler(rate, max_rows=max_rows)
    reg = CollectorRegistry()
    metrics = ReuseMetrics(reg)
    for i in range(0, ids.size, 4096):
        out = sampler.observe(table[i:i + 4096], ids[i:i + 4096])
        metrics.observe(out.depths, out.first, out.weight, out.accesses)
    hist = parse_reuse(generate_latest(reg).decode())
    assert hist.accesses == ids.size
    keys = row_hashes(table, ids).tolist()
    capacities = [1500, 3000, 9000, 30_000]
    predicted = hist.hit_ratios([float(c) for c in capacities])
    for cap, pred in zip(capacities, predicted, strict=True):
        sim = _lru_hit_ratio(keys, cap)
        assert pred is not None and abs(pred - sim) <= 0.03, (cap, pred, sim)


def test_reuse_sample_from_env():
    assert reuse_sample_from_env({}) == 0.001
    assert reuse_sample_from_env({"DLRM_REUSE_SAMPLE": "0"}) == 0.0
    assert reuse_sample_from_env({"DLRM_REUSE_SAMPLE": "1"}) == 1.0
    with pytest.raises(ConfigError, match=r"DLRM_REUSE_SAMPLE='x' is not a number"):
        reuse_sample_from_env({"DLRM_REUSE_SAMPLE": "x"})
    with pytest.raises(ConfigError, match=r"DLRM_REUSE_SAMPLE"):
        reuse_sample_from_env({"DLRM_REUSE_SAMPLE": "1.5"})


def test_the_worker_samples_its_stable_models_ids(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copyfile(tiny_random_artifact(tmp_path / "a.pt", seed=0), model / ARTIFACT_NAME)
    cfg = HandlerConfig(num_threads=1, max_instances=64)

    def load(env: dict[str, str]) -> Worker:
        return Worker.load(model, cfg, model_version="tiny", device="cpu", workers=1,
                           environ=env, metrics=HandlerMetrics(CollectorRegistry()),
                           freeze_gc=False)

    assert load({"DLRM_REUSE_SAMPLE": "0"}).reuse is None
    w = load({"DLRM_REUSE_SAMPLE": "1"})
    body = orjson.dumps(example_request(8, seed=1))
    for _ in range(2):   # the same ids twice: every second access is a re-access
        assert [r.status for r in w.handle([WorkerRequest(body, JSON_MEDIA_TYPE)])] == [200]
    get = w.metrics.registry.get_sample_value
    lookups = 2 * 8 * len(w.runtime.schema.features)
    first = get("dlrm_reuse_first_accesses_total")
    again = get("dlrm_reuse_distance_rows_count")
    assert first is not None and again is not None
    assert first + again == lookups
    assert again >= lookups / 2   # the second batch re-reads every row of the first
