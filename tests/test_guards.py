"""serve.sidecar.control.guards: snapshots of the per-arm series (parsed from real prometheus_client
families), windows between snapshots and the three rollout guards (the latency guard's
statistic in depth: tests/test_guards_latency.py; PSI and histogram_quantile:
tests/test_histograms.py)."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from serve.common.histograms import psi
from serve.metrics import (
    ARM_ERRORS_TOTAL,
    ARM_FORWARD_SECONDS_PER_INSTANCE,
    ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS,
    ARM_REQUEST_DURATION_SECONDS,
    ARM_REQUESTS_TOTAL,
    ARM_SCORE,
    REQUEST_DURATION_BUCKETS,
    ROLLOUT_GUARDS,
    SCORE_BUCKETS,
    SCORE_DIFF_BUCKETS,
    SHADOW_SCORE_DIFF,
)
from serve.metrics.aggregate import HandlerAggregateCollector
from serve.sidecar.control.guards import (
    GUARD_STATUSES,
    ArmCounts,
    GuardLimits,
    GuardResult,
    Snapshot,
    breaches,
    evaluate,
    snapshot,
    wilson_lower,
)

REPO = Path(__file__).resolve().parents[1]
LAT_LEN = len(REQUEST_DURATION_BUCKETS) + 1
SCORE_LEN = len(SCORE_BUCKETS) + 1

# The guards as the tests size their windows: 20 requests and forwards (the defaults ask
# 100 and 30).
LIMITS = GuardLimits(min_requests=20, min_forwards=20)


class Workers:
    """The workers' per-arm metrics on a fresh in-process registry (same names, labels
    and buckets as in multiprocess mode, so the families have the real shapes)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["arm", "version"]
        self.requests = Counter(ARM_REQUESTS_TOTAL.removesuffix("_total"), "requests",
                                labels, registry=r)
        self.errors = Counter(ARM_ERRORS_TOTAL.removesuffix("_total"), "errors",
                              labels, registry=r)
        self.duration = Histogram(ARM_REQUEST_DURATION_SECONDS, "seconds", labels,
                                  buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.score = Histogram(ARM_SCORE, "scores", labels, buckets=SCORE_BUCKETS,
                               registry=r)
        self.forward = Histogram(ARM_FORWARD_SECONDS_PER_INSTANCE, "per instance", labels,
                                 buckets=ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS, registry=r)
        self.diff = Histogram(SHADOW_SCORE_DIFF, "diff", ["version"],
                              buckets=SCORE_DIFF_BUCKETS, registry=r)

    def serve(self, arm: str, version: str, *, seconds: float, scores: list[float],
              n: int = 1, failed: int = 0) -> None:
        """``n`` requests of ``seconds`` each, ``failed`` of them failed, each scoring
        ``scores``; each one forward whose seconds per instance are ``seconds / 100``."""
        for i in range(n):
            self.requests.labels(arm, version).inc()
            if i < failed:
                self.errors.labels(arm, version).inc()
            self.duration.labels(arm, version).observe(seconds)
            self.forward.labels(arm, version).observe(seconds / 100)
            for s in scores:
                self.score.labels(arm, version).observe(s)

    def shadow(self, version: str, diffs: list[float]) -> None:
        for d in diffs:
            self.diff.labels(version).observe(d)

    def snap(self, stable: str = "v1", candidate: str = "v2") -> Snapshot:
        return snapshot(self.registry.collect(), stable_version=stable,
                        candidate_version=candidate)


def cumulative(bounds: tuple[float, ...], values: list[float]) -> tuple[int, ...]:
    """Cumulative ``le`` counts of ``values`` (what a Prometheus histogram holds)."""
    return tuple(sum(v <= b for v in values) for b in bounds) + (len(values),)


def latency(values: list[float]) -> tuple[int, ...]:
    return cumulative(REQUEST_DURATION_BUCKETS, values)


def scores_cum(values: list[float]) -> tuple[int, ...]:
    return cumulative(SCORE_BUCKETS, values)


def arm(requests: int = 0, errors: int = 0, seconds: list[float] | None = None,
        scores: list[float] | None = None, forwards: list[float] | None = None) -> ArmCounts:
    seconds = seconds or []
    scores = scores or []
    forwards = forwards or []
    return ArmCounts(requests=requests, errors=errors, latency_buckets=latency(seconds),
                     latency_sum=sum(seconds), score_buckets=scores_cum(scores),
                     score_count=len(scores), score_sum=sum(scores),
                     forward_buckets=cumulative(ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS,
                                                forwards), forward_sum=sum(forwards))


def by_name(results: list[GuardResult]) -> dict[str, GuardResult]:
    return {r.name: r for r in results}


# --- snapshot ----------------------------------------------------------------------------

def test_snapshot_picks_each_arms_version_and_ignores_the_others():
    w = Workers()
    w.serve("stable", "v1", seconds=0.004, scores=[0.1, 0.2], n=5, failed=1)
    w.serve("candidate", "v2", seconds=0.03, scores=[0.5], n=3, failed=2)
    # Noise: an older stable, the stable version under the candidate arm, a third version.
    w.serve("stable", "v0", seconds=0.9, scores=[0.9], n=7, failed=7)
    w.serve("candidate", "v1", seconds=0.9, scores=[0.9], n=11, failed=11)
    w.serve("candidate", "v3", seconds=0.9, scores=[0.9], n=13, failed=13)
    w.shadow("v2", [0.05, -0.01])
    w.shadow("v3", [0.9])

    snap = w.snap()
    assert (snap.stable_version, snap.candidate_version) == ("v1", "v2")
    s, c = snap.stable, snap.candidate
    assert (s.requests, s.errors, c.requests, c.errors) == (5, 1, 3, 2)
    assert s.latency_buckets == latency([0.004] * 5)
    assert c.latency_buckets == latency([0.03] * 3)
    assert s.latency_count == 5 and s.latency_sum == pytest.approx(0.02)
    assert s.score_buckets == scores_cum([0.1, 0.2] * 5)
    assert (s.score_count, s.score_sum) == (10, pytest.approx(1.5))
    assert c.score_buckets == scores_cum([0.5] * 3)
    assert (c.score_count, c.score_sum) == (3, pytest.approx(1.5))
    assert snap.diff_count == 2
    assert snap.diff_buckets == cumulative(SCORE_DIFF_BUCKETS, [0.05, -0.01])
    # In-process, prometheus_client omits _sum for a histogram with negative buckets (the
    # multiprocess collector keeps it: see the next test): a missing sum reads as 0.
    assert snap.diff_sum == 0.0


def test_missing_series_are_zeros():
    empty = Workers().snap()
    assert empty == Snapshot(stable_version="v1", candidate_version="v2")
    assert empty.candidate == ArmCounts() and empty.mean_score_diff is None
    assert empty.candidate.latency_buckets == (0,) * LAT_LEN
    assert empty.candidate.score_buckets == (0,) * SCORE_LEN

    w = Workers()
    w.serve("stable", "v1", seconds=0.002, scores=[0.3], n=4)
    snap = w.snap()
    assert snap.stable.requests == 4 and snap.stable.errors == 0  # errors never incremented
    assert snap.candidate == ArmCounts()
    assert snap.diff_count == 0 and snap.diff_buckets == (0,) * (len(SCORE_DIFF_BUCKETS) + 1)


def test_snapshot_reads_exposition_text_and_the_multiprocess_collector(tmp_path: Path):
    w = Workers()
    w.serve("stable", "v1", seconds=0.004, scores=[0.1], n=3, failed=1)
    w.serve("candidate", "v2", seconds=0.2, scores=[0.6, 0.99], n=2)
    expected = w.snap()
    # The text parser names counter families differently; samples are what count.
    text = generate_latest(w.registry).decode()
    parsed = snapshot(text_string_to_metric_families(text), stable_version="v1",
                      candidate_version="v2")
    assert parsed == expected

    # Real worker processes in multiprocess mode, read by the sidecar's collector.
    worker = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_guards import Workers
        w = Workers()
        w.serve("stable", "v1", seconds=0.004, scores=[0.1], n=3, failed=int(sys.argv[1]))
        w.serve("candidate", "v2", seconds=0.2, scores=[0.6, 0.99], n=2)
        w.shadow("v2", [0.05, -0.01])
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for failed in ("1", "0"):  # two worker processes; the collector sums them
        subprocess.run([sys.executable, "-c", worker, failed], env=env, check=True,
                       timeout=60)
    summed = snapshot(HandlerAggregateCollector(tmp_path).collect(), stable_version="v1",
                      candidate_version="v2")
    s, c = summed.stable, summed.candidate
    assert (s.requests, s.errors, c.requests, c.errors) == (6, 1, 4, 0)
    assert s.latency_buckets == latency([0.004] * 6)
    assert c.score_buckets == scores_cum([0.6, 0.99] * 4)
    assert c.score_sum == pytest.approx(2 * expected.candidate.score_sum)
    assert (summed.diff_count, summed.diff_sum) == (4, pytest.approx(0.08))
    assert summed.mean_score_diff == pytest.approx(0.02)


def _family(le_values: dict[str, float]) -> Metric:
    fam = Metric(ARM_SCORE, "scores", "histogram")
    for le, value in le_values.items():
        fam.add_sample(f"{ARM_SCORE}_bucket", {"arm": "candidate", "version": "v2", "le": le},
                       value)
    return fam


def test_bucket_labels_are_matched_by_float_value():
    fam = _family({"0.0010": 1, "1": 4, "+Inf": 5, "0.5": 3})
    snap = snapshot([fam], stable_version="v1", candidate_version="v2")
    buckets = snap.candidate.score_buckets
    assert buckets[SCORE_BUCKETS.index(0.001)] == 1
    assert buckets[SCORE_BUCKETS.index(0.5)] == 3
    assert buckets[SCORE_BUCKETS.index(1.0)] == 4
    assert buckets[-1] == 5


@pytest.mark.parametrize("le", ["0.33", "soon"])
def test_unknown_bucket_label_is_refused(le: str):
    with pytest.raises(ValueError, match="le="):
        snapshot([_family({le: 1})], stable_version="v1", candidate_version="v2")
    # ... but only in a series that is read: other versions are not judged.
    snapshot([_family({le: 1})], stable_version="v1", candidate_version="v9")


def test_snapshot_refuses_empty_versions_and_bad_counts():
    with pytest.raises(ValueError, match="stable_version"):
        snapshot([], stable_version="", candidate_version="v2")
    fam = Metric(ARM_REQUESTS_TOTAL.removesuffix("_total"), "requests", "counter")
    fam.add_sample(ARM_REQUESTS_TOTAL, {"arm": "stable", "version": "v1"}, math.nan)
    with pytest.raises(ValueError, match="finite"):
        snapshot([fam], stable_version="v1", candidate_version="v2")


# --- windows -----------------------------------------------------------------------------

def test_minus_gives_the_window_since_the_base():
    w = Workers()
    w.serve("stable", "v1", seconds=0.9, scores=[0.9], n=10, failed=5)
    w.serve("candidate", "v2", seconds=0.9, scores=[0.9], n=10, failed=5)
    w.shadow("v2", [0.5, 0.5, 0.1])
    base = w.snap()
    w.serve("stable", "v1", seconds=0.004, scores=[0.1, 0.2], n=4)
    w.serve("candidate", "v2", seconds=0.008, scores=[0.3], n=2, failed=1)
    w.shadow("v2", [-0.1])
    window = w.snap().minus(base)
    s = window.stable
    assert (s.requests, s.errors, s.score_count) == (4, 0, 8)
    assert s.latency_buckets == latency([0.004] * 4)
    assert s.score_buckets == scores_cum([0.1, 0.2] * 4)
    assert (s.latency_sum, s.score_sum) == (pytest.approx(0.016), pytest.approx(1.2))
    assert (window.candidate.requests, window.candidate.errors) == (2, 1)
    assert window.candidate.latency_buckets == latency([0.008] * 2)
    assert window.diff_count == 1
    assert window.diff_buckets == cumulative(SCORE_DIFF_BUCKETS, [-0.1])
    assert not w.snap().decreased_since(base)
    # The sum of score differences may go down, and its window be negative.
    before = Snapshot(diff_buckets=window.diff_buckets, diff_count=1, diff_sum=0.3)
    after = Snapshot(diff_buckets=cumulative(SCORE_DIFF_BUCKETS, [-0.1, -0.2]), diff_count=2,
                     diff_sum=0.1)
    assert after.minus(before).diff_sum == pytest.approx(-0.2)
    assert not after.decreased_since(before)


def test_minus_clamps_counts_that_went_down_at_zero():
    w = Workers()
    w.serve("stable", "v1", seconds=0.004, scores=[0.1], n=50, failed=3)
    w.serve("candidate", "v2", seconds=0.004, scores=[0.1], n=50, failed=3)
    w.shadow("v2", [0.01] * 5)
    base = w.snap()
    # The workers restarted with an emptied multiprocess dir: counts start from zero.
    after = Workers()
    after.serve("stable", "v1", seconds=0.3, scores=[0.7], n=2)
    after.serve("candidate", "v2", seconds=0.3, scores=[0.7], n=2, failed=1)
    after.shadow("v2", [-0.3])
    now = after.snap()
    assert now.decreased_since(base)
    window = now.minus(base)
    for counts in (window.stable, window.candidate):
        assert counts.requests == 0 and counts.errors == 0 and counts.score_count == 0
        assert min(counts.latency_buckets) >= 0 and min(counts.score_buckets) >= 0
        assert counts.latency_sum == 0.0 and counts.score_sum == 0.0
    # Every bucket went down (50 old observations, 2 new ones): each delta is clamped.
    assert window.stable.latency_buckets[REQUEST_DURATION_BUCKETS.index(0.005)] == 0
    assert window.stable.latency_buckets[REQUEST_DURATION_BUCKETS.index(0.5)] == 0
    assert (window.diff_count, window.diff_sum) == (0, 0.0)
    # Such a window judges nothing rather than something wrong.
    assert all(r.status == "insufficient_data"
               for r in evaluate(window, GuardLimits(min_requests=1, min_instances=1)))


def test_minus_refuses_snapshots_of_other_versions():
    w = Workers()
    with pytest.raises(ValueError, match="new base"):
        w.snap("v1", "v2").minus(w.snap("v1", "v3"))


def test_counts_are_validated():
    with pytest.raises(ValueError, match="latency_buckets"):
        ArmCounts(latency_buckets=(0, 1))
    with pytest.raises(ValueError, match="requests"):
        ArmCounts(requests=-1)
    with pytest.raises(ValueError, match="diff_buckets"):
        Snapshot(diff_buckets=(1,))


# --- the guards --------------------------------------------------------------------------

def test_limits_defaults_and_validation():
    limits = GuardLimits()
    assert (limits.max_error_ratio, limits.max_latency_ratio, limits.max_score_psi,
            limits.min_requests, limits.min_instances, limits.min_forwards,
            limits.confidence) == (0.01, 1.3, 0.5, 100, 500, 30, 0.99)
    for bad in ({"max_error_ratio": -0.1}, {"max_error_ratio": 1.5},
                {"max_latency_ratio": 0}, {"max_score_psi": math.inf},
                {"min_requests": 0}, {"min_instances": 2.5}, {"min_requests": True},
                {"min_forwards": 0}, {"confidence": 1.0}, {"confidence": 0.2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GuardLimits(**bad)


def test_results_come_in_guard_order_and_serialize():
    results = evaluate(Snapshot(), LIMITS)
    from serve.metrics import QUALITY_GUARDS  # judged apart (quality_gates.evaluate_quality)
    assert tuple(r.name for r in results) == tuple(
        g for g in ROLLOUT_GUARDS if g not in QUALITY_GUARDS)
    assert all(r.status == "insufficient_data" and r.value is None for r in results)
    assert breaches(results) == []
    doc = results[0].to_json()
    assert doc == {"name": "error_ratio", "value": None, "threshold": 0.01,
                   "status": "insufficient_data",
                   "detail": "candidate has 0 of the 20 requests needed", "blocking": True}
    json.dumps([r.to_json() for r in results])
    with pytest.raises(ValueError, match="not one of"):
        GuardResult("latency", 1.0, 2.0, "ok", "")
    with pytest.raises(ValueError, match="not one of"):
        GuardResult("p99_ratio", 1.0, 2.0, "ok", "")  # the guard before latency_ratio
    with pytest.raises(ValueError, match="not one of"):
        GuardResult("latency_ratio", 1.0, 2.0, "fine", "")
    with pytest.raises(ValueError, match="None exactly"):
        GuardResult("latency_ratio", None, 2.0, "ok", "")
    assert set(GUARD_STATUSES) == {"ok", "breached", "insufficient_data"}


def test_error_ratio_ok_breached_insufficient_and_strict():
    limits = LIMITS
    few = by_name(evaluate(Snapshot(candidate=arm(requests=12, errors=12)), limits))
    assert few["error_ratio"].status == "insufficient_data"
    assert few["error_ratio"].detail == "candidate has 12 of the 20 requests needed"

    # 3 of 120 (2.5%) is no evidence of a rate above 1%: the 99% lower bound is 0.0071
    # (by hand: (p + z^2/2n - z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 2.3263).
    unlucky = by_name(evaluate(Snapshot(candidate=arm(requests=120, errors=3)), limits))
    assert unlucky["error_ratio"].status == "ok"
    assert unlucky["error_ratio"].value == pytest.approx(wilson_lower(3, 120, 0.99))
    assert unlucky["error_ratio"].detail == (
        "candidate 3 errors of 120 requests (0.025): 99% lower bound = 0.007131 <= 0.01")
    bad = by_name(evaluate(Snapshot(candidate=arm(requests=120, errors=10)), limits))
    assert bad["error_ratio"].status == "breached"
    assert bad["error_ratio"].detail == (
        "candidate 10 errors of 120 requests (0.08333): 99% lower bound = 0.04115 > 0.01")
    assert [r.name for r in breaches(bad.values())] == ["error_ratio"]

    bound = wilson_lower(10, 120, 0.99)
    at_limit = by_name(evaluate(Snapshot(candidate=arm(requests=120, errors=10)),
                                GuardLimits(min_requests=20, max_error_ratio=bound)))
    assert at_limit["error_ratio"].status == "ok"  # the bound is not > itself
    clean = by_name(evaluate(Snapshot(candidate=arm(requests=20)), limits))
    assert (clean["error_ratio"].status, clean["error_ratio"].value) == ("ok", 0.0)


def _latency_window(stable_s: float, candidate_s: float, n: int = 100,
                    stable_n: int | None = None) -> Snapshot:
    """``n`` candidate and ``stable_n`` stable forwards of the given seconds per instance,
    spread +-20% (evenly, so both arms' shapes are alike)."""
    stable_n = n if stable_n is None else stable_n

    def spread(centre: float, k: int) -> list[float]:
        return [centre * (0.8 + 0.4 * i / max(1, k - 1)) for i in range(k)]

    return Snapshot(stable=arm(requests=stable_n, forwards=spread(stable_s, stable_n)),
                    candidate=arm(requests=n, forwards=spread(candidate_s, n)))


def test_latency_ratio_ok_breached_and_strict():
    slow = by_name(evaluate(_latency_window(20e-6, 40e-6), LIMITS))["latency_ratio"]
    assert slow.status == "breached" and 1.3 < slow.value < 2.0  # the lower bound of ~2x
    assert slow.detail.startswith("candidate / stable forward seconds per instance over "
                                  "100 vs 100 forwards: ratio 2")
    assert "; 99% lower bound = " in slow.detail and slow.detail.endswith("> 1.3")

    same = by_name(evaluate(_latency_window(20e-6, 20e-6), LIMITS))["latency_ratio"]
    assert same.status == "ok" and same.value < 1.0
    limit = by_name(evaluate(_latency_window(20e-6, 40e-6), LIMITS))["latency_ratio"].value
    exact = GuardLimits(min_forwards=20, max_latency_ratio=limit)
    assert by_name(evaluate(_latency_window(20e-6, 40e-6), exact))["latency_ratio"].status == "ok"
    faster = by_name(evaluate(_latency_window(20e-6, 5e-6), LIMITS))["latency_ratio"]
    assert faster.status == "ok" and faster.value < 0.3


def test_latency_ratio_needs_forwards_on_both_arms():
    few = by_name(evaluate(_latency_window(20e-6, 0.05, n=5, stable_n=50),
                           LIMITS))["latency_ratio"]
    assert few.status == "insufficient_data" and few.value is None
    assert few.detail == "candidate has 5 of the 20 timed forwards needed"
    no_stable = Snapshot(candidate=arm(requests=50, forwards=[1e-5] * 50))
    result = by_name(evaluate(no_stable, LIMITS))["latency_ratio"]
    assert result.detail == "stable has 0 of the 20 timed forwards needed"
    # Workers that predate the series: requests, no forwards.
    untimed = Snapshot(stable=arm(requests=50, seconds=[0.01] * 50),
                       candidate=arm(requests=50, seconds=[0.5] * 50))
    assert by_name(evaluate(untimed, LIMITS))["latency_ratio"].status == "insufficient_data"


def _spread(center: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [min(0.999, max(0.0005, rng.gauss(center, 0.05))) for _ in range(n)]


def test_score_psi_sees_a_shifted_distribution_and_not_the_same_one():
    stable_scores = _spread(0.2, 2000, seed=1)
    shifted = Snapshot(stable=arm(scores=stable_scores), candidate=arm(scores=[0.5] * 1000))
    result = by_name(evaluate(shifted, LIMITS))["score_psi"]
    assert result.status == "breached" and result.value > 1.0  # far above 0.2
    assert result.detail.startswith(
        "score PSI of candidate (1000 instances) vs stable (2000 instances) = ")

    same = Snapshot(stable=arm(scores=stable_scores), candidate=arm(scores=stable_scores))
    result = by_name(evaluate(same, LIMITS))["score_psi"]
    assert result.status == "ok" and result.value == pytest.approx(0.0, abs=1e-12)

    # Another sample of the same distribution: small sampling noise, well below 0.1.
    resampled = Snapshot(stable=arm(scores=stable_scores),
                         candidate=arm(scores=_spread(0.2, 2000, seed=2)))
    result = by_name(evaluate(resampled, LIMITS))["score_psi"]
    assert result.status == "ok" and result.value < 0.1


def test_score_psi_needs_instances_on_both_arms_and_is_strict():
    limits = LIMITS
    few = Snapshot(stable=arm(scores=[0.2] * 600), candidate=arm(scores=[0.5] * 499))
    result = by_name(evaluate(few, limits))["score_psi"]
    assert result.status == "insufficient_data"
    assert result.detail == "candidate has 499 of the 500 scored instances needed"
    neither = by_name(evaluate(Snapshot(candidate=arm(scores=[0.5] * 10)), limits))
    assert neither["score_psi"].detail == (
        "candidate has 10 of the 500 scored instances needed; "
        "stable has 0 of the 500 scored instances needed")

    window = Snapshot(stable=arm(scores=[0.2] * 500 + [0.6] * 500),
                      candidate=arm(scores=[0.2] * 250 + [0.6] * 750))
    value = psi(window.stable.score_bins, window.candidate.score_bins)
    assert value == pytest.approx(0.25 * math.log(2) + 0.25 * math.log(1.5))
    assert by_name(evaluate(window, GuardLimits(max_score_psi=value)))["score_psi"].status == "ok"
    assert by_name(evaluate(window, GuardLimits(max_score_psi=value * 0.999)))[
        "score_psi"].status == "breached"


def test_end_to_end_from_families_to_breaches():
    w = Workers()
    # Before the window: a bad start that the base snapshot hides.
    w.serve("candidate", "v2", seconds=0.9, scores=[0.9], n=10, failed=10)
    base = w.snap()
    rng = random.Random(0)
    for _ in range(100):
        scores = [min(0.999, max(0.0005, rng.gauss(0.2, 0.05))) for _ in range(10)]
        w.serve("stable", "v1", seconds=0.004, scores=scores)
        w.serve("candidate", "v2", seconds=0.004, scores=scores)
    w.serve("candidate", "v2", seconds=0.004, scores=[], n=30, failed=12)  # 12 of 130 fail
    results = evaluate(w.snap().minus(base), LIMITS)
    got = {r.name: r.status for r in results}
    assert got == {"error_ratio": "breached", "latency_ratio": "ok", "score_psi": "ok"}
    assert [r.name for r in breaches(results)] == ["error_ratio"]
    assert by_name(results)["error_ratio"].value == pytest.approx(wilson_lower(12, 130, 0.99))
    latency = by_name(results)["latency_ratio"]  # same forwards: ratio 1, bound below it
    assert latency.value <= 1.0 and "ratio 1;" in latency.detail
    assert by_name(results)["score_psi"].value == pytest.approx(0.0, abs=1e-12)
