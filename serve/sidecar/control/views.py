"""The status views the controllers answer ``GET /state`` with (read models).

Pydantic models, so the HTTP edge returns them as they are and ``/openapi.json``
publishes them; the controllers build them from a snapshot of their state and change
nothing while doing so.
"""
from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from serve.sidecar.adapters.torchserve import BatchingState
from serve.sidecar.config import BATCH_SIZE_MAX, MAX_BATCH_DELAY_MS_MAX, WORKERS_MAX
from serve.state import DesiredState, Rollout


class TunerStatus(BaseModel):
    """GET /tuner (and ``tuner`` in GET /state): the batching tuner's state and decisions."""

    enabled: bool
    phase: str = Field(description="off, paused, observing, switching, trying or settled "
                                   "(see dlrm_tuner_phase).")
    reason: str = Field(description="Why it is in this phase / did what it did last.")
    setting: dict[str, int] | None = Field(
        description="The batching the tuner asks for; null: the declared batching serves.")
    serving: dict[str, int] | None = Field(description="What TorchServe serves now.")
    pending: dict[str, int] | None = Field(description="Chosen, being switched to.")
    p99_goal_ms: float
    traffic: dict[str, Any] | None = Field(description="The last measurement window.")
    searched_for: dict[str, Any] | None = Field(
        description="The window the current search (or the serving setting's) began on.")
    trials: list[dict[str, Any]] = Field(description="The current search's measured settings.")
    queue: list[dict[str, int]] = Field(description="Settings the search will still try.")
    decisions: list[dict[str, Any]] = Field(
        description="The last settings it applied: at_s (sidecar monotonic s), from, to, "
                    "reason (seed, trial, best, failed), detail.")
    config: dict[str, Any]


# --------------------------------------------------------------------------- /state


class SparseFeatureSchema(BaseModel):
    """One sparse feature of a request, with the table it reads (``ModelSchema.describe``)."""

    name: str = Field(description="The feature's name (its key in a request).")
    table: str = Field(description="The embedding table it reads (several features may "
                                   "read one table).")
    rows: int = Field(description="Rows of that table: ids are 0..rows-1.")
    dim: int = Field(description="Width of that table's embeddings.")
    pooling: str = Field(description="How the table pools a feature's ids: sum or mean.")
    max_ids: int = Field(description="Most ids one instance may carry in the feature "
                                     "(1: one-hot).")


class RequestSchema(BaseModel):
    """What a request to a model version carries (:meth:`serve.schema.ModelSchema.describe`)."""

    dense: int = Field(description="Dense features per instance.")
    sparse: list[SparseFeatureSchema] = Field(
        description="The sparse features, in request order.")


class ObservedModel(BaseModel):
    """The model version TorchServe serves, and its request schema."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    version: str = Field(description="The repository version TorchServe's default version "
                                     "serves (its serving-version name without the suffix).")
    # ``schema`` would shadow BaseModel.schema: the attribute is schema_, the key "schema".
    schema_: RequestSchema | None = Field(
        default=None, alias="schema",
        description="The request schema of that version, from its build report: dense "
                    "count and the sparse features in request order (name, table, rows, "
                    "dim, pooling, max_ids). Null when the repository has no report for "
                    "the version, or none from which a schema can be derived.")


class ObservedBatching(BaseModel):
    batch_size: int
    max_batch_delay_ms: int


class TierStatus(BaseModel):
    """One table tier (``device``: the device cache; ``host``: the bounded host-memory
    tier over the table files, whose misses are disk reads), summed over the workers."""

    hit_ratio: float | None = Field(
        description="hits / lookups over the window (tables.window_s), or since the "
                    "workers started when window_s is null; null: no lookup.")
    lookups: int = Field(description="Ids looked up at the tier, over the same span.")
    hits: int = Field(description="... of them found resident there.")
    miss_p99_s: float | None = Field(
        description="p99 of a batch's fetch of its misses from the tier below, seconds "
                    "(dlrm_tier_miss_seconds, same span); null: no miss fetched.")
    read_bytes_per_s: float | None = Field(
        description="Bytes fetched from the tier below per second over the window; null "
                    "without a window (window_s null).")
    capacity_bytes: int | None = Field(
        description="The tier's budget now, summed over the live workers; null: not "
                    "reported.")
    hit_ratio_total: float | None = Field(
        description="hits / lookups since the workers started (every worker's counts, "
                    "dead ones included); null: no lookup.")
    lookups_total: int = Field(description="Ids looked up since the workers started.")


class ObservedTables(BaseModel):
    """The table tiers' hit rates (``observed.tables``), read from the workers' metrics."""

    window_s: float | None = Field(
        description="Seconds the windowed fields cover (the sidecar samples the workers' "
                    "counters every few seconds and keeps about a minute); null: no earlier "
                    "sample yet, the fields are cumulative since the workers started.")
    device: TierStatus | None = Field(
        default=None, description="The device cache; null: no worker reports it.")
    host: TierStatus | None = Field(
        default=None, description="The host-memory tier over the table files on disk; "
                                  "null: no worker reports it (tables all in memory).")


class ObservedState(BaseModel):
    """What TorchServe serves, with the desired state's keys (null when nothing serves)."""

    model: ObservedModel | None
    batching: ObservedBatching | None
    workers: int = Field(description="Workers of the default version (any status).")
    candidate: str | None = Field(
        default=None, description="A rollout's candidate loaded beside the model version "
                                  "(the serving version's _c<candidate> suffix).")
    serving_version: str | None = Field(
        description="TorchServe's name of the default version: "
                    "<version>_b<batch>d<delay>w<workers>[_c<candidate>].")
    ready_workers: int
    pending_requests: int | None = Field(
        default=None, description="Requests queued for the default version (TorchServe's jobQueueStatus).")
    registered_versions: list[str] = Field(
        description="Every registered version of the model, in TorchServe's order.")
    tables: ObservedTables | None = Field(
        default=None, description="Per table tier (device, host): hit ratio, lookups, "
                                  "hits, miss p99, bytes read per second, capacity, from "
                                  "the workers' metrics; null without the workers' "
                                  "metrics directory or before any worker reports a tier.")


class SwitchRecord(BaseModel):
    """The last version switch: where from and to, how long, and the memory it took."""

    model_config = ConfigDict(populate_by_name=True)

    from_version: str | None = Field(alias="from")
    to: str
    ok: bool
    seconds: float = Field(description="From the plan to the old version unregistered.")
    error: str | None = None
    peak_memory_bytes: int | None = Field(
        None, description="Highest memory seen during the switch: the cgroup's usage when "
                          "readable, else the RSS sum of every registered version's workers.")
    peak_workers_rss_bytes: int | None = Field(
        None, description="Highest RSS sum of the workers of every registered version.")
    memory_limit_bytes: int | None = Field(None, description="The limit checked against; "
                                                             "null: no limit.")
    memory_check: dict[str, Any] | None = Field(
        None, description="The numbers of the check made before loading the new version.")


class GuardStatus(BaseModel):
    """One guard of a rollout at its last evaluation."""

    name: str = Field(description="error_ratio, latency_ratio, score_psi, ne_increase or "
                                  "calibration_gap.")
    value: float | None = Field(description="Its value over the window; null: not enough data.")
    threshold: float = Field(description="Breached when value > threshold.")
    status: str = Field(description="ok, breached or insufficient_data.")
    detail: str
    blocking: bool = Field(True, description="Promotion waits for it to be ok (false: the "
                                             "click-quality gates without min_labels).")
    consecutive_breaches: int = Field(
        0, description="Evaluations in a row it breached (an ok one resets it); the "
                       "rollout rolls back at guards.failure_limit.")


class RolloutStatus(BaseModel):
    """The current (or last) rollout: phase, weight, guards, and why it ended."""

    phase: str = Field(description="baking, promoted or rolled_back.")
    stable: str
    candidate: str
    mode: str
    weight: float = Field(description="The candidate's share now (0 until it serves, and "
                                      "after a rollback).")
    weights: list[float] = Field(description="The weights walked: [weight, *steps].")
    step: int = Field(description="Index of the current weight in weights.")
    bake_s: float
    bake_elapsed_s: float | None = Field(description="Seconds at the current weight.")
    serving: bool = Field(description="Both versions are loaded and the candidate takes "
                                      "its share.")
    serving_version: str | None
    guards: list[GuardStatus] = Field(description="At the last evaluation.")
    guard_interval_s: float
    evaluations: int
    last_evaluated_s_ago: float | None
    reason: str | None = Field(description="Why it was promoted or rolled back, or what "
                                           "the bake waits for.")
    started_at: str | None
    finished_at: str | None
    spec: Rollout
    revision: str | None = Field(
        default=None, description="The fleet's decision (the same on every pod for one "
                                  "decision); null while it bakes.")
    decided_by: str | None = Field(
        default=None, description="The pod (or controller) that decided it.")


class FleetStatus(BaseModel):
    """``fleet`` in GET /state: this pod's place in the fleet (serve.sidecar.control.fleet)."""

    identity: str = Field(description="This pod's name.")
    leader: str | None = Field(description="The pod holding the rollout lease (it judges "
                                           "the guards); null: unknown or nobody.")
    leading: bool = Field(description="This pod holds the lease.")
    lease: str = Field(description="The lease's kind (none: a single pod leads itself).")
    pods: int = Field(description="Pods the leader knows of, itself included (this pod's "
                                  "own count when it leads).")
    pods_judged: int = Field(description="Of them, those whose metrics answered at the "
                                         "last judgement.")
    skipped: dict[str, str] = Field(description="Pods skipped at the last judgement, and why.")
    error: str | None = Field(description="Why the lease could not be reached, if so.")


class WorkerDeltaStatus(BaseModel):
    """What one live worker has applied for one version (``serve.store.deltas.status.WorkerStatus``)."""

    pid: int
    version: str
    sequence: int = Field(description="Last delta sequence applied (0: none yet).")
    rows: int = Field(description="Rows written by the deltas applied so far.")
    apply_seconds: float = Field(description="Seconds the last apply took (the wait for "
                                             "the batch in progress excluded).")
    applied_at: float = Field(description="Unix seconds of the last apply.")
    created_at: float = Field(description="When the last applied delta was built (unix "
                                          "seconds; 0: none).")


class IdMapView(BaseModel):
    """One managed feature's id map in a served version (``serve.runtime.idmap``; computed
    by ``serve.sidecar.services.deltas.idmaps.IdMaps``)."""

    feature: str = Field(description="The sparse feature (several may read one table).")
    table: str = Field(description="The managed table it reads.")
    capacity: int = Field(description="Ids the table can hold: its rows - 1 (row 0 is "
                                      "the fallback row of every id without one).")
    ids: int | None = Field(description="Ids holding a row now: the build's + admitted - "
                                        "evicted; null when the build report does not say "
                                        "how many the build admitted.")
    occupancy: float | None = Field(description="ids / capacity, 0..1 (null with ids).")
    admitted: int = Field(description="Ids the applied deltas assigned a row.")
    evicted: int = Field(description="Ids the applied deltas evicted (back to the "
                                     "fallback row).")
    sequence: int = Field(description="The deltas counted: 1..sequence (those every live "
                                      "worker applied; the stored ones while none reports).")
    fallback_lookups: int | None = Field(
        description="Lookups of the feature by this version that read the fallback row, "
                    "summed over the pod's workers (dlrm_embedding_ids_fallback_total); "
                    "null without the workers' metrics directory.")


class EmbeddingsStatus(BaseModel):
    """One served version's embedding deltas: stored, and applied by its live workers.

    The applied-side values are null while no live worker serving the version reports.
    """

    last_sequence: int = Field(description="Last delta sequence stored (0: none).")
    head_digest: str | None = Field(
        default=None, description="The parent the next delta must name (parent_digest): "
                                  "the sha256 of the last stored delta, or of the version's "
                                  "build report while none is stored.")
    applied_sequence: int | None = Field(
        description="Last sequence every live worker serving the version has applied "
                    "(their minimum).")
    rows_updated: int | None = Field(
        description="Rows written by the deltas applied (the slowest worker's count).")
    apply_seconds_max: float | None = Field(
        description="The slowest worker's last apply, in seconds.")
    newest_delta_created_at: float | None = Field(
        description="When the newest delta applied by every live worker was built (unix "
                    "seconds); null before the first.")
    newest_delta_age_s: float | None = Field(
        description="Seconds since then: how stale the embeddings are.")
    workers: list[WorkerDeltaStatus]
    id_maps: list[IdMapView] = Field(
        default_factory=list, description="Each feature of a managed table (ids mapped by "
                                          "the version's id map); [] when every table is "
                                          "modulo.")


class SidecarEndpoints(BaseModel):
    """``sidecar`` in GET /state: where this sidecar takes writes."""

    write_port: int | None = Field(
        description="The port of the write API (every PUT/POST; the public port refuses "
                    "them); null when every port takes writes (one listener).")


class ServiceEndpoints(BaseModel):
    """``endpoints`` in GET /state: where clients reach the model through this sidecar."""

    oip_url: str | None = Field(
        description="The Open Inference Protocol (KServe v2) base URL (GET "
                    "{oip_url}/v2/health/ready, POST {oip_url}/v2/models/{model}/infer), on "
                    "the host this request reached; null when not served (--oip-port 0).")


class DeltaTrust(BaseModel):
    """Whether this pod checks who made the embedding deltas it takes."""

    signatures: str = Field(description="'verified (key <id>)' with --delta-verify-key "
                                        "(unsigned or wrongly signed deltas are refused), "
                                        "else 'not verified'.")


class StateStatus(BaseModel):
    """GET /state: the declared state, what serves, and whether they agree (and why not)."""

    desired: DesiredState | None = Field(
        description="The desired state (the file; its last valid content if it is invalid now).")
    observed: ObservedState
    converged: bool
    reason: str | None = Field(description="Why it has not converged; null when it has.")
    phase: str = Field(description="The version switch's phase (see dlrm_switch_phase).")
    last_error: str | None
    last_switch: SwitchRecord | None
    target_serving_version: str | None
    available_versions: list[str] = Field(
        description="The model repository's versions, oldest first.")
    state_file: str | None
    state_file_writable: bool = Field(
        description="False where the file is read-only (a ConfigMap): PUT /state answers 409.")
    rollout: RolloutStatus | None = Field(
        default=None, description="The current or last rollout; null if none was declared.")
    tuner: TunerStatus | None = Field(
        default=None, description="The batching tuner (null without a desired-state file).")
    sidecar: SidecarEndpoints | None = Field(
        default=None, description="Where this sidecar takes writes.")
    endpoints: ServiceEndpoints | None = Field(
        default=None, description="Where clients reach the model through this sidecar.")
    fleet: FleetStatus | None = Field(
        default=None, description="The fleet's rollout leader and this pod's place; absent "
                                  "without a fleet (--fleet none).")
    embeddings: dict[str, EmbeddingsStatus] | None = Field(
        default=None, description="Embedding deltas per served version (stored, and "
                                  "applied by the live workers); absent when the sidecar "
                                  "runs without --delta-dir.")
    deltas: DeltaTrust | None = Field(
        default=None, description="Whether embedding deltas are verified; absent without "
                                  "--delta-dir.")

    @model_serializer(mode="wrap")
    def _omit_embeddings_when_off(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("embeddings") is None:
            data.pop("embeddings", None)
            data.pop("deltas", None)
        if isinstance(data, dict) and data.get("fleet") is None:
            data.pop("fleet", None)  # absent without a fleet, as before there was one
        return data


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


class BatchingUpdateResult(BatchingState):
    """PUT /batching: the settings now, the ones before, and what the switch did."""

    changed: bool
    previous: BatchingState
    seconds: float
    removed_version: str | None = None
    tuner_turned_off: bool = Field(
        False, description="True when this PUT turned the batching tuner off: a setting "
                           "given by hand is pinned (PUT /tuner {\"enabled\": true} resumes).")
