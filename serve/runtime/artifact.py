"""The serving artifact: quantized embedding tables + fp32 MLP weights, in plain tensors.

It is the contract between the pipeline (which writes it from TorchRec's quantized
model) and the runtime (which reads it with stock PyTorch: no TorchRec, no FBGEMM, so
it also runs where only ``torch`` exists, e.g. the GPU check machine).

Row format (one row of one table, ``row_bytes`` uint8), FBGEMM's own layout without
its 16-byte padding, rounded up to a multiple of 4 bytes so rows can be viewed as int32:

    int8 : [scale fp16][bias fp16][D  x uint8 q]          value = q * scale + bias
    int4 : [scale fp16][bias fp16][D/2 x uint8, low nibble first]
    fp16 : [D x fp16]
    fp32 : [D x fp32]   (the unquantized reference)

File: ``torch.save`` of a dict, format version ``FORMAT_VERSION``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from serve.errors import ArtifactError
from serve.rowformat import DTYPES, row_bytes
from serve.rowformat import SCALE_BIAS_BYTES as _SCALE_BIAS_BYTES

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "Artifact",
    "QuantTable",
    "dequantize_rows",
    "load_artifact",
    "quantize_rows_reference",
    "row_bytes",
    "save_artifact",
]

FORMAT_VERSION = 1


def dequantize_rows(rows: torch.Tensor, dtype: str, dim: int) -> torch.Tensor:
    """Reference dequantization: uint8 (n, row_bytes) -> float32 (n, D), on rows' device."""
    n = rows.shape[0]
    if dtype == "fp32":
        return rows[:, : 4 * dim].contiguous().view(torch.float32).reshape(n, dim)
    if dtype == "fp16":
        return rows[:, : 2 * dim].contiguous().view(torch.float16).reshape(n, dim).float()
    sb = rows[:, :_SCALE_BIAS_BYTES].contiguous().view(torch.float16).float()  # (n, 2)
    scale, bias = sb[:, 0:1], sb[:, 1:2]
    if dtype == "int8":
        q = rows[:, _SCALE_BIAS_BYTES : _SCALE_BIAS_BYTES + dim].float()
    elif dtype == "int4":
        packed = rows[:, _SCALE_BIAS_BYTES : _SCALE_BIAS_BYTES + dim // 2]
        q = torch.stack((packed & 0x0F, packed >> 4), dim=2).reshape(n, dim).float()
    else:
        raise ArtifactError(f"unknown table dtype {dtype!r}; expected one of {DTYPES}")
    return q * scale + bias


def quantize_rows_reference(weight: torch.Tensor, dtype: str) -> torch.Tensor:
    """Plain-torch row-wise quantization of float (n, D) rows into our row format.

    Used to build random tables at scale where FBGEMM is absent (GPU check); the
    pipeline itself quantizes with TorchRec. Scale/bias as FBGEMM: min-max per row.
    """
    n, dim = weight.shape
    out = torch.zeros((n, row_bytes(dtype, dim)), dtype=torch.uint8, device=weight.device)
    if dtype in ("fp32", "fp16"):
        tdt = torch.float32 if dtype == "fp32" else torch.float16
        b = weight.to(tdt).contiguous().view(torch.uint8)
        out[:, : b.shape[1]] = b
        return out
    levels = 255 if dtype == "int8" else 15
    lo = weight.min(dim=1, keepdim=True).values
    hi = weight.max(dim=1, keepdim=True).values
    scale = ((hi - lo) / levels).clamp_min(1e-8).half()
    bias = lo.half()
    q = torch.round((weight - bias.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    out[:, :_SCALE_BIAS_BYTES] = torch.cat((scale, bias), dim=1).contiguous().view(torch.uint8)
    if dtype == "int8":
        out[:, _SCALE_BIAS_BYTES : _SCALE_BIAS_BYTES + dim] = q
    else:
        out[:, _SCALE_BIAS_BYTES : _SCALE_BIAS_BYTES + dim // 2] = q[:, 0::2] | (q[:, 1::2] << 4)
    return out


@dataclass
class QuantTable:
    """One embedding table: ``data`` is uint8 (rows, row_bytes(dtype, dim))."""

    name: str
    feature: str
    rows: int
    dim: int
    dtype: str
    data: torch.Tensor

    def __post_init__(self) -> None:
        want = (self.rows, row_bytes(self.dtype, self.dim))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ArtifactError(
                f"table {self.name}: data is {self.data.dtype} {tuple(self.data.shape)}, "
                f"expected uint8 {want} for dtype {self.dtype} dim {self.dim}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class Artifact:
    """Everything the runtime needs to serve one DLRM.

    ``dense_arch`` / ``over_arch`` are lists of (weight (out, in), bias (out,)) fp32
    Linear layers; every layer but the last of ``over_arch`` is followed by ReLU
    (TorchRec's DLRM), and the DLRM interaction is the upper triangle (offset 1) of
    the (F+1) x (F+1) dot products of [dense_embedding, sparse_embeddings...].
    """

    feature_names: list[str]
    num_dense: int
    embedding_dim: int
    dtype: str
    tables: list[QuantTable]
    dense_arch: list[tuple[torch.Tensor, torch.Tensor]]
    over_arch: list[tuple[torch.Tensor, torch.Tensor]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def table_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables)


def save_artifact(art: Artifact, path: str | os.PathLike) -> None:
    """Write atomically (tmp file + rename) so a reader never sees half a file."""
    blob = {
        "format_version": FORMAT_VERSION,
        "feature_names": art.feature_names, "num_dense": art.num_dense,
        "embedding_dim": art.embedding_dim, "dtype": art.dtype,
        "tables": [{"name": t.name, "feature": t.feature, "rows": t.rows, "dim": t.dim,
                    "dtype": t.dtype, "data": t.data} for t in art.tables],
        "dense_arch": art.dense_arch, "over_arch": art.over_arch, "meta": art.meta,
    }
    tmp = f"{os.fspath(path)}.tmp"
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_artifact(path: str | os.PathLike, mmap: bool = True) -> Artifact:
    """Read an artifact; ``mmap=True`` maps the tables instead of copying them in."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactError(f"artifact {path} does not exist; build it with `make model`")
    try:
        blob = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as e:
        raise ArtifactError(f"artifact {path} is unreadable ({type(e).__name__}: {e}); "
                            "rebuild it with `make model`") from e
    if not isinstance(blob, dict) or blob.get("format_version") != FORMAT_VERSION:
        got = blob.get("format_version") if isinstance(blob, dict) else type(blob).__name__
        raise ArtifactError(f"artifact {path} has format version {got!r}; this runtime reads "
                            f"version {FORMAT_VERSION}; rebuild it with `make model`")
    try:
        tables = [QuantTable(**t) for t in blob["tables"]]
        return Artifact(list(blob["feature_names"]), int(blob["num_dense"]),
                        int(blob["embedding_dim"]), str(blob["dtype"]), tables,
                        [tuple(x) for x in blob["dense_arch"]],
                        [tuple(x) for x in blob["over_arch"]], dict(blob["meta"]))
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"artifact {path} is missing field {e}; rebuild it with `make model`") from e
