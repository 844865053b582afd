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

File: ``torch.save`` of a dict, format version ``FORMAT_VERSION`` (3; 2 still written for
an artifact whose tables are in memory, 1 and 2 still read):

    {"format_version": 2, "schema": ModelSchema.to_dict(),
     "tables": [{"name", "data": uint8 (rows, row_bytes)}, ...]   (format 2: in the file)
             | {"ref": "<model>-<version>.tables", "identity": str}     (format 3: on disk
                  beside the archive, :mod:`serve.store.tablefiles`; found through a
                  search path of folders, :func:`load_artifact`),
     "dense": {"kind": "dlrm", "dense_arch", "over_arch"}          (our built-in DLRM)
            | {"kind": "export", "program": uint8 (n,),            (torch.export bytes,
               "program_sha256": hex str}     checked at load; the program's archive is
                                               checked for pickled payloads before
                                               torch.export.load: serve.runtime.program_check),
     "meta": {...},
     "id_maps": {table name: {"ids": int64 (n,), "rows": int64 (n,)}}}
                                   (only when a table is ``mapping="managed"``: its
                                    :class:`serve.runtime.idmap.IdMap`)

Why ``torch.export`` for the dense part of other models: it records the user's layers
after pooling as a graph of ATen operators that ``torch.export.load`` runs with stock
PyTorch (no TorchRec, no Python of the user's in the pod: a program that carries
pickled objects is refused), with the batch dimension symbolic;
TorchScript would need the user's modules to be scriptable, which TorchRec's are not
throughout. Format 1 (one table per feature, one dim, DLRM layers, no schema) still loads.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serve.errors import ArtifactError, ConfigError
from serve.rowformat import DTYPES, row_bytes
from serve.rowformat import SCALE_BIAS_BYTES as _SCALE_BIAS_BYTES
from serve.runtime.idmap import IdMap
from serve.runtime.program_check import program_sha256
from serve.schema import DEFAULT_MAX_IDS, FeatureSpec, ModelSchema, TableSpec
from serve.settings import DLRM_REPOSITORY
from serve.store.tablefiles import TABLES_SUFFIX, TableFiles, TableWriter

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "Artifact",
    "DLRMDense",
    "DenseSpec",
    "ExportedDense",
    "QuantTable",
    "dequantize_rows",
    "load_artifact",
    "quantize_rows_reference",
    "row_bytes",
    "save_artifact",
    "tables_from_files",
    "write_tables",
]

FORMAT_VERSION = 3
#: The environment variable naming where the workers find format-3 tables folders.
TABLES_PATH_ENV = DLRM_REPOSITORY.name
#: An artifact whose tables are in the file itself (no ``files``) is written as format 2.
INLINE_FORMAT_VERSION = 2
#: Formats this runtime reads: 1 (the built-in DLRM only, before schemas), 2 (tables in
#: the file) and 3 (tables in a tables folder beside it).
READ_VERSIONS = (1, 2, 3)
#: Rows per chunk when :func:`write_tables` streams an in-memory table to disk.
WRITE_CHUNK_ROWS = 1 << 16


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
class DLRMDense:
    """TorchRec ``DLRM``'s layers after pooling, as fp32 (weight (out, in), bias (out,))
    Linear layers: every layer of ``dense_arch`` and all but the last of ``over_arch`` are
    followed by ReLU, and the interaction is the upper triangle (offset 1) of the
    (F+1) x (F+1) dot products of [dense_embedding, sparse_embeddings...]
    (:class:`serve.runtime.dense.DenseDLRM`). Needs one dim D for every feature."""

    dense_arch: list[tuple[torch.Tensor, torch.Tensor]]
    over_arch: list[tuple[torch.Tensor, torch.Tensor]]

    kind = "dlrm"


@dataclass
class ExportedDense:
    """Any model's layers after pooling, as a ``torch.export`` program (serialized bytes,
    uint8 (n,)): ``forward(dense (B, N) float32, pooled (B, sum_f D_f) float32) -> logits
    (B,)``, where ``pooled`` holds each feature's pooled embedding in schema order. It
    loads and runs with ``torch`` alone (no TorchRec), for any batch size B."""

    program: torch.Tensor
    #: hex sha256 of ``program``'s bytes: computed when empty (a fresh export), else
    #: checked (what an artifact recorded at import; a mismatch is an ArtifactError).
    sha256: str = ""

    kind = "export"

    def __post_init__(self) -> None:
        got = program_sha256(self.program)
        if not self.sha256:
            self.sha256 = got
        elif self.sha256 != got:
            raise ArtifactError(
                f"the exported program's sha256 is {got}, the artifact recorded "
                f"{self.sha256} at import: the program was changed after the import; "
                "re-import the model with `python -m serve.model.importer`")


DenseSpec = DLRMDense | ExportedDense


@dataclass
class Artifact:
    """Everything the runtime needs to serve one model.

    Attributes:
        schema: the request schema and the tables' layout (:class:`serve.schema.ModelSchema`).
        tables: the quantized rows of each table, in ``schema.tables`` order.
        dense: the model after pooling (:class:`DLRMDense` or :class:`ExportedDense`).
        meta: free-form build information (version, profile, ...).
        id_maps: table name -> :class:`serve.runtime.idmap.IdMap`, for exactly the tables
            whose schema mapping is "managed".
        files: where the tables live on disk (:class:`serve.store.tablefiles.TableFiles`;
            ``tables[i].data`` is then mapped from ``files.array(i)``, not in memory); None
            when the tables are in memory (a fresh build, format 1 or 2 artifacts).
    """

    schema: ModelSchema
    tables: list[QuantTable]
    dense: DenseSpec
    meta: dict[str, Any] = field(default_factory=dict)
    id_maps: dict[str, IdMap] = field(default_factory=dict)
    files: TableFiles | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        specs = self.schema.tables
        if len(specs) != len(self.tables):
            raise ArtifactError(f"the schema has {len(specs)} tables, the artifact "
                                f"{len(self.tables)}; they must match one to one")
        for spec, t in zip(specs, self.tables, strict=True):
            if (spec.name, spec.rows, spec.dim, spec.dtype) != (t.name, t.rows, t.dim, t.dtype):
                raise ArtifactError(
                    f"table {t.name} ({t.rows} x {t.dim} {t.dtype}) does not match the "
                    f"schema's {spec.name} ({spec.rows} x {spec.dim} {spec.dtype})")
        managed = {t.name for t in specs if t.mapping == "managed"}
        if set(self.id_maps) != managed:
            raise ArtifactError(f"id maps for tables {sorted(self.id_maps)}, but the managed "
                                f"tables are {sorted(managed)}; every managed table needs "
                                "its map and no other table has one")
        for spec in specs:
            m = self.id_maps.get(spec.name)
            if m is not None and (m.table_rows, m.fallback_rows) != (spec.rows,
                                                                     spec.fallback_rows):
                raise ArtifactError(f"table {spec.name}: its id map is for {m.table_rows} "
                                    f"rows ({m.fallback_rows} fallback), the table has "
                                    f"{spec.rows} ({spec.fallback_rows} fallback)")
        if isinstance(self.dense, DLRMDense):
            dims = {t.dim for t in self.tables}
            if len(dims) != 1:
                raise ArtifactError(f"a DLRM dense part needs one embedding dim, the tables "
                                    f"have {sorted(dims)}")

    @classmethod
    def dlrm(cls, feature_names: list[str], num_dense: int, dtype: str,
             tables: list[QuantTable], dense_arch: list[tuple[torch.Tensor, torch.Tensor]],
             over_arch: list[tuple[torch.Tensor, torch.Tensor]],
             meta: dict[str, Any] | None = None, max_ids: int = DEFAULT_MAX_IDS,
             id_maps: dict[str, IdMap] | None = None) -> Artifact:
        """Our built-in DLRM: table ``i`` is read by feature ``feature_names[i]`` alone,
        sum-pooled; the tables named in ``id_maps`` are managed, the others modulo."""
        if len(feature_names) != len(tables):
            raise ArtifactError(f"{len(feature_names)} features for {len(tables)} tables; "
                                "the built-in DLRM has one table per feature")
        maps = dict(id_maps or {})
        schema = ModelSchema(
            num_dense,
            tuple(TableSpec(t.name, t.rows, t.dim, "sum", t.dtype,
                            "managed" if t.name in maps else "modulo",
                            maps[t.name].fallback_rows if t.name in maps else 1)
                  for t in tables),
            tuple(FeatureSpec(f, t.name, max_ids)
                  for f, t in zip(feature_names, tables, strict=True)))
        del dtype  # every table states its own
        return cls(schema, tables, DLRMDense(dense_arch, over_arch), dict(meta or {}), maps)

    # -- views ---------------------------------------------------------------------------
    @property
    def feature_names(self) -> list[str]:
        return list(self.schema.feature_names)

    @property
    def num_dense(self) -> int:
        return self.schema.dense

    @property
    def dtype(self) -> str:
        """The tables' dtype, or "mixed"."""
        dtypes = {t.dtype for t in self.tables}
        return dtypes.pop() if len(dtypes) == 1 else "mixed"

    @property
    def embedding_dim(self) -> int:
        """The tables' dim, or 0 when they differ."""
        dims = {t.dim for t in self.tables}
        return dims.pop() if len(dims) == 1 else 0

    @property
    def table_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables)

    def table_feature(self, table: int) -> str:
        """The first feature (request order) that reads table ``table``: the name deltas
        carry for it (our built-in DLRM: the table's one feature)."""
        name = self.schema.tables[table].name
        return next(f.name for f in self.schema.features if f.table == name)


def tables_from_files(files: TableFiles) -> list[QuantTable]:
    """The tables of a tables folder as :class:`QuantTable` s whose data is mapped from the
    files (copy-on-write: no byte is read until a row is)."""
    out = []
    for i, t in enumerate(files.tables):
        arr = files.array(i)
        out.append(QuantTable(t.name, t.rows, t.dim, t.dtype, torch.from_numpy(arr)))
    return out


def write_tables(art: Artifact, folder: str | os.PathLike[str]) -> Artifact:
    """Write ``art``'s tables into a new tables folder (``<model>-<version>.tables``, see
    :mod:`serve.store.tablefiles`), :data:`WRITE_CHUNK_ROWS` rows at a time, and return
    the same artifact over the written files (``files`` set, tables mapped from them):
    what :func:`save_artifact` then writes as format 3.

    Raises:
        ConfigError: the folder exists.
    """
    with TableWriter(folder, art.schema.tables) as w:
        for i, t in enumerate(art.tables):
            for start in range(0, t.rows, WRITE_CHUNK_ROWS):
                w.write(i, start, t.data[start : start + WRITE_CHUNK_ROWS])
        w.commit()
    files = TableFiles.open(folder)
    return Artifact(art.schema, tables_from_files(files), art.dense, dict(art.meta),
                    dict(art.id_maps), files)


def save_artifact(art: Artifact, path: str | os.PathLike[str]) -> None:
    """Write the artifact atomically (tmp file + rename: a reader never sees half a file):
    format 3 (a reference to ``art.files``, no table bytes) when its tables are on disk,
    else format 2 (the tables in the file)."""
    if isinstance(art.dense, DLRMDense):
        dense: dict[str, Any] = {"kind": "dlrm", "dense_arch": art.dense.dense_arch,
                                 "over_arch": art.dense.over_arch}
    else:
        dense = {"kind": "export", "program": art.dense.program,
                 "program_sha256": art.dense.sha256}
    tables: Any
    if art.files is not None:
        tables = {"ref": art.files.folder.name, "identity": art.files.manifest.identity()}
    else:
        tables = [{"name": t.name, "data": t.data} for t in art.tables]
    blob = {
        "format_version": FORMAT_VERSION if art.files is not None else INLINE_FORMAT_VERSION,
        "schema": art.schema.to_dict(),
        "tables": tables,
        "dense": dense, "meta": art.meta,
    }
    if art.id_maps:
        blob["id_maps"] = {name: m.to_dict() for name, m in art.id_maps.items()}
    tmp = f"{os.fspath(path)}.tmp"
    torch.save(blob, tmp)
    os.replace(tmp, path)


def _from_v1(blob: dict[str, Any]) -> Artifact:
    """Format 1: one table per feature (``feature`` key), one dim and dtype, DLRM layers."""
    tables = [QuantTable(t["name"], int(t["rows"]), int(t["dim"]), str(t["dtype"]), t["data"])
              for t in blob["tables"]]
    return Artifact.dlrm([str(t["feature"]) for t in blob["tables"]], int(blob["num_dense"]),
                         str(blob["dtype"]), tables, [tuple(x) for x in blob["dense_arch"]],
                         [tuple(x) for x in blob["over_arch"]], dict(blob["meta"]))


def _open_tables(ref: dict[str, Any], schema: ModelSchema, search: list[Path],
                 path: str) -> TableFiles:
    """The tables folder ``ref["ref"]`` in the first folder of ``search`` that holds it,
    checked against the artifact: same identity (the build the archive was made with)
    and the schema's tables, in order."""
    name = str(ref["ref"])
    if "/" in name or name.startswith(".") or not name.endswith(TABLES_SUFFIX):
        raise ArtifactError(f"artifact {path}: tables reference {name!r} must be a plain "
                            f"folder name ending in {TABLES_SUFFIX}")
    found = next((d / name for d in search if (d / name).is_dir()), None)
    if found is None:
        raise ArtifactError(
            f"artifact {path}: its tables folder {name} is in none of "
            f"{[os.fspath(d) for d in search]}; the workers find tables in the model "
            f"repository folders named by {TABLES_PATH_ENV} (the launcher and the "
            "Deployment set it): set it, or copy the version with its .tables folder")
    files = TableFiles.open(found)
    try:
        if files.manifest.identity() != ref["identity"]:
            raise ArtifactError(
                f"artifact {path}: tables folder {found} holds another build (identity "
                f"{files.manifest.identity()}, the archive was made with {ref['identity']}); "
                "the version's files are mixed up: rebuild or re-import it")
        got = [(t.name, t.rows, t.dim, t.dtype) for t in files.tables]
        want = [(t.name, t.rows, t.dim, t.dtype) for t in schema.tables]
        if got != want:
            raise ArtifactError(f"artifact {path}: tables folder {found} holds {got}, the "
                                f"schema says {want}")
    except BaseException:
        files.close()
        raise
    return files


def _from_v2(blob: dict[str, Any], search: list[Path] | None = None,
             path: str = "") -> Artifact:
    schema = ModelSchema.from_dict(blob["schema"])
    files: TableFiles | None = None
    if blob["format_version"] == FORMAT_VERSION:
        files = _open_tables(blob["tables"], schema, search or [], path)
        tables = tables_from_files(files)
    else:
        data = {t["name"]: t["data"] for t in blob["tables"]}
        tables = [QuantTable(s.name, s.rows, s.dim, s.dtype, data[s.name])
                  for s in schema.tables]
    d = blob["dense"]
    dense: DenseSpec
    if d["kind"] == "dlrm":
        dense = DLRMDense([tuple(x) for x in d["dense_arch"]], [tuple(x) for x in d["over_arch"]])
    elif d["kind"] == "export":
        try:   # artifacts written before the digest have none: computed, nothing to check
            dense = ExportedDense(d["program"], str(d.get("program_sha256", "")))
        except ArtifactError as e:
            raise ArtifactError(f"artifact {path}: {e.message}") from None
    else:
        raise ArtifactError(f"dense kind {d['kind']!r} is not 'dlrm' or 'export'")
    specs = {s.name: s for s in schema.tables}
    id_maps = {name: IdMap.from_arrays(m["ids"], m["rows"],
                                       specs[name].rows if name in specs else 0,
                                       specs[name].fallback_rows if name in specs else 1)
               for name, m in blob.get("id_maps", {}).items()}
    return Artifact(schema, tables, dense, dict(blob["meta"]), id_maps, files)


def tables_search_path(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The folders named by :data:`TABLES_PATH_ENV` (``os.pathsep``-separated), in order."""
    env = os.environ if environ is None else environ
    return [Path(p) for p in env.get(TABLES_PATH_ENV, "").split(os.pathsep) if p]


def load_artifact(path: str | os.PathLike[str], mmap: bool = True,
                  tables_path: Sequence[str | os.PathLike[str]] | None = None) -> Artifact:
    """Read an artifact of format 1, 2 or 3; ``mmap=True`` maps the tables instead of
    copying them in (format 3 always maps them from its tables folder).

    Args:
        tables_path: where a format-3 artifact's tables folder may be: these folders, then
            the artifact's own folder (default: :func:`tables_search_path`, then the
            artifact's folder).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactError(f"artifact {path} does not exist; build it with `make model`")
    try:
        blob = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as e:
        raise ArtifactError(f"artifact {path} is unreadable ({type(e).__name__}: {e}); "
                            "rebuild it with `make model`") from e
    version = blob.get("format_version") if isinstance(blob, dict) else type(blob).__name__
    if version not in READ_VERSIONS:
        raise ArtifactError(f"artifact {path} has format version {version!r}; this runtime "
                            f"reads versions {list(READ_VERSIONS)}; rebuild it with "
                            "`make model` or re-import it")
    try:
        if version == 1:
            return _from_v1(blob)
        search = [Path(p) for p in (tables_search_path() if tables_path is None
                                    else tables_path)]
        return _from_v2(blob, [*search, Path(path).parent], path)
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"artifact {path} is missing field {e}; rebuild it with `make model`") from e
    except ConfigError as e:
        raise ArtifactError(f"artifact {path}: {e.message}") from e
