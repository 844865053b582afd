"""The embedding cache: hot quantized rows on the device, every row in host memory.

All F tables are concatenated into one uint8 host table of R = sum(rows) rows of
``row_bytes`` each (the artifact row format, still quantized). ``capacity`` slots of
the same format live on the device. One lookup takes the batch's U unique global rows
and returns their bytes (U, row_bytes) on the device, exactly, whatever the capacity:

1. ``row_to_slot[rows]`` (a device int32 map, -1 = absent) splits hits from misses;
2. hits are gathered from the slots, misses from the host table (host ``index_select``
   into a pinned staging buffer, then one non-blocking copy to the device);
3. misses are then admitted by policy into slots this batch did not hit (a hit row is
   never evicted by its own batch), so U > capacity still answers correctly: what does
   not fit is served from host memory and simply not kept.

Policies (victims are chosen among the slots not hit in this batch):

* ``lru``: victims are the slots with the oldest last-use step (empty slots first);
  every miss is admitted while such slots remain, most frequent in the batch first
  (ties: lower global row first). Ties among victims go to the lowest slot index.
* ``lfu``: the cache counts every access of every row (also of rows not resident), and
  a miss replaces the least-frequently used slot only if its count is strictly higher
  than that slot's (empty slots always admit). Misses with the highest counts go in
  first; ties among victims go to the lowest slot index.

LFU counts (int32, one per table row) saturate at 2**31 - 1 instead of wrapping, and
they age: every ``lfu_decay_every`` ids looked up, every count (resident rows' too:
a slot's count is its row's) is halved by one right shift, so a row that was hot
yesterday loses its lead geometrically once the traffic moves on, and a count can
never exceed about 2 x ``lfu_decay_every``. The default period is
``LFU_DECAY_PER_ROW`` x the table's rows (ids, not batches): long enough that the
counts rank rows as well as undecayed ones on static traffic (bench/bench_runtime.py
measures both), short enough that the hot set follows a shift in the traffic.
Without aging, a row's count only grows: under int32 wrap-around one very hot row
of a tiny table went negative within hours at GPU rates, was evicted first and never
admitted again.

Counters are per id (access), not per unique row: ``hits`` counts the ids whose row
was resident when the batch arrived, so ``hits / lookups`` is comparable with the
ideal top-k hit ratio of the id distribution.

Two lookups share this state:

* :meth:`EmbeddingCache.lookup` (any policy, any batch): unique rows in, exact bytes
  out; host syncs only to size the miss gather (and, for LFU, the admitted count).
* :meth:`EmbeddingCache.lookup_static` (LRU, fixed shapes, no host sync, so a CUDA
  graph can capture it): needs the misses readable by the device (``miss_path="mapped"``:
  the GPU reads the pinned host table over the bus) and capacity >= 2 x ids.


Host memory (:class:`serve.runtime.hostmem.HostRows`): on CUDA the host table is
page-locked in place with ``cudaHostRegister`` (exactly its bytes, no copy) and
unregistered by :meth:`EmbeddingCache.close` (or when the cache is collected). Miss
paths on CUDA: "host" (default) gathers on the host into two small pinned staging
buffers (``STAGING_BYTES`` each) and copies once per chunk; "mapped" lets the GPU gather
from the pinned table itself. Measured elsewhere on an H200 (docs/stack.md) the two move
rows at about the same rate (1-2.7e8 rows/s); "mapped" needs no host round trip of the
miss ids, which is what makes the captured path possible. ``bench/gpu_check.py``
measures both again.

The parts, each owning its state: :class:`SlotIndex` (which row is in which slot, and
the policy state that picks victims), :class:`CacheTally` (the counters, on the device),
``HostRows`` (every row in host memory, and the miss path), and :class:`EmbeddingCache`
(the device slots' bytes, and the lookups that drive the other three).

The code is device-agnostic: ``device="cpu"`` runs exactly the same tensor program,
which is how the CPU tests cover it. On CPU it only costs time (device memory is host
memory), so the runtime does not use it there unless asked to.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from serve.common.validate import int_at_least
from serve.constants import CACHE_POLICIES
from serve.errors import ConfigError
from serve.runtime.hostmem import MISS_PATHS, STAGING_BYTES, HostRows, device_guard, with_index
from serve.runtime.rowsource import MissClock, RowSource

__all__ = ["LFU_DECAY_PER_ROW", "POLICIES", "CacheCounters", "CacheTally", "EmbeddingCache",
           "SlotIndex", "capacity_for", "resolve_decay_every"]

POLICIES = CACHE_POLICIES  # defined once in serve.constants
# Key of a slot nobody may take (hit in this batch) when victims are chosen by topk.
_NEVER = torch.iinfo(torch.int64).max
_LOWEST = torch.iinfo(torch.int64).min
# LFU counts saturate here (int32). Victim keys are count * 2**32 + slot: at most
# (2**31 - 1) * 2**32 + (2**31 - 1) < _NEVER, so a saturated count still sorts below a hit.
_FREQ_MAX = torch.iinfo(torch.int32).max
#: Default LFU aging period, in ids looked up per table row: the counts are halved every
#: ``LFU_DECAY_PER_ROW * total_rows`` ids. Measured with bench/bench_runtime.py: 8 costs
#: at most 0.003 of hit ratio against never aging on the static Zipf grid, and gains up
#: to 0.024 over it once the hot set moves (4 gained more there but cost up to 0.005 on
#: static traffic; 1 cost up to 0.03).
LFU_DECAY_PER_ROW = 8
#: Above this many slots a full cache picks victims among a window of slots (a random
#: start, :data:`SAMPLE_SLOTS_MIN` slots or 8 x the batch's admissions and hits, whichever
#: is more) instead of ranking every slot: a host tier of tens of millions of slots would
#: otherwise spend tens of ms per batch in one topk (measured 66 ms at 4M slots). The
#: answer is exact either way; only which resident row leaves is approximate (sampled
#: LRU / LFU, as Redis does).
SAMPLE_ABOVE_SLOTS = 1 << 18
SAMPLE_SLOTS_MIN = 1 << 15

_F = TypeVar("_F", bound=Callable[..., Any])


def _on_own_device(fn: _F) -> _F:
    """Run a method under :func:`device_guard` of ``self.device``."""
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with device_guard(self.device):
            return fn(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def resolve_decay_every(decay_every: int | None, total_rows: int) -> int:
    """The LFU aging period in ids: ``decay_every`` if given (0 = never age), else
    ``LFU_DECAY_PER_ROW * total_rows``."""
    if decay_every is None:
        return LFU_DECAY_PER_ROW * total_rows
    return int_at_least("lfu_decay_every", decay_every, 0,
                        then=" (ids between halvings of the LFU counts; 0 = never), or None "
                             f"for the default {LFU_DECAY_PER_ROW} x the table's rows")


def capacity_for(total_rows: int, row_bytes: int, *, load_factor: float | None,
                 cache_bytes: int | None) -> int:
    """Slots for a cache: ``cache_bytes // row_bytes`` if given, else
    ``ceil(load_factor * total_rows)``; at least 1, at most ``total_rows``.

    ``cache_bytes`` counts slot payload only (the row map and policy state come on top;
    ``EmbeddingCache.device_bytes`` reports all of it).
    """
    if cache_bytes is not None:
        if cache_bytes < row_bytes:
            raise ConfigError(f"cache_bytes {cache_bytes} is smaller than one row "
                              f"({row_bytes} bytes); give at least {row_bytes}")
        cap = cache_bytes // row_bytes
    elif load_factor is not None:
        cap = -(-round(load_factor * total_rows * 1e6) // 1_000_000)  # ceil, float-safe
    else:
        cap = total_rows
    return max(1, min(int(cap), total_rows))


@dataclass
class CacheCounters:
    """Cumulative counters (ids, not unique rows); ``lfu_decays``: halvings of the LFU
    counts so far (0 for LRU)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    lfu_decays: int = 0


class CacheTally:
    """The cache's cumulative counters, summed on the device so a batch needs no sync for
    them: int64 (3,) lookups, hits, evictions (ids, not unique rows)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._count = torch.zeros(3, dtype=torch.int64, device=device)

    def add_lookups(self, ids: torch.Tensor, hits: torch.Tensor) -> None:
        """Add 0-d device tensors: ``ids`` looked up, ``hits`` of them resident."""
        self._count[:2].add_(torch.stack((ids, hits)))

    def add_evictions(self, n: torch.Tensor) -> None:
        self._count[2:].add_(n)

    def add(self, counts: torch.Tensor) -> None:
        """Add int64 (3,) lookups, hits, evictions."""
        self._count.add_(counts)

    def save(self) -> torch.Tensor:
        """A copy of the counters, for :meth:`restore` (uncounted warm-up lookups)."""
        return self._count.clone()

    def restore(self, saved: torch.Tensor) -> None:
        self._count.copy_(saved)

    def snapshot(self, lfu_decays: int) -> CacheCounters:
        """The counters (one device sync)."""
        with device_guard(self.device):
            lookups, hits, evictions = (int(x) for x in self._count.tolist())
        return CacheCounters(lookups=lookups, hits=hits, misses=lookups - hits,
                             evictions=evictions, lfu_decays=lfu_decays)


class SlotIndex:
    """Which table row is in which device slot, and the policy state that picks victims.

    All on the device: ``row_to_slot`` int32 (R + 1,) (-1 = absent), ``slot_to_row``
    int64 (C + 1,) (-1 = empty), ``slot_last_use`` int64 (C + 1,) unique LRU keys, and
    for LFU ``row_freq`` int32 (R,). Each array has one extra entry at its end (slot C,
    row R): a dump for the writes the fixed-shape path masks out, so it needs no
    data-dependent shapes; it is never resident and never a victim.

    Args:
        capacity: C slots; total_rows: R table rows; policy: one of :data:`POLICIES`.
        lfu_decay_every: LFU aging period in ids (0 = never; resolved already).
        device: where the index lives.
    """

    def __init__(self, capacity: int, total_rows: int, policy: str, lfu_decay_every: int,
                 device: torch.device) -> None:
        self.capacity, self.total_rows, self.policy = capacity, total_rows, policy
        self.lfu_decay_every = lfu_decay_every
        cap, rows, dev = capacity, total_rows, device
        self.row_to_slot = torch.full((rows + 1,), -1, dtype=torch.int32, device=dev)
        self.slot_to_row = torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)
        # Last use as a unique key: step * capacity + slot (empty: -capacity + slot), so
        # the LRU victims are the k smallest keys with no extra pass to break ties.
        self.slot_last_use = torch.arange(cap + 1, dtype=torch.int64, device=dev) - cap
        # LFU keeps per-row access counts: int32 (4 bytes per table row on the device),
        # saturating at _FREQ_MAX and halved every lfu_decay_every ids (module docstring).
        self.row_freq = (torch.zeros((rows,), dtype=torch.int32, device=dev)
                         if policy == "lfu" else None)
        self._ids_since_decay = 0
        # Slots 0.._filled-1 have held a row, the others never did (None: unknown, after
        # a fixed-shape admission): admit's shortcut while empty slots remain.
        self._filled: int | None = 0
        #: Halvings of the LFU counts so far.
        self.decays = 0
        # The step lives on the device so a captured CUDA graph advances it too.
        self._step = torch.zeros((), dtype=torch.int64, device=dev)

    @property
    def device_bytes(self) -> int:
        n = self.row_to_slot.numel() * 4 + self.slot_to_row.numel() * 8 \
            + self.slot_last_use.numel() * 8
        return n + (self.row_freq.numel() * 4 if self.row_freq is not None else 0)

    def resident_rows(self) -> torch.Tensor:
        """Sorted global rows now in a slot (int64, on the device)."""
        res = self.slot_to_row[: self.capacity]
        return torch.sort(res[res >= 0]).values

    def begin(self) -> torch.Tensor:
        """Start a batch: a 0-d key; last-use keys >= it were touched in this batch."""
        self._step.add_(1)
        return self._step * self.capacity

    def find(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 slot of each row (-1 = absent)."""
        return self.row_to_slot.index_select(0, rows).long()

    def touch(self, safe: torch.Tensor, hit: torch.Tensor, now: torch.Tensor) -> None:
        """Refresh the hit slots' last use (``safe``: slots clamped at 0); amax leaves the
        slot misses point at alone (their value is below every key, empty slots' too)."""
        self.slot_last_use.scatter_reduce_(
            0, safe, torch.where(hit, safe + now, torch.full_like(safe, _LOWEST)),
            reduce="amax")

    def count(self, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """LFU: add ``counts`` to distinct ``rows``' access counts (saturating)."""
        if self.row_freq is None:
            return
        # Saturating add (rows are distinct): an int32 index_add_ would wrap negative.
        freq = self.row_freq.index_select(0, rows).long().add_(counts).clamp_max_(_FREQ_MAX)
        self.row_freq.index_copy_(0, rows, freq.int())

    def age(self, n_ids: int) -> None:
        """LFU aging: one right shift of every count per ``lfu_decay_every`` ids seen."""
        if self.row_freq is None or self.lfu_decay_every == 0:
            return
        self._ids_since_decay += n_ids
        k, self._ids_since_decay = divmod(self._ids_since_decay, self.lfu_decay_every)
        if k:
            torch.bitwise_right_shift(self.row_freq, min(k, 31), out=self.row_freq)
            self.decays += k

    def _pool(self, k: int, n_hits: int) -> torch.Tensor | None:
        """The slots :meth:`_victims` ranks: None (every slot) up to
        :data:`SAMPLE_ABOVE_SLOTS`, else a window of distinct slots from a start drawn
        from torch's generator, large enough to hold the k victims besides every hit."""
        if self.capacity <= SAMPLE_ABOVE_SLOTS:
            return None
        size = min(self.capacity, max(SAMPLE_SLOTS_MIN, 8 * (k + n_hits)))
        if size == self.capacity:
            return None
        start = int(torch.randint(self.capacity, (1,)))
        return torch.remainder(torch.arange(start, start + size,
                                            device=self.slot_last_use.device), self.capacity)

    def _victims(self, cand: torch.Tensor, cand_key: torch.Tensor, k: int,
                 now: torch.Tensor, n_hits: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`admit`'s choice by ranking the slots of :meth:`_pool`: ``(cand,
        victims)``, the admitted candidates and their slots (None: LFU admits none)."""
        pool = self._pool(k, n_hits)
        last = self.slot_last_use[: self.capacity]
        if pool is not None:
            last = last.index_select(0, pool)
        if self.row_freq is None:
            # Hits of this batch hold the largest keys, so the k smallest never include
            # them (k <= slots - hits); empty slots (negative keys) go first. Keys are
            # unique, so topk's choice, and every later eviction, is deterministic.
            key = last
        else:
            resident = self.slot_to_row[: self.capacity]
            if pool is not None:
                resident = resident.index_select(0, pool)
            freq = torch.where(resident >= 0,
                               self.row_freq.index_select(0, resident.clamp_min(0)).long(),
                               torch.full_like(resident, -1))
            # LFU key: access count (empty = -1, below every count), ties to the lower
            # slot; hits excluded. Fits int64 even for saturated counts (see _FREQ_MAX).
            slot_ids = torch.remainder(last, self.capacity)
            key = torch.where(last >= now, torch.full_like(freq, _NEVER),
                              freq * (1 << 32) + slot_ids)
        picked = torch.topk(key, k, largest=False, sorted=True).indices   # into the pool
        victims = picked if pool is None else pool.index_select(0, picked)
        if self.row_freq is not None:
            # Candidates descend in count and victims ascend, so the admitted pairs are a
            # prefix: a miss whose count is not above its victim's stays out (it was
            # served from host memory this time).
            n_ok = int((cand_key.index_select(0, cand) > freq.index_select(0, picked)).sum())
            if n_ok == 0:
                return None
            cand, victims = cand[:n_ok], victims[:n_ok]
        return cand, victims

    def admit(self, miss_rows: torch.Tensor, miss_counts: torch.Tensor, *, n_hits: int,
              now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Map misses to victim slots by policy: ``(victims, cand, evicted)``, slot of
        each admitted miss, its position in ``miss_rows``, and a 0-d count of occupied
        slots taken; None when nothing is admitted. The caller writes the slots' bytes."""
        k = min(miss_rows.numel(), self.capacity - n_hits)
        if k <= 0:
            return None
        if self.policy == "lfu" and self.row_freq is None:
            raise RuntimeError("LFU cache without access counts")
        # Candidates: LRU the batch's most frequent misses first, LFU the highest
        # counts first (ties: lower row first).
        cand_key = (miss_counts if self.row_freq is None
                    else self.row_freq.index_select(0, miss_rows).long())
        cand = torch.sort(cand_key, descending=True, stable=True).indices[:k]
        if self._filled is not None and self._filled + k <= self.capacity:
            # Never-filled slots remain for all k: both policies take the lowest empty
            # slots first (their keys are the smallest, ascending by slot) and admit
            # every miss into an empty slot, so take them without ranking every slot
            # (an O(capacity) topk per batch: tens of ms for a host tier of millions).
            victims = torch.arange(self._filled, self._filled + k, device=miss_rows.device)
            self._filled += k
        else:
            self._filled = self.capacity   # every slot holds a row from here on
            picked = self._victims(cand, cand_key, k, now, n_hits)
            if picked is None:
                return None
            cand, victims = picked
        new_rows = miss_rows.index_select(0, cand)
        old_rows = self.slot_to_row.index_select(0, victims)
        occupied = old_rows >= 0
        # Unmap the evicted rows. An empty victim slot has no row (-1): point its write at
        # the incoming row instead, whose entry is set right after (same stream, in order),
        # so no boolean-mask sync is needed.
        self.row_to_slot.index_fill_(0, torch.where(occupied, old_rows, new_rows), -1)
        self.slot_to_row.index_copy_(0, victims, new_rows)
        self.row_to_slot.index_copy_(0, new_rows, victims.to(torch.int32))
        self.slot_last_use.index_copy_(0, victims, victims + now)
        return victims, cand, occupied.sum()

    def admit_static(self, rows: torch.Tensor, hit: torch.Tensor,
                     now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed-shape LRU admission (no host sync): ``(target, evict)``, the slot each of
        the n ids writes (the dump slot C where it admits nothing) and which evict a row.

        Misses (first occurrence of each row) take the least recently used of the n
        oldest slots, in order (never a hit of this batch when C >= 2n).
        """
        cap, n = self.capacity, rows.numel()
        self._filled = None    # admissions here are not counted: rank every slot
        # First occurrence of each row: only it may be admitted (one slot per row).
        order = torch.argsort(rows, stable=True)
        sorted_rows = rows.index_select(0, order)
        first_sorted = torch.ones(n, dtype=torch.bool, device=rows.device)
        first_sorted[1:] = sorted_rows[1:] != sorted_rows[:-1]
        first = torch.empty_like(first_sorted).scatter_(0, order, first_sorted)
        admit = ~hit & first
        # The j-th admitted id takes the j-th oldest slot.
        victims = torch.topk(self.slot_last_use[:cap], n, largest=False, sorted=True).indices
        v = victims.index_select(0, (torch.cumsum(admit, 0) - 1).clamp_min(0))
        old = self.slot_to_row.index_select(0, v)
        evict = admit & (old >= 0)
        dump_row = torch.full_like(rows, self.total_rows)
        target = torch.where(admit, v, torch.full_like(v, cap))
        self.row_to_slot.index_fill_(0, torch.where(evict, old, dump_row), -1)
        self.slot_to_row.index_copy_(0, target, torch.where(admit, rows, torch.full_like(rows, -1)))
        self.slot_last_use.index_copy_(0, target, torch.where(admit, v + now,
                                                              torch.full_like(v, _LOWEST)))
        self.row_to_slot.index_copy_(0, torch.where(admit, rows, dump_row),
                                     torch.where(admit, v, torch.full_like(v, -1)).int())
        return target, evict


class EmbeddingCache:
    """Device-resident slots over a host-resident quantized table.

    Args:
        host_table: uint8 (R, row_bytes), contiguous, on the CPU. When ``device`` is CUDA
            its memory is page-locked in place (``cudaHostRegister``, no copy) unless it
            is pinned already; :meth:`close` unregisters it. Give it memory of its own
            pages (:func:`serve.runtime.hostmem.page_exclusive_empty`, what the runtime
            does): a table sharing a page with one registered before is copied once to
            be registered. Or a :class:`serve.runtime.rowsource.RowSource` the misses
            are fetched from (the tiers below a cache over disk-backed tables,
            :mod:`serve.runtime.tiers`; ``miss_path`` and ``staging_bytes`` then unused).
        capacity: device slots, 1..R.
        policy: "lru" or "lfu".
        device: where the slots and the policy state live.
        miss_path: "host" (host gather + async copy) or "mapped" (the GPU reads the pinned
            host table directly; CUDA only, ignored on CPU).
        lfu_decay_every: LFU only: halve every count after this many ids looked up
            (0 = never; None = ``LFU_DECAY_PER_ROW`` x R).
        staging_bytes: bytes of each of the two pinned staging buffers of the host miss
            path (CUDA); at least one row.

    Parts: ``host`` (:class:`serve.runtime.hostmem.HostRows` or the row source given),
    ``clock`` (the misses' fetch times, :class:`serve.runtime.rowsource.MissClock`), ``index``
    (:class:`SlotIndex`), ``tally`` (:class:`CacheTally`); the cache itself owns the
    slots' bytes, uint8 (capacity + 1, row_bytes) (the last one a dump, see SlotIndex).

    Not thread-safe: one caller at a time. Do not use it where the host table cannot be
    page-locked (the CUDA copies need it); on CPU nothing is pinned.

    Example::

        cache = EmbeddingCache(table, capacity=1000, policy="lru", device="cpu")
        rows, inverse, counts = torch.unique(global_ids, return_inverse=True, return_counts=True)
        row_bytes = cache.lookup(rows, counts)        # (U, row_bytes) uint8 on the device
    """

    def __init__(self, host_table: torch.Tensor | RowSource, capacity: int,
                 policy: str = "lru", device: str | torch.device = "cpu",
                 miss_path: str = "host", lfu_decay_every: int | None = None,
                 staging_bytes: int = STAGING_BYTES) -> None:
        if miss_path not in MISS_PATHS:
            raise ConfigError(f"cache miss path {miss_path!r} is not one of {MISS_PATHS}")
        if policy not in POLICIES:
            raise ConfigError(f"cache_policy {policy!r} is not one of {POLICIES}; "
                              "choose 'lru' or 'lfu'")
        if isinstance(host_table, torch.Tensor):
            if host_table.dtype != torch.uint8 or host_table.dim() != 2:
                raise ConfigError(f"host table must be uint8 (rows, row_bytes), got "
                                  f"{host_table.dtype} {tuple(host_table.shape)}")
            total, rb = int(host_table.shape[0]), int(host_table.shape[1])
        else:
            total, rb = int(host_table.total_rows), int(host_table.row_bytes)
        if not 1 <= capacity <= total:
            raise ConfigError(f"cache capacity {capacity} must be in 1..{total} (the table's rows)")
        self.device = with_index(torch.device(device))
        self.policy = policy
        self.capacity = int(capacity)
        self.total_rows = total
        self.row_bytes = rb
        if staging_bytes < self.row_bytes:
            raise ConfigError(f"staging_bytes {staging_bytes} is smaller than one row "
                              f"({self.row_bytes} bytes); give at least {self.row_bytes}")
        #: LFU aging period in ids (0 = never), resolved.
        self.lfu_decay_every = resolve_decay_every(lfu_decay_every, self.total_rows)
        #: Where misses come from: every row in host memory (a tensor given), or the
        #: row source given (the tiers below, serve.runtime.tiers).
        self.host: RowSource = (HostRows(host_table, self.device, miss_path, staging_bytes)
                                if isinstance(host_table, torch.Tensor) else host_table)
        #: The fetches of misses from ``host``: seconds per batch, rows fetched.
        self.clock = MissClock()
        self._closed = False
        with device_guard(self.device):
            self.slots = torch.zeros((self.capacity + 1, self.row_bytes), dtype=torch.uint8,
                                     device=self.device)
            self.index = SlotIndex(self.capacity, self.total_rows, policy, self.lfu_decay_every,
                                   self.device)
            self.tally = CacheTally(self.device)

    @property
    def counters(self) -> CacheCounters:
        """A snapshot of the cumulative counters (one device sync)."""
        return self.tally.snapshot(self.index.decays)

    # -- sizes -------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Slots + row map + policy state, in bytes."""
        return self.slots.numel() + self.index.device_bytes

    @property
    def host_bytes(self) -> int:
        return self.host.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this cache page-locked with ``cudaHostRegister`` (0 on CPU, after
        :meth:`close`, or when the table came pinned already); staging buffers excluded."""
        return self.host.pinned_bytes

    @_on_own_device
    def resident_rows(self) -> torch.Tensor:
        """Sorted global rows now on the device (int64, CPU); for tests and tools."""
        return self.index.resident_rows().cpu()

    def close(self) -> None:
        """Unregister the page-locked host table once the device's queued work is done
        (idempotent). The cache answers no lookup afterwards; drop any CUDA graph that
        captured ``lookup_static`` first (``Runtime.close`` does)."""
        self._closed = True
        self.host.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EmbeddingCache is closed (its host table is no longer "
                               "page-locked); build a new one")

    # -- one batch -----------------------------------------------------------------------
    @_on_own_device
    def lookup(self, rows: torch.Tensor, counts: torch.Tensor | None = None,
               n_ids: int | None = None) -> torch.Tensor:
        """Bytes of ``rows`` on the device, then admit misses by policy.

        Args:
            rows: int64 (U,) distinct global rows in [0, R), on the device.
            counts: int64 (U,) accesses of each row in this batch (None: ones); they
                weight the counters and the LFU counts.
            n_ids: ids behind ``rows`` (= ``counts.sum()``), for the LFU aging schedule;
                callers that know it on the host pass it to spare a device sync.
        Returns:
            uint8 (U, row_bytes) on the device, row i holding ``rows[i]``.

        Host syncs per call: the miss count (to size the host gather), the miss rows'
        transfer to the host, and for LFU the number admitted (and ``counts.sum()``
        when ``n_ids`` is not given); counters stay on the device.
        """
        self._check_open()
        dev, index = self.device, self.index
        rows = rows.to(dev)
        u = rows.numel()
        if counts is None:
            counts = torch.ones(u, dtype=torch.int64, device=dev)
            n_ids = u
        else:
            counts = counts.to(device=dev, dtype=torch.int64)
        now = index.begin()
        slot = index.find(rows)                                    # (U,), -1 = absent
        hit = slot >= 0
        safe = slot.clamp_min(0)
        # Gather every row from the slots (misses read slot 0 and are overwritten below):
        # no sync to split hits from misses on this side.
        out = self.slots.index_select(0, safe)
        index.touch(safe, hit, now)
        index.count(rows, counts)
        self.tally.add_lookups(counts.sum(), (counts * hit).sum())
        miss_idx = (~hit).nonzero().squeeze(1)                     # sync: sizes the fetch
        n_miss = miss_idx.numel()
        if n_miss:
            miss_rows = rows.index_select(0, miss_idx)
            t0 = time.perf_counter()
            fetched = self.host.fetch(miss_rows)
            self.clock.observe(time.perf_counter() - t0, n_miss)
            out.index_copy_(0, miss_idx, fetched)
            admitted = index.admit(miss_rows, counts.index_select(0, miss_idx),
                                   n_hits=u - n_miss, now=now)
            if admitted is not None:
                victims, cand, evicted = admitted
                self.tally.add_evictions(evicted)
                self.slots.index_copy_(0, victims, fetched.index_select(0, cand))
        if index.row_freq is not None:
            index.age(n_ids if n_ids is not None else int(counts.sum()))
        return out

    @_on_own_device
    def update_rows(self, rows: torch.Tensor, data: torch.Tensor) -> int:
        """Overwrite rows in place: the host table, and the device slot of every row that
        is resident (overwrite, not invalidate: the policy state (LRU keys, LFU counts)
        stays as it was, so a delta changes values, never what is cached).

        Args:
            rows: int64 (n,) global rows, unique, in 0..R-1.
            data: uint8 (n, row_bytes) the new rows, in the table's row format.
        Returns:
            how many of them were resident on the device.
        """
        self._check_open()
        rows_cpu = rows.to("cpu", dtype=torch.int64)
        data_cpu = data.to("cpu")
        self.host.write(rows_cpu, data_cpu)
        slot = self.index.find(rows_cpu.to(self.device, non_blocking=True))
        resident = slot >= 0
        hit = int(resident.sum())
        if hit:
            self.slots.index_copy_(0, slot[resident], data_cpu.to(self.device)[resident])
        return hit

    def static_ok(self, n: int) -> bool:
        """Whether ``lookup_static`` may serve ``n`` ids: LRU, misses readable by the device
        (CPU, or CUDA with the mapped miss path), and at least 2n slots, so the n oldest
        slots never include one this batch hits."""
        return self.policy == "lru" and self.host.device_readable and self.capacity >= 2 * n

    @_on_own_device
    def lookup_static(self, rows: torch.Tensor) -> torch.Tensor:
        """Fixed-shape lookup + LRU admission with no host sync: CUDA-graph capturable.

        Args:
            rows: int64 (n,) global rows on the device, duplicates allowed.
        Returns:
            uint8 (n, row_bytes): row i holds ``rows[i]``.

        Every id is read from its slot and from host memory (over the bus) and the right
        one kept; misses (first occurrence of each row) take the least recently used of
        the n oldest slots, in order (:meth:`SlotIndex.admit_static`). Writes for
        positions that admit nothing go to the dump entries. Counters as in
        :meth:`lookup` (per id). Check ``static_ok`` first.
        """
        self._check_open()
        index = self.index
        now = index.begin()
        slot = index.find(rows)
        hit = slot >= 0
        safe = slot.clamp_min(0)
        out = torch.where(hit.unsqueeze(1), self.slots.index_select(0, safe),
                          self.host.source().index_select(0, rows))
        index.touch(safe, hit, now)
        target, evict = index.admit_static(rows, hit, now)
        self.slots.index_copy_(0, target, out)
        self.tally.add(torch.stack((torch.full_like(now, rows.numel()), hit.sum(),
                                    evict.sum())))
        return out
