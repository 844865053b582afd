"""Every Prometheus metric of the service: names, help, buckets and how they aggregate.

This is the ONE module that defines metric names. Names follow the Prometheus
conventions: ``dlrm_`` namespace, base units in the suffix (``_seconds``, ``_bytes``),
``_total`` on counters, ratios in 0..1, and only bounded labels (an HTTP status code,
a pipeline stage, a worker status; never a user, item or request id).

Two sides use it:

* **TorchServe workers** (one OS process per worker) record with :class:`HandlerMetrics`.
  Workers are separate processes, so prometheus_client runs in *multiprocess mode*:
  whoever starts TorchServe sets ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory
  (an ``emptyDir`` volume in Kubernetes) and every worker writes its values to mmap
  files there. The variable must be set before ``prometheus_client`` is first imported
  in the worker, which holds because workers inherit TorchServe's environment.
* **The sidecar** reads that directory with :class:`HandlerAggregateCollector` (a
  ``MultiProcessCollector`` plus the derived hit ratio), adds its own metrics
  (:class:`SidecarMetrics`), the worker count (:func:`workers_family`) and TorchServe's
  own metrics scraped from its metrics port (:func:`torchserve_families`).

Decisions, with why:

* The cache statistics a runtime reports (``RuntimeStats``) are cumulative per worker.
  :meth:`HandlerMetrics.set_cache` turns them into counter increments by delta, so the
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
  lists (they died or their version was unregistered); see
  :class:`HandlerAggregateCollector`.
* The sidecar's own metrics are kept in plain Python and exposed by a custom collector,
  not by prometheus_client ``Counter`` objects: if ``PROMETHEUS_MULTIPROC_DIR`` is set in
  the sidecar's environment too, such objects would write mmap files into the workers'
  directory and every sidecar series would appear twice.

Example (in a worker)::

    metrics = HandlerMetrics()
    metrics.observe_request(code=200, instances=512, seconds=0.012)
    metrics.observe_batch(instances=2048, requests=4)
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
from collections import Counter as _Tally
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from serve.constants import STAGES
from serve.sidecar.control.phases import ReconcileResult, RolloutPhase, SwitchPhase, TunerPhase

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
    "QUALITY_GUARDS",
    "RECONCILE_RESULTS",
    "RECONCILE_TOTAL",
    "REQUESTS_TOTAL",
    "REQUEST_DURATION_BUCKETS",
    "REQUEST_DURATION_SECONDS",
    "ROLLOUT_GUARDS",
    "ROLLOUT_GUARD_THRESHOLD",
    "ROLLOUT_GUARD_VALUE",
    "ROLLOUT_PHASE",
    "ROLLOUT_PHASES",
    "ROLLOUT_WEIGHT",
    "SCORE_BUCKETS",
    "SCORE_DIFF_BUCKETS",
    "SHADOW_SCORE_DIFF",
    "STAGES",
    "STAGE_DURATION_BUCKETS",
    "STAGE_DURATION_SECONDS",
    "STATE_CONVERGED",
    "SWITCH_PHASE",
    "SWITCH_PHASES",
    "TORCHSERVE_PREFIX",
    "TUNER_BATCH_SIZE",
    "TUNER_DECISIONS_TOTAL",
    "TUNER_MAX_BATCH_DELAY_SECONDS",
    "TUNER_PHASE",
    "TUNER_PHASES",
    "TUNER_REASONS",
    "WORKERS",
    "CacheStats",
    "CleanupReport",
    "EmbeddingDeltaGauges",
    "HandlerAggregateCollector",
    "HandlerMetrics",
    "IdMapGauge",
    "SidecarMetrics",
    "cache_hit_ratio_family",
    "clean_dead_worker_files",
    "delta_files_skipped_family",
    "embedding_delta_families",
    "embedding_id_families",
    "feature_counts",
    "torchserve_families",
    "workers_family",
]

_log = logging.getLogger(__name__)

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
CACHE_HITS_TOTAL = "dlrm_cache_hits_total"
CACHE_MISSES_TOTAL = "dlrm_cache_misses_total"
CACHE_EVICTIONS_TOTAL = "dlrm_cache_evictions_total"
CACHE_HIT_RATIO = "dlrm_cache_hit_ratio"
CACHE_DEVICE_BYTES = "dlrm_cache_device_bytes"
CACHE_HOST_BYTES = "dlrm_cache_host_bytes"
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
#: The batching tuner's phases (serve.sidecar.control.phases.TunerPhase) and the reasons of
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
# serve.sidecar.services.embedding_deltas): the last sequence stored, the one every live worker has applied,
# the rows those deltas wrote and the slowest worker's last apply time.
EMBEDDING_DELTA_SEQUENCE = "dlrm_embedding_delta_sequence"
EMBEDDING_DELTA_APPLIED_SEQUENCE = "dlrm_embedding_delta_applied_sequence"
EMBEDDING_DELTA_ROWS_UPDATED = "dlrm_embedding_delta_rows_updated"
EMBEDDING_DELTA_APPLY_SECONDS = "dlrm_embedding_delta_apply_seconds"

#: The two arms of a rollout: ``stable`` answers unless routed to ``candidate``.
ARMS: tuple[str, ...] = ("stable", "candidate")
#: Phases of a rollout (``serve.sidecar.control.phases.RolloutPhase``); ``none`` when no
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

#: Phases of the sidecar's version switch (``serve.sidecar.control.phases.SwitchPhase``), in order;
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


class CacheStats(Protocol):
    """The part of ``serve.runtime.engine.RuntimeStats`` read here (cumulative since load)."""

    hits: int
    misses: int
    evictions: int
    device_bytes: int
    host_bytes: int


def _strip_total(name: str) -> str:
    # prometheus_client wants counter names without the _total suffix it adds itself.
    return name.removesuffix("_total")


class HandlerMetrics:
    """What a TorchServe worker records; safe to call from the handler's thread.

    Args:
        registry: where the metric objects register. In multiprocess mode the values go
            to the mmap files in ``PROMETHEUS_MULTIPROC_DIR`` whatever the registry, so
            the default (None) is a private registry: it keeps a second instance in the
            same process (tests, a reloaded handler) from failing on duplicate names.
            Pass a fresh ``CollectorRegistry`` to read values in a single process.

    Do not use it in the sidecar: the sidecar reads the workers' files instead.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            _strip_total(REQUESTS_TOTAL),
            "Prediction requests answered by the handler, by HTTP status code.",
            ["code"], registry=r)
        self._instances = Counter(
            _strip_total(INSTANCES_TOTAL),
            "Instances (samples) received in prediction requests of any status.",
            registry=r)
        self._duration = Histogram(
            REQUEST_DURATION_SECONDS,
            "Handler time per prediction request, decode to response, in seconds.",
            buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self._batch_instances = Histogram(
            BATCH_INSTANCES,
            "Instances per merged forward pass (all requests of one TorchServe batch).",
            buckets=BATCH_INSTANCES_BUCKETS, registry=r)
        self._work = Counter(
            _strip_total(CAPACITY_WORK_SECONDS_TOTAL),
            "Seconds of model work done: each batch's handler time (decode to response), "
            "once per batch. rate() of it over the pod's capacity is the HPA's "
            "dlrm_capacity_utilization_ratio.", registry=r)
        self._batch_requests = Histogram(
            BATCH_REQUESTS,
            "Requests per forward pass: the TorchServe batch size actually formed.",
            buckets=BATCH_REQUESTS_BUCKETS, registry=r)
        self._logged = Counter(
            _strip_total(PREDICTION_LOG_RECORDS_TOTAL),
            "Requests written to the prediction log (sampled) for joining click feedback.",
            registry=r)
        self._hits = Counter(_strip_total(CACHE_HITS_TOTAL),
                             "Embedding rows found in the device cache.", registry=r)
        self._misses = Counter(_strip_total(CACHE_MISSES_TOTAL),
                               "Embedding rows fetched from host memory.", registry=r)
        self._evictions = Counter(_strip_total(CACHE_EVICTIONS_TOTAL),
                                  "Embedding rows evicted from the device cache.", registry=r)
        # livesum: the pod's total over live workers (the sidecar reaps dead ones).
        self._device_bytes = Gauge(CACHE_DEVICE_BYTES,
                                   "Embedding bytes held on the compute device.",
                                   registry=r, multiprocess_mode="livesum")
        self._host_bytes = Gauge(CACHE_HOST_BYTES,
                                 "Embedding bytes held in host memory.",
                                 registry=r, multiprocess_mode="livesum")
        self._wrapped = Counter(
            _strip_total(EMBEDDING_IDS_WRAPPED_TOTAL),
            "Sparse ids >= their table's rows, wrapped modulo rows, per feature: new ids "
            "outgrowing a table.", ["feature"], registry=r)
        self._fallback = Counter(
            _strip_total(EMBEDDING_IDS_FALLBACK_TOTAL),
            "Lookups of a managed feature whose id has no row of its own (never admitted, "
            "evicted, not admitted yet) and read the table's fallback row, per feature and "
            "model version.", ["feature", "version"], registry=r)
        self._stage = Histogram(
            STAGE_DURATION_SECONDS,
            "Time per pipeline stage of one forward pass, in seconds.",
            ["stage"], buckets=STAGE_DURATION_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        self._dropped_stages: set[str] = set()
        self._init_arms(r)

    def _init_arms(self, r: CollectorRegistry) -> None:
        """The per-arm series of rollouts (serve.store.routing): one per (arm, version);
        without a rollout the handler records everything as arm="stable" of its version."""
        arm_labels = ["arm", "version"]
        self._arm_requests = Counter(
            _strip_total(ARM_REQUESTS_TOTAL),
            "Requests scored by each arm of a rollout (shadow candidate: scored, not "
            "answered); requests whose body was refused belong to no arm.",
            arm_labels, registry=r)
        self._arm_errors = Counter(
            _strip_total(ARM_ERRORS_TOTAL),
            "Requests of an arm whose forward raised (any exception of that model).",
            arm_labels, registry=r)
        self._arm_duration = Histogram(
            ARM_REQUEST_DURATION_SECONDS,
            "Seconds per request of an arm: the batch's decode time plus that arm's "
            "forward time.",
            arm_labels, buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self._arm_forward = Histogram(
            ARM_FORWARD_SECONDS_PER_INSTANCE,
            "Forward seconds per instance of an arm: one observation per forward that "
            "succeeded (its forward time / its instances; decode and queue excluded).",
            arm_labels, buckets=ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS, registry=r)
        self._arm_score = Histogram(
            ARM_SCORE,
            "Predicted click probabilities of each arm, one observation per instance.",
            arm_labels, buckets=SCORE_BUCKETS, registry=r)
        self._shadow_diff = Histogram(
            SHADOW_SCORE_DIFF,
            "Shadow mode: candidate minus stable predicted probability on the same "
            "instance, one observation per instance.",
            ["version"], buckets=SCORE_DIFF_BUCKETS, registry=r)

    def observe_request(self, code: int, instances: int, seconds: float) -> None:
        """One answered request: its HTTP ``code``, ``instances`` in it (0 when the body
        did not parse) and the handler's time for it in ``seconds``."""
        self.observe_requests(code, 1, instances, seconds)

    def observe_requests(self, code: int, requests: int, instances: int,
                         seconds: float) -> None:
        """``requests`` answered requests of one batch with the same HTTP ``code``,
        ``instances`` in all, each taking ``seconds`` of handler time: the same series as
        that many :meth:`observe_request` calls, with one write per series (a batch of
        32 single-instance requests made 96 locked mmap writes)."""
        code = int(code)
        if not 100 <= code <= 599:
            raise ValueError(f"HTTP code {code} is outside 100..599; pass the status sent")
        if requests < 1:
            raise ValueError(f"requests={requests} must be >= 1")
        if instances < 0 or seconds < 0:
            raise ValueError(f"instances={instances} and seconds={seconds} must be >= 0")
        self._requests.labels(code=str(code)).inc(requests)
        if instances:
            self._instances.inc(instances)
        observe_many(self._duration, np.full(requests, float(seconds)))

    def observe_work(self, seconds: float) -> None:
        """One batch's handler time in ``seconds`` (the work it cost the worker, whatever
        its requests' sizes or statuses): :data:`CAPACITY_WORK_SECONDS_TOTAL`."""
        if not seconds >= 0:
            raise ValueError(f"work seconds={seconds} must be >= 0; pass the batch's "
                             "measured handler time")
        self._work.inc(float(seconds))

    def observe_batch(self, instances: int, requests: int) -> None:
        """One merged forward pass over ``instances`` samples from ``requests`` requests."""
        if instances < 0 or requests < 1:
            raise ValueError(
                f"instances={instances} must be >= 0 and requests={requests} >= 1")
        self._batch_instances.observe(instances)
        self._batch_requests.observe(requests)

    def observe_stages(self, seconds: Mapping[str, float]) -> None:
        """Per-forward stage times (deltas, seconds) keyed by ``"decode"``, ``"embedding"``,
        ``"dense"``. Other keys are dropped (logged once) to keep labels bounded: a metrics
        call must never fail a prediction."""
        for stage, value in seconds.items():
            if stage not in STAGES:
                if stage not in self._dropped_stages:
                    self._dropped_stages.add(stage)
                    _log.warning("stage %r is not one of %s; not recorded", stage, STAGES)
                continue
            self._stage.labels(stage=stage).observe(max(0.0, float(value)))

    def set_cache(self, stats: CacheStats) -> None:
        """Record the runtime's cumulative cache statistics after a forward pass.

        Counters move by the delta since the previous call; a value lower than the last
        one means the runtime was rebuilt, and counts from zero again (as Prometheus
        treats a counter reset).
        """
        with self._lock:
            for key, counter in (("hits", self._hits), ("misses", self._misses),
                                 ("evictions", self._evictions)):
                self._advance(counter, key, int(getattr(stats, key)))
            self._device_bytes.set(int(stats.device_bytes))
            self._host_bytes.set(int(stats.host_bytes))

    def skip_cache(self, stats: CacheStats, features: list[str],
                   wrapped: tuple[int, ...]) -> None:
        """Take the runtime's cumulative counts as the starting point without counting
        them (the worker's warm-up forwards before it serves): the next :meth:`set_cache`
        and :meth:`set_wrapped` count only what came after (:meth:`set_fallback` with
        ``count=False`` does the same for the fallback counts)."""
        with self._lock:
            for key in ("hits", "misses", "evictions"):
                self._last[key] = int(getattr(stats, key))
            for name, value in zip(features, wrapped, strict=True):
                self._last[f"wrapped:{name}"] = int(value)

    def set_wrapped(self, features: list[str], wrapped: tuple[int, ...]) -> None:
        """Record a runtime's cumulative wrapped-id counts (``RuntimeStats.wrapped``, one
        per feature in ``features`` order) as counter increments, like :meth:`set_cache`."""
        with self._lock:
            for name, value in zip(features, wrapped, strict=True):
                self._advance(self._wrapped.labels(feature=name), f"wrapped:{name}", int(value))

    def set_fallback(self, version: str, features: list[str], fallback: tuple[int, ...],
                     managed: frozenset[str] | None = None, *, count: bool = True) -> None:
        """Record the cumulative fallback-row lookups of ``version``'s runtime
        (``RuntimeStats.fallback``, one per feature in ``features`` order) as counter
        increments, like :meth:`set_wrapped`. ``managed``: the features whose series
        exist (those of managed tables; None: every feature); a modulo feature never reads
        a fallback row, so it gets no series of zeros. ``count=False``: take the counts as
        the starting point without counting them (warm-up), creating the series at 0."""
        with self._lock:
            for name, value in zip(features, fallback, strict=True):
                if managed is not None and name not in managed:
                    continue
                child = self._fallback.labels(feature=name, version=version)
                key = f"fallback:{version}:{name}"
                if count:
                    self._advance(child, key, int(value))
                else:
                    self._last[key] = int(value)

    def _advance(self, counter: Counter, key: str, value: int) -> None:
        """Move ``counter`` by ``value``'s increase since the last value seen under ``key``
        (a lower value: the runtime was rebuilt and counts from zero again). Under _lock."""
        last = self._last.get(key, 0)
        self._last[key] = value
        delta = value - last if value >= last else value
        if delta:
            counter.inc(delta)

    def observe_logged(self, requests: int) -> None:
        """``requests`` more requests written to the prediction log (serve.store.predlog)."""
        if requests < 0:
            raise ValueError(f"requests={requests} must be >= 0")
        self._logged.inc(requests)

    def observe_arm(self, arm: str, version: str, requests: int, errors: int,
                    seconds_per_request: float, scores: np.ndarray | None = None, *,
                    forward_seconds_per_instance: float | None = None) -> None:
        """One arm's forward in a batch.

        Args:
            arm: ``stable`` or ``candidate`` (:data:`ARMS`).
            version: the model version of that arm (label ``version``).
            requests: requests the arm scored (answered, or shadow-scored).
            errors: how many of them failed (all of them when its forward raised).
            seconds_per_request: the batch's decode time + the arm's forward time, in
                seconds; observed once per request in ``dlrm_arm_request_duration_seconds``.
            scores: (n,) the predicted probabilities of the arm's instances, one
                ``dlrm_arm_score`` observation each (None or empty: none).
            forward_seconds_per_instance: the arm's forward seconds / its instances,
                observed once in ``dlrm_arm_forward_seconds_per_instance`` (None: not
                observed; pass None for a forward that failed).
        Raises:
            ValueError: an arm outside ARMS, an empty version, counts below 0 or errors
                above requests, a negative or non-finite duration.

        Both counters get their series even when they do not move, so that an error
        ratio reads 0/n, not "no data".
        """
        _check_arm(arm, version)
        if requests < 0 or not 0 <= errors <= requests:
            raise ValueError(f"requests={requests} must be >= 0 and errors={errors} in "
                             "0..requests")
        for what, secs in (("seconds_per_request", seconds_per_request),
                           ("forward_seconds_per_instance", forward_seconds_per_instance)):
            if secs is not None and (not math.isfinite(secs) or secs < 0):
                raise ValueError(f"{what}={secs} must be finite and >= 0")
        self._arm_requests.labels(arm=arm, version=version).inc(requests)
        self._arm_errors.labels(arm=arm, version=version).inc(errors)
        if requests:
            observe_many(self._arm_duration.labels(arm=arm, version=version),
                         np.full(requests, float(seconds_per_request)))
        if forward_seconds_per_instance is not None:
            self._arm_forward.labels(arm=arm, version=version).observe(
                float(forward_seconds_per_instance))
        if scores is not None and np.size(scores):
            observe_many(self._arm_score.labels(arm=arm, version=version), scores)

    def observe_shadow_diff(self, version: str, diffs: np.ndarray) -> None:
        """Shadow mode: ``diffs`` (n,) = candidate minus stable score per instance, for
        the candidate ``version``; one ``dlrm_shadow_score_diff`` observation each."""
        _check_arm("candidate", version)
        if np.size(diffs):
            observe_many(self._shadow_diff.labels(version=version), diffs)


def _check_arm(arm: str, version: str) -> None:
    if arm not in ARMS:
        raise ValueError(f"arm {arm!r} is not one of {ARMS}")
    if not isinstance(version, str) or not version:
        raise ValueError(f"version {version!r} must be a non-empty model version")


def observe_many(histogram: Histogram, values: np.ndarray) -> int:
    """Add each of ``values`` as one observation of ``histogram``, exactly as a loop of
    ``histogram.observe(v)`` would, with one write per non-empty bucket instead of one
    per value.

    Why: a batch holds up to thousands of instances, and in multiprocess mode every
    ``observe`` takes a lock and writes the mmap file. prometheus_client has no bulk
    call, so this uses the internals ``Histogram.observe`` itself uses: the child's
    ``_upper_bounds`` (the buckets, +Inf last), ``_buckets`` (one value per bucket,
    counts NOT cumulative) and ``_sum``, plus ``_raise_if_not_observable``. Checked
    against prometheus_client 0.26.0 (the version in .venv);
    ``tests/test_metrics.py`` compares the exposition with a loop of ``observe()``, so an
    upgrade that changes them fails there.

    Binning: ``np.searchsorted(bounds, v, side="left")`` is the first bucket whose bound
    is >= v: prometheus' ``le`` (v <= bound). NaN values are skipped: ``observe`` would
    count them in no bucket and turn the sum into NaN for good.

    Args:
        histogram: a Histogram without labels, or a labelled child (``h.labels(...)``).
        values: any shape (flattened), any real dtype.
    Returns:
        The number of observations added.
    Raises:
        TypeError: ``histogram`` is not a prometheus_client Histogram (or its internals
            changed).
        ValueError: ``histogram`` is a labelled parent (call ``.labels(...)`` first).
    """
    if not hasattr(histogram, "_upper_bounds") or not hasattr(histogram,
                                                              "_raise_if_not_observable"):
        raise TypeError(f"observe_many needs a prometheus_client Histogram (child), got "
                        f"{type(histogram).__name__}")
    histogram._raise_if_not_observable()
    buckets, total = getattr(histogram, "_buckets", None), getattr(histogram, "_sum", None)
    if buckets is None or total is None or len(buckets) != len(histogram._upper_bounds):
        raise TypeError("observe_many: this prometheus_client's Histogram internals differ "
                        "from 0.26.0 (_buckets/_sum); update observe_many")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[~np.isnan(v)]
    if not v.size:
        return 0
    bounds = np.asarray(histogram._upper_bounds, dtype=np.float64)
    counts = np.bincount(np.searchsorted(bounds, v, side="left"), minlength=bounds.size)
    for i in np.flatnonzero(counts):
        buckets[i].inc(int(counts[i]))
    total.inc(float(v.sum()))
    return int(v.size)


def _family_total(families: Iterable[Metric], name: str) -> float | None:
    family = _strip_total(name)
    for metric in families:
        if metric.name == family:
            return sum(s.value for s in metric.samples if s.name == name)
    return None


def feature_counts(families: Iterable[Metric], name: str) -> dict[str, dict[str, int]]:
    """The samples of counter ``name`` (e.g. :data:`EMBEDDING_IDS_FALLBACK_TOTAL`) in
    ``families`` summed by their ``version`` and ``feature`` labels (the workers' files,
    summed over processes: :meth:`HandlerAggregateCollector.collect`):
    ``{version: {feature: count}}``."""
    family = _strip_total(name)
    out: dict[str, dict[str, int]] = {}
    for metric in families:
        if metric.name != family:
            continue
        for s in metric.samples:
            feature, version = s.labels.get("feature"), s.labels.get("version")
            if s.name == name and feature is not None and version is not None:
                per = out.setdefault(version, {})
                per[feature] = per.get(feature, 0) + int(s.value)
    return out


def cache_hit_ratio_family(families: Iterable[Metric]) -> GaugeMetricFamily:
    """``dlrm_cache_hit_ratio`` = hits / (hits + misses) summed over ``families``
    (NaN before any lookup: 0/0 is unknown, not 0)."""
    families = list(families)
    hits = _family_total(families, CACHE_HITS_TOTAL) or 0.0
    misses = _family_total(families, CACHE_MISSES_TOTAL) or 0.0
    ratio = hits / (hits + misses) if hits + misses > 0 else math.nan
    return GaugeMetricFamily(
        CACHE_HIT_RATIO,
        "Embedding cache hits / lookups over the lifetime of all workers (0..1); "
        "computed by the sidecar from the summed counters.",
        value=ratio)


class HandlerAggregateCollector(Collector):
    """The workers' metrics summed over processes, plus ``dlrm_cache_hit_ratio``.

    Args:
        multiproc_dir: the workers' ``PROMETHEUS_MULTIPROC_DIR``. A missing directory
            yields no worker metrics (logged once) rather than failing the scrape.

    :meth:`reap` removes the live-gauge files of workers that have gone, given the pids
    TorchServe lists now. A pid is reaped only once it was seen alive and then vanished:
    a just-started worker may write before TorchServe lists it, and deleting its file
    would lose its gauges for good. Pids from TorchServe (not ``os.kill``) keep this
    right when the sidecar runs in another container with its own pid namespace.
    """

    def __init__(self, multiproc_dir: str | os.PathLike[str]) -> None:
        self.path = Path(multiproc_dir)
        self._seen: set[int] = set()
        self._warned = False
        self._lock = threading.Lock()

    def reap(self, live_pids: Iterable[int]) -> list[int]:
        """Forget workers TorchServe no longer lists; returns the pids reaped."""
        live = set(live_pids)
        with self._lock:
            gone = sorted(self._seen - live)
            self._seen = (self._seen & live) | live
        if self.path.is_dir():
            for pid in gone:
                mark_process_dead(pid, str(self.path))
        return gone

    def forget(self, pids: Iterable[int]) -> None:
        """Drop the live gauges of workers known to be gone (an unregistered version's),
        whether or not a scrape ever saw them."""
        pids = set(pids)
        with self._lock:
            self._seen -= pids
        if self.path.is_dir():
            for pid in pids:
                mark_process_dead(pid, str(self.path))

    def collect(self) -> Iterator[Metric]:
        if not self.path.is_dir():
            if not self._warned:
                self._warned = True
                _log.warning("multiprocess dir %s does not exist; no handler metrics",
                             self.path)
            families: list[Metric] = []
        else:
            families = list(MultiProcessCollector(None, path=str(self.path)).collect())
        yield from families
        yield cache_hit_ratio_family(families)


def workers_family(statuses: Iterable[str]) -> GaugeMetricFamily:
    """``dlrm_workers{status}``: TorchServe workers of all versions of the model, by
    status (``READY``, ``WORKER_STARTED``, ...); a READY series is always present."""
    tally = _Tally(str(s) for s in statuses)
    tally.setdefault("READY", 0)
    family = GaugeMetricFamily(
        WORKERS, "TorchServe workers of the model (all versions), by status.",
        labels=["status"])
    for status, count in sorted(tally.items()):
        family.add_metric([status], count)
    return family


_VALID_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def torchserve_families(text: str, prefix: str = TORCHSERVE_PREFIX) -> list[Metric]:
    """TorchServe's Prometheus text (its metrics port) as families to re-expose.

    Names lacking ``prefix`` get it, so nothing collides with ``dlrm_`` names.
    Raises ``ValueError`` when ``text`` is not Prometheus exposition.
    """
    out: list[Metric] = []
    for family in text_string_to_metric_families(text):
        name = family.name if family.name.startswith(prefix) else prefix + family.name
        if not _VALID_NAME.fullmatch(name):
            continue
        renamed = Metric(name, family.documentation, family.type, family.unit)
        for s in family.samples:
            renamed.add_sample(name + s.name[len(family.name):], s.labels, s.value,
                               s.timestamp, s.exemplar)
        out.append(renamed)
    return out


@dataclass(frozen=True)
class EmbeddingDeltaGauges:
    """One served version's embedding-delta state at a scrape (``serve.sidecar.services.embedding_deltas``).

    ``None`` leaves that version's series out of the family: no live worker reports
    (``applied_sequence``, ``rows_updated``, ``apply_seconds``) or no delta applied by
    every live worker yet (``created_at``), rather than a made-up 0.
    """

    version: str
    last_sequence: int
    applied_sequence: int | None = None
    rows_updated: int | None = None
    apply_seconds: float | None = None
    created_at: float | None = None


def embedding_delta_families(gauges: Iterable[EmbeddingDeltaGauges]) -> list[Metric]:
    """The embedding-delta gauges, labelled ``{version}`` (served versions only: bounded).

    * ``dlrm_embedding_delta_sequence``: the last delta sequence the pod stored.
    * ``dlrm_embedding_delta_applied_sequence``: the last one every live worker serving the
      version has applied (their minimum); below the stored one while workers catch up.
    * ``dlrm_embedding_delta_rows_updated``: embedding rows written by the deltas applied
      (the slowest worker's count).
    * ``dlrm_embedding_delta_apply_seconds``: the slowest live worker's last apply time.
    * ``dlrm_embedding_delta_created_timestamp_seconds``: unix time the newest delta
      applied by every live worker was built; ``time() - it`` is the staleness the
      ``DlrmEmbeddingDeltasStale`` alert watches.
    """
    rows = list(gauges)
    specs: list[tuple[str, str, str]] = [
        (EMBEDDING_DELTA_SEQUENCE, "last_sequence",
         "Last embedding delta sequence number the pod stored for the version."),
        (EMBEDDING_DELTA_APPLIED_SEQUENCE, "applied_sequence",
         "Last embedding delta sequence every live worker serving the version applied."),
        (EMBEDDING_DELTA_ROWS_UPDATED, "rows_updated",
         "Embedding rows written by the deltas every live worker applied (slowest worker)."),
        (EMBEDDING_DELTA_APPLY_SECONDS, "apply_seconds",
         "Seconds the slowest live worker's last delta apply took (batch wait excluded)."),
        (EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS, "created_at",
         "Unix time the newest delta applied by every live worker was built."),
    ]
    out: list[Metric] = []
    for name, attr, doc in specs:
        family = GaugeMetricFamily(name, doc, labels=["version"])
        for g in rows:
            value = getattr(g, attr)
            if value is not None:
                family.add_metric([g.version], float(value))
        out.append(family)
    return out


@dataclass(frozen=True)
class IdMapGauge:
    """One managed feature's id-map occupancy in one served version (0..1)."""

    version: str
    feature: str
    occupancy: float


def embedding_id_families(admitted: Mapping[str, int], evicted: Mapping[str, int],
                          occupancy: Iterable[IdMapGauge]) -> list[Metric]:
    """The sidecar's managed-id families (``serve.sidecar.services.embedding_deltas``).

    * ``dlrm_embedding_ids_admitted_total{feature}`` / ``..._evicted_total{feature}``:
      ids the deltas this pod stored assigned a row / evicted (each delta counted once,
      when stored). A feature appears once a delta named it (0 until then is not made
      up: no series).
    * ``dlrm_embedding_id_map_occupancy_ratio{version,feature}``: admitted ids / capacity
      of each managed feature's table in each served version (``version`` is one of the
      served versions: bounded, like the delta gauges).
    """
    out: list[Metric] = []
    for name, doc, counts in (
            (EMBEDDING_IDS_ADMITTED_TOTAL, ("Ids of managed tables admitted (assigned a row) "
             "by the embedding deltas this pod stored, per feature."), admitted),
            (EMBEDDING_IDS_EVICTED_TOTAL, ("Ids of managed tables evicted (back to the "
             "fallback row) by the embedding deltas this pod stored, per feature."), evicted)):
        family = CounterMetricFamily(name, doc, labels=["feature"])
        for feature in sorted(counts):
            family.add_metric([feature], float(counts[feature]))
        out.append(family)
    gauge = GaugeMetricFamily(
        EMBEDDING_ID_MAP_OCCUPANCY_RATIO,
        "Admitted ids / capacity (rows - 1) of a managed feature's id map in a served "
        "version: the build's ids plus the applied deltas' admissions minus evictions.",
        labels=["version", "feature"])
    for g in occupancy:
        gauge.add_metric([g.version, g.feature], float(g.occupancy))
    out.append(gauge)
    return out


# Embedding-delta files on the model volume the sidecar did not take, by {reason}
# (too_large: over --max-delta-bytes, never read; invalid: failed a check; unreadable;
# store_full: over --max-delta-store-bytes; parent_mismatch: built on another delta than
# the one the pod holds): each file counted once, however many sync passes see it.
DELTA_FILES_SKIPPED_TOTAL = "dlrm_delta_files_skipped_total"
DELTA_SKIP_REASONS = ("too_large", "invalid", "unreadable", "store_full", "parent_mismatch")


def delta_files_skipped_family(counts: Mapping[str, int]) -> Metric:
    """``dlrm_delta_files_skipped_total{reason}``: every reason of
    :data:`DELTA_SKIP_REASONS`, 0 when none (bounded labels; others are dropped)."""
    family = CounterMetricFamily(
        DELTA_FILES_SKIPPED_TOTAL,
        "Embedding-delta files on the model volume not taken, by reason (each file once).",
        labels=["reason"])
    for reason in DELTA_SKIP_REASONS:
        family.add_metric([reason], float(counts.get(reason, 0)))
    return family


class SidecarMetrics(Collector):
    """The sidecar's own metrics, kept in plain Python (see the module docstring).

    * ``dlrm_sidecar_requests_total{route,method,code}``: routes are the app's route
      templates (bounded), never raw paths.
    * ``dlrm_batching_updates_total{result}``: PUT /batching outcomes
      (``applied``, ``unchanged``, ``conflict``, ``failed``).
    * ``dlrm_batching_last_update_duration_seconds``: how long the last applied update
      took (register + ready + switch + unregister).
    * ``dlrm_upstream_up{target}``: 1 when the last call to TorchServe's ``management``
      or ``metrics`` API succeeded, else 0.
    * ``dlrm_switch_phase{phase}``: 1 for the version switch's current phase (one of
      :data:`SWITCH_PHASES`), 0 for the others.
    * ``dlrm_state_converged``: 1 when the last reconcile pass found TorchServe serving
      exactly the desired state, 0 when not, NaN without a desired-state file (the
      reconciler is off). Alert on it staying 0, not on a 0 during a switch.
    * ``dlrm_reconcile_total{result}``: reconcile passes by outcome (one of
      :data:`RECONCILE_RESULTS`).
    * ``dlrm_rollout_phase{phase}``: 1 for the current or last rollout's phase (one of
      :data:`ROLLOUT_PHASES`); ``dlrm_rollout_weight``: the candidate's share;
      ``dlrm_rollout_guard_value{guard}`` / ``dlrm_rollout_guard_threshold{guard}``.
    * ``dlrm_tuner_phase{phase}``: 1 for the batching tuner's phase (one of
      :data:`TUNER_PHASES`); ``dlrm_tuner_batch_size`` and
      ``dlrm_tuner_max_batch_delay_seconds``: the batching it asks for (NaN: none, the
      declared batching serves); ``dlrm_tuner_decisions_total{reason}``: settings it
      applied, by reason (:data:`TUNER_REASONS`).
    """

    UPDATE_RESULTS = ("applied", "unchanged", "conflict", "failed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str], int] = {}
        self._updates = {r: 0 for r in self.UPDATE_RESULTS}
        self._last_update_s = math.nan
        self._up: dict[str, float] = {"management": 0.0, "metrics": 0.0}
        self._phase = "idle"
        self._converged = math.nan
        self._reconciles = {r: 0 for r in RECONCILE_RESULTS}
        self._rollout_phase = "none"
        self._rollout_weight = 0.0
        self._guards: dict[str, tuple[float, float]] = {}
        self._tuner_phase = "off"
        self._tuner_setting: tuple[float, float] = (math.nan, math.nan)
        self._tuner_decisions = {r: 0 for r in TUNER_REASONS}

    def observe_request(self, route: str, method: str, code: int) -> None:
        key = (route, method, str(code))
        with self._lock:
            self._requests[key] = self._requests.get(key, 0) + 1

    def observe_update(self, result: str, seconds: float | None = None) -> None:
        if result not in self._updates:
            raise ValueError(f"update result {result!r} is not one of {self.UPDATE_RESULTS}")
        with self._lock:
            self._updates[result] += 1
            if seconds is not None:
                self._last_update_s = seconds

    def set_up(self, target: str, up: bool) -> None:
        if target not in self._up:
            raise ValueError(f"upstream target {target!r} is not one of {sorted(self._up)}")
        with self._lock:
            self._up[target] = 1.0 if up else 0.0

    def set_switch_phase(self, phase: str) -> None:
        if phase not in SWITCH_PHASES:
            raise ValueError(f"switch phase {phase!r} is not one of {SWITCH_PHASES}")
        with self._lock:
            self._phase = phase

    def set_converged(self, converged: bool | None) -> None:
        """Mirror the last reconcile pass: True, False, or None when there is no
        desired state to converge to."""
        with self._lock:
            self._converged = math.nan if converged is None else float(bool(converged))

    def observe_reconcile(self, result: str) -> None:
        if result not in self._reconciles:
            raise ValueError(f"reconcile result {result!r} is not one of {RECONCILE_RESULTS}")
        with self._lock:
            self._reconciles[result] += 1

    def set_rollout(self, phase: str, weight: float,
                    guards: Iterable[tuple[str, float | None, float]]) -> None:
        """Mirror the rollout: its ``phase`` (one of :data:`ROLLOUT_PHASES`), the
        candidate's ``weight`` and each guard's (name, value or None, threshold)."""
        if phase not in ROLLOUT_PHASES:
            raise ValueError(f"rollout phase {phase!r} is not one of {ROLLOUT_PHASES}")
        table = {}
        for name, value, threshold in guards:
            if name not in ROLLOUT_GUARDS:
                raise ValueError(f"guard {name!r} is not one of {ROLLOUT_GUARDS}")
            table[name] = (math.nan if value is None else float(value), float(threshold))
        with self._lock:
            self._rollout_phase, self._rollout_weight, self._guards = phase, weight, table

    def set_tuner(self, phase: str, setting: Any | None) -> None:
        """Mirror the batching tuner: its ``phase`` and the setting it asks for (an object
        with ``batch_size`` and ``max_batch_delay_ms``; None: none)."""
        if phase not in TUNER_PHASES:
            raise ValueError(f"tuner phase {phase!r} is not one of {TUNER_PHASES}")
        value = ((float(setting.batch_size), setting.max_batch_delay_ms / 1000.0)
                 if setting is not None else (math.nan, math.nan))
        with self._lock:
            self._tuner_phase, self._tuner_setting = phase, value

    def observe_tuner_decision(self, reason: str) -> None:
        if reason not in self._tuner_decisions:
            raise ValueError(f"tuner reason {reason!r} is not one of {TUNER_REASONS}")
        with self._lock:
            self._tuner_decisions[reason] += 1

    def _collect_tuner(self) -> Iterator[Metric]:
        with self._lock:
            phase, (batch, delay) = self._tuner_phase, self._tuner_setting
            decisions = dict(self._tuner_decisions)
        gauge = GaugeMetricFamily(TUNER_PHASE, "1 for the batching tuner's current phase.",
                                  labels=["phase"])
        for name in TUNER_PHASES:
            gauge.add_metric([name], 1.0 if name == phase else 0.0)
        yield gauge
        yield GaugeMetricFamily(TUNER_BATCH_SIZE, "Batch size the tuner asks for (NaN: "
                                "none; the declared batching serves).", value=batch)
        yield GaugeMetricFamily(TUNER_MAX_BATCH_DELAY_SECONDS, "Max batch delay the tuner "
                                "asks for, in seconds (NaN: none).", value=delay)
        fam = CounterMetricFamily(TUNER_DECISIONS_TOTAL, "Batching settings the tuner "
                                  "applied, by reason.", labels=["reason"])
        for reason, n in decisions.items():
            fam.add_metric([reason], n)
        yield fam

    def collect(self) -> Iterator[Metric]:
        yield from self._collect_rollout()
        yield from self._collect_tuner()
        with self._lock:
            converged = self._converged
            reconciles = dict(self._reconciles)
            requests = dict(self._requests)
            updates = dict(self._updates)
            last = self._last_update_s
            up = dict(self._up)
            phase = self._phase
        fam = CounterMetricFamily(SIDECAR_REQUESTS_TOTAL, "HTTP requests to the sidecar.",
                                  labels=["route", "method", "code"])
        for (route, method, code), n in sorted(requests.items()):
            fam.add_metric([route, method, code], n)
        yield fam
        fam = CounterMetricFamily(BATCHING_UPDATES_TOTAL, "PUT /batching outcomes.",
                                  labels=["result"])
        for result, n in updates.items():
            fam.add_metric([result], n)
        yield fam
        yield GaugeMetricFamily(BATCHING_UPDATE_SECONDS,
                                "Seconds the last applied batching update took.",
                                value=last)
        gauge = GaugeMetricFamily(UPSTREAM_UP,
                                  "1 if the last call to this TorchServe API succeeded.",
                                  labels=["target"])
        for target, value in sorted(up.items()):
            gauge.add_metric([target], value)
        yield gauge
        gauge = GaugeMetricFamily(SWITCH_PHASE,
                                  "1 for the current phase of the sidecar's version switch.",
                                  labels=["phase"])
        for name in SWITCH_PHASES:
            gauge.add_metric([name], 1.0 if name == phase else 0.0)
        yield gauge
        yield GaugeMetricFamily(STATE_CONVERGED,
                                "1 if TorchServe serves exactly the desired state (last "
                                "reconcile pass), 0 if not, NaN without a desired state.",
                                value=converged)
        fam = CounterMetricFamily(RECONCILE_TOTAL, "Reconcile passes of the sidecar, by outcome.",
                                  labels=["result"])
        for result, n in reconciles.items():
            fam.add_metric([result], n)
        yield fam

    def _collect_rollout(self) -> Iterator[Metric]:
        with self._lock:
            phase, weight, guards = self._rollout_phase, self._rollout_weight, dict(self._guards)
        gauge = GaugeMetricFamily(ROLLOUT_PHASE, "1 for the phase of the current or last "
                                  "rollout (none: no rollout declared).", labels=["phase"])
        for name in ROLLOUT_PHASES:
            gauge.add_metric([name], 1.0 if name == phase else 0.0)
        yield gauge
        yield GaugeMetricFamily(ROLLOUT_WEIGHT, "Share of requests the rollout's candidate "
                                "answers (canary) or scores (shadow), 0..1.", value=weight)
        value = GaugeMetricFamily(ROLLOUT_GUARD_VALUE, "Each rollout guard's value at its last "
                                  "evaluation (NaN: not enough data yet).", labels=["guard"])
        limit = GaugeMetricFamily(ROLLOUT_GUARD_THRESHOLD, "Each rollout guard's threshold "
                                  "(breached when the value is above it).", labels=["guard"])
        for name in ROLLOUT_GUARDS:
            v, t = guards.get(name, (math.nan, math.nan))
            value.add_metric([name], v)
            limit.add_metric([name], t)
        yield value
        yield limit


# --------------------------------------------------------------- dead workers' metric files

class CleanupReport:
    """What :func:`clean_dead_worker_files` did in one multiprocess directory.

    Attributes:
        dead_pids: pids named by files whose process no longer exists.
        gauges_removed: live-gauge files removed (``mark_process_dead``).
        merged: counter/histogram/summary files folded into ``<type>_merged.db`` and
            removed.
        files_before: ``*.db`` files before the clean-up.
        files_after: ``*.db`` files after it.
    """

    __slots__ = ("dead_pids", "files_after", "files_before", "gauges_removed", "merged")

    def __init__(self, dead_pids: tuple[int, ...] = (), gauges_removed: tuple[str, ...] = (),
                 merged: tuple[str, ...] = (), files_before: int = 0,
                 files_after: int = 0) -> None:
        self.dead_pids = dead_pids
        self.gauges_removed = gauges_removed
        self.merged = merged
        self.files_before = files_before
        self.files_after = files_after

    def __repr__(self) -> str:
        return (f"CleanupReport(dead_pids={self.dead_pids}, gauges_removed="
                f"{self.gauges_removed}, merged={self.merged}, files_before="
                f"{self.files_before}, files_after={self.files_after})")

    def describe(self) -> str:
        """One log line: ``2 dead workers (pids 41, 57): 2 live-gauge files removed, 4
        counter/histogram files merged; 12 -> 8 files``."""
        if not self.dead_pids:
            return f"no dead workers' files; {self.files_after} files"
        return (f"{len(self.dead_pids)} dead workers (pids "
                f"{', '.join(map(str, self.dead_pids))}): {len(self.gauges_removed)} "
                f"live-gauge files removed, {len(self.merged)} counter/histogram files "
                f"merged; {self.files_before} -> {self.files_after} files")


#: Types whose values of dead workers stay in the sums: folded into ``<type>_merged.db``.
_CUMULATIVE_TYPES = ("counter", "histogram", "summary")
_LOCK_NAME = ".dlrm-cleanup.lock"  # not *.db: the collector never reads it


class _IsAlive(Protocol):
    def __call__(self, pid: int, /) -> bool: ...


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists in this pid namespace (``os.kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _file_pid(name: str) -> int | None:
    """The pid in a prometheus_client file name (``counter_123.db``,
    ``gauge_livesum_123.db``); None for other names (``counter_merged.db``)."""
    last = name.removesuffix(".db").rsplit("_", 1)[-1]
    return int(last) if last.isascii() and last.isdigit() and int(last) > 0 else None



def _files_by_pid(files: list[Path]) -> dict[int, list[Path]]:
    """The files named after a pid (:func:`_file_pid`), by pid, in ``files`` order."""
    by_pid: dict[int, list[Path]] = {}
    for f in files:
        pid = _file_pid(f.name)
        if pid is not None:
            by_pid.setdefault(pid, []).append(f)
    return by_pid


def _remove_live_gauges(folder: Path, dead: tuple[int, ...],
                        by_pid: dict[int, list[Path]]) -> list[str]:
    """``mark_process_dead`` each dead pid; return the names of its live-gauge files."""
    gauges: list[str] = []
    for pid in dead:
        gauges += [f.name for f in by_pid[pid] if f.name.startswith("gauge_live")]
        with contextlib.suppress(FileNotFoundError):  # the sidecar's reap removed it meanwhile
            mark_process_dead(pid, str(folder))
    return gauges


def _merge_files(folder: Path, typ: str, sources: list[Path]) -> None:
    """Add the values of ``sources`` (files of type ``typ``) into ``<typ>_merged.db``
    (created if missing) through a temporary file renamed over it, then remove them."""
    from prometheus_client.mmap_dict import MmapedDict

    target = folder / f"{typ}_merged.db"
    totals: dict[str, float] = {}
    for f in ([target] if target.exists() else []) + sources:
        for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(f)):
            totals[key] = totals.get(key, 0.0) + value
    tmp = folder / f".{typ}_merged.tmp"  # not *.db: invisible to the collector
    tmp.unlink(missing_ok=True)
    out = MmapedDict(str(tmp))
    try:
        for key, value in totals.items():
            out.write_value(key, value, 0.0)
    finally:
        out.close()
    os.replace(tmp, target)
    for f in sources:
        f.unlink(missing_ok=True)


def clean_dead_worker_files(path: str | os.PathLike[str], *,
                            is_alive: _IsAlive = _pid_alive,
                            own_pid: int | None = None) -> CleanupReport:
    """Clean the prometheus_client multiprocess directory of workers that have died.

    A TorchServe worker runs this at start, before its :class:`HandlerMetrics` exist.
    Every worker that ever ran leaves files named after its pid (``counter_<pid>.db``,
    ``histogram_<pid>.db``, ``gauge_livesum_<pid>.db``); workers restart on every version
    switch and on every crash, and the pod's directory is a 64 MiB tmpfs, so without a
    clean-up the files pile up until writes fail.

    For every pid in a file name that is not alive (``os.kill(pid, 0)`` raises
    ProcessLookupError):

    * **live gauges**: ``mark_process_dead(pid, path)`` removes them; a ``livesum`` gauge
      is the sum over live workers, so a dead worker's value must go.
    * **counters, histograms, summaries**: their values are added into one accumulated
      file per type, ``<type>_merged.db``, and the worker's files are removed. Removing
      them without merging would make every summed counter (``dlrm_requests_total``, a
      histogram's ``_count``) go backwards, which Prometheus reads as a counter reset of
      the whole pod (a false ``rate()`` spike, and the HPA's request rate with it).
      Keeping them would keep the totals but grow without bound. Merged, the sums
      exposed are unchanged (up to float rounding of ``_sum`` values) and the directory
      holds the live workers' files plus at most one merged file per type.
    * files of other gauge modes (``all``, ``max``, ``min``, ``sum``, ``mostrecent``) are
      left alone: their dead workers' values are part of what those modes mean.
      :class:`HandlerMetrics` writes none.

    Trade-offs: the merged file is written to a temporary name and renamed over the old
    one (atomic), then the merged workers' files are removed; a scrape between those two
    steps (microseconds) counts those workers twice once, and a crash between them would
    keep them counted twice (a one-time rise, never a fall). Workers starting together
    serialize on a lock file in the directory (``flock``), so no file is merged twice.
    Liveness is checked in this process's pid namespace, which holds for the workers of
    one TorchServe container; a dead worker's pid reused by a live process keeps its
    files until that process is gone too (a new worker on a reused pid continues the
    old counts, as prometheus_client reads existing files). The sidecar's own reaping
    (:meth:`HandlerAggregateCollector.reap`) also removes live gauges and does not
    conflict. Files are read and written with prometheus_client's ``MmapedDict`` (the
    format its collector reads; checked against 0.26.0 by ``tests/test_metrics.py``).

    Args:
        path: the multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``). A missing
            directory has nothing to clean.
        is_alive: pid -> whether that process exists (tests inject one).
        own_pid: this process's pid, never treated as dead (default ``os.getpid()``).
    Returns:
        What was removed and merged (:class:`CleanupReport`; ``describe()`` for a log
        line).
    """
    import fcntl

    folder = Path(path)
    if not folder.is_dir():
        return CleanupReport()
    me = os.getpid() if own_pid is None else own_pid
    with open(folder / _LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        files = sorted(folder.glob("*.db"))
        by_pid = _files_by_pid(files)
        dead = tuple(sorted(pid for pid in by_pid if pid != me and not is_alive(pid)))
        gauges = _remove_live_gauges(folder, dead, by_pid)
        merged: list[str] = []
        for typ in _CUMULATIVE_TYPES:
            sources = [f for pid in dead for f in by_pid[pid] if f.name.startswith(typ + "_")]
            if sources:
                _merge_files(folder, typ, sources)
                merged += [f.name for f in sources]
        after = len(list(folder.glob("*.db")))
    return CleanupReport(dead_pids=dead, gauges_removed=tuple(gauges), merged=tuple(merged),
                         files_before=len(files), files_after=after)


# POST /embeddings/deltas refused by the delta service, by {reason}: base_version (not
# served here), sequence (a gap or other bytes under a stored one), parent_mismatch (built
# on another delta than the pod's head), volume_only (--deltas-post refuse: publish on the
# model volume), invalid (400), too_large (413), store_full (507), other.
DELTA_POSTS_REFUSED_TOTAL = "dlrm_delta_posts_refused_total"
DELTA_REFUSAL_REASONS = ("base_version", "sequence", "parent_mismatch", "volume_only",
                         "invalid", "too_large", "store_full", "other")


def delta_posts_refused_family(counts: Mapping[str, int]) -> Metric:
    """``dlrm_delta_posts_refused_total{reason}``: every reason of
    :data:`DELTA_REFUSAL_REASONS`, 0 when none (others are counted as ``other``)."""
    family = CounterMetricFamily(
        DELTA_POSTS_REFUSED_TOTAL,
        "POST /embeddings/deltas refused (nothing stored), by reason.", labels=["reason"])
    known = {r: float(counts.get(r, 0)) for r in DELTA_REFUSAL_REASONS}
    known["other"] += float(sum(n for r, n in counts.items() if r not in known))
    for reason, value in known.items():
        family.add_metric([reason], value)
    return family


__all__ += ["DELTA_POSTS_REFUSED_TOTAL", "DELTA_REFUSAL_REASONS", "delta_posts_refused_family"]
