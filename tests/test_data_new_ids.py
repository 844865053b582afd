"""Later days of click logs bring brand-new ids (serve.model.data): ids >= a table's rows,
cumulative over the days, deterministic in (seed, day); day 0 is unchanged."""
import json

import numpy as np

from serve.model.data import (
    _NEW_ID_MIN_ROWS,
    DataConfig,
    _Planted,
    generate,
    load_split,
    new_id_share,
)
from serve.profiles import get_profile
from tests.test_delta_build import _digest, day0_golden

TINY = get_profile("tiny")


def _gen(tmp_path, name, day, samples=3000):
    cfg = DataConfig.for_profile(TINY, samples=samples, eval_samples=1000, day=day)
    return generate(cfg, tmp_path / name, progress=False)


def test_day0_unchanged_and_has_no_new_ids_for_admission(tmp_path):
    d0 = _gen(tmp_path, "d0", 0)
    assert _digest(d0) == day0_golden()
    meta = json.loads((d0 / "meta.json").read_text())
    assert "new_ids" not in meta and meta["dtypes"]["sparse"] == "int32"
    assert set(new_id_share(d0).values()) == {0.0}
    p0 = _Planted(TINY, 0)
    for j in range(TINY.num_sparse):
        assert p0.rank_ids[j] is p0.perms[j]


def test_day1_has_ids_beyond_the_table_for_collision(tmp_path):
    d1 = _gen(tmp_path, "d1", 1, samples=20_000)
    tr = load_split(d1)
    card = np.asarray(TINY.cardinalities)
    ids = np.asarray(tr.sparse[:, :, 0], np.int64)
    p1 = _Planted(TINY, 0, day=1)
    meta = json.loads((d1 / "meta.json").read_text())
    for j, c in enumerate(TINY.cardinalities):
        new = ids[:, j] >= c
        if c < _NEW_ID_MIN_ROWS:
            assert not new.any() and meta["new_ids"][TINY.feature_names[j]] == 0
            continue
        assert new.any(), TINY.feature_names[j]
        # the new ids are exactly card, card + 1, ... (those drawn on day 1)
        assert set(np.unique(ids[new, j]).tolist()) <= set(p1.new_ids[j].tolist())
        assert p1.new_ids[j].tolist() == list(range(c, c + p1.new_ids[j].shape[0]))
        # the old ids they displaced left the traffic
        gone = p1.perms[j][p1.new_ranks[j]]
        assert not np.isin(ids[:, j], gone).any()
    assert (ids.max(axis=0) < card + np.array([len(x) for x in p1.new_ids])).all()
    share = new_id_share(d1)
    big = [share[f] for f, c in zip(TINY.feature_names, TINY.cardinalities, strict=True)
           if c >= _NEW_ID_MIN_ROWS]
    print(f"tiny day 1: new ids are {np.mean(big):.1%} of a feature's lookups on average "
          f"(min {min(big):.1%}, max {max(big):.1%})")
    assert 0.05 < np.mean(big) < 0.25


def test_new_ids_are_cumulative_and_deterministic_for_admission():
    p1, p2, p2b = _Planted(TINY, 0, day=1), _Planted(TINY, 0, day=2), _Planted(TINY, 0, day=2)
    for j, c in enumerate(TINY.cardinalities):
        n1 = p1.new_ids[j].shape[0]
        # day 2 keeps day 1's new ids at their ranks, with their effects, and adds more
        np.testing.assert_array_equal(p2.new_ids[j][:n1], p1.new_ids[j])
        np.testing.assert_array_equal(p2.new_ranks[j][:n1], p1.new_ranks[j])
        np.testing.assert_array_equal(p2.new_effects[j][:n1], p1.new_effects[j])
        if c >= _NEW_ID_MIN_ROWS:
            assert p2.new_ids[j].shape[0] > n1
            assert np.unique(p2.new_ranks[j]).shape[0] == p2.new_ranks[j].shape[0]
        np.testing.assert_array_equal(p2.rank_ids[j], p2b.rank_ids[j])
        np.testing.assert_array_equal(p2.new_effects[j], p2b.new_effects[j])
    for i in p1.new_latent:
        n1 = p1.new_latent[i].shape[0]
        np.testing.assert_array_equal(p2.new_latent[i][:n1], p1.new_latent[i])


# --- hashed ids (a profile with hashed_ids: ids as production logs carry them) ---------------

def test_hash_ids_is_a_bijection_onto_63_bits_for_collision():
    from serve.model.data import hash_ids, unhash_ids

    x = np.arange(200_000, dtype=np.int64)
    for j in (0, 7):
        h = hash_ids(j, x)
        assert h.dtype == np.int64 and h.min() >= 0
        assert np.unique(h).shape[0] == x.shape[0]
        assert np.array_equal(unhash_ids(j, h), x)
    edges = np.array([0, 1, 2**31, 2**62, 2**63 - 1], dtype=np.int64)
    assert np.array_equal(unhash_ids(3, hash_ids(3, edges)), edges)
    assert np.array_equal(hash_ids(3, unhash_ids(3, edges)), edges)
    assert not np.array_equal(hash_ids(0, x[:100]), hash_ids(1, x[:100]))   # salted per feature
    # id % rows collides hashed ids as random ids: ~1 - 1/e of them share a row
    rows = 100_000
    _, per_row = np.unique(hash_ids(0, x[:rows]) % rows, return_counts=True)
    assert 0.60 < per_row[per_row > 1].sum() / rows < 0.66


def test_hashed_logs_are_the_dense_logs_hashed_for_collision(tmp_path):
    """Same seed and day: the hashed profile's files are the dense ones with every id
    hashed, the labels and dense features byte for byte; new ids are found again."""
    import dataclasses

    from serve.model.data import hash_ids

    hashed = dataclasses.replace(TINY, name="tiny-hashed", hashed_ids=True)
    for day in (0, 1):
        plain = _gen(tmp_path, f"plain{day}", day, samples=4000)
        cfg = DataConfig.for_profile(hashed, samples=4000, eval_samples=1000, day=day)
        hd = generate(cfg, tmp_path / f"hashed{day}", progress=False)
        meta = json.loads((hd / "meta.json").read_text())
        assert meta["hashed_ids"] is True and meta["dtypes"]["sparse"] == "int64"
        for split in ("train", "eval"):
            a, b = load_split(plain, split), load_split(hd, split)
            assert np.array_equal(a.labels, b.labels) and np.array_equal(a.dense, b.dense)
            ids = np.asarray(a.sparse, np.int64)
            for j in range(TINY.num_sparse):
                assert np.array_equal(np.asarray(b.sparse[:, j], np.int64),
                                      hash_ids(j, ids[:, j]))
        assert new_id_share(hd) == new_id_share(plain)
