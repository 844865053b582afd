"""What a reconcile pass does for the declared rollout: declare it, step it once the
target serves, and write its outcome into the desired-state file.

The reconciler (:mod:`serve.sidecar.control.reconciler`) owns the pass; the rollout
controller (:mod:`serve.sidecar.control.rollout`) owns the run. :class:`RolloutStepper`
is the reconciler's side of the rollout: it calls the controller at the right points of a
pass (the metric reads and the fleet's store on a thread), and only there:

1. :meth:`RolloutStepper.declare`, after the pass read the file: with a fleet, renew the
   lease and adopt the decision recorded for the declared rollout (a pod started after it
   was decided is born decided: the store is read before anything is served);
2. :meth:`RolloutStepper.step`, after a pass that converged: start the bake once the
   two-arm registration serves, evaluate the guards when due (only the fleet's leader),
   adopt the fleet's decision, and wake the reconciler for an outcome;
3. :meth:`RolloutStepper.settle`: write an outcome into the file where it is writable
   (else record it in the fleet's own object, never the operator's, or keep it in memory).

:meth:`RolloutStepper.end` is POST /state/rollout/promote|rollback.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from serve.errors import Conflict
from serve.sidecar.control.fleet import Fleet
from serve.sidecar.control.rollout import RolloutController, Transition
from serve.sidecar.control.state_file import DesiredStateFile
from serve.sidecar.control.views import RolloutStatus
from serve.state import DesiredState, dump_state

__all__ = ["RolloutStepper"]

_log = logging.getLogger(__name__)


class RolloutStepper:
    """The reconcile pass's calls into the rollout controller (see the module docstring).

    Args:
        rollouts: the rollout controller (owns the run).
        file: the desired-state file an outcome is written into.
        desired: the reconciler's desired state now (its snapshot: the last valid file).
        wake: asks the reconciler for another pass (an outcome changes what to serve).
        fleet: one rollout decision per fleet (:mod:`serve.sidecar.control.fleet`); None:
            this pod decides alone.
    """

    def __init__(self, rollouts: RolloutController, file: DesiredStateFile, *,
                 desired: Callable[[], DesiredState | None], wake: Callable[[], None],
                 fleet: Fleet | None = None) -> None:
        self.rollouts = rollouts
        self.file = file
        self.desired = desired
        self.wake = wake
        self.fleet = fleet

    async def declare(self, declared: DesiredState | None) -> None:
        """The one place a rollout is declared. With a fleet: renew the lease, and adopt
        the decision recorded for the declared rollout (a pod started after it was
        decided is born decided: the store is read before anything is served)."""
        ctl, fleet = self.rollouts, self.fleet
        if fleet is None:
            ctl.declare(declared)
            return
        await asyncio.to_thread(fleet.elect)  # never raises: an unreachable lease follows
        try:
            await asyncio.to_thread(ctl.declare, declared)
            await asyncio.to_thread(ctl.sync_decision)
        except Exception as e:  # noqa: BLE001 - an unreachable store: retry next pass
            _log.warning("reading the fleet's rollout decision failed (%s); a new rollout's "
                         "candidate is held back until it answers; retrying next pass", e)

    def judged(self) -> str | None:
        """Which pods' metrics the leader judged (noted in its decision); None alone."""
        fleet = self.fleet
        if fleet is None or not fleet.leading or fleet.families is None:
            return None
        return fleet.families.describe()

    async def step(self, desired: DesiredState | None, serving: str | None) -> None:
        """After a pass that converged on ``desired`` (``serving`` its serving version):
        start the bake once the two-arm registration serves, evaluate the guards when
        due, write an outcome into the file."""
        ctl = self.rollouts
        if desired is None:
            return
        ctl.on_serving(desired, serving)
        transition: Transition | None = None
        if self.fleet is None or self.fleet.leading:  # one judge per fleet
            try:
                transition = await asyncio.to_thread(ctl.tick)
            except Exception:  # noqa: BLE001 - a metrics read must not stop reconciling
                _log.exception("evaluating the rollout's guards failed; retrying next period")
        if self.fleet is not None:
            try:
                adopted = await asyncio.to_thread(ctl.sync_decision, self.judged())
            except Exception:  # noqa: BLE001 - an unreachable store: retry next pass
                _log.exception("recording the rollout's decision failed; retrying next pass")
                adopted = None
            transition = transition or adopted
        if transition in (Transition.PROMOTED, Transition.ROLLED_BACK):
            self.wake()
        self.settle()

    def settle(self) -> None:
        """Write a rollout's outcome into the desired-state file where it is writable
        (promoted: the candidate is the model version; both: ``rollout: null``), so a
        restart keeps it; where read-only, the outcome holds in memory (GET /state)."""
        ctl, desired, fleet = self.rollouts, self.desired(), self.fleet
        if desired is None:
            return
        if fleet is not None and not fleet.leading:
            return  # the leader settles; this pod serves the adopted decision meanwhile
        settled = ctl.settled_state(desired)
        if settled is None:
            return
        ctl.mark_settled()
        if self.file.write_outcome(settled):
            self.wake()
        elif fleet is not None and fleet.publish_state is not None:
            try:  # read-only here (the operator's ConfigMap): record it in the fleet's own
                fleet.publish_state(dump_state(settled))
            except Exception:  # noqa: BLE001 - the decision holds in the store anyway
                _log.exception("publishing the settled desired state failed")

    def end(self, promote: bool, reason: str) -> RolloutStatus:
        """Promote or roll back the baking rollout by hand: the outcome is written into
        the file where it is writable and the reconciler is woken to serve it. Returns
        its status.

        Raises:
            Conflict: no rollout is baking.
        """
        ctl = self.rollouts
        if promote:
            ctl.promote(reason)
        else:
            ctl.rollback(reason)
        if self.fleet is not None:  # first writer wins: the store's decision is adopted
            ctl.sync_decision(f"by POST on {self.fleet.identity}")
        self.settle()
        self.wake()
        status = ctl.status()
        if status is None:  # pragma: no cover - promote()/rollback() raised without a run
            raise Conflict("no rollout")
        return status
