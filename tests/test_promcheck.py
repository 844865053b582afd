"""Unit tests of the Prometheus pipeline check's arithmetic (serve.ops.promcheck) and the
loopback Prometheus's configuration (serve.ops.prometheus). The real Prometheus runs in
tests/test_prometheus_e2e.py; here a fake answers queries with fixed values."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from serve.errors import ConfigError, ServeError
from serve.ops.loadgen import Answer
from serve.ops.promcheck import bucket_of, check_window
from serve.ops.prometheus import RULE_FILES, PrometheusConfig


class FakeProm:
    """Answers ``value(expr, at)`` from a table keyed by the start of the expression."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values
        self.asked: list[tuple[str, float | None]] = []

    def value(self, expr: str, at: float | None = None) -> float:
        self.asked.append((expr, at))
        for key, v in self.values.items():
            if key in expr:
                return v
        return math.nan


def _answers(n: int, start: float, step: float, latency: float) -> list[Answer]:
    return [Answer(t=start + i * step + latency, status=200, version="v", ok=True,
                   t0=start + i * step) for i in range(n)]


@pytest.mark.parametrize(("value", "bounds"), [
    (0.0004, (0.0, 0.0005)), (0.025, (0.02, 0.025)), (0.0251, (0.025, 0.03)),
    (1.0, (0.5, 1.0)), (2.0, (1.0, math.inf)),
])
def test_bucket_of_is_the_histogram_bucket_that_counts_the_value(value: float,
                                                                 bounds: tuple) -> None:
    assert bucket_of(value) == bounds


def test_check_window_counts_the_window_and_judges_each_value() -> None:
    # 10 requests/s for 100 s, each 20 ms; the window (t_end - 60, t_end] holds 600
    answers = _answers(1000, 0.0, 0.1, 0.02)
    t_end = 80.07  # mid-step: no completion on an edge
    prom = FakeProm({"dlrm:requests_per_second": 10.5, "p99_1m": 0.024, "p50_1m": 0.02,
                     "dlrm_cache_hits_total": 0.75})
    res = check_window(prom, answers, t_end, 0.0,
                       expected_hits=lambda pos: (3 * len(pos), len(pos)))
    assert res["answers_in_window"] == 600
    rows = {r["check"]: r for r in res["rows"]}
    assert rows["QPS (requests/s)"]["loadgen"] == pytest.approx(10.0)
    assert rows["QPS (requests/s)"]["ok"]                    # 5 % off
    assert rows["p99 latency (s)"]["loadgen"] == pytest.approx(0.02)
    assert rows["p99 latency (s)"]["ok"]                     # both in (0.01, 0.025]
    assert rows["cache hit ratio"]["loadgen"] == pytest.approx(0.75)
    assert res["ok"]
    assert all(at == t_end for _, at in prom.asked)          # one instant for all values


def test_check_window_fails_what_is_off() -> None:
    answers = _answers(1000, 0.0, 0.1, 0.02)
    prom = FakeProm({"dlrm:requests_per_second": 11.5, "p99_1m": 0.03,
                     "dlrm_cache_hits_total": 0.70})
    res = check_window(prom, answers, 80.07, 0.0,
                       expected_hits=lambda pos: (3 * len(pos), len(pos)))
    assert [r["ok"] for r in res["rows"]] == [False, False, False]
    assert not res["ok"]


def test_check_window_without_a_cache_reports_the_ratio_only() -> None:
    prom = FakeProm({"dlrm:requests_per_second": 10.0, "p99_1m": 0.02})
    res = check_window(prom, _answers(1000, 0.0, 0.1, 0.02), 80.07, 0.0)
    row = res["rows"][-1]
    assert row["loadgen"] is None and row["ok"] and math.isnan(row["prometheus"])


def test_check_window_refuses_a_window_too_light_for_a_p99() -> None:
    with pytest.raises(ServeError, match="too light"):
        check_window(FakeProm({}), _answers(10, 0.0, 1.0, 0.02), 9.5, 0.0)


def test_prometheus_config_adds_the_service_monitor_labels_and_our_rules(tmp_path: Path) -> None:
    cfg = PrometheusConfig(port=9999, targets=["127.0.0.1:8090"], data_dir=tmp_path)
    doc = cfg.render()
    sc = doc["scrape_configs"][0]["static_configs"][0]
    assert sc == {"targets": ["127.0.0.1:8090"], "labels": {"namespace": "local",
                                                             "pod": "dlrm-serve-0"}}
    assert [Path(p).name for p in doc["rule_files"]] == list(RULE_FILES)
    assert all(Path(p).is_file() for p in doc["rule_files"])
    assert doc["global"]["scrape_interval"] == "1s"
    with pytest.raises(ConfigError, match="targets"):
        PrometheusConfig(port=1, targets=[], data_dir=tmp_path)
