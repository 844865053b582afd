"""The bodies of ``/batching``: what a client sends and what the sidecar answers.

Pydantic models, so FastAPI validates them and publishes them in ``/openapi.json``.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve.sidecar.config import BATCH_SIZE_MAX, MAX_BATCH_DELAY_MS_MAX, WORKERS_MAX

__all__ = ["BatchingState", "BatchingStatus", "BatchingUpdate", "BatchingUpdateResult"]


class BatchingUpdate(BaseModel):
    """Body of PUT /batching; omitted fields keep their current value.

    Types are strict (``"8"``, ``8.0`` and ``true`` are refused) and unknown fields are
    refused, so that a typo cannot silently change nothing.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    batch_size: int | None = Field(
        None, ge=1, le=BATCH_SIZE_MAX,
        description="Most requests TorchServe merges into one handler call.")
    max_batch_delay_ms: int | None = Field(
        None, ge=0, le=MAX_BATCH_DELAY_MS_MAX,
        description="Longest wait (ms) for a batch to fill before it is sent as is.")
    workers: int | None = Field(
        None, ge=1, le=WORKERS_MAX, description="Worker processes of the new version.")

    @model_validator(mode="after")
    def _not_empty(self) -> BatchingUpdate:
        if self.batch_size is None and self.max_batch_delay_ms is None and self.workers is None:
            raise ValueError("give at least one of batch_size, max_batch_delay_ms, workers")
        return self


class BatchingState(BaseModel):
    """The default version's batching settings, as TorchServe reports them."""

    batch_size: int
    max_batch_delay_ms: int
    workers: int
    model_version: str


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


class BatchingUpdateResult(BatchingState):
    """PUT /batching: the settings now, the ones before, and what the switch did."""

    changed: bool
    previous: BatchingState
    seconds: float
    removed_version: str | None = None
