"""The batching tuner: picks TorchServe's batch size and max delay from the traffic it sees.

No one static setting serves every traffic here: single-instance requests from 64
clients want batches of 24-32 requests (the frontend and the per-request handler work
dominate; batch 2 reaches ~0.4x), while ranking requests of 100-700 instances from a few
clients want batch 2 (a batch of 8 makes one worker collect every queued request while
the other idles: measured 2.3x worse). So the sidecar retunes live.

The model behind it (see docs/tuner.md for the measurements):

1. **A queueing seed.** From the pod's own metrics over a window: the requests in the
   system ``C`` (Little's law on TorchServe's cumulative inference latency: microseconds
   of latency accrued per second = requests in flight), the instances per request ``m``
   and the worker count ``W``. Each worker can only batch what is queued for it, about
   ``C / W`` requests, so the seed batch is ``C / W``, capped so a batch holds at most
   ``max_batch_instances`` instances (the forward's latency grows with them). The delay
   is short for big requests (they fill a batch alone) and longer for small ones.
   Requests so big that at most two fit the cap (ranking queries of 100-700 instances)
   get 2 / 0 ms: a batch with no delay never waits (TorchServe's pollBatch polls its
   queue once with no wait and stops), it merges a second request only when one is
   already queued, so a busy pod saves a worker call and an idle one adds nothing.
2. **A bounded online search.** The seed and at most two neighbours (0.75 x the seed
   batch: a batch that waits for the very last request in flight can stall on it; the
   other delay) are each served for one measurement window; the one with the
   highest instances/s whose estimated p99 meets the goal wins, unless a setting within
   ``hysteresis`` of it needs no switch (the one serving), or the seed is within
   ``seed_margin`` of it (one window is noisy: a neighbour must beat the model's answer
   clearly), or the one from before the search is within ``hysteresis``; when no
   setting meets the goal, the most instances/s wins. The search
   costs ``3 x (switch + settle + window)``: ~45 s for single-instance traffic (its
   windows close early: thousands of requests in 3 s); ranking traffic of 100-700
   instances (seed 2 / 0 ms, the shipped default, no neighbours) needs no switch.
3. **Dwell.** The winner is kept at least ``min_dwell_s``; a new search starts only when
   the traffic moves past the ``shape_change`` factor (instances per request or
   concurrency), and no two switches are closer than ``min_switch_interval_s``.
4. **Light load is left alone.** With fewer than ``min_queue_per_worker`` requests in
   flight per worker and the goal met, no search starts: batches cannot form, and each
   switch reloads the workers beside the traffic.

Why not a table from ``make capacity``: it is per machine and per traffic shape, and goes
stale when the model or the pod size changes; the seed needs no table and the search
corrects the seed on the machine it runs on. Why not a cost model fitted from stage
histograms: the handler's time is a minority of a single-instance request's cost (the
Java frontend and the worker protocol are not in our histograms).

The p99 the goal is judged on is an estimate: the workers' handler-time p99 (our
histogram) plus ``wait_factor`` x the mean time a request spends outside the handler
(TorchServe's mean inference latency minus our mean handler time: queueing, batch
collection, frontend). TorchServe exports no latency histogram, so the true client p99
is measured by ``make bench-autotune``, not here.

:class:`BatchTuner` is the state machine; :meth:`BatchTuner.step` is one observation
(the sidecar calls it every ``interval_s`` with cumulative counters) and returns a
setting to apply or None. Phases: ``off``, ``paused`` (a rollout or a switch runs, or
the state is not converged), ``observing`` (measuring the serving setting), ``switching``
(a chosen setting is being applied), ``trying`` (measuring a trial), ``settled``.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from prometheus_client.metrics_core import Metric

from serve.common.histograms import histogram_quantile
from serve.metrics import (
    BATCH_REQUESTS,
    INSTANCES_TOTAL,
    REQUEST_DURATION_BUCKETS,
    REQUEST_DURATION_SECONDS,
    REQUESTS_TOTAL,
    TUNER_REASONS,
)
from serve.phases import TunerPhase
from serve.sidecar.config import TunerConfig
from serve.state import Batching

__all__ = [
    "PHASES",
    "REASONS",
    "BatchTuner",
    "Counters",
    "Decision",
    "Setting",
    "Traffic",
    "TrafficWindow",
    "TunerPhase",
    "counters_from",
    "seed_candidates",
]

PHASES = tuple(p.value for p in TunerPhase)
#: Why the tuner applied a setting (``dlrm_tuner_decisions_total{reason}``): ``seed`` the
#: queueing model's first guess for a new traffic, ``trial`` a neighbour measured in the
#: search, ``best`` the search's winner (back from the last trial), ``failed`` a switch
#: that did not happen (the tuner went back to what serves).
REASONS = TUNER_REASONS
# TorchServe's own cumulative counters (its Prometheus exposition, per model version).
TS_LATENCY_US = "ts_inference_latency_microseconds"
TS_REQUESTS = "ts_inference_requests"


@dataclass(frozen=True)
class Setting:
    """TorchServe batching: requests per batch, ms a batch may wait to fill. The tuner's
    hashable, positional form of the desired state's :class:`~serve.state.Batching`,
    which holds the rules (a setting outside them raises its ValidationError)."""

    batch_size: int
    max_batch_delay_ms: int

    def __post_init__(self) -> None:
        self.batching()

    def batching(self) -> Batching:
        """This setting as the desired state's batching (what the reconciler serves)."""
        return Batching(batch_size=self.batch_size, max_batch_delay_ms=self.max_batch_delay_ms)

    def __str__(self) -> str:
        return f"{self.batch_size}/{self.max_batch_delay_ms}ms"


# --------------------------------------------------------------------------- signals


@dataclass(frozen=True)
class Counters:
    """Cumulative counters read at monotonic time ``t`` (s).

    requests, instances: answered by the workers (all codes). handler_buckets: the
    workers' handler-time histogram, cumulative per ``REQUEST_DURATION_BUCKETS`` bound
    then +Inf; handler_sum_s its sum. ts_latency_us / ts_requests: TorchServe's
    cumulative inference latency and request count, per series (model version): a
    version unregistered by a switch drops its series, so windows difference them series
    by series.
    """

    t: float
    requests: float
    instances: float
    handler_sum_s: float
    handler_buckets: tuple[float, ...]
    batches: float
    ts_latency_us: Mapping[str, float] = field(default_factory=dict)
    ts_requests: Mapping[str, float] = field(default_factory=dict)


def _series_key(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def counters_from(handler: Iterable[Metric], torchserve: Iterable[Metric], t: float) -> Counters:
    """:class:`Counters` from the workers' families (the sidecar's aggregate collector)
    and TorchServe's (parsed from its metrics port), read at ``t``."""
    requests = instances = hsum = batches = 0.0
    bounds = {b: i for i, b in enumerate(REQUEST_DURATION_BUCKETS)}
    buckets = [0.0] * (len(REQUEST_DURATION_BUCKETS) + 1)
    for fam in handler:
        for s in fam.samples:
            if s.name == REQUESTS_TOTAL:
                requests += s.value
            elif s.name == INSTANCES_TOTAL:
                instances += s.value
            elif s.name == f"{REQUEST_DURATION_SECONDS}_sum":
                hsum += s.value
            elif s.name == f"{REQUEST_DURATION_SECONDS}_bucket":
                le = float(s.labels.get("le", "nan"))
                i = len(REQUEST_DURATION_BUCKETS) if math.isinf(le) else bounds.get(le)
                if i is not None:
                    buckets[i] += s.value
            elif s.name == f"{BATCH_REQUESTS}_count":
                batches += s.value
    latency: dict[str, float] = {}
    count: dict[str, float] = {}
    for fam in torchserve:
        for s in fam.samples:
            # The parser names counter samples <family>_total whether or not TorchServe
            # did; compare without the suffix.
            name = s.name.removesuffix("_total")
            if name == TS_LATENCY_US:
                latency[_series_key(s.labels)] = s.value
            elif name == TS_REQUESTS:
                count[_series_key(s.labels)] = s.value
    return Counters(t, requests, instances, hsum, tuple(buckets), batches, latency, count)


def _series_delta(now: Mapping[str, float], before: Mapping[str, float]) -> float:
    """Sum over series of their increase; a new series counts from 0, a series that went
    away or down (a version unregistered, a restart) counts what it has now."""
    total = 0.0
    for key, v in now.items():
        b = before.get(key, 0.0)
        total += v - b if v >= b else v
    return total


def _fill_delay_ms(serving: Setting | None, fill: float | None, wait_ms: float) -> float:
    """The mean wait (ms) a window's requests spent for batches to fill, at most
    ``wait_ms``: ``max_batch_delay_ms`` x the share of the batch left empty (0 when
    batches fill, or the setting or the fill is unknown)."""
    if serving is None or fill is None or serving.batch_size <= 1:
        return 0.0
    empty = min(1.0, max(0.0, (serving.batch_size - fill) / (serving.batch_size - 1)))
    return min(wait_ms, serving.max_batch_delay_ms * empty)


@dataclass(frozen=True)
class Traffic:
    """What one window saw.

    seconds: its length. requests, instances: answered in it. rate_rps: requests/s.
    instances_per_s: the throughput judged. instances_per_request: ``m``.
    concurrency: requests in TorchServe (queued or running) on average, by Little's law
    (None without TorchServe's counters). handler_p99_ms: the workers' p99 handler time.
    wait_ms: mean time outside the handler (None without TorchServe's counters).
    p99_ms: the estimate judged against the goal. requests_per_batch: mean batch fill.
    """

    seconds: float
    requests: int
    instances: int
    rate_rps: float
    instances_per_s: float
    instances_per_request: float
    concurrency: float | None
    handler_p99_ms: float | None
    wait_ms: float | None
    p99_ms: float | None
    requests_per_batch: float | None

    @classmethod
    def between(cls, a: Counters, b: Counters, wait_factor: float,
                serving: Setting | None = None) -> Traffic | None:
        """The window from ``a`` to ``b``; None when it is empty or a counter went back
        (the workers' counters restarted: judge nothing).

        p99 estimate = handler p99 + the batch-fill delay + ``wait_factor`` x the rest of
        the mean wait. The batch-fill delay is the part of the wait that is not queueing:
        a batch that does not fill waits ``serving.max_batch_delay_ms`` for every request
        in it, a fixed time, not a tail, so it is counted once. Its share is how far the
        mean batch falls short of ``serving.batch_size`` ((size - fill) / (size - 1)).
        Measured with 2/2 batching, one closed-loop user of single-instance requests
        (batches never fill): doubling the whole 3.1 ms wait gave 8.1 ms against the
        clients' 6.3 ms p99 (+28%); counting the 2 ms delay once, 6.1 ms (-3%).
        """
        dt = b.t - a.t
        dreq, dinst = b.requests - a.requests, b.instances - a.instances
        if dt <= 0 or dreq <= 0 or dinst < 0 or b.batches < a.batches:
            return None
        cum = [y - x for x, y in zip(a.handler_buckets, b.handler_buckets, strict=True)]
        if any(c < 0 for c in cum):
            return None
        q = histogram_quantile(0.99, REQUEST_DURATION_BUCKETS, cum)
        handler_p99 = q * 1000.0 if q is not None and math.isfinite(q) else None
        mean_handler_ms = max(0.0, b.handler_sum_s - a.handler_sum_s) / dreq * 1000.0
        lat_us = _series_delta(b.ts_latency_us, a.ts_latency_us)
        ts_req = _series_delta(b.ts_requests, a.ts_requests)
        concurrency = wait = None
        if ts_req > 0 and lat_us > 0:
            concurrency = lat_us / 1e6 / dt
            wait = max(0.0, lat_us / ts_req / 1000.0 - mean_handler_ms)
        dbatches = b.batches - a.batches
        p99 = None
        if handler_p99 is not None:
            fill = dreq / dbatches if dbatches > 0 else None
            delay = _fill_delay_ms(serving, fill, wait or 0.0)
            p99 = handler_p99 + delay + wait_factor * max(0.0, (wait or 0.0) - delay)
        return cls(seconds=dt, requests=round(dreq), instances=round(dinst),
                   rate_rps=dreq / dt, instances_per_s=dinst / dt,
                   instances_per_request=dinst / dreq, concurrency=concurrency,
                   handler_p99_ms=handler_p99, wait_ms=wait, p99_ms=p99,
                   requests_per_batch=dreq / dbatches if dbatches > 0 else None)

    def moved_from(self, other: Traffic, factor: float, *, concurrency: bool = True) -> bool:
        """Instances per request (or, with ``concurrency``, the requests in flight)
        changed by more than ``factor``."""
        def far(x: float | None, y: float | None) -> bool:
            if x is None or y is None:
                return False
            lo, hi = sorted((max(x, 1e-9), max(y, 1e-9)))
            return hi / lo > factor
        return (far(self.instances_per_request, other.instances_per_request)
                or (concurrency and far(self.concurrency, other.concurrency)))

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def seed_candidates(traffic: Traffic, workers: int, cfg: TunerConfig) -> list[Setting]:
    """The settings a search measures, best guess first: the queueing seed
    (``fill x C / W``), a smaller batch (``smaller x`` it), and the seed with the other
    delay (duplicates dropped; none with batch 1: a batch of one never waits, so its
    delay changes nothing and a trial of it would only measure noise). Requests so big
    that at most two fit ``max_batch_instances`` get only 2 / 0 ms: it merges two only
    when both are already queued (it matched or beat 1 / 2 and 2 / 2 ms at every load in
    docs/tuner.md, so a trial of them would only measure noise)."""
    m = max(traffic.instances_per_request, 1.0)
    cap = max(1, min(cfg.max_batch_size, int(cfg.max_batch_instances // m)))
    if cap <= 2:
        return [Setting(min(2, cfg.max_batch_size), 0)]
    c = traffic.concurrency if traffic.concurrency is not None else traffic.rate_rps * (
        (traffic.handler_p99_ms or 0.0) / 1000.0)
    per_worker = max(c, 1.0) / max(workers, 1)

    def batch(x: float) -> int:
        return max(1, min(cap, round(x)))

    small = m < cfg.small_request_instances
    delay = cfg.small_delay_ms if small else cfg.large_delay_ms
    other = cfg.large_delay_ms if small else cfg.small_delay_ms
    seed = Setting(batch(cfg.fill * per_worker), delay)
    out: list[Setting] = []
    for s in (seed, Setting(batch(cfg.smaller * cfg.fill * per_worker), delay),
              Setting(seed.batch_size, other)):
        if s not in out and (s.batch_size > 1 or s == seed):
            out.append(s)
    return out


# --------------------------------------------------------------------------- the machine


@dataclass(frozen=True)
class Trial:
    """One setting measured for the current search."""

    setting: Setting
    traffic: Traffic

    def meets(self, goal_ms: float) -> bool:
        return self.traffic.p99_ms is not None and self.traffic.p99_ms <= goal_ms

    def to_json(self) -> dict[str, Any]:
        return {"setting": asdict(self.setting), "traffic": self.traffic.to_json()}


@dataclass(frozen=True)
class Decision:
    """A setting the tuner applied: when (monotonic s), from what, to what, why."""

    at_s: float
    from_: Setting | None
    to: Setting
    reason: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"at_s": round(self.at_s, 3),
                "from": asdict(self.from_) if self.from_ is not None else None,
                "to": asdict(self.to), "reason": self.reason, "detail": self.detail}


@dataclass
class TrafficWindow:
    """The tuner's measurement window: the counters where it began (``start``), and from
    when (monotonic s, after a switch's settle time) it may begin (``measure_from``)."""

    start: Counters | None = None
    measure_from: float = -math.inf

    def restart(self, measure_from: float | None = None) -> None:
        """Begin anew at the next observation from ``measure_from`` (None: as before)."""
        self.start = None
        if measure_from is not None:
            self.measure_from = measure_from

    def roll(self, counters: Counters, cfg: TunerConfig, serving: Setting | None) -> Traffic | None:
        """A Traffic once ``window_s`` has passed since the window began (or
        ``quick_window_s`` with ``quick_requests``); the next window begins here."""
        start = self.start
        if counters.t < self.measure_from:
            return None
        if start is None:
            self.start = counters
            return None
        span = counters.t - start.t
        quick = (span >= cfg.quick_window_s
                 and counters.requests - start.requests >= cfg.quick_requests)
        if span < cfg.window_s and not quick:
            return None
        self.start = counters
        return Traffic.between(start, counters, cfg.wait_factor, serving)


class BatchTuner:
    """The tuner's state machine (see the module docstring). Not thread-safe: one task
    drives it. Every method but :meth:`step` is a step of it, testable alone.

    Args:
        config: thresholds and intervals.
        clock: monotonic seconds (for the dwell and the switch interval).
        on_decision: called with each decision (the sidecar's metric counter).
    """

    def __init__(self, config: TunerConfig, *, clock: Callable[[], float] = time.monotonic,
                 on_decision: Callable[[Decision], None] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.on_decision = on_decision
        self.enabled = config.enabled
        self.phase: TunerPhase = TunerPhase.OBSERVING if self.enabled else TunerPhase.OFF
        self.why: str = "" if self.enabled else "turned off by configuration"
        self.serving: Setting | None = None      # what TorchServe serves now
        self.pending: Setting | None = None      # chosen, not serving yet
        self.pending_since = 0.0
        self.override: Setting | None = None     # what the tuner asks the reconciler for
        self.shape: Traffic | None = None        # the traffic the serving setting was chosen for
        self.last: Traffic | None = None         # the last window
        self.trials: list[Trial] = []
        self.seed: Setting | None = None         # the current search's seed
        self.queue: list[Setting] = []           # settings still to try in this search
        self.decisions: deque[Decision] = deque(maxlen=config.history)
        self.avoid: set[Setting] = set()         # settings whose switch never served
        self.last_switch_at = -math.inf
        self.settled_at = -math.inf
        self.window = TrafficWindow()
        self._deferred: tuple[Setting, str, str] | None = None  # held by the interval
        self._confirm: Traffic | None = None  # a new traffic seen once, to be confirmed
        self._after_switch: TunerPhase = TunerPhase.SETTLED

    # ---- control ------------------------------------------------------------------

    def set_enabled(self, enabled: bool, why: str) -> None:
        """Turn the tuner on (it starts from what serves) or off (the declared batching
        serves again: the override is dropped)."""
        self.enabled = enabled
        self.why = why
        self.avoid.clear()
        self._restart_search()
        self.pending = None
        self.override = None
        self.phase = TunerPhase.OBSERVING if enabled else TunerPhase.OFF

    def _restart_search(self) -> None:
        self.trials, self.queue, self.shape, self.seed = [], [], None, None
        self.window.restart()
        self._deferred = self._confirm = None

    # ---- one observation ------------------------------------------------------------

    def step(self, counters: Counters, serving: Setting | None, workers: int,
             blocked: str | None = None) -> Setting | None:
        """One observation: the cumulative ``counters`` now, the setting TorchServe
        serves (None: nothing serves), its ``workers``, and why the tuner must not act
        now (a rollout, a switch, not converged; None: free). Returns a setting to apply
        now (the caller hands it to the reconciler), or None."""
        if not self.enabled:
            self.phase = TunerPhase.OFF
            return None
        now = counters.t
        if self.pending is not None:
            # Its own switch: done once the chosen setting serves and the reconciler is
            # converged again (the old version drained and unregistered: measuring while
            # it goes would charge the clean-up to the new setting).
            return self._await_switch(serving if blocked is None else None, now)
        if blocked is not None or serving is None:
            self.why = blocked or "nothing serves"
            if self.phase is TunerPhase.TRYING:  # a search cut short: start over afterwards
                self._restart_search()
            self.phase = TunerPhase.PAUSED
            self.window.restart()
            return None
        if self._deferred is not None:
            setting, reason, detail = self._deferred
            return self._apply(now, setting, reason, detail)
        if serving != self.serving:  # first look, or someone else changed it
            self.serving = serving
            self._restart_search()
            self.window.restart(now + self.config.settle_s)
        if self.phase is TunerPhase.PAUSED:
            self.phase = TunerPhase.SETTLED if self.shape is not None else TunerPhase.OBSERVING
            self.why = "free again: measuring a window of traffic"
        traffic = self.window.roll(counters, self.config, self.serving)
        if traffic is None:
            return None
        self.last = traffic
        if traffic.requests < self.config.min_requests:
            self.why = (f"{traffic.requests} requests in {traffic.seconds:.0f} s: fewer than "
                        f"{self.config.min_requests}, nothing to judge")
            return None
        if self.phase is TunerPhase.TRYING:
            return self.judge_trial(traffic, workers, now)
        return self.consider(traffic, workers, now)

    def _await_switch(self, serving: Setting | None, now: float) -> Setting | None:
        """A chosen setting is being applied: measure from when it serves (``serving``
        None: not known to serve yet)."""
        pending = self.pending
        if pending is None:
            return None
        if serving == pending:
            self.serving, self.pending = serving, None
            self.window.restart(now + self.config.settle_s)
            self.phase = self._after_switch
            if self.phase is TunerPhase.SETTLED:
                self.settled_at = now
            return None
        self.phase = TunerPhase.SWITCHING
        # The reconciler retries a failed switch with back-off; give up after the longest
        # plausible switch and go back to what serves.
        if now - self.pending_since > 300.0:
            self._decide(now, self.serving, "failed",
                         f"{pending} did not serve within 300 s; keeping {self.serving} and not "
                         f"trying {pending} again (GET /state shows the switch's error)")
            self.avoid.add(pending)
            self.pending = None
            self.override = self.serving
            self._restart_search()
            self.phase = TunerPhase.OBSERVING
        return None

    def consider(self, traffic: Traffic, workers: int, now: float) -> Setting | None:
        """Observing or settled: start a search when the traffic is new (or moved past
        ``shape_change``) and the dwell allows it; else keep the serving setting."""
        serving = self.serving
        if serving is None:
            return None
        new = self.shape is None or traffic.moved_from(self.shape, self.config.shape_change)
        broken = (traffic.p99_ms is not None and traffic.p99_ms > self.config.p99_goal_ms)
        if not new and not broken:
            self.why = f"keeping {serving}: the traffic has not moved"
            return None
        light = self.config.min_queue_per_worker * max(workers, 1)
        if not broken and traffic.concurrency is not None and traffic.concurrency < light:
            self.why = (f"keeping {serving}: {traffic.concurrency:.2f} requests in flight on "
                        f"average over {workers} worker(s) ({traffic.concurrency / max(workers, 1):.2f}"
                        f" per worker, under {self.config.min_queue_per_worker:g}): batches "
                        "rarely hold two requests, so no setting serves this load better")
            return None
        # The dwell holds against load moving (requests in flight); a different kind of
        # request (single items after ranking) is searched for at once.
        kind = self.shape is None or traffic.moved_from(self.shape, self.config.shape_change,
                                                        concurrency=False)
        if (self.phase is TunerPhase.SETTLED and not kind
                and now - self.settled_at < self.config.min_dwell_s):
            self.why = (f"traffic moved, but {serving} was chosen "
                        f"{now - self.settled_at:.0f} s ago (min dwell "
                        f"{self.config.min_dwell_s:.0f} s)")
            return None
        # A window that straddles a change of traffic is a blend of both: search only
        # once two windows in a row agree on the new traffic. This holds for the first
        # traffic too: its first window usually blends idle time with the load's start
        # (measured: a seed of 12 for 64 clients, from 24 in flight).
        confirm = self._confirm
        if new and (confirm is None or traffic.moved_from(confirm, self.config.shape_change)):
            self._confirm = traffic
            self.why = "the traffic moved; confirming it over one more window"
            return None
        self._confirm = None
        self.shape = traffic
        self.trials = [Trial(serving, traffic)]
        candidates = seed_candidates(traffic, workers, self.config)
        self.seed = candidates[0]
        self.queue = [s for s in candidates if s != serving and s not in self.avoid]
        if not self.queue:
            return self._finish(now)
        self.phase = TunerPhase.TRYING
        return self._apply(now, self.queue.pop(0), "seed", self._describe(traffic, workers))

    def judge_trial(self, traffic: Traffic, workers: int, now: float) -> Setting | None:
        """A trial's window is in: record it, then the next trial or the winner."""
        serving = self.serving
        if serving is None:
            return None
        # Requests in flight depend on the setting under trial (closed-loop clients
        # come back sooner when it is faster), so only the request size says that the
        # traffic itself changed under the search: then start over for the new one.
        if self.shape is not None and traffic.moved_from(self.shape, self.config.shape_change,
                                                         concurrency=False):
            self.phase = TunerPhase.OBSERVING
            self.shape = None
            return self.consider(traffic, workers, now)
        self.trials.append(Trial(serving, traffic))
        if self.queue:
            return self._apply(now, self.queue.pop(0), "trial",
                               f"measured {serving}: {self._score(traffic)}")
        return self._finish(now)

    def best(self) -> Trial:
        """The search's winner among trials that meet the goal (when none does, among
        all: overload; the seed meets it up to ``seed_margin`` over it): the highest
        instances/s, unless, in this order, the one serving now (the last trial: no
        switch) is within ``hysteresis`` of it, the seed is within ``seed_margin``, or the
        one that served before the search (the first) is within ``hysteresis``."""
        cfg = self.config
        good = [t for t in self.trials if t.meets(cfg.p99_goal_ms)]
        # The seed gets the benefit of the estimate's doubt (seed_margin over the goal).
        seed = next((t for t in self.trials if t.setting == self.seed
                     and t.meets(cfg.p99_goal_ms * (1 + cfg.seed_margin))), None)
        if seed is not None and not any(seed is g for g in good):
            good.append(seed)
        # None meets the goal (overload): still the most instances/s, which drains the
        # queue fastest; the p99 estimate of an overloaded window is mostly queueing.
        good = good or self.trials
        top = max(good, key=lambda t: t.traffic.instances_per_s)
        # A difference inside the noise is not worth a switch, nor worth leaving the
        # model's answer for (measured: the same setting moves 10-30% between windows).
        for t, margin in ((self.trials[-1], cfg.hysteresis), (seed, cfg.seed_margin),
                          (self.trials[0], cfg.hysteresis)):
            if (t is not None and any(t is g for g in good)
                    and t.traffic.instances_per_s * (1 + margin) >= top.traffic.instances_per_s):
                return t
        return top

    def _finish(self, now: float) -> Setting | None:
        winner = self.best()
        self.queue = []
        summary = "; ".join(f"{t.setting}: {self._score(t.traffic)}" for t in self.trials)
        if winner.setting == self.serving:
            self.phase, self.settled_at = TunerPhase.SETTLED, now
            self.why = f"chose {winner.setting} (serving) of {summary}"
            return None
        return self._apply(now, winner.setting, "best", f"winner of {summary}")

    def _apply(self, now: float, setting: Setting, reason: str, detail: str) -> Setting | None:
        """Ask for ``setting`` unless the last switch was too recent (then it waits, and
        an observation after the interval asks)."""
        wait = self.last_switch_at + self.config.min_switch_interval_s - now
        if wait > 0:
            self._deferred = (setting, reason, detail)
            self.why = f"next: {setting} in {wait:.0f} s (min switch interval)"
            return None
        self._deferred = None
        self._decide(now, self.serving, reason, detail, to=setting)
        self.pending, self.pending_since, self.override = setting, now, setting
        self._after_switch = TunerPhase.SETTLED if reason == "best" else TunerPhase.TRYING
        self.last_switch_at = now
        self.phase = TunerPhase.SWITCHING
        return setting

    def _decide(self, now: float, from_: Setting | None, reason: str, detail: str,
                to: Setting | None = None) -> None:
        d = Decision(now, from_, to if to is not None else (from_ or Setting(1, 0)), reason,
                     detail)
        self.decisions.append(d)
        self.why = f"{reason}: {d.to} ({detail})"
        if self.on_decision is not None:
            self.on_decision(d)

    def _score(self, t: Traffic) -> str:
        p99 = f"{t.p99_ms:.1f}" if t.p99_ms is not None else "?"
        return f"{t.instances_per_s:.0f} inst/s, p99~{p99} ms"

    def _describe(self, t: Traffic, workers: int) -> str:
        c = f"{t.concurrency:.1f}" if t.concurrency is not None else "?"
        return (f"traffic {t.instances_per_request:.1f} instances/request, {t.rate_rps:.0f} "
                f"req/s, {c} in flight over {workers} workers; serving "
                f"{self.serving}: {self._score(t)}")

    # ---- GET /state ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What GET /tuner and GET /state show."""
        cfg = self.config
        return {
            "enabled": self.enabled,
            "phase": self.phase.value,
            "reason": self.why,
            "setting": asdict(self.override) if self.override is not None else None,
            "serving": asdict(self.serving) if self.serving is not None else None,
            "pending": asdict(self.pending) if self.pending is not None else None,
            "p99_goal_ms": cfg.p99_goal_ms,
            "traffic": self.last.to_json() if self.last is not None else None,
            "searched_for": self.shape.to_json() if self.shape is not None else None,
            "trials": [t.to_json() for t in self.trials],
            "queue": [asdict(s) for s in self.queue],
            "decisions": [d.to_json() for d in self.decisions],
            "config": {k: v for k, v in asdict(cfg).items() if k != "enabled"},
        }

    def with_goal(self, p99_goal_ms: float) -> None:
        """Change the goal (PUT /tuner); the next window judges with it."""
        self.config = replace(self.config, p99_goal_ms=p99_goal_ms)
        self._restart_search()
        if self.enabled and self.pending is None:
            self.phase = TunerPhase.OBSERVING
