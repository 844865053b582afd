"""The serving worker: everything one TorchServe worker process owns, without TorchServe.

A :class:`Worker` holds the stable model's :class:`~serve.runtime.engine.Runtime` and, in
a rollout, the candidate's; the rollout's control file and split; the delta followers
and the batch lock they apply deltas under; the prediction log; and the handler metrics.
:meth:`Worker.handle` answers one batch: :class:`~serve.worker.messages.WorkerRequest` in,
:class:`~serve.worker.messages.WorkerResponse` out, in order.

* :meth:`Worker.load` (once per worker process): sets torch threads per worker (cores /
  workers unless configured: more oversubscribes the cores), loads the artifact into a
  Runtime on the given device and, when the config's ``handler.rollout`` names one
  (:class:`serve.api.config.RolloutWiring`, written by the sidecar into the archives it
  derives), the candidate's artifact beside it (same runtime settings), and watches the
  control file. Before it returns (so before TorchServe marks the worker READY), each
  runtime runs ``handler.warmup_batches`` forwards on generated batches
  (:mod:`serve.runtime.warmup`): the first real requests, a rollout candidate's included,
  do not pay first-call costs. The warm-up counts in no metric.
* :meth:`Worker.handle`: each body is parsed and validated on its own (a bad one gets
  its own 4xx JSON; the others go on), the good ones run as ONE forward, and the
  probabilities are split back in order (:func:`serve.api.batch.handle_batch`). Each
  response carries ``X-DLRM-Batch-Instances`` / ``X-DLRM-Batch-Requests`` (samples and
  requests of the merged forward) and ``X-DLRM-TorchServe-Batch`` (requests handed over
  together, bad ones included): observable batching. Every response, errors included,
  carries ``X-DLRM-Model-Version``: the repository version of the model that answered.
  Bodies: JSON (``application/json`` or no Content-Type) or binary columnar
  (``application/x-dlrm-columnar``); anything else gets 415. Responses are always JSON.

Rollouts (canary / shadow, :mod:`serve.store.routing`): ``handle`` reads the control once per
batch (a batch sees one value) and splits the batch:

* ``canary``: each request that parsed takes the candidate when
  :func:`serve.store.routing.takes_candidate` says so (by its ``X-DLRM-Route-Key`` hash, else
  at random), ONE merged forward per non-empty arm, responses in request order. A
  forward that raises fails only its own arm's requests (500 JSON, logged).
* ``shadow``: the stable model answers every request (one forward, exactly as without a
  rollout); the chosen share is ALSO scored by the candidate afterwards (metrics only;
  its failures touch no response). The batch's responses leave after both forwards.

The rng for requests without a route key is ``random.Random(pid)``: seeded per worker so
that workers draw independently, reproducible within one worker's life. Responses of
requests that reached a forward carry ``X-DLRM-Arm`` (``stable`` or ``candidate``) and,
in ``X-DLRM-Model-Version``, the version that answered; refused requests (bad body,
Content-Type or route key) name the stable version and no arm. Without a rollout
everything is the stable arm (still recorded in the per-arm metrics). Route keys are
checked whether or not a rollout runs: empty or over
:data:`serve.store.routing.ROUTE_KEY_MAX_CHARS` characters is a 400.

Prediction log (:mod:`serve.store.predlog`): with ``DLRM_PREDICTION_LOG_DIR`` in the
environment, every scored request (sampled by a hash of its id) is appended there after
the batch, keyed by its request id, with its version, arm and scores; the sidecar joins
``POST /feedback`` labels with it. Writing it never fails a prediction; nor do metrics.

Deltas (:mod:`serve.store.delta_files`): with ``DLRM_DELTA_DIR`` in the environment, one
:class:`~serve.runtime.follower.DeltaFollower` per served version applies the store's
deltas before the first batch and later ones between batches (under the batch lock, and
the write side of the pod's shared tables).

Not thread-safe: one :meth:`handle` at a time (TorchServe's worker is single-threaded;
only the delta followers run beside it, under the batch lock).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from serve.api.batch import BatchInfo, MergedBatch, Outcome, Split, encode_error, handle_batch
from serve.api.config import (
    CANDIDATE_SLOWDOWN_MAX,
    DeltaWiring,
    HandlerConfig,
    cache_on_cpu_from_env,
    candidate_slowdown_from_env,
)
from serve.common.cpu import choose_threads
from serve.common.validate import number_in_range
from serve.constants import ARTIFACT_NAME
from serve.errors import ServeError
from serve.metrics import HandlerMetrics, clean_dead_worker_files
from serve.runtime.engine import Runtime, RuntimeConfig
from serve.runtime.follower import DeltaFollower
from serve.runtime.shared import SharedTables
from serve.runtime.warmup import warm_up
from serve.settings import PROMETHEUS_MULTIPROC_DIR
from serve.state import parse_serving_version
from serve.store.deltas.files import DeltaStore
from serve.store.predlog import Prediction, PredictionLogConfig, PredictionLogWriter
from serve.store.routing import ARM_HEADER, ControlWatcher, takes_candidate
from serve.worker.messages import (
    BATCH_INSTANCES_HEADER,
    BATCH_REQUESTS_HEADER,
    MODEL_VERSION_HEADER,
    TS_BATCH_HEADER,
    WorkerRequest,
    WorkerResponse,
)

__all__ = ["Worker", "model_version", "runtime_config", "worker_device"]

logger = logging.getLogger(__name__)


@dataclass
class _CacheTotals:
    """Cache statistics summed over the runtimes (stable + candidate), in the shape
    :meth:`HandlerMetrics.set_cache` reads, plus ``wrapped`` per feature (for
    ``set_wrapped``) and each runtime's ``fallback`` per feature by model version (for
    ``set_fallback``); sums of cumulative counts stay cumulative."""

    hits: int
    misses: int
    evictions: int
    device_bytes: int
    host_bytes: int
    wrapped: tuple[int, ...]
    fallback: dict[str, tuple[int, ...]] = field(default_factory=dict)



def runtime_config(cfg: HandlerConfig, *, device: str | torch.device, threads: int,
                   cache_on_cpu: bool = False) -> RuntimeConfig:
    """The runtime settings a worker serves an archive's handler config ``cfg`` with: what
    the in-process references of the benchmarks must use too."""
    return RuntimeConfig(
        device=str(device), cache_load_factor=cfg.cache_load_factor,
        cache_bytes=cfg.cache_bytes, cache_policy=cfg.cache_policy,
        num_threads=threads, max_forward_instances=cfg.max_forward_instances,
        cache_on_cpu=cache_on_cpu, dense_precision=cfg.dense_precision)


def _set_torch_threads(workers: int, cfg: HandlerConfig, env: Mapping[str, str]) -> int:
    """Set this process's torch threads (and one inter-op thread); return the count.

    ``handler.num_threads``, else ``OMP_NUM_THREADS``, else the pod's CPU budget (cgroup
    quota, not the node's cores) / workers: :func:`serve.common.cpu.choose_threads`.
    """
    choice = choose_threads(workers, cfg.num_threads, environ=env)
    threads = choice.threads
    logger.log(logging.WARNING if choice.oversubscribed else logging.INFO,
               "threads: %s", choice.describe())
    torch.set_num_threads(threads)
    # Inter-op threads only matter for forks in the graph; one is enough. RuntimeError:
    # already set, or parallel work has started: keep it.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return threads


def _shared_tables(store: DeltaStore | None, deltas: DeltaWiring | None,
                   version: str) -> SharedTables | None:
    """The pod-wide shared table of ``version``'s rows, when deltas are wired with
    shared tables; else None (each runtime keeps its own rows)."""
    if store is None or deltas is None or not deltas.shared_tables:
        return None
    return SharedTables(store.folder(version) / "tables.bin", store.last_sequence(version))


def _load_candidate(model_dir: str | os.PathLike[str], cfg: HandlerConfig,
                    runtime_cfg: RuntimeConfig,
                    shared_for: Callable[[str], SharedTables | None], model_version: str
                    ) -> tuple[Runtime | None, ControlWatcher | None, random.Random | None]:
    """A rollout's candidate runtime, the watcher of its control file and the random
    source for requests without a route key; three Nones without a rollout."""
    rollout = cfg.rollout
    if rollout is None:
        return None, None, None
    candidate = Runtime.from_artifact(
        os.path.join(model_dir, rollout.candidate_artifact), runtime_cfg,
        shared=shared_for(rollout.candidate_version))
    watcher = ControlWatcher(rollout.control_file)
    # Requests without a route key are routed at random: seeded per worker (its
    # pid), so workers draw independently and one worker's draws are reproducible.
    rng = random.Random(os.getpid())
    control = watcher.current()
    logger.info("rollout: stable=%s candidate=%s (%s) control=%s (now mode=%s "
                "weight=%.4g)", model_version, rollout.candidate_version,
                rollout.candidate_artifact, rollout.control_file, control.mode,
                control.weight)
    return candidate, watcher, rng


def _open_prediction_log(env: Mapping[str, str]) -> PredictionLogWriter | None:
    """The prediction log (serve.store.predlog) that POST /feedback joins labels with; its
    folder comes from TorchServe's environment (the launcher / the Deployment)."""
    log_cfg = PredictionLogConfig.from_env(env)
    if log_cfg is None:
        return None
    predlog = PredictionLogWriter(log_cfg)
    logger.info("prediction log: %s (sample %.3g, %d-byte files, %d bytes at most)",
                log_cfg.directory, log_cfg.sample_rate, log_cfg.file_bytes,
                log_cfg.max_bytes)
    return predlog


class Worker:
    """One worker's models, rollout split, delta followers, prediction log and metrics.

    Build it with :meth:`load` (from an archive's model dir); the constructor takes the
    parts ready-made, for tests and for callers that load runtimes themselves.

    Args:
        runtime: the stable model (the version ``model_version``).
        cfg: the archive's ``handler:`` section (limits; ``debug_delay_ms``).
        model_version: the stable model's repository version (``X-DLRM-Model-Version``,
            the metrics' ``version`` label).
        candidate: a rollout's candidate runtime, with ``candidate_version`` and the
            ``watcher`` of its control file; None: no rollout.
        rng: routes requests without a route key (default ``random.Random(0)``;
            :meth:`load` seeds it with the pid).
        predlog: where scored requests are logged; None: not logged.
        metrics: the handler metrics (default: a fresh :class:`HandlerMetrics`).
        clock: seconds for durations; wall: epoch seconds for the prediction log.
        candidate_slowdown: TESTS AND BENCHMARKS ONLY: the candidate's forwards take this
            many times their time (>= 1); default ``cfg.debug_candidate_slowdown``.
    """

    def __init__(self, runtime: Runtime, cfg: HandlerConfig, *, model_version: str,
                 candidate: Runtime | None = None, candidate_version: str | None = None,
                 watcher: ControlWatcher | None = None, rng: random.Random | None = None,
                 predlog: PredictionLogWriter | None = None,
                 metrics: HandlerMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time,
                 candidate_slowdown: float | None = None) -> None:
        if (candidate is None) != (candidate_version is None) or (
                candidate is not None and watcher is None):
            raise ValueError("Worker: a rollout needs candidate, candidate_version and "
                             "watcher together; give all three or none")
        self.runtime = runtime
        self.candidate = candidate
        self.candidate_version = candidate_version
        self.watcher = watcher
        self.cfg = cfg
        self.model_version = model_version
        self.predlog = predlog
        self.metrics = metrics if metrics is not None else HandlerMetrics()
        self.followers: list[DeltaFollower] = []
        self._rng = rng if rng is not None else random.Random(0)
        self._clock, self._wall = clock, wall
        self._batches = 0  # batches split between the arms (their forward order alternates)
        self.candidate_slowdown = (cfg.debug_candidate_slowdown if candidate_slowdown is None
                                   else float(candidate_slowdown))
        number_in_range("candidate_slowdown", self.candidate_slowdown, 1,
                        CANDIDATE_SLOWDOWN_MAX, then=" (1.0 = off)", error=ValueError)
        # Held for each batch; a delta is applied between two batches under it.
        self._batch_lock = threading.Lock()
        self._last_stages = self._stage_seconds()
        #: Per version, the features of managed tables: they get fallback-row series.
        self._managed = self._managed_features()
        # The series exist (at 0) before the first fallback, so rate() works from the start.
        self._record_fallback(self._cache_stats(), count=False)

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str], cfg: HandlerConfig, *,
             model_version: str, device: str | torch.device = "cpu", workers: int = 1,
             environ: Mapping[str, str] | None = None,
             metrics: HandlerMetrics | None = None, freeze_gc: bool = True) -> Worker:
        """Load a worker from an archive's model dir (``artifact.pt``, and a rollout's
        candidate artifact where ``cfg.rollout`` names one).

        Args:
            model_dir: the unpacked archive.
            cfg: its ``handler:`` section.
            model_version: the stable model's repository version (:func:`model_version`).
            device: where the runtimes run (:func:`worker_device`).
            workers: the model's workers in this pod: torch threads = CPU budget /
                workers unless ``cfg.num_threads`` or ``OMP_NUM_THREADS`` says otherwise
                (:func:`serve.common.cpu.choose_threads`). Sets the process's torch threads.
            environ: the environment to read (``DLRM_CACHE_ON_CPU``, ``DLRM_DELTA_*``,
                ``DLRM_PREDICTION_LOG_*``, ``PROMETHEUS_MULTIPROC_DIR``,
                ``OMP_NUM_THREADS``, and for tests ``DLRM_DEBUG_CANDIDATE_SLOWDOWN``);
                default ``os.environ``.
            metrics: default a fresh :class:`HandlerMetrics`, after the files of dead
                workers in ``PROMETHEUS_MULTIPROC_DIR`` are cleaned.
            freeze_gc: move everything allocated so far (torch, the model) out of the
                cyclic collector's reach (``gc.freeze``): it lives as long as the worker
                process, and collections stay cheap (see
                ``serve.api.json_body._gc_paused`` for the measured cost). Off in tests
                that load workers in a longer-lived process.
        Raises:
            ConfigError: a setting in ``cfg`` or ``environ`` breaks its rule.
        """
        env = os.environ if environ is None else environ
        threads = _set_torch_threads(workers, cfg, env)
        runtime_cfg = runtime_config(cfg, device=device, threads=threads,
                                     cache_on_cpu=cache_on_cpu_from_env(env))
        deltas = DeltaWiring.from_env(env)
        store = DeltaStore(deltas.directory) if deltas is not None else None
        slowdown = candidate_slowdown_from_env(env, cfg.debug_candidate_slowdown)

        def shared_for(version: str) -> SharedTables | None:
            return _shared_tables(store, deltas, version)

        runtime = Runtime.from_artifact(os.path.join(model_dir, ARTIFACT_NAME), runtime_cfg,
                                        shared=shared_for(model_version))
        rollout = cfg.rollout
        candidate, watcher, rng = _load_candidate(model_dir, cfg, runtime_cfg, shared_for,
                                                  model_version)
        predlog = _open_prediction_log(env)
        if metrics is None:
            _clean_metric_files(env)
            metrics = HandlerMetrics()
        worker = cls(runtime, cfg, model_version=model_version, candidate=candidate,
                     candidate_version=rollout.candidate_version if rollout else None,
                     watcher=watcher, rng=rng, predlog=predlog, metrics=metrics,
                     candidate_slowdown=slowdown)
        if slowdown != 1.0:
            logger.warning("TEST ONLY: the candidate's forwards are slowed %.3gx "
                           "(debug_candidate_slowdown / DLRM_DEBUG_CANDIDATE_SLOWDOWN)",
                           slowdown)
        if store is not None and deltas is not None:
            worker.follow_deltas(store, deltas)
        worker.warm_up(cfg.warmup_batches)
        worker._last_stages = worker._stage_seconds()
        if freeze_gc:
            gc.collect()
            gc.freeze()
        logger.info("DLRM handler ready: version=%s candidate=%s device=%s threads=%d "
                    "config=%s pid=%d", model_version, worker.candidate_version,
                    runtime_cfg.device, threads, cfg, os.getpid())
        return worker

    def follow_deltas(self, store: DeltaStore, wiring: DeltaWiring) -> None:
        """One follower per served version (stable, candidate): every delta already in
        the store is applied before the first batch, later ones between batches by a
        background thread (serve.runtime.follower)."""
        pairs = [(self.model_version, self.runtime)]
        if self.candidate is not None and self.candidate_version is not None:
            pairs.append((self.candidate_version, self.candidate))
        for version, rt in pairs:
            f = DeltaFollower(store, version, rt, self._batch_lock)
            n = f.catch_up()
            f.write_status()
            f.start(wiring.poll_s)
            self.followers.append(f)
            logger.info("deltas: following %s in %s (%d applied at start, sequence %d, "
                        "shared tables %s)", version, store.folder(version), n, f.applied,
                        rt.shared.path if rt.shared is not None else "off")

    def warm_up(self, batches: int) -> float:
        """``batches`` forwards of generated batches through each runtime (stable, then
        the candidate), under the batch guard (a delta follower may run already); then
        the metrics take the runtimes' counters as their starting point, so the warm-up
        counts nowhere. Returns the seconds it took (logged). 0: nothing."""
        if batches <= 0:
            return 0.0
        t0 = time.perf_counter()
        each = []
        with self._batch_guard():
            for rt in self._runtimes():
                each.append(warm_up(rt, batches))
        seconds = time.perf_counter() - t0
        self._last_stages = self._stage_seconds()
        stats = self._cache_stats()
        self.metrics.skip_cache(stats, self.runtime.feature_names, stats.wrapped)
        self._record_fallback(stats, count=False)
        logger.info("warm-up: %d forwards per runtime in %.3f s (%s)", batches, seconds,
                    ", ".join(f"{v}: {t:.3f} s" for v, t in zip(
                        (self.model_version, self.candidate_version), each, strict=False)))
        return seconds

    def close(self) -> None:
        """Stop the delta followers' threads (TorchServe never calls it: a worker ends
        with its process)."""
        for f in self.followers:
            f.stop()

    def handle(self, requests: Sequence[WorkerRequest]) -> list[WorkerResponse]:
        """Answer one batch: one response per request, in order (see the module
        docstring). Never raises: a bug answers every request 500 JSON (logged), and
        metrics or the prediction log failing touch no response."""
        t0 = self._clock()
        try:
            with self._batch_guard():
                # The stable model's request schema; a rollout's candidate is served with
                # it (the sidecar refuses one that differs).
                outcomes, info = handle_batch(
                    [r.body for r in requests], [r.content_type for r in requests],
                    self._predict, self.cfg, route_keys=[r.route_key for r in requests],
                    split=self._split(), schema=self.runtime.schema)
        except Exception:  # a bug, not bad input: answer 500 JSON, keep the worker alive
            logger.exception("DLRM handler failed on a batch of %d requests", len(requests))
            err = ServeError("internal error while predicting; see the TorchServe model log")
            outcomes, info = [Outcome(500, encode_error(err)) for _ in requests], None
        seconds = self._clock() - t0
        responses = [self._response(out, info, len(requests)) for out in outcomes]
        self._record(outcomes, info, seconds)
        if info is not None and self.predlog is not None:
            self._log_predictions(info, [r.request_id for r in requests])
        return responses

    def _response(self, out: Outcome, info: BatchInfo | None, batch: int) -> WorkerResponse:
        headers = {TS_BATCH_HEADER: str(batch), MODEL_VERSION_HEADER: self._version_of(out.arm)}
        if out.arm is not None:
            headers[ARM_HEADER] = out.arm
        if info is not None:
            run = info.arms.get(out.arm) if out.arm is not None else None
            instances = run.instances if run is not None else info.instances
            requests = run.requests if run is not None else info.requests
            headers[BATCH_INSTANCES_HEADER] = str(instances)
            headers[BATCH_REQUESTS_HEADER] = str(requests)
        return WorkerResponse(out.status, out.body, headers)

    @contextlib.contextmanager
    def _batch_guard(self) -> Iterator[None]:
        """A batch's hold on the tables: the worker's batch lock, and the read side of
        each shared table (no delta lands in any worker while this batch runs)."""
        with self._batch_lock, contextlib.ExitStack() as stack:
            for rt in self._runtimes():
                if rt.shared is not None:
                    stack.enter_context(rt.shared.read())
            yield

    def _forward(self, runtime: Runtime, batch: MergedBatch) -> np.ndarray:
        if self.cfg.debug_delay_ms:  # tests only: a slow model, so the queue fills up
            time.sleep(self.cfg.debug_delay_ms / 1000.0)
        return runtime.predict_arrays(batch.dense, batch.values, batch.lengths)

    def _predict(self, batch: MergedBatch) -> np.ndarray:
        """The stable model: MergedBatch -> float32 (B,) probabilities."""
        return self._forward(self.runtime, batch)

    def _predict_candidate(self, batch: MergedBatch) -> np.ndarray:
        """The rollout's candidate: MergedBatch -> float32 (B,) probabilities."""
        if self.candidate is None:
            raise RuntimeError("no rollout candidate is loaded")
        if self.candidate_slowdown == 1.0:
            return self._forward(self.candidate, batch)
        t0 = time.perf_counter()
        out = self._forward(self.candidate, batch)
        # TESTS ONLY (debug_candidate_slowdown): a model this many times slower.
        _spin((self.candidate_slowdown - 1.0) * (time.perf_counter() - t0))
        return out

    def _split(self) -> Split | None:
        """This batch's split: the control read once (None without a rollout)."""
        if self.watcher is None or self.candidate is None:
            return None
        control = self.watcher.current()
        rng, weight = self._rng, control.weight
        # Canary: the arms take turns at running first (the second forward runs warm).
        self._batches += 1
        return Split(mode=control.mode, candidate=self._predict_candidate,
                     choose=lambda key: takes_candidate(key, weight, rng),
                     candidate_first=self._batches % 2 == 0)

    def _log_predictions(self, info: BatchInfo, request_ids: Sequence[str | None]) -> None:
        """Every scored request of the batch (answered, or shadow-scored: arm
        ``candidate``) into the prediction log, keyed by its request id. Never fails a
        prediction: logged."""
        try:
            now, preds = self._wall(), []
            for run in info.arms.values():
                if run.scores is None:
                    continue
                version, start = self._version_of(run.arm), 0
                for idx, size in zip(run.indices, run.sizes, strict=True):
                    rid = request_ids[idx]
                    if rid:
                        preds.append(Prediction(str(rid), version, run.arm, now,
                                                run.scores[start:start + size]))
                    start += size
            written = self.predlog.write(preds) if self.predlog is not None else 0
            if written:
                self.metrics.observe_logged(written)
        except Exception:  # the log must never fail a prediction
            logger.exception("writing the prediction log failed")

    def _version_of(self, arm: str | None) -> str:
        """The model version of an arm (the stable version for no arm)."""
        if arm == "candidate" and self.candidate_version is not None:
            return self.candidate_version
        return self.model_version

    def _runtimes(self) -> list[Runtime]:
        return [r for r in (self.runtime, self.candidate) if r is not None]

    def _stage_seconds(self) -> dict[str, float]:
        """Cumulative seconds per stage, summed over the worker's runtimes."""
        total: dict[str, float] = {}
        for rt in self._runtimes():
            for k, v in rt.stats().stage_seconds.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def _cache_stats(self) -> _CacheTotals:
        """Cache statistics summed over the runtimes (stable + candidate)."""
        names = ("hits", "misses", "evictions", "device_bytes", "host_bytes")
        total = dict.fromkeys(names, 0)
        wrapped = [0] * len(self.runtime.feature_names)
        fallback: dict[str, tuple[int, ...]] = {}
        for version, rt in self._versions():
            st = rt.stats()
            for name in names:
                total[name] += int(getattr(st, name))
            for i, n in enumerate(st.wrapped):
                wrapped[i] += n
            if self._managed.get(version):
                fallback[version] = st.fallback
        return _CacheTotals(**total, wrapped=tuple(wrapped), fallback=fallback)

    def _versions(self) -> list[tuple[str, Runtime]]:
        """(model version, runtime) of the stable model and a rollout's candidate."""
        out = [(self.model_version, self.runtime)]
        if self.candidate is not None and self.candidate_version is not None:
            out.append((self.candidate_version, self.candidate))
        return out

    def _managed_features(self) -> dict[str, frozenset[str]]:
        """Per model version, the features that read a managed table
        (serve.runtime.idmap): the ones with ``dlrm_embedding_ids_fallback_total``
        series (a version without any is left out)."""
        out: dict[str, frozenset[str]] = {}
        for version, rt in self._versions():
            tables = rt.schema.tables
            names = frozenset(f.name for f, t in zip(rt.schema.features,
                                                     rt.schema.feature_tables, strict=True)
                              if tables[t].mapping == "managed")
            if names:
                out[version] = names
        return out

    def _record_fallback(self, stats: _CacheTotals, *, count: bool = True) -> None:
        """Each runtime's fallback lookups under its model version (``count=False``: the
        starting point, after the warm-up)."""
        for version, fallback in stats.fallback.items():
            self.metrics.set_fallback(version, self.runtime.feature_names, fallback,
                                      self._managed[version], count=count)

    def _record(self, outcomes: list[Outcome], info: BatchInfo | None, seconds: float) -> None:
        try:
            # The batch's time once (every request's histogram sample repeats it): the
            # work the HPA's utilization signal counts, failed batches included.
            self.metrics.observe_work(seconds)
            if info is not None:
                self.runtime.record_stage("decode", info.decode_s)
            by_status: dict[int, list[int]] = {}  # status -> [requests, instances]
            for out in outcomes:
                tally = by_status.setdefault(out.status, [0, 0])
                tally[0] += 1
                tally[1] += out.instances
            for status, (requests, instances) in by_status.items():
                self.metrics.observe_requests(status, requests, instances, seconds)
            if info is None:
                return
            self._record_arms(info)
            if info.requests:
                self.metrics.observe_batch(info.instances, info.requests)
                now = self._stage_seconds()
                self.metrics.observe_stages({k: v - self._last_stages.get(k, 0.0)
                                             for k, v in now.items()})
                self._last_stages = now
                stats = self._cache_stats()
                self.metrics.set_cache(stats)
                self.metrics.set_wrapped(self.runtime.feature_names, stats.wrapped)
                self._record_fallback(stats)
        except Exception:  # metrics must never fail a prediction
            logger.exception("recording DLRM metrics failed")

    def _record_arms(self, info: BatchInfo) -> None:
        """Per-arm series: each arm that ran a forward, with its model version; every
        request of a failed forward is an error of its arm. Seconds per request = the
        batch's decode time + the arm's forward time; forward seconds per instance (what
        the rollout's latency guard compares) = the arm's forward time / its instances,
        for forwards that succeeded."""
        try:
            for run in info.arms.values():
                per_instance = (run.forward_s / run.instances
                                if not run.failed and run.instances else None)
                self.metrics.observe_arm(
                    run.arm, self._version_of(run.arm), run.requests,
                    run.requests if run.failed else 0, info.decode_s + run.forward_s,
                    run.scores, forward_seconds_per_instance=per_instance)
            if info.shadow_diff is not None and self.candidate_version is not None:
                self.metrics.observe_shadow_diff(self.candidate_version, info.shadow_diff)
        except Exception:  # metrics must never fail a prediction
            logger.exception("recording the per-arm DLRM metrics failed")


def _spin(seconds: float) -> None:
    """Busy-wait ``seconds`` (the test-only candidate slowdown). Not ``time.sleep``: a
    slower model keeps its core busy, and on a loaded machine a sleeping thread wakes up
    late (measured: a 1.5x slowdown by sleep read as 2.4x on 2 shared cores)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _clean_metric_files(environ: Mapping[str, str]) -> None:
    """Before this worker's metrics start: fold the prometheus_client files of dead
    workers in PROMETHEUS_MULTIPROC_DIR (serve.metrics.clean_dead_worker_files), so they
    do not pile up in the pod's 64 MiB tmpfs. Never fails the worker: logged."""
    mp_dir = PROMETHEUS_MULTIPROC_DIR.get(environ)
    if not mp_dir:
        return
    try:
        logger.info("metric files: %s", clean_dead_worker_files(mp_dir).describe())
    except Exception:  # metrics must never keep a worker from serving
        logger.exception("cleaning dead workers' metric files in %s failed", mp_dir)


def model_version(manifest: Mapping[str, Any] | None) -> str:
    """The repository version named by a .mar's manifest: ``modelVersion`` itself, or
    ``V`` when it is a serving version ``V_b..d..w..`` the sidecar derived (``unknown``
    without one)."""
    raw = str(((manifest or {}).get("model") or {}).get("modelVersion") or "")
    parsed = parse_serving_version(raw)
    return parsed[0] if parsed else (raw or "unknown")


def worker_device(gpu_id: int | str | None) -> torch.device:
    """The device of a worker TorchServe assigned ``gpu_id``: ``cuda:<gpu_id>`` when CUDA
    is there and an id is given, else the CPU."""
    if torch.cuda.is_available() and gpu_id is not None:
        return torch.device(f"cuda:{gpu_id}")
    return torch.device("cpu")
