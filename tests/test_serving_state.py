"""The declared serving state, end to end: the real launcher, TorchServe and sidecar.

The service starts the way `make up` starts it (TorchServe empty, the sidecar registering
what `.run/state.yaml` declares), over a repository of four tiny versions: two fast ones
with different weights (``tiny-a``, ``tiny-b``) and two whose handler sleeps per batch
(``slow-a``, ``slow-b``) so that the queue can hold seconds of work. Every live change runs
under a closed-loop load (``serve.ops.loadgen.BackgroundLoad``) and must fail 0 requests;
the count served is printed (``pytest -s``) and asserted to be > 0.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from serve.api.binary import example_binary
from serve.api.json_body import example_request
from serve.api.request import BINARY_MEDIA_TYPE
from serve.errors import UpstreamUnavailable
from serve.ops.loadgen import BackgroundLoad
from serve.store.repository import ModelRepository
from tests.fixtures.served import Served, serve_repository
from tests.fixtures.torchserve import tiny_random_artifact

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONVERGE_S = 60.0          # the bound for a change to be served everywhere
FAST = ("tiny-a", "tiny-b")
SLOW = ("slow-a", "slow-b")
# The slow versions sleep this long per batch: 64 clients / batch 2 = 32 batches queued,
# about 6 s of work waiting in TorchServe's queue when the switch starts.
SLOW_DELAY_MS = 200
HANDLER = {"num_threads": 1, "cache_load_factor": 1.0, "max_instances": 1024,
           "max_ids_per_feature": 8}


def _add_version(repo: ModelRepository, root: Path, version: str, seed: int, created: datetime,
                 delay_ms: int = 0) -> None:
    from serve.model.archive import build_mar

    artifact = tiny_random_artifact(root / f"{version}.pt", seed=seed)
    handler = {**HANDLER, **({"debug_delay_ms": delay_ms} if delay_ms else {})}
    mar = build_mar(artifact, root / "build", model_name="dlrm", version=version,
                    batch_size=2, max_batch_delay_ms=2, handler_config=handler,
                    min_workers=1, max_workers=1, response_timeout_s=60,
                    file_name=f"{version}.mar")
    repo.add(version, mar, {"version": version, "seed": seed, "created_at": created.isoformat(),
                            "mar_batch_size": 2, "mar_max_batch_delay_ms": 2, "mar_workers": 1})


class StateServed(Served):
    """The service, and declaring a state on it."""

    def declare(self, version: str, batch_size: int = 2, delay_ms: int = 2) -> float:
        """PUT /state, wait until converged on it; return the seconds it took."""
        desired = {"model": {"version": version},
                   "batching": {"batch_size": batch_size, "max_batch_delay_ms": delay_ms},
                   "workers": 1, "rollout": None}
        t0 = time.monotonic()
        r = self.client.put_state(desired)
        assert r.status_code == 202, r.text
        try:
            st = self.client.wait_converged(desired, timeout_s=CONVERGE_S)
        except UpstreamUnavailable as e:
            raise AssertionError(f"not converged on {desired}: {e.message}") from None
        obs = st["observed"] or {}
        assert obs.get("model", {}).get("version") == version, st
        assert obs.get("batching", {}).get("batch_size") == batch_size, st
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def repo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serving_state")
    repo = ModelRepository([root / "model_store"])
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    for i, (version, seed) in enumerate(zip(FAST, (0, 7), strict=True)):
        _add_version(repo, root, version, seed, t0 + timedelta(minutes=i))
    for i, (version, seed) in enumerate(zip(SLOW, (1, 8), strict=True)):
        _add_version(repo, root, version, seed, t0 - timedelta(minutes=10 - i), SLOW_DELAY_MS)
    return root


@pytest.fixture(scope="module")
def served(repo_root: Path) -> Iterator[StateServed]:
    # No state file: the launcher declares the newest version; not waited for, so the
    # first test sees what `make up` leaves.
    with serve_repository(repo_root, wait=False, kind=StateServed,
                          ts_overrides={"job_queue_size": "200"}) as s:
        yield s


def test_make_up_serves_the_latest_version_declared_in_a_new_state_file(served: StateServed) -> None:
    st = served.state()
    assert st["desired"]["model"]["version"] == "tiny-b"  # latest by created_at
    assert st["available_versions"] == ["slow-a", "slow-b", "tiny-a", "tiny-b"]
    assert st["converged"] is True, st
    _, version = served.predict_json(example_request(1, seed=3))
    assert version == "tiny-b"


def test_batch_size_change_under_load_fails_nothing(served: StateServed) -> None:
    served.declare("tiny-a")
    bodies = [example_binary(512, seed=s) for s in range(4)]
    with BackgroundLoad(served.predict_url, bodies, clients=8,
                        content_type=BINARY_MEDIA_TYPE) as load:
        load.wait_for(16)
        seconds = served.declare("tiny-a", batch_size=4, delay_ms=3)
        before = load.served
        load.wait_for(before + 16)
    print(f"\nbatch 2 -> 4 converged in {seconds:.1f} s; served {load.served}, "
          f"failed {load.failed}")
    assert load.failed == 0, load.failures[:3]
    assert load.served > 0
    assert set(load.versions()) == {"tiny-a"}
    obs = served.state()["observed"]
    assert obs["batching"] == {"batch_size": 4, "max_batch_delay_ms": 3}


def test_version_switch_under_load_changes_answers_and_header(served: StateServed) -> None:
    served.declare("tiny-a")
    probe = example_request(1, seed=11)
    before, version = served.predict_json(probe)
    assert version == "tiny-a"
    bodies = [example_binary(512, seed=s) for s in range(4)]
    with BackgroundLoad(served.predict_url, bodies, clients=8,
                        content_type=BINARY_MEDIA_TYPE) as load:
        load.wait_for(16)
        seconds = served.declare("tiny-b")
        converged_at = time.monotonic()
        load.wait_for(load.served + 32)
    print(f"\ntiny-a -> tiny-b converged in {seconds:.1f} s; served {load.served}, "
          f"failed {load.failed}; by version {dict(load.versions())}")
    assert load.failed == 0, load.failures[:3]
    assert set(load.versions()) <= {"tiny-a", "tiny-b"}  # every answer names its version
    # Once converged, the old version is drained and gone: everything is the new one.
    # (converged = the target serves and no other version is registered any more)
    assert set(load.versions(since=converged_at)) == {"tiny-b"}
    after, version = served.predict_json(probe)
    assert version == "tiny-b"
    assert after != before  # other weights, other answer


def test_restart_comes_back_to_the_declared_state(served: StateServed) -> None:
    served.declare("tiny-b", batch_size=3, delay_ms=1)
    served.restart()
    st = served.state()
    assert st["desired"]["model"]["version"] == "tiny-b"
    assert st["desired"]["batching"] == {"batch_size": 3, "max_batch_delay_ms": 1}
    assert st["converged"] is True, st
    assert st["observed"]["model"]["version"] == "tiny-b"
    assert st["observed"]["batching"] == {"batch_size": 3, "max_batch_delay_ms": 1}
    _, version = served.predict_json(example_request(1, seed=3))
    assert version == "tiny-b"


def test_switch_under_a_deep_queue_fails_nothing(served: StateServed) -> None:
    served.declare("slow-a")
    bodies = [example_binary(512, seed=s) for s in range(4)]
    with BackgroundLoad(served.predict_url, bodies, clients=64, timeout_s=120,
                        content_type=BINARY_MEDIA_TYPE) as load:
        load.wait_for(64, timeout_s=120)  # the queue has filled up by now
        seconds = served.declare("slow-b")
        load.wait_for(load.served + 64, timeout_s=120)
    print(f"\ndeep queue: slow-a -> slow-b converged in {seconds:.1f} s; served "
          f"{load.served}, failed {load.failed}; by version {dict(load.versions())}")
    assert load.failed == 0, load.failures[:3]
    assert load.served >= 128
    assert set(load.versions()) == {"slow-a", "slow-b"}
