"""The fleet through the reconciler's passes, on fake TorchServes: one leader judges and
records, a follower never judges but adopts, and a pod restarted while a rolled-back
rollout is still declared never registers the candidate."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np

from serve.sidecar.adapters.archives import control_path
from serve.sidecar.adapters.fleet_store import FileDecisionStore, FileLease, StaticPeers
from serve.sidecar.adapters.torchserve import TorchServeClient
from serve.sidecar.config import SidecarConfig
from serve.sidecar.control.fleet import Fleet, FleetFamilies
from serve.sidecar.control.reconciler import Reconciler
from serve.sidecar.control.rollout import RolloutController, rollout_key
from serve.sidecar.control.switch import VersionSwitch
from serve.state import DesiredState, load_state, write_state
from serve.store.repository import ModelRepository
from serve.store.routing import read_control
from tests.fixtures.sidecar import FakeClock, FakeTorchServe, add_versions
from tests.test_rollout import CANDIDATE, STABLE, Clock, Workers, desired, traffic

SERVING = f"{STABLE}_b8d50w1_c{CANDIDATE}"


def declared() -> DesiredState:
    d = desired(bake_s=60)
    return d.model_copy(update={"batching": d.batching.model_copy(
        update={"batch_size": 8, "max_batch_delay_ms": 50}), "workers": 1})


class Pod:
    """A sidecar's reconciler with a file fleet, on its own fake TorchServe."""

    def __init__(self, tmp: Path, name: str, repo: ModelRepository, state_file: Path,
                 lease_clock: Clock, workers: Workers) -> None:
        self.store = tmp / name / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.ts = FakeTorchServe(self.store, initial=None)
        self.clock = FakeClock()
        cfg = SidecarConfig(management_url="http://ts", model_store=self.store,
                            switch_grace_s=0.0, state_file=state_file,
                            repositories=tuple(repo.roots))
        client = TorchServeClient(cfg, httpx.AsyncClient(transport=self.ts.transport()))
        fam = FleetFamilies(workers.families, StaticPeers([]), name)
        self.fleet = Fleet(name, decisions=FileDecisionStore(tmp / "rollout-decisions.json"),
                           lease=FileLease(tmp / "rollout-lease.json", clock=lease_clock),
                           families=fam)
        self.ctl = RolloutController(
            read_families=fam, control_file=lambda v: control_path(self.store, "dlrm", v),
            clock=self.clock, decisions=self.fleet.decisions, identity=name)
        self.rec = Reconciler(client, cfg, switch=VersionSwitch(client, cfg, clock=self.clock,
                                                                sleep=self.clock.sleep),
                              repository=repo, rollouts=self.ctl, clock=self.clock,
                              fleet=self.fleet)
        self.registered: set[str] = set()

    def tick(self):
        p = asyncio.run(self.rec.tick())
        self.registered.update(self.ts.versions)
        return p

    def status(self):
        return asyncio.run(self.rec.status())


def setup(tmp_path: Path) -> tuple[ModelRepository, Path]:
    repo = ModelRepository([add_versions(tmp_path / "repo", [STABLE, CANDIDATE])])
    state_file = tmp_path / "state.yaml"
    write_state(state_file, declared())
    return repo, state_file


def test_one_leader_judges_records_and_settles_the_follower_adopts(tmp_path):
    repo, state_file = setup(tmp_path)
    lease_clock, workers_a, workers_b = Clock(), Workers(), Workers()
    a = Pod(tmp_path, "pod-a", repo, state_file, lease_clock, workers_a)
    b = Pod(tmp_path, "pod-b", repo, state_file, lease_clock, workers_b)
    assert a.tick().target == SERVING and b.tick().target == SERVING
    assert a.fleet.leading and not b.fleet.leading
    assert b.status().fleet.leader == "pod-a"
    for w in (workers_a, workers_b):
        traffic(w, candidate_scores=np.full(200, 0.5))  # the candidate scores badly
    b.clock.now += 5.0
    b.tick()  # the follower never judges
    assert b.ctl.run.phase.value == "baking" and b.ctl.run.evaluations == 0
    for _ in range(declared().rollout.guards.failure_limit):
        a.clock.now += 5.0
        a.tick()  # the leader judges (failure_limit breaches in a row), rolls back,
        # records and settles the file
    decision = FileDecisionStore(tmp_path / "rollout-decisions.json").read(
        rollout_key(STABLE, declared().rollout))
    assert decision is not None and decision.phase == "rolled_back"
    assert decision.decided_by == "pod-a" and "pods_judged: 1 of 1" in decision.reason
    assert load_state(state_file).rollout is None  # settled by the leader
    b.tick()  # adopts: weight 0 at once, then the stable version alone
    ctl_file = control_path(b.store, "dlrm", SERVING)  # weight 0, or gone with the pair
    assert not ctl_file.exists() or read_control(ctl_file).weight == 0.0
    b.tick()
    sa, sb = a.status(), b.status()
    assert sb.rollout.phase == "rolled_back" and sb.rollout.revision == decision.revision
    assert sa.rollout.revision == decision.revision and sb.rollout.decided_by == "pod-a"
    assert list(b.ts.versions) == [f"{STABLE}_b8d50w1"]


def test_a_pod_restarted_while_the_rollback_is_declared_never_registers_the_candidate(
        tmp_path):
    repo, state_file = setup(tmp_path)
    d = declared()
    from serve.sidecar.adapters.fleet_store import RolloutDecision

    FileDecisionStore(tmp_path / "rollout-decisions.json").record(RolloutDecision.make(
        key=rollout_key(STABLE, d.rollout), stable=STABLE, candidate=CANDIDATE,
        phase="rolled_back", reason="guard breached", decided_by="pod-a", decided_at=1.7e9))
    pod = Pod(tmp_path, "pod-b", repo, state_file, Clock(), Workers())
    p = pod.tick()
    assert p.converged and p.target == f"{STABLE}_b8d50w1", p
    pod.tick()
    assert all(CANDIDATE not in v for v in pod.registered), pod.registered
    status = pod.status()
    assert status.rollout.phase == "rolled_back" and status.rollout.decided_by == "pod-a"
    assert load_state(state_file).rollout is None  # pod-b leads now (pod-a is gone): settled


# --------------------------------------------------------------------------- the sidecar app


def test_the_sidecar_app_shows_its_fleet_and_a_post_is_recorded(tmp_path):
    """--fleet file wired through the composition root: GET /state's fleet and
    rollout.revision, dlrm_fleet_leader on /metrics, a POST rollback recorded."""
    from serve.sidecar.config import FleetConfig
    from serve.sidecar.root import build_fleet
    from tests.test_reconciler import make_app, requests

    repo, state_file = setup(tmp_path)
    store = tmp_path / "ts-store"
    store.mkdir()
    ts = FakeTorchServe(store, initial=None)
    fleet = FleetConfig(mode="file", identity="pod-a")
    app = make_app(ts, repo, state_file, fleet=fleet)
    waited, rolled, state, metrics = requests(
        app, ("WAIT", "", None), ("POST", "/state/rollout/rollback", None),
        ("GET", "/state", None), ("GET", "/metrics", None))
    assert waited.json()["fleet"]["leader"] == "pod-a"
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["decided_by"] == "pod-a"
    body = state.json()
    assert body["fleet"]["identity"] == "pod-a" and body["fleet"]["leading"] is True
    assert body["rollout"]["revision"] == rolled.json()["revision"]
    recorded = FileDecisionStore(tmp_path / "rollout-decisions.json").read(
        rollout_key(STABLE, declared().rollout))
    assert recorded is not None and recorded.revision == rolled.json()["revision"]
    assert "by POST on pod-a" in recorded.reason
    assert "dlrm_fleet_leader 1.0" in metrics.text
    from serve.sidecar.config import SidecarConfig as Config

    assert build_fleet(Config(state_file=state_file), list) is None  # --fleet none
