"""``GET /healthz`` (the sidecar is alive), ``GET /readyz`` (the model can answer) and
``POST /drain`` (shutdown: refuse new requests, answer the accepted ones).

Kubernetes probes: liveness must not depend on TorchServe (a slow model load would get
the sidecar restarted for nothing); readiness says whether the pod can serve, and turns
503 for good once a drain began (:mod:`serve.sidecar.control.drain`).
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from serve.errors import UpstreamUnavailable
from serve.sidecar.adapters.torchserve import ready_workers
from serve.sidecar.http.auth import require_token
from serve.sidecar.root import Sidecar, SidecarDep

__all__ = ["readiness", "router"]

router = APIRouter()


@router.get("/healthz", summary="The sidecar process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/readyz", summary="TorchServe's model has a READY worker and /ping answers",
            responses={503: {"description": "not ready, with the reason"}})
async def readyz(sidecar: SidecarDep) -> JSONResponse:
    try:
        return JSONResponse(await readiness(sidecar))
    except UpstreamUnavailable as e:
        return JSONResponse(e.to_json(), status_code=503)


async def readiness(sidecar: Sidecar) -> dict[str, Any]:
    """``{"status": "ready", "model", "model_version", "ready_workers"}`` when the pod can
    serve (not draining, a READY worker, /ping answers, deltas caught up); raises
    UpstreamUnavailable naming why not. ``GET /readyz`` and the Open Inference Protocol's
    ready paths (:mod:`serve.sidecar.http.routes_oip`) answer from it."""
    model = sidecar.config.model_name
    if sidecar.draining:
        raise UpstreamUnavailable(f"the pod is shutting down (drain: "
                                  f"{sidecar.drainer.report.phase}); it takes no new requests")
    try:
        desc = await sidecar.torchserve.describe()
    except UpstreamUnavailable:
        sidecar.metrics.set_up("management", False)
        raise
    sidecar.metrics.set_up("management", True)
    ready = ready_workers(desc)
    if ready == 0:
        statuses = sorted({str(w.get("status")) for w in desc.get("workers") or []})
        raise UpstreamUnavailable(
            f"model {model!r} version {desc.get('modelVersion')} has no READY "
            f"worker (statuses: {', '.join(statuses) or 'no workers'}); wait for it to load")
    await sidecar.torchserve.ping()  # READY workers are no use if inference does not answer
    if sidecar.deltas is not None:  # a new pod serves only once it has its version's deltas
        need_sync = sidecar.config.delta_sync_s > 0 and bool(sidecar.config.delta_volume_roots)
        behind = await sidecar.deltas.progress.not_caught_up(
            volume_read=not need_sync or sidecar.deltas.volume.synced)
        if behind is not None:
            raise UpstreamUnavailable(behind)
    return {"status": "ready", "model": model, "model_version": str(desc.get("modelVersion")),
            "ready_workers": ready}


@router.get("/drain", summary="The shutdown drain's state (a read: no token)")
async def drain_state(sidecar: SidecarDep) -> JSONResponse:
    """``drained``, ``phase``, ``seconds``, ``versions``, ``error`` of the drain (phase
    ``serving`` before any). What the torchserve container's preStop waits on
    (``python -m serve.ops.drain --wait``), so it needs no token."""
    return JSONResponse(sidecar.drainer.report.to_json())


@router.post("/drain", dependencies=[Depends(require_token)],
             summary="Shutdown: refuse new requests (503), answer the accepted ones",
             responses={401: {}, 403: {}, 503: {"description": "the drain failed"}})
async def drain(sidecar: SidecarDep) -> JSONResponse:
    """Pause the reconciler, make the closed version default, drain the others; answers
    when every accepted request is answered (then stop TorchServe). Idempotent."""
    report = await sidecar.drainer.drain()
    return JSONResponse(report.to_json(), status_code=200 if report.drained else 503)
