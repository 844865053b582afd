"""The rollout's latency and error statistics (serve.sidecar.control.guards): the ratio
bounds of two per-instance forward-time histograms and the Wilson bound, on synthetic
histograms with fixed seeds; the series the workers write for them; the spec's renamed
field."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from serve.errors import ConfigError
from serve.metrics import ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS as BOUNDS
from serve.metrics.worker import HandlerMetrics
from serve.sidecar.control.guards import (
    GuardLimits,
    Snapshot,
    evaluate,
    ratio_bounds,
    snapshot,
    wilson_lower,
)
from serve.state import parse_state

CONF = 0.99
LIMIT = 1.3  # serve.constants.GUARD_MAX_LATENCY_RATIO


def bins(values: np.ndarray) -> list[int]:
    """Per-bin counts of ``values`` over BOUNDS (``le`` semantics) plus +Inf."""
    idx = np.searchsorted(np.asarray(BOUNDS), values, side="left")
    return np.bincount(idx, minlength=len(BOUNDS) + 1).tolist()


def forwards(rng: np.random.Generator, n: int, *, median_s: float = 25e-6,
             sigma: float = 0.3, factor: float = 1.0) -> np.ndarray:
    """``n`` forwards' seconds per instance: log-normal around ``median_s`` (CPU, batch
    ~512), times ``factor``."""
    return factor * np.exp(rng.normal(math.log(median_s), sigma, n))


def test_equal_distributions_never_breach():
    """Same distribution on both arms, 200 seeds, small to large windows: the lower bound
    never comes near the 1.3 limit (it is at most ~1: 1 time in 100 above the truth)."""
    highest = 0.0
    above_truth = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        n, m = (30, 30) if seed % 2 else (800, 200)
        r = ratio_bounds(BOUNDS, bins(forwards(rng, n)), bins(forwards(rng, m)), CONF)
        highest = max(highest, r.lower)
        above_truth += r.lower > 1.0
        assert r.lower <= r.estimate
    assert highest < 1.2
    assert above_truth <= 6  # ~1% expected of 200


def test_a_candidate_1_5x_slower_breaches_with_enough_forwards():
    for seed in range(20):
        rng = np.random.default_rng(1000 + seed)
        stable = bins(forwards(rng, 1000))
        cand = bins(forwards(rng, 250, factor=1.5))
        r = ratio_bounds(BOUNDS, stable, cand, CONF)
        assert r.estimate == pytest.approx(1.5, rel=0.08)
        assert LIMIT < r.lower < 1.5, (seed, r)
        assert (r.reference, r.compared) == (1000, 250)


def test_the_bound_covers_the_true_ratio():
    """The 99% lower bound stays below the true ratio (1.5) in ~99% of windows."""
    misses = 0
    for seed in range(200):
        rng = np.random.default_rng(5000 + seed)
        r = ratio_bounds(BOUNDS, bins(forwards(rng, 300)),
                         bins(forwards(rng, 100, factor=1.5)), CONF)
        misses += r.lower > 1.5
    assert misses <= 6


def test_small_samples_give_a_wide_bound_and_the_guard_waits():
    rng = np.random.default_rng(7)
    r = ratio_bounds(BOUNDS, bins(forwards(rng, 3)), bins(forwards(rng, 3, factor=1.5)), CONF)
    assert r.lower == 0.0  # the rank of the bound falls below the first pair
    # The guard does not even compute it below min_forwards per arm.
    limits = GuardLimits()
    window = Snapshot()
    result = {g.name: g for g in evaluate(window, limits)}["latency_ratio"]
    assert result.status == "insufficient_data"
    assert result.detail == ("candidate has 0 of the 30 timed forwards needed; "
                             "stable has 0 of the 30 timed forwards needed")


def test_a_cold_start_does_not_breach():
    """The measured failure: a fresh candidate's first forwards carry first-call costs
    (10x here, 5% of its forwards). Its p99 is ~3x the stable's; its forwards are not."""
    rng = np.random.default_rng(11)
    stable = forwards(rng, 800)
    cand = forwards(rng, 200)
    cand[:10] *= 10
    assert np.quantile(cand, 0.99) / np.quantile(stable, 0.99) > 2.0
    r = ratio_bounds(BOUNDS, bins(stable), bins(cand), CONF)
    assert r.lower < 1.1 and r.estimate < 1.15


def test_a_pure_scale_shift_is_read_as_its_factor():
    """All observations in one bucket each side, the candidate 4 buckets up (1.26^4 ~ 2.5
    on this E10 series: 1e-5 -> 2.5e-5): the estimate is the ratio of the buckets."""
    one = [0] * (len(BOUNDS) + 1)
    stable, cand = list(one), list(one)
    stable[BOUNDS.index(1e-5)] = 100
    cand[BOUNDS.index(2.5e-5)] = 100
    r = ratio_bounds(BOUNDS, stable, cand, CONF)
    assert r.estimate == pytest.approx(2.5, rel=0.01)
    assert 2.0 < r.lower < 2.5
    back = ratio_bounds(BOUNDS, cand, stable, CONF)
    assert back.estimate == pytest.approx(1 / 2.5, rel=0.01)


@pytest.mark.parametrize(("bounds", "ref", "cmp", "conf", "match"), [
    ((1.0,), [1, 1], [1, 1], CONF, "at least 2"),
    ((2.0, 1.0), [1, 1, 1], [1, 1, 1], CONF, "strictly increasing"),
    ((0.0, 1.0), [1, 1, 1], [1, 1, 1], CONF, "> 0"),
    ((1.0, 2.0), [1, 1], [1, 1, 1], CONF, "reference_bins has 2 bins; expected 3"),
    ((1.0, 2.0), [1, 1, 1], [0, 0, 0], CONF, "compared_bins are all 0"),
    ((1.0, 2.0), [1, -1, 1], [1, 1, 1], CONF, "counts >= 0"),
    ((1.0, 2.0), [1, 1, 1], [1, 1, 1], 1.0, r"confidence=1.0 must be within \[0.5, 1\)"),
])
def test_ratio_bounds_refuses_invalid_arguments(bounds, ref, cmp, conf, match):
    with pytest.raises(ValueError, match=match):
        ratio_bounds(bounds, ref, cmp, conf)


def test_wilson_lower_bound():
    # By hand: (p + z^2/2n - z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 2.3263479.
    z = 2.3263478740408408
    p, n = 0.5, 100
    expected = (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) \
        / (1 + z * z / n)
    assert wilson_lower(50, 100, 0.99) == pytest.approx(expected, rel=1e-12)
    assert wilson_lower(0, 100, 0.99) == 0.0
    assert wilson_lower(1, 100, 0.99) == pytest.approx(0.001376, abs=1e-6)
    assert wilson_lower(100, 100, 0.99) < 1.0
    assert wilson_lower(10, 1000, 0.99) < 0.01 < wilson_lower(30, 1000, 0.99)
    for k, n, match in ((1, 0, "trials"), (-1, 10, "successes"), (11, 10, "<= trials")):
        with pytest.raises(ValueError, match=match):
            wilson_lower(k, n, 0.99)


def test_the_workers_forward_series_reaches_the_snapshot():
    """HandlerMetrics.observe_arm(forward_seconds_per_instance=...) -> the families the
    sidecar reads -> ArmCounts.forward_bins, per arm and version; a failed forward (None)
    adds none."""
    m = HandlerMetrics(CollectorRegistry())
    m.observe_arm("stable", "v1", 2, 0, 0.01, forward_seconds_per_instance=2e-5)
    m.observe_arm("stable", "v1", 1, 0, 0.01, forward_seconds_per_instance=2e-5)
    m.observe_arm("candidate", "v2", 3, 0, 0.01, forward_seconds_per_instance=4.5e-5)
    m.observe_arm("candidate", "v2", 3, 3, 0.01)  # failed: no forward time
    m.observe_arm("candidate", "v3", 3, 0, 0.01, forward_seconds_per_instance=1.0)
    snap = snapshot(m.registry.collect(), stable_version="v1", candidate_version="v2")
    assert snap.stable.forward_count == 2 and snap.candidate.forward_count == 1
    assert snap.stable.forward_bins[BOUNDS.index(2e-5)] == 2
    assert snap.candidate.forward_bins[BOUNDS.index(5e-5)] == 1  # (4e-5, 5e-5]
    assert snap.candidate.forward_sum == pytest.approx(4.5e-5)
    assert snap.minus(snap).candidate.forward_count == 0
    with pytest.raises(ValueError, match="forward_seconds_per_instance=-1"):
        m.observe_arm("stable", "v1", 1, 0, 0.01, forward_seconds_per_instance=-1.0)


def test_the_buckets_span_gpu_to_loaded_cpu_at_1_26x():
    assert BOUNDS[0] == 5e-8 and BOUNDS[-1] == 0.1
    ratios = [b / a for a, b in itertools.pairwise(BOUNDS)]
    assert all(1.2 <= r <= 1.3 for r in ratios), ratios


def test_the_spec_refuses_max_p99_ratio_naming_its_successor():
    spec = {"model": {"version": "a"},
            "rollout": {"candidate": "b", "weight": 0.1, "guards": {"max_p99_ratio": 10.0}}}
    with pytest.raises(ConfigError, match=(
            r"rollout.guards: max_p99_ratio=10.0 is no longer a guard: latency is judged by "
            r"max_latency_ratio \(candidate / stable forward seconds per instance, its lower "
            r"confidence bound; default 1.3\); rename the key")):
        parse_state(spec)
    spec["rollout"]["guards"] = {"max_latency_ratio": 10.0, "failure_limit": 2,
                                 "min_forwards": 10}
    g = parse_state(spec).rollout.guards
    assert (g.max_latency_ratio, g.failure_limit, g.min_forwards) == (10.0, 2, 10)
    spec["rollout"]["guards"] = {"failure_limit": 0}
    with pytest.raises(ConfigError, match="failure_limit"):
        parse_state(spec)
