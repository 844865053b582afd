"""Every Prometheus metric of the service: names, help, buckets and how they aggregate.

This package is the ONE place that defines metric names: this module holds the names, the
bounded label values and the buckets (no prometheus_client import). Names follow the
Prometheus conventions: ``dlrm_`` namespace, base units in the suffix (``_seconds``,
``_bytes``), ``_total`` on counters, ratios in 0..1, and only bounded labels (an HTTP status
code, a pipeline stage, a worker status; never a user, item or request id).

Two sides record or expose them, each with its own module:

* **TorchServe workers** (one OS process per worker) record with
  :class:`~serve.metrics.worker.HandlerMetrics`. Workers are separate processes, so
  prometheus_client runs in *multiprocess mode*: whoever starts TorchServe sets
  ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory (an ``emptyDir`` volume in
  Kubernetes) and every worker writes its values to mmap files there. The variable must be
  set before ``prometheus_client`` is first imported in the worker, which holds because
  workers inherit TorchServe's environment. A worker starts by cleaning the files of dead
  workers out of that directory (:mod:`serve.metrics.multiprocess`).
* **The sidecar** reads that directory with
  :class:`~serve.metrics.aggregate.HandlerAggregateCollector` (a ``MultiProcessCollector``
  plus the derived hit ratio), adds its own metrics
  (:class:`~serve.metrics.sidecar.SidecarMetrics`, and the embedding-delta families of
  :mod:`serve.metrics.deltas`), the worker count and TorchServe's own metrics scraped from
  its metrics port (:mod:`serve.metrics.aggregate`).

Decisions, with why:

* The cache statistics a runtime reports (``RuntimeStats``) are cumulative per worker.
  ``HandlerMetrics.set_cache`` turns them into counter increments by delta, so the
  sum over workers stays monotonic even when a worker dies (its file keeps its final
  count) or a new model version starts from zero.
* ``dlrm_cache_hit_ratio`` is NOT written by the workers: a per-worker ratio cannot be
  summed or averaged honestly (workers see different traffic). The sidecar computes it
  from the summed counters, ``hits / (hits + misses)`` over the lifetime of all workers
  (NaN before the first lookup). For alerting over a window prefer the PromQL
  ``rate(dlrm_cache_hits_total[5m]) / (rate(dlrm_cache_hits_total[5m]) +
  rate(dlrm_cache_misses_total[5m]))``.
* Cache bytes are gauges with ``multiprocess_mode="livesum"``: the sum over live
  workers. The sidecar removes the gauge files of workers that TorchServe no longer
  lists (they died or their version was unregistered); see ``HandlerAggregateCollector``.
* The sidecar's own metrics are kept in plain Python and exposed by a custom collector,
  not by prometheus_client ``Counter`` objects: if ``PROMETHEUS_MULTIPROC_DIR`` is set in
  the sidecar's environment too, such objects would write mmap files into the workers'
  directory and every sidecar series would appear twice.

Example (in a worker)::

    from serve.metrics.worker import HandlerMetrics

    metrics = HandlerMetrics()
    metrics.observe_request(code=200, instances=512, seconds=0.012)
    metrics.observe_batch(instances=2048, requests=4)
"""
from __future__ import annotations

from serve.phases import ReconcileResult, RolloutPhase, SwitchPhase, TunerPhase

__all__ = [
    "ARMS",
    "ARM_ERRORS_TOTAL",
    "ARM_FORWARD_SECONDS_PER_INSTANCE",
    "ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS",
    "ARM_REQUESTS_TOTAL",
    "ARM_REQUEST_DURATION_SECONDS",
    "ARM_SCORE",
    "BASELINE_AUC",
    "BASELINE_CALIBRATION_RATIO",
    "BASELINE_OBSERVED_CTR",
    "BASELINE_PREDICTED_CTR",
    "BATCHING_UPDATES_TOTAL",
    "BATCHING_UPDATE_SECONDS",
    "BATCH_INSTANCES",
    "BATCH_INSTANCES_BUCKETS",
    "BATCH_REQUESTS",
    "BATCH_REQUESTS_BUCKETS",
    "CACHE_DEVICE_BYTES",
    "CACHE_EVICTIONS_TOTAL",
    "CACHE_HITS_TOTAL",
    "CACHE_HIT_RATIO",
    "CACHE_HOST_BYTES",
    "CACHE_MISSES_TOTAL",
    "CAPACITY_UTILIZATION_RATIO",
    "CAPACITY_WORK_SECONDS_TOTAL",
    "DELTA_FILES_SKIPPED_TOTAL",
    "DELTA_POSTS_REFUSED_TOTAL",
    "DELTA_REFUSAL_REASONS",
    "DELTA_SKIP_REASONS",
    "EMBEDDING_DELTA_APPLIED_SEQUENCE",
    "EMBEDDING_DELTA_APPLY_SECONDS",
    "EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS",
    "EMBEDDING_DELTA_ROWS_UPDATED",
    "EMBEDDING_DELTA_SEQUENCE",
    "EMBEDDING_IDS_ADMITTED_TOTAL",
    "EMBEDDING_IDS_EVICTED_TOTAL",
    "EMBEDDING_IDS_FALLBACK_TOTAL",
    "EMBEDDING_IDS_WRAPPED_TOTAL",
    "EMBEDDING_ID_MAP_OCCUPANCY_RATIO",
    "FEEDBACK_LABELS_TOTAL",
    "FEEDBACK_RESULTS",
    "FLEET_LEADER",
    "FLEET_PODS",
    "FLEET_PODS_JUDGED",
    "GPU_MEMORY_TOTAL_BYTES",
    "GPU_MEMORY_USED_BYTES",
    "GPU_UTILIZATION_RATIO",
    "INSTANCES_TOTAL",
    "ONLINE_AUC",
    "ONLINE_CALIBRATION_RATIO",
    "ONLINE_CLICKS_TOTAL",
    "ONLINE_LABELS",
    "ONLINE_LOGLOSS_NATS_TOTAL",
    "ONLINE_LOGLOSS_SQ_NATS2_TOTAL",
    "ONLINE_OBSERVED_CTR",
    "ONLINE_PREDICTED_CTR",
    "ONLINE_ROWS_TOTAL",
    "ONLINE_SCORE_TOTAL",
    "PREDICTION_LOG_BYTES",
    "PREDICTION_LOG_RECORDS_TOTAL",
    "PREDICT_CPU_SECONDS_TOTAL",
    "QUALITY_GUARDS",
    "RECONCILE_RESULTS",
    "RECONCILE_TOTAL",
    "REQUESTS_TOTAL",
    "REQUEST_DURATION_BUCKETS",
    "REQUEST_DURATION_SECONDS",
    "REUSE_ACCESSES_TOTAL",
    "REUSE_DISTANCE_BUCKETS",
    "REUSE_DISTANCE_ROWS",
    "REUSE_FIRST_ACCESSES_TOTAL",
    "ROLLOUT_GUARDS",
    "ROLLOUT_GUARD_THRESHOLD",
    "ROLLOUT_GUARD_VALUE",
    "ROLLOUT_PHASE",
    "ROLLOUT_PHASES",
    "ROLLOUT_WEIGHT",
    "SCORE_BUCKETS",
    "SCORE_DIFF_BUCKETS",
    "SHADOW_SCORE_DIFF",
    "SIDECAR_REQUESTS_TOTAL",
    "STAGE_DURATION_BUCKETS",
    "STAGE_DURATION_SECONDS",
    "STATE_CONVERGED",
    "SWITCH_PHASE",
    "SWITCH_PHASES",
    "TIERS",
    "TIER_CAPACITY_BYTES",
    "TIER_HITS_TOTAL",
    "TIER_LOOKUPS_TOTAL",
    "TIER_MISS_SECONDS",
    "TIER_READ_BYTES_TOTAL",
    "TORCHSERVE_PREFIX",
    "TUNER_BATCH_SIZE",
    "TUNER_DECISIONS_TOTAL",
    "TUNER_MAX_BATCH_DELAY_SECONDS",
    "TUNER_PHASE",
    "TUNER_PHASES",
    "TUNER_REASONS",
    "UPSTREAM_UP",
    "WORKERS",
    "strip_total",
]

# --- names (the family name; prometheus_client appends _total/_bucket/... to samples) ---
REQUESTS_TOTAL = "dlrm_requests_total"
INSTANCES_TOTAL = "dlrm_instances_total"
REQUEST_DURATION_SECONDS = "dlrm_request_duration_seconds"
BATCH_INSTANCES = "dlrm_batch_instances"
BATCH_REQUESTS = "dlrm_batch_requests"
# Seconds of model work done (each batch's handler time, decode to response, counted once per
# batch, not once per request): the HPA's primary signal. Its rate over the pod's available
# capacity is the custom metric CAPACITY_UTILIZATION_RATIO, made by the prometheus-adapter
# rule that serve.ops.monitoring generates (serve.sidecar.control.utilization holds the math).
CAPACITY_WORK_SECONDS_TOTAL = "dlrm_capacity_work_seconds_total"
CAPACITY_UTILIZATION_RATIO = "dlrm_capacity_utilization_ratio"
# CPU seconds the workers spent inside Runtime.predict (the model's own work), beside
# the workers' whole CPU: the rest is serving (protocol, decode, answers, metrics).
PREDICT_CPU_SECONDS_TOTAL = "dlrm_predict_cpu_seconds_total"
CACHE_HITS_TOTAL = "dlrm_cache_hits_total"
CACHE_MISSES_TOTAL = "dlrm_cache_misses_total"
CACHE_EVICTIONS_TOTAL = "dlrm_cache_evictions_total"
CACHE_HIT_RATIO = "dlrm_cache_hit_ratio"
CACHE_DEVICE_BYTES = "dlrm_cache_device_bytes"
CACHE_HOST_BYTES = "dlrm_cache_host_bytes"
# The table tiers (issue 53): label tier in TIERS. "device": the device cache (or the
# cache on CPU when asked); "host": the bounded host-memory tier over the table files on
# local disk. A host-tier miss is a disk read. Per worker, summed over live workers.
TIER_LOOKUPS_TOTAL = "dlrm_tier_lookups_total"          # ids looked up at the tier
TIER_HITS_TOTAL = "dlrm_tier_hits_total"                # ... found resident there
TIER_MISS_SECONDS = "dlrm_tier_miss_seconds"            # histogram: a batch's fetch of its
                                                        # misses from the tier below
TIER_READ_BYTES_TOTAL = "dlrm_tier_read_bytes_total"    # bytes fetched from the tier below
TIER_CAPACITY_BYTES = "dlrm_tier_capacity_bytes"        # gauge (livesum): the tier's budget
TIERS = ("device", "host")
# Reuse distances of the sampled id stream (the capacity advisor): histogram, in rows.
REUSE_DISTANCE_ROWS = "dlrm_reuse_distance_rows"
# ... and the sampled accesses whose row was new to the sampler (cold misses: no distance),
# weighted like the histogram's observations (serve.worker.recording.ReuseRecorder).
REUSE_FIRST_ACCESSES_TOTAL = "dlrm_reuse_first_accesses_total"
# ... and every row access the sampler saw, sampled or not (the advisor's SHARDS-adj
# correction: the weighted sample's shortfall against it is counted at the smallest depth).
REUSE_ACCESSES_TOTAL = "dlrm_reuse_accesses_total"
STAGE_DURATION_SECONDS = "dlrm_stage_duration_seconds"
WORKERS = "dlrm_workers"
SIDECAR_REQUESTS_TOTAL = "dlrm_sidecar_requests_total"
BATCHING_UPDATES_TOTAL = "dlrm_batching_updates_total"
BATCHING_UPDATE_SECONDS = "dlrm_batching_last_update_duration_seconds"
UPSTREAM_UP = "dlrm_upstream_up"
SWITCH_PHASE = "dlrm_switch_phase"
STATE_CONVERGED = "dlrm_state_converged"
RECONCILE_TOTAL = "dlrm_reconcile_total"
# Rollouts (serve/sidecar/control/rollout.py): per-arm series written by the workers, labels
# arm (ARMS) and version (a model version: at most two per pod at a time, so bounded).
ARM_REQUESTS_TOTAL = "dlrm_arm_requests_total"
ARM_ERRORS_TOTAL = "dlrm_arm_errors_total"
ARM_REQUEST_DURATION_SECONDS = "dlrm_arm_request_duration_seconds"
ARM_SCORE = "dlrm_arm_score"
# One observation per forward of an arm: its forward seconds / its instances (what the
# candidate's model controls: no decode, no queue). The rollout's latency guard compares it.
ARM_FORWARD_SECONDS_PER_INSTANCE = "dlrm_arm_forward_seconds_per_instance"
SHADOW_SCORE_DIFF = "dlrm_shadow_score_diff"
# ... and the rollout's own state, written by the sidecar.
TUNER_PHASE = "dlrm_tuner_phase"
TUNER_BATCH_SIZE = "dlrm_tuner_batch_size"
TUNER_MAX_BATCH_DELAY_SECONDS = "dlrm_tuner_max_batch_delay_seconds"
TUNER_DECISIONS_TOTAL = "dlrm_tuner_decisions_total"
#: The batching tuner's phases (serve.phases.TunerPhase) and the reasons of
#: its decisions.
TUNER_PHASES: tuple[str, ...] = tuple(p.value for p in TunerPhase)
TUNER_REASONS = ("seed", "trial", "best", "failed")
ROLLOUT_PHASE = "dlrm_rollout_phase"
ROLLOUT_WEIGHT = "dlrm_rollout_weight"
ROLLOUT_GUARD_VALUE = "dlrm_rollout_guard_value"
ROLLOUT_GUARD_THRESHOLD = "dlrm_rollout_guard_threshold"
# One rollout decision per fleet (serve.sidecar.control.fleet): unlabelled gauges.
FLEET_LEADER = "dlrm_fleet_leader"  # 1: this pod holds the rollout lease
FLEET_PODS = "dlrm_fleet_pods"  # pods the leader knows of, itself included
FLEET_PODS_JUDGED = "dlrm_fleet_pods_judged"  # of them, those whose metrics answered
# Predicted CTR against the version's build-time baseline, and online calibration from
# click feedback (sidecar, serve.sidecar.services.feedback). Gauges labelled {version} (baseline) or
# {version, arm} (online): the versions a pod serves, at most two at a time.
BASELINE_PREDICTED_CTR = "dlrm_baseline_predicted_ctr"
BASELINE_OBSERVED_CTR = "dlrm_baseline_observed_ctr"
BASELINE_CALIBRATION_RATIO = "dlrm_baseline_calibration_ratio"
BASELINE_AUC = "dlrm_baseline_auc"
FEEDBACK_LABELS_TOTAL = "dlrm_feedback_labels_total"
ONLINE_LABELS = "dlrm_online_labels"
ONLINE_OBSERVED_CTR = "dlrm_online_observed_ctr"
ONLINE_PREDICTED_CTR = "dlrm_online_predicted_ctr"
ONLINE_CALIBRATION_RATIO = "dlrm_online_calibration_ratio"
ONLINE_AUC = "dlrm_online_auc"
# The additive sums of the click-quality gates (serve.sidecar.control.quality_gates), per
# {version, arm}: counters of every label joined since the sidecar started (NOT the
# window), so a rollout takes the difference since its start and a fleet sums pods.
ONLINE_ROWS_TOTAL = "dlrm_online_rows_total"
ONLINE_CLICKS_TOTAL = "dlrm_online_clicks_total"
ONLINE_SCORE_TOTAL = "dlrm_online_score_total"
ONLINE_LOGLOSS_NATS_TOTAL = "dlrm_online_logloss_nats_total"
ONLINE_LOGLOSS_SQ_NATS2_TOTAL = "dlrm_online_logloss_sq_nats2_total"
PREDICTION_LOG_BYTES = "dlrm_prediction_log_bytes"
PREDICTION_LOG_RECORDS_TOTAL = "dlrm_prediction_log_records_total"
# GPU resource signals through NVML (sidecar, serve.sidecar.adapters.gpu), labelled {device} only
# (the CUDA device index); absent on machines without an NVIDIA GPU.
GPU_UTILIZATION_RATIO = "dlrm_gpu_utilization_ratio"
GPU_MEMORY_USED_BYTES = "dlrm_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL_BYTES = "dlrm_gpu_memory_total_bytes"
# Embedding deltas (the fresh-embeddings issue): unix time the newest applied delta was
# built, per {version}; ``time() - it`` is the embeddings' staleness.
EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS = "dlrm_embedding_delta_created_timestamp_seconds"
# Ids >= their table's rows (they wrap modulo rows), per feature: label `feature` is one of
# the model's 26 sparse feature names (bounded), never an id.
EMBEDDING_IDS_WRAPPED_TOTAL = "dlrm_embedding_ids_wrapped_total"
# Managed id spaces (serve.runtime.idmap), label `feature` one of the model's sparse
# feature names (bounded). Lookups of a managed feature that read the table's fallback row
# (ids never admitted, evicted, or not admitted yet), per {feature, version} (the model
# version that looked it up, as the per-arm series: a rollout's two maps differ): workers,
# like the wrapped count.
EMBEDDING_IDS_FALLBACK_TOTAL = "dlrm_embedding_ids_fallback_total"
# Ids admitted (assigned a row) / evicted by the deltas this pod accepted, counted once per
# pod by the sidecar when it stores a delta; `feature` is the one its delta file names for
# the table (a table's first feature).
EMBEDDING_IDS_ADMITTED_TOTAL = "dlrm_embedding_ids_admitted_total"
EMBEDDING_IDS_EVICTED_TOTAL = "dlrm_embedding_ids_evicted_total"
# A managed table's ids / capacity (0..1), per served {version} and each {feature} reading
# it: the build's admitted ids plus the applied deltas' assigned minus evicted ones
# (sidecar, from the build report and the stored deltas' headers).
EMBEDDING_ID_MAP_OCCUPANCY_RATIO = "dlrm_embedding_id_map_occupancy_ratio"
# ... and the rest of the delta pipeline's state per served {version} (sidecar,
# serve.sidecar.services.deltas): the last sequence stored, the one every live worker has applied,
# the rows those deltas wrote and the slowest worker's last apply time.
EMBEDDING_DELTA_SEQUENCE = "dlrm_embedding_delta_sequence"
EMBEDDING_DELTA_APPLIED_SEQUENCE = "dlrm_embedding_delta_applied_sequence"
EMBEDDING_DELTA_ROWS_UPDATED = "dlrm_embedding_delta_rows_updated"
EMBEDDING_DELTA_APPLY_SECONDS = "dlrm_embedding_delta_apply_seconds"

#: The two arms of a rollout: ``stable`` answers unless routed to ``candidate``.
ARMS: tuple[str, ...] = ("stable", "candidate")
#: Phases of a rollout (``serve.phases.RolloutPhase``); ``none`` when no
#: rollout was declared.
ROLLOUT_PHASES: tuple[str, ...] = ("none", *(p.value for p in RolloutPhase))
#: Guards of a rollout judged on click labels (serve.sidecar.control.quality_gates), the
#: last of ROLLOUT_GUARDS.
QUALITY_GUARDS: tuple[str, ...] = ("ne_increase", "calibration_gap")
#: Guards of a rollout, by name (bounded label of the guard gauges).
ROLLOUT_GUARDS: tuple[str, ...] = ("error_ratio", "latency_ratio", "score_psi", *QUALITY_GUARDS)
#: What became of one feedback label (``dlrm_feedback_labels_total{result}``): ``joined``
#: with a logged prediction; ``unknown`` request id never logged here (not sampled, served
#: by another pod, or evicted from the index); ``expired`` logged but its file was rotated
#: away; ``duplicate`` this (request id, index) was already labelled; ``bad_index`` the
#: request had fewer instances than the index.
FEEDBACK_RESULTS: tuple[str, ...] = ("joined", "unknown", "expired", "duplicate", "bad_index")

#: Phases of the sidecar's version switch (``serve.phases.SwitchPhase``), in order;
#: ``failed`` stays until the next switch starts. A fixed set: the gauge's labels are bounded.
SWITCH_PHASES: tuple[str, ...] = tuple(p.value for p in SwitchPhase)

#: Outcomes of one reconcile pass of the sidecar (``serve.sidecar.control.reconciler``), a fixed set:
#: ``converged`` nothing to do; ``applied`` a switch or clean-up step succeeded; ``waiting``
#: not converged and nothing to do yet (workers loading, retry back-off, no desired state);
#: ``failed`` a step failed (rolled back); ``refused`` a switch would not fit the memory
#: limit; ``invalid`` the desired-state file does not parse; ``unavailable`` TorchServe did
#: not answer.
RECONCILE_RESULTS: tuple[str, ...] = tuple(r.value for r in ReconcileResult)

# Latency goal is tens of ms at p99 on CPU and ~1 ms on GPU: buckets from 0.5 ms to 1 s,
# dense where the goals are so that a p99 interpolated from them is meaningful. Between
# 10 ms and the latency goal (a ranking request's handler time) they are 5-10 ms apart:
# with 10/25/50 alone, linear interpolation put the tuner's handler p99 at 23.7 ms where
# clients saw 21.8 ms end to end (1 user, ranking), a 44% overestimate of the whole p99.
REQUEST_DURATION_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.06, 0.075, 0.1, 0.25, 0.5, 1.0,
)
# One stage of one forward: cache lookups on GPU take tens of microseconds, a CPU dense
# forward at batch 512 ~13 ms; sub-millisecond buckets resolve the former.
STAGE_DURATION_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 1.0,
)
# Forward seconds per instance of one arm's forward: from ~50 ns (a GPU forward of
# thousands of instances) to 100 ms (one instance on a loaded CPU). Ten buckets per decade
# (the E10-like series 1, 1.25, 1.6, 2, 2.5, 3.2, 4, 5, 6.4, 8: ratio ~1.26 between
# neighbours), so the rollout's latency guard (serve.sidecar.control.guards) resolves a
# 1.3x ratio; fixed: changing them changes that guard's values.
ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m}e{e}") for e in range(-8, -1)
    for m in ("1", "1.25", "1.6", "2", "2.5", "3.2", "4", "5", "6.4", "8")
    if 5e-8 <= float(f"{m}e{e}") <= 0.1) + (0.1,)
# LRU stack depth of a sampled row access, in table rows (serve.common.reuse): from 1 row
# to 1e9 rows (DLRM-v2's 204M rows fit), ten buckets per decade (ratio ~1.26), so the
# capacity advisor's curve, interpolated between bounds, resolves a cache size within ~26%.
REUSE_DISTANCE_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m}e{e}") for e in range(9)
    for m in ("1", "1.25", "1.6", "2", "2.5", "3.2", "4", "5", "6.4", "8")) + (1e9,)
# Predicted click probabilities: CTRs sit mostly below 0.5, so the buckets are dense at the
# low end. These are also the FIXED bins of the rollout's score-shift guard (population
# stability index): changing them changes the guard's values.
SCORE_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
    0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0,
)
# Candidate minus stable score on the same instance (shadow mode): symmetric, dense near 0.
SCORE_DIFF_BUCKETS: tuple[float, ...] = (
    -0.5, -0.2, -0.1, -0.05, -0.02, -0.01, -0.005, -0.001, 0.0, 0.001, 0.005, 0.01, 0.02,
    0.05, 0.1, 0.2, 0.5, 1.0,
)
# Instances per merged forward: requests carry up to thousands of instances.
BATCH_INSTANCES_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(17))  # 1..65536
# Requests per forward = TorchServe's batch; exact small counts show the batch_size in
# effect (le="2" holds every batch of a batch_size=2 model).
BATCH_REQUESTS_BUCKETS: tuple[float, ...] = (
    1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096,
)

#: Prefix given to TorchServe metric names that lack it (its metrics.yaml names such as
#: ``Requests2XX``), so that every re-exposed TorchServe series sits under ``ts_``.
TORCHSERVE_PREFIX = "ts_"

# Embedding-delta files on the model volume the sidecar did not take, by {reason}
# (too_large: over --max-delta-bytes, never read; invalid: failed a check; unreadable;
# store_full: over --max-delta-store-bytes; parent_mismatch: built on another delta than
# the one the pod holds; unsigned / bad_signature: with --delta-verify-key, no or a wrong
# signature): each file counted once, however many sync passes see it.
DELTA_FILES_SKIPPED_TOTAL = "dlrm_delta_files_skipped_total"
DELTA_SKIP_REASONS = ("too_large", "invalid", "unreadable", "store_full", "parent_mismatch",
                      "unsigned", "bad_signature")

# POST /embeddings/deltas refused by the delta service, by {reason}: base_version (not
# served here), sequence (a gap or other bytes under a stored one), parent_mismatch (built
# on another delta than the pod's head), volume_only (--deltas-post refuse: publish on the
# model volume), unsigned / bad_signature (400 with --delta-verify-key), invalid (400),
# too_large (413), store_full (507), other.
DELTA_POSTS_REFUSED_TOTAL = "dlrm_delta_posts_refused_total"
DELTA_REFUSAL_REASONS = ("base_version", "sequence", "parent_mismatch", "volume_only",
                         "unsigned", "bad_signature", "invalid", "too_large", "store_full",
                         "other")


def strip_total(name: str) -> str:
    """``name`` without its ``_total`` suffix: the family name of a counter
    (prometheus_client wants counter names without the suffix it adds itself)."""
    return name.removesuffix("_total")
