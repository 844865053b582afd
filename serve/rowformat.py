"""The stored row format of an embedding table, without torch (the sidecar reads it too).

One row of one table is ``row_bytes(dtype, dim)`` uint8, FBGEMM's layout without its
16-byte padding, rounded up to a multiple of 4 bytes (see serve/runtime/artifact.py):

    int8 : [scale fp16][bias fp16][D  x uint8 q]          value = q * scale + bias
    int4 : [scale fp16][bias fp16][D/2 x uint8, low nibble first]
    fp16 : [D x fp16]
    fp32 : [D x fp32]
"""
from __future__ import annotations

import math

from serve.errors import ArtifactError

__all__ = ["DTYPES", "SCALE_BIAS_BYTES", "row_bytes"]

DTYPES = ("int8", "int4", "fp16", "fp32")
SCALE_BIAS_BYTES = 4


def _payload_bytes(dtype: str, dim: int) -> int:
    if dtype == "int8":
        return SCALE_BIAS_BYTES + dim
    if dtype == "int4":
        if dim % 2:
            raise ArtifactError(f"int4 tables need an even embedding dim, got {dim}")
        return SCALE_BIAS_BYTES + dim // 2
    if dtype == "fp16":
        return 2 * dim
    if dtype == "fp32":
        return 4 * dim
    raise ArtifactError(f"unknown table dtype {dtype!r}; expected one of {DTYPES}")


def row_bytes(dtype: str, dim: int) -> int:
    """Bytes per stored row, a multiple of 4."""
    return 4 * math.ceil(_payload_bytes(dtype, dim) / 4)
