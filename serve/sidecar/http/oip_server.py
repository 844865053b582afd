"""The Open Inference Protocol's process: ``python -m serve.sidecar.http.oip_server``.

Why a process of its own: the protocol's port is unauthenticated and open to every client
the inference port is open to, and its bodies (up to 8 MiB of JSON) cost CPU under the GIL
and ~16x their size in memory while parsed. Inside the sidecar, a flood of them took the
pod's readiness and control plane down with it (the review's N1: OOM kill, ``/readyz``
timeouts, the pod out of every Service). Here it holds no token (the sidecar starts it
without its token variables; in Kubernetes its container mounts no Secret and no API
token), its memory and CPU are its own (its own container, or at least its own process),
and readiness is the sidecar's, read through a 1 s cache (:mod:`serve.sidecar.http.oip_state`).

Bounded inside too (:mod:`serve.sidecar.http.oip_guard`, :class:`~serve.sidecar.http.oip_options.OipOptions`):
infers at once and bytes of bodies in flight (429 at once past them), a deadline for the
whole body (408), parses at once (429 when no slot frees in time), uvicorn's
``limit_concurrency`` as the backstop, its own HTTP clients (to TorchServe's inference
API, to the sidecar's read port). It reads the model repository only to know the served
version's request schema.

Run: ``python -m serve.sidecar.http.oip_server --help``; the sidecar's ``--oip-port`` (with
``--oip-mode child``, the default) starts it, and stops it when the sidecar stops.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from serve.common.flags import add_options, build
from serve.errors import ConfigError
from serve.sidecar.http import routes_oip
from serve.sidecar.http.app import listen_socket
from serve.sidecar.http.errors import register_oip_exception_handlers
from serve.sidecar.http.oip_guard import AdmissionGuard
from serve.sidecar.http.oip_options import OipOptions, oip_cli_options
from serve.sidecar.http.oip_state import OipState

__all__ = ["build_parser", "create_oip_app", "main"]

_log = logging.getLogger(__name__)


def create_oip_app(options: OipOptions, *,
                   predict_client: httpx.AsyncClient | None = None,
                   sidecar_client: httpx.AsyncClient | None = None,
                   clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The Open Inference Protocol's app (:mod:`serve.sidecar.http.routes_oip`): its own
    error mapping (``{"error": ...}``) and bounds, its state in ``app.state.oip``.

    Args:
        options: see :class:`~serve.sidecar.http.oip_options.OipOptions`.
        predict_client, sidecar_client: clients for TorchServe's inference API and the
            sidecar's ``/readyz``; default its own, made and closed with the app (tests
            pass clients on fake transports).
        clock: monotonic seconds (the readiness cache's).
    """
    owned: list[httpx.AsyncClient] = []
    if predict_client is None:
        # Its own pool, as large as the infers it admits (never the sidecar's pool).
        limits = httpx.Limits(max_connections=options.max_requests,
                              max_keepalive_connections=min(32, options.max_requests))
        predict_client = httpx.AsyncClient(limits=limits)
        owned.append(predict_client)
    if sidecar_client is None:
        sidecar_client = httpx.AsyncClient(limits=httpx.Limits(max_connections=2))
        owned.append(sidecar_client)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        parses = app.state.oip.parses
        await asyncio.get_running_loop().run_in_executor(None, parses.warm_up)
        try:
            yield
        finally:
            parses.close()
            for client in owned:
                await client.aclose()

    app = FastAPI(title="DLRM serving: Open Inference Protocol v2", version="0.1.0",
                  docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.oip = OipState.create(options, predict_client=predict_client,
                                    sidecar_client=sidecar_client, clock=clock)
    register_oip_exception_handlers(app)
    app.include_router(routes_oip.router)
    oip = app.state.oip
    app.add_middleware(AdmissionGuard, requests=oip.requests, inflight=oip.inflight,
                       max_bytes=routes_oip.MAX_BODY_BYTES)
    return app


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line, generated from :class:`~serve.sidecar.http.oip_options.OipOptions`."""
    p = argparse.ArgumentParser(
        prog="python -m serve.sidecar.http.oip_server",
        description="The Open Inference Protocol v2 (KServe v2) in a process of its own, "
                    "bounded (requests, bytes in flight, body deadline, parses), holding no "
                    "token; forwards each infer to TorchServe's predictions API.")
    add_options(p, oip_cli_options(), environ)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``python -m serve.sidecar.http.oip_server --help``."""
    import uvicorn

    try:
        options = build(OipOptions, build_parser().parse_args(argv))
    except ConfigError as e:
        raise SystemExit(f"serve.sidecar.http.oip_server: {e.message}") from None
    logging.basicConfig(level=options.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    _log.info("Open Inference Protocol v2 on http://%s:%d/v2 for model %r (TorchServe %s, "
              "readiness from %s)", options.host, options.port, options.model_name,
              options.inference_url, options.sidecar_url)
    sock = listen_socket(options.host, options.port)
    # limit_concurrency: uvicorn's plain 503 past it, a backstop above the app's own JSON
    # 429 (max_requests); h11_max_incomplete_event_size bounds a request's headers.
    config = uvicorn.Config(create_oip_app(options), log_level=options.log_level,
                            access_log=False, limit_concurrency=options.limit_concurrency,
                            h11_max_incomplete_event_size=16 * 1024, timeout_keep_alive=5)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
