"""Warm-up before traffic (serve.runtime.warmup, Worker.load) and the test-only candidate
slowdown, on two tiny random artifacts on CPU, without TorchServe: the warm-up runs its
forwards through both runtimes, changes no answer (bitwise, through a cache that evicts)
and counts in no metric; the slowdown spins (factor - 1) x the candidate's forward."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from prometheus_client import CollectorRegistry

from serve.api.config import HandlerConfig, RolloutWiring, candidate_slowdown_from_env
from serve.api.json_body import example_request
from serve.api.request import JSON_MEDIA_TYPE
from serve.constants import ARTIFACT_NAME
from serve.errors import ConfigError
from serve.metrics.worker import HandlerMetrics
from serve.runtime.engine import Runtime, RuntimeConfig
from serve.runtime.warmup import WARMUP_SIZES, warm_up, warmup_batch
from serve.store.routing import write_control
from serve.worker import Worker, WorkerRequest
from tests.fixtures.torchserve import tiny_random_artifact

STABLE, CANDIDATE = "tiny-int8-s0", "tiny-int8-s7"
CANDIDATE_ARTIFACT = "candidate/artifact.pt"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """An unpacked archive: ``artifact.pt`` and a rollout's ``candidate/artifact.pt``."""
    d = tmp_path_factory.mktemp("model")
    (d / "candidate").mkdir()
    tiny_random_artifact(d / ARTIFACT_NAME, seed=0)
    tiny_random_artifact(d / CANDIDATE_ARTIFACT, seed=7)
    return d


def _cfg(tmp_path: Path, **kw) -> HandlerConfig:
    wiring = RolloutWiring(CANDIDATE, CANDIDATE_ARTIFACT, str(tmp_path / "control.json"))
    return HandlerConfig(num_threads=1, rollout=wiring, **kw)


def _load(model_dir: Path, cfg: HandlerConfig, environ: dict | None = None) -> Worker:
    return Worker.load(model_dir, cfg, model_version=STABLE, device="cpu", workers=1,
                       environ=environ or {}, metrics=HandlerMetrics(CollectorRegistry()),
                       freeze_gc=False)


def _requests(n: int = 8) -> list[WorkerRequest]:
    return [WorkerRequest(orjson.dumps(example_request(3, seed=i)), JSON_MEDIA_TYPE,
                          f"user-{i}") for i in range(n)]


def test_warmup_batches_fit_the_runtime_schema(model_dir):
    rt = Runtime.from_artifact(model_dir / ARTIFACT_NAME,
                               RuntimeConfig(device="cpu", num_threads=1))
    rng = np.random.default_rng(0)
    dense, values, lengths = warmup_batch(rt, 5, rng)
    nf = len(rt.feature_names)
    assert dense.shape == (5, rt.num_dense) and dense.dtype == np.float32
    assert lengths.shape == (nf, 5) and lengths.dtype == np.int32 and (lengths == 1).all()
    assert values.shape == (nf * 5,) and values.dtype == np.int64
    per_feature = values.reshape(nf, 5)
    assert (per_feature >= 0).all()
    assert all((per_feature[f] < rows).all() for f, rows in enumerate(rt.feature_rows))
    assert rt.predict_arrays(dense, values, lengths).shape == (5,)
    with pytest.raises(ValueError, match="size=0 must be >= 1"):
        warmup_batch(rt, 0, rng)

    capped = Runtime.from_artifact(model_dir / ARTIFACT_NAME, RuntimeConfig(
        device="cpu", num_threads=1, max_forward_instances=32))
    assert warm_up(capped, 0) == 0.0 and capped.stats().forwards == 0
    warm_up(capped, 4)
    st = capped.stats()
    assert st.forwards == 4 and st.samples == 1 + 32 + 32 + 1  # sizes capped at 32
    assert st.wrapped == (0,) * nf  # ids within the tables' rows
    with pytest.raises(ValueError, match="batches=-1"):
        warm_up(capped, -1)


def test_load_warms_both_runtimes_and_counts_in_no_metric(model_dir, tmp_path):
    w = _load(model_dir, _cfg(tmp_path, warmup_batches=6))
    assert w.candidate is not None
    expected = 2 * sum(WARMUP_SIZES)
    for rt in (w.runtime, w.candidate):
        st = rt.stats()
        assert (st.forwards, st.samples) == (6, expected)
        assert st.stage_seconds["dense"] > 0
    get = w.metrics.registry.get_sample_value
    assert not get("dlrm_cache_hits_total")
    assert not get("dlrm_stage_duration_seconds_count", {"stage": "dense"})
    assert not get("dlrm_batch_instances_count")

    write_control(tmp_path / "control.json", "canary", 0.5)
    out = w.handle(_requests())
    assert all(r.status == 200 for r in out)
    nf = len(w.runtime.feature_names)
    # Without a cache every lookup is a hit: only the batch's 8 x 3 instances count.
    assert get("dlrm_cache_hits_total") == 8 * 3 * nf
    assert get("dlrm_stage_duration_seconds_count", {"stage": "dense"}) == 1
    arms = {r.headers["X-DLRM-Arm"] for r in out}
    assert arms == {"stable", "candidate"}
    for arm, version in (("stable", STABLE), ("candidate", CANDIDATE)):
        labels = {"arm": arm, "version": version}
        assert get("dlrm_arm_forward_seconds_per_instance_count", labels) == 1
        assert get("dlrm_arm_forward_seconds_per_instance_sum", labels) > 0


def test_warm_up_changes_no_answer_through_a_cache_that_evicts(model_dir, tmp_path):
    """Two workers, with and without warm-up, their embedding cache on CPU and small
    (it evicts during the warm-up): bitwise the same probabilities on both arms."""
    env = {"DLRM_CACHE_ON_CPU": "1"}
    cold = _load(model_dir, _cfg(tmp_path, warmup_batches=0, cache_load_factor=0.05), env)
    warm = _load(model_dir, _cfg(tmp_path, warmup_batches=9, cache_load_factor=0.05), env)
    assert cold.runtime.cache is not None and warm.runtime.cache is not None
    assert cold.runtime.stats().forwards == 0
    assert warm.runtime.stats().evictions > 0  # the warm-up really moved the cache
    rng = np.random.default_rng(42)
    for pair in ((cold.runtime, warm.runtime), (cold.candidate, warm.candidate)):
        a, b = pair
        assert a is not None and b is not None
        for size in (1, 64, 300):
            batch = warmup_batch(a, size, rng)
            pa = torch.from_numpy(a.predict_arrays(*batch))
            pb = torch.from_numpy(b.predict_arrays(*batch))
            assert torch.equal(pa, pb), size
    write_control(tmp_path / "control.json", "canary", 0.5)
    for x, y in zip(cold.handle(_requests()), warm.handle(_requests()), strict=True):
        assert (x.status, x.headers["X-DLRM-Arm"]) == (y.status, y.headers["X-DLRM-Arm"])
        assert orjson.loads(x.body) == orjson.loads(y.body)


def test_the_candidate_slowdown_spins_the_rest_of_its_forward(model_dir, tmp_path,
                                                             monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("serve.worker.arms._spin", slept.append)
    w = _load(model_dir, _cfg(tmp_path, warmup_batches=0),
              {"DLRM_DEBUG_CANDIDATE_SLOWDOWN": "2.5"})
    assert w.candidate_slowdown == 2.5
    write_control(tmp_path / "control.json", "canary", 1.0)
    out = w.handle(_requests(4))
    assert {r.headers["X-DLRM-Arm"] for r in out} == {"candidate"}
    assert len(slept) == 1 and slept[0] > 0  # 1.5 x the forward it measured

    slept.clear()
    write_control(tmp_path / "control.json", "canary", 0.0)
    w.handle(_requests(4))
    assert slept == []  # the stable arm is never slowed

    plain = _load(model_dir, _cfg(tmp_path, warmup_batches=0))
    assert plain.candidate_slowdown == 1.0
    from_cfg = _load(model_dir, _cfg(tmp_path, warmup_batches=0, debug_candidate_slowdown=3))
    assert from_cfg.candidate_slowdown == 3.0


def test_the_knobs_are_validated():
    assert candidate_slowdown_from_env({}, 1.0) == 1.0
    assert candidate_slowdown_from_env({"DLRM_DEBUG_CANDIDATE_SLOWDOWN": " 1.5 "}, 1.0) == 1.5
    for bad in ("0.5", "fast", "nan", "101"):
        with pytest.raises(ConfigError, match=(
                rf"DLRM_DEBUG_CANDIDATE_SLOWDOWN='{bad}' must be a number in 1..100")):
            candidate_slowdown_from_env({"DLRM_DEBUG_CANDIDATE_SLOWDOWN": bad}, 1.0)
    with pytest.raises(ConfigError, match="handler.warmup_batches"):
        HandlerConfig(warmup_batches=-1)
    with pytest.raises(ConfigError, match="handler.debug_candidate_slowdown"):
        HandlerConfig(debug_candidate_slowdown=0.9)
    assert HandlerConfig().warmup_batches == 6
    assert HandlerConfig.from_dict(HandlerConfig().to_dict()) == HandlerConfig()
    # Archives built before these keys existed load with the defaults.
    assert HandlerConfig.from_dict({"max_instances": 64}).debug_candidate_slowdown == 1.0
