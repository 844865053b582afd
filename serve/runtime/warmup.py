"""Warm-up forwards: a freshly loaded :class:`~serve.runtime.engine.Runtime` runs a few
generated batches before it serves, so real requests do not pay its first-call costs.

A fresh runtime's first forwards are slow: the allocator grows its pools, the kernels pick
their algorithms per shape (oneDNN primitives on CPU, cuBLAS plans on GPU), lazy modules
initialise, and the embedding cache is cold. Served as they come, those forwards land on
real requests, and a rollout's candidate, loaded minutes after the stable version, reads
as a slower model (a canary's first evaluation measured its p99 at 3.4x the stable's).

:func:`warmup_batch` makes a batch in the runtime's own request layout from its schema:
B instances (B as asked), ``num_dense`` dense features drawn from a standard normal, and
one id per sparse feature drawn below the rows of that feature's table (so no id wraps and
the wrapped-id counters stay put), or for a managed table among the ids its map admitted
(the map's own path; the fallback counters stay put). :func:`warm_up` runs ``batches`` such forwards, the
sizes cycling through :data:`WARMUP_SIZES` capped by the runtime's
``max_forward_instances``.

What warm-up changes: the runtime's counters (forwards, samples, stage seconds, cache
hits and misses) and which rows the embedding cache holds. The cache holds exact copies
of rows, so it changes no answer (``tests/test_warmup.py`` checks predictions bitwise).
Callers that export those counters take the runtime's counts after the warm-up as their
starting point (``serve.worker.Worker.load``).

Example::

    seconds = warm_up(runtime, batches=6)
"""
from __future__ import annotations

import time

import numpy as np

from serve.runtime.engine import Runtime

__all__ = ["WARMUP_SIZES", "warm_up", "warmup_batch"]

#: Instances per warm-up forward, cycled: a single instance (a lone request), a small merged
#: batch, and a ranking-sized one (hundreds of instances).
WARMUP_SIZES: tuple[int, ...] = (1, 64, 512)


def warmup_batch(runtime: Runtime, size: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A generated batch of ``size`` instances in ``runtime``'s layout.

    Returns:
        ``(dense, values, lengths)`` as :meth:`Runtime.predict_arrays` takes them: float32
        (B, N) dense, int64 (F*B,) ids feature-major (each below its table's rows), int32
        (F, B) lengths, all 1 (one id per feature).

    Raises:
        ValueError: ``size`` < 1.
    """
    if size < 1:
        raise ValueError(f"size={size} must be >= 1 instance")
    nf = len(runtime.feature_names)
    dense = rng.standard_normal((size, runtime.num_dense), dtype=np.float32)
    maps = runtime.id_maps
    parts = []
    for f, rows in enumerate(runtime.feature_rows):
        known = maps[runtime.schema.feature_tables[f]].ids if runtime.schema.feature_tables[f] \
            in maps else None
        if known is not None and known.numel():   # admitted ids: the map's real path
            parts.append(known.cpu().numpy()[rng.integers(0, known.numel(), size=size)])
        else:
            parts.append(rng.integers(0, rows, size=size, dtype=np.int64))
    values = np.concatenate(parts) if nf else np.zeros(0, dtype=np.int64)
    lengths = np.ones((nf, size), dtype=np.int32)
    return dense, values, lengths


def warm_up(runtime: Runtime, batches: int, seed: int = 0) -> float:
    """Run ``batches`` forwards of generated batches through ``runtime``; the seconds it
    took (wall). Sizes cycle through :data:`WARMUP_SIZES`, each capped by the runtime's
    ``max_forward_instances``. 0 batches: nothing, 0.0.

    Raises:
        ValueError: ``batches`` < 0.
    """
    if batches < 0:
        raise ValueError(f"batches={batches} must be >= 0")
    if batches == 0:
        return 0.0
    cap = runtime.config.max_forward_instances
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for i in range(batches):
        size = WARMUP_SIZES[i % len(WARMUP_SIZES)]
        if cap is not None:
            size = min(size, cap)
        runtime.predict_arrays(*warmup_batch(runtime, size, rng))
    # Padded dense shapes (bf16 on CPU): each one's kernels, built once here, not on the
    # first request of that size.
    for size in runtime.dense_shapes():
        runtime.predict_arrays(*warmup_batch(runtime, size, rng))
    return time.perf_counter() - t0
