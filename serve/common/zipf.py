"""Zipf-distributed ids: one sampler for the training data and the load tests.

Rank k (0 = hottest) of a table with ``rows`` rows has P(k) proportional to
(k + 1)^-alpha (a truncated zeta law). A rank becomes an id through a fixed per-feature
permutation, so hot ids are spread over the table instead of being 0, 1, 2, ...;
``serve.model.data`` and ``loadtest.traffic`` share it, so load tests hit the ids the model
was trained on.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["EXACT_CDF_MAX", "id_permutation", "zeta_cdf", "zipf_ranks"]

# Tables up to this many rows draw ranks from the exact discrete zeta CDF (16 MiB of
# float64 at most); larger ones use the continuous power-law inverse CDF (error only in
# the far tail, memory O(1)).
EXACT_CDF_MAX = 1 << 21


def zeta_cdf(rows: int, alpha: float) -> np.ndarray | None:
    """The exact CDF (rows,) float64 of ranks, or None above ``EXACT_CDF_MAX`` rows."""
    if rows > EXACT_CDF_MAX:
        return None
    w = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(w)
    return cdf / cdf[-1]


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, alpha: float,
               cdf: np.ndarray | None) -> np.ndarray:
    """n ranks, int64 in [0, rows); ``cdf`` from :func:`zeta_cdf` (None: closed form)."""
    u = rng.random(n)
    if cdf is not None:
        return np.minimum(np.searchsorted(cdf, u, side="right"), rows - 1).astype(np.int64)
    # Continuous power law on [1, rows + 1), inverted in closed form.
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * math.log(rows + 1.0))
    else:
        a = 1.0 - alpha
        x = (1.0 + u * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.clip(x.astype(np.int64) - 1, 0, rows - 1)


def id_permutation(seed: int, feature: int, rows: int) -> np.ndarray:
    """int64 (rows,): rank -> id of feature number ``feature`` (0-based) for data ``seed``."""
    return np.random.default_rng([seed, 11, feature]).permutation(rows).astype(np.int64)
