"""The batching tuner end to end: the real launcher, TorchServe and sidecar, tuner on.

One tiny version, declared at the shipped batching (2 / 2 ms). Single-instance requests
from 16 closed-loop clients: the tuner must move off batch 2 by itself through the
reconciler's zero-failure switch, every request answered (the count served is printed
with ``pytest -s`` and asserted > 0). Then a batching set by hand pins it (tuner off),
and a bad PUT /tuner gets a 400 naming the field.
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from serve.api.json_body import example_request
from serve.ops.loadgen import BackgroundLoad
from serve.store.repository import ModelRepository
from tests.fixtures.served import Served
from tests.fixtures.torchserve import service_config
from tests.test_serving_state import _add_version

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from datetime import UTC, datetime

    from serve.ops.launcher import start

    root = tmp_path_factory.mktemp("tuner_e2e")
    repo = ModelRepository([root / "model_store"])
    _add_version(repo, root, "tiny-a", 0, datetime(2026, 12, 1, tzinfo=UTC))
    cfg = service_config(
        root,
        # short windows so a search takes ~a minute here (defaults: 10 s / 30 s / 10 s)
        sidecar_env={"DLRM_AUTOTUNE": "1", "DLRM_TUNE_WINDOW_S": "4",
                     "DLRM_TUNE_SETTLE_S": "3", "DLRM_TUNE_MIN_DWELL_S": "10",
                     "DLRM_TUNE_MIN_SWITCH_INTERVAL_S": "4"})
    holder = Served(cfg, start(cfg), "")
    holder.token = cfg.token_file.read_text().strip()
    try:
        yield holder
    finally:
        holder.svc.stop()


def _tuner(served: Served) -> dict[str, Any]:
    r = httpx.get(f"{served.sidecar_url}/tuner", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_tuner_moves_off_batch_2_under_load_and_fails_nothing(served: Served) -> None:
    assert served.state()["observed"]["batching"] == {"batch_size": 2, "max_batch_delay_ms": 2}
    assert _tuner(served)["enabled"] is True
    bodies = [orjson.dumps(example_request(1, seed=s)) for s in range(64)]
    deadline = time.monotonic() + 240
    with BackgroundLoad(served.predict_url, bodies, clients=16, expect_predictions=1) as load:
        while time.monotonic() < deadline:
            t = _tuner(served)
            if t["phase"] == "settled" and any(d["reason"] == "best" or d["reason"] == "trial"
                                              for d in t["decisions"]):
                break
            time.sleep(1.0)
        load.wait_for(load.served + 32)
    st = served.state()
    print(f"\ntuner decisions: {[(d['reason'], d['to']) for d in t['decisions']]}; "
          f"served {load.served}, failed {load.failed}; now {st['observed']['batching']}")
    assert load.failed == 0, load.failures[:3]
    assert load.served > 0
    assert t["phase"] == "settled", t
    reasons = [d["reason"] for d in t["decisions"]]
    assert reasons[0] == "seed" and "trial" in reasons, reasons
    # every measured setting is in the search's record, the chosen one serves
    assert st["converged"] is True, st
    assert st["tuner"]["serving"] == st["observed"]["batching"]
    assert st["observed"]["batching"]["batch_size"] > 2  # 16 in flight, 1 worker
    metrics = httpx.get(f"{served.sidecar_url}/metrics", timeout=10).text
    assert 'dlrm_tuner_phase{phase="settled"} 1.0' in metrics
    seeds = re.search(r"^dlrm_tuner_decisions_total\{reason=\"seed\"\} (\S+)$", metrics,
                      re.MULTILINE)
    assert seeds is not None and float(seeds.group(1)) >= 1, metrics[-2000:]


def test_bad_tuner_body_is_a_400_naming_the_field(served: Served) -> None:
    auth = {"Authorization": f"Bearer {served.token}"}
    r = httpx.put(f"{served.write_url}/tuner", json={"enabled": "yes"}, headers=auth)
    assert r.status_code == 400, r.text
    assert "enabled" in r.text
    r = httpx.put(f"{served.write_url}/tuner", json={"p99_goal_ms": -1}, headers=auth)
    assert r.status_code == 400 and "p99_goal_ms" in r.text, r.text
    assert httpx.put(f"{served.write_url}/tuner", json={"enabled": False}).status_code == 401


def test_a_batching_set_by_hand_pins_it(served: Served) -> None:
    auth = {"Authorization": f"Bearer {served.token}"}
    r = httpx.put(f"{served.write_url}/batching", json={"batch_size": 3,
                                                         "max_batch_delay_ms": 1},
                  headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["tuner_turned_off"] is True
    t = _tuner(served)
    assert t["enabled"] is False and t["phase"] == "off" and "PUT /batching" in t["reason"]
    time.sleep(3)
    assert served.state()["observed"]["batching"] == {"batch_size": 3, "max_batch_delay_ms": 1}
    r = httpx.put(f"{served.write_url}/tuner", json={"enabled": True}, headers=auth)
    assert r.status_code == 200 and r.json()["enabled"] is True


def test_served_state_is_what_the_sidecar_declares(served: Served) -> None:
    """What the load test and the benchmarks record beside their figures, read from the
    real sidecar: the version, batching, workers and tuner it declares."""
    from serve.ops.state_client import describe_served, served_state

    got = served_state(served.sidecar_url)
    st = served.state()
    assert got["version"] == "tiny-a" == st["desired"]["model"]["version"]
    assert got["batching"] == st["desired"]["batching"]
    assert got["workers"] == st["desired"]["workers"] and got["converged"] is st["converged"]
    assert got["tuner_enabled"] is _tuner(served)["enabled"]
    line = describe_served(got)
    assert line.startswith("version tiny-a, batching ") and "tuner o" in line, line
