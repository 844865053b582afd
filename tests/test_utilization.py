"""serve.sidecar.control.utilization: the capacity and utilization arithmetic that the
prometheus-adapter rule and make hpa-sim share, and the work counter the workers write."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from serve.metrics import CAPACITY_WORK_SECONDS_TOTAL
from serve.metrics.worker import HandlerMetrics
from serve.sidecar.control.utilization import (
    BUSY_AT_KNEE,
    UTILIZATION_TARGET,
    WorkModel,
    capacity_work_per_s,
    utilization_ratio,
)


def test_capacity_is_ready_workers_times_busy_at_knee():
    assert capacity_work_per_s(2) == pytest.approx(2 * BUSY_AT_KNEE)
    assert capacity_work_per_s(4, 0.25) == pytest.approx(1.0)
    assert capacity_work_per_s(0) == 0.0


@pytest.mark.parametrize("work,window,workers,busy,want", [
    (48.0, 60.0, 2, 0.5, 0.8),       # 0.8 work-s/s over 2 x 0.5: the HPA's target
    (60.0, 60.0, 2, 0.5, 1.0),       # at the knee
    (30.0, 60.0, 1, 0.5, 1.0),
    (0.0, 60.0, 2, 0.5, 0.0),
    (6.0, 60.0, 0, 0.5, 0.2),        # no READY worker: divide by one worker (clamp_min)
])
def test_utilization_ratio_hand_computed(work, window, workers, busy, want):
    assert utilization_ratio(work, window, workers, busy) == pytest.approx(want, abs=1e-12)


def test_target_is_eighty_percent():
    assert UTILIZATION_TARGET == 0.8


def test_errors_state_the_value_and_the_rule():
    with pytest.raises(ValueError, match=r"window_s=0 must be > 0"):
        utilization_ratio(1.0, 0, 2)
    with pytest.raises(ValueError, match=r"work_seconds=-1.0 must be >= 0"):
        utilization_ratio(-1.0, 60.0, 2)
    with pytest.raises(ValueError, match=r"busy_at_knee=1.5 must be in \(0, 1\]"):
        capacity_work_per_s(2, 1.5)
    with pytest.raises(ValueError, match=r"ready_workers=-1 must be >= 0"):
        capacity_work_per_s(-1)


def test_work_model():
    w = WorkModel(36e-6, 22.8e-6)
    assert w.seconds(1) == pytest.approx(58.8e-6)
    assert w.seconds(400) == pytest.approx(36e-6 + 400 * 22.8e-6)
    with pytest.raises(ValueError, match=r"instances_per_request=0 must be a finite number >= 1"):
        w.seconds(0)
    with pytest.raises(ValueError, match=r"both >= 0 and not both 0"):
        WorkModel(0, 0)


def test_the_work_counter_counts_each_batch_once():
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    m.observe_requests(200, 32, 32, 0.004)  # a batch of 32: the histogram repeats 0.004 x 32
    m.observe_work(0.004)
    m.observe_work(0.010)
    assert reg.get_sample_value(CAPACITY_WORK_SECONDS_TOTAL) == pytest.approx(0.014)
    assert reg.get_sample_value("dlrm_request_duration_seconds_sum") == pytest.approx(0.128)
    with pytest.raises(ValueError, match=r"work seconds=-0.1 must be >= 0"):
        m.observe_work(-0.1)
