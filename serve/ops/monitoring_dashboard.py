"""The service's Grafana dashboard, as typed panels: their PromQL (fixed windows, no
Grafana variables, so each runs verbatim in Prometheus), the JSON model and its ConfigMap."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serve.metrics import (
    ARM_SCORE,
    BASELINE_AUC,
    BASELINE_CALIBRATION_RATIO,
    BASELINE_PREDICTED_CTR,
    BATCH_INSTANCES,
    BATCH_REQUESTS,
    CAPACITY_UTILIZATION_RATIO,
    EMBEDDING_DELTA_APPLIED_SEQUENCE,
    EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS,
    EMBEDDING_IDS_WRAPPED_TOTAL,
    FEEDBACK_LABELS_TOTAL,
    GPU_MEMORY_TOTAL_BYTES,
    GPU_MEMORY_USED_BYTES,
    GPU_UTILIZATION_RATIO,
    ONLINE_AUC,
    ONLINE_CALIBRATION_RATIO,
    REQUEST_DURATION_SECONDS,
    REQUESTS_TOTAL,
    ROLLOUT_PHASE,
    ROLLOUT_WEIGHT,
    TIER_CAPACITY_BYTES,
    TIER_MISS_SECONDS,
    TIER_READ_BYTES_TOTAL,
    TORCHSERVE_PREFIX,
    UPSTREAM_UP,
    WORKERS,
)
from serve.ops.monitoring_rules import (
    CACHE_HIT_RECORD,
    CALIBRATION_RECORD,
    ERROR_RATIO_RECORD,
    INSTANCES_RECORD,
    MEAN_SCORE_RECORD,
    P99_RECORD,
    P99_SLO_SECONDS,
    QPS_RECORD,
    TIER_HIT_RECORD,
    UTILIZATION_RECORD,
)

__all__ = [
    "DASHBOARD_UID",
    "Panel",
    "dashboard",
    "dashboard_configmap",
    "dashboard_queries",
    "dashboard_text",
    "panels",
]

DASHBOARD_UID = "dlrm-serve"


@dataclass(frozen=True)
class Panel:
    """One timeseries panel: ``targets`` are (PromQL, legend format) pairs; ``unit`` is a
    Grafana unit id (``reqps``, ``s``, ``percentunit``, ``short``)."""

    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError(f"panel {self.title!r} has no targets")
        for expr, _ in self.targets:
            if "$" in expr:
                raise ValueError(f"panel {self.title!r}: {expr!r} uses a Grafana variable; "
                                 "use fixed windows so it runs verbatim in Prometheus")


# --------------------------------------------------------------------------- dashboard


def panels() -> tuple[Panel, ...]:
    """The dashboard's panels, in grid order (two per row)."""
    return _traffic_panels() + _resource_panels() + _tier_panels() + _model_panels()


def _traffic_panels() -> tuple[Panel, ...]:
    """Traffic and latency: request and instance rates, latency, errors, batching."""
    req = REQUESTS_TOTAL
    bi, br = BATCH_INSTANCES, BATCH_REQUESTS
    dur = f"{REQUEST_DURATION_SECONDS}_bucket"
    return (
        Panel("QPS", "reqps", (
            (f"sum({QPS_RECORD})", "all pods"),
            (f"sum by (pod) ({QPS_RECORD})", "{{pod}}")),
            f"Prediction requests per second: {QPS_RECORD}, the prometheus-adapter's "
            "dlrm_requests_per_second, the HPA's backstop metric (all status codes)."),
        Panel("Capacity utilization", "percentunit", (
            (f"avg({UTILIZATION_RECORD})", "mean of pods"),
            (f"{UTILIZATION_RECORD}", "{{pod}}"),
            ("vector(0.8)", "HPA target")),
            f"{UTILIZATION_RECORD}: the prometheus-adapter's "
            f"{CAPACITY_UTILIZATION_RATIO}, what the HPA scales on: handler work-seconds "
            "per second over READY workers x the busy fraction at the knee (1.0 = the pod "
            "at its knee, for any traffic mix; docs/autoscaling.md)."),
        Panel("Instances/s", "short", (
            (f"sum({INSTANCES_RECORD})", "all pods"),
            (f"sum by (pod) ({INSTANCES_RECORD})", "{{pod}}")),
            "Instances (samples scored) per second."),
        Panel("Latency p50 / p99", "s", (
            (f"histogram_quantile(0.5, sum by (le) (rate({dur}[1m])))", "p50"),
            (f"histogram_quantile(0.99, sum by (le) (rate({dur}[1m])))", "p99"),
            (f"max({P99_RECORD})", "p99 of the slowest pod"),
            (f"vector({P99_SLO_SECONDS})", "p99 goal")),
            "Handler time per request (decode to response; TorchServe's queueing is not "
            "in it), all pods, 1 minute windows."),
        Panel("Errors (non-2xx) by code", "reqps", (
            (f'sum by (code) (rate({req}{{code!~"2.."}}[1m]))', "{{code}}"),),
            "Requests the handler answered with a non-2xx status, per second. 4xx: bad "
            "requests (the client's); 5xx: ours."),
        Panel("Error ratio (non-2xx share)", "percentunit", (
            (f"max by (pod) ({ERROR_RATIO_RECORD})", "{{pod}}"),),
            f"{ERROR_RATIO_RECORD}: share of requests answered with a non-2xx status."),
        Panel("Batch size", "short", (
            (f"sum(rate({bi}_sum[1m])) / sum(rate({bi}_count[1m]))",
             "instances per forward (mean)"),
            (f"histogram_quantile(0.9, sum by (le) (rate({bi}_bucket[1m])))",
             "instances per forward (p90)"),
            (f"sum(rate({br}_sum[1m])) / sum(rate({br}_count[1m]))",
             "requests per forward (mean)")),
            "What TorchServe's batching forms: instances and requests per merged forward."),
    )


def _resource_panels() -> tuple[Panel, ...]:
    """Resources: the cache, replicas, CPU and GPU."""
    cpu = f"{TORCHSERVE_PREFIX}CPUUtilization"
    return (
        Panel("Cache hit ratio", "percentunit", (
            (f"max by (pod) ({CACHE_HIT_RECORD})", "{{pod}}"),),
            f"{CACHE_HIT_RECORD}: embedding rows found in the device cache / rows looked "
            "up, over 5 minutes."),
        Panel("Replicas", "short", (
            (f'count({UPSTREAM_UP}{{target="management"}})', "pods scraped"),
            (f'count(sum by (namespace, pod) ({WORKERS}{{status="READY"}}) > 0)',
             "pods with a READY worker")),
            f"Pods whose sidecar is scraped (each exposes {UPSTREAM_UP}{{target="
            "\"management\"} once) and pods with at least one READY TorchServe worker."),
        Panel("CPU", "percent", (
            (f"max by (pod) ({cpu})", "{{pod}}"),),
            f"TorchServe's CPUUtilization, re-exported by the sidecar as {cpu}: psutil's "
            "CPU percent as TorchServe's container sees it (the node's CPUs, not the "
            "pod's cgroup), sampled once a minute. The sidecar exports no "
            "process_cpu_seconds_total; per-container CPU is cAdvisor's "
            "container_cpu_usage_seconds_total (another scrape job)."),
        Panel("GPU", "percentunit", (
            (f"max by (pod, device) ({GPU_UTILIZATION_RATIO})", "{{pod}} gpu{{device}} busy"),
            (f"max by (pod, device) ({GPU_MEMORY_USED_BYTES} / {GPU_MEMORY_TOTAL_BYTES})",
             "{{pod}} gpu{{device}} memory")),
            "NVML utilisation and memory used / total per device (no data on CPU pods)."),
    )


def _tier_panels() -> tuple[Panel, ...]:
    """The table tiers (device cache -> host memory -> table files on disk): hit ratio,
    miss latency, disk reads, capacity."""
    miss = f"{TIER_MISS_SECONDS}_bucket"
    return (
        Panel("Tier hit ratio", "percentunit", (
            (f"max by (pod, tier) ({TIER_HIT_RECORD})", "{{pod}} {{tier}}"),),
            f"{TIER_HIT_RECORD}: ids found in each table tier / ids looked up there, over "
            "5 minutes. device: the device cache; host: the host-memory tier over the "
            "table files (its misses are disk reads). make cache-advice predicts it for "
            "other capacities."),
        Panel("Tier miss latency p99", "s", (
            (f"histogram_quantile(0.99, sum by (pod, tier, le) (rate({miss}[5m])))",
             "{{pod}} {{tier}}"),),
            f"p99 of a batch's fetch of its misses from the tier below ({TIER_MISS_SECONDS}),"
            " over 5 minutes: host is the disk reads' time."),
        Panel("Tier bytes read", "Bps", (
            (f"sum by (pod, tier) (rate({TIER_READ_BYTES_TOTAL}[1m]))", "{{pod}} {{tier}}"),),
            "Bytes each tier fetched from the tier below per second: host is the disk read "
            "rate of the table files."),
        Panel("Tier capacity", "bytes", (
            (f"max by (pod, tier) ({TIER_CAPACITY_BYTES})", "{{pod}} {{tier}}"),),
            "Each tier's budget, summed over the pod's live workers."),
    )


def _model_panels() -> tuple[Panel, ...]:
    """The model's behaviour: predicted CTR, calibration, AUC, feedback, deltas, rollout."""
    return (
        Panel("Predicted CTR by arm", "percentunit", (
            (f"max by (version, arm) ({MEAN_SCORE_RECORD})", "{{arm}} {{version}} mean"),
            (f"max by (version) ({BASELINE_PREDICTED_CTR})", "{{version}} baseline")),
            f"Mean predicted click probability of all predictions ({ARM_SCORE} histogram, "
            "15 minutes, pooled over pods) per version and arm, beside each version's "
            "build-time baseline."),
        Panel("Calibration", "short", (
            (f"max by (version, arm) ({CALIBRATION_RECORD})", "{{arm}} {{version}} pooled"),
            (f"{ONLINE_CALIBRATION_RATIO}", "{{pod}} {{arm}} {{version}}"),
            (f"max by (version) ({BASELINE_CALIBRATION_RATIO})", "{{version}} baseline")),
            "Mean predicted / observed CTR of the labelled predictions in the feedback "
            "window (1 = calibrated)."),
        Panel("AUC", "short", (
            (f"{ONLINE_AUC}", "{{pod}} {{arm}} {{version}} online"),
            (f"max by (version) ({BASELINE_AUC})", "{{version}} baseline")),
            "ROC AUC of the labelled predictions in each pod's feedback window, beside the "
            "version's held-out AUC."),
        Panel("Feedback labels", "short", (
            (f"sum by (result) (rate({FEEDBACK_LABELS_TOTAL}[1m]))", "{{result}}"),),
            "Click labels posted to /feedback per second, by what became of them (joined "
            "with a logged prediction, unknown, expired, duplicate, bad_index)."),
        Panel("Embedding freshness", "s", (
            (f"time() - max by (version) ({EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS})",
             "{{version}} newest delta age"),
            (f"min by (version) ({EMBEDDING_DELTA_APPLIED_SEQUENCE})",
             "{{version}} delta sequence (all pods)")),
            "Age of the newest embedding delta every worker of a version applied (the "
            "DlrmEmbeddingDeltasStale alert fires past 6 h), and the lowest delta sequence "
            "applied over the pods (right axis): a pod behind the others shows here.",
            {"overrides": [{"matcher": {"id": "byRegexp", "options": ".*sequence.*"},
                            "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                           {"id": "unit", "value": "short"}]}]}),
        Panel("Ids beyond their table", "short", (
            (f"sum by (feature) (rate({EMBEDDING_IDS_WRAPPED_TOTAL}[5m]))", "{{feature}}"),),
            "Sparse ids per second that were >= their table's rows and wrapped modulo rows, "
            "per feature: new ids outgrowing a table (grow it in the next build)."),
        Panel("Rollout", "percentunit", (
            (f"max by (pod) ({ROLLOUT_WEIGHT})", "{{pod}} candidate weight"),
            (f"count by (phase) ({ROLLOUT_PHASE} == 1)", "pods {{phase}}")),
            "The candidate's share of requests (canary) or scored requests (shadow), and "
            "how many pods are in each rollout phase (right axis).",
            {"overrides": [{"matcher": {"id": "byRegexp", "options": "pods .*"},
                            "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                           {"id": "unit", "value": "short"}]}]}),
    )


_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel_json(p: Panel, panel_id: int) -> dict[str, Any]:
    refs = [chr(ord("A") + i) for i in range(len(p.targets))]
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": p.title,
        "description": p.description,
        "datasource": dict(_DATASOURCE),
        "gridPos": {"h": 8, "w": 12, "x": 12 * ((panel_id - 1) % 2),
                    "y": 8 * ((panel_id - 1) // 2)},
        "fieldConfig": {
            "defaults": {"unit": p.unit, "custom": {"drawStyle": "line", "lineWidth": 1,
                                                    "fillOpacity": 0, "showPoints": "never",
                                                    "spanNulls": False}},
            "overrides": list(p.extra.get("overrides", [])),
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom",
                               "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": ref, "datasource": dict(_DATASOURCE), "editorMode": "code",
                     "expr": expr, "legendFormat": legend, "range": True}
                    for ref, (expr, legend) in zip(refs, p.targets, strict=True)],
    }


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard (JSON model, schemaVersion 39)."""
    return {
        "annotations": {"list": []},
        "description": "DLRM serving: traffic, latency, errors, batching, cache, "
                       "resources, model quality and rollouts. Generated by "
                       "python -m serve.ops.monitoring --write.",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": [_panel_json(p, i) for i, p in enumerate(panels(), start=1)],
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["dlrm", "serving"],
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0, "includeAll": False,
            "multi": False, "options": [], "refresh": 1, "regex": "",
        }]},
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "DLRM serving",
        "uid": DASHBOARD_UID,
        "version": 1,
    }


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel of ``dashboard`` (a Grafana
    JSON model, rows' nested panels included), in order."""
    out: list[tuple[str, str]] = []

    def visit(items: list[dict[str, Any]]) -> None:
        for p in items:
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append((str(p.get("title", "")), str(t["expr"])))
            visit(p.get("panels", []))

    visit(dashboard.get("panels", []))
    return out


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def dashboard_configmap() -> dict[str, Any]:
    """The ConfigMap Grafana's dashboard sidecar loads (label ``grafana_dashboard``)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "dlrm-serve-dashboard", "labels": {
            "app.kubernetes.io/name": "dlrm-serve",
            "app.kubernetes.io/part-of": "dlrm-serve",
            "grafana_dashboard": "1"}},
        "data": {"dashboard.json": dashboard_text()},
    }
