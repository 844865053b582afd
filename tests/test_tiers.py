"""The table tiers (serve.runtime.tiers): tables on disk served through device cache ->
bounded host tier -> pread from the table files, exact (torch.equal) against the same
tables in memory at every host budget, policy, with and without the device cache, mixed
row widths, after deltas (rows and managed ids); counters per tier consistent; loading
reads no table bytes. Small random models, CPU (the cuda ones are gpu-marked)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from serve.api.config import HandlerConfig
from serve.errors import ConfigError
from serve.metrics.worker import HandlerMetrics
from serve.runtime.artifact import Artifact, quantize_rows_reference
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.runtime.idmap import IdMap
from serve.runtime.rowsource import DiskRows, Overlay
from serve.runtime.tiers import host_capacity
from serve.schema import ModelSchema
from tests.fixtures.own_models import random_artifact
from tests.test_tiers_gpu import (
    FEATURES,
    ONE_WIDTH,
    ONE_WIDTH_FEATURES,
    TABLES,
    batches,
    budget_settings,
    on_disk,
)

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def mixed() -> Artifact:
    return random_artifact(TABLES, FEATURES, seed=3)


@pytest.fixture(scope="module")
def one_width() -> Artifact:
    return random_artifact(ONE_WIDTH, ONE_WIDTH_FEATURES, seed=4)


def _check_counters(rt: Runtime) -> None:
    """Per tier: hits <= lookups; for the host tier over the files, bytes read = rows
    read x each row's own width (here: the tables' widths)."""
    for c in rt.stats().tiers.values():
        assert 0 <= c.hits <= c.lookups
        assert c.misses == c.lookups - c.hits
        assert sum(c.miss_seconds_bins) == c.miss_seconds_count


@pytest.mark.parametrize("cache_on_cpu", [False, True])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("budget", [0, 0.1, 1.0, None])
def test_tiers_equal_in_memory(mixed, tmp_path, budget, policy, cache_on_cpu):
    ref = Runtime(mixed, RuntimeConfig(cache_policy=policy))
    art = on_disk(mixed, tmp_path / "v.tables")
    rt = Runtime(art, RuntimeConfig(cache_policy=policy, cache_on_cpu=cache_on_cpu,
                                    cache_load_factor=0.05, disk_read_threads=4,
                                    **budget_settings(budget)))
    assert rt.store.tiers is not None and rt.table is None and rt.shared is None
    assert (rt.cache is not None) == cache_on_cpu
    for dense, sparse in batches(mixed, 6, seed=1):
        assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, sparse))
    _check_counters(rt)
    host = rt.stats().tiers["host"]
    if budget == 0 or budget == 0.1:
        assert host.read_bytes > 0 and host.miss_rows > 0
    if budget is None:
        assert host.read_bytes == 0 and host.hits == host.lookups
    rt.close()
    rt.close()   # idempotent


@pytest.mark.parametrize("cache_on_cpu", [False, True])
@pytest.mark.parametrize("budget", [0, 0.1, None])
def test_counters_per_tier(one_width, tmp_path, budget, cache_on_cpu):
    """One row width: bytes read from a tier below = rows fetched x row bytes; the host
    tier under a device cache sees exactly the device tier's missed rows."""
    art = on_disk(one_width, tmp_path / "v.tables")
    rt = Runtime(art, RuntimeConfig(cache_on_cpu=cache_on_cpu, cache_load_factor=0.1,
                                    **budget_settings(budget)))
    rb = rt.row_bytes
    ids = 0
    for dense, sparse in batches(one_width, 5, seed=2):
        rt.predict(dense, sparse)
        ids += int(sparse.values.numel())
    _check_counters(rt)
    st = rt.stats()
    dev, host = st.tiers["device"], st.tiers["host"]
    if cache_on_cpu:
        assert dev.lookups == ids == st.lookups and dev.hits == st.hits
        assert dev.read_bytes == dev.miss_rows * rb and dev.miss_rows > 0
        assert host.lookups == dev.miss_rows            # one id per missed row
        assert dev.capacity_bytes == rt.cache.capacity * rb
    else:
        assert dev == type(dev)() and host.lookups == ids == st.lookups
    assert host.read_bytes == host.miss_rows * rb
    if budget == 0:
        assert host.hits == 0
        # under the device cache one id per missed row; on top, ids >= distinct rows
        assert (host.miss_rows == host.lookups) if cache_on_cpu else (
            0 < host.miss_rows <= host.lookups)
        assert host.capacity_bytes == 0
    if budget == 0.1:
        assert host.capacity_bytes == host_capacity(rt.total_rows, rb, art.files.nbytes,
                                                    host_bytes=None, host_fraction=0.1) * rb
        assert 0 < host.hits < host.lookups
    rt.close()


def _managed(art: Artifact, table: int, seed: int = 0) -> Artifact:
    """``art`` with table ``table`` managed by a random map of half its rows."""
    spec = art.schema.tables[table]
    rng = np.random.default_rng(seed)
    n = (spec.rows - 1) // 2
    ids = np.sort(rng.choice(np.arange(10_000, 20_000), size=n, replace=False))
    rows = rng.permutation(np.arange(1, spec.rows))[:n]
    specs = tuple(dataclasses.replace(t, mapping="managed") if i == table else t
                  for i, t in enumerate(art.schema.tables))
    schema = ModelSchema(art.schema.dense, specs, art.schema.features)
    maps = {spec.name: IdMap.from_arrays(ids.astype(np.int64), rows.astype(np.int64),
                                         spec.rows, 1)}
    return Artifact(schema, art.tables, art.dense, dict(art.meta), maps)


def _deltas(art: Artifact, rt: Runtime, seed: int) -> None:
    """Rows of every table and a managed table's ids changed (applied to ``rt``)."""
    rng = np.random.default_rng(seed)
    for t, spec in enumerate(art.schema.tables):
        ids = np.unique(rng.integers(0, min(spec.rows, 60), size=40))   # hot rows included
        w = torch.from_numpy(rng.uniform(-0.3, 0.3, (ids.size, spec.dim)).astype(np.float32))
        rt.update_rows(t, torch.from_numpy(ids.astype(np.int64)),
                       quantize_rows_reference(w, spec.dtype))
    m = rt.id_maps[0]
    mids, mrows = m.to_numpy()
    evict = np.sort(mids[: 5 + seed])
    free = np.setdiff1d(np.arange(1, art.schema.tables[0].rows), mrows[5 + seed:])
    new = np.sort(rng.choice(np.arange(30_000, 40_000), size=4, replace=False))
    rt.update_ids(0, torch.from_numpy(new.astype(np.int64)),
                  torch.from_numpy(free[:4].astype(np.int64)),
                  torch.from_numpy(evict.astype(np.int64)))


@pytest.mark.parametrize(("budget", "cache_on_cpu", "policy"),
                         [(0, False, "lru"), (0.1, True, "lfu"), (0.1, False, "lru"),
                          (1.0, True, "lru"), (None, False, "lfu"), (None, True, "lru")])
def test_deltas_stay_exact(mixed, tmp_path, budget, cache_on_cpu, policy):
    art = _managed(mixed, 0)
    ref = Runtime(art, RuntimeConfig(cache_policy=policy))
    rt = Runtime(on_disk(art, tmp_path / "v.tables"),
                 RuntimeConfig(cache_policy=policy, cache_on_cpu=cache_on_cpu,
                               cache_load_factor=0.1, **budget_settings(budget)))
    g = torch.Generator().manual_seed(5)
    for step, (dense, sparse) in enumerate(batches(art, 6, seed=3, max_id=40_000)):
        # managed feature 0 reads raw ids: mostly admitted ones, some unknown
        n0 = int(sparse.lengths[0].sum())
        known = torch.from_numpy(ref.id_maps[0].to_numpy()[0])
        vals = sparse.values.clone()
        vals[:n0] = known[torch.randint(0, known.numel(), (n0,), generator=g)]
        sparse = SparseBatch(vals, sparse.lengths)
        assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, sparse)), step
        if step in (1, 3):
            _deltas(art, ref, step)
            _deltas(art, rt, step)
    overlay = rt.store.tiers.bottom.overlay
    assert len(overlay) > 0 and rt.stats().host_bytes >= overlay.nbytes
    # the files are untouched: every row on disk is the build's
    for i, t in enumerate(art.tables):
        assert np.array_equal(np.fromfile(tmp_path / "v.tables" / f"t{i:03d}.rows",
                                          dtype=np.uint8), t.data.numpy().reshape(-1))
    rt.close()


def test_loading_reads_no_table_bytes(tmp_path):
    """A 40 MB table: building the runtime (bounded host tier, and mapped) reads no row;
    one batch then reads its rows only."""
    art = random_artifact((("big", 600_000, 64, "sum", "int8"),), (("f", "big", 1),), seed=1)
    disk = on_disk(art, tmp_path / "big.tables")
    assert disk.files.nbytes == 600_000 * 68

    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise AssertionError("no rchar")

    before = rchar()
    rt = Runtime(disk, RuntimeConfig(host_cache_fraction=0.1))
    mapped = Runtime(disk, RuntimeConfig())
    loaded = rchar() - before
    assert loaded < 1 << 20, f"loading read {loaded} bytes"
    assert rt.stats().tiers["host"].read_bytes == 0
    dense = torch.randn(16, art.num_dense)
    sparse = SparseBatch(torch.arange(16) * 1000, torch.ones((1, 16), dtype=torch.int32))
    assert torch.equal(rt.predict(dense, sparse), mapped.predict(dense, sparse))
    assert rt.stats().tiers["host"].read_bytes == 16 * 68
    rt.close()
    mapped.close()


def test_disk_rows_threads_and_overlay(one_width, tmp_path):
    """Many rows read by many threads land where they belong; the overlay wins."""
    art = on_disk(one_width, tmp_path / "v.tables")
    src = DiskRows(art.files, threads=8)
    full = torch.cat([t.data for t in one_width.tables])
    rows = torch.randperm(full.shape[0], generator=torch.Generator().manual_seed(0))[:1000]
    assert torch.equal(src.fetch(rows), full[rows])
    new = torch.full((3, full.shape[1]), 7, dtype=torch.uint8)
    src.write(rows[:3], new)
    got = src.fetch(rows)
    assert torch.equal(got[:3], new) and torch.equal(got[3:], full[rows[3:]])
    assert src.read_rows == 1000 + 997
    src.close()
    src.close()


def test_overlay_merge_replaces():
    ov = Overlay(2)
    ov.merge(np.array([5, 1]), np.array([[5, 5], [1, 1]], dtype=np.uint8))
    ov.merge(np.array([3, 5]), np.array([[3, 3], [9, 9]], dtype=np.uint8))
    assert ov.keys.tolist() == [1, 3, 5]
    assert ov.data.tolist() == [[1, 1], [3, 3], [9, 9]]
    found, at = ov.find(np.array([0, 3, 5, 7]))
    assert found.tolist() == [False, True, True, False]
    assert ov.data[at[found]].tolist() == [[3, 3], [9, 9]]


def test_tier_settings_are_checked():
    with pytest.raises(ConfigError, match="one of the two"):
        RuntimeConfig(host_cache_bytes=10, host_cache_fraction=0.5)
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        RuntimeConfig(host_cache_bytes=-1)
    with pytest.raises(ConfigError, match="disk_read_threads"):
        RuntimeConfig(disk_read_threads=0)
    with pytest.raises(ConfigError, match="one of the two"):
        HandlerConfig(host_cache_bytes=10, host_cache_fraction=0.5)
    cfg = HandlerConfig(host_cache_fraction=0.3, disk_read_threads=8)
    assert HandlerConfig.from_dict(cfg.to_dict()) == cfg
    assert "host_cache_bytes" not in HandlerConfig().to_dict()


def test_tier_metrics(one_width, tmp_path):
    """dlrm_tier_* move by the counters' increase; warm-up counts nowhere."""
    art = on_disk(one_width, tmp_path / "v.tables")
    rt = Runtime(art, RuntimeConfig(cache_on_cpu=True, host_cache_bytes=0,
                                    cache_load_factor=0.1))
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    data = batches(one_width, 4, seed=7)
    rt.predict(*data[0])
    m.set_tiers(rt.stats().tiers, count=False)       # warm-up
    start = rt.stats().tiers
    for dense, sparse in data[1:]:
        rt.predict(dense, sparse)
        m.set_tiers(rt.stats().tiers)
    end = rt.stats().tiers

    def value(name: str, tier: str) -> float:
        v = reg.get_sample_value(name, {"tier": tier})
        return 0.0 if v is None else v

    for tier in ("device", "host"):
        assert value("dlrm_tier_lookups_total", tier) == end[tier].lookups - start[tier].lookups
        assert value("dlrm_tier_hits_total", tier) == end[tier].hits - start[tier].hits
        assert value("dlrm_tier_read_bytes_total", tier) == (end[tier].read_bytes
                                                            - start[tier].read_bytes)
        assert value("dlrm_tier_miss_seconds_count", tier) == (
            end[tier].miss_seconds_count - start[tier].miss_seconds_count)
        assert value("dlrm_tier_capacity_bytes", tier) == end[tier].capacity_bytes
    assert "dlrm_tier_miss_seconds_bucket" in generate_latest(reg).decode()
    rt.close()
