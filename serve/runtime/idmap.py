"""A managed table's id map: raw int64 ids to rows, exact for any id, with a fallback row.

A table with ``mapping="managed"`` (:data:`serve.schema.MAPPINGS`) does not fold ids
into its rows with ``id % rows`` (where an id beyond the table, or one that arrived after
the build, silently shares the row of an unrelated id). Training decides which ids own a
row (admission, :mod:`serve.model.admission`), and the version carries that decision as
an :class:`IdMap`: n admitted raw ids, each with its own row in ``1..rows-1``. Row 0 of
every managed table, :data:`FALLBACK_ROW`, is reserved: every id not in the map (never
seen, not admitted yet, evicted a moment ago, or 2**63 - 1) gets it, and training trains
it on exactly those ids, so it holds the "unknown id" embedding.

Layout: ``ids`` int64 (n,) sorted ascending and unique, ``rows`` int64 (n,) in the same
order. A lookup of k ids is one ``torch.searchsorted`` (O(k log n), no hashing, no
collisions: equality of int64 keys decides) and two gathers, on whatever device the
map's tensors live (the runtime moves them to its own). Why a sorted array rather than
a hash table: it is exact by construction, has no load factor or probe limit, is a
single stock-PyTorch op on CPU and CUDA, and its update (a delta's admissions and
evictions) is one merge of sorted arrays, milliseconds for a million ids.

Changes come as (assign ids -> rows, evict ids) (:meth:`IdMap.apply`; what a delta
carries, :func:`IdMap.diff` computes it from two maps): the evictions first, then the
assignments, each checked (an evicted id must be present, an assigned id absent and its
row free), so a map is always a bijection between its ids and a subset of the rows.

Example::

    m = IdMap.from_arrays([7, 2**63 - 1], [1, 2], table_rows=4)
    m.lookup(torch.tensor([7, 8, 2**63 - 1]))      # tensor([1, 0, 2])
    m2 = m.apply([9], [3], evict_ids=[7])           # 9 -> row 3; 7 -> fallback
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from serve.errors import ConfigError

__all__ = ["FALLBACK_ROW", "IdMap"]

#: The row of a managed table that every id without a row of its own reads.
FALLBACK_ROW = 0

_Ints = torch.Tensor | np.ndarray | Sequence[int]


def _int64(x: _Ints, what: str) -> torch.Tensor:
    """A 1-d int64 CPU tensor of ``x`` (no copy when it already is one)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu")
    else:
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.int64)))
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ConfigError(f"{what} must be a 1-d integer array, got {t.dtype} {tuple(t.shape)}")
    return t.to(torch.int64).contiguous()


@dataclass(frozen=True)
class IdMap:
    """Admitted raw ids of one managed table and their rows.

    Attributes:
        ids: int64 (n,) sorted ascending, unique, >= 0.
        rows: int64 (n,) unique, each in ``fallback_rows..table_rows - 1`` (``rows[i]`` is
            ``ids[i]``'s).
        table_rows: rows of the table, the fallback rows included.
        fallback_rows: k, the rows 0..k-1 that ids outside the map share, by ``id % k``
            (1: one fallback row, :data:`FALLBACK_ROW`).
    """

    ids: torch.Tensor
    rows: torch.Tensor
    table_rows: int
    fallback_rows: int = 1

    # -- construction --------------------------------------------------------------------
    @classmethod
    def empty(cls, table_rows: int, fallback_rows: int = 1) -> IdMap:
        """No id admitted yet: every id reads a fallback row."""
        return cls.from_arrays([], [], table_rows, fallback_rows)

    @classmethod
    def from_arrays(cls, ids: _Ints, rows: _Ints, table_rows: int,
                    fallback_rows: int = 1) -> IdMap:
        """A checked map from unsorted (id, row) pairs.

        Raises:
            ConfigError: ids repeated or negative, rows repeated or outside 1..rows-1, more
                ids than rows, lengths differ.
        """
        if not isinstance(table_rows, int) or table_rows < 2:
            raise ConfigError(f"a managed table needs >= 2 rows (row {FALLBACK_ROW} is the "
                              f"fallback), got {table_rows!r}")
        if not isinstance(fallback_rows, int) or not 1 <= fallback_rows < table_rows:
            raise ConfigError(f"fallback_rows {fallback_rows!r} must be in 1..{table_rows - 1}: "
                              "at least one fallback row, and one row left for an id")
        i, r = _int64(ids, "ids"), _int64(rows, "rows")
        if i.shape != r.shape:
            raise ConfigError(f"ids ({i.numel()}) and rows ({r.numel()}) must pair one to one")
        order = torch.argsort(i)
        i, r = i[order].contiguous(), r[order].contiguous()
        m = cls(i, r, table_rows, fallback_rows)
        m.check()
        return m

    def check(self) -> None:
        """Raise ``ConfigError`` unless this is a valid map (class docstring)."""
        n = self.ids.numel()
        if n > self.capacity:
            raise ConfigError(f"{n} ids for a table of {self.table_rows} rows: at most "
                              f"{self.capacity} (rows 0..{self.fallback_rows - 1} are the "
                              "fallback)")
        if n == 0:
            return
        if int(self.ids[0]) < 0:
            raise ConfigError(f"id {int(self.ids[0])} is negative; ids are integers >= 0")
        if n > 1 and not bool((self.ids[1:] > self.ids[:-1]).all()):
            dup = self.ids[1:][self.ids[1:] == self.ids[:-1]]
            raise ConfigError(f"id {int(dup[0])} appears twice; every id owns one row")
        lo, hi = int(self.rows.min()), int(self.rows.max())
        if lo < self.fallback_rows or hi >= self.table_rows:
            raise ConfigError(f"rows must be in {self.fallback_rows}..{self.table_rows - 1} "
                              f"(rows 0..{self.fallback_rows - 1} are the fallback), got "
                              f"{lo}..{hi}")
        if torch.unique(self.rows).numel() != n:
            raise ConfigError("a row is assigned to two ids; every admitted id owns its row")

    # -- views ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Ids admitted."""
        return int(self.ids.numel())

    @property
    def capacity(self) -> int:
        """Ids the table can admit: every row but the fallback rows."""
        return self.table_rows - self.fallback_rows

    @property
    def occupancy(self) -> float:
        """size / capacity, 0..1."""
        return self.size / self.capacity

    def to(self, device: torch.device | str) -> IdMap:
        return IdMap(self.ids.to(device), self.rows.to(device), self.table_rows,
                     self.fallback_rows)

    def to_numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) as numpy int64 (n,) each, id order."""
        return self.ids.cpu().numpy(), self.rows.cpu().numpy()

    def to_dict(self) -> dict[str, Any]:
        """What an artifact stores: ``{"ids", "rows"}`` CPU tensors (the rows count is the
        schema's)."""
        return {"ids": self.ids.cpu(), "rows": self.rows.cpu()}

    def equal(self, other: IdMap) -> bool:
        """Same ids, same rows, same table (``torch.equal``)."""
        return (self.table_rows == other.table_rows
                and self.fallback_rows == other.fallback_rows
                and torch.equal(self.ids.cpu(), other.ids.cpu())
                and torch.equal(self.rows.cpu(), other.rows.cpu()))

    # -- lookup --------------------------------------------------------------------------
    def lookup(self, values: torch.Tensor) -> torch.Tensor:
        """Rows of ``values``: int64 (k,) raw ids -> int64 (k,) rows, :data:`FALLBACK_ROW`
        for ids not in the map; on the map's device (``values`` are moved there)."""
        rows, _ = self.lookup_with_hits(values)
        return rows

    def lookup_with_hits(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows int64 (k,), found bool (k,)): as :meth:`lookup`, and which ids were in the
        map (the others read the fallback row)."""
        v = values.to(self.ids.device).long()
        fallback = v % self.fallback_rows if self.fallback_rows > 1 else \
            torch.full_like(v, FALLBACK_ROW)
        if self.ids.numel() == 0:
            return fallback, torch.zeros_like(v, dtype=torch.bool)
        pos = torch.searchsorted(self.ids, v).clamp_(max=self.ids.numel() - 1)
        found = self.ids.index_select(0, pos.view(-1)).view_as(v) == v
        rows = torch.where(found, self.rows.index_select(0, pos.view(-1)).view_as(v), fallback)
        return rows, found

    # -- change --------------------------------------------------------------------------
    def apply(self, assign_ids: _Ints, assign_rows: _Ints, evict_ids: _Ints = ()) -> IdMap:
        """A new map: ``evict_ids`` removed, then ``assign_ids[i] -> assign_rows[i]`` added.

        Raises:
            ConfigError: an evicted id is not in the map; an assigned id is still in it
                (evict it first to move it); an assigned row is taken or outside
                1..rows-1; the map overflows.
        """
        ids, rows = self.ids.cpu(), self.rows.cpu()
        ev = _int64(evict_ids, "evict_ids")
        if ev.numel():
            present = torch.isin(ev, ids)
            if not bool(present.all()):
                raise ConfigError(f"evicted id {int(ev[~present][0])} is not in the map; a "
                                  "delta evicts only ids its base version admitted")
            keep = ~torch.isin(ids, ev)
            ids, rows = ids[keep], rows[keep]
        ai, ar = _int64(assign_ids, "assign_ids"), _int64(assign_rows, "assign_rows")
        if ai.shape != ar.shape:
            raise ConfigError(f"assign_ids ({ai.numel()}) and assign_rows ({ar.numel()}) "
                              "must pair one to one")
        if ai.numel():
            again = torch.isin(ai, ids)
            if bool(again.any()):
                raise ConfigError(f"assigned id {int(ai[again][0])} already owns a row; "
                                  "evict it in the same change to move it")
            taken = torch.isin(ar, rows)
            if bool(taken.any()):
                raise ConfigError(f"assigned row {int(ar[taken][0])} belongs to another id; "
                                  "evict that id in the same change first")
        out = IdMap.from_arrays(torch.cat((ids, ai)), torch.cat((rows, ar)), self.table_rows,
                                self.fallback_rows)
        return out.to(self.ids.device)

    @staticmethod
    def diff(old: IdMap, new: IdMap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(assign_ids, assign_rows, evict_ids)``, numpy int64, sorted by id, such that
        ``old.apply(assign_ids, assign_rows, evict_ids)`` equals ``new``. An id whose row
        changed is evicted and assigned again."""
        if (old.table_rows, old.fallback_rows) != (new.table_rows, new.fallback_rows):
            raise ConfigError(f"maps of tables of {old.table_rows} and {new.table_rows} rows "
                              f"({old.fallback_rows} and {new.fallback_rows} fallback rows) "
                              "cannot be diffed: a delta never changes a table's layout")
        oi, orow = old.to_numpy()
        ni, nrow = new.to_numpy()
        common, o_at, n_at = np.intersect1d(oi, ni, assume_unique=True, return_indices=True)
        moved = orow[o_at] != nrow[n_at]
        gone = np.setdiff1d(oi, ni, assume_unique=True)
        evict = np.union1d(gone, common[moved]).astype(np.int64)
        stay = np.ones(ni.shape[0], dtype=bool)
        stay[n_at[~moved]] = False
        return ni[stay].astype(np.int64), nrow[stay].astype(np.int64), evict



class MapIndex:
    """Several managed tables' maps in one int64 region, for one lookup over many features.

    A lookup per feature through :meth:`IdMap.lookup` is about ten small tensor ops; at
    26 features their fixed cost came close to the model's forward. Here a batch costs one
    ``searchsorted`` (and one add) per feature segment, then a single gather, compare and
    select for all of them.

    Layout of the region, int64, fixed by the tables' rows (so it can live in a file every
    worker of the pod maps, :meth:`serve.runtime.shared.SharedTables.open`, and change in
    place when a delta lands)::

        counts  (T,)            ids admitted per table, n_t
        ids     (sum_t rows_t,) table t's slots at offsets[t]: its n_t ids sorted, then -1
        rows    (sum_t rows_t,) the rows of those ids, then FALLBACK_ROW

    A table has ``rows_t`` slots and at most ``rows_t - 1`` ids, so slot ``n_t`` always holds
    the sentinel -1, which no query equals (ids are >= 0): a search past the last id lands
    on it and finds nothing.

    Ids outside a map read ``id % k_t`` (k_t: the table's fallback rows, fixed by its
    schema, so not in the region).

    Args:
        tables: managed table index -> its rows, in region order.
        region: the int64 region (:meth:`size`), already written (a shared file another
            worker filled), or None: a fresh one on ``device`` holding empty maps.
        fallback: managed table index -> its fallback rows k_t (default 1 each).
    """

    def __init__(self, tables: dict[int, int], region: torch.Tensor | None = None,
                 device: torch.device | str = "cpu",
                 fallback: dict[int, int] | None = None) -> None:
        self.tables = dict(tables)
        self.fallback = {t: (fallback or {}).get(t, 1) for t in self.tables}
        self._hashed = any(k > 1 for k in self.fallback.values())
        self.order = {t: i for i, t in enumerate(self.tables)}
        self.offsets: dict[int, int] = {}
        at = 0
        for t, rows in self.tables.items():
            self.offsets[t] = at
            at += rows
        slots, nt = at, len(self.tables)
        if region is None:
            region = torch.empty(self.size(self.tables), dtype=torch.int64, device=device)
            region[:nt] = 0
            region[nt:nt + slots] = -1
            region[nt + slots:] = FALLBACK_ROW
        if region.dtype != torch.int64 or region.numel() != self.size(self.tables):
            raise ConfigError(f"an id map region for tables {self.tables} is int64 "
                              f"({self.size(self.tables)},), got {region.dtype} "
                              f"{tuple(region.shape)}")
        self.region = region
        self.counts = region[:nt]
        self.ids = region[nt:nt + slots]
        self.rows = region[nt + slots:]
        # On CUDA the counts are mirrored on the host (reading them would sync the device
        # every batch); on CPU they are read from the region, which another worker may
        # have changed (a shared file).
        self._host_counts: list[int] | None = (self.counts.tolist()
                                               if region.device.type != "cpu" else None)
        # Per-call costs are dispatcher calls (~5-10 us each on a server CPU), so what
        # does not change between batches is made once: each table's view of its ids
        # (remade when a count changes) and, per feature layout, the offsets.
        self._views: dict[int, torch.Tensor] = {}
        self._views_counts: list[int] | None = None
        self._offs: dict[tuple[int, ...], torch.Tensor] = {}
        self._ks: dict[tuple[int, ...], torch.Tensor] = {}

    @staticmethod
    def size(tables: dict[int, int]) -> int:
        """int64 elements of the region of ``tables`` (table -> rows)."""
        return len(tables) + 2 * sum(tables.values())

    def _counts(self) -> list[int]:
        return self._host_counts if self._host_counts is not None else self.counts.tolist()

    def _sorted(self) -> dict[int, torch.Tensor]:
        """Each table's sorted ids (views of the region), remade when a count changed."""
        counts = self._counts()
        if counts != self._views_counts:
            self._views = {t: self.ids[self.offsets[t]:self.offsets[t] + counts[k]]
                           for t, k in self.order.items()}
            self._views_counts = list(counts)
        return self._views

    def map(self, table: int) -> IdMap:
        """Table ``table``'s map: views of the region (valid until the next write)."""
        n, off = self._counts()[self.order[table]], self.offsets[table]
        return IdMap(self.ids[off:off + n], self.rows[off:off + n], self.tables[table],
                     self.fallback[table])

    def write(self, table: int, m: IdMap) -> None:
        """Make ``m`` table ``table``'s map, in place (the caller holds whatever lock keeps
        lookups out meanwhile)."""
        if (m.table_rows, m.fallback_rows) != (self.tables.get(table), self.fallback.get(table)):
            raise ConfigError(f"table {table} has no id map slots for {m.table_rows} rows "
                              f"with {m.fallback_rows} fallback rows")
        k, off, rows = self.order[table], self.offsets[table], self.tables[table]
        n = m.size
        self.ids[off:off + n] = m.ids.to(self.ids.device)
        self.rows[off:off + n] = m.rows.to(self.rows.device)
        self.ids[off + n:off + rows] = -1
        self.rows[off + n:off + rows] = FALLBACK_ROW
        self.counts[k] = n
        if self._host_counts is not None:
            self._host_counts[k] = n

    def lookup(self, values: torch.Tensor, segments: list[tuple[int, int, int]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``values`` int64 (k,) cut into ``segments`` ``(table, lo, hi)`` (the ids
        ``values[lo:hi]`` are of ``table``; together the segments cover ``values``):
        ``(rows int64 (k,), found bool (k,))`` on ``values``' device, FALLBACK_ROW where
        not found."""
        views = self._sorted()
        pos = torch.empty_like(values)
        ks = torch.ones_like(values) if self._hashed else None
        for t, lo, hi in segments:
            if hi > lo:
                torch.searchsorted(views[t], values[lo:hi], out=pos[lo:hi])
                pos[lo:hi] += self.offsets[t]
                if ks is not None:
                    ks[lo:hi] = self.fallback[t]
        return self._resolve(values, pos, ks)

    def lookup_features(self, values: torch.Tensor, tables: tuple[int, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """One id per (feature, sample): ``values`` int64 (M, B), row i of managed table
        ``tables[i]`` -> ``(rows int64 (M, B), found bool (M, B))``. One ``searchsorted``
        per feature and nothing else per feature (the one-hot path of every batch)."""
        views = self._sorted()
        pos = torch.empty_like(values)
        for t, v, p in zip(tables, values.unbind(0), pos.unbind(0), strict=True):
            torch.searchsorted(views[t], v, out=p)
        offs = self._offs.get(tables)
        if offs is None:
            offs = torch.tensor([self.offsets[t] for t in tables], dtype=torch.int64,
                                device=values.device).unsqueeze(1)
            self._offs[tables] = offs
        pos += offs
        ks = None
        if self._hashed:
            ks = self._ks.get(tables)
            if ks is None:
                ks = torch.tensor([self.fallback[t] for t in tables], dtype=torch.int64,
                                  device=values.device).unsqueeze(1)
                self._ks[tables] = ks
            ks = ks.expand_as(values).reshape(-1)
        rows, found = self._resolve(values.reshape(-1), pos.view(-1), ks)
        return rows.view_as(values), found.view_as(values)

    def _resolve(self, values: torch.Tensor, pos: torch.Tensor, ks: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global slots ``pos`` of ``values`` (both (k,)) -> (rows, found); ids not found
        read row ``value % ks`` (``ks`` None: every table has one fallback row, 0)."""
        found = self.ids.index_select(0, pos) == values
        fallback = (values % ks if ks is not None
                    else torch.zeros((), dtype=torch.int64, device=values.device))
        rows = torch.where(found, self.rows.index_select(0, pos), fallback)
        return rows, found
