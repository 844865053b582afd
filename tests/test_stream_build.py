"""``make model`` streamed (issue 53, deliverable 1): the built-in DLRM's merge and quantize
read the DCP checkpoint a table chunk at a time, within ``--max-memory-bytes``.

* which builds stream (the budget, ``--stream`` / ``--no-stream``), what they refuse, and
  that the stream changes only the merge step's fingerprint and those after it;
* the streamed build of the tiny profile (its data and training reused from the cached
  in-memory build) adds a version whose table bytes are ``torch.equal`` to the in-memory
  build's, with the same AUCs, an exact merge, a report with the peak RSS, and the same
  probabilities from our runtime over the stored version (slow: it trains once when the
  cache is cold), and the same HTTP predictions when TorchServe serves it (integration);
* a refused streamed build (the AUC bar, the exactness check) leaves the model store as it
  was and removes its tables folder.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from serve.errors import ArtifactError, ConfigError, QualityError
from serve.model.pipeline import REPORT_KEYS, run_pipeline, step_fingerprints
from serve.model.pipeline_config import PipelineConfig
from serve.profiles import get_profile
from serve.store.repository import ModelRepository, extract_artifact

TINY = get_profile("tiny")
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- which builds stream (fast)
def test_the_budget_decides_which_builds_stream(tmp_path: Path) -> None:
    small, kaggle = get_profile("small"), get_profile("criteo-kaggle")
    assert not PipelineConfig(profile=TINY, workdir=tmp_path).streamed
    assert PipelineConfig(profile=TINY, workdir=tmp_path, stream=True).streamed
    # criteo-kaggle's 8.6 GB of fp32 tables exceed half of the default 2 GB: streamed.
    cfg = PipelineConfig(profile=kaggle, workdir=tmp_path)
    assert cfg.memory_budget == 2_000_000_000 and cfg.streamed
    assert not PipelineConfig(profile=kaggle, workdir=tmp_path, stream=False).streamed
    fits = 2 * small.table_bytes_fp32()
    assert not PipelineConfig(profile=small, workdir=tmp_path, max_memory_bytes=fits).streamed
    assert PipelineConfig(profile=small, workdir=tmp_path, max_memory_bytes=fits - 2).streamed
    cfg = PipelineConfig(profile=TINY, workdir=tmp_path, stream=True, version="v1")
    assert cfg.stream_tables == tmp_path / "dlrm-v1.tables"


def test_what_a_streamed_build_refuses(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--mapping managed: this build streams \(--stream\), "
                                          r"and the streamed build takes modulo id spaces only"):
        PipelineConfig(profile=TINY, workdir=tmp_path, stream=True, mapping="managed")
    with pytest.raises(ConfigError, match=r"^--dense-precision bf16: this build streams \(its "
                                          r"fp32 tables \(8,6\d\d,\d{3},\d{3} B\) exceed half of "
                                          r"--max-memory-bytes 2,000,000,000\)"):
        PipelineConfig(profile=get_profile("criteo-kaggle"), workdir=tmp_path,
                       dense_precision="bf16")
    with pytest.raises(ConfigError, match=r"--max-memory-bytes 1000 must be an integer >= "
                                          r"16777216"):
        PipelineConfig(profile=TINY, workdir=tmp_path, max_memory_bytes=1000)
    with pytest.raises(ConfigError, match=r"^stream=1 must be true or false; pass --stream, --no-stream, or neither"):
        PipelineConfig(profile=TINY, workdir=tmp_path, stream=1)  # type: ignore[arg-type]
    # the in-memory path keeps taking what it took
    PipelineConfig(profile=TINY, workdir=tmp_path, mapping="managed", dense_precision="bf16")


def test_the_stream_changes_merge_and_what_follows_only(tmp_path: Path) -> None:
    mem = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path))
    st = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, stream=True))
    assert [s for s in mem if mem[s] == st[s]] == ["data", "train"]
    # the budget sizes chunks, never bytes: it is in no fingerprint
    other = step_fingerprints(PipelineConfig(profile=TINY, workdir=tmp_path, stream=True,
                                             max_memory_bytes=1 << 24))
    assert other == st


def test_make_model_passes_stream_and_the_budget() -> None:
    out = subprocess.run(["make", "-n", "model", "PROFILE=tiny", "STREAM=1",
                          "MAX_MEMORY_BYTES=20000000"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "-m serve.model.pipeline --profile tiny --stream --max-memory-bytes 20000000" in out
    out = subprocess.run(["make", "-n", "model", "STREAM=0"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "--no-stream" in out
    helptext = subprocess.run([sys.executable, "-m", "serve.model.pipeline", "--help"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "--stream, --no-stream" in helptext and "--max-memory-bytes" in helptext


# ----------------------------------------------------------------- the streamed build (slow)
def _reuse_training(tiny_build, workdir: Path) -> None:
    """The cached build's data and checkpoint, with their step records: those steps are
    up to date, so only merge, quantize and archive run."""
    workdir.mkdir(parents=True)
    for name in ("data", "checkpoint"):
        shutil.copytree(tiny_build.workdir / name, workdir / name)
    for name in ("data.done.json", "train.done.json"):
        shutil.copy(tiny_build.workdir / name, workdir / name)


@dataclass(frozen=True)
class Streamed:
    cfg: PipelineConfig
    result: Any                 # serve.model.pipeline.PipelineResult
    root: Path                  # root / "model_store" is the repository


@pytest.fixture(scope="module")
def streamed(tiny_build, tmp_path_factory: pytest.TempPathFactory) -> Streamed:
    """The tiny profile built streamed (chunks within a 16 MiB budget), its data and
    training reused from the cached in-memory build."""
    root = tmp_path_factory.mktemp("streamed")
    _reuse_training(tiny_build, root / "work")
    cfg = PipelineConfig(profile=TINY, workdir=root / "work", model_store=root / "model_store",
                         stream=True, max_memory_bytes=1 << 24)
    return Streamed(cfg, run_pipeline(cfg, say=lambda s: None), root)


@pytest.mark.slow
def test_streamed_build_equals_the_in_memory_one(tiny_build, streamed: Streamed,
                                                 tmp_path: Path) -> None:
    from serve.model.importer import generated_batch
    from serve.runtime.artifact import load_artifact
    from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

    cfg, res = streamed.cfg, streamed.result
    assert res.ran == ["merge", "quantize", "archive"] and res.skipped == ["data", "train"]
    rep, ref = res.report, tiny_build.report
    assert set(REPORT_KEYS) <= set(rep) and rep["streamed"] is True
    assert rep["max_memory_bytes"] == 1 << 24
    assert 0 < rep["peak_rss_bytes"] == max(rep["peak_rss_bytes_steps"]["merge"],
                                            rep["peak_rss_bytes_steps"]["quantize"])
    assert rep["merged_max_abs_diff"] <= 1e-6 and rep["check"]["max_abs_diff"] <= 1e-6
    # The same rows scored by our runtime instead of TorchRec's forward: equal AUCs here.
    assert abs(rep["auc_fp32"] - ref["auc_fp32"]) <= 1e-6
    assert abs(rep["auc_quantized"] - ref["auc_quantized"]) <= 1e-6
    assert rep["baseline"]["rows"] == ref["baseline"]["rows"]
    assert rep["schema"] == ref["schema"] and rep["num_parameters"] == ref["num_parameters"]
    assert rep["table_bytes_quantized"] == ref["table_bytes_quantized"]
    assert not (cfg.workdir / "merged.pt").exists() and not cfg.stream_tables.exists()

    repo = ModelRepository([cfg.model_store])
    ours = load_artifact(extract_artifact(repo.archive(cfg.version_name), tmp_path))
    theirs = load_artifact(tiny_build.artifact)
    assert ours.files is not None and ours.schema == theirs.schema
    for a, b in zip(ours.tables, theirs.tables, strict=True):
        assert a.name == b.name and torch.equal(torch.as_tensor(a.data), b.data)
    dense, values, lengths = generated_batch(theirs.schema, 64, 3)
    probs = []
    for art in (ours, theirs):
        rt = Runtime(art, RuntimeConfig(device="cpu", cache_load_factor=1.0))
        try:
            probs.append(rt.predict(dense, SparseBatch(values, lengths)))
        finally:
            rt.close()
    assert torch.equal(probs[0], probs[1])
    ours.files.close()


@pytest.mark.slow
@pytest.mark.integration
def test_the_service_serves_a_streamed_version(tiny_build, streamed: Streamed) -> None:
    """TorchServe and the sidecar over the streamed version: HTTP predictions equal our
    runtime over the in-memory build's artifact."""
    from serve.api.binary import encode_binary
    from serve.runtime.artifact import load_artifact
    from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
    from tests.fixtures.served import serve_repository

    reference = Runtime(load_artifact(tiny_build.artifact), RuntimeConfig(device="cpu"))
    g = torch.Generator().manual_seed(5)
    lengths = torch.ones((len(TINY.feature_names), 16), dtype=torch.int32)
    values = torch.randint(0, 500, (int(lengths.sum()),), generator=g)
    dense = torch.randn(16, 13, generator=g)
    body = encode_binary(dense.numpy().astype(np.float32), lengths.numpy(), values.numpy())
    version = streamed.cfg.version_name
    with serve_repository(streamed.root, state={"model": {"version": version}}) as s:
        got = torch.tensor(s.predictions(body), dtype=torch.float32)
        assert s.state()["observed"]["model"]["version"] == version
    assert torch.equal(got, reference.predict(dense, SparseBatch(values, lengths)))
    reference.close()


def _listing(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir())


@pytest.mark.slow
def test_a_refused_streamed_build_leaves_the_store_unchanged(
        tiny_build, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import serve.model.stream_build as sb
    import serve.model.stream_import as si

    work, store = tmp_path / "work", tmp_path / "store"
    _reuse_training(tiny_build, work)
    shutil.copytree(tiny_build.repository, store)   # a store that holds a version already
    before = _listing(store)
    cfg = PipelineConfig(profile=TINY, workdir=work, model_store=store, stream=True,
                         version="refused")

    aucs = iter([0.80, 0.70])   # fp32, then int8: a drop of 0.1
    monkeypatch.setattr(sb, "roc_auc", lambda y, s: next(aucs))
    with pytest.raises(QualityError, match=r"^int8 AUC 0\.70000 is below fp32 AUC 0\.80000 - "
                                           r"0\.001 \(the quality bar\)"):
        run_pipeline(cfg, say=lambda s: None)
    assert _listing(store) == before
    assert not cfg.stream_tables.exists() and not cfg.stream_artifact.exists()
    monkeypatch.undo()

    real = si.quantize_chunk

    def off(rows: torch.Tensor, dtype: str) -> torch.Tensor:
        q = real(rows, dtype)
        q[:, 5] ^= 0x80        # int8: one code of every row, by half its range
        return q

    monkeypatch.setattr(si, "quantize_chunk", off)
    with pytest.raises(ArtifactError, match=r"differ from TorchRec's quantized forward by "
                                            r".* > 1e-06"):
        run_pipeline(cfg, say=lambda s: None)
    assert _listing(store) == before
    assert not cfg.stream_tables.exists() and not cfg.stream_artifact.exists()
