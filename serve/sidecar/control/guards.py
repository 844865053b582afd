"""The guards of a canary/shadow rollout: is the ``candidate`` model version as healthy as
``stable``? Pure functions of metric counts: no I/O, no clock.

The TorchServe workers write per-arm series (names and buckets in :mod:`serve.metrics`):
``dlrm_arm_requests_total`` and ``dlrm_arm_errors_total`` (counters), the histograms
``dlrm_arm_request_duration_seconds`` (seconds per request) and ``dlrm_arm_score`` (one
observation per predicted probability), all with labels ``arm`` and ``version``, and in
shadow mode ``dlrm_shadow_score_diff`` (candidate minus stable score on the same instance,
label ``version``). The sidecar reads them summed over workers
(``serve.metrics.HandlerAggregateCollector(dir).collect()``) and:

1. :func:`snapshot` picks the two arms' series out of those families: a :class:`Snapshot`
   of cumulative counts since the workers started;
2. :meth:`Snapshot.minus` gives the counts of a window, since a base snapshot taken when
   the rollout (or its current step) began;
3. :func:`evaluate` judges the window against :class:`GuardLimits`, one
   :class:`GuardResult` per guard of :data:`~serve.metrics.ROLLOUT_GUARDS`:

``error_ratio``
    candidate errors / candidate requests (0..1).
``p99_ratio``
    candidate p99 latency / stable p99 latency, each p99 from the histogram's buckets as
    Prometheus' ``histogram_quantile`` computes it (:func:`histogram_quantile`).
``score_psi``
    population stability index of the candidate's score distribution against the
    stable's, over the fixed bins :data:`~serve.metrics.SCORE_BUCKETS` (:func:`psi`).

A guard is ``breached`` when its value is strictly greater than its threshold, and
``insufficient_data`` (value ``None``) until the window holds enough requests or scored
instances to judge it: a handful of requests says nothing about a p99 or an error ratio.

Example::

    base = snapshot(collector.collect(), stable_version="v1", candidate_version="v2")
    ...  # later
    now = snapshot(collector.collect(), stable_version="v1", candidate_version="v2")
    results = evaluate(now.minus(base), GuardLimits(max_p99_ratio=1.5))
    if breaches(results):
        ...  # roll back
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from prometheus_client.metrics_core import Metric

from serve.common.validate import int_at_least, nonneg_number, positive_int
from serve.constants import (
    GUARD_MAX_ERROR_RATIO,
    GUARD_MAX_P99_RATIO,
    GUARD_MAX_SCORE_PSI,
    GUARD_MIN_INSTANCES,
    GUARD_MIN_REQUESTS,
)
from serve.metrics import (
    ARM_ERRORS_TOTAL,
    ARM_REQUEST_DURATION_SECONDS,
    ARM_REQUESTS_TOTAL,
    ARM_SCORE,
    REQUEST_DURATION_BUCKETS,
    ROLLOUT_GUARDS,
    SCORE_BUCKETS,
    SCORE_DIFF_BUCKETS,
    SHADOW_SCORE_DIFF,
)

__all__ = [
    "GUARD_STATUSES",
    "P99",
    "PSI_EPS",
    "ArmCounts",
    "GuardLimits",
    "GuardResult",
    "Snapshot",
    "breaches",
    "evaluate",
    "histogram_quantile",
    "psi",
    "snapshot",
]

#: Outcomes of a guard: ``ok``, ``breached`` (value > threshold), ``insufficient_data``.
GUARD_STATUSES: tuple[str, ...] = ("ok", "breached", "insufficient_data")
#: Floor of each bin's fraction in :func:`psi`, so that an empty bin gives a finite term.
PSI_EPS = 1e-4
#: The quantile judged by the ``p99_ratio`` guard.
P99 = 0.99

_LATENCY_LEN = len(REQUEST_DURATION_BUCKETS) + 1  # + the +Inf bucket
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


def _monotonic(cumulative: Sequence[float]) -> list[float]:
    # Prometheus' ensureMonotonic: a cumulative count lower than the one before it (buckets
    # of a window across a worker restart, a scrape racing a write) is raised to it.
    out: list[float] = []
    top = 0.0
    for c in cumulative:
        top = max(top, float(c))
        out.append(top)
    return out


def _bins(cumulative: Sequence[int]) -> tuple[int, ...]:
    """Per-bin counts from cumulative ``le`` counts (made monotonic first, so >= 0)."""
    mono = _monotonic(cumulative)
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
    """

    requests: int = 0
    errors: int = 0
    latency_buckets: tuple[int, ...] = field(default=_zeros(_LATENCY_LEN))
    latency_sum: float = 0.0
    score_buckets: tuple[int, ...] = field(default=_zeros(_SCORE_LEN))
    score_count: int = 0
    score_sum: float = 0.0

    def __post_init__(self) -> None:
        int_at_least("requests", self.requests, 0, then=" (a count)", error=ValueError)
        int_at_least("errors", self.errors, 0, then=" (a count)", error=ValueError)
        int_at_least("score_count", self.score_count, 0, then=" (a count)", error=ValueError)
        _check_counts("latency_buckets", self.latency_buckets, _LATENCY_LEN)
        _check_counts("score_buckets", self.score_buckets, _SCORE_LEN)
        _check_sum("latency_sum", self.latency_sum)
        _check_sum("score_sum", self.score_sum)

    @property
    def latency_count(self) -> int:
        """Requests in the latency histogram (its ``+Inf`` bucket)."""
        return self.latency_buckets[-1]

    @property
    def score_bins(self) -> tuple[int, ...]:
        """Instances per score bin (non-cumulative), the bins of :data:`SCORE_BUCKETS`
        as upper edges plus ``(1.0, +Inf)``."""
        return _bins(self.score_buckets)

    def p99_seconds(self) -> float | None:
        """The p99 request latency in seconds (:func:`histogram_quantile`), ``None``
        without observations."""
        return histogram_quantile(P99, REQUEST_DURATION_BUCKETS, self.latency_buckets)

    def minus(self, base: ArmCounts) -> ArmCounts:
        """The counts since ``base``, clamped at 0 per field (see :meth:`Snapshot.minus`)."""
        latency_reset = self.latency_count < base.latency_count
        score_reset = self.score_count < base.score_count
        return ArmCounts(
            requests=max(0, self.requests - base.requests),
            errors=max(0, self.errors - base.errors),
            latency_buckets=_minus_counts(self.latency_buckets, base.latency_buckets),
            latency_sum=0.0 if latency_reset else max(0.0, self.latency_sum - base.latency_sum),
            score_buckets=_minus_counts(self.score_buckets, base.score_buckets),
            score_count=max(0, self.score_count - base.score_count),
            score_sum=0.0 if score_reset else max(0.0, self.score_sum - base.score_sum),
        )

    def decreased_since(self, base: ArmCounts) -> bool:
        """True when any count is lower than in ``base`` (the counters were reset)."""
        pairs = [(self.requests, base.requests), (self.errors, base.errors),
                 (self.score_count, base.score_count),
                 *zip(self.latency_buckets, base.latency_buckets, strict=True),
                 *zip(self.score_buckets, base.score_buckets, strict=True)]
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
        (:func:`histogram_quantile`, :func:`psi` via :attr:`ArmCounts.score_bins`) make
        them monotonic as Prometheus does. A histogram's sum moves with its count: when
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
                   "REQUEST_DURATION_BUCKETS"), (ARM_SCORE, SCORE_BUCKETS, "SCORE_BUCKETS"))
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
    counts = _monotonic(cumulative_counts)
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


# --- the guards -------------------------------------------------------------------------

@dataclass(frozen=True)
class GuardLimits:
    """Thresholds of the rollout guards (the defaults; a rollout spec may override them).

    Attributes:
        max_error_ratio: highest acceptable candidate errors / candidate requests (0..1).
        max_p99_ratio: highest acceptable candidate p99 latency / stable p99 latency
            (dimensionless; 2.0 = the candidate may be twice as slow at the tail).
        max_score_psi: highest acceptable PSI of the candidate's score distribution against
            the stable's (dimensionless; < 0.1 no shift, 0.1-0.25 moderate, > 0.25 major).
        min_requests: requests the candidate (and, for ``p99_ratio``, the stable's latency
            histogram) needs in the window before ``error_ratio`` and ``p99_ratio`` are
            judged.
        min_instances: scored instances each arm needs in the window before ``score_psi``
            is judged.

    A guard is breached when its value is strictly greater than its threshold.

    Raises:
        ValueError: a ratio limit that is negative or not finite, ``max_error_ratio`` above
            1, ``max_p99_ratio`` not > 0, a minimum that is not an integer >= 1.
    """

    max_error_ratio: float = GUARD_MAX_ERROR_RATIO  # defaults: serve.constants, as the
    max_p99_ratio: float = GUARD_MAX_P99_RATIO      # declared state's (serve.state.Guards)
    max_score_psi: float = GUARD_MAX_SCORE_PSI
    min_requests: int = GUARD_MIN_REQUESTS
    min_instances: int = GUARD_MIN_INSTANCES

    def __post_init__(self) -> None:
        for name in ("max_error_ratio", "max_p99_ratio", "max_score_psi"):
            nonneg_number(name, getattr(self, name), error=ValueError)
        if self.max_error_ratio > 1:
            raise ValueError(f"max_error_ratio={self.max_error_ratio!r} is a ratio: 0..1")
        if self.max_p99_ratio <= 0:
            raise ValueError(f"max_p99_ratio={self.max_p99_ratio!r} must be > 0")
        for name in ("min_requests", "min_instances"):
            positive_int(name, getattr(self, name), error=ValueError)


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


def _error_ratio(w: Snapshot, limits: GuardLimits) -> GuardResult:
    name, limit, c = "error_ratio", limits.max_error_ratio, w.candidate
    if c.requests < limits.min_requests:
        return _insufficient(name, limit, f"candidate has {c.requests} of the "
                             f"{limits.min_requests} requests needed")
    return _judged(name, c.errors / c.requests, limit,
                   f"candidate {c.errors} errors of {c.requests} requests")


def _p99_ratio(w: Snapshot, limits: GuardLimits) -> GuardResult:
    name, limit = "p99_ratio", limits.max_p99_ratio
    c, s = w.candidate, w.stable
    if c.requests < limits.min_requests:
        return _insufficient(name, limit, f"candidate has {c.requests} of the "
                             f"{limits.min_requests} requests needed")
    if s.latency_count < limits.min_requests:
        return _insufficient(name, limit, f"stable has {s.latency_count} of the "
                             f"{limits.min_requests} timed requests needed for its p99")
    c_p99, s_p99 = c.p99_seconds(), s.p99_seconds()
    if c_p99 is None:
        return _insufficient(name, limit, "candidate p99 is undefined: no timed requests")
    if s_p99 is None or s_p99 <= 0:
        return _insufficient(name, limit, "stable p99 is undefined or 0 s: no ratio to it")
    return _judged(name, c_p99 / s_p99, limit,
                   f"candidate p99 {_g(c_p99)} s / stable p99 {_g(s_p99)} s")


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

    * ``error_ratio`` = candidate errors / candidate requests; judged from
      ``min_requests`` candidate requests.
    * ``p99_ratio`` = candidate p99 / stable p99 latency (:func:`histogram_quantile` over
      :data:`~serve.metrics.REQUEST_DURATION_BUCKETS`); judged from ``min_requests``
      candidate requests and as many timed stable requests, and only when the stable
      p99 is > 0.
    * ``score_psi`` = :func:`psi` of the candidate's score bins against the stable's
      (:attr:`ArmCounts.score_bins`); judged from ``min_instances`` scored instances per
      arm.

    Each is ``breached`` when its value is strictly greater than its threshold. Pass
    ``GuardLimits()`` for the defaults.
    """
    return [_error_ratio(window, limits), _p99_ratio(window, limits),
            _score_psi(window, limits)]


def breaches(results: Iterable[GuardResult]) -> list[GuardResult]:
    """The results whose status is ``breached``, in their order."""
    return [r for r in results if r.status == "breached"]
