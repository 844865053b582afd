"""What a delta must fit: a model's tables (:class:`TableLayout`) and the check of a
decoded delta against them (:func:`check_layout`).

The layout comes from a version's schema (its build report's, for the sidecar, which
checks a delta before storing it; the worker's runtime's own, before applying it). A
delta's rows of table t update it for every feature that reads t (a shared table is
written once); a delta carries tables of one row format.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from serve.errors import InvalidDelta, ServeError
from serve.schema import ModelSchema
from serve.store.deltas.format import Delta, DeltaTable

__all__ = ["TableLayout", "check_layout", "layout_for_report", "layout_for_schema"]


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
    from serve.rowformat import row_bytes

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
    from serve.profiles import schema_from_report

    try:
        return layout_for_schema(schema_from_report(report))
    except ServeError as e:
        raise InvalidDelta("base_version", f"version {report.get('version')!r} has no usable "
                                           f"build report ({e}); deltas need one") from e



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

