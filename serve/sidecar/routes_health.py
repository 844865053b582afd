"""``GET /healthz`` (the sidecar is alive) and ``GET /readyz`` (the model can answer).

Kubernetes probes: liveness must not depend on TorchServe (a slow model load would get
the sidecar restarted for nothing); readiness says whether the pod can serve.
"""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from serve.errors import UpstreamUnavailable
from serve.sidecar.state import StateDep
from serve.sidecar.torchserve import ready_workers

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz", summary="The sidecar process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/readyz", summary="TorchServe's model has a READY worker and /ping answers",
            responses={503: {"description": "not ready, with the reason"}})
async def readyz(state: StateDep) -> JSONResponse:
    model = state.config.model_name
    try:
        desc = await state.torchserve.describe()
    except UpstreamUnavailable as e:
        state.metrics.set_up("management", False)
        return JSONResponse(e.to_json(), status_code=503)
    state.metrics.set_up("management", True)
    ready = ready_workers(desc)
    if ready == 0:
        statuses = sorted({str(w.get("status")) for w in desc.get("workers") or []})
        err = UpstreamUnavailable(
            f"model {model!r} version {desc.get('modelVersion')} has no READY "
            f"worker (statuses: {', '.join(statuses) or 'no workers'}); wait for it to load")
        return JSONResponse(err.to_json(), status_code=503)
    try:  # READY workers are no use if the inference API does not answer
        await state.torchserve.ping()
    except UpstreamUnavailable as e:
        return JSONResponse(e.to_json(), status_code=503)
    return JSONResponse({"status": "ready", "model": model,
                         "model_version": str(desc.get("modelVersion")),
                         "ready_workers": ready})
