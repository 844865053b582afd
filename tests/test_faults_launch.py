"""How `make faults` (and the tools beside it) start their own service: the version
`make up` would serve (never the newest file: an imported model of another request
schema), every port a free one (the OIP port too), and what a failed run started is
stopped (real processes)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from serve import constants
from serve.errors import ConfigError
from serve.ops.faults import harness_config, main, sigterm_command, stable_version
from serve.ops.launch_ports import PORTS
from serve.ops.launch_signals import launcher_groups, stop_launcher
from serve.ops.process_groups import group_alive
from serve.schema import FeatureSpec, ModelSchema, TableSpec
from serve.state import parse_state, write_state
from serve.store.repository import DEFAULT_PROFILE, ModelRepository, default_version
from tests.fixtures.sidecar import toy_mar

BUILT_IN = default_version(DEFAULT_PROFILE)  # what `make model` builds: small-int8-s0
#: An imported model's request schema: 2 dense features, one sparse (not the built-in's).
OWN = ModelSchema(dense=2, tables=(TableSpec("t_item", rows=1000, dim=16),),
                  features=(FeatureSpec("item_id", "t_item", 1),))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A model store: the built-in build, another built-in seed, then (newest) an import
    of another request schema."""
    root = tmp_path / "model_store"
    root.mkdir()
    repo = ModelRepository([root])
    reports = {BUILT_IN: {"profile": "small", "quantized_dtype": "int8"},
               "small-int8-s7": {"profile": "small", "quantized_dtype": "int8"},
               "own-ranker": {"schema": OWN.to_dict()}}
    for i, (version, report) in enumerate(reports.items()):
        src = toy_mar(tmp_path / f"{version}.mar", version=version)
        repo.add(version, src, {"created_at": f"2026-12-0{i + 1}T00:00:00Z",
                                "version": version, **report})
    assert repo.versions()[-1] == "own-ranker"  # the newest file is the import
    return root


def _declare(path: Path, version: str) -> Path:
    write_state(path, parse_state({"model": {"version": version}}))
    return path


def test_without_a_state_file_the_built_in_version_is_served_not_the_newest_import(
        store: Path, tmp_path: Path) -> None:
    assert stable_version(store, tmp_path / "absent.yaml") == BUILT_IN
    assert stable_version(store, tmp_path / "absent.yaml", "small-int8-s7") == "small-int8-s7"
    assert not (tmp_path / "absent.yaml").exists()  # chosen, not declared


def test_the_state_file_make_up_serves_decides(store: Path, tmp_path: Path) -> None:
    state = _declare(tmp_path / "state.yaml", "small-int8-s7")
    assert stable_version(store, state) == "small-int8-s7"


def test_a_declared_version_of_another_request_schema_is_refused_at_once(
        store: Path, tmp_path: Path) -> None:
    state = _declare(tmp_path / "state.yaml", "own-ranker")
    with pytest.raises(ConfigError, match=r"model version 'own-ranker' .* takes other requests "
                                          r"than the built-in model \(dense features: 13 vs 2"):
        stable_version(store, state)


def test_a_missing_version_names_what_is_there(store: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'small-int8-s99' is not in .*available: "):
        stable_version(store, tmp_path / "absent.yaml", "small-int8-s99")


def _defaults() -> dict[str, int]:
    return {setting: getattr(constants, f"DEFAULT_{setting.upper()}")
            for setting, *_ in PORTS}


def test_the_harness_leaves_no_port_at_its_default(store: Path, tmp_path: Path) -> None:
    cfg = harness_config(tmp_path, store, BUILT_IN)
    defaults = _defaults()
    assert set(defaults) == {setting for setting, *_ in PORTS}
    for setting, default in defaults.items():
        assert getattr(cfg, setting) != default, setting
    assert cfg.sidecar and cfg.sidecar_oip_port not in defaults.values()


def test_the_sigterm_launcher_gets_every_port_free(store: Path, tmp_path: Path) -> None:
    cmd, env, ports = sigterm_command(tmp_path, store, BUILT_IN, grace_s=60)
    defaults = _defaults()
    assert set(ports) == set(defaults)
    for setting, _what, flag, var in PORTS:
        assert ports[setting] != defaults[setting], setting
        if flag is not None:
            assert cmd[cmd.index(flag) + 1] == str(ports[setting]), flag
        else:
            assert env[var.name] == str(ports[setting]), var.name
    assert "--sidecar-oip-port" in cmd
    assert cmd[cmd.index("--model-store") + 1] == str(store)


# ------------------------------------------------------------------ cleanup, real processes

#: A launcher stand-in: starts two servers in sessions of their own (as TorchServe and
#: the sidecar are), records them in pids.json, then ignores SIGTERM (the worst case: a
#: launcher stuck while starting).
FAKE_LAUNCHER = textwrap.dedent("""
    import json, signal, subprocess, sys, time
    run = sys.argv[1]
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True) for _ in range(2)]
    with open(run + "/pids.json", "w") as f:
        json.dump({"torchserve": kids[0].pid, "sidecar": kids[1].pid}, f)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_failed_run_stops_the_launcher_and_what_it_started(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", FAKE_LAUNCHER, str(tmp_path)],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        groups = launcher_groups(tmp_path)
        assert len(groups) == 2 and all(group_alive(g) for g in groups)
        t0 = time.monotonic()
        stop_launcher(proc, tmp_path, timeout_s=1.0)
        assert time.monotonic() - t0 < 15
        assert proc.poll() is not None
        assert not any(group_alive(g) for g in groups), groups
    finally:
        for pgid in [proc.pid, *launcher_groups(tmp_path)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def test_no_pid_file_means_no_groups(tmp_path: Path) -> None:
    assert launcher_groups(tmp_path) == []
    (tmp_path / "pids.json").write_text("{not json")
    assert launcher_groups(tmp_path) == []
    (tmp_path / "pids.json").write_text(json.dumps({"torchserve": 12, "sidecar": None}))
    assert launcher_groups(tmp_path) == [12]


def test_sigterm_unwinds_through_finally(tmp_path: Path) -> None:
    """A tool inside sigterm_unwinds runs its finally blocks on SIGTERM (exit 143)."""
    marker = tmp_path / "stopped"
    script = textwrap.dedent(f"""
        import time
        from serve.ops.launch_signals import sigterm_unwinds
        with sigterm_unwinds():
            try:
                print("in", flush=True)
                time.sleep(60)
            finally:
                open({str(marker)!r}, "w").write("stopped")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"in"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert marker.read_text() == "stopped"


def test_the_cli_refuses_another_request_schema_before_starting_anything(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _declare(tmp_path / "state.yaml", "own-ranker")
    out = tmp_path / "faults.json"
    assert main(["--cases", "kill9_worker", "--model-store", str(store), "--state-file",
                 str(state), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model version 'own-ranker' ") and "13 vs 2" in err
    assert not out.exists()
