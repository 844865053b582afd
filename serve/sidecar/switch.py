"""The version switch behind PUT /batching: new settings with zero failed requests.

TorchServe fixes a version's batching at registration, so new settings need a new
version. :class:`VersionSwitch` takes it there in small steps, each a method that can be
run (and tested) on its own and that is harmless to run twice:

``copy``
    write ``<model>-v<new>.mar``: the default version's archive with the new version
    and settings (:func:`~serve.sidecar.mar.rewrite_mar`).
``register``
    ``POST /models`` for it (skipped when that version is already registered).
``wait_ready``
    until it has as many READY workers as asked, within ``register_timeout_s``.
``set_default``
    ``PUT /models/{m}/{new}/set-default``: from here new requests go to the new version.
``drain``
    until the old version's queue is empty, judged from TorchServe's own description
    (``jobQueueStatus.pendingRequests`` == 0 on two reads in a row), and at least
    ``switch_grace_s`` after the switch.
``unregister``
    ``DELETE`` the old version, forget its workers' live gauges, delete its archive if
    the sidecar wrote it.
``rollback``
    after a failure in copy/register/wait_ready/set_default: unregister the new version
    and delete its archive; the old version was never replaced, so it stays default.

A failure in ``drain`` or ``unregister`` comes after the switch: the new version serves,
so there is nothing to roll back; the old version stays registered (no queued request
is failed) and the result says ``removed_version: null``.

:attr:`VersionSwitch.phase` is the current step (a :class:`SwitchPhase`), mirrored by the
``dlrm_switch_phase`` gauge and GET /batching; :attr:`VersionSwitch.last_error` says why
the last switch failed. Not thread-safe, and one switch at a time: the caller (PUT
/batching) holds a lock around :meth:`VersionSwitch.run`.

Example::

    switch = VersionSwitch(TorchServeClient(config, client), config)
    result = await switch.run(BatchingUpdate(batch_size=16))
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from serve.errors import ServeError, UpstreamUnavailable
from serve.sidecar.config import SidecarConfig
from serve.sidecar.mar import is_sidecar_archive, mar_path, next_version, rewrite_mar
from serve.sidecar.schemas import BatchingState, BatchingUpdate, BatchingUpdateResult
from serve.sidecar.torchserve import (
    NotRegistered,
    TorchServeClient,
    batching_state,
    pending_requests,
    ready_workers,
)

__all__ = ["SwitchPhase", "SwitchPlan", "VersionSwitch"]

_log = logging.getLogger(__name__)


class SwitchPhase(StrEnum):
    """What the switch is doing; the values are ``serve.metrics.SWITCH_PHASES``."""

    IDLE = "idle"
    COPYING = "copying"
    REGISTERING = "registering"
    WAITING_READY = "waiting_ready"
    SETTING_DEFAULT = "setting_default"
    DRAINING = "draining"
    UNREGISTERING = "unregistering"
    ROLLING_BACK = "rolling_back"
    FAILED = "failed"


@dataclass(frozen=True)
class SwitchPlan:
    """One switch, from the default version to a new one with other batching settings.

    Args:
        old: the default version's settings now (``old.model_version`` is its version).
        new: the settings wanted; ``new.model_version`` is the version to register.
        src: the old version's archive; dst: where the new one is written.
        old_pids: the old version's worker pids (their live gauges are dropped with it).
    """

    old: BatchingState
    new: BatchingState
    src: Path
    dst: Path
    old_pids: tuple[int, ...] = ()


class VersionSwitch:
    """Moves the model's default version to new batching settings (see the module doc).

    Args:
        torchserve: the client for TorchServe's management API.
        config: model name and store, ``register_timeout_s``, ``switch_grace_s``,
            ``drain_timeout_s``.
        clock: monotonic seconds, for deadlines and the result's ``seconds``.
        sleep: ``asyncio.sleep``; tests pass one that advances a fake clock.
        on_phase: told every new phase (the app passes the phase gauge's setter).
        forget_workers: given the old version's worker pids once it is unregistered.
        poll_interval_s: between reads of TorchServe while waiting for READY workers.
        drain_interval_s: between reads of the old version's queue; two empty reads this
            far apart count as drained (one could fall between a dequeue and an enqueue).
    """

    def __init__(self, torchserve: TorchServeClient, config: SidecarConfig, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 on_phase: Callable[[str], None] | None = None,
                 forget_workers: Callable[[list[int]], None] | None = None,
                 poll_interval_s: float = 0.2, drain_interval_s: float = 0.1) -> None:
        self.ts = torchserve
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self.on_phase = on_phase
        self.forget_workers = forget_workers
        self.poll_interval_s = poll_interval_s
        self.drain_interval_s = drain_interval_s
        self.phase = SwitchPhase.IDLE
        self.last_error: str | None = None

    def _enter(self, phase: SwitchPhase) -> None:
        self.phase = phase
        if self.on_phase is not None:
            self.on_phase(phase.value)

    @property
    def _model(self) -> str:
        return self.config.model_name

    # ------------------------------------------------------------------ the steps

    async def plan(self, current: dict[str, Any], update: BatchingUpdate) -> SwitchPlan | None:
        """The switch from the version described by ``current`` (the default) to the
        settings in ``update``; None when they are the settings already in effect."""
        before = batching_state(current)
        target = BatchingState(
            batch_size=_pick(update.batch_size, before.batch_size),
            max_batch_delay_ms=_pick(update.max_batch_delay_ms, before.max_batch_delay_ms),
            workers=_pick(update.workers, max(1, before.workers)),
            model_version=before.model_version)
        if target == before:
            return None
        taken = {str(d["modelVersion"]) for d in await self.ts.describe_all()}
        version = next_version(before.model_version, taken)
        model_url = str(current.get("modelUrl") or "")
        store = self.config.model_store
        src = Path(model_url) if os.path.isabs(model_url) else store / model_url
        pids = tuple(int(w["pid"]) for w in current.get("workers") or [] if w.get("pid"))
        return SwitchPlan(old=before, new=target.model_copy(update={"model_version": version}),
                          src=src, dst=mar_path(store, self._model, version), old_pids=pids)

    async def copy(self, plan: SwitchPlan) -> Path:
        """Write the new version's archive (atomically; a second run rewrites it)."""
        self._enter(SwitchPhase.COPYING)
        _log.info("batching %s -> %s: building %s", plan.old, plan.new, plan.dst)
        new = plan.new
        return await asyncio.to_thread(
            rewrite_mar, plan.src, plan.dst, version=new.model_version,
            batch_size=new.batch_size, max_batch_delay_ms=new.max_batch_delay_ms,
            workers=new.workers)

    async def register(self, plan: SwitchPlan) -> None:
        """Register the new archive with TorchServe, unless that version already is."""
        self._enter(SwitchPhase.REGISTERING)
        if await self._registered(plan.new.model_version):
            return
        new = plan.new
        await self.ts.call("POST", "/models", params={
            "url": plan.dst.name, "model_name": self._model, "batch_size": new.batch_size,
            "max_batch_delay": new.max_batch_delay_ms, "initial_workers": new.workers,
            "synchronous": "true"}, timeout=self.config.register_timeout_s)

    async def wait_ready(self, plan: SwitchPlan) -> None:
        """Until the new version has ``plan.new.workers`` READY workers.

        Raises:
            UpstreamUnavailable: not within ``register_timeout_s``.
        """
        self._enter(SwitchPhase.WAITING_READY)
        version, want = plan.new.model_version, plan.new.workers
        deadline = self.clock() + self.config.register_timeout_s
        while ready_workers(await self.ts.describe(version)) < want:
            if self.clock() > deadline:
                raise UpstreamUnavailable(
                    f"version {version} of {self._model!r} did not get {want} READY workers "
                    f"within {self.config.register_timeout_s:.0f} s; the old version stays "
                    f"default")
            await self.sleep(self.poll_interval_s)

    async def set_default(self, plan: SwitchPlan) -> None:
        """Make the new version the default: new requests go to it from now on."""
        self._enter(SwitchPhase.SETTING_DEFAULT)
        await self.ts.call("PUT", f"/models/{self._model}/{plan.new.model_version}/set-default")

    async def drain(self, plan: SwitchPlan) -> None:
        """Until the old version has no queued request, and ``switch_grace_s`` has passed.

        Queued means ``jobQueueStatus.pendingRequests`` in TorchServe's description of
        the old version; it must read 0 twice, ``drain_interval_s`` apart. The grace
        period starts with this call, just after the switch: it covers the batch a
        worker already took off the queue, which no description shows. An old version
        that is gone already counts as drained.

        Raises:
            UpstreamUnavailable: the queue was not empty within ``drain_timeout_s``.
        """
        self._enter(SwitchPhase.DRAINING)
        version = plan.old.model_version
        start = self.clock()
        empty_reads = 0
        while True:
            try:
                pending = pending_requests(await self.ts.describe(version))
            except NotRegistered:
                return
            if pending is None:  # TorchServe < 0.9: only the grace period can tell
                _log.warning("TorchServe does not report jobQueueStatus; draining version %s "
                             "for switch_grace_s=%s s only", version, self.config.switch_grace_s)
                pending = 0
            empty_reads = empty_reads + 1 if pending == 0 else 0
            drained, elapsed = empty_reads >= 2, self.clock() - start
            if drained and elapsed >= self.config.switch_grace_s:
                return
            if not drained and elapsed >= self.config.drain_timeout_s:
                raise UpstreamUnavailable(
                    f"version {version} of {self._model!r} still had {pending} queued "
                    f"requests {self.config.drain_timeout_s:.0f} s after the switch "
                    f"(drain_timeout_s); it stays registered so they are answered: "
                    f"unregister it (DELETE /models/{self._model}/{version}) once its "
                    f"queue is empty")
            await self.sleep(self.drain_interval_s)

    async def unregister(self, plan: SwitchPlan) -> None:
        """Unregister the old version (gone already is fine), drop its workers' live
        gauges and delete its archive if the sidecar wrote it."""
        self._enter(SwitchPhase.UNREGISTERING)
        version = plan.old.model_version
        try:
            await self.ts.call("DELETE", f"/models/{self._model}/{version}",
                               timeout=self.config.register_timeout_s)
        except NotRegistered:
            _log.info("old version %s was already unregistered", version)
        if self.forget_workers is not None:
            self.forget_workers(list(plan.old_pids))
        if is_sidecar_archive(plan.src, self.config.model_store, self._model):
            plan.src.unlink(missing_ok=True)

    async def rollback(self, plan: SwitchPlan) -> None:
        """Undo a switch that failed before the new version became default: unregister
        the new version (not registered is fine) and delete its archive. Never raises:
        what it could not undo is logged."""
        self._enter(SwitchPhase.ROLLING_BACK)
        version = plan.new.model_version
        try:
            await self.ts.call("DELETE", f"/models/{self._model}/{version}",
                               timeout=self.config.register_timeout_s)
        except NotRegistered:
            pass
        except ServeError as e:
            _log.error("could not unregister the failed version %s: %s", version, e)
        plan.dst.unlink(missing_ok=True)
        plan.dst.with_name(plan.dst.name + ".tmp").unlink(missing_ok=True)

    # ------------------------------------------------------------------ the whole switch

    async def run(self, update: BatchingUpdate) -> BatchingUpdateResult:
        """Apply ``update``: plan, copy, register, wait_ready, set_default (rolled back on
        failure), then drain and unregister the old version.

        Raises:
            ServeError: the switch failed; the old version is still default and serving.
        """
        t0 = self.clock()
        self.last_error = None
        self._enter(SwitchPhase.IDLE)  # a new switch: a past failure is no longer current
        try:
            current = await self.ts.describe()
            before = batching_state(current)
            plan = await self.plan(current, update)
            if plan is None:
                return BatchingUpdateResult(**before.model_dump(), changed=False,
                                            previous=before, seconds=self.clock() - t0)
            await self._switch(plan)
            removed = await self._retire(plan)
            after = batching_state(await self.ts.describe())
        except Exception as e:
            self.last_error = e.message if isinstance(e, ServeError) else repr(e)
            self._enter(SwitchPhase.FAILED)
            raise
        self._enter(SwitchPhase.IDLE)
        return BatchingUpdateResult(**after.model_dump(), changed=True, previous=before,
                                    seconds=self.clock() - t0, removed_version=removed)

    async def _switch(self, plan: SwitchPlan) -> None:
        try:
            await self.copy(plan)
            await self.register(plan)
            await self.wait_ready(plan)
            await self.set_default(plan)
        except Exception:
            await self.rollback(plan)
            raise
        _log.info("version %s is default; retiring %s", plan.new.model_version,
                  plan.old.model_version)

    async def _retire(self, plan: SwitchPlan) -> str | None:
        """Drain and unregister the old version; the removed version, or None if it stays."""
        try:
            await self.drain(plan)
            await self.unregister(plan)
        except ServeError as e:
            _log.error("new version %s is default but the old one stays registered: %s",
                       plan.new.model_version, e)
            self.last_error = e.message
            return None
        return plan.old.model_version

    async def _registered(self, version: str) -> bool:
        try:
            await self.ts.describe(version)
        except NotRegistered:
            return False
        return True


def _pick(value: int | None, current: int) -> int:
    return current if value is None else value
