"""Fresh embeddings: drifting days of data, resumed sparse-only training, the delta builder."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from serve.errors import ConfigError
from serve.model.data import DataConfig, _Planted, day_data_dir, ensure_day_data, generate
from serve.model.delta import DONE_FILE, DeltaConfig, build_delta, next_sequence
from serve.model.pipeline import _step_args
from serve.model.pipeline_config import PipelineConfig, default_workdir
from serve.model.train import (
    CHANGED_ROWS_FILE,
    PLAN_FILE,
    TrainConfig,
    check_resume,
    load_changed_rows,
)
from serve.profiles import get_profile
from serve.runtime.artifact import load_artifact
from serve.store.deltas.format import decode_delta, file_sha256, version_digest
from serve.store.repository import default_version
from tests.fixtures.deltas import with_delta_rows

TINY = get_profile("tiny")
FILES = ("train.dense.f32", "train.sparse.ids", "train.labels.u8",
         "eval.dense.f32", "eval.sparse.ids", "eval.labels.u8")
# sha256 over FILES of tiny, 3000 + 1000 rows, seed 0, as generated before days existed
# (serve/model/data.py at commit bfcaea2): day 0 must stay byte for byte what it was, on
# each kind of CPU. numpy's float64 exp/log1p dispatch to AVX-512 kernels where the CPU
# has them (Xeon; AMD Zen 4) and to AVX2 ones elsewhere (an AMD EPYC without AVX-512
# here), which round some results differently in the last bit: two digests, one per
# kernel family, each byte-identical run to run on its machines.
DAY0_GOLDEN = {"avx512": "431e7dbd16dc6533a436701e3899b3637b2fbf78baf92ffc1644d1109e1002c4",
               "avx2": "f5744b1c03c539edf36b076b65b0abbf5b8b73c1ca761219c5905a0309d04660"}


def day0_golden() -> str:
    """The day-0 digest for the float kernels numpy dispatches to on this CPU."""
    from numpy._core._multiarray_umath import __cpu_features__

    return DAY0_GOLDEN["avx512" if __cpu_features__.get("AVX512_SKX") else "avx2"]


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for name in FILES:
        h.update((d / name).read_bytes())
    return h.hexdigest()


def _gen(tmp_path: Path, name: str, day: int | None) -> Path:
    kw = {} if day is None else {"day": day}
    cfg = DataConfig.for_profile(TINY, samples=3000, eval_samples=1000, **kw)
    return generate(cfg, tmp_path / name, progress=False)


# ----------------------------------------------------------------------------- data

def test_day0_is_unchanged(tmp_path):
    default, explicit = _gen(tmp_path, "default", None), _gen(tmp_path, "day0", 0)
    assert _digest(default) == _digest(explicit) == day0_golden()
    assert json.loads((default / "meta.json").read_text())["day"] == 0


def test_day1_is_deterministic_and_differs_from_day0(tmp_path):
    a, b, d0 = _gen(tmp_path, "a", 1), _gen(tmp_path, "b", 1), _gen(tmp_path, "d0", 0)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # Other random streams for every split, not only other ids.
    for name in ("train.dense.f32", "eval.dense.f32", "train.sparse.ids", "eval.labels.u8"):
        assert (a / name).read_bytes() != (d0 / name).read_bytes(), name
    assert json.loads((a / "meta.json").read_text())["day"] == 1
    assert _digest(_gen(tmp_path, "d2", 2)) != _digest(a)


def test_drift_moves_hot_ids_to_cold_ones_and_keeps_dense_and_pairs():
    p0, p1 = _Planted(TINY, 0), _Planted(TINY, 0, day=1)
    np.testing.assert_array_equal(p0.dense_w, p1.dense_w)
    assert p0.pairs == p1.pairs
    for i in p0.latent:
        np.testing.assert_array_equal(p0.latent[i], p1.latent[i])
    big = [j for j, c in enumerate(TINY.cardinalities) if c >= 100]
    assert big
    for j in big:
        card = TINY.cardinalities[j]
        k = max(3, round(0.01 * card))
        rank0 = np.argsort(p0.perms[j])            # id -> day-0 rank
        new_hot = p1.perms[j][:k]
        assert (rank0[new_hot] >= card // 2).all(), j   # cold on day 0
        np.testing.assert_array_equal(np.sort(p0.perms[j]), np.sort(p1.perms[j]))  # a permutation
    changed = sum(int((p0.effects[j] != p1.effects[j]).sum()) for j in range(TINY.num_sparse))
    assert changed > 0
    p1b = _Planted(TINY, 0, day=1)  # deterministic in (seed, day)
    for j in range(TINY.num_sparse):
        np.testing.assert_array_equal(p1.perms[j], p1b.perms[j])
        np.testing.assert_array_equal(p1.effects[j], p1b.effects[j])


def test_bad_day_is_rejected():
    with pytest.raises(ConfigError, match="--day -1"):
        DataConfig.for_profile(TINY, day=-1)


def test_ensure_day_data_reuses_and_regenerates(tmp_path):
    assert day_data_dir("small", 3) == Path("build") / "small-data" / "day3"
    said: list[str] = []
    out = ensure_day_data(TINY, 1, tmp_path / "d1", say=said.append)
    assert out == tmp_path / "d1" and "generating" in said[-2]
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["day"], meta["seed"], meta["splits"]["train"]["rows"]) == (1, 0, 20_000)
    mtime = (out / "train.sparse.ids").stat().st_mtime_ns
    ensure_day_data(TINY, 1, out, say=said.append)
    assert "reused" in said[-1] and (out / "train.sparse.ids").stat().st_mtime_ns == mtime
    meta["day"] = 2  # another day's folder: regenerated
    (out / "meta.json").write_text(json.dumps(meta))
    ensure_day_data(TINY, 1, out, say=said.append)
    assert json.loads((out / "meta.json").read_text())["day"] == 1


def test_pipeline_names_and_args_for_a_later_day(tmp_path):
    assert default_version("small", "int8", 0, data_day=1) == "small-int8-s0-day1"
    assert default_version("small", "int8", 0) == "small-int8-s0"
    assert default_workdir("small", 0, data_day=2) == Path("build/small-s0-day2")
    assert default_workdir("small", 0) == Path("build/small-s0")
    day0 = PipelineConfig(profile=TINY, workdir=tmp_path)
    day1 = PipelineConfig(profile=TINY, workdir=tmp_path, data_day=1)
    assert "day" not in _step_args(day0)["data"]
    assert _step_args(day1)["data"]["day"] == 1
    assert day1.version_name == "tiny-int8-s0-day1"
    with pytest.raises(ConfigError, match="--data-day -1"):
        PipelineConfig(profile=TINY, workdir=tmp_path, data_day=-1)


# ----------------------------------------------------------------------------- resume

def _fake_ckpt(d: Path, world_size: int = 2, profile: str = "tiny") -> Path:
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / PLAN_FILE).write_text(json.dumps({"profile": profile, "world_size": world_size}))
    return d


def test_sparse_only_needs_resume(tmp_path):
    with pytest.raises(ConfigError, match="--sparse-only without --resume"):
        TrainConfig(profile=TINY, data_dir=tmp_path, out_dir=tmp_path / "o", sparse_only=True)


def test_resume_validation(tmp_path):
    def cfg(ckpt):
        return TrainConfig(profile=TINY, data_dir=tmp_path, out_dir=tmp_path / "o",
                           resume_from=ckpt, sparse_only=True)

    with pytest.raises(ConfigError, match="no checkpoint there"):
        check_resume(cfg(tmp_path / "missing"), 2)
    ok = _fake_ckpt(tmp_path / "ck")
    assert check_resume(cfg(ok), 2)["world_size"] == 2
    with pytest.raises(ConfigError, match=r"saved by 2 ranks but this run has 3.*--nproc 2"):
        check_resume(cfg(ok), 3)
    other = _fake_ckpt(tmp_path / "ck-small", profile="small")
    with pytest.raises(ConfigError, match="profile 'small'"):
        check_resume(cfg(other), 2)
    (ok / PLAN_FILE).unlink()
    with pytest.raises(ConfigError, match="plan.json is missing"):
        check_resume(cfg(ok), 2)


def test_delta_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="--day 0"):
        DeltaConfig(day=0)
    with pytest.raises(ConfigError, match=r"pass --version V .*make up"):
        build_delta(DeltaConfig(day=1, state_file=tmp_path / "none.yaml",
                                model_store=tmp_path), say=lambda s: None)


def test_next_sequence_counts_finished_deltas_only(tmp_path):
    assert next_sequence(tmp_path) == 1
    for seq, done in ((1, True), (2, True), (3, False)):
        (tmp_path / f"{seq:08d}").mkdir()
        if done:
            (tmp_path / f"{seq:08d}" / DONE_FILE).write_text("{}")
    assert next_sequence(tmp_path) == 3


# ----------------------------------------------------------------------------- end to end

def _apply(base, delta):
    return [t.data for t in with_delta_rows(base, delta).tables]


def _check_seq(prev_art: Path, res, tiny_build) -> None:
    old, new = load_artifact(prev_art), load_artifact(res.folder / "artifact.pt")
    delta = decode_delta(res.path.read_bytes())
    assert delta.base_version == tiny_build.version and delta.sequence == res.done["sequence"]
    assert delta.rows == res.done["rows"] > 0
    assert res.path.stat().st_size == res.done["bytes"]
    for got, want in zip(_apply(old, delta), new.tables, strict=True):
        assert torch.equal(got, want.data), want.name
    for name in ("dense_arch", "over_arch"):
        for (wo, bo), (wn, bn) in zip(getattr(old.dense, name), getattr(new.dense, name),
                                      strict=True):
            assert torch.equal(wo, wn) and torch.equal(bo, bn)
    touched = load_changed_rows(res.folder / "checkpoint")
    for t in delta.tables:
        assert np.isin(t.ids, touched[t.feature]).all()
    plan = json.loads((res.folder / "checkpoint" / PLAN_FILE).read_text())
    assert plan["sparse_only"] is True and plan["day"] == res.done["day"]
    assert (res.folder / "checkpoint" / CHANGED_ROWS_FILE).is_file()
    for key in ("auc_before", "auc_after", "seconds", "tables"):
        assert key in res.done
    assert delta.parent_digest == res.done["parent_digest"]
    assert res.done["digest"] == file_sha256(res.path)


@pytest.mark.slow
def test_delta_chain_on_tiny(tiny_build, tmp_path):
    """Seq 1 (day 1) on the cached tiny build, seq 2 (day 2) on seq 1; nothing is written
    into the shared build (work root, data in tmp_path)."""
    def cfg(day):
        return DeltaConfig(day=day, version=tiny_build.version,
                           model_store=tiny_build.repository, build_dir=tiny_build.workdir,
                           work_root=tmp_path / "deltas", data_dir=tmp_path / f"day{day}",
                           backend="gloo", max_steps=30)

    said: list[str] = []
    first = build_delta(cfg(1), say=said.append)
    assert first.folder == tmp_path / "deltas" / "00000001"
    assert first.path.name == f"dlrm-{tiny_build.version}-00000001.delta"
    _check_seq(tiny_build.artifact, first, tiny_build)
    assert first.done["parent_digest"] == version_digest(tiny_build.report)
    assert first.done["auc_after"] > first.done["auc_before"]
    second = build_delta(cfg(2), say=said.append)
    assert second.done["sequence"] == 2 and second.done["base"] == str(first.folder)
    _check_seq(first.folder / "artifact.pt", second, tiny_build)
    assert second.done["parent_digest"] == first.done["digest"]  # one chain
    assert not (tiny_build.workdir / "deltas").exists()
