"""The header of a delta file: its canonical JSON, its checksum and its checks.

The layout and the fields are :mod:`serve.store.deltas.format`'s docstring; this module
reads the magic, the header and the table spans of a file's first bytes and says which
field is wrong (:class:`~serve.errors.InvalidDelta`). Both readers of
:mod:`~serve.store.deltas.format` (in memory, and in chunks from a file) go through it.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from serve.common.validate import ErrorFactory, int_at_least, nonneg_number
from serve.errors import InvalidDelta
from serve.state import VERSION_RE

__all__ = [
    "DELTA_MAGIC",
    "FORMAT",
    "HEADER_MAX",
    "UNCHECKED_KEYS",
    "TableSpan",
    "canonical_json",
    "check_checksum",
    "header_checksum",
    "header_fields",
    "header_parent",
    "read_header",
    "table_spans",
]

DELTA_MAGIC = b"DLRMDELTA1\n"
FORMAT = 1
#: The largest header (bytes) a reader takes.
HEADER_MAX = 1 << 20
#: Header keys the checksum does not cover: itself, and the signature over it.
UNCHECKED_KEYS = frozenset({"sha256", "signature"})
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def canonical_json(header: dict[str, Any]) -> bytes:
    """``header`` as canonical JSON (sorted keys, no spaces), UTF-8."""
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def header_checksum(header: dict[str, Any],
                    payload: Iterable[bytes | bytearray | memoryview]) -> str:
    """The file's ``sha256`` (hex): the header without its ``sha256`` and ``signature``
    keys as canonical JSON, then the payload's chunks in order. (The signature signs this
    checksum, :mod:`serve.store.deltas.signature`, so it cannot be inside it.)"""
    h = hashlib.sha256(canonical_json({k: v for k, v in header.items()
                                       if k not in UNCHECKED_KEYS}))
    for chunk in payload:
        h.update(chunk)
    return h.hexdigest()


def _in_header(key: str) -> ErrorFactory:
    """The error for a bad ``header.<key>``: an :class:`InvalidDelta` naming that field."""
    return lambda message: InvalidDelta(f"header.{key}", message)


def _int_field(header: dict[str, Any], key: str, lo: int) -> int:
    return int_at_least(key, header.get(key), lo, error=_in_header(key))


def read_header(view: memoryview, total: int) -> tuple[dict[str, Any], int]:
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
    if hlen > HEADER_MAX or total < off + hlen:
        raise InvalidDelta("header", f"header length {hlen} exceeds the body or "
                                     f"{HEADER_MAX} bytes")
    try:
        header = json.loads(bytes(view[off:off + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidDelta("header", f"is not valid UTF-8 JSON ({e})") from e
    except RecursionError:  # stdlib json recurses per nesting level
        raise InvalidDelta("header", "is nested too deeply to parse (a delta's header is "
                                     "a flat JSON object written by `make delta`)") from None
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


def check_checksum(header: dict[str, Any], got: str) -> None:
    """The header's ``sha256`` is ``got`` (:func:`header_checksum` of the file)."""
    sha = header.get("sha256")
    if not isinstance(sha, str) or sha != got:
        raise InvalidDelta("sha256", f"checksum {str(sha)[:16]!r}... does not match the "
                                     "header and rows: the delta was changed or damaged in "
                                     "transit; rebuild or resend it")


def header_parent(header: dict[str, Any]) -> str | None:
    """``parent_digest``: 64 lowercase hex digits, or None when the header has none."""
    parent = header.get("parent_digest")
    if parent is not None and not (isinstance(parent, str) and _DIGEST_RE.fullmatch(parent)):
        raise InvalidDelta("header.parent_digest", f"{str(parent)[:80]!r} is not a sha256 "
                                                   "(64 lowercase hex digits); rebuild the "
                                                   "delta with `make delta`")
    return parent


def header_fields(header: dict[str, Any]) -> tuple[str, int, float, str, int, int, list[Any]]:
    """base version, sequence, created_at, dtype, dim, row bytes, the raw tables."""
    base = header.get("base_version")
    if not isinstance(base, str) or not re.fullmatch(VERSION_RE, base):
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
class TableSpan:
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
        """Bytes of the table's arrays at ``rb`` bytes a row."""
        return self.n * (8 + rb) + 16 * self.k + 8 * self.e


def table_spans(raw_tables: list[Any], rb: int, payload: int) -> list[TableSpan]:
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
        span = TableSpan(t["feature"], idx, n, k, e, pos)
        if pos + span.size(rb) > payload:
            raise InvalidDelta(f"header.tables[{i}].rows", f"{n} rows, {k} assigned and {e} "
                                                           "evicted ids do not fit the payload")
        out.append(span)
        pos += span.size(rb)
    if pos != payload:
        raise InvalidDelta("payload", f"{payload - pos} bytes left after the last table")
    return out
