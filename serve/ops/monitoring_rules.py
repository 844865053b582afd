"""The service's Prometheus recording and alert rules, as typed data: the records the HPA,
the dashboard and the alerts read, each alert's threshold with why, and the rule files
(plain and as a PrometheusRule) :mod:`serve.ops.monitoring` writes."""
from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from serve.constants import P99_SLO_MS
from serve.metrics import (
    ARM_SCORE,
    BASELINE_CALIBRATION_RATIO,
    BASELINE_PREDICTED_CTR,
    CACHE_HITS_TOTAL,
    CACHE_MISSES_TOTAL,
    CAPACITY_UTILIZATION_RATIO,
    EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS,
    EMBEDDING_IDS_FALLBACK_TOTAL,
    INSTANCES_TOTAL,
    ONLINE_LABELS,
    ONLINE_OBSERVED_CTR,
    ONLINE_PREDICTED_CTR,
    REQUEST_DURATION_SECONDS,
    REQUESTS_TOTAL,
    ROLLOUT_PHASE,
    ROLLOUT_PHASES,
    TIER_HITS_TOTAL,
    TIER_LOOKUPS_TOTAL,
    TORCHSERVE_PREFIX,
    UPSTREAM_UP,
    WORKERS,
)
from serve.ops.monitoring_adapter import adapter_query

__all__ = [
    "ALERT_GROUP",
    "CACHE_HIT_DROP",
    "CACHE_HIT_RECORD",
    "CALIBRATION_MIN_LABELS",
    "CALIBRATION_RANGE",
    "CALIBRATION_RECORD",
    "CTR_SHIFT_MAX",
    "EMBEDDING_STALE_SECONDS",
    "ERROR_RATIO_MAX",
    "ERROR_RATIO_RECORD",
    "FALLBACK_RISE",
    "FALLBACK_SHARE_MAX",
    "INSTANCES_RECORD",
    "LABELS_RECORD",
    "MEAN_SCORE_RECORD",
    "P50_RECORD",
    "P99_RECORD",
    "P99_SLO_SECONDS",
    "QPS_RECORD",
    "RECORDING_GROUP",
    "TIER_HIT_RECORD",
    "UTILIZATION_RECORD",
    "AlertRule",
    "RecordingRule",
    "alert_rules",
    "prometheus_rule",
    "recording_rules",
    "rule_file",
]

RECORDING_GROUP = "dlrm-serve-recording"
ALERT_GROUP = "dlrm-serve-alerts"

# --- recording rule names (level:metric:operations) ---
#: Per-pod request rate: exactly the prometheus-adapter's dlrm_requests_per_second query.
QPS_RECORD = "dlrm:requests_per_second:rate1m"
#: Per-pod utilization of capacity: exactly the adapter's dlrm_capacity_utilization_ratio.
UTILIZATION_RECORD = "dlrm:capacity_utilization:ratio_rate1m"
INSTANCES_RECORD = "dlrm:instances_per_second:rate1m"
P50_RECORD = "dlrm:request_duration_seconds:p50_1m"
P99_RECORD = "dlrm:request_duration_seconds:p99_1m"
CACHE_HIT_RECORD = "dlrm:cache_hit_ratio:rate5m"
#: Per-pod hit ratio of each table tier ({tier}: device, host), over 5 minutes.
TIER_HIT_RECORD = "dlrm:tier_hit_ratio:rate5m"
ERROR_RATIO_RECORD = "dlrm:requests_non2xx:ratio_rate1m"
MEAN_SCORE_RECORD = "dlrm:arm_score:mean_rate15m"
CALIBRATION_RECORD = "dlrm:online_calibration_ratio:pooled"
LABELS_RECORD = "dlrm:online_labels:sum"

# --- alert thresholds, with why ---
#: p99 goal of one request, seconds: the service's goal (serve.constants.P99_SLO_MS), the
#: one loadtest/capacity.json's HPA target was measured against.
P99_SLO_SECONDS = P99_SLO_MS / 1000
#: Share of requests that may fail with a server error before someone is paged.
ERROR_RATIO_MAX = 0.01
#: The cache hit ratio may fall to this fraction of its value an hour earlier.
CACHE_HIT_DROP = 0.8
#: Largest relative gap between an arm's mean predicted CTR and its build-time baseline.
CTR_SHIFT_MAX = 0.2
#: Predicted / observed CTR outside this range is miscalibrated (symmetric: 0.8 = 1/1.25).
CALIBRATION_RANGE: tuple[float, float] = (0.8, 1.25)
#: Labelled predictions (over pods) before calibration is judged: at a CTR of ~3 %, 5000
#: labels hold ~150 clicks, so the observed CTR's relative error is ~8 % and the 0.8
#: bound sits ~2.5 standard errors away.
CALIBRATION_MIN_LABELS = 5000
#: Age of the newest applied embedding delta after which the embeddings count as stale.
EMBEDDING_STALE_SECONDS = 6 * 3600
#: Fallback-row lookups of a managed feature per instance (over 15 minutes) above which
#: its rise is worth a ticket. A managed table always serves its long tail (ids seen
#: fewer times than the admission threshold) from the fallback row, a share set by the
#: threshold and the traffic and steady from hour to hour; below 5 % a doubling is a
#: handful of unknown users, not a broken pipeline.
FALLBACK_SHARE_MAX = 0.05
#: ... and it must be this many times its value an hour earlier: new ids arrive all the
#: time, and while deltas admit them the share stays flat; when they stop reaching
#: serving (the delta builder stopped, its deltas are refused, the table is full and
#: evicts nothing) every new user reads the fallback row and the share climbs by the
#: hour. 2x separates that climb from the tail's noise (a day's traffic shifts it by
#: tens of percent, not 2x in an hour).
FALLBACK_RISE = 2.0

_DURATION = re.compile(r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$")
_RECORD_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*(:[a-zA-Z0-9_]+)+$")
_ALERT_NAME = re.compile(r"^Dlrm[A-Z][A-Za-z0-9]*$")


def _expr(text: str) -> str:
    """A PromQL expression written indented in this module, dedented and stripped."""
    return textwrap.dedent(text).strip()


@dataclass(frozen=True)
class RecordingRule:
    """One recording rule: ``record`` (``level:metric:operations``) is ``expr``."""

    record: str
    expr: str

    def __post_init__(self) -> None:
        if not _RECORD_NAME.fullmatch(self.record):
            raise ValueError(f"recording rule name {self.record!r} must be "
                             "level:metric:operations (colons, [a-zA-Z0-9_])")
        if not self.expr.strip():
            raise ValueError(f"recording rule {self.record} has an empty expr")

    def to_rule(self) -> dict[str, Any]:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True)
class AlertRule:
    """One alert: ``expr`` must hold for ``for_`` before it fires.

    Attributes:
        name: ``Dlrm<CamelCase>``.
        expr: PromQL; each series it returns is one alert (its labels identify it).
        for_: a Prometheus duration (``5m``).
        severity: ``page`` (wake someone: users are hurt now) or ``ticket`` (look
            within the working day).
        summary: one line, Go-templated (``{{ $labels.pod }}``, ``{{ $value }}``).
        description: what it means and what to do.
    """

    name: str
    expr: str
    for_: str
    severity: Literal["page", "ticket"]
    summary: str
    description: str

    def __post_init__(self) -> None:
        if not _ALERT_NAME.fullmatch(self.name):
            raise ValueError(f"alert name {self.name!r} must be Dlrm<CamelCase>")
        if not _DURATION.fullmatch(self.for_):
            raise ValueError(f"alert {self.name}: for={self.for_!r} is not a Prometheus "
                             "duration such as 5m")
        if self.severity not in ("page", "ticket"):
            raise ValueError(f"alert {self.name}: severity {self.severity!r} is not page "
                             "or ticket")
        if not (self.summary.strip() and self.description.strip()):
            raise ValueError(f"alert {self.name} needs a summary and a description")

    def to_rule(self) -> dict[str, Any]:
        return {"alert": self.name, "expr": self.expr, "for": self.for_,
                "labels": {"severity": self.severity},
                "annotations": {"summary": self.summary, "description": self.description}}


# --------------------------------------------------------------------------- rules


def recording_rules(adapter_rules: Path | None = None) -> tuple[RecordingRule, ...]:
    """The recording group, in evaluation order; ``adapter_rules`` as in
    :func:`adapter_query`."""
    pod = "namespace, pod"
    arm = "namespace, version, arm"
    req, dur = REQUESTS_TOTAL, f"{REQUEST_DURATION_SECONDS}_bucket"
    hits, misses = CACHE_HITS_TOTAL, CACHE_MISSES_TOTAL
    return (
        RecordingRule(QPS_RECORD, adapter_query(adapter_rules)),
        RecordingRule(UTILIZATION_RECORD,
                      adapter_query(adapter_rules, CAPACITY_UTILIZATION_RATIO)),
        RecordingRule(INSTANCES_RECORD,
                      f"sum by ({pod}) (rate({INSTANCES_TOTAL}[1m]))"),
        RecordingRule(P50_RECORD,
                      f"histogram_quantile(0.5, sum by ({pod}, le) (rate({dur}[1m])))"),
        RecordingRule(P99_RECORD,
                      f"histogram_quantile(0.99, sum by ({pod}, le) (rate({dur}[1m])))"),
        RecordingRule(CACHE_HIT_RECORD, _expr(f"""
            sum by ({pod}) (rate({hits}[5m]))
            /
            (sum by ({pod}) (rate({hits}[5m])) + sum by ({pod}) (rate({misses}[5m])))
            """)),
        RecordingRule(TIER_HIT_RECORD, _expr(f"""
            sum by ({pod}, tier) (rate({TIER_HITS_TOTAL}[5m]))
            /
            sum by ({pod}, tier) (rate({TIER_LOOKUPS_TOTAL}[5m]))
            """)),
        # "or 0 * ...": a pod without any non-2xx series reads 0, not "no data".
        RecordingRule(ERROR_RATIO_RECORD, _expr(f"""
            (
              sum by ({pod}) (rate({req}{{code!~"2.."}}[1m]))
              or
              0 * sum by ({pod}) (rate({req}[1m]))
            )
            /
            sum by ({pod}) (rate({req}[1m]))
            """)),
        # Mean predicted click probability of ALL of an arm's predictions (the score
        # histogram), pooled over pods; dlrm_online_predicted_ctr covers labelled ones only.
        RecordingRule(MEAN_SCORE_RECORD, _expr(f"""
            sum by ({arm}) (rate({ARM_SCORE}_sum[15m]))
            /
            sum by ({arm}) (rate({ARM_SCORE}_count[15m]))
            """)),
        # Pooled over pods: each pod joins only its own predictions, so weight each pod's
        # means by its labels: sum(pred * n) / sum(obs * n) = predicted / observed clicks.
        RecordingRule(CALIBRATION_RECORD, _expr(f"""
            sum by ({arm}) ({ONLINE_PREDICTED_CTR} * {ONLINE_LABELS})
            /
            sum by ({arm}) ({ONLINE_OBSERVED_CTR} * {ONLINE_LABELS})
            """)),
        RecordingRule(LABELS_RECORD, f"sum by ({arm}) ({ONLINE_LABELS})"),
    )


def alert_rules() -> tuple[AlertRule, ...]:
    """The alert group: serving health (pages first), then the model's behaviour."""
    return (_high_error_ratio(), _p99_over_slo(), _no_ready_workers(),
            _cache_hit_ratio_falling(), _predicted_ctr_shift(), _calibration_off(),
            _rollout_rolled_back(), _embedding_deltas_stale(), _fallback_share_rising())


def _hit_ratio(offset: str = "") -> str:
    """The cache hit ratio per namespace over 30 minutes (``offset`` e.g. " offset 1h")."""
    hits, misses = CACHE_HITS_TOTAL, CACHE_MISSES_TOTAL
    w = f"[30m]{offset}"
    return (f"sum by (namespace) (rate({hits}{w}))\n  /\n"
            f"  (sum by (namespace) (rate({hits}{w})) + "
            f"sum by (namespace) (rate({misses}{w})))")


def _high_error_ratio() -> AlertRule:
    """A page: over ERROR_RATIO_MAX of the requests fail with a 5xx."""
    req = REQUESTS_TOTAL
    return AlertRule(
        "DlrmHighErrorRatio",
        _expr(f"""
        sum by (namespace) (rate({req}{{code=~"5.."}}[5m]))
        /
        sum by (namespace) (rate({req}[5m]))
        > {ERROR_RATIO_MAX}
        """),
        "5m", "page",
        "{{ $value | humanizePercentage }} of DLRM prediction requests in "
        "{{ $labels.namespace }} fail with a 5xx",
        f"More than {ERROR_RATIO_MAX:.0%} of the prediction requests the handler "
        "answered over the last 5 minutes were server errors (5xx), for 5 minutes: "
        "those users got no scores. See which pods and codes (dashboard panel Errors, "
        f"or sum by (pod, code) (rate({req}{{code=~\"5..\"}}[5m]))) and read the "
        "torchserve container's logs there. After a version switch or rollout "
        "(GET /state on a sidecar), go back to the previous model.version in the "
        "serving state. TorchServe's own 503s (queue full) never reach the handler: "
        f"see {TORCHSERVE_PREFIX}Requests5XX_total.")


def _p99_over_slo() -> AlertRule:
    """A page: the handler's p99 over the SLO, all pods together."""
    dur = f"{REQUEST_DURATION_SECONDS}_bucket"
    return AlertRule(
        "DlrmP99OverSlo",
        _expr(f"""
        histogram_quantile(0.99, sum by (namespace, le) (rate({dur}[5m])))
        > {P99_SLO_SECONDS}
        """),
        "10m", "page",
        "DLRM p99 latency in {{ $labels.namespace }} is {{ $value | humanizeDuration }}, "
        f"over the {P99_SLO_SECONDS * 1000:.0f}ms goal",
        "The handler's p99 (decode to response, without TorchServe's queueing) over 5 "
        f"minutes, all pods together, has been above {P99_SLO_SECONDS * 1000:.0f} ms for "
        f"10 minutes. Compare {P99_RECORD} and {UTILIZATION_RECORD} per pod: all pods "
        "slow at a utilization above the HPA target (0.8, k8s/hpa.yaml) means scaling is "
        "not keeping up "
        "(maxReplicas reached, pods Pending, a slow model load); one pod slow means a "
        "bad node or a noisy neighbour: delete that pod. A falling cache hit ratio or a "
        "new version can also raise it.")


def _no_ready_workers() -> AlertRule:
    """A page: a pod without a READY worker (or without TorchServe's management API)."""
    return AlertRule(
        "DlrmNoReadyWorkers",
        _expr(f"""
        sum by (namespace, pod) ({WORKERS}{{status="READY"}}) == 0
        or
        max by (namespace, pod) ({UPSTREAM_UP}{{target="management"}}) == 0
        """),
        "15m", "page",
        "Pod {{ $labels.namespace }}/{{ $labels.pod }} has no READY TorchServe worker",
        f"For 15 minutes (longer than a model load may take) {WORKERS}{{status=\"READY\"}} "
        f"was 0, or the sidecar could not reach TorchServe's management API "
        f"({UPSTREAM_UP}{{target=\"management\"}} == 0, so {WORKERS} is absent). The pod "
        "is not Ready, answers no predictions, and Kubernetes will not restart it "
        "(TorchServe's /ping stays healthy without workers), while the HPA still counts "
        "it. Read GET /state on its sidecar (the last reconcile error: a model that "
        "fails to load, a switch refused for memory) and the torchserve container's "
        "logs; fix the serving state, or delete the pod if TorchServe is wedged.")


def _cache_hit_ratio_falling() -> AlertRule:
    """A ticket: the cache hit ratio fell against an hour earlier."""
    req = REQUESTS_TOTAL
    return AlertRule(
        "DlrmCacheHitRatioFalling",
        f"(\n  {_hit_ratio()}\n)\n"
        f"< {CACHE_HIT_DROP} *\n"
        f"(\n  {_hit_ratio(' offset 1h')}\n)\n"
        f"and on (namespace)\n"
        f"sum by (namespace) (rate({req}[30m])) > 0",
        "15m", "ticket",
        "Embedding cache hit ratio in {{ $labels.namespace }} fell to "
        "{{ $value | humanizePercentage }}",
        "Over the last 30 minutes the device cache served less than "
        f"{CACHE_HIT_DROP}x the share of embedding lookups it served an hour earlier, "
        "with traffic flowing, for 15 minutes. More misses mean more host-to-device "
        "copies and a higher p99. Usual causes: traffic moved to other items (a "
        "campaign, a catalogue change), a new model version or cache policy, many pods "
        f"restarted with cold caches. Check {CACHE_HIT_RECORD} per pod and the p99; if "
        "latency suffers, give the version a larger cache (its build profile) or scale "
        "out.")


def _predicted_ctr_shift() -> AlertRule:
    """A ticket: an arm's mean predicted CTR is off its version's baseline."""
    return AlertRule(
        "DlrmPredictedCtrShift",
        _expr(f"""
        abs(
          {MEAN_SCORE_RECORD}
          / on (namespace, version) group_left
          max by (namespace, version) ({BASELINE_PREDICTED_CTR})
          - 1
        )
        > {CTR_SHIFT_MAX}
        """),
        "15m", "ticket",
        "Mean predicted CTR of {{ $labels.arm }} version {{ $labels.version }} is "
        "{{ $value | humanizePercentage }} off its baseline",
        "The mean predicted click probability of all this arm's predictions over 15 "
        f"minutes ({ARM_SCORE} histogram, pooled over pods) has differed from the "
        f"version's held-out baseline ({BASELINE_PREDICTED_CTR}, from its build report) "
        f"by more than {CTR_SHIFT_MAX:.0%} for 15 minutes. Either the traffic drifted "
        "(new items, a broken feature pipeline upstream: look at the request features) "
        "or the model is wrong for it. Compare with the other arm and with the "
        "calibration from click feedback; if it is a rollout's candidate, roll it back "
        "(POST /state/rollout/rollback).")


def _calibration_off() -> AlertRule:
    """A ticket: predicted / observed CTR outside CALIBRATION_RANGE."""
    lo, hi = CALIBRATION_RANGE
    return AlertRule(
        "DlrmCalibrationOff",
        _expr(f"""
        (
          {CALIBRATION_RECORD} < {lo}
          or
          {CALIBRATION_RECORD} > {hi}
        )
        and on (namespace, version, arm)
        {LABELS_RECORD} >= {CALIBRATION_MIN_LABELS}
        """),
        "30m", "ticket",
        "{{ $labels.arm }} version {{ $labels.version }} predicts "
        "{{ $value | humanize }}x the observed CTR",
        "Over the feedback window (pooled over pods, at least "
        f"{CALIBRATION_MIN_LABELS} labelled predictions) the mean predicted CTR divided "
        f"by the observed CTR has stayed outside [{lo}, {hi}] for 30 minutes: bids or "
        "rankings that use the probability as a probability are off. Above 1 the model "
        "over-predicts clicks. Check that feedback is complete (dlrm_feedback_labels_total "
        "by result: many unknown or expired labels bias the join), compare with "
        f"{BASELINE_CALIBRATION_RATIO} and the online AUC; a real shift needs a "
        "retrained or recalibrated version.")


def _rollout_rolled_back() -> AlertRule:
    """A ticket: a rollout rolled back in the last hour."""
    if "rolled_back" not in ROLLOUT_PHASES:
        raise ValueError(f"rollout phase 'rolled_back' is not in {ROLLOUT_PHASES}; update "
                         "DlrmRolloutRolledBack")
    return AlertRule(
        "DlrmRolloutRolledBack",
        _expr(f"""
        count by (namespace) (
          {ROLLOUT_PHASE}{{phase="rolled_back"}} == 1
          and
          changes({ROLLOUT_PHASE}{{phase="rolled_back"}}[1h]) > 0
        )
        """),
        "0m", "ticket",
        "{{ $value }} pod(s) in {{ $labels.namespace }} rolled back a rollout",
        "A rollout's guards (error ratio, p99 ratio, score PSI) breached, or someone "
        "called POST /state/rollout/rollback, in the last hour: the pods serve the "
        "stable version alone again (the alert clears an hour after the rollback). GET "
        "/state on a sidecar gives rollout.reason and each guard's value and threshold "
        "(also dlrm_rollout_guard_value). Fix the candidate, then declare a new rollout; "
        "with a read-only ConfigMap, also remove the rollout from the serving state so "
        "a restart does not retry it.")


def _embedding_deltas_stale() -> AlertRule:
    """A ticket: a version's newest applied embedding delta is old."""
    return AlertRule(
        "DlrmEmbeddingDeltasStale",
        _expr(f"""
        time() - max by (namespace, pod, version) ({EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS})
        > {EMBEDDING_STALE_SECONDS}
        """),
        "15m", "ticket",
        "Embeddings of version {{ $labels.version }} in {{ $labels.namespace }}/"
        "{{ $labels.pod }} are {{ $value | humanizeDuration }} old",
        "The newest embedding delta applied to this version was built more than "
        f"{EMBEDDING_STALE_SECONDS // 3600} hours ago: new items and changed users are "
        "scored with old embeddings. Check the delta builder (did it run and publish?) "
        "and the sidecar's log for deltas it refused to apply.")


def _fallback_share(offset: str = "") -> str:
    """Fallback-row lookups per instance, per (namespace, feature), over 15 minutes
    (``offset`` e.g. " offset 1h")."""
    w = f"[15m]{offset}"
    return (f"sum by (namespace, feature) (rate({EMBEDDING_IDS_FALLBACK_TOTAL}{w}))\n"
            f"  / on (namespace) group_left\n"
            f"  sum by (namespace) (rate({INSTANCES_TOTAL}{w}))")


def _fallback_share_rising() -> AlertRule:
    """A ticket: a managed feature's fallback share rose (new ids are not reaching
    serving)."""
    return AlertRule(
        "DlrmEmbeddingFallbackRising",
        f"(\n  {_fallback_share()}\n)\n"
        f"> {FALLBACK_SHARE_MAX}\n"
        f"and\n"
        f"(\n  {_fallback_share()}\n)\n"
        f"> {FALLBACK_RISE} *\n"
        f"(\n  {_fallback_share(' offset 1h')}\n)",
        "30m", "ticket",
        "{{ $value | humanizePercentage }} of instances read the fallback row of "
        "{{ $labels.feature }} in {{ $labels.namespace }}",
        f"Over the last 15 minutes more than {FALLBACK_SHARE_MAX:.0%} of the instances "
        f"looked up an id of managed feature {{{{ $labels.feature }}}} that has no row "
        f"of its own (the fallback row), and that share is over {FALLBACK_RISE:g}x its "
        "value an hour earlier, for 30 minutes: new ids are not reaching serving, so new "
        "users and items are scored with the table's unknown-id embedding. The tail of "
        "rare ids keeps a steady share; a climb means admissions stopped arriving. Check "
        "that embedding deltas are built and applied (GET /state embeddings.<version>: "
        "applied_sequence, id_maps admitted and occupancy; DlrmEmbeddingDeltasStale; "
        "dlrm_delta_posts_refused_total), and whether the table is full (occupancy near "
        "1: evictions must free rows, or give it more rows in the next build).")


def _group(name: str, rules: Sequence[RecordingRule] | Sequence[AlertRule]) -> dict[str, Any]:
    return {"name": name, "rules": [r.to_rule() for r in rules]}


def rule_file(kind: Literal["recording", "alerts"],
              adapter_rules: Path | None = None) -> dict[str, Any]:
    """A Prometheus rule file (``{"groups": [...]}``) of the recording or alert rules."""
    if kind == "recording":
        return {"groups": [_group(RECORDING_GROUP, recording_rules(adapter_rules))]}
    return {"groups": [_group(ALERT_GROUP, alert_rules())]}


def prometheus_rule(adapter_rules: Path | None = None) -> dict[str, Any]:
    """The PrometheusRule holding both groups (the Prometheus operator's form)."""
    groups = (rule_file("recording", adapter_rules)["groups"]
              + rule_file("alerts")["groups"])
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "dlrm-serve", "labels": {
            "app.kubernetes.io/name": "dlrm-serve",
            "app.kubernetes.io/part-of": "dlrm-serve"}},
        "spec": {"groups": groups},
    }
