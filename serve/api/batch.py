"""One TorchServe batch: decode each request, run ONE merged forward per arm, split back.

:func:`handle_batch` decodes every body on its own (a bad one gets its own 4xx
:class:`Outcome`; the others go on), merges the good ones (:func:`merge_requests`) and
answers them from one forward, in request order, with ``{"predictions": [p_0, ...,
p_{B-1}]}`` (JSON, click probabilities in (0, 1)).

Rollouts (:mod:`serve.store.routing`): a request may send ``X-DLRM-Route-Key`` (1 to 256
characters, else 400), which keeps it on one arm of a canary or shadow rollout.
:func:`handle_batch` takes the routing as data (:class:`Split`: a mode, the candidate's
predict, a per-request decision) and runs ONE merged forward per arm; the worker
(:class:`serve.worker.Worker`) binds them to its two runtimes and the control file.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from serve.api.config import HandlerConfig
from serve.api.decode import _decode
from serve.api.request import ParsedRequest, _spec_of
from serve.errors import ServeError
from serve.schema import ModelSchema
from serve.store.routing import MODES

__all__ = [
    "ArmRun",
    "BatchInfo",
    "MergedBatch",
    "Outcome",
    "Split",
    "encode_error",
    "encode_predictions",
    "handle_batch",
    "merge_requests",
]

logger = logging.getLogger(__name__)


@dataclass
class MergedBatch:
    """Several requests merged into one forward; ``sizes[i]`` samples belong to request i."""

    dense: np.ndarray     # float32 (B, N)
    lengths: np.ndarray   # int32 (F, B)
    values: np.ndarray    # int64 (nnz,), feature-major
    sizes: list[int] = field(default_factory=list)


def merge_requests(parsed: Sequence[ParsedRequest]) -> MergedBatch:
    """Concatenate requests into one feature-major batch (request order kept).

    Feature-major means: for each feature, request 0's ids, then request 1's ... One
    gather over all the requests' ids (not a split per request and feature: with 32
    single-instance requests that was 832 tiny arrays and 12% of the worker's time).
    """
    if len(parsed) == 1:
        p = parsed[0]
        return MergedBatch(p.dense, p.lengths, p.values, [p.batch_size for p in parsed])
    dense = np.concatenate([p.dense for p in parsed])
    lengths = np.concatenate([p.lengths for p in parsed], axis=1)
    values = np.concatenate([p.values for p in parsed])
    return MergedBatch(dense, lengths, values[_feature_major_order(parsed)],
                       [p.batch_size for p in parsed])


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


@dataclass(frozen=True)
class Split:
    """How :func:`handle_batch` shares a batch between the two arms of a rollout.

    Attributes:
        mode: ``canary``: requests for which ``choose`` is true are answered by
            ``candidate`` instead of the stable ``predict``. ``shadow``: the stable
            ``predict`` answers every request; those for which ``choose`` is true are
            ALSO scored by ``candidate``, after the stable forward, and its results reach
            no response.
        candidate: the candidate's forward: MergedBatch -> float32 (B,) probabilities.
        choose: route key (None when the request sent none) -> whether the request takes
            the candidate. Called once per request that parsed, in request order (the
            worker binds :func:`serve.store.routing.takes_candidate` to the control's weight
            and the worker's rng).
        candidate_first: canary only: run the candidate's forward before the stable's.
            The second forward of a batch runs warm (measured ~12-15% less time per
            instance on CPU, whichever model it is), so the worker alternates the order
            per batch and neither arm's forward time is favoured (the rollout's latency
            guard compares them). Shadow always runs the stable forward first.
    """

    mode: str
    candidate: Callable[[MergedBatch], np.ndarray]
    choose: Callable[[str | None], bool]
    candidate_first: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Split.mode={self.mode!r} must be one of {list(MODES)}")


@dataclass
class ArmRun:
    """One arm's merged forward over its requests of a batch (``BatchInfo.arms[arm]``).

    Attributes:
        arm: ``stable`` or ``candidate``.
        answered: True when its results are the responses; False for the shadow
            candidate (scored for the metrics only).
        indices: positions of its requests in the batch, in order.
        sizes: instances of each of those requests.
        forward_s: seconds of its forward (merge + predict + checks).
        scores: float32 (instances,) its probabilities in request order; None when the
            forward failed.
        error: what the forward raised (a ServeError, or any other exception: the
            model's fault), else None.
    """

    arm: str
    answered: bool
    indices: list[int]
    sizes: list[int]
    forward_s: float = 0.0
    scores: np.ndarray | None = None
    error: Exception | None = None

    @property
    def requests(self) -> int:
        return len(self.indices)

    @property
    def instances(self) -> int:
        return sum(self.sizes)

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(frozen=True)
class BatchInfo:
    """What :func:`handle_batch` did with a batch, summed over the arms.

    Attributes:
        decode_s: seconds parsing all bodies.
        forward_s: seconds of all forwards, the shadow one included.
        instances, requests: those routed to an answering arm (every request that
            parsed).
        arms: {arm: :class:`ArmRun`} for each arm that ran a forward (``stable`` first).
        mode: the split's mode (``canary`` / ``shadow``), None without a split.
        shadow_diff: float32 (k,) candidate minus stable score over the shadow-scored
            instances, or None.
    """

    decode_s: float
    forward_s: float
    instances: int
    requests: int
    arms: dict[str, ArmRun] = field(default_factory=dict)
    mode: str | None = None
    shadow_diff: np.ndarray | None = None


def encode_predictions(probs: np.ndarray) -> bytes:
    return orjson.dumps({"predictions": probs}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_error(err: ServeError) -> bytes:
    return orjson.dumps(err.to_json())


def _run_arm(arm: str, answered: bool, requests: Sequence[tuple[int, ParsedRequest]],
             predict: Callable[[MergedBatch], np.ndarray],
             clock: Callable[[], float]) -> ArmRun:
    """ONE merged forward of ``predict`` over ``requests``; never raises (a failure is
    kept in ``ArmRun.error``, and logged with its traceback unless it is a ServeError
    of an answering arm, which its requests report themselves)."""
    run = ArmRun(arm, answered, [i for i, _ in requests], [p.batch_size for _, p in requests])
    t = clock()
    try:
        merged = merge_requests([p for _, p in requests])
        probs = np.asarray(predict(merged), dtype=np.float32).reshape(-1)
        if probs.shape[0] != merged.dense.shape[0]:
            raise RuntimeError(f"predict returned {probs.shape[0]} scores for "
                               f"{merged.dense.shape[0]} samples")
        run.scores = probs
    except Exception as e:  # this arm's fault: only its requests fail
        run.error = e
        if not (answered and isinstance(e, ServeError)):
            logger.exception("the %s model's forward failed on %d requests (%d instances)%s",
                             arm, run.requests, run.instances,
                             "" if answered else " (shadow: no response affected)")
    run.forward_s = clock() - t
    return run


def _answer(run: ArmRun, outcomes: list[Outcome | None]) -> None:
    """Fill the outcomes of ``run``'s requests: their predictions, or the arm's error
    (a ServeError as it is; anything else as a 500 naming the model log)."""
    if run.scores is not None:
        start = 0
        for i, size in zip(run.indices, run.sizes, strict=True):
            outcomes[i] = Outcome(200, encode_predictions(run.scores[start:start + size]), size,
                                  run.arm)
            start += size
        return
    err = run.error if isinstance(run.error, ServeError) else ServeError(
        f"internal error while predicting with the {run.arm} model; see the TorchServe "
        "model log")
    body = encode_error(err)
    for i in run.indices:
        outcomes[i] = Outcome(err.status, body, 0, run.arm)


def _shadow_diff(stable: ArmRun, candidate: ArmRun) -> np.ndarray | None:
    """float32 (k,): candidate minus stable score, instance by instance, over the
    candidate's (shadow) requests; None unless both forwards succeeded."""
    if stable.scores is None or candidate.scores is None:
        return None
    where: dict[int, tuple[int, int]] = {}
    start = 0
    for i, size in zip(stable.indices, stable.sizes, strict=True):
        where[i] = (start, start + size)
        start += size
    base = np.concatenate([stable.scores[slice(*where[i])] for i in candidate.indices])
    diff: np.ndarray = candidate.scores - base
    return diff


def handle_batch(bodies: Sequence[Any], content_types: Sequence[str | None],
                 predict: Callable[[MergedBatch], np.ndarray], cfg: HandlerConfig,
                 clock: Callable[[], float] = time.perf_counter, *,
                 route_keys: Sequence[str | None] | None = None,
                 split: Split | None = None,
                 schema: ModelSchema | None = None) -> tuple[list[Outcome], BatchInfo]:
    """Parse every request separately, run ONE forward per arm for the good ones, split back.

    Args:
        bodies: the raw body of each request (bytes; a JSON str is encoded as UTF-8).
        content_types: each request's Content-Type header (None if absent); it selects
            JSON or binary columnar decoding (:func:`check_content_type`).
        predict: the stable model's forward: MergedBatch -> float32 (B,) probabilities.
        route_keys: each request's ``X-DLRM-Route-Key`` (None: no header); checked by
            :func:`check_route_key` whether or not a rollout runs. None: no keys at all.
        split: a rollout's split (:class:`Split`); None: every good request is answered
            by ``predict`` (one forward).
        schema: the served model's schema every body is decoded against (a rollout's
            candidate shares the stable model's request schema); None:
            :data:`DEFAULT_SCHEMA`.
    Returns:
        (one Outcome per request in order, :class:`BatchInfo`).

    A bad request gets its own 4xx Outcome; the others are unaffected. A forward that
    raises fails only its arm's requests: a ServeError (e.g. InvalidInput from the
    runtime) with its status, anything else with a 500 (logged with its traceback). A
    failing shadow forward affects no response.
    """
    n = len(bodies)
    if len(content_types) != n or (route_keys is not None and len(route_keys) != n):
        raise ValueError(f"handle_batch: {n} bodies, {len(content_types)} content types and "
                         f"{'no' if route_keys is None else len(route_keys)} route keys; give "
                         "one of each per request")
    keys: Sequence[str | None] = route_keys if route_keys is not None else [None] * n
    spec = _spec_of(schema)
    t0 = clock()
    outcomes: list[Outcome | None] = [None] * n
    good: list[tuple[int, ParsedRequest]] = []
    for i, (body, ctype) in enumerate(zip(bodies, content_types, strict=True)):
        try:
            good.append((i, _decode(body, ctype, keys[i], cfg, spec)))
        except ServeError as e:
            outcomes[i] = Outcome(e.status, encode_error(e))
    t1 = clock()
    arms: dict[str, ArmRun] = {}
    shadow_diff = None
    if good:
        stable, candidate = good, []
        if split is not None:
            chosen = [bool(split.choose(keys[i])) for i, _ in good]
            candidate = [g for g, c in zip(good, chosen, strict=True) if c]
            if split.mode == "canary":
                stable = [g for g, c in zip(good, chosen, strict=True) if not c]
        first = split is not None and split.mode == "canary" and split.candidate_first
        if candidate and split is not None and first:
            arms["candidate"] = _run_arm("candidate", True, candidate, split.candidate, clock)
        if stable:
            arms["stable"] = _run_arm("stable", True, stable, predict, clock)
        if candidate and split is not None and not first:
            arms["candidate"] = _run_arm("candidate", split.mode == "canary", candidate,
                                         split.candidate, clock)
        for run in arms.values():
            if run.answered:
                _answer(run, outcomes)
        if split is not None and split.mode == "shadow" and "candidate" in arms:
            shadow_diff = _shadow_diff(arms["stable"], arms["candidate"])
    answering = [r for r in arms.values() if r.answered]
    info = BatchInfo(
        decode_s=t1 - t0,
        forward_s=sum(r.forward_s for r in arms.values()),
        instances=sum(r.instances for r in answering),
        requests=sum(r.requests for r in answering),
        arms=arms,
        mode=split.mode if split is not None else None,
        shadow_diff=shadow_diff,
    )
    return [o for o in outcomes if o is not None], info
