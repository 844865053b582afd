"""Model quality from labels and scores, shared by the build and the pod (numpy only).

* :func:`roc_auc`: ROC AUC (Mann-Whitney U with average ranks; no scikit-learn).
* :func:`summarize`: what the build stores as a version's ``baseline`` (held-out data)
  and what the sidecar exports from click feedback (a sliding window): rows, observed
  CTR (mean label), mean predicted CTR, calibration ratio, AUC and the counts of scores
  per bin of :data:`serve.metrics.SCORE_BUCKETS`.

Calibration ratio = mean predicted CTR / observed CTR (1.0: calibrated; above 1 the model
over-predicts clicks). It is the ratio used in ads CTR work ("predicted over actual");
NaN when no click was observed.

Normalized entropy (NE, He et al., "Practical lessons from predicting clicks on ads at
Facebook", 2014) = mean log loss / H(observed CTR), where the log loss of one prediction
``p`` with label ``y`` is ``-(y ln p + (1-y) ln(1-p))`` in nats (``p`` clipped to
[:data:`LOGLOSS_EPS`, 1 - :data:`LOGLOSS_EPS`]) and ``H(c) = -(c ln c + (1-c) ln(1-c))``
is the log loss of always predicting the base rate. NE < 1: the model beats the base
rate; 1: it knows nothing more; lower is better. :func:`logloss` gives the per-row values,
:func:`entropy` H; the additive sums behind both (rows, clicks, sum of scores, sum of log
losses and of their squares) are what the rollout's quality gates read
(:mod:`serve.sidecar.control.quality_gates`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from serve.errors import ConfigError
from serve.metrics import SCORE_BUCKETS

__all__ = ["LOGLOSS_EPS", "ScoreSummary", "calibration_ratio", "entropy", "logloss",
           "normalized_entropy", "roc_auc", "summarize"]

#: Scores are clipped to [LOGLOSS_EPS, 1 - LOGLOSS_EPS] before a log loss: a score of
#: exactly 0 or 1 with the other label would be an infinite loss (-ln 1e-7 = 16.1 nats).
LOGLOSS_EPS = 1e-7


def logloss(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """float64 (n,) log loss in nats of each prediction: ``-(y ln p + (1-y) ln(1-p))`` for
    ``scores`` (n,) probabilities and ``labels`` (n,) 0/1, ``p`` clipped to
    [LOGLOSS_EPS, 1 - LOGLOSS_EPS].

    Raises ConfigError when the shapes differ.
    """
    y = np.asarray(labels).reshape(-1).astype(np.float64)
    p = np.clip(np.asarray(scores, dtype=np.float64).reshape(-1), LOGLOSS_EPS,
                1.0 - LOGLOSS_EPS)
    if y.shape != p.shape:
        raise ConfigError(f"logloss: {y.shape[0]} labels for {p.shape[0]} scores; give one "
                          "per prediction")
    return -(y * np.log(p) + (1.0 - y) * np.log1p(-p))


def entropy(ctr: float) -> float:
    """H(ctr) in nats: the log loss per row of always predicting ``ctr``; 0 for a CTR of
    exactly 0 or 1 (NE is undefined then)."""
    if not 0.0 < ctr < 1.0:
        return 0.0
    return -(ctr * math.log(ctr) + (1.0 - ctr) * math.log1p(-ctr))


def normalized_entropy(mean_logloss: float, ctr: float) -> float | None:
    """``mean_logloss / H(ctr)`` (dimensionless, lower is better, 1 = the base rate);
    None when ``ctr`` is 0 or 1 (one class only: H = 0)."""
    h = entropy(ctr)
    return mean_logloss / h if h > 0.0 else None


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """AUC of ``scores`` (n,) for binary ``labels`` (n,), both array-likes.

    Raises ConfigError when the shapes differ or only one class is present (AUC is
    undefined then).
    """
    y = np.asarray(labels).reshape(-1).astype(bool)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ConfigError(f"roc_auc: {y.shape[0]} labels for {s.shape[0]} scores; give one per sample")
    pos = int(y.sum())
    neg = y.shape[0] - pos
    if pos == 0 or neg == 0:
        raise ConfigError(f"roc_auc: needs both classes, got {pos} positives and {neg} negatives")
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    # Average 1-based ranks over runs of tied scores.
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    ends = np.r_[starts[1:], s_sorted.shape[0]]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty_like(s)
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def calibration_ratio(predicted_ctr: float, observed_ctr: float) -> float:
    """Mean predicted CTR / observed CTR; NaN when nothing was clicked (undefined)."""
    if not observed_ctr > 0.0:
        return math.nan
    return predicted_ctr / observed_ctr


@dataclass(frozen=True)
class ScoreSummary:
    """Quality of a set of predictions with their labels.

    Attributes:
        rows: labelled predictions.
        observed_ctr: mean label (clicks / rows).
        predicted_ctr: mean predicted click probability.
        calibration_ratio: ``predicted_ctr / observed_ctr`` (NaN without clicks).
        auc: ROC AUC; None when only one class is present.
        score_le: upper bounds of the score bins (``SCORE_BUCKETS``).
        score_counts: predictions per bin, NOT cumulative: ``score_counts[i]`` scores are
            in ``(score_le[i-1], score_le[i]]`` (the first bin from 0).
        logloss: mean log loss in nats (:func:`logloss`).
        ne: normalized entropy, ``logloss / H(observed_ctr)`` (:func:`normalized_entropy`);
            None when only one class is present.
    """

    rows: int
    observed_ctr: float
    predicted_ctr: float
    calibration_ratio: float
    auc: float | None
    score_le: tuple[float, ...]
    score_counts: tuple[int, ...]
    logloss: float = math.nan
    ne: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["score_le"], d["score_counts"] = list(self.score_le), list(self.score_counts)
        if math.isnan(self.calibration_ratio):
            d["calibration_ratio"] = None
        return d


def summarize(labels: np.ndarray, scores: np.ndarray,
              buckets: Sequence[float] = SCORE_BUCKETS) -> ScoreSummary:
    """:class:`ScoreSummary` of ``scores`` (n,) probabilities in [0, 1] with ``labels`` (n,) 0/1.

    Raises ConfigError for no rows or shapes that differ.
    """
    y = np.asarray(labels).reshape(-1).astype(np.float64)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ConfigError(f"summarize: {y.shape[0]} labels for {s.shape[0]} scores; give one "
                          "per prediction")
    if y.shape[0] == 0:
        raise ConfigError("summarize: no labelled predictions")
    observed, predicted = float(y.mean()), float(s.mean())
    mean_ll = float(logloss(y, s).mean())
    pos = int(y.sum())
    auc = roc_auc(y, s) if 0 < pos < y.shape[0] else None
    le = np.asarray(buckets, dtype=np.float64)
    # Bin i holds le[i-1] < score <= le[i], as a Prometheus histogram counts them.
    idx = np.minimum(np.searchsorted(le, s, side="left"), le.shape[0] - 1)
    counts = np.bincount(idx, minlength=le.shape[0])
    return ScoreSummary(rows=int(y.shape[0]), observed_ctr=observed, predicted_ctr=predicted,
                        calibration_ratio=calibration_ratio(predicted, observed), auc=auc,
                        score_le=tuple(float(b) for b in le),
                        score_counts=tuple(int(c) for c in counts), logloss=mean_ll,
                        ne=normalized_entropy(mean_ll, observed))
