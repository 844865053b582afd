"""Every controller's phase, one ``StrEnum`` each, written once.

The values are the label values of the phase gauges (``serve.metrics``: ``SWITCH_PHASES``,
``ROLLOUT_PHASES``, ``TUNER_PHASES``, ``RECONCILE_RESULTS`` are built from these enums)
and what GET /state, GET /tuner and POST /drain show. Ground floor (it imports only
:mod:`enum`): ``serve.metrics`` and the sidecar's controllers both import it.
"""
from __future__ import annotations

from enum import StrEnum

__all__ = ["DrainPhase", "ReconcileResult", "RolloutPhase", "SwitchPhase", "TunerPhase"]


class SwitchPhase(StrEnum):
    """What the version switch is doing (``dlrm_switch_phase``), in order; ``failed``
    stays until the next switch starts."""

    IDLE = "idle"
    COPYING = "copying"
    REGISTERING = "registering"
    WAITING_READY = "waiting_ready"
    SETTING_DEFAULT = "setting_default"
    DRAINING = "draining"
    UNREGISTERING = "unregistering"
    ROLLING_BACK = "rolling_back"
    FAILED = "failed"


class RolloutPhase(StrEnum):
    """Where a declared rollout is (``dlrm_rollout_phase``; that gauge also has ``none``
    for no rollout declared)."""

    BAKING = "baking"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


class TunerPhase(StrEnum):
    """What the batching tuner is doing (``dlrm_tuner_phase``)."""

    OFF = "off"
    PAUSED = "paused"
    OBSERVING = "observing"
    SWITCHING = "switching"
    TRYING = "trying"
    SETTLED = "settled"


class DrainPhase(StrEnum):
    """How far a drain for shutdown got (POST /drain's ``phase``)."""

    SERVING = "serving"
    CLOSING = "closing"
    DRAINING = "draining"
    DRAINED = "drained"
    FAILED = "failed"


class ReconcileResult(StrEnum):
    """What one reconcile pass did (``dlrm_reconcile_total{result}``): ``converged``
    nothing to do; ``applied`` a switch or clean-up step succeeded; ``waiting`` not
    converged and nothing to do yet (workers loading, retry back-off, no desired state);
    ``failed`` a step failed (rolled back); ``refused`` a switch would not fit the memory
    limit; ``invalid`` the desired-state file does not parse; ``unavailable`` TorchServe
    did not answer."""

    CONVERGED = "converged"
    APPLIED = "applied"
    WAITING = "waiting"
    FAILED = "failed"
    REFUSED = "refused"
    INVALID = "invalid"
    UNAVAILABLE = "unavailable"
