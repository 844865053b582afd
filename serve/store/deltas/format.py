"""The embedding-delta file: its format, its encoder and its two readers.

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
              "sha256": "<hex>",
              "signature": {...}}                  # optional: who built it (below)

``sha256`` covers the header without its ``sha256`` and ``signature`` keys (canonical
JSON: sorted keys, no spaces) followed by the payload, so a changed base version or sequence is caught as
surely as a flipped row byte.

``parent_digest`` names the delta it builds on: the sha256 (hex) of the previous
sequence's file bytes (:func:`file_sha256`), or for sequence 1 the version's identity,
:func:`version_digest` (the sha256 of its build report, canonical JSON). The store
checks it (:mod:`serve.store.deltas.files`: one chain per version). Deltas written
before the field existed have none.

``signature`` (optional) is an ed25519 signature over ``sha256`` and the chain fields
(:mod:`serve.store.deltas.signature`); a pod with ``--delta-verify-key`` takes only
deltas it verifies.

**Id changes** (tables with ``mapping="managed"``, :mod:`serve.runtime.idmap`): a
table's entry may also carry the ids training admitted (``assigned``: raw id -> row)
and the ids it evicted (``evicted``), :meth:`serve.runtime.idmap.IdMap.diff` of the two
builds' maps. A worker applies them and the rows in one step between two batches
(:mod:`serve.runtime.follower`), so after the delta the pod serves exactly the rebuilt
artifact: its map and its rows. ``row ids`` (``ids``) stay row numbers of the table; the
rows of newly assigned ids are always among them. A file without the two counts (every
delta of a modulo table) has the layout above without the last three arrays.

Whether a delta fits a model's tables is :mod:`serve.store.deltas.layout`'s check.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from serve.errors import InvalidDelta
from serve.store.deltas.header import (
    DELTA_MAGIC,
    FORMAT,
    HEADER_MAX,
    canonical_json,
    check_checksum,
    header_checksum,
    header_fields,
    header_parent,
    read_header,
    table_spans,
)

if TYPE_CHECKING:
    from serve.common.signing import SigningKey

__all__ = [
    "CHUNK_BYTES",
    "DELTA_MEDIA_TYPE",
    "MAX_DELTA_BYTES",
    "Delta",
    "DeltaTable",
    "decode_delta",
    "encode_delta",
    "file_sha256",
    "read_delta_file",
    "scan_delta_file",
    "version_digest",
]

DELTA_MEDIA_TYPE = "application/x-dlrm-delta"
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
#: Bytes read at a time from a delta file (checksums, the sidecar's copies).
CHUNK_BYTES = 1 << 20


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


def version_digest(report: dict[str, Any]) -> str:
    """The identity of a version that its delta 1 names as ``parent_digest``: the sha256
    (hex) of its build report (``model_store/<model>-<version>.json``, the dict
    :meth:`serve.store.repository.ModelRepository.report` returns) as canonical JSON
    (sorted keys, no spaces), so the report file's whitespace does not matter. Why the
    report and not the archive: module docstring."""
    return hashlib.sha256(canonical_json(report)).hexdigest()


def encode_delta(delta: Delta, sign_key: SigningKey | None = None) -> bytes:
    """The delta as file bytes (module docstring), checksum included; with ``sign_key``
    also its signature (:mod:`serve.store.deltas.signature`)."""
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
    header["sha256"] = header_checksum(header, [payload])
    if sign_key is not None:
        # lazy: the workers read deltas and never sign, so they never load cryptography
        from serve.store.deltas.signature import sign_header

        header = sign_header(header, sign_key)
    head = canonical_json(header)
    return DELTA_MAGIC + struct.pack("<I", len(head)) + head + payload


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
    header, off = read_header(view, len(view))
    payload = view[off:]
    check_checksum(header, header_checksum(header, [payload]))
    base, seq, created, dtype, dim, rb, raw_tables = header_fields(header)
    tables = []
    for sp in table_spans(raw_tables, rb, len(payload)):
        at_rows, at_ai, at_ar, at_ev = sp.arrays(rb)
        ids = _ids_from(payload, sp.n, sp.pos)
        rows = np.frombuffer(payload, dtype=np.uint8, count=sp.n * rb,
                             offset=at_rows).reshape(sp.n, rb)
        tables.append(DeltaTable(sp.feature, sp.table, ids, rows,
                                 _ids_from(payload, sp.k, at_ai), _ids_from(payload, sp.k, at_ar),
                                 _ids_from(payload, sp.e, at_ev)))
    return Delta(base, seq, created, dtype, dim, rb, tuple(tables), header_parent(header))


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
        head = f.read(len(DELTA_MAGIC) + 4 + HEADER_MAX)
        header, off = read_header(memoryview(head), total)
        f.seek(off)
        check_checksum(header, header_checksum(header, iter(lambda: f.read(CHUNK_BYTES), b"")))
        base, seq, created, dtype, dim, rb, raw_tables = header_fields(header)
        tables = []
        for sp in table_spans(raw_tables, rb, total - off):
            _, at_ai, _, _ = sp.arrays(rb)
            f.seek(off + sp.pos)
            ids = np.frombuffer(f.read(8 * sp.n), dtype="<i8").astype(np.int64)
            rows = np.broadcast_to(np.zeros(rb, dtype=np.uint8), (sp.n, rb))
            f.seek(off + at_ai)
            changes = np.frombuffer(f.read(8 * (2 * sp.k + sp.e)), dtype="<i8").astype(np.int64)
            tables.append(DeltaTable(sp.feature, sp.table, ids, rows, changes[:sp.k],
                                     changes[sp.k:2 * sp.k], changes[2 * sp.k:]))
    return Delta(base, seq, created, dtype, dim, rb, tuple(tables), header_parent(header))


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
        _over_limit(size, max_bytes)  # refused before mapping anything
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # The decoded rows are views of the map: it is unmapped once the Delta is dropped.
    return decode_delta(mapped, max_bytes)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()
