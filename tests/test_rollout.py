"""The rollout controller's steps, one by one, on a fake clock and real metric families.

The workers' per-arm series are written with prometheus_client into a plain registry (the
same family shapes the sidecar's multiprocess collector yields), so the controller reads
them exactly as it does in the pod. No TorchServe here: tests/test_rollout_e2e.py runs
the whole thing under load.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from serve.errors import Conflict
from serve.metrics import (
    ARM_ERRORS_TOTAL,
    ARM_FORWARD_SECONDS_PER_INSTANCE,
    ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS,
    ARM_REQUEST_DURATION_SECONDS,
    ARM_REQUESTS_TOTAL,
    ARM_SCORE,
    REQUEST_DURATION_BUCKETS,
    ROLLOUT_PHASE,
    ROLLOUT_WEIGHT,
    SCORE_BUCKETS,
)
from serve.metrics.sidecar import SidecarMetrics
from serve.sidecar.control.rollout import RolloutController, RolloutPhase, limits_of, rollout_key
from serve.state import DesiredState, parse_state
from serve.store.routing import read_control

STABLE, CANDIDATE = "small-int8-s0", "small-int8-s7"
SERVING = f"{STABLE}_b2d0w2_c{CANDIDATE}"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Workers:
    """Per-arm series as the handler writes them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(ARM_REQUESTS_TOTAL.removesuffix("_total"), "r",
                                ["arm", "version"], registry=r)
        self.errors = Counter(ARM_ERRORS_TOTAL.removesuffix("_total"), "e",
                              ["arm", "version"], registry=r)
        self.latency = Histogram(ARM_REQUEST_DURATION_SECONDS, "l", ["arm", "version"],
                                 buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.score = Histogram(ARM_SCORE, "s", ["arm", "version"], buckets=SCORE_BUCKETS,
                               registry=r)
        self.forward = Histogram(ARM_FORWARD_SECONDS_PER_INSTANCE, "f", ["arm", "version"],
                                 buckets=ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS, registry=r)

    def serve(self, arm: str, version: str, requests: int, *, errors: int = 0,
              latency_s: float = 0.01, scores: np.ndarray | None = None) -> None:
        """``requests`` requests of one forward each, of 100 instances: the forward's
        seconds per instance are ``latency_s / 100``."""
        self.requests.labels(arm, version).inc(requests)
        if errors:
            self.errors.labels(arm, version).inc(errors)
        for _ in range(requests):
            self.latency.labels(arm, version).observe(latency_s)
            self.forward.labels(arm, version).observe(latency_s / 100)
        for s in (scores if scores is not None else []):
            self.score.labels(arm, version).observe(float(s))

    def families(self) -> list:
        return list(self.registry.collect())


def good_scores(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).beta(2, 6, size=n)


def desired(**rollout) -> DesiredState:
    spec = {"candidate": CANDIDATE, "mode": "canary", "weight": 0.2, "bake_s": 30,
            "guards": {"interval_s": 5, "min_requests": 10, "min_instances": 100,
                       "min_forwards": 10}}
    spec.update(rollout)
    return parse_state({"model": {"version": STABLE}, "rollout": spec})


@pytest.fixture
def rig(tmp_path):
    clock, workers, metrics = Clock(), Workers(), SidecarMetrics()
    ctl = RolloutController(read_families=workers.families,
                            control_file=lambda v: tmp_path / f"{v}.control.json",
                            metrics=metrics, clock=clock, wall_clock=lambda: 1.7e9)
    return ctl, clock, workers, metrics, tmp_path


def control(tmp_path, version=SERVING):
    return read_control(tmp_path / f"{version}.control.json")


def traffic(workers: Workers, *, candidate_scores=None, candidate_errors=0, seed=0,
            requests=(80, 20), latency=(0.01, 0.01)) -> None:
    workers.serve("stable", STABLE, requests[0], latency_s=latency[0],
                  scores=good_scores(requests[0] * 10, seed))
    cand = candidate_scores if candidate_scores is not None else good_scores(
        requests[1] * 10, seed + 1)
    workers.serve("candidate", CANDIDATE, requests[1], errors=candidate_errors,
                  latency_s=latency[1], scores=cand)


def gauge(metrics: SidecarMetrics, name: str, **labels) -> float:
    for fam in metrics.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_declared_rollout_bakes_at_weight_zero_until_it_serves(rig):
    ctl, _, _, metrics, tmp = rig
    d = desired()
    run = ctl.declare(d)
    assert run is not None and run.phase is RolloutPhase.BAKING
    assert ctl.effective(d) == d and d.serving_version() == SERVING
    status = ctl.status()
    assert status.phase == "baking" and status.weight == 0.0 and not status.serving
    assert "loading" in status.reason
    assert gauge(metrics, ROLLOUT_PHASE, phase="baking") == 1.0
    assert not ctl.due() and ctl.tick() is None

    assert ctl.on_serving(d, SERVING) is True
    assert control(tmp).weight == pytest.approx(0.2) and control(tmp).mode == "canary"
    assert ctl.status().serving and ctl.status().weight == pytest.approx(0.2)
    assert gauge(metrics, ROLLOUT_WEIGHT) == pytest.approx(0.2)
    assert ctl.on_serving(d, SERVING) is False  # once per serving version


def test_guards_every_interval_then_promotion_after_bake(rig):
    ctl, clock, workers, metrics, _ = rig
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    traffic(workers)
    clock.t += 4.9
    assert not ctl.due()
    clock.t += 0.2
    assert ctl.tick() is None  # evaluated, within bake
    status = ctl.status()
    assert status.evaluations == 1 and [g.name for g in status.guards] == [
        "error_ratio", "latency_ratio", "score_psi", "ne_increase", "calibration_gap"]
    assert all(g.status == "ok" for g in status.guards[:3]), status.guards
    # no labels posted: the click-quality gates wait, without blocking (min_labels 0)
    assert all(g.status == "insufficient_data" and not g.blocking
               for g in status.guards[3:]), status.guards
    for _ in range(5):
        traffic(workers, seed=3)
        clock.t += 5.0
        transition = ctl.tick()
    assert transition == "promoted"
    status = ctl.status()
    assert status.phase == "promoted" and "every guard held" in status.reason
    promoted = ctl.effective(d)
    assert promoted.model.version == CANDIDATE and promoted.rollout is None
    assert gauge(metrics, ROLLOUT_PHASE, phase="promoted") == 1.0
    assert ctl.settled_state(d) == promoted
    ctl.mark_settled()
    assert ctl.settled_state(d) is None


def test_steps_walk_the_weights_one_bake_each(rig):
    ctl, clock, workers, _, tmp = rig
    d = desired(weight=0.1, steps=[0.5, 1.0], bake_s=10)
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    seen = [control(tmp).weight]
    transitions = []
    for i in range(12):
        traffic(workers, seed=i)
        clock.t += 5.0
        t = ctl.tick()
        if t:
            transitions.append(t)
            seen.append(control(tmp).weight)
        if t == "promoted":
            break
    assert transitions == ["stepped", "stepped", "promoted"]
    assert seen[:3] == [pytest.approx(0.1), pytest.approx(0.5), pytest.approx(1.0)]


def test_score_shift_rolls_back_after_failure_limit_breaches_in_a_row(rig):
    ctl, clock, workers, metrics, tmp = rig
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    flat = np.full(200, 0.5)  # a shuffled-label model: every score near the base rate
    for n in (1, 2):
        traffic(workers, candidate_scores=flat)
        clock.t += 5.0
        assert ctl.tick() is None  # breached, still counting
        status = ctl.status()
        assert status.phase == "baking" and control(tmp).weight == pytest.approx(0.2)
        assert f"guard score_psi breached {n} of 3 times in a row" in status.reason
        psi = next(g for g in status.guards if g.name == "score_psi")
        assert psi.status == "breached" and psi.consecutive_breaches == n
    traffic(workers, candidate_scores=flat)
    clock.t += 5.0
    assert ctl.tick() == "rolled_back"
    status = ctl.status()
    assert status.phase == "rolled_back" and status.weight == 0.0
    assert "score_psi breached 3 times in a row" in status.reason
    psi = next(g for g in status.guards if g.name == "score_psi")
    assert psi.status == "breached" and psi.value > psi.threshold
    assert control(tmp).weight == 0.0  # at once, before any switch
    stable_only = ctl.effective(d)
    assert stable_only.rollout is None and stable_only.model.version == STABLE
    assert gauge(metrics, ROLLOUT_PHASE, phase="rolled_back") == 1.0
    with pytest.raises(Conflict, match="rolled_back already"):
        ctl.promote("late")


def test_errors_roll_back_at_once_and_latency_after_failure_limit(rig):
    ctl, clock, workers, _, _ = rig
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    traffic(workers, candidate_errors=5)  # 5 of 20: Wilson 99% lower bound ~0.07 > 0.01
    clock.t += 5.0
    assert ctl.tick() == "rolled_back"
    assert "error_ratio breached:" in ctl.status().reason

    d2 = desired(weight=0.3)  # a new spec: a new run
    ctl.declare(d2)
    assert ctl.run.key == rollout_key(STABLE, d2.rollout) and ctl.run.phase is RolloutPhase.BAKING
    ctl.on_serving(d2, SERVING)
    transitions = []
    for _ in range(3):
        traffic(workers, latency=(0.005, 0.5))
        clock.t += 5.0
        transitions.append(ctl.tick())
    assert transitions == [None, None, "rolled_back"]
    assert "latency_ratio breached 3 times in a row" in ctl.status().reason


def test_an_ok_evaluation_resets_the_count(rig):
    """A breach that does not hold (a transient) never rolls back: breached, breached, ok,
    breached, breached is never 3 in a row."""
    ctl, clock, workers, _, _ = rig
    d = desired(bake_s=600)
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    seen = []
    # The window is cumulative since the weight began: fast traffic outweighs the slow
    # forwards for the ok evaluation, then more slow traffic outweighs it again.
    for slow, n in ((True, 20), (True, 20), (False, 200), (True, 600), (True, 100)):
        traffic(workers, requests=(80, n), latency=(0.01, 0.05 if slow else 0.01))
        clock.t += 5.0
        assert ctl.tick() is None
        g = next(g for g in ctl.status().guards if g.name == "latency_ratio")
        seen.append((g.status, g.consecutive_breaches))
    assert seen == [("breached", 1), ("breached", 2), ("ok", 0), ("breached", 1),
                    ("breached", 2)]
    assert ctl.status().phase == "baking"


def test_manual_rollback_ignores_the_failure_limit(rig):
    ctl, clock, workers, _, tmp = rig
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    traffic(workers, latency=(0.005, 0.5))
    clock.t += 5.0
    assert ctl.tick() is None
    assert ctl.rollback("by hand").phase is RolloutPhase.ROLLED_BACK
    assert ctl.status().reason == "by hand" and control(tmp).weight == 0.0


def test_failure_limit_one_rolls_back_on_the_first_breach(rig):
    ctl, clock, workers, _, _ = rig
    d = desired(guards={"interval_s": 5, "min_requests": 10, "min_instances": 100,
                        "min_forwards": 10, "failure_limit": 1})
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    traffic(workers, latency=(0.005, 0.5))
    clock.t += 5.0
    assert ctl.tick() == "rolled_back"
    assert "guard latency_ratio breached:" in ctl.status().reason


def test_bake_waits_for_data_instead_of_promoting_blind(rig):
    ctl, clock, workers, _, _ = rig
    d = desired(bake_s=5)
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    traffic(workers, requests=(80, 3))  # 3 of the 10 candidate requests needed
    clock.t += 6.0
    assert ctl.tick() is None
    status = ctl.status()
    assert status.phase == "baking" and "not every guard could judge" in status.reason
    traffic(workers, requests=(80, 20))
    clock.t += 5.0
    assert ctl.tick() == "promoted"


def test_manual_promote_and_rollback(rig):
    ctl, _, _, _, tmp = rig
    with pytest.raises(Conflict, match="no rollout was declared"):
        ctl.rollback("by hand")
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    ctl.rollback("by hand")
    assert ctl.status().phase == "rolled_back" and control(tmp).weight == 0.0
    d2 = desired(mode="shadow")
    ctl.declare(d2)
    ctl.promote("by hand")
    assert ctl.effective(d2).model.version == CANDIDATE


def test_metric_guard_values_mirror_status(rig):
    ctl, clock, workers, metrics, _ = rig
    assert gauge(metrics, ROLLOUT_PHASE, phase="none") == 1.0
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    traffic(workers)
    clock.t += 5.0
    ctl.tick()
    for g in ctl.status().guards:
        value = gauge(metrics, "dlrm_rollout_guard_value", guard=g.name)
        assert math.isnan(value) if g.value is None else value == pytest.approx(g.value)
        assert gauge(metrics, "dlrm_rollout_guard_threshold", guard=g.name) == g.threshold
    assert not math.isnan(gauge(metrics, "dlrm_rollout_guard_value", guard="score_psi"))


# ------------------------------------------------------------------ through the reconciler


def test_reconciler_loads_both_settles_the_outcome_and_unloads(tmp_path):
    """Declared rollout -> a two-arm registration holding the candidate's artifact, bake
    started once it serves; a breach -> weight 0, the file rewritten without the rollout,
    and the next pass switches to the stable version alone."""
    import asyncio
    import zipfile

    import httpx
    import yaml

    from serve.constants import CANDIDATE_ARTIFACT
    from serve.sidecar.adapters.archives import control_path
    from serve.sidecar.adapters.torchserve import TorchServeClient
    from serve.sidecar.config import SidecarConfig
    from serve.sidecar.control.reconciler import Reconciler
    from serve.sidecar.control.switch import VersionSwitch
    from serve.state import load_state, write_state
    from serve.store.repository import ModelRepository
    from tests.fixtures.sidecar import FakeClock, FakeTorchServe, add_versions

    repo = ModelRepository([add_versions(tmp_path / "repo", [STABLE, CANDIDATE])])
    store = tmp_path / "store"
    store.mkdir()
    ts = FakeTorchServe(store, initial=None)
    state_file = tmp_path / "state.yaml"
    d = desired(bake_s=60, guards={"interval_s": 5, "min_requests": 10, "min_instances": 100,
                                   "failure_limit": 1})
    d = d.model_copy(update={"batching": d.batching.model_copy(
        update={"batch_size": 8, "max_batch_delay_ms": 50}), "workers": 1})
    write_state(state_file, d)
    clock, workers = FakeClock(), Workers()
    cfg = SidecarConfig(management_url="http://ts", model_store=store, switch_grace_s=0.0,
                        state_file=state_file, repositories=tuple(repo.roots))
    client = TorchServeClient(cfg, httpx.AsyncClient(transport=ts.transport()))
    ctl = RolloutController(read_families=workers.families,
                            control_file=lambda v: control_path(store, "dlrm", v), clock=clock)
    rec = Reconciler(client, cfg, switch=VersionSwitch(client, cfg, clock=clock,
                                                       sleep=clock.sleep),
                     repository=repo, rollouts=ctl, clock=clock)

    serving = f"{STABLE}_b8d50w1_c{CANDIDATE}"
    p = asyncio.run(rec.tick())
    assert p.target == serving and p.converged, p
    mar = store / f"dlrm-{serving}.mar"
    with zipfile.ZipFile(mar) as z:
        assert CANDIDATE_ARTIFACT in z.namelist()
        handler = yaml.safe_load(z.read("model-config.yaml"))["handler"]
    assert handler["rollout"]["candidate_version"] == CANDIDATE
    assert handler["rollout"]["control_file"] == str(control_path(store, "dlrm", serving))
    assert read_control(control_path(store, "dlrm", serving)).weight == pytest.approx(0.2)
    status = asyncio.run(rec.status())
    assert status.observed.candidate == CANDIDATE and status.rollout.serving

    traffic(workers, candidate_scores=np.full(200, 0.5))
    clock.now += 5.0
    asyncio.run(rec.tick())
    assert read_control(control_path(store, "dlrm", serving)).weight == 0.0
    settled = load_state(state_file)
    assert settled.rollout is None and settled.model.version == STABLE
    p = asyncio.run(rec.tick())  # switches to the stable version alone, unloads the pair
    assert p.converged and p.target == f"{STABLE}_b8d50w1", p
    assert list(ts.versions) == [f"{STABLE}_b8d50w1"]
    assert not control_path(store, "dlrm", serving).exists()
    status = asyncio.run(rec.status())
    assert status.rollout.phase == "rolled_back" and "score_psi" in status.rollout.reason


def test_spec_defaults_are_the_guard_defaults():
    """One set of defaults: the desired state's guards and GuardLimits agree."""
    from serve.sidecar.control.guards import GuardLimits
    from serve.state import Guards

    assert limits_of(desired().rollout.model_copy(update={"guards": Guards()})) == GuardLimits()


def test_full_weight_is_judged_over_the_whole_rollout(rig):
    """At weight 1.0 the stable arm gets nothing: its p99 and scores come from the earlier
    weights instead of leaving the bake waiting forever."""
    ctl, clock, workers, _, _ = rig
    d = desired(weight=0.5, steps=[1.0], bake_s=5)
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    traffic(workers)
    clock.t += 5.0
    assert ctl.tick() == "stepped"
    workers.serve("candidate", CANDIDATE, 30, scores=good_scores(300, 9))  # no stable traffic
    clock.t += 5.0
    assert ctl.tick() == "promoted", ctl.status().reason
    psi = next(g for g in ctl.status().guards if g.name == "score_psi")
    assert psi.status == "ok" and "over the whole rollout" in psi.detail


def test_bake_starts_only_when_the_two_arm_registration_serves(rig):
    ctl, _, _, _, tmp = rig
    d = desired()
    ctl.declare(d)
    # a pass that began before the rollout was declared converged on the stable version
    assert ctl.on_serving(d, f"{STABLE}_b2d0w2") is False
    assert not ctl.status().serving and not (tmp / f"{STABLE}_b2d0w2.control.json").exists()
    assert ctl.on_serving(d, SERVING) is True


def test_a_run_judges_its_own_evaluations():
    """RolloutRun.record and RolloutRun.judge alone (no controller, no I/O): breaches in a
    row roll back at failure_limit (error_ratio at once); a bake ends with the next weight
    or promotion only when every blocking guard is ok."""
    from serve.sidecar.control.guards import GuardResult
    from serve.sidecar.control.rollout import RolloutRun, Transition

    spec = desired(steps=[0.5], guards={"interval_s": 5, "failure_limit": 2}).rollout
    assert spec is not None
    run = RolloutRun(key="k", stable=STABLE, spec=spec, started_wall=0.0)

    def judged(status: str, name: str = "score_psi", blocking: bool = True) -> GuardResult:
        return GuardResult(name, None if status == "insufficient_data" else 0.7, 0.5, status,
                           "detail", blocking)

    run.record([judged("breached")], now=1.0)
    assert (run.consecutive, run.last_eval, run.evaluations) == ({"score_psi": 1}, 1.0, 1)
    verdict, reason = run.judge(elapsed=60.0)
    assert verdict is None and reason is not None and "breached 1 of 2 times" in reason
    run.record([judged("breached")], now=2.0)
    verdict, reason = run.judge(elapsed=60.0)
    assert verdict is Transition.ROLLED_BACK and reason == (
        "guard score_psi breached 2 times in a row: detail")
    run.record([judged("ok")], now=3.0)
    assert run.consecutive == {"score_psi": 0} and run.judge(elapsed=1.0) == (None, None)
    run.record([judged("insufficient_data")], now=4.0)
    verdict, reason = run.judge(elapsed=60.0)
    assert verdict is None and reason is not None and reason.startswith("bake time is over")
    run.record([judged("insufficient_data", blocking=False)], now=5.0)
    assert run.judge(elapsed=60.0) == (Transition.STEPPED, None)
    run.step = 1
    assert run.judge(elapsed=60.0) == (
        Transition.PROMOTED, "every guard held through 2 weight(s) of 30 s each")
    run.record([judged("breached", name="error_ratio")], now=6.0)
    assert run.judge(elapsed=60.0)[0] is Transition.ROLLED_BACK  # at once
