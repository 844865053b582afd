"""Quantize a merged DLRM's tables with TorchRec and write the serving artifact.

Tables go through ``torchrec.inference.modules.quantize_inference_model`` (FBGEMM
row-wise int8 by default; int4 and fp16 selectable); the MLPs stay fp32. The result is
converted to our plain-torch artifact (:mod:`serve.runtime.artifact`), which the runtime reads
without TorchRec. Quality is measured on held-out data: the AUC of the fp32 model and
of the quantized one; int8 must keep AUC >= fp32 AUC - 0.001 (MLPerf's 99.9% bar).

Managed id spaces (``id_maps``, table name -> :class:`serve.runtime.idmap.IdMap`): the
evaluation reads rows through the maps (as training did and the runtime will), and both
artifacts carry the maps with their schema's tables ``mapping="managed"``; modulo tables
are evaluated on ``id % rows`` (the identity on day-0 data), as the runtime serves them.
The import check compares row layouts (our runtime vs TorchRec's quantized forward on the
same rows) before the maps are attached.

Writes ``--out`` (quantized artifact), the fp32 artifact of the same model next to it
(``<out stem>.fp32.pt``, the exact reference for runtime tests) and ``<out>.json``
(AUCs, table bytes).

Example::

    python -m serve.model.quantize --merged build/tiny/merged.pt --profile tiny \
        --data build/tiny/data --dtype int8 --out build/tiny/artifact.pt
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve.common.clilog import setup_cli_logging
from serve.common.quality import roc_auc, summarize
from serve.errors import ArtifactError, ConfigError, QualityError, ServeError
from serve.profiles import PROFILES, Profile, get_profile

__all__ = [
    "FLOAT_ARTIFACT_MAX_BYTES",
    "INT8_MAX_AUC_DROP",
    "QUANT_DTYPES",
    "QuantizeResult",
    "evaluate_auc",
    "float_artifact_path",
    "main",
    "one_hot_schema",
    "quality_bar",
    "quantize",
    "quantize_model",
]

log = logging.getLogger(__name__)

QUANT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "int4": torch.quint4x2,
                                        "fp16": torch.float16}
INT8_MAX_AUC_DROP = 0.001
FLOAT_ARTIFACT_MAX_BYTES = 1 << 30


@dataclass
class QuantizeResult:
    artifact: str
    float_artifact: str | None
    quantized_dtype: str
    auc_fp32: float
    auc_quantized: float
    eval_rows: int
    table_bytes_fp32: int
    table_bytes_quantized: int
    table_bytes_quantized_fbgemm: int | None   # None: no FBGEMM model held (streamed)
    num_parameters: int
    seconds: float
    # The int8 (served) model on the held-out rows: serve.common.quality.ScoreSummary.to_dict()
    # (rows, observed/predicted CTR, calibration ratio, AUC, score bins): the version's
    # baseline that the pod's online metrics are compared with.
    baseline: dict | None = None
    # The import check (serve.model.importer.check_artifact) and the model's schema.
    check_max_abs_diff: float | None = None
    schema: dict | None = None


def float_artifact_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(f"{out.stem}.fp32{out.suffix or '.pt'}")


def quantize_model(model: torch.nn.Module, dtype: str, inplace: bool = False) -> torch.nn.Module:
    """``model`` with TorchRec-quantized tables (MLPs stay fp32).

    TorchRec swaps the modules in place, so unless ``inplace`` the model is deep-copied
    first; pass ``inplace=True`` only when the float model is no longer needed.
    """
    from torchrec.inference.modules import quantize_inference_model

    if dtype not in QUANT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} must be one of {', '.join(QUANT_DTYPES)}")
    src = model if inplace else copy.deepcopy(model)
    q = quantize_inference_model(src, quantization_dtype=QUANT_DTYPES[dtype])
    q.eval()
    return q


def evaluate_auc(model: torch.nn.Module, data_dir: str | os.PathLike, split: str = "eval",
                 batch_size: int = 4096, limit: int | None = None,
                 progress: bool = False, mapper: Any = None) -> tuple[float, int]:
    """AUC of ``model`` on a split; returns (auc, rows). Forward in eval mode, no grad."""
    y, s = evaluate_scores(model, data_dir, split, batch_size, limit, progress, mapper)
    return roc_auc(y, s), int(y.shape[0])


def evaluate_scores(model: torch.nn.Module, data_dir: str | os.PathLike, split: str = "eval",
                    batch_size: int = 4096, limit: int | None = None,
                    progress: bool = False, mapper: Any = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(labels uint8 (n,), click probabilities float32 (n,)) of ``model`` on a split, in
    row order: the sigmoid of the model's logits, as the serving runtime answers.

    ``mapper``: raw ids -> table rows (:class:`serve.model.train.RowMapper`); None: the
    raw ids as they are (a model whose tables hold every id)."""
    from serve.model.data import ClickLogDataset, iter_batches
    from serve.model.train import RowMappedDataset

    ds: Any = ClickLogDataset(data_dir, split, batch_size, limit=limit)
    if mapper is not None:
        ds = RowMappedDataset(ds, mapper)
    scores, labels = [], []
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, b in enumerate(iter_batches(ds, num_workers=0)):
            scores.append(torch.sigmoid(model(b.dense, b.sparse).reshape(-1).float()).numpy())
            labels.append(b.labels.numpy())
            if progress and (i + 1) % 10 == 0:
                n = sum(len(x) for x in labels)
                print(f"  eval {n}/{ds.rows} rows ({n / (time.perf_counter() - t0):,.0f} rows/s)",
                      flush=True)
    return np.concatenate(labels), np.concatenate(scores)


def _fbgemm_table_bytes(qmodel: Any) -> int:
    total = 0
    for tbe in qmodel.sparse_arch.embedding_bag_collection._emb_modules:
        # FBGEMM keeps scale/bias inside each (16-byte padded) weight row.
        for w, *_ in tbe.split_embedding_weights():
            total += w.numel() * w.element_size()
    return total


def quantize(merged: str | os.PathLike, profile: Profile, data_dir: str | os.PathLike,
             dtype: str, out: str | os.PathLike, eval_limit: int | None = None,
             check: bool = True, progress: bool = True,
             max_auc_drop: float = INT8_MAX_AUC_DROP,
             float_artifact: bool | None = None,
             id_maps: dict[str, Any] | None = None) -> QuantizeResult:
    """Quantize ``merged`` (from serve.model.merge), measure AUCs, write the artifacts.

    ``float_artifact``: also write the fp32 twin; None = only when the fp32 tables are at
    most FLOAT_ARTIFACT_MAX_BYTES (criteo-kaggle's 8.7 GB twin is not worth its disk).
    Memory: one fp32 model at a time; the float model is quantized in place once its
    AUC and fp32 artifact are taken, instead of being deep-copied.
    The quantized artifact is written only if it passes the quality bar.
    ``id_maps``: table name -> IdMap for managed tables (module docstring); None: modulo.
    """
    from serve.model.export import artifact_from_float_dlrm, artifact_from_quantized_dlrm
    from serve.model.importer import DEFAULT_TOLERANCE, check_artifact
    from serve.model.merge import load_merged
    from serve.model.train import RowMapper
    from serve.runtime.artifact import save_artifact

    if dtype not in QUANT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} must be one of {', '.join(QUANT_DTYPES)}")
    t0 = time.perf_counter()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fpath = float_artifact_path(out)
    model, meta = load_merged(merged, profile)
    id_maps = dict(id_maps or {})
    unknown = sorted(set(id_maps) - set(profile.table_names))
    if unknown:
        raise ConfigError(f"id maps for {unknown}: profile {profile.name!r} has no such tables")
    mapper = RowMapper(profile.cardinalities,
                       {j: id_maps[t] for j, t in enumerate(profile.table_names) if t in id_maps})
    nparams = int(meta.get("num_parameters") or sum(p.numel() for p in model.parameters()))
    if progress:
        print(f"quantize: evaluating fp32 AUC, then tables -> {dtype}", flush=True)
    auc_fp32, rows = evaluate_auc(model, data_dir, limit=eval_limit, progress=progress,
                                  mapper=mapper)
    base_meta = {"profile": profile.name, "auc_fp32": auc_fp32,
                 "world_size": meta.get("world_size"), "source": os.fspath(merged)}
    if float_artifact is None:
        float_artifact = profile.table_bytes_fp32() <= FLOAT_ARTIFACT_MAX_BYTES
    if float_artifact:
        save_artifact(_with_id_maps(artifact_from_float_dlrm(
            model, meta={**base_meta, "dtype": "fp32"}), id_maps), fpath)
    qmodel = quantize_model(model, dtype, inplace=True)
    del model
    labels_q, scores_q = evaluate_scores(qmodel, data_dir, limit=eval_limit, progress=progress,
                                         mapper=mapper)
    baseline = summarize(labels_q, scores_q)
    auc_q = roc_auc(labels_q, scores_q)
    art = artifact_from_quantized_dlrm(qmodel, dtype, meta={**base_meta, f"auc_{dtype}": auc_q})
    # The importer's check (serve.model.importer): our runtime against TorchRec's quantized
    # forward on a generated batch (multi-hot, empty bags, every table's last row), and on
    # a one-hot one: on sums of 64 rows a trained model's probabilities saturate to 0 or 1.
    exact = max((check_artifact(a, qmodel, batch=64, seed=0, tolerance=DEFAULT_TOLERANCE)
                 for a in (art, dataclasses.replace(art, schema=one_hot_schema(art.schema)))),
                key=lambda r: r.max_abs_diff)
    if not exact.passed:
        raise ArtifactError(f"the runtime's probabilities differ from TorchRec's quantized "
                            f"forward by {exact.max_abs_diff:.3g} > {exact.tolerance:g}")
    art = _with_id_maps(art, id_maps)  # after the check: it compares rows, not id spaces
    res = QuantizeResult(
        artifact=os.fspath(out), float_artifact=os.fspath(fpath) if float_artifact else None,
        quantized_dtype=dtype, auc_fp32=auc_fp32, auc_quantized=auc_q, eval_rows=rows,
        table_bytes_fp32=profile.table_bytes_fp32(), table_bytes_quantized=art.table_bytes,
        table_bytes_quantized_fbgemm=_fbgemm_table_bytes(qmodel), num_parameters=nparams,
        seconds=round(time.perf_counter() - t0, 3), baseline=baseline.to_dict(),
        check_max_abs_diff=exact.max_abs_diff, schema=art.schema.to_dict())
    Path(f"{out}.json").write_text(json.dumps(asdict(res), indent=2))
    quality_bar(dtype, auc_fp32, auc_q, check=check, max_auc_drop=max_auc_drop)
    save_artifact(art, out)
    return res


def one_hot_schema(schema: Any) -> Any:
    """``schema`` (:class:`serve.schema.ModelSchema`) with at most one id per feature, as
    the built-in DLRM is trained: the inputs on which an exactness check can see a
    difference (a trained model saturates on multi-hot sums)."""
    return dataclasses.replace(schema, features=tuple(
        dataclasses.replace(f, max_ids=1) for f in schema.features))


def quality_bar(dtype: str, auc_fp32: float, auc_quantized: float, *, check: bool = True,
                max_auc_drop: float = INT8_MAX_AUC_DROP) -> None:
    """The int8 quality bar: int8 AUC >= fp32 AUC - ``max_auc_drop`` (other dtypes and
    ``check=False``: reported only).

    Raises:
        QualityError: int8 misses the bar.
    """
    if check and dtype == "int8" and auc_quantized < auc_fp32 - max_auc_drop:
        raise QualityError(f"int8 AUC {auc_quantized:.5f} is below fp32 AUC {auc_fp32:.5f} - "
                           f"{max_auc_drop:g} (the quality bar); the tables do not "
                           "quantize well: keep them fp16 (--dtype fp16) or retrain")


def _with_id_maps(art: Any, id_maps: dict[str, Any]) -> Any:
    """``art`` with ``id_maps`` (table name -> IdMap) and those tables' schema mapping
    "managed"; ``art`` itself when there are none (modulo artifacts stay as they were)."""
    if not id_maps:
        return art
    tables = tuple(dataclasses.replace(t, mapping="managed",
                                       fallback_rows=id_maps[t.name].fallback_rows)
                   if t.name in id_maps else t for t in art.schema.tables)
    schema = dataclasses.replace(art.schema, tables=tables)
    return dataclasses.replace(art, schema=schema, id_maps=dict(id_maps))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.quantize",
        description="Quantize a merged DLRM's embedding tables with TorchRec (row-wise int8 by "
                    "default), check AUC on held-out data and write the serving artifact plus "
                    "its fp32 twin (<out stem>.fp32.pt).")
    ap.add_argument("--merged", required=True, help="merged.pt from serve.model.merge")
    ap.add_argument("--profile", required=True, help=f"profile name ({', '.join(PROFILES)})")
    ap.add_argument("--data", required=True, help="data directory (its eval split is used)")
    ap.add_argument("--dtype", default="int8", choices=tuple(QUANT_DTYPES),
                    help="table dtype: int8 (default; must keep AUC within 0.001), int4, fp16")
    ap.add_argument("--out", required=True, help="artifact file, e.g. build/tiny/artifact.pt")
    ap.add_argument("--eval-limit", type=int, default=None, help="evaluate on at most N rows")
    ap.add_argument("--float-artifact", choices=("auto", "yes", "no"), default="auto",
                    help="also write the fp32 twin (<out stem>.fp32.pt), the exact reference "
                         "for runtime tests; auto = only when fp32 tables are <= 1 GiB")
    ap.add_argument("--no-check", action="store_true",
                    help="report but do not fail when int8 misses the AUC bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_cli_logging()
    try:
        res = quantize(args.merged, get_profile(args.profile), args.data, args.dtype, args.out,
                       eval_limit=args.eval_limit, check=not args.no_check,
                       float_artifact={"auto": None, "yes": True, "no": False}[args.float_artifact])
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    also = f" and {res.float_artifact}" if res.float_artifact else ""
    print(f"wrote {res.artifact}{also}: AUC fp32 {res.auc_fp32:.4f} "
          f"{res.quantized_dtype} {res.auc_quantized:.4f} on {res.eval_rows} rows; tables "
          f"{res.table_bytes_fp32:,} B fp32 -> {res.table_bytes_quantized:,} B "
          f"{res.quantized_dtype}; {res.seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
