"""Every body of the sidecar's HTTP API, in one place: what a client sends to
``/batching``, ``/tuner``, ``/state``, ``/feedback`` and ``/embeddings/deltas``, and what
the sidecar answers.

Pydantic models, so FastAPI validates them and publishes them in ``/openapi.json``. The
bodies defined here are the edge's own (requests, acknowledgements); the status views
the controllers build (``GET /state``, ``GET /batching``, ``PUT /batching``'s result) live
in :mod:`serve.sidecar.control.views` and :mod:`serve.sidecar.adapters.torchserve` and
are re-exported here, so a client reads every schema from this module. The body of
PUT /state is :class:`serve.state.DesiredState`.
"""
from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from serve.sidecar.adapters.torchserve import BatchingState
from serve.sidecar.control.views import (
    BatchingUpdate,
    BatchingUpdateResult,
    DeltaTrust,
    EmbeddingsStatus,
    GuardStatus,
    ObservedBatching,
    ObservedModel,
    ObservedState,
    RequestSchema,
    RolloutStatus,
    ServiceEndpoints,
    SidecarEndpoints,
    SparseFeatureSchema,
    StateStatus,
    SwitchRecord,
    TunerStatus,
    WorkerDeltaStatus,
)
from serve.state import DesiredState

__all__ = [
    "FEEDBACK_MAX_LABELS",
    "BatchingState",
    "BatchingStatus",
    "BatchingUpdate",
    "BatchingUpdateResult",
    "DamagedDelta",
    "DeltaAnswer",
    "DeltaTrust",
    "DeltaWorker",
    "DeltasStatus",
    "EmbeddingsStatus",
    "FeedbackAnswer",
    "FeedbackBody",
    "FeedbackLabel",
    "GuardStatus",
    "ObservedBatching",
    "ObservedModel",
    "ObservedState",
    "RequestSchema",
    "RolloutStatus",
    "ServiceEndpoints",
    "SidecarEndpoints",
    "SparseFeatureSchema",
    "StateAccepted",
    "StateStatus",
    "SwitchRecord",
    "TunerStatus",
    "TunerUpdate",
    "WorkerDeltaStatus",
]


class BatchingStatus(BatchingState):
    """GET /batching: the settings, plus the version switch's status when there is one.

    Both extra fields are left out of the body while the switch is idle and has no error,
    so the usual answer is exactly a :class:`BatchingState`.
    """

    switch_phase: str | None = Field(
        None, description="Phase of the running (or last failed) version switch: copying, "
                          "registering, waiting_ready, setting_default, draining, "
                          "unregistering, rolling_back or failed; absent when idle.")
    switch_error: str | None = Field(
        None, description="Why the last switch failed or left the old version registered.")


# --------------------------------------------------------------------------- /tuner


class TunerUpdate(BaseModel):
    """Body of PUT /tuner; omitted fields keep their value. Strict types, no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool | None = Field(None, description="Tune (true) or serve the declared "
                                                   "batching (false).")
    p99_goal_ms: float | None = Field(None, gt=0, le=60_000,
                                      description="The p99 latency goal settings are judged on.")

    @model_validator(mode="after")
    def _not_empty(self) -> TunerUpdate:
        if self.enabled is None and self.p99_goal_ms is None:
            raise ValueError("give at least one of enabled, p99_goal_ms")
        return self


class StateAccepted(BaseModel):
    """PUT /state (202): the new desired state is written; the reconciler applies it."""

    desired: DesiredState
    converged: bool
    target_serving_version: str
    state_file: str
    message: str


# --------------------------------------------------------------------------- /feedback

#: Labels one POST /feedback may carry (a body of 100,000 is ~7 MB of JSON).
FEEDBACK_MAX_LABELS = 100_000
#: TorchServe's request ids are UUIDs (36 characters); room for other id schemes.
REQUEST_ID_MAX_CHARS = 128


class FeedbackLabel(BaseModel):
    """One click label for an earlier prediction. Strict: ``"1"``, ``1.0`` and ``true``
    are refused, as are unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str = Field(min_length=1, max_length=REQUEST_ID_MAX_CHARS,
                            description="The x-request-id header of the prediction's response.")
    index: int = Field(ge=0, description="Position of the instance in that request (0-based).")
    label: int = Field(ge=0, le=1, description="1 = clicked, 0 = not clicked.")


class FeedbackBody(BaseModel):
    """Body of POST /feedback."""

    model_config = ConfigDict(extra="forbid", strict=True)

    labels: list[FeedbackLabel] = Field(min_length=1, max_length=FEEDBACK_MAX_LABELS)


class FeedbackAnswer(BaseModel):
    """What became of the labels of one POST /feedback (see serve.sidecar.services.feedback)."""

    received: int
    joined: int
    unknown: int
    expired: int
    duplicate: int
    bad_index: int
    joined_by_arm: list[dict[str, Any]] = Field(
        description="Labels added to each (version, arm) window by this body.")


# --------------------------------------------------------------------------- /embeddings


class DeltaWorker(BaseModel):
    """One live worker in the answer to POST /embeddings/deltas."""

    pid: int
    sequence: int = Field(description="Last delta sequence it has applied.")
    apply_seconds: float = Field(description="Seconds its last apply took.")


class DeltaAnswer(BaseModel):
    """POST /embeddings/deltas: the delta is stored (200: every live worker serving the
    version applied it; 202: not within ``wait_s``, they still will)."""

    version: str = Field(description="The delta's base version.")
    sequence: int
    rows: int = Field(description="Rows the delta changes, over all tables.")
    bytes: int = Field(description="Size of the delta file.")
    applied: bool = Field(description="Every live worker serving the version (at least "
                                      "one) reports this sequence or a later one.")
    workers: list[DeltaWorker] = Field(description="The live workers serving the version "
                                                   "when the wait ended.")
    waited_s: float
    message: str


class DamagedDelta(BaseModel):
    """A stored delta that does not read back whole (its workers stop before it)."""

    version: str
    file: str = Field(description="The file in <delta_dir>/<version>/.")
    reason: str = Field(description="Why it is damaged; POST the right bytes to repair it.")


class DeltasStatus(BaseModel):
    """GET /embeddings/deltas: per served version, the deltas stored and applied."""

    enabled: bool = Field(description="False when the sidecar runs without --delta-dir.")
    delta_dir: str | None
    versions: dict[str, EmbeddingsStatus]
    damaged: list[DamagedDelta] = Field(
        default_factory=list, description="Stored deltas of served versions that are "
                                          "damaged (truncated, bad checksum): re-POST them.")
    max_bytes: int | None = Field(default=None, description="The largest delta accepted "
                                                            "(--max-delta-bytes).")
    message: str | None = Field(default=None, description="How to enable deltas, when off.")
    signatures: str | None = Field(
        default=None, description="'verified (key <id>)' with --delta-verify-key (unsigned "
                                  "or wrongly signed deltas are refused), else 'not "
                                  "verified'; null when deltas are off.")
