"""The serving worker: everything one TorchServe worker process owns, without TorchServe.

A :class:`Worker` composes the parts that own a worker's state: the models and the
rollout split (:class:`~serve.worker.arms.Arms`: the stable model's
:class:`~serve.runtime.engine.Runtime` and, in a rollout, the candidate's, with the
control file), the batch guard and the delta followers (:mod:`serve.worker.deltas`), and
the recorders of the handler metrics and the prediction log
(:mod:`serve.worker.recording`).
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
  probabilities are split back in order (:func:`serve.worker.arms.handle_batch`). Each
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

Deltas (:mod:`serve.store.deltas`): with ``DLRM_DELTA_DIR`` in the environment, one
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
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from serve.api.batch import Outcome, encode_error
from serve.api.config import (
    CANDIDATE_SLOWDOWN_MAX,
    DeltaWiring,
    HandlerConfig,
    cache_on_cpu_from_env,
    candidate_slowdown_from_env,
    host_budget_from_env,
)
from serve.common.cpu import choose_threads
from serve.common.validate import number_in_range
from serve.constants import ARTIFACT_NAME
from serve.errors import ServeError
from serve.metrics.multiprocess import clean_dead_worker_files
from serve.metrics.worker import HandlerMetrics, ReuseMetrics
from serve.runtime.artifact import tables_search_path
from serve.runtime.engine import Runtime, RuntimeConfig
from serve.runtime.follower import DeltaFollower
from serve.runtime.shared import SharedTables
from serve.runtime.warmup import warm_up
from serve.settings import PROMETHEUS_MULTIPROC_DIR
from serve.state import parse_serving_version
from serve.store.deltas.files import DeltaStore
from serve.store.predlog import PredictionLogConfig, PredictionLogWriter
from serve.store.routing import ARM_HEADER, ControlWatcher
from serve.worker.arms import Arms, BatchInfo
from serve.worker.deltas import BatchGuard, DeltaFollowers
from serve.worker.messages import (
    BATCH_INSTANCES_HEADER,
    BATCH_REQUESTS_HEADER,
    MODEL_VERSION_HEADER,
    TS_BATCH_HEADER,
    WorkerRequest,
    WorkerResponse,
)
from serve.worker.recording import (
    BatchRecorder,
    PredictionRecorder,
    ReuseRecorder,
    reuse_sample_from_env,
)

__all__ = ["Worker", "model_version", "runtime_config", "worker_device"]

logger = logging.getLogger(__name__)


def runtime_config(cfg: HandlerConfig, *, device: str | torch.device, threads: int,
                   cache_on_cpu: bool = False) -> RuntimeConfig:
    """The runtime settings a worker serves an archive's handler config ``cfg`` with: what
    the in-process references of the benchmarks must use too."""
    return RuntimeConfig(
        device=str(device), cache_load_factor=cfg.cache_load_factor,
        cache_bytes=cfg.cache_bytes, cache_policy=cfg.cache_policy,
        num_threads=threads, max_forward_instances=cfg.max_forward_instances,
        cache_on_cpu=cache_on_cpu, dense_precision=cfg.dense_precision,
        host_cache_bytes=cfg.host_cache_bytes, host_cache_fraction=cfg.host_cache_fraction,
        disk_read_threads=cfg.disk_read_threads)


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
                    shared_for: Callable[[str], SharedTables | None], model_version: str,
                    tables_path: list[Path]
                    ) -> tuple[Runtime | None, ControlWatcher | None, random.Random | None]:
    """A rollout's candidate runtime, the watcher of its control file and the random
    source for requests without a route key; three Nones without a rollout."""
    rollout = cfg.rollout
    if rollout is None:
        return None, None, None
    candidate = Runtime.from_artifact(
        os.path.join(model_dir, rollout.candidate_artifact), runtime_cfg,
        shared=shared_for(rollout.candidate_version), tables_path=tables_path)
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

    Its parts, each owning its state: :attr:`arms` (the runtimes and the split),
    :attr:`guard` (the batch lock), :attr:`deltas` (the followers), :attr:`recorder` (the
    metrics) and :attr:`prediction_log` (None without one).
    """

    def __init__(self, runtime: Runtime, cfg: HandlerConfig, *, model_version: str,
                 candidate: Runtime | None = None, candidate_version: str | None = None,
                 watcher: ControlWatcher | None = None, rng: random.Random | None = None,
                 predlog: PredictionLogWriter | None = None,
                 metrics: HandlerMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time,
                 candidate_slowdown: float | None = None) -> None:
        slowdown = (cfg.debug_candidate_slowdown if candidate_slowdown is None
                    else float(candidate_slowdown))
        self.arms = Arms(runtime, model_version, candidate=candidate,
                         candidate_version=candidate_version, watcher=watcher, rng=rng,
                         debug_delay_ms=cfg.debug_delay_ms, candidate_slowdown=slowdown)
        number_in_range("candidate_slowdown", slowdown, 1,
                        CANDIDATE_SLOWDOWN_MAX, then=" (1.0 = off)", error=ValueError)
        self.cfg = cfg
        self.metrics = metrics if metrics is not None else HandlerMetrics()
        self.prediction_log = (
            PredictionRecorder(predlog, self.arms.version_of, self.metrics, wall)
            if predlog is not None else None)
        self.guard = BatchGuard(self.arms.runtimes())
        self.deltas = DeltaFollowers()
        self.recorder = BatchRecorder(self.arms, self.metrics)
        #: The capacity advisor's sampler of the stable model's ids (None: off);
        #: :meth:`load` sets it from DLRM_REUSE_SAMPLE.
        self.reuse: ReuseRecorder | None = None
        self._clock = clock

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
            environ: the environment to read (``DLRM_REPOSITORY``: where the versions'
                tables folders are; ``DLRM_CACHE_ON_CPU``, ``DLRM_DELTA_*``,
                ``DLRM_REUSE_SAMPLE``,
                ``DLRM_PREDICTION_LOG_*``, ``PROMETHEUS_MULTIPROC_DIR``,
                ``OMP_NUM_THREADS``, and for tests ``DLRM_DEBUG_CANDIDATE_SLOWDOWN``);
                default ``os.environ``.
            metrics: default a fresh :class:`HandlerMetrics`, after the files of dead
                workers in ``PROMETHEUS_MULTIPROC_DIR`` are cleaned.
            freeze_gc: move everything allocated so far (torch, the model) out of the
                cyclic collector's reach (``gc.freeze``): it lives as long as the worker
                process, and collections stay cheap (see
                ``serve.api.json_body.gc_paused`` for the measured cost). Off in tests
                that load workers in a longer-lived process.
        Raises:
            ConfigError: a setting in ``cfg`` or ``environ`` breaks its rule.
        """
        env = os.environ if environ is None else environ
        cfg = host_budget_from_env(cfg, env)
        threads = _set_torch_threads(workers, cfg, env)
        runtime_cfg = runtime_config(cfg, device=device, threads=threads,
                                     cache_on_cpu=cache_on_cpu_from_env(env))
        deltas = DeltaWiring.from_env(env)
        store = DeltaStore(deltas.directory) if deltas is not None else None
        slowdown = candidate_slowdown_from_env(env, cfg.debug_candidate_slowdown)
        rate = reuse_sample_from_env(env)

        def shared_for(version: str) -> SharedTables | None:
            return _shared_tables(store, deltas, version)

        tables_path = tables_search_path(env)
        runtime = Runtime.from_artifact(os.path.join(model_dir, ARTIFACT_NAME), runtime_cfg,
                                        shared=shared_for(model_version),
                                        tables_path=tables_path)
        rollout = cfg.rollout
        candidate, watcher, rng = _load_candidate(model_dir, cfg, runtime_cfg, shared_for,
                                                  model_version, tables_path)
        predlog = _open_prediction_log(env)
        if metrics is None:
            _clean_metric_files(env)
            metrics = HandlerMetrics()
        worker = cls(runtime, cfg, model_version=model_version, candidate=candidate,
                     candidate_version=rollout.candidate_version if rollout else None,
                     watcher=watcher, rng=rng, predlog=predlog, metrics=metrics,
                     candidate_slowdown=slowdown)
        if rate > 0:
            worker.reuse = ReuseRecorder(runtime.schema, rate, ReuseMetrics(metrics.registry))
        if slowdown != 1.0:
            logger.warning("TEST ONLY: the candidate's forwards are slowed %.3gx "
                           "(debug_candidate_slowdown / DLRM_DEBUG_CANDIDATE_SLOWDOWN)",
                           slowdown)
        if store is not None and deltas is not None:
            worker.follow_deltas(store, deltas)
        worker.warm_up(cfg.warmup_batches)
        worker.recorder.restart_stages()
        if freeze_gc:
            gc.collect()
            gc.freeze()
        logger.info("DLRM handler ready: version=%s candidate=%s device=%s threads=%d "
                    "config=%s pid=%d", model_version, worker.candidate_version,
                    runtime_cfg.device, threads, cfg, os.getpid())
        return worker


    @property
    def runtime(self) -> Runtime:
        """The stable model."""
        return self.arms.stable

    @property
    def candidate(self) -> Runtime | None:
        """A rollout's candidate model (None: no rollout)."""
        return self.arms.candidate

    @property
    def candidate_version(self) -> str | None:
        return self.arms.candidate_version

    @property
    def model_version(self) -> str:
        return self.arms.model_version

    @property
    def candidate_slowdown(self) -> float:
        return self.arms.candidate_slowdown

    @property
    def followers(self) -> list[DeltaFollower]:
        return self.deltas.followers

    def follow_deltas(self, store: DeltaStore, wiring: DeltaWiring) -> None:
        """One follower per served version (stable, candidate): every delta already in
        the store is applied before the first batch, later ones between batches by a
        background thread (serve.runtime.follower)."""
        self.deltas.follow(store, wiring, self.arms.versions(), self.guard.lock)

    def warm_up(self, batches: int) -> float:
        """``batches`` forwards of generated batches through each runtime (stable, then
        the candidate), under the batch guard (a delta follower may run already); then
        the metrics take the runtimes' counters as their starting point, so the warm-up
        counts nowhere. Returns the seconds it took (logged). 0: nothing."""
        if batches <= 0:
            return 0.0
        t0 = time.perf_counter()
        each = []
        with self.guard.hold():
            for rt in self.arms.runtimes():
                each.append(warm_up(rt, batches))
        seconds = time.perf_counter() - t0
        self.recorder.start_here()
        logger.info("warm-up: %d forwards per runtime in %.3f s (%s)", batches, seconds,
                    ", ".join(f"{v}: {t:.3f} s" for v, t in zip(
                        (self.model_version, self.candidate_version), each, strict=False)))
        return seconds

    def close(self) -> None:
        """Stop the delta followers' threads (TorchServe never calls it: a worker ends
        with its process)."""
        self.deltas.close()

    def handle(self, requests: Sequence[WorkerRequest]) -> list[WorkerResponse]:
        """Answer one batch: one response per request, in order (see the module
        docstring). Never raises: a bug answers every request 500 JSON (logged), and
        metrics or the prediction log failing touch no response."""
        t0 = self._clock()
        try:
            with self.guard.hold():
                outcomes, info = self.arms.run(requests, self.cfg)
        except Exception:  # a bug, not bad input: answer 500 JSON, keep the worker alive
            logger.exception("DLRM handler failed on a batch of %d requests", len(requests))
            err = ServeError("internal error while predicting; see the TorchServe model log")
            outcomes, info = [Outcome(500, encode_error(err)) for _ in requests], None
        seconds = self._clock() - t0
        responses = [self._response(out, info, len(requests)) for out in outcomes]
        self.recorder.record(outcomes, info, seconds)
        ids = self.arms.take_ids()
        if ids is not None and self.reuse is not None:
            self.reuse.observe(*ids)
        if info is not None and self.prediction_log is not None:
            self.prediction_log.record(info, [r.request_id for r in requests])
        return responses

    def _response(self, out: Outcome, info: BatchInfo | None, batch: int) -> WorkerResponse:
        headers = {TS_BATCH_HEADER: str(batch),
                   MODEL_VERSION_HEADER: self.arms.version_of(out.arm)}
        if out.arm is not None:
            headers[ARM_HEADER] = out.arm
        if info is not None:
            run = info.arms.get(out.arm) if out.arm is not None else None
            instances = run.instances if run is not None else info.instances
            requests = run.requests if run is not None else info.requests
            headers[BATCH_INSTANCES_HEADER] = str(instances)
            headers[BATCH_REQUESTS_HEADER] = str(requests)
        return WorkerResponse(out.status, out.body, headers)


def _clean_metric_files(environ: Mapping[str, str]) -> None:
    """Before this worker's metrics start: fold the prometheus_client files of dead
    workers in PROMETHEUS_MULTIPROC_DIR
    (serve.metrics.multiprocess.clean_dead_worker_files), so they do not pile up in the
    pod's 64 MiB tmpfs. Never fails the worker: logged."""
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
