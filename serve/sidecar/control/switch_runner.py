"""The reconciler's hands: run a version switch, clean up after it, back off after a
failure.

:class:`SwitchRunner` is what a reconcile pass (:mod:`serve.sidecar.control.reconciler`)
acts through (:meth:`SwitchRunner.act`): when :func:`~serve.sidecar.control.assessment.assess`
says ``switch`` or ``cleanup``, it plans and runs the switch
(:class:`~serve.sidecar.control.switch.VersionSwitch`) while sampling memory, records
it (:class:`~serve.sidecar.control.views.SwitchRecord`: duration, peak memory), drains
and unregisters the versions left over, deletes derived archives nobody uses, and keeps
the retry back-off of a failed switch (2, 4, 8... up to 300 s). Its state is changed
only by those calls, i.e. only inside a pass; reads (:meth:`SwitchRunner.retry_wait`,
:attr:`SwitchRunner.last_switch`) change nothing.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from serve.errors import InsufficientMemory, ServeError
from serve.phases import ReconcileResult
from serve.sidecar.adapters.archives import control_path, is_sidecar_archive
from serve.sidecar.adapters.memory import MemoryCheck
from serve.sidecar.adapters.torchserve import Observed, Registered, TorchServeClient, observe
from serve.sidecar.config import SidecarConfig
from serve.sidecar.control.assessment import Action, assess
from serve.sidecar.control.switch import SwitchPlan, VersionSwitch
from serve.sidecar.control.views import SwitchRecord
from serve.state import DesiredState
from serve.store.repository import ModelRepository

__all__ = ["SwitchRunner", "as_serve_error"]

_log = logging.getLogger(__name__)


def as_serve_error(e: BaseException) -> ServeError:
    """``e`` as the ServeError a caller is answered with."""
    return e if isinstance(e, ServeError) else ServeError(repr(e))


class SwitchRunner:
    """Runs switches and clean-ups for the reconciler (see the module docstring).

    Args:
        torchserve: the management API client (memory sampling sees every version).
        config: model name and store (the archives swept).
        switch: the version switch (owns the phase, the memory probe and the peak).
        repository: where the model versions' archives are.
        clock: monotonic seconds (durations, back-off).
        retry_base_s, retry_max_s: back-off after a failed switch: base, 2 x base, ...
            up to max.
        sample_interval_s: how often memory is sampled while a switch runs.
    """

    def __init__(self, torchserve: TorchServeClient, config: SidecarConfig, *,
                 switch: VersionSwitch, repository: ModelRepository,
                 clock: Callable[[], float], retry_base_s: float = 2.0,
                 retry_max_s: float = 300.0, sample_interval_s: float = 0.25) -> None:
        self.ts, self.config, self.switch = torchserve, config, switch
        self.repository = repository
        self.clock = clock
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.sample_interval_s = sample_interval_s
        self.last_switch: SwitchRecord | None = None
        self.failures = 0
        self.failed_error: str | None = None
        self._retry_at = 0.0
        self._switch_t0: float | None = None

    # ------------------------------------------------------------------ one pass's actions

    async def act(self, desired: DesiredState | None
                  ) -> tuple[ReconcileResult, ServeError | None, str | None, Observed | None]:
        """This pass's actions toward ``desired`` (the effective desired state): the
        switch when :func:`assess` says ``switch`` (unless the back-off waits), then the
        clean-up when it says ``cleanup``. Returns (result, switch error, clean-up error,
        what TorchServe serves now or None when an action may have changed it).

        Raises:
            UpstreamUnavailable: TorchServe did not answer.
        """
        observed = await observe(self.ts)
        a = assess(desired, observed)
        acted = False
        if a.action is Action.SWITCH and desired is not None:
            if self.retry_wait() > 0:
                return ReconcileResult.WAITING, None, None, observed
            error = await self.run(desired, observed)
            if error is not None:
                result = (ReconcileResult.REFUSED if isinstance(error, InsufficientMemory)
                          else ReconcileResult.FAILED)
                return result, error, None, None
            acted = True
            observed = await observe(self.ts)
            a = assess(desired, observed)
        if a.action is Action.CLEANUP and a.target is not None:
            cleanup_error = await self.cleanup(observed, a.target)
            self.close_record(cleanup_error)
            if cleanup_error is not None:
                return ReconcileResult.FAILED, None, cleanup_error, None
            acted = True
        if acted:
            self.close_record(None)
            self.switch.idle()
            return ReconcileResult.APPLIED, None, None, None
        converged = ReconcileResult.CONVERGED if a.converged else ReconcileResult.WAITING
        return converged, None, None, observed

    # ------------------------------------------------------------------ the switch

    async def run(self, desired: DesiredState, observed: Observed) -> ServeError | None:
        """Plan and run the switch to ``desired``; the error (recorded, retried later)."""
        self._switch_t0 = t0 = self.clock()
        if self.switch.memory.tracker is not None:
            self.switch.memory.tracker.reset()
        check: MemoryCheck | None = None
        plan: SwitchPlan | None = None
        try:
            plan = self.switch.plan(observed, desired, self.repository)
            if plan is None:
                return None
            sampler = asyncio.create_task(self._sample_while_switching())
            try:
                check = await self.switch.switch(plan, observed)
            finally:
                # gather, not suppress(CancelledError): a cancel of THIS task arriving
                # here must propagate (suppressing it kept the reconciler looping).
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
        except Exception as e:  # noqa: BLE001 - a bad archive fails this switch, not the loop
            error = as_serve_error(e)
            if plan is None:  # plan() failed (e.g. no such version): the switch never began
                self.switch.fail(e)
            self._record(observed, desired, t0, error, check)
            self._schedule_retry(error)
            return error
        self._record(observed, desired, t0, None, check)
        self.failures = 0
        return None

    async def _sample_while_switching(self) -> None:
        """Sample memory every ``sample_interval_s`` over every registered version's
        workers (new ones appear while TorchServe loads them)."""
        while True:
            await asyncio.sleep(self.sample_interval_s)
            try:
                found = [Registered.from_description(d) for d in await self.ts.describe_all()]
            except ServeError:
                continue
            for r in found:
                self.switch.memory.live_pids.update(r.pids)
            self.switch.memory.sample()

    # ------------------------------------------------------------------ the clean-up

    async def cleanup(self, observed: Observed, target: str) -> str | None:
        """Drain and unregister every registered version but ``target``; delete derived
        archives no registered version uses. The errors (None when all went)."""
        errors: list[str] = []
        still = {target}
        for old in observed.versions:
            if old.version == target:
                continue
            try:
                await self.switch.retire(old)
            except ServeError as e:
                errors.append(e.message)
                still.add(old.version)
        self.sweep_archives([r for r in observed.versions if r.version in still])
        return "; ".join(errors) or None

    def sweep_archives(self, registered: list[Registered]) -> list[Path]:
        """Delete the derived archives in the model store that no registered version
        uses (left by a pass that stopped half-way); the paths deleted."""
        store, model = self.config.model_store, self.config.model_name
        keep = {Path(r.url).name for r in registered}
        gone = []
        for path in sorted(store.glob(f"{model}-*.mar")):
            if path.name not in keep and is_sidecar_archive(path, store, model):
                path.unlink(missing_ok=True)
                gone.append(path)
        live = {control_path(store, model, r.version).name for r in registered}
        for path in sorted(store.glob(f"{model}-*.control.json")):
            if path.name not in live:
                path.unlink(missing_ok=True)
                gone.append(path)
        return gone

    # ------------------------------------------------------------------ the record

    def _record(self, observed: Observed, desired: DesiredState, t0: float,
                error: ServeError | None, check: MemoryCheck | None) -> None:
        tracker, memory = self.switch.memory.tracker, self.switch.memory.probe
        self.last_switch = SwitchRecord.model_validate({
            "from": observed.default, "to": desired.serving_version(), "ok": error is None,
            "seconds": round(self.clock() - t0, 3), "error": error.message if error else None,
            "peak_memory_bytes": tracker.peak_bytes if tracker else None,
            "peak_workers_rss_bytes": tracker.peak_rss_bytes if tracker else None,
            "memory_limit_bytes": memory.limit()[0] if memory else None,
            "memory_check": check.to_json() if check else None})
        if error is None:
            _log.info("switch %s -> %s done in %.1f s", observed.default,
                      desired.serving_version(), self.clock() - t0)

    def close_record(self, cleanup_error: str | None) -> None:
        """Extend the last switch's record over its clean-up (duration, peak)."""
        record, t0 = self.last_switch, self._switch_t0
        if record is None or t0 is None or not record.ok:
            return
        tracker = self.switch.memory.tracker
        self.last_switch = record.model_copy(update={
            "seconds": round(self.clock() - t0, 3), "error": cleanup_error,
            "peak_memory_bytes": tracker.peak_bytes if tracker else None,
            "peak_workers_rss_bytes": tracker.peak_rss_bytes if tracker else None})
        self._switch_t0 = None

    # ------------------------------------------------------------------ the back-off

    def _schedule_retry(self, error: ServeError) -> None:
        self.failures += 1
        delay = min(self.retry_max_s, self.retry_base_s * 2 ** (self.failures - 1))
        self._retry_at = self.clock() + delay
        self.failed_error = error.message
        _log.error("switch failed (retry in %.0f s): %s", delay, error.message)

    def reset_retry(self) -> None:
        """Retry a failed target at once (the desired state changed, or was asked again)."""
        self.failures, self._retry_at = 0, 0.0

    def retry_wait(self) -> float:
        """Seconds until a failed switch may be retried (0: now)."""
        return max(0.0, self._retry_at - self.clock()) if self.failures else 0.0
