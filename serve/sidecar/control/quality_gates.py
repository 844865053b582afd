"""The click-quality gates of a rollout: does the ``candidate`` predict clicks as well as
``stable``? Pure functions of label counts: no I/O, no clock.

The sidecar's feedback join (:mod:`serve.sidecar.services.feedback`) counts, per model
version and arm, every click label it joined with a logged prediction since it started,
as counters (names in :mod:`serve.metrics`): rows ``dlrm_online_rows_total``, clicks
``dlrm_online_clicks_total`` (sum of labels), ``dlrm_online_score_total`` (sum of the
predicted probabilities), ``dlrm_online_logloss_nats_total`` (sum of per-row log losses,
nats) and ``dlrm_online_logloss_sq_nats2_total`` (sum of their squares). They are
additive: the sums of several pods (or of families concatenated from several pods'
``/metrics``) are the sums of the fleet, and :func:`quality_snapshot` adds every sample
with the same labels.

1. :func:`quality_snapshot` picks both arms' sums out of metric families: a
   :class:`QualitySnapshot`;
2. :meth:`QualitySnapshot.minus` gives the labels joined since a base snapshot (the
   rollout's start: labels of predictions made before it do not judge it);
3. :func:`evaluate_quality` judges it against :class:`QualityLimits`, two
   :class:`~serve.sidecar.control.guards.GuardResult` (the last two of
   :data:`~serve.metrics.ROLLOUT_GUARDS`):

``ne_increase``
    ``d = (mean logloss_c - mean logloss_s) / H(pooled CTR)``: the candidate's normalized
    entropy minus the stable's, both normalized by the entropy of the CTR of BOTH arms'
    labels pooled (under a random split the arms see the same population, so one
    denominator removes the noise of two). Its value is the lower end of a one-sided
    confidence interval, ``d - z * SE`` with ``SE = sqrt(var_c / n_c + var_s / n_s) / H``
    (``var`` the variance of one row's log loss, from the sums of log losses and of their
    squares): breached when even that is above ``max_ne_increase``.
``calibration_gap``
    ``|ln cal_c| - |ln cal_s|`` with ``cal = sum(score) / clicks``: how much further from
    calibrated (1) the candidate is than the stable, in log-ratio units. Its value is the
    lower bound ``gap - z * sqrt(1 / clicks_c + 1 / clicks_s)`` (``1 / clicks`` is the
    variance of ``ln(clicks)`` for a Poisson count; that of ``ln(sum(score))`` is much
    smaller and ignored): breached when above ``max_calibration_gap``.

Both are ``insufficient_data`` until each arm has the labels needed: ``min_labels`` when
it is > 0, and then the gates are *blocking* (a rollout does not promote before they
judge ``ok``); with ``min_labels = 0`` they judge from
:data:`~serve.constants.QUALITY_MIN_LABELS_TO_JUDGE` labels per arm but a rollout whose
labels never come is promoted on its other guards (:attr:`GuardResult.blocking` False).

When NOT to use: a CTR of 0 or 1 in the labels (no entropy, no calibration): the gates
stay ``insufficient_data``. The confidence bounds assume independent rows; labels of
the same user or session are correlated, so keep ``min_labels`` in the thousands. In
shadow mode both arms score the same requests: the arms are positively correlated and
the bounds, computed as for independent arms, are conservative.

What the window holds: labels JOINED since the base snapshot. The candidate's are all of
predictions made during the rollout (its version serves nothing else); the stable arm's
series (``arm="stable"``) is the same before and during a rollout, so a late label for a
prediction made just before the rollout began counts for it: the same model, on a
population a little older.

Example::

    base = quality_snapshot(read(), stable_version="v1", candidate_version="v2")
    ...  # labels arrive
    now = quality_snapshot(read(), stable_version="v1", candidate_version="v2")
    results = evaluate_quality(now.minus(base), QualityLimits(min_labels=2000))
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from pydantic import Field

from serve.common.quality import entropy
from serve.common.validate import int_at_least, nonneg_number
from serve.constants import QUALITY_MIN_LABELS_TO_JUDGE, QUALITY_Z
from serve.metrics import (
    ONLINE_CLICKS_TOTAL,
    ONLINE_LOGLOSS_NATS_TOTAL,
    ONLINE_LOGLOSS_SQ_NATS2_TOTAL,
    ONLINE_ROWS_TOTAL,
    ONLINE_SCORE_TOTAL,
)
from serve.sidecar.control.guards import GuardResult
from serve.state import Guards

__all__ = [
    "QualityCounts",
    "QualityLimits",
    "QualitySnapshot",
    "evaluate_quality",
    "quality_snapshot",
]

# sample name -> QualityCounts field
_FIELDS: dict[str, str] = {
    ONLINE_ROWS_TOTAL: "n",
    ONLINE_CLICKS_TOTAL: "clicks",
    ONLINE_SCORE_TOTAL: "score_sum",
    ONLINE_LOGLOSS_NATS_TOTAL: "ll_sum",
    ONLINE_LOGLOSS_SQ_NATS2_TOTAL: "ll_sq_sum",
}


@dataclass(frozen=True)
class QualityCounts:
    """One arm's labelled predictions, as additive sums (since start, or over a window).

    Attributes:
        n: labelled predictions (rows).
        clicks: of those, labelled 1.
        score_sum: sum of their predicted click probabilities.
        ll_sum: sum of their log losses, nats.
        ll_sq_sum: sum of the squares of their log losses, nats^2.

    Raises:
        ValueError: a count that is not an integer >= 0, clicks above n, a sum that is
            negative or not finite.
    """

    n: int = 0
    clicks: int = 0
    score_sum: float = 0.0
    ll_sum: float = 0.0
    ll_sq_sum: float = 0.0

    def __post_init__(self) -> None:
        int_at_least("n", self.n, 0, then=" (a count)", error=ValueError)
        int_at_least("clicks", self.clicks, 0, then=" (a count)", error=ValueError)
        if self.clicks > self.n:
            raise ValueError(f"clicks={self.clicks} is more than the n={self.n} rows")
        for name in ("score_sum", "ll_sum", "ll_sq_sum"):
            nonneg_number(name, getattr(self, name), error=ValueError)

    @property
    def ctr(self) -> float | None:
        """clicks / n; None without rows."""
        return self.clicks / self.n if self.n else None

    @property
    def mean_logloss(self) -> float | None:
        """Mean log loss per row, nats; None without rows."""
        return self.ll_sum / self.n if self.n else None

    @property
    def logloss_var(self) -> float | None:
        """Variance of one row's log loss (nats^2, the population variance); None
        without rows."""
        if not self.n:
            return None
        mean = self.ll_sum / self.n
        return max(0.0, self.ll_sq_sum / self.n - mean * mean)

    @property
    def calibration_ratio(self) -> float | None:
        """sum(score) / clicks (1 = calibrated); None without clicks or scores."""
        return self.score_sum / self.clicks if self.clicks and self.score_sum > 0 else None

    def minus(self, base: QualityCounts) -> QualityCounts:
        """The labels joined since ``base``. When the rows went down (the sidecar
        restarted, or evicted the series), the counters restarted from 0 after ``base``:
        the window is then everything counted since, ``self``."""
        if self.n < base.n or self.clicks < base.clicks:
            return self
        return QualityCounts(
            n=self.n - base.n, clicks=self.clicks - base.clicks,
            score_sum=max(0.0, self.score_sum - base.score_sum),
            ll_sum=max(0.0, self.ll_sum - base.ll_sum),
            ll_sq_sum=max(0.0, self.ll_sq_sum - base.ll_sq_sum))


@dataclass(frozen=True)
class QualitySnapshot:
    """Both arms' label sums for one (stable, candidate) pair of versions."""

    stable: QualityCounts = QualityCounts()
    candidate: QualityCounts = QualityCounts()
    stable_version: str = ""
    candidate_version: str = ""

    def minus(self, base: QualitySnapshot) -> QualitySnapshot:
        """The labels joined since ``base`` (taken earlier for the same versions), per arm
        (:meth:`QualityCounts.minus`).

        Raises:
            ValueError: ``base`` was taken for other versions.
        """
        if (self.stable_version, self.candidate_version) != (
                base.stable_version, base.candidate_version):
            raise ValueError(
                f"cannot subtract a quality snapshot of stable={base.stable_version!r} "
                f"candidate={base.candidate_version!r} from one of "
                f"stable={self.stable_version!r} candidate={self.candidate_version!r}; "
                "take a new base snapshot when the versions change")
        return QualitySnapshot(self.stable.minus(base.stable),
                               self.candidate.minus(base.candidate),
                               self.stable_version, self.candidate_version)


def quality_snapshot(families: Iterable[Metric], *, stable_version: str,
                     candidate_version: str) -> QualitySnapshot:
    """Both arms' sums out of metric families: the stable arm is the samples labelled
    ``{version=stable_version, arm="stable"}``, the candidate's ``{version=
    candidate_version, arm="candidate"}``. Every sample with those labels is ADDED, so
    families of several pods (or the same family listed twice) give the fleet's sums.
    Families and samples of other names are ignored; no sample: zeros.

    Raises:
        ValueError: a sum that is negative or not finite, a row or click count that is
            not a whole number.
    """
    want = {(stable_version, "stable"): "stable", (candidate_version, "candidate"): "candidate"}
    sums: dict[str, dict[str, float]] = {"stable": {}, "candidate": {}}
    for family in families:
        for sample in family.samples:
            field = _FIELDS.get(sample.name)
            if field is None:
                continue
            arm = want.get((sample.labels.get("version", ""), sample.labels.get("arm", "")))
            if arm is None:
                continue
            value = float(sample.value)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{sample.name}{{version={sample.labels.get('version')!r},"
                                 f"arm={arm!r}}} is {value!r}; a sum of labels must be finite "
                                 "and >= 0")
            sums[arm][field] = sums[arm].get(field, 0.0) + value
    return QualitySnapshot(_counts(sums["stable"], "stable"),
                           _counts(sums["candidate"], "candidate"),
                           stable_version, candidate_version)


def _counts(sums: dict[str, float], arm: str) -> QualityCounts:
    ints: dict[str, int] = {}
    for name in ("n", "clicks"):
        v = sums.get(name, 0.0)
        if v != round(v):
            raise ValueError(f"the {arm} arm's {name} is {v!r}; it counts labels, a whole "
                             "number")
        ints[name] = round(v)
    return QualityCounts(n=ints["n"], clicks=ints["clicks"],
                         score_sum=sums.get("score_sum", 0.0), ll_sum=sums.get("ll_sum", 0.0),
                         ll_sq_sum=sums.get("ll_sq_sum", 0.0))


class QualityLimits(Guards):
    """What judges the click-quality gates: the declared guards
    (:class:`serve.state.Guards`, the one declaration of every limit's field, bounds and
    default; this module reads ``max_ne_increase``, ``max_calibration_gap`` and
    ``min_labels``) plus two statistical settings no state declares.

    Attributes:
        z: the normal quantile of the one-sided confidence bounds (2.326: 99%).
        labels_to_judge_unblocking: labels per arm before non-blocking gates judge.

    ``max_ne_increase`` is the highest acceptable lower bound of candidate NE - stable NE
    (dimensionless; NE of a useful CTR model is ~0.6-0.9), ``max_calibration_gap`` that of
    |ln cal_c| - |ln cal_s| (log-ratio units; 0.1 ~ 10% further from calibrated);
    ``min_labels`` > 0 makes the gates blocking (no promotion before they judge ok), 0
    judges from ``labels_to_judge_unblocking`` and never blocks.

    Raises:
        pydantic.ValidationError (a ValueError naming the field): a limit outside the
            bounds of :class:`serve.state.Guards`, ``z`` negative or not finite,
            ``labels_to_judge_unblocking`` < 1.
    """

    z: float = Field(default=QUALITY_Z, ge=0, allow_inf_nan=False,
                     description="Normal quantile of the one-sided bounds.")
    labels_to_judge_unblocking: int = Field(
        default=QUALITY_MIN_LABELS_TO_JUDGE, ge=1,
        description="Labels per arm before non-blocking gates judge.")

    @property
    def blocking(self) -> bool:
        """Whether a rollout waits for the gates (``min_labels`` > 0)."""
        return self.min_labels > 0

    @property
    def labels_needed(self) -> int:
        """Labels per arm before the gates judge."""
        return self.min_labels if self.min_labels > 0 else self.labels_to_judge_unblocking


def _g(x: float) -> str:
    return f"{x:.4g}"


def _result(name: str, value: float | None, threshold: float, detail: str,
            blocking: bool) -> GuardResult:
    if value is None:
        return GuardResult(name, None, threshold, "insufficient_data", detail, blocking)
    breached = value > threshold
    op = ">" if breached else "<="
    return GuardResult(name, value, threshold, "breached" if breached else "ok",
                       f"{detail}: lower bound {_g(value)} {op} {_g(threshold)}", blocking)


def _short(q: QualitySnapshot, need: int) -> str | None:
    short = [f"{arm} has {c.n} of the {need} labels needed"
             for arm, c in (("candidate", q.candidate), ("stable", q.stable)) if c.n < need]
    return "; ".join(short) if short else None


def _ne_increase(q: QualitySnapshot, limits: QualityLimits) -> GuardResult:
    name, limit, blocking = "ne_increase", limits.max_ne_increase, limits.blocking
    short = _short(q, limits.labels_needed)
    if short:
        return _result(name, None, limit, short, blocking)
    c, s = q.candidate, q.stable
    pooled = (c.clicks + s.clicks) / (c.n + s.n)
    h = entropy(pooled)
    if h <= 0.0:
        return _result(name, None, limit, f"the pooled CTR is {_g(pooled)}: one class "
                       "only, no entropy to normalize by", blocking)
    # n >= labels_needed >= 1 here, so the means and variances exist
    ll_c, ll_s = c.ll_sum / c.n, s.ll_sum / s.n
    var_c, var_s = c.logloss_var or 0.0, s.logloss_var or 0.0
    d = (ll_c - ll_s) / h
    se = math.sqrt(var_c / c.n + var_s / s.n) / h
    return _result(name, d - limits.z * se, limit,
                   f"NE candidate {_g(ll_c / h)} ({c.n} labels) - stable {_g(ll_s / h)} "
                   f"({s.n} labels) = {_g(d)} +- {_g(limits.z)} x {_g(se)}", blocking)


def _calibration_gap(q: QualitySnapshot, limits: QualityLimits) -> GuardResult:
    name, limit, blocking = "calibration_gap", limits.max_calibration_gap, limits.blocking
    short = _short(q, limits.labels_needed)
    if short:
        return _result(name, None, limit, short, blocking)
    c, s = q.candidate, q.stable
    cal_c, cal_s = c.calibration_ratio, s.calibration_ratio
    if cal_c is None or cal_s is None:
        missing = [arm for arm, cal in (("candidate", cal_c), ("stable", cal_s)) if cal is None]
        return _result(name, None, limit, f"no calibration ratio for {' and '.join(missing)}"
                       " (no clicks, or all scores 0)", blocking)
    gap = abs(math.log(cal_c)) - abs(math.log(cal_s))
    se = math.sqrt(1.0 / c.clicks + 1.0 / s.clicks)
    return _result(name, gap - limits.z * se, limit,
                   f"|ln calibration| candidate {_g(abs(math.log(cal_c)))} (ratio "
                   f"{_g(cal_c)}, {c.clicks} clicks) - stable {_g(abs(math.log(cal_s)))} "
                   f"(ratio {_g(cal_s)}, {s.clicks} clicks) = {_g(gap)} +- {_g(limits.z)} "
                   f"x {_g(se)}", blocking)


def evaluate_quality(q: QualitySnapshot, limits: QualityLimits) -> list[GuardResult]:
    """Judge the click-quality gates over ``q`` (usually ``now.minus(base)``): the
    ``ne_increase`` and ``calibration_gap`` results, in that order (see the module
    docstring). Each value is a lower confidence bound, breached when strictly above its
    threshold; ``blocking`` is ``limits.blocking``."""
    return [_ne_increase(q, limits), _calibration_gap(q, limits)]
