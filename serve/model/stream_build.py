"""``make model``'s merge and quantize steps for the built-in DLRM, streamed: memory bounded
by ``--max-memory-bytes`` (default 2 GB, the importer's) whatever the profile's size.

The in-memory path (:mod:`serve.model.merge`, :mod:`serve.model.quantize`) holds the merged
fp32 model, then TorchRec's quantized model, then the artifact: criteo-kaggle's 8.6 GB of
fp32 tables peaked at 17.2 GB. :mod:`serve.model.pipeline` takes this path instead when
the profile's fp32 tables exceed half the budget
(:attr:`serve.model.pipeline_config.PipelineConfig.streamed`), or with
``--stream`` (``make model STREAM=1``). The steps:

* **merge** (:func:`stream_merge`): no ``merged.pt``. The DLRM is built with its tables on
  the meta device and only its dense weights read from the DCP checkpoint
  (:func:`serve.model.stream_import.load_dense`); the merge is proved exact as before, the
  logits on the trainer's fixed batch against the sharded model's (<= 1e-6), but by a
  model holding only the rows that batch reads (:func:`serve.model.stream_import.check_model`).
* **quantize** (:func:`stream_quantize`): every table streamed from the checkpoint a chunk
  of rows at a time into the version's tables folder (:func:`serve.model.stream_import.
  stream_tables`, TorchRec's row-wise arithmetic: the bytes of the in-memory path, table
  for table). The AUC gate scores the held-out rows with our runtime over those files,
  its host tier bounded to a quarter of the budget (rows beyond it are read from disk);
  the fp32 AUC the same way over an fp32 copy of the tables streamed into a temporary
  folder beside them and removed after (it needs the fp32 table bytes of disk for that
  while). int8 must keep AUC >= fp32 AUC - 0.001 (:func:`serve.model.quantize.quality_bar`).
  Exactness: our runtime against TorchRec's ``quantize_inference_model`` on a model of the
  rows a generated check batch reads (:func:`serve.model.importer.check_streamed`).
* **archive**: the format-3 artifact and its tables folder go into the repository by
  :func:`serve.model.archive.add_version` (``tables=``), as the importer's do.

What a streamed version lacks: the fp32 twin (``artifact.fp32.pt``) and the format-2
artifact in the work directory, which :mod:`serve.model.delta` reads; managed id spaces
and a lossy dense precision are not streamed (the config refuses them).

Peak memory: a chunk's working set (half the budget), the host tier (a quarter), the dense
weights and the checked rows; :func:`peak_rss_bytes` measures it per step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from serve.common.quality import roc_auc, summarize
from serve.errors import ArtifactError, CheckpointError
from serve.profiles import NUM_DENSE, Profile
from serve.schema import ModelSchema

__all__ = ["OpenedCheckpoint", "open_checkpoint", "peak_rss_bytes",
           "reset_peak_rss", "score_artifact", "stream_merge", "stream_quantize"]

_HINT = "re-run `python -m serve.model.train` (or `make model`) to write it again"
#: Samples of the generated batch the exactness check runs (the importer's default).
CHECK_BATCH = 64


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set to its current one (Linux: ``5`` into
    ``/proc/self/clear_refs``); False where that is not allowed (the peak then covers the
    whole process so far)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """This process's peak resident set since start or :func:`reset_peak_rss`, in bytes
    (``VmHWM``; ``ru_maxrss`` where ``/proc`` is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    from serve.model.importer import peak_rss_bytes as ru_maxrss

    return ru_maxrss()


@dataclass(frozen=True)
class OpenedCheckpoint:
    """The DLRM with its dense weights read (tables on the meta device, or as built when
    under 1 MiB: never read), the checkpoint opened by row ranges, its plan.json, the
    schema of the version (tables in ``dtype``) and each table's state-dict key."""

    model: nn.Module
    source: Any                 # serve.model.ckpt_stream.DcpSource
    plan: dict[str, Any]
    schema: ModelSchema
    keys: dict[str, str]


def open_checkpoint(ckpt: Path, profile: Profile, dtype: str = "int8") -> OpenedCheckpoint:
    """Check the checkpoint (files, profile, keys and shapes both ways) and read its
    dense weights into a DLRM whose tables take no memory.

    Raises:
        CheckpointError: a file is missing or truncated, a key or shape differs.
        ConfigError: the checkpoint was trained with another profile.
    """
    from serve.model.ckpt_stream import DcpSource
    from serve.model.dlrm import build_dlrm
    from serve.model.export import model_schema
    from serve.model.merge import checked_plan
    from serve.model.stream_import import load_dense, table_keys, tables_on_meta

    plan = checked_plan(ckpt, profile)
    with tables_on_meta():
        model = build_dlrm(profile, device="cpu")
    source = DcpSource(ckpt, hint=_HINT)
    load_dense(model, source, os.fspath(ckpt))
    return OpenedCheckpoint(model, source, plan, model_schema(model, NUM_DENSE, dtype=dtype),
                            table_keys(model))


def _checked(op: OpenedCheckpoint, batches: list[tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[nn.Module, ModelSchema, dict[str, torch.Tensor]]:
    """The float model over the rows ``batches`` (values (nnz,), lengths (F, B)) read, its
    schema and those rows (sorted ids per table)."""
    from serve.model.stream_import import check_ids, check_model

    ids = check_ids(op.schema, batches)
    small, small_schema = check_model(op.model, op.schema, op.source, op.keys, ids)
    return small, small_schema, ids


def stream_merge(ckpt: str | os.PathLike[str], profile: Profile,
                 max_diff: float | None = None) -> dict[str, Any]:
    """The streamed merge step: the checkpoint checked and proved exact, nothing written.

    Returns ``{"merged_max_abs_diff", "world_size", "num_parameters", "checked_rows"}``.

    Raises:
        CheckpointError: the merged logits differ from the sharded ones by more than
            ``max_diff`` (default :data:`serve.model.merge.MAX_MERGE_DIFF`), or the
            checkpoint is broken.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from serve.model.merge import MAX_MERGE_DIFF, fixed_batch, load_outputs, logits_diff
    from serve.model.stream_import import remap_values

    limit = MAX_MERGE_DIFF if max_diff is None else max_diff
    ckpt = Path(ckpt)
    op = open_checkpoint(ckpt, profile)
    outputs = load_outputs(ckpt)
    names = list(outputs["feature_names"])
    if names != list(op.schema.feature_names):
        raise CheckpointError(f"checkpoint outputs {ckpt}: the fixed batch's features {names[:3]}"
                              f"... are not the profile's {list(op.schema.feature_names)[:3]}...;"
                              f" {_HINT}")
    batch = fixed_batch(outputs)
    values = batch.sparse.values()
    lengths = batch.sparse.lengths().reshape(len(names), -1)
    small, _, ids = _checked(op, [(values, lengths)])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=names, values=remap_values(op.schema, values, lengths, ids),
        lengths=lengths.reshape(-1))
    with torch.no_grad():
        diff = logits_diff(small(batch.dense, kjt), outputs)
    if not diff <= limit:
        raise CheckpointError(f"merged model differs from the sharded one by {diff:.3g} on the "
                              f"saved batch (limit {limit:g}); the checkpoint is inconsistent")
    return {"merged_max_abs_diff": diff, "world_size": int(op.plan["world_size"]),
            "num_parameters": sum(p.numel() for p in op.model.parameters()),
            "checked_rows": int(sum(t.numel() for t in ids.values()))}


def score_artifact(art: Any, data_dir: str | os.PathLike[str], host_cache_bytes: int | None,
                   *, batch: int = 4096, limit: int | None = None, split: str = "eval"
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(labels uint8 (n,), probabilities float32 (n,)) of our runtime over ``art`` on a
    split, in row order; tables on disk are read through a host tier of
    ``host_cache_bytes`` (None: the mapped files, unbounded)."""
    from serve.model.precision import score_rows
    from serve.runtime.engine import Runtime, RuntimeConfig

    rt = Runtime(art, RuntimeConfig(device="cpu", cache_load_factor=1.0,
                                    host_cache_bytes=host_cache_bytes))
    try:
        labels, probs, _ = score_rows(rt, data_dir, rows=limit, batch=batch, split=split)
    finally:
        rt.close()
    return labels, probs


@dataclass(frozen=True)
class _Budget:
    """``--max-memory-bytes`` split: a table chunk's working set, the runtime's host tier."""

    max_memory_bytes: int

    @property
    def chunk(self) -> int:
        return self.max_memory_bytes // 2

    @property
    def host(self) -> int:
        return self.max_memory_bytes // 4


def _stream(op: OpenedCheckpoint, schema: ModelSchema, folder: Path, budget: _Budget,
            dense: Any, meta: dict[str, Any]) -> Any:
    """Every table of ``schema`` streamed into ``folder``; the format-3 artifact over it."""
    from serve.model.stream_import import Progress, stream_tables
    from serve.runtime.artifact import Artifact, tables_from_files

    files = stream_tables(op.source, schema, op.keys, op.model, folder, budget.chunk,
                          Progress(schema.total_rows))
    return Artifact(schema, tables_from_files(files), dense, meta, files=files)


def _fp32_scores(op: OpenedCheckpoint, dense: Any, data_dir: Path, scratch: Path,
                 budget: _Budget, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The fp32 model's held-out scores: its tables streamed as fp32 into a temporary
    folder under ``scratch`` (removed after), scored by our runtime."""
    fp32 = dataclasses.replace(op.schema, tables=tuple(
        dataclasses.replace(t, dtype="fp32") for t in op.schema.tables))
    with tempfile.TemporaryDirectory(prefix=".fp32-", dir=scratch) as tmp:
        art = _stream(op, fp32, Path(tmp) / "fp32.tables", budget, dense, {"dtype": "fp32"})
        try:
            return score_artifact(art, data_dir, budget.host, limit=limit)
        finally:
            art.files.close()


def _check_exact(art: Any, op: OpenedCheckpoint) -> Any:
    """Our runtime over the written rows generated batches read vs TorchRec's
    ``quantize_inference_model`` on a model of those rows (the importer's check), on a
    multi-hot batch (up to each feature's max ids, as the in-memory build checks) and on a
    one-hot one: a trained model's probabilities saturate to 0 or 1 on sums of 64 rows,
    where no difference shows; one-hot inputs are the ones it was trained on.

    Raises:
        ArtifactError: they differ by more than the importer's tolerance (1e-6).
    """
    from serve.model.export import quantize_for_serving
    from serve.model.importer import DEFAULT_TOLERANCE, check_streamed, generated_batch
    from serve.model.quantize import one_hot_schema
    from serve.runtime.artifact import Artifact, QuantTable

    schemas = (op.schema, one_hot_schema(op.schema))
    batches = [generated_batch(s, n, 0)[1:] for s in schemas for n in (3, CHECK_BATCH)]
    small, small_schema, ids = _checked(op, batches)
    qsmall = quantize_for_serving(small, small_schema)
    rows = [QuantTable(t.name, int(ids[t.name].numel()), t.dim, t.dtype,
                       torch.from_numpy(art.files.read_rows(i, ids[t.name].numpy())))
            for i, t in enumerate(art.tables)]
    ours = Artifact(small_schema, rows, art.dense, dict(art.meta))
    res = max((check_streamed(ours, qsmall, s, ids, batch=CHECK_BATCH, seed=0,
                              tolerance=DEFAULT_TOLERANCE, remap_ours=True) for s in schemas),
              key=lambda r: r.max_abs_diff)
    if not res.passed:
        raise ArtifactError(f"the runtime's probabilities differ from TorchRec's quantized "
                            f"forward by {res.max_abs_diff:.3g} > {res.tolerance:g}")
    return res


def stream_quantize(ckpt: str | os.PathLike[str], profile: Profile,
                    data_dir: str | os.PathLike[str], dtype: str, out: str | os.PathLike[str],
                    tables: str | os.PathLike[str], *, max_memory_bytes: int,
                    check: bool = True, eval_limit: int | None = None,
                    say: Callable[[str], None] = print) -> Any:
    """The streamed quantize step: ``tables`` (the version's tables folder, replaced if
    there) and ``out`` (a format-3 artifact referencing it) written only when the int8
    bar and the exactness check pass; a refused build removes ``tables``.

    Returns a :class:`serve.model.quantize.QuantizeResult` (no fp32 twin, no FBGEMM byte
    count); ``out`` + ``.json`` holds it too.

    Raises:
        QualityError: int8 misses the AUC bar (``check``).
        ArtifactError: our runtime differs from TorchRec's quantized forward.
        CheckpointError / ConfigError: as :func:`open_checkpoint`.
    """
    from serve.model.export import dlrm_dense
    from serve.model.quantize import QuantizeResult, quality_bar
    from serve.runtime.artifact import save_artifact

    t0 = time.perf_counter()
    ckpt, out, folder, data = Path(ckpt), Path(out), Path(tables), Path(data_dir)
    budget = _Budget(max_memory_bytes)
    op = open_checkpoint(ckpt, profile, dtype)
    dense = dlrm_dense(op.model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    say(f"[quantize] streaming: fp32 AUC over {profile.table_bytes_fp32():,} B of fp32 "
        f"tables on disk (chunks within {budget.chunk:,} B, host tier {budget.host:,} B)")
    labels, p32 = _fp32_scores(op, dense, data, folder.parent, budget, eval_limit)
    auc_fp32 = roc_auc(labels, p32)
    shutil.rmtree(folder, ignore_errors=True)        # a failed earlier build's
    meta = {"profile": profile.name, "auc_fp32": auc_fp32, "world_size": op.plan["world_size"],
            "source": os.fspath(ckpt)}
    art = _stream(op, op.schema, folder, budget, dense, meta)
    try:
        labels_q, scores_q = score_artifact(art, data, budget.host, limit=eval_limit)
        auc_q = roc_auc(labels_q, scores_q)
        exact = _check_exact(art, op)
        quality_bar(dtype, auc_fp32, auc_q, check=check)
        art = dataclasses.replace(art, meta={**meta, f"auc_{dtype}": auc_q})
        save_artifact(art, out)
    except BaseException:
        art.files.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    art.files.close()
    res = QuantizeResult(
        artifact=os.fspath(out), float_artifact=None, quantized_dtype=dtype,
        auc_fp32=auc_fp32, auc_quantized=auc_q, eval_rows=int(labels_q.size),
        table_bytes_fp32=profile.table_bytes_fp32(), table_bytes_quantized=art.table_bytes,
        table_bytes_quantized_fbgemm=None,
        num_parameters=sum(p.numel() for p in op.model.parameters()),
        seconds=round(time.perf_counter() - t0, 3),
        baseline=summarize(labels_q, scores_q).to_dict(),
        check_max_abs_diff=exact.max_abs_diff, schema=op.schema.to_dict())
    Path(f"{out}.json").write_text(json.dumps(dataclasses.asdict(res), indent=2))
    return res
