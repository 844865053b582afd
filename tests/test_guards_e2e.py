"""The latency guard end to end: the real launcher, TorchServe and sidecar, the trained tiny
models, and a candidate made 2x slower by the test-only knob
``DLRM_DEBUG_CANDIDATE_SLOWDOWN`` (TorchServe's environment, so every worker's). The
candidate is the good retrain (seed 7): only its speed differs, so only ``latency_ratio``
may roll it back, after ``failure_limit`` breaches in a row, with 0 failed requests.
(``tests/test_rollout_e2e.py`` shows the same guard letting the good retrain through at
full speed.)
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from serve import settings
from serve.api.json_body import example_request
from serve.ops.loadgen import BackgroundLoad
from serve.ops.state_client import StateClient
from serve.state import parse_state, write_state
from serve.store.repository import ModelRepository
from tests.fixtures.torchserve import service_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCHING = {"batch_size": 4, "max_batch_delay_ms": 5}
# Default latency limit (1.3) and failure_limit (3); the PSI limit as in test_rollout_e2e
# (two tiny seeds differ by a PSI of 0.13-0.20, close to the default 0.25).
GUARDS = {"interval_s": 2, "min_requests": 50, "min_instances": 500, "max_score_psi": 0.5}
# 2x: a margin over the 1.3 limit whatever the machine. Measured at 1.5x (2026-12-03, 2
# shared cores, 4 clients of 256 instances, canary 0.5): the ratio read 1.43 (the merge of
# the requests is not slowed), its 99% lower bound crossed 1.3 after 361 vs 375 forwards,
# rolled back 12.3 s after serving (6 evaluations), 0 failed.
SLOWDOWN = "2.0"
LOAD_INSTANCES = 256
CLIENTS = 4


def _add(repo: ModelRepository, build: Any) -> str:
    repo.add(build.version, build.mar, dict(build.report))
    return str(build.version)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_build, tiny_build_seed7
            ) -> Iterator[tuple[Any, StateClient, str, str]]:
    from serve.ops.launcher import start

    root = tmp_path_factory.mktemp("guards")
    repo = ModelRepository([root / "model_store"])
    stable, candidate = _add(repo, tiny_build), _add(repo, tiny_build_seed7)
    write_state(root / "state.yaml", parse_state({"model": {"version": stable},
                                                  "batching": BATCHING, "workers": 1}))
    cfg = service_config(root, extra_env={
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        settings.DLRM_DEBUG_CANDIDATE_SLOWDOWN.name: SLOWDOWN})
    svc = start(cfg)
    client = StateClient(cfg.sidecar_write_url, cfg.token_file.read_text().strip(),
                         timeout_s=30)
    try:
        client.wait_converged(timeout_s=180)
        yield cfg, client, stable, candidate
    finally:
        svc.stop()
        shutil.rmtree(root / "run", ignore_errors=True)


def test_a_slower_candidate_is_rolled_back_by_the_latency_guard(service) -> None:
    cfg, client, stable, candidate = service
    bodies = [orjson.dumps(example_request(LOAD_INSTANCES, seed=i, max_id=10_000))
              for i in range(16)]
    with BackgroundLoad(f"{cfg.inference_url}/predictions/dlrm", bodies, clients=CLIENTS,
                        expect_predictions=LOAD_INSTANCES) as load:
        load.wait_for(20)
        r = client.put_state({"model": {"version": stable}, "batching": BATCHING,
                              "workers": 1, "rollout": {
                                  "candidate": candidate, "mode": "canary", "weight": 0.5,
                                  "bake_s": 600, "guards": GUARDS}})
        assert r.status_code == 202, r.text
        client.wait_rollout(phase="baking", serving=True, timeout_s=120)
        t0 = time.monotonic()
        body = client.wait_rollout(phase="rolled_back", timeout_s=120)
        took = time.monotonic() - t0
        body = client.wait_rollout(phase="rolled_back", converged=True, timeout_s=120)
        n = load.served
        load.wait_for(n + 20)
    rollout = body["rollout"]
    guards = {g["name"]: g for g in rollout["guards"]}
    print(f"\ncandidate slowed {SLOWDOWN}x: rolled back {took:.1f} s after it began serving, "
          f"{rollout['evaluations']} evaluation(s); "
          + "; ".join(f"{k}={g['value']} ({g['detail']})" for k, g in guards.items())
          + f"; {load.served} served, {load.failed} failed")
    assert load.failed == 0, load.failures[:3]
    assert "latency_ratio breached 3 times in a row" in rollout["reason"], rollout
    assert guards["latency_ratio"]["consecutive_breaches"] == 3
    assert guards["latency_ratio"]["value"] > guards["latency_ratio"]["threshold"] == 1.3
    assert guards["error_ratio"]["status"] == "ok"
    assert body["observed"]["candidate"] is None
