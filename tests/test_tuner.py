"""The batching tuner's state machine, step by step, on synthetic traffic (no I/O).

A ``Plant`` stands in for TorchServe + the workers: given the serving setting it produces
the cumulative counters the sidecar would read, with a throughput that depends on the
setting (a table per traffic shape). The tuner is the real one.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from serve.errors import ConfigError
from serve.metrics import REQUEST_DURATION_BUCKETS
from serve.metrics.sidecar import SidecarMetrics
from serve.metrics.worker import HandlerMetrics
from serve.sidecar.config import TunerConfig
from serve.sidecar.control.tuner import (
    BatchTuner,
    Counters,
    Setting,
    Traffic,
    TrafficWindow,
    Trial,
    counters_from,
    seed_candidates,
)

S = Setting


@dataclass
class Shape:
    """A traffic: instances per request, requests in flight, and the requests/s each
    setting serves (a setting not in the table serves ``default_rps``)."""

    instances: int
    concurrency: float
    rps: dict[Setting, float]
    default_rps: float = 100.0
    handler_s: float = 0.004   # every request's handler time (one histogram bucket)


@dataclass
class Plant:
    shape: Shape
    t: float = 0.0
    requests: float = 0.0
    instances: float = 0.0
    hsum: float = 0.0
    buckets: list[float] = field(default_factory=lambda: [0.0] * (len(REQUEST_DURATION_BUCKETS) + 1))
    batches: float = 0.0
    ts_lat: float = 0.0
    pending: tuple[Setting, float] | None = None  # a switch TorchServe is applying

    def advance(self, serving: Setting, dt: float) -> Counters:
        rps = self.shape.rps.get(serving, self.shape.default_rps)
        n = rps * dt
        self.t += dt
        self.requests += n
        self.instances += n * self.shape.instances
        self.hsum += n * self.shape.handler_s
        for i, b in enumerate(REQUEST_DURATION_BUCKETS):  # cumulative buckets
            if self.shape.handler_s <= b:
                self.buckets[i] += n
        self.buckets[-1] += n
        self.batches += n / serving.batch_size
        self.ts_lat += self.shape.concurrency * dt * 1e6  # Little: C requests in flight
        return Counters(self.t, self.requests, self.instances, self.hsum, tuple(self.buckets),
                        self.batches, {"v": self.ts_lat}, {"v": self.requests})


SINGLE = Shape(1, 64.0, {S(2, 2): 1000, S(24, 5): 4800, S(32, 5): 4000, S(32, 2): 3000})
RANKING = Shape(250, 4.0, {S(2, 0): 200, S(2, 2): 180, S(2, 5): 170, S(24, 5): 40, S(32, 5): 30})
FAST = TunerConfig(interval_s=1.0, window_s=4.0, settle_s=2.0, min_dwell_s=20.0,
                   min_switch_interval_s=6.0, min_requests=50)


def drive(tuner: BatchTuner, plant: Plant, serving: Setting, seconds: float,
          workers: int = 2, switch_s: float = 2.0) -> Setting:
    """Run the loop for ``seconds``: the tuner's choice serves ``switch_s`` later."""
    t_end = plant.t + seconds
    while plant.t < t_end:
        counters = plant.advance(serving, tuner.config.interval_s)
        if plant.pending is not None and plant.t >= plant.pending[1]:
            serving, plant.pending = plant.pending[0], None
        change = tuner.step(counters, serving, workers)
        if change is not None:
            plant.pending = (change, plant.t + switch_s)
    return serving


def test_config_refuses_bad_values_with_the_rule():
    with pytest.raises(ConfigError, match="p99_goal_ms=0 must be a finite number > 0"):
        TunerConfig(p99_goal_ms=0)
    with pytest.raises(ConfigError, match="shape_change=1.0 must be > 1"):
        TunerConfig(shape_change=1.0)
    with pytest.raises(ConfigError, match="fill=1.5 must be in"):
        TunerConfig(fill=1.5)
    with pytest.raises(ConfigError, match="min_dwell_s=-1 must be a finite number >= 0"):
        TunerConfig(min_dwell_s=-1)


def test_traffic_window_uses_littles_law_and_survives_a_dropped_series():
    a = Counters(0.0, 100, 100, 0.4, (0,) * 7 + (100,) * (len(REQUEST_DURATION_BUCKETS) - 6),
                 10, {"old": 5e6}, {"old": 100})
    buckets = tuple(x * 11 for x in a.handler_buckets)
    # 10 s later: 1000 more requests; the old version's series is gone, a new one has
    # 20e6 us of latency (2 requests in flight on average) over 1000 requests.
    b = Counters(10.0, 1100, 1100, 4.4, buckets, 110, {"new": 20e6}, {"new": 1000})
    t = Traffic.between(a, b, wait_factor=2.0)
    assert t is not None
    assert t.rate_rps == pytest.approx(100.0) and t.instances_per_request == pytest.approx(1.0)
    assert t.concurrency == pytest.approx(2.0)
    # mean e2e 20 ms, mean handler 4 ms -> wait 16 ms; p99 = handler p99 + 2 x 16
    assert t.wait_ms == pytest.approx(16.0)
    assert t.handler_p99_ms is not None
    assert t.p99_ms == pytest.approx(t.handler_p99_ms + 32.0)
    assert t.requests_per_batch == pytest.approx(10.0)
    # counters that went back (the workers restarted) judge nothing
    assert Traffic.between(b, a, 2.0) is None


def test_seed_candidates_follow_the_traffic_shape():
    single = Traffic(10, 44000, 44000, 4400, 4400, 1.0, 64.0, 5.0, 10.0, 25.0, 20.0)
    assert seed_candidates(single, 2, TunerConfig()) == [S(32, 5), S(24, 5), S(32, 2)]
    ranking = Traffic(10, 1800, 450000, 180, 45000, 250.0, 4.0, 20.0, 5.0, 30.0, 2.0)
    # 512 instances per batch at most: two 250-instance requests fill it, so the
    # zero-wait merge only (two requests only when both are already queued)
    assert seed_candidates(ranking, 2, TunerConfig()) == [S(2, 0)]
    big = Traffic(10, 1800, 720000, 180, 72000, 400.0, 8.0, 20.0, 5.0, 30.0, 2.0)
    assert seed_candidates(big, 2, TunerConfig()) == [S(2, 0)]
    # medium requests (100 instances: 5 fit) are searched with a waiting batch
    medium = replace(ranking, instances_per_request=100.0)
    assert seed_candidates(medium, 2, TunerConfig()) == [S(2, 2), S(2, 5)]
    assert seed_candidates(big, 2, TunerConfig(max_batch_size=1)) == [S(1, 0)]
    idle = Traffic(10, 300, 300, 30, 30, 1.0, 0.2, 2.0, 1.0, 4.0, 1.0)
    # batch 1 never waits: no trial of the other delay (it would only measure noise)
    assert seed_candidates(idle, 2, TunerConfig()) == [S(1, 5)]


def test_single_instance_traffic_is_searched_and_the_best_kept():
    decisions = []
    tuner = BatchTuner(FAST, on_decision=decisions.append)
    plant = Plant(SINGLE)
    serving = drive(tuner, plant, S(2, 2), 120)
    assert serving == S(24, 5)
    assert tuner.phase == "settled"
    assert [(d.reason, d.to) for d in decisions] == [
        ("seed", S(32, 5)), ("trial", S(24, 5)), ("trial", S(32, 2)), ("best", S(24, 5))]
    # measured: the incumbent and each trial, one window each
    assert [t.setting for t in tuner.trials] == [S(2, 2), S(32, 5), S(24, 5), S(32, 2)]
    # no two switches closer than the interval
    times = [d.at_s for d in decisions]
    assert all(b - a >= FAST.min_switch_interval_s for a, b in pairwise(times))
    status = tuner.status()
    assert status["setting"] == {"batch_size": 24, "max_batch_delay_ms": 5}
    assert status["decisions"][-1]["reason"] == "best"


def test_dwell_holds_against_load_but_a_new_kind_of_request_is_searched_at_once():
    tuner = BatchTuner(FAST)
    plant = Plant(SINGLE)
    serving = S(2, 2)
    while tuner.phase != "settled":
        serving = drive(tuner, plant, serving, 1)
    n = len(tuner.decisions)
    # more clients, same requests: held for the dwell (20 s here), then searched
    plant.shape = Shape(1, 200.0, SINGLE.rps)
    serving = drive(tuner, plant, serving, 10)
    assert len(tuner.decisions) == n and "min dwell" in tuner.why
    serving = drive(tuner, plant, serving, 30)
    assert len(tuner.decisions) > n and tuner.decisions[n].reason == "seed"
    assert tuner.decisions[n].to == S(100, 5)  # 200 in flight over 2 workers
    while tuner.phase != "settled":
        serving = drive(tuner, plant, serving, 1)
    n, t_change = len(tuner.decisions), plant.t
    plant.shape = RANKING  # another kind of request: no dwell, confirmed over 2 windows
    serving = drive(tuner, plant, serving, 3 * FAST.window_s + 2)
    assert tuner.decisions[n].reason == "seed" and tuner.decisions[n].to == S(2, 0)
    assert tuner.decisions[n].at_s - t_change <= 3 * FAST.window_s + 2
    serving = drive(tuner, plant, serving, 120)
    assert serving == S(2, 0)
    # stable traffic: no more decisions, however long
    m = len(tuner.decisions)
    drive(tuner, plant, serving, 300)
    assert len(tuner.decisions) == m and tuner.phase == "settled"


def test_a_win_inside_the_noise_keeps_what_serves_else_the_seed():
    # 24/5 measures highest, but 32/2 (serving: the last trial) is within 5% of it
    close = Shape(1, 64.0, {S(2, 2): 1000, S(32, 5): 4000, S(24, 5): 4100, S(32, 2): 3950})
    decisions = []
    tuner = BatchTuner(FAST, on_decision=decisions.append)
    serving = drive(tuner, Plant(close), S(2, 2), 120)
    assert [(d.reason, d.to) for d in decisions] == [
        ("seed", S(32, 5)), ("trial", S(24, 5)), ("trial", S(32, 2))]
    assert serving == S(32, 2) and tuner.phase == "settled"
    # 32/2 no longer close: the seed (32/5) is, within its 15% margin of 24/5's 4,100
    tuner.trials[-1] = Trial(S(32, 2), replace(tuner.trials[-1].traffic, instances_per_s=3000.0))
    assert tuner.best().setting == S(32, 5)
    # ...and a clear win over the seed moves it: 4,700 is more than 15% over 4,000
    tuner.trials[2] = Trial(S(24, 5), replace(tuner.trials[2].traffic, instances_per_s=4700.0))
    assert tuner.best().setting == S(24, 5)
    # the seed must meet the goal (up to seed_margin over it: 69 ms) to be kept
    tuner.trials[2] = Trial(S(24, 5), replace(tuner.trials[2].traffic, instances_per_s=4100.0))
    tuner.trials[1] = Trial(S(32, 5), replace(tuner.trials[1].traffic, p99_ms=70.0))
    assert tuner.best().setting == S(24, 5)


def test_the_seed_gets_the_benefit_of_the_p99_estimates_doubt():
    # measured: 2/2 (before the search) 40,423 inst/s at p99~59.9 ms, the seed 1/2 49,074
    # at p99~60.6 ms; wrk then measured p99 96 ms for 2/2 and 52 ms for batch 1
    tuner = BatchTuner(FAST)
    ranking = Traffic(10, 970, 404230, 97, 40423, 415.0, 2.9, 20.0, 5.0, 59.9, 2.0)
    tuner.seed = S(1, 2)
    tuner.trials = [Trial(S(2, 2), ranking),
                    Trial(S(1, 2), replace(ranking, instances_per_s=49074.0, p99_ms=60.6))]
    assert tuner.best().setting == S(1, 2)
    # ...up to seed_margin (15%) over the goal: at 70 ms (> 69) the seed is out
    tuner.trials[1] = Trial(S(1, 2), replace(tuner.trials[1].traffic, p99_ms=70.0))
    assert tuner.best().setting == S(2, 2)
    # a neighbour gets no such doubt
    tuner.seed = S(2, 2)
    tuner.trials = [Trial(S(2, 2), replace(ranking, p99_ms=30.0)),
                    Trial(S(1, 2), replace(ranking, instances_per_s=60000.0, p99_ms=60.6))]
    assert tuner.best().setting == S(2, 2)


def test_a_setting_over_the_goal_loses_even_when_faster():
    fast_but_slow = Shape(1, 64.0, {S(2, 2): 1000, S(32, 5): 4000, S(24, 5): 3500,
                                    S(32, 2): 9000})
    tuner = BatchTuner(FAST)
    plant = Plant(fast_but_slow)
    serving = S(2, 2)
    while plant.t < 200:
        # 32/2 answers the most, but its handler p99 is 90 ms: over the 60 ms goal
        plant.shape.handler_s = 0.09 if serving == S(32, 2) else 0.004
        serving = drive(tuner, plant, serving, 1)
    assert serving == S(32, 5) and tuner.best().setting == S(32, 5)
    # overload: no setting meets the goal, the most instances/s wins
    overloaded = Shape(1, 64.0, {S(2, 2): 1000, S(32, 5): 4000, S(24, 5): 9000,
                                 S(32, 2): 3000}, handler_s=0.09)
    assert drive(BatchTuner(FAST), Plant(overloaded), S(2, 2), 120) == S(24, 5)


def test_a_window_closes_early_on_fast_traffic_only():
    # 10-s windows at most; one closes at 3 s once it holds 2,000 requests
    cfg = TunerConfig(interval_s=1.0, window_s=10.0, quick_window_s=3.0, quick_requests=2000,
                      settle_s=2.0, min_requests=50)
    fast = BatchTuner(cfg)
    plant = Plant(SINGLE)
    drive(fast, plant, S(2, 2), 6)              # 1,000 req/s: 3,000 requests in 3 s
    assert fast.last is not None and fast.last.seconds == pytest.approx(3.0)
    assert fast.trials == []                    # even the first traffic is confirmed
    drive(fast, plant, S(2, 2), 3)
    assert [t.setting for t in fast.trials] == [S(2, 2)]
    assert fast.trials[0].traffic.seconds == pytest.approx(3.0)
    slow, plant = BatchTuner(cfg), Plant(RANKING)
    drive(slow, plant, S(2, 2), 8)              # 180 req/s: the full window
    assert slow.trials == [] and slow.last is None
    drive(slow, plant, S(2, 2), 6)
    assert slow.last is not None and slow.last.seconds == pytest.approx(10.0)


def test_light_load_is_left_alone_unless_it_misses_the_goal():
    # Poisson ranking queries at 40/s on 2 workers: 0.7 requests in flight. Every setting
    # serves that alike (the table says 2/0 would do 20% more: arrival noise), so no
    # switch, and the reason says why.
    light = Shape(250, 0.7, {S(2, 2): 40, S(2, 0): 48})
    decisions = []
    tuner = BatchTuner(FAST, on_decision=decisions.append)
    plant = Plant(light)
    assert drive(tuner, plant, S(2, 2), 120) == S(2, 2)
    assert decisions == [] and tuner.phase == "observing"
    assert ("0.70 requests in flight on average over 2 worker(s) (0.35 per worker, under 0.5)"
            in tuner.why)
    # the same requests in flight over one worker are not light: searched
    assert drive(BatchTuner(FAST), Plant(light), S(2, 2), 120, workers=1) == S(2, 0)
    # the same load once its p99 misses the goal (handler 90 ms): searched too
    slow = Shape(250, 0.7, {S(2, 2): 40, S(2, 0): 48}, handler_s=0.09)
    tuner = BatchTuner(FAST)
    drive(tuner, Plant(slow), S(2, 2), 60)
    assert tuner.decisions and tuner.decisions[0].reason == "seed"
    # more in flight (the load grew): searched as before
    plant.shape = Shape(250, 4.0, light.rps)
    drive(tuner := BatchTuner(FAST), plant, S(2, 2), 60)
    assert tuner.decisions and tuner.decisions[0].reason == "seed"
    with pytest.raises(ConfigError, match="min_queue_per_worker=-1 must be a finite number"):
        TunerConfig(min_queue_per_worker=-1)


def test_too_little_traffic_judges_nothing():
    quiet = Shape(1, 0.1, {}, default_rps=2.0)
    tuner = BatchTuner(FAST)
    drive(tuner, Plant(quiet), S(2, 2), 120)
    assert not tuner.decisions and "fewer than 50" in tuner.why


def test_off_and_blocked_do_nothing():
    tuner = BatchTuner(TunerConfig(enabled=False))
    plant = Plant(SINGLE)
    assert drive(tuner, plant, S(2, 2), 60) == S(2, 2) and tuner.phase == "off"
    on = BatchTuner(FAST)
    for _ in range(30):
        assert on.step(plant.advance(S(2, 2), 1.0), S(2, 2), 2, blocked="a rollout") is None
    assert on.phase == "paused" and on.why == "a rollout"
    on.step(plant.advance(S(2, 2), 1.0), S(2, 2), 2)  # free again: the reason says so
    assert on.phase == "observing" and "free again" in on.why
    on.set_enabled(False, "test")
    assert on.phase == "off" and on.override is None


def test_a_switch_that_never_serves_is_given_up():
    tuner = BatchTuner(FAST)
    plant = Plant(SINGLE)
    serving = S(2, 2)
    while tuner.pending is None:
        tuner.step(plant.advance(serving, 1.0), serving, 2)
    for _ in range(310):  # TorchServe keeps serving 2/2
        tuner.step(plant.advance(serving, 1.0), serving, 2)
        if tuner.decisions[-1].reason == "failed":
            break
    assert tuner.pending is None and tuner.decisions[-1].reason == "failed"
    assert tuner.override == serving and S(32, 5) in tuner.avoid
    drive(tuner, plant, serving, 60)  # the search goes on without the failed setting
    assert all(d.to != S(32, 5) for d in list(tuner.decisions)[1:])


def test_counters_from_real_families():
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    m.observe_requests(200, 30, 30, 0.003)
    m.observe_requests(400, 2, 0, 0.001)
    m.observe_batch(instances=30, requests=30)
    ts_text = ('# TYPE ts_inference_latency_microseconds counter\n'
               'ts_inference_latency_microseconds{model_name="dlrm",model_version="a"} 5000.0\n'
               '# TYPE ts_inference_requests_total counter\n'
               'ts_inference_requests_total{model_name="dlrm",model_version="a"} 32.0\n')
    c = counters_from(reg.collect(), text_string_to_metric_families(ts_text), 7.0)
    assert (c.t, c.requests, c.instances, c.batches) == (7.0, 32, 30, 1)
    assert c.handler_buckets[-1] == 32 and c.handler_sum_s == pytest.approx(0.092)
    assert list(c.ts_latency_us.values()) == [5000.0]
    assert list(c.ts_requests.values()) == [32.0]


def test_metrics_mirror_the_tuner():
    sm = SidecarMetrics()
    sm.set_tuner("trying", S(24, 5))
    sm.observe_tuner_decision("seed")
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in sm.collect() for s in fam.samples}
    assert values[("dlrm_tuner_phase", (("phase", "trying"),))] == 1.0
    assert values[("dlrm_tuner_phase", (("phase", "settled"),))] == 0.0
    assert values[("dlrm_tuner_batch_size", ())] == 24.0
    assert values[("dlrm_tuner_max_batch_delay_seconds", ())] == 0.005
    assert values[("dlrm_tuner_decisions_total", (("reason", "seed"),))] == 1.0
    with pytest.raises(ValueError, match="tuner phase 'bogus'"):
        sm.set_tuner("bogus", None)


def test_p99_estimate_counts_the_batch_fill_delay_once():
    """Batches that never fill make every request wait the max delay: a fixed time, not
    a queueing tail, so the estimate adds it once and doubles only the rest."""
    n = len(REQUEST_DURATION_BUCKETS) + 1
    a = Counters(0.0, 0, 0, 0.0, (0,) * n, 0, {"v": 0.0}, {"v": 0})
    # 1000 requests in 1000 batches (fill 1 of 2), mean handler 2 ms, mean e2e 5 ms
    b = Counters(10.0, 1000, 1000, 2.0, (0,) * 3 + (1000,) * (n - 3), 1000,
                 {"v": 5e6}, {"v": 1000})
    plain = Traffic.between(a, b, 2.0)
    filled = Traffic.between(a, b, 2.0, Setting(2, 2))
    assert plain is not None and filled is not None and plain.handler_p99_ms is not None
    assert plain.wait_ms == pytest.approx(3.0)
    assert plain.p99_ms == pytest.approx(plain.handler_p99_ms + 6.0)
    assert filled.p99_ms == pytest.approx(plain.handler_p99_ms + 2.0 + 2.0 * 1.0)
    # full batches: no fill delay, the whole wait is queueing
    full = Counters(10.0, 1000, 1000, 2.0, b.handler_buckets, 500, {"v": 5e6}, {"v": 1000})
    t = Traffic.between(a, full, 2.0, Setting(2, 2))
    assert t is not None and t.p99_ms == pytest.approx(plain.p99_ms)
    # a delay longer than the wait itself is capped at the wait
    long = Traffic.between(a, b, 2.0, Setting(2, 50))
    assert long is not None and long.p99_ms == pytest.approx(plain.handler_p99_ms + 3.0)


def test_the_traffic_window_rolls_after_window_s_or_a_quick_window():
    """TrafficWindow alone: nothing before ``measure_from``; the first observation opens
    the window; a Traffic once ``window_s`` passed (or ``quick_window_s`` with
    ``quick_requests``), and the next window begins there; restart drops the start."""
    plant, cfg = Plant(SINGLE), replace(FAST, quick_window_s=2.0, quick_requests=10_000)
    window = TrafficWindow()
    window.restart(measure_from=1.5)
    assert window.roll(plant.advance(S(2, 2), 1.0), cfg, S(2, 2)) is None  # t=1 < 1.5
    assert window.start is None
    assert window.roll(plant.advance(S(2, 2), 1.0), cfg, S(2, 2)) is None  # opens at t=2
    assert window.start is not None and window.start.t == 2.0
    assert window.roll(plant.advance(S(2, 2), 3.0), cfg, S(2, 2)) is None  # 3 s < window_s
    traffic = window.roll(plant.advance(S(2, 2), 1.0), cfg, S(2, 2))     # 4 s: a window
    assert traffic is not None and traffic.seconds == pytest.approx(4.0)
    assert traffic.rate_rps == pytest.approx(1000.0) and window.start.t == 6.0
    # 2 s and >= 10000 requests close a quick window (the table's 4800/s for 24/5)
    quick = window.roll(plant.advance(S(24, 5), 2.5), cfg, S(24, 5))
    assert quick is not None and quick.seconds == pytest.approx(2.5)
    window.restart()
    assert window.start is None and window.measure_from == 1.5
    assert window.roll(plant.advance(S(24, 5), 5.0), cfg, S(24, 5)) is None  # reopens
