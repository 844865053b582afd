"""Replay load curves through the Kubernetes HPA algorithm with our k8s/hpa.yaml.

What it answers: with the HPA spec we ship and the per-pod capacity we measured
(loadtest/capacity.json), how many pods run over time under a ramp, a spike and a diurnal
curve, and when is the load per ready pod above what one pod sustains at the p99 goal
(the "p99 risk")?

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

The cluster model around it (stated, not hidden): the Service spreads load evenly over
ready pods; a new pod is Ready ``startup_s`` after creation (image cached, model load);
the QPS metric the HPA sees for a pod is its own request rate averaged over the
adapter's 1 m window while it was Ready, delayed by one scrape interval (no value until
it was Ready for a scrape interval); CPU utilization is proportional to per-pod QPS,
``cpu_at_knee`` of the request at the knee (a model, since CPU is a backstop metric);
removed pods go at once, newest first.

Run: ``python -m serve.ops.hpa_sim`` (``make hpa-sim``); ``--help`` for the knobs.
"""
from __future__ import annotations

import argparse
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

__all__ = [
    "Hpa",
    "HpaSpec",
    "ScalingPolicy",
    "ScalingRules",
    "ScenarioResult",
    "SimConfig",
    "load_capacity",
    "load_hpa",
    "main",
    "metric_proposal",
    "parse_quantity",
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
_INT32_MAX = 2**31 - 1


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

    target_qps: the Pods metric's averageValue (requests/s per pod).
    cpu_target: CPU averageUtilization as a fraction (0.75), or None.
    """

    min_replicas: int
    max_replicas: int
    target_qps: float
    cpu_target: float | None
    scale_up: ScalingRules
    scale_down: ScalingRules
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(f"minReplicas {self.min_replicas} and maxReplicas "
                              f"{self.max_replicas}: need 1 <= min <= max")
        if not self.target_qps > 0:
            raise ConfigError(f"QPS target {self.target_qps} must be > 0")

    @classmethod
    def from_manifest(cls, doc: dict[str, Any], metric_name: str = QPS_METRIC) -> HpaSpec:
        if doc.get("apiVersion") != "autoscaling/v2" or doc.get("kind") != "HorizontalPodAutoscaler":
            raise ConfigError(f"expected an autoscaling/v2 HorizontalPodAutoscaler, got "
                              f"{doc.get('apiVersion')}/{doc.get('kind')}")
        spec = doc["spec"]
        target_qps: float | None = None
        cpu: float | None = None
        for m in spec.get("metrics") or ():
            if m["type"] == "Pods" and m["pods"]["metric"]["name"] == metric_name:
                target_qps = parse_quantity(m["pods"]["target"]["averageValue"])
            elif m["type"] == "Resource" and m["resource"]["name"] == "cpu":
                cpu = float(m["resource"]["target"]["averageUtilization"]) / 100.0
        if target_qps is None:
            raise ConfigError(f"the HPA has no Pods metric named {metric_name!r}; "
                              "add it or pass --metric")
        behavior = spec.get("behavior") or {}
        # Kubernetes' defaults when behavior is absent: up window 0, down window 300 s.
        return cls(min_replicas=int(spec.get("minReplicas", 1)),
                   max_replicas=int(spec["maxReplicas"]), target_qps=target_qps, cpu_target=cpu,
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


def load_capacity(path: str | Path = DEFAULT_CAPACITY) -> dict[str, Any]:
    """loadtest/capacity.json (written by ``make capacity``): knee_qps, target_qps, ..."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"capacity file {path} does not exist; run `make capacity` or "
                          "pass --knee-qps")
    doc = json.loads(path.read_text())
    for key in ("knee_qps", "target_qps"):
        if not isinstance(doc.get(key), (int, float)) or doc[key] <= 0:
            raise ConfigError(f"{path}: {key}={doc.get(key)!r} must be a number > 0")
    return doc


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

    knee_qps: requests/s one pod sustains at the p99 goal (capacity.json).
    startup_s: pod creation to Ready (image cached; TorchServe loads the model).
    sync_s: the HPA controller's sync period (kube-controller-manager default 15 s).
    rate_window_s / scrape_s: the adapter's rate() window and Prometheus' scrape interval.
    cpu_at_knee: CPU utilization (of the request) of a pod serving knee_qps.
    """

    knee_qps: float
    startup_s: float = 90.0
    sync_s: float = 15.0
    rate_window_s: float = 60.0
    scrape_s: float = 15.0
    cpu_at_knee: float = 0.9
    dt_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.knee_qps > 0:
            raise ConfigError(f"knee_qps {self.knee_qps} must be > 0")
        for name in ("startup_s", "rate_window_s", "scrape_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.dt_s <= self.sync_s:
            raise ConfigError(f"dt_s={self.dt_s} must be in (0, sync_s={self.sync_s}]")


def reaction_time_s(spec: HpaSpec, cfg: SimConfig, start: int, needed: int) -> float:
    """Longest a step in load from ``start`` pods' worth to ``needed`` pods' worth may stay
    over capacity by design: the metric's delay (scrape + rate window), one sync period,
    the scale-up window and policy periods, and the pod start-up."""
    periods = max((p.period_s for p in spec.scale_up.policies), default=0)
    return (cfg.scrape_s + cfg.rate_window_s + cfg.sync_s + spec.scale_up.stabilization_window_s
            + scale_up_steps(start, needed, spec.scale_up) * periods + cfg.startup_s)


@dataclass
class ScenarioResult:
    """Time series (one sample per ``sample_s``) and the over-capacity intervals."""

    name: str
    t_s: list[float] = field(default_factory=list)
    load_qps: list[float] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    per_pod_qps: list[float] = field(default_factory=list)
    over_capacity: list[bool] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)

    @property
    def longest_over_s(self) -> float:
        return max((b - a for a, b in self.intervals), default=0.0)

    @property
    def over_fraction(self) -> float:
        return sum(self.over_capacity) / max(len(self.over_capacity), 1)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "max_replicas": max(self.replicas, default=0),
                "min_replicas": min(self.replicas, default=0),
                "over_capacity_fraction": round(self.over_fraction, 4),
                "over_capacity_intervals": len(self.intervals),
                "longest_over_capacity_s": self.longest_over_s}


def simulate(spec: HpaSpec, cfg: SimConfig, load: Callable[[float], float], duration_s: float,
             *, name: str = "load", initial_replicas: int | None = None,
             sample_s: float = 15.0) -> ScenarioResult:
    """Run the HPA + cluster model for ``duration_s`` against ``load(t)`` requests/s."""
    hpa = Hpa(spec)
    replicas = initial_replicas or spec.min_replicas
    # Pod creation times; the initial pods are Ready at t = 0.
    pods: list[float] = [-cfg.startup_s] * replicas
    window: deque[tuple[float, float]] = deque()  # (time, per-pod qps) for the rate window
    res = ScenarioResult(name)
    over_since: float | None = None
    next_sync, next_sample = cfg.sync_s, 0.0
    steps = round(duration_s / cfg.dt_s)
    for i in range(steps + 1):
        t = i * cfg.dt_s
        ready = sum(1 for c in pods if t - c >= cfg.startup_s)
        q = load(t)
        per_pod = q / ready if ready else math.inf
        over = per_pod > cfg.knee_qps
        if over and over_since is None:
            over_since = t
        elif not over and over_since is not None:
            res.intervals.append((over_since, t))
            over_since = None
        window.append((t, per_pod))
        while window and window[0][0] < t - cfg.rate_window_s - cfg.scrape_s:
            window.popleft()
        if t >= next_sync:
            next_sync += cfg.sync_s
            # What Prometheus + the adapter report now, per pod: its request rate over the
            # rate window that ended one scrape ago, counted only while it was Ready. A pod
            # Ready for less than two scrapes of that window has no rate yet (missing).
            lo, hi = t - cfg.scrape_s - cfg.rate_window_s, t - cfg.scrape_s
            values: list[float] = []
            for c in pods:
                since = max(lo, c + cfg.startup_s)
                if hi - since < cfg.scrape_s:
                    continue
                seen = [v for ts, v in window if since <= ts <= hi and not math.isinf(v)]
                if seen:
                    values.append(sum(seen) / len(seen))
            missing = len(pods) - len(values)
            proposal = metric_proposal(replicas, values, missing, spec.target_qps,
                                       spec.tolerance)
            if spec.cpu_target is not None:
                utils = [min(v / cfg.knee_qps, 1.5) * cfg.cpu_at_knee for v in values]
                proposal = max(proposal, metric_proposal(
                    replicas, utils, missing, spec.cpu_target, spec.tolerance))
            new = hpa.decide(t, replicas, proposal)
            if new > replicas:
                pods.extend([t] * (new - replicas))
            elif new < replicas:
                pods.sort()
                del pods[new:]  # the newest go first
            replicas = new
        if t >= next_sample:
            next_sample += sample_s
            res.t_s.append(t)
            res.load_qps.append(round(q, 3))
            res.replicas.append(replicas)
            res.ready.append(ready)
            res.per_pod_qps.append(round(per_pod, 3) if ready else -1.0)
            res.over_capacity.append(over)
    if over_since is not None:
        res.intervals.append((over_since, steps * cfg.dt_s))
    return res


def scenarios(spec: HpaSpec, cfg: SimConfig) -> dict[str, tuple[Callable[[float], float], float]]:
    """The three load curves, in units of the measured capacity: name -> (load(t), seconds).

    ramp: from 1 to 12 pods' worth of knee load over 40 min, then flat for 20 min;
    spike: 1.5 pods' worth, jumping to 6 pods' worth at 10 min for 15 min;
    diurnal: 24 h, a sinusoid between 1 and 10 pods' worth with its peak at 14:00.
    """
    k = cfg.knee_qps
    cap = spec.max_replicas * k

    def ramp(t: float) -> float:
        return min(k * (1.0 + 11.0 * min(t, 2400.0) / 2400.0), cap)

    def spike(t: float) -> float:
        return k * (6.0 if 600.0 <= t < 1500.0 else 1.5)

    def diurnal(t: float) -> float:
        hours = t / 3600.0
        return k * (5.5 + 4.5 * math.cos(2.0 * math.pi * (hours - 14.0) / 24.0))

    return {"ramp": (ramp, 3600.0), "spike": (spike, 2700.0), "diurnal": (diurnal, 86400.0)}


def _spike_check(spec: HpaSpec, cfg: SimConfig, res: ScenarioResult) -> dict[str, Any]:
    start = math.ceil(1.5 * cfg.knee_qps / spec.target_qps)
    needed = math.ceil(6.0 * cfg.knee_qps / spec.target_qps)
    start = max(start, spec.min_replicas)
    bound = reaction_time_s(spec, cfg, start, min(needed, spec.max_replicas))
    return {"reaction_time_s": bound, "longest_over_capacity_s": res.longest_over_s,
            "ok": res.longest_over_s <= bound and needed <= spec.max_replicas,
            "pods_before": start, "pods_needed": needed}


def _plot(results: Sequence[ScenarioResult], cfg: SimConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.2 * len(results)))
    for ax, r in zip(axes, results, strict=True):
        scale = 3600.0 if r.t_s and r.t_s[-1] > 6 * 3600 else 60.0
        unit = "h" if scale == 3600.0 else "min"
        t = [x / scale for x in r.t_s]
        ax.plot(t, [q / cfg.knee_qps for q in r.load_qps], label="load (pods' worth at knee)",
                color="tab:gray")
        ax.step(t, r.replicas, where="post", label="replicas (desired)", color="tab:blue")
        ax.step(t, r.ready, where="post", label="ready pods", color="tab:green")
        for a, b in r.intervals:
            ax.axvspan(a / scale, b / scale, color="tab:red", alpha=0.2)
        ax.set_title(f"{r.name}: red = load per ready pod above the knee (p99 risk)")
        ax.set_xlabel(unit)
        ax.set_ylabel("pods")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_table(r: ScenarioResult, every_s: float) -> None:
    print(f"\n== {r.name} ==")
    print(f"{'t':>8} {'load qps':>10} {'replicas':>8} {'ready':>6} {'qps/pod':>9}  risk")
    last = -math.inf
    for i, t in enumerate(r.t_s):
        if t - last < every_s and not (i and r.replicas[i] != r.replicas[i - 1]):
            continue
        last = t
        mark = "OVER" if r.over_capacity[i] else ""
        print(f"{t / 60:7.1f}m {r.load_qps[i]:10.1f} {r.replicas[i]:8d} {r.ready[i]:6d} "
              f"{r.per_pod_qps[i]:9.1f}  {mark}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m serve.ops.hpa_sim --help``."""
    p = argparse.ArgumentParser(
        prog="python -m serve.ops.hpa_sim",
        description="Replay ramp, spike and diurnal load through the HPA in k8s/hpa.yaml "
                    "with the per-pod capacity in loadtest/capacity.json; print replicas and "
                    "p99 risk over time, plot them, and check the spike's reaction time.")
    p.add_argument("--hpa", type=Path, default=DEFAULT_HPA, help="HPA manifest")
    p.add_argument("--capacity", type=Path, default=DEFAULT_CAPACITY,
                   help="capacity.json from `make capacity` (knee_qps)")
    p.add_argument("--knee-qps", type=float, default=None,
                   help="override capacity.json's knee_qps (requests/s per pod at the p99 goal)")
    p.add_argument("--startup-s", type=float, default=90.0,
                   help="seconds from pod creation to Ready (model load); longer start-up "
                        "means longer p99 risk after a spike")
    p.add_argument("--cpu-at-knee", type=float, default=0.9,
                   help="CPU utilization of a pod at the knee (models the CPU metric)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder for hpa_sim.json and hpa_sim.png")
    p.add_argument("--print-every-s", type=float, default=300.0,
                   help="table row interval (rows are also printed on every replica change)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        spec = load_hpa(args.hpa)
        knee = args.knee_qps
        if knee is None:
            cap = load_capacity(args.capacity)
            knee = float(cap["knee_qps"])
            if abs(float(cap["target_qps"]) - spec.target_qps) > 1e-9:
                _log.warning("capacity.json target_qps %s != the HPA's averageValue %s; "
                             "run `make capacity` to sync them", cap["target_qps"],
                             spec.target_qps)
        cfg = SimConfig(knee_qps=knee, startup_s=args.startup_s, cpu_at_knee=args.cpu_at_knee)
    except ConfigError as e:
        print(f"hpa_sim: {e.message}", file=sys.stderr)
        return 2
    print(f"HPA: min {spec.min_replicas} max {spec.max_replicas}, target {spec.target_qps} "
          f"req/s per pod (knee {knee}; {spec.target_qps / knee:.0%} of it), CPU target "
          f"{spec.cpu_target}, tolerance {spec.tolerance}; scale-up window "
          f"{spec.scale_up.stabilization_window_s} s, scale-down window "
          f"{spec.scale_down.stabilization_window_s} s; pod start-up {cfg.startup_s} s")
    results = []
    for name, (fn, duration) in scenarios(spec, cfg).items():
        print(f"simulating {name} ({duration / 60:.0f} min of load) ...", flush=True)
        r = simulate(spec, cfg, fn, duration, name=name,
                     sample_s=15.0 if duration <= 4 * 3600 else 60.0)
        results.append(r)
        _print_table(r, args.print_every_s if duration <= 4 * 3600 else 3600.0)
    spike = _spike_check(spec, cfg, next(r for r in results if r.name == "spike"))
    print("\n== summary ==")
    for r in results:
        s = r.summary()
        print(f"{s['name']:8s} replicas {s['min_replicas']}..{s['max_replicas']}, over capacity "
              f"{s['over_capacity_fraction']:.1%} of the time in {s['over_capacity_intervals']} "
              f"interval(s), longest {s['longest_over_capacity_s']:.0f} s")
    verdict = "OK" if spike["ok"] else "FAIL"
    print(f"spike: longest over-capacity interval {spike['longest_over_capacity_s']:.0f} s "
          f"<= scale-up reaction time {spike['reaction_time_s']:.0f} s "
          f"({spike['pods_before']} -> {spike['pods_needed']} pods): {verdict}")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"hpa": asdict(spec), "sim": asdict(cfg), "spike_check": spike,
           "scenarios": {r.name: {**r.summary(), "intervals": r.intervals,
                                  "t_s": r.t_s, "load_qps": r.load_qps, "replicas": r.replicas,
                                  "ready": r.ready} for r in results}}
    (args.out / "hpa_sim.json").write_text(json.dumps(doc, indent=1))
    _plot(results, cfg, args.out / "hpa_sim.png")
    print(f"wrote {args.out / 'hpa_sim.json'} and {args.out / 'hpa_sim.png'}")
    return 0 if spike["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
