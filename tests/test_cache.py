"""EmbeddingCache on CPU: exact rows for any capacity, LRU/LFU victims by hand, counters,
LFU counts that saturate and age."""
import pytest
import torch

from serve.errors import ConfigError
from serve.runtime.cache import LFU_DECAY_PER_ROW, EmbeddingCache, capacity_for

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
    assert c.index.row_freq.tolist()[:5] == [0, 3, 3, 2, 1]


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


@pytest.mark.parametrize("policy,decay", [("lru", None), ("lfu", None), ("lfu", 50)])
@pytest.mark.parametrize("capacity", [1, 3, 50, 200])
def test_random_sequences_return_exact_rows(policy, decay, capacity):
    """Exact bytes and consistent maps whatever the policy; ("lfu", 50): the counts are
    halved about every batch, so admissions run on freshly aged counts."""
    torch.manual_seed(0)
    table = torch.randint(0, 256, (200, 8), dtype=torch.uint8)
    cache = EmbeddingCache(table, capacity=capacity, policy=policy, lfu_decay_every=decay)
    probs = 1.0 / torch.arange(1, 201).float() ** 1.1
    for _ in range(30):
        ids = torch.multinomial(probs, 64, replacement=True)
        rows, counts = torch.unique(ids, return_counts=True)
        assert torch.equal(cache.lookup(rows, counts), table[rows])
        # Invariants: map and slots agree; no more residents than slots.
        res = cache.index.slot_to_row[cache.index.slot_to_row >= 0]
        assert res.numel() <= capacity and res.unique().numel() == res.numel()
        slots = cache.index.row_to_slot[res].long()
        assert torch.equal(cache.index.slot_to_row[slots], res)
        assert torch.equal(cache.slots[slots], table[res])
        assert int((cache.index.row_to_slot >= 0).sum()) == res.numel()
    c = cache.counters
    assert c.lookups == 30 * 64 and c.hits + c.misses == c.lookups
    if capacity == 200:
        assert c.evictions == 0
    assert c.lfu_decays == (30 * 64 // cache.lfu_decay_every if policy == "lfu" else 0)


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
    from serve.runtime.hostmem import _alias_via_dlpack

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
    res = cache.index.slot_to_row[:cap][cache.index.slot_to_row[:cap] >= 0]
    assert res.unique().numel() == res.numel() <= cap
    slots = cache.index.row_to_slot[res].long()
    assert torch.equal(cache.index.slot_to_row[slots], res)
    assert torch.equal(cache.slots[slots], table[res])
    assert int((cache.index.row_to_slot[: cache.total_rows] >= 0).sum()) == res.numel()
    assert int(cache.index.row_to_slot[-1]) == -1 and int(cache.index.slot_to_row[-1]) == -1  # dumps


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


# -- LFU counts: saturating, aging ----------------------------------------------------

def test_lfu_count_near_the_int32_limit_does_not_wrap():
    """The failure this fixes: one row of a tiny table takes half the lookups, its int32
    count wrapped negative, and it was evicted first and never admitted again. Simulated
    by setting the counts near 2**31 (aging off, so nothing halves them)."""
    limit = 2**31 - 1
    c = EmbeddingCache(_table(), capacity=2, policy="lfu", lfu_decay_every=0)
    _lookup(c, [0, 1])                          # both admitted (empty slots)
    c.index.row_freq[0] = limit - 10
    c.index.row_freq[1] = limit - 1
    _lookup(c, [0, 1], [100, 5])                # would wrap: saturate instead
    assert c.index.row_freq.dtype == torch.int32
    assert c.index.row_freq[:2].tolist() == [limit, limit]
    for _ in range(3):                          # cold rows keep missing: the hot ones stay
        _lookup(c, [2, 3], [1000, 1000])
        _lookup(c, [0], [2**20])                # saturated + more: still the maximum
    assert _resident(c) == [0, 1] and c.counters.evictions == 0
    assert c.index.row_freq[:4].tolist() == [limit, limit, 3000, 3000]
    before = c.counters.hits
    _lookup(c, [0, 1])                          # and they still hit
    assert c.counters.hits == before + 2


def test_lfu_saturated_counts_still_order_victims():
    """A saturated count sorts below nothing it should not: the victim key (count, slot)
    fits int64, so the cold slot is the one replaced."""
    limit = 2**31 - 1
    c = EmbeddingCache(_table(), capacity=3, policy="lfu", lfu_decay_every=0)
    _lookup(c, [0, 1, 2])
    c.index.row_freq[0] = limit
    c.index.row_freq[1] = limit
    _lookup(c, [5], [2])                        # 5 (2) beats row 2 (1), not 0 or 1
    assert _resident(c) == [0, 1, 5]


def test_lfu_aging_lets_a_formerly_hot_row_go():
    """Rows 0 and 1 were hot (1000 accesses each), then the traffic moves to 2 and 3 at
    20 accesses per lookup. Without aging, 2 and 3 would need more than 1000 accesses to
    get in; with the counts halved every 100 ids they are admitted within a few lookups."""
    def run(decay: int) -> EmbeddingCache:
        c = EmbeddingCache(_table(), capacity=2, policy="lfu", lfu_decay_every=decay)
        for _ in range(20):
            _lookup(c, [0, 1], [50, 50])        # yesterday's hot rows
        for _ in range(10):
            _lookup(c, [2, 3], [10, 10])        # today's
        return c

    never, aged = run(0), run(100)
    assert _resident(never) == [0, 1]           # stuck with yesterday's rows
    assert never.index.row_freq[:4].tolist() == [1000, 1000, 100, 100]
    assert _resident(aged) == [2, 3]
    assert aged.counters.evictions == 2 and aged.counters.lfu_decays == 22
    f = aged.index.row_freq[:4].tolist()
    assert f[2] > f[0] and f[3] > f[1]


def test_lfu_decay_happens_on_schedule():
    """Every count is halved (one right shift) once per ``lfu_decay_every`` ids, counted
    across lookups; a lookup that crosses several periods shifts several times."""
    c = EmbeddingCache(_table(), capacity=4, policy="lfu", lfu_decay_every=100)
    _lookup(c, [0, 1, 2], [40, 30, 20])         # 90 ids: no decay yet
    assert c.index.row_freq[:3].tolist() == [40, 30, 20] and c.counters.lfu_decays == 0
    _lookup(c, [0, 3], [21, 9])                 # 120 ids: one halving, 20 carried over
    assert c.index.row_freq[:4].tolist() == [30, 15, 10, 4] and c.counters.lfu_decays == 1
    # n_ids given by the caller (the runtime knows it on the host): 20 + 260 = 280 -> 2
    c.lookup(torch.tensor([1]), torch.tensor([260]), n_ids=260)
    assert c.index.row_freq[:4].tolist() == [7, 68, 2, 1] and c.counters.lfu_decays == 3
    _lookup(c, [5])                             # counts=None: 1 id, no decay (81 < 100)
    assert c.counters.lfu_decays == 3 and int(c.index.row_freq[5]) == 1
    assert torch.equal(c.slots[c.index.row_to_slot[torch.tensor([0, 1, 2, 3])].long()],
                       _table()[[0, 1, 2, 3]])   # residents unchanged by aging


def test_lfu_decay_default_and_validation():
    assert EmbeddingCache(_table(), 2, "lfu").lfu_decay_every == LFU_DECAY_PER_ROW * ROWS
    assert EmbeddingCache(_table(), 2, "lfu", lfu_decay_every=0).lfu_decay_every == 0
    with pytest.raises(ConfigError, match=r"^lfu_decay_every=-1 must be an integer >= 0"):
        EmbeddingCache(_table(), 2, "lfu", lfu_decay_every=-1)
    with pytest.raises(ConfigError, match=r"^staging_bytes 3 is smaller than one row \(4 bytes\)"):
        EmbeddingCache(_table(), 2, "lru", staging_bytes=3)


def test_closed_cache_refuses_lookups():
    c = EmbeddingCache(_table(), capacity=2)
    _lookup(c, [1])
    assert c.pinned_bytes == 0                  # nothing is page-locked on CPU
    c.close()
    c.close()                                   # idempotent
    with pytest.raises(RuntimeError, match=r"EmbeddingCache is closed"):
        c.lookup(torch.tensor([1]))
    with pytest.raises(RuntimeError, match=r"EmbeddingCache is closed"):
        c.lookup_static(torch.tensor([1]))


# -- page-locking host memory (the registry's logic, with fake driver calls) ---------------

def test_page_exclusive_empty_owns_its_pages():
    import gc
    import mmap

    from serve.runtime.hostmem import page_exclusive_empty

    t = page_exclusive_empty(1000, 68)
    assert t.shape == (1000, 68) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % mmap.PAGESIZE == 0
    assert t.untyped_storage().nbytes() == 68_000           # exactly the table, no rounding
    t.fill_(7)
    view = t[10:20]
    del t
    gc.collect()
    assert int(view.sum()) == 7 * 680                       # the tensor keeps the mapping


class _FakeDriver:
    """cudaHostRegister / cudaHostUnregister stand-ins that record their calls."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.calls: list[tuple] = []

    def register(self, ptr: int, nbytes: int) -> int:
        self.calls.append(("register", ptr, nbytes))
        return self.fail

    def unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_host_registry_registers_in_place_once_per_storage():
    from serve.runtime.hostmem import _HostRegistry, page_exclusive_empty

    drv = _FakeDriver()
    reg = _HostRegistry(drv.register, drv.unregister)
    table = page_exclusive_empty(300, 20)
    got, key = reg.acquire(table)
    assert got is table and key == table.data_ptr()          # in place: no copy
    assert drv.calls == [("register", key, 6000)]            # exactly the table's bytes
    again, key2 = reg.acquire(table)                         # a second cache, same table
    assert again is table and key2 == key and len(drv.calls) == 1
    assert reg.registered_bytes(key) == 6000
    reg.release(key)
    assert len(drv.calls) == 1 and reg.registered_bytes(key) == 6000   # one user left
    reg.release(key)
    assert drv.calls[-1] == ("unregister", key) and reg.registered_bytes(key) == 0


def test_host_registry_copies_a_table_that_shares_a_page():
    """Two tables in one page: the driver would refuse the second range, so it is copied
    into memory of its own pages and that copy is registered instead."""
    import mmap

    from serve.runtime.hostmem import _HostRegistry

    drv = _FakeDriver()
    reg = _HostRegistry(drv.register, drv.unregister)
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    a = torch.frombuffer(buf, dtype=torch.uint8, count=400).view(100, 4)
    b = torch.frombuffer(buf, dtype=torch.uint8, count=400, offset=400).view(100, 4)
    b.copy_(torch.arange(400, dtype=torch.uint8).view(100, 4))
    got_a, key_a = reg.acquire(a)
    got_b, key_b = reg.acquire(b)
    assert got_a is a and key_a == a.data_ptr()
    assert got_b is not b and torch.equal(got_b, b)                    # an exact copy
    assert got_b.data_ptr() % mmap.PAGESIZE == 0 and key_b == got_b.data_ptr()
    assert [c[0] for c in drv.calls] == ["register", "register"]
    reg.release(key_a)
    reg.release(key_b)
    assert [c[0] for c in drv.calls][2:] == ["unregister", "unregister"]


def test_host_registry_reports_a_refused_registration():
    from serve.runtime.hostmem import _HostRegistry, page_exclusive_empty

    reg = _HostRegistry(_FakeDriver(fail=2).register, _FakeDriver().unregister)
    with pytest.raises(RuntimeError, match=r"^cudaHostRegister of the 400-byte host table "
                                           r"failed \(cudaError 2: "):
        reg.acquire(page_exclusive_empty(100, 4))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_sampled_victims_of_a_large_cache_stay_exact(policy, monkeypatch):
    """Above SAMPLE_ABOVE_SLOTS a full cache ranks a window of slots, not every slot
    (lowered here so a small cache takes that path): answers stay exact, the maps agree,
    and the hot rows still end up resident (a sampled LRU/LFU, not a random one)."""
    import serve.runtime.cache as cache_mod

    monkeypatch.setattr(cache_mod, "SAMPLE_ABOVE_SLOTS", 16)
    monkeypatch.setattr(cache_mod, "SAMPLE_SLOTS_MIN", 8)
    torch.manual_seed(1)
    table = torch.randint(0, 256, (2000, 8), dtype=torch.uint8)
    cache = EmbeddingCache(table, capacity=100, policy=policy)
    probs = 1.0 / torch.arange(1, 2001).float() ** 1.2
    for _ in range(200):
        ids = torch.multinomial(probs, 32, replacement=True)
        rows, counts = torch.unique(ids, return_counts=True)
        assert torch.equal(cache.lookup(rows, counts), table[rows])
        res = cache.index.slot_to_row[cache.index.slot_to_row >= 0]
        assert res.unique().numel() == res.numel() <= 100
        assert torch.equal(cache.index.slot_to_row[cache.index.row_to_slot[res].long()], res)
        assert torch.equal(cache.slots[cache.index.row_to_slot[res].long()], table[res])
    assert int((cache.index.slot_to_row >= 0).sum()) == 100
    assert cache.counters.hits / cache.counters.lookups > 0.5   # the hottest rows stayed
