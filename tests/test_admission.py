"""The admission/eviction engine of managed tables (serve.model.admission), step by step."""
import numpy as np
import pytest

from serve.errors import ConfigError
from serve.model.admission import (
    FORGET_DAYS,
    AdmissionConfig,
    AdmissionState,
    load_state,
    split_counts,
)


def _ids(*pairs):
    """_ids((id, times), ...) -> the id repeated ``times`` times."""
    return np.concatenate([np.full(n, i, np.int64) for i, n in pairs])


def _state(policy="lfu_lru", rows=4, **kw):
    return AdmissionState.new(AdmissionConfig(policy=policy, **kw), {"t": rows})


def _rows(state):
    t = state.table("t")
    on = t.row > 0
    return dict(zip(t.ids[on].tolist(), t.row[on].tolist(), strict=True))


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl", "lfu_lru"])
def test_admit_at_threshold(policy):
    s = _state(policy, rows=8, threshold=3)
    s.observe(0, {"t": _ids((10, 3), (11, 2), (12, 1))})
    d = s.decide()["t"]
    assert d.admitted.tolist() == [10] and d.evicted.size == 0
    assert _rows(s) == {10: 1}  # the first free row; row 0 is the fallback
    # Counts of ids not yet admitted carry over to the next day.
    s.observe(1, {"t": _ids((11, 1), (12, 1))})
    assert s.decide()["t"].admitted.tolist() == [11]
    assert 12 not in _rows(s)


def test_admit_fills_free_rows_best_first_and_never_row_0():
    s = _state("lfu", rows=4, threshold=1)
    s.observe(0, {"t": _ids((5, 1), (6, 4), (7, 3), (8, 2))})
    d = s.decide()["t"]
    # capacity 3: the three most frequent, best first on ascending rows
    assert d.admitted.tolist() == [6, 7, 8]
    assert _rows(s) == {6: 1, 7: 2, 8: 3}
    assert s.summary()["t"] == {"admitted": 3, "capacity": 3, "occupancy": 1.0}


def test_lfu_evict_order_and_displace_rule():
    s = _state("lfu", rows=3, threshold=1)
    s.observe(0, {"t": _ids((1, 8), (2, 4))})
    s.decide()
    # day 1: freq decays to 4 and 2; id 3 seen 3 times beats id 2 (2), not id 1 (4)
    s.observe(1, {"t": _ids((3, 3), (4, 1))})
    d = s.decide()["t"]
    assert d.admitted.tolist() == [3] and d.evicted.tolist() == [2]
    assert _rows(s) == {1: 1, 3: 2}  # 3 took 2's row
    # day 2: id 5 seen once (freq 1) does not beat id 3 (freq 1.5) nor id 1 (2)
    s.observe(2, {"t": _ids((5, 1))})
    d = s.decide()["t"]
    assert d.admitted.size == 0 and d.evicted.size == 0


def test_lru_evict_oldest_last_seen():
    s = _state("lru", rows=3, threshold=1)
    s.observe(0, {"t": _ids((1, 1))})
    s.decide()
    s.observe(1, {"t": _ids((2, 9))})
    s.decide()
    assert _rows(s) == {1: 1, 2: 2}
    s.observe(2, {"t": _ids((3, 1), (2, 1))})
    d = s.decide()["t"]
    assert d.evicted.tolist() == [1] and d.admitted.tolist() == [3]  # 1 is the oldest
    # an id seen today is never displaced by LRU
    s.observe(3, {"t": _ids((2, 1), (3, 1), (4, 5))})
    d = s.decide()["t"]
    assert d.admitted.size == 0 and d.evicted.size == 0


def test_ttl_evicts_expired_ids_and_a_full_table_refuses():
    s = _state("ttl", rows=3, threshold=1, ttl_days=2)
    s.observe(0, {"t": _ids((1, 1), (2, 1))})
    s.decide()
    s.observe(1, {"t": _ids((2, 1), (3, 50))})
    d = s.decide()["t"]
    assert d.admitted.size == 0 and d.evicted.size == 0  # full: 3 is refused
    assert _rows(s) == {1: 1, 2: 2}
    s.observe(2, {"t": _ids((3, 1))})  # 1 unseen for 2 days: expired, 3 takes its row
    d = s.decide()["t"]
    assert d.evicted.tolist() == [1] and d.admitted.tolist() == [3]
    assert _rows(s) == {3: 1, 2: 2}
    s.observe(5, {"t": _ids((7, 1))})  # expired whether or not anything waits
    d = s.decide()["t"]
    assert d.evicted.tolist() == [2, 3] and d.admitted.tolist() == [7]


def test_hybrid_protects_recent_and_evicts_least_frequent_of_the_rest():
    s = _state("lfu_lru", rows=4, threshold=1, recency_days=2)
    s.observe(0, {"t": _ids((1, 9), (2, 1), (3, 5))})
    s.decide()
    s.observe(1, {"t": _ids((2, 1))})
    s.decide()
    # day 2: 2 was seen on day 1 (protected, recency 2); 1 and 3 were not: 3 is the least
    # frequent of them, so the one new id displaces 3, although 2 has the lowest freq
    s.observe(2, {"t": _ids((4, 1))})
    d = s.decide()["t"]
    assert d.evicted.tolist() == [3] and d.admitted.tolist() == [4]
    assert _rows(s) == {1: 1, 4: 2, 2: 3}  # day 0 rows went best first: 1, 3, 2
    # every resident protected: a full table admits no one
    s.observe(3, {"t": _ids((1, 1), (2, 1), (4, 1), (5, 9))})
    d = s.decide()["t"]
    assert d.admitted.size == 0 and d.evicted.size == 0


def test_evicted_id_starts_over():
    s = _state("lfu_lru", rows=2, threshold=2)
    s.observe(0, {"t": _ids((1, 2))})
    s.decide()
    s.observe(1, {"t": _ids((2, 2))})
    assert s.decide()["t"].evicted.tolist() == [1]
    s.observe(2, {"t": _ids((1, 1))})  # needs 2 fresh sightings to come back
    assert s.decide()["t"].admitted.size == 0


def test_unadmitted_ids_are_forgotten_after_forget_days():
    s = _state("lfu", rows=8, threshold=5)
    s.observe(0, {"t": _ids((1, 1))})
    s.decide()
    s.observe(FORGET_DAYS, {"t": _ids((2, 1))})
    s.decide()
    assert s.table("t").ids.tolist() == [2]


def test_state_round_trip(tmp_path):
    s = AdmissionState.new(AdmissionConfig("ttl", threshold=1, ttl_days=3), {"a": 5, "b": 3})
    s.observe(0, {"a": _ids((4, 2), (9, 1)), "b": _ids((1 << 62, 1))})
    s.decide()
    path = s.save(tmp_path / "admission.npz")
    back = load_state(path)
    assert back.config == s.config and back.day == 0 and list(back.tables) == ["a", "b"]
    for name in ("a", "b"):
        for f in ("ids", "count", "freq", "last_seen", "row"):
            np.testing.assert_array_equal(getattr(back.table(name), f),
                                          getattr(s.table(name), f))
    # the loaded state continues exactly like the original
    for st in (s, back):
        st.observe(4, {"a": _ids((5, 1))})
    assert s.decide()["a"].to_dict() == back.decide()["a"].to_dict()


def test_admission_is_deterministic():
    runs = []
    for _ in range(2):
        rng = np.random.default_rng(3)
        s = _state("lfu_lru", rows=50, threshold=2)
        for day in range(3):
            s.observe(day, {"t": rng.integers(0, 200, size=500)})
            s.decide()
        runs.append(_rows(s))
    assert runs[0] == runs[1] and len(runs[0]) == 49


def test_admit_config_and_observe_validation(tmp_path):
    with pytest.raises(ConfigError, match="--eviction 'fifo' is not one of lru, lfu, ttl, lfu_lru"):
        AdmissionConfig(policy="fifo")
    with pytest.raises(ConfigError, match="--admit-threshold"):
        AdmissionConfig(threshold=0)
    s = _state()
    with pytest.raises(ConfigError, match="before any observe"):
        s.decide()
    s.observe(1, {"t": _ids((1, 1))})
    with pytest.raises(ConfigError, match="admission day 1 is not after the last observed day 1"):
        s.observe(1, {"t": _ids((1, 1))})
    with pytest.raises(ConfigError, match="not managed tables"):
        s.observe(2, {"x": _ids((1, 1))})
    with pytest.raises(ConfigError, match="negative id"):
        s.observe(3, {"t": np.array([-1])})
    with pytest.raises(ConfigError, match="does not exist"):
        load_state(tmp_path / "nope.npz")


def test_split_counts_counts_only_valid_ids(tmp_path):
    from serve.model.data import DataConfig, generate, load_split
    from serve.profiles import get_profile

    p = get_profile("tiny")
    out = generate(DataConfig.for_profile(p, samples=500, eval_samples=50, day=1),
                   tmp_path / "d", progress=False)
    counts = split_counts(out)
    d = load_split(out)
    ids, cnt = counts["t_C1"]
    assert cnt.sum() == 500
    want_ids, want_cnt = np.unique(np.asarray(d.sparse[:, 0, 0], np.int64), return_counts=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(cnt, want_cnt)


def test_lfu_admits_what_torchrec_mch_lfu_admits():
    """One day, threshold 1, no decay: where the semantics coincide, our lfu admits the
    same ids as TorchRec's MCHManagedCollisionModule with LFU_EvictionPolicy."""
    import torch
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
    from torchrec.sparse.jagged_tensor import JaggedTensor

    rng = np.random.default_rng(0)
    # distinct counts (no ties, whose order the two engines break differently)
    ids = np.concatenate([np.full(c, i * 7 + 3, np.int64) for i, c in
                          enumerate(rng.permutation(np.arange(1, 41)))])
    rows = 16
    mch = MCHManagedCollisionModule(zch_size=rows, device=torch.device("cpu"),
                                    eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
    mch.train()
    mch({"f": JaggedTensor(values=torch.from_numpy(ids), lengths=torch.tensor([ids.size]))})
    theirs = sorted(v for v in mch._mch_sorted_raw_ids.tolist() if v != (1 << 63) - 1)
    s = _state("lfu", rows=rows, threshold=1)
    s.observe(0, {"t": ids})
    s.decide()
    assert sorted(_rows(s)) == theirs and len(theirs) == rows - 1
