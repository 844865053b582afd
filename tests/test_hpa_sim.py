"""The HPA algorithm of serve.ops.hpa_sim on hand-computed cases (tolerance, missing pods,
stabilization, rate policies, max over metrics), the parse of the shipped k8s/hpa.yaml,
the pod model, and the simulation of single, ranking and mixed traffic."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from serve.errors import ConfigError
from serve.ops.hpa_sim import (
    MIXES,
    QPS_METRIC,
    UTILIZATION_METRIC,
    Hpa,
    HpaSpec,
    Mix,
    ScalingPolicy,
    ScalingRules,
    SimConfig,
    load_capacity,
    load_hpa,
    main,
    metric_proposal,
    mixes_from,
    old_spec,
    parse_quantity,
    pod_metrics,
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
    base = {"min_replicas": 2, "max_replicas": 16, "targets": ((QPS_METRIC, 100.0),),
            "cpu_target": None, "scale_up": UP, "scale_down": DOWN}
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
    s, cfg = spec(), SimConfig(startup_s=90.0)
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
    """The simulator's numbers are the shipped file's, not copies."""
    doc = yaml.safe_load((REPO / "k8s" / "hpa.yaml").read_text())["spec"]
    s = load_hpa(REPO / "k8s" / "hpa.yaml")
    assert (s.min_replicas, s.max_replicas) == (doc["minReplicas"], doc["maxReplicas"])
    assert s.targets == tuple((m["pods"]["metric"]["name"],
                               parse_quantity(m["pods"]["target"]["averageValue"]))
                              for m in doc["metrics"] if m["type"] == "Pods")
    assert s.target(UTILIZATION_METRIC) == 0.8 and s.target(QPS_METRIC) > 1000
    assert s.scale_down.stabilization_window_s == doc["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"]
    assert s.scale_up.stabilization_window_s == doc["behavior"]["scaleUp"][
        "stabilizationWindowSeconds"]
    assert [(p.type, p.value, p.period_s) for p in s.scale_up.policies] == \
        [(p["type"], p["value"], p["periodSeconds"]) for p in doc["behavior"]["scaleUp"]["policies"]]
    assert s.cpu_target == pytest.approx(
        next(m for m in doc["metrics"] if m["type"] == "Resource")["resource"]["target"]
        ["averageUtilization"] / 100)
    assert s.tolerance == 0.1


def test_the_simulator_follows_an_edited_manifest(tmp_path):
    """Change the shipped file's target and the parsed spec changes with it."""
    text = (REPO / "k8s" / "hpa.yaml").read_text().replace("averageValue: 800m",
                                                          "averageValue: 600m")
    path = tmp_path / "hpa.yaml"
    path.write_text(text)
    assert load_hpa(path).target(UTILIZATION_METRIC) == pytest.approx(0.6)


def test_spec_errors_name_the_rule():
    with pytest.raises(ConfigError, match=r"minReplicas 5 and maxReplicas 3: need 1 <= min <= max"):
        spec(min_replicas=5, max_replicas=3)
    with pytest.raises(ConfigError, match=r"the HPA has no metric the simulation knows"):
        HpaSpec.from_manifest({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                               "spec": {"maxReplicas": 3, "metrics": []}})
    with pytest.raises(ConfigError, match=r"Pods metric 'dlrm_other' is not one the simulation "
                                          r"models"):
        spec(targets=(("dlrm_other", 1.0),))


@pytest.mark.parametrize("q,want", [("100", 100.0), ("12.5", 12.5), ("1500m", 1.5),
                                    (7, 7.0), ("2k", 2000.0)])
def test_parse_quantity(q, want):
    assert parse_quantity(q) == want


def test_parse_quantity_rejects_garbage():
    with pytest.raises(ConfigError, match=r"quantity 'lots' is not a Kubernetes quantity"):
        parse_quantity("lots")


# --------------------------------------------------------------------------- max over metrics


def test_the_largest_proposal_over_metrics_wins():
    """Two metrics: utilization asks for 3 pods, req/s for 2: the HPA goes to 3."""
    mix = Mix("m", 100.0, 10.0, "test")
    s = spec(targets=((UTILIZATION_METRIC, 0.8), (QPS_METRIC, 1000.0)))
    cfg = SimConfig(startup_s=0.0, busy_at_knee=0.5)
    per_pod = pod_metrics(50.0, mix, cfg)
    # 2 pods x 50 req/s x (36 + 228) us = 0.0264 s/s over capacity 1.0
    assert per_pod[UTILIZATION_METRIC] == pytest.approx(50.0 * (36e-6 + 10 * 22.8e-6))
    assert per_pod["cpu"] == pytest.approx(0.9 * 0.5)
    r = simulate(s, cfg, lambda t: (100.0, mix), 60.0)
    assert set(r.replicas) == {2}  # utilization 0.026, req/s 50: both below target


# --------------------------------------------------------------------------- pod model


def test_utilization_reads_about_one_at_the_knee_of_worker_bound_mixes():
    cap = load_capacity(REPO / "loadtest" / "capacity.json")
    mixes = mixes_from(cap)
    cfg = SimConfig()
    for name in ("ranking", "mixed"):
        u = pod_metrics(mixes[name].knee_rps, mixes[name], cfg)[UTILIZATION_METRIC]
        assert 0.9 <= u <= 1.1, (name, u)
    single = pod_metrics(MIXES["single"].knee_rps, MIXES["single"], cfg)[UTILIZATION_METRIC]
    assert single < 0.5  # why the req/s backstop exists
    assert mixes["mixed"].knee_rps == cap["knee_qps"]


def test_old_spec_is_request_rate_only():
    s = load_hpa(REPO / "k8s" / "hpa.yaml")
    o = old_spec(s, 142.4)
    assert o.targets == ((QPS_METRIC, 142.4),) and o.cpu_target == 0.75
    assert (o.scale_up, o.scale_down, o.max_replicas) == (s.scale_up, s.scale_down, s.max_replicas)


# --------------------------------------------------------------------------- simulation

MIX = Mix("test", 125.0, 1.0, "test")


def test_constant_load_settles_within_tolerance_of_the_target():
    s, cfg = spec(), SimConfig(startup_s=60.0)
    r = simulate(s, cfg, lambda t: (730.0, MIX), 1800.0)
    # 2 pods at 365 req/s: ceil(3.65 * 2) = 8, capped by the policy at max(2 * 2, 2 + 4) = 6;
    # 6 pods at 121.7: ceil(1.217 * 6) = 8; 8 pods at 91.25 are within the tolerance.
    changes = [n for i, n in enumerate(r.replicas) if i == 0 or n != r.replicas[i - 1]]
    assert changes[:3] == [2, 6, 8]
    assert abs(730.0 / r.replicas[-1] / 100.0 - 1.0) <= 0.1
    assert r.replicas[-1] == r.ready[-1] == 8
    # Ideal at 0.8 x knee = 100 req/s per pod: ceil(7.3) = 8; over the SLO until Ready.
    # Then the old pods' 1 m rate still holds the overload from before the new pods were
    # Ready: an overshoot (as on a real cluster), undone after the 300 s scale-down window.
    assert r.ideal[-1] == 8
    ups = sum(1 for a, b in zip(r.replicas[:-1], r.replicas[1:], strict=True) if b > a)
    assert r.scale_ups == ups >= 2
    assert r.intervals and r.intervals[0][0] == 0.0
    assert r.longest_over_s <= reaction_time_s(s, cfg, 2, 8)


def test_low_load_stays_at_min_replicas_without_risk():
    r = simulate(spec(), SimConfig(), lambda t: (50.0, MIX), 1200.0)
    assert set(r.replicas) == {2} and not r.intervals and r.scale_ups == 0
    assert r.pods_vs_ideal == 1.0  # the ideal is minReplicas too


def test_a_slow_scale_up_runs_longer_over_the_slo():
    """Negative control: a 10-minute scale-up window keeps pods over the knee longer."""
    mixes = {**MIXES, "mixed": Mix("mixed", 178.0, 244.0, "test")}
    fn, duration = scenarios(mixes)["ranking"]
    s = spec(targets=((UTILIZATION_METRIC, 0.8),))
    slow = spec(targets=((UTILIZATION_METRIC, 0.8),),
                scale_up=ScalingRules(600, "Max", UP.policies))
    fast_r = simulate(s, SimConfig(), fn, duration)
    slow_r = simulate(slow, SimConfig(), fn, duration)
    assert slow_r.longest_over_s > fast_r.longest_over_s


def test_the_shipped_spec_meets_the_goal_and_beats_the_old_one(tmp_path, capsys):
    rc = main(["--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| scenario | pods / ideal" in out and ": met" in out
    doc = json.loads((tmp_path / "hpa_sim.json").read_text())
    assert set(doc["scenarios"]) == {"single", "ranking", "mixed", "switch"}
    for name in ("single", "ranking", "mixed"):
        new = doc["scenarios"][name]["shipped"]
        assert new["pods_vs_ideal"] <= 1.25 and new["over_slo_s_per_scale_up"] <= 60, name
    old = doc["scenarios"]["single"]["old"]
    assert old["pods_vs_ideal"] > 1.5  # req/s sized for ranking over-scales single traffic
    assert doc["hpa"]["targets"] == [list(t) for t in load_hpa(REPO / "k8s" / "hpa.yaml").targets]


def test_main_plots(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0, capsys.readouterr().out
    png = (tmp_path / "hpa_sim.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
