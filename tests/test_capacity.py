"""serve.ops.capacity's pure parts on synthetic step data: knee (serve.ops.knee, the one
rule capacity uses), target, the HPA rewrite."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve.errors import CapacityError, ConfigError
from serve.ops.capacity import (
    CapacityConfig,
    capacity_document,
    derive_target,
    format_quantity,
    main,
)
from serve.ops.hpa_sim import parse_quantity
from serve.ops.knee import find_knee
from serve.ops.machine import machine_info

REPO = Path(__file__).resolve().parents[1]


def step(users, rps, p99, fail=0.0, inst_per_req=270.0, p50=None):
    return {"users": users, "rps": rps, "instances_per_s": rps * inst_per_req,
            "p50_ms": p50 if p50 is not None else p99 / 3, "p99_ms": p99, "fail_ratio": fail}


RAMP = [step(1, 20.0, 14.0), step(2, 38.0, 18.0), step(4, 61.0, 33.0), step(8, 70.0, 58.0),
        step(16, 72.0, 121.0), step(32, 71.0, 240.0, fail=0.02)]


def test_knee_is_the_best_step_before_the_goal_breaks():
    k = find_knee(RAMP, p99_goal_ms=60.0)
    assert (k.step_index, k.users, k.rps, k.p99_ms) == (3, 8, 70.0, 58.0)
    assert k.saturated is True
    assert "step 4 (16 users, 72.0 req/s) has p99 121.0 ms (goal 60)" in k.stop_reason
    assert k.instances_per_request == pytest.approx(270.0)


def test_a_tighter_goal_moves_the_knee_down():
    assert find_knee(RAMP, p99_goal_ms=30.0).rps == 38.0


def test_failures_end_the_walk_even_with_good_latency():
    steps = [step(1, 20.0, 10.0), step(2, 40.0, 12.0, fail=0.05), step(4, 80.0, 15.0)]
    k = find_knee(steps, 60.0, max_fail_ratio=0.001)
    assert k.rps == 20.0 and "fail ratio 0.0500 (max 0.001)" in k.stop_reason


def test_noise_after_the_peak_keeps_the_highest_passing_step():
    steps = [step(1, 20.0, 10.0), step(2, 41.0, 20.0), step(4, 39.5, 40.0), step(8, 90.0, 70.0)]
    k = find_knee(steps, 60.0)
    assert (k.rps, k.step_index) == (41.0, 1)


def test_unsaturated_run_is_flagged_as_a_lower_bound():
    k = find_knee(RAMP[:3], 60.0)
    assert k.rps == 61.0 and k.saturated is False
    assert "lower bound" in k.stop_reason


def test_no_passing_step_is_an_error_that_says_why():
    with pytest.raises(CapacityError, match=r"no step meets the goals \(step 0 \(1 users, "
                                            r"20.0 req/s\) has p99 90.0 ms \(goal 60\)"):
        find_knee([step(1, 20.0, 90.0)], 60.0)
    with pytest.raises(CapacityError, match="the load test reported no steps"):
        find_knee([], 60.0)
    with pytest.raises(CapacityError, match=r"step 0 \(1 users\) measured no requests "
                                            r"\(no p99_ms\): overloaded, or lengthen --duration"):
        find_knee([{"users": 1, "rps": 0.0, "p99_ms": None, "fail_ratio": 0.0}], 60.0)


def test_a_step_without_answers_ends_the_walk():
    steps = [step(1, 20.0, 10.0), {"users": 2, "rps": 0.0, "p99_ms": None, "fail_ratio": 1.0}]
    k = find_knee(steps, 60.0)
    assert k.rps == 20.0 and k.saturated and "step 1 (2 users) measured no requests" in k.stop_reason


@pytest.mark.parametrize("knee,headroom,want", [(70.0, 0.8, 56.0), (70.26, 0.8, 56.2),
                                                (125.0, 0.8, 100.0), (0.05, 0.8, 0.1)])
def test_target_is_headroom_times_knee_rounded_down(knee, headroom, want):
    assert derive_target(knee, headroom) == want


@pytest.mark.parametrize("v,want", [(56.0, "56"), (56.2, "56.2"), (0.1, "0.1"), (1234.0, "1234")])
def test_format_quantity_is_a_plain_kubernetes_quantity(v, want):
    assert format_quantity(v) == want
    assert parse_quantity(want) == pytest.approx(v)


def test_config_validation_names_the_flag():
    with pytest.raises(ConfigError, match=r"--headroom 1.5 must be in \(0, 1\]"):
        CapacityConfig(headroom=1.5)
    with pytest.raises(ConfigError, match=r"--p99-goal-ms 0.0 must be a finite number > 0"):
        CapacityConfig(p99_goal_ms=0.0)


def test_document_records_machine_and_derivation():
    cfg = CapacityConfig()
    k = find_knee(RAMP, 60.0)
    doc = capacity_document(k, cfg, derive_target(k.rps), RAMP, machine_info(),
                            "2026-11-29T21:00:00+00:00")
    assert doc["knee_qps"] == 70.0 and doc["target_qps"] == 56.0 and doc["p99_goal_ms"] == 60.0
    assert doc["machine"]["logical_cores"] >= 1 and doc["machine"]["cpu_model"]
    assert doc["instances_per_request"] == 270.0
    assert doc["derivation"] == "target_qps = floor(0.8 x knee 70.00 req/s, 0.1) = 56 req/s per pod"
    json.dumps(doc)


def test_main_from_a_summary_writes_capacity_only(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": RAMP, "knee": None}))
    out = tmp_path / "capacity.json"
    hpa_before = (REPO / "k8s" / "hpa.yaml").read_text()
    rc = main(["--from-summary", str(summary), "--output", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "target_qps = floor(0.8 x 70.00, 0.1) = 56 req/s per pod" in printed
    assert "k8s/hpa.yaml unchanged" in printed
    doc = json.loads(out.read_text())
    assert doc["target_qps"] == 56.0
    assert doc["form"] == "instances"  # a summary from before the field: instances
    assert (REPO / "k8s" / "hpa.yaml").read_text() == hpa_before


def test_capacity_records_the_form_the_load_test_sent(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": RAMP, "traffic": {"form": "context"}}))
    out = tmp_path / "capacity.json"
    assert main(["--from-summary", str(summary), "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["form"] == doc["load_test"]["form"] == "context"
    with pytest.raises(ConfigError, match=r"--form 'batch' is not one of context, instances"):
        CapacityConfig(form="batch")


def test_the_warm_up_stage_is_not_a_capacity_measurement(tmp_path, capsys):
    """A busier warm-up (cold server, not judged) must not become the knee."""
    warmup = dict(step(4, 500.0, 10.0), name="warmup", slo=False)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": [warmup, *[dict(s, slo=True) for s in RAMP]]}))
    out = tmp_path / "capacity.json"
    rc = main(["--from-summary", str(summary), "--output", str(out), "--no-write"])
    assert rc == 0
    assert "target_qps = floor(0.8 x 70.00, 0.1) = 56 req/s per pod" in capsys.readouterr().out


# --------------------------------------------------------------------------- the one rule


def test_the_knee_rule_skips_the_warm_up_and_indexes_the_given_steps():
    warmup = dict(step(4, 500.0, 10.0), slo=False)
    k = find_knee([warmup, *RAMP], 60.0)
    assert (k.users, k.rps, k.step_index) == (8, 70.0, 4)  # RAMP[3], index 4 with the warm-up


def test_a_flat_step_does_not_become_the_knee_nor_end_the_walk():
    """More users for < 5% more throughput only add queueing; a later rise still counts."""
    flat = [step(1, 20.0, 10.0), step(2, 20.5, 20.0), step(4, 20.9, 30.0)]
    assert find_knee(flat, 60.0).users == 1
    rises_again = [*flat[:2], step(4, 40.0, 30.0)]
    assert find_knee(rises_again, 60.0).users == 4
    assert find_knee(flat, 60.0, min_gain=0.0).users == 4


def test_loadtest_capacity_and_bench_share_the_knee_rule():
    """The load test's summary knee, make capacity's and the HTTP benchmark's all come from
    serve.ops.knee: the same steps give the same knee in each."""
    from bench.bench_e2e import Step, _knee_row
    from loadtest import stats

    rows = [dict(s, name=f"step-{i}", measured_requests=100, slo=True)
            for i, s in enumerate(RAMP)]
    summary = stats.find_knee(rows, stats.Thresholds(p99_goal_ms=60.0, max_fail_ratio=0.001))
    assert summary == find_knee(rows, 60.0, max_fail_ratio=0.001).summary()
    assert summary["users"] == 8
    bench_steps = [Step(concurrency=s["users"], requests=1000, errors=0, seconds=1.0,
                        samples_per_s=s["instances_per_s"], requests_per_s=s["rps"],
                        p50_ms=s["p50_ms"], p99_ms=s["p99_ms"]) for s in RAMP[:5]]
    bench_knee = find_knee([_knee_row(s) for s in bench_steps], 60.0)
    assert (bench_knee.users, bench_knee.rps, bench_knee.name) == (8, 70.0, "C=8")
