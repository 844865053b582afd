"""``GET /batching`` (the default version's settings) and ``PUT /batching`` (change them).

PUT /batching (:mod:`serve.sidecar.control.batching`) is a shortcut into the desired
state (:mod:`serve.state`): it edits the batching and workers of the desired-state file,
wakes the reconciler and waits (up to ``register_timeout_s + drain_timeout_s``) until
TorchServe serves the new settings, then answers what changed. The reconciler does the
switch (:mod:`serve.sidecar.control.switch`): a new serving version is registered and made default, then the old one is drained and
unregistered; requests keep flowing throughout. If the switch fails (or is refused for
memory) the file is put back as it was, so the declared state stays what serves, and the
error is the answer. One PUT /batching at a time: a second one while a switch runs gets
409. Without a desired-state file (``--state-file``) it answers 409.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends

from serve.phases import SwitchPhase
from serve.sidecar.adapters.torchserve import batching_state
from serve.sidecar.control.batching import apply_batching, edited
from serve.sidecar.http.auth import require_token
from serve.sidecar.http.schemas import BatchingStatus, BatchingUpdate, BatchingUpdateResult
from serve.sidecar.root import SidecarDep

__all__ = ["apply_batching", "edited", "require_token", "router"]

router = APIRouter()


@router.get("/batching", response_model=BatchingStatus, response_model_exclude_none=True,
            summary="Batching settings of the default model version")
async def get_batching(sidecar: SidecarDep) -> BatchingStatus:
    current = batching_state(await sidecar.torchserve.describe())
    switch = sidecar.switch
    phase = None if switch.phase is SwitchPhase.IDLE else switch.phase.value
    return BatchingStatus(**current.model_dump(), switch_phase=phase,
                          switch_error=switch.last_error)


@router.put("/batching", response_model=BatchingUpdateResult,
            dependencies=[Depends(require_token)],
            summary="Apply new batching settings with zero failed requests",
            responses={400: {"description": "invalid body"}, 401: {}, 403: {},
                       409: {"description": "another update is in progress, the state "
                                            "file is read-only, or there is none"},
                       503: {"description": "TorchServe could not apply it"},
                       507: {"description": "two versions would not fit in memory"}})
async def put_batching(update: BatchingUpdate, sidecar: SidecarDep) -> BatchingUpdateResult:
    return await sidecar.batching_updates("PUT /batching").put(update)
