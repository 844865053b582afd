"""The OIP's process as the sidecar starts it (``--oip-mode child``, what ``make up`` and
the tests run): it holds none of the sidecar's tokens, it answers on ``--oip-port``, and
it goes when the sidecar goes (``make down`` stops the sidecar's process group; a
SIGKILLed sidecar takes it too). No TorchServe needed: readiness answers 503 naming why."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from bench.oip_flood import oip_child
from serve.common.net import free_ports
from serve.ops.process_groups import stop_group

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
TOKEN = "t0ken-in-the-environment-0123456789abcdef"


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port, write_port, oip_port, dead = free_ports(4)
    env = {**os.environ, "DLRM_SIDECAR_TOKEN": TOKEN, "AWS_SECRET_ACCESS_KEY": "nope",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "serve.sidecar", "--port", str(port), "--write-port",
           str(write_port), "--oip-port", str(oip_port), "--model-store", str(tmp_path),
           "--multiproc-dir", "", "--inference-url", f"http://127.0.0.1:{dead}",
           "--management-url", f"http://127.0.0.1:{dead}", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    oip = f"http://127.0.0.1:{oip_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{oip}/v2/health/live", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}", oip
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
    stop_group(proc.pid, proc)
    pytest.fail(f"the sidecar or its OIP process did not start (exit {proc.poll()})")


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie":
            return True
        time.sleep(0.1)
    return False


def test_the_child_holds_no_token_answers_and_goes_with_the_sidecar_s_group(tmp_path):
    proc, sidecar, oip = _start(tmp_path)
    try:
        pid = oip_child(proc.pid)
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert TOKEN.encode() not in environ and b"DLRM_SIDECAR_TOKEN" not in environ
        assert b"AWS_SECRET_ACCESS_KEY" not in environ
        assert TOKEN.encode() in Path(f"/proc/{proc.pid}/environ").read_bytes()  # the test's
        # Its readiness is the sidecar's (TorchServe is absent here): 503 naming why.
        r = httpx.get(f"{oip}/v2/health/ready", timeout=10)
        assert r.status_code == 503 and "TorchServe" in r.json()["error"], r.text
        state = httpx.get(f"{sidecar}/state", timeout=10).json()
        assert state["endpoints"]["oip_url"] == oip
    finally:
        stop_group(proc.pid, proc)  # what `make down` does
    assert _gone(pid)


def test_a_killed_sidecar_takes_its_oip_child_with_it(tmp_path):
    proc, _, _ = _start(tmp_path)
    pid = oip_child(proc.pid)
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the sidecar alone, not its group
        proc.wait(10)
        assert _gone(pid), "the OIP process outlived a SIGKILLed sidecar"
    finally:
        stop_group(proc.pid, proc)
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)
