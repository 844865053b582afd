"""serve.common.cpu: the pod's CPU budget from fake cgroup files, and the worker-thread rule."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from serve.api.config import default_num_threads
from serve.common.cpu import (
    ThreadChoice,
    available_cpus,
    choose_threads,
    cpu_quota,
    threads_per_worker,
)
from serve.errors import ConfigError


def v2(root: Path, text: str) -> Path:
    """A cgroup v2 mount holding ``cpu.max``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text + "\n")
    return root


def v1(root: Path, quota: str, period: str = "100000", folder: str = "cpu") -> Path:
    """A cgroup v1 mount: ``<folder>/cpu.cfs_quota_us`` and ``cpu.cfs_period_us``."""
    d = root / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.cfs_quota_us").write_text(quota + "\n")
    (d / "cpu.cfs_period_us").write_text(period + "\n")
    return root


# --------------------------------------------------------------------------- cpu_quota

def test_v2_limit_is_quota_over_period(tmp_path: Path):
    assert cpu_quota(v2(tmp_path, "400000 100000")) == 4.0
    assert cpu_quota(v2(tmp_path, "150000 100000")) == 1.5
    assert cpu_quota(v2(tmp_path, "50000 50000")) == 1.0


def test_v2_max_is_no_limit(tmp_path: Path):
    assert cpu_quota(v2(tmp_path, "max 100000")) is None


def test_v1_limit_under_cpu_or_cpu_cpuacct(tmp_path: Path):
    assert cpu_quota(v1(tmp_path / "a", "200000")) == 2.0
    assert cpu_quota(v1(tmp_path / "b", "250000", folder="cpu,cpuacct")) == 2.5
    assert cpu_quota(v1(tmp_path / "c", "50000", "100000", folder="cpuacct,cpu")) == 0.5


def test_v1_minus_one_is_no_limit(tmp_path: Path):
    assert cpu_quota(v1(tmp_path, "-1")) is None


def test_v2_wins_over_v1(tmp_path: Path):
    root = v1(tmp_path, "800000")
    v2(root, "200000 100000")
    assert cpu_quota(root) == 2.0


def test_missing_files_mean_no_quota(tmp_path: Path):
    assert cpu_quota(tmp_path / "nowhere") is None
    assert cpu_quota(tmp_path) is None                      # an empty mount
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")  # period missing
    assert cpu_quota(tmp_path) is None


@pytest.mark.parametrize("text", ["", "400000", "abc 100000", "400000 0", "0 100000",
                                  "-5 100000", "1 2 3"])
def test_malformed_v2_is_ignored_and_logged(tmp_path: Path, text: str,
                                            caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="serve.common.cpu"):
        assert cpu_quota(v2(tmp_path, text)) is None
    assert "ignoring the CPU quota" in caplog.text


def test_malformed_v1_is_ignored_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="serve.common.cpu"):
        assert cpu_quota(v1(tmp_path, "lots")) is None
        assert cpu_quota(v1(tmp_path, "100000", "0")) is None
    assert caplog.text.count("ignoring the CPU quota") == 2


# --------------------------------------------------------------------- available_cpus

def test_quota_below_affinity_limits_the_cpus(tmp_path: Path):
    # the pod: a 4-CPU limit on a 64-core node without the static CPU manager
    assert available_cpus(v2(tmp_path, "400000 100000"), affinity=64) == 4


def test_affinity_below_quota_limits_the_cpus(tmp_path: Path):
    # the static CPU manager pinned 2 cores; the quota says 4
    assert available_cpus(v2(tmp_path, "400000 100000"), affinity=2) == 2


def test_no_quota_means_the_affinity(tmp_path: Path):
    assert available_cpus(v2(tmp_path, "max 100000"), affinity=64) == 64
    assert available_cpus(tmp_path / "none", affinity=3) == 3


def test_fractional_quota_rounds_up(tmp_path: Path):
    # 1.5 CPUs of time per period: only 2 threads can use all of it
    assert available_cpus(v2(tmp_path, "150000 100000"), affinity=64) == 2
    assert available_cpus(v2(tmp_path, "10000 100000"), affinity=64) == 1   # 0.1 CPU: 1
    assert available_cpus(v1(tmp_path / "v1", "450000"), affinity=64) == 5


def test_without_cgroup_files_the_real_affinity_counts(tmp_path: Path):
    assert available_cpus(tmp_path) >= 1


def test_affinity_must_be_positive(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"affinity=0 must be an integer >= 1"):
        available_cpus(tmp_path, affinity=0)


# ------------------------------------------------------------------ the thread rule

def test_budget_split_over_workers(tmp_path: Path):
    root = v2(tmp_path, "400000 100000")
    c = choose_threads(2, environ={}, cgroup_root=root, affinity=64)
    assert (c.threads, c.source, c.cpus, c.quota, c.affinity) == (2, "cpu budget", 4, 4.0, 64)
    assert not c.oversubscribed
    assert c.describe() == ("2 threads per worker from cpu budget (4 CPUs = min(affinity 64, "
                            "ceil(quota 4)) / 2 workers)")
    assert choose_threads(1, environ={}, cgroup_root=root, affinity=64).threads == 4
    assert choose_threads(3, environ={}, cgroup_root=root, affinity=64).threads == 1
    # more workers than CPUs: still one thread each, and the log says so
    many = choose_threads(8, environ={}, cgroup_root=root, affinity=64)
    assert many.threads == 1 and many.oversubscribed and "OVERSUBSCRIBED: 8 x 1" in many.describe()


def test_handler_num_threads_wins_over_everything(tmp_path: Path):
    root = v2(tmp_path, "400000 100000")
    c = choose_threads(2, 3, environ={"OMP_NUM_THREADS": "1"}, cgroup_root=root, affinity=64)
    assert (c.threads, c.source) == (3, "handler.num_threads")
    assert c.oversubscribed  # 2 x 3 > 4: allowed (explicit), but logged
    assert c.describe().startswith("3 threads per worker from handler.num_threads (explicit; "
                                   "the cpu budget would give 2: 4 CPUs")


def test_omp_num_threads_wins_over_the_budget(tmp_path: Path):
    root = v2(tmp_path, "400000 100000")
    c = choose_threads(2, environ={"OMP_NUM_THREADS": "1"}, cgroup_root=root, affinity=64)
    assert (c.threads, c.source) == (1, "OMP_NUM_THREADS")
    # an OpenMP list: the first (outermost) level; blank means unset
    assert choose_threads(1, environ={"OMP_NUM_THREADS": " 3,1 "}, cgroup_root=root,
                          affinity=64).threads == 3
    blank = choose_threads(2, environ={"OMP_NUM_THREADS": ""}, cgroup_root=root, affinity=64)
    assert (blank.threads, blank.source) == (2, "cpu budget")


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", ",2"])
def test_bad_omp_num_threads_says_what_to_do(tmp_path: Path, bad: str):
    with pytest.raises(ConfigError) as info:
        choose_threads(2, environ={"OMP_NUM_THREADS": bad}, cgroup_root=tmp_path, affinity=4)
    assert info.value.message == (
        f"OMP_NUM_THREADS={bad!r} must be a positive integer (threads per worker); unset it "
        "to size threads from the CPU quota, or set handler.num_threads in the model config")


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_bad_configured_threads_and_workers(tmp_path: Path, bad: object):
    with pytest.raises(ConfigError, match=r"handler.num_threads=.* must be an integer >= 1"):
        choose_threads(2, bad, environ={}, cgroup_root=tmp_path, affinity=4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"workers=.* must be an integer >= 1"):
        choose_threads(bad, environ={}, cgroup_root=tmp_path, affinity=4)  # type: ignore[arg-type]


def test_default_environment_is_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert choose_threads(1, cgroup_root=tmp_path, affinity=64).source == "OMP_NUM_THREADS"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert choose_threads(1, cgroup_root=tmp_path, affinity=64) == ThreadChoice(
        threads=64, source="cpu budget", cpus=64, quota=None, affinity=64, workers=1)


def test_threads_per_worker_and_default_num_threads():
    assert threads_per_worker(2, 4) == 2 and threads_per_worker(4, 2) == 1
    assert default_num_threads(workers=2, cores=2) == 1
    assert default_num_threads(workers=1, cores=16) == 16
    # without cores: this machine's budget (quota and affinity), at least 1
    assert default_num_threads(workers=1) == available_cpus() >= 1


def test_log_line_without_a_quota(tmp_path: Path):
    c = choose_threads(1, 1, environ={}, cgroup_root=tmp_path, affinity=2)
    assert c.describe() == ("1 thread per worker from handler.num_threads (explicit; the cpu "
                            "budget would give 2: 2 CPUs = affinity 2 (no cgroup CPU quota) / "
                            "1 worker)")
