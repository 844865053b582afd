"""Profiles, errors and the artifact row format (shared contracts)."""
import copy

import pytest
import torch

from serve.artifact import (
    artifact_from_quantized_dlrm,
    dequantize_rows,
    load_artifact,
    quantize_rows_reference,
    row_bytes,
    save_artifact,
)
from serve.errors import ArtifactError, UnknownProfileError
from serve.profiles import PROFILES, get_profile


def test_unknown_profile_names_the_choices():
    with pytest.raises(UnknownProfileError,
                       match=r"profile 'huge' does not exist; choose one of: tiny, small, criteo-kaggle"):
        get_profile("huge")


def test_criteo_kaggle_profile_size():
    p = PROFILES["criteo-kaggle"]
    assert p.total_rows == 33_762_577
    assert p.table_bytes_fp32() == 33_762_577 * 64 * 4


@pytest.mark.parametrize("dtype,dim,want", [("int8", 64, 68), ("int4", 64, 36), ("fp16", 64, 128),
                                            ("int8", 16, 20), ("fp32", 8, 32)])
def test_row_bytes(dtype, dim, want):
    assert row_bytes(dtype, dim) == want


@pytest.mark.parametrize("dtype,tol", [("int8", 2e-3), ("int4", 3e-2), ("fp16", 1e-3), ("fp32", 0.0)])
def test_reference_quantization_round_trips(dtype, tol):
    torch.manual_seed(0)
    w = torch.randn(100, 16) * 0.1
    back = dequantize_rows(quantize_rows_reference(w, dtype), dtype, 16)
    assert back.shape == (100, 16)
    assert (back - w).abs().max().item() <= tol


@pytest.mark.parametrize("name,qdtype", [("int8", torch.int8), ("int4", torch.quint4x2),
                                         ("fp16", torch.float16)])
def test_torchrec_quantized_tables_convert_exactly(tmp_path, name, qdtype):
    """Our row format decodes to exactly what TorchRec's own quantized tables hold."""
    from torchrec.inference.modules import quantize_inference_model

    from serve.model import build_dlrm

    model = build_dlrm(get_profile("tiny"), seed=0)
    qmodel = quantize_inference_model(copy.deepcopy(model), quantization_dtype=qdtype)
    art = artifact_from_quantized_dlrm(qmodel, name)
    save_artifact(art, tmp_path / "a.pt")
    back = load_artifact(tmp_path / "a.pt")
    assert [t.feature for t in back.tables] == [f"C{i}" for i in range(1, 27)]
    # Our reference quantizer follows FBGEMM's min-max rule, so both decode alike.
    t = back.tables[2]
    fw = model.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight.detach()
    ours = dequantize_rows(quantize_rows_reference(fw, name), name, t.dim)
    theirs = dequantize_rows(t.data, name, t.dim)
    assert (ours - theirs).abs().max().item() <= {"int8": 1e-3, "int4": 1e-2, "fp16": 0.0}[name]


def test_missing_artifact_says_how_to_build(tmp_path):
    with pytest.raises(ArtifactError, match=r"does not exist; build it with `make model`"):
        load_artifact(tmp_path / "nope.pt")


def test_corrupt_artifact_is_rejected(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ArtifactError, match=r"is unreadable"):
        load_artifact(bad)
