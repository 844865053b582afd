"""The sidecar's own metrics: :class:`SidecarMetrics`, kept in plain Python and exposed
by a custom collector (never prometheus_client metric objects, which would write into the
workers' multiprocess directory). Names and label values in :mod:`serve.metrics`.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from serve.metrics import (
    BATCHING_UPDATE_SECONDS,
    BATCHING_UPDATES_TOTAL,
    RECONCILE_RESULTS,
    RECONCILE_TOTAL,
    ROLLOUT_GUARD_THRESHOLD,
    ROLLOUT_GUARD_VALUE,
    ROLLOUT_GUARDS,
    ROLLOUT_PHASE,
    ROLLOUT_PHASES,
    ROLLOUT_WEIGHT,
    SIDECAR_REQUESTS_TOTAL,
    STATE_CONVERGED,
    SWITCH_PHASE,
    SWITCH_PHASES,
    TUNER_BATCH_SIZE,
    TUNER_DECISIONS_TOTAL,
    TUNER_MAX_BATCH_DELAY_SECONDS,
    TUNER_PHASE,
    TUNER_PHASES,
    TUNER_REASONS,
    UPSTREAM_UP,
)

__all__ = [
    "SidecarMetrics",
]


class SidecarMetrics(Collector):
    """The sidecar's own metrics, kept in plain Python (:mod:`serve.metrics` says why).

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
