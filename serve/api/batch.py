"""A batch's data shaping: merge decoded requests into one forward's input, encode the
responses.

* :func:`merge_requests`: several :class:`~serve.api.request.ParsedRequest` -> one
  :class:`MergedBatch` (dense float32 (B, N), lengths int32 (F, B), values int64 (nnz,)
  feature-major; ``sizes[i]`` samples of request i, in order).
* :class:`Outcome`: one response (HTTP status, JSON body bytes); :func:`encode_predictions`
  gives ``{"predictions": [p_0, ..., p_{B-1}]}`` (click probabilities in (0, 1)),
  :func:`encode_error` a :class:`~serve.errors.ServeError`'s ``{"code", "type", "message"}``.

No model runs here: the worker (:mod:`serve.worker.arms`) runs one merged forward per arm
of a rollout and splits the scores back with these.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import orjson

from serve.api.request import ParsedRequest
from serve.errors import ServeError

__all__ = [
    "MergedBatch",
    "Outcome",
    "encode_error",
    "encode_predictions",
    "merge_requests",
]


@dataclass
class MergedBatch:
    """Several requests merged into one forward; ``sizes[i]`` samples belong to request i."""

    dense: np.ndarray     # float32 (B, N)
    lengths: np.ndarray   # int32 (F, B)
    values: np.ndarray    # int64 (nnz,), feature-major
    sizes: list[int] = field(default_factory=list)
    #: features some request sent once, and int64 (S, B): the sample whose bag each
    #: sample reads for them (:class:`serve.runtime.engine.SparseBatch`); () / None: none.
    shared: tuple[int, ...] = ()
    bag_of: np.ndarray | None = None


def merge_requests(parsed: Sequence[ParsedRequest]) -> MergedBatch:
    """Concatenate requests into one feature-major batch (request order kept).

    Feature-major means: for each feature, request 0's ids, then request 1's ... One
    gather over all the requests' ids (not a split per request and feature: with 32
    single-instance requests that was 832 tiny arrays and 12% of the worker's time).
    """
    sizes = [p.batch_size for p in parsed]
    shared, bag_of = _shared_bags(parsed, sizes)
    if len(parsed) == 1:
        p = parsed[0]
        return MergedBatch(p.dense, p.lengths, p.values, sizes, shared, bag_of)
    dense = np.concatenate([p.dense for p in parsed])
    lengths = np.concatenate([p.lengths for p in parsed], axis=1)
    values = np.concatenate([p.values for p in parsed])
    return MergedBatch(dense, lengths, values[_feature_major_order(parsed)], sizes, shared,
                       bag_of)


def _shared_bags(parsed: Sequence[ParsedRequest], sizes: list[int]
                 ) -> tuple[tuple[int, ...], np.ndarray | None]:
    """The features any request sent once, and int64 (S, B): for each, the sample whose
    bag each merged sample reads (its request's first sample where that request sent the
    feature once, itself otherwise)."""
    if not any(p.shared for p in parsed):
        return (), None
    shared = tuple(sorted({f for p in parsed for f in p.shared}))
    b = sum(sizes)
    if len(parsed) == 1:   # one request: every sample reads sample 0's bag
        return shared, np.zeros((len(shared), b), dtype=np.int64)
    own = np.arange(b, dtype=np.int64)
    firsts = np.repeat(np.cumsum(sizes) - sizes, sizes)          # (B,) request's sample 0
    bag_of = np.empty((len(shared), b), dtype=np.int64)
    for k, f in enumerate(shared):
        once = np.repeat([f in p.shared for p in parsed], sizes)
        bag_of[k] = np.where(once, firsts, own)
    return shared, bag_of


def _feature_major_order(parsed: Sequence[ParsedRequest]) -> np.ndarray:
    """int64 (nnz,): positions in the requests' concatenated ids, in feature-major order.

    Each request's ids are feature-major already, so each (request r, feature f) pair is
    one contiguous segment: at ``base[r] + start-in-request[r, f]``, ``seg[r, f]`` long.
    The merged order takes the segments feature by feature, request by request.
    """
    seg = np.stack([p.lengths.sum(axis=1, dtype=np.int64) for p in parsed])  # (R, F)
    within = np.cumsum(seg, axis=1) - seg                                      # (R, F)
    totals = seg.sum(axis=1)
    base = np.cumsum(totals) - totals                                          # (R,)
    starts = (base[:, None] + within).T.reshape(-1)   # (F*R,) feature-major segments
    counts = seg.T.reshape(-1)
    # position k of segment s: starts[s] + (k - first output position of s)
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


@dataclass
class Outcome:
    """One response: HTTP status and the JSON body bytes.

    ``instances``: samples answered (0 unless the status is 200). ``arm``: the arm whose
    forward answered (``stable`` or ``candidate``); None when the request never reached a
    forward (its body, Content-Type or route key was refused).
    """

    status: int
    body: bytes
    instances: int = 0
    arm: str | None = None


def encode_predictions(probs: np.ndarray) -> bytes:
    return orjson.dumps({"predictions": probs}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_error(err: ServeError) -> bytes:
    return orjson.dumps(err.to_json())
