"""Rollouts end to end: the real launcher, TorchServe and sidecar, real trained models.

Three versions of the trained tiny model (``tests/fixtures/pipeline.py``): the stable one
(seed 0), a good candidate (seed 7, same click logs) and a bad one trained on shuffled
labels (AUC ~0.5). Every rollout runs under a closed-loop load
(``serve.ops.loadgen.BackgroundLoad``) and must fail 0 requests; the counts are printed
(``pytest -s``).

Order matters (one service for the module): sticky canary routing and shadow mode end
with a manual rollback; the bad candidate is rolled back by its guards; the good one is
promoted last.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import torch

from serve.api.json_body import example_request
from serve.ops.loadgen import VERSION_HEADER, BackgroundLoad
from serve.store.repository import ModelRepository
from serve.store.routing import ARM_HEADER, ROUTE_KEY_HEADER, key_point
from tests.fixtures.served import Served, serve_repository
from tests.fixtures.torchserve import ROUTE_KEY_SALT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCHING = {"batch_size": 4, "max_batch_delay_ms": 5}
# The tiny models of two seeds differ more than the small ones: their score PSI on random
# inputs is 0.13-0.20 (small: 0.011), close to the default limit of 0.25; the shuffled-label
# model's is ~7.5. A limit of 0.5 keeps both far from the line. The latency guard keeps
# its default (1.3 on the lower confidence bound of the forward-time ratio, 3 breaches in
# a row): it judges forward seconds per instance, which a slow neighbour on the shared
# cores moves on both arms alike, not request p99s.
GUARDS = {"interval_s": 2, "min_requests": 50, "min_instances": 500, "max_score_psi": 0.5}
LOAD_INSTANCES = 64
CLIENTS = 6


@dataclass
class Versions:
    stable: str
    good: str
    bad: str


@dataclass
class RolloutServed(Served):
    """The service over the stable version and its two candidates, under a load."""

    versions: Versions

    def desired(self, stable: str, rollout: dict[str, Any] | None) -> dict[str, Any]:
        return {"model": {"version": stable}, "batching": BATCHING, "workers": 1,
                "rollout": rollout}

    def load(self, seed: int = 0) -> BackgroundLoad:
        bodies = [orjson.dumps(example_request(LOAD_INSTANCES, seed=seed + i, max_id=10_000))
                  for i in range(32)]
        return BackgroundLoad(self.predict_url, bodies, clients=CLIENTS,
                              expect_predictions=LOAD_INSTANCES)


def _add(repo: ModelRepository, build: Any) -> str:
    version = build.version
    repo.add(version, build.mar, dict(build.report))
    return version


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_build, tiny_build_seed7,
           tiny_build_shuffled) -> Iterator[RolloutServed]:
    root = tmp_path_factory.mktemp("rollout")
    repo = ModelRepository([root / "model_store"])
    versions = Versions(stable=_add(repo, tiny_build), good=_add(repo, tiny_build_seed7),
                        bad=_add(repo, tiny_build_shuffled))
    with serve_repository(root, state={"model": {"version": versions.stable},
                                       "batching": BATCHING, "workers": 1},
                          kind=RolloutServed, fields={"versions": versions},
                          ts_overrides={"job_queue_size": "200"}) as s:
        yield s


def _declare(s: RolloutServed, stable: str, rollout: dict[str, Any] | None) -> None:
    r = s.client.put_state(s.desired(stable, rollout))
    assert r.status_code == 202, r.text


def _end_by_hand(s: RolloutServed) -> None:
    r = s.client.rollout_action("rollback")
    assert r.status_code == 200, r.text
    assert r.json()["phase"] == "rolled_back"
    body = s.client.wait_rollout(phase="rolled_back", converged=True, timeout_s=120)
    assert body["observed"]["candidate"] is None, body


def test_canary_routes_each_key_to_one_arm_at_the_declared_share(served: RolloutServed) -> None:
    s, v = served, served.versions
    _declare(s, v.stable, {"candidate": v.good, "mode": "canary", "weight": 0.2,
                           "bake_s": 3600, "guards": GUARDS})
    body = s.client.wait_rollout(phase="baking", serving=True, timeout_s=120)
    assert body["observed"]["candidate"] == v.good and body["rollout"]["weight"] == 0.2, body

    keys = [f"user-{i}" for i in range(500)] * 4  # 2,000 requests over 500 route keys
    payload = orjson.dumps(example_request(1, seed=3, max_id=10_000))

    def send(key: str) -> tuple[str, int, str | None, str | None]:
        r = httpx.post(s.predict_url, content=payload, timeout=30,
                       headers={"Content-Type": "application/json", ROUTE_KEY_HEADER: key})
        return key, r.status_code, r.headers.get(ARM_HEADER), r.headers.get(VERSION_HEADER)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, keys))
    assert all(code == 200 for _, code, _, _ in answers), Counter(c for _, c, _, _ in answers)
    arms: dict[str, set[str | None]] = defaultdict(set)
    for key, _, arm, version in answers:
        arms[key].add(arm)
        assert version == (v.good if arm == "candidate" else v.stable)
    assert all(len(a) == 1 for a in arms.values()), "a key was answered by both arms"
    # each key's arm is the keyed hash's: below the weight = candidate (the workers hash
    # with the fleet's secret, here the fixtures' ROUTE_KEY_SALT)
    wrong = [k for k, a in arms.items()
             if a != {"candidate" if key_point(k, ROUTE_KEY_SALT) < 0.2 else "stable"}]
    assert not wrong, f"keys answered by the other arm than their hash picks: {wrong[:5]}"
    share = sum(arm == "candidate" for _, _, arm, _ in answers) / len(answers)
    print(f"\ncanary 0.2 over 500 keys x 4: candidate share {share:.3f}")
    assert abs(share - 0.2) <= 0.03
    # without a key: random per request, still about the weight
    r = httpx.post(s.predict_url, content=payload, timeout=30,
                   headers={ROUTE_KEY_HEADER: "k" * 300})
    assert r.status_code == 400 and ROUTE_KEY_HEADER in r.json()["message"]
    _end_by_hand(s)


def test_shadow_answers_bit_for_bit_as_stable_alone(served: RolloutServed) -> None:
    s, v = served, served.versions
    bodies = [orjson.dumps(example_request(16, seed=100 + i, max_id=10_000)) for i in range(12)]

    def answers() -> list[tuple[torch.Tensor, str | None]]:
        out = []
        for b in bodies:  # one at a time: each request is its own batch, as alone
            r = httpx.post(s.predict_url, content=b, timeout=30,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            out.append((torch.tensor(r.json()["predictions"], dtype=torch.float64),
                        r.headers.get(VERSION_HEADER)))
        return out

    alone = answers()
    key = ("dlrm_arm_score_count", (("arm", "candidate"), ("version", v.bad)))
    before = s.metrics().get(key, 0.0)
    _declare(s, v.stable, {"candidate": v.bad, "mode": "shadow", "weight": 1.0,
                           "bake_s": 3600, "guards": {**GUARDS, "max_score_psi": 100.0}})
    s.client.wait_rollout(phase="baking", serving=True, timeout_s=120)
    shadowed = answers()
    for (a, va), (b, vb) in zip(alone, shadowed, strict=True):
        assert torch.equal(a, b)
        assert va == vb == v.stable
    filled = s.metrics().get(key, 0.0) - before
    print(f"\nshadow: candidate scored {filled:.0f} instances unseen")
    assert filled >= 16 * len(bodies)
    diff = s.metrics().get(("dlrm_shadow_score_diff_count", (("version", v.bad),)), 0.0)
    assert diff >= 16 * len(bodies)
    _end_by_hand(s)


def test_shuffled_label_candidate_is_rolled_back_by_the_score_guard(served: RolloutServed) -> None:
    s, v = served, served.versions
    with s.load(seed=1) as load:
        load.wait_for(20)
        _declare(s, v.stable, {"candidate": v.bad, "mode": "canary", "weight": 0.5,
                               "bake_s": 600, "guards": GUARDS})
        s.client.wait_rollout(phase="baking", serving=True, timeout_s=120)
        t0 = time.monotonic()
        body = s.client.wait_rollout(phase="rolled_back", timeout_s=60)
        took = time.monotonic() - t0
        body = s.client.wait_rollout(phase="rolled_back", converged=True, timeout_s=120)
        n = load.served
        load.wait_for(n + 20)
    r = body["rollout"]
    guards = {g["name"]: g for g in r["guards"]}
    print(f"\nbad candidate: rolled back {took:.1f} s after it began serving, "
          f"{r['evaluations']} evaluation(s); guards "
          + ", ".join(f"{k}={g['value']}" for k, g in guards.items())
          + f"; {load.served} served, {load.failed} failed")
    assert load.failed == 0, load.failures[:3]
    # failure_limit (3) breaches in a row, after at most one evaluation short of data
    assert r["evaluations"] <= 4 and "score_psi breached 3 times in a row" in r["reason"], r
    assert guards["score_psi"]["consecutive_breaches"] == 3
    assert guards["score_psi"]["status"] == "breached"
    assert guards["score_psi"]["value"] > guards["score_psi"]["threshold"]
    assert body["observed"]["candidate"] is None
    assert body["desired"]["rollout"] is None  # the outcome is written into the file
    assert s.metrics()[("dlrm_rollout_phase", (("phase", "rolled_back"),))] == 1.0


def test_good_candidate_is_promoted_after_bake_with_zero_failures(served: RolloutServed) -> None:
    s, v = served, served.versions
    with s.load(seed=2) as load:
        load.wait_for(20)
        _declare(s, v.stable, {"candidate": v.good, "mode": "canary", "weight": 0.5,
                               "steps": [1.0], "bake_s": 6, "guards": GUARDS})
        s.client.wait_rollout(phase="baking", serving=True, timeout_s=120)
        body = s.client.wait_rollout(phase="promoted", timeout_s=120)
        guards = {g["name"]: g["value"] for g in body["rollout"]["guards"]}
        body = s.client.wait_rollout(phase="promoted", converged=True, timeout_s=120)
        n = load.served
        load.wait_for(n + 20)
        versions = load.versions()
    print(f"\ngood candidate promoted; guards {guards}; {load.served} served, "
          f"{load.failed} failed; answered by {dict(versions)}")
    assert load.failed == 0, load.failures[:3]
    assert body["observed"]["model"]["version"] == v.good
    assert body["observed"]["candidate"] is None
    assert body["desired"]["model"]["version"] == v.good and body["desired"]["rollout"] is None
    assert versions[v.good] > 0 and versions[v.stable] > 0
