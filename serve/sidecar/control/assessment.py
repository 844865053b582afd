"""Desired vs observed, as data: the reconciler's decision (:func:`assess`) and the
``observed`` view of GET /state (:func:`observed_state`). Pure functions: no I/O, no
state, so GET /state and the reconciler's pass judge alike.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from serve.sidecar.adapters.torchserve import Observed
from serve.sidecar.control.views import ObservedBatching, ObservedModel, ObservedState
from serve.state import DesiredState, parse_serving_version, serving_candidate

__all__ = ["Action", "Assessment", "assess", "observed_state"]


class Action(StrEnum):
    """The reconciler's next step toward the desired state: ``none`` (converged),
    ``switch`` (to the target serving version), ``cleanup`` (the target serves; drain and
    unregister the others) or ``wait`` (workers loading, or no valid desired state)."""

    NONE = "none"
    SWITCH = "switch"
    CLEANUP = "cleanup"
    WAIT = "wait"


@dataclass(frozen=True)
class Assessment:
    """Desired vs observed: converged, or the next action and why not.

    ``action``: an :class:`Action`; ``serving``: the target is the default version with
    all its workers READY.
    """

    converged: bool
    action: Action
    reason: str | None
    target: str | None
    serving: bool = False


def assess(desired: DesiredState | None, observed: Observed) -> Assessment:
    """The next step from ``observed`` toward ``desired`` (no I/O)."""
    if desired is None:
        return Assessment(False, Action.WAIT, "there is no valid desired state", None)
    target = desired.serving_version()
    current = observed.get(target)
    if observed.default == target and current is not None:
        if current.ready < desired.workers:
            return Assessment(False, Action.WAIT, f"{current.ready} of {desired.workers} workers of "
                              f"{target} are READY; TorchServe is starting them", target)
        others = [v for v in observed.names() if v != target]
        if others:
            return Assessment(False, Action.CLEANUP, f"{target} serves; {', '.join(others)} still "
                              "registered (being drained and unregistered)", target, True)
        return Assessment(True, Action.NONE, None, target, True)
    if observed.default is None:
        why = f"nothing is registered in TorchServe; {target} is to be registered"
    else:
        why = f"TorchServe serves {observed.default}; the desired state is {target}"
    return Assessment(False, Action.SWITCH, why, target)


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
