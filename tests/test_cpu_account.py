"""bench.cpu_account: which process is which part of the service, and CPU ms per query.

The service's processes are read from a fake /proc (a test double of the kernel's files,
which we don't ship); one test reads the real /proc for this process."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import cpu_account
from bench.cpu_account import GROUPS, CpuSnapshot, cpu_ms_per_query, service_processes, snapshot

TICK = os.sysconf("SC_CLK_TCK")


def _proc(root: Path, pid: int, pgid: int, cmd: str, utime: int, stime: int) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    d.joinpath("cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")
    # fields after "(comm)": state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime ...; the name has a space and a parenthesis, as real ones can
    rest = ["S", "1", str(pgid)] + ["0"] * 8 + [str(utime), str(stime)] + ["0"] * 10
    d.joinpath("stat").write_text(f"{pid} (ja va) x) " + " ".join(rest) + "\n")


def _fake_proc(tmp_path: Path, busy_ticks: int, ticks: dict[int, int]) -> Path:
    root = tmp_path / "proc"
    _proc(root, 11, 10, "java -cp x org.pytorch.serve.ModelServer", ticks[11], 0)
    _proc(root, 12, 10, "python ts/model_service_worker.py --sock-name x", ticks[12], 0)
    _proc(root, 13, 10, "python ts/model_service_worker.py --sock-name y", ticks[13], 0)
    _proc(root, 20, 20, "python -m serve.sidecar --port 8090", ticks[20], 0)
    _proc(root, 30, 30, "python -m something.else", 500, 0)     # not the service's
    _proc(root, 99, 99, "python -m bench.bench_slo", ticks[99], 0)
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    (root / "stat").write_text(f"cpu {busy_ticks} 0 0 9000 100 0 0 0 0 0\ncpu0 1 2 3 4\n")
    return root


def test_service_processes_tell_the_parts_apart_by_process_group(tmp_path: Path) -> None:
    root = _fake_proc(tmp_path, 0, {11: 0, 12: 0, 13: 0, 20: 0, 99: 0})
    run = tmp_path / "run"
    run.mkdir()
    (run / "pids.json").write_text(json.dumps({"torchserve": 10, "sidecar": 20}))
    pids = service_processes(run, proc=root, self_pid=99)
    assert pids == {99: "client", 11: "frontend", 12: "workers", 13: "workers", 20: "sidecar"}
    # no run dir, or no pids.json: the client alone (everything else is "other")
    assert service_processes(None, proc=root, self_pid=99) == {99: "client"}
    assert service_processes(tmp_path / "nowhere", proc=root, self_pid=99) == {99: "client"}


def test_cpu_ms_per_query_splits_the_machines_busy_time(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "pids.json").write_text(json.dumps({"torchserve": 10, "sidecar": 20}))
    before_root = _fake_proc(tmp_path / "a", 1000, {11: 10, 12: 20, 13: 30, 20: 5, 99: 7})
    pids = service_processes(run, proc=before_root, self_pid=99)
    before = snapshot(pids, proc=before_root)
    # 100 queries in 2 s: frontend +1 s, workers +2 s, sidecar +0.1 s, client +0.5 s,
    # machine +4 s busy, so 0.4 s went to something else
    after_root = _fake_proc(tmp_path / "b", 1000 + 4 * TICK,
                            {11: 10 + TICK, 12: 20 + TICK, 13: 30 + TICK, 20: 5 + TICK // 10,
                             99: 7 + TICK // 2})
    after = snapshot(pids, proc=after_root)
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
    pids = {1: "workers", 2: "workers"}
    before = CpuSnapshot({1: 3.0}, 10.0)            # 2 started during the window
    after = CpuSnapshot({1: 4.0, 2: 0.5}, 12.0)
    got = cpu_ms_per_query(pids, before, after, 10, 1.0)
    assert got["workers"] == pytest.approx(150.0) and got["other"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="must be > 0"):
        cpu_ms_per_query(pids, before, after, 0, 1.0)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")
def test_real_proc_counts_this_process_as_the_client() -> None:
    pids = service_processes(None)
    before = snapshot(pids)
    x = 0
    for i in range(3_000_000):      # ~0.1-0.3 s of one core
        x += i * i
    after = snapshot(pids)
    got = cpu_ms_per_query(pids, before, after, 1, 0.1)
    assert got["client"] > 0 and got["total"] >= got["client"]
    assert cpu_account.GROUPS[0] == "client"
