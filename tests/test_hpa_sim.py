"""The HPA algorithm of serve.ops.hpa_sim on hand-computed cases, the parse of k8s/hpa.yaml,
and the simulation's spike check with the shipped spec."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from serve.errors import ConfigError
from serve.ops.hpa_sim import (
    Hpa,
    HpaSpec,
    ScalingPolicy,
    ScalingRules,
    SimConfig,
    load_hpa,
    main,
    metric_proposal,
    parse_quantity,
    reaction_time_s,
    scale_down_limit,
    scale_up_limit,
    scale_up_steps,
    scenarios,
    simulate,
)

REPO = Path(__file__).resolve().parents[1]
UP = ScalingRules(0, "Max", (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15)))
DOWN = ScalingRules(300, "Max", (ScalingPolicy("Percent", 25, 60),))


def spec(**kw) -> HpaSpec:
    base = {"min_replicas": 2, "max_replicas": 16, "target_qps": 100.0, "cpu_target": None,
                "scale_up": UP, "scale_down": DOWN}
    base.update(kw)
    return HpaSpec(**base)


# --------------------------------------------------------------------------- one metric


@pytest.mark.parametrize("current,values,missing,want", [
    (2, [150.0, 150.0], 0, 3),        # ratio 1.5: ceil(1.5 * 2)
    (2, [105.0, 105.0], 0, 2),        # within the 0.1 tolerance: no change
    (2, [111.0, 111.0], 0, 3),        # just outside it: ceil(1.11 * 2)
    (4, [50.0] * 4, 0, 2),            # ratio 0.5: ceil(0.5 * 4)
    (4, [200.0, 200.0], 2, 4),        # missing count 0 on the way up: 400/4/100 = 1.0
    (4, [300.0, 300.0], 2, 6),        # 600/4/100 = 1.5: ceil(1.5 * 4)
    (4, [40.0, 40.0], 2, 3),          # missing count as target on the way down: 0.7 * 4
    (4, [120.0, 120.0], 2, 4),        # 240/4/100 = 0.6 flips direction: no change
    (3, [], 3, 3),                    # no metric at all: no change
])
def test_metric_proposal_hand_computed(current, values, missing, want):
    assert metric_proposal(current, values, missing, 100.0, 0.1) == want


# --------------------------------------------------------------------------- rate policies


def test_scale_up_limit_takes_the_larger_policy_and_counts_recent_additions():
    assert scale_up_limit(4, [], 0.0, UP) == 8       # max(4 * 2, 4 + 4)
    assert scale_up_limit(2, [], 0.0, UP) == 6       # max(2 * 2, 2 + 4)
    # 2 pods added 10 s ago count against the 15 s period: it started at 2.
    assert scale_up_limit(4, [(10.0, 2)], 20.0, UP) == 6
    assert scale_up_limit(4, [(10.0, 2)], 30.0, UP) == 8  # 20 s ago: outside the period
    minimum = ScalingRules(0, "Min", UP.policies)
    assert scale_up_limit(2, [], 0.0, minimum) == 4  # min(2 * 2, 2 + 4)
    assert scale_up_limit(5, [], 0.0, ScalingRules(0, "Disabled", UP.policies)) == 5


def test_scale_down_limit_truncates_percent_and_counts_recent_removals():
    assert scale_down_limit(8, [], 0.0, DOWN) == 6             # int(8 * 0.75)
    assert scale_down_limit(3, [], 0.0, DOWN) == 2             # int(2.25)
    assert scale_down_limit(8, [(0.0, 2)], 30.0, DOWN) == 7    # period started at 10
    both = ScalingRules(300, "Max", DOWN.policies + (ScalingPolicy("Pods", 1, 60),))
    assert scale_down_limit(8, [], 0.0, both) == 6             # Max: the bigger cut
    assert scale_down_limit(8, [], 0.0, ScalingRules(300, "Min", both.policies)) == 7


def test_scale_up_steps_and_reaction_time():
    assert scale_up_steps(2, 8, UP) == 2   # 2 -> 6 -> 12
    assert scale_up_steps(4, 4, UP) == 0
    s, cfg = spec(), SimConfig(knee_qps=125.0, startup_s=90.0)
    # scrape 15 + window 60 + sync 15 + up window 0 + 2 periods x 15 + start-up 90
    assert reaction_time_s(s, cfg, 2, 8) == 210.0


# --------------------------------------------------------------------------- stabilization


def test_scale_down_waits_for_the_stabilization_window_then_obeys_the_policy():
    hpa = Hpa(spec())
    assert hpa.decide(0.0, 4, 4) == 4
    for t in range(15, 300, 15):   # the proposal drops to 2, but 4 is in the window
        assert hpa.decide(float(t), 4, 2) == 4, t
    # At 300 s the t=0 recommendation has left the window: down, 25% per minute at most.
    assert hpa.decide(300.0, 4, 2) == 3
    assert hpa.decide(315.0, 3, 2) == 3        # the period started at 4: int(4 * 0.75) = 3
    assert hpa.decide(375.0, 3, 2) == 2        # that removal is over 60 s old: int(3 * 0.75)
    assert hpa.decide(390.0, 2, 1) == 2        # minReplicas


def test_scale_up_is_immediate_and_capped():
    hpa = Hpa(spec(max_replicas=10))
    assert hpa.decide(0.0, 2, 20) == 6         # policy: max(2 * 2, 2 + 4)
    assert hpa.decide(15.0, 6, 20) == 10       # then maxReplicas
    window = Hpa(spec(scale_up=ScalingRules(60, "Max", UP.policies)))
    assert window.decide(0.0, 2, 2) == 2
    assert window.decide(15.0, 2, 5) == 2      # lowest proposal of the last 60 s is 2
    assert window.decide(75.0, 2, 5) == 5


# --------------------------------------------------------------------------- manifest


def test_load_hpa_reads_the_shipped_manifest():
    doc = yaml.safe_load((REPO / "k8s" / "hpa.yaml").read_text())["spec"]
    s = load_hpa(REPO / "k8s" / "hpa.yaml")
    assert (s.min_replicas, s.max_replicas) == (doc["minReplicas"], doc["maxReplicas"])
    assert s.scale_down.stabilization_window_s == 300
    assert s.scale_up.stabilization_window_s == 0
    assert [(p.type, p.value, p.period_s) for p in s.scale_up.policies] == \
        [(p["type"], p["value"], p["periodSeconds"]) for p in doc["behavior"]["scaleUp"]["policies"]]
    assert s.cpu_target == pytest.approx(
        next(m for m in doc["metrics"] if m["type"] == "Resource")["resource"]["target"]
        ["averageUtilization"] / 100)
    assert s.tolerance == 0.1


def test_spec_errors_name_the_rule():
    with pytest.raises(ConfigError, match=r"minReplicas 5 and maxReplicas 3: need 1 <= min <= max"):
        spec(min_replicas=5, max_replicas=3)
    with pytest.raises(ConfigError, match=r"no Pods metric named 'dlrm_requests_per_second'"):
        HpaSpec.from_manifest({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                               "spec": {"maxReplicas": 3, "metrics": []}})


@pytest.mark.parametrize("q,want", [("100", 100.0), ("12.5", 12.5), ("1500m", 1.5),
                                    (7, 7.0), ("2k", 2000.0)])
def test_parse_quantity(q, want):
    assert parse_quantity(q) == want


def test_parse_quantity_rejects_garbage():
    with pytest.raises(ConfigError, match=r"quantity 'lots' is not a Kubernetes quantity"):
        parse_quantity("lots")


# --------------------------------------------------------------------------- simulation


def test_constant_load_settles_within_tolerance_of_the_target():
    s, cfg = spec(), SimConfig(knee_qps=125.0, startup_s=60.0)
    r = simulate(s, cfg, lambda t: 730.0, 1800.0)
    # 2 pods at 365 req/s: ceil(3.65 * 2) = 8, capped by the policy at max(2 * 2, 2 + 4) = 6;
    # 6 pods at 121.7: ceil(1.217 * 6) = 8; 8 pods at 91.25 are within the tolerance.
    # Then the old pods' 1 m rate still holds the overload from before the new pods were
    # Ready: an overshoot (as on a real cluster), undone after the 300 s scale-down window.
    changes = [n for i, n in enumerate(r.replicas) if i == 0 or n != r.replicas[i - 1]]
    assert changes[:3] == [2, 6, 8]
    assert abs(730.0 / r.replicas[-1] / 100.0 - 1.0) <= 0.1
    assert r.replicas[-1] == r.ready[-1] == 8


def test_low_load_stays_at_min_replicas_without_risk():
    r = simulate(spec(), SimConfig(knee_qps=125.0), lambda t: 50.0, 1200.0)
    assert set(r.replicas) == {2} and not r.intervals


def test_spike_over_capacity_is_bounded_by_the_reaction_time():
    s = load_hpa(REPO / "k8s" / "hpa.yaml")
    cfg = SimConfig(knee_qps=s.target_qps / 0.8, startup_s=90.0)
    fn, duration = scenarios(s, cfg)["spike"]
    r = simulate(s, cfg, fn, duration, name="spike")
    start = max(math.ceil(1.5 * cfg.knee_qps / s.target_qps), s.min_replicas)
    needed = math.ceil(6.0 * cfg.knee_qps / s.target_qps)
    assert needed <= s.max_replicas
    assert r.intervals, "a 4x spike must show some over-capacity (start-up takes time)"
    assert r.longest_over_s <= reaction_time_s(s, cfg, start, needed)


def test_a_slow_scale_up_fails_the_spike_check():
    """Negative control: a 10-minute scale-up window makes the spike run over."""
    s = spec(scale_up=ScalingRules(600, "Max", UP.policies))
    cfg = SimConfig(knee_qps=125.0, startup_s=90.0)
    fn, duration = scenarios(s, cfg)["spike"]
    r = simulate(s, cfg, fn, duration)
    bound = reaction_time_s(spec(), cfg, 2, 8)  # what the fast spec promises
    assert r.longest_over_s > bound


def test_main_prints_plots_and_writes_json(tmp_path, capsys):
    rc = main(["--knee-qps", "125", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "spike: longest over-capacity interval" in out and ": OK" in out
    doc = json.loads((tmp_path / "hpa_sim.json").read_text())
    assert set(doc["scenarios"]) == {"ramp", "spike", "diurnal"}
    assert doc["spike_check"]["ok"] is True
    png = (tmp_path / "hpa_sim.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
