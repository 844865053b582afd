"""ROC AUC in numpy (no scikit-learn): the probability that a random click outranks a
random non-click, ties counted half (Mann-Whitney U with average ranks).

It lives in :mod:`serve.quality` (the pod computes the online AUC with it too); this
module keeps the build's import path."""
from __future__ import annotations

from serve.quality import roc_auc

__all__ = ["roc_auc"]
