"""Statistics of histogram bins, shared by the rollout guards and the batching tuner.

* :func:`histogram_quantile`: a quantile of cumulative ``le`` buckets, exactly as
  Prometheus' ``histogram_quantile`` computes it (the tuner's p99, an arm's p99).
* :func:`psi`: the population stability index of two distributions over the same bins
  (the rollout's ``score_psi`` guard).
* :func:`monotonic`: cumulative counts made non-decreasing, as Prometheus does before
  either (a window across a worker restart, a scrape racing a write).

Pure functions of counts: no I/O, no metric registry.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

__all__ = ["PSI_EPS", "histogram_quantile", "monotonic", "psi"]

#: Floor of each bin's fraction in :func:`psi`, so that an empty bin gives a finite term.
PSI_EPS = 1e-4


def monotonic(cumulative: Sequence[float]) -> list[float]:
    """``cumulative`` with every count lower than the one before it raised to it
    (Prometheus' ``ensureMonotonic``)."""
    out: list[float] = []
    top = 0.0
    for c in cumulative:
        top = max(top, float(c))
        out.append(top)
    return out


def histogram_quantile(q: float, bounds: Sequence[float],
                       cumulative_counts: Sequence[float]) -> float | None:
    """The ``q``-quantile of a histogram, exactly as Prometheus' ``histogram_quantile``.

    Args:
        q: the quantile, 0..1 (0.99 for a p99).
        bounds: the finite upper bounds (``le``) of the buckets, strictly increasing, in
            the unit of the observations (seconds for latencies).
        cumulative_counts: observations ``<= bounds[i]`` for each bound, then the ``+Inf``
            bucket (the total): ``len(bounds) + 1`` values.

    Returns:
        The quantile in the unit of ``bounds``, or ``None`` for an empty histogram (where
        Prometheus returns NaN).

    The rules, as Prometheus applies them: cumulative counts that decrease are raised to
    the previous one (its ``ensureMonotonic``); the rank is ``q * total``; the quantile
    lies in the first bucket whose cumulative count is >= the rank and is interpolated
    linearly inside it, between the bucket's lower bound (the previous bound, or 0 for the
    first bucket) and its upper bound. If it falls in the ``+Inf`` bucket, the highest
    finite bound is returned (the histogram cannot say more). If the first bound is <= 0
    and the quantile falls in the first bucket, that bound is returned. One deviation: for
    a rank on the lower edge of an empty first bucket (``q = 0``) Prometheus computes
    0/0 = NaN; this returns the bucket's lower bound, 0.

    Raises:
        ValueError: ``q`` outside 0..1 (Prometheus would return -Inf/+Inf), no finite
            bound, bounds not strictly increasing or not finite, counts of the wrong length,
            negative or not finite.
    """
    if not 0.0 <= q <= 1.0:  # also rejects NaN
        raise ValueError(f"quantile q={q!r} must be within 0..1")
    if not bounds:
        raise ValueError("histogram_quantile needs at least one finite bucket bound")
    if len(cumulative_counts) != len(bounds) + 1:
        raise ValueError(f"{len(cumulative_counts)} cumulative counts for {len(bounds)} "
                         "bounds; expected one per bound plus the +Inf bucket")
    if any(not math.isfinite(b) for b in bounds) or any(
            b >= c for b, c in pairwise(bounds)):
        raise ValueError(f"bucket bounds must be finite and strictly increasing: {bounds!r}")
    if any(not math.isfinite(c) or c < 0 for c in cumulative_counts):
        raise ValueError(f"cumulative counts must be finite and >= 0: {cumulative_counts!r}")
    counts = monotonic(cumulative_counts)
    total = counts[-1]
    if total == 0:
        return None
    rank = q * total
    # The first finite bucket holding the rank, else the +Inf bucket (Go's sort.Search
    # over all buckets but the last).
    b = next((i for i, c in enumerate(counts[:-1]) if c >= rank), len(bounds))
    if b == len(bounds):
        return float(bounds[-1])
    if b == 0 and bounds[0] <= 0:
        return float(bounds[0])
    start = float(bounds[b - 1]) if b > 0 else 0.0
    end = float(bounds[b])
    count = counts[b]
    if b > 0:
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count == 0:
        return start
    return start + (end - start) * (rank / count)


def psi(expected_counts: Sequence[float], actual_counts: Sequence[float],
        eps: float = PSI_EPS) -> float:
    """Population stability index of ``actual`` against ``expected`` (dimensionless, >= 0).

    ``PSI = sum_i (a_i - e_i) * ln(a_i / e_i)`` over the bins, ``a_i`` and ``e_i`` the
    fraction of each distribution's count in bin ``i``. An empty bin would make a term
    infinite, so each fraction is floored at ``eps`` (the floored fractions are not
    renormalised: with ``eps = 1e-4`` the error is negligible next to the thresholds).
    The index is symmetric in its two arguments and 0 for identical distributions. Rule of
    thumb: below 0.1 no shift, 0.1 to 0.25 a moderate shift, above 0.25 a major one.

    Args:
        expected_counts: per-bin counts (not cumulative) of the reference (stable).
        actual_counts: per-bin counts of the compared distribution (candidate), same bins.
        eps: the floor of a bin's fraction, 0 < eps < 1.

    Raises:
        ValueError: different or zero numbers of bins, a negative or non-finite count, a
            distribution without any count, ``eps`` outside (0, 1).
    """
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps={eps!r} must be within (0, 1)")
    if len(expected_counts) != len(actual_counts) or not expected_counts:
        raise ValueError(f"PSI needs the same non-zero number of bins on both sides, got "
                         f"{len(expected_counts)} and {len(actual_counts)}")
    for what, counts in (("expected", expected_counts), ("actual", actual_counts)):
        if any(not math.isfinite(c) or c < 0 for c in counts):
            raise ValueError(f"{what} counts must be finite and >= 0: {list(counts)!r}")
        if sum(counts) <= 0:
            raise ValueError(f"{what} counts are all 0: PSI needs observations on both sides")
    e_total = float(sum(expected_counts))
    a_total = float(sum(actual_counts))
    value = 0.0
    for e, a in zip(expected_counts, actual_counts, strict=True):
        ef = max(e / e_total, eps)
        af = max(a / a_total, eps)
        value += (af - ef) * math.log(af / ef)
    return value
