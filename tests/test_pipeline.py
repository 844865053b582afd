"""The end-to-end build: report, .mar, idempotence, bad input at the CLI."""
import json
import os
import shutil
import sys
import zipfile
from datetime import datetime

import pytest

from serve.model.pipeline import REPORT_KEYS, STEPS
from serve.profiles import get_profile
from tests.fixtures.pipeline import run_in_group


def _run(*args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_in_group([sys.executable, "-m", "serve.model.pipeline", *args], env=env, timeout=timeout)


def test_report_has_every_key(tiny_build):
    r = tiny_build.report
    assert set(REPORT_KEYS) <= set(r)
    assert r["profile"] == "tiny" and r["world_size"] == 2
    assert set(r["sharding_plan"]) == {f"t_C{i}" for i in range(1, 27)}
    assert set(r["sharding_plan"].values()) == {"column_wise", "table_wise"}
    assert 0 <= r["merged_max_abs_diff"] <= 1e-6
    p = get_profile("tiny")
    over_in = p.embedding_dim + (p.num_sparse + 1) * p.num_sparse // 2  # dense emb + pairwise dots
    mlp = sum(i * o + o for i, o in zip((13, *p.dense_arch), p.dense_arch))
    mlp += sum(i * o + o for i, o in zip((over_in, *p.over_arch), p.over_arch))
    assert r["num_parameters"] == p.total_rows * p.embedding_dim + mlp
    datetime.fromisoformat(r["created_at"])
    assert r["git_commit"] is None or len(r["git_commit"]) >= 40
    assert set(r["wall_seconds"]) == {"data", "train", "merge", "quantize"}


def test_mar_holds_handler_artifact_and_config(tiny_build):
    with zipfile.ZipFile(tiny_build.mar) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
    assert {"artifact.pt", "dlrm_handler.py", "model-config.yaml"} <= names
    assert manifest["model"]["modelName"] == "dlrm"


@pytest.fixture
def workdir_copy(tiny_build, tmp_path):
    d = tmp_path / "w"
    shutil.copytree(tiny_build.workdir, d)
    return d


def test_second_run_skips_every_step_and_dtype_change_redoes_only_the_tail(workdir_copy):
    ms = workdir_copy / "model_store"
    args = ("--profile", "tiny", "--workdir", str(workdir_copy), "--model-store", str(ms),
            "--backend", "gloo")
    # First run: brings the copy up to date should a source file have changed since the
    # cached build (others edit serve/ while tests run); usually it skips everything too.
    first = _run(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (ms / "dlrm.report.json").read_text()
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in STEPS:
        assert f"[{step}] up to date" in proc.stdout, proc.stdout
    assert "ran nothing; skipped data, train, merge, quantize, archive" in proc.stdout
    assert (ms / "dlrm.report.json").read_text() == before

    proc = _run("--profile", "tiny", "--workdir", str(workdir_copy), "--model-store", str(ms),
                "--backend", "gloo", "--dtype", "fp16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran quantize, archive; skipped data, train, merge" in proc.stdout
    rep = json.loads((ms / "dlrm.report.json").read_text())
    assert rep["quantized_dtype"] == "fp16"
    assert rep["table_bytes_quantized"] == rep["table_bytes_fp32"] // 2
    assert "AUC fp32" in proc.stdout and "merged_max_abs_diff" in proc.stdout


def test_unknown_profile_exits_nonzero_with_choices(tmp_path):
    proc = _run("--profile", "huge", "--workdir", str(tmp_path / "w"))
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "error: profile 'huge' does not exist; choose one of: tiny, small, criteo-kaggle")
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
