"""What the Open Inference Protocol's routes (:mod:`serve.sidecar.http.routes_oip`) share in
its own process (:mod:`serve.sidecar.http.oip_server`): its options, its own HTTP clients,
its bounds (:mod:`serve.sidecar.http.oip_guard`) and the readiness it reads from the sidecar.

It holds no token and no part of the sidecar: TorchServe's inference API (to forward each
infer), the sidecar's public ``GET /readyz`` (cached, :class:`~serve.sidecar.http.oip_guard.ReadyCache`:
ready or why not, and the served version) and, read only, the model repository (the
served version's request schema from its build report).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from fastapi import Depends, Request

from serve.errors import ServeError, UpstreamUnavailable
from serve.schema import ModelSchema
from serve.sidecar.adapters.model_schemas import SchemaCache
from serve.sidecar.adapters.torchserve import TorchServeClient
from serve.sidecar.config import SidecarConfig
from serve.sidecar.http.oip_guard import Budget, ParseSlots, ReadyCache
from serve.sidecar.http.oip_options import OipOptions
from serve.state import parse_serving_version
from serve.store.repository import ModelRepository

__all__ = ["OipDep", "OipState", "get_oip"]

#: Longest wait for the sidecar's /readyz (s): its own probe's timeout is 2 s.
READYZ_TIMEOUT_S = 2.0


@dataclass
class OipState:
    """The OIP process's parts.

    Attributes:
        options: see :class:`~serve.sidecar.http.oip_options.OipOptions`.
        torchserve: predicts go through it, on the OIP's own client (never the sidecar's).
        ready: the sidecar's ``GET /readyz`` answer, at most one call per ``ready_cache_s``.
        schemas: the versions' schemas from the repository; None: the built-in DLRM's.
        inflight: bytes of bodies held; requests: infers at once; parses: parse slots.
    """

    options: OipOptions
    torchserve: TorchServeClient
    ready: ReadyCache[dict[str, Any]]
    schemas: SchemaCache | None
    inflight: Budget
    requests: Budget
    parses: ParseSlots

    @classmethod
    def create(cls, options: OipOptions, *, predict_client: httpx.AsyncClient,
               sidecar_client: httpx.AsyncClient,
               clock: Callable[[], float] = time.monotonic) -> OipState:
        """The parts over two clients the caller owns: ``predict_client`` for TorchServe's
        inference API, ``sidecar_client`` for the sidecar's ``/readyz`` (a flood of
        predicts cannot starve the readiness call of connections)."""
        ts = TorchServeClient(SidecarConfig(inference_url=options.inference_url,
                                            model_name=options.model_name), predict_client)
        url = f"{options.sidecar_url}/readyz"

        async def readyz() -> dict[str, Any]:
            try:
                r = await sidecar_client.get(url, timeout=READYZ_TIMEOUT_S)
            except httpx.HTTPError as e:
                raise UpstreamUnavailable(f"the sidecar's readiness at {url} did not answer "
                                          f"({type(e).__name__}); check that the sidecar "
                                          "is running") from None
            try:
                body = r.json()
            except ValueError:
                body = {}
            if r.status_code != 200 or not isinstance(body, dict):
                message = body.get("message") if isinstance(body, dict) else None
                raise UpstreamUnavailable(str(message or f"{url} answered {r.status_code}"))
            return body

        schemas = (SchemaCache(ModelRepository(options.repositories,
                                               options.model_name).report)
                   if options.repositories else None)
        return cls(options=options, torchserve=ts,
                   ready=ReadyCache(readyz, options.ready_cache_s, clock=clock),
                   schemas=schemas,
                   inflight=Budget(options.max_inflight_bytes, "bytes of bodies in flight"),
                   requests=Budget(options.max_requests, "requests at once"),
                   parses=ParseSlots(options.max_parses, options.parse_wait_s,
                                     processes=options.parse_in == "process"))

    async def readiness(self) -> dict[str, Any]:
        """The sidecar's ``/readyz`` answer (cached); UpstreamUnavailable naming why not."""
        return await self.ready.get()

    async def served(self) -> tuple[str, ModelSchema | None]:
        """The served repository version and its schema (None: the built-in DLRM's):
        from the sidecar's readiness (the default version TorchServe serves); while the
        sidecar says not ready, the last version it named."""
        try:
            answer = await self.ready.get()
        except ServeError:
            if self.ready.last_good is None:
                raise
            answer = self.ready.last_good
        name = str(answer.get("model_version"))
        parsed = parse_serving_version(name)
        version = parsed[0] if parsed else name
        return version, self.schemas.schema(version) if self.schemas is not None else None


def get_oip(request: Request) -> OipState:
    """The process's :class:`OipState` (``app.state.oip``)."""
    state: OipState = request.app.state.oip
    return state


#: Route parameter type: ``async def route(oip: OipDep)``.
OipDep = Annotated[OipState, Depends(get_oip)]
