"""Per-stage load-test statistics, the knee of a step ramp, and pass/fail thresholds.

Locust's own percentiles are cumulative or over a rolling 10 s window; a step ramp needs
exact figures per step, measured after each step has settled. :class:`StageRecorder`
collects them from locust's ``request`` event into one :class:`StageStats` per stage of
the load shape (latencies in a log-bucket histogram: bounded memory for hour-long soaks,
1% relative resolution). :func:`summarize` turns the recorded stages into the
``summary.json`` document and the verdict.

Units: latencies in milliseconds, times in seconds since the shape started.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve.common.validate import positive_number
from serve.constants import P99_SLO_MS
from serve.errors import CapacityError, ConfigError
from serve.ops import knee as _knee

__all__ = [
    "LatencyHistogram",
    "StageRecorder",
    "StageStats",
    "Thresholds",
    "find_knee",
    "summarize",
]

# Log buckets: bucket i holds latencies in [_MIN_MS * R^i, _MIN_MS * R^(i+1)); R = 1.01
# gives <= 1% error on any percentile, 0.01 ms .. 10 min in ~1800 buckets.
_MIN_MS = 0.01
_RATIO = 1.01
_LOG_RATIO = math.log(_RATIO)
# Distinct failure reasons kept per stage (reasons carry numbers; keep memory bounded).
_MAX_REASONS = 50


class LatencyHistogram:
    """Latency histogram with 1% relative resolution (ms)."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.n = 0
        self.max_ms = 0.0

    def add(self, ms: float) -> None:
        i = 0 if ms <= _MIN_MS else int(math.log(ms / _MIN_MS) / _LOG_RATIO)
        self.counts[i] += 1
        self.n += 1
        self.max_ms = max(self.max_ms, ms)

    def merge(self, other: LatencyHistogram) -> None:
        self.counts.update(other.counts)
        self.n += other.n
        self.max_ms = max(self.max_ms, other.max_ms)

    def percentile(self, q: float) -> float | None:
        """The q-quantile (0 < q <= 1) in ms, None when empty (bucket mid-point, <= 1% off)."""
        if self.n == 0:
            return None
        rank = max(1, math.ceil(q * self.n))
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return min(_MIN_MS * _RATIO ** (i + 0.5), self.max_ms)
        return self.max_ms  # pragma: no cover - rank <= n always hits above

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "max_ms": self.max_ms,
                "buckets": {str(k): v for k, v in sorted(self.counts.items())}}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LatencyHistogram:
        h = cls()
        h.counts = Counter({int(k): int(v) for k, v in doc.get("buckets", {}).items()})
        h.n = int(doc.get("n", sum(h.counts.values())))
        h.max_ms = float(doc.get("max_ms", 0.0))
        return h


@dataclass
class StageStats:
    """Counts of one stage of a load shape.

    ``requests``/``failures``/``instances`` count every request that completed inside
    the stage; ``measured_*`` and ``latency`` only those completed after the stage
    settled (``start_s + settle_s``), so a step's figures are its steady state.
    ``instances`` counts the instances (B) of successful requests only.
    """

    name: str
    start_s: float
    end_s: float
    users: int
    settle_s: float = 0.0
    slo: bool = True
    requests: int = 0
    failures: int = 0
    instances: int = 0
    measured_requests: int = 0
    measured_failures: int = 0
    measured_instances: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    failure_reasons: Counter[str] = field(default_factory=Counter)

    @property
    def measured_seconds(self) -> float:
        return max(0.0, self.end_s - self.start_s - self.settle_s)

    def record(self, t: float, ms: float, ok: bool, instances: int, reason: str | None) -> None:
        measured = t >= self.start_s + self.settle_s
        self.requests += 1
        if measured:
            self.measured_requests += 1
            self.latency.add(ms)
        if ok:
            self.instances += instances
            if measured:
                self.measured_instances += instances
        else:
            self.failures += 1
            if measured:
                self.measured_failures += 1
            key = (reason or "unknown")[:200]
            if key in self.failure_reasons or len(self.failure_reasons) < _MAX_REASONS:
                self.failure_reasons[key] += 1

    def row(self) -> dict[str, Any]:
        """The stage's figures (rates over the measured window)."""
        secs = self.measured_seconds
        n = self.measured_requests
        p50, p99 = self.latency.percentile(0.50), self.latency.percentile(0.99)
        return {
            "name": self.name, "users": self.users, "start_s": round(self.start_s, 3),
            "end_s": round(self.end_s, 3), "settle_s": round(self.settle_s, 3), "slo": self.slo,
            "requests": self.requests, "failures": self.failures,
            "measured_requests": n,
            "rps": round(n / secs, 3) if secs > 0 else 0.0,
            "instances_per_s": round(self.measured_instances / secs, 3) if secs > 0 else 0.0,
            "p50_ms": None if p50 is None else round(p50, 3),
            "p99_ms": None if p99 is None else round(p99, 3),
            "fail_ratio": round(self.failures / self.requests, 6) if self.requests else 0.0,
        }

    def to_json(self) -> dict[str, Any]:
        doc = {k: getattr(self, k) for k in (
            "name", "start_s", "end_s", "users", "settle_s", "slo", "requests", "failures",
            "instances", "measured_requests", "measured_failures", "measured_instances")}
        doc["latency"] = self.latency.to_json()
        doc["failure_reasons"] = dict(self.failure_reasons.most_common())
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> StageStats:
        s = cls(name=doc["name"], start_s=float(doc["start_s"]), end_s=float(doc["end_s"]),
                users=int(doc["users"]), settle_s=float(doc.get("settle_s", 0.0)),
                slo=bool(doc.get("slo", True)))
        for k in ("requests", "failures", "instances", "measured_requests",
                  "measured_failures", "measured_instances"):
            setattr(s, k, int(doc.get(k, 0)))
        s.latency = LatencyHistogram.from_json(doc.get("latency", {}))
        s.failure_reasons = Counter(doc.get("failure_reasons", {}))
        return s


class StageRecorder:
    """Routes each completed request to the stage it finished in.

    ``clock`` returns seconds since the shape started (the shape's ``get_run_time``).
    Requests after the last stage's end (the stop tail) count in the last stage.
    """

    def __init__(self, stages: Sequence[StageStats], clock: Callable[[], float]) -> None:
        if not stages:
            raise ConfigError("a load shape needs at least one stage")
        self.stages = list(stages)
        self.clock = clock

    def stage_at(self, t: float) -> StageStats:
        for s in self.stages:
            if t < s.end_s:
                return s
        return self.stages[-1]

    def record(self, ms: float, ok: bool, instances: int, reason: str | None = None) -> None:
        t = self.clock()
        self.stage_at(t).record(t, ms, ok, instances, reason)


@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits of a run.

    Attributes:
        p99_goal_ms: latency bound (default the service's goal, ``P99_SLO_MS``). For the step
            shape it is met when at least one step meets it (a knee exists): a ramp is
            meant to push past it. For the other shapes it applies to the merged
            latencies of the stages marked ``slo`` (after each stage settled).
        max_fail_ratio: failed / all requests over the whole run (0 = any wrong answer
            or error fails the run).
        min_gain: a step must raise throughput by this fraction over the knee so far to
            replace it (the knee rule, :mod:`serve.ops.knee`).
    """

    p99_goal_ms: float = P99_SLO_MS
    max_fail_ratio: float = 0.0
    min_gain: float = 0.05

    def __post_init__(self) -> None:
        positive_number("--p99-goal-ms", self.p99_goal_ms)
        if not (0.0 <= self.max_fail_ratio <= 1.0):
            raise ConfigError(f"--max-fail-ratio {self.max_fail_ratio} must be in [0, 1]")
        if not (0.0 <= self.min_gain < 1.0):
            raise ConfigError(f"min_gain {self.min_gain} must be in [0, 1)")


def find_knee(rows: Sequence[dict[str, Any]], thresholds: Thresholds) -> dict[str, Any] | None:
    """The ``knee`` entry of summary.json: :func:`serve.ops.knee.find_knee` (the one knee
    rule, shared with ``make capacity`` and the HTTP benchmark) on ``rows`` with the run's
    goals; None when the first judged step already misses them (or has no requests).
    """
    try:
        knee = _knee.find_knee(rows, thresholds.p99_goal_ms, thresholds.max_fail_ratio,
                               thresholds.min_gain)
    except CapacityError:
        return None
    return knee.summary()


def summarize(shape: str, stages: Sequence[StageStats], thresholds: Thresholds,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``summary.json`` document: per-stage rows, totals, knee, checks and verdict."""
    rows = [s.row() for s in stages]
    requests = sum(s.requests for s in stages)
    failures = sum(s.failures for s in stages)
    fail_ratio = failures / requests if requests else 0.0
    merged = LatencyHistogram()
    for s in stages:
        if s.slo:
            merged.merge(s.latency)
    measured_secs = sum(s.measured_seconds for s in stages if s.slo)
    reasons: Counter[str] = Counter()
    for s in stages:
        reasons.update(s.failure_reasons)
    p50, p99 = merged.percentile(0.50), merged.percentile(0.99)
    totals = {
        "requests": requests, "failures": failures, "fail_ratio": round(fail_ratio, 6),
        "instances": sum(s.instances for s in stages),
        "slo_p50_ms": None if p50 is None else round(p50, 3),
        "slo_p99_ms": None if p99 is None else round(p99, 3),
        "slo_rps": round(sum(s.measured_requests for s in stages if s.slo) / measured_secs, 3)
        if measured_secs > 0 else 0.0,
        "slo_instances_per_s": round(
            sum(s.measured_instances for s in stages if s.slo) / measured_secs, 3)
        if measured_secs > 0 else 0.0,
    }
    # The knee rule skips the rows not judged (the step shape's warm-up).
    knee = find_knee(rows, thresholds) if shape == "step" else None
    checks = [
        {"name": "requests > 0", "value": requests, "limit": 0, "passed": requests > 0},
        {"name": "fail_ratio <= max_fail_ratio", "value": round(fail_ratio, 6),
         "limit": thresholds.max_fail_ratio, "passed": fail_ratio <= thresholds.max_fail_ratio},
    ]
    if shape == "step":
        checks.append({"name": "a step meets p99 <= goal (knee found)",
                       "value": None if knee is None else knee["p99_ms"],
                       "limit": thresholds.p99_goal_ms, "passed": knee is not None})
    else:
        checks.append({"name": "p99 <= goal over the SLO stages", "value": totals["slo_p99_ms"],
                       "limit": thresholds.p99_goal_ms,
                       "passed": p99 is not None and p99 <= thresholds.p99_goal_ms})
    doc: dict[str, Any] = {
        "shape": shape,
        "steps": rows,
        "knee": knee,
        "totals": totals,
        "failure_reasons": dict(reasons.most_common(20)),
        "thresholds": {"p99_goal_ms": thresholds.p99_goal_ms,
                       "max_fail_ratio": thresholds.max_fail_ratio,
                       "min_gain": thresholds.min_gain, "checks": checks},
        "passed": all(c["passed"] for c in checks),
    }
    if extra:
        doc.update(extra)
    return doc
