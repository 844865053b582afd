"""LRU reuse distances of a sampled id stream (the capacity advisor's input) and the hit
ratio curve they predict.

* :class:`ReuseSampler`: spatial sampling (SHARDS, Waldspurger et al., FAST '15) of a
  worker's row accesses: an access of row ``(table, id)`` is kept when
  ``hash(table, id) mod P < T``, so a row is either always or never sampled, and the kept
  rows are a uniform random share ``R = T / P`` of all rows. For each kept access it
  computes the LRU stack depth among the sampled rows (distinct sampled rows accessed
  since the same row's last access, itself included) with a Fenwick tree over access
  timestamps, and scales the distance by ``1 / R`` to table rows. Fixed-size SHARDS: it
  tracks at most ``max_rows`` rows; past that it lowers ``T`` to the largest hash it
  tracks and forgets the rows at or above it, so memory and time stay bounded whatever
  the tables' size (each access is weighted ``1 / R`` at the rate in force, which keeps
  the counts unbiased across a change of rate).
* :func:`hit_ratio_curve`: the LRU hit ratio at given capacities from a histogram of
  those depths (cumulative ``le`` buckets, as ``dlrm_reuse_distance_rows`` exposes them)
  and the weight of first accesses (cold misses).

Only numpy here: the selection of the sampled accesses is vectorised; the few sampled
ones (``R`` x the batch's ids) go through Python.

Example::

    sampler = ReuseSampler(rate=0.01)
    out = sampler.observe(tables, ids)   # int (n,) table index, int64 (n,) ids
    out.depths  # float64 (k,): depth in table rows (>= 1) of each sampled re-access
    out.weight  # 1 / R: how many accesses each sampled one stands for
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "HASH_SPACE",
    "ReuseBatch",
    "ReuseSampler",
    "hit_ratio_curve",
    "lru_stack_depths",
    "row_hashes",
]

#: P: the sampling hash's range (the top 32 bits of a 64-bit mix).
HASH_SPACE = 1 << 32

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def row_hashes(tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """uint64 (n,): a 64-bit mix (splitmix64's finaliser) of each ``(tables[i], ids[i])``.

    Its top 32 bits (``>> 32``) are the sampling hash, uniform in ``[0, HASH_SPACE)``; the
    whole value identifies the row (two rows share it with probability 2**-64).
    """
    with np.errstate(over="ignore"):
        # + gamma first, as splitmix64 does: (0, 0) must not hash to the fixed point 0.
        x = (np.asarray(ids).astype(np.uint64, copy=False) + _GOLD) ^ (
            (np.asarray(tables).astype(np.uint64, copy=False) + np.uint64(1)) * _M2)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


@dataclass(frozen=True)
class ReuseBatch:
    """What one :meth:`ReuseSampler.observe` saw.

    Attributes:
        depths: float64 (k,): the LRU stack depth, in table rows (>= 1), of each sampled
            access whose row was seen before: the smallest LRU cache, in rows, that still
            holds the row when it comes back (a cache of C rows hits iff depth <= C).
        first: sampled accesses whose row the sampler had not seen (cold misses).
        weight: ``1 / R``: the accesses each sampled one stands for (R at this batch).
        sampled: sampled accesses in all (``len(depths) + first``).
        accesses: every access of the batch, sampled or not.
    """

    depths: np.ndarray
    first: int
    weight: float
    sampled: int
    accesses: int


class _Fenwick:
    """Counts over positions 1..n: point add, prefix sum; plain Python ints (the few
    sampled accesses of a batch; numpy per element would cost more)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)

    def add(self, i: int, delta: int) -> None:
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        tree, total = self.tree, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


class ReuseSampler:
    """Sampled LRU reuse distances of one id stream (see the module docstring).

    Args:
        rate: R, the share of rows sampled at the start (0 < R <= 1).
        max_rows: most rows tracked at once (fixed-size SHARDS: R falls as more rows
            are seen; memory ~ 200 bytes a row).
        timestamps: the Fenwick tree's span (>= 2 x max_rows); when the clock reaches it,
            the live timestamps are renumbered (O(span), amortised over ``span - max_rows``
            accesses).

    Not thread-safe: one per worker, called from its batch thread.
    """

    def __init__(self, rate: float, max_rows: int = 16384, timestamps: int | None = None) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"reuse sampling rate={rate} must be in (0, 1]; 0 turns the "
                             "sampler off (do not build one)")
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        span = timestamps if timestamps is not None else 4 * max_rows
        if span < 2 * max_rows:
            raise ValueError(f"timestamps={span} must be >= 2 x max_rows={max_rows}")
        self.threshold = min(HASH_SPACE, max(1, round(rate * HASH_SPACE)))
        self.max_rows = max_rows
        self._span = span
        self._tree = _Fenwick(span)
        self._clock = 1                       # the next timestamp
        self._live = 0                        # marks in the tree (= rows tracked)
        self._last: dict[int, int] = {}       # row key -> its last access's timestamp
        self._heap: list[tuple[int, int]] = []  # (-sampling hash, key) of tracked rows

    @property
    def rate(self) -> float:
        """R now: ``T / P``."""
        return self.threshold / HASH_SPACE

    @property
    def tracked(self) -> int:
        """Rows tracked now (<= max_rows)."""
        return len(self._last)

    def select(self, tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """uint64 (k,): the row keys of the accesses sampled at the current rate, in
        stream order (vectorised)."""
        keys = row_hashes(tables, ids)
        keep = (keys >> np.uint64(32)) < np.uint64(self.threshold)
        out: np.ndarray = keys[keep]
        return out

    def observe(self, tables: np.ndarray, ids: np.ndarray) -> ReuseBatch:
        """Feed accesses in stream order: ``tables`` int (n,) each access's table index,
        ``ids`` int64 (n,) its id (row). Returns what the sampled ones showed."""
        weight = 1.0 / self.rate
        keys = self.select(tables, ids).tolist()
        depths: list[float] = []
        first = 0
        last, tree = self._last, self._tree
        for key in keys:
            if key >> 32 >= self.threshold:   # the rate fell during this batch
                continue
            if self._clock > self._span:
                self._compact()
            p = last.get(key)
            if p is None:
                first += 1
                heapq.heappush(self._heap, (-(key >> 32), key))
            else:
                # Marks after p: the other rows accessed since (each once, at its last).
                depths.append((self._live - tree.prefix(p)) * weight + 1.0)
                tree.add(p, -1)
                self._live -= 1
            t = self._clock
            self._clock += 1
            tree.add(t, 1)
            self._live += 1
            last[key] = t
            if len(last) > self.max_rows:
                self._lower_rate()
        return ReuseBatch(np.asarray(depths, dtype=np.float64), first, weight, len(keys),
                          int(np.size(ids)))

    def _lower_rate(self) -> None:
        """Fixed-size SHARDS: T becomes the largest sampling hash tracked, and every row
        at or above it is forgotten."""
        top = -self._heap[0][0]
        self.threshold = top
        while self._heap and -self._heap[0][0] >= top:
            _, key = heapq.heappop(self._heap)
            p = self._last.pop(key)
            self._tree.add(p, -1)
            self._live -= 1

    def _compact(self) -> None:
        """Renumber the live timestamps 1..live, in order, and rebuild the tree."""
        order = sorted(self._last.items(), key=lambda kv: kv[1])
        self._tree.tree[:] = [0] * (self._span + 1)   # in place: observe holds the tree
        for i, (key, _) in enumerate(order, start=1):
            self._last[key] = i
            self._tree.add(i, 1)
        self._clock = len(order) + 1


def lru_stack_depths(keys: Sequence[int]) -> list[int | None]:
    """The exact LRU stack depth of every access of ``keys`` (None: first access), by
    brute force (O(n x distinct)): the reference the sampler is tested against."""
    stack: list[int] = []   # most recent last
    out: list[int | None] = []
    for k in keys:
        if k in stack:
            i = stack.index(k)
            out.append(len(stack) - i)
            stack.pop(i)
        else:
            out.append(None)
        stack.append(k)
    return out


def hit_ratio_curve(bounds: Sequence[float], cumulative: Sequence[float], first: float,
                    capacities: Sequence[float], accesses: float | None = None
                    ) -> list[float | None]:
    """The predicted LRU hit ratio at each of ``capacities`` (rows) from a depth histogram.

    Args:
        bounds: the finite ``le`` bounds (rows), increasing.
        cumulative: accesses with depth ``<= bounds[i]`` for each bound, then the
            ``+Inf`` bucket (all re-accesses): ``len(bounds) + 1`` values.
        first: accesses whose row was new (cold misses: never hits).
        capacities: cache sizes in rows.
        accesses: every access of the stream, sampled or not (None: unknown). Given, the
            weighted sample's shortfall (or excess) against it is counted at the smallest
            depth (SHARDS-adj, Waldspurger et al.): a Zipf stream's hottest rows are
            few, so whether they were sampled moves the sampled share of accesses; the
            correction removes most of that error at small capacities.
    Returns:
        hits / accesses at each capacity (a cache of C rows hits the accesses of depth
        <= C); between two bounds the count is interpolated linearly in log(rows) (the
        buckets are log-spaced); None for every capacity when nothing was sampled.
    """
    if len(cumulative) != len(bounds) + 1:
        raise ValueError(f"{len(cumulative)} cumulative counts for {len(bounds)} bounds; "
                         "give one per bound plus the +Inf bucket")
    sampled = float(cumulative[-1]) + float(first)
    total = float(accesses) if accesses is not None and accesses > 0 else sampled
    if total <= 0 or sampled <= 0:
        return [None for _ in capacities]
    adj = total - sampled
    b = np.log(np.asarray(bounds, dtype=np.float64))
    c = np.maximum.accumulate(np.asarray(cumulative[:-1], dtype=np.float64)) + adj
    out: list[float | None] = []
    for cap in capacities:
        if cap < bounds[0]:
            out.append(0.0)
            continue
        hits = float(np.interp(np.log(cap), b, c))
        if cap > bounds[-1]:
            hits = float(cumulative[-1]) + adj
        out.append(min(1.0, max(0.0, hits / total)))
    return out
