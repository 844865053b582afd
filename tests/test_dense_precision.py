"""The dense-precision lever (issue 32.2): a build may serve its dense part in bf16 or
int8 only through the AUC gate (serve.model.precision), the version says so in its name,
the archive's handler config carries it and the worker serves it.

Uses the cached tiny build (tests/fixtures/pipeline.py); the gate scores its held-out rows
twice (fp32 and the lossy precision) through the serving runtime.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile

import numpy as np
import pytest
import torch
import yaml

from serve.api.config import HandlerConfig
from serve.constants import DENSE_MAX_AUC_DROP
from serve.errors import ConfigError, QualityError
from serve.model.pipeline_config import PipelineConfig
from serve.model.precision import dense_precision_gate, score_heldout
from serve.profiles import get_profile
from serve.store.repository import ModelRepository, default_version
from serve.worker import Worker
from tests.fixtures.pipeline import run_in_group

TINY = get_profile("tiny")
ROWS = 2000  # held-out rows the gate tests score (tiny has 4000)


@pytest.mark.parametrize("bad", ["fp16", "BF16", "", "int4"])
def test_handler_config_refuses_an_unknown_dense_precision_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"handler\.dense_precision=.*must be one of fp32, bf16, int8"):
        HandlerConfig(dense_precision=bad)


def test_handler_config_keeps_fp32_archives_unchanged_and_round_trips_bf16():
    assert "dense_precision" not in HandlerConfig().to_dict()
    d = HandlerConfig(dense_precision="bf16").to_dict()
    assert d["dense_precision"] == "bf16"
    assert HandlerConfig.from_dict(d).dense_precision == "bf16"


def test_version_names_a_lossy_dense_precision():
    assert default_version("small", "int8", 0) == "small-int8-s0"
    assert default_version("small", "int8", 0, dense_precision="fp32") == "small-int8-s0"
    assert default_version("small", "int8", 0, dense_precision="bf16") == "small-int8-s0-dense-bf16"
    assert (default_version("small", "int8", 0, mapping="managed", dense_precision="int8")
            == "small-int8-s0-managed-dense-int8")


def test_pipeline_config_refuses_a_bad_precision_and_a_handler_config_that_skips_the_gate(tmp_path):
    with pytest.raises(ConfigError, match="--dense-precision 'fp16' must be one of"):
        PipelineConfig(profile=TINY, workdir=tmp_path, dense_precision="fp16")
    with pytest.raises(ConfigError, match="set it with --dense-precision"):
        PipelineConfig(profile=TINY, workdir=tmp_path,
                       handler_config={"dense_precision": "bf16"})
    cfg = PipelineConfig(profile=TINY, workdir=tmp_path, dense_precision="bf16")
    assert cfg.version_name == "tiny-int8-s0-dense-bf16"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_gate_refuses_a_precision_that_is_not_lossy(tiny_build, precision):
    with pytest.raises(ConfigError, match="compares a lossy one of bf16, int8 with fp32"):
        dense_precision_gate(tiny_build.artifact, tiny_build.data_dir, precision, rows=ROWS)


def test_gate_passes_bf16_on_the_tiny_build_and_reports_both_aucs(tiny_build):
    lines: list[str] = []
    rep = dense_precision_gate(tiny_build.artifact, tiny_build.data_dir, "bf16", rows=ROWS,
                               say=lines.append)
    assert rep.rows == ROWS and rep.precision == "bf16"
    assert rep.max_auc_drop == DENSE_MAX_AUC_DROP
    assert rep.auc >= rep.auc_fp32 - DENSE_MAX_AUC_DROP
    # bf16 is lossy (8 mantissa bits) but close: probabilities move, by little.
    assert 0.0 < rep.max_abs_diff < 0.05
    assert "AUC" in lines[0] and "bf16" in lines[0]


def test_gate_fp32_scores_equal_the_runtime_forward_it_gates(tiny_build):
    """The gate's fp32 baseline is the serving runtime's own answer: two passes agree
    bit for bit (no sampling, no reordering)."""
    labels, p1, _ = score_heldout(tiny_build.artifact, tiny_build.data_dir, "fp32", rows=1000)
    _, p2, _ = score_heldout(tiny_build.artifact, tiny_build.data_dir, "fp32", rows=1000)
    assert labels.shape == p1.shape == (1000,)
    assert np.array_equal(p1, p2)


def test_gate_raises_quality_error_when_the_drop_passes_the_bar(tiny_build):
    # A negative bar demands the lossy AUC beat fp32 by a full point: no model does.
    with pytest.raises(QualityError, match="below fp32 AUC .* serve this model with --dense-precision fp32"):
        dense_precision_gate(tiny_build.artifact, tiny_build.data_dir, "bf16", rows=ROWS,
                             max_auc_drop=-1.0, say=lambda _s: None)
    rep = dense_precision_gate(tiny_build.artifact, tiny_build.data_dir, "bf16", rows=ROWS,
                               max_auc_drop=-1.0, check=False, say=lambda _s: None)
    assert rep.auc < rep.auc_fp32 + 1.0


def test_worker_serves_the_archived_dense_precision(tiny_build, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    os.symlink(tiny_build.artifact, d / "artifact.pt")
    env = {"OMP_NUM_THREADS": "1"}
    w32 = Worker.load(d, HandlerConfig(), model_version="v", environ=env, freeze_gc=False)
    w16 = Worker.load(d, HandlerConfig(dense_precision="bf16"), model_version="v", environ=env,
                      freeze_gc=False)
    assert w32.runtime.config.dense_precision == "fp32"
    assert w16.runtime.config.dense_precision == "bf16"
    assert any(p.dtype == torch.bfloat16 for p in w16.runtime.dense.parameters())
    assert all(p.dtype == torch.float32 for p in w32.runtime.dense.parameters())


@pytest.mark.slow
def test_build_with_dense_bf16_reruns_only_the_archive_and_records_the_gate(tiny_build, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(tiny_build.workdir, work, ignore=shutil.ignore_patterns("model_store"))
    ms = tmp_path / "ms"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "serve.model.pipeline", "--profile", "tiny", "--workdir",
            str(work), "--model-store", str(ms), "--backend", "gloo"]
    proc = run_in_group([*args, "--dense-precision", "bf16"], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[precision] dense bf16: AUC" in proc.stdout
    assert "[archive] added version tiny-int8-s0-dense-bf16" in proc.stdout
    repo = ModelRepository([ms])
    rep = json.loads((ms / "dlrm-tiny-int8-s0-dense-bf16.json").read_text())
    gate = rep["dense_precision"]
    assert gate["precision"] == "bf16" and gate["auc"] >= gate["auc_fp32"] - gate["max_auc_drop"]
    with zipfile.ZipFile(repo.archive("tiny-int8-s0-dense-bf16")) as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert cfg["handler"]["dense_precision"] == "bf16"


def test_bf16_pads_rows_to_a_few_shapes_and_padding_never_reaches_a_real_row(tiny_build):
    """oneDNN builds a bf16 kernel per batch shape: the runtime runs the dense part on a
    multiple of DENSE_PAD_ROWS rows and warms those shapes up. A row's probability does
    not depend on the padding: B=100 (padded to 128) equals the first 100 of B=128."""
    from serve.runtime.engine import DENSE_PAD_ROWS, DENSE_WARM_ROWS, Runtime, RuntimeConfig
    from serve.runtime.warmup import warmup_batch

    rt = Runtime.from_artifact(tiny_build.artifact, RuntimeConfig(device="cpu",
                                                                  dense_precision="bf16"))
    assert [rt.dense_rows(b) for b in (1, 64, 65, 100, 128)] == [64, 64, 128, 128, 128]
    assert rt.dense_shapes() == list(range(DENSE_PAD_ROWS, DENSE_WARM_ROWS + 1, DENSE_PAD_ROWS))
    d, v, lengths = warmup_batch(rt, 128, np.random.default_rng(0))
    nf = lengths.shape[0]
    full = rt.predict_arrays(d, v, lengths)
    part = rt.predict_arrays(d[:100], v.reshape(nf, 128)[:, :100].reshape(-1),
                             lengths[:, :100].copy())
    # Not torch.equal: oneDNN's bf16 kernel may round the last row block of a batch
    # differently by one float32 ulp (seen: row 96, 3e-8); the bar is far below bf16's own
    # error (the gate's |dp| is ~1e-3), so no padded row's value reached a real row.
    diff = (torch.as_tensor(part) - torch.as_tensor(full)[:100]).abs().max()
    assert float(diff) <= 1e-6
    fp32 = Runtime.from_artifact(tiny_build.artifact, RuntimeConfig(device="cpu"))
    assert fp32.dense_rows(100) == 100 and fp32.dense_shapes() == []
