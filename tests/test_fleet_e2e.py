"""A real two-pod local fleet (serve/ops/fleet.py, one worker each): a canary declared on
one pod, rolled back by a POST on the other; both pods show one revision; a sidecar killed
with SIGKILL and started again stays rolled back and never registers the candidate."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from serve.errors import ConfigError
from serve.ops.fleet import FleetPlan, pod_config, start_fleet, stop_fleet
from serve.ops.fleet_check import _kill_and_restart, _registered, _wait_decision
from serve.ops.launch_config import REPO
from serve.ops.launch_ports import check_ports
from serve.sidecar.adapters.fleet_store import read_fleet_file
from serve.state import Batching, DesiredState, ModelRef, write_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STABLE, CANDIDATE = "small-int8-s0", "small-int8-s7"


def _free_plan(tmp_path) -> FleetPlan:
    rng = random.Random(7)
    for _ in range(50):
        plan = FleetPlan(pods=2, base_port=rng.randrange(20000, 40000, 100),
                         run_dir=tmp_path / "run", log_dir=tmp_path / "logs",
                         state_file=tmp_path / "run" / "state.yaml",
                         model_store=REPO / "model_store", ready_timeout_s=400)
        try:
            for i in range(plan.pods):
                check_ports(pod_config(plan, i), holder=lambda _port: None)
        except ConfigError:
            continue
        return plan
    pytest.skip("no free block of ports")


def test_two_pods_share_one_decision_and_a_restart_stays_rolled_back(tmp_path):
    store = REPO / "model_store"
    if not all((store / f"dlrm-{v}.mar").exists() for v in (STABLE, CANDIDATE)):
        pytest.skip(f"needs {STABLE} and {CANDIDATE} in model_store (make model SEED=0/7)")
    plan = _free_plan(tmp_path)
    write_state(plan.state_file, DesiredState(
        model=ModelRef(version=STABLE), batching=Batching(batch_size=2, max_batch_delay_ms=2),
        workers=1))
    start_fleet(plan, say=print)
    try:
        pods = read_fleet_file(plan.fleet_file)
        token = (plan.run_dir / "sidecar-token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}
        body = {"model": {"version": STABLE}, "batching": {"batch_size": 2,
                                                          "max_batch_delay_ms": 2},
                "workers": 1, "rollout": {"candidate": CANDIDATE, "mode": "canary",
                                          "weight": 0.5, "bake_s": 600}}
        r = httpx.put(f"{pods[0].write_url}/state", json=body, headers=auth, timeout=30)
        assert r.status_code < 300, r.text
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:  # both pods serve the pair
            views = [httpx.get(f"{p.sidecar_url}/state", timeout=5).json() for p in pods]
            if all((v.get("rollout") or {}).get("serving") for v in views):
                break
            time.sleep(1.0)
        else:
            pytest.fail(f"the pair never served on both pods: {views}")
        leader = views[0]["fleet"]["leader"]
        assert {v["fleet"]["leader"] for v in views} == {leader}
        r = httpx.post(f"{pods[1].write_url}/state/rollout/rollback", headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        decided, _, _ = _wait_decision(pods, 60)
        revisions = {v.get("revision") for v in decided.values()}
        assert all(v.get("phase") == "rolled_back" for v in decided.values()), decided
        assert len(revisions) == 1 and None not in revisions, decided
        assert {v.get("decided_by") for v in decided.values()} == {pods[1].name}
        done, stays, seen = _kill_and_restart(plan, pods, STABLE)
        assert stays, done
        assert not any(CANDIDATE in v for v in seen), seen
        assert not any(CANDIDATE in v for v in _registered(pod_config(plan, 1).management_url))
    finally:
        stop_fleet(plan, say=print)
