"""The reconciler: moves TorchServe toward the desired-state file, one level-triggered pass
at a time.

Each :meth:`Reconciler.tick`:

1. **reads the desired state** from the file, by path every time (a ConfigMap update
   swaps a symlink: holding an inode would miss it). A change is seen by content hash.
   A file that does not parse becomes ``last_error`` and the last valid desired state is
   kept (after a restart there is none: nothing is changed until the file is fixed).
2. **observes** TorchServe: every registered version of the model and the default one
   (:func:`~serve.sidecar.adapters.torchserve.observe`), from TorchServe's own description, so a
   restarted sidecar (or TorchServe) is picked up where things stand.
3. **decides** (:func:`assess`, pure): converged; or ``switch`` (the target serving
   version is not the default with all its workers READY); or ``cleanup`` (it is, but
   other versions are still registered); or ``wait`` (workers still loading, or a retry
   back-off after a failed switch).
4. **acts**: the switch (:class:`~serve.sidecar.control.switch.VersionSwitch`: memory check,
   copy, register, wait READY, set default; rolled back on failure), then the clean-up:
   every other registered version is drained and unregistered, and derived archives of
   versions no longer registered are deleted. A failed switch is retried after 2, 4, 8...
   up to 300 s (a change of the desired state retries at once).

One writer: only the reconciler changes TorchServe's registrations. The APIs write the
file (:meth:`Reconciler.write`) and wake it. A second write during a switch changes the
target; the running switch completes (and its clean-up, so at most two versions are
ever loaded) and the next pass converges to the latest.

Only the pass acts. It keeps what it read as a snapshot (:attr:`Reconciler.desired`,
``file_error``; the rollout it declared; the back-off): every read (GET /state, the
metric collectors, a delta's validation, the tuner's view) is a pure function of that
snapshot plus what TorchServe answers now, and changes nothing. A read that acted (it
used to re-read the file and declare the rollout) could replace the rollout's run on the
event loop while the pass evaluated it on a thread.

The parts: :mod:`~serve.sidecar.control.state_file` (the file),
:mod:`~serve.sidecar.control.assessment` (desired vs observed, pure),
:mod:`~serve.sidecar.control.switch_runner` (the pass's actions: the switch, clean-up and
back-off), :mod:`~serve.sidecar.control.rollout_stepper` (the pass's calls into the
rollout controller) and :class:`PassLog` (the passes' record, and waiting for one).

Status is data: :meth:`Reconciler.status` is GET /state; ``dlrm_state_converged``,
``dlrm_reconcile_total{result}`` and ``dlrm_switch_phase`` mirror it.

Example::

    rec = Reconciler(ts, config, switch=VersionSwitch(ts, config),
                     repository=ModelRepository(config.repository_roots))
    task = asyncio.create_task(rec.run())    # the app's lifespan does this
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serve.errors import ConfigError, Conflict, ServeError, UpstreamUnavailable
from serve.metrics.sidecar import SidecarMetrics
from serve.phases import ReconcileResult
from serve.sidecar.adapters.model_schemas import SchemaCache, check_switch_schema
from serve.sidecar.adapters.torchserve import Observed, TorchServeClient, observe
from serve.sidecar.config import SidecarConfig
from serve.sidecar.control.assessment import Action, Assessment, assess, observed_state
from serve.sidecar.control.fleet import Fleet
from serve.sidecar.control.rollout import RolloutController
from serve.sidecar.control.rollout_stepper import RolloutStepper
from serve.sidecar.control.state_file import DesiredStateFile, digest
from serve.sidecar.control.switch import VersionSwitch
from serve.sidecar.control.switch_runner import SwitchRunner
from serve.sidecar.control.views import FleetStatus, RolloutStatus, StateStatus, SwitchRecord
from serve.state import Batching, DesiredState, dump_state
from serve.store.repository import ModelRepository

__all__ = ["Assessment", "PassLog", "PassResult", "ReconcileResult", "Reconciler", "SwitchFailed",
           "assess", "observed_state"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassResult:
    """One reconcile pass: what it read (``desired_hash``), did (``result``) and found at
    its end."""

    seq: int
    desired_hash: str | None
    target: str | None
    result: ReconcileResult
    converged: bool
    serving: bool
    reason: str | None
    switch_error: ServeError | None = None
    cleanup_error: str | None = None


class SwitchFailed(Exception):
    """The switch to a written desired state failed (raised to the writer that waits)."""

    def __init__(self, error: ServeError) -> None:
        super().__init__(error.message)
        self.error = error


class PassLog:
    """The reconcile passes' record: how many began (``seq``), the last one's result
    (``last``), and waiting for a later one (a writer waits for its change to serve).

    Args:
        file: the desired-state file (a wait ends when someone else rewrote it).
        clock: monotonic seconds (the wait's deadline).
    """

    def __init__(self, file: DesiredStateFile, clock: Callable[[], float]) -> None:
        self.file = file
        self.clock = clock
        self.seq = 0
        self.last: PassResult | None = None
        self._passed = asyncio.Event()

    def begin(self) -> int:
        """A pass begins: its number."""
        self.seq += 1
        return self.seq

    def finish(self, p: PassResult) -> None:
        """A pass ended with ``p``: wake those waiting."""
        self.last = p
        passed, self._passed = self._passed, asyncio.Event()
        passed.set()

    async def wait_serving(self, after: int, digest: str, timeout_s: float) -> PassResult:
        """Until a pass begun after pass ``after`` that read the content ``digest`` finds
        its target serving (converged, or serving with an old version that would not
        drain).

        Raises:
            SwitchFailed: the switch to it failed (rolled back).
            Conflict: the file was changed by someone else meanwhile.
            UpstreamUnavailable: TorchServe did not answer, or not converged within
                ``timeout_s``.
        """
        deadline = self.clock() + timeout_s
        while True:
            p = self.last
            if p is not None and p.seq > after:
                if p.desired_hash != digest and self.file.digest() != digest:
                    raise Conflict(
                        f"the desired state in {self.file.path} was changed by another writer "
                        "while this change was being applied; GET /state shows the target now")
                if p.desired_hash == digest and p.switch_error is not None:
                    raise SwitchFailed(p.switch_error)
                if p.desired_hash == digest and p.result is ReconcileResult.UNAVAILABLE:
                    raise UpstreamUnavailable(
                        f"{p.reason}; the change stays declared in {self.file.path} and is "
                        f"applied once TorchServe answers (GET /state)")
                if p.desired_hash == digest and (p.converged or (p.serving and p.cleanup_error)):
                    return p
            remaining = deadline - self.clock()
            if remaining <= 0:
                why = p.reason if p is not None else "no reconcile pass finished"
                raise UpstreamUnavailable(
                    f"TorchServe did not converge to the new desired state within "
                    f"{timeout_s:.0f} s ({why}); it stays declared in {self.file.path} and the "
                    f"reconciler keeps going: GET /state shows its progress")
            passed = self._passed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(passed.wait(), remaining)


class Reconciler:
    """Level-triggered reconciler of TorchServe toward the desired-state file.

    Args:
        torchserve: the management API client.
        config: ``state_file`` (required), ``model_store``, timeouts,
            ``reconcile_interval_s``.
        switch: the version switch (owns the phase, the memory probe and the peak).
        repository: where the model versions' archives are.
        metrics: the sidecar's metrics (converged gauge, pass counter); None: none.
        rollouts: runs a declared rollout (guards, promotion, rollback); None: a
            declared rollout is served as declared, never judged.
        schemas: the versions' schemas (GET /state's ``observed.model.schema``);
            None: read from ``repository``'s build reports (each once).
        clock: monotonic seconds (back-off, deadlines, durations).
        retry_base_s, retry_max_s: back-off after a failed switch: base, 2 x base, ...
            up to max.
        sample_interval_s: how often memory is sampled while a switch runs (the peak
            happens while TorchServe loads the new workers, inside one long call).
        fleet: one rollout decision per fleet (:mod:`serve.sidecar.control.fleet`): each
            pass renews the lease, only the leader ticks the guards and settles the
            state, and every pod adopts the recorded decision. None: this pod decides
            alone (its outcome kept in memory where the file is read-only).
    """

    def __init__(self, torchserve: TorchServeClient, config: SidecarConfig, *,
                 switch: VersionSwitch, repository: ModelRepository,
                 metrics: SidecarMetrics | None = None,
                 rollouts: RolloutController | None = None,
                 schemas: SchemaCache | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 retry_base_s: float = 2.0, retry_max_s: float = 300.0,
                 sample_interval_s: float = 0.25, fleet: Fleet | None = None) -> None:
        if config.state_file is None:
            raise ConfigError("the reconciler needs a desired-state file (--state-file)")
        self.ts = torchserve
        self.config = config
        self.file = DesiredStateFile(config.state_file)
        self.switch = switch
        self.schemas = schemas if schemas is not None else SchemaCache(repository.report)
        self.metrics = metrics
        self.rollouts = rollouts
        self.fleet = fleet
        self.clock = clock
        self.runner = SwitchRunner(torchserve, config, switch=switch, repository=repository,
                                   clock=clock, retry_base_s=retry_base_s,
                                   retry_max_s=retry_max_s,
                                   sample_interval_s=sample_interval_s)
        # The snapshot: written by the pass (tick) and the write path (write, revert),
        # read by everyone else.
        self.desired: DesiredState | None = None
        self.file_error: str | None = None
        self.last_error: str | None = None
        self.passes = PassLog(self.file, clock)
        self._hash: str | None = None
        self._wake = asyncio.Event()
        self._pass_lock = asyncio.Lock()
        self.paused: str | None = None
        self.stepper = None if rollouts is None else RolloutStepper(
            rollouts, self.file, desired=lambda: self.desired, wake=self.wake, fleet=fleet)
        # The batching tuner's choice (serve.sidecar.control.tuner_loop); None: the declared
        # batching. Set by the tuner's loop, which then wakes the reconciler.
        self.batching_override: Batching | None = None

    @property
    def repository(self) -> ModelRepository:
        """Where the model versions' archives are (the switch plans from it)."""
        return self.runner.repository

    @repository.setter
    def repository(self, repository: ModelRepository) -> None:
        self.runner.repository = repository

    @property
    def path(self) -> Path:
        """The desired-state file."""
        return self.file.path

    @property
    def last_pass(self) -> PassResult | None:
        """The last pass's result (None before the first ended)."""
        return self.passes.last

    @property
    def last_switch(self) -> SwitchRecord | None:
        """The last switch: from, to, duration, peak memory, error."""
        return self.runner.last_switch

    # ------------------------------------------------------------------ the desired state

    def _read_desired(self) -> str | None:
        """The pass's read of the file: update the snapshot (``desired``, the last valid
        and accepted one; ``file_error``); a new desired state resets the back-off.
        Returns the hash of the content read (None when it could not be read)."""
        read = self.file.read()
        if read.digest is not None and read.digest == self._hash:
            return read.digest  # unchanged: keep what it said the last time
        self._hash, self.file_error = read.digest, read.error
        try:  # an edit of the file (or ConfigMap) is held to PUT /state's schema rule
            if read.state is not None:
                self.check_schema(read.state)
                if read.state != self.desired:
                    _log.info("desired state: %s", read.state.serving_version())
                    self.runner.reset_retry()
                self.desired = read.state
        except Conflict as e:
            self.file_error = f"{self.path}: {e.message}; the last accepted state stays"
        return read.digest

    def declared_now(self) -> tuple[DesiredState | None, str | None]:
        """The desired state in the file now (its last valid one, the snapshot's, when it
        does not parse) and why the file is not usable (None when it is); changes
        nothing (PUT /batching edits this)."""
        read = self.file.read()
        if read.state is not None:
            return read.state, None
        return self.desired, read.error

    def writable_error(self) -> str | None:
        """Why the file cannot be written (None when it can)."""
        return self.file.writable_error()

    def write(self, desired: DesiredState) -> tuple[int, str]:
        """Write the file atomically and wake the reconciler. Returns the passes begun so
        far (those after them read the new file) and the hash of what was written.

        Raises:
            Conflict: the file is read-only (the message says to edit the ConfigMap), or
                ``desired`` switches model.version to another request schema without
                ``model.schema_change`` (:func:`check_switch_schema`); nothing written.
        """
        self.check_schema(desired)
        written = self.file.write(desired)
        self._declare(desired, written)
        self.runner.reset_retry()  # asked again: retry a failed target at once
        self.wake()
        return self.passes.seq, written

    def check_schema(self, desired: DesiredState) -> None:
        """Refuse (409) a declaration switching the declared model.version to another
        request schema without ``model.schema_change: true``; changes nothing."""
        if self.desired is not None:
            check_switch_schema(self.schemas, self.desired.model.version,
                                desired.model.version, desired.model.schema_change)

    def _declare(self, desired: DesiredState, written: str) -> None:
        """The write path's update of the snapshot: what was written is what the next
        pass reads (so GET /state does not show the old target as converged meanwhile).
        The rollout is declared by that pass."""
        if desired != self.desired:
            _log.info("desired state: %s", desired.serving_version())
        self.desired, self._hash, self.file_error = desired, written, None

    def revert(self, written: DesiredState, previous: DesiredState) -> bool:
        """Put ``previous`` back if the file still holds exactly ``written`` (nobody wrote
        since); True if it did."""
        if not self.file.replace(written, previous):
            return False
        self._declare(previous, digest(dump_state(previous).encode()))
        self.wake()
        return True

    # ------------------------------------------------------------------ one pass

    async def tick(self) -> PassResult:
        """One pass: read, observe, decide, act; see the module docstring."""
        seq = self.passes.begin()
        read_hash = self._read_desired()
        declared = self.desired
        if self.stepper is not None:
            await self.stepper.declare(declared)
        desired = self.effective()
        target = desired.serving_version() if desired else None
        try:
            result, switch_error, cleanup_error, observed = await self.runner.act(desired)
            if observed is None:  # something changed: look again
                observed = await observe(self.ts)
        except UpstreamUnavailable as e:
            return self._finish(PassResult(
                seq, read_hash, target, ReconcileResult.UNAVAILABLE, False, False,
                f"TorchServe did not answer: {e.message}"), e.message)
        a = assess(desired, observed)
        if self.file_error is not None and result in (
                ReconcileResult.CONVERGED, ReconcileResult.WAITING, ReconcileResult.APPLIED):
            result = ReconcileResult.INVALID
        error = (switch_error.message if switch_error else cleanup_error) or self.file_error
        converged = a.converged and self.file_error is None
        if converged and self.stepper is not None:
            await self.stepper.step(declared, a.target)
        return self._finish(PassResult(
            seq, read_hash, target, result, converged, a.serving,
            self._reason(a), switch_error, cleanup_error), error)

    def effective(self) -> DesiredState | None:
        """What to converge to: the desired state with its rollout's outcome applied
        (:meth:`serve.sidecar.control.rollout.RolloutController.effective`), with the batching
        tuner's setting (:attr:`batching_override`) in place of the declared batching.
        A pure function of the snapshot."""
        desired = self.desired
        if self.rollouts is not None:
            desired = self.rollouts.effective(desired)
        override = self.batching_override
        if desired is not None and override is not None:
            desired = desired.model_copy(update={"batching": override})
        return desired

    def end_rollout(self, promote: bool, reason: str) -> RolloutStatus:
        """Promote or roll back the baking rollout by hand (POST
        /state/rollout/promote|rollback): :meth:`RolloutStepper.end`.

        Raises:
            Conflict: no rollout controller, or no rollout is baking.
        """
        if self.stepper is None:
            action = "promote" if promote else "rollback"
            raise Conflict(f"POST /state/rollout/{action}: this sidecar runs no rollout "
                           "controller")
        return self.stepper.end(promote, reason)

    def _finish(self, p: PassResult, error: str | None) -> PassResult:
        if error is not None:
            self.last_error = error
        elif p.converged:
            self.last_error = None
        if self.metrics is not None:
            self.metrics.observe_reconcile(p.result)
            self.metrics.set_converged(p.converged if self.desired is not None else None)
        self.passes.finish(p)
        return p

    def _reason(self, a: Assessment) -> str | None:
        parts = []
        if self.file_error is not None:
            keep = ("keeping the last valid desired state" if self.desired is not None
                    else "nothing to converge to")
            parts.append(f"the desired-state file is not usable ({self.file_error}); {keep}")
        if not a.converged and self.desired is not None and a.reason:
            parts.append(a.reason)
        if a.action is Action.SWITCH and self.runner.failures:
            wait = self.runner.retry_wait()
            parts.append(f"the last switch failed ({self.runner.failed_error}); "
                         + (f"retrying in {wait:.0f} s" if wait > 0 else "retrying now"))
        return "; ".join(parts) or None

    # ------------------------------------------------------------------ running, waiting

    def wake(self) -> None:
        """Run the next pass now (after the current one, if one runs)."""
        self._wake.set()

    async def pause(self, reason: str) -> None:
        """Stop reconciling for good (a drain for shutdown): waits for a pass in progress
        to end; no switch or clean-up starts after this returns."""
        async with self._pass_lock:
            self.paused = reason
        _log.info("reconciler paused: %s", reason)

    async def run(self) -> None:
        """Pass after pass: every ``reconcile_interval_s``, or at once when woken."""
        while True:
            try:
                async with self._pass_lock:
                    if self.paused is None:
                        await self.tick()
            except Exception:  # noqa: BLE001 - a bug: log it, keep reconciling
                _log.exception("reconcile pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval_s)
            self._wake.clear()

    # ------------------------------------------------------------------ GET /state

    async def status(self) -> StateStatus:
        """GET /state: the last pass's snapshot of the file, what TorchServe serves now,
        the switch's phase and history. Changes nothing (asking TorchServe is an
        observation)."""
        try:
            observed = await observe(self.ts)
            down = None
        except UpstreamUnavailable as e:
            observed, down = Observed(default=None), e.message
        a = assess(self.effective(), observed)
        versions = await asyncio.to_thread(self.repository.versions)
        reason = f"TorchServe did not answer: {down}" if down else self._reason(a)
        if self.passes.seq == 0 and reason is None:
            reason = ("the reconciler has not read the desired-state file yet (its first "
                      "pass is starting)")
        if self.paused is not None:
            reason = f"not reconciling: {self.paused}" + (f"; {reason}" if reason else "")
        return StateStatus(
            desired=self.desired, observed=observed_state(observed, self.schemas.describe),
            converged=a.converged and self.file_error is None and down is None,
            reason=reason,
            phase=self.switch.phase.value, last_error=self.last_error or self.file_error,
            last_switch=self.last_switch, target_serving_version=a.target,
            available_versions=versions, state_file=str(self.path),
            state_file_writable=self.writable_error() is None,
            rollout=self.rollouts.status() if self.rollouts is not None else None,
            fleet=FleetStatus(**self.fleet.status()) if self.fleet is not None else None)
