"""Managed id spaces in the build: ``--mapping managed`` on the pipeline, training on mapped
rows, and deltas that carry admissions and evictions (serve.model.{pipeline,train,delta})."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from serve.errors import ConfigError
from serve.model.admission import (
    ADMISSION_FILE,
    DEFAULT_FALLBACK_SHARE,
    AdmissionConfig,
    load_state,
)
from serve.model.delta import DeltaConfig, build_delta
from serve.model.pipeline import (
    _parser,
    _step_args,
    config_from_args,
    id_mapping_line,
    step_fingerprints,
)
from serve.model.pipeline_config import PipelineConfig, default_workdir
from serve.model.quantize import _with_id_maps
from serve.model.train import RowMapper, TrainConfig
from serve.profiles import get_profile
from serve.runtime.artifact import load_artifact
from serve.runtime.idmap import FALLBACK_ROW, IdMap
from serve.store.deltas.format import decode_delta
from tests.fixtures.deltas import with_delta_rows
from tests.fixtures.pipeline import build_tiny

TINY = get_profile("tiny")


# ----------------------------------------------------------------------------- fast

def test_managed_pipeline_names_args_and_modulo_unchanged(tmp_path):
    modulo = PipelineConfig(profile=TINY, workdir=tmp_path)
    managed = PipelineConfig(profile=TINY, workdir=tmp_path, mapping="managed")
    assert modulo.version_name == "tiny-int8-s0" and modulo.admission is None
    assert managed.version_name == "tiny-int8-s0-managed"
    assert managed.admission == AdmissionConfig("lfu_lru", 2, 2, 1, DEFAULT_FALLBACK_SHARE)
    assert default_workdir("tiny", 0) == Path("build/tiny-s0")
    assert default_workdir("tiny", 0, mapping="managed") == Path("build/tiny-s0-managed")
    assert "id_mapping" not in _step_args(modulo)["train"]  # modulo arguments as before
    idm = _step_args(managed)["train"]["id_mapping"]
    assert {k: idm[k] for k in ("mapping", "policy", "threshold", "ttl_days",
                                "recency_days")} == {
        "mapping": "managed", "policy": "lfu_lru", "threshold": 2, "ttl_days": 2,
        "recency_days": 1}
    fm, fg = step_fingerprints(modulo), step_fingerprints(managed)
    assert fm["data"] == fg["data"] and fm["train"] != fg["train"]
    other = PipelineConfig(profile=TINY, workdir=tmp_path, mapping="managed", eviction="ttl")
    assert step_fingerprints(other)["train"] != fg["train"]


def test_managed_pipeline_cli_and_validation(tmp_path):
    args = _parser().parse_args(["--profile", "tiny", "--mapping", "managed", "--eviction",
                                 "lru", "--admit-threshold", "3", "--ttl-days", "4",
                                 "--recency-days", "2"])
    cfg = config_from_args(args)
    assert cfg.workdir == Path("build/tiny-s0-managed")
    assert cfg.admission == AdmissionConfig("lru", 3, 4, 2, DEFAULT_FALLBACK_SHARE)
    one_row = config_from_args(_parser().parse_args(["--profile", "tiny", "--mapping", "managed",
                                                     "--fallback-share", "0"]))
    assert one_row.admission.fallback_share == 0.0
    with pytest.raises(ConfigError, match="--fallback-share 1.0 must be in"):
        PipelineConfig(profile=TINY, workdir=tmp_path, mapping="managed", fallback_share=1.0)
    assert config_from_args(_parser().parse_args(["--profile", "tiny"])).mapping == "modulo"
    with pytest.raises(ConfigError, match="--mapping 'hashed' must be one of modulo, managed"):
        PipelineConfig(profile=TINY, workdir=tmp_path, mapping="hashed")
    with pytest.raises(ConfigError, match="--admit-threshold"):
        PipelineConfig(profile=TINY, workdir=tmp_path, mapping="managed", admit_threshold=0)
    with pytest.raises(ConfigError, match="needs a managed id space"):
        TrainConfig(profile=TINY, data_dir=tmp_path, out_dir=tmp_path / "c",
                    admission_from=tmp_path / ADMISSION_FILE)


def test_row_mapper_modulo_collision_and_managed_fallback():
    ids = torch.tensor([[[3], [7]], [[12], [1 << 62]], [[0], [5]]])  # (B=3, F=2, M=1)
    modulo = RowMapper((10, 6))(ids)
    assert modulo[:, 0, 0].tolist() == [3, 2, 0]      # 12 collides with 2
    assert modulo[:, 1, 0].tolist() == [1, (1 << 62) % 6, 5]
    m = IdMap.from_arrays(np.array([5, 7]), np.array([2, 1]), 6)
    managed = RowMapper((10, 6), {1: m})(ids)
    assert managed[:, 0, 0].tolist() == [3, 2, 0]
    assert managed[:, 1, 0].tolist() == [1, FALLBACK_ROW, 2]
    small = torch.tensor([[[4], [3]]])
    assert torch.equal(RowMapper((10, 6))(small), small)  # day-0 ids: the identity


def test_id_mapping_summary_line_names_the_managed_policy():
    idm = {"mapping": "managed", "policy": "lfu_lru", "threshold": 2,
           "tables": {"a": {"admitted": 9, "capacity": 9, "occupancy": 1.0},
                      "b": {"admitted": 1, "capacity": 3, "occupancy": 0.333}}}
    assert id_mapping_line(idm) == ("  id mapping managed (lfu_lru, threshold 2): 10 admitted "
                                    "ids / 12 capacity (83.3%) over 2 tables")


def test_with_id_maps_marks_managed_tables():
    from serve.runtime.artifact import Artifact, QuantTable, quantize_rows_reference

    torch.manual_seed(0)
    tables = [QuantTable(f"t{i}", 6, 4, "int8",
                         quantize_rows_reference(torch.randn(6, 4), "int8")) for i in range(2)]
    dense = [(torch.randn(4, 3), torch.randn(4))]
    over = [(torch.randn(1, 4 + 1), torch.randn(1))]
    art = Artifact.dlrm(["a", "b"], 3, "int8", tables, dense, over)
    assert _with_id_maps(art, {}) is art
    m = IdMap.from_arrays(np.array([40]), np.array([3]), 6)
    out = _with_id_maps(art, {"t1": m})
    assert [t.mapping for t in out.schema.tables] == ["modulo", "managed"]
    assert out.id_maps["t1"].equal(m) and not art.id_maps


# ----------------------------------------------------------------------------- tiny builds

@pytest.fixture(scope="module")
def managed_build():
    return build_tiny("tiny", mapping="managed")


@pytest.mark.slow
def test_managed_build_has_id_maps_with_fallback_row_reserved(managed_build):
    b = managed_build
    art = load_artifact(b.artifact)
    names = [t.name for t in art.schema.tables]
    assert sorted(art.id_maps) == sorted(names)
    assert {t.mapping for t in art.schema.tables} == {"managed"}
    state = load_state(b.checkpoint / ADMISSION_FILE)
    rep = b.report["id_mapping"]
    assert rep["mapping"] == "managed" and rep["policy"] == "lfu_lru"
    assert (rep["threshold"], rep["ttl_days"], rep["recency_days"]) == (2, 2, 1)
    for t in art.schema.tables:
        m = art.id_maps[t.name]
        _ids, rows = m.to_numpy()
        assert rows.min() >= t.fallback_rows and rows.max() < t.rows  # fallback rows reserved
        assert m.equal(state.id_map(t.name))
        cap = t.rows - t.fallback_rows
        assert rep["tables"][t.name] == {"admitted": m.size, "capacity": cap,
                                         "occupancy": round(m.size / cap, 6)}
    # the fp32 twin carries the same maps
    fl = load_artifact(b.float_artifact)
    assert all(fl.id_maps[n].equal(art.id_maps[n]) for n in names)
    total = sum(t["admitted"] for t in rep["tables"].values())
    print(f"tiny managed build: {total} ids admitted of "
          f"{sum(t['capacity'] for t in rep['tables'].values())} capacity")


@pytest.mark.slow
def test_managed_delta_carries_admit_and_evict_and_rebuilds_exactly(managed_build, tmp_path):
    b = managed_build
    cfg = DeltaConfig(day=1, version=b.version, model_store=b.repository, build_dir=b.workdir,
                      work_root=tmp_path / "deltas", data_dir=tmp_path / "day1",
                      backend="gloo", max_steps=30)
    res = build_delta(cfg, say=lambda _s: None)
    delta = decode_delta(res.path.read_bytes())
    base, new = load_artifact(b.artifact), load_artifact(res.folder / "artifact.pt")
    admitted = sum(t.assign_ids.shape[0] for t in delta.tables)
    evicted = sum(t.evict_ids.shape[0] for t in delta.tables)
    assert admitted > 0 and evicted > 0
    changes = res.done["id_changes"]
    assert set(changes) <= {t.name for t in new.schema.tables}  # per table name
    assert sum(c["admitted"] for c in changes.values()) == admitted
    assert sum(c["evicted"] for c in changes.values()) == evicted
    print(f"tiny managed delta day 1: {admitted} ids admitted, {evicted} evicted, "
          f"{delta.rows} rows, AUC {res.done['auc_before']:.4f} -> {res.done['auc_after']:.4f}")
    new_ids = set()
    for t in delta.tables:
        assert np.isin(t.assign_rows, t.ids).all()  # assigned ids' rows always ship
        new_ids |= set(t.assign_ids.tolist())
    # brand-new day-1 ids (>= the table's rows) were admitted
    card = dict(zip(TINY.feature_names, TINY.cardinalities, strict=True))
    assert any(any(i >= card[t.feature] for i in t.assign_ids.tolist()) for t in delta.tables)
    # base + the delta's id changes (IdMap.apply) and rows = the delta's seq artifact
    rebuilt = with_delta_rows(base, delta)
    for spec, got, want in zip(new.schema.tables, rebuilt.tables, new.tables, strict=True):
        assert torch.equal(got.data, want.data), spec.name
        m = base.id_maps[spec.name]
        dt = [t for t in delta.tables if t.table == new.schema.tables.index(spec)]
        if dt:
            m = m.apply(dt[0].assign_ids, dt[0].assign_rows, dt[0].evict_ids)
        assert m.equal(new.id_maps[spec.name]), spec.name
        assert rebuilt.id_maps[spec.name].equal(new.id_maps[spec.name])
    # the next sequence continues this state
    assert load_state(res.folder / ADMISSION_FILE).day == 1
    done = json.loads((res.folder / "done.json").read_text())
    assert done["id_mapping"]["policy"] == "lfu_lru"
