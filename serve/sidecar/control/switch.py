"""The version switch: TorchServe from what it serves to a target serving version, with
zero failed requests.

TorchServe fixes a version's batching at registration, so every (model version, batching,
workers) is its own *serving version* (:func:`serve.state.serving_version`). The
reconciler (:mod:`serve.sidecar.control.reconciler`) decides the target; :class:`VersionSwitch`
takes TorchServe there in small steps, each a method that can be run (and tested) on its
own and that is harmless to run twice:

``check_memory``
    refuse (:class:`~serve.errors.InsufficientMemory`) when the new version's workers
    would not fit beside the old ones (:func:`~serve.sidecar.adapters.memory.check_fits`).
``copy``
    write ``<model>-<serving version>.mar`` into the model store: the model version's
    repository archive with that version and the settings
    (:func:`~serve.sidecar.adapters.archives.rewrite_mar`).
``register``
    ``POST /models`` for it (skipped when that version is already registered).
``wait_ready``
    until it has as many READY workers as asked, within ``register_timeout_s``.
``set_default``
    ``PUT /models/{m}/{new}/set-default``: from here new requests go to the new version.
``drain``
    (of an old version) until its queue is empty, judged from TorchServe's own
    description (``jobQueueStatus.pendingRequests``), and has stayed empty for
    ``switch_grace_s`` + its ``max_batch_delay`` (the batch a worker took off the queue
    last, which no description shows, is answered by then).
``unregister``
    ``DELETE`` the old version, forget its workers' live gauges, delete its archive if
    the sidecar derived it (repository archives are never touched).
``rollback``
    after a failure in copy/register/wait_ready/set_default: unregister the
    new version and delete its archive; the old version was never replaced, so it stays
    default, and nothing is left registered that should not be.

With nothing registered (TorchServe just started) the switch is copy, register,
wait_ready, set_default: there is nothing to drain. :meth:`VersionSwitch.switch` runs the
steps up to the new default; :meth:`VersionSwitch.retire` drains and unregisters one old
version. A failure in ``retire`` comes after the switch: the new version serves and the
old one stays registered (no queued request is failed) until a later pass retries.

:attr:`VersionSwitch.phase` is the current step (a :class:`SwitchPhase`), mirrored by the
``dlrm_switch_phase`` gauge, GET /state and GET /batching; :attr:`VersionSwitch.last_error`
says why the last switch failed. :attr:`VersionSwitch.memory` (a :class:`MemoryWatch`)
holds the live workers and the memory peak of the running switch. One switch at a time: only the reconciler calls it.

Example::

    switch = VersionSwitch(TorchServeClient(config, client), config)
    plan = switch.plan(await observe(ts), desired, ModelRepository([store]))
    if plan is not None:
        await switch.switch(plan, observed)
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from serve.errors import ServeError, UpstreamUnavailable
from serve.phases import SwitchPhase
from serve.sidecar.adapters.archives import (
    CandidateArchive,
    control_path,
    is_sidecar_archive,
    mar_path,
    rewrite_mar,
)
from serve.sidecar.adapters.memory import (
    MemoryCheck,
    MemoryProbe,
    PeakTracker,
    TableMemory,
    check_fits,
    table_memory,
)
from serve.sidecar.adapters.torchserve import (
    BatchingState,
    NotRegistered,
    Observed,
    Registered,
    TorchServeClient,
    pending_requests,
    ready_workers,
)
from serve.sidecar.config import SidecarConfig
from serve.state import DesiredState, RolloutMode
from serve.store.repository import ModelRepository
from serve.store.routing import write_control
from serve.store.tablefiles import TableManifest

__all__ = ["MemoryWatch", "SwitchPhase", "SwitchPlan", "VersionSwitch", "plan_switch"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwitchPlan:
    """One switch, from what serves now to a target serving version.

    Args:
        new: the target's settings; ``new.model_version`` is the serving version name.
        src: the model version's repository archive; None when the target is registered
            already (nothing to copy).
        dst: the target's archive in the model store.
        old: the default version now; None when nothing is registered.
        candidate: a rollout's candidate packed beside the model version (its archive,
            its control file); ``mode`` is the rollout's, written in the control file
            with weight 0 until the rollout controller starts baking.
        tables: the tables folders the new workers read (the version's and the
            candidate's, from their manifests; empty for archives that hold their
            tables): what the memory check counts (under the host budget), the archives
            being a few MB.
        src_sha256: ``src``'s sha256 as its build recorded it (checked by
            :meth:`ModelRepository.check_archive` when planned, and again on the bytes
            :func:`rewrite_mar` copies); None: not checked.
    """

    new: BatchingState
    src: Path | None
    dst: Path
    old: Registered | None = None
    candidate: CandidateArchive | None = None
    mode: RolloutMode = RolloutMode.CANARY
    tables: tuple[TableManifest, ...] = ()
    src_sha256: str | None = None

    @property
    def table_bytes(self) -> int:
        return sum(m.nbytes for m in self.tables)


def _error_text(e: BaseException) -> str:
    return e.message if isinstance(e, ServeError) else repr(e)


def plan_switch(observed: Observed, desired: DesiredState, repository: ModelRepository, *,
                store: Path, model: str) -> SwitchPlan | None:
    """The switch to ``desired``'s serving version of ``model`` (archives in the model
    ``store``); None when it is the default with all its workers READY.

    Raises:
        ConfigError: the model version (or the candidate) is not in ``repository`` (names
            the ones there), or the tables folder its archive references is missing,
            incomplete or another build's, or its archive's recorded digest is missing or
            differs (:meth:`ModelRepository.check_tables`): refused before anything is
            copied or loaded.
    """
    target = desired.serving_version()
    current = observed.get(target)
    if observed.default == target and current is not None \
            and current.ready >= desired.workers:
        return None
    new = BatchingState(batch_size=desired.batching.batch_size,
                        max_batch_delay_ms=desired.batching.max_batch_delay_ms,
                        workers=desired.workers, model_version=target)
    if current is not None:  # registered already (e.g. a pass that stopped half-way)
        url = current.url or mar_path(store, model, target).name
        dst = Path(url) if os.path.isabs(url) else store / url
        return SwitchPlan(new=new, src=None, dst=dst, old=observed.serving)
    versions = [desired.model.version] + ([desired.rollout.candidate] if desired.rollout
                                          else [])
    for version in versions:
        repository.check_tables(version)  # its archive's digest too
    src = repository.archive(desired.model.version)
    candidate = None
    if desired.rollout is not None:
        candidate = CandidateArchive(
            version=desired.rollout.candidate,
            src=repository.archive(desired.rollout.candidate),
            control_file=control_path(store, model, target),
            sha256=repository.check_archive(desired.rollout.candidate))
    return SwitchPlan(new=new, src=src, dst=mar_path(store, model, target),
                      src_sha256=repository.check_archive(desired.model.version),
                      old=observed.serving, candidate=candidate,
                      mode=(RolloutMode(desired.rollout.mode) if desired.rollout
                            else RolloutMode.CANARY),
                      tables=tuple(m for v in versions
                                   if (m := repository.manifest(v)) is not None))


class MemoryWatch:
    """Memory while a switch runs: the live workers' pids (every registered version's),
    the memory TorchServe reports for them (bytes by pid), the peak over the switch, and
    the check that the new version's workers fit.

    Args:
        probe: the memory limit, usage and RSS; None: no check, no peak.
    """

    def __init__(self, probe: MemoryProbe | None) -> None:
        self.probe = probe
        self.tracker = PeakTracker(probe) if probe is not None else None
        self.live_pids: set[int] = set()
        self.reported: dict[int, int] = {}

    def watch(self, observed: Observed) -> None:
        """Sample from now on over the workers of every version in ``observed``."""
        self.live_pids = set(observed.pids())
        self.reported = {p: m for r in observed.versions for p, m in r.memory_by_pid}
        self.sample()

    def add(self, registered: Registered) -> None:
        """Sample a (new) version's workers too, then sample."""
        self.live_pids.update(registered.pids)
        self.reported.update(registered.memory_by_pid)
        self.sample()

    def forget(self, pids: Iterable[int]) -> None:
        """Workers that are gone (their version unregistered), then sample."""
        self.live_pids.difference_update(pids)
        self.sample()

    def sample(self) -> None:
        """One memory sample over the live workers (cheap: /proc reads)."""
        if self.tracker is not None:
            self.tracker.sample(sorted(self.live_pids), self.reported)

    async def check(self, plan: SwitchPlan, observed: Observed, headroom: float,
                    budget: tuple[int | None, float | None] = (None, None)
                    ) -> MemoryCheck | None:
        """Refuse a switch whose new workers would not fit beside the ones running
        (:func:`~serve.sidecar.adapters.memory.check_fits`, within ``headroom`` of the
        limit). The model's bytes are its archives' plus its tables' memory
        (:func:`~serve.sidecar.adapters.memory.table_memory` under ``budget``, the
        workers' host budget ``(bytes, fraction)``): with the tables in a folder beside
        the archive (format 3) the archive is only the dense part, and sizing by it
        would let a switch to a large model through.

        Returns the numbers (None without a memory limit, or when the target is
        registered already: nothing new loads).

        Raises:
            InsufficientMemory: with the numbers and what to do.
        """
        if self.probe is None or plan.src is None:
            return None
        old = plan.old
        per_worker = self.probe.worker_bytes(old.pids, self.reported) if old else []
        def archives_size() -> int:
            paths = [plan.src] + ([plan.candidate.src] if plan.candidate else [])
            return sum(p.stat().st_size for p in paths if p is not None)

        size = await asyncio.to_thread(archives_size)
        tables = [table_memory(m.nbytes, sum(t.rows for t in m.tables),
                               max((t.row_bytes for t in m.tables), default=0),
                               host_bytes=budget[0], host_fraction=budget[1])
                  for m in plan.tables]
        total = TableMemory(sum(t.per_pod for t in tables), sum(t.per_worker for t in tables),
                            "; ".join(t.basis for t in tables))
        return check_fits(self.probe, target=plan.new.model_version, pids=observed.pids(),
                          per_worker=per_worker, archive_bytes=size, tables=total,
                          workers=plan.new.workers, headroom=headroom,
                          reported=self.reported)


class VersionSwitch:
    """Moves the model's default version to a target serving version (see the module doc).

    Args:
        torchserve: the client for TorchServe's management API.
        config: model name and store, ``register_timeout_s``, ``switch_grace_s``,
            ``drain_timeout_s``, ``memory_headroom``.
        clock: monotonic seconds, for deadlines.
        sleep: ``asyncio.sleep``; tests pass one that advances a fake clock.
        on_phase: told every new phase (the app passes the phase gauge's setter).
        forget_workers: given an old version's worker pids once it is unregistered.
        memory: the memory limit, usage and RSS; None: no check, no peak.
        poll_interval_s: between reads of TorchServe while waiting for READY workers.
        drain_interval_s: between reads of the old version's queue; two empty reads this
            far apart count as drained (one could fall between a dequeue and an enqueue).
    """

    def __init__(self, torchserve: TorchServeClient, config: SidecarConfig, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
                 on_phase: Callable[[str], None] | None = None,
                 forget_workers: Callable[[list[int]], None] | None = None,
                 memory: MemoryProbe | None = None,
                 poll_interval_s: float = 0.2, drain_interval_s: float = 0.1) -> None:
        self.ts = torchserve
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self.on_phase = on_phase
        self.forget_workers = forget_workers
        self.memory = MemoryWatch(memory)
        self.poll_interval_s = poll_interval_s
        self.drain_interval_s = drain_interval_s
        self.phase = SwitchPhase.IDLE
        self.last_error: str | None = None

    def _enter(self, phase: SwitchPhase) -> None:
        self.phase = phase
        if self.on_phase is not None:
            self.on_phase(phase.value)

    def idle(self) -> None:
        """Back to idle (a switch and its clean-up are done)."""
        self._enter(SwitchPhase.IDLE)

    @property
    def _model(self) -> str:
        return self.config.model_name

    # ------------------------------------------------------------------ the steps

    def plan(self, observed: Observed, desired: DesiredState,
             repository: ModelRepository) -> SwitchPlan | None:
        """:func:`plan_switch` for this switch's model and store."""
        return plan_switch(observed, desired, repository, store=self.config.model_store,
                           model=self._model)

    async def check_memory(self, plan: SwitchPlan, observed: Observed) -> MemoryCheck | None:
        """Refuse a switch whose new workers would not fit beside the ones running
        (:meth:`MemoryWatch.check`, with ``memory_headroom``).

        Raises:
            InsufficientMemory: with the numbers and what to do.
        """
        return await self.memory.check(plan, observed, self.config.memory_headroom,
                                       (self.config.host_cache_bytes,
                                        self.config.host_cache_fraction))

    async def copy(self, plan: SwitchPlan) -> Path | None:
        """Write the new version's archive (atomically; a second run rewrites it).
        Nothing to do when the target is registered already (``plan.src`` is None)."""
        if plan.src is None:
            return None
        self._enter(SwitchPhase.COPYING)
        _log.info("switch %s -> %s: building %s from %s",
                  plan.old.version if plan.old else "nothing", plan.new.model_version,
                  plan.dst, plan.src)
        new = plan.new
        plan.dst.parent.mkdir(parents=True, exist_ok=True)
        if plan.candidate is not None:
            # weight 0 until the rollout controller sees it serve and starts baking
            await asyncio.to_thread(write_control, plan.candidate.control_file, plan.mode, 0.0)
        dst = await asyncio.to_thread(
            rewrite_mar, plan.src, plan.dst, version=new.model_version,
            batch_size=new.batch_size, max_batch_delay_ms=new.max_batch_delay_ms,
            workers=new.workers, candidate=plan.candidate, src_sha256=plan.src_sha256)
        self.memory.sample()
        return dst

    async def register(self, plan: SwitchPlan) -> None:
        """Register the new archive with TorchServe, unless that version already is."""
        self._enter(SwitchPhase.REGISTERING)
        if await self._registered(plan.new.model_version):
            return
        new = plan.new
        # synchronous=false: TorchServe 0.12 answers at once and loads the workers in the
        # background (wait_ready polls them). A synchronous registration stalled /ping,
        # describe and predictions of the version already serving for the whole load
        # (measured: ~28 s for a handler that takes 30 s to load), failing probes.
        await self.ts.call("POST", "/models", params={
            "url": plan.dst.name, "model_name": self._model, "batch_size": new.batch_size,
            "max_batch_delay": new.max_batch_delay_ms, "initial_workers": new.workers,
            "synchronous": "false"}, timeout=self.config.register_timeout_s)
        self.memory.sample()

    async def wait_ready(self, plan: SwitchPlan) -> None:
        """Until the new version has ``plan.new.workers`` READY workers.

        Raises:
            UpstreamUnavailable: not within ``register_timeout_s``.
        """
        self._enter(SwitchPhase.WAITING_READY)
        version, want = plan.new.model_version, plan.new.workers
        deadline = self.clock() + self.config.register_timeout_s
        while True:
            try:
                desc = await self.ts.describe(version)
            except NotRegistered:
                # registered asynchronously: not described yet; keep polling
                if self.clock() > deadline:
                    raise
                await self.sleep(self.poll_interval_s)
                continue
            self.memory.add(Registered.from_description(desc))
            if ready_workers(desc) >= want:
                return
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

    async def drain(self, old: Registered) -> None:
        """Until ``old`` has had no queued request for a settle time.

        Queued means ``jobQueueStatus.pendingRequests`` in TorchServe's description of
        the old version. TorchServe does not describe the batch a worker has already taken
        off the queue (it waits up to ``max_batch_delay`` to fill it, then runs it), so an
        empty queue is trusted only once it has read 0 on every read for ``settle`` =
        ``switch_grace_s`` + the version's ``max_batch_delay``, and on at least two reads
        ``drain_interval_s`` apart: by then the last batch taken has been answered
        (``switch_grace_s`` must exceed the slowest batch). An old version that is gone
        already counts as drained.

        Raises:
            UpstreamUnavailable: the queue was not empty within ``drain_timeout_s``.
        """
        self._enter(SwitchPhase.DRAINING)
        version = old.version
        settle = self.config.switch_grace_s + old.max_batch_delay_ms / 1000.0
        start = self.clock()
        empty_since: float | None = None
        empty_reads = 0
        while True:
            try:
                pending = pending_requests(await self.ts.describe(version))
            except NotRegistered:
                return
            self.memory.sample()
            now = self.clock()
            if pending is None:  # TorchServe < 0.9: only the settle time can tell
                _log.warning("TorchServe does not report jobQueueStatus; draining version %s "
                             "for %.1f s only", version, settle)
                pending = 0
            if pending == 0:
                empty_reads += 1
                empty_since = now if empty_since is None else empty_since
                if empty_reads >= 2 and now - empty_since >= settle:
                    return
            else:
                empty_reads, empty_since = 0, None
                if now - start >= self.config.drain_timeout_s:
                    raise UpstreamUnavailable(
                        f"version {version} of {self._model!r} still had {pending} queued "
                        f"requests {self.config.drain_timeout_s:.0f} s after the switch "
                        f"(drain_timeout_s); it stays registered so they are answered, and "
                        f"the next reconcile pass drains it again")
            await self.sleep(self.drain_interval_s)

    async def unregister(self, old: Registered) -> None:
        """Unregister ``old`` (gone already is fine), drop its workers' live gauges and
        delete its archive if the sidecar derived it."""
        self._enter(SwitchPhase.UNREGISTERING)
        try:
            await self.ts.call("DELETE", f"/models/{self._model}/{old.version}",
                               timeout=self.config.register_timeout_s)
        except NotRegistered:
            _log.info("old version %s was already unregistered", old.version)
        if self.forget_workers is not None:
            self.forget_workers(list(old.pids))
        self.memory.forget(old.pids)
        store = self.config.model_store
        src = Path(old.url) if os.path.isabs(old.url) else store / old.url
        if old.url and is_sidecar_archive(src, store, self._model):
            src.unlink(missing_ok=True)
        control_path(store, self._model, old.version).unlink(missing_ok=True)

    async def rollback(self, plan: SwitchPlan) -> None:
        """Undo a switch that failed before the new version became default: unregister
        the new version (not registered is fine) and delete its archive. Never raises:
        what it could not undo is logged (and the next pass's clean-up retries)."""
        self._enter(SwitchPhase.ROLLING_BACK)
        version = plan.new.model_version
        try:
            await self.ts.call("DELETE", f"/models/{self._model}/{version}",
                               timeout=self.config.register_timeout_s)
        except NotRegistered:
            pass
        except ServeError as e:
            _log.error("could not unregister the failed version %s: %s", version, e)
        if is_sidecar_archive(plan.dst, self.config.model_store, self._model):
            plan.dst.unlink(missing_ok=True)
            plan.dst.with_name(plan.dst.name + ".tmp").unlink(missing_ok=True)
        if plan.candidate is not None:
            plan.candidate.control_file.unlink(missing_ok=True)

    # ------------------------------------------------------------------ whole runs

    async def switch(self, plan: SwitchPlan, observed: Observed) -> MemoryCheck | None:
        """Check memory, copy, register, wait_ready, set_default; rolled back on failure.

        Returns the memory check's numbers (None when nothing was checked).

        Raises:
            InsufficientMemory: refused before anything was done.
            ServeError (or another error): a step failed; rolled back, the old version
                is still default and serving. ``phase`` is ``failed`` and ``last_error``
                says why.
        """
        self.last_error = None
        self._enter(SwitchPhase.IDLE)  # a new switch: a past failure is no longer current
        self.memory.watch(observed)
        try:
            check = await self.check_memory(plan, observed)
        except Exception as e:
            self.fail(e)
            raise
        try:
            await self.copy(plan)
            await self.register(plan)
            await self.wait_ready(plan)
            await self.set_default(plan)
        except Exception as e:
            await self.rollback(plan)
            self.fail(e)
            raise
        _log.info("version %s is default (was %s)", plan.new.model_version,
                  plan.old.version if plan.old else "nothing")
        return check

    async def retire(self, old: Registered) -> None:
        """Drain and unregister an old version.

        Raises:
            ServeError: it stays registered (``last_error`` says why); the new version
                serves regardless.
        """
        try:
            await self.drain(old)
            await self.unregister(old)
        except ServeError as e:
            _log.error("version %s stays registered for now: %s", old.version, e.message)
            self.last_error = e.message
            self.idle()
            raise

    def fail(self, e: BaseException) -> None:
        """Record ``e`` as why the switch failed (phase ``failed``)."""
        self.last_error = _error_text(e)
        self._enter(SwitchPhase.FAILED)

    async def _registered(self, version: str) -> bool:
        try:
            await self.ts.describe(version)
        except NotRegistered:
            return False
        return True
