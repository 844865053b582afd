"""Managed id spaces (serve.runtime.idmap): the map itself, the artifact, the runtime's
lookup through it (cached = uncached, equal to the rows fed directly), and deltas that
admit and evict ids, applied live and compared with the rebuilt artifact (torch.equal)."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gpu_check import build_random_artifact
from serve.errors import ArtifactError, ConfigError, InvalidDelta
from serve.runtime.artifact import Artifact, load_artifact, save_artifact
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.runtime.follower import DeltaFollower
from serve.runtime.idmap import (
    FALLBACK_ROW,
    IdMap,
    MapIndex,
    cuckoo_place,
    hash_slots,
    multipliers,
    slot_bits,
)
from serve.schema import TableSpec
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import Delta, decode_delta, encode_delta, scan_delta_file
from serve.store.deltas.layout import check_layout, layout_for_schema
from tests.fixtures.deltas import chained, store_delta, with_delta_rows
from tests.fixtures.idmaps import (
    MANAGED,
    MAX,
    VERSION,
    F,
    as_rows,
    id_delta,
    managed_copy,
    random_map,
    raw_batch,
    traffic,
)


@pytest.fixture(scope="module")
def base() -> Artifact:
    return build_random_artifact("tiny", torch.device("cpu"), seed=3)


@pytest.fixture(scope="module")
def managed(base: Artifact) -> Artifact:
    return managed_copy(base)


# -- the map ------------------------------------------------------------------------------

def test_managed_map_lookup_is_exact_for_any_int64():
    m = IdMap.from_arrays([MAX, 7, 0, 2**40], [3, 1, 4, 2], table_rows=6)
    got, found = m.lookup_with_hits(torch.tensor([7, 8, MAX, MAX - 1, 0, 2**40, 2**40 + 6]))
    assert got.tolist() == [1, FALLBACK_ROW, 3, FALLBACK_ROW, 4, 2, FALLBACK_ROW]
    assert found.tolist() == [True, False, True, False, True, True, False]
    assert (m.size, m.capacity, m.occupancy) == (4, 5, 0.8)
    empty = IdMap.empty(3)
    assert empty.lookup(torch.tensor([0, MAX])).tolist() == [FALLBACK_ROW] * 2


def test_managed_map_admit_evict_diff_round_trip():
    for seed in range(5):
        old, new = random_map(500, seed), random_map(500, seed + 100, share=0.7)
        # share ids between them, some keeping their row and some moving
        ai, ar, ev = IdMap.diff(old, new)
        assert old.apply(ai, ar, ev).equal(new)
        assert not ai.size or bool((np.diff(ai) > 0).all())
    same = random_map(50, 1)
    ai, ar, ev = IdMap.diff(same, same)
    assert ai.size == ar.size == ev.size == 0
    moved = IdMap.from_arrays([5, 6], [1, 2], 4)
    ai, ar, ev = IdMap.diff(moved, IdMap.from_arrays([5, 6], [2, 1], 4))
    assert ai.tolist() == [5, 6] and ar.tolist() == [2, 1] and ev.tolist() == [5, 6]


@pytest.mark.parametrize("change, rule", [
    (([], [], [9]), "evicted id 9 is not in the map"),
    (([5], [3], []), "assigned id 5 already owns a row"),
    (([9], [1], []), "assigned row 1 belongs to another id"),
    (([9], [0], []), "rows must be in 1..3"),
    (([9, 10], [3], []), "must pair one to one"),
    (([9, 10], [3, 3], [6]), "a row is assigned to two ids"),
])
def test_managed_map_refuses_changes_that_break_it(change, rule):
    m = IdMap.from_arrays([5, 6], [1, 2], 4)
    with pytest.raises(ConfigError, match=rule):
        m.apply(*change)
    assert m.equal(IdMap.from_arrays([5, 6], [1, 2], 4)), "a refused change changed nothing"


def test_managed_map_refuses_malformed_arrays():
    with pytest.raises(ConfigError, match="appears twice"):
        IdMap.from_arrays([1, 1], [1, 2], 4)
    with pytest.raises(ConfigError, match="negative"):
        IdMap.from_arrays([-1], [1], 4)
    with pytest.raises(ConfigError, match="at most 2"):
        IdMap.from_arrays([1, 2, 3], [1, 2, 3], 3)
    with pytest.raises(ConfigError, match=">= 2 rows"):
        IdMap.empty(1)
    with pytest.raises(ConfigError, match="needs >= 2 rows"):
        TableSpec("t", 1, 4, mapping="managed")


# -- the artifact -------------------------------------------------------------------------


# -- the map's hash index (MapIndex) ------------------------------------------------------

def test_managed_hash_slots_agree_between_numpy_and_torch_for_collision():
    """The build places ids with numpy (hash_slots), lookups recompute slots with torch
    int64 ops: wrapping multiply, arithmetic shift. They must agree on every id, extremes
    included, or an admitted id would be looked for in the wrong slot."""
    g = np.random.default_rng(7)
    ids = np.concatenate([[0, 1, 2**31, 2**32 - 1, 2**62, MAX - 1, MAX],
                          g.integers(0, MAX, 5000, dtype=np.int64)])
    t = torch.from_numpy(ids)
    for bits in (1, 3, 17, 30):
        for attempt in (0, 5):
            mult = multipliers(attempt)[1]
            want = hash_slots(ids, bits, mult)
            got = (((t ^ (t >> 29)) * mult) >> (64 - bits)) + (1 << (bits - 1))
            assert np.array_equal(got.numpy(), want)
            assert want.min() >= 0 and want.max() < 1 << bits


def test_managed_cuckoo_places_full_tables_and_reports_the_impossible_for_collision():
    g = np.random.default_rng(3)
    for rows in (2, 3, 4, 5, 64, 65, 1000, 4096):      # full: rows - 1 ids, load up to 0.4
        for ids in (np.arange(1, rows, dtype=np.int64),
                    g.choice(MAX, rows - 1, replace=False).astype(np.int64)):
            at = cuckoo_place(ids, slot_bits(rows), multipliers(0))
            assert at is not None
            placed = np.sort(at[at >= 0])
            assert np.array_equal(placed, np.arange(ids.size))
            for k in range(ids.size):       # each id in one of its two slots
                slots = [hash_slots(ids[k:k + 1], slot_bits(rows), m)[0]
                         for m in multipliers(0)]
                assert k in (at[slots[0]], at[slots[1]])
    # three ids, two slots: no placement, and the caller learns it (None, not a loop)
    assert cuckoo_place(np.array([1, 2, 3], dtype=np.int64), 1, multipliers(0)) is None


_CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device,probe", [
    ("cpu", "auto"), ("cpu", "ops"),
    pytest.param("cuda", "auto", marks=_CUDA.marks, id="cuda-auto")])
@pytest.mark.parametrize("fallback_rows", [1, 3])
def test_managed_map_index_equals_the_sorted_map_after_admits_and_evictions(fallback_rows,
                                                                             device, probe):
    """MapIndex (hash probe, all features at once, and per segment) returns exactly what
    IdMap.lookup (binary search, on the CPU) returns, for admitted ids, ids never seen, ids
    evicted a moment ago and 2**63 - 1, before and after a change of the map: the compiled
    loop (host memory) and the tensor ops alike; on CUDA the region and the probe (tensor
    ops) live on the device."""
    g = torch.Generator().manual_seed(11)
    tables = {0: 50, 2: 7, 5: 300}
    index = MapIndex(tables, device=device, fallback={t: fallback_rows for t in tables},
                     probe=probe)
    assert index.probe == ("compiled" if probe == "auto" and device == "cpu" else "ops")
    maps = {}
    for t, rows in tables.items():
        n = rows - fallback_rows
        ids = torch.randperm(2**20, generator=g)[:n] * 2**40 + 5    # multiples of 2**40
        maps[t] = IdMap.from_arrays(ids, torch.randperm(n, generator=g) + fallback_rows,
                                    rows, fallback_rows)
        index.write(t, maps[t])

    def check(order: tuple[int, ...]) -> None:
        cols = []
        for t in order:
            known = maps[t].ids[torch.randint(0, maps[t].size, (40,), generator=g)]
            cols.append(torch.cat([known, torch.tensor([0, MAX, 2**40 + 4, 12345]),
                                   evicted[t]]))
        vals = torch.stack(cols)
        rows, found = index.lookup_features(vals.to(device), order)
        assert rows.device.type == device
        rows, found = rows.cpu(), found.cpu()
        for i, t in enumerate(order):
            want, hit = maps[t].lookup_with_hits(vals[i])
            assert torch.equal(rows[i], want) and torch.equal(found[i], hit)
        flat = vals.reshape(-1)
        segs = [(t, i * vals.shape[1], (i + 1) * vals.shape[1]) for i, t in enumerate(order)]
        r2, f2 = index.lookup(flat.to(device), segs)
        assert torch.equal(r2.cpu(), rows.reshape(-1)) and torch.equal(f2.cpu(), found.reshape(-1))
        for t in tables:
            assert index.map(t).equal(maps[t])

    evicted = {t: torch.tensor([1, 2], dtype=torch.int64) for t in tables}
    check((0, 2, 5))
    check((5, 5, 0))
    for t, m in maps.items():      # evict a third of each map, admit fresh ids to its rows
        cut = max(2, m.size // 3)
        ev, freed = m.ids[:cut], m.rows[:cut]
        fresh = torch.arange(ev.numel(), dtype=torch.int64) * 3 + 1
        maps[t] = m.apply(fresh, freed, evict_ids=ev)
        index.write(t, maps[t])
        evicted[t] = ev[:2]
    check((2, 0, 5))


@pytest.mark.parametrize("fallback_rows", [1, 5])
def test_managed_compiled_probe_equals_the_tensor_ops_for_any_int64(fallback_rows):
    """The compiled loop and the tensor ops give the same rows and hits, bit for bit, for
    ids over the whole int64 range (negative ones too, though the runtime refuses them
    before a lookup), both extremes, admitted ids and their neighbours, per feature and
    per segment, over tables of very different slot counts (b = 2..17)."""
    g = torch.Generator().manual_seed(23)
    tables = {0: 2, 1: 9, 3: 4000, 4: 50_000}
    kw = {"fallback": {t: min(fallback_rows, r - 1) for t, r in tables.items()}}
    fast, ops = MapIndex(tables, **kw), MapIndex(tables, probe="ops", **kw)
    assert (fast.probe, ops.probe) == ("compiled", "ops")
    admitted = {}
    for t, rows in tables.items():
        k = kw["fallback"][t]
        n = rows - k
        ids = torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64).abs()
        ids = torch.unique(ids)
        m = IdMap.from_arrays(ids, torch.randperm(rows - k, generator=g)[:ids.numel()] + k,
                              rows, k)
        fast.write(t, m)
        ops.write(t, m)
        admitted[t] = m.ids
    b = 700
    cols = []
    for t in (4, 0, 3, 1, 4):
        pick = admitted[t][torch.randint(0, admitted[t].numel(), (b // 2,), generator=g)]
        rand = torch.randint(-2**63, 2**63 - 1, (b // 2 - 6,), generator=g, dtype=torch.int64)
        edge = torch.tensor([MAX, -MAX - 1, 0, -1, 1, int(pick[0]) + 1])
        cols.append(torch.cat([pick, rand, edge])[torch.randperm(b, generator=g)])
    vals = torch.stack(cols)
    order = (4, 0, 3, 1, 4)
    got, want = fast.lookup_features(vals, order), ops.lookup_features(vals, order)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int(got[1].sum()) < got[1].numel()
    segs = [(4, 0, 10), (1, 10, 10), (3, 10, 2000), (0, 2000, vals.numel())]
    flat = vals.reshape(-1)
    got, want = fast.lookup(flat, segs), ops.lookup(flat, segs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ConfigError, match="probe 'fast' is not one of"):
        MapIndex(tables, probe="fast")


def test_managed_artifact_round_trip(managed, base, tmp_path):
    save_artifact(managed, tmp_path / "m.pt")
    back = load_artifact(tmp_path / "m.pt")
    assert back.schema == managed.schema
    assert set(back.id_maps) == set(managed.id_maps)
    assert all(back.id_maps[k].equal(m) for k, m in managed.id_maps.items())
    save_artifact(base, tmp_path / "b.pt")
    assert "id_maps" not in torch.load(tmp_path / "b.pt", weights_only=True)
    assert base.schema.to_dict() == load_artifact(tmp_path / "b.pt").schema.to_dict()
    assert all("mapping" not in t for t in base.schema.to_dict()["tables"])
    with pytest.raises(ArtifactError, match="every managed table needs its map"):
        Artifact(managed.schema, managed.tables, managed.dense, {}, {})


# -- the runtime --------------------------------------------------------------------------

@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("cache", [None, "lru", "lfu"])
def test_managed_runtime_equals_rows_fed_directly(managed, base, multi_hot, cache):
    """Raw ids through the maps = the same rows given to a modulo runtime of the same
    tables, bit for bit; with the cache on (load factor 0.2) too."""
    cfg = (RuntimeConfig() if cache is None else
           RuntimeConfig(cache_on_cpu=True, cache_policy=cache, cache_load_factor=0.2))
    rt = Runtime.from_artifact(managed, cfg)
    ref = Runtime.from_artifact(base, RuntimeConfig())
    for step in range(4):
        dense, sparse = raw_batch(managed, step, 64, multi_hot)
        assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, as_rows(managed, sparse)))


def test_managed_fallback_counted_per_feature_and_never_wrapped(managed):
    rt = Runtime.from_artifact(managed, RuntimeConfig())
    dense, sparse = raw_batch(managed, 9, 200, multi_hot=False, unknown=0.3)
    rt.predict(dense, sparse)
    st = rt.stats()
    rows = as_rows(managed, sparse).values.view(F, -1)
    for f in range(F):
        if f in MANAGED:
            assert st.fallback[f] == int((rows[f] == FALLBACK_ROW).sum()) > 0, f
            assert st.wrapped[f] == 0, "a managed feature's big ids are not wraps"
        else:
            assert st.fallback[f] == 0
    # ids at the top of int64 and ids never seen: fallback row, no error
    b = 3
    values = torch.full((F * b,), MAX, dtype=torch.int64)
    probs = rt.predict(torch.zeros(b, 13), SparseBatch(values, torch.ones((F, b), dtype=torch.int32)))
    assert probs.shape == (b,) and bool(torch.isfinite(probs).all())
    after = rt.stats().fallback
    managed_top = {f for f in MANAGED if MAX not in
                   set(managed.id_maps[managed.schema.tables[f].name].ids.tolist())}
    assert all(after[f] - st.fallback[f] == (b if f in managed_top else 0) for f in range(F))


# -- deltas with ids ----------------------------------------------------------------------

def _store_with(tmp_path: Path, *deltas: Delta) -> DeltaStore:
    store = DeltaStore(tmp_path / "deltas")
    for blob, d in chained(deltas):
        store_delta(store, blob, d)
    return store


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_managed_delta_admit_evict_equals_rebuilt(managed, tmp_path, policy):
    """Cache on (load factor 0.2), warmed with the ids the delta evicts: after the live
    delta (two in a chain) the predictions equal a runtime built from the rebuilt
    artifact (maps changed, rows written), bit for bit; evicted ids read the fallback."""
    d1 = id_delta(managed, 11, 1)
    d2 = id_delta(with_delta_rows(managed, d1), 12, 2, tables=(0, 2), modulo_tables=(4,))
    cfg = RuntimeConfig(cache_on_cpu=True, cache_policy=policy, cache_load_factor=0.2)
    rt = Runtime.from_artifact(managed, cfg)
    for step in range(4):
        rt.predict(*traffic(managed, d1, step, 64, multi_hot=step % 2 == 1))
    assert rt.cache is not None and rt.cache.resident_rows().numel()
    store = _store_with(tmp_path, d1, d2)
    f = DeltaFollower(store, VERSION, rt, threading.Lock())
    assert f.catch_up() == 2 and f.applied == 2
    rebuilt = with_delta_rows(managed, d1, d2)
    ref = Runtime.from_artifact(rebuilt, RuntimeConfig())
    stale = Runtime.from_artifact(managed, RuntimeConfig())
    changed = False
    for step in range(10, 16):
        dense, sparse = traffic(managed, d1, step, 96, multi_hot=step % 2 == 1)
        got = rt.predict(dense, sparse)
        assert torch.equal(got, ref.predict(dense, sparse)), step
        changed |= not torch.equal(got, stale.predict(dense, sparse))
    assert changed, "the deltas changed no prediction: the test could not fail"
    for t in d1.tables:
        if t.id_changes:
            evicted = torch.from_numpy(np.setdiff1d(t.evict_ids, d2.tables[0].assign_ids))
            assert bool((rt.id_maps[t.table].lookup(evicted) == FALLBACK_ROW).all())
            assert rt.id_maps[t.table].equal(rebuilt.id_maps[managed.schema.tables[t.table].name])


def test_managed_delta_file_round_trip_and_layout(managed, base, tmp_path):
    d = id_delta(managed, 5)
    blob = encode_delta(d)
    back = decode_delta(blob)
    for a, b in zip(d.tables, back.tables, strict=True):
        for key in ("ids", "rows", "assign_ids", "assign_rows", "evict_ids"):
            assert np.array_equal(getattr(a, key), getattr(b, key)), key
    assert back.assigned == d.assigned > 0 and back.evicted == d.evicted > 0
    path = tmp_path / "d.delta"
    path.write_bytes(blob)
    scanned = scan_delta_file(path)
    assert all(np.array_equal(a.assign_ids, b.assign_ids) and np.array_equal(a.evict_ids, b.evict_ids)
               and np.array_equal(a.assign_rows, b.assign_rows)
               for a, b in zip(d.tables, scanned.tables, strict=True))
    check_layout(back, layout_for_schema(managed.schema))
    with pytest.raises(InvalidDelta, match="only a managed table takes id assignments") as e:
        check_layout(back, layout_for_schema(base.schema))
    assert e.value.field == "tables[0].assigned"
    t0 = back.tables[0]
    keep = ~np.isin(t0.ids, t0.assign_rows)   # assigned rows whose bytes are missing
    orphan = dataclasses.replace(t0, ids=t0.ids[keep], rows=t0.rows[keep])
    bad = dataclasses.replace(back, tables=(orphan, *back.tables[1:]))
    with pytest.raises(InvalidDelta, match="every assigned row's bytes must be in the delta"):
        check_layout(bad, layout_for_schema(managed.schema))


def test_managed_follower_refuses_a_change_the_map_refuses(managed, tmp_path):
    """Evicting an id the map does not hold: the delta is refused whole (no map or row
    changed) and the worker keeps serving the version as it was."""
    d = id_delta(managed, 7)
    t = next(x for x in d.tables if x.id_changes)
    ghost = dataclasses.replace(t, evict_ids=np.sort(np.append(t.evict_ids[1:], 12345)))
    bad = dataclasses.replace(d, tables=tuple(ghost if x is t else x for x in d.tables))
    rt = Runtime.from_artifact(managed, RuntimeConfig())
    ref = Runtime.from_artifact(managed, RuntimeConfig())
    f = DeltaFollower(_store_with(tmp_path, bad), VERSION, rt, threading.Lock())
    assert f.catch_up() == 0 and f.applied == 0
    dense, sparse = traffic(managed, d, 3, 64, multi_hot=True)
    assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, sparse))


def test_managed_follower_hashes_maps_before_the_lock_and_refuses_a_map_it_cannot_place(
        managed, tmp_path, monkeypatch):
    """The changed maps are hashed before batches stop (the write under the lock is only
    copies); a map that finds no placement refuses the delta whole, like any id conflict,
    and the worker keeps serving the version as it was."""
    from serve.runtime import idmap

    d = id_delta(managed, 7)
    rt = Runtime.from_artifact(managed, RuntimeConfig())
    ref = Runtime.from_artifact(managed, RuntimeConfig())
    f = DeltaFollower(_store_with(tmp_path, d), VERSION, rt, threading.Lock())
    monkeypatch.setattr(idmap, "HASH_ATTEMPTS", 0)       # no multiplier pair to try
    assert f.catch_up() == 0 and f.applied == 0
    dense, sparse = traffic(managed, d, 3, 64, multi_hot=True)
    assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, sparse))
    monkeypatch.undo()
    maps = f.id_maps(f.load(1))
    assert maps and all("placement" not in m.__dict__ for m in maps.values())
    placed_when_written = []
    write = rt.set_id_map

    def spy(table: int, m: IdMap) -> None:     # runs under the follower's locks
        placed_when_written.append("placement" in m.__dict__)
        write(table, m)

    monkeypatch.setattr(rt, "set_id_map", spy)
    f.apply(f.load(1), maps)
    assert placed_when_written and all(placed_when_written)
    assert f.applied == 1
    rebuilt = Runtime.from_artifact(with_delta_rows(managed, d), RuntimeConfig())
    assert torch.equal(rt.predict(dense, sparse), rebuilt.predict(dense, sparse))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", [None, "lru", "lfu"])
def test_managed_runtime_on_cuda_equals_cpu(managed, tmp_path, cache):
    """The map on the GPU: lookups (2**63 - 1 included), a live admit/evict delta, and the
    predictions of a runtime rebuilt after it, CUDA vs CPU (same rows; the dense part's
    float rounding may differ between devices, so allclose there, torch.equal for rows)."""
    cfg = RuntimeConfig(device="cuda", cache_policy=cache or "lru",
                        cache_load_factor=1.0 if cache is None else 0.2)
    rt = Runtime.from_artifact(managed, cfg)
    name = managed.schema.tables[0].name
    probe = torch.tensor([0, MAX, 12345, *managed.id_maps[name].ids[:5].tolist()])
    assert torch.equal(rt.id_maps[0].lookup(probe.cuda()).cpu(), managed.id_maps[name].lookup(probe))
    d1 = id_delta(managed, 11, 1)
    f = DeltaFollower(_store_with(tmp_path, d1), VERSION, rt, threading.Lock())
    assert f.catch_up() == 1
    rebuilt = with_delta_rows(managed, d1)
    ref_gpu = Runtime.from_artifact(rebuilt, RuntimeConfig(device="cuda", cache_load_factor=1.0))
    for step in range(3):
        dense, sparse = traffic(managed, d1, step, 128, multi_hot=step == 1)
        assert torch.equal(rt.predict(dense, sparse), ref_gpu.predict(dense, sparse))


# -- one copy of the maps per pod ----------------------------------------------------------

def _shared_managed_worker(art_path: str, folder: str, apply: bool, q) -> None:
    from serve.runtime.artifact import load_artifact
    from serve.runtime.shared import SharedTables

    art = load_artifact(art_path)
    store = DeltaStore(folder)
    shared = SharedTables(store.folder(VERSION) / "tables.bin", store.last_sequence(VERSION))
    rt = Runtime.from_artifact(art, RuntimeConfig(), shared=shared)
    f = DeltaFollower(store, VERSION, rt, threading.Lock())
    if apply:
        f.catch_up()
    else:
        q.put("ready")
        while f.applied < 1:  # the delta is added after "ready"
            f.catch_up()
            time.sleep(0.01)
    d = decode_delta(store.path(VERSION, 1).read_bytes())
    dense, sparse = traffic(art, d, 3, 64, multi_hot=True)
    with shared.read():
        q.put((rt.predict(dense, sparse).numpy(), rt.stats().fallback))


def test_managed_maps_shared_by_two_worker_processes(managed, tmp_path):
    """Two workers map one file holding the rows AND the id maps (one copy per pod); one
    writes the delta's admissions, evictions and rows, the other only sees them: both
    serve exactly the rebuilt artifact."""
    import multiprocessing as mp

    from serve.runtime.shared import SharedTables

    art_path = tmp_path / "artifact.pt"
    save_artifact(managed, art_path)
    d1 = id_delta(managed, 55)
    folder = tmp_path / "deltas"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    reader = ctx.Process(target=_shared_managed_worker, args=(str(art_path), str(folder), False, q))
    reader.start()
    assert q.get(timeout=120) == "ready"
    store = DeltaStore(folder)
    for blob, d in chained([d1]):
        store_delta(store, blob, d)
    writer = ctx.Process(target=_shared_managed_worker, args=(str(art_path), str(folder), True, q))
    writer.start()
    outs = [q.get(timeout=120), q.get(timeout=120)]
    reader.join(60)
    writer.join(60)
    assert reader.exitcode == 0 and writer.exitcode == 0
    rebuilt = with_delta_rows(managed, d1)
    dense, sparse = traffic(managed, d1, 3, 64, multi_hot=True)
    expected = Runtime.from_artifact(rebuilt).predict(dense, sparse).numpy()
    stale = Runtime.from_artifact(managed).predict(dense, sparse).numpy()
    assert not np.array_equal(expected, stale), "the delta changed nothing: cannot fail"
    for probs, _fallback in outs:
        assert np.array_equal(probs, expected)
    assert outs[0][1] == outs[1][1], "both workers read the same maps"
    shared = SharedTables(store.folder(VERSION) / "tables.bin")
    assert shared.sequence() == 1
    table_bytes = sum(t.data.numel() for t in managed.tables)
    rows = [managed.schema.tables[t].rows for t in MANAGED]
    # counts and multipliers, the sorted maps, the hash slots (2**b >= 2.5 x rows each)
    maps = 8 * (3 * len(MANAGED) + 2 * sum(rows) + 2 * sum(1 << slot_bits(r) for r in rows))
    assert all(2.5 * r <= 1 << slot_bits(r) < 5 * r for r in rows)
    assert shared.path.stat().st_size == table_bytes + (-table_bytes % 8) + maps


def test_managed_second_worker_maps_the_region_without_hashing_a_map(managed, tmp_path,
                                                                     monkeypatch):
    """The worker that writes the pod's shared file builds the id map region (hashing
    every admitted id); a worker that finds the file of the same build maps it as it is,
    and serves the same predictions. A file whose region another layout wrote (an older
    REGION_LAYOUT) is written afresh."""
    from serve.runtime import idmap
    from serve.runtime import shared as shared_mod
    from serve.runtime.shared import SharedTables

    art_path = tmp_path / "artifact.pt"
    save_artifact(managed, art_path)
    path = tmp_path / "deltas" / VERSION / "tables.bin"
    first = Runtime.from_artifact(load_artifact(art_path), RuntimeConfig(),
                                  shared=SharedTables(path))
    written = path.stat().st_ino
    dense, sparse = traffic(managed, id_delta(managed, 9), 1, 64, multi_hot=True)
    expected = first.predict(dense, sparse)

    hashed: list[int] = []
    real = IdMap.placement.func

    def counted(self):
        hashed.append(self.size)
        return real(self)

    monkeypatch.setattr(IdMap, "placement", property(counted))
    second = Runtime.from_artifact(load_artifact(art_path), RuntimeConfig(),
                                   shared=SharedTables(path))
    assert hashed == [], "the second worker hashed maps the file already holds"
    assert path.stat().st_ino == written
    assert torch.equal(second.predict(dense, sparse), expected)

    writes: list[str] = []
    monkeypatch.setattr(shared_mod.log, "info", lambda msg, *a: writes.append(msg % a))
    monkeypatch.setattr(idmap, "REGION_LAYOUT", idmap.REGION_LAYOUT + "-next")
    third = Runtime.from_artifact(load_artifact(art_path), RuntimeConfig(),
                                  shared=SharedTables(path))
    assert len(hashed) == len(MANAGED) and any("another build" in w for w in writes), writes
    assert torch.equal(third.predict(dense, sparse), expected)


#: The digest of the region that one fixed map gives, per REGION_LAYOUT. A change to the
#: layout or the hash changes it: give the layout a new tag (and record its digest here),
#: so that pods never read a shared file written with the old one as the new.
LAYOUT_DIGESTS = {"cuckoo2:1": "c149238698d975a7"}


def test_managed_region_layout_is_named_by_its_tag():
    import hashlib

    from serve.runtime.idmap import REGION_LAYOUT, MapIndex

    m = IdMap.from_arrays([MAX, 7, 0, 2**40, 123456789], [3, 1, 4, 2, 5], table_rows=8)
    index = MapIndex({2: 8, 5: 8})
    index.write(2, m)
    digest = hashlib.sha256(index.region.numpy().tobytes()).hexdigest()[:16]
    assert LAYOUT_DIGESTS.get(REGION_LAYOUT) == digest, (
        f"the region of a fixed map is now {digest} under REGION_LAYOUT {REGION_LAYOUT!r}; "
        "if its layout or hash changed, give REGION_LAYOUT a new tag and record it here")


def test_managed_warm_up_reads_admitted_ids_and_leaves_the_fallback_count(managed):
    from serve.runtime.warmup import warm_up

    rt = Runtime.from_artifact(managed, RuntimeConfig())
    warm_up(rt, batches=3)
    st = rt.stats()
    assert st.forwards == 3 and st.samples > 0
    assert sum(st.fallback) == 0 and sum(st.wrapped) == 0


@pytest.mark.parametrize("multi_hot", [False, True])
def test_managed_every_table_equals_rows_fed_directly(base, multi_hot):
    """Every table managed (the one-hot path then skips the modulo arithmetic): the same
    answers as the rows fed to a modulo runtime, and the fallback counted per feature."""
    every = managed_copy(base, tables=tuple(range(F)), seed=40)
    rt = Runtime.from_artifact(every, RuntimeConfig())
    ref = Runtime.from_artifact(base, RuntimeConfig())
    dense, sparse = raw_batch(every, 4, 80, multi_hot)
    assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, as_rows(every, sparse)))
    rows = as_rows(every, sparse).values
    assert sum(rt.stats().fallback) == int((rows == FALLBACK_ROW).sum()) > 0


@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("every", [False, True])
def test_managed_hashed_fallback_rows_equal_rows_fed_directly(base, multi_hot, every):
    """k fallback rows per table: an id outside the map reads row id % k (not all of them
    row 0); admitted ids own rows k..rows-1. Same answers as those rows fed directly."""
    tables = tuple(range(F)) if every else MANAGED
    art = managed_copy(base, tables=tables, seed=60, fallback_share=0.2)
    big = next(t for t in tables if base.schema.tables[t].rows >= 50)
    m = art.id_maps[base.schema.tables[big].name]
    assert m.fallback_rows > 1 and int(m.rows.min()) >= m.fallback_rows
    probe = torch.tensor([MAX - 1, 12345, 7, 8])   # none admitted (map ids < 2**62, MAX)
    assert m.lookup(probe).tolist() == [int(x) % m.fallback_rows for x in probe.tolist()]
    rt = Runtime.from_artifact(art, RuntimeConfig())
    ref = Runtime.from_artifact(base, RuntimeConfig())
    dense, sparse = raw_batch(art, 5, 80, multi_hot)
    assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, as_rows(art, sparse)))
    fallen = as_rows(art, sparse).values
    assert sum(rt.stats().fallback) > 0 and int((fallen > 0).sum()) > 0
