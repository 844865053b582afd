"""TorchServe's logging (log4j2.xml): no line per request on the request path by default.

The unit checks read the shipped file; the integration check reads the logs of the real
TorchServe the ``torchserve`` fixture starts (the launcher passes the file as
``--log-config``) after requests were answered.
"""
from __future__ import annotations

import gzip
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from serve.api.json_body import example_request

REPO = Path(__file__).resolve().parents[1]
# Loggers that write a line per request or per batch in TorchServe 0.12's frontend.
PER_REQUEST = ("ACCESS_LOG", "org.pytorch.serve.wlm.BatchAggregator",
               "org.pytorch.serve.wlm.WorkerThread", "org.pytorch.serve.job")
QUIET = "${env:DLRM_REQUEST_LOG:-warn}"


def _loggers() -> dict[str, ET.Element]:
    root = ET.parse(REPO / "log4j2.xml").getroot()  # also fails on malformed XML
    return {lg.get("name", "Root"): lg for lg in root.iter() if lg.tag in ("Logger", "Root")}


def test_per_request_loggers_are_quiet_unless_DLRM_REQUEST_LOG_says_otherwise():
    loggers = _loggers()
    for name in PER_REQUEST:
        assert loggers[name].get("level") == QUIET, name
    # each line once: the access log only in its own file, the frontend's not again via Root
    assert loggers["ACCESS_LOG"].get("additivity") == "false"
    assert loggers["org.pytorch.serve"].get("additivity") == "false"
    assert loggers["org.pytorch.serve"].get("level") == "info"  # lifecycle lines stay


def test_every_appender_ref_names_an_appender():
    root = ET.parse(REPO / "log4j2.xml").getroot()
    appenders = {a.get("name") for a in root.find("Appenders")}
    refs = {r.get("ref") for r in root.iter("AppenderRef")}
    assert refs and refs <= appenders, refs - appenders


@pytest.mark.integration
def test_requests_leave_no_line_per_request_in_torchserves_logs(torchserve):
    with httpx.Client(timeout=30) as c:
        for seed in range(20):
            r = c.post(torchserve.predict_url, json=example_request(1, seed=seed))
            assert r.status_code == 200, r.text
    time.sleep(1.0)  # async_logging: give the appenders time to write what they would
    logs = torchserve.log_dir
    # with what log4j2 rolled over (ts_log.<dd-MMM>.log.gz): a run across midnight rolls
    # the lifecycle lines out of ts_log.log
    ts_log = "".join(gzip.decompress(f.read_bytes()).decode()
                     for f in sorted(logs.glob("ts_log.*.log.gz")))
    ts_log += (logs / "ts_log.log").read_text()
    # the file is ours: it exists (so the config loaded) and holds lifecycle lines
    assert "Model server started" in ts_log or "Initializing plugins manager" in ts_log
    assert "Sending response for jobId" not in ts_log and "Backend response time" not in ts_log
    access = logs / "access_log.log"
    assert access.is_file() and "/predictions/" not in access.read_text()
