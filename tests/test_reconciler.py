"""serve.sidecar.control.reconciler and GET/PUT /state: the desired-state file reconciled into
TorchServe, pass by pass, against a fake of TorchServe's management API.

Each pass is driven by hand (``tick``) with a fake clock, a temp state file and a temp
model repository of tiny archives; the app-level tests run the real background loop
against the same fake. Nothing here starts TorchServe: the real thing is
``tests/test_sidecar.py::test_state_file_is_served_by_a_real_torchserve``.
"""
from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from serve import settings
from serve.errors import Conflict, UpstreamUnavailable
from serve.metrics import RECONCILE_RESULTS
from serve.metrics.sidecar import SidecarMetrics
from serve.profiles import get_profile
from serve.schema import FeatureSpec, ModelSchema, TableSpec
from serve.settings import DLRM_STATE_FILE
from serve.sidecar.adapters.memory import CgroupMemory, MemoryProbe
from serve.sidecar.adapters.model_schemas import SchemaCache, check_rollout_schema
from serve.sidecar.adapters.torchserve import Observed, TorchServeClient
from serve.sidecar.config import DEFAULT_STATE_FILE, SidecarConfig
from serve.sidecar.control import reconciler as reconciler_module
from serve.sidecar.control import state_file as state_file_module
from serve.sidecar.control.reconciler import Reconciler, assess
from serve.sidecar.control.switch import VersionSwitch
from serve.sidecar.http.app import create_app
from serve.state import ALLOWED_FIELDS, Batching, DesiredState, ModelRef, write_state
from serve.store.repository import ModelRepository, record_archive_digest
from tests.fixtures.sidecar import FakeClock, FakeTorchServe, add_versions, dead_port, toy_mar
from tests.promtext import samples

T = TypeVar("T")
MGMT = "http://ts-management"
TOKEN = "t0ken-for-tests-t0ken-for-tests-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MiB = 1 << 20


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def desired(version: str = "small-s0", batch_size: int = 8, delay: int = 50,
            workers: int = 1) -> DesiredState:
    return DesiredState(model=ModelRef(version=version),
                        batching=Batching(batch_size=batch_size, max_batch_delay_ms=delay),
                        workers=workers)


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepository:
    return ModelRepository([add_versions(tmp_path / "repo", ["small-s0", "small-s1"])])


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    path = tmp_path / "state" / "state.yaml"
    write_state(path, desired())
    return path


class World:
    """A reconciler on the fake TorchServe, with its fake clock and metrics."""

    def __init__(self, ts: FakeTorchServe, repo: ModelRepository, state_file: Path,
                 memory: MemoryProbe | None = None, **config: Any) -> None:
        self.ts, self.clock, self.metrics = ts, FakeClock(), SidecarMetrics()
        self.phases: list[str] = []
        cfg = SidecarConfig(**{"management_url": MGMT, "model_store": ts.store,
                               "switch_grace_s": 0.0, "state_file": state_file,
                               "repositories": tuple(repo.roots), **config})
        client = TorchServeClient(cfg, httpx.AsyncClient(transport=ts.transport()))

        def phase(p: str) -> None:
            self.phases.append(p)
            self.metrics.set_switch_phase(p)

        self.switch = VersionSwitch(client, cfg, clock=self.clock, sleep=self.clock.sleep,
                                    on_phase=phase, memory=memory)
        self.rec = Reconciler(client, cfg, switch=self.switch, repository=repo,
                              metrics=self.metrics, clock=self.clock)

    def tick(self):
        return run(self.rec.tick())

    def status(self) -> dict[str, Any]:
        return run(self.rec.status()).model_dump(mode="json", by_alias=True)

    def reconcile_counts(self) -> dict[str, float]:
        return {s.labels["result"]: s.value for fam in self.metrics.collect()
                for s in fam.samples if fam.name == "dlrm_reconcile"}


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------ assess (pure)


def test_assess_decides_the_next_step():
    from serve.sidecar.adapters.torchserve import Registered

    def reg(version: str, ready: int = 1) -> Registered:
        return Registered(version=version, batch_size=8, max_batch_delay_ms=50, url="x.mar",
                          pids=(1,), ready=ready, pending=0, memory=(0,))

    want = desired()
    t = "small-s0_b8d50w1"
    assert assess(None, Observed(None)).action == "wait"
    a = assess(want, Observed(None))
    assert (a.action, a.reason) == ("switch", (f"nothing is registered in TorchServe; {t} is "
                                              "to be registered"))
    a = assess(want, Observed("1.0", (reg("1.0"),)))
    assert (a.action, a.reason) == ("switch", f"TorchServe serves 1.0; the desired state is {t}")
    a = assess(want, Observed(t, (reg("1.0"), reg(t))))
    assert (a.action, a.serving, a.reason) == (
        "cleanup", True, f"{t} serves; 1.0 still registered (being drained and unregistered)")
    a = assess(want, Observed(t, (reg(t, ready=0),)))
    assert (a.action, a.reason) == (
        "wait", f"0 of 1 workers of {t} are READY; TorchServe is starting them")
    a = assess(want, Observed(t, (reg(t),)))
    assert (a.converged, a.action, a.reason, a.target) == (True, "none", None, t)


# ------------------------------------------------------------------ passes


def test_nothing_registered_converges(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    w = World(ts, repo, state_file)
    p = w.tick()
    assert (p.result, p.converged, p.reason) == ("applied", True, None)
    assert ts.default == "small-s0_b8d50w1" and set(ts.versions) == {"small-s0_b8d50w1"}
    assert ("DELETE", "/models/dlrm/small-s0_b8d50w1") not in ts.calls  # nothing drained
    assert w.phases == ["idle", "copying", "registering", "waiting_ready", "setting_default",
                        "idle"]
    assert files(ts.store) == ["dlrm-small-s0_b8d50w1.mar"]
    ts.calls.clear()
    p = w.tick()  # level-triggered: look again, nothing to do
    assert (p.result, p.converged) == ("converged", True)
    assert all(method == "GET" for method, _ in ts.calls)
    assert w.reconcile_counts() == {r: float(r in ("applied", "converged"))
                                    for r in RECONCILE_RESULTS}


def test_batching_change_switches_then_drains_and_unregisters_the_old(tmp_path, repo,
                                                                     state_file):
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    w = World(ts, repo, state_file)
    w.tick()
    write_state(state_file, desired(batch_size=16, delay=5))
    ts.pending["small-s0_b8d50w1"] = [3, 0, 0]
    ts.calls.clear()
    p = w.tick()
    assert (p.result, p.converged) == ("applied", True)
    new = "small-s0_b16d5w1"
    assert ts.default == new and set(ts.versions) == {new}
    old_calls = [c for c in ts.calls if c[1].startswith("/models/dlrm/small-s0_b8d50w1")]
    assert old_calls == [("GET", "/models/dlrm/small-s0_b8d50w1")] * 3 + [
        ("DELETE", "/models/dlrm/small-s0_b8d50w1")]  # drained (3, 0, 0), then unregistered
    assert ts.calls.index(("PUT", f"/models/dlrm/{new}/set-default")) < \
        ts.calls.index(("GET", "/models/dlrm/small-s0_b8d50w1"))
    assert files(ts.store) == [f"dlrm-{new}.mar"]  # the old derived archive went with it
    assert w.phases[-3:] == ["draining", "unregistering", "idle"]
    record = w.rec.last_switch
    assert record is not None
    assert (record.from_version, record.to, record.ok, record.error) == \
        ("small-s0_b8d50w1", new, True, None)


def test_version_change_and_a_foreign_version_at_start(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")  # 1.0 from dlrm.mar, as TorchServe --models
    w = World(ts, repo, state_file)
    assert w.tick().converged
    assert set(ts.versions) == {"small-s0_b8d50w1"}
    assert files(ts.store) == ["dlrm-small-s0_b8d50w1.mar", "dlrm.mar"]  # not ours: kept
    write_state(state_file, desired("small-s1"))
    assert w.tick().converged
    assert ts.default == "small-s1_b8d50w1" and set(ts.versions) == {"small-s1_b8d50w1"}
    assert files(ts.store) == ["dlrm-small-s1_b8d50w1.mar", "dlrm.mar"]
    assert repo.versions() == ["small-s0", "small-s1"]  # repository archives untouched


@pytest.mark.parametrize("failure", [
    {("POST", "/models"): 500},
    "never ready",
    {("PUT", "/models/dlrm/small-s0_b16d50w1/set-default"): 503},
    "bad archive",
])
def test_a_failure_at_any_step_rolls_back_and_is_retried_later(tmp_path, repo, state_file,
                                                               failure):
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    w = World(ts, repo, state_file, register_timeout_s=5.0)
    w.tick()
    before = (set(ts.versions), ts.default, files(ts.store))
    bad_root = tmp_path / "bad"
    if failure == "never ready":
        ts.ready_after = None
    elif failure == "bad archive":  # small-s1 is damaged in a repository that wins
        add_versions(bad_root, ["small-s0"])
        (bad_root / "dlrm-small-s0.mar").chmod(0o644)
        (bad_root / "dlrm-small-s0.mar").write_bytes(b"not a zip")
        # a build that recorded its broken archive: the digest passes, the copy fails
        (bad_root / "dlrm-small-s0.mar.sha256").unlink()
        record_archive_digest(ModelRepository([bad_root]), "small-s0")
        w.rec.repository = ModelRepository([bad_root, *repo.roots])
    else:
        ts.failures.update(failure)
    write_state(state_file, desired(batch_size=16))
    p = w.tick()
    assert (p.result, p.converged) == ("failed", False)
    assert p.switch_error is not None and w.rec.last_error == p.switch_error.message
    assert (set(ts.versions), ts.default, files(ts.store)) == before  # nothing orphaned
    assert w.phases[-2:] == ["rolling_back", "failed"]
    assert p.reason.endswith(f"the last switch failed ({p.switch_error.message}); retrying "
                             "in 2 s")
    # Back-off: the next pass does not retry before 2 s have passed...
    ts.calls.clear()
    p = w.tick()
    assert p.result == "waiting" and ("POST", "/models") not in ts.calls
    # ...then it does, and once the fault is gone it converges.
    ts.failures.clear()
    ts.ready_after = 0
    w.rec.repository = repo
    w.clock.now += 2.0
    p = w.tick()
    assert (p.result, p.converged) == ("applied", True)
    assert set(ts.versions) == {"small-s0_b16d50w1"} and w.rec.last_error is None


def test_a_file_naming_a_version_the_repository_lacks_fails_and_names_the_available(
        tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file)
    w.tick()
    write_state(state_file, desired("small-s9"))  # edited by hand (or a ConfigMap)
    p = w.tick()
    assert (p.result, p.converged) == ("failed", False)
    assert w.rec.last_error.startswith("model version 'small-s9' is not in the repository")
    assert "available: ['small-s0', 'small-s1']" in w.rec.last_error
    assert w.switch.phase.value == "failed" and w.switch.last_error == w.rec.last_error
    assert set(ts.versions) == {"small-s0_b8d50w1"}  # the last good one keeps serving


def test_retries_back_off_exponentially_and_a_new_desired_state_retries_at_once(
        tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    w = World(ts, repo, state_file)
    ts.failures[("POST", "/models")] = 500
    posts = []
    for _ in range(4):
        w.tick()
        posts.append(ts.calls.count(("POST", "/models")))
        w.clock.now += 2.0
    assert posts == [1, 2, 2, 3]  # retried at 0 s, 2 s, then 4 s later
    write_state(state_file, desired(batch_size=4))
    w.tick()
    assert ts.calls.count(("POST", "/models")) == 4


def test_a_second_change_during_a_switch_is_applied_after_it(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file)
    ts.ready_after = 2  # wait_ready sleeps twice: the second change lands meanwhile
    sleep = w.clock.sleep

    async def change_during_switch(seconds: float) -> None:
        if w.switch.phase.value == "waiting_ready":
            write_state(state_file, desired(batch_size=32))
        await sleep(seconds)

    w.switch.sleep = change_during_switch
    p = w.tick()
    # The running switch completed (and its clean-up: at most two versions loaded)...
    assert (p.target, p.result, p.converged) == ("small-s0_b8d50w1", "applied", True)
    assert set(ts.versions) == {"small-s0_b8d50w1"}
    # ...and the next pass converges to the latest.
    p = w.tick()
    assert (p.target, p.converged) == ("small-s0_b32d50w1", True)
    assert set(ts.versions) == {"small-s0_b32d50w1"}


def test_cleanup_removes_every_other_version_and_orphan_archives(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file)
    w.tick()
    # A crashed pass left a registered version and an archive nobody registered.
    toy_mar(ts.store / "dlrm-small-s1_b2d2w2.mar", version="small-s1_b2d2w2")
    ts.add("small-s1_b2d2w2", "dlrm-small-s1_b2d2w2.mar", batch_size=2, delay=2, workers=2,
           ready=True)
    toy_mar(ts.store / "dlrm-small-s1_b9d9w9.mar", version="small-s1_b9d9w9")
    p = w.tick()
    assert (p.result, p.converged) == ("applied", True)
    assert set(ts.versions) == {"small-s0_b8d50w1"}
    assert files(ts.store) == ["dlrm-small-s0_b8d50w1.mar", "dlrm.mar"]


def test_a_stuck_old_queue_stays_registered_and_is_drained_again(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file, drain_timeout_s=1.0)
    ts.pending["1.0"] = [5]
    p = w.tick()
    assert (p.result, p.serving, p.converged) == ("failed", True, False)
    assert p.cleanup_error.startswith("version 1.0 of 'dlrm' still had 5 queued requests")
    assert set(ts.versions) == {"1.0", "small-s0_b8d50w1"} and w.switch.phase.value == "idle"
    assert w.rec.last_switch.ok and w.rec.last_switch.error == p.cleanup_error
    ts.pending["1.0"] = [0]
    p = w.tick()
    assert (p.result, p.converged) == ("applied", True) and set(ts.versions) == \
        {"small-s0_b8d50w1"}


def test_a_restart_with_the_desired_state_serving_changes_nothing(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    World(ts, repo, state_file).tick()
    ts.calls.clear()
    again = World(ts, repo, state_file)  # a new sidecar process: no memory of the past
    p = again.tick()
    assert (p.result, p.converged) == ("converged", True)
    assert all(method == "GET" for method, _ in ts.calls)


def test_an_invalid_file_keeps_the_last_valid_desired_state(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file)
    w.tick()
    state_file.write_text("model:\n  version: small-s0\nbatching:\n  batch_size: 0\n")
    p = w.tick()
    message = (f"{state_file}: batching.batch_size: Input should be greater than or equal "
               "to 1 (got 0)")
    assert (p.result, p.converged) == ("invalid", False)
    assert w.rec.desired == desired() and w.rec.last_error == message
    assert p.reason == (f"the desired-state file is not usable ({message}); keeping the last "
                        "valid desired state")
    state_file.write_text("model: [unclosed\n")
    p = w.tick()
    assert w.rec.last_error.startswith(f"desired-state file {state_file} is not valid YAML")
    assert set(ts.versions) == {"small-s0_b8d50w1"}  # still serving the last valid one
    write_state(state_file, desired(batch_size=4))
    p = w.tick()
    assert (p.result, p.converged, w.rec.last_error) == ("applied", True, None)


def test_without_a_valid_file_at_start_nothing_is_touched(tmp_path, repo):
    ts = FakeTorchServe(tmp_path / "store")
    path = tmp_path / "absent" / "state.yaml"
    w = World(ts, repo, path)
    p = w.tick()
    assert (p.result, p.converged) == ("invalid", False)
    assert p.reason == (f"the desired-state file is not usable (desired-state file {path} "
                        "does not exist; PUT /state or write it (format: serve/state.py)); "
                        "nothing to converge to")
    assert all(method == "GET" for method, _ in ts.calls) and set(ts.versions) == {"1.0"}
    assert w.status()["observed"]["serving_version"] == "1.0"


def test_the_file_is_reread_by_path_across_a_symlink_swap(tmp_path, repo):
    """kubelet updates a ConfigMap folder by pointing ``..data`` at a new folder."""
    mount = tmp_path / "mount"
    (mount / "..v1").mkdir(parents=True)
    write_state(mount / "..v1" / "state.yaml", desired())
    (mount / "..data").symlink_to("..v1")
    (mount / "state.yaml").symlink_to("..data/state.yaml")
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, mount / "state.yaml")
    assert w.tick().target == "small-s0_b8d50w1"
    (mount / "..v2").mkdir()
    write_state(mount / "..v2" / "state.yaml", desired(workers=2))
    (mount / "..data_tmp").symlink_to("..v2")
    os.replace(mount / "..data_tmp", mount / "..data")
    p = w.tick()
    assert (p.target, p.converged) == ("small-s0_b8d50w2", True)


def test_not_enough_memory_refuses_the_switch(tmp_path, repo, state_file):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{1000 * MiB}\n")
    (root / "memory.current").write_text(f"{800 * MiB}\n")
    ts = FakeTorchServe(tmp_path / "store")
    probe = MemoryProbe(CgroupMemory(root), rss={100: 200 * MiB}.get)
    w = World(ts, repo, state_file, memory=probe)
    p = w.tick()
    message = (f"switch to small-s0_b8d50w1 refused: it needs about 200 MiB (serving workers' "
               f"RSS 200 MiB x 1 workers) on top of 800 MiB in use (cgroup working set), "
               f"1000 MiB > 90% of the memory limit 1000 MiB ({root}/memory.max): the old and "
               f"the new version would not fit side by side. Raise the memory limit of "
               f"TorchServe's container to at least 1111 MiB, or declare fewer workers")
    assert (p.result, p.converged) == ("refused", False)
    assert p.switch_error.message == message and p.switch_error.status == 507
    assert set(ts.versions) == {"1.0"} and ("POST", "/models") not in ts.calls
    assert files(ts.store) == ["dlrm.mar"]
    status = w.status()
    assert status["last_error"] == message and status["phase"] == "failed"
    assert status["reason"] == ("TorchServe serves 1.0; the desired state is "
                                f"small-s0_b8d50w1; the last switch failed ({message}); "
                                "retrying in 2 s")
    assert status["last_switch"]["ok"] is False
    assert status["last_switch"]["memory_limit_bytes"] == 1000 * MiB
    # With room (the limit raised), the switch goes ahead and its numbers are kept.
    (root / "memory.max").write_text(f"{2000 * MiB}\n")
    w.clock.now += 2.0
    p = w.tick()
    assert p.converged
    check = w.rec.last_switch.memory_check
    assert check == {"limit_bytes": 2000 * MiB, "usage_bytes": 800 * MiB,
                     "need_bytes": 200 * MiB, "headroom": 0.9,
                     "limit_source": f"{root}/memory.max", "fits": True}
    assert w.rec.last_switch.peak_memory_bytes == 800 * MiB
    assert w.rec.last_switch.peak_workers_rss_bytes == 200 * MiB


def test_status_shape(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file)
    # A read changes nothing: before the first pass nothing has read the file yet.
    first = w.status()
    assert (first["desired"], first["converged"], first["target_serving_version"]) == (
        None, False, None)
    assert first["reason"] == ("the reconciler has not read the desired-state file yet "
                               "(its first pass is starting)")
    ts.failures[("GET", "/models/dlrm/all")] = 500  # the first pass reads the file only
    assert w.tick().result == "unavailable"
    ts.failures.clear()
    before = w.status()
    assert before["last_error"].startswith("TorchServe http://ts-management/models/dlrm/all")
    before["last_error"] = None
    assert before == {
        "desired": {"model": {"version": "small-s0"},
                    "batching": {"batch_size": 8, "max_batch_delay_ms": 50},
                    "workers": 1, "rollout": None},
        "observed": {"model": {"version": "1.0", "schema": None},
                     "batching": {"batch_size": 8, "max_batch_delay_ms": 50},
                     "workers": 1, "candidate": None, "serving_version": "1.0",
                     "ready_workers": 1, "pending_requests": 0,
                     "registered_versions": ["1.0"], "tables": None},
        "converged": False,
        "reason": "TorchServe serves 1.0; the desired state is small-s0_b8d50w1",
        "phase": "idle", "last_error": None, "last_switch": None,
        "target_serving_version": "small-s0_b8d50w1",
        "available_versions": ["small-s0", "small-s1"],
        "state_file": str(state_file), "state_file_writable": True, "rollout": None,
        "tuner": None, "sidecar": None, "endpoints": None}
    w.tick()
    after = w.status()
    assert after["converged"] is True and after["reason"] is None
    assert after["observed"] == {
        "model": {"version": "small-s0", "schema": None},
        "batching": {"batch_size": 8, "max_batch_delay_ms": 50}, "workers": 1,
        "candidate": None, "serving_version": "small-s0_b8d50w1", "ready_workers": 1,
        "pending_requests": 0, "registered_versions": ["small-s0_b8d50w1"], "tables": None}
    assert after["last_switch"] == {
        "from": "1.0", "to": "small-s0_b8d50w1", "ok": True,
        "seconds": after["last_switch"]["seconds"], "error": None, "peak_memory_bytes": None,
        "peak_workers_rss_bytes": None, "memory_limit_bytes": None, "memory_check": None}
    samples_ = {fam.name: fam.samples[0].value for fam in w.metrics.collect()
                if fam.name == "dlrm_state_converged"}
    assert samples_ == {"dlrm_state_converged": 1.0}


def test_torchserve_down_is_a_reason_not_a_crash(tmp_path, repo, state_file):
    dead = f"http://127.0.0.1:{dead_port()}"
    w = World(FakeTorchServe(tmp_path / "store"), repo, state_file, management_url=dead)
    w.rec.ts.client = httpx.AsyncClient()  # a real client, to a port nobody listens on
    p = w.tick()
    assert (p.result, p.converged) == ("unavailable", False)
    assert p.reason.startswith(f"TorchServe did not answer: TorchServe management API at "
                               f"{dead}/models/dlrm/all did not answer (ConnectError")
    status = w.status()
    assert status["reason"] == p.reason and status["converged"] is False
    assert status["observed"]["registered_versions"] == [] and status["last_error"]


def test_a_writer_waiting_for_its_change_learns_the_outcome(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file)
    w.tick()

    async def write_and_wait(state: DesiredState, timeout_s: float = 5.0):
        after, digest = w.rec.write(state)
        waiter = asyncio.create_task(w.rec.passes.wait_serving(after, digest, timeout_s))
        await asyncio.sleep(0)
        await w.rec.tick()
        return await waiter

    p = run(write_and_wait(desired(batch_size=16)))
    assert p.converged and p.target == "small-s0_b16d50w1"
    ts.failures[("POST", "/models")] = 500
    with pytest.raises(reconciler_module.SwitchFailed) as failed:
        run(write_and_wait(desired(batch_size=4)))
    assert failed.value.error.message.startswith("TorchServe POST http://ts-management/models "
                                                 "answered 500")
    assert w.rec.revert(desired(batch_size=4), desired(batch_size=16))  # as PUT /batching does
    assert not w.rec.revert(desired(batch_size=4), desired())  # only what it wrote
    ts.failures = {("GET", "/models/dlrm/all"): 500}
    with pytest.raises(UpstreamUnavailable, match=(
            r"^TorchServe did not answer: TorchServe http://ts-management/models/dlrm/all "
            r"answered 500: .*; the change stays declared in .* and is applied once "
            r"TorchServe answers \(GET /state\)$")):
        run(write_and_wait(desired(batch_size=5)))


# ------------------------------------------------------------------ GET/PUT /state


def make_app(ts: FakeTorchServe, repo: ModelRepository, state_file: Path | None,
             registry: CollectorRegistry | None = None, **config: Any):
    return create_app(
        SidecarConfig(**{"management_url": MGMT, "metrics_url": MGMT, "token": TOKEN,
                         "model_store": ts.store, "switch_grace_s": 0.0,
                         "state_file": state_file, "repositories": tuple(repo.roots),
                         "cgroup_root": ts.store.parent / "no-cgroup",
                         "reconcile_interval_s": 0.05, **config}),
        registry=registry, http_client=httpx.AsyncClient(transport=ts.transport()))


def requests(app, *calls: tuple[str, str, Any]) -> list[httpx.Response]:
    """``(method, url, json body or None)`` in one app lifespan (the loop runs)."""
    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
                out = []
                for method, url, body in calls:
                    if method == "WAIT":  # until GET /state converges
                        for _ in range(300):
                            r = await c.get("/state")
                            if r.json()["converged"]:
                                break
                            await asyncio.sleep(0.02)
                        out.append(r)
                        continue
                    out.append(await c.request(method, url, json=body, headers=AUTH))
                return out
    return asyncio.run(go())


def test_put_state_returns_at_once_and_the_reconciler_applies_it(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    registry = CollectorRegistry()
    # A long interval: only the PUT's wake-up can make it converge within the test.
    app = make_app(ts, repo, state_file, registry, reconcile_interval_s=30.0)
    body = {"model": {"version": "small-s1"}, "batching": {"batch_size": 4,
                                                           "max_batch_delay_ms": 3},
            "workers": 2, "rollout": None}
    put, state = requests(app, ("PUT", "/state", body), ("WAIT", "", None))
    assert put.status_code == 202, put.text
    assert put.json() == {"desired": body, "converged": False,
                          "target_serving_version": "small-s1_b4d3w2",
                          "state_file": str(state_file),
                          "message": "written; the reconciler applies it now: GET /state "
                                     "shows the progress"}
    assert yaml.safe_load(state_file.read_text()) == body
    assert state.json()["converged"] is True
    assert state.json()["observed"]["serving_version"] == "small-s1_b4d3w2"
    assert set(ts.versions) == {"small-s1_b4d3w2"}
    got = samples(generate_latest(registry).decode())
    assert got[("dlrm_state_converged", ())] == 1
    assert got[("dlrm_reconcile_total", (("result", "applied"),))] >= 1


@pytest.mark.parametrize("body, message", [
    ({"model": {"version": "small-s0"}, "batching": {"batch_size": 0}},
     "batching.batch_size: Input should be greater than or equal to 1 (got 0)"),
    ({"model": {"version": "small-s0"}, "workers": "2"},
     "workers: Input should be a valid integer (got '2')"),
    ({"model": {"version": "small-s0"}, "workers": 65},
     "workers: Input should be less than or equal to 64 (got 65)"),
    ({"batching": {"batch_size": 8, "max_batch_delay_ms": 2}}, "model: Field required"),
    ({"model": {"version": "a_b"}},
     ("model.version: String should match pattern '^[A-Za-z0-9][A-Za-z0-9.\\-]{0,63}$' "
     "(got 'a_b')")),
    ({"model": {"version": "small-s0"}, "rollout": {"candidate": "small-s1"}},
     "rollout.weight: Field required"),
    ({"model": {"version": "small-s0"}, "batchSize": 8},
     f"batchSize: unknown field; remove it (allowed: {ALLOWED_FIELDS}) (got 8)"),
    ([1], ("body: must be a JSON object (got list); a desired state is {\"model\": "
          "{\"version\": V}, \"batching\": {\"batch_size\": 1..4096, \"max_batch_delay_ms\": "
          "0..10000}, \"workers\": 1..64, \"rollout\": null or {\"candidate\": V2, "
          "\"mode\": \"canary\"|\"shadow\", \"weight\": 0..1, \"steps\": [...], "
          "\"bake_s\": s, \"guards\": {...}}}")),
])
def test_bad_put_state_bodies_get_400_naming_the_field(tmp_path, repo, state_file, body,
                                                      message):
    ts = FakeTorchServe(tmp_path / "store")
    before = state_file.read_text()
    [r] = requests(make_app(ts, repo, state_file), ("PUT", "/state", body))
    assert r.status_code == 400
    assert r.json() == {"code": 400, "type": "InvalidInput",
                        "message": f"invalid PUT /state body: {message}"}
    assert state_file.read_text() == before


def test_a_version_not_in_the_repository_gets_400_listing_the_available(tmp_path, repo,
                                                                       state_file):
    ts = FakeTorchServe(tmp_path / "store")
    [r] = requests(make_app(ts, repo, state_file),
                   ("PUT", "/state", {"model": {"version": "small-s9"}}))
    assert r.status_code == 400
    assert r.json()["message"] == (
        f"invalid PUT /state body: model.version: model version 'small-s9' is not in the "
        f"repository ({repo.roots[0]}); available: ['small-s0', 'small-s1']. Build it with "
        f"`make model` (SEED=, VERSION=) or copy its .mar and .json there")


def test_put_state_on_a_read_only_file_is_409(tmp_path, repo, state_file, monkeypatch):
    ts = FakeTorchServe(tmp_path / "store")
    real_access = os.access
    folder = str(state_file.parent)

    def access(path: Any, mode: int) -> bool:  # as a ConfigMap mount is (root or not)
        if str(path).startswith(folder) and mode == os.W_OK:
            return False
        return real_access(path, mode)

    monkeypatch.setattr(state_file_module.os, "access", access)
    before = state_file.read_text()
    put, state = requests(make_app(ts, repo, state_file),
                          ("PUT", "/state", {"model": {"version": "small-s1"}}),
                          ("GET", "/state", None))
    assert put.status_code == 409
    assert put.json() == {
        "code": 409, "type": "Conflict",
        "message": f"the desired-state file {state_file} is read-only ({state_file} is not "
                   "writable). In Kubernetes it is the ConfigMap dlrm-serving-state mounted "
                   "into the pod: change it there (`kubectl edit configmap "
                   "dlrm-serving-state`, or edit the manifest and `kubectl apply -f` it); "
                   "every pod applies it once kubelet updates the mount (up to a minute)"}
    assert state_file.read_text() == before
    assert state.json()["state_file_writable"] is False


def test_a_read_only_file_system_on_write_is_409(tmp_path, repo, state_file, monkeypatch):
    ts = FakeTorchServe(tmp_path / "store")

    def erofs(path: Any, state: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(state_file_module, "write_state", erofs)
    [put] = requests(make_app(ts, repo, state_file),
                     ("PUT", "/state", {"model": {"version": "small-s1"}}))
    assert put.status_code == 409
    assert put.json()["message"].startswith(
        f"the desired-state file {state_file} is read-only ([Errno 30] Read-only file "
        f"system: '{state_file}'). In Kubernetes it is the ConfigMap dlrm-serving-state")


def test_without_a_state_file_puts_are_409_and_get_explains(tmp_path, repo):
    ts = FakeTorchServe(tmp_path / "store")
    state_put, batching_put, get = requests(
        make_app(ts, repo, None), ("PUT", "/state", {"model": {"version": "small-s0"}}),
        ("PUT", "/batching", {"batch_size": 4}), ("GET", "/state", None))
    for r, what in ((state_put, "PUT /state"), (batching_put, "PUT /batching")):
        assert r.status_code == 409
        assert r.json() == {
            "code": 409, "type": "Conflict",
            "message": f"{what} changes the desired state, but this sidecar was started "
                       f"without --state-file (or {DLRM_STATE_FILE}): restart it with one (in "
                       f"Kubernetes the ConfigMap dlrm-serving-state mounted at "
                       f"{DEFAULT_STATE_FILE})"}
    body = get.json()
    assert get.status_code == 200 and body["desired"] is None and body["converged"] is False
    assert body["reason"] == ("this sidecar was started without --state-file: nothing "
                              "declares what to serve, and nothing is reconciled")
    assert body["observed"]["serving_version"] == "1.0" and set(ts.versions) == {"1.0"}


def test_put_state_needs_the_token(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    app = make_app(ts, repo, state_file)

    async def go() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
                return await c.put("/state", json={"model": {"version": "small-s1"}})

    r = run(go())
    assert r.status_code == 401
    assert r.json()["message"].startswith("PUT /state needs the header 'Authorization: Bearer")


def test_the_documented_default_state_file():
    assert DEFAULT_STATE_FILE == "/etc/dlrm/state/state.yaml"
    from serve.sidecar.http.app import build_parser

    assert build_parser().parse_args(["--state-file", DEFAULT_STATE_FILE]).state_file == \
        DEFAULT_STATE_FILE


def test_cli_flags_and_env(monkeypatch, tmp_path):
    from serve.sidecar.http.app import build_parser

    monkeypatch.delenv(DLRM_STATE_FILE.name, raising=False)
    monkeypatch.delenv(settings.DLRM_REPOSITORY.name, raising=False)
    args = build_parser().parse_args([])
    assert (args.state_file, args.repository, args.reconcile_interval, args.drain_timeout,
            args.cgroup_root) == (None, (), 1.0, 60.0, "/sys/fs/cgroup")
    monkeypatch.setenv(DLRM_STATE_FILE.name, "/x/state.yaml")
    assert build_parser().parse_args([]).state_file == "/x/state.yaml"
    args = build_parser().parse_args(["--repository", "a", "--repository", "b"])
    assert args.repository == ["a", "b"]


def test_put_state_rollout_names_a_missing_candidate(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    before = state_file.read_text()
    body = {"model": {"version": "small-s0"}, "rollout": {"candidate": "small-s9", "weight": 0.1}}
    [r] = requests(make_app(ts, repo, state_file), ("PUT", "/state", body))
    assert r.status_code == 400
    assert r.json()["message"].startswith(
        "invalid PUT /state body: rollout.candidate: model version 'small-s9' is not in the "
        "repository")
    assert "available: ['small-s0', 'small-s1']" in r.json()["message"]
    assert state_file.read_text() == before


def test_manual_promote_and_rollback_need_a_baking_rollout(tmp_path, repo, state_file):
    ts = FakeTorchServe(tmp_path / "store")
    app = make_app(ts, repo, state_file)
    r1, r2 = requests(app, ("POST", "/state/rollout/promote", None),
                      ("POST", "/state/rollout/rollback", None))
    for r, what in ((r1, "promote"), (r2, "roll back")):
        assert r.status_code == 409, r.text
        assert r.json()["message"].startswith(f"cannot {what}: no rollout was declared")


def test_put_state_with_a_new_batching_pins_it_and_the_tuner_can_resume(tmp_path, repo,
                                                                       state_file):
    ts = FakeTorchServe(tmp_path / "store")
    same = {"model": {"version": "small-s1"},
            "batching": {"batch_size": 8, "max_batch_delay_ms": 50}, "workers": 1}
    new = {**same, "batching": {"batch_size": 16, "max_batch_delay_ms": 5}}
    r1, t1, r2, t2, bad, on, st = requests(
        make_app(ts, repo, state_file), ("WAIT", "", None),
        ("PUT", "/state", same), ("GET", "/tuner", None),       # a new version only
        ("PUT", "/state", new), ("GET", "/tuner", None),        # a new batching: pinned
        ("PUT", "/tuner", {"enabled": 1}), ("PUT", "/tuner", {"enabled": True}),
        ("GET", "/state", None))[1:]
    assert r1.status_code == 202 and t1.json()["enabled"] is True
    assert r2.status_code == 202 and t2.json()["enabled"] is False
    assert "PUT /state declaring batching 16/5 ms" in t2.json()["reason"]
    assert bad.status_code == 400 and "enabled" in bad.json()["message"]
    assert on.status_code == 200 and on.json()["enabled"] is True
    assert st.json()["tuner"]["enabled"] is True


def test_stop_task_ends_a_task_that_swallowed_its_first_cancel():
    """A cancel lost inside a task must not hang the sidecar's shutdown (it once hung a
    test's app lifespan): stop_task cancels again until the task has ended."""
    from serve.sidecar.root import stop_task

    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:  # the second cancel ends it
                    raise
                swallowed.append(True)  # e.g. suppress(CancelledError) in a finally

    async def go() -> asyncio.Task[None]:
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(stop_task(task, retry_s=0.05), timeout=5)
        return task

    task = asyncio.run(go())
    assert swallowed == [True] and task.cancelled()



# ------------------------------------------------------------------ model schemas

#: An imported model's schema: 2 dense, two features reading one table.
OWN = ModelSchema(dense=2, tables=(TableSpec("t_item", rows=1000, dim=16),),
                  features=(FeatureSpec("item_id", "t_item", 1),
                            FeatureSpec("history", "t_item", 20)))
#: The same requests, another table layout (rows, dim, dtype, pooling).
OWN_RESIZED = ModelSchema(dense=2, tables=(TableSpec("t_item", 5000, 32, "mean", "fp16"),),
                          features=OWN.features)
#: Other requests: a third dense feature and one more sparse feature.
OWN_WIDER = ModelSchema(dense=3, tables=OWN.tables + (TableSpec("t_user", 10, 8),),
                        features=OWN.features + (FeatureSpec("user_id", "t_user", 1),))


@pytest.fixture
def schema_repo(tmp_path: Path) -> ModelRepository:
    """Versions with every kind of report: a built-in build (profile + dtype), imports
    recording their schema, and a report with neither."""
    root = tmp_path / "schema-repo"
    repo = ModelRepository([root])
    root.mkdir(parents=True)
    reports = {"tiny-s0": {"profile": "tiny", "quantized_dtype": "int8"},
               "own-a": {"schema": OWN.to_dict()},
               "own-b": {"schema": OWN_RESIZED.to_dict()},
               "own-c": {"schema": OWN_WIDER.to_dict()},
               "plain": {}}
    for i, (version, report) in enumerate(reports.items()):
        src = toy_mar(root / f".src-{version}.mar", version=version)
        repo.add(version, src, {"created_at": f"2026-01-01T00:00:{i:02d}Z",
                                "version": version, **report})
        src.unlink()
    return repo


def test_get_state_shows_the_served_versions_schema(tmp_path, schema_repo):
    ts = FakeTorchServe(tmp_path / "store")
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired("own-a"))
    own, _, builtin, _, plain = requests(
        make_app(ts, schema_repo, state_file), ("WAIT", "", None),
        ("PUT", "/state", {"model": {"version": "tiny-s0", "schema_change": True}}),
        ("WAIT", "", None),
        ("PUT", "/state", {"model": {"version": "plain"}}), ("WAIT", "", None))
    model = own.json()["observed"]["model"]
    assert model == {"version": "own-a", "schema": {"dense": 2, "sparse": [
        {"name": "item_id", "table": "t_item", "rows": 1000, "dim": 16, "pooling": "sum",
         "max_ids": 1},
        {"name": "history", "table": "t_item", "rows": 1000, "dim": 16, "pooling": "sum",
         "max_ids": 20}]}}
    model = builtin.json()["observed"]["model"]
    assert model["version"] == "tiny-s0"
    schema = model["schema"]  # derived from the report's profile and quantized_dtype
    assert schema == get_profile("tiny").schema("int8").describe()
    assert schema["dense"] == 13 and len(schema["sparse"]) == 26
    assert schema["sparse"][0] == {"name": "C1", "table": "t_C1", "rows": 500, "dim": 16,
                                   "pooling": "sum", "max_ids": 64}
    assert plain.status_code == 200
    assert plain.json()["observed"]["model"] == {"version": "plain", "schema": None}


def test_the_schema_is_read_once_per_version_from_the_injected_reader(tmp_path, repo,
                                                                     state_file):
    reads: list[str] = []
    reports = {"small-s0": {"schema": OWN.to_dict()}, "small-s1": {"profile": "nope"}}

    def report_of(version: str) -> dict[str, Any]:
        reads.append(version)
        return reports[version]  # KeyError: no report

    ts = FakeTorchServe(tmp_path / "store")
    w = World(ts, repo, state_file)
    w.rec.schemas = SchemaCache(report_of)
    assert w.status()["observed"]["model"] == {"version": "1.0", "schema": None}
    assert w.status()["observed"]["model"]["schema"] is None
    assert reads == ["1.0", "1.0"]  # no report: not remembered (it may be written later)
    w.tick()
    for _ in range(3):
        assert w.status()["observed"]["model"] == {"version": "small-s0",
                                                   "schema": OWN.describe()}
    assert reads.count("small-s0") == 1  # reports are immutable: read and parsed once
    cache = w.rec.schemas
    assert cache.schema("small-s1") is None and cache.schema("small-s1") is None
    assert reads.count("small-s1") == 1  # underivable: a fact of an immutable report


@pytest.mark.parametrize("stable, candidate, differences", [
    ("own-a", "own-c", ["dense features: 2 vs 3",
                        "sparse features only in the second: ['user_id']"]),
    ("tiny-s0", "own-a", ["dense features: 13 vs 2"]),
])
def test_a_rollout_to_another_request_schema_is_409_and_changes_nothing(
        tmp_path, schema_repo, stable, candidate, differences):
    ts = FakeTorchServe(tmp_path / "store")
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired(stable))
    before = state_file.read_text()
    body = {"model": {"version": stable},
            "rollout": {"candidate": candidate, "weight": 0.1}}
    put, get = requests(make_app(ts, schema_repo, state_file), ("PUT", "/state", body),
                        ("GET", "/state", None))
    assert put.status_code == 409, put.text
    answer = put.json()
    assert (answer["code"], answer["type"]) == (409, "Conflict")
    message = answer["message"]
    assert message.startswith(f"rollout.candidate: {candidate!r} takes other requests than "
                              f"the stable version {stable!r} (")
    for difference in differences:
        assert difference in message
    assert message.endswith("import the candidate with the same features, or switch the "
                            "version with PUT /state instead of a rollout (model.version "
                            "set to the candidate, rollout null)")
    assert state_file.read_text() == before
    assert get.json()["desired"]["rollout"] is None
    assert get.json()["desired"]["model"] == {"version": stable}


def test_a_rollout_to_the_same_requests_with_other_tables_is_accepted(tmp_path, schema_repo):
    ts = FakeTorchServe(tmp_path / "store")
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired("own-a"))
    body = {"model": {"version": "own-a"}, "rollout": {"candidate": "own-b", "weight": 0.1}}
    [put] = requests(make_app(ts, schema_repo, state_file), ("PUT", "/state", body))
    assert put.status_code == 202, put.text
    assert yaml.safe_load(state_file.read_text())["rollout"]["candidate"] == "own-b"


def test_the_rollout_check_skips_versions_without_a_schema():
    reports: dict[str, dict[str, Any]] = {"a": {"schema": OWN.to_dict()}, "b": {},
                                          "c": {"schema": OWN_WIDER.to_dict()}}
    schemas = SchemaCache(reports.__getitem__)
    check_rollout_schema(schemas, "a", "b")        # b's schema is unknown: not compared
    check_rollout_schema(schemas, "a", "missing")  # no report
    check_rollout_schema(schemas, "a", "a")
    with pytest.raises(Conflict, match=r"dense features: 2 vs 3"):
        check_rollout_schema(schemas, "a", "c")
    with pytest.raises(Conflict, match=r"sparse features only in the first: \['user_id'\]"):
        check_rollout_schema(schemas, "c", "a")


@pytest.mark.parametrize("error", [OSError("gone"), ValueError("bad JSON"),
                                   TypeError("a list, not an object")])
def test_an_unreadable_report_shows_no_schema_and_is_read_again(error):
    reads: list[str] = []

    def report_of(version: str) -> dict[str, Any]:
        reads.append(version)
        raise error

    cache = SchemaCache(report_of)
    assert cache.describe("v") is None and cache.describe("v") is None
    assert reads == ["v", "v"]
