"""bench.cpu_account: which process is which part of the service, and CPU ms per query.

Real processes in real process groups (children of this test) stand in for the
service's; the arithmetic is checked on snapshots with known values."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cpu_account import GROUPS, CpuSnapshot, cpu_ms_per_query, service_processes, snapshot

_SLEEP = "import time; time.sleep(60)"


@pytest.fixture
def fake_service(tmp_path: Path) -> Iterator[tuple[Path, dict[str, int]]]:
    """A "TorchServe" group (a frontend and a process named like a worker), a "sidecar"
    group, an unrelated process, and the run dir whose pids.json names the two groups."""
    procs = []
    try:
        ts = subprocess.Popen([sys.executable, "-c", _SLEEP, "frontend"], process_group=0)
        procs.append(ts)
        worker = subprocess.Popen([sys.executable, "-c", _SLEEP, "ts/model_service_worker.py"],
                                  process_group=ts.pid)
        procs.append(worker)
        side = subprocess.Popen([sys.executable, "-c", _SLEEP, "serve.sidecar"],
                                process_group=0)
        procs.append(side)
        other = subprocess.Popen([sys.executable, "-c", _SLEEP, "model_service_worker"],
                                 process_group=0)      # not the service's
        procs.append(other)
        run = tmp_path / "run"
        run.mkdir()
        (run / "pids.json").write_text(json.dumps({"torchserve": ts.pid, "sidecar": side.pid}))
        yield run, {"frontend": ts.pid, "worker": worker.pid, "sidecar": side.pid,
                    "other": other.pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_service_processes_tell_the_parts_apart_by_process_group(
        fake_service: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    run, pid = fake_service
    pids = service_processes(run, self_pid=99)
    assert pids == {99: "client", pid["frontend"]: "frontend", pid["worker"]: "workers",
                    pid["sidecar"]: "sidecar"}
    # no run dir, or no pids.json: the client alone (everything else is "other")
    assert service_processes(None, self_pid=99) == {99: "client"}
    assert service_processes(tmp_path / "nowhere", self_pid=99) == {99: "client"}


def test_snapshot_counts_live_processes_and_the_machine(
        fake_service: tuple[Path, dict[str, int]]) -> None:
    run, _ = fake_service
    pids = service_processes(run)
    before = snapshot(pids)
    x = 0
    for i in range(3_000_000):      # ~0.1-0.3 s of one core, in this process (the client)
        x += i * i
    after = snapshot({**pids, 2**22 + 12345: "workers"})     # a pid that does not exist
    assert set(before.by_pid) == set(pids) and 2**22 + 12345 not in after.by_pid
    got = cpu_ms_per_query(pids, before, after, 1, 0.1)
    assert got["client"] > 0 and got["total"] >= got["client"]
    assert after.machine_busy_s > before.machine_busy_s


def test_cpu_ms_per_query_splits_the_machines_busy_time() -> None:
    pids = {11: "frontend", 12: "workers", 13: "workers", 20: "sidecar", 99: "client"}
    before = CpuSnapshot({11: 0.1, 12: 0.2, 13: 0.3, 20: 0.05, 99: 0.07}, 10.0)
    # 100 queries in 2 s: frontend +1 s, workers +2 s, sidecar +0.1 s, client +0.5 s,
    # machine +4 s busy, so 0.4 s went to something else
    after = CpuSnapshot({11: 1.1, 12: 1.2, 13: 1.3, 20: 0.15, 99: 0.57}, 14.0)
    got = cpu_ms_per_query(pids, before, after, 100, 2.0)
    assert set(got) == set(GROUPS) | {"total", "busy_cores"}
    assert got["frontend"] == pytest.approx(10.0, abs=0.2)
    assert got["workers"] == pytest.approx(20.0, abs=0.2)
    assert got["sidecar"] == pytest.approx(1.0, abs=0.2)
    assert got["client"] == pytest.approx(5.0, abs=0.2)
    assert got["other"] == pytest.approx(4.0, abs=0.5)
    assert got["total"] == pytest.approx(40.0, abs=0.2)
    assert got["busy_cores"] == pytest.approx(2.0, abs=0.01)


def test_a_process_gone_or_new_counts_what_was_seen() -> None:
    pids = {1: "workers", 2: "workers", 3: "workers"}
    before = CpuSnapshot({1: 3.0, 3: 1.0}, 10.0)     # 2 started during the window
    after = CpuSnapshot({1: 4.0, 2: 0.5}, 12.0)      # 3 ended: not counted
    got = cpu_ms_per_query(pids, before, after, 10, 1.0)
    assert got["workers"] == pytest.approx(150.0) and got["other"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="must be > 0"):
        cpu_ms_per_query(pids, before, after, 0, 1.0)


def test_the_clients_own_cpu_is_seen_below_procs_tick() -> None:
    """A few ms of this process's CPU (less than one of /proc's 10 ms ticks) shows as
    client time: a short trial's client share is not rounded to 0."""
    pids = service_processes(None)
    before = snapshot(pids)
    start = time.process_time()
    while time.process_time() - start < 0.003:
        pass
    after = snapshot(pids)
    got = cpu_ms_per_query(pids, before, after, queries=1, seconds=1.0)
    assert 3.0 <= got["client"] < 9.0, got     # /proc would say 0 or 10
