"""The worker's models and the rollout split between them: one TorchServe batch in, ONE
merged forward per arm, the responses out.

* :class:`Arms`: a worker's stable runtime and, in a rollout, the candidate's, with the
  control file's watcher and the random source of requests without a route key.
  :meth:`Arms.run` answers one batch: it reads the control once (:meth:`Arms.split`) and
  runs the forwards itself (:meth:`Arms.forward`).
* :func:`handle_batch`: decodes every body on its own (:func:`serve.api.decode.decode_request`;
  a bad one gets its own 4xx :class:`~serve.api.batch.Outcome`; the others go on), merges
  the good ones of each arm (:func:`serve.api.batch.merge_requests`) and answers them from
  one forward per arm, in request order, with ``{"predictions": [p_0, ..., p_{B-1}]}``
  (JSON, click probabilities in (0, 1)). It takes the forwards as functions
  (MergedBatch -> float32 (B,)) and the routing as data (:class:`Split`), so tests drive
  it with fakes.
* :class:`BatchInfo` / :class:`ArmRun`: what a batch did, per arm (the worker's metrics
  and prediction log read them).

Rollouts (:mod:`serve.store.routing`): a request may send ``X-DLRM-Route-Key`` (1 to 256
characters, else 400), which keeps it on one arm of a canary or shadow rollout.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve.api.batch import MergedBatch, Outcome, encode_error, encode_predictions, merge_requests
from serve.api.config import HandlerConfig
from serve.api.decode import decode_request
from serve.api.request import ParsedRequest
from serve.api.spec import spec_of
from serve.errors import ServeError
from serve.runtime.engine import Runtime
from serve.schema import ModelSchema
from serve.state import ROLLOUT_MODES, RolloutMode
from serve.store.routing import ControlWatcher, route_key_salt, takes_candidate
from serve.worker.messages import WorkerRequest

__all__ = [
    "ArmRun",
    "Arms",
    "BatchInfo",
    "Split",
    "handle_batch",
]

logger = logging.getLogger(__name__)


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
            the candidate. Called once per request that parsed, in request order
            (:meth:`Arms.split` binds :func:`serve.store.routing.takes_candidate` to the
            control's weight and the worker's rng).
        candidate_first: canary only: run the candidate's forward before the stable's.
            The second forward of a batch runs warm (measured ~12-15% less time per
            instance on CPU, whichever model it is), so :class:`Arms` alternates the order
            per batch and neither arm's forward time is favoured (the rollout's latency
            guard compares them). Shadow always runs the stable forward first.
    """

    mode: str
    candidate: Callable[[MergedBatch], np.ndarray]
    choose: Callable[[str | None], bool]
    candidate_first: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(f"Split.mode={self.mode!r} must be one of {list(ROLLOUT_MODES)}")


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
        arms: {arm: :class:`ArmRun`} for each arm that ran a forward, in the order they
            ran: ``candidate`` first when the split is a canary with
            ``candidate_first`` set, else ``stable`` first.
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
            JSON or binary columnar decoding (:func:`serve.api.request.check_content_type`).
        predict: the stable model's forward: MergedBatch -> float32 (B,) probabilities.
        route_keys: each request's ``X-DLRM-Route-Key`` (None: no header); checked by
            :func:`serve.api.request.check_route_key` whether or not a rollout runs. None: no keys at all.
        split: a rollout's split (:class:`Split`); None: every good request is answered
            by ``predict`` (one forward).
        schema: the served model's schema every body is decoded against (a rollout's
            candidate shares the stable model's request schema); None:
            :data:`serve.api.request.DEFAULT_SCHEMA`.
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
    spec = spec_of(schema)
    t0 = clock()
    outcomes: list[Outcome | None] = [None] * n
    good: list[tuple[int, ParsedRequest]] = []
    for i, (body, ctype) in enumerate(zip(bodies, content_types, strict=True)):
        try:
            good.append((i, decode_request(body, ctype, keys[i], cfg, spec)))
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
            if split.mode == RolloutMode.CANARY:
                stable = [g for g, c in zip(good, chosen, strict=True) if not c]
        first = split is not None and split.mode == RolloutMode.CANARY and split.candidate_first
        if candidate and split is not None and first:
            arms["candidate"] = _run_arm("candidate", True, candidate, split.candidate, clock)
        if stable:
            arms["stable"] = _run_arm("stable", True, stable, predict, clock)
        if candidate and split is not None and not first:
            arms["candidate"] = _run_arm("candidate", split.mode == RolloutMode.CANARY, candidate,
                                         split.candidate, clock)
        for run in arms.values():
            if run.answered:
                _answer(run, outcomes)
        if split is not None and split.mode == RolloutMode.SHADOW and "candidate" in arms:
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


class Arms:
    """A worker's models: the stable runtime and, in a rollout, the candidate's; and how a
    batch is split between them.

    Args:
        stable: the stable model (the version ``model_version``).
        model_version: its repository version (``X-DLRM-Model-Version``).
        candidate: a rollout's candidate runtime, with ``candidate_version`` and the
            ``watcher`` of its control file; None: no rollout.
        rng: routes requests without a route key (default ``random.Random(0)``).
        route_salt: the fleet's route-key secret (default: :func:`serve.store.routing.route_key_salt`
            from the environment, read when there is a candidate).
        debug_delay_ms: TESTS ONLY: every forward sleeps this long first (a slow model, so
            TorchServe's queue fills up); 0: off.
        candidate_slowdown: TESTS AND BENCHMARKS ONLY: the candidate's forwards take this
            many times their time (>= 1; 1.0: off).
    """

    def __init__(self, stable: Runtime, model_version: str, *,
                 candidate: Runtime | None = None, candidate_version: str | None = None,
                 watcher: ControlWatcher | None = None, rng: random.Random | None = None,
                 debug_delay_ms: float = 0, candidate_slowdown: float = 1.0,
                 route_salt: bytes | None = None) -> None:
        if (candidate is None) != (candidate_version is None) or (
                candidate is not None and watcher is None):
            raise ValueError("Worker: a rollout needs candidate, candidate_version and "
                             "watcher together; give all three or none")
        self.stable = stable
        self.model_version = model_version
        self.candidate = candidate
        self.candidate_version = candidate_version
        self.watcher = watcher
        self.debug_delay_ms = debug_delay_ms
        self.candidate_slowdown = candidate_slowdown
        self._rng = rng if rng is not None else random.Random(0)
        # The fleet's route-key secret; read once (a rollout only: nothing routes without).
        self._salt = route_salt if route_salt is not None else (
            route_key_salt() if candidate is not None else b"")
        self._batches = 0  # batches split between the arms (their forward order alternates)
        #: The ids of the stable model's last forward, (values int64 (nnz,), lengths int32
        #: (F, B)), for the reuse sampler to read after the batch (outside the timed
        #: forward); None once taken (:meth:`take_ids`).
        self.last_ids: tuple[np.ndarray, np.ndarray] | None = None

    def run(self, requests: Sequence[WorkerRequest], cfg: HandlerConfig
            ) -> tuple[list[Outcome], BatchInfo]:
        """Answer one batch (:func:`handle_batch`) with this batch's split. Every body is
        decoded against the stable model's request schema; a rollout's candidate is
        served with it (the sidecar refuses one that differs)."""
        return handle_batch(
            [r.body for r in requests], [r.content_type for r in requests], self.predict, cfg,
            route_keys=[r.route_key for r in requests], split=self.split(),
            schema=self.stable.schema)

    def forward(self, runtime: Runtime, batch: MergedBatch) -> np.ndarray:
        """One forward of ``runtime``: MergedBatch -> float32 (B,) probabilities."""
        if self.debug_delay_ms:  # tests only: a slow model, so the queue fills up
            time.sleep(self.debug_delay_ms / 1000.0)
        if batch.shared:   # a ranking request's context: looked up once
            return runtime.predict_arrays(batch.dense, batch.values, batch.lengths,
                                          batch.shared, batch.bag_of)
        return runtime.predict_arrays(batch.dense, batch.values, batch.lengths)

    def predict(self, batch: MergedBatch) -> np.ndarray:
        """The stable model: MergedBatch -> float32 (B,) probabilities."""
        self.last_ids = (batch.values, batch.lengths)
        return self.forward(self.stable, batch)

    def take_ids(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The stable model's last forward's ids (see :attr:`last_ids`), once."""
        ids, self.last_ids = self.last_ids, None
        return ids

    def predict_candidate(self, batch: MergedBatch) -> np.ndarray:
        """The rollout's candidate: MergedBatch -> float32 (B,) probabilities."""
        if self.candidate is None:
            raise RuntimeError("no rollout candidate is loaded")
        if self.candidate_slowdown == 1.0:
            return self.forward(self.candidate, batch)
        t0 = time.perf_counter()
        out = self.forward(self.candidate, batch)
        # TESTS ONLY (debug_candidate_slowdown): a model this many times slower.
        _spin((self.candidate_slowdown - 1.0) * (time.perf_counter() - t0))
        return out

    def split(self) -> Split | None:
        """This batch's split: the control read once (None without a rollout)."""
        if self.watcher is None or self.candidate is None:
            return None
        control = self.watcher.current()
        rng, weight, salt = self._rng, control.weight, self._salt
        # Canary: the arms take turns at running first (the second forward runs warm).
        self._batches += 1
        return Split(mode=control.mode, candidate=self.predict_candidate,
                     choose=lambda key: takes_candidate(key, weight, rng, salt),
                     candidate_first=self._batches % 2 == 0)

    def version_of(self, arm: str | None) -> str:
        """The model version of an arm (the stable version for no arm)."""
        if arm == "candidate" and self.candidate_version is not None:
            return self.candidate_version
        return self.model_version

    def runtimes(self) -> list[Runtime]:
        """The stable runtime, then a rollout's candidate."""
        return [r for r in (self.stable, self.candidate) if r is not None]

    def versions(self) -> list[tuple[str, Runtime]]:
        """(model version, runtime) of the stable model and a rollout's candidate."""
        out = [(self.model_version, self.stable)]
        if self.candidate is not None and self.candidate_version is not None:
            out.append((self.candidate_version, self.candidate))
        return out


def _spin(seconds: float) -> None:
    """Busy-wait ``seconds`` (the test-only candidate slowdown). Not ``time.sleep``: a
    slower model keeps its core busy, and on a loaded machine a sleeping thread wakes up
    late (measured: a 1.5x slowdown by sleep read as 2.4x on 2 shared cores)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass
