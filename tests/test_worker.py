"""serve.worker.Worker on a real tiny artifact, on CPU, without TorchServe: loading from a
model dir, a batch of good and bad requests, a rollout's split by the control file, the
prediction log, deltas applied at start, and the 500 a bug gets."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from prometheus_client import CollectorRegistry

from serve.api.binary import example_binary
from serve.api.config import HandlerConfig, RolloutWiring
from serve.api.decode import parse_body
from serve.api.json_body import example_request
from serve.api.request import BINARY_MEDIA_TYPE, JSON_MEDIA_TYPE
from serve.constants import ARTIFACT_NAME
from serve.errors import ConfigError
from serve.metrics.worker import HandlerMetrics
from serve.runtime.artifact import load_artifact, quantize_rows_reference, row_bytes
from serve.runtime.engine import Runtime, RuntimeConfig
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import Delta, DeltaTable, encode_delta
from serve.store.predlog import iter_log
from serve.store.routing import key_point, write_control
from serve.worker import Worker, WorkerRequest, model_version, worker_device
from tests.fixtures.deltas import store_delta, with_delta_rows
from tests.fixtures.torchserve import tiny_random_artifact

STABLE, CANDIDATE = "tiny-int8-s0", "tiny-int8-s7"
# One thread: Worker.load sets the test process's torch threads.
CFG = HandlerConfig(num_threads=1, max_instances=64)
WIDE = HandlerConfig(max_instances=1024)
CANDIDATE_ARTIFACT = "candidate/artifact.pt"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """{version: artifact path} of two tiny random models (seeds 0 and 7)."""
    d = tmp_path_factory.mktemp("artifacts")
    return {STABLE: tiny_random_artifact(d / "s0.pt", seed=0),
            CANDIDATE: tiny_random_artifact(d / "s7.pt", seed=7)}


@pytest.fixture
def model_dir(tmp_path, artifacts) -> Path:
    """An unpacked archive: ``artifact.pt`` and a rollout's ``candidate/artifact.pt``."""
    d = tmp_path / "model"
    (d / "candidate").mkdir(parents=True)
    shutil.copyfile(artifacts[STABLE], d / ARTIFACT_NAME)
    shutil.copyfile(artifacts[CANDIDATE], d / CANDIDATE_ARTIFACT)
    return d


def _load(model_dir: Path, cfg: HandlerConfig = CFG, environ: dict | None = None) -> Worker:
    return Worker.load(model_dir, cfg, model_version=STABLE, device="cpu", workers=1,
                       environ=environ or {}, metrics=HandlerMetrics(CollectorRegistry()),
                       freeze_gc=False)


def _reference(path: Path, body: bytes, ctype: str = JSON_MEDIA_TYPE) -> np.ndarray:
    """The probabilities of a runtime of its own on the artifact."""
    rt = Runtime.from_artifact(path, RuntimeConfig(device="cpu", num_threads=1))
    p = parse_body(body, WIDE, ctype)
    return rt.predict_arrays(p.dense, p.values, p.lengths)


def _preds(body: bytes) -> np.ndarray:
    return np.array(orjson.loads(body)["predictions"], dtype=np.float32)


def test_a_batch_of_good_and_bad_requests(model_dir, artifacts):
    w = _load(model_dir)
    cpu_before = w.runtime.stats().predict_cpu_seconds     # the warm-up's: not counted
    rows = orjson.dumps(example_request(2, seed=1))
    columnar = orjson.dumps(example_request(3, seed=2, form="columnar"))
    binary = example_binary(1, seed=3)
    bad_id = orjson.dumps({"instances": [{**example_request(1)["instances"][0], "dense": [1]}]})
    out = w.handle([
        WorkerRequest(rows, JSON_MEDIA_TYPE, "user-1", "r0"),
        WorkerRequest(bad_id, JSON_MEDIA_TYPE),
        WorkerRequest(binary, BINARY_MEDIA_TYPE),
        WorkerRequest(rows, "text/plain"),
        WorkerRequest(rows, None, ""),
        WorkerRequest(columnar.decode(), None),           # a str body is JSON text
        WorkerRequest(b"x" * (CFG.max_body_bytes + 1), JSON_MEDIA_TYPE),
    ])
    assert [r.status for r in out] == [200, 400, 200, 415, 400, 200, 413]
    assert [r.reason for r in out] == ["OK", "Bad Request", "OK", "Unsupported Media Type",
                                       "Bad Request", "OK", "Payload Too Large"]
    assert {r.content_type for r in out} == {"application/json"}
    for i, (body, ctype) in {0: (rows, JSON_MEDIA_TYPE), 2: (binary, BINARY_MEDIA_TYPE),
                             5: (columnar, JSON_MEDIA_TYPE)}.items():
        np.testing.assert_allclose(_preds(out[i].body), _reference(artifacts[STABLE], body, ctype),
                                   rtol=0, atol=1e-6)
        assert out[i].headers == {"X-DLRM-TorchServe-Batch": "7", "X-DLRM-Model-Version": STABLE,
                                  "X-DLRM-Arm": "stable", "X-DLRM-Batch-Instances": "6",
                                  "X-DLRM-Batch-Requests": "3"}
    # a refused request names the stable version and no arm
    assert out[1].headers == {"X-DLRM-TorchServe-Batch": "7", "X-DLRM-Model-Version": STABLE,
                              "X-DLRM-Batch-Instances": "6", "X-DLRM-Batch-Requests": "3"}
    assert orjson.loads(out[1].body) == {
        "code": 400, "type": "InvalidInput",
        "message": "instances[0].dense: has 1 values; it must have exactly 13 (the model's "
                   "dense features)"}
    assert orjson.loads(out[3].body)["type"] == "UnsupportedMediaType"
    assert "X-DLRM-Route-Key: is empty" in orjson.loads(out[4].body)["message"]
    get = w.metrics.registry.get_sample_value
    assert get("dlrm_requests_total", {"code": "200"}) == 3
    assert get("dlrm_requests_total", {"code": "400"}) == 2
    assert get("dlrm_requests_total", {"code": "415"}) == 1
    assert get("dlrm_requests_total", {"code": "413"}) == 1
    assert get("dlrm_instances_total") == 6
    assert get("dlrm_batch_requests_count") == 1 and get("dlrm_batch_instances_sum") == 6
    assert get("dlrm_arm_requests_total", {"arm": "stable", "version": STABLE}) == 3
    assert get("dlrm_stage_duration_seconds_count", {"stage": "decode"}) == 1
    assert w.runtime.stats().stage_seconds["decode"] > 0
    # the CPU the batch spent in predict, counted once in the worker's counter
    assert get("dlrm_predict_cpu_seconds_total") == pytest.approx(
        w.runtime.stats().predict_cpu_seconds - cpu_before, abs=1e-9) and cpu_before >= 0


def test_a_rollout_control_file_splits_the_batch(model_dir, artifacts, tmp_path):
    control = tmp_path / "control.json"
    cfg = HandlerConfig(num_threads=1, rollout=RolloutWiring(CANDIDATE, CANDIDATE_ARTIFACT,
                                                             str(control)))
    w = _load(model_dir, cfg)
    keys = [f"user-{i}" for i in range(16)]
    bodies = [orjson.dumps(example_request(1, seed=i)) for i in range(16)]
    requests = [WorkerRequest(b, JSON_MEDIA_TYPE, k) for b, k in zip(bodies, keys, strict=True)]
    stable = [_reference(artifacts[STABLE], b) for b in bodies]
    candidate = [_reference(artifacts[CANDIDATE], b) for b in bodies]

    out = w.handle(requests)  # no control file yet: every request on the stable arm
    assert {r.headers["X-DLRM-Arm"] for r in out} == {"stable"}

    write_control(control, "canary", 0.5)
    out = w.handle(requests)
    # keyed requests: the key's hash decides, whatever the rng
    chosen = [key_point(k) < 0.5 for k in keys]
    assert 0 < sum(chosen) < len(keys)
    assert [r.headers["X-DLRM-Arm"] for r in out] == [
        "candidate" if c else "stable" for c in chosen]
    for r, c, s, cand in zip(out, chosen, stable, candidate, strict=True):
        assert r.status == 200
        assert r.headers["X-DLRM-Model-Version"] == (CANDIDATE if c else STABLE)
        assert r.headers["X-DLRM-Batch-Requests"] == str(sum(chosen) if c else 16 - sum(chosen))
        np.testing.assert_allclose(_preds(r.body), cand if c else s, rtol=0, atol=1e-6)

    write_control(control, "shadow", 1.0)
    out = w.handle(requests)
    assert {r.headers["X-DLRM-Arm"] for r in out} == {"stable"}
    for r, s in zip(out, stable, strict=True):
        np.testing.assert_allclose(_preds(r.body), s, rtol=0, atol=1e-6)
    get = w.metrics.registry.get_sample_value
    assert get("dlrm_arm_requests_total", {"arm": "candidate", "version": CANDIDATE}) == \
        sum(chosen) + 16
    assert get("dlrm_shadow_score_diff_count", {"version": CANDIDATE}) == 16


def test_scored_requests_go_to_the_prediction_log(model_dir, tmp_path):
    log_dir = tmp_path / "predlog"
    w = _load(model_dir, environ={"DLRM_PREDICTION_LOG_DIR": str(log_dir)})
    body = orjson.dumps(example_request(2, seed=4))
    out = w.handle([WorkerRequest(body, JSON_MEDIA_TYPE, request_id="req-1"),
                    WorkerRequest(b"{}", JSON_MEDIA_TYPE, request_id="req-2"),
                    WorkerRequest(body, JSON_MEDIA_TYPE)])    # no id: not logged
    assert [r.status for r in out] == [200, 400, 200]
    logged = list(iter_log(log_dir))
    assert [(p.request_id, p.version, p.arm) for p in logged] == [("req-1", STABLE, "stable")]
    np.testing.assert_array_equal(logged[0].scores, _preds(out[0].body))


def _delta(path: Path, version: str, sequence: int = 1) -> Delta:
    """New random rows for 30% of table 0 and 3 of ``path``'s artifact."""
    art = load_artifact(path)
    g = torch.Generator().manual_seed(sequence)
    tables = []
    for t in (0, 3):
        qt = art.tables[t]
        ids = torch.unique(torch.cat([torch.arange(min(20, qt.rows)),
                                      torch.randint(0, qt.rows, (qt.rows // 3,), generator=g)]))
        w = (torch.rand((ids.numel(), art.embedding_dim), generator=g) - 0.5) * 0.5
        tables.append(DeltaTable(art.table_feature(t), t, ids.numpy().astype(np.int64),
                                 quantize_rows_reference(w, art.dtype).numpy()))
    return Delta(version, sequence, 1_800_000_000.0 + sequence, art.dtype, art.embedding_dim,
                 row_bytes(art.dtype, art.embedding_dim), tuple(tables))


@pytest.mark.parametrize("shared", ["0", "1"])
def test_deltas_in_the_store_are_applied_before_the_first_batch(model_dir, artifacts, tmp_path,
                                                                 shared):
    store = DeltaStore(tmp_path / "deltas")
    delta = _delta(artifacts[STABLE], STABLE)
    store_delta(store, encode_delta(delta), delta)
    w = _load(model_dir, environ={"DLRM_DELTA_DIR": str(store.root),
                                  "DLRM_SHARED_TABLES": shared, "DLRM_DELTA_POLL_MS": "50"})
    try:
        assert [(f.version, f.applied) for f in w.followers] == [(STABLE, 1)]
        assert (w.runtime.shared is not None) == (shared == "1")
        body = orjson.dumps(example_request(8, seed=5, max_id=20))  # ids the delta rewrote
        out = w.handle([WorkerRequest(body, JSON_MEDIA_TYPE)])
        want = Runtime.from_artifact(with_delta_rows(load_artifact(artifacts[STABLE]), delta),
                                     RuntimeConfig(device="cpu", num_threads=1))
        p = parse_body(body, WIDE)
        np.testing.assert_array_equal(_preds(out[0].body),
                                      want.predict_arrays(p.dense, p.values, p.lengths))
    finally:
        w.close()
    assert all(not f._thread.is_alive() for f in w.followers)


def test_a_bug_answers_every_request_500_and_the_worker_goes_on(model_dir, caplog):
    w = _load(model_dir)
    body = orjson.dumps(example_request(1))
    schema = w.runtime.schema
    w.runtime.schema = "not a schema"  # type: ignore[assignment]  # handle_batch raises
    out = w.handle([WorkerRequest(body, JSON_MEDIA_TYPE), WorkerRequest(b"{}", None)])
    assert [r.status for r in out] == [500, 500]
    assert orjson.loads(out[0].body) == {
        "code": 500, "type": "InternalError",
        "message": "internal error while predicting; see the TorchServe model log"}
    assert out[0].headers == {"X-DLRM-TorchServe-Batch": "2", "X-DLRM-Model-Version": STABLE}
    assert "DLRM handler failed on a batch of 2 requests" in caplog.text
    assert w.metrics.registry.get_sample_value("dlrm_requests_total", {"code": "500"}) == 2
    w.runtime.schema = schema
    assert [r.status for r in w.handle([WorkerRequest(body, JSON_MEDIA_TYPE)])] == [200]


def test_load_refuses_a_bad_environment(model_dir):
    with pytest.raises(ConfigError, match=r"DLRM_CACHE_ON_CPU='yes' must be 1"):
        _load(model_dir, environ={"DLRM_CACHE_ON_CPU": "yes"})


def test_model_version_and_device():
    assert model_version({"model": {"modelVersion": "small-int8-s0_b8d5w2"}}) == "small-int8-s0"
    assert model_version({"model": {"modelVersion": "1.0"}}) == "1.0"  # not derived: as is
    assert model_version({"model": {}}) == "unknown" and model_version(None) == "unknown"
    assert worker_device(None) == torch.device("cpu")
    want = torch.device("cuda:1") if torch.cuda.is_available() else torch.device("cpu")
    assert worker_device(1) == want


def test_canary_arms_take_turns_at_running_first(model_dir, tmp_path, monkeypatch):
    """The second forward of a batch runs warm (~12-15% less time per instance on CPU,
    whichever model), so in canary mode the worker alternates which arm runs first and
    the latency guard compares like with like; shadow always runs the stable first."""
    control = tmp_path / "control.json"
    cfg = HandlerConfig(num_threads=1, warmup_batches=0,
                        rollout=RolloutWiring(CANDIDATE, CANDIDATE_ARTIFACT, str(control)))
    w = _load(model_dir, cfg)
    order: list[str] = []
    real = w.arms.forward

    def forward(runtime, batch):
        order.append("candidate" if runtime is w.candidate else "stable")
        return real(runtime, batch)

    monkeypatch.setattr(w.arms, "forward", forward)
    keys = [f"user-{i}" for i in range(16)]
    requests = [WorkerRequest(orjson.dumps(example_request(1, seed=i)), JSON_MEDIA_TYPE, k)
                for i, k in enumerate(keys)]
    write_control(control, "canary", 0.5)
    firsts = []
    for _ in range(4):
        order.clear()
        out = w.handle(requests)
        assert sorted(order) == ["candidate", "stable"]
        firsts.append(order[0])
        assert all(r.status == 200 for r in out)
    assert firsts == ["stable", "candidate", "stable", "candidate"]
    write_control(control, "shadow", 0.5)
    for _ in range(2):
        order.clear()
        w.handle(requests)
        assert order == ["stable", "candidate"]
