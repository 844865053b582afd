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
order. :meth:`IdMap.lookup` of k ids is one ``torch.searchsorted`` (O(k log n), exact:
equality of int64 keys decides) and two gathers. The sorted arrays are the map's record:
exact by construction, no load factor, and a delta's admissions and evictions are one
merge of sorted arrays (milliseconds for a million ids). What the runtime probes per
batch is :class:`MapIndex`, which keeps beside each sorted map a cuckoo hash of the same
ids (two candidate slots per id, keys compared whole): a binary search is ~17 dependent
cache misses per id, the probe two independent ones, at the same exactness.

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

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from serve.errors import ConfigError
from serve.runtime.shared import spread_sample

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

    @functools.cached_property
    def placement(self) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
        """``(multipliers, keys, slot_rows)``: this map's cuckoo hash as :class:`MapIndex`
        stores it (int64 (2**b,) each, b = :func:`slot_bits` of the table's rows; -1 and
        FALLBACK_ROW in empty slots). Computed once per map, so a delta can place its maps
        before it takes the lock that stops batches (:meth:`serve.runtime.follower.
        DeltaFollower.apply`), and the write under it is only copies.

        Raises:
            ConfigError: no multiplier pair of :data:`HASH_ATTEMPTS` places the ids (not
                seen at load <= 0.4).
        """
        ids, row_of = self.to_numpy()
        bits = slot_bits(self.table_rows)
        for attempt in range(HASH_ATTEMPTS):
            mults = multipliers(attempt)
            at = cuckoo_place(ids, bits, mults)
            if at is not None:
                break
        else:
            raise ConfigError(f"{ids.shape[0]} ids found no cuckoo placement in {1 << bits} "
                              f"slots under {HASH_ATTEMPTS} hash multiplier pairs; report "
                              f"this map (it should not happen below load {1 / SLOTS_PER_ROW:.1f})")
        used = at >= 0
        keys = np.full(at.shape[0], -1, dtype=np.int64)
        slot_rows = np.full(at.shape[0], FALLBACK_ROW, dtype=np.int64)
        keys[used], slot_rows[used] = ids[at[used]], row_of[at[used]]
        return mults, keys, slot_rows

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


# -- the hash index of a MapIndex ---------------------------------------------------------
#: Hash slots per table row, before rounding up to a power of two: at most 1/2.5 = 0.4 of
#: a table's slots hold an id (a table admits at most rows - 1), safely below 0.5, where
#: two-choice cuckoo hashing stops finding places for every key.
SLOTS_PER_ROW = 2.5
#: Multiplier pairs tried, in order, until every id of a table has one of its two slots
#: (below load 0.5 the first pair almost always does; each retry is independent).
HASH_ATTEMPTS = 16
_ROUNDS = 2000        # placement rounds per attempt (load <= 0.4 needs tens)
#: Names the region's layout and hash (:class:`MapIndex`, :func:`hash_slots`,
#: :func:`multipliers`). A pod's shared table file is recognised by an identity that
#: includes it (:meth:`MapIndex.identity`), not by its bytes: change it with any change to
#: what a region holds for the same maps, or a file an older build of this code wrote
#: would be read with the new layout (``test_managed_region_layout_is_named_by_its_tag``
#: fails until it is changed).
REGION_LAYOUT = "cuckoo2:1"
#: Ids and rows per map that :meth:`MapIndex.identity` reads (evenly spread).
IDENTITY_IDS = 256
_MIX = 29             # x ^ (x >> 29): high id bits reach the multiplier's low bits
#: How a :class:`MapIndex` probes: ``"auto"`` runs the compiled loop
#: (:func:`compiled_probe`) where the region is in host memory and the tensor ops on
#: CUDA; ``"ops"`` runs the tensor ops everywhere (the reference the tests compare with).
PROBES = ("auto", "ops")


def slot_bits(rows: int) -> int:
    """b: a table of ``rows`` rows has 2**b hash slots (>= SLOTS_PER_ROW * rows)."""
    return max(1, int(np.ceil(np.log2(np.ceil(rows * SLOTS_PER_ROW)))))


def multipliers(attempt: int) -> tuple[int, int]:
    """Attempt ``attempt``'s two odd 64-bit multipliers, as signed int64 values (fixed,
    so every worker and every build computes the same slots)."""
    out = []
    for k in (2 * attempt, 2 * attempt + 1):
        z = (k + 1) * 0x9E3779B97F4A7C15 % 2**64      # splitmix64 of k + 1
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
        z = (z ^ (z >> 31)) | 1
        out.append(z - 2**64 if z >= 2**63 else z)
    return out[0], out[1]


def hash_slots(ids: np.ndarray, bits: int, mult: int) -> np.ndarray:
    """Slots 0..2**bits-1 of int64 ``ids`` (>= 0) under ``mult``: the top ``bits`` bits of
    ``(x ^ x >> 29) * mult`` mod 2**64, made non-negative. :meth:`MapIndex.lookup` computes
    the same with torch int64 ops (wrapping multiply, arithmetic shift)."""
    x = ids ^ (ids >> _MIX)
    h = (x.view(np.uint64) * np.uint64(mult % 2**64)).view(np.int64)
    out: np.ndarray = (h >> (64 - bits)) + (1 << (bits - 1))
    return out


def _slots(mixed: torch.Tensor, mult: torch.Tensor | int, shift: torch.Tensor | int,
           base: torch.Tensor | int) -> torch.Tensor:
    """:func:`hash_slots` in torch, from ``mixed = x ^ (x >> 29)`` (computed once for both
    multipliers), with ``shift = 64 - b`` and ``base`` = the table's first slot in the
    region + 2**(b-1) (the centring :func:`hash_slots` adds); all broadcast."""
    return ((mixed * mult) >> shift) + base


def cuckoo_place(ids: np.ndarray, bits: int, mults: tuple[int, int]) -> np.ndarray | None:
    """Two-choice cuckoo placement of int64 ``ids`` (n,) in 2**bits slots: ``at`` int64
    (2**bits,), the index into ``ids`` of the id in each slot or -1, such that every id
    sits in one of its two slots (:func:`hash_slots` under each multiplier); None when
    :data:`_ROUNDS` rounds did not place them all (try other multipliers).

    Placement runs in rounds, all pending ids at once: each writes itself into its
    current slot (one of several writing the same slot wins, the others retry), and an id
    it pushes out moves to its other slot in the next round."""
    n = ids.shape[0]
    at = np.full(1 << bits, -1, dtype=np.int64)
    if n == 0:
        return at
    slots = np.stack([hash_slots(ids, bits, mults[0]), hash_slots(ids, bits, mults[1])])
    choice = np.zeros(n, dtype=np.int64)
    pending = np.arange(n, dtype=np.int64)
    for _ in range(_ROUNDS):
        if pending.size == 0:
            return at
        s = slots[choice[pending], pending]
        before = at[s]
        at[s] = pending
        lost = at[s] != pending
        pushed = np.unique(before[before >= 0])
        choice[pushed] ^= 1
        pending = np.concatenate((pending[lost], pushed))
    return None


def _probe_loop(values: np.ndarray, los: np.ndarray, his: np.ndarray, pos: np.ndarray,
                shifts: np.ndarray, bases: np.ndarray, ks: np.ndarray, mults: np.ndarray,
                keys: np.ndarray, slot_rows: np.ndarray, rows_out: np.ndarray,
                found_out: np.ndarray) -> None:   # pragma: no cover - runs compiled
    """The probe of :meth:`MapIndex._probe` as one loop over the ids (compiled by
    :func:`compiled_probe`): segment s is ``values[los[s]:his[s]]``, ids of the table at
    region position ``pos[s]`` with ``shifts[s] = 64 - b``, ``bases[s]`` (its first slot +
    2**(b-1)) and ``ks[s]`` fallback rows. Writes ``rows_out``/``found_out`` (same length
    as ``values``). The same int64 arithmetic as :func:`_slots` (wrapping multiply,
    arithmetic shift), so the same slots; the slot index is always inside the table's
    2**b slots (the shifted product lies in [-2**(b-1), 2**(b-1))), whatever the id."""
    for s in range(los.shape[0]):
        m1 = mults[2 * pos[s]]
        m2 = mults[2 * pos[s] + 1]
        sh = shifts[s]
        base = bases[s]
        k = ks[s]
        for i in range(los[s], his[s]):
            v = values[i]
            x = v ^ (v >> _MIX)
            s1 = ((x * m1) >> sh) + base
            if keys[s1] == v:
                rows_out[i] = slot_rows[s1]
                found_out[i] = True
                continue
            s2 = ((x * m2) >> sh) + base
            if keys[s2] == v:
                rows_out[i] = slot_rows[s2]
                found_out[i] = True
            else:
                rows_out[i] = v % k
                found_out[i] = False


@functools.cache
def compiled_probe() -> Any:
    """:func:`_probe_loop` compiled by numba for its one signature (int64 arrays, a bool
    output), once per process, on the first call (~0.4 s), not at import. Why: the tensor
    ops of the probe are ~15 dispatcher calls of 6-8 us each over the batch's ids plus
    three gathers; one loop reads each id once and its slots in place (on ``small``,
    batch 512 x 26 features: ~45 us against ~190 us warm, docs/deltas.md). ``nogil``: a
    worker's other threads run meanwhile."""
    import numba  # heavy (LLVM): imported only once a host-memory MapIndex needs it

    i64 = numba.int64[::1]
    sig = numba.void(*([i64] * 11), numba.boolean[::1])
    return numba.njit(sig, nogil=True, boundscheck=False, cache=False)(_probe_loop)


class MapIndex:
    """Several managed tables' maps in one int64 region, for one lookup over many features.

    A lookup is a hash probe, not a search: each table keeps, beside its sorted map (what
    :meth:`map` returns, what deltas diff and apply), a two-choice cuckoo hash of its ids
    (:func:`cuckoo_place`): every admitted id sits in one of two slots computed from the id
    alone (:func:`hash_slots`), so a batch's ids are resolved over all features at once,
    whatever the table size: in host memory by one compiled loop (:func:`compiled_probe`),
    on CUDA by a fixed dozen of elementwise ops and three gathers (the same arithmetic,
    the same rows). Exact: a slot holds the whole int64 id, and an id is found only
    where a slot's key equals it (empty slots hold -1, and ids are >= 0). A binary search
    (``searchsorted`` per feature, what this replaced) takes about 17 dependent cache
    misses per id on a 100k-id table; the probe takes two independent ones.

    Layout of the region, int64, fixed by the tables' rows (so it can live in a file every
    worker of the pod maps, :meth:`serve.runtime.shared.SharedTables.open`, and change in
    place when a delta lands)::

        counts  (T,)             ids admitted per table, n_t
        mults   (2T,)            table t's two hash multipliers (:func:`multipliers`)
        ids     (sum_t rows_t,)  table t's sorted map at offsets[t]: its n_t ids, then -1
        rows    (sum_t rows_t,)  the rows of those ids, then FALLBACK_ROW
        keys    (sum_t S_t,)     table t's hash slots at slot_offsets[t] (S_t = 2**b_t,
                                 :func:`slot_bits`): the id in each slot, or -1
        slot_rows (sum_t S_t,)   the row of that id (FALLBACK_ROW in empty slots)

    Memory: 16 B per slot, 2.5-5 slots per table row (40-80 B per row) besides the sorted
    map's 16 B: the price of one probe per id at a load of at most 0.4.

    Ids outside a map read ``id % k_t`` (k_t: the table's fallback rows, fixed by its
    schema, so not in the region).

    Args:
        tables: managed table index -> its rows, in region order.
        region: the int64 region (:meth:`size`), already written (a shared file another
            worker filled), or None: a fresh one on ``device`` holding empty maps.
        fallback: managed table index -> its fallback rows k_t (default 1 each).
        probe: one of :data:`PROBES`: the compiled loop in host memory (``"auto"``) or
            the tensor ops (``"ops"``). Both give the same rows, bit for bit.
    """

    def __init__(self, tables: dict[int, int], region: torch.Tensor | None = None,
                 device: torch.device | str = "cpu",
                 fallback: dict[int, int] | None = None, probe: str = "auto") -> None:
        if probe not in PROBES:
            raise ConfigError(f"probe {probe!r} is not one of {PROBES}")
        self.tables = dict(tables)
        self.fallback = {t: (fallback or {}).get(t, 1) for t in self.tables}
        self._hashed = any(k > 1 for k in self.fallback.values())
        self.order = {t: i for i, t in enumerate(self.tables)}
        self.bits = {t: slot_bits(rows) for t, rows in self.tables.items()}
        self.offsets: dict[int, int] = {}
        self.slot_offsets: dict[int, int] = {}
        at = sat = 0
        for t, rows in self.tables.items():
            self.offsets[t], self.slot_offsets[t] = at, sat
            at += rows
            sat += 1 << self.bits[t]
        nt, size = len(self.tables), self.size(self.tables)
        fresh = region is None
        if region is None:
            region = torch.empty(size, dtype=torch.int64, device=device)
        if region.dtype != torch.int64 or region.numel() != size:
            raise ConfigError(f"an id map region for tables {self.tables} is int64 "
                              f"({size},), got {region.dtype} {tuple(region.shape)}")
        self.region = region
        (self.counts, self.mults, self.ids, self.rows, self.keys,
         self.slot_rows) = torch.split(region, [nt, 2 * nt, at, at, sat, sat])
        if fresh:     # empty maps: no ids, every slot empty
            self.counts.zero_()
            self.mults.copy_(torch.tensor(multipliers(0) * nt, dtype=torch.int64))
            self.ids.fill_(-1)
            self.keys.fill_(-1)
            self.rows.fill_(FALLBACK_ROW)
            self.slot_rows.fill_(FALLBACK_ROW)
        # On CUDA the counts are mirrored on the host (reading them would sync the device);
        # on CPU they are read from the region, which another worker may have changed.
        # Lookups never read them: only map() does.
        self._host_counts: list[int] | None = (self.counts.tolist()
                                               if region.device.type != "cpu" else None)
        # Per feature layout, what does not change between batches (each tensor op is a
        # dispatcher call, ~5-10 us on a server CPU): table positions, shifts, bases, ks.
        self._layouts: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        # The compiled loop reads the region through numpy views of the same memory (a
        # delta's write() changes them in place); its per-feature layouts as numpy.
        self._loop: Any = (compiled_probe() if probe == "auto" and self.tables
                           and region.device.type == "cpu" else None)
        self._np = ((self.mults.numpy(), self.keys.numpy(), self.slot_rows.numpy())
                    if self._loop is not None else ())
        self._np_layouts: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}

    @property
    def probe(self) -> str:
        """What runs a lookup: ``"compiled"`` (:func:`compiled_probe`) or ``"ops"``."""
        return "compiled" if self._loop is not None else "ops"

    @staticmethod
    def size(tables: dict[int, int]) -> int:
        """int64 elements of the region of ``tables`` (table -> rows)."""
        return (3 * len(tables) + 2 * sum(tables.values())
                + 2 * sum(1 << slot_bits(r) for r in tables.values()))

    @staticmethod
    def identity(tables: dict[int, int], maps: dict[int, IdMap]) -> str:
        """Names the region that ``maps`` (table -> its map) give ``tables`` (table ->
        rows), without building it: :data:`REGION_LAYOUT`, each table's rows and fallback
        rows, and each map's size and up to :data:`IDENTITY_IDS` evenly spread (id, row)
        pairs (two builds differ in their maps' sizes or ids; the region is a function of
        the maps). Microseconds, where building the region hashes every id."""
        h = hashlib.sha256(f"{REGION_LAYOUT};".encode())
        for t, rows in tables.items():
            m = maps[t]
            h.update(f"{t}:{rows}:{m.fallback_rows}:{m.size};".encode())
            h.update(spread_sample(m.ids.cpu(), IDENTITY_IDS))
            h.update(spread_sample(m.rows.cpu(), IDENTITY_IDS))
        return h.hexdigest()[:32]

    def _counts(self) -> list[int]:
        return self._host_counts if self._host_counts is not None else self.counts.tolist()

    def map(self, table: int) -> IdMap:
        """Table ``table``'s map: views of the region (valid until the next write)."""
        n, off = self._counts()[self.order[table]], self.offsets[table]
        return IdMap(self.ids[off:off + n], self.rows[off:off + n], self.tables[table],
                     self.fallback[table])

    def write(self, table: int, m: IdMap) -> None:
        """Make ``m`` table ``table``'s map, in place: its sorted map and its hash slots
        (:attr:`IdMap.placement`, computed on the host, once per map: here only copies;
        the caller holds whatever lock keeps lookups out meanwhile).

        Raises:
            ConfigError: ``m`` is not of this table's layout, or it has no placement.
        """
        if (m.table_rows, m.fallback_rows) != (self.tables.get(table), self.fallback.get(table)):
            raise ConfigError(f"table {table} has no id map slots for {m.table_rows} rows "
                              f"with {m.fallback_rows} fallback rows")
        k, off, rows = self.order[table], self.offsets[table], self.tables[table]
        bits, soff = self.bits[table], self.slot_offsets[table]
        mults, keys, slot_rows = m.placement
        dev = self.region.device
        n = m.size
        self.ids[off:off + n] = m.ids.to(dev)
        self.rows[off:off + n] = m.rows.to(dev)
        self.ids[off + n:off + rows] = -1
        self.rows[off + n:off + rows] = FALLBACK_ROW
        self.keys[soff:soff + (1 << bits)] = torch.from_numpy(keys).to(dev)
        self.slot_rows[soff:soff + (1 << bits)] = torch.from_numpy(slot_rows).to(dev)
        self.mults[2 * k:2 * k + 2] = torch.tensor(mults, dtype=torch.int64, device=dev)
        self.counts[k] = n
        if self._host_counts is not None:
            self._host_counts[k] = n

    def _layout(self, tables: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """(positions (M,), shifts (M, 1), bases (M, 1), ks (M, 1)) of a feature layout:
        each feature's table position in the region, ``64 - b``, its slots' first index
        plus ``2**(b-1)`` (the arithmetic shift's result is signed), its fallback rows."""
        got = self._layouts.get(tables)
        if got is None:
            dev = self.region.device

            def col(xs: list[int]) -> torch.Tensor:
                return torch.tensor(xs, dtype=torch.int64, device=dev).unsqueeze(1)

            got = (torch.tensor([self.order[t] for t in tables], dtype=torch.int64,
                                device=dev),
                   col([64 - self.bits[t] for t in tables]),
                   col([self.slot_offsets[t] + (1 << (self.bits[t] - 1)) for t in tables]),
                   col([self.fallback[t] for t in tables]))
            self._layouts[tables] = got
        return got

    def lookup(self, values: torch.Tensor, segments: list[tuple[int, int, int]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``values`` int64 (k,) cut into ``segments`` ``(table, lo, hi)`` (the ids
        ``values[lo:hi]`` are of ``table``; together the segments cover ``values``):
        ``(rows int64 (k,), found bool (k,))`` on ``values``' device, FALLBACK_ROW where
        not found."""
        if self._loop is not None:
            segs = [(t, lo, hi) for t, lo, hi in segments if hi > lo]
            return self._run_loop(values, [t for t, _, _ in segs], [lo for _, lo, _ in segs],
                                  [hi for _, _, hi in segs])
        x = values ^ (values >> _MIX)
        s1, s2 = torch.empty_like(values), torch.empty_like(values)
        ks = torch.ones_like(values) if self._hashed else None
        for t, lo, hi in segments:
            if hi <= lo:
                continue
            k, bits = self.order[t], self.bits[t]
            base = self.slot_offsets[t] + (1 << (bits - 1))
            for s, j in ((s1, 2 * k), (s2, 2 * k + 1)):
                s[lo:hi] = _slots(x[lo:hi], self.mults[j:j + 1], 64 - bits, base)
            if ks is not None:
                ks[lo:hi] = self.fallback[t]
        return self._probe(values, s1, s2, ks)

    def lookup_features(self, values: torch.Tensor, tables: tuple[int, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """One id per (feature, sample): ``values`` int64 (M, B), row i of managed table
        ``tables[i]`` -> ``(rows int64 (M, B), found bool (M, B))``. The same ops for every
        feature at once (the one-hot path of every batch)."""
        if self._loop is not None:
            b = values.shape[1]
            rows, found = self._run_loop(values.reshape(-1), tables,
                                         range(0, b * len(tables), b),
                                         range(b, b * len(tables) + 1, b))
            return rows.view(values.shape), found.view(values.shape)
        pos, shifts, bases, ks = self._layout(tables)
        mults = self.mults.view(-1, 2).index_select(0, pos)          # (M, 2)
        x = values ^ (values >> _MIX)
        s1 = _slots(x, mults[:, :1], shifts, bases)
        s2 = _slots(x, mults[:, 1:], shifts, bases)
        rows, found = self._probe(values.reshape(-1), s1.view(-1), s2.view(-1),
                                  ks.expand_as(values).reshape(-1) if self._hashed else None)
        return rows.view_as(values), found.view_as(values)

    def _run_loop(self, values: torch.Tensor, tables: Sequence[int], los: Sequence[int],
                  his: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled probe of ``values`` int64 (k,) in host memory, ids
        ``values[los[s]:his[s]]`` of table ``tables[s]`` -> ``(rows int64 (k,), found bool
        (k,))``, as :meth:`_probe` would return them."""
        key = tuple(tables)
        lay = self._np_layouts.get(key)
        if lay is None:
            lay = (np.array([self.order[t] for t in key], np.int64),
                   np.array([64 - self.bits[t] for t in key], np.int64),
                   np.array([self.slot_offsets[t] + (1 << (self.bits[t] - 1)) for t in key],
                            np.int64),
                   np.array([self.fallback[t] for t in key], np.int64))
            self._np_layouts[key] = lay
        v = values.contiguous()
        rows = torch.empty_like(v)
        found = torch.empty(v.shape, dtype=torch.bool)
        self._loop(v.numpy(), np.asarray(los, np.int64), np.asarray(his, np.int64), *lay,
                   *self._np, rows.numpy(), found.numpy())
        return rows, found

    def _probe(self, values: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor,
               ks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Both slots ``s1``, ``s2`` of ``values`` (all (k,)) -> (rows, found); ids in
        neither read row ``value % ks`` (``ks`` None: every table has one fallback row, 0)."""
        in1 = self.keys.index_select(0, s1) == values
        found = in1 | (self.keys.index_select(0, s2) == values)
        got = self.slot_rows.index_select(0, torch.where(in1, s1, s2))
        if ks is None:      # one fallback row, row 0: a product is cheaper than a select
            return got.mul_(found), found
        return torch.where(found, got, values % ks), found
