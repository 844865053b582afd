"""The sidecar app: ``create_app`` wires the parts together; ``main`` runs it under uvicorn.

The sidecar runs in the same pod as TorchServe and talks to it over loopback only:

* ``GET /metrics`` (:mod:`serve.sidecar.http.routes_metrics`): the workers' handler metrics,
  the sidecar's own, ``dlrm_workers`` and TorchServe's own metrics under ``ts_``.
* ``GET /state`` and ``PUT /state`` (bearer token) (:mod:`serve.sidecar.http.routes_state`):
  the desired serving state (the ``--state-file``) beside what TorchServe serves, and a
  new desired state, which the reconciler (:mod:`serve.sidecar.control.reconciler`, a background
  task) applies with zero failed requests.
* ``GET /batching`` and ``PUT /batching`` (bearer token)
  (:mod:`serve.sidecar.http.routes_batching`): the default version's batching settings, and
  a shortcut that edits them in the desired state and waits until they serve.
* ``POST /feedback`` (bearer token) and ``GET /feedback``
  (:mod:`serve.sidecar.http.routes_feedback`): click labels joined with the workers'
  prediction log; the online CTR, calibration and AUC per version and arm.
* ``POST /embeddings/deltas`` (bearer token) and ``GET /embeddings/deltas``
  (:mod:`serve.sidecar.http.routes_deltas`, :mod:`serve.sidecar.services.embedding_deltas`): embedding deltas
  for a served version, stored in ``--delta-dir`` and applied by the workers.
* ``GET /tuner`` and ``PUT /tuner`` (bearer token) (:mod:`serve.sidecar.http.routes_tuner`,
  :mod:`serve.sidecar.control.tuner`): the batching tuner, which picks batch size and max delay
  from the traffic (on by default).
* ``GET /healthz``, ``GET /readyz`` (:mod:`serve.sidecar.http.routes_health`), ``/docs``
  (OpenAPI).

The parts: :mod:`~serve.sidecar.config` (settings), :mod:`~serve.sidecar.root` (what
routes share, injected), :mod:`~serve.sidecar.adapters.torchserve` (the calls to TorchServe),
:mod:`~serve.sidecar.control.reconciler` (desired vs observed, the next step),
:mod:`~serve.sidecar.control.switch` (the version switch), :mod:`~serve.sidecar.adapters.memory` (the
memory guard and peak), :mod:`~serve.sidecar.adapters.archives` (derived archives),
:mod:`~serve.sidecar.adapters.tokens`, :mod:`~serve.sidecar.http.auth`,
:mod:`~serve.sidecar.http.errors` (the one error mapping) and
:mod:`~serve.sidecar.http.middleware` (request counts). The names other code imports from
here (``SidecarConfig``, ``ensure_dev_token``...) are re-exported.

Run: ``python -m serve.sidecar --help``.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from serve.errors import ConfigError
from serve.sidecar.adapters.archives import rewrite_mar
from serve.sidecar.adapters.tokens import ensure_dev_token, load_token
from serve.sidecar.config import (
    AUTOTUNE_ENV,
    DEFAULT_CGROUP_ROOT,
    DEFAULT_STATE_FILE,
    DELTA_DIR_ENV,
    MEMORY_LIMIT_ENV,
    REPOSITORY_ENV,
    STATE_FILE_ENV,
    TOKEN_ENV,
    SidecarConfig,
)
from serve.sidecar.control.tuner import TunerConfig
from serve.sidecar.http import (
    routes_batching,
    routes_deltas,
    routes_feedback,
    routes_health,
    routes_metrics,
    routes_state,
    routes_tuner,
)
from serve.sidecar.http.docs import mount_docs
from serve.sidecar.http.errors import register_exception_handlers
from serve.sidecar.http.middleware import count_requests
from serve.sidecar.http.schemas import BatchingState, BatchingUpdate, BatchingUpdateResult
from serve.sidecar.root import Sidecar
from serve.sidecar.services.feedback import FeedbackConfig
from serve.store.predlog import LOG_DIR_ENV

__all__ = [
    "DEFAULT_STATE_FILE",
    "BatchingState",
    "BatchingUpdate",
    "BatchingUpdateResult",
    "SidecarConfig",
    "create_app",
    "ensure_dev_token",
    "load_token",
    "main",
    "register_exception_handlers",
    "rewrite_mar",
]

_log = logging.getLogger(__name__)


def create_app(config: SidecarConfig, *, registry: CollectorRegistry | None = None,
               http_client: httpx.AsyncClient | None = None,
               clock: Callable[[], float] = time.monotonic,
               wall_clock: Callable[[], float] = time.time) -> FastAPI:
    """The sidecar app.

    Args:
        config: see :class:`SidecarConfig`.
        registry: where the sidecar's and the workers' metrics are collected; default a
            fresh ``CollectorRegistry`` (never the global one, so apps don't collide).
        http_client: client for TorchServe; default one made and closed with the app.
        clock: monotonic seconds, for durations and deadlines.
        wall_clock: unix seconds (the age of the newest embedding delta applied).
    """
    state = Sidecar.create(config, registry=registry, clock=clock,
                                wall_clock=wall_clock)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client = http_client or httpx.AsyncClient()
        state.connect(client)
        state.start()
        try:
            yield
        finally:
            await state.stop()
            if state.gpu is not None:
                state.gpu.close()
            if http_client is None:
                await client.aclose()

    app = FastAPI(
        title="DLRM serving sidecar",
        description="Prometheus metrics, the declared serving state (reconciled into "
                    "TorchServe) and live batching settings for the TorchServe DLRM model "
                    "beside it.",
        version="0.1.0", lifespan=lifespan,
        # /docs from local assets (air-gapped clusters have no CDN); no ReDoc.
        docs_url=None, redoc_url=None)
    mount_docs(app)
    app.state.sidecar = state
    register_exception_handlers(app)
    app.middleware("http")(count_requests)
    for router in (routes_health.router, routes_metrics.router, routes_batching.router,
                   routes_state.router, routes_feedback.router, routes_deltas.router,
                   routes_tuner.router):
        app.include_router(router)
    return app


# --------------------------------------------------------------------------- CLI


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.sidecar",
        description="Metrics and live batching API beside TorchServe. Every flag has an "
                    "env var (shown) that sets its default.")
    p.add_argument("--host", default=_env("DLRM_SIDECAR_HOST", "127.0.0.1"),
                   help="bind address [DLRM_SIDECAR_HOST]; 0.0.0.0 in a pod so Prometheus "
                        "can scrape it")
    p.add_argument("--port", type=int, default=int(_env("DLRM_SIDECAR_PORT", "8090")),
                   help="port [DLRM_SIDECAR_PORT]")
    p.add_argument("--inference-url", default=_env("TS_INFERENCE_URL", "http://127.0.0.1:8080"),
                   help="TorchServe inference API [TS_INFERENCE_URL]")
    p.add_argument("--management-url",
                   default=_env("TS_MANAGEMENT_URL", "http://127.0.0.1:8081"),
                   help="TorchServe management API, loopback only [TS_MANAGEMENT_URL]")
    p.add_argument("--metrics-url", default=_env("TS_METRICS_URL", "http://127.0.0.1:8082"),
                   help="TorchServe metrics API [TS_METRICS_URL]")
    p.add_argument("--model-name", default=_env("DLRM_MODEL_NAME", "dlrm"),
                   help="TorchServe model to manage [DLRM_MODEL_NAME]")
    p.add_argument("--token-file", default=_env("DLRM_SIDECAR_TOKEN_FILE", ".run/sidecar-token"),
                   help=f"file holding the PUT /batching bearer token [DLRM_SIDECAR_TOKEN_FILE]; "
                        f"env {TOKEN_ENV} (e.g. from a Kubernetes Secret) wins over it")
    p.add_argument("--create-token", action="store_true",
                   help="write a random development token to --token-file if it is absent")
    p.add_argument("--multiproc-dir", default=_env("PROMETHEUS_MULTIPROC_DIR", ".run/prometheus"),
                   help="the TorchServe workers' PROMETHEUS_MULTIPROC_DIR "
                        "[PROMETHEUS_MULTIPROC_DIR]")
    p.add_argument("--model-store", default=_env("TS_MODEL_STORE", "model_store"),
                   help="TorchServe's --model-store; new versions' .mar files are written "
                        "there [TS_MODEL_STORE]")
    p.add_argument("--state-file", default=os.environ.get(STATE_FILE_ENV) or None,
                   help=f"the desired serving state (YAML, serve/state.py) the sidecar "
                        f"reconciles TorchServe toward [{STATE_FILE_ENV}]; in Kubernetes "
                        f"{DEFAULT_STATE_FILE} (a ConfigMap mounted as a folder). Unset: "
                        f"no reconciler, PUT /state and PUT /batching answer 409")
    p.add_argument("--repository", action="append", default=None,
                   help=f"a model repository folder (repeat for more; earlier wins) "
                        f"[{REPOSITORY_ENV}, ':'-separated]; default: --model-store")
    p.add_argument("--reconcile-interval", type=float, default=1.0,
                   help="seconds between reconcile passes (a PUT wakes it at once): how "
                        "soon a ConfigMap edit or a dead worker is noticed")
    p.add_argument("--register-timeout", type=float, default=600.0,
                   help="seconds a new model version may take to get READY")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds an old version's queue may take to empty after a switch; "
                        "past it the old version stays registered and the next pass retries")
    p.add_argument("--cgroup-root", default=str(DEFAULT_CGROUP_ROOT),
                   help="cgroup filesystem with memory.max/memory.current (v1: memory/...): "
                        "the memory limit a switch must fit in")
    p.add_argument("--memory-limit-bytes", type=int,
                   default=int(os.environ[MEMORY_LIMIT_ENV]) if os.environ.get(
                       MEMORY_LIMIT_ENV) else None,
                   help=f"TorchServe's memory limit when it runs in another container than "
                        f"the sidecar (Downward API limits.memory of that container) "
                        f"[{MEMORY_LIMIT_ENV}]; default: the sidecar's cgroup limit")
    p.add_argument("--prediction-log-dir", default=os.environ.get(LOG_DIR_ENV) or None,
                   help=f"the prediction log folder TorchServe's workers write "
                        f"[{LOG_DIR_ENV}]; POST /feedback joins labels with it. Unset: no "
                        f"join (every label counts as unknown)")
    p.add_argument("--feedback-window-s", type=float,
                   default=float(_env("DLRM_FEEDBACK_WINDOW_S", "3600")),
                   help="seconds a labelled prediction counts in the online CTR, calibration "
                        "and AUC [DLRM_FEEDBACK_WINDOW_S]")
    p.add_argument("--feedback-index-entries", type=int,
                   default=int(_env("DLRM_FEEDBACK_INDEX_ENTRIES", "200000")),
                   help="logged request ids the join remembers (~150 bytes each) "
                        "[DLRM_FEEDBACK_INDEX_ENTRIES]")
    p.add_argument("--delta-dir", default=os.environ.get(DELTA_DIR_ENV) or None,
                   help=f"the pod's embedding-delta folder, shared with the TorchServe "
                        f"workers (they follow <dir>/<version>/) [{DELTA_DIR_ENV}]; POST "
                        f"/embeddings/deltas stores deltas there. Unset: deltas are off "
                        f"(POST answers 409)")
    p.add_argument("--autotune", choices=["on", "off"],
                   default="off" if _env(AUTOTUNE_ENV, "on").strip().lower() in (
                       "0", "false", "off", "no") else "on",
                   help=f"the batching tuner [{AUTOTUNE_ENV}=0 turns it off]: picks batch "
                        f"size and max delay from the traffic and applies them like PUT "
                        f"/batching (needs --state-file); off: the declared batching serves. "
                        f"PUT /tuner turns it on or off live. Default on")
    p.add_argument("--p99-goal-ms", type=float,
                   default=float(_env("DLRM_P99_GOAL_MS", "60")),
                   help="the tuner's p99 latency goal in ms [DLRM_P99_GOAL_MS]")
    p.add_argument("--tune-window-s", type=float,
                   default=float(_env("DLRM_TUNE_WINDOW_S", "10")),
                   help="seconds of traffic the tuner measures a setting on, at most (a "
                        "window closes after 3 s once it holds 2,000 requests) "
                        "[DLRM_TUNE_WINDOW_S]")
    p.add_argument("--tune-settle-s", type=float,
                   default=float(_env("DLRM_TUNE_SETTLE_S", "4")),
                   help="seconds skipped after a switch before measuring "
                        "[DLRM_TUNE_SETTLE_S]")
    p.add_argument("--tune-min-dwell-s", type=float,
                   default=float(_env("DLRM_TUNE_MIN_DWELL_S", "30")),
                   help="seconds a setting the tuner chose is kept at least "
                        "[DLRM_TUNE_MIN_DWELL_S]")
    p.add_argument("--tune-min-switch-interval-s", type=float,
                   default=float(_env("DLRM_TUNE_MIN_SWITCH_INTERVAL_S", "10")),
                   help="seconds between two switches of the tuner, at least "
                        "[DLRM_TUNE_MIN_SWITCH_INTERVAL_S]")
    p.add_argument("--log-level", default=_env("DLRM_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m serve.sidecar --help``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per TorchServe call (every scrape) drowns the log; keep its warnings only.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    if token is None:
        if args.create_token:
            token = ensure_dev_token(args.token_file)
            _log.info("PUT /batching token is in %s", Path(args.token_file).resolve())
        else:
            try:
                token = load_token(args.token_file)
            except ConfigError as e:
                raise SystemExit(f"serve.sidecar: {e.message}") from None
    repositories = args.repository or [
        p for p in os.environ.get(REPOSITORY_ENV, "").split(":") if p]
    try:
        config = SidecarConfig(
            inference_url=args.inference_url, management_url=args.management_url,
            metrics_url=args.metrics_url, model_name=args.model_name, token=token,
            multiproc_dir=Path(args.multiproc_dir), model_store=Path(args.model_store),
            register_timeout_s=args.register_timeout, drain_timeout_s=args.drain_timeout,
            state_file=Path(args.state_file) if args.state_file else None,
            repositories=tuple(Path(r) for r in repositories),
            reconcile_interval_s=args.reconcile_interval, cgroup_root=Path(args.cgroup_root),
            memory_limit_bytes=args.memory_limit_bytes,
            feedback=FeedbackConfig(
                log_dir=Path(args.prediction_log_dir) if args.prediction_log_dir else None,
                window_s=args.feedback_window_s, index_entries=args.feedback_index_entries),
            delta_dir=Path(args.delta_dir) if args.delta_dir else None,
            tuner=TunerConfig(enabled=args.autotune == "on", p99_goal_ms=args.p99_goal_ms,
                              window_s=args.tune_window_s, settle_s=args.tune_settle_s,
                              min_dwell_s=args.tune_min_dwell_s,
                              min_switch_interval_s=args.tune_min_switch_interval_s))
    except ConfigError as e:
        raise SystemExit(f"serve.sidecar: {e.message}") from None
    import uvicorn

    _log.info("sidecar on http://%s:%d for model %r (management %s); desired state: %s",
              args.host, args.port, config.model_name, config.management_url,
              config.state_file or "none (reconciler off)")
    uvicorn.run(create_app(config), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
