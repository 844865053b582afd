"""The shutdown drain (serve.sidecar.control.drain, POST /drain) against a fake of TorchServe's
management API: closed version registered and made default, the serving version drained
until its queue stays empty, reconciler paused, readiness 503. The real thing under load
is `make faults` (case sigterm)."""
from __future__ import annotations

import asyncio
import json
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml

from serve.sidecar.adapters.torchserve import TorchServeClient
from serve.sidecar.config import SidecarConfig
from serve.sidecar.control.drain import CLOSED_VERSION, Drainer, closed_archive
from serve.sidecar.control.switch import VersionSwitch
from tests.fixtures.sidecar import FakeClock, FakeTorchServe


def test_closed_archive_is_a_handler_only_mar(tmp_path: Path) -> None:
    mar = closed_archive(tmp_path, "dlrm")
    with zipfile.ZipFile(mar) as z:
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]
        config = yaml.safe_load(z.read("model-config.yaml"))
        handler = z.read("closed_handler.py").decode()
    assert manifest["modelVersion"] == CLOSED_VERSION and manifest["handler"] == "closed_handler.py"
    assert config["minWorkers"] == config["maxWorkers"] == 1
    assert "503" in handler and handler.count("\nclass ") == 1  # TorchServe wants one class


def test_drain_closes_then_waits_for_the_queue(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ts = FakeTorchServe(store)             # serves "1.0"
    ts.pending["1.0"] = [5, 3, 0, 0, 0]    # the queue empties over three reads
    clock = FakeClock()
    cfg = SidecarConfig(management_url="http://ts", model_store=store, switch_grace_s=0.5)
    client = TorchServeClient(cfg, httpx.AsyncClient(transport=ts.transport()))
    switch = VersionSwitch(client, cfg, clock=clock, sleep=clock.sleep)
    drainer = Drainer(client, cfg, switch=switch, clock=clock)
    assert not drainer.draining

    async def both() -> tuple:
        return await asyncio.gather(drainer.drain(), drainer.drain())  # idempotent

    first, second = asyncio.run(both())
    assert first is second and first.drained and first.phase == "drained", first
    assert first.versions == ["1.0"] and drainer.draining
    assert ts.default == CLOSED_VERSION
    calls = [c for c in ts.calls if c[0] in ("POST", "PUT")]
    assert calls == [("POST", "/models"), ("PUT", f"/models/dlrm/{CLOSED_VERSION}/set-default")]
    # drained only after the queue read empty for grace + the batch delay (0.5 + 0.05 s)
    assert clock.now >= 0.55
    assert "1.0" in ts.versions  # left registered: TorchServe stops next, nothing to drop


def test_drain_failure_is_reported_not_raised(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ts = FakeTorchServe(store)
    ts.failures[("POST", "/models")] = 500
    clock = FakeClock()
    cfg = SidecarConfig(management_url="http://ts", model_store=store, switch_grace_s=0.0)
    client = TorchServeClient(cfg, httpx.AsyncClient(transport=ts.transport()))
    drainer = Drainer(client, cfg, switch=VersionSwitch(client, cfg, clock=clock,
                                                        sleep=clock.sleep), clock=clock)
    report = asyncio.run(drainer.drain())
    assert not report.drained and report.phase == "failed" and "injected failure" in report.error
    assert ts.default == "1.0"


@pytest.mark.parametrize("argv", [["--help"]])
def test_drain_cli_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from serve.ops.drain import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "preStop" in capsys.readouterr().out


def test_the_tools_token_comes_from_the_env_then_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from serve.ops.state_client import sidecar_token
    from serve.settings import DLRM_SIDECAR_TOKEN

    token_env = DLRM_SIDECAR_TOKEN.name

    f = tmp_path / "sidecar-token"
    monkeypatch.delenv(token_env, raising=False)
    assert sidecar_token(f) is None and sidecar_token(None) is None  # no file, no env
    f.write_text("from-file\n")
    assert sidecar_token(f) == "from-file"
    monkeypatch.setenv(token_env, "  from-env \n")
    assert sidecar_token(f) == "from-env"
    monkeypatch.setenv(token_env, "   ")  # blank: the file
    assert sidecar_token(str(f)) == "from-file"
