"""TorchServe handler for the quantized DLRM: a thin adapter over ``serve``.

* ``initialize``: picks the device (the worker's ``gpu_id`` when CUDA is there, else
  CPU), sets torch threads per worker (cores / workers unless configured: more
  oversubscribes the cores), reads the ``handler:`` section of the .mar's
  model-config.yaml into :class:`serve.api.protocol.HandlerConfig`, and loads the artifact
  into :class:`serve.runtime.engine.Runtime`.
* ``handle``: one TorchServe batch = several HTTP requests. Each body is parsed and
  validated on its own (a bad one gets its own 4xx JSON; the others go on), the good
  ones run as ONE forward, and the probabilities are split back in order. Each response
  carries ``X-DLRM-Batch-Instances`` / ``X-DLRM-Batch-Requests`` (samples and requests
  of the merged forward) and ``X-DLRM-TorchServe-Batch`` (requests TorchServe handed
  over together, bad ones included): observable batching. Every response, errors
  included, carries ``X-DLRM-Model-Version``: the repository version of the model that
  answered (the archive's ``modelVersion``; for the archives the sidecar derives,
  ``<version>_b..d..w..``, the ``<version>`` part, see :mod:`serve.state`).
* Bodies: JSON (``application/json`` or no Content-Type) or binary columnar
  (``application/x-dlrm-columnar``, see :mod:`serve.api.protocol`); the Content-Type of each
  request picks the decoder, anything else gets 415. Responses are always JSON.

Rollouts (canary / shadow, :mod:`serve.routing`): when the model config's ``handler:``
section has ``rollout:`` (:class:`serve.api.protocol.RolloutWiring`, written by the
sidecar into the archives it derives), ``initialize`` loads the candidate's artifact
beside the stable one (same runtime settings) and watches the control file. ``handle``
reads the control once per batch (a batch sees one value) and splits the batch:

* ``canary``: each request that parsed takes the candidate when
  :func:`serve.routing.takes_candidate` says so (by its ``X-DLRM-Route-Key`` hash, else
  at random), ONE merged forward per non-empty arm, responses in request order. A
  forward that raises fails only its own arm's requests (500 JSON, logged).
* ``shadow``: the stable model answers every request (one forward, exactly as without a
  rollout); the chosen share is ALSO scored by the candidate afterwards (metrics only;
  its failures touch no response). The batch's responses leave after both forwards.

The worker's rng for requests without a route key is ``random.Random(pid)``: seeded per
worker so that workers draw independently, reproducible within one worker's life.
Responses of requests that reached a forward carry ``X-DLRM-Arm`` (``stable`` or
``candidate``) and, in ``X-DLRM-Model-Version``, the version that answered; refused
requests (bad body, Content-Type or route key) name the stable version and no arm.
Without a rollout everything is the stable arm (still recorded in the per-arm metrics).
Route keys are checked whether or not a rollout runs: empty or over
:data:`serve.routing.ROUTE_KEY_MAX_CHARS` characters is a 400.

Prediction log (:mod:`serve.predlog`): with ``DLRM_PREDICTION_LOG_DIR`` in TorchServe's
environment, every scored request (sampled by a hash of its id) is appended there after
the batch, keyed by TorchServe's request id (the response's ``x-request-id``), with its
version, arm and scores; the sidecar joins ``POST /feedback`` labels with it. Writing it
never fails a prediction.

The logic lives in :mod:`serve.api.protocol` (no TorchServe needed to test it).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from ts.torch_handler.base_handler import BaseHandler

from serve.api.protocol import (
    DeltaWiring,
    HandlerConfig,
    MergedBatch,
    Outcome,
    Split,
    cache_on_cpu_from_env,
    encode_error,
    handle_batch,
)
from serve.constants import ARTIFACT_NAME
from serve.cpu import choose_threads
from serve.deltas import DeltaStore
from serve.errors import ServeError
from serve.predlog import Prediction, PredictionLogConfig, PredictionLogWriter
from serve.routing import ARM_HEADER, ROUTE_KEY_HEADER, ControlWatcher, takes_candidate
from serve.state import parse_serving_version

try:  # the sidecar engineer's module; the handler works without it
    from serve.metrics import HandlerMetrics, clean_dead_worker_files
except ImportError:  # pragma: no cover - only before serve/metrics.py exists
    HandlerMetrics = None  # type: ignore[assignment,misc]
    clean_dead_worker_files = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

BATCH_INSTANCES_HEADER = "X-DLRM-Batch-Instances"
BATCH_REQUESTS_HEADER = "X-DLRM-Batch-Requests"
TS_BATCH_HEADER = "X-DLRM-TorchServe-Batch"
MODEL_VERSION_HEADER = "X-DLRM-Model-Version"
_PHRASES = {200: "OK", 400: "Bad Request", 413: "Payload Too Large",
            415: "Unsupported Media Type", 500: "Internal Server Error"}


class DLRMHandler(BaseHandler):
    """BaseHandler subclass; TorchServe calls ``initialize`` once and ``handle`` per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.runtime: Any = None
        self.candidate: Any = None  # the rollout candidate's Runtime, when configured
        self.watcher: ControlWatcher | None = None
        self.cfg = HandlerConfig()
        self.metrics: Any = None
        self.model_version = "unknown"
        self.candidate_version: str | None = None
        # Routes requests without a route key; reseeded with the pid in initialize.
        self._rng = random.Random(0)
        self._last_stages: dict[str, float] = {}
        self.predlog: PredictionLogWriter | None = None
        # Held for each batch; a delta is applied between two batches under it.
        self._batch_lock = threading.Lock()
        self.followers: list[Any] = []

    def initialize(self, context: Any) -> None:
        # Keep bodies as raw bytes: TorchServe's own json.loads would accept NaN and turn
        # huge ids into Python ints before we see them; we parse with orjson ourselves.
        # The worker reads this variable per request, so setting it here takes effect.
        # Binary columnar bodies (application/x-dlrm-columnar) arrive as a bytearray
        # either way (TorchServe decodes only JSON and text/*); numpy views it in place.
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        from serve.runtime.engine import Runtime, RuntimeConfig
        from serve.runtime.shared import SharedTables

        props = context.system_properties
        model_dir = props.get("model_dir")
        self.model_version = model_version(getattr(context, "manifest", None))
        yaml_cfg = context.model_yaml_config or {}
        self.cfg = HandlerConfig.from_dict(yaml_cfg.get("handler"))
        gpu_id = props.get("gpu_id")
        if torch.cuda.is_available() and gpu_id is not None:
            self.device = torch.device(f"cuda:{gpu_id}")
        else:
            self.device = torch.device("cpu")
        workers = int(yaml_cfg.get("maxWorkers") or yaml_cfg.get("minWorkers") or 1)
        # handler.num_threads, else OMP_NUM_THREADS, else the pod's CPU budget (cgroup
        # quota, not the node's cores) / workers: serve.cpu.choose_threads.
        choice = choose_threads(workers, self.cfg.num_threads)
        threads = choice.threads
        logger.log(logging.WARNING if choice.oversubscribed else logging.INFO,
                   "threads: %s", choice.describe())
        torch.set_num_threads(threads)
        try:  # inter-op threads only matter for forks in the graph; one is enough
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set or parallel work has started: keep it
            pass
        runtime_cfg = RuntimeConfig(
            device=str(self.device), cache_load_factor=self.cfg.cache_load_factor,
            cache_bytes=self.cfg.cache_bytes, cache_policy=self.cfg.cache_policy,
            num_threads=threads, max_forward_instances=self.cfg.max_forward_instances,
            cache_on_cpu=cache_on_cpu_from_env(os.environ))
        deltas = DeltaWiring.from_env(os.environ)
        store = DeltaStore(deltas.directory) if deltas is not None else None

        def shared_for(version: str) -> SharedTables | None:
            if store is None or deltas is None or not deltas.shared_tables:
                return None
            return SharedTables(store.folder(version) / "tables.bin",
                                store.last_sequence(version))

        self.runtime = Runtime.from_artifact(os.path.join(model_dir, ARTIFACT_NAME), runtime_cfg,
                                             shared=shared_for(self.model_version))
        rollout = self.cfg.rollout
        if rollout is not None:
            self.candidate = Runtime.from_artifact(
                os.path.join(model_dir, rollout.candidate_artifact), runtime_cfg,
                shared=shared_for(rollout.candidate_version))
            self.candidate_version = rollout.candidate_version
            self.watcher = ControlWatcher(rollout.control_file)
            # Requests without a route key are routed at random: seeded per worker (its
            # pid), so workers draw independently and one worker's draws are reproducible.
            self._rng = random.Random(os.getpid())
            control = self.watcher.current()
            logger.info("rollout: stable=%s candidate=%s (%s) control=%s (now mode=%s "
                        "weight=%.4g)", self.model_version, rollout.candidate_version,
                        rollout.candidate_artifact, rollout.control_file, control.mode,
                        control.weight)
        # The prediction log (serve.predlog) that POST /feedback joins labels with; its
        # folder comes from TorchServe's environment (the launcher / the Deployment).
        log_cfg = PredictionLogConfig.from_env()
        if log_cfg is not None:
            self.predlog = PredictionLogWriter(log_cfg)
            logger.info("prediction log: %s (sample %.3g, %d-byte files, %d bytes at most)",
                        log_cfg.directory, log_cfg.sample_rate, log_cfg.file_bytes,
                        log_cfg.max_bytes)
        if store is not None and deltas is not None:
            self._follow_deltas(store, deltas)
        if HandlerMetrics is not None:
            _clean_metric_files()
            self.metrics = HandlerMetrics()
        self._last_stages = self._stage_seconds()
        # Everything allocated so far (torch, the model) lives as long as the worker: move
        # it out of the cyclic collector's reach so collections stay cheap (see
        # serve.api.protocol._gc_paused for the measured cost).
        gc.collect()
        gc.freeze()
        self.initialized = True
        logger.info("DLRM handler ready: version=%s candidate=%s device=%s threads=%d "
                    "config=%s pid=%d", self.model_version, self.candidate_version,
                    self.device, threads, self.cfg, os.getpid())

    def _follow_deltas(self, store: DeltaStore, wiring: DeltaWiring) -> None:
        """One follower per served version (stable, candidate): every delta already in
        the store is applied before the first batch, later ones between batches by a
        background thread (serve.runtime.follower)."""
        from serve.runtime.follower import DeltaFollower

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

    @contextlib.contextmanager
    def _batch_guard(self) -> Any:
        """A batch's hold on the tables: the worker's batch lock, and the read side of
        each shared table (no delta lands in any worker while this batch runs)."""
        with self._batch_lock, contextlib.ExitStack() as stack:
            for rt in self._runtimes():
                if rt.shared is not None:
                    stack.enter_context(rt.shared.read())
            yield

    def _forward(self, runtime: Any, batch: MergedBatch) -> np.ndarray:
        if self.cfg.debug_delay_ms:  # tests only: a slow model, so the queue fills up
            time.sleep(self.cfg.debug_delay_ms / 1000.0)
        return runtime.predict_arrays(batch.dense, batch.values, batch.lengths)

    def _predict(self, batch: MergedBatch) -> np.ndarray:
        """The stable model: MergedBatch -> float32 (B,) probabilities."""
        return self._forward(self.runtime, batch)

    def _predict_candidate(self, batch: MergedBatch) -> np.ndarray:
        """The rollout's candidate: MergedBatch -> float32 (B,) probabilities."""
        return self._forward(self.candidate, batch)

    def _split(self) -> Split | None:
        """This batch's split: the control read once (None without a rollout)."""
        if self.watcher is None or self.candidate is None:
            return None
        control = self.watcher.current()
        rng, weight = self._rng, control.weight
        return Split(mode=control.mode, candidate=self._predict_candidate,
                     choose=lambda key: takes_candidate(key, weight, rng))

    def handle(self, data: list[dict], context: Any) -> list[bytes]:
        t0 = time.perf_counter()
        try:
            bodies, ctypes, keys = [], [], []
            for idx, req in enumerate(data):
                body, ctype, key = _request_parts(req, context, idx)
                bodies.append(body)
                ctypes.append(ctype)
                keys.append(key)
            with self._batch_guard():
                # The stable model's request schema (None: the built-in one); a rollout's
                # candidate is served with it (the sidecar refuses one that differs).
                outcomes, info = handle_batch(bodies, ctypes, self._predict, self.cfg,
                                              route_keys=keys, split=self._split(),
                                              schema=getattr(self.runtime, "schema", None))
        except Exception:  # a bug, not bad input: answer 500 JSON, keep the worker alive
            logger.exception("DLRM handler failed on a batch of %d requests", len(data))
            err = ServeError("internal error while predicting; see the TorchServe model log")
            outcomes, info = [Outcome(500, encode_error(err)) for _ in data], None
        seconds = time.perf_counter() - t0
        arms = info["arms"] if info is not None else {}
        for idx, out in enumerate(outcomes):
            context.set_response_status(out.status, _PHRASES.get(out.status, ""), idx)
            context.set_response_content_type(idx, "application/json")
            context.set_response_header(idx, TS_BATCH_HEADER, str(len(data)))
            context.set_response_header(idx, MODEL_VERSION_HEADER, self._version_of(out.arm))
            if out.arm is not None:
                context.set_response_header(idx, ARM_HEADER, out.arm)
            if info is not None:
                run = arms.get(out.arm) if out.arm is not None else None
                instances = run.instances if run is not None else info["instances"]
                requests = run.requests if run is not None else info["requests"]
                context.set_response_header(idx, BATCH_INSTANCES_HEADER, str(instances))
                context.set_response_header(idx, BATCH_REQUESTS_HEADER, str(requests))
        self._record(outcomes, info, seconds)
        if info is not None and self.predlog is not None:
            self._log_predictions(info, context)
        return [o.body for o in outcomes]

    def _log_predictions(self, info: dict, context: Any) -> None:
        """Every scored request of the batch (answered, or shadow-scored: arm
        ``candidate``) into the prediction log, keyed by TorchServe's request id (the
        ``x-request-id`` of the response). Never fails a prediction: logged."""
        try:
            now, preds = time.time(), []
            for run in info["arms"].values():
                if run.scores is None:
                    continue
                version, start = self._version_of(run.arm), 0
                for idx, size in zip(run.indices, run.sizes):
                    rid = context.get_request_id(idx)
                    if rid:
                        preds.append(Prediction(str(rid), version, run.arm, now,
                                                run.scores[start:start + size]))
                    start += size
            written = self.predlog.write(preds) if self.predlog is not None else 0
            if written and self.metrics is not None:
                self.metrics.observe_logged(written)
        except Exception:  # the log must never fail a prediction
            logger.exception("writing the prediction log failed")

    def _version_of(self, arm: str | None) -> str:
        """The model version of an arm (the stable version for no arm)."""
        if arm == "candidate" and self.candidate_version is not None:
            return self.candidate_version
        return self.model_version

    def _runtimes(self) -> list[Any]:
        return [r for r in (self.runtime, self.candidate) if r is not None]

    def _stage_seconds(self) -> dict[str, float]:
        """Cumulative seconds per stage, summed over the worker's runtimes."""
        total: dict[str, float] = {}
        for rt in self._runtimes():
            for k, v in rt.stats().stage_seconds.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def _cache_stats(self) -> SimpleNamespace:
        """Cache statistics summed over the runtimes (stable + candidate), in the shape
        ``HandlerMetrics.set_cache`` reads, plus ``wrapped`` (per feature, for
        ``set_wrapped``); sums of cumulative counts stay cumulative.
        (A namespace, not a class: TorchServe wants exactly one class in this module.)"""
        names = ("hits", "misses", "evictions", "device_bytes", "host_bytes")
        total: dict[str, Any] = dict.fromkeys(names, 0)
        wrapped = [0] * len(self.runtime.feature_names) if self.runtime is not None else []
        for rt in self._runtimes():
            st = rt.stats()
            for name in names:
                total[name] += int(getattr(st, name))
            for i, n in enumerate(st.wrapped):
                wrapped[i] += n
        return SimpleNamespace(**total, wrapped=tuple(wrapped))

    def _record(self, outcomes: list[Outcome], info: dict | None, seconds: float) -> None:
        try:
            if info is not None and self.runtime is not None:
                self.runtime.record_stage("decode", info["decode_s"])
            if self.metrics is None:
                return
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
            if info["requests"]:
                self.metrics.observe_batch(info["instances"], info["requests"])
                now = self._stage_seconds()
                self.metrics.observe_stages({k: v - self._last_stages.get(k, 0.0)
                                             for k, v in now.items()})
                self._last_stages = now
                stats = self._cache_stats()
                self.metrics.set_cache(stats)
                self.metrics.set_wrapped(self.runtime.feature_names, stats.wrapped)
        except Exception:  # metrics must never fail a prediction
            logger.exception("recording DLRM metrics failed")

    def _record_arms(self, info: dict) -> None:
        """Per-arm series: each arm that ran a forward, with its model version; every
        request of a failed forward is an error of its arm. Seconds per request = the
        batch's decode time + the arm's forward time."""
        try:
            for run in info["arms"].values():
                self.metrics.observe_arm(
                    run.arm, self._version_of(run.arm), run.requests,
                    run.requests if run.failed else 0, info["decode_s"] + run.forward_s,
                    run.scores)
            if info["shadow_diff"] is not None and self.candidate_version is not None:
                self.metrics.observe_shadow_diff(self.candidate_version, info["shadow_diff"])
        except Exception:  # metrics must never fail a prediction
            logger.exception("recording the per-arm DLRM metrics failed")


def _clean_metric_files() -> None:
    """Before this worker's metrics start: fold the prometheus_client files of dead
    workers in PROMETHEUS_MULTIPROC_DIR (serve.metrics.clean_dead_worker_files), so they
    do not pile up in the pod's 64 MiB tmpfs. Never fails the worker: logged."""
    mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not mp_dir or clean_dead_worker_files is None:
        return
    try:
        logger.info("metric files: %s", clean_dead_worker_files(mp_dir).describe())
    except Exception:  # metrics must never keep a worker from serving
        logger.exception("cleaning dead workers' metric files in %s failed", mp_dir)


def model_version(manifest: dict | None) -> str:
    """The repository version named by a .mar's manifest: ``modelVersion`` itself, or
    ``V`` when it is a serving version ``V_b..d..w..`` the sidecar derived (``unknown``
    without one)."""
    raw = str(((manifest or {}).get("model") or {}).get("modelVersion") or "")
    parsed = parse_serving_version(raw)
    return parsed[0] if parsed else (raw or "unknown")


def _request_parts(req: dict, context: Any, idx: int) -> tuple[Any, str | None, str | None]:
    """(raw body, Content-Type, X-DLRM-Route-Key) of request ``idx`` of a TorchServe batch."""
    body, ctype = _body_and_type(req, context, idx)
    params = context.get_all_request_header(idx) or {}
    return body, ctype, _header(params, ROUTE_KEY_HEADER.lower())


def _body_and_type(req: dict, context: Any, idx: int) -> tuple[Any, str | None]:
    """The raw body and its Content-Type of request ``idx`` of a TorchServe batch.

    TorchServe hands a plain body over as parameter ``body`` (``data`` for some
    clients); form posts arrive split into form fields, which we answer with 415. The
    request's own Content-Type header comes first: the parameter's content type is the
    bare media type (TorchServe drops parameters such as ``; charset=latin-1``), which
    would let a body in a charset we do not decode, or ``application/x-dlrm-columnar;
    charset=utf-8``, through.
    """
    params = context.get_all_request_header(idx) or {}
    if "body" in req or "data" in req:
        name = "body" if "body" in req else "data"
        ctype = _header(params, "content-type")
        if ctype is None:
            per_param = params.get(name)
            ctype = per_param.get("content-type") if isinstance(per_param, dict) else None
        return req[name], ctype
    # e.g. application/x-www-form-urlencoded (curl -d without -H) decoded into fields
    return b"", _header(params, "content-type") or "application/x-www-form-urlencoded"


def _header(params: dict, name: str) -> str | None:
    """The value of header ``name`` (lower case), matched case-insensitively."""
    for k, v in params.items():
        if isinstance(k, str) and k.lower() == name and isinstance(v, str):
            return v
    return None

