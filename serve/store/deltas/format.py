"""Embedding deltas: the file format, its checks, and the pod's delta store.

A delta carries the embedding rows that continued training changed, for ONE base
version, already quantized in the artifact's row format (``serve.runtime.artifact``:
int8 rows are ``[scale fp16][bias fp16][D x uint8]`` padded to 4 bytes), so applying it
is a byte copy and the result equals a full build with the same rows, bit for bit.
Dense weights are never in a delta: they ship as a new version.

File layout (little-endian)::

    b"DLRMDELTA1\\n"                 magic (11 bytes)
    u32                             header length H
    H bytes                         header, UTF-8 JSON (below)
    payload                         per table of the header, in order:
                                        ids  int64 (n,)   sorted, unique, 0 <= id < rows
                                        rows uint8 (n, row_bytes)
                                        assign_ids  int64 (k,)  managed tables only:
                                        assign_rows int64 (k,)  admitted raw id -> row
                                        evict_ids   int64 (e,)  raw ids removed

    header = {"format": 1, "base_version": "small-int8-s0", "sequence": 1,
              "created_at": 1796000000.0,          # unix seconds, when it was built
              "dtype": "int8", "dim": 16, "row_bytes": 20,
              "tables": [{"feature": "C1", "table": 0, "rows": 123,
                          "assigned": 5, "evicted": 2}, ...],   # (both omitted when 0)
              "payload_bytes": 4567,
              "parent_digest": "<hex>",            # what it builds on (below)
              "sha256": "<hex>"}

``sha256`` covers the header without its ``sha256`` key (canonical JSON: sorted keys, no
spaces) followed by the payload, so a changed base version or sequence is caught as
surely as a flipped row byte.

**One chain per version.** A delta names the delta it builds on: ``parent_digest`` is
the sha256 (hex) of the previous sequence's file bytes, or for sequence 1 the version's
identity, :func:`version_digest` (the sha256 of its build report, canonical JSON). A
delta's own *digest* is the sha256 of its file bytes (:func:`file_sha256`; the store
hashes a body while it streams in). :meth:`DeltaStore.commit` takes a delta only when
its parent is the store's head of that version, the digest of its last stored delta (the
version's identity when none): two pods that hold different deltas under one sequence
number refuse each other's next delta (409 ``DeltaConflict``, ``reason``
``parent_mismatch``, naming both digests) instead of drifting further apart.

Why the build report for sequence 1: it is what the pod already reads to check a delta
(its tables), a few KB, written once and read-only (versions are immutable), and it
differs between two builds of one name (``created_at``, ``build_fingerprint``,
``git_commit``...). The .mar or ``artifact.pt`` would identify the bytes served, but
hashing 59 MB (GBs at scale) per check is what the store must not do, and
``build_fingerprint`` alone is missing from imported versions (``make import``).

Deltas written before ``parent_digest`` existed: sequence 1 is still taken (a first
delta can only build on its version; what is lost is the check that it was built on this
very build of it); a later sequence is refused (400 ``header.parent_digest``: rebuild
it with ``make delta``, which writes the field).

**Id changes** (tables with ``mapping="managed"``, :mod:`serve.runtime.idmap`): a
table's entry may also carry the ids training admitted (``assigned``: raw id -> row)
and the ids it evicted (``evicted``), :meth:`serve.runtime.idmap.IdMap.diff` of the two
builds' maps. A worker applies them and the rows in one step between two batches
(:mod:`serve.runtime.follower`), so after the delta the pod serves exactly the rebuilt
artifact: its map and its rows. ``row ids`` (``ids``) stay row numbers of the table; the
rows of newly assigned ids are always among them. A file without the two counts (every
delta of a modulo table) has the layout above without the last three arrays.

The delta store (``DeltaStore``, one folder per pod, shared by the sidecar and the
TorchServe workers)::

    <root>/<version>/00000001.delta      accepted deltas, immutable, in sequence order
    <root>/<version>/workers/<pid>.json  what each worker has applied (WorkerStatus)

The sidecar validates a posted delta completely (format, checksum, base version, the
model's tables, the next sequence number) and only then adds it; workers follow the
folder of their version and apply each delta once, in order, between two batches
(:mod:`serve.runtime.follower`).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import re
import shutil
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serve.common.durable import fsync_dir, replace_durably
from serve.common.validate import ErrorFactory, int_at_least, nonneg_number
from serve.errors import DeltaConflict, InvalidDelta, PayloadTooLarge, ServeError
from serve.schema import ModelSchema

__all__ = [
    "DELTA_MAGIC",
    "DELTA_MEDIA_TYPE",
    "FORMAT",
    "MAX_DELTA_BYTES",
    "MAX_DELTA_STORE_BYTES",
    "Delta",
    "DeltaStore",
    "DeltaTable",
    "Incoming",
    "Stored",
    "TableLayout",
    "WorkerStatus",
    "check_layout",
    "decode_delta",
    "encode_delta",
    "file_sha256",
    "layout_for_report",
    "layout_for_schema",
    "read_delta_file",
    "scan_delta_file",
    "version_digest",
]

DELTA_MAGIC = b"DLRMDELTA1\n"
DELTA_MEDIA_TYPE = "application/x-dlrm-delta"
FORMAT = 1
#: Default largest delta (bytes): the sidecar's ``--max-delta-bytes``
#: (:class:`serve.sidecar.config.SidecarConfig`) and what :func:`decode_delta` accepts when
#: given no limit. A day of small-profile training changed 630,523 of its 840,543 rows
#: (47.9 MB: every row seen that day moves); a day at criteo-kaggle scale touches a smaller
#: share of far larger tables (hundreds of MB). The sidecar streams a delta to the delta
#: folder and validates it in chunks (tests/test_deltas_memory.py, 512 MiB cgroup: a 400 MB
#: delta on a disk-backed folder peaks at 167 MiB RSS). On a memory-backed folder (an
#: emptyDir ``medium: Memory``) the file's pages are charged to the sidecar's cgroup: 300 MB
#: peaked at 408 MiB of the cgroup and 400 MB got the sidecar OOM-killed. 256 MiB keeps one
#: delta inside a 512 MiB sidecar on either folder.
MAX_DELTA_BYTES = 256 << 20
#: The default bound on all the deltas the store holds (``--max-delta-store-bytes``): two
#: of the largest. Stored deltas stay until their version stops being served, charged to
#: the sidecar's container on a memory-backed folder, so its memory limit is sized from
#: this bound (docs/deltas.md, "Memory of the sidecar").
MAX_DELTA_STORE_BYTES = 2 * MAX_DELTA_BYTES
_HEADER_MAX = 1 << 20
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,63}$")
_FILE_RE = re.compile(r"^(\d{8})\.delta$")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_INCOMING = ".incoming."
_CHUNK = 1 << 20


def _no_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class DeltaTable:
    """The changed rows of one table: ``ids`` int64 (n,) sorted unique row numbers,
    ``rows`` uint8 (n, row_bytes) in the artifact's row format; for a managed table also
    its id changes: ``assign_ids`` int64 (k,) sorted unique raw ids and their
    ``assign_rows`` int64 (k,), ``evict_ids`` int64 (e,) sorted unique raw ids."""

    feature: str
    table: int
    ids: np.ndarray
    rows: np.ndarray
    assign_ids: np.ndarray = field(default_factory=_no_ids)
    assign_rows: np.ndarray = field(default_factory=_no_ids)
    evict_ids: np.ndarray = field(default_factory=_no_ids)

    @property
    def id_changes(self) -> int:
        """Ids assigned plus ids evicted."""
        return int(self.assign_ids.shape[0]) + int(self.evict_ids.shape[0])


@dataclass(frozen=True)
class Delta:
    """One decoded delta (see the module docstring for the fields)."""

    base_version: str
    sequence: int
    created_at: float
    dtype: str
    dim: int
    row_bytes: int
    tables: tuple[DeltaTable, ...]
    #: sha256 (hex) of what it builds on: the previous sequence's file, or for sequence 1
    #: :func:`version_digest` of the base version; None in a file written before the
    #: field existed (module docstring).
    parent_digest: str | None = None

    @property
    def rows(self) -> int:
        """Rows changed, over all tables."""
        return sum(int(t.ids.shape[0]) for t in self.tables)

    @property
    def assigned(self) -> int:
        """Ids admitted (assigned a row), over all tables."""
        return sum(int(t.assign_ids.shape[0]) for t in self.tables)

    @property
    def evicted(self) -> int:
        """Ids evicted, over all tables."""
        return sum(int(t.evict_ids.shape[0]) for t in self.tables)

    def summary(self) -> dict[str, Any]:
        return {"base_version": self.base_version, "sequence": self.sequence,
                "created_at": self.created_at, "rows": self.rows,
                "assigned": self.assigned, "evicted": self.evicted,
                "tables": len(self.tables), "dtype": self.dtype,
                "parent_digest": self.parent_digest}


@dataclass(frozen=True)
class TableLayout:
    """What a delta must fit: per table (schema order), the name a delta gives it (its
    first feature: our built-in DLRM's one feature per table) and its rows; the one dtype,
    dim and row bytes of every table ("mixed", 0, 0 when the tables differ); ``formats``:
    each table's (dtype, dim, row bytes). A delta carries tables of one row format, so a
    model of mixed formats takes one delta per format."""

    feature_names: tuple[str, ...]
    table_rows: tuple[int, ...]
    dtype: str
    dim: int
    row_bytes: int
    formats: tuple[tuple[str, int, int], ...] = ()
    #: Each table's id mapping ("modulo" | "managed"); empty = all modulo.
    mappings: tuple[str, ...] = ()
    #: Each table's fallback rows (rows 0..k-1 no id is assigned); empty = 1 each.
    fallback_rows: tuple[int, ...] = ()


def layout_for_schema(schema: ModelSchema) -> TableLayout:
    """The delta layout of a model: a delta row of table t updates it for every feature
    that reads t (a shared table is written once)."""
    from serve.store.rowformat import row_bytes

    first: dict[str, str] = {}
    for f in schema.features:
        first.setdefault(f.table, f.name)
    formats = {(t.dtype, t.dim) for t in schema.tables}
    dtype, dim = formats.pop() if len(formats) == 1 else ("mixed", 0)
    return TableLayout(tuple(first[t.name] for t in schema.tables),
                       tuple(t.rows for t in schema.tables), dtype, dim,
                       row_bytes(dtype, dim) if dim else 0,
                       tuple((t.dtype, t.dim, row_bytes(t.dtype, t.dim)) for t in schema.tables),
                       tuple(t.mapping for t in schema.tables),
                       tuple(t.fallback_rows for t in schema.tables))


def layout_for_report(report: dict[str, Any]) -> TableLayout:
    """The tables of a version from its build report (its schema, or for older builds
    its profile and quantized dtype).

    Raises:
        InvalidDelta: the report gives no schema (an old or foreign build).
    """
    from serve.schema import schema_from_report

    try:
        return layout_for_schema(schema_from_report(report))
    except ServeError as e:
        raise InvalidDelta("base_version", f"version {report.get('version')!r} has no usable "
                                           f"build report ({e}); deltas need one") from e


def version_digest(report: dict[str, Any]) -> str:
    """The identity of a version that its delta 1 names as ``parent_digest``: the sha256
    (hex) of its build report (``model_store/<model>-<version>.json``, the dict
    :meth:`serve.store.repository.ModelRepository.report` returns) as canonical JSON
    (sorted keys, no spaces), so the report file's whitespace does not matter. Why the
    report and not the archive: module docstring."""
    return hashlib.sha256(_canonical(report)).hexdigest()


def _canonical(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _checksum(header: dict[str, Any], payload: bytes | memoryview) -> str:
    h = hashlib.sha256(_canonical({k: v for k, v in header.items() if k != "sha256"}))
    h.update(payload)
    return h.hexdigest()


def encode_delta(delta: Delta) -> bytes:
    """The delta as file bytes (module docstring), checksum included."""
    parts = []
    tables: list[dict[str, Any]] = []
    for t in delta.tables:
        ids = np.ascontiguousarray(t.ids, dtype="<i8")
        rows = np.ascontiguousarray(t.rows, dtype=np.uint8)
        parts += [ids.tobytes(), rows.tobytes()]
        entry = {"feature": t.feature, "table": int(t.table), "rows": int(ids.shape[0])}
        if t.id_changes:
            ai = np.ascontiguousarray(t.assign_ids, dtype="<i8")
            ar = np.ascontiguousarray(t.assign_rows, dtype="<i8")
            ev = np.ascontiguousarray(t.evict_ids, dtype="<i8")
            if ai.shape != ar.shape:
                raise InvalidDelta(f"tables[{len(tables)}].assigned",
                                   f"{ai.shape[0]} assigned ids for {ar.shape[0]} rows")
            parts += [ai.tobytes(), ar.tobytes(), ev.tobytes()]
            if ai.shape[0]:
                entry["assigned"] = int(ai.shape[0])
            if ev.shape[0]:
                entry["evicted"] = int(ev.shape[0])
        tables.append(entry)
    payload = b"".join(parts)
    header: dict[str, Any] = {
        "format": FORMAT, "base_version": delta.base_version, "sequence": int(delta.sequence),
        "created_at": float(delta.created_at), "dtype": delta.dtype, "dim": int(delta.dim),
        "row_bytes": int(delta.row_bytes), "tables": tables, "payload_bytes": len(payload)}
    if delta.parent_digest is not None:
        header["parent_digest"] = delta.parent_digest
    header["sha256"] = _checksum(header, payload)
    head = _canonical(header)
    return DELTA_MAGIC + struct.pack("<I", len(head)) + head + payload


def _in_header(key: str) -> ErrorFactory:
    """The error for a bad ``header.<key>``: an :class:`InvalidDelta` naming that field."""
    return lambda message: InvalidDelta(f"header.{key}", message)


def _int_field(header: dict[str, Any], key: str, lo: int) -> int:
    return int_at_least(key, header.get(key), lo, error=_in_header(key))


def _read_header(view: memoryview, total: int) -> tuple[dict[str, Any], int]:
    """The header of a delta of ``total`` bytes whose first bytes are ``view``, and the
    offset of its payload."""
    if bytes(view[:len(DELTA_MAGIC)]) != DELTA_MAGIC:
        raise InvalidDelta("magic", f"the body must start with {DELTA_MAGIC!r} (a file "
                                    "written by `make delta`); got "
                                    f"{bytes(view[:len(DELTA_MAGIC)])!r}")
    off = len(DELTA_MAGIC)
    if total < off + 4:
        raise InvalidDelta("header", "the body ends before the header length")
    (hlen,) = struct.unpack("<I", view[off:off + 4])
    off += 4
    if hlen > _HEADER_MAX or total < off + hlen:
        raise InvalidDelta("header", f"header length {hlen} exceeds the body or "
                                     f"{_HEADER_MAX} bytes")
    try:
        header = json.loads(bytes(view[off:off + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidDelta("header", f"is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise InvalidDelta("header", "must be a JSON object")
    if header.get("format") != FORMAT:
        raise InvalidDelta("header.format", f"{header.get('format')!r} is not {FORMAT}, the "
                                            "only format this service reads")
    want = _int_field(header, "payload_bytes", 0)
    if total - off - hlen != want:
        raise InvalidDelta("payload", f"{total - off - hlen} bytes after the header, the "
                                      f"header says {want}: the file is truncated or padded")
    return header, off + hlen


def _check_sha(header: dict[str, Any], got: str) -> None:
    sha = header.get("sha256")
    if not isinstance(sha, str) or sha != got:
        raise InvalidDelta("sha256", f"checksum {str(sha)[:16]!r}... does not match the "
                                     "header and rows: the delta was changed or damaged in "
                                     "transit; rebuild or resend it")


def _parent(header: dict[str, Any]) -> str | None:
    """``parent_digest``: 64 lowercase hex digits, or None when the header has none."""
    parent = header.get("parent_digest")
    if parent is not None and not (isinstance(parent, str) and _DIGEST_RE.fullmatch(parent)):
        raise InvalidDelta("header.parent_digest", f"{str(parent)[:80]!r} is not a sha256 "
                                                   "(64 lowercase hex digits); rebuild the "
                                                   "delta with `make delta`")
    return parent


def _fields(header: dict[str, Any]) -> tuple[str, int, float, str, int, int, list[Any]]:
    """base version, sequence, created_at, dtype, dim, row bytes, the raw tables."""
    base = header.get("base_version")
    if not isinstance(base, str) or not _VERSION_RE.fullmatch(base):
        raise InvalidDelta("header.base_version", f"{base!r} is not a version name")
    seq = _int_field(header, "sequence", 1)
    created = nonneg_number("created_at", header.get("created_at"), then=" (unix seconds)",
                            error=_in_header("created_at"))
    dtype = header.get("dtype")
    if not isinstance(dtype, str):
        raise InvalidDelta("header.dtype", f"{dtype!r} must be a string")
    dim = _int_field(header, "dim", 1)
    rb = _int_field(header, "row_bytes", 1)
    raw_tables = header.get("tables")
    if not isinstance(raw_tables, list):
        raise InvalidDelta("header.tables", "must be a list")
    return base, seq, float(created), dtype, dim, rb, raw_tables


@dataclass(frozen=True)
class _Span:
    """Where one table's arrays are in the payload: ``n`` rows at ``pos``, then ``k``
    assigned (id, row) pairs and ``e`` evicted ids."""

    feature: str
    table: int
    n: int
    k: int
    e: int
    pos: int

    def arrays(self, rb: int) -> tuple[int, int, int, int]:
        """Offsets of rows, assign_ids, assign_rows, evict_ids."""
        rows = self.pos + 8 * self.n
        ai = rows + rb * self.n
        return rows, ai, ai + 8 * self.k, ai + 16 * self.k

    def size(self, rb: int) -> int:
        return self.n * (8 + rb) + 16 * self.k + 8 * self.e


def _table_spans(raw_tables: list[Any], rb: int, payload: int) -> list[_Span]:
    """Each table's arrays, checked to tile the payload exactly."""
    out, pos = [], 0
    for i, t in enumerate(raw_tables):
        if not isinstance(t, dict) or not isinstance(t.get("feature"), str):
            raise InvalidDelta(f"header.tables[{i}]", "must be an object with feature, "
                                                      "table, rows")
        n = _int_field(t, "rows", 0)
        idx = _int_field(t, "table", 0)
        k = int_at_least("assigned", t.get("assigned", 0), 0,
                         error=_in_header(f"tables[{i}].assigned"))
        e = int_at_least("evicted", t.get("evicted", 0), 0,
                         error=_in_header(f"tables[{i}].evicted"))
        span = _Span(t["feature"], idx, n, k, e, pos)
        if pos + span.size(rb) > payload:
            raise InvalidDelta(f"header.tables[{i}].rows", f"{n} rows, {k} assigned and {e} "
                                                           "evicted ids do not fit the payload")
        out.append(span)
        pos += span.size(rb)
    if pos != payload:
        raise InvalidDelta("payload", f"{payload - pos} bytes left after the last table")
    return out


def _ids_from(buf: Any, count: int, offset: int) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i8", count=count, offset=offset).astype(np.int64)


def _over_limit(size: int, max_bytes: int | None) -> None:
    limit = MAX_DELTA_BYTES if max_bytes is None else max_bytes
    if size > limit:
        raise InvalidDelta("body", f"{size} bytes is over the {limit}-byte limit")


def decode_delta(blob: bytes | bytearray | memoryview | mmap.mmap,
                 max_bytes: int | None = None) -> Delta:
    """Parse and verify a delta file's bytes (format, sizes, checksum; not the model).
    ``blob`` may be an mmap of the file (:func:`read_delta_file`): the rows stay views of
    it, nothing is copied but the ids. ``max_bytes``: default :data:`MAX_DELTA_BYTES`.

    Raises:
        InvalidDelta: naming the field at fault and the rule it breaks.
    """
    view = memoryview(blob)
    _over_limit(len(view), max_bytes)
    header, off = _read_header(view, len(view))
    payload = view[off:]
    _check_sha(header, _checksum(header, payload))
    base, seq, created, dtype, dim, rb, raw_tables = _fields(header)
    tables = []
    for sp in _table_spans(raw_tables, rb, len(payload)):
        at_rows, at_ai, at_ar, at_ev = sp.arrays(rb)
        ids = _ids_from(payload, sp.n, sp.pos)
        rows = np.frombuffer(payload, dtype=np.uint8, count=sp.n * rb,
                             offset=at_rows).reshape(sp.n, rb)
        tables.append(DeltaTable(sp.feature, sp.table, ids, rows,
                                 _ids_from(payload, sp.k, at_ai), _ids_from(payload, sp.k, at_ar),
                                 _ids_from(payload, sp.e, at_ev)))
    return Delta(base, seq, created, dtype, dim, rb, tuple(tables), _parent(header))


def scan_delta_file(path: str | os.PathLike[str], max_bytes: int | None = None) -> Delta:
    """Every check of :func:`decode_delta` on a file, reading it in 1 MiB chunks and
    loading only the ids: what the sidecar validates a large delta with, in far less
    memory than the delta (no mapping either: mapped pages count in the RSS and in the
    working set kubelet evicts on). The returned tables' ``rows`` are NOT the file's
    (a zero-filled read-only view of the right shape): apply a delta from
    :func:`read_delta_file`.

    Raises:
        InvalidDelta: as :func:`decode_delta`.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        _over_limit(total, max_bytes)
        head = f.read(len(DELTA_MAGIC) + 4 + _HEADER_MAX)
        header, off = _read_header(memoryview(head), total)
        h = hashlib.sha256(_canonical({k: v for k, v in header.items() if k != "sha256"}))
        f.seek(off)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        _check_sha(header, h.hexdigest())
        base, seq, created, dtype, dim, rb, raw_tables = _fields(header)
        tables = []
        for sp in _table_spans(raw_tables, rb, total - off):
            _, at_ai, _, _ = sp.arrays(rb)
            f.seek(off + sp.pos)
            ids = np.frombuffer(f.read(8 * sp.n), dtype="<i8").astype(np.int64)
            rows = np.broadcast_to(np.zeros(rb, dtype=np.uint8), (sp.n, rb))
            f.seek(off + at_ai)
            changes = np.frombuffer(f.read(8 * (2 * sp.k + sp.e)), dtype="<i8").astype(np.int64)
            tables.append(DeltaTable(sp.feature, sp.table, ids, rows, changes[:sp.k],
                                     changes[sp.k:2 * sp.k], changes[2 * sp.k:]))
    return Delta(base, seq, created, dtype, dim, rb, tuple(tables), _parent(header))


def check_layout(delta: Delta, layout: TableLayout) -> None:
    """The delta fits the model: same dtype/dim/row bytes (as each of its tables, when the
    model's tables mix row formats), known features at their table index, each table at
    most once, ids sorted, unique and inside the table.

    Raises:
        InvalidDelta: naming the field and the rule.
    """
    mixed = layout.dtype == "mixed"
    for key in ("dtype", "dim", "row_bytes"):
        if not mixed and getattr(delta, key) != getattr(layout, key):
            raise InvalidDelta(f"header.{key}", f"{getattr(delta, key)!r} does not match the "
                                                f"model's {getattr(layout, key)!r}")
    seen: set[int] = set()
    for i, t in enumerate(delta.tables):
        where = f"tables[{i}]"
        if not 0 <= t.table < len(layout.feature_names) \
                or layout.feature_names[t.table] != t.feature:
            raise InvalidDelta(f"{where}.feature", f"{t.feature!r} at table {t.table} is not "
                                                   "one of the model's features at that index")
        fmt = (delta.dtype, delta.dim, delta.row_bytes)
        if mixed and layout.formats[t.table] != fmt:
            want = layout.formats[t.table]
            raise InvalidDelta("header.dtype", f"{fmt[0]!r}, dim {fmt[1]}, {fmt[2]}-byte rows "
                                               f"do not match table {t.table} ({t.feature}): "
                                               f"{want[0]!r}, dim {want[1]}, {want[2]}-byte "
                                               "rows; this model's tables mix row formats and "
                                               "a delta carries one: send one delta per format")
        if t.table in seen:
            raise InvalidDelta(f"{where}.table", f"table {t.table} appears twice")
        seen.add(t.table)
        ids, rows = t.ids, layout.table_rows[t.table]
        if ids.size and (int(ids[0]) < 0 or int(ids[-1]) >= rows):
            raise InvalidDelta(f"{where}.ids", f"ids must be in [0, {rows}) for {t.feature}; "
                                               f"got {int(ids.min())}..{int(ids.max())}")
        if ids.size > 1 and not bool((np.diff(ids) > 0).all()):
            raise InvalidDelta(f"{where}.ids", "ids must be sorted ascending and unique")
        _check_id_changes(t, where, layout.mappings[t.table] if layout.mappings else "modulo",
                          rows, layout.fallback_rows[t.table] if layout.fallback_rows else 1)


def _check_id_changes(t: DeltaTable, where: str, mapping: str, rows: int,
                      fallback_rows: int = 1) -> None:
    """A table's id changes fit its mapping: none on a modulo table; on a managed one,
    raw ids sorted, unique and >= 0, assigned rows in 1..rows-1 and unique, and every
    assigned row's bytes carried in the same delta. (Whether an evicted id is in the map
    and an assigned row free is the worker's map to check: ``IdMap.apply``.)"""
    if not t.id_changes:
        return
    if mapping != "managed":
        raise InvalidDelta(f"{where}.assigned", f"table {t.table} ({t.feature}) maps ids "
                                                "modulo its rows; only a managed table takes "
                                                "id assignments or evictions")
    for key, arr in (("assigned", t.assign_ids), ("evicted", t.evict_ids)):
        if arr.size and int(arr[0]) < 0:
            raise InvalidDelta(f"{where}.{key}", f"raw id {int(arr[0])} is negative; ids "
                                                 "are integers >= 0")
        if arr.size > 1 and not bool((np.diff(arr) > 0).all()):
            raise InvalidDelta(f"{where}.{key}", "raw ids must be sorted ascending and unique")
    ar = t.assign_rows
    if ar.size:
        if int(ar.min()) < fallback_rows or int(ar.max()) >= rows:
            raise InvalidDelta(f"{where}.assigned", f"rows must be in [{fallback_rows}, {rows}) "
                                                    f"(rows below {fallback_rows} are the "
                                                    f"fallback); got {int(ar.min())}.."
                                                    f"{int(ar.max())}")
        if np.unique(ar).shape[0] != ar.shape[0]:
            raise InvalidDelta(f"{where}.assigned", "two ids are assigned the same row")
        if not bool(np.isin(ar, t.ids).all()):
            raise InvalidDelta(f"{where}.assigned", "every assigned row's bytes must be in "
                                                    "the delta (its ids); rebuild it with "
                                                    "`make delta`")


def read_delta_file(path: str | os.PathLike[str], max_bytes: int | None = None) -> Delta:
    """:func:`decode_delta` of a file through a read-only mmap: its pages are the page
    cache's (reclaimable, or the tmpfs's own), never a second copy in this process.

    Raises:
        InvalidDelta: as :func:`decode_delta` (an empty file: no magic).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return decode_delta(b"", max_bytes)
        limit = MAX_DELTA_BYTES if max_bytes is None else max_bytes
        if size > limit:  # refused before mapping anything
            raise InvalidDelta("body", f"{size} bytes is over the {limit}-byte limit")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # The decoded rows are views of the map: it is unmapped once the Delta is dropped.
    return decode_delta(mapped, max_bytes)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Incoming:
    """A delta body being received into the store's folder (``.incoming.<pid>.<n>``):
    written chunk by chunk and hashed on the way, refused (413) as soon as it passes
    ``max_bytes``. :meth:`DeltaStore.commit` moves it into place; :meth:`discard` drops it.
    Never holds more than one chunk in memory."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.size = 0
        self._sha = hashlib.sha256()
        self._file = open(path, "wb")  # noqa: SIM115 - closed by finish/discard

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk``.

        Raises:
            PayloadTooLarge: the body is now over ``max_bytes`` (nothing kept).
        """
        self.size += len(chunk)
        if self.size > self.max_bytes:
            self.discard()
            raise PayloadTooLarge(
                f"body: {self.size} bytes (so far) is over the {self.max_bytes}-byte limit "
                f"of one delta (--max-delta-bytes); split the rows into several deltas "
                f"(consecutive sequence numbers)")
        self._sha.update(chunk)
        self._file.write(chunk)

    def finish(self) -> None:
        """Flush and fsync the file (its bytes are on the disk before any rename); once."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    @property
    def sha256(self) -> str:
        """The sha256 of every byte written (the content hash re-posts are matched by)."""
        return self._sha.hexdigest()

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Stored:
    """What :meth:`DeltaStore.commit` did: ``path`` the stored file; ``outcome``
    ``"stored"`` (a new sequence), ``"unchanged"`` (the same bytes were stored already:
    kept once) or ``"repaired"`` (the stored file was damaged; replaced)."""

    path: Path
    outcome: str


@dataclass(frozen=True)
class WorkerStatus:
    """What one worker has applied for one version (``workers/<pid>.json``)."""

    pid: int
    version: str
    sequence: int                 # last applied (0: none)
    rows: int                     # rows written by the deltas applied so far
    apply_seconds: float          # wall time of the last apply (waiting for the batch lock excluded)
    applied_at: float             # unix seconds of the last apply
    created_at: float             # the last applied delta's created_at (0: none)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class DeltaStore:
    """The pod's accepted deltas, one folder per version (module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self._open: set[str] = set()           # incoming bodies being received now
        self._damage: dict[Path, tuple[tuple[int, int, int], str | None]] = {}
        self._digests: dict[Path, tuple[tuple[int, int, int], str]] = {}

    def folder(self, version: str) -> Path:
        if not _VERSION_RE.fullmatch(version):
            raise InvalidDelta("base_version", f"{version!r} is not a version name")
        return self.root / version

    def path(self, version: str, sequence: int) -> Path:
        return self.folder(version) / f"{sequence:08d}.delta"

    def sequences(self, version: str) -> list[int]:
        """Accepted sequence numbers of ``version``, ascending."""
        try:
            names = os.listdir(self.folder(version))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _FILE_RE.fullmatch(n)))

    def last_sequence(self, version: str) -> int:
        seqs = self.sequences(version)
        return seqs[-1] if seqs else 0

    def incoming(self, max_bytes: int) -> Incoming:
        """A new :class:`Incoming` body in the store's folder (same filesystem as the
        versions' folders, so the final rename is atomic)."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{_INCOMING}{os.getpid()}.{next(self._counter)}"
        incoming = Incoming(self.root / name, max_bytes)
        with self._lock:
            self._open.add(name)
        return incoming

    def digest(self, version: str, sequence: int) -> str:
        """The sha256 (hex) of stored delta ``sequence`` of ``version``: what delta
        ``sequence + 1`` names as its parent. Cached per (size, mtime, inode): a delta the
        store received is not read again (its hash was taken while it streamed in).

        Raises:
            OSError: the file cannot be read (e.g. not stored).
        """
        path = self.path(version, sequence)
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        cached = self._digests.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        got = file_sha256(path)
        self._digests[path] = (key, got)
        return got

    def head_digest(self, version: str, base_digest: str | None) -> str | None:
        """What the next delta of ``version`` must name as ``parent_digest``: the digest of
        its last stored delta, or ``base_digest`` (:func:`version_digest`) when none."""
        last = self.last_sequence(version)
        return self.digest(version, last) if last else base_digest

    def commit(self, incoming: Incoming, delta: Delta, max_bytes: int | None = None, *,
               base_digest: str | None = None) -> Stored:
        """Move a received, validated delta into place as its version's file (fsync of
        the file and the folder first, so a crash leaves the old or the new state).

        The same bytes again (same sha256) are stored once (``unchanged``); other bytes for
        a stored sequence replace it only when the stored file is damaged (``repaired``:
        truncated, bad checksum). A new (or repairing) delta must name the store's head as
        its parent (module docstring): the digest of the previous sequence's file, or for
        sequence 1 ``base_digest`` (:func:`version_digest` of the base version's report;
        None: not checked, for callers without a report).

        Raises:
            DeltaConflict: its sequence is not ``last + 1``, nor a stored one it repeats
                or repairs; or its ``parent_digest`` is not the head (``reason``
                ``parent_mismatch``, both digests in ``details``). The incoming file is
                dropped; the store is unchanged.
            InvalidDelta: a sequence above 1 that names no parent (an old delta).
        """
        with self._lock:
            self._open.discard(incoming.path.name)
            try:
                return self._commit(incoming, delta, max_bytes, base_digest)
            finally:
                incoming.discard()  # gone after the rename; dropped on a refusal

    def _check_parent(self, delta: Delta, base_digest: str | None,
                      max_bytes: int | None) -> None:
        """``delta.parent_digest`` is what it must build on (:meth:`commit`)."""
        version, seq, got = delta.base_version, delta.sequence, delta.parent_digest
        if got is None:
            if seq == 1:
                return  # an old delta 1: it can only build on its version (module docstring)
            raise InvalidDelta(
                "header.parent_digest", f"missing: delta {seq} of version {version} does not "
                "name the delta it builds on (written before deltas named their parent); "
                "rebuild it with `make delta`, which writes parent_digest")
        if seq == 1:
            if base_digest is None or got == base_digest:
                return
            expected, held = base_digest, (f"this pod's build of version {version} (sha256 "
                                           f"of its build report)")
            todo = (f"the delta was built on another build of {version!r}: build it from "
                    f"the version this pod serves (the same model_store report)")
        else:
            expected = self.digest(version, seq - 1)
            if got == expected:
                return
            held = f"this pod's delta {seq - 1} of version {version}"
            why = self.damage(self.path(version, seq - 1), max_bytes)
            todo = (f"its stored file is damaged ({why}): re-post delta {seq - 1}'s bytes "
                    f"first" if why is not None else
                    "the delta belongs to another chain of deltas: build it on top of the "
                    "deltas this pod holds (GET /embeddings/deltas, head_digest), or "
                    "publish every delta of one chain on the model volume so that every "
                    "pod holds the same ones")
        raise DeltaConflict(
            "header.parent_digest",
            f"delta {seq} of version {version} builds on parent {got}, but {held} is "
            f"{expected}; nothing was changed. {todo[0].upper()}{todo[1:]}",
            reason="parent_mismatch",
            details={"parent_digest": got, "expected_parent_digest": expected})

    def _commit(self, incoming: Incoming, delta: Delta, max_bytes: int | None,
                base_digest: str | None) -> Stored:
        version, seq = delta.base_version, delta.sequence
        last = self.last_sequence(version)
        final = self.path(version, seq)
        outcome = "stored"
        if seq <= last and final.exists():
            if self.digest(version, seq) == incoming.sha256:
                return Stored(final, "unchanged")
            if self.damage(final, max_bytes) is None:
                raise DeltaConflict(
                    "header.sequence",
                    f"{seq} was already applied with other bytes: version {version} is at "
                    f"sequence {last}, so the next delta must be {last + 1}; deltas apply in "
                    f"order, once", reason="sequence")
            outcome = "repaired"
        elif seq != last + 1:
            raise DeltaConflict(
                "header.sequence",
                f"{seq} skips a delta: version {version} is at sequence {last}, so the next "
                f"delta must be {last + 1}; deltas apply in order, once", reason="sequence")
        self._check_parent(delta, base_digest, max_bytes)
        folder = self.folder(version)
        folder.mkdir(parents=True, exist_ok=True)
        incoming.finish()
        replace_durably(incoming.path, final)
        fsync_dir(self.root)  # the version's folder itself, when it was just created
        self._damage.pop(final, None)
        st = final.stat()  # the hash taken while the body streamed in: not read again
        self._digests[final] = ((st.st_size, st.st_mtime_ns, st.st_ino), incoming.sha256)
        return Stored(final, outcome)

    def add(self, blob: bytes, delta: Delta, *, base_digest: str | None = None) -> Path:
        """Store an already validated delta held in memory (tests, tools); the sidecar
        streams with :meth:`incoming` and :meth:`commit`.

        Raises:
            DeltaConflict, InvalidDelta: as :meth:`commit`.
        """
        incoming = self.incoming(max(len(blob), 1))
        incoming.write(blob)
        return self.commit(incoming, delta, base_digest=base_digest).path

    def read(self, version: str, sequence: int) -> Delta:
        return read_delta_file(self.path(version, sequence))

    def damage(self, path: Path, max_bytes: int | None = None) -> str | None:
        """Why the stored delta ``path`` is damaged (truncated, bad checksum, unreadable),
        or None when it reads back whole. Cached per (size, mtime, inode): the checksum of
        a large delta is computed once, not at every GET."""
        try:
            st = path.stat()
        except OSError as e:
            return f"unreadable: {e}"
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        cached = self._damage.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            scan_delta_file(path, max_bytes)
            why = None
        except InvalidDelta as e:
            why = e.message
        except OSError as e:
            why = f"unreadable: {e}"
        self._damage[path] = (key, why)
        return why

    def damaged(self, version: str, max_bytes: int | None = None) -> list[tuple[str, str]]:
        """(file name, reason) of each damaged stored delta of ``version``."""
        out = []
        for seq in self.sequences(version):
            why = self.damage(self.path(version, seq), max_bytes)
            if why is not None:
                out.append((self.path(version, seq).name, why))
        return out

    def remove_version(self, version: str) -> int:
        """Delete ``version``'s folder (its deltas, workers' statuses and shared table);
        the bytes it held."""
        folder = self.folder(version)
        held = sum(_size(p) for p in _files(folder))
        shutil.rmtree(folder, ignore_errors=True)
        with self._lock:
            self._damage = {p: v for p, v in self._damage.items() if folder not in p.parents}
            self._digests = {p: v for p, v in self._digests.items()
                             if folder not in p.parents}
        if self.root.exists():
            fsync_dir(self.root)
        return held

    def drop_stale_incoming(self) -> int:
        """Delete bodies left half-received by a process that died (not the ones being
        received now); how many."""
        try:
            names = [n for n in os.listdir(self.root) if n.startswith(_INCOMING)]
        except FileNotFoundError:
            return 0
        with self._lock:
            stale = [n for n in names if n not in self._open]
        for name in stale:
            (self.root / name).unlink(missing_ok=True)
        return len(stale)

    def held_bytes(self, skip_tables_of: Sequence[str] = ()) -> int:
        """Bytes of every file in the store, less the shared tables (``tables.bin``) of
        ``skip_tables_of`` (versions whose live workers map them: counted in their RSS)."""
        skip = {self.root / v / "tables.bin" for v in skip_tables_of}
        return sum(_size(p) for p in _files(self.root) if p not in skip)

    def delta_bytes(self) -> int:
        """Bytes of the stored deltas (every version's ``*.delta``) and of bodies being
        received: what the sidecar itself has put in the store (the workers' shared
        ``tables.bin`` and status files are theirs)."""
        return sum(_size(p) for p in _files(self.root)
                   if p.suffix == ".delta" or p.name.startswith(_INCOMING))

    def write_worker_status(self, status: WorkerStatus) -> None:
        folder = self.folder(status.version) / "workers"
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"{status.pid}.json"
        tmp = folder / f".{status.pid}.json.tmp"
        tmp.write_text(json.dumps(status.to_json()))
        os.replace(tmp, final)

    def worker_statuses(self, version: str, pids: Sequence[int] | None = None
                        ) -> list[WorkerStatus]:
        """The workers' statuses of ``version`` (only ``pids`` when given: the live ones)."""
        folder = self.folder(version) / "workers"
        out = []
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            return []
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                raw = json.loads((folder / name).read_text())
                st = WorkerStatus(**raw)
            except (OSError, ValueError, TypeError):
                continue  # a half-written or foreign file: skipped, never fatal
            if pids is None or st.pid in pids:
                out.append(st)
        return out

    def versions(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root)
                          if _VERSION_RE.fullmatch(n) and (self.root / n).is_dir())
        except FileNotFoundError:
            return []


def _files(folder: Path) -> Iterator[Path]:
    """Every regular file under ``folder`` (none when it is missing)."""
    for dirpath, _, names in os.walk(folder):
        for name in names:
            p = Path(dirpath) / name
            try:
                if p.is_file():
                    yield p
            except OSError:
                continue


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
