"""The prediction log (serve.store.predlog), quality summaries (serve.common.quality) and the feedback
join (serve.sidecar.services.feedback), in process: exact counts, exact online statistics, bounds."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from serve.common.quality import calibration_ratio, roc_auc, summarize
from serve.errors import ConfigError
from serve.metrics import SCORE_BUCKETS
from serve.sidecar.config import FeedbackConfig
from serve.sidecar.services.feedback import CalibrationWindow, FeedbackService
from serve.store.predlog import (
    Prediction,
    PredictionLogConfig,
    PredictionLogWriter,
    encode,
    iter_log,
    log_files,
    sampled,
    scan,
)
from tests.promtext import samples


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _pred(rid: str, n: int, seed: int, version: str = "v1", arm: str = "stable") -> Prediction:
    rng = np.random.default_rng(seed)
    return Prediction(rid, version, arm, 1_700_000_000.0, rng.random(n, dtype=np.float32))


# ------------------------------------------------------------------ serve.common.quality


def test_summarize_matches_hand_computed_values_and_prometheus_bins() -> None:
    labels = np.array([1, 0, 0, 1, 0], dtype=np.uint8)
    scores = np.array([0.9, 0.1, 0.2, 0.6, 0.001], dtype=np.float64)
    s = summarize(labels, scores)
    assert s.rows == 5
    assert s.observed_ctr == pytest.approx(0.4)
    assert s.predicted_ctr == pytest.approx(float(scores.astype(np.float64).mean()))
    assert s.calibration_ratio == pytest.approx(s.predicted_ctr / 0.4)
    assert s.auc == 1.0 and s.auc == roc_auc(labels, scores)
    # le is inclusive, as in a Prometheus histogram: 0.001 falls in the first bin.
    le = list(SCORE_BUCKETS)
    counts = dict(zip(le, s.score_counts, strict=True))
    assert counts[0.001] == 1 and sum(s.score_counts) == 5
    for v in scores:
        first = next(b for b in le if float(v) <= b)
        assert counts[first] >= 1
    assert summarize(np.zeros(3), np.full(3, 0.2)).auc is None
    assert math.isnan(calibration_ratio(0.2, 0.0))
    with pytest.raises(ConfigError, match="no labelled predictions"):
        summarize(np.zeros(0), np.zeros(0))
    with pytest.raises(ConfigError, match="2 labels for 3 scores"):
        summarize(np.zeros(2), np.zeros(3))


# ------------------------------------------------------------------ serve.store.predlog


def test_writer_then_scan_reads_back_every_record_exactly(tmp_path: Path) -> None:
    w = PredictionLogWriter(PredictionLogConfig(tmp_path), pid=7, clock=Clock())
    preds = [_pred(f"r{i}", n=i + 1, seed=i, arm="stable" if i % 2 else "candidate")
             for i in range(20)]
    assert w.write(preds[:10]) == 10
    assert w.write(preds[10:]) == 10
    w.close()
    got = list(iter_log(tmp_path))
    assert [p.request_id for p in got] == [p.request_id for p in preds]
    for a, b in zip(got, preds, strict=True):
        assert (a.version, a.arm) == (b.version, b.arm)
        assert np.array_equal(a.scores, b.scores)  # bit for bit: float32 stored as is


def test_a_record_is_the_documented_layout_byte_for_byte() -> None:
    """b"DPL1" | u32 meta bytes | u32 n | compact JSON meta | float32 scores, little-endian,
    for float32 (n,) scores and for the ones encode must convert (float64, 2-D, a view)."""
    import json
    import struct

    rng = np.random.default_rng(7)
    cases = [rng.random(3, dtype=np.float32), rng.random(4), rng.random((2, 2)).astype(np.float32),
             rng.random(6, dtype=np.float32)[::2], np.empty(0, np.float32)]
    for i, scores in enumerate(cases):
        p = Prediction(f"req-{i}", "small-int8-s0", "candidate", 1_700_000_000.123456, scores)
        meta = json.dumps({"id": p.request_id, "v": p.version, "a": p.arm, "t": 1_700_000_000.123},
                          separators=(",", ":")).encode()
        flat = np.asarray(scores, dtype="<f4").reshape(-1)
        want = struct.pack("<4sII", b"DPL1", len(meta), flat.size) + meta + flat.tobytes()
        assert encode(p) == want, i


def test_scan_stops_at_a_partial_record_and_resumes_from_it(tmp_path: Path) -> None:
    rec = encode(_pred("a", 4, 0)) + encode(_pred("b", 4, 1))
    path = tmp_path / "0000000000001-1.dpl"
    path.write_bytes(rec[:-3])  # the second record is still being written
    found, off = scan(path, 0)
    assert [r.request_id for r in found] == ["a"]
    with open(path, "ab") as f:
        f.write(rec[-3:])
    more, end = scan(path, off)
    assert [r.request_id for r in more] == ["b"] and end == len(rec)


def test_a_corrupt_file_is_skipped_not_misread(tmp_path: Path) -> None:
    path = tmp_path / "0000000000001-1.dpl"
    path.write_bytes(encode(_pred("a", 2, 0)) + b"garbage!" * 10)
    found, off = scan(path, 0)
    assert [r.request_id for r in found] == ["a"] and off == path.stat().st_size


def test_files_rotate_and_the_folder_stays_within_max_bytes(tmp_path: Path) -> None:
    clock = Clock()
    cfg = PredictionLogConfig(tmp_path, file_bytes=8192, max_bytes=32768)
    w = PredictionLogWriter(cfg, pid=1, clock=clock)
    for i in range(200):  # 200 x ~1.1 KB = 220 KB written in all
        clock.t += 0.01
        w.write([_pred(f"r{i}", 256, i)])
        total = sum(p.stat().st_size for p in log_files(tmp_path))
        assert total <= cfg.max_bytes + 1100, total
    assert len(log_files(tmp_path)) >= 3
    ids = [p.request_id for p in iter_log(tmp_path)]
    assert ids[-1] == "r199" and "r0" not in ids  # the oldest went first


def test_sampling_is_by_request_id_hash_deterministic_and_near_the_rate() -> None:
    ids = [f"req-{i}" for i in range(20_000)]
    picked = [sampled(i, 0.1) for i in ids]
    assert picked == [sampled(i, 0.1) for i in ids]
    assert abs(sum(picked) / len(ids) - 0.1) < 0.01
    assert all(sampled(i, 1.0) for i in ids[:10]) and not any(sampled(i, 0.0) for i in ids[:10])


def test_config_from_env_validates_with_clear_messages(tmp_path: Path) -> None:
    assert PredictionLogConfig.from_env({}) is None
    cfg = PredictionLogConfig.from_env({"DLRM_PREDICTION_LOG_DIR": str(tmp_path),
                                        "DLRM_PREDICTION_LOG_SAMPLE": "0.25"})
    assert cfg is not None and cfg.sample_rate == 0.25 and cfg.directory == tmp_path
    with pytest.raises(ConfigError, match=r"DLRM_PREDICTION_LOG_SAMPLE=1.5 must be a number in \[0, 1\]"):
        PredictionLogConfig.from_env({"DLRM_PREDICTION_LOG_DIR": "x",
                                      "DLRM_PREDICTION_LOG_SAMPLE": "1.5"})
    with pytest.raises(ConfigError, match="DLRM_PREDICTION_LOG_FILE_BYTES='big' is not an integer"):
        PredictionLogConfig.from_env({"DLRM_PREDICTION_LOG_DIR": "x",
                                      "DLRM_PREDICTION_LOG_FILE_BYTES": "big"})
    with pytest.raises(ConfigError, match="must be at least twice"):
        PredictionLogConfig(tmp_path, file_bytes=1 << 20, max_bytes=1 << 20)


def test_a_write_failure_drops_records_and_never_raises(tmp_path: Path) -> None:
    w = PredictionLogWriter(PredictionLogConfig(tmp_path / "log"), pid=1)
    assert w.write([_pred("a", 2, 0)]) == 1
    w.close()
    for p in log_files(tmp_path / "log"):
        p.unlink()
    (tmp_path / "log").rmdir()
    (tmp_path / "log").write_text("not a folder")  # the folder is gone: open() fails
    assert w.write([_pred("b", 2, 1)]) == 0


# ------------------------------------------------------------------ the join


def _service(tmp_path: Path, clock: Clock | None = None, **kw: object) -> FeedbackService:
    cfg = FeedbackConfig(log_dir=tmp_path, **kw)  # type: ignore[arg-type]
    baselines = {"v1": {"rows": 100, "observed_ctr": 0.25, "predicted_ctr": 0.26,
                        "calibration_ratio": 1.04, "auc": 0.8}}
    return FeedbackService(cfg, versions=lambda: ["v1"], baseline_of=baselines.get,
                           clock=clock or Clock())


def test_join_counts_every_outcome_and_the_window_is_exact(tmp_path: Path) -> None:
    w = PredictionLogWriter(PredictionLogConfig(tmp_path), pid=1)
    preds = [_pred(f"r{i}", 8, i) for i in range(50)]
    w.write(preds)
    svc = _service(tmp_path)
    rng = np.random.default_rng(0)
    labels = [(p.request_id, j, int(rng.integers(0, 2))) for p in preds for j in range(8)]
    extra = [("never-seen", 0, 1), ("r3", 8, 1), ("r4", 99, 0)]
    res = svc.post(labels + extra)
    assert res.results == {"joined": 400, "unknown": 1, "expired": 0, "duplicate": 0,
                           "bad_index": 2}
    assert res.joined_by_series == {("v1", "stable"): 400}
    # the same labels again, and a repeat inside one body: duplicates, counted once
    new = _pred("new", 2, 99)
    w.write([new])
    again = svc.post(labels[:10] + [("new", 0, 1), ("new", 0, 1)])
    assert again.results["duplicate"] == 11 and again.results["joined"] == 1
    s = svc.window.summaries()[("v1", "stable")]
    assert s is not None
    y = np.array([lab for _, _, lab in labels] + [1])
    scores = np.concatenate([p.scores for p in preds] + [new.scores[:1]])
    assert s.rows == 401
    assert s.observed_ctr == pytest.approx(y.mean())
    assert s.predicted_ctr == pytest.approx(float(scores.astype(np.float64).mean()), rel=1e-6)
    assert s.auc == pytest.approx(roc_auc(y, scores))


def test_labels_of_a_deleted_log_file_are_expired(tmp_path: Path) -> None:
    w = PredictionLogWriter(PredictionLogConfig(tmp_path), pid=1)
    w.write([_pred("old", 4, 0)])
    w.close()
    svc = _service(tmp_path)
    svc.post([("nothing", 0, 1)])  # indexes "old"
    for p in log_files(tmp_path):
        p.unlink()
    assert svc.post([("old", 0, 1)]).results["expired"] == 1


def test_shadow_requests_label_both_arms(tmp_path: Path) -> None:
    w = PredictionLogWriter(PredictionLogConfig(tmp_path), pid=1)
    w.write([_pred("s", 4, 0, "v1", "stable"), _pred("s", 4, 1, "v2", "candidate")])
    res = _service(tmp_path).post([("s", i, i % 2) for i in range(4)])
    assert res.results["joined"] == 4
    assert res.joined_by_series == {("v1", "stable"): 4, ("v2", "candidate"): 4}


def test_the_window_forgets_by_time_and_by_capacity() -> None:
    clock = Clock()
    win = CalibrationWindow(window_s=60.0, capacity=5, clock=clock)
    keys = np.arange(1, 8, dtype=np.uint64)
    win.add(("v", "stable"), np.full(7, 0.5, np.float32), np.array([1, 0, 1, 0, 1, 1, 1]), keys)
    s = win.summaries()[("v", "stable")]
    assert s is not None and s.rows == 5 and s.observed_ctr == pytest.approx(0.8)  # newest 5
    clock.t += 30
    win.add(("v", "stable"), np.array([0.1], np.float32), np.array([0]), np.array([9], np.uint64))
    clock.t += 31  # the first 5 are now older than 60 s
    s = win.summaries()[("v", "stable")]
    assert s is not None and s.rows == 1 and s.predicted_ctr == pytest.approx(0.1)
    assert win.duplicates(("v", "stable"), np.array([9, 10, 10], np.uint64)).tolist() == [
        True, False, True]


def test_metrics_export_online_and_baseline_values(tmp_path: Path) -> None:
    w = PredictionLogWriter(PredictionLogConfig(tmp_path), pid=1)
    w.write([Prediction("a", "v1", "stable", 0.0, np.array([0.2, 0.4, 0.6, 0.8], np.float32))])
    svc = _service(tmp_path)
    svc.post([("a", 0, 0), ("a", 1, 0), ("a", 2, 1), ("a", 3, 1), ("zzz", 0, 1)])
    reg = CollectorRegistry()
    reg.register(svc)
    got = samples(generate_latest(reg).decode())
    lab = (("arm", "stable"), ("version", "v1"))
    assert got[("dlrm_online_labels", lab)] == 4
    assert got[("dlrm_online_observed_ctr", lab)] == pytest.approx(0.5)
    assert got[("dlrm_online_predicted_ctr", lab)] == pytest.approx(0.5)
    assert got[("dlrm_online_calibration_ratio", lab)] == pytest.approx(1.0)
    assert got[("dlrm_online_auc", lab)] == 1.0
    assert got[("dlrm_baseline_auc", (("version", "v1"),))] == 0.8
    assert got[("dlrm_baseline_predicted_ctr", (("version", "v1"),))] == 0.26
    assert got[("dlrm_feedback_labels_total", (("result", "joined"),))] == 4
    assert got[("dlrm_feedback_labels_total", (("result", "unknown"),))] == 1
    assert got[("dlrm_prediction_log_bytes", ())] == sum(
        os.path.getsize(p) for p in log_files(tmp_path))
    status = svc.status()
    assert status["labels"]["joined"] == 4
    assert status["arms"][0]["online"]["auc"] == 1.0
    assert status["arms"][0]["baseline"]["auc"] == 0.8


def test_without_a_log_every_label_is_unknown() -> None:
    svc = FeedbackService(FeedbackConfig(log_dir=None))
    assert svc.post([("a", 0, 1)]).results["unknown"] == 1
    assert svc.status()["prediction_log"]["dir"] is None
