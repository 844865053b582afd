"""The rollout controller: a candidate version beside the stable one, baked under guards,
then promoted or rolled back by itself.

A rollout is declared in the desired state (``rollout:``, :class:`serve.state.Rollout`).
Its life, one :class:`RolloutRun` per declared (stable version, rollout spec):

``baking``
    The reconciler serves a registration holding both versions
    (``<stable>_b..d..w.._c<candidate>``). Until it serves, the weight is 0. Once it
    does (:meth:`RolloutController.on_serving`), the controller writes the first weight
    into the registration's control file (the workers read it per batch,
    :mod:`serve.store.routing`) and the bake clock starts. Every ``guards.interval_s``
    (:meth:`RolloutController.tick`) it reads the workers' per-arm metrics, takes the
    window since the current weight began, and evaluates the guards
    (:mod:`serve.sidecar.control.guards`): error ratio, latency ratio (forward seconds per
    instance), score PSI; and, over every click label joined since the first weight began,
    the click-quality gates (:mod:`serve.sidecar.control.quality_gates`): NE increase,
    calibration gap. Each guard's consecutive breached evaluations are counted; an ``ok``
    evaluation resets its count (``insufficient_data`` leaves it).
``rolled_back``
    A guard breached on ``guards.failure_limit`` evaluations in a row (``error_ratio``:
    on its first breach: its errors reach users, and its Wilson bound is evidence already),
    or ``POST /state/rollout/rollback``: the weight goes to 0 at
    once (control file), and the effective desired state drops the candidate, so the
    reconciler switches to the stable version alone (zero-failure switch) and unloads it.
    While a breach is still counting, GET /state says so (``reason``, and each guard's
    ``consecutive_breaches``) and the bake does not advance.
``promoted``
    Every weight survived ``bake_s`` with every guard judged ``ok`` (a guard still short
    of data extends the bake: nothing is promoted blind), or ``POST
    /state/rollout/promote``: the effective desired state serves the candidate alone,
    through the same zero-failure switch.

Where the desired-state file is writable, the reconciler also writes the outcome into it
(promoted: ``model.version = candidate``; both: ``rollout: null``), so a restart keeps
it. Where it is read-only (a ConfigMap) the outcome is kept in memory for as long as that
rollout stays declared; update the ConfigMap to make it durable (docs/rollouts.md).
With a fleet (``decisions``, :mod:`serve.sidecar.control.fleet`) the outcome is recorded
once for every pod: :meth:`RolloutController.declare` adopts a recorded decision before the
candidate is ever served (born decided), :meth:`RolloutController.sync_decision` records
this run's outcome (first writer wins) and adopts the store's.

The state is data: :meth:`RolloutController.status` is ``rollout`` in GET /state, and
``dlrm_rollout_phase``, ``dlrm_rollout_weight`` and ``dlrm_rollout_guard_value``/
``_threshold`` mirror it.

Example::

    ctl = RolloutController(read_families=collector.collect,
                            control_file=lambda version: store / f"dlrm-{version}.control.json")
    ctl.declare(desired)                     # the reconciler's pass, after reading the file
    effective = ctl.effective(desired)       # what the reconciler converges to (pure)
    ctl.on_serving(desired, effective.serving_version())  # a pass found it serving
    transition = ctl.tick()                  # a Transition (stepped, promoted, rolled_back) or None
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from prometheus_client.metrics_core import Metric

from serve.errors import Conflict
from serve.metrics.sidecar import SidecarMetrics
from serve.phases import RolloutPhase
from serve.sidecar.adapters.fleet_store import DecisionStore, RolloutDecision
from serve.sidecar.control.guards import (
    GuardLimits,
    GuardResult,
    Snapshot,
    breaches,
    evaluate,
    snapshot,
)
from serve.sidecar.control.quality_gates import (
    QualityLimits,
    QualitySnapshot,
    evaluate_quality,
    quality_snapshot,
)
from serve.sidecar.control.views import GuardStatus, RolloutStatus
from serve.state import DesiredState, ModelRef, Rollout
from serve.store.routing import write_control

__all__ = ["IMMEDIATE_GUARDS", "RolloutController", "RolloutPhase", "RolloutRun", "Transition",
           "limits_of", "mirror", "quality_limits_of", "rollout_key"]

_log = logging.getLogger(__name__)

#: Guards whose first breach rolls back (not ``failure_limit`` in a row): failed requests
#: reach users, and ``error_ratio`` judges a Wilson lower bound, evidence already.
IMMEDIATE_GUARDS: frozenset[str] = frozenset({"error_ratio"})


class Transition(StrEnum):
    """What a guard period (:meth:`RolloutController.tick`) or the fleet's decision did to
    a baking run: ``stepped`` to its next weight, ``promoted``, ``rolled_back`` (the last
    two are also :class:`RolloutPhase` values)."""

    STEPPED = "stepped"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


def rollout_key(stable: str, spec: Rollout) -> str:
    """Identifies one declared rollout: the stable version and the whole spec."""
    text = json.dumps([stable, spec.model_dump(mode="json")], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def limits_of(spec: Rollout) -> GuardLimits:
    """The guard limits of a rollout spec: its declared guards, at the default confidence."""
    return GuardLimits(**spec.guards.model_dump())


def quality_limits_of(spec: Rollout) -> QualityLimits:
    """The click-quality gates' limits of a rollout spec: its declared guards."""
    return QualityLimits(**spec.guards.model_dump())


def _iso(wall: float | None) -> str | None:
    return None if wall is None else datetime.fromtimestamp(wall, UTC).isoformat(
        timespec="seconds")


@dataclass
class RolloutRun:
    """One declared rollout and how far it got (monotonic seconds unless ``*_wall``)."""

    key: str
    stable: str
    spec: Rollout
    started_wall: float
    phase: RolloutPhase = RolloutPhase.BAKING
    step: int = 0
    serving_version: str | None = None  # the two-arm registration, once it serves
    step_started: float | None = None
    base: Snapshot | None = None        # at the current weight's start
    first_base: Snapshot | None = None  # at the first weight's start
    quality_base: QualitySnapshot | None = None  # label sums at the first weight's start
    last_eval: float | None = None
    evaluations: int = 0
    guards: list[GuardResult] = field(default_factory=list)
    # guard name -> breached evaluations in a row (reset by an ok one, and at each weight)
    consecutive: dict[str, int] = field(default_factory=dict)
    reason: str | None = None
    finished_wall: float | None = None
    settled: bool = False  # the outcome was written into the desired-state file
    revision: str | None = None     # the fleet's decision (serve.sidecar.control.fleet)
    decided_by: str | None = None   # the pod that decided it
    checked: bool = True  # the fleet's store was read for a decision (else: held back)

    @property
    def weight(self) -> float:
        """The candidate's share now: 0 until it serves and after a rollback."""
        if self.phase is RolloutPhase.ROLLED_BACK or self.serving_version is None:
            return 0.0
        return self.spec.weights()[self.step]

    def applied_to(self, desired: DesiredState) -> DesiredState:
        """``desired`` (which declares this run) with the run's outcome applied: the
        stable version alone when rolled back (and while the fleet's store has not
        answered), the candidate alone when promoted; as it is while baking."""
        if not self.checked or self.phase is RolloutPhase.ROLLED_BACK:
            return desired.model_copy(update={"rollout": None})
        if self.phase is RolloutPhase.BAKING:
            return desired
        return desired.model_copy(update={"rollout": None,
                                          "model": ModelRef(version=self.spec.candidate)})

    def status(self, now: float) -> RolloutStatus:
        """``rollout`` of GET /state at monotonic time ``now``."""
        elapsed = None if self.step_started is None else round(now - self.step_started, 3)
        ago = None if self.last_eval is None or not self.evaluations else round(
            now - self.last_eval, 3)
        reason = self.reason
        if not self.checked:
            reason = ("the fleet's decision store did not answer: the candidate is held "
                      "back (stable version alone) until it does")
        elif self.phase is RolloutPhase.BAKING and self.serving_version is None \
                and reason is None:
            reason = "loading the candidate beside the stable version (weight 0 until it serves)"
        return RolloutStatus(
            phase=self.phase.value, stable=self.stable, candidate=self.spec.candidate,
            mode=self.spec.mode, weight=self.weight, weights=self.spec.weights(),
            step=self.step, bake_s=self.spec.bake_s, bake_elapsed_s=elapsed,
            serving=self.serving_version is not None and self.phase is RolloutPhase.BAKING,
            serving_version=self.serving_version,
            guards=[GuardStatus(**g.to_json(), consecutive_breaches=self.consecutive.get(
                g.name, 0)) for g in self.guards],
            guard_interval_s=self.spec.guards.interval_s, evaluations=self.evaluations,
            last_evaluated_s_ago=ago, reason=reason, started_at=_iso(self.started_wall),
            finished_at=_iso(self.finished_wall), spec=self.spec,
            revision=self.revision, decided_by=self.decided_by)

    def decision(self, identity: str, note: str | None, now_wall: float
                 ) -> RolloutDecision | None:
        """This run's outcome as a decision ``identity`` records (None while it bakes);
        ``note`` is appended to the reason; decided at ``finished_wall``, else
        ``now_wall`` (Unix s)."""
        if self.phase is RolloutPhase.BAKING:
            return None
        reason = self.reason or ""
        if note:
            reason = f"{reason} [{note}]" if reason else note
        decided_at = self.finished_wall if self.finished_wall is not None else now_wall
        return RolloutDecision.make(key=self.key, stable=self.stable,
                                    candidate=self.spec.candidate, phase=self.phase.value,
                                    reason=reason, decided_by=identity, decided_at=decided_at)

    def adopt(self, decision: RolloutDecision) -> None:
        """Take ``decision`` (of this run): its phase, reason, revision, who decided."""
        phase = RolloutPhase(decision.phase)
        if self.phase is not phase:
            self.settled = False  # another outcome than the one written (if any)
            _log.warning("rollout of %s: adopting the fleet's decision %s (%s by %s): %s",
                         self.spec.candidate, decision.revision, decision.phase,
                         decision.decided_by, decision.reason)
        self.phase, self.reason = phase, decision.reason
        self.revision, self.decided_by = decision.revision, decision.decided_by
        self.finished_wall = decision.decided_at

    def record(self, results: list[GuardResult], now: float) -> None:
        """An evaluation's results: each guard's breaches in a row (an ``ok`` resets its
        count, ``insufficient_data`` leaves it), at monotonic time ``now``."""
        self.guards = results
        for g in results:
            if g.status == "breached":
                self.consecutive[g.name] = self.consecutive.get(g.name, 0) + 1
            elif g.status == "ok":
                self.consecutive[g.name] = 0
        self.last_eval = now
        self.evaluations += 1

    def judge(self, elapsed: float) -> tuple[Transition | None, str | None]:
        """The verdict after an evaluation, ``elapsed`` seconds into the current weight,
        and why: ``rolled_back`` on a guard breached ``failure_limit`` times in a row
        (:data:`IMMEDIATE_GUARDS`: once); at the end of a bake with every blocking guard
        ok, ``stepped`` to the next weight or ``promoted``; else None (baking on) and the
        reason to show (None: nothing to say)."""
        limit = self.spec.guards.failure_limit
        bad = breaches(self.guards)
        final = [g for g in bad if g.name in IMMEDIATE_GUARDS
                 or self.consecutive.get(g.name, 0) >= limit]
        if final:
            return Transition.ROLLED_BACK, "guard " + "; guard ".join(
                f"{g.name} breached{self.times(g.name)}: {g.detail}" for g in final)
        if bad:
            return None, "; ".join(
                f"guard {g.name} breached {self.consecutive.get(g.name, 0)} of {limit} times "
                f"in a row (rolls back at {limit}): {g.detail}" for g in bad)
        if elapsed < self.spec.bake_s:
            return None, None
        waiting = [g for g in self.guards if g.status != "ok" and g.blocking]
        if waiting:
            return None, ("bake time is over but not every guard could judge yet; "
                          "baking on: " + "; ".join(f"{g.name}: {g.detail}" for g in waiting))
        if self.step + 1 < len(self.spec.weights()):
            return Transition.STEPPED, None
        return Transition.PROMOTED, (f"every guard held through {len(self.spec.weights())} "
                                     f"weight(s) of {self.spec.bake_s:g} s each")

    def times(self, name: str) -> str:
        """`` N times in a row`` for a guard breached more than once in a row, else ""."""
        n = self.consecutive.get(name, 0)
        return f" {n} times in a row" if n > 1 else ""


class RolloutController:
    """Runs the declared rollout (see the module docstring).

    Args:
        read_families: the metric families now: the workers' (the sidecar's
            ``HandlerAggregateCollector.collect``) and the feedback join's label sums
            (``FeedbackService.collect``), for the click-quality gates.
        control_file: the control file of a serving version.
        metrics: where the phase, weight and guard values are mirrored; None: nowhere.
        clock: monotonic seconds (bake and guard periods).
        wall_clock: Unix seconds (the times GET /state shows).
        decisions: the fleet's decision store (:mod:`serve.sidecar.control.fleet`): a
            recorded decision makes a newly declared run born decided
            (:meth:`declare`), and :meth:`sync_decision` records and adopts; None: the
            outcome is this controller's alone.
        identity: who decides here (the pod's name), recorded as ``decided_by``.
    """

    def __init__(self, *, read_families: Callable[[], Iterable[Metric]],
                 control_file: Callable[[str], Path],
                 metrics: SidecarMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 decisions: DecisionStore | None = None, identity: str = "local") -> None:
        self.decisions = decisions
        self.identity = identity
        self.read_families = read_families
        self.control_file = control_file
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock
        self.run: RolloutRun | None = None
        self._mirror()

    # ------------------------------------------------------------------ the declared state

    def declare(self, desired: DesiredState | None) -> RolloutRun | None:
        """Start a run for a newly declared rollout (a spec or stable version not seen
        before); keep the current one otherwise. Returns the current run."""
        if desired is None or desired.rollout is None:
            return self.run
        key = rollout_key(desired.model.version, desired.rollout)
        if self.run is None or self.run.key != key:
            self.run = RolloutRun(key=key, stable=desired.model.version, spec=desired.rollout,
                                  started_wall=self.wall_clock(),
                                  checked=self.decisions is None)
            _log.info("rollout of %s beside %s (%s, weights %s, bake %.0f s) begins",
                      desired.rollout.candidate, desired.model.version, desired.rollout.mode,
                      desired.rollout.weights(), desired.rollout.bake_s)
            self._mirror()
        run = self.run
        if not run.checked and self.decisions is not None:
            # Born decided: a recorded decision is adopted before the candidate is ever
            # served. A store that does not answer raises here and the run stays
            # unchecked: effective() holds the candidate back until it answers.
            recorded = self.decisions.read(key)
            run.checked = True
            if recorded is not None:
                self.adopt(recorded)
            self._mirror()
        return run

    def _run_for(self, desired: DesiredState) -> RolloutRun | None:
        run = self.run
        if run is None or desired.rollout is None:
            return None
        return run if run.key == rollout_key(desired.model.version, desired.rollout) else None

    def effective(self, desired: DesiredState | None) -> DesiredState | None:
        """What the reconciler converges to: ``desired``, with its rollout's outcome
        applied (rolled back: the stable version alone; promoted: the candidate alone)."""
        if desired is None or desired.rollout is None:
            return desired
        run = self._run_for(desired)
        return desired if run is None else run.applied_to(desired)

    def settled_state(self, desired: DesiredState) -> DesiredState | None:
        """The desired state to write once the declared rollout has an outcome (None when
        it has none yet, or it was written already)."""
        run = self._run_for(desired)
        if run is None or run.phase is RolloutPhase.BAKING or run.settled:
            return None
        return self.effective(desired)

    # ------------------------------------------------------------------ the steps

    def on_serving(self, desired: DesiredState | None, serving_version: str | None) -> bool:
        """Called after each reconcile pass that found the effective target serving
        (converged). The first time for a baking run: the first weight goes into the
        control file and the bake clock starts. True when it started now."""
        if desired is None or serving_version is None:
            return False
        run = self._run_for(desired)
        if run is None or run.phase is not RolloutPhase.BAKING:
            return False
        if run.serving_version == serving_version or serving_version != desired.serving_version():
            return False  # started already; or not the two-arm registration of this rollout
        run.serving_version = serving_version
        self._start_step(run, run.step)
        return True

    def _start_step(self, run: RolloutRun, step: int) -> None:
        run.step = step
        weight = run.spec.weights()[step]
        self._write_weight(run, weight)
        run.step_started = self.clock()
        run.base, quality = self._snapshots(run)
        if step == 0 or run.first_base is None:
            run.first_base = run.base
        if step == 0 or run.quality_base is None:
            run.quality_base = quality
        run.last_eval = run.step_started
        run.guards = []
        run.consecutive = {}
        run.reason = None
        _log.info("rollout of %s: weight %.4g (step %d of %d) for %.0f s", run.spec.candidate,
                  weight, step + 1, len(run.spec.weights()), run.spec.bake_s)
        self._mirror()

    def _write_weight(self, run: RolloutRun, weight: float) -> None:
        if run.serving_version is None:
            return
        write_control(self.control_file(run.serving_version), run.spec.mode, weight,
                      candidate=run.spec.candidate, stable=run.stable, step=run.step)

    def _snapshots(self, run: RolloutRun) -> tuple[Snapshot, QualitySnapshot]:
        families = list(self.read_families())  # one read for both
        return (snapshot(families, stable_version=run.stable,
                         candidate_version=run.spec.candidate),
                quality_snapshot(families, stable_version=run.stable,
                                 candidate_version=run.spec.candidate))

    def due(self) -> bool:
        """A baking, serving run whose guard period has passed."""
        run = self.run
        return (run is not None and run.phase is RolloutPhase.BAKING
                and run.serving_version is not None and run.last_eval is not None
                and self.clock() - run.last_eval >= run.spec.guards.interval_s)

    def evaluate(self) -> list[GuardResult]:
        """Evaluate the guards over the window since the current weight began; a guard
        short of data there is judged over the whole rollout instead (at weight 1.0 the
        stable arm gets no traffic, so its p99 and scores come from the earlier weights).
        The click-quality gates judge every label joined since the first weight began
        (labels are scarce and come late; the candidate is the same model at every
        weight), appended last."""
        run = self.run
        if run is None or run.base is None:
            return []
        now, quality = self._snapshots(run)
        limits = limits_of(run.spec)
        results = evaluate(now.minus(run.base), limits)
        if run.first_base is not None and run.first_base is not run.base and any(
                g.status == "insufficient_data" for g in results):
            whole = {g.name: g for g in evaluate(now.minus(run.first_base), limits)}
            results = [g if g.status != "insufficient_data" or
                       whole[g.name].status == "insufficient_data"
                       else replace(whole[g.name], detail=whole[g.name].detail
                                    + " (over the whole rollout: too little at this weight)")
                       for g in results]
        if run.quality_base is not None:
            results += evaluate_quality(quality.minus(run.quality_base),
                                        quality_limits_of(run.spec))
        run.record(results, self.clock())
        self._mirror()
        return run.guards

    def advance(self) -> Transition | None:
        """After an evaluation, act on :meth:`RolloutRun.judge`: roll back, start the next
        weight, promote, or bake on (its reason shown). Returns the :class:`Transition`,
        or None."""
        run = self.run
        if run is None or run.phase is not RolloutPhase.BAKING or run.step_started is None:
            return None
        transition, reason = run.judge(self.clock() - run.step_started)
        if transition is Transition.ROLLED_BACK:
            self.rollback(reason or "")
        elif transition is Transition.STEPPED:
            self._start_step(run, run.step + 1)
        elif transition is Transition.PROMOTED:
            self.promote(reason or "")
        else:
            run.reason = reason
        return transition

    def tick(self) -> Transition | None:
        """One guard period: evaluate and advance when due (the reconciler calls it every
        pass). Returns the transition, if any."""
        if not self.due():
            return None
        self.evaluate()
        return self.advance()

    # ------------------------------------------------------------------ outcomes

    def _baking(self, action: str) -> RolloutRun:
        run = self.run
        if run is None or run.phase is not RolloutPhase.BAKING:
            state = "no rollout was declared" if run is None else f"the rollout of " \
                f"{run.spec.candidate} is {run.phase.value} already"
            raise Conflict(f"cannot {action}: {state}; declare one with PUT /state "
                           "(rollout: {candidate, mode, weight, bake_s})")
        return run

    def rollback(self, reason: str) -> RolloutRun:
        """Weight 0 now; the candidate is unloaded by the next reconcile pass.

        Raises:
            Conflict: no rollout is baking.
        """
        run = self._baking("roll back")
        if run.serving_version is not None:
            self._write_weight(run, 0.0)
        run.phase, run.reason = RolloutPhase.ROLLED_BACK, reason
        run.finished_wall = self.wall_clock()
        _log.warning("rollout of %s rolled back: %s", run.spec.candidate, reason)
        self._mirror()
        return run

    def promote(self, reason: str) -> RolloutRun:
        """The candidate becomes the stable version (the next reconcile pass switches).

        Raises:
            Conflict: no rollout is baking.
        """
        run = self._baking("promote")
        run.phase, run.reason = RolloutPhase.PROMOTED, reason
        run.finished_wall = self.wall_clock()
        _log.info("rollout of %s promoted: %s", run.spec.candidate, reason)
        self._mirror()
        return run

    # ------------------------------------------------------------------ the fleet's decision

    def decision_of(self, note: str | None = None) -> RolloutDecision | None:
        """The current run's outcome as a decision to record (None while it bakes);
        ``note`` is appended to the reason (e.g. the pods judged)."""
        if self.run is None:
            return None
        return self.run.decision(self.identity, note, self.wall_clock())

    def adopt(self, decision: RolloutDecision) -> bool:
        """Take the fleet's recorded ``decision`` for the current run (its phase, reason,
        revision, who decided): weight 0 at once for a rollback; the effective desired
        state follows. True when the run changed; a decision of another rollout, or one
        adopted already, changes nothing."""
        run = self.run
        if run is None or run.key != decision.key or run.revision == decision.revision:
            return False
        if decision.phase == RolloutPhase.ROLLED_BACK and run.serving_version is not None:
            self._write_weight(run, 0.0)
        run.adopt(decision)
        self._mirror()
        return True

    def sync_decision(self, note: str | None = None) -> Transition | None:
        """Record the current run's outcome in the store (first writer wins), then adopt
        what the store holds for it (every reconcile pass, and after a POST). Without a
        store the outcome is stamped as this controller's own. Returns the phase adopted
        now, as a :class:`Transition`, when the run's phase changed (another pod
        decided), else None."""
        run = self.run
        if run is None:
            return None
        if self.decisions is None or not run.checked:
            if self.decisions is None and run.phase is not RolloutPhase.BAKING \
                    and run.revision is None:
                own = self.decision_of(note)
                if own is not None:
                    run.revision, run.decided_by = own.revision, own.decided_by
            return None
        if run.revision is not None and run.decided_by is not None:
            return None  # adopted already: a recorded decision never changes
        recorded = self.decisions.read(run.key)
        if recorded is None and run.phase is not RolloutPhase.BAKING:
            own = self.decision_of(note)
            if own is not None:
                recorded = self.decisions.record(own)
        before = run.phase
        if recorded is not None and self.adopt(recorded) and run.phase is not before:
            return Transition(recorded.phase)
        return None

    def mark_settled(self) -> None:
        """The outcome is written into the desired-state file."""
        if self.run is not None:
            self.run.settled = True

    # ------------------------------------------------------------------ status

    def status(self) -> RolloutStatus | None:
        """``rollout`` of GET /state: the current or last rollout; None if there was none."""
        return None if self.run is None else self.run.status(self.clock())

    def _mirror(self) -> None:
        if self.metrics is not None:
            mirror(self.metrics, self.run)


def mirror(metrics: SidecarMetrics, run: RolloutRun | None) -> None:
    """Mirror ``run`` in the rollout gauges: its phase and weight, and each guard's value
    (None before it judged) and threshold (the spec's); ``none`` without a run."""
    if run is None:
        metrics.set_rollout("none", 0.0, [])
        return
    g = run.spec.guards
    thresholds = {"error_ratio": g.max_error_ratio, "latency_ratio": g.max_latency_ratio,
                  "score_psi": g.max_score_psi, "ne_increase": g.max_ne_increase,
                  "calibration_gap": g.max_calibration_gap}
    values = {r.name: r.value for r in run.guards}
    metrics.set_rollout(run.phase.value, run.weight,
                        [(name, values.get(name), thresholds[name]) for name in thresholds])
