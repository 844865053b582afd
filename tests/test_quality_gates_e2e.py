"""The click-quality gates end to end: the real launcher, TorchServe, sidecar and the
trained tiny model, held-out rows sent through a canary and their labels posted back.

Versions (``tests/fixtures/pipeline.py``'s tiny build, no second training):

* stable ``tiny-int8-s0``;
* bad ``tiny-int8-s0-shuffled``: the tiny build trained on permuted labels (the fixture
  ``tiny_build_shuffled``, which ``test_rollout_e2e`` builds too), AUC ~0.5: it predicts
  about the base rate for everyone, calibrated, so NE is what catches it;
* good ``tiny-int8-s0-copy``: the stable's artifact under another version name.

Each rollout is a canary at weight 0.5 with ``min_labels`` set (the gates block), the
score PSI guard off (``max_score_psi: 100``: the shuffled model's scores would trip it
first) and the default latency guard. The held-out rows (4,000) go through the
inference API twice, in requests of 16 (every answer keeps TorchServe's request id), and
their labels are posted to ``POST /feedback`` after each pass, as a click pipeline would,
while a background load keeps traffic on both arms: the bad candidate is rolled back by
``ne_increase`` (or ``calibration_gap``) with 0 failed requests, the good one is promoted with both gates ok.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from serve.api.json_body import example_request
from serve.ops.feedback_check import label_triples, post_labels
from serve.ops.heldout import score_split
from serve.ops.loadgen import BackgroundLoad
from serve.store.repository import ModelRepository
from tests.fixtures.served import Served, serve_repository

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCHING = {"batch_size": 4, "max_batch_delay_ms": 5}
MIN_LABELS = 1500
GUARDS = {"interval_s": 1, "min_requests": 20, "min_instances": 100, "max_score_psi": 100,
          "min_labels": MIN_LABELS}


@dataclass
class QualityServed(Served):
    """The service over the stable version and its two candidates (``good``: a copy of
    the stable, ``bad``: trained on shuffled labels), and the held-out rows' labels."""

    stable: str
    good: str
    bad: str
    data_dir: Path
    labels: np.ndarray

    def load(self) -> BackgroundLoad:
        bodies = [orjson.dumps(example_request(8, seed=i, max_id=1000)) for i in range(16)]
        return BackgroundLoad(self.predict_url, bodies, clients=2, expect_predictions=8)

    def desired(self, rollout: dict[str, Any] | None) -> dict[str, Any]:
        return {"model": {"version": self.stable}, "batching": BATCHING, "workers": 1,
                "rollout": rollout}


def _add(repo: ModelRepository, version: str, artifact: Path, report: dict[str, Any],
         workdir: Path) -> str:
    from serve.model.archive import add_version

    add_version(repo, artifact, version, {**report, "version": version}, workdir,
                batch_size=BATCHING["batch_size"],
                max_batch_delay_ms=BATCHING["max_batch_delay_ms"], workers=1)
    return version


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_build,
           tiny_build_shuffled) -> Iterator[QualityServed]:
    from serve.model.data import load_split

    root = tmp_path_factory.mktemp("quality")
    repo = ModelRepository([root / "model_store"])
    report = dict(tiny_build.report)
    stable = tiny_build.version
    repo.add(stable, tiny_build.mar, report)
    work = root / "work"
    work.mkdir()
    labels = np.asarray(load_split(tiny_build.data_dir, "eval").labels)
    shuffled = tiny_build_shuffled
    bad = _add(repo, shuffled.version, shuffled.artifact, dict(shuffled.report), work)
    good = _add(repo, f"{stable}-copy", tiny_build.artifact, report, work)
    fields = {"stable": stable, "good": good, "bad": bad, "data_dir": tiny_build.data_dir,
              "labels": labels}
    with serve_repository(root, state={"model": {"version": stable}, "batching": BATCHING,
                                       "workers": 1},
                          kind=QualityServed, fields=fields) as s:
        yield s


def _rollout(s: QualityServed, candidate: str, done: str) -> tuple[dict[str, Any], dict[str, int],
                                                             BackgroundLoad]:
    """Declare a canary of ``candidate``, send the held-out rows and post their labels
    until the rollout is ``done`` (rolled_back / promoted); the last GET /state body, the
    labels joined per arm and the load (stopped)."""
    r = s.client.put_state(s.desired({"candidate": candidate, "mode": "canary", "weight": 0.5,
                                      "bake_s": 3, "guards": GUARDS}))
    assert r.status_code == 202, r.text
    joined: dict[str, int] = {"stable": 0, "candidate": 0}
    with s.load() as load:
        s.client.wait_rollout(phase="baking", serving=True, timeout_s=120)
        for _ in range(3):
            answers = score_split(s.predict_url, s.data_dir, batch=16, clients=2)
            for a in answers:
                if a.arm in joined:
                    joined[a.arm] += a.stop - a.start
            got = post_labels(s.write_url, s.token, label_triples(answers, s.labels))
            assert got["joined"] == len(s.labels), got
            state = httpx.get(f"{s.write_url}/state", timeout=10).json()["rollout"]
            if state["phase"] != "baking" or min(joined.values()) >= 2 * MIN_LABELS:
                break
        body = s.client.wait_rollout(phase=done, timeout_s=60)
        body = s.client.wait_rollout(phase=done, converged=True, timeout_s=120)
        n = load.served
        load.wait_for(n + 10)
    return body, joined, load


def test_a_shuffled_label_candidate_is_rolled_back_by_a_quality_gate(served: QualityServed) -> None:
    body, joined, load = _rollout(served, served.bad, "rolled_back")
    r = body["rollout"]
    guards = {g["name"]: g for g in r["guards"]}
    print(f"\nshuffled-label candidate: labels by arm {joined}; reason: {r['reason']}; "
          f"{load.served} served, {load.failed} failed")
    assert load.failed == 0, load.failures[:3]
    gate = next(g for g in ("ne_increase", "calibration_gap") if f"guard {g} breached"
                in (r["reason"] or ""))  # StopIteration: not rolled back by a quality gate
    assert guards[gate]["status"] == "breached" and guards[gate]["blocking"]
    assert guards[gate]["value"] > guards[gate]["threshold"]
    assert guards["score_psi"]["status"] != "breached"  # off: the quality gate caught it
    assert body["observed"]["candidate"] is None


def test_a_good_candidate_is_promoted_with_both_gates_ok(served: QualityServed) -> None:
    body, joined, load = _rollout(served, served.good, "promoted")
    r = body["rollout"]
    guards = {g["name"]: g for g in r["guards"]}
    print(f"\ngood candidate: labels by arm {joined}; guards "
          + ", ".join(f"{k}={g['value']}" for k, g in guards.items())
          + f"; {load.served} served, {load.failed} failed")
    assert load.failed == 0, load.failures[:3]
    assert guards["ne_increase"]["status"] == "ok", guards["ne_increase"]
    assert guards["calibration_gap"]["status"] == "ok", guards["calibration_gap"]
    assert body["observed"]["model"]["version"] == served.good
    metrics = httpx.get(f"{served.write_url}/metrics", timeout=10).text
    assert f'dlrm_online_rows_total{{arm="candidate",version="{served.good}"}}' in metrics
