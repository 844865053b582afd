"""``GET /batching`` (the default version's settings) and ``PUT /batching`` (change them).

PUT needs the bearer token and runs the :class:`~serve.sidecar.switch.VersionSwitch`:
a new version with the new settings is registered and made default, then the old one is
drained and unregistered; requests keep flowing throughout. One PUT at a time: a second
one while a switch runs gets 409. The change lives as long as the TorchServe process:
persist it in the model's build settings.
"""
from __future__ import annotations

import asyncio
import hmac
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve.errors import Conflict, Forbidden, Unauthorized
from serve.sidecar.config import TOKEN_ENV
from serve.sidecar.schemas import BatchingStatus, BatchingUpdate, BatchingUpdateResult
from serve.sidecar.state import SidecarState, StateDep
from serve.sidecar.switch import SwitchPhase
from serve.sidecar.torchserve import batching_state

__all__ = ["require_token", "router"]

router = APIRouter()

# auto_error=False: missing/wrong headers are answered by require_token with our JSON
# shape (401 vs 403), not by FastAPI's default. Module level, because the annotation
# is resolved from module globals (``from __future__ import annotations``).
_bearer = HTTPBearer(auto_error=False, description="PUT /batching token")
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def require_token(credentials: _Credentials, state: StateDep) -> None:
    """Dependency: 403 when writes are disabled or the token is wrong, 401 without one."""
    token = state.config.token
    if token is None:
        raise Forbidden("this sidecar has no token configured, so PUT /batching is "
                        f"disabled; start it with --token-file or {TOKEN_ENV}")
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Unauthorized("PUT /batching needs the header 'Authorization: Bearer <token>'"
                           f"; the token is in the sidecar's --token-file or {TOKEN_ENV}")
    if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        raise Forbidden("the bearer token is wrong; use the one in the sidecar's "
                        f"--token-file or {TOKEN_ENV}")


@router.get("/batching", response_model=BatchingStatus, response_model_exclude_none=True,
            summary="Batching settings of the default model version")
async def get_batching(state: StateDep) -> BatchingStatus:
    current = batching_state(await state.torchserve.describe())
    switch = state.switch
    phase = None if switch.phase is SwitchPhase.IDLE else switch.phase.value
    return BatchingStatus(**current.model_dump(), switch_phase=phase,
                          switch_error=switch.last_error)


@router.put("/batching", response_model=BatchingUpdateResult,
            dependencies=[Depends(require_token)],
            summary="Apply new batching settings with zero failed requests",
            responses={400: {"description": "invalid body"}, 401: {}, 403: {},
                       409: {"description": "another update is in progress"},
                       503: {"description": "TorchServe could not apply it"}})
async def put_batching(update: BatchingUpdate, state: StateDep) -> BatchingUpdateResult:
    if state.update_lock.locked():
        state.metrics.observe_update("conflict")
        raise Conflict("another PUT /batching is being applied; retry when it returns")
    await state.update_lock.acquire()  # no await between the check and this: no race
    # A client that hangs up must not cancel a switch half-way (a registered but
    # unused version, a lock held by nobody): the task runs to its end regardless.
    task = asyncio.create_task(_apply(state, update))
    state.running.add(task)
    task.add_done_callback(state.running.discard)
    return await asyncio.shield(task)


async def _apply(state: SidecarState, update: BatchingUpdate) -> BatchingUpdateResult:
    """Run the switch (the caller holds the update lock; released here) and count it."""
    try:
        result = await state.switch.run(update)
    except Exception:
        state.metrics.observe_update("failed")
        raise
    finally:
        state.update_lock.release()
    state.metrics.observe_update("applied" if result.changed else "unchanged", result.seconds)
    return result
