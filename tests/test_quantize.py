"""Quantization through TorchRec: AUC bar, table bytes, the artifacts it writes."""
import json
import subprocess
import sys

import pytest
import torch

from serve.errors import CheckpointError, QualityError
from serve.model.merge import load_merged
from serve.model.quantize import INT8_MAX_AUC_DROP, quantize
from serve.profiles import get_profile
from serve.runtime.artifact import dequantize_rows, load_artifact, row_bytes

TINY = get_profile("tiny")


def test_int8_keeps_auc_within_the_bar(tiny_build):
    r = tiny_build.report
    assert r["quantized_dtype"] == "int8"
    assert r["auc_fp32"] > 0.7
    assert r["auc_quantized"] >= r["auc_fp32"] - INT8_MAX_AUC_DROP


def test_table_bytes(tiny_build):
    r = tiny_build.report
    assert r["table_bytes_fp32"] == TINY.total_rows * 16 * 4
    # int8 row: 4 bytes fp16 scale+bias + 16 bytes of codes
    assert r["table_bytes_quantized"] == TINY.total_rows * row_bytes("int8", 16) == TINY.total_rows * 20


def test_artifacts_hold_the_merged_weights(tiny_build):
    model, _ = load_merged(tiny_build.merged, TINY)
    ebc = model.sparse_arch.embedding_bag_collection
    fart = load_artifact(tiny_build.float_artifact)
    qart = load_artifact(tiny_build.artifact)
    assert fart.dtype == "fp32" and qart.dtype == "int8"
    assert qart.meta["profile"] == "tiny" and qart.meta["auc_int8"] == tiny_build.report["auc_quantized"]
    for ft, qt in zip(fart.tables, qart.tables, strict=True):
        w = ebc.embedding_bags[ft.name].weight.detach()
        assert torch.equal(dequantize_rows(ft.data, "fp32", ft.dim), w)  # fp32 artifact is exact
        back = dequantize_rows(qt.data, "int8", qt.dim)
        # Row-wise min-max int8: error <= half a step (range/255/2) plus fp16 scale/bias rounding.
        step = (w.max(1).values - w.min(1).values) / 255
        assert ((back - w).abs().max(1).values <= step * 0.5 + 2e-3).all(), ft.name
    # The MLPs are carried over in fp32, identical in both.
    for (wa, ba), (wb, bb) in zip(fart.dense.dense_arch + fart.dense.over_arch,
                                      qart.dense.dense_arch + qart.dense.over_arch, strict=True):
        assert torch.equal(wa, wb) and torch.equal(ba, bb)


@pytest.mark.parametrize("dtype,max_drop", [("fp16", 1e-3), ("int4", 0.02)])
def test_other_dtypes(tiny_build, tmp_path, dtype, max_drop):
    res = quantize(tiny_build.merged, TINY, tiny_build.data_dir, dtype, tmp_path / "a.pt",
                   eval_limit=2000, progress=False)
    assert res.eval_rows == 2000
    assert res.auc_quantized >= res.auc_fp32 - max_drop
    assert res.table_bytes_quantized == TINY.total_rows * row_bytes(dtype, 16)
    assert load_artifact(tmp_path / "a.pt").dtype == dtype
    assert (tmp_path / "a.fp32.pt").is_file() and (tmp_path / "a.pt.json").is_file()


def test_quality_bar_failure_is_explained(tiny_build, tmp_path):
    # A bar no model can meet (quantized AUC above fp32 AUC + 1) must raise, naming both AUCs.
    with pytest.raises(QualityError, match=r"int8 AUC 0\.\d{5} is below fp32 AUC 0\.\d{5} - -1 "
                                           r"\(the quality bar\).*--dtype fp16"):
        quantize(tiny_build.merged, TINY, tiny_build.data_dir, "int8", tmp_path / "a.pt",
                 eval_limit=500, progress=False, max_auc_drop=-1.0)
    assert not (tmp_path / "a.pt").exists()  # a model that misses the bar is never written
    assert json.loads((tmp_path / "a.pt.json").read_text())["eval_rows"] == 500  # but reported


def test_missing_merged_file(tmp_path, tiny_build):
    with pytest.raises(CheckpointError, match=r"merged checkpoint .*none\.pt does not exist; run "
                                              r"`python -m serve\.model\.merge`"):
        quantize(tmp_path / "none.pt", TINY, tiny_build.data_dir, "int8", tmp_path / "a.pt")


def test_cli_rejects_unknown_dtype(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "serve.model.quantize", "--merged", "m.pt", "--profile",
                           "tiny", "--data", "d", "--dtype", "int2", "--out", str(tmp_path / "a.pt")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "argument --dtype: invalid choice: 'int2'" in proc.stderr


def test_float_twin_can_be_skipped(tiny_build, tmp_path):
    res = quantize(tiny_build.merged, TINY, tiny_build.data_dir, "int8", tmp_path / "a.pt",
                   eval_limit=500, progress=False, float_artifact=False)
    assert res.float_artifact is None and not (tmp_path / "a.fp32.pt").exists()
    assert load_artifact(tmp_path / "a.pt").dtype == "int8"
