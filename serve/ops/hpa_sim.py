"""Replay traffic through the Kubernetes HPA algorithm with our k8s/hpa.yaml.

What it answers: with the HPA spec we ship and the per-pod capacity we measured, how many
pods run under single-instance, ranking and mixed traffic, and a switch between them,
against the fewest pods that would keep every pod at or below its knee (the ideal); and
how long the load per ready pod stays above the knee (over the SLO) after each scale-up.
The same traffic also goes through the OLD spec (request rate only, at
loadtest/capacity.json's target_qps, CPU 75%) for comparison.

The controller logic follows kube-controller-manager's horizontal pod autoscaler
(pkg/controller/podautoscaler, autoscaling/v2):

* per metric, ``desired = ceil(ready_pods_with_metrics * metric / target)``, unchanged
  while ``|metric / target - 1| <= tolerance`` (0.1); pods without a metric yet (still
  starting) count as 0 when scaling up and as the target when scaling down, and the
  proposal is dropped when that flips its direction;
* the largest proposal over all metrics wins;
* stabilization: scale up to the *lowest* raw proposal of the scale-up window, down to the
  *highest* of the scale-down window;
* rate policies: per period, Pods adds/removes N, Percent multiplies; ``selectPolicy: Max``
  takes the policy allowing the biggest change; then min/max replicas.

The pod model (stated, not hidden): the Service spreads load evenly over ready pods; a new
pod is Ready ``startup_s`` after creation; a pod's capacity is its traffic mix's knee in
req/s (:data:`MIXES`: single-instance and ranking from ``make bench-autotune``'s tuned
figures, 2026-12-02, README; mixed from loadtest/capacity.json, ``make capacity``);
each metric the HPA sees for a pod is its value averaged over the adapter's 1 m window
while it was Ready, delayed by one scrape interval:

* ``dlrm_requests_per_second``: the pod's request rate;
* ``dlrm_capacity_utilization_ratio``: request rate x the mix's handler seconds per
  request (:class:`serve.sidecar.control.utilization.WorkModel`, measured in-process)
  over the pod's capacity (:func:`serve.sidecar.control.utilization.utilization_ratio`);
* CPU: ``cpu_at_knee`` x load / knee (CPU pod at the knee: 1.8 of 2 cores, README's
  ``make bench-e2e``).

Removed pods go at once, newest first.

Run: ``python -m serve.ops.hpa_sim`` (``make hpa-sim``); ``--help`` for the knobs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from serve.errors import ConfigError
from serve.sidecar.control.utilization import (
    BUSY_AT_KNEE,
    UTILIZATION_TARGET,
    WorkModel,
    capacity_work_per_s,
)

__all__ = [
    "MIXES",
    "UTILIZATION_METRIC",
    "Hpa",
    "HpaSpec",
    "Mix",
    "ScalingPolicy",
    "ScalingRules",
    "ScenarioResult",
    "SimConfig",
    "load_capacity",
    "load_hpa",
    "main",
    "metric_proposal",
    "mixes_from",
    "old_spec",
    "parse_quantity",
    "pod_metrics",
    "reaction_time_s",
    "scale_down_limit",
    "scale_up_limit",
    "scale_up_steps",
    "scenarios",
    "simulate",
]

_log = logging.getLogger(__name__)

DEFAULT_HPA = Path("k8s/hpa.yaml")
DEFAULT_CAPACITY = Path("loadtest/capacity.json")
QPS_METRIC = "dlrm_requests_per_second"
UTILIZATION_METRIC = "dlrm_capacity_utilization_ratio"
_KNOWN_METRICS = (QPS_METRIC, UTILIZATION_METRIC)
_INT32_MAX = 2**31 - 1
#: Handler seconds per request: 36 us + 22.8 us per instance (in-process, one thread, the
#: shipped int8 small model, row-form JSON, 2026-12-04: 22.8 us/instance in ranking
#: batches, 59 us per single-instance request in batches of 32; bench/bench_work.py).
WORK = WorkModel(per_request_s=36e-6, per_instance_s=22.8e-6)
#: The old spec's CPU target (k8s/hpa.yaml before the utilization metric).
OLD_CPU_TARGET = 0.75


def parse_quantity(value: str | float) -> float:
    """A Kubernetes quantity ("100", "12.5", "1500m", "2k") as a float."""
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).strip()
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 1024.0, "Mi": 1024.0**2,
                "Gi": 1024.0**3}
    for suf in sorted(suffixes, key=len, reverse=True):
        if s.endswith(suf):
            try:
                return float(s[: -len(suf)]) * suffixes[suf]
            except ValueError:
                break
    try:
        return float(s)
    except ValueError:
        raise ConfigError(f"quantity {value!r} is not a Kubernetes quantity "
                          f"(e.g. \"100\", \"12.5\", \"1500m\")") from None


@dataclass(frozen=True)
class ScalingPolicy:
    """One HPA rate policy: ``type`` "Pods" (add/remove ``value`` pods) or "Percent"."""

    type: str
    value: int
    period_s: int

    def __post_init__(self) -> None:
        if self.type not in ("Pods", "Percent"):
            raise ConfigError(f"policy type {self.type!r} must be 'Pods' or 'Percent'")
        if self.value <= 0 or not 0 < self.period_s <= 1800:
            raise ConfigError(f"policy {self.type} value={self.value} period={self.period_s}s: "
                              "value must be > 0 and period in (0, 1800] s")


@dataclass(frozen=True)
class ScalingRules:
    """``behavior.scaleUp`` or ``behavior.scaleDown`` of an autoscaling/v2 HPA."""

    stabilization_window_s: int
    select_policy: str
    policies: tuple[ScalingPolicy, ...]

    def __post_init__(self) -> None:
        if self.select_policy not in ("Max", "Min", "Disabled"):
            raise ConfigError(f"selectPolicy {self.select_policy!r} must be Max, Min or Disabled")
        if not 0 <= self.stabilization_window_s <= 3600:
            raise ConfigError(f"stabilizationWindowSeconds {self.stabilization_window_s} "
                              "must be in [0, 3600]")

    @classmethod
    def from_manifest(cls, doc: dict[str, Any] | None, default_window_s: int) -> ScalingRules:
        doc = doc or {}
        pols = tuple(ScalingPolicy(p["type"], int(p["value"]), int(p["periodSeconds"]))
                     for p in doc.get("policies") or ())
        return cls(int(doc.get("stabilizationWindowSeconds", default_window_s)),
                   str(doc.get("selectPolicy", "Max")), pols)


@dataclass(frozen=True)
class HpaSpec:
    """What the simulation needs of k8s/hpa.yaml.

    targets: each Pods metric's name and averageValue, e.g.
        ``(("dlrm_capacity_utilization_ratio", 0.8), ("dlrm_requests_per_second", 5050.0))``.
    cpu_target: CPU averageUtilization as a fraction (0.7), or None.
    """

    min_replicas: int
    max_replicas: int
    targets: tuple[tuple[str, float], ...]
    cpu_target: float | None
    scale_up: ScalingRules
    scale_down: ScalingRules
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(f"minReplicas {self.min_replicas} and maxReplicas "
                              f"{self.max_replicas}: need 1 <= min <= max")
        if not self.targets and self.cpu_target is None:
            raise ConfigError("the HPA has no metric the simulation knows; need a Pods "
                              f"metric of {_KNOWN_METRICS} or a CPU target")
        for name, target in self.targets:
            if name not in _KNOWN_METRICS:
                raise ConfigError(f"Pods metric {name!r} is not one the simulation models "
                                  f"({', '.join(_KNOWN_METRICS)}); model it or remove it")
            if not target > 0:
                raise ConfigError(f"target {target} of {name} must be > 0")

    def target(self, metric: str) -> float | None:
        """The averageValue of Pods metric ``metric``, or None when the spec lacks it."""
        return next((t for n, t in self.targets if n == metric), None)

    @classmethod
    def from_manifest(cls, doc: dict[str, Any]) -> HpaSpec:
        if doc.get("apiVersion") != "autoscaling/v2" or doc.get("kind") != "HorizontalPodAutoscaler":
            raise ConfigError(f"expected an autoscaling/v2 HorizontalPodAutoscaler, got "
                              f"{doc.get('apiVersion')}/{doc.get('kind')}")
        spec = doc["spec"]
        targets: list[tuple[str, float]] = []
        cpu: float | None = None
        for m in spec.get("metrics") or ():
            if m["type"] == "Pods":
                targets.append((str(m["pods"]["metric"]["name"]),
                                parse_quantity(m["pods"]["target"]["averageValue"])))
            elif m["type"] == "Resource" and m["resource"]["name"] == "cpu":
                cpu = float(m["resource"]["target"]["averageUtilization"]) / 100.0
        behavior = spec.get("behavior") or {}
        # Kubernetes' defaults when behavior is absent: up window 0, down window 300 s.
        return cls(min_replicas=int(spec.get("minReplicas", 1)),
                   max_replicas=int(spec["maxReplicas"]), targets=tuple(targets),
                   cpu_target=cpu,
                   scale_up=ScalingRules.from_manifest(behavior.get("scaleUp"), 0),
                   scale_down=ScalingRules.from_manifest(behavior.get("scaleDown"), 300))


def load_hpa(path: str | Path = DEFAULT_HPA) -> HpaSpec:
    """Parse the HPA in ``path`` (one YAML document)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"HPA manifest {path} does not exist; run from the repo root or "
                          "pass --hpa")
    return HpaSpec.from_manifest(yaml.safe_load(path.read_text()))


def old_spec(spec: HpaSpec, target_qps: float) -> HpaSpec:
    """The spec before the utilization metric: request rate only at ``target_qps``
    (capacity.json's, written by the old ``make capacity``), CPU 75%, ``spec``'s
    replicas and behavior."""
    return dataclasses.replace(spec, targets=((QPS_METRIC, target_qps),),
                               cpu_target=OLD_CPU_TARGET)


def load_capacity(path: str | Path = DEFAULT_CAPACITY) -> dict[str, Any]:
    """loadtest/capacity.json (written by ``make capacity``): knee_qps, target_qps,
    instances_per_request, ..."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"capacity file {path} does not exist; run `make capacity`")
    doc = json.loads(path.read_text())
    for key in ("knee_qps", "target_qps", "instances_per_request"):
        if not isinstance(doc.get(key), (int, float)) or doc[key] <= 0:
            raise ConfigError(f"{path}: {key}={doc.get(key)!r} must be a number > 0")
    return doc


@dataclass(frozen=True)
class Mix:
    """One traffic mix and what one pod sustains of it at the p99 goal.

    knee_rps: requests/s per pod at the knee; instances_per_request: the mean ``m``;
    source: where the knee was measured.
    """

    name: str
    knee_rps: float
    instances_per_request: float
    source: str

    def __post_init__(self) -> None:
        if not (self.knee_rps > 0 and self.instances_per_request >= 1):
            raise ConfigError(f"mix {self.name}: knee_rps={self.knee_rps} must be > 0 and "
                              f"instances_per_request={self.instances_per_request} >= 1")


#: Single-instance and ranking capacity of the CPU pod (2 workers x 1 thread, 2 cores):
#: README "Batching tuner vs static batching", `make bench-autotune`, 2026-12-02, tuner on:
#: single 6,316 samples/s at p99 20.1 ms (1 instance per request); ranking 44,549
#: samples/s at p99 53.7 ms (100-700 instances, uniform: 400 per request).
MIXES: dict[str, Mix] = {
    "single": Mix("single", 6316.0, 1.0, "make bench-autotune 2026-12-02 (README)"),
    "ranking": Mix("ranking", 44549.0 / 400.0, 400.0,
                   "make bench-autotune 2026-12-02 (README)"),
}


def mixes_from(capacity: dict[str, Any]) -> dict[str, Mix]:
    """:data:`MIXES` plus ``mixed``: capacity.json's knee (the load test's MLPerf-like
    mix: 100-700 candidates, 10% single-instance)."""
    mixed = Mix("mixed", float(capacity["knee_qps"]), float(capacity["instances_per_request"]),
                f"loadtest/capacity.json ({capacity.get('measured_at', '?')})")
    return {**MIXES, "mixed": mixed}


# --------------------------------------------------------------------------- algorithm


def metric_proposal(current: int, values: Sequence[float], missing: int, target: float,
                    tolerance: float = 0.1) -> int:
    """Replica proposal of one per-pod metric (replica_calculator's plain-metric path).

    Args:
        current: the scale target's replica count now.
        values: the metric of each pod that reports one (e.g. requests/s).
        missing: pods that exist but report no metric yet (starting).
        target: the per-pod target (averageValue).
    """
    if not values:
        return current
    ratio = sum(values) / len(values) / target
    if missing == 0:
        if abs(ratio - 1.0) <= tolerance:
            return current
        return math.ceil(ratio * len(values))
    # Missing pods: assume the least helpful value for the direction (0 when scaling up,
    # the target when scaling down) and drop the proposal if that flips the direction.
    fill = target if ratio < 1.0 else 0.0
    new_ratio = (sum(values) + fill * missing) / (len(values) + missing) / target
    if abs(new_ratio - 1.0) <= tolerance or (ratio > 1.0) != (new_ratio > 1.0):
        return current
    proposal = math.ceil(new_ratio * (len(values) + missing))
    if (new_ratio < 1.0 and proposal > current) or (new_ratio > 1.0 and proposal < current):
        return current
    return proposal


def _changes_in(events: Sequence[tuple[float, int]], now: float, period_s: int) -> int:
    return sum(n for t, n in events if t > now - period_s)


def scale_up_limit(current: int, up_events: Sequence[tuple[float, int]], now: float,
                   rules: ScalingRules) -> int:
    """Most replicas the scale-up policies allow now (``up_events``: (time, pods added))."""
    if rules.select_policy == "Disabled" or not rules.policies:
        return current
    pick: Callable[[int, int], int] = max if rules.select_policy == "Max" else min
    result = -_INT32_MAX if rules.select_policy == "Max" else _INT32_MAX
    for p in rules.policies:
        start = current - _changes_in(up_events, now, p.period_s)
        proposed = (start + p.value if p.type == "Pods"
                    else math.ceil(start * (1.0 + p.value / 100.0)))
        result = pick(result, proposed)
    return result


def scale_down_limit(current: int, down_events: Sequence[tuple[float, int]], now: float,
                     rules: ScalingRules) -> int:
    """Fewest replicas the scale-down policies allow now (``down_events``: pods removed)."""
    if rules.select_policy == "Disabled" or not rules.policies:
        return current
    # Max = the policy allowing the biggest change = the lowest floor.
    pick: Callable[[int, int], int] = min if rules.select_policy == "Max" else max
    result = _INT32_MAX if rules.select_policy == "Max" else -_INT32_MAX
    for p in rules.policies:
        start = current + _changes_in(down_events, now, p.period_s)
        proposed = (start - p.value if p.type == "Pods"
                    else int(start * (1.0 - p.value / 100.0)))
        result = pick(result, proposed)
    return result


class Hpa:
    """One HPA's state between syncs: recommendations and scale events."""

    def __init__(self, spec: HpaSpec) -> None:
        self.spec = spec
        self._recs: deque[tuple[float, int]] = deque()
        self._up: list[tuple[float, int]] = []
        self._down: list[tuple[float, int]] = []

    def _stabilize(self, now: float, current: int, proposal: int) -> int:
        up_w, down_w = self.spec.scale_up.stabilization_window_s, self.spec.scale_down.stabilization_window_s
        up_rec = down_rec = proposal
        for t, r in self._recs:
            if t > now - up_w:
                up_rec = min(up_rec, r)
            if t > now - down_w:
                down_rec = max(down_rec, r)
        self._recs.append((now, proposal))
        keep = max(up_w, down_w)
        while self._recs and self._recs[0][0] <= now - keep:
            self._recs.popleft()
        rec = current
        rec = max(rec, up_rec)
        rec = min(rec, down_rec)
        return rec

    def decide(self, now: float, current: int, proposal: int) -> int:
        """Stabilize ``proposal``, apply rate policies and min/max; record the change."""
        s = self.spec
        desired = self._stabilize(now, current, proposal)
        if desired > current:
            limit = max(scale_up_limit(current, self._up, now, s.scale_up), current)
            desired = min(desired, limit, s.max_replicas)
        elif desired < current:
            limit = min(scale_down_limit(current, self._down, now, s.scale_down), current)
            desired = max(desired, limit, s.min_replicas)
        desired = min(max(desired, s.min_replicas), s.max_replicas)
        if desired > current:
            self._up.append((now, desired - current))
        elif desired < current:
            self._down.append((now, current - desired))
        horizon = now - 1800
        self._up = [e for e in self._up if e[0] > horizon]
        self._down = [e for e in self._down if e[0] > horizon]
        return desired


def scale_up_steps(start: int, needed: int, rules: ScalingRules) -> int:
    """Policy periods the scale-up rules need to grow from ``start`` to ``needed`` pods."""
    if needed <= start:
        return 0
    if rules.select_policy == "Disabled" or not rules.policies:
        raise ConfigError("scale-up is disabled: the HPA can never add pods")
    n, steps = start, 0
    while n < needed:
        n = max(scale_up_limit(n, [], 0.0, rules), n + 1)
        steps += 1
    return steps


@dataclass(frozen=True)
class SimConfig:
    """The cluster model around the HPA (all times in seconds).

    startup_s: pod creation to Ready (image cached; TorchServe loads the model).
    sync_s: the HPA controller's sync period (kube-controller-manager default 15 s).
    rate_window_s / scrape_s: the adapter's rate() window and Prometheus' scrape interval.
    cpu_at_knee: CPU utilization (of the request) of a pod at its knee.
    workers: TorchServe workers per pod; busy_at_knee: see
        :mod:`serve.sidecar.control.utilization`.
    """

    startup_s: float = 90.0
    sync_s: float = 15.0
    rate_window_s: float = 60.0
    scrape_s: float = 15.0
    cpu_at_knee: float = 0.9
    workers: int = 2
    busy_at_knee: float = BUSY_AT_KNEE
    work: WorkModel = field(default=WORK)
    dt_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("startup_s", "rate_window_s", "scrape_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.dt_s <= self.sync_s:
            raise ConfigError(f"dt_s={self.dt_s} must be in (0, sync_s={self.sync_s}]")
        if self.workers < 1:
            raise ConfigError(f"workers={self.workers} must be >= 1")


def pod_metrics(rps: float, mix: Mix, cfg: SimConfig) -> dict[str, float]:
    """What one pod serving ``rps`` requests/s of ``mix`` reports, per metric (``cpu`` as a
    fraction of its request)."""
    work_per_s = rps * cfg.work.seconds(mix.instances_per_request)
    return {QPS_METRIC: rps,
            UTILIZATION_METRIC: work_per_s / capacity_work_per_s(cfg.workers,
                                                                 cfg.busy_at_knee),
            "cpu": cfg.cpu_at_knee * rps / mix.knee_rps}


def reaction_time_s(spec: HpaSpec, cfg: SimConfig, start: int, needed: int) -> float:
    """Longest a step in load from ``start`` pods' worth to ``needed`` pods' worth may stay
    over capacity by design: the metric's delay (scrape + rate window), one sync period,
    the scale-up window and policy periods, and the pod start-up."""
    periods = max((p.period_s for p in spec.scale_up.policies), default=0)
    return (cfg.scrape_s + cfg.rate_window_s + cfg.sync_s + spec.scale_up.stabilization_window_s
            + scale_up_steps(start, needed, spec.scale_up) * periods + cfg.startup_s)


#: A load curve: t (s) -> (requests/s, the mix they are).
Load = Callable[[float], tuple[float, Mix]]


@dataclass
class ScenarioResult:
    """Time series (one sample per ``sample_s``), over-SLO intervals and the totals.

    pod_s: pod-seconds run (desired replicas). ideal_pod_s: the fewest that keep every pod
    at :data:`~serve.sidecar.control.utilization.UTILIZATION_TARGET` (0.8) of its knee,
    the headroom the design keeps for the metric's delay and pod start-up
    (``max(minReplicas, ceil(load / (0.8 x knee)))`` each second); knee_pod_s: the fewest
    at the knee itself (no headroom: 1/0.8 = 1.25x fewer; an HPA cannot get there).
    intervals: when the load per ready pod was above the mix's knee (over the SLO).
    scale_ups: HPA decisions that added pods.
    """

    name: str
    t_s: list[float] = field(default_factory=list)
    load_rps: list[float] = field(default_factory=list)
    mix: list[str] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    ideal: list[int] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    pod_s: float = 0.0
    ideal_pod_s: float = 0.0
    knee_pod_s: float = 0.0
    scale_ups: int = 0

    @property
    def over_s(self) -> float:
        return sum(b - a for a, b in self.intervals)

    @property
    def longest_over_s(self) -> float:
        return max((b - a for a, b in self.intervals), default=0.0)

    @property
    def pods_vs_ideal(self) -> float:
        return self.pod_s / self.ideal_pod_s if self.ideal_pod_s else math.nan

    @property
    def pods_vs_knee(self) -> float:
        return self.pod_s / self.knee_pod_s if self.knee_pod_s else math.nan

    @property
    def over_s_per_scale_up(self) -> float:
        return self.over_s / self.scale_ups if self.scale_ups else self.over_s

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "pods_vs_ideal": round(self.pods_vs_ideal, 3),
                "pods_vs_knee": round(self.pods_vs_knee, 3),
                "pod_hours": round(self.pod_s / 3600.0, 3),
                "ideal_pod_hours": round(self.ideal_pod_s / 3600.0, 3),
                "max_replicas": max(self.replicas, default=0),
                "scale_ups": self.scale_ups, "over_slo_s": self.over_s,
                "over_slo_s_per_scale_up": round(self.over_s_per_scale_up, 1),
                "longest_over_slo_s": self.longest_over_s,
                "over_slo_episodes": len(self.intervals)}


def simulate(spec: HpaSpec, cfg: SimConfig, load: Load, duration_s: float, *,
             name: str = "load", initial_replicas: int | None = None,
             sample_s: float = 15.0) -> ScenarioResult:
    """Run the HPA + pod model for ``duration_s`` against ``load(t)``."""
    hpa = Hpa(spec)
    replicas = initial_replicas or spec.min_replicas
    pods: list[float] = [-cfg.startup_s] * replicas  # creation times; Ready at t = 0
    # (time, what one ready pod reports) over the rate window plus a scrape.
    window: deque[tuple[float, dict[str, float]]] = deque()
    res = ScenarioResult(name)
    over_since: float | None = None
    next_sync, next_sample = cfg.sync_s, 0.0
    steps = round(duration_s / cfg.dt_s)
    for i in range(steps + 1):
        t = i * cfg.dt_s
        ready = sum(1 for c in pods if t - c >= cfg.startup_s)
        rps, mix = load(t)
        per_pod = rps / ready if ready else math.inf
        over = per_pod > mix.knee_rps
        if over and over_since is None:
            over_since = t
        elif not over and over_since is not None:
            res.intervals.append((over_since, t))
            over_since = None
        ideal = _fewest(rps, mix.knee_rps * UTILIZATION_TARGET, spec)
        res.pod_s += replicas * cfg.dt_s
        res.ideal_pod_s += ideal * cfg.dt_s
        res.knee_pod_s += _fewest(rps, mix.knee_rps, spec) * cfg.dt_s
        if ready:
            window.append((t, pod_metrics(per_pod, mix, cfg)))
        while window and window[0][0] < t - cfg.rate_window_s - cfg.scrape_s:
            window.popleft()
        if t >= next_sync:
            next_sync += cfg.sync_s
            replicas = _sync(hpa, spec, cfg, t, replicas, pods, window, res)
        if t >= next_sample:
            next_sample += sample_s
            res.t_s.append(t)
            res.load_rps.append(round(rps, 3))
            res.mix.append(mix.name)
            res.replicas.append(replicas)
            res.ready.append(ready)
            res.ideal.append(ideal)
    if over_since is not None:
        res.intervals.append((over_since, steps * cfg.dt_s))
    return res


def _fewest(rps: float, per_pod: float, spec: HpaSpec) -> int:
    return min(max(math.ceil(rps / per_pod - 1e-9), spec.min_replicas), spec.max_replicas)


def _sync(hpa: Hpa, spec: HpaSpec, cfg: SimConfig, t: float, replicas: int,
          pods: list[float], window: deque[tuple[float, dict[str, float]]],
          res: ScenarioResult) -> int:
    """One HPA sync at ``t``: each pod's metrics as the adapter reports them now (its
    values over the rate window that ended one scrape ago, while it was Ready; a pod
    Ready for less than a scrape of that window has none yet), the largest proposal, the
    decision. Adds/removes pods; returns the new replica count."""
    lo, hi = t - cfg.scrape_s - cfg.rate_window_s, t - cfg.scrape_s
    per_pod: list[dict[str, float]] = []
    for c in pods:
        since = max(lo, c + cfg.startup_s)
        if hi - since < cfg.scrape_s:
            continue
        seen = [v for ts, v in window if since <= ts <= hi]
        if seen:
            per_pod.append({k: sum(v[k] for v in seen) / len(seen) for k in seen[0]})
    missing = len(pods) - len(per_pod)
    proposal = 0
    metrics = list(spec.targets)
    if spec.cpu_target is not None:
        metrics.append(("cpu", spec.cpu_target))
    for metric, target in metrics:
        proposal = max(proposal, metric_proposal(
            replicas, [v[metric] for v in per_pod], missing, target, spec.tolerance))
    new = hpa.decide(t, replicas, proposal)
    if new > replicas:
        pods.extend([t] * (new - replicas))
        res.scale_ups += 1
    elif new < replicas:
        pods.sort()
        del pods[new:]  # the newest go first
    return new


def _shape(t: float) -> float:
    """Pods' worth of load at ``t`` (s): 2 for 5 min, a 20-min ramp to 10, 10 min flat, a
    step to 14 for 10 min, a 10-min ramp down to 4, 4 until the end (75 min)."""
    m = t / 60.0
    if m < 5:
        return 2.0
    if m < 25:
        return 2.0 + 8.0 * (m - 5) / 20.0
    if m < 35:
        return 10.0
    if m < 45:
        return 14.0
    if m < 55:
        return 14.0 - 10.0 * (m - 45) / 10.0
    return 4.0


def _shaped(mix: Mix) -> Load:
    def load(t: float) -> tuple[float, Mix]:
        return _shape(t) * mix.knee_rps, mix
    return load


def scenarios(mixes: dict[str, Mix]) -> dict[str, tuple[Load, float]]:
    """name -> (load, seconds). ``single``, ``ranking``, ``mixed``: :func:`_shape` in
    pods' worth of that mix; ``switch``: 6 pods' worth throughout, ranking, then single
    at 20 min, mixed at 40 min, ranking again at 60 min (80 min)."""
    out: dict[str, tuple[Load, float]] = {}
    for name in ("single", "ranking", "mixed"):
        out[name] = (_shaped(mixes[name]), 75 * 60.0)
    order = [mixes["ranking"], mixes["single"], mixes["mixed"], mixes["ranking"]]

    def switch(t: float) -> tuple[float, Mix]:
        mix = order[min(int(t // 1200.0), len(order) - 1)]
        return 6.0 * mix.knee_rps, mix

    out["switch"] = (switch, 80 * 60.0)
    return out


def _plot(results: Sequence[ScenarioResult], old: Sequence[ScenarioResult],
          path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.0 * len(results)))
    for ax, r, o in zip(axes, results, old, strict=True):
        t = [x / 60.0 for x in r.t_s]
        ax.step(t, r.ideal, where="post", label="ideal pods", color="tab:gray")
        ax.step(t, r.replicas, where="post", label="replicas (shipped spec)", color="tab:blue")
        ax.step([x / 60.0 for x in o.t_s], o.replicas, where="post",
                label="replicas (old req/s spec)", color="tab:orange", alpha=0.7)
        for a, b in r.intervals:
            ax.axvspan(a / 60.0, b / 60.0, color="tab:red", alpha=0.2)
        ax.set_title(f"{r.name}: red = load per ready pod above the knee (shipped spec)")
        ax.set_xlabel("min")
        ax.set_ylabel("pods")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _table(rows: Sequence[tuple[str, ScenarioResult, ScenarioResult]]) -> str:
    header = ("| scenario | pods / ideal (at knee) | over SLO s per scale-up "
              "| longest over SLO s | scale-ups | old spec: pods / ideal (at knee) "
              "| old: over SLO s per scale-up | old: longest s |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r, o in rows:
        lines.append(f"| {name} | {r.pods_vs_ideal:.2f} ({r.pods_vs_knee:.2f}) "
                     f"| {r.over_s_per_scale_up:.1f} | {r.longest_over_s:.0f} | {r.scale_ups} "
                     f"| {o.pods_vs_ideal:.2f} ({o.pods_vs_knee:.2f}) "
                     f"| {o.over_s_per_scale_up:.1f} | {o.longest_over_s:.0f} |")
    return "\n".join(lines)


#: The issue's goal for single, ranking and mixed traffic.
MAX_PODS_VS_IDEAL = 1.25
MAX_OVER_S_PER_SCALE_UP = 60.0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m serve.ops.hpa_sim --help``."""
    p = argparse.ArgumentParser(
        prog="python -m serve.ops.hpa_sim",
        description="Replay single-instance, ranking and mixed traffic and a switch "
                    "between them through the HPA in k8s/hpa.yaml and through the old "
                    "request-rate-only spec; print pods vs the ideal count and seconds "
                    "over the SLO per scale-up, write hpa_sim.json and a plot.")
    p.add_argument("--hpa", type=Path, default=DEFAULT_HPA, help="HPA manifest")
    p.add_argument("--capacity", type=Path, default=DEFAULT_CAPACITY,
                   help="capacity.json from `make capacity`: the mixed traffic's knee and "
                        "the old spec's target_qps")
    p.add_argument("--startup-s", type=float, default=90.0,
                   help="seconds from pod creation to Ready (model load); longer start-up "
                        "means more time over the SLO after a scale-up")
    p.add_argument("--cpu-at-knee", type=float, default=0.9,
                   help="CPU utilization of a pod at its knee (models the CPU metric)")
    p.add_argument("--cpu-target", type=float, default=None,
                   help="replace the spec's CPU averageUtilization (percent), to compare "
                        "(e.g. 70)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder for hpa_sim.json and hpa_sim.png")
    p.add_argument("--no-plot", action="store_true", help="skip hpa_sim.png")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        spec = load_hpa(args.hpa)
        if args.cpu_target is not None:
            spec = dataclasses.replace(spec, cpu_target=args.cpu_target / 100.0)
        cap = load_capacity(args.capacity)
        mixes = mixes_from(cap)
        old = old_spec(spec, float(cap["target_qps"]))
        cfg = SimConfig(startup_s=args.startup_s, cpu_at_knee=args.cpu_at_knee)
    except ConfigError as e:
        print(f"hpa_sim: {e.message}", file=sys.stderr)
        return 2
    print(f"shipped HPA ({args.hpa}): min {spec.min_replicas} max {spec.max_replicas}, "
          f"targets {dict(spec.targets)}, CPU {spec.cpu_target}, tolerance {spec.tolerance}; "
          f"scale-up window {spec.scale_up.stabilization_window_s} s, scale-down window "
          f"{spec.scale_down.stabilization_window_s} s; pod start-up {cfg.startup_s} s")
    print(f"old HPA: {dict(old.targets)}, CPU {old.cpu_target}, same replicas and behavior")
    for m in mixes.values():
        u = pod_metrics(m.knee_rps, m, cfg)[UTILIZATION_METRIC]
        print(f"mix {m.name:8s} knee {m.knee_rps:9.1f} req/s x {m.instances_per_request:6.1f} "
              f"instances, utilization at the knee {u:.2f} ({m.source})")
    rows = []
    for name, (fn, duration) in scenarios(mixes).items():
        r = simulate(spec, cfg, fn, duration, name=name)
        o = simulate(old, cfg, fn, duration, name=name)
        rows.append((name, r, o))
    table = _table(rows)
    print()
    print(table)
    failed = [name for name, r, _ in rows if name != "switch" and (
        r.pods_vs_ideal > MAX_PODS_VS_IDEAL or r.over_s_per_scale_up > MAX_OVER_S_PER_SCALE_UP)]
    verdict = (f"goal (pods <= {MAX_PODS_VS_IDEAL}x ideal, <= {MAX_OVER_S_PER_SCALE_UP:.0f} s "
               f"over the SLO per scale-up for single, ranking, mixed): "
               + ("met" if not failed else f"NOT met by {', '.join(failed)}"))
    print(verdict)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"hpa": asdict(spec), "old_hpa": asdict(old),
           "sim": {k: v for k, v in asdict(cfg).items() if k != "work"}
           | {"work_per_request_s": cfg.work.per_request_s,
              "work_per_instance_s": cfg.work.per_instance_s},
           "mixes": {k: asdict(m) for k, m in mixes.items()},
           "goal_met": not failed, "table": table,
           "scenarios": {name: {"shipped": {**r.summary(), "intervals": r.intervals,
                                            "t_s": r.t_s, "load_rps": r.load_rps,
                                            "mix": r.mix, "replicas": r.replicas,
                                            "ready": r.ready, "ideal": r.ideal},
                                "old": o.summary()} for name, r, o in rows}}
    (args.out / "hpa_sim.json").write_text(json.dumps(doc, indent=1))
    wrote = [str(args.out / "hpa_sim.json")]
    if not args.no_plot:
        _plot([r for _, r, _ in rows], [o for _, _, o in rows], args.out / "hpa_sim.png")
        wrote.append(str(args.out / "hpa_sim.png"))
    print(f"wrote {' and '.join(wrote)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
