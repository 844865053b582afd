"""The AUC gate of a lossy dense precision: a build serves its dense part in bf16 or int8
only when the held-out AUC stays within ``DENSE_MAX_AUC_DROP`` of the same artifact in fp32.

Why a gate and not a default: fp32 is exact against TorchRec's quantized forward (the
import check compares with ``torch.equal``-level tolerances), bf16 is not. On CPUs with
AMX or AVX-512 BF16 the dense MLPs, most of a ranking request's compute, run ~1.7-1.9x
faster in bf16 (``make bench-runtime``'s levers), so a user who wants that speed turns it
on per version (``make model DENSE_PRECISION=bf16``) and the build proves the model still
ranks as well: both runs score the same held-out rows through the serving runtime
(:class:`serve.runtime.engine.Runtime`, every table row resident), the report keeps both
AUCs and the largest probability difference, and a drop past the bar fails the build
with :class:`serve.errors.QualityError`.

Shapes: B rows per forward, N dense features, F sparse features.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from serve.common.quality import roc_auc
from serve.constants import DENSE_MAX_AUC_DROP, DENSE_PRECISIONS
from serve.errors import ConfigError, QualityError

__all__ = ["PrecisionReport", "dense_precision_gate", "score_heldout"]


@dataclass(frozen=True)
class PrecisionReport:
    """What the gate measured (kept in the build report as ``dense_precision``).

    Attributes:
        precision: the lossy precision asked for ("bf16" or "int8").
        auc_fp32 / auc: held-out AUC with the dense part in fp32 / in ``precision``.
        max_abs_diff: largest |p_precision - p_fp32| over the rows (probabilities).
        rows: held-out rows scored.
        max_auc_drop: the bar: ``auc >= auc_fp32 - max_auc_drop``.
        seconds_fp32 / seconds: wall time of each scoring pass (same rows, same batches).
    """

    precision: str
    auc_fp32: float
    auc: float
    max_abs_diff: float
    rows: int
    max_auc_drop: float
    seconds_fp32: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_heldout(artifact: str | os.PathLike[str], data_dir: str | os.PathLike[str],
                  precision: str, *, rows: int | None = None, batch: int = 4096,
                  split: str = "eval") -> tuple[np.ndarray, np.ndarray, float]:
    """(labels uint8 (n,), probabilities float32 (n,), seconds) of ``artifact`` on a split,
    scored by the serving runtime with its dense part in ``precision``."""
    from serve.runtime.engine import Runtime, RuntimeConfig

    rt = Runtime.from_artifact(artifact, RuntimeConfig(device="cpu", cache_load_factor=1.0,
                                                       dense_precision=precision))
    return score_rows(rt, data_dir, rows=rows, batch=batch, split=split)


def score_rows(rt: Any, data_dir: str | os.PathLike[str], *, rows: int | None = None,
               batch: int = 4096, split: str = "eval"
               ) -> tuple[np.ndarray, np.ndarray, float]:
    """(labels uint8 (n,), probabilities float32 (n,), seconds) of the runtime ``rt``
    (:class:`serve.runtime.engine.Runtime`) on a split's first ``rows`` rows (None: all),
    in row order, ``batch`` rows per forward."""
    import torch

    from serve.model.data import columnar_rows, load_split
    from serve.runtime.engine import SparseBatch

    data = load_split(data_dir, split)
    n = len(data) if rows is None else min(rows, len(data))
    if n == 0:
        raise ConfigError(f"no {split} rows in {data_dir}: the gate needs held-out data")
    out = np.empty(n, dtype=np.float32)
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, n, batch):
            stop = min(start + batch, n)
            dense, values, lengths = columnar_rows(data, start, stop)
            p = rt.predict(torch.from_numpy(dense),
                           SparseBatch(torch.from_numpy(values), torch.from_numpy(lengths)))
            out[start:stop] = p.float().numpy().reshape(-1)
    seconds = time.perf_counter() - t0
    labels = np.asarray(data.labels[:n], dtype=np.uint8)
    return labels, out, seconds


def dense_precision_gate(artifact: str | os.PathLike[str], data_dir: str | os.PathLike[str],
                         precision: str, *, rows: int | None = None,
                         max_auc_drop: float = DENSE_MAX_AUC_DROP, check: bool = True,
                         say: Callable[[str], None] = print) -> PrecisionReport:
    """Score the held-out rows with the dense part in fp32 and in ``precision``; raise
    unless the AUC stays within ``max_auc_drop``.

    Raises:
        ConfigError: ``precision`` is not a lossy one of ``DENSE_PRECISIONS``, or the
            artifact's dense part cannot run in it (an imported model's exported layers).
        QualityError: ``check`` and the AUC dropped by more than ``max_auc_drop``.
    """
    if precision not in DENSE_PRECISIONS or precision == "fp32":
        raise ConfigError(f"dense precision {precision!r}: the gate compares a lossy one of "
                          f"{', '.join(p for p in DENSE_PRECISIONS if p != 'fp32')} with fp32")
    labels, p32, s32 = score_heldout(artifact, data_dir, "fp32", rows=rows)
    _, plo, slo = score_heldout(artifact, data_dir, precision, rows=rows)
    rep = PrecisionReport(precision=precision, auc_fp32=roc_auc(labels, p32),
                          auc=roc_auc(labels, plo),
                          max_abs_diff=float(np.abs(plo - p32).max()), rows=int(labels.size),
                          max_auc_drop=max_auc_drop, seconds_fp32=s32, seconds=slo)
    say(f"[precision] dense {precision}: AUC {rep.auc:.5f} vs fp32 {rep.auc_fp32:.5f} on "
        f"{rep.rows:,} held-out rows (bar: drop <= {max_auc_drop:g}); max |dp| "
        f"{rep.max_abs_diff:.2e}; scoring {s32:.2f}s fp32, {slo:.2f}s {precision}")
    if check and rep.auc < rep.auc_fp32 - max_auc_drop:
        raise QualityError(f"dense {precision} AUC {rep.auc:.5f} is below fp32 AUC "
                           f"{rep.auc_fp32:.5f} - {max_auc_drop:g} (the dense precision bar): "
                           f"serve this model with --dense-precision fp32")
    return rep
