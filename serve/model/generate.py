"""Full-size models with random weights, written chunk by chunk: no training, bounded memory.

    python -m serve.model.generate checkpoint --factory FILE.py:FUNCTION --out DIR
        [--seed 0] [--ranks 2] [--chunk-rows 1048576]
    python -m serve.model.generate version --factory FILE.py:FUNCTION --version NAME
        [--model-store model_store] [--dtype int8] [--seed 0] [--chunk-rows 1048576]

``checkpoint`` writes a ``torch.distributed.checkpoint`` directory, byte for byte as DCP's
``FileSystemWriter`` lays one out: ``__<rank>_0.distcp`` files (one per rank, as if
``--ranks`` ranks had saved a sharded model: the tables' chunks in about equal bytes per
rank, a large table row-wise over several ranks; the dense weights on rank 0), each item
a ``torch.save`` of one chunk at its offset, and a pickled ``Metadata`` (``.metadata``, written last) naming
every chunk (``ChunkStorageMetadata`` offsets and sizes) and where it lies
(``MetadataIndex(fqn, offset)`` -> ``_StorageInfo(file, offset, length)``). Stock
``dcp.load`` and the importer read it like any other.

``version`` writes a version into the model store directly (for models whose fp32
checkpoint does not fit the disk: MLPerf DLRM-v2's is 104 GB): each chunk is quantized
as it is generated with FBGEMM's row-wise ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``
(the operator TorchRec's ``quantize_inference_model`` calls, so the rows are the bytes an
import of the same weights stores), streamed into the version's table files
(:class:`serve.store.tablefiles.TableWriter`); the dense part is the factory's model after
pooling (``torch.export``, or TorchRec ``DLRM``'s weights), as the importer stores it; the
artifact is format 3 and the version is added with :func:`serve.model.archive.add_version`.
No check against TorchRec's forward is possible without the float model (the report's
``check`` is null): the import of the article's model is what shows the check at scale.

Weights. The dense (non-table) weights are the factory's own initialisation under
``torch.manual_seed(seed)``. Table rows are uniform in TorchRec's own initialisation range
for the table (``EmbeddingBagConfig.get_weight_init_min/max``: +-sqrt(1 / rows) unless the
config sets it), drawn in blocks of :data:`BLOCK_ROWS` rows, each from its own generator
seeded by (seed, table, block): the same seed gives the same bytes, whatever the chunk size
or the number of ranks, and the two modes give the same rows.

Memory: one chunk (``--chunk-rows`` x D fp32; a version also holds its quantized copy)
plus the dense layers: a factory that takes ``device`` is called with ``device="meta"``,
so the tables are never allocated (see :func:`seeded_model`).
Disk: the output only (the checkpoint's table bytes are rows x D x 4 plus about 1 KB of
``torch.save`` framing per chunk); it is written beside its final place and renamed in
when complete, so a failed or interrupted run leaves nothing behind. A progress line
(rows/s, GB/s, ETA) goes to stderr.

Shapes: D a table's dim; a chunk is (n, D) float32, n <= ``--chunk-rows``.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from serve.common.clilog import setup_cli_logging
from serve.errors import ArtifactError, ConfigError, ServeError
from serve.rowformat import DTYPES, row_bytes
from serve.schema import DEFAULT_MAX_IDS, ModelSchema
from serve.state import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_DELAY_MS, DEFAULT_WORKERS

__all__ = ["BLOCK_ROWS", "DEFAULT_CHUNK_ROWS", "Progress", "TableInit", "VersionConfig",
           "main", "quantize_rows", "seeded_model", "table_inits", "table_rows_fp32",
           "write_checkpoint", "write_version"]

#: Rows drawn from one seeded generator (chunks are multiples of it).
BLOCK_ROWS = 1 << 16
#: Rows per chunk by default: 256 MB of fp32 at D = 64.
DEFAULT_CHUNK_ROWS = 1 << 20
#: Seconds between two progress lines.
PROGRESS_EVERY_S = 2.0
#: The free disk a run keeps beyond what it writes.
DISK_MARGIN_BYTES = 1 << 30
#: ``torch.save`` framing per chunk in a checkpoint (zip headers; measured ~1.1 KB).
SAVE_OVERHEAD_BYTES = 4096
_METADATA = ".metadata"


# ----------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class TableInit:
    """One table's weight: ``fqn`` in the model's state dict, (rows, dim) float32, drawn
    uniform in [low, high) (TorchRec's init range for it)."""

    fqn: str
    name: str
    rows: int
    dim: int
    low: float
    high: float

    @property
    def nbytes(self) -> int:
        """fp32 bytes of the whole table."""
        return self.rows * self.dim * 4


def table_inits(model: nn.Module) -> list[TableInit]:
    """Every table of the model's ``EmbeddingBagCollection`` s, in schema order (collections
    in ``named_modules`` order, each one's tables in config order).

    Raises:
        ConfigError: no collection, or a table weight not found in the state dict.
    """
    from serve.model.export import collections
    from serve.model.stream_import import table_keys

    keys = table_keys(model)    # the importer's own check of where each weight is
    out = [TableInit(keys[cfg.name], cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim),
                     float(cfg.get_weight_init_min()), float(cfg.get_weight_init_max()))
           for _, ebc in collections(model) for cfg in ebc.embedding_bag_configs()]
    if not out:
        raise ConfigError("the model has no torchrec EmbeddingBagCollection table; the "
                          "contract keeps embeddings in EmbeddingBagCollection modules")
    return out


def _block_seed(seed: int, table: str, block: int) -> int:
    h = hashlib.blake2b(f"{seed}:{table}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def table_rows_fp32(t: TableInit, seed: int, start: int, n: int) -> torch.Tensor:
    """Rows ``start .. start + n`` of table ``t``: float32 (n, D), uniform in
    [t.low, t.high). ``start`` must be a multiple of :data:`BLOCK_ROWS`; the rows depend
    only on (seed, table name, row), not on how they are chunked."""
    if start % BLOCK_ROWS or n < 0 or start + n > t.rows:
        raise ConfigError(f"table {t.name}: rows {start}..{start + n} must start at a "
                          f"multiple of {BLOCK_ROWS} and end by {t.rows}")
    out = torch.empty((n, t.dim), dtype=torch.float32)
    for a in range(0, n, BLOCK_ROWS):
        g = torch.Generator().manual_seed(_block_seed(seed, t.name, (start + a) // BLOCK_ROWS))
        out[a : a + BLOCK_ROWS].uniform_(t.low, t.high, generator=g)
    return out


def quantize_rows(weight: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 (n, D) rows -> our row format, uint8 (n, row_bytes(dtype, D)), with the
    quantizer TorchRec's ``quantize_inference_model`` uses (FBGEMM's
    ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``: [q][scale fp16][bias fp16], moved
    to our [scale][bias][q]), so the bytes equal an import's."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    n, dim = weight.shape
    out = torch.zeros((n, row_bytes(dtype, dim)), dtype=torch.uint8)
    if dtype in ("fp32", "fp16"):
        raw = weight.to(torch.float32 if dtype == "fp32" else torch.float16).view(torch.uint8)
        out[:, : raw.shape[1]] = raw
        return out
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(
        weight.contiguous(), 8 if dtype == "int8" else 4)       # (n, q bytes + 4)
    out[:, :4] = fused[:, -4:]
    out[:, 4 : fused.shape[1]] = fused[:, :-4]
    return out


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def seeded_model(factory: str, seed: int) -> tuple[nn.Module, Any]:
    """(the factory's model built under ``torch.manual_seed(seed)``, its module): its
    dense weights are the ones both modes write. A factory with a ``device`` argument is
    called with ``device="meta"`` (the examples' convention: tables on meta, the other
    layers on the CPU), so no table is allocated; any other is called as ``FUNCTION()``
    (then its tables are built as it builds them: memory is theirs too).

    Raises:
        ConfigError: a bad factory, or dense (non-table) weights on the meta device.
    """
    from serve.model.importer import load_factory

    factory_fn, module = load_factory(factory)
    fn: Callable[..., Any] = factory_fn
    try:
        takes_device = "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):   # a builtin or C callable: no signature to read
        takes_device = False
    with _seeded(seed):
        # tables on meta: building the model allocates none of them, whatever its size
        model = fn(device="meta") if takes_device else fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--factory {factory} returned {type(model).__name__}, not a "
                          "torch.nn.Module")
    tables = {t.fqn for t in table_inits(model)}
    meta = [k for k, v in model.state_dict().items() if k not in tables and v.is_meta]
    if meta:
        raise ConfigError(f"--factory {factory}: the dense weights {meta[:3]} are on the meta "
                          "device; build the tables on meta but the other layers on the CPU "
                          "(as examples/article_two_tables does)")
    return model.eval(), module


# ----------------------------------------------------------------------------- progress
class Progress:
    """A progress line on ``stream`` every :data:`PROGRESS_EVERY_S` seconds and at the end:
    bytes and rows done of the total, rows/s, GB/s, ETA."""

    def __init__(self, total_bytes: int, total_rows: int, what: str,
                 stream: TextIO | None = None) -> None:
        self.total_bytes, self.total_rows, self.what = total_bytes, total_rows, what
        self.bytes = self.rows = 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = self._last = time.perf_counter()

    def add(self, rows: int, nbytes: int) -> None:
        self.rows += rows
        self.bytes += nbytes
        now = time.perf_counter()
        if now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            self.line(now, done=False)

    def done(self) -> float:
        """Print the last line; return the seconds since the start."""
        now = time.perf_counter()
        self.line(now, done=True)
        return now - self.t0

    def line(self, now: float, done: bool) -> None:
        """Print the line as of ``now`` (``time.perf_counter()`` seconds)."""
        s = max(now - self.t0, 1e-9)
        eta = (self.total_bytes - self.bytes) / max(self.bytes / s, 1e-9)
        tail = f"{s:.0f} s" if done else f"ETA {eta:.0f} s"
        print(f"[{self.what}] {self.bytes / 1e9:.2f} of {self.total_bytes / 1e9:.2f} GB, "
              f"{self.rows:,} of {self.total_rows:,} rows, {self.rows / s:,.0f} rows/s, "
              f"{self.bytes / s / 1e9:.2f} GB/s, {tail}", file=self.stream, flush=True)


def _check_disk(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need + DISK_MARGIN_BYTES:
        raise ConfigError(f"{what} needs {need / 1e9:.1f} GB on {where}, which has "
                          f"{free / 1e9:.1f} GB free (keeping {DISK_MARGIN_BYTES / 1e9:.1f} GB "
                          "spare); free disk or write elsewhere")


def _check_chunk_rows(chunk_rows: int) -> None:
    if chunk_rows < BLOCK_ROWS or chunk_rows % BLOCK_ROWS:
        raise ConfigError(f"--chunk-rows {chunk_rows} must be a positive multiple of "
                          f"{BLOCK_ROWS} (rows drawn from one generator)")


# ----------------------------------------------------------------------------- checkpoint
@dataclass(frozen=True)
class _Item:
    """One chunk of one state-dict tensor and the rank file it goes to."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    table: TableInit | None     # None: a dense tensor, written whole


def _plan(state: dict[str, torch.Tensor], tables: list[TableInit], ranks: int,
          chunk_rows: int) -> list[_Item]:
    """Every chunk in write order. The tables' chunks, in order, are cut into ``ranks``
    contiguous runs of about equal bytes, one per rank file (a large table row-wise over
    several ranks, small ones whole on one, as a sharded save spreads them); every dense
    tensor is whole on rank 0 (a replicated tensor is saved once)."""
    by_fqn = {t.fqn: t for t in tables}
    total = max(sum(t.nbytes for t in tables), 1)
    done = 0
    items: list[_Item] = []
    for fqn, v in state.items():
        t = by_fqn.get(fqn)
        if t is None:
            items.append(_Item(fqn, (0,) * v.dim(), tuple(v.shape), 0, None))
            continue
        for start in range(0, t.rows, chunk_rows):
            n = min(chunk_rows, t.rows - start)
            items.append(_Item(fqn, (start, 0), (n, t.dim), done * ranks // total, t))
            done += n * t.dim * 4
    return items


def _metadata(state: dict[str, torch.Tensor], items: list[_Item], infos: list[Any],
              out: Path) -> Any:
    """DCP's ``Metadata`` for the written items, as ``FileSystemWriter.finish`` pickles it."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for it, info in zip(items, infos, strict=True):
        if it.fqn not in md:
            v = state[it.fqn]
            props = (TensorProperties(dtype=torch.float32) if it.table is not None
                     else TensorProperties.create_from_tensor(v))
            md[it.fqn] = TensorStorageMetadata(props, torch.Size(v.shape), [])
        chunks = md[it.fqn].chunks
        chunks.append(ChunkStorageMetadata(torch.Size(it.offsets), torch.Size(it.sizes)))
        storage[MetadataIndex(it.fqn, it.offsets, len(chunks) - 1)] = info
    return Metadata(state_dict_metadata=md, planner_data={k: (k,) for k in md},
                    storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=out, save_id=str(uuid.uuid4())),
                    version="1.0.0")


def _new_dir(out: Path) -> Path:
    """The temporary sibling a result is written in (renamed to ``out`` when complete)."""
    if out.exists():
        raise ConfigError(f"--out {out} exists; the generator writes a new directory (remove "
                          "it or pick another path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def write_checkpoint(factory: str, out: Path, *, seed: int = 0, ranks: int = 2,
                     chunk_rows: int = DEFAULT_CHUNK_ROWS,
                     stream: TextIO | None = None) -> dict[str, Any]:
    """Write the DCP checkpoint of the factory's model with random weights into ``out``
    (a new directory); return ``{"checkpoint", "bytes", "rows", "seconds", "gb_per_s",
    "files", "chunks"}``.

    Raises:
        ConfigError: a bad factory or option, ``out`` exists, too little free disk.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if ranks < 1:
        raise ConfigError(f"--ranks {ranks} must be >= 1")
    _check_chunk_rows(chunk_rows)
    model, _ = seeded_model(factory, seed)
    state = model.state_dict()
    tables = table_inits(model)
    items = _plan(state, tables, ranks, chunk_rows)
    total = sum(t.nbytes for t in tables)
    _check_disk(out.parent if out.parent.exists() else Path("."),
                total + len(items) * SAVE_OVERHEAD_BYTES, f"the checkpoint {out}")
    tmp = _new_dir(out)
    progress = Progress(total, sum(t.rows for t in tables), "generate", stream)
    try:
        names = [f"__{r}_0.distcp" for r in range(ranks)]
        infos = []
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(open(tmp / n, "wb")) for n in names]
            for it in items:
                f = files[it.rank]
                chunk = (state[it.fqn].detach().clone() if it.table is None else
                         table_rows_fp32(it.table, seed, it.offsets[0], it.sizes[0]))
                offset = f.tell()
                torch.save(chunk, f)
                infos.append(_StorageInfo(names[it.rank], offset, f.tell() - offset))
                if it.table is not None:
                    progress.add(it.sizes[0], chunk.numel() * 4)
                del chunk
            for f in files:
                f.flush()
                os.fsync(f.fileno())
        with open(tmp / f"{_METADATA}.tmp", "wb") as f:
            pickle.dump(_metadata(state, items, infos, out), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp / f"{_METADATA}.tmp", tmp / _METADATA)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = progress.done()
    size = sum(p.stat().st_size for p in out.iterdir())
    return {"checkpoint": os.fspath(out), "bytes": size, "rows": progress.rows,
            "seconds": round(seconds, 3), "gb_per_s": round(size / seconds / 1e9, 3),
            "files": ranks, "chunks": len(items)}


# ----------------------------------------------------------------------------- version
@dataclass(frozen=True)
class VersionConfig:
    """One generated version (see the module docstring)."""

    factory: str
    version: str
    model_store: Path = Path("model_store")
    model_name: str = "dlrm"
    seed: int = 0
    dtype: str = "int8"
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    batch_size: int = DEFAULT_BATCH_SIZE
    max_batch_delay_ms: int = DEFAULT_MAX_BATCH_DELAY_MS
    workers: int = DEFAULT_WORKERS

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} must be one of {', '.join(DTYPES)}")
        _check_chunk_rows(self.chunk_rows)


def _version_schema(model: nn.Module, module: Any, dtype: str) -> ModelSchema:
    """The schema as the importer derives it (the module's NUM_DENSE and MAX_IDS)."""
    from serve.common.validate import is_int
    from serve.model.export import collections, model_schema

    num_dense = getattr(module, "NUM_DENSE", None)
    if not is_int(num_dense):
        raise ConfigError("the number of dense features is unknown: define NUM_DENSE = N in "
                          "the factory's module")
    ours = {f for _, ebc in collections(model) for c in ebc.embedding_bag_configs()
            for f in c.feature_names}
    max_ids = {k: v for k, v in dict(getattr(module, "MAX_IDS", {}) or {}).items() if k in ours}
    return model_schema(model, num_dense, dtype=dtype, max_ids=max_ids)


def _write_tables(folder: Path, schema: ModelSchema, tables: list[TableInit], seed: int,
                  chunk_rows: int, stream: TextIO | None) -> Progress:
    """Stream every table's quantized rows into a new tables folder, chunk by chunk."""
    from serve.store.tablefiles import TableWriter

    if [t.name for t in tables] != [s.name for s in schema.tables]:
        raise ArtifactError(f"tables {[t.name for t in tables]} are not the schema's "
                            f"{[s.name for s in schema.tables]}")
    progress = Progress(sum(s.rows * row_bytes(s.dtype, s.dim) for s in schema.tables),
                        sum(t.rows for t in tables), "generate", stream)
    with TableWriter(folder, schema.tables) as w:
        for i, (t, spec) in enumerate(zip(tables, schema.tables, strict=True)):
            for start in range(0, t.rows, chunk_rows):
                rows = quantize_rows(table_rows_fp32(t, seed, start,
                                                     min(chunk_rows, t.rows - start)), spec.dtype)
                w.write(i, start, rows)
                progress.add(rows.shape[0], rows.numel())
                del rows
        w.commit()
    return progress


def write_version(cfg: VersionConfig, stream: TextIO | None = None,
                  say: Callable[[str], None] = print) -> dict[str, Any]:
    """Generate the factory's model as version ``cfg.version`` of ``cfg.model_store``
    (quantized table files, dense part, format-3 archive, report); return
    ``{"version", "archive", "report", "table_bytes", "seconds", "gb_per_s"}``.

    Raises:
        ConfigError: a bad factory or option, the version exists, too little free disk.
    """
    from serve.model.archive import add_version
    from serve.model.export import dlrm_dense, export_dense, is_torchrec_dlrm
    from serve.runtime.artifact import Artifact, DenseSpec, save_artifact, tables_from_files
    from serve.store.repository import ModelRepository
    from serve.store.tablefiles import TableFiles

    t0 = time.perf_counter()
    repo = ModelRepository([cfg.model_store], cfg.model_name)
    if repo.exists(cfg.version):
        raise ConfigError(f"version {cfg.version!r} already exists in {cfg.model_store} and "
                          "versions are immutable; pick another --version")
    model, module = seeded_model(cfg.factory, cfg.seed)
    schema = _version_schema(model, module, cfg.dtype)
    tables = table_inits(model)
    dense: DenseSpec = dlrm_dense(model) if is_torchrec_dlrm(model) else export_dense(model, schema)
    kind = "dlrm" if is_torchrec_dlrm(model) else "export"
    say(f"[schema] {schema.dense} dense, {len(schema.features)} sparse features over "
        f"{len(schema.tables)} tables ({schema.total_rows:,} rows); dense part: {kind}")
    cfg.model_store.mkdir(parents=True, exist_ok=True)
    need = sum(s.rows * row_bytes(s.dtype, s.dim) for s in schema.tables)
    _check_disk(cfg.model_store, need, f"version {cfg.version}")
    with tempfile.TemporaryDirectory(prefix=".generate-", dir=cfg.model_store) as tmp:
        folder = Path(tmp) / repo.tables_name(cfg.version)
        progress = _write_tables(folder, schema, tables, cfg.seed, cfg.chunk_rows, stream)
        seconds = {"tables": round(progress.done(), 3)}
        files = TableFiles.open(folder)
        try:
            art = Artifact(schema, tables_from_files(files), dense,
                           {"version": cfg.version, "origin": "generate",
                            "factory": cfg.factory, "seed": cfg.seed}, files=files)
            path = Path(tmp) / "artifact.pt"
            save_artifact(art, path)
            report = _version_report(cfg, model, art, kind, seconds)
            stored = add_version(repo, path, cfg.version, report, Path(tmp),
                                 batch_size=cfg.batch_size,
                                 max_batch_delay_ms=cfg.max_batch_delay_ms,
                                 workers=cfg.workers, tables=folder,
                                 handler_config={"max_ids_per_feature":
                                                 max(DEFAULT_MAX_IDS, *schema.max_ids)})
        finally:
            files.close()
    total = time.perf_counter() - t0
    say(f"[store] added version {cfg.version}: {stored}")
    return {"version": cfg.version, "archive": os.fspath(stored),
            "report": os.fspath(cfg.model_store / f"{cfg.model_name}-{cfg.version}.json"),
            "table_bytes": progress.bytes, "seconds": round(total, 3),
            "gb_per_s": round(progress.bytes / max(seconds["tables"], 1e-9) / 1e9, 3)}


def _version_report(cfg: VersionConfig, model: nn.Module, art: Any, kind: str,
                    seconds: dict[str, float]) -> dict[str, Any]:
    return {
        "version": cfg.version, "model_name": cfg.model_name, "origin": "generate",
        "factory": cfg.factory, "seed": cfg.seed, "schema": art.schema.to_dict(),
        "dense_kind": kind, "quantized_dtype": art.dtype,
        "quantizer": "fbgemm FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf (as TorchRec's "
                     "quantize_inference_model)",
        "weights": "random: dense from the factory's init under torch.manual_seed(seed), "
                   "tables uniform in TorchRec's init range",
        "num_parameters": sum(v.numel() for v in model.state_dict().values()),
        "table_bytes_quantized": art.table_bytes,
        "table_bytes": {t.name: t.nbytes for t in art.tables},
        # Generated, not imported: no float model to check against (see the docstring).
        "check": None, "baseline": None,
        "mar_batch_size": cfg.batch_size, "mar_max_batch_delay_ms": cfg.max_batch_delay_ms,
        "mar_workers": cfg.workers,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_seconds": seconds,
    }


# ----------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.generate",
        description="Write a model with random weights at any size, chunk by chunk (memory: "
                    "one chunk): a DCP checkpoint to import, or a version straight into the "
                    "model store. The factory's own size options apply (e.g. "
                    "ARTICLE_SCALE=full, DLRMV2_MAX_ROWS=0). Prints one JSON line last.")
    sub = ap.add_subparsers(dest="mode", required=True)
    ck = sub.add_parser("checkpoint", help="a torch.distributed.checkpoint directory, as N "
                        "ranks would write it (import it with `make import`)")
    ck.add_argument("--out", required=True, type=Path, help="the new checkpoint directory")
    ck.add_argument("--ranks", type=int, default=2,
                    help="__<rank>_0.distcp files; the tables' chunks are spread over them "
                         "in about equal bytes, large tables row-wise (default 2)")
    ver = sub.add_parser("version", help="a version in the model store: quantized table "
                         "files, the dense part and the archive (no float checkpoint)")
    ver.add_argument("--version", required=True, help="the new version's name (immutable)")
    ver.add_argument("--model-store", type=Path, default=Path("model_store"),
                     help="the repository folder (default model_store/)")
    ver.add_argument("--model-name", default="dlrm", help="TorchServe's model name (dlrm)")
    ver.add_argument("--dtype", default="int8", help="stored dtype of every table: int8 "
                     "(default), int4, fp16 or fp32")
    ver.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                     help=f"TorchServe batch size the version declares ({DEFAULT_BATCH_SIZE})")
    ver.add_argument("--max-batch-delay-ms", type=int, default=DEFAULT_MAX_BATCH_DELAY_MS,
                     help=f"TorchServe batch delay, ms ({DEFAULT_MAX_BATCH_DELAY_MS})")
    ver.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                     help=f"TorchServe workers the version declares ({DEFAULT_WORKERS})")
    for p in (ck, ver):
        p.add_argument("--factory", required=True,
                       help="FILE.py:FUNCTION; FUNCTION() returns the model (tables may be "
                            "on meta, the other layers on the CPU)")
        p.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
        p.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                       help=f"rows per chunk, a multiple of {BLOCK_ROWS} (default "
                            f"{DEFAULT_CHUNK_ROWS}; memory is about one chunk of fp32)")
    return ap


def main(argv: list[str] | None = None) -> int:
    setup_cli_logging()
    args = _parser().parse_args(argv)
    try:
        if args.mode == "checkpoint":
            out = write_checkpoint(args.factory, args.out, seed=args.seed, ranks=args.ranks,
                                   chunk_rows=args.chunk_rows)
        else:
            cfg = VersionConfig(factory=args.factory, version=args.version,
                                model_store=args.model_store, model_name=args.model_name,
                                seed=args.seed, dtype=args.dtype, chunk_rows=args.chunk_rows,
                                batch_size=args.batch_size,
                                max_batch_delay_ms=args.max_batch_delay_ms,
                                workers=args.workers)
            out = write_version(cfg, say=lambda m: print(m, flush=True))
    except ServeError as e:
        print(f"generate failed: {e.message}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
