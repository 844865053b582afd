"""serve.common.histograms: Prometheus' histogram_quantile and the population stability
index (moved from tests/test_guards.py with the functions)."""
from __future__ import annotations

import math

import pytest

from serve.common.histograms import PSI_EPS, histogram_quantile, psi
from serve.metrics import REQUEST_DURATION_BUCKETS
from tests.test_guards import latency

# --- histogram_quantile ------------------------------------------------------------------

BOUNDS = (1.0, 2.0, 4.0)


@pytest.mark.parametrize(("q", "expected"), [
    (0.25, 1.0),   # rank 10: the top of the first bucket, 0 + 1 * 10/10
    (0.5, 2.0),    # rank 20: (1, 2], 1 + 1 * 10/10
    (0.1, 0.4),    # rank 4: (0, 1], 0 + 1 * 4/10
    (0.9, 3.6),    # rank 36: (2, 4], 2 + 2 * 16/20
    (1.0, 4.0),    # rank 40: the top of the highest non-empty bucket
])
def test_histogram_quantile_interpolates_linearly_inside_the_bucket(q: float, expected: float):
    assert histogram_quantile(q, BOUNDS, (10, 20, 40, 40)) == pytest.approx(expected)


def test_histogram_quantile_follows_prometheus_edge_rules():
    # In the +Inf bucket: the highest finite bound.
    assert histogram_quantile(0.99, BOUNDS, (0, 0, 10, 20)) == 4.0
    # Empty histogram: Prometheus says NaN, this says None.
    assert histogram_quantile(0.99, BOUNDS, (0, 0, 0, 0)) is None
    # Decreasing cumulative counts are made monotonic: (5, 3, 10) reads as (5, 5, 10).
    assert histogram_quantile(0.5, BOUNDS, (5, 3, 10, 10)) == histogram_quantile(
        0.5, BOUNDS, (5, 5, 10, 10)) == pytest.approx(1.0)
    # A first bound <= 0 is returned as it is.
    assert histogram_quantile(0.1, (0.0, 1.0), (5, 10, 10)) == 0.0
    # q = 0 on an empty first bucket: its lower edge (Prometheus: NaN).
    assert histogram_quantile(0.0, BOUNDS, (0, 4, 4, 4)) == 0.0
    # The p99 of latencies all in (7.5 ms, 10 ms].
    cum = latency([0.009] * 100)
    assert histogram_quantile(0.99, REQUEST_DURATION_BUCKETS, cum) == pytest.approx(
        0.0075 + 0.0025 * 0.99)


@pytest.mark.parametrize(("q", "bounds", "counts", "match"), [
    (1.5, BOUNDS, (0, 0, 0, 0), "within 0..1"),
    (math.nan, BOUNDS, (0, 0, 0, 0), "within 0..1"),
    (0.5, (), (1,), "at least one"),
    (0.5, BOUNDS, (1, 2, 3), "plus the \\+Inf"),
    (0.5, (1.0, 1.0, 2.0), (1, 2, 3, 3), "strictly increasing"),
    (0.5, BOUNDS, (1, -2, 3, 3), ">= 0"),
])
def test_histogram_quantile_refuses_invalid_arguments(q, bounds, counts, match):
    with pytest.raises(ValueError, match=match):
        histogram_quantile(q, bounds, counts)


# --- psi ---------------------------------------------------------------------------------

def test_psi_of_identical_distributions_is_zero_whatever_the_scale():
    counts = [3, 0, 10, 7, 80]
    assert psi(counts, counts) == 0.0
    assert psi(counts, [10 * c for c in counts]) == pytest.approx(0.0, abs=1e-12)


def test_psi_matches_a_hand_computed_example_and_is_symmetric():
    # Fractions (0.5, 0.5) vs (0.25, 0.75):
    # (0.25 - 0.5) ln(0.25/0.5) + (0.75 - 0.5) ln(0.75/0.5) = 0.25 ln 2 + 0.25 ln 1.5.
    expected = 0.25 * math.log(2) + 0.25 * math.log(1.5)
    assert psi([50, 50], [25, 75]) == pytest.approx(expected)  # ~0.2747
    assert psi([25, 75], [50, 50]) == pytest.approx(expected)
    a, b = [5, 20, 40, 35], [10, 30, 30, 30]
    assert psi(a, b) == pytest.approx(psi(b, a))


def test_psi_floors_empty_bins_at_eps():
    # Bin 2 of "expected" is empty: its fraction counts as eps = 1e-4.
    expected = (0.5 - 1.0) * math.log(0.5 / 1.0) + (0.5 - PSI_EPS) * math.log(0.5 / PSI_EPS)
    assert psi([100, 0], [50, 50]) == pytest.approx(expected)  # ~4.75: finite
    assert psi([100, 0], [50, 50], eps=1e-2) < psi([100, 0], [50, 50])


@pytest.mark.parametrize(("e", "a", "eps", "match"), [
    ([1, 2], [1, 2, 3], PSI_EPS, "same non-zero number"),
    ([], [], PSI_EPS, "same non-zero number"),
    ([0, 0], [1, 2], PSI_EPS, "all 0"),
    ([1, -1], [1, 2], PSI_EPS, ">= 0"),
    ([1, 2], [1, 2], 0.0, "eps"),
    ([1, 2], [1, 2], 1.0, "eps"),
])
def test_psi_refuses_invalid_arguments(e, a, eps, match):
    with pytest.raises(ValueError, match=match):
        psi(e, a, eps)
