"""ROC AUC in numpy (no scikit-learn): the probability that a random click outranks a
random non-click, ties counted half (Mann-Whitney U with average ranks)."""
from __future__ import annotations

import numpy as np

from serve.errors import ConfigError

__all__ = ["roc_auc"]


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
