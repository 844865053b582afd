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

    header = {"format": 1, "base_version": "small-int8-s0", "sequence": 1,
              "created_at": 1796000000.0,          # unix seconds, when it was built
              "dtype": "int8", "dim": 16, "row_bytes": 20,
              "tables": [{"feature": "C1", "table": 0, "rows": 123}, ...],
              "payload_bytes": 4567,
              "sha256": "<hex>"}

``sha256`` covers the header without its ``sha256`` key (canonical JSON: sorted keys, no
spaces) followed by the payload, so a changed base version or sequence is caught as
surely as a flipped row byte.

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
import json
import os
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve.common.validate import ErrorFactory, int_at_least, nonneg_number
from serve.errors import DeltaConflict, InvalidDelta, ServeError
from serve.schema import ModelSchema

__all__ = [
    "DELTA_MAGIC",
    "DELTA_MEDIA_TYPE",
    "FORMAT",
    "MAX_DELTA_BYTES",
    "Delta",
    "DeltaStore",
    "DeltaTable",
    "TableLayout",
    "WorkerStatus",
    "check_layout",
    "decode_delta",
    "encode_delta",
    "layout_for_report",
    "layout_for_schema",
]

DELTA_MAGIC = b"DLRMDELTA1\n"
DELTA_MEDIA_TYPE = "application/x-dlrm-delta"
FORMAT = 1
#: Largest delta body the sidecar reads (bytes). A day of small-profile training changed
#: 630,523 of its 840,543 rows (47.9 MB: every row seen that day moves); a day at
#: criteo-kaggle scale touches a smaller share of far larger tables (hundreds of MB).
MAX_DELTA_BYTES = 1 << 30
_HEADER_MAX = 1 << 20
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,63}$")
_FILE_RE = re.compile(r"^(\d{8})\.delta$")


@dataclass(frozen=True)
class DeltaTable:
    """The changed rows of one table: ``ids`` int64 (n,) sorted unique, ``rows`` uint8
    (n, row_bytes) in the artifact's row format."""

    feature: str
    table: int
    ids: np.ndarray
    rows: np.ndarray


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

    @property
    def rows(self) -> int:
        """Rows changed, over all tables."""
        return sum(int(t.ids.shape[0]) for t in self.tables)

    def summary(self) -> dict[str, Any]:
        return {"base_version": self.base_version, "sequence": self.sequence,
                "created_at": self.created_at, "rows": self.rows,
                "tables": len(self.tables), "dtype": self.dtype}


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
                       tuple((t.dtype, t.dim, row_bytes(t.dtype, t.dim)) for t in schema.tables))


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


def _canonical(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _checksum(header: dict[str, Any], payload: bytes | memoryview) -> str:
    h = hashlib.sha256(_canonical({k: v for k, v in header.items() if k != "sha256"}))
    h.update(payload)
    return h.hexdigest()


def encode_delta(delta: Delta) -> bytes:
    """The delta as file bytes (module docstring), checksum included."""
    parts = []
    tables = []
    for t in delta.tables:
        ids = np.ascontiguousarray(t.ids, dtype="<i8")
        rows = np.ascontiguousarray(t.rows, dtype=np.uint8)
        parts += [ids.tobytes(), rows.tobytes()]
        tables.append({"feature": t.feature, "table": int(t.table), "rows": int(ids.shape[0])})
    payload = b"".join(parts)
    header: dict[str, Any] = {
        "format": FORMAT, "base_version": delta.base_version, "sequence": int(delta.sequence),
        "created_at": float(delta.created_at), "dtype": delta.dtype, "dim": int(delta.dim),
        "row_bytes": int(delta.row_bytes), "tables": tables, "payload_bytes": len(payload)}
    header["sha256"] = _checksum(header, payload)
    head = _canonical(header)
    return DELTA_MAGIC + struct.pack("<I", len(head)) + head + payload


def _in_header(key: str) -> ErrorFactory:
    """The error for a bad ``header.<key>``: an :class:`InvalidDelta` naming that field."""
    return lambda message: InvalidDelta(f"header.{key}", message)


def _int_field(header: dict[str, Any], key: str, lo: int) -> int:
    return int_at_least(key, header.get(key), lo, error=_in_header(key))


def decode_delta(blob: bytes | bytearray | memoryview) -> Delta:
    """Parse and verify a delta file's bytes (format, sizes, checksum; not the model).

    Raises:
        InvalidDelta: naming the field at fault and the rule it breaks.
    """
    view = memoryview(blob)
    if len(view) > MAX_DELTA_BYTES:
        raise InvalidDelta("body", f"{len(view)} bytes is over the {MAX_DELTA_BYTES}-byte limit")
    if bytes(view[:len(DELTA_MAGIC)]) != DELTA_MAGIC:
        raise InvalidDelta("magic", f"the body must start with {DELTA_MAGIC!r} (a file "
                                    "written by `make delta`); got "
                                    f"{bytes(view[:len(DELTA_MAGIC)])!r}")
    off = len(DELTA_MAGIC)
    if len(view) < off + 4:
        raise InvalidDelta("header", "the body ends before the header length")
    (hlen,) = struct.unpack("<I", view[off:off + 4])
    off += 4
    if hlen > _HEADER_MAX or len(view) < off + hlen:
        raise InvalidDelta("header", f"header length {hlen} exceeds the body or "
                                     f"{_HEADER_MAX} bytes")
    try:
        header = json.loads(bytes(view[off:off + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidDelta("header", f"is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise InvalidDelta("header", "must be a JSON object")
    off += hlen
    if header.get("format") != FORMAT:
        raise InvalidDelta("header.format", f"{header.get('format')!r} is not {FORMAT}, the "
                                            "only format this service reads")
    payload = view[off:]
    want = _int_field(header, "payload_bytes", 0)
    if len(payload) != want:
        raise InvalidDelta("payload", f"{len(payload)} bytes after the header, the header "
                                      f"says {want}: the file is truncated or padded")
    sha = header.get("sha256")
    if not isinstance(sha, str) or sha != _checksum(header, payload):
        raise InvalidDelta("sha256", f"checksum {str(sha)[:16]!r}... does not match the "
                                     "header and rows: the delta was changed or damaged in "
                                     "transit; rebuild or resend it")
    base = header.get("base_version")
    if not isinstance(base, str) or not _VERSION_RE.match(base):
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
    tables, pos = [], 0
    for i, t in enumerate(raw_tables):
        if not isinstance(t, dict) or not isinstance(t.get("feature"), str):
            raise InvalidDelta(f"header.tables[{i}]", "must be an object with feature, "
                                                      "table, rows")
        n = _int_field(t, "rows", 0)
        idx = _int_field(t, "table", 0)
        nb = n * (8 + rb)
        if pos + nb > len(payload):
            raise InvalidDelta(f"header.tables[{i}].rows", f"{n} rows do not fit the payload")
        ids = np.frombuffer(payload, dtype="<i8", count=n, offset=pos).astype(np.int64)
        rows = np.frombuffer(payload, dtype=np.uint8, count=n * rb,
                             offset=pos + 8 * n).reshape(n, rb)
        pos += nb
        tables.append(DeltaTable(t["feature"], idx, ids, rows))
    if pos != len(payload):
        raise InvalidDelta("payload", f"{len(payload) - pos} bytes left after the last table")
    return Delta(base, seq, created, dtype, dim, rb, tuple(tables))


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

    def folder(self, version: str) -> Path:
        if not _VERSION_RE.match(version):
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
        return sorted(int(m.group(1)) for n in names if (m := _FILE_RE.match(n)))

    def last_sequence(self, version: str) -> int:
        seqs = self.sequences(version)
        return seqs[-1] if seqs else 0

    def add(self, blob: bytes, delta: Delta) -> Path:
        """Store an already validated delta as the next of its version.

        Raises:
            DeltaConflict: its sequence is not ``last + 1`` (a repeat or a gap).
        """
        with self._lock:
            last = self.last_sequence(delta.base_version)
            if delta.sequence != last + 1:
                what = "was already applied" if delta.sequence <= last else "skips a delta"
                raise DeltaConflict(
                    "header.sequence",
                    f"{delta.sequence} {what}: version {delta.base_version} is at sequence "
                    f"{last}, so the next delta must be {last + 1}; deltas apply in order, once")
            folder = self.folder(delta.base_version)
            folder.mkdir(parents=True, exist_ok=True)
            final = self.path(delta.base_version, delta.sequence)
            tmp = folder / f".{final.name}.{os.getpid()}.tmp"
            tmp.write_bytes(blob)
            os.replace(tmp, final)
            return final

    def read(self, version: str, sequence: int) -> Delta:
        return decode_delta(self.path(version, sequence).read_bytes())

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
                          if _VERSION_RE.match(n) and (self.root / n).is_dir())
        except FileNotFoundError:
            return []
