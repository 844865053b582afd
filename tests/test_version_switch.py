"""serve.sidecar.switch: each step of the version switch on its own, the drain, the
rollbacks and whole runs, against a fake of TorchServe's management API.

TorchServe is not ours, so its API is faked (``FakeTorchServe`` on an
``httpx.MockTransport``); the switch, the archive rewrite and the app are the real ones.
Waiting uses a fake clock, so the tests take milliseconds. The real switch against a
real TorchServe under load is ``tests/test_sidecar.py::test_live_batching_change_*``.
"""
from __future__ import annotations

import asyncio
import json
import re
import zipfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from serve.errors import UpstreamUnavailable
from serve.metrics import SWITCH_PHASES, SidecarMetrics
from serve.sidecar.app import SidecarConfig, create_app
from serve.sidecar.schemas import BatchingState, BatchingUpdate
from serve.sidecar.switch import SwitchPhase, SwitchPlan, VersionSwitch
from serve.sidecar.torchserve import TorchServeClient
from tests.fixtures.sidecar import toy_mar
from tests.promtext import samples

T = TypeVar("T")
MGMT = "http://ts-management"
TOKEN = "t0ken"


class FakeTorchServe:
    """TorchServe's management API for one model, in memory, as far as the sidecar uses it.

    Like TorchServe, ``POST /models`` reads the archive from the model store, takes the
    version from its manifest and the batching from its model config; ``DELETE`` refuses
    the default version. Knobs: ``failures[(method, path)] = status`` makes that call
    fail; ``pending[version]`` is the queue lengths successive ``GET /models/{m}/{v}`` of
    that version report (the last one repeats); ``ready_after`` is how many of those a new
    version answers before its workers are READY (None: never). ``calls`` records every
    request.
    """

    def __init__(self, store: Path, model: str = "dlrm") -> None:
        self.store, self.model = store, model
        self.versions: dict[str, dict[str, Any]] = {}
        self.default = "1.0"
        self.calls: list[tuple[str, str]] = []
        self.failures: dict[tuple[str, str], int] = {}
        self.pending: dict[str, list[int]] = {}
        self.ready_after: int | None = 0
        self._next_pid = 100
        self._describes: dict[str, int] = {}
        toy_mar(store / f"{model}.mar")
        self._add("1.0", f"{model}.mar", batch_size=8, delay=50, workers=1, ready=True)

    def _add(self, version: str, url: str, *, batch_size: int, delay: int, workers: int,
             ready: bool = False) -> None:
        pids = list(range(self._next_pid, self._next_pid + workers))
        self._next_pid += workers
        self.versions[version] = {"url": url, "batchSize": batch_size, "maxBatchDelay": delay,
                                  "pids": pids, "ready": ready}

    def describe(self, version: str, *, polled: bool = False) -> dict[str, Any]:
        """``polled``: a GET of this very version, which moves ``pending``/``ready_after``."""
        v = self.versions[version]
        n = self._describes.get(version, 0) + polled
        self._describes[version] = n
        ready = v["ready"] or (self.ready_after is not None and n > self.ready_after)
        queue = self.pending.get(version) or [0]
        pending = queue.pop(0) if polled and len(queue) > 1 else queue[0]
        return {"modelName": self.model, "modelVersion": version, "modelUrl": v["url"],
                "batchSize": v["batchSize"], "maxBatchDelay": v["maxBatchDelay"],
                "workers": [{"id": str(p), "pid": p,
                             "status": "READY" if ready else "UNLOADING"} for p in v["pids"]],
                "jobQueueStatus": {"remainingCapacity": 100 - pending,
                                   "pendingRequests": pending}}

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        method, path = request.method, request.url.path
        self.calls.append((method, path))
        if (method, path) in self.failures:
            return _error(self.failures[(method, path)], f"injected failure of {method} {path}")
        m = re.escape(self.model)
        if method == "POST" and path == "/models":
            return self._register(dict(request.url.params))
        if method == "GET" and (hit := re.fullmatch(rf"/models/{m}(?:/([^/]+))?", path)):
            version = hit.group(1) or self.default
            if version == "all":
                return httpx.Response(200, json=[self.describe(v) for v in self.versions])
            if version not in self.versions:
                return _error(404, f"Model version: {version} does not exist for model: {m}")
            return httpx.Response(200, json=[self.describe(version, polled=bool(hit.group(1)))])
        if method == "PUT" and (hit := re.fullmatch(rf"/models/{m}/([^/]+)/set-default", path)):
            if hit.group(1) not in self.versions:
                return _error(404, f"Model version {hit.group(1)} does not exist")
            self.default = hit.group(1)
            return httpx.Response(200, json={"status": "Default version updated"})
        if method == "DELETE" and (hit := re.fullmatch(rf"/models/{m}/([^/]+)", path)):
            version = hit.group(1)
            if version not in self.versions:
                return _error(404, f"Model version: {version} does not exist for model: {m}")
            if version == self.default:
                return _error(400, f"Can't remove default version: {version}")
            del self.versions[version]
            return httpx.Response(200, json={"status": f"Model {m} unregistered"})
        return _error(404, f"{method} {path} is not faked")

    def _register(self, params: dict[str, str]) -> httpx.Response:
        archive = self.store / params["url"]
        if not archive.is_file():
            return _error(404, f"Model not found in model store: {params['url']}")
        with zipfile.ZipFile(archive) as z:
            manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
            config = yaml.safe_load(z.read(manifest["model"]["configFile"]))
        version = manifest["model"]["modelVersion"]
        if version in self.versions:
            return _error(409, f"Model version {version} is already registered.")
        self._add(version, params["url"], batch_size=config["batchSize"],
                  delay=config["maxBatchDelay"], workers=int(params["initial_workers"]))
        return httpx.Response(200, json={"status": f"Model {self.model} registered"})


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"code": status, "type": "Error", "message": message})


class FakeClock:
    """Monotonic seconds that move only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture
def ts(tmp_path: Path) -> FakeTorchServe:
    return FakeTorchServe(tmp_path)


def make_switch(ts: FakeTorchServe, clock: FakeClock | None = None, **config: Any,
                ) -> tuple[VersionSwitch, list[str], list[list[int]]]:
    """A switch on the fake, with the phases it enters and the pids it forgets."""
    config = {"management_url": MGMT, "model_store": ts.store, "switch_grace_s": 0.0,
              **config}
    clock = clock or FakeClock()
    phases: list[str] = []
    forgotten: list[list[int]] = []
    sidecar = SidecarConfig(**config)
    client = httpx.AsyncClient(transport=ts.transport())
    switch = VersionSwitch(TorchServeClient(sidecar, client), sidecar, clock=clock,
                           sleep=clock.sleep, on_phase=phases.append,
                           forget_workers=forgotten.append)
    return switch, phases, forgotten


def plan_for(ts: FakeTorchServe, **settings: int) -> SwitchPlan:
    old = BatchingState(batch_size=8, max_batch_delay_ms=50, workers=1, model_version="1.0")
    new = old.model_copy(update={"model_version": "1.1", **settings})
    return SwitchPlan(old=old, new=new, src=ts.store / "dlrm.mar",
                      dst=ts.store / "dlrm-v1.1.mar", old_pids=(100,))


# ------------------------------------------------------------------ the steps alone


def test_phases_are_the_metric_labels():
    assert tuple(p.value for p in SwitchPhase) == SWITCH_PHASES
    metrics = SidecarMetrics()
    with pytest.raises(ValueError, match=r"switch phase 'done' is not one of \('idle', "):
        metrics.set_switch_phase("done")
    metrics.set_switch_phase("draining")
    gauge = {s.labels["phase"]: s.value for fam in metrics.collect() for s in fam.samples
             if fam.name == "dlrm_switch_phase"}
    assert gauge == {p: float(p == "draining") for p in SWITCH_PHASES}


def test_plan_names_the_next_version_and_none_when_nothing_changes(ts):
    switch, _, _ = make_switch(ts)
    current = ts.describe("1.0")
    assert run(switch.plan(current, BatchingUpdate(batch_size=8, workers=1))) is None
    plan = run(switch.plan(current, BatchingUpdate(batch_size=16)))
    assert plan == plan_for(ts, batch_size=16)
    ts.versions["1.1"] = ts.versions["1.0"]  # taken: the next free one is used
    assert run(switch.plan(current, BatchingUpdate(batch_size=16))).new.model_version == "1.2"


def test_copy_writes_the_new_archive(ts):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(ts, batch_size=16, max_batch_delay_ms=5, workers=2)
    assert run(switch.copy(plan)) == plan.dst
    with zipfile.ZipFile(plan.dst) as z:
        assert json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]["modelVersion"] == "1.1"
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert (cfg["batchSize"], cfg["maxBatchDelay"], cfg["minWorkers"]) == (16, 5, 2)
    assert phases == ["copying"] and ts.calls == []


def test_register_posts_the_archive_once(ts):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(ts, batch_size=16)
    run(switch.copy(plan))
    run(switch.register(plan))
    assert ts.versions["1.1"]["batchSize"] == 16 and ts.default == "1.0"
    assert ts.calls == [("GET", "/models/dlrm/1.1"), ("POST", "/models")]
    run(switch.register(plan))  # registered already: nothing posted
    assert ts.calls[2:] == [("GET", "/models/dlrm/1.1")]
    assert phases == ["copying", "registering", "registering"]


def test_wait_ready_polls_until_the_workers_are_ready(ts):
    clock = FakeClock()
    switch, phases, _ = make_switch(ts, clock)
    plan = plan_for(ts, batch_size=16)
    run(switch.copy(plan))
    run(switch.register(plan))
    ts.ready_after = 3  # three reads see no READY worker, the fourth does
    run(switch.wait_ready(plan))
    assert clock.sleeps == [0.2, 0.2, 0.2]
    assert phases[-1] == "waiting_ready"


def test_wait_ready_gives_up_at_the_register_timeout(ts):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock, register_timeout_s=5.0)
    plan = plan_for(ts, batch_size=16)
    run(switch.copy(plan))
    ts.ready_after = None
    run(switch.register(plan))
    with pytest.raises(UpstreamUnavailable, match=r"^version 1.1 of 'dlrm' did not get 1 READY "
                       r"workers within 5 s; the old version stays default$"):
        run(switch.wait_ready(plan))
    assert 5.0 < clock.now < 5.5


def test_set_default(ts):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(ts, batch_size=16)
    run(switch.copy(plan))
    run(switch.register(plan))
    run(switch.set_default(plan))
    assert ts.default == "1.1" and phases[-1] == "setting_default"
    assert ts.calls[-1] == ("PUT", "/models/dlrm/1.1/set-default")


def test_drain_waits_for_two_empty_reads_of_the_old_queue(ts):
    clock = FakeClock()
    switch, phases, _ = make_switch(ts, clock)
    ts.pending["1.0"] = [3, 1, 0, 0, 5]
    run(switch.drain(plan_for(ts, batch_size=16)))
    assert ts.calls == [("GET", "/models/dlrm/1.0")] * 4  # 3, 1, 0, 0: never the 5
    assert clock.sleeps == [0.1, 0.1, 0.1]
    assert phases == ["draining"]


def test_drain_restarts_its_count_when_the_queue_fills_again(ts):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock)
    ts.pending["1.0"] = [0, 2, 0, 0]
    run(switch.drain(plan_for(ts, batch_size=16)))
    assert len(ts.calls) == 4


def test_drain_lasts_at_least_the_grace_period(ts):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock, switch_grace_s=0.5)
    run(switch.drain(plan_for(ts, batch_size=16)))  # empty from the start
    assert clock.now == pytest.approx(0.5) and len(ts.calls) == 6


def test_drain_gives_up_at_its_timeout(ts):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock, drain_timeout_s=2.0)
    ts.pending["1.0"] = [4]
    with pytest.raises(UpstreamUnavailable, match=(
            r"^version 1.0 of 'dlrm' still had 4 queued requests 2 s after the switch "
            r"\(drain_timeout_s\); it stays registered so they are answered: unregister it "
            r"\(DELETE /models/dlrm/1.0\) once its queue is empty$")):
        run(switch.drain(plan_for(ts, batch_size=16)))
    assert clock.now == pytest.approx(2.0)


def test_drain_of_a_version_already_gone_is_done(ts):
    switch, _, _ = make_switch(ts)
    plan = plan_for(ts, batch_size=16)
    del ts.versions["1.0"]
    run(switch.drain(plan))
    assert ts.calls == [("GET", "/models/dlrm/1.0")]


def test_unregister_removes_the_old_version_and_only_our_archives(ts):
    switch, phases, forgotten = make_switch(ts)
    plan = plan_for(ts, batch_size=16)
    ts.default = "1.1"
    ts._add("1.1", "dlrm-v1.1.mar", batch_size=16, delay=50, workers=1, ready=True)
    run(switch.unregister(plan))
    assert "1.0" not in ts.versions and forgotten == [[100]]
    assert (ts.store / "dlrm.mar").is_file()  # the pipeline's archive is not ours: kept
    run(switch.unregister(plan))  # gone already: fine
    assert ts.calls == [("DELETE", "/models/dlrm/1.0")] * 2
    # A version the sidecar made: its archive goes with it.
    toy_mar(ts.store / "dlrm-v1.1.mar", version="1.1")
    ts.default = "1.0"
    ts._add("1.0", "dlrm.mar", batch_size=8, delay=50, workers=1, ready=True)
    later = SwitchPlan(old=plan.new, new=plan.old, src=ts.store / "dlrm-v1.1.mar",
                       dst=ts.store / "dlrm.mar")
    run(switch.unregister(later))
    assert "1.1" not in ts.versions and not (ts.store / "dlrm-v1.1.mar").exists()
    assert phases == ["unregistering"] * 3


def test_rollback_removes_the_new_version_and_its_archive(ts):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(ts, batch_size=16)
    run(switch.copy(plan))
    run(switch.register(plan))
    run(switch.rollback(plan))
    assert set(ts.versions) == {"1.0"} and ts.default == "1.0"
    assert not plan.dst.exists() and phases[-1] == "rolling_back"
    run(switch.rollback(plan))  # nothing left to undo: fine
    assert ts.calls[-2:] == [("DELETE", "/models/dlrm/1.1")] * 2


# ------------------------------------------------------------------ whole runs


def test_run_switches_and_retires_the_old_version(ts):
    clock = FakeClock()
    switch, phases, forgotten = make_switch(ts, clock)
    ts.pending["1.0"] = [3, 1, 0, 0]
    result = run(switch.run(BatchingUpdate(batch_size=16, max_batch_delay_ms=5)))
    assert result.model_dump() == {
        "batch_size": 16, "max_batch_delay_ms": 5, "workers": 1, "model_version": "1.1",
        "changed": True, "seconds": pytest.approx(0.3), "removed_version": "1.0",
        "previous": {"batch_size": 8, "max_batch_delay_ms": 50, "workers": 1,
                     "model_version": "1.0"}}
    assert phases == ["idle", "copying", "registering", "waiting_ready", "setting_default",
                      "draining", "unregistering", "idle"]
    assert ts.calls == [
        ("GET", "/models/dlrm"), ("GET", "/models/dlrm/all"),
        ("GET", "/models/dlrm/1.1"), ("POST", "/models"), ("GET", "/models/dlrm/1.1"),
        ("PUT", "/models/dlrm/1.1/set-default"),
        *[("GET", "/models/dlrm/1.0")] * 4, ("DELETE", "/models/dlrm/1.0"),
        ("GET", "/models/dlrm")]
    assert set(ts.versions) == {"1.1"} and ts.default == "1.1" and forgotten == [[100]]
    assert sorted(p.name for p in ts.store.iterdir()) == ["dlrm-v1.1.mar", "dlrm.mar"]
    assert switch.phase is SwitchPhase.IDLE and switch.last_error is None
    # Again, from the sidecar's own version: its archive is removed with it.
    result = run(switch.run(BatchingUpdate(workers=2)))
    assert (result.model_version, result.workers, result.removed_version) == ("1.2", 2, "1.1")
    assert sorted(p.name for p in ts.store.iterdir()) == ["dlrm-v1.2.mar", "dlrm.mar"]


def test_run_with_the_settings_in_effect_changes_nothing(ts):
    switch, phases, _ = make_switch(ts)
    result = run(switch.run(BatchingUpdate(batch_size=8)))
    assert result.changed is False and result.model_version == "1.0"
    assert ts.calls == [("GET", "/models/dlrm")] and phases == ["idle"]


@pytest.mark.parametrize("phase, failure, message", [
    ("registering", {("POST", "/models"): 500},
     ("TorchServe POST http://ts-management/models answered 500: injected failure of "
      "POST /models")),
    ("waiting_ready", None,
     ("version 1.1 of 'dlrm' did not get 1 READY workers within 5 s; "
      "the old version stays default")),
    ("setting_default", {("PUT", "/models/dlrm/1.1/set-default"): 503},
     ("TorchServe PUT http://ts-management/models/dlrm/1.1/set-default answered 503: "
      "injected failure of PUT /models/dlrm/1.1/set-default")),
])
def test_a_failed_step_is_rolled_back(ts, phase, failure, message):
    switch, phases, forgotten = make_switch(ts, register_timeout_s=5.0)
    if failure is None:
        ts.ready_after = None
    else:
        ts.failures.update(failure)
    with pytest.raises(UpstreamUnavailable) as info:
        run(switch.run(BatchingUpdate(batch_size=16)))
    assert info.value.message == message
    assert phases[-3:] == [phase, "rolling_back", "failed"]
    assert ("DELETE", "/models/dlrm/1.1") in ts.calls
    assert set(ts.versions) == {"1.0"} and ts.default == "1.0"  # no orphan, old still serves
    assert sorted(p.name for p in ts.store.iterdir()) == ["dlrm.mar"]
    assert switch.phase is SwitchPhase.FAILED and switch.last_error == message
    assert forgotten == []


def test_a_failed_copy_leaves_no_file(ts):
    switch, phases, _ = make_switch(ts)
    (ts.store / "dlrm.mar").write_bytes(b"not a zip")
    with pytest.raises(zipfile.BadZipFile):
        run(switch.run(BatchingUpdate(batch_size=16)))
    assert sorted(p.name for p in ts.store.iterdir()) == ["dlrm.mar"]
    assert phases[-3:] == ["copying", "rolling_back", "failed"]
    assert switch.last_error == "BadZipFile('File is not a zip file')"


def test_after_the_switch_a_stuck_old_queue_keeps_the_old_version(ts):
    switch, phases, forgotten = make_switch(ts, drain_timeout_s=1.0)
    ts.pending["1.0"] = [2]
    result = run(switch.run(BatchingUpdate(batch_size=16)))
    assert result.changed is True and result.model_version == "1.1"
    assert result.removed_version is None
    assert set(ts.versions) == {"1.0", "1.1"} and ts.default == "1.1" and forgotten == []
    assert switch.phase is SwitchPhase.IDLE
    assert switch.last_error.startswith("version 1.0 of 'dlrm' still had 2 queued requests")
    assert "rolling_back" not in phases


# ------------------------------------------------------------------ through the app


def test_put_batching_runs_the_switch_and_get_shows_its_status(ts):
    registry = CollectorRegistry()
    app = create_app(SidecarConfig(management_url=MGMT, metrics_url=MGMT, token=TOKEN,
                                   model_store=ts.store, switch_grace_s=0.0),
                     registry=registry,
                     http_client=httpx.AsyncClient(transport=ts.transport()))
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
                put = await c.put("/batching", json={"batch_size": 16}, headers=auth)
                ok = await c.get("/batching")
                ts.failures[("POST", "/models")] = 500
                failed = await c.put("/batching", json={"batch_size": 4}, headers=auth)
                after = await c.get("/batching")
                return [put, ok, failed, after]

    put, ok, failed, after = run(go())
    assert put.status_code == 200, put.text
    assert put.json()["model_version"] == "1.1" and put.json()["removed_version"] == "1.0"
    assert ok.json() == {"batch_size": 16, "max_batch_delay_ms": 50, "workers": 1,
                         "model_version": "1.1"}  # idle: no status fields
    assert failed.status_code == 503 and failed.json()["type"] == "UpstreamUnavailable"
    assert after.json() == {
        "batch_size": 16, "max_batch_delay_ms": 50, "workers": 1, "model_version": "1.1",
        "switch_phase": "failed", "switch_error": failed.json()["message"]}
    got = samples(generate_latest(registry).decode())
    phases = {dict(lab)["phase"]: v for (name, lab), v in got.items()
              if name == "dlrm_switch_phase"}
    assert phases == {p: (1.0 if p == "failed" else 0.0) for p in SWITCH_PHASES}
    assert got[("dlrm_batching_updates_total", (("result", "failed"),))] == 1
    assert got[("dlrm_batching_updates_total", (("result", "applied"),))] == 1
