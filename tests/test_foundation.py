"""Profiles, errors and the artifact row format (shared contracts)."""
import copy

import pytest
import torch

from serve.errors import ArtifactError, UnknownProfileError
from serve.model.export import artifact_from_quantized_dlrm
from serve.profiles import PROFILES, get_profile
from serve.runtime.artifact import (
    dequantize_rows,
    load_artifact,
    quantize_rows_reference,
    row_bytes,
    save_artifact,
)


def test_unknown_profile_names_the_choices():
    with pytest.raises(UnknownProfileError,
                       match=r"profile 'huge' does not exist; choose one of: tiny, small, small-half, small-hashed, criteo-kaggle"):
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
    """Our row format decodes to exactly what TorchRec's own quantized tables hold, for
    every table: each row looked up through TorchRec's quantized EBC (a bag of one id, so
    FBGEMM's kernel returns the dequantized row itself) equals ``dequantize_rows`` of the
    saved artifact bit for bit. (q * scale is exact in float32 for q < 256 and an fp16
    scale, so FBGEMM's fused multiply-add and our multiply-then-add round alike.)"""
    from torchrec.inference.modules import quantize_inference_model

    from serve.model.dlrm import build_dlrm, make_kjt

    profile = get_profile("tiny")
    model = build_dlrm(profile, seed=0)
    qmodel = quantize_inference_model(copy.deepcopy(model), quantization_dtype=qdtype)
    art = artifact_from_quantized_dlrm(qmodel, name)
    save_artifact(art, tmp_path / "a.pt")
    back = load_artifact(tmp_path / "a.pt")
    assert [back.table_feature(i) for i in range(len(back.tables))] == [f"C{i}" for i in range(1, 27)]
    assert back.dtype == name and len(back.tables) == profile.num_sparse
    # Sample b asks every table for row b % rows: B = the largest table covers every row.
    b = max(profile.cardinalities)
    kjt = make_kjt(profile.feature_names, [torch.arange(b) % r for r in profile.cardinalities],
                   [torch.ones(b, dtype=torch.int32)] * profile.num_sparse)
    with torch.no_grad():
        looked_up = qmodel.sparse_arch.embedding_bag_collection(kjt).to_dict()
    ebc = model.sparse_arch.embedding_bag_collection
    for t in back.tables:
        assert t.dtype == name and tuple(t.data.shape) == (t.rows, row_bytes(name, t.dim)), t.name
        theirs = looked_up[t.name[2:]][: t.rows]
        assert theirs.dtype == torch.float32
        assert torch.equal(dequantize_rows(t.data, name, t.dim), theirs), t.name
        # Our reference quantizer (random tables on the GPU machine) follows FBGEMM's
        # min-max rule: fp16 is a plain cast, so exact; for int8/int4 a code may round to
        # the neighbouring level (one step = the row's scale), and scale and bias may
        # differ by one fp16 ulp (2^-10 relative), which moves a value by at most
        # levels x scale x 2^-10 and |bias| x 2^-10.
        fw = ebc.embedding_bags[t.name].weight.detach()
        ours = dequantize_rows(quantize_rows_reference(fw, name), name, t.dim)
        if name == "fp16":
            assert torch.equal(ours, theirs), t.name
            continue
        levels = {"int8": 255, "int4": 15}[name]
        sb = t.data[:, :4].contiguous().view(torch.float16).float()   # (rows, 2) scale, bias
        bound = sb[:, 0:1] * (1 + levels / 1024) + sb[:, 1:2].abs() / 1024
        assert ((ours - theirs).abs() <= bound).all(), t.name


def test_missing_artifact_says_how_to_build(tmp_path):
    with pytest.raises(ArtifactError, match=r"does not exist; build it with `make model`"):
        load_artifact(tmp_path / "nope.pt")


def test_corrupt_artifact_is_rejected(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ArtifactError, match=r"is unreadable"):
        load_artifact(bad)
