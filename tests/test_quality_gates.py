"""The click-quality gates (serve.sidecar.control.quality_gates), NE in
serve.common.quality, the feedback join's label sums, and the rollout waiting for or
rolled back by the gates: in process, synthetic labels with fixed seeds, a fake clock.

Labels are drawn as clicks of a known click probability ``q`` per row (Beta(2, 3), CTR
~0.4 as in the small profile's data); a "model" is a score per row: the truth ``q``
itself (calibrated, informative), ``q`` permuted across rows (what a model trained on
shuffled labels knows: nothing), or ``q`` scaled (miscalibrated).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from serve.common.quality import entropy, logloss, normalized_entropy, summarize
from serve.constants import QUALITY_MIN_LABELS_TO_JUDGE
from serve.metrics import (
    ONLINE_CLICKS_TOTAL,
    ONLINE_LOGLOSS_NATS_TOTAL,
    ONLINE_LOGLOSS_SQ_NATS2_TOTAL,
    ONLINE_ROWS_TOTAL,
    ONLINE_SCORE_TOTAL,
)
from serve.metrics.sidecar import SidecarMetrics
from serve.sidecar.config import FeedbackConfig
from serve.sidecar.control.quality_gates import (
    QualityCounts,
    QualityLimits,
    QualitySnapshot,
    evaluate_quality,
    quality_snapshot,
)
from serve.sidecar.control.rollout import RolloutController, RolloutPhase
from serve.sidecar.services.feedback import FeedbackService, QualityTotals
from serve.state import DesiredState, parse_state
from serve.store.predlog import Prediction, PredictionLogConfig, PredictionLogWriter
from tests.test_rollout import Workers, traffic

STABLE, CANDIDATE = "small-int8-s0", "small-int8-s7"
SERVING = f"{STABLE}_b2d0w2_c{CANDIDATE}"
SEEDS = range(100)


def truth(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels uint8 (n,), click probabilities float64 (n,)) of ``n`` rows."""
    rng = np.random.default_rng(seed)
    q = rng.beta(2, 3, size=n)
    return (rng.random(n) < q).astype(np.uint8), q


def counts(y: np.ndarray, p: np.ndarray) -> QualityCounts:
    ll = logloss(y, p)
    return QualityCounts(n=int(y.shape[0]), clicks=int(y.sum()), score_sum=float(p.sum()),
                         ll_sum=float(ll.sum()), ll_sq_sum=float((ll * ll).sum()))


def split(n: int, seed: int, candidate=lambda q, rng: q) -> QualitySnapshot:
    """A canary split: ``n`` rows per arm, the stable scoring the truth, the candidate
    ``candidate(q, rng)``."""
    y, q = truth(2 * n, seed)
    rng = np.random.default_rng(seed + 10_000)
    return QualitySnapshot(counts(y[:n], q[:n]), counts(y[n:], candidate(q[n:], rng)),
                           STABLE, CANDIDATE)


def by_name(results):
    return {r.name: r for r in results}


# ------------------------------------------------------------------ NE in quality.py


def test_logloss_entropy_and_ne_match_hand_computed_values() -> None:
    y = np.array([1, 0, 1, 0], dtype=np.uint8)
    p = np.array([0.8, 0.2, 0.5, 0.0])
    ll = logloss(y, p)
    assert ll == pytest.approx([-math.log(0.8), -math.log(0.8), math.log(2), 1e-7], rel=1e-6)
    assert entropy(0.5) == pytest.approx(math.log(2))
    assert entropy(0.0) == 0.0 and entropy(1.0) == 0.0
    assert normalized_entropy(math.log(2), 0.5) == pytest.approx(1.0)
    assert normalized_entropy(0.3, 1.0) is None
    s = summarize(y, p)
    assert s.logloss == pytest.approx(float(ll.mean()))
    assert s.ne == pytest.approx(float(ll.mean()) / math.log(2))
    assert s.to_dict()["ne"] == s.ne
    # always predicting the base rate: NE exactly 1
    y2, _ = truth(1000, 0)
    assert summarize(y2, np.full(1000, y2.mean())).ne == pytest.approx(1.0)
    assert summarize(np.zeros(3), np.full(3, 0.1)).ne is None


# ------------------------------------------------------------------ the gates


def test_the_same_model_never_breaches_at_the_defaults() -> None:
    limits = QualityLimits()
    for n in (1000, 5000):
        for seed in SEEDS:
            results = evaluate_quality(split(n, seed), limits)
            assert [r.status for r in results] == ["ok", "ok"], (n, seed, results)


def test_an_uninformative_model_breaches_ne_increase() -> None:
    limits = QualityLimits()
    for seed in SEEDS:
        got = by_name(evaluate_quality(split(2000, seed, lambda q, rng: rng.permutation(q)),
                                       limits))
        assert got["ne_increase"].status == "breached", (seed, got["ne_increase"])
        assert got["ne_increase"].value > limits.max_ne_increase
        assert "NE candidate" in got["ne_increase"].detail


def test_a_miscalibrated_model_breaches_calibration_gap() -> None:
    limits = QualityLimits()
    for seed in range(20):
        got = by_name(evaluate_quality(split(5000, seed, lambda q, rng: q * 1.5), limits))
        assert got["calibration_gap"].status == "breached", (seed, got["calibration_gap"])
        assert "ratio 1.5" in got["calibration_gap"].detail or "ratio 1.4" in \
            got["calibration_gap"].detail


def test_ne_increase_is_the_lower_bound_over_the_pooled_entropy() -> None:
    q = split(3000, 1, lambda q, rng: rng.permutation(q))
    r = by_name(evaluate_quality(q, QualityLimits()))["ne_increase"]
    c, s = q.candidate, q.stable
    h = entropy((c.clicks + s.clicks) / (c.n + s.n))
    d = (c.ll_sum / c.n - s.ll_sum / s.n) / h
    se = math.sqrt((c.logloss_var or 0.0) / c.n + (s.logloss_var or 0.0) / s.n) / h
    assert r.value == pytest.approx(d - QualityLimits().z * se, rel=1e-12)
    g = by_name(evaluate_quality(q, QualityLimits()))["calibration_gap"]
    gap = abs(math.log(c.score_sum / c.clicks)) - abs(math.log(s.score_sum / s.clicks))
    assert g.value == pytest.approx(gap - 2.326 * math.sqrt(1 / c.clicks + 1 / s.clicks))


def test_insufficient_below_min_labels_and_blocking_only_with_min_labels() -> None:
    few = split(999, 0, lambda q, rng: rng.permutation(q))
    for r in evaluate_quality(few, QualityLimits()):
        assert r.status == "insufficient_data" and r.value is None and not r.blocking
        assert r.detail == (f"candidate has 999 of the {QUALITY_MIN_LABELS_TO_JUDGE} labels "
                            f"needed; stable has 999 of the {QUALITY_MIN_LABELS_TO_JUDGE} "
                            "labels needed")
    blocking = QualityLimits(min_labels=3000)
    for r in evaluate_quality(split(2000, 0), blocking):
        assert r.status == "insufficient_data" and r.blocking
    assert all(r.blocking and r.status == "ok"
               for r in evaluate_quality(split(3000, 0), blocking))
    one_class = QualitySnapshot(QualityCounts(n=2000, clicks=0, score_sum=10.0),
                                QualityCounts(n=2000, clicks=0, score_sum=10.0))
    got = by_name(evaluate_quality(one_class, QualityLimits()))
    assert got["ne_increase"].status == "insufficient_data"
    assert "one class only" in got["ne_increase"].detail
    assert got["calibration_gap"].detail == (
        "no calibration ratio for candidate and stable (no clicks, or all scores 0)")


def test_limits_and_counts_are_validated() -> None:
    for bad, match in (({"max_ne_increase": -0.1}, "max_ne_increase"),
                       ({"max_calibration_gap": math.nan}, "max_calibration_gap"),
                       ({"min_labels": -1}, "min_labels"), ({"min_labels": 2.5}, "min_labels"),
                       ({"labels_to_judge_unblocking": 0}, "labels_to_judge_unblocking")):
        with pytest.raises(ValueError, match=match):
            QualityLimits(**bad)
    with pytest.raises(ValueError, match="clicks=3 is more than the n=2 rows"):
        QualityCounts(n=2, clicks=3)
    with pytest.raises(ValueError, match="ll_sum"):
        QualityCounts(n=2, ll_sum=-1.0)


# ------------------------------------------------------------------ reading the families


def families(sums: dict[tuple[str, str], tuple[float, ...]]) -> list[Metric]:
    """The feedback service's counter families for ``{(version, arm): (n, clicks, score,
    ll, ll_sq)}``."""
    out: list[Metric] = []
    for i, name in enumerate((ONLINE_ROWS_TOTAL, ONLINE_CLICKS_TOTAL, ONLINE_SCORE_TOTAL,
                              ONLINE_LOGLOSS_NATS_TOTAL, ONLINE_LOGLOSS_SQ_NATS2_TOTAL)):
        fam = CounterMetricFamily(name, "x", labels=["version", "arm"])
        for (v, a), t in sums.items():
            fam.add_metric([v, a], t[i])
        out.append(fam)
    return out


def test_snapshot_sums_samples_across_families_of_several_pods() -> None:
    pod1 = families({(STABLE, "stable"): (100, 40, 38.0, 60.0, 50.0),
                     (CANDIDATE, "candidate"): (10, 5, 4.0, 6.0, 5.0),
                     (STABLE, "candidate"): (7, 7, 7.0, 7.0, 7.0),   # other series: ignored
                     ("other", "stable"): (9, 9, 9.0, 9.0, 9.0)})
    pod2 = families({(STABLE, "stable"): (50, 10, 12.0, 30.0, 25.0),
                     (CANDIDATE, "candidate"): (20, 5, 6.0, 12.0, 10.0)})
    q = quality_snapshot([*pod1, *pod2], stable_version=STABLE, candidate_version=CANDIDATE)
    assert q.stable == QualityCounts(150, 50, 50.0, 90.0, 75.0)
    assert q.candidate == QualityCounts(30, 10, 10.0, 18.0, 15.0)
    assert quality_snapshot([], stable_version=STABLE, candidate_version=CANDIDATE) == \
        QualitySnapshot(stable_version=STABLE, candidate_version=CANDIDATE)
    # the window since a base; a restarted sidecar (rows went down) counts from 0
    base = quality_snapshot(pod1, stable_version=STABLE, candidate_version=CANDIDATE)
    w = q.minus(base)
    assert w.stable == QualityCounts(50, 10, 12.0, 30.0, 25.0)
    restarted = quality_snapshot(pod2, stable_version=STABLE, candidate_version=CANDIDATE)
    assert restarted.minus(q).candidate == restarted.candidate
    with pytest.raises(ValueError, match="take a new base snapshot"):
        q.minus(QualitySnapshot(stable_version="x", candidate_version=CANDIDATE))
    with pytest.raises(ValueError, match="a whole number"):
        quality_snapshot(families({(STABLE, "stable"): (1.5, 0, 0, 0, 0)}),
                         stable_version=STABLE, candidate_version=CANDIDATE)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        quality_snapshot(families({(STABLE, "stable"): (1, 0, -1.0, 0, 0)}),
                         stable_version=STABLE, candidate_version=CANDIDATE)


def test_snapshot_reads_prometheus_client_counters_too() -> None:
    # what a registry (or a parsed /metrics) yields: sample name ..._total, plus _created
    reg = CollectorRegistry()
    for name in (ONLINE_ROWS_TOTAL, ONLINE_CLICKS_TOTAL, ONLINE_SCORE_TOTAL,
                 ONLINE_LOGLOSS_NATS_TOTAL, ONLINE_LOGLOSS_SQ_NATS2_TOTAL):
        Counter(name.removesuffix("_total"), "x", ["version", "arm"],
                registry=reg).labels(STABLE, "stable").inc(4)
    q = quality_snapshot(reg.collect(), stable_version=STABLE, candidate_version=CANDIDATE)
    assert q.stable == QualityCounts(4, 4, 4.0, 4.0, 4.0)


# ------------------------------------------------------------------ the feedback join's sums


def test_feedback_service_counts_label_sums_that_the_gates_read(tmp_path: Path) -> None:
    writer = PredictionLogWriter(PredictionLogConfig(tmp_path), pid=1, clock=lambda: 1.7e9)
    y, q = truth(400, 3)
    writer.write([Prediction(f"s{i}", STABLE, "stable", 1.7e9, q[i:i + 100].astype(np.float32))
                  for i in range(0, 200, 100)]
                 + [Prediction(f"c{i}", CANDIDATE, "candidate", 1.7e9,
                               q[200 + i:300 + i].astype(np.float32)) for i in range(0, 200, 100)])
    writer.close()
    svc = FeedbackService(FeedbackConfig(log_dir=tmp_path))
    labels = [(f"{p}{i}", j, int(y[off + i + j])) for p, off in (("s", 0), ("c", 200))
              for i in (0, 100) for j in range(100)]
    assert svc.post(labels).results["joined"] == 400
    assert svc.post(labels[:10]).results["duplicate"] == 10  # not counted twice
    got = quality_snapshot(svc.quality_collect(), stable_version=STABLE,
                           candidate_version=CANDIDATE)
    q32 = q.astype(np.float32).astype(np.float64)
    for counted, rows in ((got.stable, slice(0, 200)), (got.candidate, slice(200, 400))):
        want = counts(y[rows], q32[rows])
        assert (counted.n, counted.clicks) == (want.n, want.clicks)
        assert counted.score_sum == pytest.approx(want.score_sum, rel=1e-9)
        assert counted.ll_sum == pytest.approx(want.ll_sum, rel=1e-9)
        assert counted.ll_sq_sum == pytest.approx(want.ll_sq_sum, rel=1e-9)
    # the full scrape has the same counters, and GET /feedback shows the NE per arm
    assert quality_snapshot(svc.collect(), stable_version=STABLE,
                            candidate_version=CANDIDATE) == got
    arms = {(a["version"], a["arm"]): a["online"] for a in svc.status()["arms"]}
    ne = arms[(STABLE, "stable")]["ne"]
    assert ne == pytest.approx(summarize(y[:200], q32[:200]).ne, rel=1e-6)


def test_quality_totals_are_bounded_by_series() -> None:
    t = QualityTotals(max_series=2)
    for v in ("a", "b", "c"):
        t.add((v, "stable"), np.array([0.5]), np.array([1]))
    assert set(t.snapshot()) == {("b", "stable"), ("c", "stable")}


# ------------------------------------------------------------------ in the rollout


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Labels:
    """The feedback service's families, written by hand: label sums per arm."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, str], np.ndarray] = {}

    def add(self, version: str, arm: str, y: np.ndarray, p: np.ndarray) -> None:
        c = counts(y, p)
        s = self.sums.setdefault((version, arm), np.zeros(5))
        s += (c.n, c.clicks, c.score_sum, c.ll_sum, c.ll_sq_sum)

    def families(self) -> list[Metric]:
        return families({k: tuple(float(x) for x in v) for k, v in self.sums.items()})


def desired(**guards) -> DesiredState:
    g = {"interval_s": 5, "min_requests": 10, "min_instances": 100, "max_latency_ratio": 1000,
         "max_score_psi": 100}
    g.update(guards)
    return parse_state({"model": {"version": STABLE}, "rollout": {
        "candidate": CANDIDATE, "mode": "canary", "weight": 0.5, "bake_s": 10, "guards": g}})


def rig(tmp_path: Path) -> tuple[RolloutController, Clock, Labels]:
    """A controller reading healthy worker traffic (tests/test_rollout.py's, sent on each
    tick: the other guards stay ok) and hand-written label sums."""
    clock, labels, workers = Clock(), Labels(), Workers()

    def read() -> list[Metric]:
        traffic(workers)
        return [*workers.families(), *labels.families()]

    ctl = RolloutController(read_families=read,
                            control_file=lambda v: tmp_path / f"{v}.control.json",
                            metrics=SidecarMetrics(), clock=clock, wall_clock=lambda: 1.7e9)
    return ctl, clock, labels


def label_both(labels: Labels, n: int, seed: int, candidate=lambda q, rng: q) -> None:
    y, q = truth(2 * n, seed)
    labels.add(STABLE, "stable", y[:n], q[:n])
    labels.add(CANDIDATE, "candidate", y[n:], candidate(q[n:], np.random.default_rng(seed)))


def test_labels_from_before_the_rollout_do_not_judge_it(tmp_path: Path) -> None:
    ctl, clock, labels = rig(tmp_path)
    # before: a stable arm with a terrible record (constant scores): it must not count
    y, _ = truth(5000, 7)
    labels.add(STABLE, "stable", y, np.full(5000, 0.99))
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    label_both(labels, 1500, 1, lambda q, rng: rng.permutation(q))
    for _ in range(d.rollout.guards.failure_limit - 1):  # breaches in a row first
        clock.t += 5
        assert ctl.tick() is None
    clock.t += 5
    assert ctl.tick() == "rolled_back"
    assert ctl.run is not None and "guard ne_increase breached" in (ctl.run.reason or "")
    status = ctl.status()
    assert status is not None
    ne = next(g for g in status.guards if g.name == "ne_increase")
    assert "(1500 labels)" in ne.detail and ne.status == "breached"


def test_min_labels_blocks_promotion_until_the_gates_judge(tmp_path: Path) -> None:
    ctl, clock, labels = rig(tmp_path)
    d = desired(min_labels=2000)
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    for _ in range(4):  # bake over, no labels: waits on the blocking gates alone
        clock.t += 5
        assert ctl.tick() is None
    assert ctl.run is not None and ctl.run.phase is RolloutPhase.BAKING
    reason = ctl.run.reason or ""
    assert "ne_increase" in reason and "calibration_gap" in reason
    label_both(labels, 2500, 2)
    clock.t += 5
    assert ctl.tick() == "promoted"


def test_without_min_labels_a_rollout_without_labels_promotes(tmp_path: Path) -> None:
    ctl, clock, _ = rig(tmp_path)
    d = desired()
    ctl.declare(d)
    ctl.on_serving(d, SERVING)
    clock.t += 5
    assert ctl.tick() is None
    clock.t += 5
    assert ctl.tick() == "promoted"
    assert ctl.run is not None
    assert [g.status for g in ctl.run.guards[3:]] == ["insufficient_data"] * 2


def test_real_heldout_scores_retrain_passes_uninformative_fails() -> None:
    """The small models' scores on held-out rows, when this checkout has them (the
    bench's numbers, bench/quality_calibration.py): the seed-7 retrain passes both gates,
    the stable's scores permuted and the shuffled-label model (when built) breach
    ne_increase, 5,000 labels per arm, 20 splits; skipped without the models."""
    repo = Path(__file__).resolve().parents[1]
    data = repo / "build" / "small-s0" / "data"
    marts = [repo / "model_store" / f"dlrm-small-int8-s{s}.mar" for s in (0, 7)]
    if not (data / "meta.json").is_file() or not all(m.is_file() for m in marts):
        pytest.skip("needs build/small-s0/data and the small s0/s7 archives in model_store")
    import tempfile

    from bench.quality_calibration import _artifact, score

    with tempfile.TemporaryDirectory() as tmp:
        y, s0 = score(_artifact(marts[0], Path(tmp)), data, 20_000)
        _, s7 = score(_artifact(marts[1], Path(tmp)), data, 20_000)
        shuffled = repo / "model_store" / "dlrm-small-int8-s8-shuffled.mar"
        s8 = score(_artifact(shuffled, Path(tmp)), data, 20_000)[1] if shuffled.is_file() \
            else None
    limits = QualityLimits()
    perm = np.random.default_rng(0).permutation(s0)
    for seed in range(20):
        idx = np.random.default_rng(seed).choice(20_000, size=10_000, replace=False)
        a, b = idx[:5000], idx[5000:]
        good = QualitySnapshot(counts(y[a], s0[a]), counts(y[b], s7[b]))
        assert [r.status for r in evaluate_quality(good, limits)] == ["ok", "ok"], seed
        for worse in (perm, s8):
            if worse is None:
                continue
            bad = QualitySnapshot(counts(y[a], s0[a]), counts(y[b], worse[b]))
            assert by_name(evaluate_quality(bad, limits))["ne_increase"].status == "breached"
