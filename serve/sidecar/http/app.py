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
  (:mod:`serve.sidecar.http.routes_deltas`, :mod:`serve.sidecar.services.deltas`): embedding deltas
  for a served version, stored in ``--delta-dir`` and applied by the workers.
* ``GET /tuner`` and ``PUT /tuner`` (bearer token) (:mod:`serve.sidecar.http.routes_tuner`,
  :mod:`serve.sidecar.control.tuner`): the batching tuner, which picks batch size and max delay
  from the traffic (on by default).
* ``GET /healthz``, ``GET /readyz`` (:mod:`serve.sidecar.http.routes_health`), ``/docs``
  (OpenAPI).
* Not here: the Open Inference Protocol v2 (``--oip-port``). It runs in a process of its
  own (:mod:`serve.sidecar.http.oip_server`: no token, its own memory, CPU and bounds),
  which ``main`` starts as a child without the token variables (``--oip-mode child``) or
  which a container of its own runs (``external``); GET /state names its URL.

Two ports, one process: the public port (``--port``, 8090: metrics, probes, every read;
a write there answers 403) and the write port (``--write-port``, 8091: every route).
Every write passes the edge guard (:mod:`serve.sidecar.http.edge`) before a byte of its
body is read: its token and the token's scope (operator, delta publisher, feedback
producer: :mod:`serve.sidecar.http.auth`), and its body's size.

The parts: :mod:`~serve.sidecar.config` (settings), :mod:`~serve.sidecar.root` (what
routes share, injected), :mod:`~serve.sidecar.adapters.torchserve` (the calls to TorchServe),
:mod:`~serve.sidecar.control.reconciler` (desired vs observed, the next step),
:mod:`~serve.sidecar.control.switch` (the version switch), :mod:`~serve.sidecar.adapters.memory` (the
memory guard and peak), :mod:`~serve.sidecar.adapters.archives` (derived archives),
:mod:`~serve.sidecar.adapters.tokens`, :mod:`~serve.sidecar.http.auth`,
:mod:`~serve.sidecar.http.edge` (the edge: tokens, scopes, body limits),
:mod:`~serve.sidecar.http.errors` (the one error mapping) and
:mod:`~serve.sidecar.http.middleware` (request counts). The names other code imports from
here (``SidecarConfig``, ``ensure_dev_token``...) are re-exported.

Run: ``python -m serve.sidecar --help``.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from serve import settings
from serve.common.flags import add_options, build
from serve.errors import ConfigError
from serve.sidecar.adapters.tokens import ensure_dev_token, load_optional_token, load_token
from serve.sidecar.config import ServerOptions, SidecarConfig, cli_options
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
from serve.sidecar.http.edge import EdgeGuard, check_write_routes
from serve.sidecar.http.errors import register_exception_handlers
from serve.sidecar.http.middleware import count_requests
from serve.sidecar.http.oip_options import OipOptions
from serve.sidecar.root import Sidecar

__all__ = [
    "build_parser",
    "create_app",
    "listen_socket",
    "main",
    "start_oip_child",
]

_log = logging.getLogger(__name__)


def create_app(config: SidecarConfig, *, registry: CollectorRegistry | None = None,
               http_client: httpx.AsyncClient | None = None,
               clock: Callable[[], float] = time.monotonic,
               wall_clock: Callable[[], float] = time.time,
               write_port: int | None = None, oip_port: int | None = None) -> FastAPI:
    """The sidecar app, behind its edge guard (:class:`~serve.sidecar.http.edge.EdgeGuard`).

    Args:
        config: see :class:`SidecarConfig`.
        registry: where the sidecar's and the workers' metrics are collected; default a
            fresh ``CollectorRegistry`` (never the global one, so apps don't collide).
        http_client: client for TorchServe; default one made and closed with the app.
        clock: monotonic seconds, for durations and deadlines.
        wall_clock: unix seconds (the age of the newest embedding delta applied).
        write_port: the local port writes are taken on (GET /state shows it); a write
            on another port answers 403. None: writes on any port (one listener).
        oip_port: the port the Open Inference Protocol's process serves on (GET /state's
            ``endpoints.oip_url``); None: not served.
    """
    state = Sidecar.create(config, registry=registry, clock=clock,
                           wall_clock=wall_clock)
    state.write_port = write_port
    state.oip_port = oip_port or None

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
    routers = (routes_health.router, routes_metrics.router, routes_batching.router,
               routes_state.router, routes_feedback.router, routes_deltas.router,
               routes_tuner.router)
    for router in routers:
        app.include_router(router)
    # The routers' own routes (included without a prefix): what the app serves.
    check_write_routes([*app.routes, *(r for router in routers for r in router.routes)])
    # Added last, so outermost of the app's middleware: it answers before the request
    # counter, the routing and any body parsing (it counts its own answers).
    app.add_middleware(EdgeGuard, sidecar=state, write_port=write_port)
    return app


# --------------------------------------------------------------------------- CLI


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line, generated from the config dataclasses (:mod:`serve.common.flags`);
    the environment (``environ``, default ``os.environ``) sets the defaults it names."""
    p = argparse.ArgumentParser(
        prog="python -m serve.sidecar",
        description="Metrics, the declared serving state and live batching beside "
                    "TorchServe. A flag's [VARIABLE] sets its default; the flag wins. "
                    "docs/configuration.md lists them all.")
    add_options(p, cli_options(), environ)
    return p


def _tokens(opts: ServerOptions, environ: Mapping[str, str]) -> dict[str, str | None]:
    """The tokens, as :class:`SidecarConfig` fields: the operator's (the variable, else
    the token file, created first with ``--create-token``) and the scoped ones (their
    files, when given). SidecarConfig checks each (length, placeholder)."""
    token = settings.DLRM_SIDECAR_TOKEN.get(environ)
    if token is None and opts.create_token:
        token = ensure_dev_token(opts.token_file)
        _log.info("the write token is in %s", opts.token_file.resolve())
    elif token is None:
        token = load_token(opts.token_file)
    return {"token": token,
            "delta_token": load_optional_token(opts.delta_token_file),
            "feedback_token": load_optional_token(opts.feedback_token_file)}


def _serve(app: FastAPI, opts: ServerOptions) -> None:
    """Run ``app`` under one uvicorn server listening on both ports (one event loop,
    one lifespan): the public port and the write port."""
    import uvicorn

    sockets = [listen_socket(opts.host, opts.port), listen_socket(opts.host, opts.write_port)]
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                            access_log=False)
    uvicorn.Server(config).run(sockets=sockets)


#: Environment variables the OIP's child process never sees: the sidecar's tokens and
#: anything else named like a credential.
_CREDENTIAL = re.compile(r"TOKEN|SECRET|PASSWORD|CREDENTIAL|_KEY", re.IGNORECASE)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGTERM when the sidecar dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_oip_child(opts: ServerOptions, config: SidecarConfig,
                    environ: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m serve.sidecar.http.oip_server`` on ``opts.oip_port``: the
    sidecar's host, model, TorchServe inference URL and repositories (read only), its
    readiness from this sidecar's public port; the environment without any variable
    named like a credential (:data:`_CREDENTIAL`), so it holds no token."""
    local = "127.0.0.1" if opts.host in ("0.0.0.0", "", "::") else opts.host
    local = f"[{local}]" if ":" in local else local
    options = OipOptions(host=opts.host, port=opts.oip_port, model_name=config.model_name,
                         inference_url=config.inference_url,
                         sidecar_url=f"http://{local}:{opts.port}",
                         repositories=config.repository_roots, log_level=opts.log_level)
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if not _CREDENTIAL.search(k)}
    cmd = [sys.executable, "-m", "serve.sidecar.http.oip_server", *options.argv()]
    return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509


def _stop(child: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    child.terminate()
    try:
        child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn to serve on.

    Made with ``proto=IPPROTO_TCP``, not 0 as ``uvicorn.Config.bind_socket`` makes it:
    asyncio sets ``TCP_NODELAY`` on an accepted connection only when its socket's proto
    is IPPROTO_TCP, and without it every answer after the first on a kept-alive
    connection waited ~40 ms for the client's delayed ACK (Nagle).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"serve.sidecar: cannot listen on {host}:{port}: {e.strerror}; "
                         f"stop what holds it or pass another --port / --write-port") from None
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m serve.sidecar --help``."""
    try:
        args = build_parser().parse_args(argv)
        opts = build(ServerOptions, args)
        logging.basicConfig(level=opts.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # One line per TorchServe call (every scrape) drowns the log; keep its warnings.
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
        config = build(SidecarConfig, args, _tokens(opts, os.environ))
    except ConfigError as e:
        raise SystemExit(f"serve.sidecar: {e.message}") from None
    _log.info("sidecar on http://%s:%d (writes on :%d) for model %r (management %s); "
              "desired state: %s", opts.host, opts.port, opts.write_port, config.model_name,
              config.management_url, config.state_file or "none (reconciler off)")
    app = create_app(config, write_port=opts.write_port, oip_port=opts.oip_port)
    child = None
    if opts.oip_port and opts.oip_mode == "child":
        child = start_oip_child(opts, config)
        _log.info("Open Inference Protocol v2 on http://%s:%d/v2 (process %d, no token)",
                  opts.host, opts.oip_port, child.pid)
    try:
        _serve(app, opts)
    finally:
        if child is not None:
            _stop(child)

if __name__ == "__main__":
    main()
