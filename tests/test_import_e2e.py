"""An own TorchRec model end to end, through the tool that checks it
(``serve/ops/import_check.py``, ``make import-check``): examples/own_ranker fitted on 2
real gloo ranks (twice: seeds 0 and 1), imported twice, served by the real TorchServe +
sidecar on free loopback ports; ``PUT /state``, ``GET /state``'s schema, HTTP predictions
against TorchRec's own quantized forward, bad requests, and a version switch under load.

The test runs the tool's own ``run_check`` (so the tool is the tested code) and pins each
verdict it reports. About 1-2 minutes on 2 cores; the figures print with ``pytest -s``.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from serve.ops.import_check import format_table, run_check
from serve.ops.import_check_config import CheckConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_own_ranker_end_to_end(tmp_path: Path) -> None:
    """fit (2 ranks) -> import -> real service -> PUT /state -> HTTP == TorchRec quantized
    forward -> bad requests 400 naming the feature, 0 5xx -> a version switch under load."""
    cfg = CheckConfig(workdir=tmp_path, models=("own_ranker",), steps=4, batch=64, clients=3,
                      converge_timeout_s=150.0, step_timeout_s=300.0)
    t0 = time.monotonic()
    report = run_check(cfg, say=print)
    print(f"\n{format_table(report)}\n(test flow {time.monotonic() - t0:.0f} s)")

    (row,) = report.rows
    assert row.errors == [], row.errors
    # 1-2: 2 ranks trained it, the importer stored it and checked it itself.
    assert row.version == "own-ranker-s0" and row.dense_kind == "export"
    assert (row.dense, row.tables, row.features) == (8, 4, 5)
    assert row.import_max_abs_diff is not None and row.import_max_abs_diff <= 1e-6
    # 3-4: served after PUT /state; GET /state's schema is the report's (and the model's).
    assert row.converge_seconds is not None and row.schema_match is True
    # 5: the HTTP answers are TorchRec's quantized forward on the same 64 instances.
    assert row.http_max_abs_diff is not None and row.http_max_abs_diff <= 1e-6
    assert row.http_instances == 64 and row.http_ids is not None and row.http_ids > 64
    # 6: every malformed request is a 400 naming what is wrong; no 5xx anywhere.
    assert [(b.case.split(" (")[0], b.status, b.names_it) for b in row.bad_requests] == [
        ("unknown feature", 400, True), ("missing feature", 400, True),
        ("more ids than max_ids", 400, True), ("wrong dense count", 400, True)]
    assert row.http_5xx == 0 and row.http_requests == 5
    # 7: the switch under load fails nothing, and the new version answers afterwards.
    sw = report.switch
    assert sw is not None and sw.errors == [], None if sw is None else sw.errors
    assert (sw.from_version, sw.to_version) == ("own-ranker-s0", "own-ranker-s1")
    assert sw.failed == 0 and sw.http_5xx == 0, sw.failures
    assert sw.served > 0 and sw.served_during_switch > 0
    assert set(sw.versions) <= {"own-ranker-s0", "own-ranker-s1"}
    assert set(sw.versions_after) == {"own-ranker-s1"}
    assert sw.after_max_abs_diff is not None and sw.after_max_abs_diff <= 1e-6
    assert sw.answers_changed is True
    assert report.ok
