"""Load tests: traffic generator, shapes, statistics/thresholds, and real locust runs.

Unit tests run in milliseconds. The integration tests run the real locust (as
``python -m loadtest.run`` does, in a subprocess): a 16 s smoke run against the real
TorchServe of the ``torchserve`` fixture, and a 5 s run against a deliberately broken
HTTP server to prove that wrong answers fail the run.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from loadtest import plan, stats, traffic
from loadtest import run as lrun
from serve.common.net import free_port
from serve.errors import ConfigError
from serve.profiles import get_profile
from tests.fakes.http_peer import local_http_server

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- traffic

def test_default_instances_follow_mlperf_dlrm_v2_server():
    d = traffic.InstancesDistribution()
    assert (d.min, d.max, d.mean, d.single_fraction) == (100, 700, 270.0, 0.1)
    ranked_mean = float(np.dot(d._support, d._probs))
    assert ranked_mean == pytest.approx(270.0, abs=1e-6)
    assert d.expected_mean == pytest.approx(0.1 * 1 + 0.9 * 270.0, abs=1e-6)
    s = d.sample(np.random.default_rng(0), 200_000)
    singles = s == 1
    # binomial sd of the fraction: sqrt(0.1*0.9/2e5) = 6.7e-4
    assert singles.mean() == pytest.approx(0.1, abs=0.003)
    ranked = s[~singles]
    assert ranked.min() >= 100 and ranked.max() <= 700
    assert ranked.mean() == pytest.approx(270.0, abs=2.0)


@pytest.mark.parametrize("spec,want", [
    ("1-64:16", (1, 64, 16.0)), ("100-700", (100, 700, 400.0)), ("64", (64, 64, 64.0)),
    (" 10-20:12.5 ", (10, 20, 12.5)),
])
def test_instances_spec_parses(spec, want):
    d = traffic.InstancesDistribution.parse(spec, single_fraction=0.0)
    assert (d.min, d.max, d.mean) == want
    s = d.sample(np.random.default_rng(1), 5000)
    assert s.min() >= want[0] and s.max() <= want[1]


def test_fixed_instances_are_fixed():
    d = traffic.InstancesDistribution.parse("64", single_fraction=0.0)
    assert set(d.sample(np.random.default_rng(0), 100).tolist()) == {64}


@pytest.mark.parametrize("spec,frac,match", [
    ("abc", 0.1, r"instances spec 'abc' is not MIN-MAX\[:MEAN\] or N; e.g. 100-700:270"),
    ("700-100", 0.1, r"instances range 700-100 is invalid: need 1 <= min <= max"),
    ("100-700:900", 0.1, r"instances mean 900.0 must lie strictly between min 100 and max 700"),
    ("0-5", 0.1, r"instances range 0-5 is invalid"),
    ("1-64", 1.5, r"single-instance fraction 1.5 must be in \[0, 1\]"),
])
def test_bad_instances_spec_is_named(spec, frac, match):
    with pytest.raises(ConfigError, match=match):
        traffic.InstancesDistribution.parse(spec, frac)


def test_ids_follow_the_training_data_law_and_mapping():
    """Same ranks and the same rank->id permutation as serve.model.data's generator."""
    from serve.common import zipf
    from serve.model import data as sdata

    p = get_profile("tiny")
    sampler = traffic.IdSampler(p, alpha=1.05)
    planted = sdata._Planted(p, p.seed)
    for j in (0, 2, 8, 25):
        rows = p.cardinalities[j]
        ours = sampler.ids(np.random.default_rng([5, j]), j, 4000)
        ranks = zipf.zipf_ranks(np.random.default_rng([5, j]), 4000, rows, 1.05,
                                zipf.zeta_cdf(rows, 1.05))
        np.testing.assert_array_equal(ours, planted.perms[j][ranks])
        assert ours.min() >= 0 and ours.max() < rows


def test_zipf_rank_frequencies_match_the_zeta_law():
    p = get_profile("tiny")
    sampler = traffic.IdSampler(p, alpha=1.05, permuted=False)
    rows = p.cardinalities[0]  # 500
    n = 200_000
    r = sampler.ranks(np.random.default_rng(3), 0, n)
    w = np.arange(1, rows + 1, dtype=np.float64) ** -1.05
    want = w / w.sum()
    got = np.bincount(r, minlength=rows) / n
    for k in (0, 1, 9):
        sd = np.sqrt(want[k] * (1 - want[k]) / n)
        assert abs(got[k] - want[k]) < 4 * sd, (k, got[k], want[k])


def test_large_tables_use_the_training_data_continuous_law():
    from serve.common import zipf

    p = get_profile("criteo-kaggle")
    sampler = traffic.IdSampler(p, alpha=1.05, permuted=False)
    j = 2  # 10,131,227 rows: beyond the exact-CDF limit
    ours = sampler.ranks(np.random.default_rng(9), j, 5000)
    theirs = zipf.zipf_ranks(np.random.default_rng(9), 5000, p.cardinalities[j], 1.05, None)
    np.testing.assert_array_equal(ours, theirs)
    assert ours.max() < p.cardinalities[j]


def test_dense_features_match_the_training_distribution():
    x = traffic.dense_features(np.random.default_rng(0), 50_000)
    assert x.shape == (50_000, 13) and (x >= 0).all()
    # E[softplus(Z)], Z ~ N(0, 1), by quadrature: the training data's dense law.
    z = np.linspace(-12, 12, 200_001)
    ref = np.trapezoid(np.logaddexp(0, z) * np.exp(-z * z / 2) / np.sqrt(2 * np.pi), z)
    assert x.mean() == pytest.approx(ref, abs=0.01)
    assert np.all(np.round(x, 4) == x)  # rounded to 1e-4: small bodies


@pytest.mark.parametrize("multi_hot", [1, 3])
def test_pool_bodies_parse_with_the_real_protocol_in_both_forms(multi_hot):
    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body

    p = dataclasses.replace(get_profile("tiny"), max_ids_per_feature=multi_hot)
    cfg = {"profile": p, "instances": traffic.InstancesDistribution.parse("1-40:10", 0.2),
           "pool_size": 12, "seed": 4}
    hc = HandlerConfig()
    for form in traffic.REQUEST_FORMS:
        rows = traffic.RequestPool(traffic.TrafficConfig(body_format="row", form=form, **cfg))
        cols = traffic.RequestPool(traffic.TrafficConfig(body_format="columnar", form=form,
                                                         **cfg))
        for a, b in zip(rows.requests, cols.requests, strict=True):
            assert a.instances == b.instances
            pa, pb = parse_body(a.body, hc), parse_body(b.body, hc)
            assert pa.batch_size == a.instances
            np.testing.assert_array_equal(pa.dense, pb.dense)
            np.testing.assert_array_equal(pa.lengths, pb.lengths)
            np.testing.assert_array_equal(pa.values, pb.values)
            assert pa.shared == pb.shared
            own = pa.lengths if form == "instances" else pa.lengths[13:]
            assert own.min() >= 1 and pa.lengths.max() <= multi_hot
            if form == "context" and a.instances > 1:
                # one user: C1..C13 once (the profile's declaration), the dense vector shared
                assert pa.shared == tuple(range(13))
                assert (pa.lengths[:13, 0] >= 1).all() and not pa.lengths[:13, 1:].any()
                assert (pa.dense == pa.dense[:1]).all()
        top = set(orjson.loads(rows.requests[0].body))
        assert top == ({"instances"} if form == "instances" else {"context", "candidates"})
        assert isinstance(orjson.loads(cols.requests[0].body).get("candidates", {}), dict)


def test_stratified_pool_sizes_match_the_law():
    d = traffic.InstancesDistribution()
    sizes = d.stratified(np.random.default_rng(0), 256)
    assert (sizes == 1).sum() in (25, 26, 27)  # 10% of 256, within one stratum
    assert sizes.mean() == pytest.approx(d.expected_mean, rel=0.02)
    assert sizes[sizes > 1].min() >= 100 and sizes.max() <= 700
    assert not np.all(np.diff(sizes) >= 0)  # shuffled, not in quantile order
    fixed = traffic.InstancesDistribution.parse("64", 0.0).stratified(np.random.default_rng(0), 9)
    assert set(fixed.tolist()) == {64}


def test_pool_is_deterministic_in_its_seed():
    cfg = traffic.TrafficConfig(profile=get_profile("tiny"), pool_size=3, seed=7)
    a, b = traffic.RequestPool(cfg), traffic.RequestPool(cfg)
    assert [r.body for r in a.requests] == [r.body for r in b.requests]
    assert a.mean_instances == pytest.approx(np.mean([r.instances for r in a.requests]))


def test_traffic_config_rejects_bad_values():
    with pytest.raises(ConfigError, match=r"body format 'xml' is unknown; use one of row, columnar"):
        traffic.TrafficConfig(profile=get_profile("tiny"), body_format="xml")
    with pytest.raises(ConfigError, match=r"pool size 0 must be in \[1, 10000\] bodies"):
        traffic.TrafficConfig(profile=get_profile("tiny"), pool_size=0)
    with pytest.raises(ConfigError, match=r"zipf alpha 0 must be a finite number > 0"):
        traffic.IdSampler(get_profile("tiny"), alpha=0)
    with pytest.raises(ConfigError, match=r"request form 'batch' is unknown; use one of "
                                          r"context, instances"):
        traffic.TrafficConfig(profile=get_profile("tiny"), form="batch")
    with pytest.raises(ConfigError, match=r"context features \['X1'\] are not the model's"):
        traffic.TrafficConfig(profile=get_profile("tiny"), context_features=("C1", "X1"))
    assert traffic.parse_features(" C1, C2 ,") == ("C1", "C2")
    assert traffic.parse_features("") is None


@pytest.mark.parametrize("status,body,n,want", [
    (200, b'{"predictions": [0.1, 0.9]}', 2, None),
    (200, b'{"predictions": [0, 1]}', 2, None),
    (200, b'{"predictions": [0.1, 0.9]}', 3, "expected 3 predictions, got 2"),
    (200, b'{"predictions": [0.1, 1.5]}', 2, "predictions[1] = 1.5 is outside [0, 1]"),
    (200, b'{"predictions": [-0.0001]}', 1, "predictions[0] = -0.0001 is outside [0, 1]"),
    (200, b'{"predictions": [true]}', 1, "predictions[0] = True is not a number"),
    (200, b'{"predictions": ["0.5"]}', 1, "predictions[0] = '0.5' is not a number"),
    (200, b'{"predictions": 0.5}', 1, "response has no 'predictions' list: '{\"predictions\": 0.5}'"),
    (200, b'[0.5]', 1, "response has no 'predictions' list: '[0.5]'"),
    (200, b'<html>', 1, "response is not JSON: '<html>'"),
    (200, b'{"predictions": [NaN]}', 1, "response is not JSON: '{\"predictions\": [NaN]}'"),
    (503, b'{"code": 503}', 1, 'HTTP 503: {"code": 503}'),
    (0, b"ConnectionRefusedError()", 1, "no HTTP answer: ConnectionRefusedError()"),
])
def test_check_response(status, body, n, want):
    assert traffic.check_response(status, body, n) == want


def test_check_response_accepts_the_handlers_encoding():
    from serve.api.batch import encode_predictions

    body = encode_predictions(np.array([0.25, 0.5, 1.0], dtype=np.float32))
    assert traffic.check_response(200, body, 3) is None
    assert traffic.check_response(200, body, 4) == "expected 4 predictions, got 3"


# ----------------------------------------------------------------------------- shapes

def _tiles(stages, d):
    assert stages[0].start_s == 0 and stages[-1].end_s == pytest.approx(d)
    for a, b in itertools.pairwise(stages):
        assert a.end_s == pytest.approx(b.start_s)


@pytest.mark.parametrize("name", plan.SHAPES)
def test_every_shape_tiles_the_run_and_scales_with_duration(name):
    s60 = plan.build_stages(plan.ShapeConfig(name, 60.0))
    s120 = plan.build_stages(plan.ShapeConfig(name, 120.0))
    _tiles(s60, 60.0)
    _tiles(s120, 120.0)
    assert [s.name for s in s60] == [s.name for s in s120]
    for a, b in zip(s60, s120, strict=True):
        assert b.end_s == pytest.approx(2 * a.end_s)
        assert b.settle_s == pytest.approx(2 * a.settle_s)


def test_step_plan_ticks_through_its_levels():
    stages = plan.build_stages(plan.ShapeConfig("step", 40.0, (1, 2, 4, 8)))
    assert [s.name for s in stages] == ["warmup", "step-1", "step-2", "step-3", "step-4"]
    assert [s.start_s for s in stages] == [0.0, 4.0, 13.0, 22.0, 31.0]
    assert plan.tick_at(stages, 0.0) == (4, 8.0)  # warm-up at the middle level
    assert plan.tick_at(stages, 4.0) == (1, 8.0)
    assert plan.tick_at(stages, 14.0) == (2, 8.0)
    assert plan.tick_at(stages, 39.9) == (8, 8.0)
    assert plan.tick_at(stages, 40.0) is None
    assert [s.settle_s for s in stages] == [0.0] + [2.25] * 4
    assert [s.slo for s in stages] == [False, True, True, True, True]


_SHAPE_CLASSES_CHECK = """
import json, sys
from locust import LoadTestShape
from loadtest import plan, shapes
out = {}
for name in plan.SHAPES:
    cls = shapes.shape_class(name)
    shape = cls(plan.ShapeConfig(name, 40.0))
    ticks = [shape.tick_at(t) for t in (0.0, 17.0, 25.0, 39.9, 40.0)]
    out[name] = [issubclass(cls, LoadTestShape), cls.abstract, cls.shape_name, ticks,
                 shape.stage_at(25.0).name]
try:
    shapes.StepShape(plan.ShapeConfig("steady", 40.0))
except Exception as e:
    out["mismatch"] = str(e)
print(json.dumps(out))
"""


def test_locust_shape_classes_follow_their_plans():
    """The LoadTestShape classes, in a child process (importing locust patches gevent in)."""
    res = subprocess.run([sys.executable, "-c", _SHAPE_CLASSES_CHECK], cwd=REPO, text=True,
                         capture_output=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got.pop("mismatch") == "StepShape got a config for shape 'steady'"
    want = {
        "steady": [True, False, "steady", [[4, 1.0], [4, 1.0], [4, 1.0], [4, 1.0], None], "hold"],
        "step": [True, False, "step", [[4, 16.0], [2, 16.0], [4, 16.0], [16, 16.0], None],
                 "step-3"],
        "spike": [True, False, "spike", [[4, 2.0], [16, 16.0], [4, 16.0], [4, 16.0], None],
                  "recovery"],
        "soak": [True, False, "soak", [[4, 2.0], [4, 2.0], [4, 2.0], [4, 2.0], None], "hold-3"],
    }
    assert got == want


def test_driver_modules_do_not_import_locust():
    """Importing locust monkey-patches the process with gevent; only locust's own process
    (the locustfile and loadtest.shapes) may import it."""
    code = ("import sys; import loadtest.run, loadtest.plan, loadtest.stats, loadtest.traffic, "
            "loadtest.report; print('locust' in sys.modules, 'gevent' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True,
                         capture_output=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("users,levels", [((16,), (1, 2, 4, 8, 16)), ((10,), (1, 2, 4, 8, 10)),
                                          ((1,), (1,)), ((3, 5, 9), (3, 5, 9))])
def test_step_levels(users, levels):
    assert plan.ShapeConfig("step", 60.0, users).step_levels() == levels


def test_spike_shape_base_peak_recovery():
    stages = plan.build_stages(plan.ShapeConfig("spike", 100.0, (16,)))
    assert [(s.name, s.users, s.slo) for s in stages] == [
        ("base", 4, True), ("spike", 16, False), ("recovery", 4, True)]
    assert [(s.start_s, s.end_s) for s in stages] == [(0, 40), (40, 60), (60, 100)]
    stages = plan.build_stages(plan.ShapeConfig("spike", 100.0, (2, 10)))
    assert [s.users for s in stages] == [2, 10, 2]


def test_steady_and_soak_stages():
    steady = plan.build_stages(plan.ShapeConfig("steady", 60.0, (8,)))
    assert [(s.name, s.users, s.slo) for s in steady] == [("ramp", 8, False), ("hold", 8, True)]
    soak = plan.build_stages(plan.ShapeConfig("soak", 3600.0))
    assert [s.name for s in soak] == ["ramp", "hold-1", "hold-2", "hold-3", "hold-4"]
    assert soak[0].end_s == 60.0  # 5% capped at 60 s


@pytest.mark.parametrize("args,match", [
    (("walk", 60.0), r"shape 'walk' is unknown; choose one of steady, step, spike, soak"),
    (("step", 10.0, (1, 2, 4, 8, 16)),
     r"5 steps in 10s \(after the warm-up\) leave 1.8s per step; each step needs >= 4s"),
    (("step", 60.0, (4, 2)), r"step levels \(4, 2\) must be strictly increasing"),
    (("steady", 60.0, (1, 2)), r"shape 'steady' takes one user count, got \(1, 2\)"),
    (("spike", 60.0, (8, 4)), r"shape 'spike' takes --users PEAK or BASE,PEAK with BASE < PEAK"),
    (("steady", 2.0), r"duration 2s is out of range: give 5s to 24h"),
])
def test_bad_shape_configs_are_named(args, match):
    with pytest.raises(ConfigError, match=match):
        plan.ShapeConfig(*args)


@pytest.mark.parametrize("text,secs", [("60s", 60.0), ("5m", 300.0), ("1m30s", 90.0),
                                       ("1h", 3600.0), ("90", 90.0), ("7.5s", 7.5), (45, 45.0)])
def test_parse_duration(text, secs):
    assert plan.parse_duration(text) == secs


def test_parse_duration_and_users_errors():
    with pytest.raises(ConfigError, match=r"duration 'soon' is not understood; use e.g. 60s, 5m"):
        plan.parse_duration("soon")
    with pytest.raises(ConfigError, match=r"--users '1,x' must be a number or a comma-separated"):
        plan.parse_users("1,x")
    with pytest.raises(ConfigError, match=r"--users '0': every value must be in \[1, 10000\]"):
        plan.parse_users("0")
    assert plan.parse_users("1,2,4") == (1, 2, 4)
    assert plan.parse_users("") is None


# ----------------------------------------------------------------------------- stats

def test_histogram_percentiles_within_one_percent():
    rng = np.random.default_rng(0)
    xs = rng.lognormal(mean=3.0, sigma=0.8, size=50_000)
    h = stats.LatencyHistogram()
    for x in xs:
        h.add(float(x))
    for q in (0.5, 0.9, 0.99, 0.999):
        assert h.percentile(q) == pytest.approx(float(np.quantile(xs, q)), rel=0.011)
    assert h.percentile(1.0) == pytest.approx(xs.max(), rel=0.011)
    back = stats.LatencyHistogram.from_json(json.loads(json.dumps(h.to_json())))
    assert back.percentile(0.99) == h.percentile(0.99) and back.n == h.n
    assert stats.LatencyHistogram().percentile(0.5) is None


def test_recorder_routes_by_time_and_skips_settling():
    now = [0.0]
    s1 = stats.StageStats("a", 0.0, 10.0, users=1, settle_s=2.0)
    s2 = stats.StageStats("b", 10.0, 20.0, users=2, settle_s=0.0)
    rec = stats.StageRecorder([s1, s2], clock=lambda: now[0])
    for t, ms, ok, n in [(1.0, 500.0, True, 10), (3.0, 20.0, True, 10), (4.0, 30.0, False, 5),
                         (12.0, 40.0, True, 7), (25.0, 50.0, True, 7)]:
        now[0] = t
        rec.record(ms, ok, n, None if ok else "HTTP 503: busy")
    assert (s1.requests, s1.measured_requests, s1.failures, s1.instances) == (3, 2, 1, 20)
    assert s1.measured_instances == 10 and s1.latency.n == 2
    assert s1.latency.max_ms == 30.0  # the 500 ms warm-up request is not in the figures
    assert (s2.requests, s2.instances) == (2, 14)  # the stop tail counts in the last stage
    row = s1.row()
    assert row["rps"] == pytest.approx(2 / 8.0) and row["instances_per_s"] == pytest.approx(10 / 8.0)
    assert row["fail_ratio"] == pytest.approx(1 / 3, abs=1e-6)
    assert dict(s1.failure_reasons) == {"HTTP 503: busy": 1}
    back = stats.StageStats.from_json(json.loads(json.dumps(s1.to_json())))
    assert back.row() == row


def _row(users, rps, p99, fail=0.0, n=100):
    return {"name": f"u{users}", "users": users, "rps": rps, "instances_per_s": rps * 270,
            "p50_ms": p99 / 2, "p99_ms": p99, "fail_ratio": fail, "measured_requests": n}


@pytest.mark.parametrize("rows,knee_users", [
    ([_row(1, 10, 20), _row(2, 19, 25), _row(4, 35, 40), _row(8, 36, 58)], 4),  # rps flat
    ([_row(1, 10, 20), _row(2, 19, 25), _row(4, 35, 70)], 2),                 # p99 over goal
    ([_row(1, 10, 20), _row(2, 19, 25, fail=0.01)], 1),                       # a failure
    ([_row(1, 10, 20), _row(2, 19, 25), _row(4, 35, 40)], 4),                 # still rising
    ([_row(1, 10, 61), _row(2, 19, 25)], None),                               # first misses
    ([_row(1, 10, 20), _row(2, 30, 20, n=0)], 1),                             # empty step
    ([_row(1, 10, 20), _row(2, 10.2, 30), _row(4, 20, 40)], 4),              # flat, then rises
    ([_row(1, 10, 20), _row(2, 10.2, 30), _row(4, 10.3, 70)], 1),             # flat, then misses
])
def test_find_knee(rows, knee_users):
    knee = stats.find_knee(rows, stats.Thresholds(p99_goal_ms=60.0))
    assert (knee or {}).get("users") == knee_users
    if knee:
        assert set(knee) == {"users", "rps", "instances_per_s", "p50_ms", "p99_ms", "name"}


def _stage(name, users, latencies, fails=0, slo=True):
    s = stats.StageStats(name, 0.0, 10.0, users=users, slo=slo)
    for i, ms in enumerate(latencies):
        s.record(5.0, ms, i >= fails, 100, None if i >= fails else "bad")
    return s


def test_summarize_verdicts():
    th = stats.Thresholds(p99_goal_ms=60.0)
    ok = stats.summarize("steady", [_stage("ramp", 2, [500.0] * 5, slo=False),
                                    _stage("hold", 2, [10.0] * 99 + [50.0])], th)
    assert ok["passed"] and ok["totals"]["requests"] == 105
    assert ok["totals"]["slo_p99_ms"] == pytest.approx(10.0, rel=0.011)  # ramp excluded
    assert ok["knee"] is None
    slow = stats.summarize("steady", [_stage("hold", 2, [10.0] * 50 + [90.0] * 50)], th)
    assert not slow["passed"]
    assert [c["passed"] for c in slow["thresholds"]["checks"]] == [True, True, False]
    failed = stats.summarize("steady", [_stage("hold", 2, [10.0] * 100, fails=1)], th)
    assert not failed["passed"] and failed["failure_reasons"] == {"bad": 1}
    lenient = stats.summarize("steady", [_stage("hold", 2, [10.0] * 100, fails=1)],
                              stats.Thresholds(60.0, max_fail_ratio=0.05))
    assert lenient["passed"]
    step = stats.summarize("step", [_stage("warmup", 2, [900.0] * 10, slo=False),
                                    _stage("step-1", 1, [10.0] * 100),
                                    _stage("step-2", 2, [200.0] * 100)], th)
    assert step["passed"] and step["knee"]["users"] == 1  # p99 past the goal later is fine
    assert [r["name"] for r in step["steps"]] == ["warmup", "step-1", "step-2"]
    empty = stats.summarize("steady", [_stage("hold", 2, [])], th)
    assert not empty["passed"]


def test_thresholds_validation():
    with pytest.raises(ConfigError, match=r"--p99-goal-ms 0 must be a finite number > 0"):
        stats.Thresholds(p99_goal_ms=0)
    with pytest.raises(ConfigError, match=r"--max-fail-ratio 2 must be in \[0, 1\]"):
        stats.Thresholds(max_fail_ratio=2)


# ----------------------------------------------------------------------------- run.py

@pytest.mark.parametrize("url,want", [
    ("http://127.0.0.1:8080", ("http://127.0.0.1:8080", True)),
    ("http://127.0.0.1:8080/", ("http://127.0.0.1:8080", True)),
    ("http://localhost:9000", ("http://localhost:9000", True)),
    ("http://[::1]:8080", ("http://[::1]:8080", True)),
    ("http://127.3.2.1", ("http://127.3.2.1", True)),
])
def test_loopback_hosts_pass(url, want):
    assert lrun.check_host(url, allow_remote=False) == want


def test_remote_hosts_need_allow_remote():
    with pytest.raises(ConfigError, match=r"--host 'http://dlrm-serve:8080' is not a loopback "
                                          r"address; .* takes --allow-remote"):
        lrun.check_host("http://dlrm-serve:8080", allow_remote=False)
    assert lrun.check_host("http://10.0.0.5:8080", allow_remote=True) == (
        "http://10.0.0.5:8080", False)
    with pytest.raises(ConfigError, match=r"must be an http\(s\) URL"):
        lrun.check_host("ftp://127.0.0.1", allow_remote=False)
    with pytest.raises(ConfigError, match=r"must be the server root"):
        lrun.check_host("http://127.0.0.1:8080/predictions/dlrm", allow_remote=False)


def test_cli_rejects_bad_arguments_before_doing_anything(capsys, tmp_path):
    assert lrun.main(["--duration", "2s", "--out", str(tmp_path / "o")]) == lrun.EXIT_USAGE
    assert "duration 2s is out of range" in capsys.readouterr().err
    assert lrun.main(["-H", "http://10.1.2.3:8080", "--out", str(tmp_path / "o")]) == lrun.EXIT_USAGE
    assert "not a loopback address" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_unreachable_service_with_no_start_exits_3(tmp_path):
    rc = lrun.main(["--shape", "steady", "--duration", "5s", "--no-start",
                    "-H", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "o")])
    assert rc == lrun.EXIT_UNREACHABLE


def test_served_state_recorded_beside_the_figures(tmp_path, monkeypatch):
    """The load test asks the sidecar on a loopback target's host (or the one named) for
    what it serves, and prints it with the verdict; a remote target's is not guessed, and
    a sidecar that does not answer is recorded as unknown, not fatal."""
    from serve.ops.state_client import describe_served, served_state

    monkeypatch.delenv("LOADTEST_SIDECAR", raising=False)
    assert lrun.default_sidecar("http://127.0.0.1:8080", True) == "http://127.0.0.1:8090"
    assert lrun.default_sidecar("http://[::1]:8080", True) == "http://[::1]:8090"
    assert lrun.default_sidecar("http://10.0.0.5:8080", False) is None
    monkeypatch.setenv("LOADTEST_SIDECAR", "http://127.0.0.1:9999/")
    assert lrun.default_sidecar("http://10.0.0.5:8080", False) == "http://127.0.0.1:9999"
    down = served_state(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    assert set(down) == {"error"} and "GET http://127.0.0.1:" in down["error"]
    assert describe_served(down).startswith("unknown (GET ")
    summary = stats.summarize("steady", [], stats.Thresholds(60.0, 0.0, 0.05), {"served": {
        "before": {"version": "v1", "batching": {"batch_size": 2, "max_batch_delay_ms": 2},
                   "workers": 2, "converged": True, "tuner_enabled": True},
        "after": {"version": "v1", "batching": {"batch_size": 4, "max_batch_delay_ms": 3},
                  "workers": 2, "converged": True, "tuner_enabled": True}}})
    buf = io.StringIO()
    lrun.print_summary(summary, file=buf)
    text = buf.getvalue()
    assert "served before: version v1, batching 2 / 2 ms, 2 workers, tuner on" in text
    assert "served after:  version v1, batching 4 / 3 ms, 2 workers, tuner on" in text


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "loadtest.run", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0
    assert "--allow-remote" in out.stdout and "--p99-goal-ms" in out.stdout


# ----------------------------------------------------------------------------- real runs

def _run_cli(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "loadtest.run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _locust_aggregated(out: Path) -> dict[str, str]:
    with (out / "locust_stats.csv").open() as f:
        return next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")


@pytest.mark.integration
def test_smoke_run_against_real_torchserve(torchserve, tmp_path):
    """CI smoke: 16 s of real locust against the real TorchServe; zero failures."""
    out = tmp_path / "run"
    # p99 goal far above anything real: this run asserts correctness, not speed.
    res = _run_cli(["--shape", "steady", "--duration", "16s", "--users", "2",
                    "-H", torchserve.inference_url, "--model", torchserve.model_name,
                    "--no-start", "--profile", "tiny", "--instances", "1-64:16",
                    "--p99-goal-ms", "60000", "--out", str(out),
                    "--summary-json", str(tmp_path / "summary.json")])
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is True
    assert summary["totals"]["requests"] > 0 and summary["totals"]["failures"] == 0
    assert summary["totals"]["instances"] > summary["totals"]["requests"]  # multi-instance
    agg = _locust_aggregated(out)
    assert int(agg["Request Count"]) > 0 and int(agg["Failure Count"]) == 0
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report.html").stat().st_size > 0
    assert [s["name"] for s in summary["steps"]] == ["ramp", "hold"]
    # where the load generator (and, on loopback, the service) ran
    assert summary["machine"]["logical_cores"] >= 1 and summary["machine"]["cpu_model"]
    assert "machine (load generator): " in res.stdout
    # The columnar form is answered as well (one checked request; the run used rows).
    pool = traffic.RequestPool(traffic.TrafficConfig(
        profile=get_profile("tiny"), body_format="columnar", pool_size=1,
        instances=traffic.InstancesDistribution.parse("32", 0.0)))
    r = httpx.post(torchserve.predict_url, content=pool.requests[0].body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert traffic.check_response(r.status_code, r.content, 32) is None


# Plain locust, as a locust user runs it: -u/-r/-t set the load unless --dlrm-shape is given.
# Small requests of the tiny profile (the fixture's model), so a few seconds suffice.
_LOCUST_TRAFFIC = ["--dlrm-profile", "tiny", "--dlrm-instances", "1-64:16",
                   "--dlrm-pool-size", "32"]


def _locust(args: list[str], timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """``locust -f loadtest/locustfile.py ARGS`` from the repo root; (result, wall seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOAD_SHAPE", None)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py",
                          *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    return res, time.monotonic() - t0


def _history(prefix: Path) -> list[dict[str, str]]:
    """locust's per-second history rows of the Aggregated line (while users ran)."""
    with Path(f"{prefix}_stats_history.csv").open() as f:
        return [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]


@pytest.mark.integration
def test_plain_locust_follows_users_spawn_rate_and_run_time(torchserve, tmp_path):
    """`locust -f loadtest/locustfile.py --headless -u 2 -r 2 -t 6s`: locust's own options
    set the load (no shape takes them over, as one found in the locustfile would)."""
    prefix = tmp_path / "locust"
    res, wall = _locust(["--headless", "-u", "2", "-r", "2", "-t", "6s",
                         "-H", torchserve.inference_url, "--dlrm-model", torchserve.model_name,
                         "--csv", str(prefix), "--only-summary", *_LOCUST_TRAFFIC])
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    assert "have no impact on LoadShapes" not in log and "will be ignored" not in log, log
    assert "Run time limit set to 6 seconds" in log, log
    total = _locust_aggregated(tmp_path)
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0, total
    rows = _history(prefix)
    assert max(int(r["User Count"]) for r in rows) == 2, rows
    # The run lasted -t, not a shape's 60 s default: locust's history spans ~6 s and the
    # whole process (imports, request pool, stop) took far less than 60 s.
    span = int(rows[-1]["Timestamp"]) - int(rows[0]["Timestamp"])
    assert 4 <= span <= 8, rows
    assert wall < 40, wall


@pytest.mark.integration
def test_locust_with_dlrm_shape_follows_the_shape(torchserve, tmp_path):
    """`--dlrm-shape steady`: the shape sets users and duration (not -u / -t), and the
    per-stage figures are written."""
    prefix, stages = tmp_path / "locust", tmp_path / "stages.json"
    res, wall = _locust(["--headless", "-u", "5", "-t", "60s",
                         "-H", torchserve.inference_url, "--dlrm-model", torchserve.model_name,
                         "--csv", str(prefix), "--only-summary", *_LOCUST_TRAFFIC,
                         "--dlrm-shape", "steady", "--dlrm-duration", "6s", "--dlrm-users", "1",
                         "--dlrm-stages-json", str(stages)])
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    assert "--dlrm-shape steady sets the users; -u/--users ignored" in log, log
    assert "Shape test completed" in log, log
    doc = json.loads(stages.read_text())
    assert doc["shape"]["shape"] == "steady"
    assert [(s["name"], s["users"]) for s in doc["stages"]] == [("ramp", 1), ("hold", 1)]
    assert sum(s["requests"] for s in doc["stages"]) > 0
    assert sum(s["failures"] for s in doc["stages"]) == 0
    rows = _history(prefix)
    assert max(int(r["User Count"]) for r in rows) == 1, rows  # the shape's 1, not -u 5
    assert int(rows[-1]["Timestamp"]) - int(rows[0]["Timestamp"]) <= 8, rows  # not -t 60s
    assert wall < 40, wall


def test_locustfile_defines_no_shape_locust_would_pick_up():
    """A non-abstract LoadTestShape in the locustfile's globals would make every plain
    `locust -f` run ignore -u/-r/-t; locust's own loader must find none."""
    code = ("from locust.util.load_locustfile import load_locustfile; "
            "users, shapes = load_locustfile('loadtest/locustfile.py'); "
            "print(sorted(users), len(shapes))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True,
                         capture_output=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[-2] == "['DlrmUser'] 0", res.stdout


class _BrokenHandler(BaseHTTPRequestHandler):
    """Answers like the service, except: every 3rd predict has one prediction too few and
    every 7th is a 500. Proves the load test counts wrong answers as failures."""

    counter = 0
    lock = threading.Lock()

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self._send(200, b'{"status": "Healthy"}')

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        doc = orjson.loads(body)     # the context form (the default) or instances
        n = len(doc["candidates"] if "candidates" in doc else doc["instances"])
        with self.lock:
            i = type(self).counter
            type(self).counter += 1
        if i % 7 == 6:
            self._send(500, b'{"code": 500, "type": "InternalError", "message": "boom"}')
        else:
            k = n - 1 if i % 3 == 2 else n
            self._send(200, orjson.dumps({"predictions": [0.5] * k}))

    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def broken_server():
    with local_http_server(_BrokenHandler) as url:
        yield url


@pytest.mark.integration
def test_wrong_answers_fail_the_run(broken_server, tmp_path):
    out = tmp_path / "run"
    res = _run_cli(["--shape", "steady", "--duration", "5s", "--users", "1", "-H", broken_server,
                    "--no-start", "--profile", "tiny", "--instances", "1-8:4",
                    "--p99-goal-ms", "60000", "--think-ms", "20", "--out", str(out)])
    assert res.returncode == lrun.EXIT_THRESHOLD, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is False
    t = summary["totals"]
    assert t["failures"] > 0 and t["requests"] > t["failures"]
    reasons = " | ".join(summary["failure_reasons"])
    assert "predictions, got" in reasons and "HTTP 500" in reasons
    failed = {c["name"]: c["passed"] for c in summary["thresholds"]["checks"]}
    assert failed == {"requests > 0": True, "fail_ratio <= max_fail_ratio": False,
                      "p99 <= goal over the SLO stages": True}
    assert int(_locust_aggregated(out)["Failure Count"]) > 0
    assert "FAIL  fail_ratio <= max_fail_ratio" in res.stdout
    # Re-judged with a lenient fail ratio, the same results pass.
    res2 = _run_cli(["--from-results", str(out), "--max-fail-ratio", "0.9",
                     "--p99-goal-ms", "60000"])
    assert res2.returncode == 0, res2.stdout + res2.stderr
