"""Deltas and shared tables for an imported model's layout: a table read by two features
(its rows are written once and both features see them), mean pooling, and tables of
different dims and dtypes (shared host tables; a delta carries tables of one row format, so
such a model takes one delta per format).

Exactness is ``torch.equal`` against a runtime built from an artifact that holds the new
rows (a delta is a byte copy of rows, so the arithmetic is the same).
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from serve.errors import InvalidDelta
from serve.model.importer import generated_batch
from serve.runtime.artifact import quantize_rows_reference, row_bytes
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.runtime.follower import DeltaFollower
from serve.runtime.shared import SharedTables
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import Delta, DeltaTable
from tests.fixtures.deltas import chained, store_delta, with_delta_rows
from tests.fixtures.own_models import random_artifact

VERSION = "own-a"
# One row format (int8, dim 16): deltas apply. t_item is read by item_id and history.
SHARED = (("t_user", 400, 16, "sum", "int8"), ("t_item", 900, 16, "sum", "int8"),
          ("t_tag", 60, 16, "mean", "int8"))
SHARED_FEATURES = (("user_id", "t_user", 1), ("item_id", "t_item", 1),
                   ("history", "t_item", 12), ("tags", "t_tag", 4))
# Mixed dims and dtypes.
MIXED = (("t_user", 400, 32, "sum", "fp16"), ("t_item", 900, 16, "sum", "int8"),
         ("t_tag", 60, 8, "mean", "int8"))


def _item_delta(art, seed: int, name: str = "item_id", sequence: int = 1) -> Delta:
    g = torch.Generator().manual_seed(seed)
    t = art.schema.table_index("t_item")
    spec = art.schema.tables[t]
    ids = torch.unique(torch.cat([torch.arange(50), torch.randint(0, spec.rows, (200,),
                                                                   generator=g)]))
    rows = quantize_rows_reference((torch.rand((ids.numel(), spec.dim), generator=g) - 0.5),
                                   spec.dtype)
    return Delta(VERSION, sequence, 1_800_000_000.0 + sequence, spec.dtype, spec.dim,
                 row_bytes(spec.dtype, spec.dim),
                 (DeltaTable(name, t, ids.numpy().astype(np.int64), rows.numpy()),))


def _store(tmp_path: Path, *deltas: Delta) -> DeltaStore:
    store = DeltaStore(tmp_path / "deltas")
    for blob, d in chained(deltas):
        store_delta(store, blob, d)
    return store


@pytest.mark.parametrize("config", [
    {"cache_load_factor": 1.0},
    {"cache_load_factor": 0.2, "cache_on_cpu": True, "cache_policy": "lru"},
    {"cache_load_factor": 0.2, "cache_on_cpu": True, "cache_policy": "lfu"},
], ids=["no-cache", "lru-0.2", "lfu-0.2"])
def test_a_delta_on_the_shared_table_equals_a_rebuild(tmp_path: Path, config: dict) -> None:
    art = random_artifact(SHARED, SHARED_FEATURES, seed=1)
    d = _item_delta(art, 7)
    rt = Runtime(art, RuntimeConfig(**config))
    for s in range(3):   # warm: the delta's hot rows are resident when it lands
        dense, values, lengths = generated_batch(art.schema, 64, seed=s)
        rt.predict(dense, SparseBatch(values, lengths))
    f = DeltaFollower(_store(tmp_path, d), VERSION, rt, threading.Lock())
    assert f.catch_up() == 1
    ref = Runtime(with_delta_rows(art, d), RuntimeConfig(cache_load_factor=1.0))
    stale = Runtime(art, RuntimeConfig(cache_load_factor=1.0))
    changed_item = changed_history = False
    for s in range(10, 14):
        dense, values, lengths = generated_batch(art.schema, 96, seed=s)
        got = rt.predict(dense, SparseBatch(values, lengths))
        assert torch.equal(got, ref.predict(dense, SparseBatch(values, lengths))), s
        changed_item |= not torch.equal(got, stale.predict(dense, SparseBatch(values, lengths)))
        # Only history reads t_item here: item_id empty, so any change comes through history.
        hist_only = lengths.clone()
        hist_only[1] = 0
        keep = torch.repeat_interleave(torch.arange(4).repeat_interleave(96),
                                       lengths.reshape(-1).long()) != 1
        sb = SparseBatch(values[keep], hist_only)
        changed_history |= not torch.equal(rt.predict(dense, sb), stale.predict(dense, sb))
        assert torch.equal(rt.predict(dense, sb), ref.predict(dense, sb))
    assert changed_item and changed_history, "the delta changed nothing: the test could not fail"


def test_a_delta_names_the_shared_table_by_its_first_feature(tmp_path: Path) -> None:
    art = random_artifact(SHARED, SHARED_FEATURES, seed=1)
    rt = Runtime(art, RuntimeConfig())
    f = DeltaFollower(_store(tmp_path, _item_delta(art, 7, name="history")), VERSION, rt,
                      threading.Lock())
    with pytest.raises(InvalidDelta, match=r"'history' at table 1 is not one of the model's "
                                           r"features at that index"):
        f.load(1)
    assert f.catch_up() == 0 and f.applied == 0   # logged, not applied; serving goes on


@pytest.mark.parametrize("config", [
    {"cache_load_factor": 1.0},
    {"cache_load_factor": 0.2, "cache_on_cpu": True, "cache_policy": "lru"},
    {"cache_load_factor": 0.2, "cache_on_cpu": True, "cache_policy": "lfu"},
], ids=["no-cache", "lru-0.2", "lfu-0.2"])
def test_mixed_dims_a_delta_on_the_shared_table_equals_a_rebuild(tmp_path: Path,
                                                                 config: dict) -> None:
    """Tables of dims 32 (fp16) / 16 / 8: a delta of t_item's format (int8, dim 16) is
    written once into the widest-row storage and equals a rebuild, bit for bit."""
    art = random_artifact(MIXED, SHARED_FEATURES, seed=2)
    d = _item_delta(art, 8)
    rt = Runtime(art, RuntimeConfig(**config))
    for s in range(3):
        dense, values, lengths = generated_batch(art.schema, 64, seed=s)
        rt.predict(dense, SparseBatch(values, lengths))
    f = DeltaFollower(_store(tmp_path, d), VERSION, rt, threading.Lock())
    assert f.catch_up() == 1
    ref = Runtime(with_delta_rows(art, d), RuntimeConfig(cache_load_factor=1.0))
    stale = Runtime(art, RuntimeConfig(cache_load_factor=1.0))
    changed = False
    for s in range(20, 24):
        dense, values, lengths = generated_batch(art.schema, 96, seed=s)
        got = rt.predict(dense, SparseBatch(values, lengths))
        assert torch.equal(got, ref.predict(dense, SparseBatch(values, lengths))), s
        changed |= not torch.equal(got, stale.predict(dense, SparseBatch(values, lengths)))
    assert changed, "the delta changed nothing: the test could not fail"


def test_mixed_dims_a_delta_of_another_format_is_refused_by_name(tmp_path: Path) -> None:
    art = random_artifact(MIXED, SHARED_FEATURES, seed=2)
    d = _item_delta(art, 8)
    wrong = Delta(d.base_version, 1, d.created_at, "fp16", 32, row_bytes("fp16", 32),
                  (DeltaTable("item_id", 1, d.tables[0].ids,
                              np.zeros((d.tables[0].ids.size, 64), dtype=np.uint8)),))
    rt = Runtime(art, RuntimeConfig())
    f = DeltaFollower(_store(tmp_path, wrong), VERSION, rt, threading.Lock())
    with pytest.raises(InvalidDelta, match=r"'fp16', dim 32, 64-byte rows do not match table 1 "
                                           r"\(item_id\): 'int8', dim 16, 20-byte rows; .* "
                                           r"send one delta per format"):
        f.load(1)
    assert f.catch_up() == 0


def test_mixed_dims_serve_from_one_shared_host_table(tmp_path: Path) -> None:
    """Two runtimes (two workers) map one table file of the widest rows; both answer as a
    private runtime, and a row written through one is seen by the other."""
    art = random_artifact(MIXED, SHARED_FEATURES, seed=2)
    path = tmp_path / "v" / "tables.bin"
    a = Runtime(art, RuntimeConfig(), shared=SharedTables(path))
    b = Runtime(art, RuntimeConfig(), shared=SharedTables(path))
    private = Runtime(art, RuntimeConfig())
    assert a.shared is not None and b.shared is not None
    assert path.stat().st_size == art.schema.total_rows * row_bytes("fp16", 32)
    dense, values, lengths = generated_batch(art.schema, 50, seed=4)
    want = private.predict(dense, SparseBatch(values, lengths))
    assert torch.equal(a.predict(dense, SparseBatch(values, lengths)), want)
    assert torch.equal(b.predict(dense, SparseBatch(values, lengths)), want)
    t = art.schema.table_index("t_tag")
    ids = torch.arange(60)
    rows = quantize_rows_reference(torch.rand((60, 8)) - 0.5, "int8")
    with a.shared.write():
        a.update_rows(t, ids, rows)
    private.update_rows(t, ids, rows)
    want = private.predict(dense, SparseBatch(values, lengths))
    assert torch.equal(b.predict(dense, SparseBatch(values, lengths)), want)
