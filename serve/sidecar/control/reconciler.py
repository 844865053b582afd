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
import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serve.errors import ConfigError, Conflict, InsufficientMemory, ServeError, UpstreamUnavailable
from serve.metrics import SidecarMetrics
from serve.sidecar.adapters.archives import control_path, is_sidecar_archive
from serve.sidecar.adapters.memory import MemoryCheck
from serve.sidecar.adapters.model_schemas import SchemaCache
from serve.sidecar.adapters.torchserve import Observed, Registered, TorchServeClient, observe
from serve.sidecar.config import SidecarConfig
from serve.sidecar.control.rollout import RolloutController
from serve.sidecar.control.switch import VersionSwitch
from serve.sidecar.control.views import (
    ObservedBatching,
    ObservedModel,
    ObservedState,
    StateStatus,
    SwitchRecord,
)
from serve.state import (
    Batching,
    DesiredState,
    dump_state,
    parse_serving_version,
    parse_state,
    serving_candidate,
    write_state,
)
from serve.store.repository import ModelRepository

__all__ = ["Assessment", "PassResult", "Reconciler", "SwitchFailed", "assess", "observed_state"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assessment:
    """Desired vs observed: converged, or the next action and why not.

    ``action``: ``none`` (converged), ``switch``, ``cleanup`` or ``wait``; ``serving``:
    the target is the default version with all its workers READY.
    """

    converged: bool
    action: str
    reason: str | None
    target: str | None
    serving: bool = False


def assess(desired: DesiredState | None, observed: Observed) -> Assessment:
    """The next step from ``observed`` toward ``desired`` (no I/O)."""
    if desired is None:
        return Assessment(False, "wait", "there is no valid desired state", None)
    target = desired.serving_version()
    current = observed.get(target)
    if observed.default == target and current is not None:
        if current.ready < desired.workers:
            return Assessment(False, "wait", f"{current.ready} of {desired.workers} workers of "
                              f"{target} are READY; TorchServe is starting them", target)
        others = [v for v in observed.names() if v != target]
        if others:
            return Assessment(False, "cleanup", f"{target} serves; {', '.join(others)} still "
                              "registered (being drained and unregistered)", target, True)
        return Assessment(True, "none", None, target, True)
    if observed.default is None:
        why = f"nothing is registered in TorchServe; {target} is to be registered"
    else:
        why = f"TorchServe serves {observed.default}; the desired state is {target}"
    return Assessment(False, "switch", why, target)


def observed_state(observed: Observed,
                   schema_of: Callable[[str], dict[str, Any] | None] | None = None
                   ) -> ObservedState:
    """``observed`` in the desired state's shape (plus serving version, READY workers...).

    ``schema_of``: the request schema (``ModelSchema.describe()``) of a repository
    version, or None (:meth:`SchemaCache.describe`; it reads each report once); None: no
    schema is shown.
    """
    serving = observed.serving
    if serving is None:
        return ObservedState(model=None, batching=None, workers=0, serving_version=None,
                             ready_workers=0, registered_versions=observed.names())
    parsed = parse_serving_version(serving.version)
    version = parsed[0] if parsed else serving.version
    schema = schema_of(version) if schema_of is not None else None
    return ObservedState(
        model=ObservedModel.model_validate({"version": version, "schema": schema}),
        candidate=serving_candidate(serving.version),
        batching=ObservedBatching(batch_size=serving.batch_size,
                                  max_batch_delay_ms=serving.max_batch_delay_ms),
        workers=serving.workers, serving_version=serving.version,
        ready_workers=serving.ready, pending_requests=serving.pending,
        registered_versions=observed.names())


@dataclass(frozen=True)
class PassResult:
    """One reconcile pass: what it read (``desired_hash``), did (``result``, one of
    ``serve.metrics.RECONCILE_RESULTS``) and found at its end."""

    seq: int
    desired_hash: str | None
    target: str | None
    result: str
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


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _as_serve_error(e: BaseException) -> ServeError:
    return e if isinstance(e, ServeError) else ServeError(repr(e))


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
    """

    def __init__(self, torchserve: TorchServeClient, config: SidecarConfig, *,
                 switch: VersionSwitch, repository: ModelRepository,
                 metrics: SidecarMetrics | None = None,
                 rollouts: RolloutController | None = None,
                 schemas: SchemaCache | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 retry_base_s: float = 2.0, retry_max_s: float = 300.0,
                 sample_interval_s: float = 0.25) -> None:
        if config.state_file is None:
            raise ConfigError("the reconciler needs a desired-state file (--state-file)")
        self.ts = torchserve
        self.config = config
        self.path: Path = config.state_file
        self.switch = switch
        self.repository = repository
        self.schemas = schemas if schemas is not None else SchemaCache(repository.report)
        self.metrics = metrics
        self.rollouts = rollouts
        self.clock = clock
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.sample_interval_s = sample_interval_s
        self.desired: DesiredState | None = None
        self.file_error: str | None = None
        self.last_error: str | None = None
        self.last_switch: SwitchRecord | None = None
        self.last_pass: PassResult | None = None
        self._hash: str | None = None
        self._seq = 0
        self._failures = 0
        self._retry_at = 0.0
        self._failed_error: str | None = None
        self._switch_t0: float | None = None
        self._wake = asyncio.Event()
        self._passed = asyncio.Event()
        self._pass_lock = asyncio.Lock()
        self.paused: str | None = None
        # The batching tuner's choice (serve.sidecar.control.tuner); None: the declared batching.
        self.batching_override: Batching | None = None

    # ------------------------------------------------------------------ the desired state

    def read_desired(self) -> str | None:
        """Re-read the file by path; update ``desired`` (last valid) and ``file_error``.

        Returns the hash of the content read (None when it could not be read).
        """
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.file_error = (f"desired-state file {self.path} does not exist; PUT /state "
                               "or write it (format: serve/state.py)")
            self._hash = None
            return None
        except OSError as e:
            self.file_error = f"desired-state file {self.path} could not be read: {e}"
            self._hash = None
            return None
        digest = _digest(data)
        if digest == self._hash:
            return digest
        self._hash = digest
        try:
            state = parse_state(yaml.safe_load(data), source=str(self.path))
        except yaml.YAMLError as e:
            self.file_error = f"desired-state file {self.path} is not valid YAML: {e}"
            return digest
        except ConfigError as e:
            self.file_error = e.message
            return digest
        self.file_error = None
        if state != self.desired:
            _log.info("desired state: %s", state.serving_version())
            self._reset_retry()
        self.desired = state
        return digest

    def writable_error(self) -> str | None:
        """Why the file cannot be written (None when it can): a read-only file or folder,
        as a ConfigMap mount is."""
        if self.path.exists() and not os.access(self.path, os.W_OK):
            return self._read_only(f"{self.path} is not writable")
        folder = self.path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not os.access(folder, os.W_OK):
            return self._read_only(f"its folder {folder} is not writable")
        return None

    def _read_only(self, detail: str) -> str:
        return (f"the desired-state file {self.path} is read-only ({detail}). In Kubernetes "
                f"it is the ConfigMap dlrm-serving-state mounted into the pod: change it "
                f"there (`kubectl edit configmap dlrm-serving-state`, or edit the manifest "
                f"and `kubectl apply -f` it); every pod applies it once kubelet updates the "
                f"mount (up to a minute)")

    def write(self, desired: DesiredState) -> tuple[int, str]:
        """Write the file atomically and wake the reconciler. Returns the passes begun so
        far (those after them read the new file) and the hash of what was written.

        Raises:
            Conflict: the file is read-only (the message says to edit the ConfigMap).
        """
        why = self.writable_error()
        if why is not None:
            raise Conflict(why)
        try:
            write_state(self.path, desired)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise Conflict(self._read_only(str(e))) from None
            raise
        self._reset_retry()  # asked again: retry a failed target at once
        self.wake()
        return self._seq, _digest(dump_state(desired).encode())

    def revert(self, written: DesiredState, previous: DesiredState) -> bool:
        """Put ``previous`` back if the file still holds exactly ``written`` (nobody wrote
        since); True if it did."""
        try:
            if self.path.read_bytes() != dump_state(written).encode():
                return False
            write_state(self.path, previous)
        except OSError as e:
            _log.error("could not restore the desired state in %s: %s", self.path, e)
            return False
        self.wake()
        return True

    # ------------------------------------------------------------------ one pass

    async def tick(self) -> PassResult:
        """One pass: read, observe, decide, act; see the module docstring."""
        self._seq += 1
        seq = self._seq
        digest = self.read_desired()
        declared = self.desired  # GET /state may re-read the file while this pass awaits
        desired = self.effective()
        target = desired.serving_version() if desired else None
        try:
            result, switch_error, cleanup_error, observed = await self._act(desired)
            if observed is None:  # something changed: look again
                observed = await observe(self.ts)
        except UpstreamUnavailable as e:
            return self._finish(PassResult(
                seq, digest, target, "unavailable", False, False,
                f"TorchServe did not answer: {e.message}"), e.message)
        a = assess(desired, observed)
        if self.file_error is not None and result in ("converged", "waiting", "applied"):
            result = "invalid"
        error = (switch_error.message if switch_error else cleanup_error) or self.file_error
        converged = a.converged and self.file_error is None
        if converged:
            await self._rollout_step(declared, a.target)
        return self._finish(PassResult(
            seq, digest, target, result, converged, a.serving,
            self._reason(a), switch_error, cleanup_error), error)

    def effective(self) -> DesiredState | None:
        """What to converge to: the desired state with its rollout's outcome applied
        (:meth:`serve.sidecar.control.rollout.RolloutController.effective`), with the batching
        tuner's setting (:attr:`batching_override`) in place of the declared batching."""
        desired = self.desired
        if self.rollouts is not None:
            self.rollouts.declare(desired)
            desired = self.rollouts.effective(desired)
        override = self.batching_override
        if desired is not None and override is not None:
            desired = desired.model_copy(update={"batching": override})
        return desired

    async def _rollout_step(self, desired: DesiredState | None, serving: str | None) -> None:
        """After a pass that converged on ``desired``: start the bake once the two-arm
        registration serves, evaluate the guards when due, write an outcome into the
        file."""
        ctl = self.rollouts
        if ctl is None or desired is None:
            return
        ctl.on_serving(desired, serving)
        try:
            transition = await asyncio.to_thread(ctl.tick)
        except Exception:  # noqa: BLE001 - a metrics read must not stop reconciling
            _log.exception("evaluating the rollout's guards failed; retrying next period")
            transition = None
        if transition in ("promoted", "rolled_back"):
            self.wake()
        self.settle_rollout()

    def settle_rollout(self) -> None:
        """Write a rollout's outcome into the desired-state file where it is writable
        (promoted: the candidate is the model version; both: ``rollout: null``), so a
        restart keeps it; where read-only, the outcome holds in memory (GET /state)."""
        ctl, desired = self.rollouts, self.desired
        if ctl is None or desired is None:
            return
        settled = ctl.settled_state(desired)
        if settled is None:
            return
        ctl.mark_settled()
        why = self.writable_error()
        if why is not None:
            _log.warning("rollout outcome not written (%s); update the desired state to %s "
                         "to make it durable", why, settled.serving_version())
            return
        try:
            write_state(self.path, settled)
        except OSError as e:
            _log.error("could not write the rollout's outcome into %s: %s", self.path, e)
            return
        self.wake()

    async def _act(self, desired: DesiredState | None
                   ) -> tuple[str, ServeError | None, str | None, Observed | None]:
        """(result, switch error, clean-up error, what TorchServe serves now or None when
        an action may have changed it) of this pass's actions toward ``desired`` (the
        effective desired state)."""
        observed = await observe(self.ts)
        a = assess(desired, observed)
        acted = False
        if a.action == "switch" and desired is not None:
            if self._retry_wait() > 0:
                return "waiting", None, None, observed
            error = await self._run_switch(desired, observed)
            if error is not None:
                result = "refused" if isinstance(error, InsufficientMemory) else "failed"
                return result, error, None, None
            acted = True
            observed = await observe(self.ts)
            a = assess(desired, observed)
        if a.action == "cleanup" and a.target is not None:
            cleanup_error = await self.cleanup(observed, a.target)
            self._close_switch_record(cleanup_error)
            if cleanup_error is not None:
                return "failed", None, cleanup_error, None
            acted = True
        if acted:
            self._close_switch_record(None)
            self.switch.idle()
            return "applied", None, None, None
        return ("converged" if a.converged else "waiting"), None, None, observed

    async def _run_switch(self, desired: DesiredState, observed: Observed) -> ServeError | None:
        """Plan and run the switch to ``desired``; the error (recorded, retried later)."""
        self._switch_t0 = t0 = self.clock()
        if self.switch.tracker is not None:
            self.switch.tracker.reset()
        check: MemoryCheck | None = None
        plan = None
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
            error = _as_serve_error(e)
            if plan is None:  # plan() failed (e.g. no such version): the switch never began
                self.switch.fail(e)
            self._record_switch(observed, desired, t0, error, check)
            self._schedule_retry(error)
            return error
        self._record_switch(observed, desired, t0, None, check)
        self._failures = 0
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
                self.switch.live_pids.update(r.pids)
            self.switch.sample()

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

    # ------------------------------------------------------------------ bookkeeping

    def _finish(self, p: PassResult, error: str | None) -> PassResult:
        self.last_pass = p
        if error is not None:
            self.last_error = error
        elif p.converged:
            self.last_error = None
        if self.metrics is not None:
            self.metrics.observe_reconcile(p.result)
            self.metrics.set_converged(p.converged if self.desired is not None else None)
        passed, self._passed = self._passed, asyncio.Event()
        passed.set()
        return p

    def _reason(self, a: Assessment) -> str | None:
        parts = []
        if self.file_error is not None:
            keep = ("keeping the last valid desired state" if self.desired is not None
                    else "nothing to converge to")
            parts.append(f"the desired-state file is not usable ({self.file_error}); {keep}")
        if not a.converged and self.desired is not None and a.reason:
            parts.append(a.reason)
        if a.action == "switch" and self._failures:
            wait = self._retry_wait()
            parts.append(f"the last switch failed ({self._failed_error}); "
                         + (f"retrying in {wait:.0f} s" if wait > 0 else "retrying now"))
        return "; ".join(parts) or None

    def _record_switch(self, observed: Observed, desired: DesiredState, t0: float,
                       error: ServeError | None, check: MemoryCheck | None) -> None:
        tracker, memory = self.switch.tracker, self.switch.memory
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

    def _close_switch_record(self, cleanup_error: str | None) -> None:
        """Extend the last switch's record over its clean-up (duration, peak)."""
        record, t0 = self.last_switch, self._switch_t0
        if record is None or t0 is None or not record.ok:
            return
        tracker = self.switch.tracker
        self.last_switch = record.model_copy(update={
            "seconds": round(self.clock() - t0, 3), "error": cleanup_error,
            "peak_memory_bytes": tracker.peak_bytes if tracker else None,
            "peak_workers_rss_bytes": tracker.peak_rss_bytes if tracker else None})
        self._switch_t0 = None

    def _schedule_retry(self, error: ServeError) -> None:
        self._failures += 1
        delay = min(self.retry_max_s, self.retry_base_s * 2 ** (self._failures - 1))
        self._retry_at = self.clock() + delay
        self._failed_error = error.message
        _log.error("switch failed (retry in %.0f s): %s", delay, error.message)

    def _reset_retry(self) -> None:
        self._failures, self._retry_at = 0, 0.0

    def _retry_wait(self) -> float:
        return max(0.0, self._retry_at - self.clock()) if self._failures else 0.0

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
            p = self.last_pass
            if p is not None and p.seq > after:
                if p.desired_hash != digest and self._file_digest() != digest:
                    raise Conflict(
                        f"the desired state in {self.path} was changed by another writer "
                        "while this change was being applied; GET /state shows the target now")
                if p.desired_hash == digest and p.switch_error is not None:
                    raise SwitchFailed(p.switch_error)
                if p.desired_hash == digest and p.result == "unavailable":
                    raise UpstreamUnavailable(
                        f"{p.reason}; the change stays declared in {self.path} and is "
                        f"applied once TorchServe answers (GET /state)")
                if p.desired_hash == digest and (p.converged or (p.serving and p.cleanup_error)):
                    return p
            remaining = deadline - self.clock()
            if remaining <= 0:
                why = p.reason if p is not None else "no reconcile pass finished"
                raise UpstreamUnavailable(
                    f"TorchServe did not converge to the new desired state within "
                    f"{timeout_s:.0f} s ({why}); it stays declared in {self.path} and the "
                    f"reconciler keeps going: GET /state shows its progress")
            passed = self._passed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(passed.wait(), remaining)

    def _file_digest(self) -> str | None:
        try:
            return _digest(self.path.read_bytes())
        except OSError:
            return None

    @property
    def passes(self) -> int:
        """Passes begun so far."""
        return self._seq

    # ------------------------------------------------------------------ GET /state

    async def status(self) -> StateStatus:
        """GET /state: the file and TorchServe read now, the switch's phase and history."""
        self.read_desired()
        try:
            observed = await observe(self.ts)
            down = None
        except UpstreamUnavailable as e:
            observed, down = Observed(default=None), e.message
        a = assess(self.effective(), observed)
        versions = await asyncio.to_thread(self.repository.versions)
        reason = f"TorchServe did not answer: {down}" if down else self._reason(a)
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
            rollout=self.rollouts.status() if self.rollouts is not None else None)
