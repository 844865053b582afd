"""Quantize a chunk of float rows into our row format with TorchRec's own arithmetic.

``quantize_inference_model`` quantizes each table in ``torchrec.quant.embedding_modules.
quantize_state_dict``: int8 / int4 by FBGEMM's
``torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight, bits)`` (per row:
the codes, then fp16 scale and bias), fp16 by ``weight.half()``, fp32 as is. Every one is
row-wise: a row's bytes depend on that row alone, so quantizing a table a chunk of rows at
a time gives the bytes of quantizing it whole (``tests/test_stream_import.py`` proves them
``torch.equal`` to :func:`serve.model.export.tables_from_quantized` for every dtype).

Our row (:mod:`serve.rowformat`): int8/int4 ``[scale, bias][codes]`` (FBGEMM keeps scale
and bias apart, after the codes), zero-padded to a multiple of 4 bytes.

Shapes: n rows in a chunk, D the table's dim.
"""
from __future__ import annotations

import torch

from serve.errors import CheckpointError, ConfigError
from serve.rowformat import DTYPES, SCALE_BIAS_BYTES, row_bytes

__all__ = ["BYTES_PER_ROW_WORK", "quantize_chunk", "rows_per_chunk"]

_BITS = {"int8": 8, "int4": 4}


def quantize_chunk(weight: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 or float16 (n, D) rows -> uint8 (n, row_bytes(dtype, D)), TorchRec's bytes.

    Raises:
        CheckpointError: the rows are neither float32 nor float16 (TorchRec refuses them too).
        ConfigError: an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"table dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    if weight.dtype not in (torch.float32, torch.float16) or weight.dim() != 2:
        raise CheckpointError(f"table rows are {weight.dtype} {tuple(weight.shape)}; TorchRec "
                              "quantizes float32 or float16 (rows, dim) tables only")
    n, dim = weight.shape
    out = torch.zeros((n, row_bytes(dtype, dim)), dtype=torch.uint8)
    if dtype in ("fp16", "fp32"):
        w = weight.half() if dtype == "fp16" else weight.float()
        b = w.contiguous().view(torch.uint8)
        out[:, : b.shape[1]] = b
        return out
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    q = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight.contiguous(),
                                                                      _BITS[dtype])
    width = dim if dtype == "int8" else dim // 2
    out[:, :SCALE_BIAS_BYTES] = q[:, -SCALE_BIAS_BYTES:]
    out[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + width] = q[:, :width]
    return out


def _work_bytes(dim: int, dtype: str, src_itemsize: int) -> int:
    """Bytes held per row of a chunk: the read rows, FBGEMM's output and ours, plus the
    float copy a half table or a column-assembled one may need."""
    return dim * src_itemsize + 2 * dim * 4 + 2 * row_bytes(dtype, dim) + 16


#: For the docs: bytes held per row of a dim-64 fp32 table quantized to int8.
BYTES_PER_ROW_WORK = _work_bytes(64, "int8", 4)


def rows_per_chunk(budget_bytes: int, dim: int, dtype: str, src_itemsize: int = 4) -> int:
    """Rows per chunk so one chunk's working set stays within ``budget_bytes`` (>= 1)."""
    return max(1, budget_bytes // _work_bytes(dim, dtype, src_itemsize))
