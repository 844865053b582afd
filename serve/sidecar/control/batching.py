"""PUT /batching: a shortcut into the desired state, applied by the reconciler.

:class:`BatchingUpdates` edits the batching and workers of the desired-state file
(:func:`edited`), wakes the reconciler and waits (up to ``register_timeout_s +
drain_timeout_s``) until TorchServe serves the new settings (:func:`apply_batching`).
If the switch fails (or is refused for memory) the file is put back as it was, so the
declared state stays what serves, and the error is the answer. One update at a time: a
second one while a switch runs is a :class:`~serve.errors.Conflict`. A setting given by
hand is pinned: the batching tuner is turned off (it would move it again). Each update is
counted in ``dlrm_batching_updates_total{result}``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from serve.errors import Conflict
from serve.metrics.sidecar import SidecarMetrics
from serve.sidecar.adapters.torchserve import TorchServeClient, batching_state
from serve.sidecar.control.reconciler import Reconciler, SwitchFailed
from serve.sidecar.control.tuner_loop import TuningLoop
from serve.sidecar.control.views import BatchingUpdate, BatchingUpdateResult
from serve.state import Batching, DesiredState

__all__ = ["BatchingUpdates", "apply_batching", "edited"]


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
        served = await reconciler.passes.wait_serving(after_pass, digest, timeout)
    except SwitchFailed as e:
        reconciler.revert(new, base)
        raise e.error from None
    after = batching_state(await ts.describe())
    changed = after.model_version != before.model_version
    removed = before.model_version if changed and served.cleanup_error is None else None
    return BatchingUpdateResult(**after.model_dump(), changed=changed, previous=before,
                                seconds=clock() - t0, removed_version=removed)


class BatchingUpdates:
    """PUT /batching, one at a time (see the module docstring).

    Args:
        reconciler: applies the edited desired state.
        torchserve: what serves before and after.
        metrics: counts each update by result.
        tuning: turned off by a hand-set batching; None: no tuner.
        clock: monotonic seconds (the update's duration).
    """

    def __init__(self, reconciler: Reconciler, *, torchserve: TorchServeClient,
                 metrics: SidecarMetrics, tuning: TuningLoop | None,
                 clock: Callable[[], float]) -> None:
        self.reconciler, self.ts, self.metrics = reconciler, torchserve, metrics
        self.tuning, self.clock = tuning, clock
        self.lock = asyncio.Lock()
        self.running: set[asyncio.Task[Any]] = set()

    async def put(self, update: BatchingUpdate) -> BatchingUpdateResult:
        """Apply ``update``; a second call while one runs is refused.

        Raises:
            Conflict: another update is being applied (and as :func:`apply_batching`).
        """
        if self.lock.locked():
            self.metrics.observe_update("conflict")
            raise Conflict("another PUT /batching is being applied; retry when it returns")
        await self.lock.acquire()  # no await between the check and this: no race
        # A client that hangs up must not cancel the wait half-way (a lock held by
        # nobody, a failed change left declared): the task runs to its end regardless.
        task = asyncio.create_task(self._apply(update))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return await asyncio.shield(task)

    async def _apply(self, update: BatchingUpdate) -> BatchingUpdateResult:
        """Apply ``update`` (the caller holds the lock; released here) and count it."""
        tuning = self.tuning
        pinned = (tuning.pin_batching(f"PUT /batching {update.model_dump(exclude_none=True)}")
                  if tuning is not None else False)
        try:
            result = await apply_batching(self.reconciler, self.ts, update, self.clock)
        except Conflict:
            self.metrics.observe_update("conflict")
            raise
        except Exception:
            self.metrics.observe_update("failed")
            raise
        finally:
            self.lock.release()
        self.metrics.observe_update("applied" if result.changed else "unchanged",
                                    result.seconds)
        return result.model_copy(update={"tuner_turned_off": pinned})
