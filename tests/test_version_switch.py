"""serve.sidecar.control.switch: each step of the version switch on its own, the drain, the
rollbacks, the memory guard and whole switches, against a fake of TorchServe's
management API.

TorchServe is not ours, so its API is faked (``FakeTorchServe`` on an
``httpx.MockTransport``, tests/fixtures/sidecar.py); the switch, the archive rewrite, the
repository and the app are the real ones. Waiting uses a fake clock, so the tests take
milliseconds. The reconciler that drives the switch is tests/test_reconciler.py; the
real switch against a real TorchServe under load is
``tests/test_sidecar.py::test_live_batching_change_*``.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import zipfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from serve.errors import ConfigError, InsufficientMemory, UpstreamUnavailable
from serve.metrics import SWITCH_PHASES
from serve.metrics.sidecar import SidecarMetrics
from serve.sidecar.adapters.memory import CgroupMemory, MemoryProbe
from serve.sidecar.adapters.torchserve import Observed, TorchServeClient, observe
from serve.sidecar.config import SidecarConfig
from serve.sidecar.control.switch import SwitchPhase, SwitchPlan, VersionSwitch
from serve.sidecar.http.app import create_app
from serve.sidecar.http.schemas import BatchingState
from serve.state import Batching, DesiredState, ModelRef, write_state
from serve.store.repository import ModelRepository, record_archive_digest
from tests.fixtures.sidecar import FakeClock, FakeTorchServe, add_versions, toy_mar
from tests.promtext import samples

T = TypeVar("T")
MGMT = "http://ts-management"
TOKEN = "t0ken-for-tests-t0ken-for-tests-0123"
V = "small-s0"
TARGET = "small-s0_b16d50w1"
MiB = 1 << 20


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture
def ts(tmp_path: Path) -> FakeTorchServe:
    return FakeTorchServe(tmp_path / "store")


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepository:
    return ModelRepository([add_versions(tmp_path / "repo", [V, "small-s1"])])


def desired(version: str = V, batch_size: int = 16, delay: int = 50,
            workers: int = 1) -> DesiredState:
    return DesiredState(model=ModelRef(version=version),
                        batching=Batching(batch_size=batch_size, max_batch_delay_ms=delay),
                        workers=workers)


def make_switch(ts: FakeTorchServe, clock: FakeClock | None = None,
                memory: MemoryProbe | None = None, **config: Any,
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
                           forget_workers=forgotten.append, memory=memory)
    return switch, phases, forgotten


def seen(switch: VersionSwitch, ts: FakeTorchServe) -> Observed:
    """What the switch's client observes now (the calls it makes are not recorded)."""
    observed = run(observe(switch.ts))
    ts.calls.clear()
    return observed


def plan_for(switch: VersionSwitch, ts: FakeTorchServe, repo: ModelRepository,
             **settings: int) -> SwitchPlan:
    plan = switch.plan(seen(switch, ts), desired(**settings), repo)
    assert plan is not None
    return plan


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


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


def test_plan_targets_the_serving_version_from_the_repository_archive(ts, repo):
    switch, _, _ = make_switch(ts)
    observed = seen(switch, ts)
    plan = switch.plan(observed, desired(), repo)
    assert plan == SwitchPlan(
        new=BatchingState(batch_size=16, max_batch_delay_ms=50, workers=1, model_version=TARGET),
        src=repo.archive(V), dst=ts.store / f"dlrm-{TARGET}.mar", old=observed.serving,
        src_sha256=hashlib.sha256(repo.archive(V).read_bytes()).hexdigest())
    assert plan.old is not None and plan.old.version == "1.0" and plan.old.pids == (100,)
    # Registered already (a pass that stopped half-way): nothing to copy.
    ts.add(TARGET, f"dlrm-{TARGET}.mar", batch_size=16, delay=50, workers=1)
    again = switch.plan(seen(switch, ts), desired(), repo)
    assert again is not None and again.src is None
    assert again.dst == ts.store / f"dlrm-{TARGET}.mar"
    # Default with its workers READY: nothing to do.
    ts.default = TARGET
    ts.versions[TARGET]["ready"] = True
    assert switch.plan(seen(switch, ts), desired(), repo) is None
    with pytest.raises(ConfigError, match=r"model version 'nope' is not in the repository .*"
                       r"available: \['small-s0', 'small-s1'\]"):
        switch.plan(seen(switch, ts), desired("nope"), repo)


def test_copy_writes_the_new_archive_and_leaves_the_repository_alone(ts, repo):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(switch, ts, repo, batch_size=16, delay=5, workers=2)
    original = repo.archive(V).read_bytes()
    assert run(switch.copy(plan)) == plan.dst == ts.store / "dlrm-small-s0_b16d5w2.mar"
    with zipfile.ZipFile(plan.dst) as z:
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert manifest["model"]["modelVersion"] == "small-s0_b16d5w2"
    assert (cfg["batchSize"], cfg["maxBatchDelay"], cfg["minWorkers"], cfg["maxWorkers"]) \
        == (16, 5, 2, 2)
    assert repo.archive(V).read_bytes() == original
    assert phases == ["copying"] and ts.calls == []


def test_register_posts_the_archive_once(ts, repo):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(switch, ts, repo)
    run(switch.copy(plan))
    run(switch.register(plan))
    assert ts.versions[TARGET]["batchSize"] == 16 and ts.default == "1.0"
    assert ts.calls == [("GET", f"/models/dlrm/{TARGET}"), ("POST", "/models")]
    run(switch.register(plan))  # registered already: nothing posted
    assert ts.calls[2:] == [("GET", f"/models/dlrm/{TARGET}")]
    assert phases == ["copying", "registering", "registering"]


def test_wait_ready_polls_until_the_workers_are_ready(ts, repo):
    clock = FakeClock()
    switch, phases, _ = make_switch(ts, clock)
    plan = plan_for(switch, ts, repo)
    run(switch.copy(plan))
    run(switch.register(plan))
    ts.ready_after = 3  # three reads see no READY worker, the fourth does
    run(switch.wait_ready(plan))
    assert clock.sleeps == [0.2, 0.2, 0.2]
    assert phases[-1] == "waiting_ready"
    assert switch.memory.live_pids >= set(ts.versions[TARGET]["pids"])  # its memory is sampled


def test_wait_ready_gives_up_at_the_register_timeout(ts, repo):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock, register_timeout_s=5.0)
    plan = plan_for(switch, ts, repo)
    run(switch.copy(plan))
    ts.ready_after = None
    run(switch.register(plan))
    with pytest.raises(UpstreamUnavailable, match=(
            rf"^version {TARGET} of 'dlrm' did not get 1 READY workers within 5 s; the old "
            r"version stays default$")):
        run(switch.wait_ready(plan))
    assert 5.0 < clock.now < 5.5


def test_set_default(ts, repo):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(switch, ts, repo)
    run(switch.copy(plan))
    run(switch.register(plan))
    run(switch.set_default(plan))
    assert ts.default == TARGET and phases[-1] == "setting_default"
    assert ts.calls[-1] == ("PUT", f"/models/dlrm/{TARGET}/set-default")


def _old(switch: VersionSwitch, ts: FakeTorchServe):
    old = seen(switch, ts).get("1.0")
    assert old is not None
    return old


def test_drain_waits_for_two_empty_reads_of_the_old_queue(ts):
    clock = FakeClock()
    switch, phases, _ = make_switch(ts, clock)
    ts.pending["1.0"] = [3, 1, 0, 0, 5]
    run(switch.drain(_old(switch, ts)))
    assert ts.calls == [("GET", "/models/dlrm/1.0")] * 4  # 3, 1, 0, 0: never the 5
    assert clock.sleeps == [0.1, 0.1, 0.1]
    assert phases == ["draining"]


def test_drain_restarts_its_count_when_the_queue_fills_again(ts):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock)
    ts.pending["1.0"] = [0, 2, 0, 0]
    run(switch.drain(_old(switch, ts)))
    assert len(ts.calls) == 4


def test_drain_waits_for_the_queue_to_stay_empty_for_grace_plus_batch_delay(ts):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock, switch_grace_s=0.5)
    run(switch.drain(_old(switch, ts)))  # empty from the start: 0.5 s + 50 ms batch delay
    assert clock.now == pytest.approx(0.6) and len(ts.calls) == 7
    # A deep queue: the settle time counts from the first empty read, not from the switch
    # (the worker may have taken the last batch just before it).
    clock, ts.calls[:] = FakeClock(), []
    switch, _, _ = make_switch(ts, clock, switch_grace_s=0.5)
    ts.pending["1.0"] = [9] * 30 + [0]
    run(switch.drain(_old(switch, ts)))
    assert clock.now == pytest.approx(3.0 + 0.6)


def test_drain_gives_up_at_its_timeout(ts):
    clock = FakeClock()
    switch, _, _ = make_switch(ts, clock, drain_timeout_s=2.0)
    ts.pending["1.0"] = [4]
    with pytest.raises(UpstreamUnavailable, match=(
            r"^version 1.0 of 'dlrm' still had 4 queued requests 2 s after the switch "
            r"\(drain_timeout_s\); it stays registered so they are answered, and the next "
            r"reconcile pass drains it again$")):
        run(switch.drain(_old(switch, ts)))
    assert clock.now == pytest.approx(2.0)


def test_drain_of_a_version_already_gone_is_done(ts):
    switch, _, _ = make_switch(ts)
    old = _old(switch, ts)
    del ts.versions["1.0"]
    run(switch.drain(old))
    assert ts.calls == [("GET", "/models/dlrm/1.0")]


def test_unregister_removes_the_old_version_and_only_derived_archives(ts, repo):
    switch, phases, forgotten = make_switch(ts)
    toy_mar(ts.store / f"dlrm-{TARGET}.mar", version=TARGET)
    ts.add(TARGET, f"dlrm-{TARGET}.mar", batch_size=16, delay=50, workers=1, ready=True)
    ts.default = TARGET
    observed = seen(switch, ts)
    run(switch.unregister(observed.get("1.0")))
    assert "1.0" not in ts.versions and forgotten == [[100]]
    assert (ts.store / "dlrm.mar").is_file()  # not derived by the sidecar: kept
    run(switch.unregister(observed.get("1.0")))  # gone already: fine
    # A version the sidecar derived: its archive goes with it; the repository's stays.
    ts.add("1.0", "dlrm.mar", batch_size=8, delay=50, workers=1, ready=True)
    ts.default = "1.0"
    run(switch.unregister(observed.get(TARGET)))
    assert TARGET not in ts.versions and not (ts.store / f"dlrm-{TARGET}.mar").exists()
    assert repo.exists(V) and files(ts.store) == ["dlrm.mar"]
    assert ts.calls == [("DELETE", "/models/dlrm/1.0")] * 2 + [("DELETE", f"/models/dlrm/{TARGET}")]
    assert phases == ["unregistering"] * 3


def test_rollback_removes_the_new_version_and_its_archive(ts, repo):
    switch, phases, _ = make_switch(ts)
    plan = plan_for(switch, ts, repo)
    run(switch.copy(plan))
    run(switch.register(plan))
    run(switch.rollback(plan))
    assert set(ts.versions) == {"1.0"} and ts.default == "1.0"
    assert not plan.dst.exists() and phases[-1] == "rolling_back"
    run(switch.rollback(plan))  # nothing left to undo: fine
    assert ts.calls[-2:] == [("DELETE", f"/models/dlrm/{TARGET}")] * 2


# ------------------------------------------------------------------ whole switches


def test_switch_then_retire(ts, repo):
    clock = FakeClock()
    switch, phases, forgotten = make_switch(ts, clock)
    ts.pending["1.0"] = [3, 1, 0, 0]
    observed = seen(switch, ts)
    plan = switch.plan(observed, desired(delay=5), repo)
    assert plan is not None
    assert run(switch.switch(plan, observed)) is None  # no memory probe: nothing checked
    assert ts.default == "small-s0_b16d5w1" and set(ts.versions) == {"1.0", "small-s0_b16d5w1"}
    run(switch.retire(observed.get("1.0")))
    assert phases == ["idle", "copying", "registering", "waiting_ready", "setting_default",
                      "draining", "unregistering"]
    assert ts.calls == [
        ("GET", "/models/dlrm/small-s0_b16d5w1"), ("POST", "/models"),
        ("GET", "/models/dlrm/small-s0_b16d5w1"),
        ("PUT", "/models/dlrm/small-s0_b16d5w1/set-default"),
        *[("GET", "/models/dlrm/1.0")] * 4, ("DELETE", "/models/dlrm/1.0")]
    assert set(ts.versions) == {"small-s0_b16d5w1"} and forgotten == [[100]]
    assert files(ts.store) == ["dlrm-small-s0_b16d5w1.mar", "dlrm.mar"]
    assert switch.last_error is None


def test_switch_from_nothing_registered_needs_no_drain(tmp_path, repo):
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    switch, phases, _ = make_switch(ts)
    observed = seen(switch, ts)
    assert observed == Observed(default=None)
    plan = switch.plan(observed, desired(), repo)
    assert plan is not None and plan.old is None
    run(switch.switch(plan, observed))
    assert ts.default == TARGET and set(ts.versions) == {TARGET}
    assert phases == ["idle", "copying", "registering", "waiting_ready", "setting_default"]
    assert files(ts.store) == [f"dlrm-{TARGET}.mar"]


@pytest.mark.parametrize("phase, failure, message", [
    ("registering", {("POST", "/models"): 500},
     ("TorchServe POST http://ts-management/models answered 500: injected failure of "
      "POST /models")),
    ("waiting_ready", None,
     (f"version {TARGET} of 'dlrm' did not get 1 READY workers within 5 s; "
      "the old version stays default")),
    ("setting_default", {("PUT", f"/models/dlrm/{TARGET}/set-default"): 503},
     (f"TorchServe PUT http://ts-management/models/dlrm/{TARGET}/set-default answered 503: "
      f"injected failure of PUT /models/dlrm/{TARGET}/set-default")),
])
@pytest.mark.parametrize("initial", ["1.0", None])
def test_a_failed_step_is_rolled_back(tmp_path, repo, phase, failure, message, initial):
    ts = FakeTorchServe(tmp_path / "store", initial=initial)
    switch, phases, forgotten = make_switch(ts, register_timeout_s=5.0)
    if failure is None:
        ts.ready_after = None
    else:
        ts.failures.update(failure)
    observed = seen(switch, ts)
    plan = switch.plan(observed, desired(), repo)
    with pytest.raises(UpstreamUnavailable) as info:
        run(switch.switch(plan, observed))
    assert info.value.message == message
    assert phases[-3:] == [phase, "rolling_back", "failed"]
    assert ("DELETE", f"/models/dlrm/{TARGET}") in ts.calls
    # No orphan: what served before still does (or nothing, as before).
    assert set(ts.versions) == ({initial} if initial else set()) and ts.default == initial
    assert files(ts.store) == (["dlrm.mar"] if initial else [])
    assert switch.phase is SwitchPhase.FAILED and switch.last_error == message
    assert forgotten == []


def test_a_failed_copy_leaves_no_file(ts, tmp_path):
    root = tmp_path / "bad-repo"
    add_versions(root, [V])
    (root / f"dlrm-{V}.mar").chmod(0o644)
    (root / f"dlrm-{V}.mar").write_bytes(b"not a zip")
    # a build that recorded its broken archive: the digest passes, the copy fails
    (root / f"dlrm-{V}.mar.sha256").unlink()
    record_archive_digest(ModelRepository([root]), V)
    switch, phases, _ = make_switch(ts)
    observed = seen(switch, ts)
    plan = switch.plan(observed, desired(), ModelRepository([root]))
    with pytest.raises(zipfile.BadZipFile):
        run(switch.switch(plan, observed))
    assert files(ts.store) == ["dlrm.mar"]
    assert phases[-3:] == ["copying", "rolling_back", "failed"]
    assert switch.last_error == "BadZipFile('File is not a zip file')"


def test_after_the_switch_a_stuck_old_queue_keeps_the_old_version(ts, repo):
    switch, phases, forgotten = make_switch(ts, drain_timeout_s=1.0)
    ts.pending["1.0"] = [2]
    observed = seen(switch, ts)
    run(switch.switch(switch.plan(observed, desired(), repo), observed))
    with pytest.raises(UpstreamUnavailable, match="still had 2 queued requests"):
        run(switch.retire(observed.get("1.0")))
    assert set(ts.versions) == {"1.0", TARGET} and ts.default == TARGET and forgotten == []
    assert switch.phase is SwitchPhase.IDLE
    assert switch.last_error.startswith("version 1.0 of 'dlrm' still had 2 queued requests")
    assert "rolling_back" not in phases


# ------------------------------------------------------------------ memory


def cgroup(tmp_path: Path, limit: str, current: int, v1: bool = False) -> CgroupMemory:
    """Fake cgroup files (v2 memory.max/current, or v1 memory/memory.*_in_bytes)."""
    root = tmp_path / "cgroup"
    if v1:
        (root / "memory").mkdir(parents=True)
        (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (root / "memory" / "memory.usage_in_bytes").write_text(f"{current}\n")
    else:
        root.mkdir(parents=True)
        (root / "memory.max").write_text(f"{limit}\n")
        (root / "memory.current").write_text(f"{current}\n")
    return CgroupMemory(root)


def test_cgroup_files_v2_and_v1(tmp_path):
    assert cgroup(tmp_path / "a", str(8 * 1024 * MiB), 3 * MiB).limit()[0] == 8 * 1024 * MiB
    assert cgroup(tmp_path / "b", "max", 3 * MiB).limit()[0] is None
    v1 = cgroup(tmp_path / "c", str(2 * 1024 * MiB), 7 * MiB, v1=True)
    assert v1.limit() == (2 * 1024 * MiB, str(tmp_path / "c" / "cgroup" / "memory" /
                                              "memory.limit_in_bytes"))
    assert v1.current() == 7 * MiB
    assert cgroup(tmp_path / "d", "9223372036854771712", 1, v1=True).limit()[0] is None
    assert CgroupMemory(tmp_path / "none").limit()[0] is None
    assert CgroupMemory(tmp_path / "none").current() is None
    # The working set: usage less the file cache the kernel can drop (as kubelet counts).
    (tmp_path / "a" / "cgroup" / "memory.stat").write_text(
        f"anon 1\nfile {2 * MiB}\ninactive_file {2 * MiB}\nactive_file 0\n")
    assert CgroupMemory(tmp_path / "a" / "cgroup").current() == 1 * MiB
    (tmp_path / "c" / "cgroup" / "memory" / "memory.stat").write_text(
        f"cache 1\ntotal_inactive_file {3 * MiB}\n")
    assert v1.current() == 4 * MiB


def test_check_memory_estimates_from_the_serving_workers_rss(ts, repo, tmp_path):
    rss = {100: 600 * MiB}
    probe = MemoryProbe(cgroup(tmp_path, str(2048 * MiB), 900 * MiB), rss=rss.get)
    switch, _, _ = make_switch(ts, memory=probe)
    observed = seen(switch, ts)
    switch.memory.watch(observed)
    plan = switch.plan(observed, desired(workers=1), repo)
    check = run(switch.check_memory(plan, observed))
    assert check is not None and check.fits
    assert (check.usage_bytes, check.need_bytes, check.limit_bytes) == \
        (900 * MiB, 600 * MiB, 2048 * MiB)
    # Two workers of the new version: 900 + 1200 MiB > 90% of 2048 MiB.
    plan = switch.plan(observed, desired(workers=2), repo)
    with pytest.raises(InsufficientMemory) as info:
        run(switch.check_memory(plan, observed))
    assert info.value.status == 507
    assert info.value.message == (
        "switch to small-s0_b16d50w2 refused: it needs about 1200 MiB (serving workers' "
        "RSS 600 MiB x 2 workers) on top of 900 MiB in use (cgroup working set), 2100 MiB "
        f"> 90% of the memory limit 2048 MiB ({tmp_path}/cgroup/memory.max): the old and "
        "the new version would not fit side by side. Raise the memory limit of "
        "TorchServe's container to at least 2333 MiB, or declare fewer workers")


def test_check_memory_uses_the_archive_size_when_nothing_serves(tmp_path, repo):
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    size = repo.archive(V).stat().st_size
    probe = MemoryProbe(cgroup(tmp_path, str(10 * size), 8 * size), rss=lambda pid: None)
    switch, _, _ = make_switch(ts, memory=probe)
    observed = seen(switch, ts)
    with pytest.raises(InsufficientMemory, match=r"needs about .* \(archive 0 MiB x 2 "
                       r"workers\) on top of"):
        run(switch.check_memory(switch.plan(observed, desired(workers=2), repo), observed))
    assert run(switch.check_memory(switch.plan(observed, desired(workers=1), repo),
                                   observed)).need_bytes == size
    # No limit (memory.max "max"): nothing to respect.
    open_probe = MemoryProbe(cgroup(tmp_path / "x", "max", 0), rss=lambda pid: None)
    switch, _, _ = make_switch(ts, memory=open_probe)
    assert run(switch.check_memory(switch.plan(observed, desired(workers=64), repo),
                                   observed)) is None


def test_an_explicit_limit_counts_the_workers_rss_not_the_sidecars_cgroup(ts, repo, tmp_path):
    ts.memory["1.0"] = 300 * MiB  # what TorchServe reports when psutil cannot see the pid
    probe = MemoryProbe(cgroup(tmp_path, str(100 * MiB), 90 * MiB),
                        limit_bytes=1000 * MiB, rss=lambda pid: None)
    switch, _, _ = make_switch(ts, memory=probe)
    observed = seen(switch, ts)
    switch.memory.watch(observed)
    check = run(switch.check_memory(switch.plan(observed, desired(), repo), observed))
    assert check is not None
    assert (check.usage_bytes, check.need_bytes, check.limit_source) == \
        (300 * MiB, 300 * MiB, "--memory-limit-bytes")


def test_a_refused_switch_changes_nothing(ts, repo, tmp_path):
    probe = MemoryProbe(cgroup(tmp_path, str(1000 * MiB), 950 * MiB), rss={100: 100 * MiB}.get)
    switch, phases, _ = make_switch(ts, memory=probe)
    observed = seen(switch, ts)
    with pytest.raises(InsufficientMemory):
        run(switch.switch(switch.plan(observed, desired(), repo), observed))
    assert phases == ["idle", "failed"] and ts.calls == []
    assert set(ts.versions) == {"1.0"} and files(ts.store) == ["dlrm.mar"]
    assert switch.last_error.startswith(f"switch to {TARGET} refused: it needs about 100 MiB")


def test_the_peak_is_sampled_over_every_registered_versions_workers(ts, repo, tmp_path):
    rss = {100: 500 * MiB, 101: 700 * MiB}
    files_ = cgroup(tmp_path, str(4096 * MiB), 1000 * MiB)
    switch, _, _ = make_switch(ts, memory=MemoryProbe(files_, rss=rss.get))
    observed = seen(switch, ts)
    current = tmp_path / "cgroup" / "memory.current"

    async def go() -> None:
        plan = switch.plan(observed, desired(), repo)
        await switch.switch(plan, observed)   # the new worker (pid 101) is sampled too
        current.write_text(str(1800 * MiB))   # e.g. the page cache of the copy
        switch.memory.sample()
        current.write_text(str(1200 * MiB))
        await switch.retire(observed.get("1.0"))

    run(go())
    assert switch.memory.tracker.peak_rss_bytes == 1200 * MiB
    assert switch.memory.tracker.peak_bytes == 1800 * MiB


# ------------------------------------------------------------------ through the app


def test_put_batching_edits_the_desired_state_and_waits_until_it_serves(ts, repo, tmp_path):
    registry = CollectorRegistry()
    state_file = tmp_path / "state" / "state.yaml"
    write_state(state_file, desired(batch_size=8))
    app = create_app(SidecarConfig(management_url=MGMT, metrics_url=MGMT, token=TOKEN,
                                   model_store=ts.store, switch_grace_s=0.0,
                                   state_file=state_file, repositories=tuple(repo.roots),
                                   cgroup_root=tmp_path / "no-cgroup",
                                   reconcile_interval_s=0.05),
                     registry=registry,
                     http_client=httpx.AsyncClient(transport=ts.transport()))
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
                for _ in range(200):  # the first pass replaces 1.0 by the declared state
                    if (await c.get("/state")).json()["converged"]:
                        break
                    await asyncio.sleep(0.02)
                put = await c.put("/batching", json={"batch_size": 16}, headers=auth)
                tuner = await c.get("/tuner")
                ok = await c.get("/batching")
                ts.failures[("POST", "/models")] = 500
                failed = await c.put("/batching", json={"batch_size": 4}, headers=auth)
                after = await c.get("/batching")
                await asyncio.sleep(0.2)  # a few passes: the reverted state is converged
                state = await c.get("/state")
                return [put, tuner, ok, failed, after, state]

    put, tuner, ok, failed, after, state = run(go())
    assert put.status_code == 200, put.text
    assert put.json() == {
        "batch_size": 16, "max_batch_delay_ms": 50, "workers": 1, "model_version": TARGET,
        "changed": True, "seconds": pytest.approx(put.json()["seconds"]),
        "removed_version": "small-s0_b8d50w1", "tuner_turned_off": True,
        "previous": {"batch_size": 8, "max_batch_delay_ms": 50, "workers": 1,
                     "model_version": "small-s0_b8d50w1"}}
    # a batching set by hand is pinned: the tuner (on by default) is off now
    assert tuner.json()["enabled"] is False and "PUT /batching" in tuner.json()["reason"]
    assert ok.json() == {"batch_size": 16, "max_batch_delay_ms": 50, "workers": 1,
                         "model_version": TARGET}  # idle: no status fields
    assert failed.status_code == 503 and failed.json()["type"] == "UpstreamUnavailable"
    assert after.json() == {
        "batch_size": 16, "max_batch_delay_ms": 50, "workers": 1, "model_version": TARGET,
        "switch_phase": "failed", "switch_error": failed.json()["message"]}
    # The failed change was taken back: the file declares what serves.
    assert yaml.safe_load(state_file.read_text())["batching"]["batch_size"] == 16
    body = state.json()
    assert body["converged"] is True and body["phase"] == "failed"
    assert body["last_switch"]["ok"] is False
    assert body["last_switch"]["error"] == failed.json()["message"]
    assert set(ts.versions) == {TARGET}
    got = samples(generate_latest(registry).decode())
    phases = {dict(lab)["phase"]: v for (name, lab), v in got.items()
              if name == "dlrm_switch_phase"}
    assert phases == {p: (1.0 if p == "failed" else 0.0) for p in SWITCH_PHASES}
    assert got[("dlrm_batching_updates_total", (("result", "failed"),))] == 1
    assert got[("dlrm_batching_updates_total", (("result", "applied"),))] == 1
    assert got[("dlrm_state_converged", ())] == 1
