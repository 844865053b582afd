"""``GET /batching`` (the default version's settings) and ``PUT /batching`` (change them).

PUT /batching is a shortcut into the desired state (:mod:`serve.state`): it edits the
batching and workers of the desired-state file, wakes the reconciler and waits (up to
``register_timeout_s + drain_timeout_s``) until TorchServe serves the new settings, then
answers what changed. The reconciler does the switch (:mod:`serve.sidecar.control.switch`): a new
serving version is registered and made default, then the old one is drained and
unregistered; requests keep flowing throughout. If the switch fails (or is refused for
memory) the file is put back as it was, so the declared state stays what serves, and the
error is the answer. One PUT /batching at a time: a second one while a switch runs gets
409. Without a desired-state file (``--state-file``) it answers 409.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter, Depends

from serve.errors import Conflict
from serve.sidecar.adapters.torchserve import TorchServeClient, batching_state
from serve.sidecar.control.reconciler import Reconciler, SwitchFailed
from serve.sidecar.control.switch import SwitchPhase
from serve.sidecar.http.auth import require_token
from serve.sidecar.http.schemas import BatchingStatus, BatchingUpdate, BatchingUpdateResult
from serve.sidecar.root import Sidecar, SidecarDep
from serve.state import Batching, DesiredState

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
    reconciler = sidecar.require_reconciler("PUT /batching")
    if sidecar.update_lock.locked():
        sidecar.metrics.observe_update("conflict")
        raise Conflict("another PUT /batching is being applied; retry when it returns")
    await sidecar.update_lock.acquire()  # no await between the check and this: no race
    # A client that hangs up must not cancel the wait half-way (a lock held by nobody,
    # a failed change left declared): the task runs to its end regardless.
    task = asyncio.create_task(_apply(sidecar, reconciler, update))
    sidecar.running.add(task)
    task.add_done_callback(sidecar.running.discard)
    return await asyncio.shield(task)


async def _apply(sidecar: Sidecar, reconciler: Reconciler,
                 update: BatchingUpdate) -> BatchingUpdateResult:
    """Apply ``update`` (the caller holds the update lock; released here) and count it."""
    # A setting given by hand is pinned: the tuner would otherwise move it again.
    tuning = sidecar.tuning
    pinned = (tuning.pin_batching(f"PUT /batching {update.model_dump(exclude_none=True)}")
              if tuning is not None else False)
    try:
        result = await apply_batching(reconciler, sidecar.torchserve, update, sidecar.clock)
    except Conflict:
        sidecar.metrics.observe_update("conflict")
        raise
    except Exception:
        sidecar.metrics.observe_update("failed")
        raise
    finally:
        sidecar.update_lock.release()
    sidecar.metrics.observe_update("applied" if result.changed else "unchanged", result.seconds)
    return result.model_copy(update={"tuner_turned_off": pinned})


def edited(desired: DesiredState, update: BatchingUpdate) -> DesiredState:
    """``desired`` with the fields ``update`` gives (the others kept)."""
    b = desired.batching
    batching = Batching(
        batch_size=b.batch_size if update.batch_size is None else update.batch_size,
        max_batch_delay_ms=(b.max_batch_delay_ms if update.max_batch_delay_ms is None
                            else update.max_batch_delay_ms))
    workers = desired.workers if update.workers is None else update.workers
    return desired.model_copy(update={"batching": batching, "workers": workers})


async def apply_batching(reconciler: Reconciler, ts: TorchServeClient, update: BatchingUpdate,
                         clock: Callable[[], float]) -> BatchingUpdateResult:
    """Write the edited desired state, wait until it serves; revert the file on failure.

    Raises:
        UpstreamUnavailable: TorchServe is down or has nothing registered (checked
            before writing), or the switch failed or did not finish in time.
        InsufficientMemory: the switch was refused (file reverted).
        Conflict: no valid desired state to edit, the file is read-only, or it was
            changed by someone else meanwhile.
    """
    t0 = clock()
    before = batching_state(await ts.describe())
    base, why = reconciler.declared_now()
    if base is None:
        raise Conflict(f"there is no valid desired state to edit ({why}); "
                       "declare one with PUT /state")
    new = edited(base, update)
    after_pass, digest = reconciler.write(new)
    timeout = ts.config.register_timeout_s + ts.config.drain_timeout_s
    try:
        served = await reconciler.wait_serving(after_pass, digest, timeout)
    except SwitchFailed as e:
        reconciler.revert(new, base)
        raise e.error from None
    after = batching_state(await ts.describe())
    changed = after.model_version != before.model_version
    removed = before.model_version if changed and served.cleanup_error is None else None
    return BatchingUpdateResult(**after.model_dump(), changed=changed, previous=before,
                                seconds=clock() - t0, removed_version=removed)
