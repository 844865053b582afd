"""Splitting a batch between a rollout's arms (serve.worker.arms.handle_batch with a Split),
the worker's wiring of it (serve.worker.Worker on fake runtimes), the TorchServe adapter
(handlers/dlrm_handler.py with a fake context) and the rollout section of HandlerConfig.
Fast: fake predict callables, no model."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from serve.api.batch import MergedBatch, merge_requests
from serve.api.config import HandlerConfig, RolloutWiring
from serve.api.decode import parse_body
from serve.api.json_body import example_request
from serve.api.request import DEFAULT_SCHEMA
from serve.errors import ConfigError, InvalidInput
from serve.metrics.worker import HandlerMetrics
from serve.profiles import SPARSE_FEATURES
from serve.runtime.engine import Runtime, RuntimeStats
from serve.store.routing import (
    ROUTE_KEY_HEADER,
    ROUTE_KEY_MAX_CHARS,
    ControlWatcher,
    takes_candidate,
    write_control,
)
from serve.worker import Worker, WorkerRequest
from serve.worker.arms import Split, handle_batch

CFG = HandlerConfig(max_instances=16, max_ids_per_feature=4)
JSON = "application/json"


def _bodies(sizes: list[int], seed: int = 0) -> list[bytes]:
    return [orjson.dumps(example_request(n, seed=seed + i)) for i, n in enumerate(sizes)]


def _dense(body: bytes) -> np.ndarray:
    return parse_body(body, CFG).dense


def _score(dense: np.ndarray) -> np.ndarray:
    """A deterministic per-row score in (0, 1): tells which rows a forward saw."""
    return (1.0 / (1.0 + np.exp(-dense.sum(axis=1) / 10.0))).astype(np.float32)


@dataclass
class FakeModel:
    """A predict callable: ``offset`` + row score, or raises ``error``; records calls."""

    offset: float = 0.0
    error: Exception | None = None
    calls: list[MergedBatch] = field(default_factory=list)

    def __call__(self, m: MergedBatch) -> np.ndarray:
        self.calls.append(m)
        if self.error is not None:
            raise self.error
        return (_score(m.dense) * 0.5 + self.offset).astype(np.float32)


def _preds(out) -> np.ndarray:
    return np.array(orjson.loads(out.body)["predictions"], dtype=np.float32)


def _chooser(chosen: set[str]):
    seen: list[str | None] = []

    def choose(key: str | None) -> bool:
        seen.append(key)
        return key in chosen
    return seen, choose


def test_without_a_split_one_forward_answers_everything_as_stable():
    bodies = _bodies([2, 3, 1])
    stable = FakeModel()
    outs, info = handle_batch(bodies, [JSON] * 3, stable, CFG)
    assert [m.sizes for m in stable.calls] == [[2, 3, 1]]
    assert [o.status for o in outs] == [200] * 3 and [o.arm for o in outs] == ["stable"] * 3
    assert set(info.arms) == {"stable"} and info.mode is None
    assert info.shadow_diff is None
    assert (info.instances, info.requests) == (6, 3)
    run = info.arms["stable"]
    assert (run.requests, run.instances, run.indices, run.answered) == (3, 6, [0, 1, 2], True)
    np.testing.assert_array_equal(run.scores, np.concatenate([stable(merge_requests(
        [parse_body(b, CFG)])) for b in bodies]))


def test_canary_runs_one_forward_per_arm_and_keeps_the_order():
    sizes = [2, 3, 1, 4, 2]
    bodies = _bodies(sizes, seed=10)
    keys = ["a", "b", None, "d", "e"]
    stable, cand = FakeModel(0.0), FakeModel(0.5)
    seen, choose = _chooser({"b", "d"})
    outs, info = handle_batch(bodies, [JSON] * 5, stable, CFG, route_keys=keys,
                              split=Split("canary", cand, choose))
    assert seen == keys  # every request parsed, asked once, in order
    assert [m.sizes for m in stable.calls] == [[2, 1, 2]]
    assert [m.sizes for m in cand.calls] == [[3, 4]]
    # the right rows went to each arm
    np.testing.assert_array_equal(stable.calls[0].dense,
                                  np.concatenate([_dense(bodies[i]) for i in (0, 2, 4)]))
    np.testing.assert_array_equal(cand.calls[0].dense,
                                  np.concatenate([_dense(bodies[i]) for i in (1, 3)]))
    assert [o.arm for o in outs] == ["stable", "candidate", "stable", "candidate", "stable"]
    for i, out in enumerate(outs):
        assert out.status == 200 and out.instances == sizes[i]
        offset = 0.5 if out.arm == "candidate" else 0.0
        np.testing.assert_array_equal(_preds(out), _score(_dense(bodies[i])) * 0.5 + offset)
    assert (info.instances, info.requests, info.mode) == (12, 5, "canary")
    s, c = info.arms["stable"], info.arms["candidate"]
    assert (s.requests, s.instances, c.requests, c.instances) == (3, 5, 2, 7)
    assert c.answered and not c.failed and c.scores.shape == (7,)
    assert info.forward_s == pytest.approx(s.forward_s + c.forward_s)
    assert info.shadow_diff is None


def test_canary_with_every_request_on_one_arm_runs_only_that_arm():
    bodies = _bodies([1, 2])
    stable, cand = FakeModel(0.0), FakeModel(0.5)
    outs, info = handle_batch(bodies, [JSON] * 2, stable, CFG,
                              split=Split("canary", cand, lambda k: True))
    assert stable.calls == [] and [m.sizes for m in cand.calls] == [[1, 2]]
    assert set(info.arms) == {"candidate"} and [o.arm for o in outs] == ["candidate"] * 2
    outs, info = handle_batch(bodies, [JSON] * 2, stable, CFG,
                              split=Split("canary", cand, lambda k: False))
    assert len(cand.calls) == 1 and [m.sizes for m in stable.calls] == [[1, 2]]
    assert set(info.arms) == {"stable"}


@pytest.mark.parametrize("failing", ["candidate", "stable"])
def test_a_raising_arm_fails_only_its_own_requests(failing, caplog):
    bodies = _bodies([2, 1, 3, 1])
    boom = RuntimeError("CUDA fell over")
    stable = FakeModel(0.0, error=boom if failing == "stable" else None)
    cand = FakeModel(0.5, error=boom if failing == "candidate" else None)
    _, choose = _chooser({"k1", "k3"})
    with caplog.at_level(logging.ERROR, logger="serve.api.batch"):
        outs, info = handle_batch(bodies, [JSON] * 4, stable, CFG,
                                  route_keys=["k0", "k1", "k2", "k3"],
                                  split=Split("canary", cand, choose))
    bad = {1, 3} if failing == "candidate" else {0, 2}
    for i, out in enumerate(outs):
        if i in bad:
            assert out.status == 500 and out.arm == failing and out.instances == 0
            assert orjson.loads(out.body) == {
                "code": 500, "type": "InternalError",
                "message": f"internal error while predicting with the {failing} model; see "
                           "the TorchServe model log"}
        else:
            assert out.status == 200
    assert info.arms[failing].failed and info.arms[failing].scores is None
    assert info.arms[failing].error is boom
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1] is boom]
    assert len(logged) == 1 and failing in logged[0].getMessage()


def test_a_serve_error_of_an_arm_keeps_its_status():
    bodies = _bodies([1, 1])
    cand = FakeModel(error=InvalidInput("sparse.C3: id too large for this model"))
    outs, _ = handle_batch(bodies, [JSON] * 2, FakeModel(), CFG, route_keys=["x", "y"],
                           split=Split("canary", cand, lambda k: k == "y"))
    assert [o.status for o in outs] == [200, 400]
    assert orjson.loads(outs[1].body)["message"] == "sparse.C3: id too large for this model"


def test_a_wrong_number_of_scores_fails_that_arm_only():
    bodies = _bodies([2, 2])

    def short(m: MergedBatch) -> np.ndarray:
        return np.zeros(1, np.float32)
    outs, info = handle_batch(bodies, [JSON] * 2, FakeModel(), CFG, route_keys=["s", "c"],
                              split=Split("canary", short, lambda k: k == "c"))
    assert [o.status for o in outs] == [200, 500]
    assert "predict returned 1 scores for 2 samples" in str(info.arms["candidate"].error)


def test_without_a_split_a_raising_model_fails_the_good_requests_only():
    bodies = _bodies([1]) + [b"not json"]
    outs, info = handle_batch(bodies, [JSON] * 2, FakeModel(error=ValueError("x")), CFG)
    assert [o.status for o in outs] == [500, 400]
    assert info.requests == 1 and info.arms["stable"].failed


def test_shadow_answers_everything_from_stable_and_scores_the_sample():
    sizes = [2, 3, 1, 4]
    bodies = _bodies(sizes, seed=30)
    keys = ["a", "b", "c", "d"]
    alone_stable = FakeModel(0.0)
    alone, alone_info = handle_batch(bodies, [JSON] * 4, alone_stable, CFG, route_keys=keys)
    stable, cand = FakeModel(0.0), FakeModel(0.25)
    seen, choose = _chooser({"b", "d"})
    outs, info = handle_batch(bodies, [JSON] * 4, stable, CFG, route_keys=keys,
                              split=Split("shadow", cand, choose))
    assert seen == keys
    assert [o.body for o in outs] == [o.body for o in alone]  # bit for bit
    assert [o.status for o in outs] == [200] * 4 and [o.arm for o in outs] == ["stable"] * 4
    assert [m.sizes for m in stable.calls] == [[2, 3, 1, 4]]
    assert [m.sizes for m in cand.calls] == [[3, 4]]
    np.testing.assert_array_equal(cand.calls[0].dense,
                                  np.concatenate([_dense(bodies[i]) for i in (1, 3)]))
    assert (info.instances, info.requests, info.mode) == (10, 4, "shadow")
    assert (alone_info.instances, alone_info.requests) == (10, 4)
    c = info.arms["candidate"]
    assert not c.answered and (c.requests, c.instances, c.indices) == (2, 7, [1, 3])
    want = np.concatenate([cand(merge_requests([parse_body(bodies[i], CFG)])) -
                           alone_stable(merge_requests([parse_body(bodies[i], CFG)]))
                           for i in (1, 3)])
    np.testing.assert_allclose(info.shadow_diff, want, rtol=0, atol=1e-7)
    assert info.shadow_diff.shape == (7,)
    np.testing.assert_allclose(info.shadow_diff, 0.25, atol=1e-6)


def test_shadow_without_a_sample_never_calls_the_candidate():
    cand = FakeModel()
    outs, info = handle_batch(_bodies([1, 2]), [JSON] * 2, FakeModel(), CFG,
                              split=Split("shadow", cand, lambda k: False))
    assert cand.calls == [] and set(info.arms) == {"stable"}
    assert info.shadow_diff is None and [o.status for o in outs] == [200, 200]


def test_a_failing_shadow_candidate_affects_no_response(caplog):
    bodies = _bodies([2, 1])
    alone, _ = handle_batch(bodies, [JSON] * 2, FakeModel(), CFG)
    boom = MemoryError("candidate out of memory")
    with caplog.at_level(logging.ERROR, logger="serve.api.batch"):
        outs, info = handle_batch(bodies, [JSON] * 2, FakeModel(), CFG,
                                  split=Split("shadow", FakeModel(error=boom), lambda k: True))
    assert [o.body for o in outs] == [o.body for o in alone]
    assert info.arms["candidate"].error is boom and info.shadow_diff is None
    assert any(r.exc_info and r.exc_info[1] is boom and "shadow" in r.getMessage()
               for r in caplog.records)
    # a shadow ServeError is logged too (it reaches no client)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="serve.api.batch"):
        handle_batch(bodies, [JSON] * 2, FakeModel(), CFG,
                     split=Split("shadow", FakeModel(error=InvalidInput("no")), lambda k: True))
    assert len(caplog.records) == 1


def test_route_keys_are_checked_and_a_bad_one_fails_alone():
    bodies = _bodies([1, 1, 1, 1]) + [b"{}"]
    keys = ["ok", "x" * (ROUTE_KEY_MAX_CHARS + 44), "", "y" * ROUTE_KEY_MAX_CHARS, None]
    for split in (None, Split("canary", FakeModel(0.5), lambda k: True)):
        seen, choose = _chooser(set())
        if split is not None:
            split = Split("canary", split.candidate, choose)
        outs, info = handle_batch(bodies, [JSON] * 5, FakeModel(), CFG, route_keys=keys,
                                  split=split)
        assert [o.status for o in outs] == [200, 400, 400, 200, 400]
        assert [o.arm for o in outs] == ["stable", None, None, "stable", None]
        assert orjson.loads(outs[1].body) == {
            "code": 400, "type": "InvalidInput",
            "message": f"header {ROUTE_KEY_HEADER}: has 300 characters; at most 256 are "
                       "allowed; send a shorter key (e.g. a hash of the user id) or leave "
                       "the header out"}
        assert orjson.loads(outs[2].body)["message"] == (
            f"header {ROUTE_KEY_HEADER}: is empty; send 1 to 256 characters (e.g. a user or "
            "session id), or leave the header out")
        assert info.requests == 2
        if split is not None:
            assert seen == ["ok", "y" * ROUTE_KEY_MAX_CHARS]  # refused requests are not routed


def test_handle_batch_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match=r"2 bodies, 2 content types and 1 route keys"):
        handle_batch(_bodies([1, 1]), [JSON] * 2, FakeModel(), CFG, route_keys=["a"])
    with pytest.raises(ValueError, match=r"must be one of \['canary', 'shadow'\]"):
        Split("ab", FakeModel(), lambda k: True)


def test_keyed_requests_stick_to_their_arm_across_batches():
    rng = random.Random(5)
    keys = [f"user-{i}" for i in range(40)]
    arms_seen: dict[str, set[str | None]] = {}
    for b in range(3):
        bodies = _bodies([1] * len(keys), seed=100 * b)
        outs, _ = handle_batch(bodies, [JSON] * len(keys), FakeModel(), CFG, route_keys=keys,
                               split=Split("canary", FakeModel(0.5),
                                           lambda k: takes_candidate(k, 0.3, rng)))
        for k, o in zip(keys, outs, strict=True):
            arms_seen.setdefault(k, set()).add(o.arm)
    assert all(len(v) == 1 for v in arms_seen.values())
    assert 0 < sum(v == {"candidate"} for v in arms_seen.values()) < len(keys)


# ------------------------------------------------------------------- HandlerConfig.rollout

WIRING = {"candidate_version": "tiny-int8-s7", "candidate_artifact": "candidate/artifact.pt",
          "control_file": "/tmp/dlrm-x_b8d5w1_ctiny-int8-s7.control.json"}


def test_rollout_section_is_read_typed_and_round_trips():
    cfg = HandlerConfig.from_dict({"max_instances": 9, "rollout": dict(WIRING)})
    assert cfg.rollout == RolloutWiring(**WIRING)
    assert HandlerConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["rollout"] == WIRING
    assert HandlerConfig.from_dict({"rollout": None}).rollout is None
    assert "rollout" not in HandlerConfig().to_dict()  # archives without one are unchanged
    assert HandlerConfig().rollout is None


@pytest.mark.parametrize("change,match", [
    ({"extra": 1}, r"handler.rollout: unknown keys \['extra'\]; known keys: \['candidate_artifact'"),
    ({"candidate_version": None}, r"candidate_version=None must be a model version matching"),
    ({"candidate_version": "a_b"}, r"candidate_version='a_b' must be a model version"),
    ({"candidate_artifact": "/abs/artifact.pt"},
     r"candidate_artifact='/abs/artifact.pt' must be a normalized path relative to the model"),
    ({"candidate_artifact": "../artifact.pt"}, r"without '\.', '\.\.' or empty parts"),
    ({"candidate_artifact": "candidate//a.pt"}, r"candidate_artifact="),
    ({"candidate_artifact": ""}, r"candidate_artifact=''"),
    ({"control_file": "control.json"}, r"control_file='control.json' must be an absolute path"),
])
def test_rollout_section_is_validated(change, match):
    with pytest.raises(ConfigError, match=match):
        HandlerConfig.from_dict({"rollout": {**WIRING, **change}})


def test_rollout_section_must_be_a_complete_mapping():
    with pytest.raises(ConfigError, match=r"handler.rollout: missing keys \['control_file'\]"):
        HandlerConfig.from_dict({"rollout": {k: v for k, v in WIRING.items()
                                             if k != "control_file"}})
    with pytest.raises(ConfigError, match=r"handler.rollout must be a mapping"):
        HandlerConfig.from_dict({"rollout": "tiny-int8-s7"})
    with pytest.raises(ConfigError, match=r"handler.rollout=.* must be a RolloutWiring"):
        HandlerConfig(rollout=dict(WIRING))  # type: ignore[arg-type]


def test_build_time_model_config_carries_the_rollout():
    from serve.model.archive import model_config

    cfg = model_config(handler_config={"rollout": dict(WIRING)})
    assert cfg["handler"]["rollout"] == WIRING
    assert "rollout" not in model_config()["handler"]


# ------------------------------------------------------------------ the worker's wiring

class FakeRuntime(Runtime):
    """A Runtime without an artifact: predicts with a :class:`FakeModel`, counts every id
    as a cache hit and adds stage seconds, as the worker reads them."""

    def __init__(self, offset: float, error: Exception | None = None) -> None:
        # No super().__init__: there is no artifact to load; only what the worker reads.
        self.model = FakeModel(offset, error)
        self.stages = {"decode": 0.0, "embedding": 0.0, "dense": 0.0}
        self.hits = 0
        self.shared = None                  # no pod-wide shared tables
        self.schema = DEFAULT_SCHEMA
        self.feature_names = list(SPARSE_FEATURES)

    def predict_arrays(self, dense, values, lengths):
        self.hits += int(values.size)
        self.stages["dense"] += 0.001
        return self.model(MergedBatch(dense, lengths, values))

    def record_stage(self, name: str, seconds: float) -> None:
        self.stages[name] += seconds

    def stats(self) -> RuntimeStats:
        return RuntimeStats(lookups=self.hits, hits=self.hits, misses=0, evictions=0,
                            hit_ratio=1.0, device_bytes=100, host_bytes=0,
                            stage_seconds=dict(self.stages), wrapped=(0,) * 26)


def _worker(tmp_path, rollout: bool, candidate_error: Exception | None = None) -> Worker:
    if not rollout:
        return Worker(FakeRuntime(0.0), CFG, model_version="tiny-int8-s0",
                      metrics=HandlerMetrics(CollectorRegistry()))
    return Worker(FakeRuntime(0.0), CFG, model_version="tiny-int8-s0",
                  candidate=FakeRuntime(0.5, candidate_error), candidate_version="tiny-int8-s7",
                  watcher=ControlWatcher(tmp_path / "control.json"), rng=random.Random(0),
                  metrics=HandlerMetrics(CollectorRegistry()))


def _requests(n: int, keys: list[str | None]) -> list[WorkerRequest]:
    return [WorkerRequest(b, JSON, k) for b, k in zip(_bodies([2] * n, seed=50), keys, strict=True)]


def test_worker_without_a_rollout_answers_as_stable_and_records_the_stable_arm(tmp_path):
    w = _worker(tmp_path, rollout=False)
    out = w.handle(_requests(3, ["a", None, "x" * 300]))
    assert [r.status for r in out] == [200, 200, 400]
    assert ROUTE_KEY_HEADER in orjson.loads(out[2].body)["message"]
    assert [r.headers["X-DLRM-Model-Version"] for r in out] == ["tiny-int8-s0"] * 3
    assert [r.headers.get("X-DLRM-Arm") for r in out] == ["stable", "stable", None]
    assert out[0].headers["X-DLRM-Batch-Requests"] == "2"
    assert out[2].headers["X-DLRM-Batch-Requests"] == "2"
    assert {r.headers["X-DLRM-TorchServe-Batch"] for r in out} == {"3"}
    assert [r.content_type for r in out] == ["application/json"] * 3
    get = w.metrics.registry.get_sample_value
    labels = {"arm": "stable", "version": "tiny-int8-s0"}
    assert get("dlrm_arm_requests_total", labels) == 2
    assert get("dlrm_arm_errors_total", labels) == 0
    assert get("dlrm_arm_request_duration_seconds_count", labels) == 2
    assert get("dlrm_arm_score_count", labels) == 4
    assert get("dlrm_batch_requests_count") == 1


def test_worker_canary_names_the_answering_version_and_arm(tmp_path):
    w = _worker(tmp_path, rollout=True)
    requests = _requests(4, ["a", "b", "c", "d"])
    # no control file yet: everything to stable
    out = w.handle(requests)
    assert {r.headers["X-DLRM-Arm"] for r in out} == {"stable"}
    assert w.candidate.model.calls == []
    write_control(tmp_path / "control.json", "canary", 1.0)
    out = w.handle(requests)
    assert [r.headers["X-DLRM-Arm"] for r in out] == ["candidate"] * 4
    assert [r.headers["X-DLRM-Model-Version"] for r in out] == ["tiny-int8-s7"] * 4
    assert out[0].headers["X-DLRM-Batch-Requests"] == "4"
    for r, req in zip(out, requests, strict=True):
        np.testing.assert_allclose(orjson.loads(r.body)["predictions"],
                                   _score(_dense(req.body)) * 0.5 + 0.5, atol=1e-6)
    get = w.metrics.registry.get_sample_value
    assert get("dlrm_arm_requests_total", {"arm": "candidate", "version": "tiny-int8-s7"}) == 4
    assert get("dlrm_arm_score_count", {"arm": "candidate", "version": "tiny-int8-s7"}) == 8
    assert get("dlrm_arm_requests_total", {"arm": "stable", "version": "tiny-int8-s0"}) == 4
    # the cache counters sum both runtimes
    assert get("dlrm_cache_hits_total") == w.runtime.hits + w.candidate.hits


def test_worker_shadow_records_candidate_scores_and_diffs(tmp_path):
    w = _worker(tmp_path, rollout=True)
    write_control(tmp_path / "control.json", "shadow", 1.0)
    requests = _requests(3, [None, "k", None])
    out = w.handle(requests)
    assert [r.headers["X-DLRM-Arm"] for r in out] == ["stable"] * 3
    assert [r.headers["X-DLRM-Model-Version"] for r in out] == ["tiny-int8-s0"] * 3
    for r, req in zip(out, requests, strict=True):
        np.testing.assert_allclose(orjson.loads(r.body)["predictions"],
                                   _score(_dense(req.body)) * 0.5, atol=1e-6)
    get = w.metrics.registry.get_sample_value
    cand = {"arm": "candidate", "version": "tiny-int8-s7"}
    assert get("dlrm_arm_requests_total", cand) == 3
    assert get("dlrm_arm_score_count", cand) == 6
    assert get("dlrm_shadow_score_diff_count", {"version": "tiny-int8-s7"}) == 6
    assert get("dlrm_shadow_score_diff_bucket", {"version": "tiny-int8-s7", "le": "0.5"}) == 6
    assert get("dlrm_shadow_score_diff_bucket", {"version": "tiny-int8-s7", "le": "0.2"}) == 0


def test_worker_counts_a_failing_candidate_as_its_errors(tmp_path):
    w = _worker(tmp_path, rollout=True, candidate_error=RuntimeError("broken candidate"))
    write_control(tmp_path / "control.json", "canary", 1.0)
    requests = _requests(2, ["a", "b"])
    assert [r.status for r in w.handle(requests)] == [500, 500]
    get = w.metrics.registry.get_sample_value
    cand = {"arm": "candidate", "version": "tiny-int8-s7"}
    assert get("dlrm_arm_errors_total", cand) == 2 and get("dlrm_arm_score_count", cand) is None
    write_control(tmp_path / "control.json", "shadow", 1.0)
    assert [r.status for r in w.handle(requests)] == [200, 200]
    assert get("dlrm_arm_errors_total", cand) == 4


def test_a_workers_split_hashes_route_keys_with_the_fleet_secret(tmp_path, monkeypatch):
    """The worker reads DLRM_ROUTE_KEY_SALT once and its split routes each key as the
    salted hash says; two fleets' secrets send some keys to different arms."""
    keys = [f"user-{i}" for i in range(200)]
    write_control(tmp_path / "control.json", "canary", 0.3)
    chosen = {}
    for secret in ("fleet-a", "fleet-b"):
        monkeypatch.setenv("DLRM_ROUTE_KEY_SALT", secret)
        w = _worker(tmp_path, rollout=True)
        split = w.arms.split()
        assert split is not None
        chosen[secret] = [split.choose(k) for k in keys]
        rng = random.Random(0)
        assert chosen[secret] == [takes_candidate(k, 0.3, rng, secret.encode()) for k in keys]
    assert chosen["fleet-a"] != chosen["fleet-b"]


def test_worker_needs_every_part_of_a_rollout(tmp_path):
    with pytest.raises(ValueError, match="a rollout needs candidate, candidate_version and "
                                         "watcher together"):
        Worker(FakeRuntime(0.0), CFG, model_version="v", candidate=FakeRuntime(0.5),
               candidate_version="w")


# ------------------------------------------------------------------ the TorchServe adapter

class FakeContext:
    """What the handler uses of TorchServe's ``ts.context.Context``."""

    def __init__(self, headers: list[dict], request_ids: dict[int, str] | None = None) -> None:
        self.headers = headers
        self.request_ids = request_ids or {}
        self.status: dict[int, tuple[int, str]] = {}
        self.out: dict[int, dict[str, str]] = {}

    def get_all_request_header(self, idx: int) -> dict:
        return self.headers[idx]

    def get_request_id(self, idx: int = 0) -> str | None:
        return self.request_ids.get(idx)

    def set_response_status(self, code: int, phrase: str, idx: int) -> None:
        self.status[idx] = (code, phrase)

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.out.setdefault(idx, {})["content-type"] = value

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.out.setdefault(idx, {})[key] = value


class SpyWorker(Worker):
    """The real worker, recording the requests the handler hands over."""

    def handle(self, requests):
        self.seen = list(requests)
        return super().handle(requests)


def test_handler_translates_torchserves_batch_and_copies_the_responses_back():
    from handlers.dlrm_handler import DLRMHandler

    h = DLRMHandler()
    h.worker = SpyWorker(FakeRuntime(0.0), CFG, model_version="tiny-int8-s0",
                         metrics=HandlerMetrics(CollectorRegistry()))
    body = _bodies([2], seed=60)[0]
    data = [{"body": body}, {"data": body}, {"body": body}, {"field": b"x"}]
    headers = [{"Content-Type": JSON, "X-DLRM-Route-Key": "u1"},
               {"data": {"content-type": JSON}},     # only the parameter's type
               {"content-type": "text/plain"},
               {}]                                    # a form post, split into fields
    ctx = FakeContext(headers, {0: "r0", 1: "r1", 2: "r2"})
    bodies = h.handle(data, ctx)
    seen = h.worker.seen
    assert [(r.content_type, r.route_key, r.request_id) for r in seen] == [
        (JSON, "u1", "r0"), (JSON, None, "r1"), ("text/plain", None, "r2"),
        ("application/x-www-form-urlencoded", None, None)]
    assert seen[0].body is body and seen[3].body == b""
    assert ctx.status == {0: (200, "OK"), 1: (200, "OK"), 2: (415, "Unsupported Media Type"),
                          3: (415, "Unsupported Media Type")}
    assert ctx.out[0] == {"content-type": "application/json", "X-DLRM-TorchServe-Batch": "4",
                          "X-DLRM-Model-Version": "tiny-int8-s0", "X-DLRM-Arm": "stable",
                          "X-DLRM-Batch-Instances": "4", "X-DLRM-Batch-Requests": "2"}
    assert ctx.out[2] == {"content-type": "application/json", "X-DLRM-TorchServe-Batch": "4",
                          "X-DLRM-Model-Version": "tiny-int8-s0",
                          "X-DLRM-Batch-Instances": "4", "X-DLRM-Batch-Requests": "2"}
    np.testing.assert_allclose(orjson.loads(bodies[0])["predictions"],
                               _score(_dense(body)) * 0.5, atol=1e-6)
    assert orjson.loads(bodies[3])["code"] == 415


def test_the_handler_module_defines_exactly_one_class():
    """TorchServe's model loader refuses a handler file that defines more than one class
    ("Expected only one class in custom service code")."""
    import inspect

    import handlers.dlrm_handler as mod

    own = [n for n, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == mod.__name__]
    assert own == ["DLRMHandler"]
