"""Label shuffle (``make model LABEL_SHUFFLE=1``, ``--label-shuffle``): a real model version
trained on the same click logs with the training labels permuted, whose eval AUC is ~0.5.

Fast tests: the permutation (deterministic per seed, a true permutation, the same on every
rank, eval untouched), naming, CLI parsing, fingerprints, immutability, help, Makefile.
One slow test builds the tiny profile with shuffle and compares it with the normal build.
"""
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serve.errors import ConfigError
from serve.model.data import ClickLogDataset, DataConfig, generate, load_split
from serve.model.pipeline import STEPS, config_from_args, run_pipeline, step_fingerprints
from serve.model.pipeline import _parser as pipeline_parser
from serve.model.pipeline_config import PipelineConfig, default_workdir
from serve.model.train import (
    PLAN_FILE,
    ShuffledLabelDataset,
    TrainConfig,
    label_permutation,
    shuffled_labels,
    train_dataset,
)
from serve.model.train import _parser as train_parser
from serve.model.train import config_from_args as train_config_from_args
from serve.profiles import get_profile
from serve.store.repository import ModelRepository, default_version
from tests.fixtures.pipeline import REPO, run_in_group

TINY = get_profile("tiny")
SEED = 8
TRAIN_ROWS, EVAL_ROWS, BATCH = 3_000, 500, 64


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Tiny click logs, fewer rows than the profile (generated in about a second)."""
    d = tmp_path_factory.mktemp("shuffle") / "data"
    generate(DataConfig.for_profile(TINY, samples=TRAIN_ROWS, eval_samples=EVAL_ROWS, seed=0), d,
             progress=False)
    return d


# ----------------------------------------------------------------- the permutation

def test_permutation_is_deterministic_per_seed_and_differs_between_seeds():
    a, b = label_permutation(10_000, SEED), label_permutation(10_000, SEED)
    assert a.dtype == np.int64 and a.shape == (10_000,)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, label_permutation(10_000, SEED + 1))
    assert not np.array_equal(a, label_permutation(10_000, 0))


def test_permutation_is_a_true_permutation_not_the_identity():
    perm = label_permutation(10_000, SEED)
    assert np.array_equal(np.sort(perm), np.arange(10_000))
    assert (perm != np.arange(10_000)).mean() > 0.99


def test_shuffled_labels_keep_the_multiset_and_leave_the_input_alone():
    labels = (np.random.default_rng(0).random(10_000) < 0.3).astype(np.uint8)
    before = labels.copy()
    out = shuffled_labels(labels, SEED)
    assert np.array_equal(labels, before)  # the source (a memmap in training) is not written
    assert out.dtype == labels.dtype and out.shape == labels.shape
    assert np.array_equal(np.bincount(out, minlength=2), np.bincount(labels, minlength=2))
    assert np.array_equal(out, labels[label_permutation(10_000, SEED)])
    # a real shuffle: ~2 p (1 - p) of the rows change label (0.42 for p = 0.3)
    assert 0.35 < (out != labels).mean() < 0.49
    assert np.array_equal(out, shuffled_labels(labels, SEED))


@pytest.mark.parametrize(("n", "seed", "message"), [
    (-1, 0, r"label permutation of -1 rows: the row count must be >= 0"),
    (10, -3, r"label permutation seed -3 must be >= 0; pass --seed S with S >= 0"),
])
def test_bad_permutation_arguments_are_refused(n, seed, message):
    with pytest.raises(ConfigError, match=message):
        label_permutation(n, seed)


def test_shuffled_labels_need_one_label_per_row():
    with pytest.raises(ConfigError,
                       match=r"labels have shape \(2, 3\); expected one label per row"):
        shuffled_labels(np.zeros((2, 3), dtype=np.uint8), 0)


# ----------------------------------------------------------------- the training data, per rank

def test_every_rank_reads_its_batches_of_one_shared_permutation(data_dir):
    """Two ranks (two processes in training, two objects here) agree on the permutation,
    take the same global batches as without shuffle, and only the labels differ."""
    train = load_split(data_dir, "train")
    expected = shuffled_labels(train.labels, SEED)
    seen = []
    for rank in (0, 1):
        plain = ClickLogDataset(data_dir, "train", BATCH, rank=rank, world_size=2, drop_last=True)
        shuf = ShuffledLabelDataset(data_dir, BATCH, SEED, rank=rank, world_size=2,
                                    drop_last=True)
        again = ShuffledLabelDataset(data_dir, BATCH, SEED, rank=rank, world_size=2,
                                     drop_last=True)
        assert shuf.batches == plain.batches and len(shuf) == len(plain) > 0
        assert np.array_equal(shuf.labels, again.labels)  # seeded identically everywhere
        for i, b in enumerate(shuf.batches):
            dense, ids, lengths, labels = shuf[i]
            p_dense, p_ids, p_lengths, p_labels = plain[i]
            assert dense.equal(p_dense) and ids.equal(p_ids) and lengths.equal(p_lengths)
            assert p_labels.numpy().tolist() == train.labels[b * BATCH:(b + 1) * BATCH].tolist()
            assert labels.numpy().tolist() == expected[b * BATCH:(b + 1) * BATCH].tolist()
            seen.append(b)
    # the ranks together cover every full batch exactly once
    assert sorted(seen) == list(range(TRAIN_ROWS // BATCH // 2 * 2))


def test_train_dataset_shuffles_only_when_asked_and_never_touches_eval(data_dir, tmp_path):
    files = sorted(data_dir.glob("*.*"))
    digests = {f.name: _sha(f) for f in files}
    base = TrainConfig(profile=TINY, data_dir=data_dir, out_dir=tmp_path / "c", seed=SEED)
    plain = train_dataset(base, BATCH)
    assert type(plain) is ClickLogDataset and plain.split == "train"
    shuf = train_dataset(TrainConfig(profile=TINY, data_dir=data_dir, out_dir=tmp_path / "c",
                                     seed=SEED, label_shuffle=True), BATCH)
    assert isinstance(shuf, ShuffledLabelDataset) and shuf.split == "train"
    assert shuf.seed == SEED  # the training seed
    _ = [shuf[i] for i in range(len(shuf))]
    # nothing on disk changed: the eval split (and its labels) is what evaluation reads
    assert {f.name: _sha(f) for f in files} == digests
    ev = ClickLogDataset(data_dir, "eval", EVAL_ROWS)
    assert ev[0][3].numpy().tolist() == load_split(data_dir, "eval").labels.tolist()


def test_train_config_takes_the_profile_seed_and_validates_the_flag(tmp_path):
    cfg = TrainConfig(profile=TINY, data_dir=tmp_path, out_dir=tmp_path / "c", label_shuffle=True)
    assert cfg.resolved_seed == TINY.seed
    with pytest.raises(ConfigError, match=r"label_shuffle='yes' must be true or false; pass "
                                          r"--label-shuffle"):
        TrainConfig(profile=TINY, data_dir=tmp_path, out_dir=tmp_path / "c",
                    label_shuffle="yes")  # type: ignore[arg-type]


def test_train_cli_parses_the_flag():
    base = ["--profile", "tiny", "--data", "d", "--out", "o", "--seed", str(SEED)]
    assert train_config_from_args(train_parser().parse_args(base)).label_shuffle is False
    cfg = train_config_from_args(train_parser().parse_args([*base, "--label-shuffle"]))
    assert cfg.label_shuffle is True and cfg.resolved_seed == SEED
    assert "--label-shuffle" in train_parser().format_help()


# ----------------------------------------------------------------- pipeline: names, CLI

def test_default_version_and_workdir_with_shuffle():
    assert default_version("small", "int8", SEED, label_shuffle=True) == "small-int8-s8-shuffled"
    assert default_version("small", "int8", SEED) == "small-int8-s8"
    assert default_workdir("small", SEED, label_shuffle=True) == Path("build/small-s8-shuffled")
    assert default_workdir("small", SEED) == Path("build/small-s8")


def test_pipeline_config_names_the_shuffled_version(tmp_path):
    cfg = PipelineConfig(profile=TINY, workdir=tmp_path, seed=SEED, label_shuffle=True)
    assert cfg.version_name == "tiny-int8-s8-shuffled"
    assert cfg.mar == tmp_path / "dlrm-tiny-int8-s8-shuffled.mar"
    assert cfg.quality_check is False  # AUC ~0.5: the int8 bar would be noise
    assert PipelineConfig(profile=TINY, workdir=tmp_path, seed=SEED).quality_check is True
    named = PipelineConfig(profile=TINY, workdir=tmp_path, label_shuffle=True, version="bad.1")
    assert named.version_name == "bad.1"
    with pytest.raises(ConfigError, match=r"label_shuffle=1 must be true or false"):
        PipelineConfig(profile=TINY, workdir=tmp_path, label_shuffle=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "shuffle", "version", "workdir"), [
    (["--seed", "8", "--label-shuffle"], True, "small-int8-s8-shuffled", "build/small-s8-shuffled"),
    (["--seed", "8"], False, "small-int8-s8", "build/small-s8"),
    (["--label-shuffle"], True, "small-int8-s0-shuffled", "build/small-s0-shuffled"),
    (["--profile", "tiny", "--seed", "3", "--dtype", "fp16", "--label-shuffle"], True,
     "tiny-fp16-s3-shuffled", "build/tiny-s3-shuffled"),
    (["--seed", "8", "--label-shuffle", "--workdir", "w", "--version", "cand"], True, "cand", "w"),
])
def test_pipeline_cli_parses_the_flag(argv, shuffle, version, workdir):
    cfg = config_from_args(pipeline_parser().parse_args(argv))
    assert cfg.label_shuffle is shuffle
    assert cfg.version_name == version and cfg.workdir == Path(workdir)


def test_shuffle_is_in_every_fingerprint_from_train_on(tmp_path):
    base = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, backend="gloo"))
    shuf = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, backend="gloo",
                                            label_shuffle=True))
    assert shuf["data"] == base["data"]  # the same click logs
    assert all(shuf[s] != base[s] for s in STEPS[1:])
    # even under one name and work directory the two builds never share a step
    named = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, backend="gloo",
                                             label_shuffle=True, version="tiny-int8-s0"))
    assert all(named[s] != base[s] for s in STEPS[1:])


def test_shuffled_build_under_a_normal_versions_name_is_refused(tmp_path):
    store, w = tmp_path / "ms", tmp_path / "w"
    normal = PipelineConfig(profile=TINY, workdir=w, model_store=store, backend="gloo")
    src = tmp_path / "fake.mar"
    src.write_bytes(b"an archive stored earlier")
    ModelRepository([store]).add("tiny-int8-s0", src, {
        "version": "tiny-int8-s0", "build_fingerprint": step_fingerprints(normal)["archive"],
        "label_shuffle": False, "created_at": "2026-12-01T09:00:00+00:00"})
    assert run_pipeline(normal, say=lambda _: None).ran == []  # the normal build: up to date
    shuffled = PipelineConfig(profile=TINY, workdir=w, model_store=store, backend="gloo",
                              label_shuffle=True, version="tiny-int8-s0")
    with pytest.raises(ConfigError, match=r"version 'tiny-int8-s0' already exists and versions "
                                          r"are immutable; .* it was trained with "
                                          r"label_shuffle=False, this build has "
                                          r"label_shuffle=True\)$"):
        run_pipeline(shuffled, say=lambda _: None)
    assert not w.exists()


def test_help_documents_the_flag():
    proc = run_in_group([sys.executable, "-m", "serve.model.pipeline", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--label-shuffle" in text and "<profile>-<dtype>-s<seed>-shuffled" in text
    assert "build/<profile>-s<seed>-shuffled" in text and "AUC is ~0.5" in text


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(("value", "passed"), [
    ("1", True), ("true", True), ("yes", True), ("0", False), ("", False), ("no", False)])
def test_make_model_passes_the_flag_only_when_on(value, passed):
    proc = subprocess.run(["make", "-n", "--no-print-directory", "model", "PROFILE=small",
                           "SEED=8", f"LABEL_SHUFFLE={value}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    line = [x for x in proc.stdout.splitlines() if "serve.model.pipeline" in x][-1]
    assert line.endswith("--profile small --seed 8" + (" --label-shuffle" if passed else ""))


# ----------------------------------------------------------------- the real tiny build (slow)

@pytest.mark.slow
def test_tiny_build_with_shuffle_has_auc_near_half(tiny_build, tiny_build_shuffled):
    s, n = tiny_build_shuffled, tiny_build
    r, rn = s.report, n.report
    assert s.version == r["version"] == "tiny-int8-s0-shuffled"
    assert r["label_shuffle"] is True and rn["label_shuffle"] is False
    assert r["seed"] == rn["seed"] == 0 and r["data_seed"] == rn["data_seed"] == 0
    assert r["build_fingerprint"] != rn["build_fingerprint"]
    assert '"label_shuffle": true' in (s.checkpoint / PLAN_FILE).read_text()
    # the same click logs, eval labels included: only training saw permuted labels
    for f in sorted(n.data_dir.glob("*.*")):
        if f.name != "meta.json":  # meta.json also holds the generation time
            assert _sha(s.data_dir / f.name) == _sha(f), f.name
    # a real model that learned nothing about the features: AUC of a coin
    assert abs(r["auc_fp32"] - 0.5) <= 0.1, r["auc_fp32"]
    assert abs(r["auc_quantized"] - 0.5) <= 0.1, r["auc_quantized"]
    # ...while the normal build of the same data clearly learned
    assert rn["auc_fp32"] >= 0.65 and rn["auc_fp32"] >= r["auc_fp32"] + 0.1, (rn, r)
