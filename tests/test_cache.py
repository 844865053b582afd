"""EmbeddingCache on CPU: exact rows for any capacity, LRU/LFU victims by hand, counters."""
import pytest
import torch

from serve.errors import ConfigError
from serve.runtime.cache import EmbeddingCache, capacity_for

ROWS, RB = 10, 4


def _table(rows: int = ROWS) -> torch.Tensor:
    """Row r holds bytes (r, r+1, r+2, r+3) so every returned row is recognisable."""
    return (torch.arange(rows).unsqueeze(1) + torch.arange(RB)).to(torch.uint8)


def _lookup(cache: EmbeddingCache, rows: list[int], counts: list[int] | None = None) -> None:
    r = torch.tensor(rows, dtype=torch.int64)
    c = None if counts is None else torch.tensor(counts, dtype=torch.int64)
    out = cache.lookup(r, c)
    assert torch.equal(out, _table()[r]), "cache returned wrong row bytes"


def _resident(cache: EmbeddingCache) -> list[int]:
    return cache.resident_rows().tolist()


def test_lru_evicts_least_recently_used_by_hand():
    c = EmbeddingCache(_table(), capacity=3, policy="lru")
    _lookup(c, [0, 1, 2])                 # step 1: 3 misses fill slots 0, 1, 2
    assert _resident(c) == [0, 1, 2] and c.counters.evictions == 0
    _lookup(c, [0, 3])                    # step 2: 0 hits; 3 replaces 1 (last used step 1,
    assert _resident(c) == [0, 2, 3]      #         lower slot than row 2)
    _lookup(c, [4, 5], [1, 2])            # step 3: 5 (2 uses) then 4 evict 2 then 0
    assert _resident(c) == [3, 4, 5]
    assert (c.counters.lookups, c.counters.hits, c.counters.misses,
            c.counters.evictions) == (3 + 2 + 3, 1, 7, 3)
    # step 4: 7 unique rows > 3 slots: 3, 4, 5 hit and are never evicted by their own
    # batch, and no slot is left for the 4 misses, which are served from host memory.
    _lookup(c, [0, 1, 2, 3, 4, 5, 6])
    assert _resident(c) == [3, 4, 5]
    assert (c.counters.hits, c.counters.misses, c.counters.evictions) == (4, 11, 3)


def test_lfu_admits_only_more_frequent_rows_by_hand():
    c = EmbeddingCache(_table(), capacity=2, policy="lfu")
    _lookup(c, [1], [3])        # freq 1:3 -> empty slot
    _lookup(c, [2], [1])        # freq 2:1 -> empty slot
    assert _resident(c) == [1, 2]
    _lookup(c, [3], [1])        # freq 3:1, not above row 2's 1: stays out
    assert _resident(c) == [1, 2] and c.counters.evictions == 0
    _lookup(c, [3], [1])        # freq 3:2 > 1: evicts row 2
    assert _resident(c) == [1, 3] and c.counters.evictions == 1
    _lookup(c, [2, 4])          # 2:2 vs 3:2 and 4:1 vs 1:3 -> neither gets in
    assert _resident(c) == [1, 3]
    _lookup(c, [2])             # 2:3 > 3:2: evicts row 3
    assert _resident(c) == [1, 2] and c.counters.evictions == 2
    assert c.row_freq.tolist()[:5] == [0, 3, 3, 2, 1]


def test_lru_and_lfu_differ_on_a_scan():
    """A one-off scan flushes LRU but not LFU (the textbook difference)."""
    hot, scan = [0, 1], [5, 6]
    lru = EmbeddingCache(_table(), capacity=2, policy="lru")
    lfu = EmbeddingCache(_table(), capacity=2, policy="lfu")
    for cache in (lru, lfu):
        for _ in range(3):
            _lookup(cache, hot)
        _lookup(cache, scan)
    assert _resident(lru) == scan
    assert _resident(lfu) == hot


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [1, 3, 50, 200])
def test_random_sequences_return_exact_rows(policy, capacity):
    torch.manual_seed(0)
    table = torch.randint(0, 256, (200, 8), dtype=torch.uint8)
    cache = EmbeddingCache(table, capacity=capacity, policy=policy)
    probs = 1.0 / torch.arange(1, 201).float() ** 1.1
    for _ in range(30):
        ids = torch.multinomial(probs, 64, replacement=True)
        rows, counts = torch.unique(ids, return_counts=True)
        assert torch.equal(cache.lookup(rows, counts), table[rows])
        # Invariants: map and slots agree; no more residents than slots.
        res = cache.slot_to_row[cache.slot_to_row >= 0]
        assert res.numel() <= capacity and res.unique().numel() == res.numel()
        slots = cache.row_to_slot[res].long()
        assert torch.equal(cache.slot_to_row[slots], res)
        assert torch.equal(cache.slots[slots], table[res])
        assert int((cache.row_to_slot >= 0).sum()) == res.numel()
    c = cache.counters
    assert c.lookups == 30 * 64 and c.hits + c.misses == c.lookups
    if capacity == 200:
        assert c.evictions == 0


def test_capacity_rules():
    assert capacity_for(1000, 68, load_factor=0.2, cache_bytes=None) == 200
    assert capacity_for(1001, 68, load_factor=0.2, cache_bytes=None) == 201   # ceil
    assert capacity_for(1000, 68, load_factor=0.2, cache_bytes=68 * 7) == 7   # bytes win
    assert capacity_for(1000, 68, load_factor=None, cache_bytes=None) == 1000
    assert capacity_for(10, 68, load_factor=None, cache_bytes=68 * 99) == 10
    with pytest.raises(ConfigError, match=r"cache_bytes 10 is smaller than one row \(68 bytes\)"):
        capacity_for(1000, 68, load_factor=None, cache_bytes=10)


def test_bad_cache_arguments():
    with pytest.raises(ConfigError, match=r"cache_policy 'fifo' is not one of \('lru', 'lfu'\)"):
        EmbeddingCache(_table(), capacity=2, policy="fifo")
    with pytest.raises(ConfigError, match=r"cache capacity 11 must be in 1..10"):
        EmbeddingCache(_table(), capacity=11)


def test_bytes_accounting():
    c = EmbeddingCache(_table(), capacity=4, policy="lfu")
    assert c.host_bytes == ROWS * RB
    # slots + row->slot int32 + slot->row int64 + last-use int64 (each with one dump
    # entry) + LFU counts int32
    assert c.device_bytes == 5 * RB + (ROWS + 1) * 4 + 5 * 8 + 5 * 8 + ROWS * 4


def test_dlpack_alias_reads_the_same_memory():
    """The capsule behind the zero-copy miss path (CUDA-labelled there), checked on CPU."""
    from serve.runtime.cache import _alias_via_dlpack

    t = torch.randint(0, 256, (1000, 20), dtype=torch.uint8)
    view, keep = _alias_via_dlpack(t, 1, 0)   # kDLCPU
    assert view.shape == (1000, 20) and view.dtype == torch.uint8
    assert view.data_ptr() == t.data_ptr()
    idx = torch.tensor([5, 999, 0, 5])
    assert torch.equal(view.index_select(0, idx), t[idx])
    t[5, 3] = 7                                # it aliases, it does not copy
    assert int(view[5, 3]) == 7
    del view, keep


def test_bad_miss_path():
    with pytest.raises(ConfigError, match=r"cache miss path 'uvm' is not one of \('host', 'mapped'\)"):
        EmbeddingCache(_table(), capacity=2, miss_path="uvm")


def _check_invariants(cache: EmbeddingCache, table: torch.Tensor) -> None:
    cap = cache.capacity
    res = cache.slot_to_row[:cap][cache.slot_to_row[:cap] >= 0]
    assert res.unique().numel() == res.numel() <= cap
    slots = cache.row_to_slot[res].long()
    assert torch.equal(cache.slot_to_row[slots], res)
    assert torch.equal(cache.slots[slots], table[res])
    assert int((cache.row_to_slot[: cache.total_rows] >= 0).sum()) == res.numel()
    assert int(cache.row_to_slot[-1]) == -1 and int(cache.slot_to_row[-1]) == -1  # dumps


def test_static_lookup_is_exact_and_consistent():
    """The fixed-shape (CUDA-graph) path: duplicates, hits, misses, evictions; mixed with
    the dynamic path on the same cache."""
    torch.manual_seed(1)
    table = torch.randint(0, 256, (300, 8), dtype=torch.uint8)
    cache = EmbeddingCache(table, capacity=64, policy="lru")
    probs = 1.0 / torch.arange(1, 301).float() ** 1.1
    for step in range(40):
        ids = torch.multinomial(probs, 26, replacement=True)     # duplicates likely
        assert cache.static_ok(ids.numel())
        if step % 3 == 2:
            rows, counts = torch.unique(ids, return_counts=True)
            assert torch.equal(cache.lookup(rows, counts), table[rows])
        else:
            assert torch.equal(cache.lookup_static(ids), table[ids])
        _check_invariants(cache, table)
    c = cache.counters
    assert c.lookups == 40 * 26 and 0 < c.hits < c.lookups and c.evictions > 0


def test_static_lookup_lru_by_hand():
    c = EmbeddingCache(_table(), capacity=4, policy="lru")
    out = c.lookup_static(torch.tensor([3, 3]))      # one row, twice: 2 misses, one slot
    assert torch.equal(out, _table()[[3, 3]]) and _resident(c) == [3]
    c.lookup_static(torch.tensor([1, 2]))            # slots 1, 2
    c.lookup_static(torch.tensor([3, 4]))            # 3 hits; 4 takes the empty slot 3
    assert _resident(c) == [1, 2, 3, 4]
    c.lookup_static(torch.tensor([5, 1]))            # 1 hits; 5 evicts 2 (oldest left)
    assert _resident(c) == [1, 3, 4, 5]
    assert (c.counters.lookups, c.counters.hits, c.counters.evictions) == (8, 2, 1)
    assert not c.static_ok(3)                        # 4 slots < 2 x 3 ids


def test_static_path_needs_lru():
    assert not EmbeddingCache(_table(), capacity=8, policy="lfu").static_ok(2)
