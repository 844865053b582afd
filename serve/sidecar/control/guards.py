"""The guards of a canary/shadow rollout: is the ``candidate`` model version as healthy as
``stable``? Pure functions of metric counts: no I/O, no clock.

The TorchServe workers write per-arm series (names and buckets in :mod:`serve.metrics`):
``dlrm_arm_requests_total`` and ``dlrm_arm_errors_total`` (counters), the histograms
``dlrm_arm_request_duration_seconds`` (seconds per request),
``dlrm_arm_forward_seconds_per_instance`` (one observation per forward: its seconds / its
instances) and ``dlrm_arm_score`` (one observation per predicted probability), all with
labels ``arm`` and ``version``, and in
shadow mode ``dlrm_shadow_score_diff`` (candidate minus stable score on the same instance,
label ``version``). The sidecar reads them summed over workers
(``serve.metrics.aggregate.HandlerAggregateCollector(dir).collect()``) and:

1. :func:`snapshot` picks the two arms' series out of those families: a :class:`Snapshot`
   of cumulative counts since the workers started;
2. :meth:`Snapshot.minus` gives the counts of a window, since a base snapshot taken when
   the rollout (or its current step) began;
3. :func:`evaluate` judges the window against :class:`GuardLimits`, one
   :class:`GuardResult` per guard of :data:`~serve.metrics.ROLLOUT_GUARDS`:

``error_ratio``
    the Wilson lower confidence bound (one-sided, ``GuardLimits.confidence``, 99% by
    default) of the candidate's error probability, from candidate errors / candidate
    requests (0..1, :func:`wilson_lower`). 1 error in 100 requests reads 0.0014, not 0.01:
    the guard breaches when the data say the candidate's error rate is above the limit,
    not when one unlucky window shows it.
``latency_ratio``
    how much slower the candidate's model is than the stable's, judged on what the
    candidate controls: forward seconds per instance (no decode, no queueing, no
    request size), one observation per forward. The value is the lower confidence bound
    (one-sided, ``confidence``) of the ratio candidate / stable from
    :func:`ratio_bounds`: the Hodges-Lehmann estimate of a scale shift (the median of
    ``log(candidate) - log(stable)`` over all pairs of one candidate and one stable
    forward, exponentiated) with its distribution-free Mann-Whitney (Moses) interval: the
    order statistics of those pairwise differences at ranks
    ``n*m/2 -+ z * sqrt(n*m*(n+m+1)/12)`` (the normal approximation of the U statistic,
    ``n``, ``m`` the two arms' forwards, ``z`` the normal quantile of ``confidence``).
    The histograms hold bucket counts, not values: each bucket's count is spread evenly
    in log space over it (:data:`RATIO_POINTS_PER_BUCKET` points; the first bucket spans
    one bucket ratio below its bound, ``+Inf`` one above the last), and the variance is
    that of U without ties (the times are continuous; the buckets tie them only in the
    record), the wider, conservative choice. Rank-based, so a few slow first forwards (a
    cold candidate) move it little; a candidate whose every forward is 1.5x slower moves
    it by 1.5x. A point estimate above the limit is not enough: only a lower bound above
    it breaches.
``score_psi``
    population stability index of the candidate's score distribution against the
    stable's, over the fixed bins :data:`~serve.metrics.SCORE_BUCKETS`
    (:func:`~serve.common.histograms.psi`).

A guard is ``breached`` when its value is strictly greater than its threshold, and
``insufficient_data`` (value ``None``) until the window holds enough requests, forwards or
scored instances to judge it. One breach is a verdict over one window, not a rollback: the
controller (:mod:`serve.sidecar.control.rollout`) rolls back when a guard breaches on
``failure_limit`` consecutive evaluations (``error_ratio``: at once).

Caveats of ``latency_ratio``: per-instance time falls with the forward's size (a fixed
cost per forward is spread over its instances), and a canary's candidate gets smaller
merged forwards than the stable (fewer requests per batch), so an equal model may read
somewhat slower (measured negligible at ranking sizes: ``small`` s7 beside s0 in a 0.2
canary of 100-700-instance requests read 1.00, lower bound 0.95). And the second forward
of a batch runs warm (0.85-0.88x per instance, whichever model): the worker alternates
which arm runs first (``serve.worker.arms.Split.candidate_first``). ``max_latency_ratio``
(1.3 by default) leaves room for what remains.

Example::

    base = snapshot(collector.collect(), stable_version="v1", candidate_version="v2")
    ...  # later
    now = snapshot(collector.collect(), stable_version="v1", candidate_version="v2")
    results = evaluate(now.minus(base), GuardLimits(max_latency_ratio=1.5))
    if breaches(results):
        ...  # roll back
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from statistics import NormalDist
from typing import Any

import numpy as np
from prometheus_client.metrics_core import Metric
from pydantic import Field

from serve.common.histograms import histogram_quantile, monotonic, psi
from serve.common.validate import int_at_least, positive_int
from serve.constants import GUARD_CONFIDENCE
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
from serve.state import Guards

__all__ = [
    "GUARD_STATUSES",
    "P99",
    "RATIO_POINTS_PER_BUCKET",
    "ArmCounts",
    "GuardLimits",
    "GuardResult",
    "RatioBounds",
    "Snapshot",
    "breaches",
    "evaluate",
    "ratio_bounds",
    "snapshot",
    "wilson_lower",
]

#: Outcomes of a guard: ``ok``, ``breached`` (value > threshold), ``insufficient_data``.
GUARD_STATUSES: tuple[str, ...] = ("ok", "breached", "insufficient_data")
#: The quantile of :meth:`ArmCounts.p99_seconds` (request latency; no guard judges it).
P99 = 0.99
#: Points each bucket's count is spread over (evenly in log space) by
#: :func:`ratio_bounds`: 4 resolve a ratio to ~1.06 with buckets ~1.26 apart.
RATIO_POINTS_PER_BUCKET = 4

_LATENCY_LEN = len(REQUEST_DURATION_BUCKETS) + 1  # + the +Inf bucket
_FORWARD_LEN = len(ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS) + 1
_SCORE_LEN = len(SCORE_BUCKETS) + 1
_DIFF_LEN = len(SCORE_DIFF_BUCKETS) + 1


def _zeros(n: int) -> tuple[int, ...]:
    return (0,) * n


def _check_counts(what: str, counts: Sequence[int], length: int) -> None:
    if len(counts) != length:
        raise ValueError(f"{what} has {len(counts)} buckets; expected {length} "
                         f"(the configured buckets plus +Inf)")
    for i, c in enumerate(counts):
        int_at_least(f"{what}[{i}]", c, 0, then=" (a count)", error=ValueError)


def _check_sum(what: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")


def _bins(cumulative: Sequence[int]) -> tuple[int, ...]:
    """Per-bin counts from cumulative ``le`` counts (made monotonic first, so >= 0)."""
    mono = monotonic(cumulative)
    return tuple(int(c - p) for c, p in zip(mono, [0.0, *mono[:-1]], strict=True))


@dataclass(frozen=True)
class ArmCounts:
    """The counts of one arm (one model version), cumulative or over a window.

    Attributes:
        requests: requests answered (in shadow mode: scored) by the arm.
        errors: of those, the ones whose forward failed.
        latency_buckets: cumulative request counts per ``le``, aligned to
            :data:`~serve.metrics.REQUEST_DURATION_BUCKETS` (seconds) plus ``+Inf``.
        latency_sum: total handler time of those requests, in seconds.
        score_buckets: cumulative counts of predicted probabilities per ``le``, aligned
            to :data:`~serve.metrics.SCORE_BUCKETS` plus ``+Inf``.
        score_count: predicted probabilities (instances) scored.
        score_sum: their sum (so ``score_sum / score_count`` is the mean predicted CTR).
        forward_buckets: cumulative counts of forwards per ``le`` of their seconds per
            instance, aligned to
            :data:`~serve.metrics.ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS` plus ``+Inf``
            (zeros from workers that predate the series).
        forward_sum: the sum of those seconds per instance.
    """

    requests: int = 0
    errors: int = 0
    latency_buckets: tuple[int, ...] = field(default=_zeros(_LATENCY_LEN))
    latency_sum: float = 0.0
    score_buckets: tuple[int, ...] = field(default=_zeros(_SCORE_LEN))
    score_count: int = 0
    score_sum: float = 0.0
    forward_buckets: tuple[int, ...] = field(default=_zeros(_FORWARD_LEN))
    forward_sum: float = 0.0

    def __post_init__(self) -> None:
        int_at_least("requests", self.requests, 0, then=" (a count)", error=ValueError)
        int_at_least("errors", self.errors, 0, then=" (a count)", error=ValueError)
        int_at_least("score_count", self.score_count, 0, then=" (a count)", error=ValueError)
        _check_counts("latency_buckets", self.latency_buckets, _LATENCY_LEN)
        _check_counts("score_buckets", self.score_buckets, _SCORE_LEN)
        _check_counts("forward_buckets", self.forward_buckets, _FORWARD_LEN)
        _check_sum("latency_sum", self.latency_sum)
        _check_sum("score_sum", self.score_sum)
        _check_sum("forward_sum", self.forward_sum)

    @property
    def latency_count(self) -> int:
        """Requests in the latency histogram (its ``+Inf`` bucket)."""
        return self.latency_buckets[-1]

    @property
    def forward_count(self) -> int:
        """Forwards timed per instance (the ``+Inf`` bucket)."""
        return self.forward_buckets[-1]

    @property
    def forward_bins(self) -> tuple[int, ...]:
        """Forwards per seconds-per-instance bin (non-cumulative)."""
        return _bins(self.forward_buckets)

    @property
    def score_bins(self) -> tuple[int, ...]:
        """Instances per score bin (non-cumulative), the bins of :data:`SCORE_BUCKETS`
        as upper edges plus ``(1.0, +Inf)``."""
        return _bins(self.score_buckets)

    def p99_seconds(self) -> float | None:
        """The p99 request latency in seconds
        (:func:`~serve.common.histograms.histogram_quantile`), ``None`` without
        observations."""
        return histogram_quantile(P99, REQUEST_DURATION_BUCKETS, self.latency_buckets)

    def minus(self, base: ArmCounts) -> ArmCounts:
        """The counts since ``base``, clamped at 0 per field (see :meth:`Snapshot.minus`)."""
        latency_reset = self.latency_count < base.latency_count
        score_reset = self.score_count < base.score_count
        forward_reset = self.forward_count < base.forward_count
        return ArmCounts(
            requests=max(0, self.requests - base.requests),
            errors=max(0, self.errors - base.errors),
            latency_buckets=_minus_counts(self.latency_buckets, base.latency_buckets),
            latency_sum=0.0 if latency_reset else max(0.0, self.latency_sum - base.latency_sum),
            score_buckets=_minus_counts(self.score_buckets, base.score_buckets),
            score_count=max(0, self.score_count - base.score_count),
            score_sum=0.0 if score_reset else max(0.0, self.score_sum - base.score_sum),
            forward_buckets=_minus_counts(self.forward_buckets, base.forward_buckets),
            forward_sum=(0.0 if forward_reset
                         else max(0.0, self.forward_sum - base.forward_sum)),
        )

    def decreased_since(self, base: ArmCounts) -> bool:
        """True when any count is lower than in ``base`` (the counters were reset)."""
        pairs = [(self.requests, base.requests), (self.errors, base.errors),
                 (self.score_count, base.score_count),
                 *zip(self.latency_buckets, base.latency_buckets, strict=True),
                 *zip(self.score_buckets, base.score_buckets, strict=True),
                 *zip(self.forward_buckets, base.forward_buckets, strict=True)]
        return any(now < then for now, then in pairs)


def _minus_counts(now: tuple[int, ...], base: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(max(0, n - b) for n, b in zip(now, base, strict=True))


@dataclass(frozen=True)
class Snapshot:
    """Both arms' counts, plus the shadow score difference, at one moment or over a window.

    Attributes:
        stable, candidate: the arms' counts.
        diff_buckets: cumulative counts of ``candidate - stable`` score per ``le``,
            aligned to :data:`~serve.metrics.SCORE_DIFF_BUCKETS` plus ``+Inf`` (shadow
            mode only; zeros otherwise).
        diff_count: instances scored by both arms (shadow mode).
        diff_sum: sum of their ``candidate - stable`` differences (may be negative). The
            mean *absolute* difference cannot be derived from a sum; the buckets bound it.
            0 when the families lack the ``_sum`` sample: prometheus_client's in-process
            exposition omits it for a histogram with negative buckets, the multiprocess
            collector (what the sidecar reads) keeps it.
        stable_version, candidate_version: the model versions the counts were picked for
            ("" when built by hand); :meth:`minus` refuses snapshots of other versions.
    """

    stable: ArmCounts = field(default_factory=ArmCounts)
    candidate: ArmCounts = field(default_factory=ArmCounts)
    diff_buckets: tuple[int, ...] = field(default=_zeros(_DIFF_LEN))
    diff_count: int = 0
    diff_sum: float = 0.0
    stable_version: str = ""
    candidate_version: str = ""

    def __post_init__(self) -> None:
        _check_counts("diff_buckets", self.diff_buckets, _DIFF_LEN)
        int_at_least("diff_count", self.diff_count, 0, then=" (a count)", error=ValueError)
        _check_sum("diff_sum", self.diff_sum)

    @property
    def mean_score_diff(self) -> float | None:
        """Mean ``candidate - stable`` score over the shadow-scored instances (probability
        units), ``None`` without any."""
        return self.diff_sum / self.diff_count if self.diff_count else None

    def minus(self, base: Snapshot) -> Snapshot:
        """The counts of the window since ``base`` (taken earlier, same versions).

        Every count is ``self - base`` clamped at 0 per field (each request, error and
        bucket count on its own). A count goes down only when the counters were reset (the
        workers' multiprocess directory was emptied, TorchServe restarted): clamping keeps
        the window free of negative counts, but such a window under-counts, so a caller
        seeing :meth:`decreased_since` should take the new snapshot as its base. After
        clamping, a histogram's cumulative buckets may be non-monotonic; the consumers
        (:mod:`serve.common.histograms`' quantile, and PSI via :attr:`ArmCounts.score_bins`)
        make them monotonic as Prometheus does. A histogram's sum moves with its count: when
        the count went down the window's sum is 0, otherwise ``self - base`` (clamped at 0
        for latencies and scores, which are never negative; a score difference may be).

        Raises:
            ValueError: when ``base`` was taken for other versions.
        """
        if (self.stable_version, self.candidate_version) != (
                base.stable_version, base.candidate_version):
            raise ValueError(
                f"cannot subtract a snapshot of stable={base.stable_version!r} "
                f"candidate={base.candidate_version!r} from one of "
                f"stable={self.stable_version!r} candidate={self.candidate_version!r}; "
                "take a new base snapshot when the versions change")
        diff_reset = self.diff_count < base.diff_count
        return Snapshot(
            stable=self.stable.minus(base.stable),
            candidate=self.candidate.minus(base.candidate),
            diff_buckets=_minus_counts(self.diff_buckets, base.diff_buckets),
            diff_count=max(0, self.diff_count - base.diff_count),
            diff_sum=0.0 if diff_reset else self.diff_sum - base.diff_sum,
            stable_version=self.stable_version,
            candidate_version=self.candidate_version,
        )

    def decreased_since(self, base: Snapshot) -> bool:
        """True when any count is lower than in ``base``: the counters were reset since,
        and a window from ``base`` would under-count (re-base instead)."""
        return (self.stable.decreased_since(base.stable)
                or self.candidate.decreased_since(base.candidate)
                or self.diff_count < base.diff_count
                or any(n < b for n, b in zip(self.diff_buckets, base.diff_buckets,
                                             strict=True)))


# --- parsing the families ---------------------------------------------------------------

class _Hist:
    """Accumulates one histogram series: buckets matched by the float value of ``le``."""

    def __init__(self, name: str, bounds: tuple[float, ...], bounds_name: str) -> None:
        self.name = name
        self.bounds_name = bounds_name
        self.index = {b: i for i, b in enumerate(bounds)}
        self.index[math.inf] = len(bounds)
        self.buckets = [0.0] * (len(bounds) + 1)
        self.count = 0.0
        self.sum = 0.0

    def add_bucket(self, le: str | None, value: float) -> None:
        if le is None:
            raise ValueError(f"{self.name}_bucket sample without an 'le' label")
        try:
            bound = float(le)
        except ValueError:
            raise ValueError(f"{self.name}_bucket has le={le!r}, not a number") from None
        i = self.index.get(bound)
        if i is None:
            raise ValueError(
                f"{self.name}_bucket has le={le!r}, not one of the configured "
                f"{self.bounds_name}: the workers and the sidecar disagree on the buckets")
        self.buckets[i] += value


def _as_count(what: str, value: float) -> int:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} is {value!r}; a count must be finite and >= 0")
    return round(value)


def snapshot(families: Iterable[Metric], *, stable_version: str,
             candidate_version: str) -> Snapshot:
    """The two arms' cumulative counts out of the workers' metric families.

    Args:
        families: ``prometheus_client`` metric families, e.g.
            ``HandlerAggregateCollector(dir).collect()`` or ``registry.collect()``. Samples
            are recognised by their sample name (``dlrm_arm_requests_total``,
            ``dlrm_arm_score_bucket``, ...), so any family naming works; ``_created``
            samples and other metrics are ignored.
        stable_version: the model version of the ``stable`` arm: samples with
            ``arm="stable", version=stable_version`` count.
        candidate_version: likewise for ``arm="candidate"``; the shadow score difference
            is the series with ``version=candidate_version``.

    Samples of the same arm and version that differ in other labels are summed. A series
    or sample that is absent (no request yet) counts as zeros. Bucket ``le`` labels ("0.005",
    "+Inf") are matched to the configured buckets by float value.

    Raises:
        ValueError: a version is empty; a selected count is negative or not finite; a
            selected bucket's ``le`` is not one of the configured buckets.
    """
    for what, version in (("stable_version", stable_version),
                          ("candidate_version", candidate_version)):
        if not isinstance(version, str) or not version:
            raise ValueError(f"{what} must be a non-empty model version, got {version!r}")
    wanted = {"stable": stable_version, "candidate": candidate_version}
    counters: dict[tuple[str, str], float] = {}
    hists: dict[tuple[str, str], _Hist] = {}
    diff = _Hist(SHADOW_SCORE_DIFF, SCORE_DIFF_BUCKETS, "SCORE_DIFF_BUCKETS")
    histograms = ((ARM_REQUEST_DURATION_SECONDS, REQUEST_DURATION_BUCKETS,
                   "REQUEST_DURATION_BUCKETS"), (ARM_SCORE, SCORE_BUCKETS, "SCORE_BUCKETS"),
                  (ARM_FORWARD_SECONDS_PER_INSTANCE, ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS,
                   "ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS"))
    for arm in wanted:
        for name, bounds, bounds_name in histograms:
            hists[(name, arm)] = _Hist(name, bounds, bounds_name)
    hist_of = {name + suffix: (name, suffix)
               for name, _, _ in histograms for suffix in ("_bucket", "_count", "_sum")}
    diff_of = {SHADOW_SCORE_DIFF + s: s for s in ("_bucket", "_count", "_sum")}

    for family in families:
        for s in family.samples:
            labels = s.labels
            if s.name in diff_of:
                if labels.get("version") != candidate_version:
                    continue
                _add(diff, diff_of[s.name], labels.get("le"), s.value)
                continue
            label = labels.get("arm")
            if label is None or label not in wanted or labels.get("version") != wanted[label]:
                continue
            if s.name in (ARM_REQUESTS_TOTAL, ARM_ERRORS_TOTAL):
                counters[(s.name, label)] = counters.get((s.name, label), 0.0) + s.value
            elif s.name in hist_of:
                name, suffix = hist_of[s.name]
                _add(hists[(name, label)], suffix, labels.get("le"), s.value)

    where = f"version {candidate_version!r}"
    return Snapshot(
        stable=_arm_counts("stable", wanted["stable"], counters, hists),
        candidate=_arm_counts("candidate", wanted["candidate"], counters, hists),
        diff_buckets=tuple(_as_count(f"{SHADOW_SCORE_DIFF}_bucket of {where}", v)
                           for v in diff.buckets),
        diff_count=_as_count(f"{SHADOW_SCORE_DIFF}_count of {where}", diff.count),
        diff_sum=_finite(f"{SHADOW_SCORE_DIFF}_sum of {where}", diff.sum),
        stable_version=stable_version,
        candidate_version=candidate_version,
    )


def _arm_counts(arm: str, version: str, counters: dict[tuple[str, str], float],
                hists: dict[tuple[str, str], _Hist]) -> ArmCounts:
    """One arm's counts out of what :func:`snapshot` summed (checked: finite, >= 0)."""
    latency = hists[(ARM_REQUEST_DURATION_SECONDS, arm)]
    score = hists[(ARM_SCORE, arm)]
    forward = hists[(ARM_FORWARD_SECONDS_PER_INSTANCE, arm)]
    where = f"{arm} (version {version!r})"
    return ArmCounts(
        requests=_as_count(f"{ARM_REQUESTS_TOTAL} of {where}",
                           counters.get((ARM_REQUESTS_TOTAL, arm), 0.0)),
        errors=_as_count(f"{ARM_ERRORS_TOTAL} of {where}",
                         counters.get((ARM_ERRORS_TOTAL, arm), 0.0)),
        latency_buckets=tuple(_as_count(f"{ARM_REQUEST_DURATION_SECONDS}_bucket of {where}",
                                        v) for v in latency.buckets),
        latency_sum=_finite(f"{ARM_REQUEST_DURATION_SECONDS}_sum of {where}", latency.sum),
        score_buckets=tuple(_as_count(f"{ARM_SCORE}_bucket of {where}", v)
                            for v in score.buckets),
        score_count=_as_count(f"{ARM_SCORE}_count of {where}", score.count),
        score_sum=_finite(f"{ARM_SCORE}_sum of {where}", score.sum),
        forward_buckets=tuple(_as_count(f"{ARM_FORWARD_SECONDS_PER_INSTANCE}_bucket of "
                                        f"{where}", v) for v in forward.buckets),
        forward_sum=_finite(f"{ARM_FORWARD_SECONDS_PER_INSTANCE}_sum of {where}",
                            forward.sum),
    )


def _add(hist: _Hist, suffix: str, le: str | None, value: float) -> None:
    if suffix == "_bucket":
        hist.add_bucket(le, value)
    elif suffix == "_count":
        hist.count += value
    else:
        hist.sum += value


def _finite(what: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}; it must be finite")
    return float(value)


# --- the statistics ---------------------------------------------------------------------

def _z(confidence: float) -> float:
    if not 0.5 <= confidence < 1.0:  # also rejects NaN
        raise ValueError(f"confidence={confidence!r} must be within [0.5, 1) (one-sided; "
                         "0.99 = wrong 1 time in 100)")
    return NormalDist().inv_cdf(confidence)


def wilson_lower(successes: int, trials: int, confidence: float) -> float:
    """The Wilson score lower confidence bound (one-sided) of a probability, 0..1.

    ``(p + z^2/2n - z * sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)`` with ``p = k/n`` and
    ``z`` the standard normal quantile of ``confidence``. Unlike ``p - z*se`` it stays
    within 0..1 and behaves at ``k = 0`` (0) and small ``n``. Example: 1 error in 100
    requests at 99% gives 0.0014; 50 in 100 gives 0.39.

    Raises:
        ValueError: ``trials`` < 1, ``successes`` outside 0..trials, ``confidence``
            outside [0.5, 1).
    """
    positive_int("trials", trials, error=ValueError)
    int_at_least("successes", successes, 0, then=" (a count)", error=ValueError)
    if successes > trials:
        raise ValueError(f"successes={successes} must be <= trials={trials}")
    z = _z(confidence)
    n, p = float(trials), successes / trials
    z2 = z * z
    centre = p + z2 / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - margin) / (1 + z2 / n))


@dataclass(frozen=True)
class RatioBounds:
    """How many times larger one arm's observations are than another's (dimensionless).

    Attributes:
        estimate: the Hodges-Lehmann ratio (median pairwise ratio).
        lower: its one-sided lower confidence bound (0 when the samples are too small for
            any bound: the rank falls below the first pair).
        reference, compared: observations on each side (n and m).
    """

    estimate: float
    lower: float
    reference: int
    compared: int


def _log_points(bounds: Sequence[float], bins: Sequence[int],
                per_bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Each non-empty bin's count spread evenly in log space over the bin: (points,
    weights). The first bin (0, b0] spans [b0 / r, b0], the +Inf bin [b_last, b_last * r],
    r the ratio of the neighbouring bounds."""
    logs = np.log(np.asarray(bounds, dtype=np.float64))
    edges = np.concatenate(([2 * logs[0] - logs[1]], logs, [2 * logs[-1] - logs[-2]]))
    counts = np.asarray(bins, dtype=np.float64)
    nz = np.nonzero(counts)[0]
    frac = (np.arange(per_bucket) + 0.5) / per_bucket
    lo, hi = edges[nz], edges[nz + 1]
    points = (lo[:, None] + (hi - lo)[:, None] * frac[None, :]).ravel()
    weights = np.repeat(counts[nz] / per_bucket, per_bucket)
    return points, weights


def ratio_bounds(bounds: Sequence[float], reference_bins: Sequence[int],
                 compared_bins: Sequence[int], confidence: float,
                 per_bucket: int = RATIO_POINTS_PER_BUCKET) -> RatioBounds:
    """The ratio compared / reference of two histograms of positive values, with its
    one-sided lower confidence bound (see the module docstring, ``latency_ratio``).

    Args:
        bounds: the finite upper bounds of the buckets, > 0, strictly increasing, at least 2.
        reference_bins, compared_bins: per-bin counts (not cumulative), one per bound plus
            the ``+Inf`` bin.
        confidence: of the lower bound, one-sided, in [0.5, 1).
        per_bucket: points each bucket's count is spread over.

    Returns:
        :class:`RatioBounds`: ``exp`` of the Hodges-Lehmann shift of the logs and of its
        lower Moses bound, the weighted quantiles ``1/2`` and
        ``1/2 - z * sqrt((n+m+1) / (12 n m))`` of the pairwise log differences.

    Raises:
        ValueError: bounds not positive/increasing or fewer than 2, counts of the wrong
            length or negative, an empty side, ``confidence`` outside [0.5, 1).
    """
    z = _z(confidence)
    if len(bounds) < 2 or any(b <= 0 or not math.isfinite(b) for b in bounds) or any(
            a >= b for a, b in pairwise(bounds)):
        raise ValueError(f"bounds must be at least 2, finite, > 0 and strictly increasing: "
                         f"{tuple(bounds)!r}")
    for what, bins in (("reference_bins", reference_bins), ("compared_bins", compared_bins)):
        if len(bins) != len(bounds) + 1:
            raise ValueError(f"{what} has {len(bins)} bins; expected {len(bounds) + 1} (one "
                             "per bound plus +Inf)")
        if any(c < 0 for c in bins):
            raise ValueError(f"{what} must be counts >= 0: {list(bins)!r}")
        if sum(bins) <= 0:
            raise ValueError(f"{what} are all 0: a ratio needs observations on both sides")
    positive_int("per_bucket", per_bucket, error=ValueError)
    xs, xw = _log_points(bounds, reference_bins, per_bucket)
    ys, yw = _log_points(bounds, compared_bins, per_bucket)
    diffs = (ys[:, None] - xs[None, :]).ravel()
    weights = (yw[:, None] * xw[None, :]).ravel()
    order = np.argsort(diffs, kind="stable")
    diffs, weights = diffs[order], weights[order]
    total = float(weights.sum())
    # Each pair's rank at the middle of its weight, so a quantile interpolates between pairs.
    mid = (np.cumsum(weights) - weights / 2) / total
    n, m = float(sum(reference_bins)), float(sum(compared_bins))
    q_lo = 0.5 - z * math.sqrt((n + m + 1) / (12 * n * m))
    estimate = float(np.exp(np.interp(0.5, mid, diffs)))
    lower = 0.0 if q_lo <= 0 else float(np.exp(np.interp(q_lo, mid, diffs)))
    return RatioBounds(estimate=estimate, lower=lower, reference=int(n), compared=int(m))


# --- the guards -------------------------------------------------------------------------

class GuardLimits(Guards):
    """What judges the metric guards: the declared guards (:class:`serve.state.Guards`,
    the one declaration of every limit's field, bounds and default; this module reads
    ``max_error_ratio``, ``max_latency_ratio``, ``max_score_psi``, ``min_requests``,
    ``min_forwards`` and ``min_instances``) plus ``confidence``, which no state declares.

    Attributes:
        confidence: of the lower bounds of ``error_ratio`` and ``latency_ratio``
            (one-sided; 0.99: a bound above the truth 1 time in 100).

    A guard is breached when its value is strictly greater than its threshold.

    Raises:
        pydantic.ValidationError (a ValueError naming the field): a limit outside the
            bounds of :class:`serve.state.Guards`, ``confidence`` outside [0.5, 1).
    """

    confidence: float = Field(default=GUARD_CONFIDENCE, ge=0.5, lt=1,
                              description="One-sided confidence of the lower bounds.")


@dataclass(frozen=True)
class GuardResult:
    """One guard judged over a window.

    Attributes:
        name: one of :data:`~serve.metrics.ROLLOUT_GUARDS`.
        value: the guard's value (a ratio or a PSI, dimensionless); ``None`` when the
            window does not hold enough data to judge it.
        threshold: the limit it is judged against (breached when ``value > threshold``).
        status: ``ok``, ``breached`` or ``insufficient_data``.
        detail: one sentence for people, with the numbers behind the value.
        blocking: whether a rollout waits for this guard to be ``ok`` before it promotes
            (a non-blocking guard still rolls back when breached; the click-quality gates
            without ``min_labels`` are non-blocking).
    """

    name: str
    value: float | None
    threshold: float
    status: str
    detail: str
    blocking: bool = True

    def __post_init__(self) -> None:
        if self.name not in ROLLOUT_GUARDS:
            raise ValueError(f"guard {self.name!r} is not one of {ROLLOUT_GUARDS}")
        if self.status not in GUARD_STATUSES:
            raise ValueError(f"guard status {self.status!r} is not one of {GUARD_STATUSES}")
        if (self.value is None) != (self.status == "insufficient_data"):
            raise ValueError(f"guard {self.name}: value {self.value!r} does not fit status "
                             f"{self.status!r} (None exactly when insufficient_data)")

    @property
    def breached(self) -> bool:
        return self.status == "breached"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``name``, ``value`` (null without data), ``threshold``,
        ``status``, ``detail``, ``blocking``."""
        return {"name": self.name, "value": self.value, "threshold": self.threshold,
                "status": self.status, "detail": self.detail, "blocking": self.blocking}


def _g(x: float) -> str:
    return f"{x:.4g}"


def _judged(name: str, value: float, threshold: float, sentence: str) -> GuardResult:
    breached = value > threshold
    op = ">" if breached else "<="
    return GuardResult(name, value, threshold, "breached" if breached else "ok",
                       f"{sentence} = {_g(value)} {op} {_g(threshold)}")


def _insufficient(name: str, threshold: float, detail: str) -> GuardResult:
    return GuardResult(name, None, threshold, "insufficient_data", detail)


def _pct(confidence: float) -> str:
    return f"{confidence * 100:g}%"


def _error_ratio(w: Snapshot, limits: GuardLimits) -> GuardResult:
    name, limit, c = "error_ratio", limits.max_error_ratio, w.candidate
    if c.requests < limits.min_requests:
        return _insufficient(name, limit, f"candidate has {c.requests} of the "
                             f"{limits.min_requests} requests needed")
    errors = min(c.errors, c.requests)  # a window across a reset may count more errors
    lower = wilson_lower(errors, c.requests, limits.confidence)
    return _judged(name, lower, limit,
                   f"candidate {errors} errors of {c.requests} requests "
                   f"({_g(errors / c.requests)}): {_pct(limits.confidence)} lower bound")


def _latency_ratio(w: Snapshot, limits: GuardLimits) -> GuardResult:
    name, limit = "latency_ratio", limits.max_latency_ratio
    c, s = w.candidate, w.stable
    need = limits.min_forwards
    if c.forward_count < need or s.forward_count < need:
        short = [f"{arm} has {n} of the {need} timed forwards needed"
                 for arm, n in (("candidate", c.forward_count), ("stable", s.forward_count))
                 if n < need]
        return _insufficient(name, limit, "; ".join(short))
    r = ratio_bounds(ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS, s.forward_bins,
                     c.forward_bins, limits.confidence)
    means = (f"; mean {_g(c.forward_sum / c.forward_count * 1e6)} vs "
             f"{_g(s.forward_sum / s.forward_count * 1e6)} us per instance")
    return _judged(name, r.lower, limit,
                   f"candidate / stable forward seconds per instance over {r.compared} vs "
                   f"{r.reference} forwards: ratio {_g(r.estimate)}{means}; "
                   f"{_pct(limits.confidence)} lower bound")


def _score_psi(w: Snapshot, limits: GuardLimits) -> GuardResult:
    name, limit = "score_psi", limits.max_score_psi
    c_bins, s_bins = w.candidate.score_bins, w.stable.score_bins
    c_n, s_n = sum(c_bins), sum(s_bins)
    need = limits.min_instances
    if c_n < need or s_n < need:
        short = [f"{arm} has {n} of the {need} scored instances needed"
                 for arm, n in (("candidate", c_n), ("stable", s_n)) if n < need]
        return _insufficient(name, limit, "; ".join(short))
    return _judged(name, psi(s_bins, c_bins), limit,
                   f"score PSI of candidate ({c_n} instances) vs stable ({s_n} instances)")


def evaluate(window: Snapshot, limits: GuardLimits) -> list[GuardResult]:
    """Judge the guards over ``window`` (usually ``now.minus(base)``), one
    :class:`GuardResult` per guard in :data:`~serve.metrics.ROLLOUT_GUARDS` order:

    * ``error_ratio`` = the Wilson lower bound (:func:`wilson_lower`, ``confidence``) of
      candidate errors / candidate requests; judged from ``min_requests`` candidate
      requests.
    * ``latency_ratio`` = the lower bound (``confidence``) of candidate / stable forward
      seconds per instance (:func:`ratio_bounds` over
      :data:`~serve.metrics.ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS`); judged from
      ``min_forwards`` timed forwards per arm.
    * ``score_psi`` = :func:`~serve.common.histograms.psi` of the candidate's score bins against the stable's
      (:attr:`ArmCounts.score_bins`); judged from ``min_instances`` scored instances per
      arm.

    Each is ``breached`` when its value is strictly greater than its threshold. Pass
    ``GuardLimits()`` for the defaults.
    """
    return [_error_ratio(window, limits), _latency_ratio(window, limits),
            _score_psi(window, limits)]


def breaches(results: Iterable[GuardResult]) -> list[GuardResult]:
    """The results whose status is ``breached``, in their order."""
    return [r for r in results if r.status == "breached"]
