"""Managed id maps as the sidecar describes them, without asking a worker.

Tables with ``mapping="managed"`` (:mod:`serve.runtime.idmap`): their deltas admit ids
(assign them rows) and evict ids. :class:`IdLedger` counts them once per pod, when a
delta is stored (``dlrm_embedding_ids_admitted_total{feature}``,
``dlrm_embedding_ids_evicted_total{feature}``), and keeps each stored file's per-table
counts. :class:`IdMaps` describes each served version's maps (GET /state
``embeddings.<version>.id_maps``, the gauge
``dlrm_embedding_id_map_occupancy_ratio{version,feature}``)::

    ids = admitted at build (the build report's ``id_mapping.tables.<table>.admitted``)
          + assigned - evicted over the deltas 1..applied_sequence

Why here and not in the workers: the sum is exact (a worker's ``IdMap.apply`` refuses an
eviction of an absent id and an assignment of a present one, so every applied change
moves the count by one), every worker of a version holds the same map after the same
deltas, so a per-worker count would only repeat it; and the sidecar already has both
inputs, the report and the stored deltas (their per-table counts, read once per file and
kept), so a scrape costs no worker time, and the count is per pod, never per worker.
The deltas counted are those every live worker applied (``applied_sequence``; the stored
ones while no worker reports). A report without ``id_mapping`` (a version built before
it, or a test artifact) gives ``ids`` and ``occupancy`` null, never a made-up number.
``fallback_lookups`` is the pod's ``dlrm_embedding_ids_fallback_total`` of the feature
and version, summed over its workers' metric files (null without the workers' metrics
directory). A version without a managed table has ``id_maps: []``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.profiles import schema_from_report
from serve.schema import ModelSchema
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import Delta, scan_delta_file

__all__ = ["IdLedger", "IdMapStatus", "IdMaps", "TableIdCounts"]

#: Per delta file: table index -> (ids assigned, ids evicted), tables with changes only.
TableIdCounts = dict[int, tuple[int, int]]


def _id_counts(delta: Delta) -> TableIdCounts:
    return {t.table: (int(t.assign_ids.shape[0]), int(t.evict_ids.shape[0]))
            for t in delta.tables if t.id_changes}


@dataclass(frozen=True)
class IdMapStatus:
    """One managed feature's id map in one served version (module docstring).

    ``capacity``: ids the table can hold (rows - fallback rows); ``ids``: ids
    holding a row now (build + ``admitted`` - ``evicted``; None when the build report
    does not say how many the build admitted); ``occupancy`` = ids / capacity (0..1);
    ``admitted`` / ``evicted``: ids the applied deltas (1..``sequence``) assigned a row /
    evicted; ``fallback_lookups``: the pod's lookups of the feature that read the
    fallback row (None when unknown).
    """

    feature: str
    table: str
    capacity: int
    ids: int | None
    occupancy: float | None
    admitted: int
    evicted: int
    sequence: int
    fallback_lookups: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"feature": self.feature, "table": self.table, "capacity": self.capacity,
                "ids": self.ids, "occupancy": self.occupancy, "admitted": self.admitted,
                "evicted": self.evicted, "sequence": self.sequence,
                "fallback_lookups": self.fallback_lookups}


class IdLedger:
    """The id changes of the deltas stored in ``store``: the pod's admitted/evicted
    counts per feature, and each stored file's per-table counts (kept from its commit,
    else read once from the file). Thread-safe: one lock over its three maps.

    Args:
        store: the pod's delta store.
        max_bytes: the largest delta file read (the intake's limit).
    """

    def __init__(self, store: DeltaStore, max_bytes: int) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._admitted: dict[str, int] = {}
        self._evicted: dict[str, int] = {}
        # (version, sequence) -> ((size, mtime_ns) of its file, its id counts): read once.
        self._files: dict[tuple[str, int], tuple[tuple[int, int], TableIdCounts]] = {}

    def record(self, delta: Delta, path: Path, *, count: bool) -> None:
        """Keep a stored delta's id counts (no re-read later) and, when ``count`` (a new
        sequence, not a repaired file), add them to the admitted/evicted counters."""
        counts = _id_counts(delta)
        try:
            st = path.stat()
        except OSError:
            return
        with self._lock:
            self._files[(delta.base_version, delta.sequence)] = (
                (st.st_size, st.st_mtime_ns), counts)
            if not count:
                return
            for t in delta.tables:
                if t.assign_ids.shape[0]:
                    self._admitted[t.feature] = (self._admitted.get(t.feature, 0)
                                                 + int(t.assign_ids.shape[0]))
                if t.evict_ids.shape[0]:
                    self._evicted[t.feature] = (self._evicted.get(t.feature, 0)
                                                + int(t.evict_ids.shape[0]))

    @property
    def admitted(self) -> dict[str, int]:
        """Ids admitted by the deltas stored so far, per feature (the delta's name for
        the table)."""
        with self._lock:
            return dict(self._admitted)

    @property
    def evicted(self) -> dict[str, int]:
        """Ids evicted by the deltas stored so far, per feature."""
        with self._lock:
            return dict(self._evicted)

    def stored(self, version: str, sequence: int) -> TableIdCounts:
        """A stored delta's id counts: kept from its commit, else read once from its file
        (ids only, :func:`serve.store.deltas.format.scan_delta_file`) and kept while the
        file is unchanged. Raises OSError / ServeError for a file that cannot be read."""
        path = self.store.path(version, sequence)
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            got = self._files.get((version, sequence))
        if got is not None and got[0] == key:
            return got[1]
        counts = _id_counts(scan_delta_file(path, self.max_bytes))
        with self._lock:
            self._files[(version, sequence)] = (key, counts)
        return counts


class IdMaps:
    """Each served version's managed id maps (module docstring), from its build report
    (read once per version: a version's report never changes) and ``ledger``'s counts.
    Thread-safe: one lock over the reports' cache."""

    def __init__(self, ledger: IdLedger, report_of: Callable[[str], dict[str, Any]]) -> None:
        self.ledger = ledger
        self._report_of = report_of
        self._lock = threading.Lock()
        # version -> its schema and the ids its build admitted per table (None: unknown).
        self._builds: dict[str, tuple[ModelSchema, dict[str, int | None]]] = {}

    def build(self, version: str) -> tuple[ModelSchema, dict[str, int | None]]:
        """``version``'s schema and its build's admitted ids per managed table (from its
        build report, read once)."""
        with self._lock:
            got = self._builds.get(version)
        if got is not None:
            return got
        report = self._report_of(version)
        schema = schema_from_report(report)
        mapping = report.get("id_mapping")
        tables = mapping.get("tables") if isinstance(mapping, dict) else None
        admitted: dict[str, int | None] = {}
        for t in schema.tables:
            if t.mapping != "managed":
                continue
            entry = tables.get(t.name) if isinstance(tables, dict) else None
            n = entry.get("admitted") if isinstance(entry, dict) else None
            admitted[t.name] = int(n) if isinstance(n, int) and not isinstance(n, bool) \
                and n >= 0 else None
        with self._lock:
            self._builds[version] = (schema, admitted)
        return schema, admitted

    def of(self, version: str, through: int,
           fallback: dict[str, int] | None = None) -> tuple[IdMapStatus, ...]:
        """Each managed feature of ``version`` after its build and deltas 1..``through``
        (module docstring); ``fallback``: the pod's fallback lookups of ``version`` per
        feature. Empty for a version without managed tables. Blocking file reads (cached).

        Raises:
            OSError, ServeError: the report or a stored delta cannot be read.
        """
        schema, build = self.build(version)
        if not build:
            return ()
        assigned = dict.fromkeys(build, 0)
        evicted = dict.fromkeys(build, 0)
        for seq in range(1, through + 1):
            for t, (k, e) in self.ledger.stored(version, seq).items():
                name = schema.tables[t].name if 0 <= t < len(schema.tables) else None
                if name in assigned:
                    assigned[name] += k
                    evicted[name] += e
        out = []
        for f, t in zip(schema.features, schema.feature_tables, strict=True):
            spec = schema.tables[t]
            if spec.name not in build:
                continue
            at_build = build[spec.name]
            ids = None if at_build is None else at_build + assigned[spec.name] - evicted[spec.name]
            cap = spec.rows - spec.fallback_rows
            out.append(IdMapStatus(
                feature=f.name, table=spec.name, capacity=cap, ids=ids,
                occupancy=None if ids is None or cap <= 0 else min(1.0, max(0.0, ids / cap)),
                admitted=assigned[spec.name], evicted=evicted[spec.name], sequence=through,
                fallback_lookups=None if fallback is None else int(fallback.get(f.name, 0))))
        return tuple(out)
