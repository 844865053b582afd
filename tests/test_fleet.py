"""One rollout decision per fleet (serve/sidecar/control/fleet.py), step by step: the
decision record, the first-writer-wins store, the lease on an injected clock, the fleet's
families, and the rollout controller's born-decided / adopt hooks. No server here."""
from __future__ import annotations

import json
import threading

import pytest

from serve.errors import ConfigError
from serve.metrics import FLEET_LEADER, FLEET_PODS_JUDGED
from serve.sidecar.adapters.fleet_store import (
    FileDecisionStore,
    FileLease,
    FilePeers,
    Peer,
    RolloutDecision,
    StaticPeers,
    decision_revision,
    read_fleet_file,
    write_fleet_file,
)
from serve.sidecar.control.fleet import Fleet, FleetFamilies
from serve.sidecar.control.rollout import RolloutController, RolloutPhase, rollout_key
from serve.store.routing import read_control
from tests.test_rollout import CANDIDATE, SERVING, STABLE, Clock, Workers, desired, traffic


def decision(key: str = "k1", phase: str = "rolled_back", by: str = "pod-a",
             at: float = 1.7e9) -> RolloutDecision:
    return RolloutDecision.make(key=key, stable=STABLE, candidate=CANDIDATE, phase=phase,
                                reason="guard error_ratio breached", decided_by=by,
                                decided_at=at)


# --------------------------------------------------------------------------- the record


def test_decision_round_trips_through_json_and_its_revision_is_stable():
    d = decision()
    assert RolloutDecision.from_json(json.loads(json.dumps(d.to_json()))) == d
    assert d.revision == decision_revision("k1", "rolled_back", 1.7e9, "pod-a")
    assert d.revision.startswith("k1-") and len(d.revision) == len("k1-") + 8
    assert decision(by="pod-b").revision != d.revision
    assert decision(phase="promoted").revision != d.revision


def test_decision_refuses_a_bad_phase_or_record():
    with pytest.raises(ValueError, match="phase 'baking' must be one of"):
        decision(phase="baking")
    with pytest.raises(ValueError, match="lacks or mistypes 'revision'"):
        RolloutDecision.from_json({k: v for k, v in decision().to_json().items()
                                   if k != "revision"})
    with pytest.raises(ValueError, match="is a JSON object, got list"):
        RolloutDecision.from_json([])


# --------------------------------------------------------------------------- the store


def test_store_first_writer_wins(tmp_path):
    store = FileDecisionStore(tmp_path / "decisions.json")
    assert store.read("k1") is None
    first = store.record(decision(by="pod-a"))
    assert first.decided_by == "pod-a"
    second = store.record(decision(phase="promoted", by="pod-b", at=1.7e9 + 5))
    assert second == first  # the existing one, unchanged
    assert FileDecisionStore(tmp_path / "decisions.json").read("k1") == first
    assert store.read("other") is None


def test_store_keeps_the_newest_decisions(tmp_path):
    store = FileDecisionStore(tmp_path / "d.json", keep=3)
    for i in range(5):
        store.record(decision(key=f"k{i}"))
    kept = [d["key"] for d in json.loads((tmp_path / "d.json").read_text())["decisions"]]
    assert kept == ["k2", "k3", "k4"]
    assert store.read("k0") is None and store.read("k4") is not None


def test_store_racing_writers_agree_on_one_decision(tmp_path):
    path = tmp_path / "d.json"
    results: list[RolloutDecision] = []
    lock = threading.Lock()

    def write(i: int) -> None:
        got = FileDecisionStore(path).record(decision(by=f"pod-{i}", at=1.7e9 + i))
        with lock:
            results.append(got)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.revision for r in results}) == 1
    assert FileDecisionStore(path).read("k1") == results[0]


def test_store_reads_a_broken_file_as_empty(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("{not json")
    store = FileDecisionStore(path)
    assert store.read("k1") is None
    assert store.record(decision()).decided_by == "pod-a"


# --------------------------------------------------------------------------- the lease


def test_lease_is_held_renewed_expires_and_is_taken_over(tmp_path):
    clock = Clock()
    a = FileLease(tmp_path / "lease.json", duration_s=15, clock=clock)
    b = FileLease(tmp_path / "lease.json", duration_s=15, clock=clock)
    assert a.try_acquire("pod-a") is True
    assert b.try_acquire("pod-b") is False and b.holder() == "pod-a"
    clock.t += 10
    assert a.try_acquire("pod-a") is True  # renewed at +10
    clock.t += 10
    assert b.try_acquire("pod-b") is False  # 10 s since the renewal: still held
    clock.t += 5
    assert a.holder() is None  # 15 s without renewal: expired
    assert b.try_acquire("pod-b") is True and a.holder() == "pod-b"
    assert a.try_acquire("pod-a") is False
    body = json.loads((tmp_path / "lease.json").read_text())
    assert body["holder"] == "pod-b" and body["transitions"] == 2


def test_lease_refuses_a_bad_duration(tmp_path):
    with pytest.raises(ConfigError, match="duration_s=0 must be > 0"):
        FileLease(tmp_path / "l.json", duration_s=0)


# --------------------------------------------------------------------------- peers


def test_fleet_file_round_trip_and_errors(tmp_path):
    pods = [Peer("pod-a", "http://127.0.0.1:8180", "http://127.0.0.1:8190",
                 "http://127.0.0.1:8191"),
            Peer("pod-b", "http://127.0.0.1:8280", "http://127.0.0.1:8290")]
    write_fleet_file(tmp_path / "fleet.json", pods)
    assert read_fleet_file(tmp_path / "fleet.json") == pods
    assert FilePeers(tmp_path / "fleet.json").peers() == pods
    assert read_fleet_file(tmp_path / "absent.json") == []
    (tmp_path / "bad.json").write_text('{"pods": [{"name": "x"}]}')
    with pytest.raises(ConfigError, match="lacks name, predict_url or sidecar_url"):
        read_fleet_file(tmp_path / "bad.json")


def _metrics_text(workers: Workers) -> str:
    from prometheus_client import generate_latest

    return generate_latest(workers.registry).decode()


def test_fleet_families_sum_every_pod_and_skip_a_silent_one():
    own, b, c = Workers(), Workers(), Workers()
    traffic(own, requests=(10, 2))
    traffic(b, requests=(30, 6))
    traffic(c, requests=(50, 10))
    down = {"pod-c": False}

    def get(url: str, timeout_s: float) -> str:
        assert timeout_s == 1.0
        if "9390" in url:
            if down["pod-c"]:
                raise TimeoutError("timed out")
            return _metrics_text(c)
        return _metrics_text(b)

    peers = StaticPeers([Peer("pod-a", "http://x:1", "http://127.0.0.1:9190"),
                         Peer("pod-b", "http://x:2", "http://127.0.0.1:9290"),
                         Peer("pod-c", "http://x:3", "http://127.0.0.1:9390")])
    fam = FleetFamilies(own.families, peers, "pod-a", get=get)
    from serve.sidecar.control.guards import snapshot

    snap = snapshot(fam(), stable_version=STABLE, candidate_version=CANDIDATE)
    assert (snap.stable.requests, snap.candidate.requests) == (90, 18)
    assert fam.describe() == "pods_judged: 3 of 3"
    down["pod-c"] = True
    traffic(b, requests=(30, 6))
    snap = snapshot(fam(), stable_version=STABLE, candidate_version=CANDIDATE)
    # pod-c's last answer still counts: the window never goes backwards
    assert (snap.stable.requests, snap.candidate.requests) == (120, 24)
    assert (fam.judged, fam.pods) == (2, 3)
    assert fam.describe() == "pods_judged: 2 of 3 (skipped pod-c: TimeoutError: timed out)"


# --------------------------------------------------------------------------- the fleet


def test_fleet_elects_and_reports(tmp_path):
    clock = Clock()
    lease = tmp_path / "lease.json"
    a = Fleet("pod-a", decisions=FileDecisionStore(tmp_path / "d.json"),
              lease=FileLease(lease, clock=clock))
    b = Fleet("pod-b", decisions=FileDecisionStore(tmp_path / "d.json"),
              lease=FileLease(lease, clock=clock))
    assert a.elect() and not b.elect()
    assert b.status()["leader"] == "pod-a" and not b.status()["leading"]
    values = {s.name: s.value for m in a.collect() for s in m.samples}
    assert values[FLEET_LEADER] == 1.0 and values[FLEET_PODS_JUDGED] == 1.0
    assert {s.name: s.value for m in b.collect() for s in m.samples}[FLEET_LEADER] == 0.0
    solo = Fleet("solo", decisions=FileDecisionStore(tmp_path / "s.json"))
    assert solo.elect() and solo.status()["leader"] == "solo"


def test_an_unreachable_lease_is_not_held(tmp_path):
    class Broken:
        def try_acquire(self, identity: str) -> bool:
            raise OSError("api server down")

        def holder(self) -> str | None:
            return None

    f = Fleet("pod-a", decisions=FileDecisionStore(tmp_path / "d.json"), lease=Broken())
    assert f.elect() is False and f.status()["error"] == "lease: api server down"
    with pytest.raises(ConfigError, match="identity"):
        Fleet("", decisions=FileDecisionStore(tmp_path / "d.json"))


# --------------------------------------------------------------------------- the controller


def controller(tmp_path, store: FileDecisionStore, identity: str, workers: Workers,
               clock: Clock) -> RolloutController:
    return RolloutController(read_families=workers.families,
                             control_file=lambda v: tmp_path / f"{v}.control.json",
                             clock=clock, wall_clock=lambda: 1.7e9, decisions=store,
                             identity=identity)


def test_leader_records_a_rollback_and_a_follower_adopts_it(tmp_path):
    store = FileDecisionStore(tmp_path / "d.json")
    clock, workers = Clock(), Workers()
    leader = controller(tmp_path / "a", store, "pod-a", workers, clock)
    follower = controller(tmp_path / "b", store, "pod-b", workers, clock)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    d = desired()
    for ctl in (leader, follower):
        ctl.declare(d)
        ctl.on_serving(d, SERVING)
    assert read_control(tmp_path / "b" / f"{SERVING}.control.json").weight == 0.2
    leader.rollback("guard error_ratio breached: 0.5 > 0.01")
    assert leader.sync_decision("pods_judged: 2 of 2") is None  # its own: nothing to adopt
    recorded = store.read(rollout_key(STABLE, d.rollout))
    assert recorded is not None and recorded.decided_by == "pod-a"
    assert recorded.reason.endswith("[pods_judged: 2 of 2]")
    assert follower.sync_decision() == "rolled_back"
    assert follower.run is not None and follower.run.phase is RolloutPhase.ROLLED_BACK
    assert read_control(tmp_path / "b" / f"{SERVING}.control.json").weight == 0.0
    status = follower.status()
    assert status is not None and (status.revision, status.decided_by) == (
        recorded.revision, "pod-a")
    assert leader.status().revision == recorded.revision
    assert follower.effective(d).rollout is None  # the candidate is dropped
    assert follower.sync_decision() is None  # adopted already: idempotent


def test_a_restarted_pod_is_born_decided(tmp_path):
    store = FileDecisionStore(tmp_path / "d.json")
    d = desired()
    store.record(decision(key=rollout_key(STABLE, d.rollout), by="pod-a"))
    restarted = controller(tmp_path, store, "pod-b", Workers(), Clock())
    run = restarted.declare(d)
    assert run is not None and run.phase is RolloutPhase.ROLLED_BACK
    assert run.decided_by == "pod-a"
    effective = restarted.effective(d)
    assert effective is not None and effective.rollout is None
    assert CANDIDATE not in effective.serving_version()  # never registered again
    restarted.on_serving(d, SERVING)  # a pass that finds the two-arm version: no bake
    assert run.serving_version is None and not restarted.due()


def test_a_post_on_a_follower_loses_to_the_recorded_decision(tmp_path):
    store = FileDecisionStore(tmp_path / "d.json")
    clock, workers = Clock(), Workers()
    a = controller(tmp_path, store, "pod-a", workers, clock)
    b = controller(tmp_path, store, "pod-b", workers, clock)
    d = desired()
    a.declare(d)
    b.declare(d)
    a.rollback("guard breached")
    a.sync_decision()
    b.promote("POST /state/rollout/promote")  # raced: the store already holds a rollback
    assert b.sync_decision() == "rolled_back"
    assert b.run is not None and b.run.phase is RolloutPhase.ROLLED_BACK
    assert b.run.decided_by == "pod-a"


def test_without_a_store_the_outcome_is_stamped_as_its_own(tmp_path):
    clock, workers = Clock(), Workers()
    ctl = RolloutController(read_families=workers.families,
                            control_file=lambda v: tmp_path / f"{v}.control.json",
                            clock=clock, wall_clock=lambda: 1.7e9)
    d = desired()
    ctl.declare(d)
    assert ctl.sync_decision() is None and ctl.status().revision is None
    ctl.promote("by hand")
    ctl.sync_decision()
    status = ctl.status()
    assert status.decided_by == "local" and status.revision is not None
    assert status.revision.startswith(rollout_key(STABLE, d.rollout))


def test_an_unreachable_store_holds_the_candidate_back_until_it_answers(tmp_path):
    class Flaky(FileDecisionStore):
        down = True

        def read(self, key: str) -> RolloutDecision | None:
            if self.down:
                raise OSError("api server down")
            return super().read(key)

    store = Flaky(tmp_path / "d.json")
    ctl = controller(tmp_path, store, "pod-b", Workers(), Clock())
    d = desired()
    with pytest.raises(OSError):
        ctl.declare(d)
    effective = ctl.effective(d)
    assert effective is not None and effective.rollout is None  # stable alone meanwhile
    assert "held back" in (ctl.status().reason or "")
    store.down = False
    FileDecisionStore(tmp_path / "d.json").record(decision(key=rollout_key(STABLE, d.rollout)))
    run = ctl.declare(d)
    assert run is not None and run.phase is RolloutPhase.ROLLED_BACK and run.checked


def test_the_lease_is_asked_at_most_every_renew_period(tmp_path):
    asked = []

    class Counting(FileLease):
        def try_acquire(self, identity: str) -> bool:
            asked.append(identity)
            return super().try_acquire(identity)

    mono = Clock()
    f = Fleet("pod-a", decisions=FileDecisionStore(tmp_path / "d.json"),
              lease=Counting(tmp_path / "l.json", clock=Clock()), renew_every_s=5.0, clock=mono)
    assert f.elect() and f.elect()
    mono.t += 4.9
    assert f.elect() and len(asked) == 1
    mono.t += 0.1
    assert f.elect() and len(asked) == 2
