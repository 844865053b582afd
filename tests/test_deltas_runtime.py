"""Embedding deltas in the runtime: exact after a delta (with and without the device cache),
applied in order and once, between batches, and the pod-wide shared tables.

Exactness is ``torch.equal`` against a runtime built directly from an artifact that has
the updated rows: applying a delta is a byte copy of rows in the artifact's format, so
the arithmetic is the same.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gpu_check import build_random_artifact
from serve.errors import DeltaConflict, InvalidDelta
from serve.runtime.artifact import Artifact, quantize_rows_reference, row_bytes
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.runtime.follower import DeltaFollower
from serve.runtime.shared import SharedTables
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import Delta, DeltaTable, encode_delta
from tests.fixtures.deltas import chained, store_delta, with_delta_rows

F = 26
VERSION = "tiny-int8-s0"


@pytest.fixture(scope="module")
def base() -> Artifact:
    return build_random_artifact("tiny", torch.device("cpu"), seed=3)


def _batch(seed: int, b: int, multi_hot: bool, max_id: int = 3000) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(0, 4, (F, b), generator=g, dtype=torch.int32) if multi_hot
               else torch.ones((F, b), dtype=torch.int32))
    probs = 1.0 / torch.arange(1, max_id + 1).double() ** 1.2
    values = torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)
    return torch.randn(b, 13, generator=g), SparseBatch(values, lengths)


def _delta(art: Artifact, seed: int, sequence: int = 1, tables: tuple[int, ...] = (0, 3, 7, 25),
           share: float = 0.3) -> Delta:
    """New random rows for a share of some tables' rows, hot ids (small ids) included."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in tables:
        qt = art.tables[t]
        n = max(1, int(qt.rows * share))
        ids = torch.unique(torch.cat([torch.arange(min(20, qt.rows)),
                                      torch.randint(0, qt.rows, (n,), generator=g)]))
        w = (torch.rand((ids.numel(), art.embedding_dim), generator=g) - 0.5) * 0.5
        rows = quantize_rows_reference(w, art.dtype)
        out.append(DeltaTable(art.table_feature(t), t, ids.numpy().astype(np.int64), rows.numpy()))
    return Delta(VERSION, sequence, 1_800_000_000.0 + sequence, art.dtype, art.embedding_dim,
                 row_bytes(art.dtype, art.embedding_dim), tuple(out))




def _store_with(tmp_path: Path, *deltas: Delta) -> DeltaStore:
    store = DeltaStore(tmp_path / "deltas")
    for blob, d in chained(deltas):
        store_delta(store, blob, d)
    return store


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("lf", [0.05, 0.2, 1.0])
def test_delta_applied_equals_rebuilt_artifact(base, tmp_path, policy, lf):
    """Cache on (CPU), warm: rows of the delta are resident when it lands, and others are
    not; after it, predictions equal a runtime built from the updated artifact."""
    d1, d2 = _delta(base, 11, 1), _delta(base, 12, 2, tables=(0, 1, 2))
    cfg = RuntimeConfig(cache_on_cpu=True, cache_policy=policy, cache_load_factor=lf)
    rt = Runtime.from_artifact(base, cfg)
    for step in range(4):  # warm the cache with the hot ids the delta changes
        rt.predict(*_batch(step, 64, multi_hot=step % 2 == 1))
    resident = set(rt.cache.resident_rows().tolist())
    assert resident, "the cache holds nothing: the test would not cover cached rows"
    store = _store_with(tmp_path, d1, d2)
    f = DeltaFollower(store, VERSION, rt, threading.Lock())
    assert f.catch_up() == 2 and f.applied == 2 and f.rows == d1.rows + d2.rows
    ref = Runtime.from_artifact(with_delta_rows(base, d1, d2), RuntimeConfig(cache_load_factor=1.0))
    stale = Runtime.from_artifact(base, RuntimeConfig(cache_load_factor=1.0))
    changed = False
    for step in range(10, 16):
        dense, sparse = _batch(step, 96, multi_hot=step % 2 == 1)
        got = rt.predict(dense, sparse)
        assert torch.equal(got, ref.predict(dense, sparse)), step
        changed |= not torch.equal(got, stale.predict(dense, sparse))
    assert changed, "the delta changed no prediction: the test could not fail"


def test_delta_without_cache_and_status(base, tmp_path):
    d1 = _delta(base, 21)
    rt = Runtime.from_artifact(base, RuntimeConfig())
    store = _store_with(tmp_path, d1)
    now = iter([100.0, 200.0])
    f = DeltaFollower(store, VERSION, rt, threading.Lock(), pid=4242, clock=lambda: next(now))
    f.write_status()
    assert store.worker_statuses(VERSION)[0].sequence == 0
    f.catch_up()
    st = store.worker_statuses(VERSION, pids=[4242])[0]
    assert (st.sequence, st.rows, st.created_at) == (1, d1.rows, d1.created_at)
    assert st.apply_seconds > 0 and st.applied_at == 100.0
    ref = Runtime.from_artifact(with_delta_rows(base, d1))
    dense, sparse = _batch(5, 128, multi_hot=True)
    assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, sparse))
    assert f.catch_up() == 0, "a delta applies once"


def test_follower_refuses_what_does_not_fit_and_keeps_serving(base, tmp_path):
    rt = Runtime.from_artifact(base, RuntimeConfig())
    dense, sparse = _batch(7, 32, multi_hot=False)
    before = rt.predict(dense, sparse)
    store = DeltaStore(tmp_path / "deltas")
    wrong_base = _delta(base, 1)
    wrong_base = Delta("other-version", 1, 1.0, wrong_base.dtype, wrong_base.dim,
                       wrong_base.row_bytes, wrong_base.tables)
    # Planted behind the sidecar's back: the worker checks again and refuses.
    folder = store.folder(VERSION)
    folder.mkdir(parents=True)
    store.path(VERSION, 1).write_bytes(encode_delta(wrong_base))
    f = DeltaFollower(store, VERSION, rt, threading.Lock())
    with pytest.raises(DeltaConflict, match="base_version"):
        f.load(1)
    assert f.catch_up() == 0 and f.applied == 0
    bad = bytearray(encode_delta(_delta(base, 2)))
    bad[-3] ^= 0xFF
    store.path(VERSION, 1).write_bytes(bytes(bad))
    with pytest.raises(InvalidDelta, match="sha256"):
        f.load(1)
    assert f.catch_up() == 0
    assert torch.equal(rt.predict(dense, sparse), before)


def test_a_delta_with_one_bad_table_changes_no_table(base, tmp_path):
    """All or nothing per delta: table 7's rows are one byte short (a delta applied
    without the file checks, as apply() allows), so tables 0 and 3 before it are not
    written either; the same delta with good rows then applies and changes predictions."""
    rt = Runtime.from_artifact(base, RuntimeConfig())
    dense, sparse = _batch(9, 64, multi_hot=True)
    before = rt.predict(dense, sparse)
    good = _delta(base, 31, tables=(0, 3, 7))
    t7 = good.tables[2]
    bad_t7 = DeltaTable(t7.feature, t7.table, t7.ids, t7.rows[:, :-1])
    bad = Delta(good.base_version, 1, good.created_at, good.dtype, good.dim, good.row_bytes,
                (good.tables[0], good.tables[1], bad_t7))
    f = DeltaFollower(DeltaStore(tmp_path / "deltas"), VERSION, rt, threading.Lock())
    with pytest.raises(InvalidDelta, match=r"tables\[2\]\.rows.*nothing of the delta"):
        f.apply(bad)
    assert torch.equal(rt.predict(dense, sparse), before), "tables 0 and 3 were written"
    assert f.applied == 0 and f.rows == 0
    f.apply(good)
    ref = Runtime.from_artifact(with_delta_rows(base, good))
    after = rt.predict(dense, sparse)
    assert torch.equal(after, ref.predict(dense, sparse)) and not torch.equal(after, before)


def test_store_refuses_repeats_and_gaps(base, tmp_path):
    store = _store_with(tmp_path, _delta(base, 1, 1))
    with pytest.raises(DeltaConflict, match="already applied"):
        store_delta(store, b"x", _delta(base, 2, 1))
    with pytest.raises(DeltaConflict, match="skips"):
        store_delta(store, b"x", _delta(base, 3, 3))
    assert store.sequences(VERSION) == [1]


def test_batches_see_all_of_a_delta_or_none(base, tmp_path):
    """A thread predicts the same batch under the batch lock while deltas land: every
    answer equals the answer before or after a whole delta, never a mix."""
    deltas = [_delta(base, 40 + i, i + 1, share=0.5) for i in range(4)]
    refs = [Runtime.from_artifact(with_delta_rows(base, *deltas[:i])) for i in range(5)]
    dense, sparse = _batch(9, 256, multi_hot=True)
    expected = [r.predict(dense, sparse) for r in refs]
    rt = Runtime.from_artifact(base, RuntimeConfig())
    lock = threading.Lock()
    store = DeltaStore(tmp_path / "deltas")
    f = DeltaFollower(store, VERSION, rt, lock)
    seen: list[int] = []
    stop = threading.Event()

    def predict_loop() -> None:
        while not stop.is_set():
            with lock:
                got = rt.predict(dense, sparse)
            seen.append(next(i for i, e in enumerate(expected) if torch.equal(got, e)))

    t = threading.Thread(target=predict_loop)
    t.start()
    try:
        for blob, d in chained(deltas):
            store_delta(store, blob, d)
            f.catch_up()
            time.sleep(0.02)
    finally:
        stop.set()
        t.join()
    assert seen == sorted(seen) and seen[-1] == 4 and len(set(seen)) >= 2


def test_ids_beyond_a_table_are_counted_per_feature(base):
    rt = Runtime.from_artifact(base, RuntimeConfig())
    rows = [t.rows for t in base.tables]
    lengths = torch.ones((F, 3), dtype=torch.int32)
    values = torch.zeros(F * 3, dtype=torch.int64)
    values[0] = rows[0] + 5          # C1, sample 0
    values[1] = rows[0]              # C1, sample 1 (== rows wraps too)
    values[3 * 4 + 2] = rows[4] * 3  # C5, sample 2
    rt.predict(torch.zeros(3, 13), SparseBatch(values, lengths))
    multi = SparseBatch(torch.tensor([rows[1] + 1, 2, rows[25] + 7]),
                        torch.tensor([[0]] * 1 + [[2]] + [[0]] * 23 + [[1]], dtype=torch.int32))
    rt.predict(torch.zeros(1, 13), multi)
    wrapped = rt.stats().wrapped
    assert len(wrapped) == F
    assert wrapped[0] == 2 and wrapped[4] == 1 and wrapped[1] == 1 and wrapped[25] == 1
    assert sum(wrapped) == 5


def _shared_worker(art_path: str, folder: str, apply: bool, q: mp.Queue) -> None:
    from serve.runtime.artifact import load_artifact

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
    dense, sparse = _batch(3, 64, multi_hot=True)
    with shared.read():
        q.put(rt.predict(dense, sparse).numpy())


def test_shared_tables_one_copy_two_processes(base, tmp_path):
    """Two worker processes map one table file; one writes the delta, both see it."""
    from serve.runtime.artifact import save_artifact

    art_path = tmp_path / "artifact.pt"
    save_artifact(base, art_path)
    d1 = _delta(base, 55)
    folder = tmp_path / "deltas"
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    reader = ctx.Process(target=_shared_worker, args=(str(art_path), str(folder), False, q))
    reader.start()
    assert q.get(timeout=120) == "ready"   # mapped the file, before any delta
    store = DeltaStore(folder)
    store_delta(store, encode_delta(d1), d1)
    writer = ctx.Process(target=_shared_worker, args=(str(art_path), str(folder), True, q))
    writer.start()
    outs = [q.get(timeout=120), q.get(timeout=120)]
    reader.join(60)
    writer.join(60)
    assert reader.exitcode == 0 and writer.exitcode == 0
    ref = Runtime.from_artifact(with_delta_rows(base, d1))
    expected = ref.predict(*_batch(3, 64, multi_hot=True)).numpy()
    for out in outs:
        assert np.array_equal(out, expected)
    shared = SharedTables(store.folder(VERSION) / "tables.bin")
    assert shared.sequence() == 1
    total = sum(t.data.numel() for t in base.tables)
    assert shared.path.stat().st_size == total


def test_shared_file_written_afresh_when_the_store_lost_its_deltas(base, tmp_path):
    folder = tmp_path / "v"
    shared = SharedTables(folder / "tables.bin", max_sequence=0)
    rt = Runtime.from_artifact(base, RuntimeConfig(), shared=shared)
    d1 = _delta(base, 66)
    store = _store_with(tmp_path, d1)
    rt.update_rows(0, torch.from_numpy(d1.tables[0].ids), torch.from_numpy(d1.tables[0].rows.copy()))
    with shared.write():
        shared.set_sequence(1)
    del store
    fresh = Runtime.from_artifact(base, RuntimeConfig(),
                                  shared=SharedTables(folder / "tables.bin", max_sequence=0))
    plain = Runtime.from_artifact(base)
    dense, sparse = _batch(4, 32, multi_hot=False)
    assert torch.equal(fresh.predict(dense, sparse), plain.predict(dense, sparse))


def test_shared_file_of_another_build_of_the_version_is_written_afresh(base, tmp_path):
    """Same version name, other weights (`make clean-models` and a rebuild) while the delta
    folder survives: the old build's rows, same size, must not be served under the new
    dense layers (a silent wrong answer)."""
    other = build_random_artifact("tiny", torch.device("cpu"), seed=4)  # same shapes
    assert [t.data.shape for t in other.tables] == [t.data.shape for t in base.tables]
    path = tmp_path / "v" / "tables.bin"
    old = Runtime.from_artifact(other, RuntimeConfig(), shared=SharedTables(path))
    size = path.stat().st_size
    fresh = Runtime.from_artifact(base, RuntimeConfig(), shared=SharedTables(path))
    plain = Runtime.from_artifact(base)
    dense, sparse = _batch(5, 64, multi_hot=True)
    assert path.stat().st_size == size
    assert torch.equal(fresh.predict(dense, sparse), plain.predict(dense, sparse))
    assert not torch.equal(old.predict(dense, sparse), plain.predict(dense, sparse))
    # the same build again: the file (and what deltas wrote into it) is kept
    written = path.read_bytes()
    fresh.update_rows(0, torch.tensor([1]), torch.from_numpy(
        np.full((1, base.tables[0].data.shape[1]), 7, dtype=np.uint8)))
    before = path.read_bytes()
    assert before != written  # the row went into the shared file
    Runtime.from_artifact(base, RuntimeConfig(), shared=SharedTables(path))
    assert path.read_bytes() == before
