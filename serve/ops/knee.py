"""The knee of a step ramp: the one rule for the load test, ``make capacity`` and the
HTTP benchmark.

A step ramp raises concurrency (closed-loop users) step by step and measures each step
after it settled. The knee is the step to size by:

1. Walk the steps in order, skipping those not judged (``"slo": False``, the step shape's
   warm-up on a cold server: not a capacity measurement).
2. Stop at the first step that measured no answers, whose p99 is over the goal, or whose
   failure ratio is over the bound: past it, more users only break the goals.
3. Before that stop, a step becomes the knee only if it raises throughput by at least
   ``min_gain`` (5%) over the knee so far: more users for flat throughput only add
   queueing (higher latency for nothing). A flat step does not end the walk, because
   TorchServe's batching can hold throughput flat for a step (two users' requests merged
   onto one worker) and rise again after.

Units: rates in requests/s (``rps``) and instances/s, latencies in ms, ratios 0-1.

When *not* to use it: for a run at one fixed load (steady, soak, spike), judge the p99
of the whole run instead (``loadtest.stats.summarize`` does).

Example::

    steps = [{"users": 1, "rps": 20.0, "p99_ms": 14.0, "fail_ratio": 0.0},
             {"users": 2, "rps": 38.0, "p99_ms": 71.0, "fail_ratio": 0.0}]
    find_knee(steps, p99_goal_ms=P99_SLO_MS).users   # 1: the 2-user step misses the goal

(``serve.constants.P99_SLO_MS`` is the service's goal, the callers' default.)
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serve.errors import CapacityError

__all__ = ["Knee", "find_knee"]

# Keys a step needs (loadtest.stats.StageStats.row() writes them all).
_REQUIRED = ("users", "rps", "p99_ms", "fail_ratio")


@dataclass(frozen=True)
class Knee:
    """The step to size by.

    ``step_index`` indexes the sequence given to :func:`find_knee` (warm-up included).
    ``saturated`` is False when no step broke the goals: the knee is then only a lower
    bound (the ramp did not push hard enough). ``stop_reason`` says where the walk
    stopped and why.
    """

    rps: float
    instances_per_s: float
    users: int
    p50_ms: float
    p99_ms: float
    fail_ratio: float
    step_index: int
    saturated: bool
    stop_reason: str
    name: str = ""

    @property
    def instances_per_request(self) -> float:
        return self.instances_per_s / self.rps if self.rps else 0.0

    def summary(self) -> dict[str, Any]:
        """The short form in a load test's summary.json ``knee``."""
        return {"users": self.users, "rps": self.rps, "instances_per_s": self.instances_per_s,
                "p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "name": self.name}


def _broken(i: int, s: Mapping[str, Any], p99_goal_ms: float,
            max_fail_ratio: float) -> str | None:
    """Why step ``i`` ends the walk, or None when it meets the goals."""
    missing = [k for k in _REQUIRED if s.get(k) is None]
    if missing or not s.get("rps") or s.get("measured_requests") == 0:
        # No answer measured in the step: overloaded past any latency (or too short).
        what = ", ".join(missing) or ("rps" if not s.get("rps") else "measured_requests")
        return (f"step {i} ({s.get('users')} users) measured no requests (no {what}): "
                "overloaded, or lengthen --duration")
    if s["p99_ms"] > p99_goal_ms or s["fail_ratio"] > max_fail_ratio:
        return (f"step {i} ({s['users']} users, {s['rps']:.1f} req/s) has p99 "
                f"{s['p99_ms']:.1f} ms (goal {p99_goal_ms:g}) and fail ratio "
                f"{s['fail_ratio']:.4f} (max {max_fail_ratio:g})")
    return None


def find_knee(steps: Sequence[Mapping[str, Any]], p99_goal_ms: float,
              max_fail_ratio: float = 0.0, min_gain: float = 0.05) -> Knee:
    """The knee of ``steps`` by the rule of the module docstring.

    Args:
        steps: the ramp's steps in order, each with "users", "rps", "p99_ms",
            "fail_ratio" and optionally "instances_per_s", "p50_ms", "name",
            "measured_requests" and "slo" (loadtest's summary.json "steps" rows).
        p99_goal_ms: latency bound a step must meet (``math.inf``: none, the knee is
            then where throughput stops rising).
        max_fail_ratio: failed/all requests a step may have and still count.
        min_gain: throughput gain (fraction) a step needs over the knee so far to
            replace it.
    Raises:
        CapacityError: no judged steps, or the first one already misses the goals.
    """
    if not (p99_goal_ms > 0 and not math.isnan(p99_goal_ms)):
        raise CapacityError(f"p99 goal {p99_goal_ms} ms must be > 0")
    if not 0.0 <= min_gain < 1.0:
        raise CapacityError(f"min_gain {min_gain} must be in [0, 1)")
    judged = [(i, s) for i, s in enumerate(steps) if s.get("slo", True)]
    if not judged:
        raise CapacityError("the load test reported no steps; check its log")
    knee: tuple[int, Mapping[str, Any]] | None = None
    reason = "every step met the goals: the knee is a lower bound; add users or duration"
    saturated = False
    for i, s in judged:
        broken = _broken(i, s, p99_goal_ms, max_fail_ratio)
        if broken is not None:
            saturated, reason = True, broken
            break
        if knee is None or s["rps"] >= knee[1]["rps"] * (1.0 + min_gain):
            knee = (i, s)
    if knee is None:
        raise CapacityError(f"no step meets the goals ({reason}); one instance cannot serve "
                            f"at p99 <= {p99_goal_ms:g} ms even with one user: profile it "
                            "before scaling it")
    i, s = knee
    return Knee(rps=float(s["rps"]), instances_per_s=float(s.get("instances_per_s") or 0.0),
                users=int(s["users"]), p50_ms=float(s.get("p50_ms") or 0.0),
                p99_ms=float(s["p99_ms"]), fail_ratio=float(s["fail_ratio"]), step_index=i,
                saturated=saturated, stop_reason=reason, name=str(s.get("name") or ""))
