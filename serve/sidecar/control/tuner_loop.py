"""The batching tuner's loop: what drives :class:`~serve.sidecar.control.tuner.BatchTuner`.

The tuner is a state machine with no I/O; :class:`TuningLoop` feeds it. Every
``interval_s`` (:meth:`TuningLoop.run`) one observation (:meth:`TuningLoop.step`): read
TorchServe's and the workers' counters and what serves, say why the tuner must not act
now (:meth:`TuningLoop.blocked`: a paused reconciler, a rollout, a switch, not
converged), step the tuner, and hand its setting to the reconciler
(``batching_override``; woken when it changed). The reconciler applies it like any
desired state, with zero failed requests.

A batching set by hand is pinned (:meth:`TuningLoop.pin_batching`: PUT /batching, PUT
/state with a new batching): the tuner is turned off (:meth:`TuningLoop.set_enabled`),
which drops its override, until PUT /tuner turns it on again.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from serve.metrics.aggregate import torchserve_families
from serve.metrics.sidecar import SidecarMetrics
from serve.phases import SwitchPhase
from serve.sidecar.adapters.torchserve import Observed, TorchServeClient, observe
from serve.sidecar.control.reconciler import Reconciler
from serve.sidecar.control.switch import VersionSwitch
from serve.sidecar.control.tuner import BatchTuner, Setting, counters_from

__all__ = ["TuningLoop"]

_log = logging.getLogger(__name__)


class TuningLoop:
    """Drives the batching tuner (see the module docstring).

    Args:
        tuner: the state machine.
        metrics: where its phase and setting are mirrored.
        torchserve: TorchServe's management and metrics API.
        switch: the version switch (the tuner waits while it runs).
        reconciler: applies the tuner's setting; None (no desired-state file): the tuner
            never acts.
        worker_families: the workers' metric families now (the multiprocess collector);
            None: none.
        clock: monotonic seconds (the counters' time).
    """

    def __init__(self, tuner: BatchTuner, *, metrics: SidecarMetrics,
                 torchserve: TorchServeClient, switch: VersionSwitch,
                 reconciler: Reconciler | None,
                 worker_families: Callable[[], Iterable[Metric]] | None,
                 clock: Callable[[], float]) -> None:
        self.tuner, self.metrics = tuner, metrics
        self.ts, self.switch, self.reconciler = torchserve, switch, reconciler
        self.worker_families = worker_families
        self.clock = clock

    async def run(self) -> None:
        """Every ``tuner.interval_s``: one tuner observation. Never dies: errors are
        logged (a failed read judges nothing; the next one goes on)."""
        while True:
            await asyncio.sleep(self.tuner.config.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the tuner must not stop the sidecar
                _log.exception("batching tuner step failed")

    async def step(self) -> Setting | None:
        """One observation of the tuner: read the counters and what serves, step it, and
        hand its setting to the reconciler (woken when it changed). Returns the setting
        asked for now, or None."""
        tuner, reconciler = self.tuner, self.reconciler
        if reconciler is None:
            return None
        change = None
        if tuner.enabled:
            observed = await observe(self.ts)
            serving = observed.serving
            setting = (Setting(serving.batch_size, serving.max_batch_delay_ms)
                       if serving is not None else None)
            try:
                families = torchserve_families(await self.ts.metrics_text())
            except Exception as e:  # noqa: BLE001 - without them concurrency is unknown
                _log.debug("TorchServe metrics unavailable to the tuner: %s", e)
                families = []
            read = self.worker_families
            workers_families = (await asyncio.to_thread(lambda: list(read()))
                                if read is not None else [])
            counters = counters_from(workers_families, families, self.clock())
            change = tuner.step(counters, setting,
                                serving.workers if serving is not None else 0,
                                self.blocked(reconciler, observed))
        override = tuner.override if tuner.enabled else None
        batching = override.batching() if override is not None else None
        if batching != reconciler.batching_override:
            reconciler.batching_override = batching
            reconciler.wake()
        self.metrics.set_tuner(tuner.phase, override)
        return change

    def blocked(self, reconciler: Reconciler, observed: Observed) -> str | None:
        """Why the tuner must not judge or act now (None: it may)."""
        if reconciler.paused is not None:
            return f"the reconciler is paused ({reconciler.paused})"
        desired = reconciler.desired
        if desired is None:
            return "there is no valid desired state"
        if desired.rollout is not None:
            return f"a rollout of {desired.rollout.candidate} is declared; batching holds"
        if self.switch.phase is not SwitchPhase.IDLE:
            return f"a version switch is running ({self.switch.phase.value})"
        last = reconciler.last_pass
        if last is None or not last.converged:
            return "the serving state has not converged yet"
        if observed.serving is None:
            return "nothing serves"
        return None

    def pin_batching(self, what: str) -> bool:
        """A batching set by hand (``what``: the call and its value) is pinned: turn the
        tuner off, which would move it again. Returns whether the tuner was on."""
        if not self.tuner.enabled:
            return False
        self.set_enabled(False, f"turned off by {what}: the setting is pinned; PUT /tuner "
                                '{"enabled": true} resumes tuning')
        return True

    def set_enabled(self, enabled: bool, why: str) -> None:
        """Turn the tuner on or off (PUT /tuner; PUT /batching and PUT /state with a new
        batching turn it off); the reconciler follows at its next pass."""
        tuner = self.tuner
        was = tuner.enabled
        tuner.set_enabled(enabled, why)
        if was != enabled:
            _log.info("batching tuner %s: %s", "on" if enabled else "off", why)
        if self.reconciler is not None and not enabled:
            self.reconciler.batching_override = None
        self.metrics.set_tuner(tuner.phase, None)
