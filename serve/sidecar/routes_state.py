"""``GET /state`` (desired vs observed, converged or why not) and ``PUT /state`` (declare).

GET is the status of the serving state: the desired state (the file), what TorchServe
serves (read now), ``converged``, the ``reason`` when not, the switch's ``phase``, the
``last_error``, the ``last_switch`` (duration, peak memory) and the repository's versions.

PUT takes a whole desired state (the ``desired`` object of GET), validates it (400 naming
the field and the rule; a version the repository lacks names the ones it has), writes the
file atomically and answers 202 at once: the reconciler applies it; poll GET /state.
Where the file is read-only (a ConfigMap) it answers 409 and says to edit the ConfigMap.
"""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends
from pydantic import ValidationError

from serve.errors import ConfigError, InvalidInput, UpstreamUnavailable
from serve.sidecar.auth import require_token
from serve.sidecar.reconciler import observed_state
from serve.sidecar.schemas import ObservedState, StateAccepted, StateStatus
from serve.sidecar.state import SidecarState, StateDep
from serve.sidecar.torchserve import Observed, observe
from serve.state import DesiredState, describe_validation_error

__all__ = ["router"]

router = APIRouter()

_SHAPE = ('a desired state is {"model": {"version": V}, "batching": {"batch_size": 1..4096, '
          '"max_batch_delay_ms": 0..10000}, "workers": 1..64, "rollout": null}')


@router.get("/state", response_model=StateStatus, response_model_by_alias=True,
            summary="Desired vs observed serving state, converged or why not")
async def get_state(state: StateDep) -> StateStatus:
    reconciler = state.reconciler
    if reconciler is not None:
        return await reconciler.status()
    return await _status_without_file(state)


@router.put("/state", status_code=202, response_model=StateAccepted,
            dependencies=[Depends(require_token)],
            summary="Declare the desired serving state (applied in the background)",
            openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/DesiredState"}}}}},
            responses={400: {"description": "invalid desired state"}, 401: {}, 403: {},
                       409: {"description": "the desired-state file is read-only (a "
                                            "ConfigMap), or the sidecar has none"}})
async def put_state(body: Annotated[Any, Body()], state: StateDep) -> StateAccepted:
    reconciler = state.require_reconciler("PUT /state")
    desired = _validated(body, state)
    reconciler.write(desired)
    last = reconciler.last_pass
    converged = bool(last is not None and last.converged and reconciler.desired == desired)
    return StateAccepted(
        desired=desired, converged=converged, target_serving_version=desired.serving_version(),
        state_file=str(reconciler.path),
        message="written; the reconciler applies it now: GET /state shows the progress")


def _validated(body: Any, state: SidecarState) -> DesiredState:
    """The body as a desired state whose version is in the repository, or 400."""
    if not isinstance(body, dict):
        raise InvalidInput(f"invalid PUT /state body: body: must be a JSON object "
                           f"(got {type(body).__name__}); {_SHAPE}")
    try:
        desired = DesiredState.model_validate(body)
    except ValidationError as e:
        raise InvalidInput(f"invalid PUT /state body: {describe_validation_error(e)}"
                           ) from None
    repository = state.repository
    if repository is not None and not repository.exists(desired.model.version):
        try:
            repository.archive(desired.model.version)
        except ConfigError as e:
            raise InvalidInput(f"invalid PUT /state body: model.version: {e.message}") from None
    return desired


async def _status_without_file(state: SidecarState) -> StateStatus:
    """GET /state of a sidecar started without --state-file: what serves, and why
    nothing is reconciled."""
    reason = ("this sidecar was started without --state-file: nothing declares what to "
              "serve, and nothing is reconciled")
    try:
        observed: ObservedState = observed_state(await observe(state.torchserve))
    except UpstreamUnavailable as e:
        observed = observed_state(Observed(default=None))
        reason = f"{reason}; TorchServe did not answer: {e.message}"
    versions = state.repository.versions() if state.repository is not None else []
    return StateStatus(desired=None, observed=observed, converged=False, reason=reason,
                       phase=state.switch.phase.value, last_error=state.switch.last_error,
                       last_switch=None, target_serving_version=None,
                       available_versions=versions, state_file=None,
                       state_file_writable=False)
