"""Deeply nested documents (security review N8): every parser of outside input answers
with its own 4xx / domain error, and no traceback reaches the log.

stdlib ``json`` and PyYAML recurse once per nesting level: 200k ``[`` raise
``RecursionError``, which no ``except ValueError`` catches (a 500, or a traceback every
sync-loop pass for the decisions ConfigMap)."""
from __future__ import annotations

import asyncio
import logging
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve.errors import ConfigError, InvalidDelta
from serve.sidecar.adapters.kubernetes import ConfigMapDecisionStore, KubeClient
from serve.state import STATE_MAX_BYTES, read_state_yaml, write_state
from serve.store.deltas.header import DELTA_MAGIC, read_header
from serve.store.repository import ModelRepository
from tests.fakes.kube_api import FakeKubeApi
from tests.fixtures.sidecar import FakeTorchServe, add_versions
from tests.test_feedback_bounded import _app as feedback_app
from tests.test_feedback_bounded import _posts as feedback_posts
from tests.test_reconciler import AUTH, desired, make_app

DEEP = 200_000
NESTED = b"[" * DEEP


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    tracebacks = [r for r in caplog.records if r.exc_info or r.exc_text]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    assert "RecursionError" not in caplog.text


def test_a_deep_delta_header_is_invalid_delta(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    body = DELTA_MAGIC + struct.pack("<I", len(NESTED)) + NESTED
    with pytest.raises(InvalidDelta, match=r"header: is nested too deeply to parse"):
        read_header(memoryview(body), len(body))
    _no_traceback(caplog)


def test_a_deep_feedback_body_is_400(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    [r] = feedback_posts(feedback_app(tmp_path, 1 << 20), [
        {"content": NESTED, "headers": {"Content-Type": "application/json"}}])
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "InvalidInput"
    assert "invalid POST /feedback body: body:" in r.json()["message"]
    _no_traceback(caplog)


@pytest.mark.parametrize("depth, status", [(STATE_MAX_BYTES - 8, 400), (DEEP, 413)])
def test_a_deep_put_state_body_is_4xx(depth: int, status: int, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """Under the body limit FastAPI's json.loads recurses too deep (its 400); over it, 413."""
    caplog.set_level(logging.DEBUG)
    repo = ModelRepository([add_versions(tmp_path / "repo", ["small-s0"])])
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired())
    before = state_file.read_text()
    app = make_app(FakeTorchServe(tmp_path / "store"), repo, state_file)
    [put] = _put_raw(app, b"[" * depth)
    assert put.status_code == status, put.text
    assert state_file.read_text() == before
    _no_traceback(caplog)


def _put_raw(app: Any, body: bytes) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sc") as c:
                return [await c.put("/state", content=body, headers={
                    **AUTH, "Content-Type": "application/json"})]
    return asyncio.run(go())


def test_a_deep_decisions_configmap_reads_as_empty(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with FakeKubeApi("tok") as api:
        api.put_object("configmaps", {"metadata": {"name": "rollout"},
                                      "data": {"decisions.json": NESTED.decode()}})
        store = ConfigMapDecisionStore(
            KubeClient(api.url, api.namespace, token=lambda: "tok", verify=False), "rollout")
        assert store.read("any") is None
    assert "decisions.json of the rollout ConfigMap is not JSON" in caplog.text
    _no_traceback(caplog)


@pytest.mark.parametrize("depth", [STATE_MAX_BYTES - 8, DEEP])
def test_a_deep_desired_state_is_config_error(depth: int,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Under the size limit PyYAML itself recurses too deep; over it, the size refuses."""
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError, match=r"nested too deeply|a desired state is at most"):
        read_state_yaml("[" * depth, "desired-state file x")
    _no_traceback(caplog)
