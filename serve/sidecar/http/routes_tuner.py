"""``GET /tuner`` (the batching tuner's state and decisions) and ``PUT /tuner`` (turn it
on or off, change its p99 goal).

The tuner (:mod:`serve.sidecar.control.tuner`) picks TorchServe's batch size and max delay from
the traffic and applies them through the reconciler, as PUT /batching would, with zero
failed requests. It is on by default and needs a desired-state file (``--state-file``);
``--autotune off`` or ``DLRM_AUTOTUNE=0`` start it off. A batching set by hand (PUT
/batching, or PUT /state with a new batching) turns it off: the hand-set value is
pinned until ``PUT /tuner {"enabled": true}``. Turned off, the declared batching serves
again. GET /state shows the same object under ``tuner``.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends

from serve.errors import Conflict
from serve.sidecar.http.auth import require_token
from serve.sidecar.http.schemas import TunerStatus, TunerUpdate
from serve.sidecar.root import Sidecar, SidecarDep

__all__ = ["router", "tuner_status"]

router = APIRouter()


def tuner_status(sidecar: Sidecar) -> TunerStatus | None:
    """The tuner's status (None when the sidecar has none)."""
    return TunerStatus.model_validate(sidecar.tuner.status()) if sidecar.tuner is not None else None


@router.get("/tuner", response_model=TunerStatus, summary="The batching tuner: phase, "
            "traffic seen, trials and decisions")
async def get_tuner(sidecar: SidecarDep) -> TunerStatus:
    status = tuner_status(sidecar)
    if status is None:
        raise Conflict("this sidecar has no batching tuner")
    return status


@router.put("/tuner", response_model=TunerStatus, dependencies=[Depends(require_token)],
            summary="Turn the batching tuner on or off, or change its p99 goal",
            responses={400: {"description": "invalid body"}, 401: {}, 403: {},
                       409: {"description": "the sidecar runs without a desired-state file"}})
async def put_tuner(update: TunerUpdate, sidecar: SidecarDep) -> TunerStatus:
    sidecar.require_reconciler("PUT /tuner")
    tuner = sidecar.tuner
    if tuner is None:
        raise Conflict("this sidecar has no batching tuner")
    if update.p99_goal_ms is not None:
        tuner.with_goal(update.p99_goal_ms)
    if update.enabled is not None and sidecar.tuning is not None:
        sidecar.tuning.set_enabled(update.enabled, "turned on by PUT /tuner" if update.enabled
                                 else "turned off by PUT /tuner: the declared batching serves")
    status = tuner_status(sidecar)
    if status is None:  # unreachable: checked above
        raise Conflict("this sidecar has no batching tuner")
    return status
