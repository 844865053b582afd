"""Synthetic Criteo-like click logs: generation, memory-mapped storage, DataLoader.

Shapes: B batch, F = 26 sparse features, N = 13 dense features, M = max ids per
feature (profile.max_ids_per_feature; 1 = one-hot).

Each split (``train``, ``eval``) of a data directory holds four flat binary files read
with ``np.memmap`` plus one JSON header (``meta.json``) giving shapes and dtypes:

    {split}.dense.f32    float32 (n, N)    log1p-transformed counts, like Criteo's
    {split}.sparse.ids   int32/int64 (n, F, M) ids (int32 when every table fits)
    {split}.lengths.u8   uint8 (n, F)      ids per (sample, feature); only when M > 1
    {split}.labels.u8    uint8 (n,)        clicks, 0/1

Ids follow Zipf(alpha) per feature: ranks are drawn from a truncated zeta law and then
mapped to ids through a fixed per-feature permutation, so hot ids are spread over the
table instead of being 0..k. Labels come from a planted ground-truth model (per-id
random effects, a dense linear term and a few pairwise id interactions), so a trained
DLRM has something real to learn and AUC means something.

Days (``--day N``): day 0 is the data above. Day d >= 1 is the same world a little
later, deterministic in (seed, d) and cumulative (day d = day d-1 plus one more drift):

- new hot ids: per feature, the top-K Zipf ranks (K = 1% of the table, at least 3, at
  most a quarter of it) are swapped with ranks drawn from the cold half of the previous
  day's mapping, so ids a day-0 model barely trained become hot;
- changed effects: the planted per-id effect of a share (30%) of the ids hot on day d
  (top 2% of ranks) is redrawn;
- new ids (new users and items becoming active): per feature with >= 8 rows, n =
  max(1, round(0.4% of the table)) more of the top ranks (drawn among the 2.5% highest
  ranks not already taken by a new id, at least 4n of them) get brand-new raw ids
  ``card + k``, k counting new ids over the days (day 2 keeps day 1's new ids at their
  ranks and adds n more), each with a planted effect of its own (and a latent vector when
  the feature is in a pair). The old ids they displace leave the traffic (churn). On
  ``small`` new ids are ~10-20% of a large feature's lookups on day 1 (``new_id_share``);
  a modulo model serves them from the row ``id % card`` of an unrelated, mostly cold id.
  Day 0's ids stay < card (and its files byte for byte what they were); on day >= 1 ids
  reach ``card + new ids``, and the id dtype is chosen to hold them.

Hashed ids (a profile with ``hashed_ids``, e.g. ``small-hashed``): the files carry each id
as :func:`hash_ids` of it, a per-feature bijection onto [0, 2**63), as production logs
carry user and item ids (and Criteo its categories, as 32-bit hashes). The planted model
and the day drift are the same; only the ids written change, so ``id % rows`` folds them
at random from day 0 on. :func:`unhash_ids` inverts it (new ids are then again ids >= the
feature's id space, :func:`new_id_share`).

The dense weights and the pairwise interactions stay, so retraining only the embedding
rows can recover what drifted (and learn the new ids, once they have rows of their own). Day d's splits draw from random streams of their own.
``ensure_day_data(profile, d)`` keeps one folder per day, ``build/<profile>-data/day<d>``.

Example::

    python -m serve.model.data --profile tiny --out build/tiny/data
    python -m serve.model.data --profile tiny --day 1 --out build/tiny-data/day1
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve.common.validate import int_at_least
from serve.common.zipf import id_permutation, zeta_cdf, zipf_ranks
from serve.errors import ConfigError, ServeError
from serve.profiles import DENSE_FEATURES, NUM_DENSE, PROFILES, Profile, get_profile

__all__ = [
    "FORMAT_VERSION",
    "Batch",
    "ClickLogDataset",
    "DataConfig",
    "DataSplit",
    "columnar_rows",
    "day_data_dir",
    "ensure_day_data",
    "generate",
    "hash_ids",
    "iter_batches",
    "load_split",
    "main",
    "make_loader",
    "new_id_share",
    "unhash_ids",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_CHUNK_ROWS = 1 << 18
# Planted-model strengths, tuned so a trained DLRM reaches AUC >= 0.75 on `small` and
# clearly above 0.7 on `tiny` (see tests/test_data.py for the planted-model AUC).
_DENSE_WEIGHT = 0.45
_ID_EFFECT = 0.55
_PAIR_WEIGHT = 0.5
_LATENT = 4
_PAIRS = ((0, 1), (2, 5), (3, 7), (10, 13), (4, 11), (15, 20))
_BIAS = -1.0
# Day drift (module docstring): tuned so the day-0 `small` model loses a few AUC points on
# day 1 and embedding-only continued training on day 1 wins them back.
_DRIFT_STREAM = 0xDA7
_DAY_SPLIT_STREAM = 0xDA75
_DRIFT_HOT_SHARE = 0.01      # top ranks remapped to cold ids, per table and day
_DRIFT_MIN_HOT = 3
_DRIFT_EFFECT_RANKS = 0.02   # the "hot" ranks whose effects may be redrawn
_DRIFT_EFFECT_SHARE = 0.3    # share of those redrawn each day
# New ids (module docstring): tuned so that on `small` a large feature's lookups on day 1
# are ~10-20% brand-new ids (new_id_share; printed by tests/test_data_new_ids.py).
_NEW_ID_STREAM = 0x9E1D
_NEW_ID_SHARE = 0.004        # ranks given a brand-new id, per table and day
_NEW_ID_POOL = 0.025         # ... drawn among this share of the highest free ranks
_NEW_ID_MIN_ROWS = 8         # tables smaller than this get no new ids


# Hashed ids: a splitmix64-style mix restricted to 63 bits, so it is a bijection of
# [0, 2**63): add a per-feature salt, then xor-shift / multiply by an odd constant /
# xor-shift / multiply / xor-shift, each step invertible on 63-bit words (uint64 products
# wrap mod 2**64, whose low 63 bits are the product mod 2**63). Consecutive ids land at
# random, so ``id % rows`` collides them as it would random 64-bit ids (a plain
# multiplicative hash folds consecutive ids into a lattice with too few collisions).
_HASH_BITS = 63
_HASH_MASK = (1 << _HASH_BITS) - 1
_HASH_MULS = (0xBF58476D1CE4E5B9 & _HASH_MASK, 0x94D049BB133111EB & _HASH_MASK)   # odd
_HASH_INVS = tuple(pow(m, -1, 1 << _HASH_BITS) for m in _HASH_MULS)
_HASH_SHIFTS = (30, 27, 31)
_HASH_SALT = 0x9E3779B97F4A7C15


def _salt(feature: int) -> np.uint64:
    return np.uint64((_HASH_SALT * (feature + 1)) & _HASH_MASK)


def _unxorshift(y: np.ndarray, k: int) -> np.ndarray:
    """x from y = x ^ (x >> k) on 63-bit words."""
    x, shift = y.copy(), k
    while shift < _HASH_BITS:
        x ^= y >> np.uint64(shift)
        shift += k
    return x


def hash_ids(feature: int, ids: np.ndarray) -> np.ndarray:
    """Feature ``feature``'s ids (int64, >= 0, any shape) as the click logs of a
    ``hashed_ids`` profile carry them: int64 in [0, 2**63), a bijection per feature
    (:func:`unhash_ids` inverts it)."""
    mask = np.uint64(_HASH_MASK)
    x = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x + _salt(feature)) & mask
        x ^= x >> np.uint64(_HASH_SHIFTS[0])
        x = (x * np.uint64(_HASH_MULS[0])) & mask
        x ^= x >> np.uint64(_HASH_SHIFTS[1])
        x = (x * np.uint64(_HASH_MULS[1])) & mask
        x ^= x >> np.uint64(_HASH_SHIFTS[2])
    return x.astype(np.int64)


def unhash_ids(feature: int, raw: np.ndarray) -> np.ndarray:
    """The inverse of :func:`hash_ids`: the ids behind feature ``feature``'s hashed ids."""
    mask = np.uint64(_HASH_MASK)
    x = np.asarray(raw, dtype=np.int64).astype(np.uint64) & mask
    with np.errstate(over="ignore"):
        x = _unxorshift(x, _HASH_SHIFTS[2])
        x = (x * np.uint64(_HASH_INVS[1])) & mask
        x = _unxorshift(x, _HASH_SHIFTS[1])
        x = (x * np.uint64(_HASH_INVS[0])) & mask
        x = _unxorshift(x, _HASH_SHIFTS[0])
        x = (x - _salt(feature)) & mask
    return x.astype(np.int64)


@dataclass(frozen=True)
class DataConfig:
    """What to generate. ``samples``/``eval_samples`` default to the profile's."""

    profile: Profile
    alpha: float
    train_samples: int
    eval_samples: int
    seed: int = 0
    day: int = 0          # 0: the original logs; d >= 1: d days of drift (module docstring)

    def __post_init__(self) -> None:
        int_at_least("--day", self.day, 0,
                     then=" (0 = the original click logs, d >= 1 = d days of drift)")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ConfigError(f"--alpha {self.alpha} must be a finite number > 0 (Zipf exponent)")
        if self.train_samples < 1 or self.eval_samples < 1:
            raise ConfigError(f"sample counts must be >= 1, got train={self.train_samples} "
                              f"eval={self.eval_samples}")

    @classmethod
    def for_profile(cls, profile: Profile, alpha: float | None = None,
                    samples: int | None = None, eval_samples: int | None = None,
                    seed: int | None = None, day: int = 0) -> DataConfig:
        return cls(profile=profile, alpha=profile.zipf_alpha if alpha is None else alpha,
                   train_samples=profile.train_samples if samples is None else samples,
                   eval_samples=profile.eval_samples if eval_samples is None else eval_samples,
                   seed=profile.seed if seed is None else seed, day=day)


# ----------------------------------------------------------------------------- sampling

class _Planted:
    """The ground-truth model the labels come from (deterministic in seed and day)."""

    def __init__(self, profile: Profile, seed: int, day: int = 0) -> None:
        rng = np.random.default_rng([seed, 7])
        f = profile.num_sparse
        # Per-feature informativeness: some features matter a lot, some barely.
        self.feature_scale = rng.uniform(0.2, 1.0, size=f) * _ID_EFFECT
        self.effects = [rng.standard_normal(c).astype(np.float32) for c in profile.id_space]
        self.dense_w = (rng.standard_normal(NUM_DENSE) * _DENSE_WEIGHT).astype(np.float32)
        self.pairs = [(a, b) for a, b in _PAIRS if a < f and b < f]
        self.latent = {i: rng.standard_normal((profile.id_space[i], _LATENT)).astype(np.float32)
                       / math.sqrt(_LATENT)
                       for i in sorted({i for p in self.pairs for i in p})}
        self.perms = [id_permutation(seed, i, c) for i, c in enumerate(profile.id_space)]
        # New ids (day >= 1): per feature, the ranks taken by a brand-new id and those ids
        # (card + k, k in order of arrival), int64 (n,) each; perms stay permutations.
        f = profile.num_sparse
        self.new_ranks = [np.zeros(0, np.int64) for _ in range(f)]
        self.new_ids = [np.zeros(0, np.int64) for _ in range(f)]
        # Their planted effects (n,) and latent vectors (n, L), kept apart so the old ids'
        # arrays keep their shapes: id card + k reads entry k.
        self.new_effects = [np.zeros(0, np.float32) for _ in range(f)]
        self.new_latent = {i: np.zeros((0, _LATENT), np.float32) for i in self.latent}
        for d in range(1, day + 1):
            self._drift(profile, seed, d)
            self._new_ids(profile, seed, d)
        self.rank_ids = [self.ids_by_rank(j) for j in range(f)]

    def _drift(self, profile: Profile, seed: int, day: int) -> None:
        """Move the world from day ``day - 1`` to ``day``: new hot ids, changed effects."""
        rng = np.random.default_rng([seed, _DRIFT_STREAM, day])
        for j, card in enumerate(profile.id_space):
            prev = self.perms[j]
            perm = prev.copy()
            k = min(max(_DRIFT_MIN_HOT, round(_DRIFT_HOT_SHARE * card)), card // 4)
            if k > 0:  # the top-k ranks take ids from the cold half, and give theirs away
                cold = rng.choice(np.arange(card // 2, card), size=k, replace=False)
                perm[:k], perm[cold] = prev[cold], prev[:k]
            h = min(card, max(k, round(_DRIFT_EFFECT_RANKS * card), 1))
            redraw = perm[:h][rng.random(h) < _DRIFT_EFFECT_SHARE]
            effects = self.effects[j].copy()
            effects[redraw] = np.asarray(rng.standard_normal(redraw.shape[0]), dtype=np.float32)
            self.perms[j], self.effects[j] = perm, effects

    def _new_ids(self, profile: Profile, seed: int, day: int) -> None:
        """Day ``day``'s new ids: per feature with >= _NEW_ID_MIN_ROWS rows, n hot ranks
        drawn among the free top ranks get ids ``card + k`` with fresh effects (and latent
        vectors); the old ids at those ranks leave the traffic."""
        rng = np.random.default_rng([seed, _NEW_ID_STREAM, day])
        for j, card in enumerate(profile.id_space):
            if card < _NEW_ID_MIN_ROWS:
                continue
            n = max(1, round(_NEW_ID_SHARE * card))
            free = np.setdiff1d(np.arange(card, dtype=np.int64), self.new_ranks[j])
            pool = free[:min(free.shape[0], max(4 * n, round(_NEW_ID_POOL * card)))]
            n = min(n, pool.shape[0])
            if n == 0:
                continue
            ranks = np.sort(rng.choice(pool, size=n, replace=False)).astype(np.int64)
            start = card + self.new_ids[j].shape[0]
            ids = np.arange(start, start + n, dtype=np.int64)
            self.new_ranks[j] = np.concatenate([self.new_ranks[j], ranks])
            self.new_ids[j] = np.concatenate([self.new_ids[j], ids])
            effects = np.asarray(rng.standard_normal(n), dtype=np.float32)
            self.new_effects[j] = np.concatenate([self.new_effects[j], effects])
            if j in self.latent:
                lat = (rng.standard_normal((n, _LATENT)) / math.sqrt(_LATENT)).astype(np.float32)
                self.new_latent[j] = np.concatenate([self.new_latent[j], lat])

    def ids_by_rank(self, j: int) -> np.ndarray:
        """Feature ``j``'s raw id at each Zipf rank: int64 (card,), the permutation with the
        new ids in their ranks (day 0: the permutation itself)."""
        if not self.new_ranks[j].shape[0]:
            return self.perms[j]
        ids = self.perms[j].copy()
        ids[self.new_ranks[j]] = self.new_ids[j]
        return ids

    def max_id(self) -> int:
        """The largest raw id any feature can draw (card - 1 on day 0)."""
        return max(int(r.max()) for r in self.rank_ids)

    def logit(self, z: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """z: (n, N) standardised dense; ids: (n, F, M); lengths: (n, F) -> (n,) logits."""
        _n, f, m = ids.shape
        valid = (np.arange(m)[None, None, :] < lengths[:, :, None]).astype(np.float32)
        denom = np.maximum(lengths, 1).astype(np.float32)
        out = z @ self.dense_w + _BIAS
        effects = [np.concatenate([e, n]) if n.shape[0] else e
                   for e, n in zip(self.effects, self.new_effects, strict=True)]
        latent = {i: np.concatenate([v, self.new_latent[i]]) if self.new_latent[i].shape[0]
                  else v for i, v in self.latent.items()}
        for j in range(f):
            e = (effects[j][ids[:, j, :]] * valid[:, j, :]).sum(1) / denom[:, j]
            out += self.feature_scale[j] * e
        for a, b in self.pairs:
            ua = (latent[a][ids[:, a, :]] * valid[:, a, :, None]).sum(1) / denom[:, a, None]
            ub = (latent[b][ids[:, b, :]] * valid[:, b, :, None]).sum(1) / denom[:, b, None]
            out += _PAIR_WEIGHT * (ua * ub).sum(1)
        return out.astype(np.float32)


def _id_dtype(profile: Profile, max_id: int | None = None) -> np.dtype:
    """int32 when every id fits (``max_id``: the largest id drawn; default the largest
    table's last row, as on day 0), else int64."""
    if profile.hashed_ids:
        return np.dtype(np.int64)
    top = max(profile.id_space) if max_id is None else max_id
    return np.dtype(np.int32 if top <= np.iinfo(np.int32).max else np.int64)


def _files(out: Path, split: str, multi_hot: bool) -> dict[str, Path]:
    files = {"dense": out / f"{split}.dense.f32", "sparse": out / f"{split}.sparse.ids",
             "labels": out / f"{split}.labels.u8"}
    if multi_hot:
        files["lengths"] = out / f"{split}.lengths.u8"
    return files


def _generate_split(cfg: DataConfig, planted: _Planted, cdfs: list, out: Path, split: str,
                    n: int, split_seed: int, progress: bool) -> dict:
    p = cfg.profile
    f, m = p.num_sparse, p.max_ids_per_feature
    id_dtype = _id_dtype(p, planted.max_id() if cfg.day > 0 else None)
    files = _files(out, split, m > 1)
    mm_dense = np.memmap(files["dense"], np.float32, "w+", shape=(n, NUM_DENSE))
    mm_sparse = np.memmap(files["sparse"], id_dtype, "w+", shape=(n, f, m))
    mm_labels = np.memmap(files["labels"], np.uint8, "w+", shape=(n,))
    mm_len = np.memmap(files["lengths"], np.uint8, "w+", shape=(n, f)) if m > 1 else None
    t0 = time.perf_counter()
    positives = 0
    for c, start in enumerate(range(0, n, _CHUNK_ROWS)):
        rows = min(_CHUNK_ROWS, n - start)
        # Day 0 keeps its original streams (same bytes as before days existed).
        rng = np.random.default_rng([cfg.seed, split_seed, c] if cfg.day == 0 else
                                    [cfg.seed, split_seed, c, _DAY_SPLIT_STREAM, cfg.day])
        z = rng.standard_normal((rows, NUM_DENSE)).astype(np.float32)
        ids = np.zeros((rows, f, m), dtype=np.int64)
        if m > 1:
            lengths = rng.integers(1, m + 1, size=(rows, f)).astype(np.uint8)
        else:
            lengths = np.ones((rows, f), dtype=np.uint8)
        for j, card in enumerate(p.id_space):
            ranks = zipf_ranks(rng, rows * m, card, cfg.alpha, cdfs[j]).reshape(rows, m)
            ids[:, j, :] = planted.rank_ids[j][ranks]
        logit = planted.logit(z, ids, lengths)      # reads only ids within the lengths
        if p.hashed_ids:   # the labels come from the ids; the files carry their hashes
            for j in range(f):
                ids[:, j, :] = hash_ids(j, ids[:, j, :])
        if m > 1:  # ids beyond a sample's length are padding: store 0, never read
            ids[np.arange(m)[None, None, :] >= lengths[:, :, None]] = 0
        labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.uint8)
        # Criteo dense features are counts; ours are softplus(z) so they are >= 0 and
        # skewed like log1p(count) while staying a monotone function of z.
        mm_dense[start:start + rows] = np.log1p(np.exp(z))
        mm_sparse[start:start + rows] = ids.astype(id_dtype)
        mm_labels[start:start + rows] = labels
        if mm_len is not None:
            mm_len[start:start + rows] = lengths
        positives += int(labels.sum())
        if progress:
            done = start + rows
            el = time.perf_counter() - t0
            log.info("data %s: %d/%d rows (%.0f rows/s)", split, done, n, done / max(el, 1e-9))
    for mm in (mm_dense, mm_sparse, mm_labels, mm_len):
        if mm is not None:
            mm.flush()
    return {"rows": n, "ctr": positives / n,
            "files": {k: v.name for k, v in files.items()}}


def generate(cfg: DataConfig, out: str | os.PathLike, progress: bool = True) -> Path:
    """Write train and eval splits into ``out`` (atomically: tmp dir, then rename)."""
    out = Path(out)
    p = cfg.profile
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    planted = _Planted(p, cfg.seed, cfg.day)
    cdfs = [zeta_cdf(c, cfg.alpha) for c in p.id_space]
    splits = {}
    for split, n, s in (("train", cfg.train_samples, 1), ("eval", cfg.eval_samples, 2)):
        splits[split] = _generate_split(cfg, planted, cdfs, tmp, split, n, s, progress)
    meta = {
        "format_version": FORMAT_VERSION, "profile": p.name, "alpha": cfg.alpha,
        "seed": cfg.seed, "day": cfg.day, "num_dense": NUM_DENSE,
        "dense_features": list(DENSE_FEATURES),
        "sparse_features": list(p.feature_names), "cardinalities": list(p.id_space),
        "max_ids_per_feature": p.max_ids_per_feature,
        "dtypes": {"dense": "float32",
                   "sparse": _id_dtype(p, planted.max_id() if cfg.day > 0 else None).name,
                   "labels": "uint8", "lengths": "uint8"},
        "splits": splits, "seconds": round(time.perf_counter() - t0, 3),
    }
    if p.hashed_ids:   # only then: other profiles' meta stays byte for byte as it was
        meta["hashed_ids"] = True
    if cfg.day > 0:  # day 0's meta stays as it was
        meta["new_id_share"] = _NEW_ID_SHARE
        meta["new_ids"] = {name: int(planted.new_ids[j].shape[0])
                           for j, name in enumerate(p.feature_names)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def day_data_dir(profile_name: str, day: int) -> Path:
    """Where one day of a profile's click logs lives: ``build/<profile>-data/day<day>``."""
    return Path("build") / f"{profile_name}-data" / f"day{day}"


def ensure_day_data(profile: Profile, day: int, out: Path | None = None,
                    say: Callable[[str], None] = print) -> Path:
    """Day ``day`` of ``profile``'s click logs (the profile's data seed and sample counts,
    what the pipeline trains on), generated into ``out`` (default :func:`day_data_dir`)
    unless it is already there; returns the directory.

    An existing directory is reused when its meta.json names the same profile, seed, day,
    alpha and train/eval row counts; otherwise it is regenerated (atomically).

    Raises:
        ConfigError: ``day`` is not an integer >= 0.
    """
    cfg = DataConfig.for_profile(profile, day=day)
    out = day_data_dir(profile.name, day) if out is None else Path(out)
    want = {"profile": profile.name, "seed": cfg.seed, "day": cfg.day, "alpha": cfg.alpha,
            "train": cfg.train_samples, "eval": cfg.eval_samples,
            # a later day written before new ids existed is regenerated
            "new_id_share": _NEW_ID_SHARE if day > 0 else None}
    try:
        meta = json.loads((out / "meta.json").read_text())
        have = {"profile": meta.get("profile"), "seed": meta.get("seed"),
                "day": meta.get("day", 0), "alpha": meta.get("alpha"),
                "train": meta["splits"]["train"]["rows"], "eval": meta["splits"]["eval"]["rows"],
                "new_id_share": meta.get("new_id_share")}
        fresh = have == want and meta.get("format_version") == FORMAT_VERSION
    except (OSError, ValueError, KeyError, TypeError):
        fresh = False
    if fresh:
        say(f"data: day {day} of {profile.name} (seed {cfg.seed}) is in {out}, reused")
        return out
    t0 = time.perf_counter()
    say(f"data: generating day {day} of {profile.name} (seed {cfg.seed}, "
        f"{cfg.train_samples:,} train + {cfg.eval_samples:,} eval rows) into {out} ...")
    generate(cfg, out, progress=False)
    say(f"data: day {day} written in {time.perf_counter() - t0:.1f}s")
    return out


# ----------------------------------------------------------------------------- reading

@dataclass
class DataSplit:
    """Memory-mapped arrays of one split (read-only; no copy until indexed)."""

    dense: np.ndarray            # float32 (n, N)
    sparse: np.ndarray           # int32/int64 (n, F, M)
    labels: np.ndarray           # uint8 (n,)
    lengths: np.ndarray | None   # uint8 (n, F), None when one-hot
    feature_names: list[str]
    meta: dict

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def load_split(data_dir: str | os.PathLike, split: str = "train") -> DataSplit:
    """Map one split of a directory written by :func:`generate`."""
    d = Path(data_dir)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"data directory {d} has no meta.json; generate it with "
                          f"`python -m serve.model.data --profile P --out {d}`")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{meta_path} is not valid JSON ({e}); regenerate the data") from e
    if meta.get("format_version") != FORMAT_VERSION or split not in meta.get("splits", {}):
        raise ConfigError(f"{meta_path}: format version {meta.get('format_version')!r} or split "
                          f"{split!r} not readable by this version; regenerate the data")
    n = int(meta["splits"][split]["rows"])
    f, m = len(meta["sparse_features"]), int(meta["max_ids_per_feature"])
    files = _files(d, split, m > 1)
    shapes = {"dense": ((n, meta["num_dense"]), np.float32),
              "sparse": ((n, f, m), np.dtype(meta["dtypes"]["sparse"])),
              "labels": ((n,), np.uint8), "lengths": ((n, f), np.uint8)}
    arrays = {}
    for key, path in files.items():
        shape, dt = shapes[key]
        want = int(np.prod(shape)) * np.dtype(dt).itemsize
        if not path.is_file() or path.stat().st_size != want:
            got = path.stat().st_size if path.is_file() else "missing"
            raise ConfigError(f"data file {path} is {got} bytes, expected {want}; "
                              "regenerate the data")
        arrays[key] = np.memmap(path, dt, "r", shape=shape)
    return DataSplit(arrays["dense"], arrays["sparse"], arrays["labels"], arrays.get("lengths"),
                     list(meta["sparse_features"]), meta)


def columnar_rows(data: DataSplit, start: int, stop: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` of a split (:func:`load_split`) in the columnar
    form the runtime and the binary body take: float32 (B, N) dense, int64 ids feature by
    feature, int32 (F, B) lengths."""
    ids = np.asarray(data.sparse[start:stop])               # (B, F, M)
    b, f = ids.shape[0], ids.shape[1]
    if data.lengths is None:                                  # one-hot: M == 1
        lengths = np.ones((f, b), dtype=np.int32)
        values = ids[:, :, 0].T.reshape(-1)
    else:
        lens = np.asarray(data.lengths[start:stop]).astype(np.int32)  # (B, F)
        lengths = lens.T.copy()
        values = np.concatenate([ids[bi, fi, :lens[bi, fi]] for fi in range(f)
                                 for bi in range(b)])
    return (np.array(data.dense[start:stop], dtype=np.float32), values.astype(np.int64),
            lengths)


def new_id_share(data_dir: str | os.PathLike, split: str = "train") -> dict[str, float]:
    """Per feature, the share of a split's lookups (valid ids) that are brand-new ids,
    i.e. ids >= the feature's id space (0.0 on day 0; hashed ids are unhashed first).
    Reads the whole split."""
    d = load_split(data_dir, split)
    card = np.asarray(d.meta["cardinalities"], dtype=np.int64)
    hashed = bool(d.meta.get("hashed_ids"))
    out: dict[str, float] = {}
    for j, name in enumerate(d.feature_names):
        ids = np.asarray(d.sparse[:, j, :], dtype=np.int64)
        if d.lengths is not None:
            valid = np.arange(ids.shape[1])[None, :] < np.asarray(d.lengths[:, j])[:, None]
            ids = ids[valid]
        if hashed:
            ids = unhash_ids(j, ids)
        out[name] = float((ids >= card[j]).mean()) if ids.size else 0.0
    return out


@dataclass
class Batch:
    """One batch: dense (B, N) float32, sparse KJT (F keys), labels (B,) float32."""

    dense: torch.Tensor
    sparse: Any  # torchrec KeyedJaggedTensor (typed loosely: torchrec is imported lazily)
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class ClickLogDataset(torch.utils.data.Dataset):
    """Map-style dataset whose items are whole batches (cheap slicing of the memmap).

    Item ``i`` is batch ``indices[i]`` of size ``batch_size`` (the last may be short
    unless ``drop_last``). Items are plain tensors so DataLoader workers pickle them
    cheaply: (dense (B, N) f32, ids (B, F, M) int64, lengths (B, F) int32, labels (B,) f32).
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, batch_size: int,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False,
                 limit: int | None = None) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size {batch_size} must be >= 1")
        self.data_dir, self.split, self.batch_size = Path(data_dir), split, batch_size
        self._split: DataSplit | None = None
        n = len(self._data())
        if limit is not None:
            n = min(n, limit)
        self.rows = n
        nb = n // batch_size if drop_last else math.ceil(n / batch_size)
        # Each rank takes every world_size-th batch; equal counts keep collectives in step.
        per_rank = nb // world_size if world_size > 1 else nb
        self.batches = [rank + i * world_size for i in range(per_rank)]
        self.feature_names = self._data().feature_names

    def _data(self) -> DataSplit:
        if self._split is None:  # opened lazily so each worker maps the files itself
            self._split = load_split(self.data_dir, self.split)
        return self._split

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_split"] = None
        return state

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        d = self._data()
        b = self.batches[i]
        lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self.rows)
        dense = torch.from_numpy(np.array(d.dense[lo:hi], dtype=np.float32))
        ids = torch.from_numpy(np.array(d.sparse[lo:hi], dtype=np.int64))
        if d.lengths is None:
            lengths = torch.ones(ids.shape[:2], dtype=torch.int32)
        else:
            lengths = torch.from_numpy(np.array(d.lengths[lo:hi], dtype=np.int32))
        labels = torch.from_numpy(np.array(d.labels[lo:hi], dtype=np.float32))
        return dense, ids, lengths, labels


def to_batch(item: tuple[torch.Tensor, ...], feature_names: list[str]) -> Batch:
    """(dense, ids (B,F,M), lengths (B,F), labels) -> Batch with a feature-major KJT."""
    from serve.model.dlrm import make_kjt

    dense, ids, lengths, labels = item
    m = ids.shape[2]
    values, lens = [], []
    for j in range(ids.shape[1]):
        ln = lengths[:, j]
        if m == 1:
            values.append(ids[:, j, 0])
        else:
            mask = torch.arange(m)[None, :] < ln[:, None]
            values.append(ids[:, j, :][mask])
        lens.append(ln)
    return Batch(dense, make_kjt(feature_names, values, lens), labels)


def make_loader(dataset: Any, num_workers: int = 1,
                prefetch_factor: int = 4) -> torch.utils.data.DataLoader:
    """A DataLoader over whole batches: ``num_workers`` processes, ``prefetch_factor``
    batches each queued ahead (0 workers: read in the calling process)."""
    kwargs: dict = {}
    if num_workers > 0:
        kwargs = {"prefetch_factor": prefetch_factor, "persistent_workers": False}
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False,
                                       num_workers=num_workers, **kwargs)


def iter_batches(dataset: Any, num_workers: int = 1,
                 prefetch_factor: int = 4) -> Iterator[Batch]:
    """Batches with a KJT built in the calling process (KJTs need not cross processes).

    ``dataset``: a :class:`ClickLogDataset`, or a wrapper of one with the same items and a
    ``feature_names`` list (e.g. :class:`serve.model.train.RowMappedDataset`)."""
    for item in make_loader(dataset, num_workers, prefetch_factor):
        yield to_batch(item, dataset.feature_names)


# ----------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.data",
        description="Generate Criteo-like click logs (13 dense + 26 categorical features, "
                    "Zipf ids, labels from a planted model) into a memory-mapped directory.")
    ap.add_argument("--profile", required=True,
                    help=f"profile name: sets cardinalities and sample counts ({', '.join(PROFILES)})")
    ap.add_argument("--out", required=True, help="output directory (replaced atomically)")
    ap.add_argument("--alpha", type=float, default=None,
                    help="Zipf exponent of ids (default: the profile's, 1.05); higher = hotter head")
    ap.add_argument("--samples", type=int, default=None,
                    help="training rows (default: the profile's train_samples)")
    ap.add_argument("--eval-samples", type=int, default=None,
                    help="held-out rows (default: the profile's eval_samples)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: the profile's)")
    ap.add_argument("--day", type=int, default=0,
                    help="day of the logs (default 0, the original): day d >= 1 has d days of "
                         "drift (new hot ids, changed per-id effects; same dense weights) and "
                         "brand-new ids >= the table's rows, deterministic in (seed, day)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        cfg = DataConfig.for_profile(get_profile(args.profile), args.alpha, args.samples,
                                     args.eval_samples, args.seed, day=args.day)
        t0 = time.perf_counter()
        out = generate(cfg, args.out)
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    meta = json.loads((out / "meta.json").read_text())
    print(f"wrote {out}: train {meta['splits']['train']['rows']} rows "
          f"(ctr {meta['splits']['train']['ctr']:.3f}), eval {meta['splits']['eval']['rows']} rows, "
          f"alpha {cfg.alpha}, day {cfg.day}, {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
