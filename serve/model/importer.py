"""Import the user's own TorchRec model into the model store: one immutable version.

    python -m serve.model.importer --factory FILE.py:FUNCTION --checkpoint PATH --version NAME
        [--num-dense N] [--dtype int8] [--table-dtype TABLE=fp16 ...] [--max-ids FEATURE=N ...]
        [--max-memory-bytes 2000000000]

The contract (docs/own-model.md): ``FUNCTION()`` returns a
``torch.nn.Module`` (on CPU or on the meta device) whose ``forward(dense_features,
sparse_features)`` takes float32 (B, N) and a ``KeyedJaggedTensor``, returns logits (B,)
or (B, 1), and keeps its embeddings in ``EmbeddingBagCollection`` modules (sum or mean
pooling), reading the KeyedJaggedTensor only through them.

The import streams: its memory is bounded by ``--max-memory-bytes`` (default 2 GB) beyond
the interpreter and its libraries, whatever the model's size. Steps:

1. the factory runs with every allocation of 1 MiB or more on the meta device (the
   tables, whatever device it names); the checkpoint (a ``torch.distributed.checkpoint``
   directory as ``dcp.save(dmp.state_dict(), ...)`` writes it from N ranks, or one
   ``torch.save(model.state_dict())`` file) is checked against the model, keys and shapes
   both ways (a missing or unexpected key, a shape that does not match: named), and only
   its dense weights are read (:mod:`serve.model.stream_import`);
2. the schema from the model's collections (:func:`serve.model.export.model_schema`);
3. the reference: the factory's model with each table cut down to the rows the check
   batches read (ids remapped to ``0 .. U-1``), quantized by TorchRec's own
   ``quantize_inference_model`` (each table in its dtype); the contract check on it (a
   forward on a generated batch must return (B,) or (B, 1) floats); the layers after
   pooling stored as a ``torch.export`` program (TorchRec's plain ``DLRM``: as weights,
   served by our own dense DLRM);
4. every table read from the checkpoint a chunk of rows at a time
   (:mod:`serve.model.ckpt_stream`), quantized with TorchRec's arithmetic
   (:mod:`serve.model.rowquant`: row-wise, so chunk by chunk gives the same bytes) and
   written into the version's tables folder, in a temporary folder of the model store;
   a progress line (rows/s, ETA) on stderr at most once a second;
5. the check: our runtime's probabilities over the written rows against ``torch.sigmoid``
   of the reference's forward on a generated batch covering every feature (multi-hot up
   to each feature's max ids, empty bags included); refused when they differ by more than
   ``--tolerance`` (1e-6);
6. the format-3 archive, its tables folder and the report (schema, parameters, bytes per
   table, the check, peak RSS) are added to the repository; the last line printed is one
   JSON object ``{"version", "max_abs_diff", "report", "archive", "peak_rss_bytes",
   "seconds"}``.

A refused or failed import removes what it wrote and leaves ``model_store/`` unchanged (the
repository only ever receives a complete version, its report last).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from torch import nn

from serve.common.clilog import setup_cli_logging
from serve.common.validate import is_int, positive_int
from serve.constants import DENSE_MAX_PROB_DIFF
from serve.errors import ArtifactError, CheckpointError, ConfigError, ServeError
from serve.schema import DEFAULT_MAX_IDS, ModelSchema
from serve.state import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_DELAY_MS, DEFAULT_WORKERS

if TYPE_CHECKING:  # imported where used: the runtime and the store load late
    from serve.model.ckpt_stream import CheckpointSource
    from serve.runtime.artifact import Artifact
    from serve.store.repository import ModelRepository

__all__ = ["DEFAULT_MAX_MEMORY_BYTES", "CheckResult", "ImportConfig", "check_artifact",
           "check_streamed", "generated_batch", "import_model", "load_checkpoint",
           "load_factory", "main", "peak_rss_bytes"]

#: Largest |ours - TorchRec's| probability an import accepts by default.
DEFAULT_TOLERANCE = 1e-6
#: ``--max-memory-bytes`` by default: 2 GB (decimal), what an import may hold beyond the
#: interpreter and its libraries, whatever the model's size.
DEFAULT_MAX_MEMORY_BYTES = 2_000_000_000
#: The smallest budget accepted (a chunk of one row must fit many times over).
MIN_MAX_MEMORY_BYTES = 1 << 24
_PREFIXES = ("_dmp_wrapped_module.", "module.")


@dataclass(frozen=True)
class ImportConfig:
    """One import. ``factory`` is ``FILE.py:FUNCTION``; see the module docstring."""

    factory: str
    checkpoint: Path
    version: str
    num_dense: int | None = None
    dtype: str = "int8"
    table_dtypes: Mapping[str, str] = field(default_factory=dict)
    max_ids: Mapping[str, int] = field(default_factory=dict)
    default_max_ids: int = DEFAULT_MAX_IDS
    tolerance: float = DEFAULT_TOLERANCE
    check_batch: int = 64
    seed: int = 0
    model_store: Path = Path("model_store")
    model_name: str = "dlrm"
    # The archive's TorchServe settings (what `make up` declares for it by default).
    mar_batch_size: int = DEFAULT_BATCH_SIZE
    mar_max_batch_delay_ms: int = DEFAULT_MAX_BATCH_DELAY_MS
    mar_workers: int = DEFAULT_WORKERS
    # The dense part's arithmetic when served: fp32 (exact) or bf16, admitted only when
    # its probabilities stay within dense_tolerance of fp32's on the check batch.
    dense_precision: str = "fp32"
    dense_tolerance: float = DENSE_MAX_PROB_DIFF
    # Memory the import may hold beyond the interpreter: sizes the table chunks.
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES

    def __post_init__(self) -> None:
        from serve.rowformat import DTYPES

        if not is_int(self.max_memory_bytes) or self.max_memory_bytes < MIN_MAX_MEMORY_BYTES:
            raise ConfigError(f"--max-memory-bytes {self.max_memory_bytes!r} must be a whole "
                              f"number >= {MIN_MAX_MEMORY_BYTES} (16 MiB); the default is "
                              f"{DEFAULT_MAX_MEMORY_BYTES}")

        if self.dense_precision not in ("fp32", "bf16"):
            raise ConfigError(f"--dense-precision {self.dense_precision!r} must be fp32 or bf16 "
                              "(an imported model's exported dense part)")
        if not (isinstance(self.dense_tolerance, float) and self.dense_tolerance >= 0):
            raise ConfigError(f"--dense-tolerance {self.dense_tolerance!r} must be a float >= 0")

        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} must be one of {', '.join(DTYPES)}")
        for t, d in self.table_dtypes.items():
            if d not in DTYPES:
                raise ConfigError(f"--table-dtype {t}={d}: the dtype must be one of "
                                  f"{', '.join(DTYPES)}")
        if not (isinstance(self.tolerance, float) and self.tolerance >= 0):
            raise ConfigError(f"--tolerance {self.tolerance!r} must be a float >= 0")
        positive_int("--check-batch", self.check_batch)
        positive_int("--workers", self.mar_workers)
        if self.num_dense is not None and self.num_dense < 0:
            raise ConfigError(f"--num-dense {self.num_dense} must be >= 0")


@dataclass(frozen=True)
class CheckResult:
    """Our runtime against TorchRec's quantized forward on one generated batch."""

    max_abs_diff: float
    batch: int
    ids: int
    tolerance: float
    rows: str = "all"       # our runtime held "all" the rows, or the "checked" ones only

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


# ----------------------------------------------------------------------------- loading
def load_factory(spec: str) -> tuple[Callable[[], nn.Module], Any]:
    """``FILE.py:FUNCTION`` -> (the function, its module), as :mod:`serve.model.fit` loads
    it. ``ModelContractError`` (a ``ConfigError``) names what is off."""
    from serve.model.fit import load_factory as _load

    return _load(spec)


def _strip(key: str) -> str:
    for p in _PREFIXES:
        while key.startswith(p):
            key = key[len(p):]
    return key


def load_checkpoint(model: nn.Module, path: Path) -> nn.Module:
    """Load a DCP directory or a state-dict file into ``model`` (strict) and return it.

    A model built on the meta device is materialized on the CPU first.
    """
    path = Path(path)
    if any(p.is_meta for p in model.parameters()):
        model = model.to_empty(device="cpu")
    if path.is_dir():
        from serve.model.merge import load_dcp_into

        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {path} is a folder without .metadata; give a "
                                  "torch.distributed.checkpoint directory or a state-dict file")
        load_dcp_into(model, path, hint="check --factory, or re-train")
        return model
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                              "give torch.save(model.state_dict()) or a DCP directory") from e
    if isinstance(blob, dict) and "state_dict" in blob and isinstance(blob["state_dict"], dict):
        blob = blob["state_dict"]
    if not isinstance(blob, dict) or not all(isinstance(v, torch.Tensor) for v in blob.values()):
        raise CheckpointError(f"checkpoint {path} holds {type(blob).__name__}, not a state dict "
                              "of tensors; save it with torch.save(model.state_dict(), PATH)")
    state = {_strip(k): v for k, v in blob.items()}
    from serve.model.ckpt_stream import check_keys

    check_keys(model, {k: v.shape for k, v in state.items()}, os.fspath(path))
    model.load_state_dict(state, strict=True)
    return model


# ----------------------------------------------------------------------------- checking
def generated_batch(schema: ModelSchema, batch: int, seed: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch that covers every feature: dense (B, N) float32, values int64 (nnz,)
    feature-major, lengths int32 (F, B). Sample 0 carries each feature's max ids, sample
    1 none (an empty bag) when B > 1, the rest 1..max ids; ids span each table."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn((batch, schema.dense), generator=g)
    lengths = torch.zeros((len(schema.features), batch), dtype=torch.int32)
    values = []
    rows = {t.name: t.rows for t in schema.tables}
    for f, spec in enumerate(schema.features):
        cap = spec.max_ids
        ln = torch.randint(1, cap + 1, (batch,), generator=g, dtype=torch.int32)
        ln[0] = cap
        if batch > 1:
            ln[1] = 0
        lengths[f] = ln
        n = int(ln.sum())
        ids = torch.randint(0, rows[spec.table], (n,), generator=g)
        if n:
            ids[0] = rows[spec.table] - 1   # the last row of the table is read too
        values.append(ids)
    return dense, torch.cat(values), lengths


def _kjt(schema: ModelSchema, values: torch.Tensor, lengths: torch.Tensor) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=list(schema.feature_names), values=values,
                                               lengths=lengths.reshape(-1))


def _check_contract(model: nn.Module, schema: ModelSchema, seed: int,
                    ids: Mapping[str, torch.Tensor] | None = None) -> None:
    """The forward on a generated batch of 3 returns (3,) or (3, 1) finite floats; with
    ``ids``, ``model`` holds only those rows of each table and reads the ids remapped."""
    dense, values, lengths = generated_batch(schema, 3, seed)
    if ids is not None:
        from serve.model.stream_import import remap_values

        values = remap_values(schema, values, lengths, ids)
    try:
        with torch.no_grad():
            out = model(dense, _kjt(schema, values, lengths))
    except Exception as e:
        raise ConfigError(f"the model's forward(dense (3, {schema.dense}), KeyedJaggedTensor of "
                          f"{list(schema.feature_names)}) failed ({type(e).__name__}: {e}); "
                          "check --num-dense and the contract") from e
    if not isinstance(out, torch.Tensor) or tuple(out.shape) not in ((3,), (3, 1)) \
            or not out.is_floating_point():
        got = (f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise ConfigError(f"the model's forward returned {got} for a batch of 3; the contract "
                          "is logits of shape (B,) or (B, 1), floating point")


def check_artifact(artifact: Any, qmodel: nn.Module, *, batch: int, seed: int,
                   tolerance: float) -> CheckResult:
    """Our runtime (CPU, no cache) vs ``torch.sigmoid`` of ``qmodel`` (TorchRec's quantized
    model) on :func:`generated_batch`: the largest absolute difference of probabilities."""
    from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

    schema = artifact.schema
    dense, values, lengths = generated_batch(schema, batch, seed)
    rt = Runtime(artifact, RuntimeConfig(device="cpu", cache_load_factor=1.0))
    try:
        ours = rt.predict(dense, SparseBatch(values, lengths))
    finally:
        rt.close()
    with torch.no_grad():
        ref = torch.sigmoid(qmodel(dense, _kjt(schema, values, lengths)).float().reshape(-1))
    diff = float((ours - ref).abs().max()) if batch else 0.0
    return CheckResult(diff, batch, int(values.numel()), tolerance)


# ----------------------------------------------------------------------------- the import
def _report(cfg: ImportConfig, model: nn.Module, artifact: Any, check: CheckResult,
            dense_kind: str, seconds: dict[str, float]) -> dict[str, Any]:
    schema: ModelSchema = artifact.schema
    return {
        "version": cfg.version, "model_name": cfg.model_name, "origin": "import",
        "factory": cfg.factory, "checkpoint": os.fspath(cfg.checkpoint),
        "schema": schema.to_dict(), "dense_kind": dense_kind,
        # the exported program's digest, also in the artifact and checked at load (N3)
        "program_sha256": getattr(artifact.dense, "sha256", None),
        "quantized_dtype": artifact.dtype,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "table_bytes_quantized": artifact.table_bytes,
        "table_bytes": {t.name: t.nbytes for t in artifact.tables},
        "check": {"max_abs_diff": check.max_abs_diff, "batch": check.batch, "ids": check.ids,
                  "tolerance": check.tolerance, "rows": check.rows,
                  "reference": "torch.sigmoid(quantize_inference_model(model)(dense, kjt)), "
                               "the model holding the rows the batch reads"},
        "mar_batch_size": cfg.mar_batch_size,
        "mar_max_batch_delay_ms": cfg.mar_max_batch_delay_ms, "mar_workers": cfg.mar_workers,
        # No held-out labels come with an import: the quality baseline is unknown.
        "baseline": None,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_seconds": seconds,
        "max_memory_bytes": cfg.max_memory_bytes,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (``ru_maxrss``: KiB on Linux)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def import_model(cfg: ImportConfig, say: Callable[[str], None] = print,
                 progress: TextIO | None = None) -> dict[str, Any]:
    """Run the import; returns ``{"version", "max_abs_diff", "report", "archive",
    "peak_rss_bytes", "seconds"}``.

    Steps: the factory's model without its tables (dense weights read from the
    checkpoint), the check's reference (TorchRec's quantized model over the rows the
    check batch reads), the tables streamed chunk by chunk into a tables folder in a
    temporary folder of the model store, the check of our runtime over them, the version
    stored. A refused or failed import removes what it wrote. Table progress goes to
    ``progress`` (default stderr).

    Raises:
        ConfigError: a bad option or factory, a model outside the contract, a version
            that exists already.
        CheckpointError: the checkpoint does not fit the model.
        ArtifactError: the check failed (our runtime differs from TorchRec's forward).
    """
    from serve.store.repository import ModelRepository

    repo = ModelRepository([cfg.model_store], cfg.model_name)
    if repo.exists(cfg.version):
        raise ConfigError(f"version {cfg.version!r} already exists in {cfg.model_store} and "
                          "versions are immutable; pick another --version")
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    model, module, num_dense, source = _load_model(cfg, say)
    seconds["load"] = round(time.perf_counter() - t0, 3)

    t = time.perf_counter()
    ref = _reference(cfg, model, module, num_dense, source, say)
    seconds["reference"] = round(time.perf_counter() - t, 3)

    cfg.model_store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".import-", dir=cfg.model_store) as tmp:
        t = time.perf_counter()
        folder = Path(tmp) / repo.tables_name(cfg.version)
        art = _stream(cfg, ref, source, model, folder, say, progress)
        seconds["tables"] = round(time.perf_counter() - t, 3)
        try:
            t = time.perf_counter()
            check = _check(cfg, art, ref, say)
            lossy = _check_dense_precision(cfg, art, ref, say) \
                if cfg.dense_precision != "fp32" else None
            seconds["check"] = round(time.perf_counter() - t, 3)
            stored = _store(cfg, repo, art, _Provenance(
                model, check, ref.kind, lossy, context_features(module, art.schema)),
                seconds, Path(tmp), folder)
        finally:
            if art.files is not None:
                art.files.close()
    say(f"[store] added version {cfg.version}: {stored}")
    total = round(time.perf_counter() - t0, 3)
    return {"version": cfg.version, "max_abs_diff": check.max_abs_diff,
            "report": os.fspath(cfg.model_store / f"{cfg.model_name}-{cfg.version}.json"),
            "archive": os.fspath(stored), "peak_rss_bytes": peak_rss_bytes(),
            "seconds": total}


def _load_model(cfg: ImportConfig, say: Callable[[str], None]
                ) -> tuple[nn.Module, Any, int, CheckpointSource]:
    """The factory's model with its dense weights loaded (eval mode; its tables on the
    meta device, or as the factory made them when small), the factory's module, the
    number of dense features (``--num-dense`` or the module's ``NUM_DENSE``) and the
    checkpoint opened for reading by row ranges.

    Raises:
        ConfigError: the number of dense features is unknown, or the factory returned
            something other than a module.
        CheckpointError: the checkpoint does not fit the model.
    """
    from serve.model.ckpt_stream import open_source
    from serve.model.stream_import import load_dense, tables_on_meta

    fn, module = load_factory(cfg.factory)
    num_dense = cfg.num_dense if cfg.num_dense is not None else getattr(module, "NUM_DENSE", None)
    if not is_int(num_dense):
        raise ConfigError("the number of dense features is unknown: pass --num-dense N, or "
                          "define NUM_DENSE = N in the factory's module")
    say(f"[load] {cfg.factory}() (tables on the meta device) and {cfg.checkpoint}")
    with tables_on_meta():
        model = fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--factory {cfg.factory} returned {type(model).__name__}, not a "
                          "torch.nn.Module")
    source = open_source(Path(cfg.checkpoint), hint="check --factory, or re-train")
    return load_dense(model, source, os.fspath(cfg.checkpoint)), module, num_dense, source


@dataclass(frozen=True)
class _Reference:
    """What the check compares against, built before any table is written: the schema,
    TorchRec's quantized model over the checked rows (``ids[table]``, remapped to
    ``0 .. U-1``: ``small_schema``), the dense part and its kind."""

    schema: ModelSchema
    small_schema: ModelSchema
    ids: dict[str, torch.Tensor]
    qsmall: nn.Module
    dense: Any
    kind: str
    keys: dict[str, str]


def _reference(cfg: ImportConfig, model: nn.Module, module: Any, num_dense: int,
               source: CheckpointSource, say: Callable[[str], None]) -> _Reference:
    """The model's schema, the contract check and TorchRec's quantized reference on a
    model holding only the rows the check batches read; the dense part exported."""
    from serve.model.export import (
        collections,
        dlrm_dense,
        export_dense,
        is_torchrec_dlrm,
        model_schema,
        quantize_for_serving,
    )
    from serve.model.stream_import import check_ids, check_model, table_keys
    from serve.runtime.artifact import DLRMDense, ExportedDense

    # The module's MAX_IDS may serve several factories: only this model's features count.
    # --max-ids is checked strictly (a feature the model lacks is an error).
    ours = {f for _, ebc in collections(model) for c in ebc.embedding_bag_configs()
            for f in c.feature_names}
    max_ids = {k: v for k, v in dict(getattr(module, "MAX_IDS", {}) or {}).items() if k in ours}
    max_ids.update(cfg.max_ids)
    schema = model_schema(model, num_dense, dtype=cfg.dtype, table_dtypes=cfg.table_dtypes,
                          max_ids=max_ids, default_max_ids=cfg.default_max_ids)
    say(f"[schema] {schema.dense} dense, {len(schema.features)} sparse features over "
        f"{len(schema.tables)} tables ({schema.total_rows:,} rows)")
    keys = table_keys(model)
    batches = [generated_batch(schema, n, cfg.seed)[1:] for n in (3, cfg.check_batch)]
    ids = check_ids(schema, batches)
    small, small_schema = check_model(model, schema, source, keys, ids)
    _check_contract(small, schema, cfg.seed, ids)
    qsmall = quantize_for_serving(small, small_schema)
    say(f"[reference] TorchRec's quantize_inference_model over the {small_schema.total_rows:,} "
        "rows the check batch reads")
    dense: DLRMDense | ExportedDense
    if is_torchrec_dlrm(model):
        dense, kind = dlrm_dense(model), "dlrm"
    else:
        dense, kind = export_dense(model, schema), "export"
    return _Reference(schema, small_schema, ids, qsmall, dense, kind, keys)


def _stream(cfg: ImportConfig, ref: _Reference, source: CheckpointSource, model: nn.Module,
            folder: Path, say: Callable[[str], None], progress: TextIO | None) -> Artifact:
    """Every table streamed into ``folder``; the format-3 artifact over it."""
    from serve.model.stream_import import Progress, stream_tables
    from serve.runtime.artifact import Artifact, tables_from_files

    schema = ref.schema
    say(f"[tables] streaming {schema.total_rows:,} rows into {folder.name} (chunks within "
        f"{cfg.max_memory_bytes // 2:,} bytes)")
    files = stream_tables(source, schema, ref.keys, model, folder, cfg.max_memory_bytes // 2,
                          Progress(schema.total_rows, progress))
    art = Artifact(schema, tables_from_files(files), ref.dense,
                   {"version": cfg.version, "origin": "import", "factory": cfg.factory},
                   files=files)
    say(f"[quantize] tables {art.dtype}, {art.table_bytes:,} bytes; dense part: {ref.kind}")
    return art


def _checked_artifact(cfg: ImportConfig, art: Artifact, ref: _Reference
                      ) -> tuple[Artifact, dict[str, torch.Tensor] | None]:
    """The artifact our runtime checks, and the id remapping its batch needs: the whole
    artifact when its tables fit a quarter of the memory budget (the runtime holds them
    in memory), else only the checked rows, read back from the written files."""
    from serve.runtime.artifact import Artifact, QuantTable

    if art.table_bytes <= cfg.max_memory_bytes // 4 or art.files is None:
        return art, None
    tables = [QuantTable(t.name, int(ref.ids[t.name].numel()), t.dim, t.dtype,
                         torch.from_numpy(art.files.read_rows(i, ref.ids[t.name].numpy())))
              for i, t in enumerate(art.tables)]
    return Artifact(ref.small_schema, tables, art.dense, dict(art.meta)), ref.ids


def _check(cfg: ImportConfig, art: Artifact, ref: _Reference,
           say: Callable[[str], None]) -> CheckResult:
    """Compare the artifact's probabilities with TorchRec's quantized forward.

    Raises:
        ArtifactError: they differ by more than the tolerance.
    """
    ours, remap = _checked_artifact(cfg, art, ref)
    check = check_streamed(ours, ref.qsmall, ref.schema, ref.ids, batch=cfg.check_batch,
                           seed=cfg.seed, tolerance=cfg.tolerance, remap_ours=remap is not None)
    say(f"[check] max |ours - TorchRec| = {check.max_abs_diff:.3g} over {check.batch} samples "
        f"({check.ids} ids, {check.rows} rows); tolerance {check.tolerance:g}")
    if not check.passed:
        raise ArtifactError(
            f"the imported model's probabilities differ from TorchRec's quantized forward by "
            f"{check.max_abs_diff:.3g} > {check.tolerance:g}; nothing was written. The model "
            "may do work outside its EmbeddingBagCollections that the export did not keep; "
            "see the contract in the README")
    return check


def check_streamed(artifact: Any, qsmall: nn.Module, schema: ModelSchema,
                   ids: Mapping[str, torch.Tensor], *, batch: int, seed: int, tolerance: float,
                   remap_ours: bool = False) -> CheckResult:
    """Our runtime over ``artifact`` vs ``torch.sigmoid`` of ``qsmall`` (TorchRec's
    quantized model over rows ``ids[table]`` only) on :func:`generated_batch` of
    ``schema``: ``qsmall`` reads the ids remapped to their index in ``ids``; ours reads
    the original ids, or the remapped ones when ``remap_ours`` (an artifact of the
    checked rows only)."""
    from serve.model.stream_import import remap_values
    from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

    dense, values, lengths = generated_batch(schema, batch, seed)
    small = remap_values(schema, values, lengths, ids)
    rt = Runtime(artifact, RuntimeConfig(device="cpu", cache_load_factor=1.0))
    try:
        ours = rt.predict(dense, SparseBatch(small if remap_ours else values, lengths))
    finally:
        rt.close()
    with torch.no_grad():
        ref = torch.sigmoid(qsmall(dense, _kjt(schema, small, lengths)).float().reshape(-1))
    diff = float((ours - ref).abs().max()) if batch else 0.0
    rows = "checked" if remap_ours else "all"
    return CheckResult(diff, batch, int(values.numel()), tolerance, rows)


def dense_precision_diff(artifact: Any, precision: str, *, batch: int, seed: int) -> float:
    """Largest |p_precision - p_fp32| of our runtime on :func:`generated_batch` (the same
    artifact, dense part in fp32 and in ``precision``)."""
    from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

    dense, values, lengths = generated_batch(artifact.schema, batch, seed)
    out = []
    for p in ("fp32", precision):
        rt = Runtime(artifact, RuntimeConfig(device="cpu", cache_load_factor=1.0,
                                             dense_precision=p))
        try:
            out.append(rt.predict(dense, SparseBatch(values, lengths)))
        finally:
            rt.close()
    return float((out[1] - out[0]).abs().max()) if batch else 0.0


def _check_dense_precision(cfg: ImportConfig, art: Artifact, ref: _Reference,
                           say: Callable[[str], None]) -> dict[str, Any]:
    """The lossy dense precision's gate: an import has no held-out labels, so it bounds
    the probabilities (``cfg.dense_tolerance``) on the check batch instead of the AUC.

    Raises:
        ArtifactError: they move by more than the tolerance.
    """
    ours, _ = _checked_artifact(cfg, art, ref)
    diff = dense_precision_diff(ours, cfg.dense_precision, batch=cfg.check_batch, seed=cfg.seed)
    say(f"[check] dense {cfg.dense_precision}: max |p_{cfg.dense_precision} - p_fp32| = "
        f"{diff:.3g} over {cfg.check_batch} samples; tolerance {cfg.dense_tolerance:g}")
    if diff > cfg.dense_tolerance:
        raise ArtifactError(
            f"dense {cfg.dense_precision} moves the probabilities by {diff:.3g} > "
            f"{cfg.dense_tolerance:g} (--dense-tolerance); nothing was written. Import it "
            "with --dense-precision fp32")
    return {"precision": cfg.dense_precision, "max_abs_diff_vs_fp32": diff,
            "tolerance": cfg.dense_tolerance, "batch": cfg.check_batch,
            "gate": "probabilities on the check batch (an import has no held-out labels)"}


@dataclass(frozen=True)
class _Provenance:
    """What the version's report says of where the artifact came from."""

    model: nn.Module            # the imported (float) model
    check: CheckResult          # the check against TorchRec's quantized forward
    kind: str                   # the dense part's kind
    dense_precision: dict[str, Any] | None = None   # the lossy precision's gate, if any
    context: tuple[str, ...] = ()                   # the factory's CONTEXT_FEATURES


def context_features(module: Any, schema: ModelSchema) -> tuple[str, ...]:
    """The factory module's ``CONTEXT_FEATURES`` (its user side, what a ranking request
    sends once) among this model's features, in the schema's order; () when it declares
    none. A module may serve several factories, so names the model lacks are skipped."""
    declared = getattr(module, "CONTEXT_FEATURES", ()) or ()
    if isinstance(declared, str) or not all(isinstance(n, str) for n in declared):
        raise ConfigError(f"CONTEXT_FEATURES in the factory's module is {declared!r}; make it "
                          "a tuple of feature names, e.g. ('user_id',)")
    return tuple(f for f in schema.feature_names if f in set(declared))


def _store(cfg: ImportConfig, repo: ModelRepository, art: Artifact, prov: _Provenance,
           seconds: dict[str, float], tmp: Path, folder: Path) -> Path:
    """Save the format-3 artifact (its tables in ``folder``, inside ``tmp`` on the model
    store's file system) and add it to the model store as version ``cfg.version``, with
    its report and archive; return what the repository stored."""
    from serve.model.archive import add_version
    from serve.runtime.artifact import save_artifact

    t = time.perf_counter()
    path = tmp / "artifact.pt"
    save_artifact(art, path)
    seconds["archive"] = round(time.perf_counter() - t, 3)
    report = _report(cfg, prov.model, art, prov.check, prov.kind, seconds)
    report["peak_rss_bytes"] = peak_rss_bytes()
    report["context_features"] = list(prov.context)
    handler: dict[str, Any] = {"max_ids_per_feature": max(DEFAULT_MAX_IDS, *art.schema.max_ids)}
    if prov.dense_precision is not None:
        report["dense_precision"] = prov.dense_precision
        handler["dense_precision"] = cfg.dense_precision
    stored: Path = add_version(repo, path, cfg.version, report, tmp,
                               batch_size=cfg.mar_batch_size,
                               max_batch_delay_ms=cfg.mar_max_batch_delay_ms,
                               workers=cfg.mar_workers,
                               # The handler's own cap on ids per feature must not
                               # undercut the model's (DLRM-v2 takes 100 ids in one
                               # feature).
                               handler_config=handler, tables=folder)
    return stored


# ----------------------------------------------------------------------------- CLI
def _pairs(items: Sequence[str], flag: str, conv: Callable[[str], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r} must be NAME=VALUE")
        try:
            out[key] = conv(value)
        except ValueError:
            raise ConfigError(f"{flag} {item!r}: {value!r} is not valid") from None
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.importer",
        description="Import your own TorchRec model (factory + checkpoint) into the model "
                    "store as an immutable version, after checking that our runtime gives "
                    "TorchRec's own quantized probabilities. Prints one JSON line last.")
    ap.add_argument("--factory", required=True,
                    help="FILE.py:FUNCTION; FUNCTION() returns the model (CPU or meta device)")
    ap.add_argument("--checkpoint", required=True, type=Path,
                    help="a torch.distributed.checkpoint directory (dcp.save of a DMP "
                         "state_dict, any number of ranks) or a torch.save(state_dict) file")
    ap.add_argument("--version", required=True, help="the new version's name (immutable)")
    ap.add_argument("--num-dense", type=int, default=None,
                    help="N dense features of forward's first argument (default: the factory "
                         "module's NUM_DENSE)")
    ap.add_argument("--dtype", default="int8",
                    help="stored dtype of every table: int8 (default), int4, fp16 or fp32")
    ap.add_argument("--table-dtype", action="append", default=[], metavar="TABLE=DTYPE",
                    help="another dtype for one table (repeatable), e.g. t_user=fp16")
    ap.add_argument("--max-ids", action="append", default=[], metavar="FEATURE=N",
                    help="most ids per instance of one feature (repeatable; default: the "
                         "factory module's MAX_IDS, else --default-max-ids)")
    ap.add_argument("--default-max-ids", type=int, default=DEFAULT_MAX_IDS,
                    help=f"most ids per instance of the other features (default {DEFAULT_MAX_IDS})")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help="largest accepted |ours - TorchRec| probability (default 1e-6)")
    ap.add_argument("--check-batch", type=int, default=64,
                    help="samples in the generated check batch (default 64)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the check batch")
    ap.add_argument("--model-store", type=Path, default=Path("model_store"),
                    help="the repository folder (default model_store/)")
    ap.add_argument("--model-name", default="dlrm", help="TorchServe's model name (dlrm)")
    ap.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                    help="TorchServe workers the version declares (default 2; threads per "
                         "worker = the pod's CPUs / workers: 1 worker x 2 threads halves a "
                         "large model's per-request latency on 2 cores)")
    ap.add_argument("--dense-precision", default="fp32", choices=("fp32", "bf16"),
                    help="the dense part's arithmetic when served: fp32 (default, exact) or "
                         "bf16 (AMX/AVX-512 BF16 CPUs, GPUs: several times the dense speed), "
                         "admitted only if the probabilities stay within --dense-tolerance "
                         "of fp32's on the check batch")
    ap.add_argument("--max-memory-bytes", type=int, default=DEFAULT_MAX_MEMORY_BYTES,
                    help="memory the import may hold beyond the interpreter and its "
                         "libraries, in bytes (default 2e9 = 2 GB): it sizes the chunks of "
                         "rows read, quantized and written at a time (half of it), so a "
                         "model of any size imports within it; the check's runtime holds "
                         "every table only when they fit a quarter of it, else the rows "
                         "the check reads")
    ap.add_argument("--dense-tolerance", type=float, default=DENSE_MAX_PROB_DIFF,
                    help=f"bf16's bound on |p_bf16 - p_fp32| (default {DENSE_MAX_PROB_DIFF:g})")
    return ap


def main(argv: list[str] | None = None) -> int:
    setup_cli_logging()
    args = _parser().parse_args(argv)
    try:
        cfg = ImportConfig(
            factory=args.factory, checkpoint=args.checkpoint, version=args.version,
            num_dense=args.num_dense, dtype=args.dtype,
            table_dtypes=_pairs(args.table_dtype, "--table-dtype", str),
            max_ids=_pairs(args.max_ids, "--max-ids", int),
            default_max_ids=args.default_max_ids, tolerance=args.tolerance,
            check_batch=args.check_batch, seed=args.seed, model_store=args.model_store,
            model_name=args.model_name, mar_workers=args.workers,
            dense_precision=args.dense_precision,
            dense_tolerance=args.dense_tolerance,
            max_memory_bytes=args.max_memory_bytes)
        out = import_model(cfg, say=lambda m: print(m, flush=True))
    except ServeError as e:
        print(f"import failed: {e.message}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
