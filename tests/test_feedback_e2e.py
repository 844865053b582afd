"""Click feedback end to end: the real launcher, TorchServe, sidecar and the trained tiny
model. Held-out rows go through the inference API, their labels come back through
``POST /feedback``, and the stable arm's online AUC and calibration ratio match the
build-time baseline in the version's report (the issue's bars: 0.01 and 0.05)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from serve.api.json_body import example_request
from serve.ops import feedback_check
from serve.store.repository import ModelRepository
from tests.fixtures.served import Served, serve_repository

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class FeedbackServed(Served):
    """The service over the trained tiny version, its held-out data and build report."""

    version: str
    data_dir: Path
    repo_dir: Path
    report: dict[str, Any]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_build) -> Iterator[FeedbackServed]:
    root = tmp_path_factory.mktemp("feedback")
    repo = ModelRepository([root / "model_store"])
    version = tiny_build.version
    repo.add(version, tiny_build.mar, dict(tiny_build.report))
    fields = {"version": version, "data_dir": tiny_build.data_dir,
              "repo_dir": root / "model_store", "report": dict(tiny_build.report)}
    with serve_repository(root, state={"model": {"version": version},
                                       "batching": {"batch_size": 4, "max_batch_delay_ms": 5},
                                       "workers": 1},
                          kind=FeedbackServed, fields=fields,
                          extra_env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def test_the_report_carries_the_baseline(served: FeedbackServed) -> None:
    b = served.report["baseline"]
    assert b["rows"] == served.report["eval_rows"]
    assert b["auc"] == pytest.approx(served.report["auc_quantized"], abs=1e-12)
    assert b["calibration_ratio"] == pytest.approx(b["predicted_ctr"] / b["observed_ctr"])
    assert sum(b["score_counts"]) == b["rows"]
    m = served.metrics()
    assert m[("dlrm_baseline_auc", (("version", served.version),))] == pytest.approx(b["auc"])


def test_held_out_labels_give_the_build_time_auc_and_calibration(served: FeedbackServed,
                                                                  tmp_path: Path) -> None:
    before = served.metrics()
    out = tmp_path / "feedback.json"
    rc = feedback_check.main([
        "--url", served.predict_url, "--sidecar", served.write_url,
        "--token-file", str(served.cfg.token_file), "--repository", str(served.repo_dir),
        "--data-dir", str(served.data_dir), "--json", str(out), "--clients", "2"])
    res = json.loads(out.read_text())
    assert rc == 0, res["checks"]
    rows = res["rows_sent"]
    assert rows == served.report["eval_rows"]
    # every label joined: the handler keys the log by the same id the client got
    assert res["feedback"]["joined"] == rows and res["feedback"]["unknown"] == 0
    assert res["window_rows"] == rows
    assert abs(res["online"]["auc"] - res["baseline"]["auc"]) <= 0.01
    assert abs(res["online"]["calibration_ratio"] - res["baseline"]["calibration_ratio"]) <= 0.05
    # the sidecar's join equals the client's own (same scores, same labels)
    assert res["online"]["auc"] == pytest.approx(res["client_side"]["auc"], abs=1e-9)
    after = served.metrics()
    lab = (("arm", "stable"), ("version", served.version))
    assert after[("dlrm_online_labels", lab)] == rows
    assert after[("dlrm_online_auc", lab)] == pytest.approx(res["online"]["auc"])
    logged = after[("dlrm_prediction_log_records_total", ())] - before.get(
        ("dlrm_prediction_log_records_total", ()), 0.0)
    assert logged == res["requests"]
    assert after[("dlrm_prediction_log_bytes", ())] > 0


def test_unknown_ids_are_counted_and_bad_bodies_get_400_naming_the_field(served: FeedbackServed) -> None:
    r = served.post_feedback({"labels": [{"request_id": "no-such-id", "index": 0, "label": 1}]})
    assert r.status_code == 200 and r.json()["unknown"] == 1
    bad = [
        ({"labels": [{"request_id": "a", "index": 0, "label": 2}]}, "labels.0.label"),
        ({"labels": [{"request_id": "a", "index": -1, "label": 0}]}, "labels.0.index"),
        ({"labels": [{"request_id": "a", "index": 0, "label": True}]}, "labels.0.label"),
        ({"labels": [{"index": 0, "label": 0}]}, "labels.0.request_id"),
        ({"labels": [{"request_id": "a", "index": 0, "label": 0, "x": 1}]}, "labels.0.x"),
        ({"labels": []}, "labels"),
        ({"label": []}, "label"),
        ([1, 2], "body"),
    ]
    for body, field in bad:
        r = served.post_feedback(body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["type"] == "InvalidInput" and field in r.json()["message"], r.text
    assert served.post_feedback({"labels": [{"request_id": "a", "index": 0, "label": 1}]},
                                token=None).status_code == 401
    assert served.post_feedback({"labels": [{"request_id": "a", "index": 0, "label": 1}]},
                                token="wrong").status_code == 403
    r = httpx.post(f"{served.write_url}/feedback", content=b"{not json",
                   headers={"Authorization": f"Bearer {served.token}",
                            "Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["message"]
    # and nothing broke: predictions still answer, with a request id
    p = httpx.post(served.predict_url, content=orjson.dumps(example_request(3, max_id=1000)),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert p.status_code == 200 and len(p.json()["predictions"]) == 3
    assert p.headers.get("x-request-id")
