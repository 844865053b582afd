"""The end-to-end build: versions in the model repository, report, .mar, idempotence,
immutability, bad input at the CLI."""
import hashlib
import json
import os
import shutil
import stat
import sys
import zipfile
from datetime import datetime
from pathlib import Path

import pytest
import torch

from serve.errors import ConfigError
from serve.model.pipeline import REPORT_KEYS, STEPS, run_pipeline, step_fingerprints
from serve.model.pipeline_config import PipelineConfig, default_workdir
from serve.profiles import get_profile
from serve.store.repository import ModelRepository, default_version
from tests.fixtures.pipeline import run_in_group

TINY = get_profile("tiny")


def _run(*args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_in_group([sys.executable, "-m", "serve.model.pipeline", *args], env=env, timeout=timeout)


def _read_only(path: Path) -> bool:
    return not os.stat(path).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


# ----------------------------------------------------------------- names, fast (no training)

def test_default_version_and_workdir_come_from_profile_dtype_and_seed(tmp_path):
    assert default_version("small", "int8", 0) == "small-int8-s0"
    assert default_workdir("small", 7) == Path("build/small-s7")
    cfg = PipelineConfig(profile=TINY, workdir=tmp_path)
    assert cfg.train_seed == TINY.seed == 0 and cfg.version_name == "tiny-int8-s0"
    cfg = PipelineConfig(profile=TINY, workdir=tmp_path, seed=7, dtype="fp16")
    assert cfg.train_seed == 7 and cfg.version_name == "tiny-fp16-s7"
    assert cfg.mar == tmp_path / "dlrm-tiny-fp16-s7.mar"
    assert PipelineConfig(profile=TINY, workdir=tmp_path, version="exp.2").version_name == "exp.2"


@pytest.mark.parametrize("bad", ["a_b", "-lead", "has space", "x/y", "v" * 65, ""])
def test_version_names_are_validated(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"^--version '.*' is not a valid version name: use "
                                          r"letters, digits, '\.' and '-' \(no '_'"):
        PipelineConfig(profile=TINY, workdir=tmp_path, version=bad)


def test_negative_seed_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--seed -1 must be an integer >= 0"):
        PipelineConfig(profile=TINY, workdir=tmp_path, seed=-1)


def test_bad_version_exits_nonzero_before_any_work(tmp_path):
    proc = _run("--profile", "tiny", "--workdir", str(tmp_path / "w"),
                "--model-store", str(tmp_path / "ms"), "--version", "tiny_b")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --version 'tiny_b' is not a valid version name")
    assert not (tmp_path / "w").exists() and not (tmp_path / "ms").exists()


def test_fingerprints_chain_and_name_the_build(tmp_path):
    base = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, backend="gloo"))
    assert list(base) == list(STEPS)
    # Not the work directory or the store: only what the build is made of.
    moved = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path / "x", backend="gloo",
                                             model_store=tmp_path / "y"))
    assert moved == base
    seed7 = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, backend="gloo", seed=7))
    assert seed7["data"] == base["data"]  # same data for every seed
    assert all(seed7[s] != base[s] for s in STEPS[1:])
    batch4 = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, backend="gloo",
                                              mar_batch_size=4))
    assert [s for s in STEPS if batch4[s] != base[s]] == ["archive"]


def _fake_version(store: Path, tmp_path: Path, version: str, fingerprint: str) -> Path:
    """A version as an earlier build stored it (only the report keys the pipeline reads)."""
    src = tmp_path / "fake.mar"
    src.write_bytes(b"an archive stored earlier")
    return ModelRepository([store]).add(version, src, {
        "version": version, "build_fingerprint": fingerprint, "profile": "tiny", "seed": 0,
        "world_size": 2, "created_at": "2026-12-01T09:00:00+00:00"})


def test_existing_version_with_this_build_is_up_to_date_without_any_work(tmp_path):
    store, w = tmp_path / "ms", tmp_path / "w"
    cfg = PipelineConfig(profile=TINY, workdir=w, model_store=store, backend="gloo")
    mar = _fake_version(store, tmp_path, "tiny-int8-s0", step_fingerprints(cfg)["archive"])
    said: list[str] = []
    res = run_pipeline(cfg, say=said.append)
    assert res.ran == [] and res.skipped == list(STEPS)
    assert res.version == "tiny-int8-s0" and res.archive == mar
    assert said[0].startswith("version tiny-int8-s0 is in ") and "nothing to build" in said[0]
    assert all(f"[{s}] up to date" in line for s, line in zip(STEPS, said[1:], strict=True))
    assert not w.exists()  # the repository answered: no work directory, no step ran


def test_existing_version_from_another_build_is_refused_before_any_work(tmp_path):
    store, w = tmp_path / "ms", tmp_path / "w"
    mar = _fake_version(store, tmp_path, "tiny-int8-s0", "0123456789abcdef")
    proc = _run("--profile", "tiny", "--workdir", str(w), "--model-store", str(store),
                "--backend", "gloo")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().startswith(
        "error: version 'tiny-int8-s0' already exists and versions are immutable; pass "
        "--version NAME (make model VERSION=NAME): ")
    assert "was built from fingerprint 0123456789abcdef" in proc.stderr
    assert not w.exists() and "running" not in proc.stdout
    assert mar.read_bytes() == b"an archive stored earlier" and _read_only(mar)
    # --force is a rebuild, so it needs a new name too
    cfg = PipelineConfig(profile=TINY, workdir=w, model_store=store, backend="gloo", force=True)
    with pytest.raises(ConfigError, match=r"already exists and versions are immutable; .*"
                                          r"--force rebuilds every step"):
        run_pipeline(cfg, say=lambda _: None)


def test_if_missing_builds_nothing_when_that_version_exists(tmp_path):
    store = tmp_path / "ms"
    _fake_version(store, tmp_path, "tiny-int8-s0", "0123456789abcdef")
    proc = _run("--profile", "tiny", "--workdir", str(tmp_path / "w"), "--model-store", str(store),
                "--if-missing")
    assert proc.returncode == 0, proc.stderr
    assert "holds version tiny-int8-s0; not building (--if-missing)" in proc.stdout
    assert not (tmp_path / "w").exists()
    # by name too: `make up VERSION=mine` serves an existing version without building
    _fake_version(store, tmp_path, "mine", "0123456789abcdef")
    proc = _run("--profile", "tiny", "--workdir", str(tmp_path / "w"), "--model-store", str(store),
                "--version", "mine", "--if-missing")
    assert proc.returncode == 0 and "holds version mine; not building" in proc.stdout, proc.stderr
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------- the real tiny build (slow, cached)

def test_report_has_every_key(tiny_build):
    r = tiny_build.report
    assert set(REPORT_KEYS) <= set(r)
    assert tiny_build.version == r["version"] == "tiny-int8-s0"
    assert r["seed"] == r["data_seed"] == 0
    assert r["archive"] == "dlrm-tiny-int8-s0.mar" == tiny_build.mar.name
    assert len(r["build_fingerprint"]) == 16
    # the shipped batching: 2 requests, merged only when already queued (delay 0)
    assert (r["mar_batch_size"], r["mar_max_batch_delay_ms"], r["mar_workers"]) == (2, 0, 2)
    assert r["profile"] == "tiny" and r["world_size"] == 2
    assert set(r["sharding_plan"]) == {f"t_C{i}" for i in range(1, 27)}
    assert set(r["sharding_plan"].values()) == {"column_wise", "table_wise"}
    assert 0 <= r["merged_max_abs_diff"] <= 1e-6
    p = TINY
    over_in = p.embedding_dim + (p.num_sparse + 1) * p.num_sparse // 2  # dense emb + pairwise dots
    mlp = sum(i * o + o for i, o in zip((13, *p.dense_arch[:-1]), p.dense_arch, strict=True))
    mlp += sum(i * o + o for i, o in zip((over_in, *p.over_arch[:-1]), p.over_arch, strict=True))
    assert r["num_parameters"] == p.total_rows * p.embedding_dim + mlp
    datetime.fromisoformat(r["created_at"])
    assert r["git_commit"] is None or len(r["git_commit"]) >= 40
    assert set(r["wall_seconds"]) == {"data", "train", "merge", "quantize"}


def test_version_lives_in_the_repository_read_only(tiny_build):
    repo = ModelRepository([tiny_build.repository])
    assert repo.versions() == [tiny_build.version]
    assert repo.archive(tiny_build.version) == tiny_build.mar
    assert _read_only(tiny_build.mar) and _read_only(tiny_build.mar.with_suffix(".json"))
    assert not (tiny_build.repository / "dlrm.mar").exists()  # the old single-file layout
    # the staging copy in the work directory is not kept (the repository holds the archive)
    assert not list(tiny_build.workdir.glob("*.mar"))


def test_mar_holds_handler_artifact_and_config(tiny_build):
    with zipfile.ZipFile(tiny_build.mar) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
    assert {"artifact.pt", "dlrm_handler.py", "model-config.yaml"} <= names
    assert manifest["model"]["modelName"] == "dlrm"
    assert manifest["model"]["modelVersion"] == tiny_build.version


@pytest.fixture
def workdir_copy(tiny_build, tmp_path):
    """The build's work directory (step cache) without its repository."""
    d = tmp_path / "w"
    shutil.copytree(tiny_build.workdir, d, ignore=shutil.ignore_patterns("model_store"))
    return d


def test_second_run_skips_every_step_and_dtype_change_redoes_only_the_tail(workdir_copy, tmp_path):
    ms = tmp_path / "ms"
    args = ("--profile", "tiny", "--workdir", str(workdir_copy), "--model-store", str(ms),
            "--backend", "gloo")
    # First run: an empty repository, so the archive step runs (and any step whose
    # sources changed since the cached build: others edit serve/ while tests run).
    first = _run(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[archive] added version tiny-int8-s0" in first.stdout
    report = ms / "dlrm-tiny-int8-s0.json"
    before = report.read_bytes()
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in STEPS:
        assert f"[{step}] up to date" in proc.stdout, proc.stdout
    assert "ran nothing; skipped data, train, merge, quantize, archive" in proc.stdout
    assert report.read_bytes() == before

    proc = _run(*args, "--dtype", "fp16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran quantize, archive; skipped data, train, merge" in proc.stdout
    assert sorted(ModelRepository([ms]).versions()) == ["tiny-fp16-s0", "tiny-int8-s0"]
    rep = json.loads((ms / "dlrm-tiny-fp16-s0.json").read_text())
    assert rep["quantized_dtype"] == "fp16" and rep["version"] == "tiny-fp16-s0"
    assert rep["table_bytes_quantized"] == rep["table_bytes_fp32"] // 2
    assert "AUC fp32" in proc.stdout and "merged_max_abs_diff" in proc.stdout
    assert report.read_bytes() == before  # the int8 version is untouched


def test_same_name_for_a_different_build_is_refused_and_changes_nothing(workdir_copy, tmp_path):
    ms = tmp_path / "ms"
    args = ("--profile", "tiny", "--workdir", str(workdir_copy), "--model-store", str(ms),
            "--backend", "gloo")
    assert _run(*args).returncode == 0
    mar, report = ms / "dlrm-tiny-int8-s0.mar", ms / "dlrm-tiny-int8-s0.json"
    digest = hashlib.sha256(mar.read_bytes()).hexdigest()
    before = report.read_bytes()
    done = (workdir_copy / "archive.done.json").read_bytes()
    proc = _run(*args, "--mar-batch-size", "4")  # same name, different archive
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(
        "error: version 'tiny-int8-s0' already exists and versions are immutable; pass "
        "--version NAME (make model VERSION=NAME)")
    assert "running" not in proc.stdout
    assert hashlib.sha256(mar.read_bytes()).hexdigest() == digest and report.read_bytes() == before
    assert (workdir_copy / "archive.done.json").read_bytes() == done
    # the way out the message names
    proc = _run(*args, "--mar-batch-size", "4", "--version", "tiny-b4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran archive; skipped data, train, merge, quantize" in proc.stdout
    assert json.loads((ms / "dlrm-tiny-b4.json").read_text())["mar_batch_size"] == 4


@pytest.mark.slow
def test_a_second_seed_adds_a_second_version_with_other_weights(tiny_build, tiny_build_seed7,
                                                                tmp_path):
    from serve.runtime.artifact import load_artifact

    s0, s7 = tiny_build, tiny_build_seed7
    assert s7.version == "tiny-int8-s7" and s7.report["seed"] == 7
    # the same click logs: the data keeps the profile's seed
    assert s7.report["data_seed"] == s0.report["data_seed"] == 0
    for f in sorted(s0.data_dir.glob("*.*")):
        if f.name != "meta.json":  # meta.json also holds the generation time
            assert (s7.data_dir / f.name).read_bytes() == f.read_bytes(), f.name
    # next to the first version: s0 is in the repository, the s7 build adds its own
    ms = tmp_path / "ms"
    ModelRepository([ms]).add(s0.version, s0.mar, s0.report)
    w = tmp_path / "w7"
    shutil.copytree(s7.workdir, w, ignore=shutil.ignore_patterns("model_store"))
    proc = _run("--profile", "tiny", "--seed", "7", "--workdir", str(w), "--model-store", str(ms),
                "--backend", "gloo")
    assert proc.returncode == 0, proc.stderr[-3000:]
    repo = ModelRepository([ms])
    assert sorted(repo.versions()) == ["tiny-int8-s0", "tiny-int8-s7"]
    assert repo.latest() == "tiny-int8-s7"  # built last
    assert repo.report("tiny-int8-s7")["build_fingerprint"] == s7.report["build_fingerprint"]
    # different weights
    a0, a7 = load_artifact(s0.artifact), load_artifact(s7.artifact)
    assert not torch.equal(a0.dense.dense_arch[0][0], a7.dense.dense_arch[0][0])
    assert not torch.equal(a0.tables[0].data, a7.tables[0].data)


def test_unknown_profile_exits_nonzero_with_choices(tmp_path):
    proc = _run("--profile", "huge", "--workdir", str(tmp_path / "w"))
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "error: profile 'huge' does not exist; choose one of: tiny, small, small-half, small-hashed, criteo-kaggle")
    assert not (tmp_path / "w").exists()


def test_unshardable_world_size_fails_before_any_work(tmp_path):
    proc = _run("--profile", "tiny", "--workdir", str(tmp_path / "w"), "--nproc", "500",
                "--backend", "gloo")
    assert proc.returncode == 2
    assert "error: world size 500 cannot be sharded: profile 'tiny'" in proc.stderr
    assert "use --nproc <= 77" in proc.stderr
    assert not (tmp_path / "w").exists()


def test_help():
    proc = _run("--help")
    assert proc.returncode == 0 and "--force" in proc.stdout and "skipped" in proc.stdout
    assert "--seed" in proc.stdout and "--version" in proc.stdout and "immutable" in proc.stdout
