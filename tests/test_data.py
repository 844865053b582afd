"""Click-log generation, the memory-mapped format, the DataLoader and AUC."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from serve.common.quality import roc_auc
from serve.common.zipf import zeta_cdf, zipf_ranks
from serve.errors import ConfigError
from serve.model.data import (
    ClickLogDataset,
    DataConfig,
    _Planted,
    generate,
    iter_batches,
    load_split,
)
from serve.profiles import get_profile

TINY = get_profile("tiny")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "tiny"
    generate(DataConfig.for_profile(TINY, samples=6000, eval_samples=2000), out, progress=False)
    return out


def test_layout_shapes_and_dtypes(tiny_data):
    meta = json.loads((tiny_data / "meta.json").read_text())
    assert meta["profile"] == "tiny" and meta["alpha"] == 1.05
    assert meta["dtypes"]["sparse"] == "int32"  # every tiny table fits in int32
    tr = load_split(tiny_data, "train")
    assert tr.dense.shape == (6000, 13) and tr.dense.dtype == np.float32
    assert tr.sparse.shape == (6000, 26, 1) and tr.sparse.dtype == np.int32
    assert tr.labels.shape == (6000,) and set(np.unique(tr.labels)) <= {0, 1}
    assert tr.lengths is None
    assert isinstance(tr.sparse, np.memmap)
    # Raw files, no padding: 13 float32 + 26 int32 + 1 uint8 per row.
    assert (tiny_data / "train.dense.f32").stat().st_size == 6000 * 13 * 4
    assert (tiny_data / "train.sparse.ids").stat().st_size == 6000 * 26 * 4
    card = np.array(TINY.cardinalities)
    assert (tr.sparse[:, :, 0] < card).all() and (tr.sparse[:, :, 0] >= 0).all()
    assert (tr.dense >= 0).all()  # log1p-like counts
    assert 0.1 < tr.labels.mean() < 0.6


def test_generation_is_deterministic(tiny_data, tmp_path):
    again = tmp_path / "again"
    generate(DataConfig.for_profile(TINY, samples=6000, eval_samples=2000), again, progress=False)
    for name in ("train.dense.f32", "train.sparse.ids", "train.labels.u8", "eval.sparse.ids"):
        assert (again / name).read_bytes() == (tiny_data / name).read_bytes()


def test_zipf_exact_cdf_matches_zeta_law():
    rows, alpha = 1000, 1.05
    rng = np.random.default_rng(0)
    ranks = zipf_ranks(rng, 400_000, rows, alpha, zeta_cdf(rows, alpha))
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    freq = np.bincount(ranks, minlength=rows) / ranks.size
    # Binomial standard error of the top ranks' frequencies is < 1e-3 here.
    np.testing.assert_allclose(freq[:5], p[:5], atol=3e-3)
    assert ranks.min() == 0 and ranks.max() <= rows - 1


def test_zipf_continuous_tail_approximation_is_close():
    rows, alpha = 1000, 1.05
    rng = np.random.default_rng(1)
    exact = np.bincount(zipf_ranks(rng, 400_000, rows, alpha, zeta_cdf(rows, alpha)), minlength=rows)
    approx = np.bincount(zipf_ranks(rng, 400_000, rows, alpha, None), minlength=rows)
    # Used only for tables > 2M rows; the head mass (top 10%) agrees within 3 points.
    assert abs(exact[:100].sum() - approx[:100].sum()) / 400_000 < 0.03


def test_hot_ids_are_permuted_not_0_to_k(tiny_data):
    tr = load_split(tiny_data, "train")
    col = np.asarray(tr.sparse[:, 0, 0])  # C1: 500 rows
    counts = np.bincount(col, minlength=500)
    hottest = np.argsort(-counts)[:5]
    assert set(hottest.tolist()) != set(range(5))
    assert counts.max() > 20 * np.median(counts[counts > 0])  # skewed: a real head


def test_alpha_changes_skew(tmp_path):
    lo, hi = tmp_path / "lo", tmp_path / "hi"
    generate(DataConfig.for_profile(TINY, alpha=0.5, samples=3000, eval_samples=100), lo, progress=False)
    generate(DataConfig.for_profile(TINY, alpha=1.5, samples=3000, eval_samples=100), hi, progress=False)

    def top_share(d):
        c = np.bincount(np.asarray(load_split(d).sparse[:, 0, 0]), minlength=500)
        return np.sort(c)[-10:].sum() / c.sum()
    assert top_share(hi) > top_share(lo) + 0.3


def test_planted_model_is_learnable(tiny_data):
    """The oracle (the planted logit itself) separates clicks well, so AUC can be high."""
    ev = load_split(tiny_data, "eval")
    planted = _Planted(TINY, TINY.seed)
    z = np.log(np.expm1(np.asarray(ev.dense, dtype=np.float64))).astype(np.float32)  # undo softplus
    logit = planted.logit(z, np.asarray(ev.sparse, dtype=np.int64), np.ones((len(ev), 26), np.uint8))
    assert roc_auc(ev.labels, logit) > 0.8


def test_loader_yields_kjt_batches(tiny_data):
    ds = ClickLogDataset(tiny_data, "train", batch_size=512, rank=1, world_size=2, drop_last=True)
    assert len(ds) == 5  # 11 full batches of 512 in 6000 rows -> 5 per rank
    batches = list(iter_batches(ds, num_workers=1, prefetch_factor=2))
    assert len(batches) == 5
    b = batches[0]
    assert b.dense.shape == (512, 13) and b.dense.dtype == torch.float32
    assert b.labels.shape == (512,)
    assert b.sparse.keys() == [f"C{i}" for i in range(1, 27)]
    assert b.sparse.lengths().shape == (26 * 512,)
    # rank 1 takes batch 1 (rows 512..1023); KJT is feature-major
    tr = load_split(tiny_data, "train")
    c3 = b.sparse["C3"].values()
    assert torch.equal(c3, torch.from_numpy(np.asarray(tr.sparse[512:1024, 2, 0], dtype=np.int64)))


def test_multi_hot_honours_max_ids_per_feature(tmp_path):
    prof = dataclasses.replace(TINY, max_ids_per_feature=3)
    generate(DataConfig.for_profile(prof, samples=1000, eval_samples=100), tmp_path / "mh", progress=False)
    tr = load_split(tmp_path / "mh")
    assert tr.sparse.shape == (1000, 26, 3) and tr.lengths.shape == (1000, 26)
    assert tr.lengths.min() == 1 and tr.lengths.max() == 3
    b = next(iter_batches(ClickLogDataset(tmp_path / "mh", "train", 100), num_workers=0))
    assert int(b.sparse.lengths().sum()) == int(np.asarray(tr.lengths[:100]).sum())
    assert b.sparse["C1"].values().numel() == int(np.asarray(tr.lengths[:100, 0]).sum())


def test_truncated_file_is_named(tiny_data, tmp_path):
    import shutil
    d = tmp_path / "d"
    shutil.copytree(tiny_data, d)
    with open(d / "train.labels.u8", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match=r"data file .*train\.labels\.u8 is 10 bytes, expected 6000; "
                                          r"regenerate the data"):
        load_split(d, "train")


def test_missing_data_dir_says_how_to_make_it(tmp_path):
    with pytest.raises(ConfigError, match=r"has no meta\.json; generate it with `python -m serve\.model\.data"):
        load_split(tmp_path / "none")


def test_bad_alpha_is_rejected():
    with pytest.raises(ConfigError, match=r"--alpha -1.0 must be a finite number > 0"):
        DataConfig.for_profile(TINY, alpha=-1.0)


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 300)
    s = np.round(rng.normal(size=300) + y, 1)  # rounding makes ties
    pos, neg = s[y == 1], s[y == 0]
    diff = pos[:, None] - neg[None, :]
    want = ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size
    assert roc_auc(y, s) == pytest.approx(want, abs=1e-12)
    assert roc_auc([0, 1], [0.2, 0.9]) == 1.0 and roc_auc([0, 1], [0.9, 0.2]) == 0.0


def test_roc_auc_needs_both_classes():
    with pytest.raises(ConfigError, match=r"needs both classes, got 3 positives and 0 negatives"):
        roc_auc([1, 1, 1], [0.1, 0.2, 0.3])


def test_cli_unknown_profile_fails_with_the_choices(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "serve.model.data", "--profile", "huge", "--out",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "error: profile 'huge' does not exist; choose one of: tiny, small, small-half, small-hashed, criteo-kaggle" in proc.stderr


def test_cli_help():
    proc = subprocess.run([sys.executable, "-m", "serve.model.data", "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "--alpha" in proc.stdout and "Zipf" in proc.stdout


def test_cli_day_writes_that_day(tmp_path):
    out = tmp_path / "d1"
    proc = subprocess.run([sys.executable, "-m", "serve.model.data", "--profile", "tiny",
                           "--samples", "500", "--eval-samples", "200", "--day", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "day 1" in proc.stdout
    assert json.loads((out / "meta.json").read_text())["day"] == 1
    bad = subprocess.run([sys.executable, "-m", "serve.model.data", "--profile", "tiny",
                          "--day", "-2", "--out", str(tmp_path / "x")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--day -2 must be an integer >= 0" in bad.stderr


def test_day_must_be_an_integer():
    with pytest.raises(ConfigError, match="--day True"):
        DataConfig.for_profile(TINY, day=True)
