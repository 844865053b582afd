"""Load-shape plans: steady, step, spike and soak as named stages (no locust import).

The locust ``LoadTestShape`` classes that follow these plans are in
``loadtest/shapes.py``; this module stays free of locust because importing locust
monkey-patches the whole process with gevent (tests and ``loadtest.run`` import this).

Each shape is a plan of named :class:`Stage` windows laid over the run's duration; every
window scales with ``--duration``. Stages carry what the statistics need: a ``settle_s``
prefix excluded from the stage's latency/throughput figures (users still ramping, queues
still filling) and ``slo``: whether the p99 goal applies to the stage.

- ``steady``: ramp to U users over 10% of the run, hold U (one SLO stage).
- ``step``:   a warm-up (10% of the run, at the middle level; not judged: a fresh
  server's embedding cache is cold and its first batches are slow), then equal-length
  steps of increasing users (default doubling 1, 2, 4, ... U); each step is its own
  stage, so the knee (best throughput within the latency goal) can be read off per step.
- ``spike``:  base load B for 40%, a sudden jump to U for 20%, back to B for 40%; the
  base and recovery stages are SLO stages, the spike itself is not (it is meant to
  overload): the run passes when nothing fails and latency recovers.
- ``soak``:   ramp over 5%, then hold U for the rest, reported as four quarters so a
  drift (leak, cache churn) shows as rising p99 from quarter to quarter.

Users here are locust users: closed-loop clients, each with one request in flight.

Example::

    cfg = ShapeConfig("step", duration_s=60, users=(1, 2, 4, 8))
    [s.name for s in build_stages(cfg)]   # ['step-1', 'step-2', 'step-3', 'step-4']
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from serve.errors import ConfigError

__all__ = [
    "DEFAULT_USERS",
    "SHAPES",
    "ShapeConfig",
    "Stage",
    "build_stages",
    "parse_duration",
    "parse_users",
    "stage_at",
    "tick_at",
]

SHAPES = ("steady", "step", "spike", "soak")
# Users when --users is not given: sized for one CPU instance on a small machine; a
# cluster run should pass its own (e.g. --users 1,2,4,8,16,32,64).
DEFAULT_USERS: dict[str, tuple[int, ...]] = {
    "steady": (4,), "step": (1, 2, 4, 8, 16), "spike": (4, 16), "soak": (4,),
}
_MIN_DURATION_S = 5.0
_MAX_DURATION_S = 24 * 3600.0
_MIN_STEP_S = 4.0  # a shorter step has no steady state left after settling
_MAX_USERS = 10_000
_DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


@dataclass(frozen=True)
class Stage:
    """One window of a shape, in seconds since the shape started: [start_s, end_s)."""

    name: str
    start_s: float
    end_s: float
    users: int
    spawn_rate: float      # users started (or stopped) per second on entering the stage
    settle_s: float = 0.0  # excluded from the stage's figures
    slo: bool = True       # the p99 goal applies to this stage


def parse_duration(text: str | float) -> float:
    """Seconds from ``"60s"``, ``"5m"``, ``"1h30m"``, ``"90"`` or a number."""
    if isinstance(text, (int, float)):
        secs = float(text)
    else:
        m = _DURATION_RE.match(text.strip().lower())
        if not m or not any(m.groups()):
            raise ConfigError(f"duration {text!r} is not understood; use e.g. 60s, 5m, 1h30m "
                              "or a number of seconds")
        h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        secs = h * 3600 + mi * 60 + s
    if not (_MIN_DURATION_S <= secs <= _MAX_DURATION_S):
        raise ConfigError(f"duration {secs:g}s is out of range: give {_MIN_DURATION_S:g}s to "
                          f"{_MAX_DURATION_S / 3600:g}h")
    return secs


def parse_users(text: str | None) -> tuple[int, ...] | None:
    """``"16"`` -> (16,); ``"1,2,4,8"`` -> (1, 2, 4, 8); None/"" -> None (shape default)."""
    if text is None or not str(text).strip():
        return None
    try:
        users = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"--users {text!r} must be a number or a comma-separated list of "
                          "numbers, e.g. 16 or 1,2,4,8") from None
    if any(not (1 <= u <= _MAX_USERS) for u in users):
        raise ConfigError(f"--users {text!r}: every value must be in [1, {_MAX_USERS}]")
    return users


@dataclass(frozen=True)
class ShapeConfig:
    """Which shape, how long, how many users.

    ``users`` by shape: steady/soak one value U; step the levels (one value U means
    doubling 1, 2, 4, ... up to U); spike (peak,) or (base, peak), base < peak.
    """

    shape: str
    duration_s: float = 60.0
    users: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ConfigError(f"shape {self.shape!r} is unknown; choose one of "
                              f"{', '.join(SHAPES)} (--shape or env LOAD_SHAPE)")
        parse_duration(self.duration_s)  # range check
        users = self.users if self.users is not None else DEFAULT_USERS[self.shape]
        if any(not (1 <= u <= _MAX_USERS) for u in users) or not users:
            raise ConfigError(f"users {users} must be 1..{_MAX_USERS}")
        if self.shape in ("steady", "soak") and len(users) != 1:
            raise ConfigError(f"shape {self.shape!r} takes one user count, got {users}; "
                              "e.g. --users 8")
        if self.shape == "spike" and (len(users) > 2
                                      or (len(users) == 2 and users[0] >= users[1])):
            raise ConfigError(f"shape 'spike' takes --users PEAK or BASE,PEAK with "
                              f"BASE < PEAK, got {users}")
        if self.shape == "step":
            levels = self.step_levels()
            if list(levels) != sorted(set(levels)):
                raise ConfigError(f"step levels {levels} must be strictly increasing")
            step_s = (self.duration_s - _step_warmup_s(self.duration_s)) / len(levels)
            if step_s < _MIN_STEP_S:
                raise ConfigError(
                    f"{len(levels)} steps in {self.duration_s:g}s (after the warm-up) leave "
                    f"{step_s:.1f}s per step; "
                    f"each step needs >= {_MIN_STEP_S:g}s: lengthen --duration or give fewer "
                    "--users levels")

    @property
    def user_values(self) -> tuple[int, ...]:
        return self.users if self.users is not None else DEFAULT_USERS[self.shape]

    def step_levels(self) -> tuple[int, ...]:
        users = self.user_values
        if len(users) > 1:
            return users
        top, levels, u = users[0], [], 1
        while u < top:
            levels.append(u)
            u *= 2
        return tuple(levels + [top])

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.shape, "duration_s": self.duration_s,
                "users": list(self.user_values)}


def build_stages(cfg: ShapeConfig) -> list[Stage]:
    """The stages of ``cfg``; they tile [0, duration_s) without gaps."""
    d = cfg.duration_s
    users = cfg.user_values
    if cfg.shape == "steady":
        u = users[0]
        ramp = min(max(0.1 * d, 1.0), 30.0)
        return [Stage("ramp", 0.0, ramp, u, u / ramp, 0.0, slo=False),
                Stage("hold", ramp, d, u, u / ramp, 0.0, slo=True)]
    if cfg.shape == "soak":
        u = users[0]
        ramp = min(max(0.05 * d, 1.0), 60.0)
        q = (d - ramp) / 4.0
        return [Stage("ramp", 0.0, ramp, u, u / ramp, 0.0, slo=False)] + [
            Stage(f"hold-{i + 1}", ramp + i * q, ramp + (i + 1) * q if i < 3 else d, u,
                  u / ramp, 0.0, slo=True) for i in range(4)]
    if cfg.shape == "spike":
        peak = users[-1]
        base = users[0] if len(users) == 2 else max(1, peak // 4)
        t1, t2 = 0.4 * d, 0.6 * d
        return [
            # The base stage ramps from 0; its first quarter is excluded as warm-up.
            Stage("base", 0.0, t1, base, max(base / 2.0, 1.0), 0.25 * t1, slo=True),
            # The spike arrives within ~1 s: spawn the whole jump at once.
            Stage("spike", t1, t2, peak, float(peak), 0.0, slo=False),
            # Recovery: the backlog of the spike drains during the settle window.
            Stage("recovery", t2, d, base, float(peak), 0.25 * (d - t2), slo=True),
        ]
    levels = cfg.step_levels()
    warm = _step_warmup_s(d)
    step = (d - warm) / len(levels)
    rate = float(max(levels))  # each step's new users start within ~1 s
    return [Stage("warmup", 0.0, warm, levels[len(levels) // 2], rate, 0.0, slo=False)] + [
        Stage(f"step-{i + 1}", warm + i * step, warm + (i + 1) * step if i < len(levels) - 1
              else d, u, rate, 0.25 * step, slo=True) for i, u in enumerate(levels)]


def _step_warmup_s(duration_s: float) -> float:
    """Warm-up before the first step: 10% of the run, at most 60 s."""
    return min(0.1 * duration_s, 60.0)


def stage_at(stages: list[Stage], t: float) -> Stage | None:
    """The stage running ``t`` seconds after the start, None once the plan is over."""
    for s in stages:
        if t < s.end_s:
            return s
    return None


def tick_at(stages: list[Stage], t: float) -> tuple[int, float] | None:
    """What a locust ``LoadTestShape.tick`` returns at ``t``: (users, spawn rate) or None."""
    s = stage_at(stages, t)
    return None if s is None else (s.users, s.spawn_rate)
