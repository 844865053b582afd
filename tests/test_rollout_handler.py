"""A real TorchServe serving a rollout: the stable tiny model (seed 0) and a candidate
(seed 7) in ONE registration, split by the control file (serve.store.routing), per arm metrics
in the multiprocess dir. Slow (two trained tiny builds) and integration (a real server)."""
from __future__ import annotations

import zipfile
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch

from serve.api.config import HandlerConfig
from serve.api.decode import parse_body
from serve.api.json_body import example_request
from serve.constants import CANDIDATE_ARTIFACT
from serve.store.routing import ROUTE_KEY_HEADER, ROUTE_KEY_MAX_CHARS, key_point, write_control
from tests.fixtures.torchserve import HANDLER_CONFIG, ROUTE_KEY_SALT, start_torchserve

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}


def pack_candidate(mar: Path, candidate_artifact: Path) -> None:
    """Add the candidate's artifact to a built .mar as ``candidate/artifact.pt``
    (uncompressed, like the stable one), as the sidecar's derived archives hold it."""
    with zipfile.ZipFile(mar, "a", compression=zipfile.ZIP_STORED) as z:
        z.write(candidate_artifact, CANDIDATE_ARTIFACT)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, tiny_build, tiny_build_seed7):
    root = tmp_path_factory.mktemp("rollout")
    control = root / "control.json"
    wiring = {"candidate_version": tiny_build_seed7.version,
              "candidate_artifact": CANDIDATE_ARTIFACT, "control_file": str(control)}
    inst = start_torchserve(root / "ts", tiny_build.artifact,
                            handler_config={**HANDLER_CONFIG, "rollout": wiring},
                            version=tiny_build.version,
                            extend_mar=lambda mar: pack_candidate(mar, tiny_build_seed7.artifact))
    inst.control = control  # type: ignore[attr-defined]
    try:
        yield inst
    finally:
        inst.stop()


def _runtime(path: Path):
    from serve.runtime.engine import Runtime, RuntimeConfig

    return Runtime.from_artifact(path, RuntimeConfig(device="cpu", cache_load_factor=1.0,
                                                     num_threads=1))


@pytest.fixture(scope="module")
def stable_rt(tiny_build):
    return _runtime(tiny_build.artifact)


@pytest.fixture(scope="module")
def candidate_rt(tiny_build_seed7):
    return _runtime(tiny_build_seed7.artifact)


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=30) as c:
        yield c


BODIES = [example_request(n, seed=40 + n) for n in (1, 3, 7)]


def _alone(runtime, body: dict) -> torch.Tensor:
    """The runtime's scores for ``body`` as one forward (what a request alone gets)."""
    from serve.runtime.engine import SparseBatch

    p = parse_body(orjson.dumps(body), HandlerConfig(max_instances=1024))
    return runtime.predict(torch.from_numpy(p.dense), SparseBatch(
        torch.from_numpy(p.values), torch.from_numpy(p.lengths)))


def _post(client, inst, body: dict, key: str | None = None) -> httpx.Response:
    headers = dict(JSON, **({ROUTE_KEY_HEADER: key} if key is not None else {}))
    r = client.post(inst.predict_url, content=orjson.dumps(body), headers=headers)
    assert r.status_code == 200, r.text
    return r


def _got(r: httpx.Response) -> torch.Tensor:
    return torch.from_numpy(np.array(r.json()["predictions"], dtype=np.float32))


def _arm_samples(inst) -> dict[tuple[str, tuple], float]:
    from prometheus_client import CollectorRegistry, generate_latest

    from serve.metrics.aggregate import HandlerAggregateCollector
    from tests.promtext import samples

    reg = CollectorRegistry()
    reg.register(HandlerAggregateCollector(inst.multiproc_dir))
    return {k: v for k, v in samples(generate_latest(reg).decode()).items()
            if k[0].startswith(("dlrm_arm", "dlrm_shadow"))}


def _count(s: dict, name: str, arm: str | None, version: str) -> float:
    labels = (("version", version),) if arm is None else (("arm", arm), ("version", version))
    return s.get((name, labels), 0.0)


def test_rollout_canary_shadow_and_live_control_changes(rollout, stable_rt, candidate_rt,
                                                         client, tiny_build, tiny_build_seed7):
    stable_v, cand_v = tiny_build.version, tiny_build_seed7.version
    pids = rollout.worker_pids()
    # Requests are sent one at a time, so each is a forward of its own, exactly as the
    # in-process runtime computes it alone: the scores must be equal bit for bit.
    stable_want = [_alone(stable_rt, b) for b in BODIES]
    cand_want = [_alone(candidate_rt, b) for b in BODIES]
    assert not torch.equal(stable_want[1], cand_want[1])  # two different models

    # 1. No control file yet: weight 0, all stable.
    for i, body in enumerate(BODIES):
        r = _post(client, rollout, body, key=f"user-{i}")
        assert torch.equal(_got(r), stable_want[i])
        assert r.headers["x-dlrm-model-version"] == stable_v
        assert r.headers["x-dlrm-arm"] == "stable"

    # 2. Canary at weight 1: all candidate, on the next request, nothing restarted.
    write_control(rollout.control, "canary", 1.0, candidate=cand_v)
    for i, body in enumerate(BODIES):
        r = _post(client, rollout, body, key=None if i == 0 else f"user-{i}")
        assert torch.equal(_got(r), cand_want[i])
        assert r.headers["x-dlrm-model-version"] == cand_v
        assert r.headers["x-dlrm-arm"] == "candidate"

    # 3. Canary at weight 0.5: keyed requests take the arm their key's hash says, always.
    write_control(rollout.control, "canary", 0.5)
    keys = [f"user-{i}" for i in range(12)]
    for _ in range(2):
        for k in keys:
            r = _post(client, rollout, BODIES[0], key=k)
            arm = "candidate" if key_point(k, ROUTE_KEY_SALT) < 0.5 else "stable"
            assert r.headers["x-dlrm-arm"] == arm, k
            want = cand_want[0] if arm == "candidate" else stable_want[0]
            assert torch.equal(_got(r), want)
    assert {key_point(k, ROUTE_KEY_SALT) < 0.5 for k in keys} == {True, False}  # both arms were exercised

    # 4. Back to weight 0: stable again.
    write_control(rollout.control, "canary", 0.0)
    r = _post(client, rollout, BODIES[2], key="user-1")
    assert torch.equal(_got(r), stable_want[2]) and r.headers["x-dlrm-arm"] == "stable"

    # 5. Shadow at weight 1: responses are stable's alone, the candidate's scores fill.
    before = _arm_samples(rollout)
    write_control(rollout.control, "shadow", 1.0)
    for i, body in enumerate(BODIES):
        r = _post(client, rollout, body)
        assert torch.equal(_got(r), stable_want[i])
        assert r.headers["x-dlrm-model-version"] == stable_v
        assert r.headers["x-dlrm-arm"] == "stable"
    after = _arm_samples(rollout)
    instances = sum(len(b["instances"]) for b in BODIES)
    assert _count(after, "dlrm_arm_score_count", "candidate", cand_v) - \
        _count(before, "dlrm_arm_score_count", "candidate", cand_v) == instances
    assert _count(after, "dlrm_arm_score_count", "stable", stable_v) - \
        _count(before, "dlrm_arm_score_count", "stable", stable_v) == instances
    assert _count(after, "dlrm_arm_requests_total", "candidate", cand_v) - \
        _count(before, "dlrm_arm_requests_total", "candidate", cand_v) == len(BODIES)
    assert _count(after, "dlrm_arm_errors_total", "candidate", cand_v) == 0
    assert _count(after, "dlrm_shadow_score_diff_count", None, cand_v) - \
        _count(before, "dlrm_shadow_score_diff_count", None, cand_v) == instances
    assert _count(after, "dlrm_arm_request_duration_seconds_count", "candidate", cand_v) > 0

    assert rollout.worker_pids() == pids  # every change without a restart


def test_bad_route_keys_get_their_own_400(rollout, client):
    too_long = "k" * 300
    body = orjson.dumps(example_request(2, seed=3))
    r = client.post(rollout.predict_url, content=body, headers={**JSON, ROUTE_KEY_HEADER: too_long})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"code": 400, "type": "InvalidInput",
                        "message": f"header {ROUTE_KEY_HEADER}: has 300 characters; at most "
                                   f"{ROUTE_KEY_MAX_CHARS} are allowed; send a shorter key (e.g. "
                                   "a hash of the user id) or leave the header out"}
    assert "x-dlrm-arm" not in r.headers
    ok = client.post(rollout.predict_url, content=body,
                     headers={**JSON, "x-dlrm-route-key": "k" * ROUTE_KEY_MAX_CHARS})
    assert ok.status_code == 200, ok.text
