"""The launcher's desired state and command lines (fast: nothing is started).

``make up`` / ``make run`` create ``.run/state.yaml`` declaring the version ``make model``
builds (never simply the newest file) when it is absent and leave it alone when present; TorchServe starts with no model and
the sidecar gets ``--state-file`` and ``--repository``.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from serve.common.net import free_port
from serve.errors import ConfigError, UpstreamUnavailable
from serve.ops.launch_config import REPO, LaunchConfig
from serve.ops.launch_ports import free_port_settings
from serve.ops.launch_processes import render_ts_config, sidecar_command, torchserve_command
from serve.ops.launch_state import default_state, ensure_state
from serve.ops.launcher import Service, _banner, start, wait_ready
from serve.state import LOCAL_STATE_FILE, load_state, parse_state, write_state
from serve.store.repository import ModelRepository, default_version


def _add(store: Path, version: str, created: str, **report: object) -> None:
    src = store.parent / f"src-{version}.mar"
    src.write_bytes(version.encode())
    ModelRepository([store]).add(version, src, {"version": version, "created_at": created,
                                                **report})


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A repository with two versions; the latest's .mar batches 8 / 5 ms with 1 worker."""
    s = tmp_path / "model_store"
    _add(s, "small-int8-s0", "2026-12-01T09:00:00+00:00",
         mar_batch_size=2, mar_max_batch_delay_ms=2, mar_workers=2)
    _add(s, "small-int8-s7", "2026-12-01T10:00:00+00:00",
         mar_batch_size=8, mar_max_batch_delay_ms=5, mar_workers=1)
    return s


def test_absent_state_declares_the_given_version_with_its_reports_batching(store: Path,
                                                                           tmp_path: Path):
    path = tmp_path / "run" / "state.yaml"
    state, created = ensure_state(path, ModelRepository([store]), "small-int8-s7")
    assert created
    assert state.model.version == "small-int8-s7"
    assert (state.batching.batch_size, state.batching.max_batch_delay_ms, state.workers) == (8, 5, 1)
    assert state.rollout is None
    assert load_state(path) == state


def test_report_without_batching_falls_back_to_the_shipped_2_0_2(tmp_path: Path):
    s = tmp_path / "model_store"
    _add(s, "old-v1", "2026-12-01T09:00:00+00:00", mar_batch_size="8")  # wrong type: ignored
    state = default_state(ModelRepository([s]), "old-v1")
    assert state.model.version == "old-v1"
    assert (state.batching.batch_size, state.batching.max_batch_delay_ms, state.workers) == (2, 0, 2)


def test_existing_state_is_left_alone(store: Path, tmp_path: Path):
    path = tmp_path / "state.yaml"
    declared = parse_state({"model": {"version": "small-int8-s0"},
                            "batching": {"batch_size": 4, "max_batch_delay_ms": 10}, "workers": 3})
    write_state(path, declared)
    text, mtime = path.read_bytes(), path.stat().st_mtime_ns
    state, created = ensure_state(path, ModelRepository([store]), "small-int8-s7")
    assert not created and state == declared
    assert path.read_bytes() == text and path.stat().st_mtime_ns == mtime


def test_existing_state_naming_a_missing_version_says_what_to_do(store: Path, tmp_path: Path):
    path = tmp_path / "state.yaml"
    write_state(path, parse_state({"model": {"version": "gone-v9"}}))
    with pytest.raises(ConfigError, match=r"declares model version 'gone-v9', which is not in the "
                                          r"repository \(.*\); available: small-int8-s0, "
                                          r"small-int8-s7\. Build it .* or delete the file"):
        ensure_state(path, ModelRepository([store]), "small-int8-s0")


def test_invalid_existing_state_names_the_field(store: Path, tmp_path: Path):
    path = tmp_path / "state.yaml"
    path.write_text("model: {version: small-int8-s0}\nworkers: 0\n")
    with pytest.raises(ConfigError, match=r"workers: Input should be greater than or equal to 1"):
        ensure_state(path, ModelRepository([store]), "small-int8-s0")


def test_empty_repository_says_run_make_model(tmp_path: Path):
    s = tmp_path / "model_store"
    s.mkdir()
    (s / "dlrm-half.mar").write_bytes(b"x")  # an archive without its report: not a version
    with pytest.raises(ConfigError, match=r"^model version 'small-int8-s0' is not in "
                                          r".*model_store/ \(the repository is empty\); build "
                                          r"it with `make model`"):
        ensure_state(tmp_path / "state.yaml", ModelRepository([s]), "small-int8-s0")
    assert not (tmp_path / "state.yaml").exists()
    # inside the checkout the message names the folder as people type it
    with pytest.raises(ConfigError, match=r"^model version 'x' is not in build/no-such-store/ "):
        default_state(ModelRepository([REPO / "build" / "no-such-store"]), "x")


def test_a_newer_shuffled_label_version_is_not_declared(store: Path, tmp_path: Path):
    """`make model SEED=8 LABEL_SHUFFLE=1` after `make model`: the newest file is the
    AUC-0.5 model; a fresh `make up` still declares what `make model` builds by default."""
    _add(store, default_version("small", seed=8, label_shuffle=True),
         "2026-12-01T11:00:00+00:00")
    assert ModelRepository([store]).latest() == "small-int8-s8-shuffled"
    cfg = LaunchConfig(model_store=store, state_file=tmp_path / "state.yaml")
    assert cfg.initial_version == "small-int8-s0" == default_version("small")
    state, created = ensure_state(cfg.path(cfg.state_file), cfg.repository(),
                                  cfg.initial_version)
    assert created and state.model.version == "small-int8-s0"


def test_a_missing_declared_version_lists_what_is_there(store: Path, tmp_path: Path):
    with pytest.raises(ConfigError, match=r"model version 'small-int8-s3' is not in .*"
                                          r"available: small-int8-s0, small-int8-s7; serve one "
                                          r"of them with `make up VERSION=<name>`"):
        ensure_state(tmp_path / "state.yaml", ModelRepository([store]), "small-int8-s3")


def test_launcher_flags_name_the_version_like_make_model():
    from serve.ops import launcher
    seen = {}

    def grab(cfg: LaunchConfig) -> int:
        seen["v"] = cfg.initial_version
        return 0

    for argv, want in ((["up"], "small-int8-s0"), (["up", "--seed", "7"], "small-int8-s7"),
                       (["up", "--seed", "8", "--label-shuffle"], "small-int8-s8-shuffled"),
                       (["up", "--profile", "tiny"], "tiny-int8-s0"),
                       (["up", "--version", "mine-v2"], "mine-v2")):
        orig = launcher._cmd_up
        launcher._cmd_up = grab
        try:
            assert launcher.main(argv) == 0
        finally:
            launcher._cmd_up = orig
        assert seen["v"] == want, argv


def _cfg(tmp_path: Path, **kw: object) -> LaunchConfig:
    # free ports: start() checks them first, and a `make up` on this host holds the defaults
    base: dict = {"model_store": tmp_path / "model_store", "run_dir": tmp_path / "run",
                  "log_dir": tmp_path / "logs", "state_file": tmp_path / "run" / "state.yaml",
                  **free_port_settings()}
    return LaunchConfig(**{**base, **kw})


def test_torchserve_starts_without_models_unless_an_archive_is_named(tmp_path: Path):
    cfg = _cfg(tmp_path)
    assert LaunchConfig().startup_archive is None  # make up / make run: the sidecar registers
    cmd = torchserve_command(cfg, tmp_path / "conf.properties")
    assert "--models" not in cmd
    assert cmd[1:] == ["--start", "--foreground", "--ncs", "--model-store",
                       str(tmp_path / "model_store"), "--log-config", str(REPO / "log4j2.xml"),
                       "--ts-config", str(tmp_path / "conf.properties")]
    cmd = torchserve_command(_cfg(tmp_path, mar_name="test.mar"), tmp_path / "c")
    assert _flag(cmd, "--models") == ["dlrm=test.mar"]
    # without the sidecar nothing else would register a model: the fixtures' dlrm.mar
    cmd = torchserve_command(_cfg(tmp_path, sidecar=False), tmp_path / "c")
    assert _flag(cmd, "--models") == ["dlrm=dlrm.mar"]


def _flag(cmd: list[str], name: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == name]


def test_sidecar_command_names_the_state_file_and_the_repository(tmp_path: Path):
    cfg = _cfg(tmp_path, sidecar_port=9190)
    cmd = sidecar_command(cfg)
    assert cmd[:3] == [sys.executable, "-m", "serve.sidecar"]
    assert _flag(cmd, "--state-file") == [str(tmp_path / "run" / "state.yaml")]
    assert _flag(cmd, "--repository") == [str(tmp_path / "model_store")]  # default: the store
    assert _flag(cmd, "--model-store") == [str(tmp_path / "model_store")]
    assert _flag(cmd, "--port") == ["9190"] and _flag(cmd, "--model-name") == ["dlrm"]
    assert _flag(cmd, "--management-url") == [cfg.management_url]
    cmd = sidecar_command(_cfg(tmp_path, repositories=(tmp_path / "a", Path("rel"))))
    assert _flag(cmd, "--repository") == [str(tmp_path / "a"), str(REPO / "rel")]
    # the default state file is .run/state.yaml under the checkout
    assert _flag(sidecar_command(LaunchConfig()), "--state-file") == [str(REPO / LOCAL_STATE_FILE)]


def test_shipped_config_loads_no_model(tmp_path: Path):
    text = (REPO / "config.properties").read_text()
    keys = [ln.split("=", 1)[0].strip() for ln in text.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]
    assert "load_models" not in keys and "model_store" in keys
    out = render_ts_config(text, _cfg(tmp_path))
    assert f"model_store={tmp_path / 'model_store'}" in out and "load_models=" not in out


def test_start_refuses_before_anything_starts(store: Path, tmp_path: Path):
    # no sidecar and no archive to load: the old single-file layout is gone
    with pytest.raises(ConfigError, match=r"model_store/dlrm\.mar does not exist: name an archive "
                                          r"of .* \(--mar; `make model` stores versions as "
                                          r"dlrm-<version>\.mar\), or start with the sidecar"):
        start(_cfg(tmp_path, model_store=store, sidecar=False))
    # an empty repository: the state cannot be defaulted
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"not in .*empty/ \(the repository is empty\)"):
        start(_cfg(tmp_path, model_store=empty))
    assert not (tmp_path / "run" / "torchserve").exists() and not (tmp_path / "logs").exists()


def test_a_missing_log_config_is_refused_before_anything_starts(store: Path, tmp_path: Path):
    cfg = _cfg(tmp_path, model_store=store, log_config=tmp_path / "nope.xml")
    with pytest.raises(ConfigError, match=r"TorchServe log config .*nope\.xml does not exist: "
                                          r"pass --log-config FILE"):
        start(cfg)
    assert not (tmp_path / "run" / "torchserve").exists()


def test_readiness_timeout_points_at_the_sidecar(tmp_path: Path):
    port = free_port()
    cfg = _cfg(tmp_path, inference_port=port, sidecar_port=free_port())
    with pytest.raises(UpstreamUnavailable) as e:
        wait_ready(cfg, [], timeout_s=0.3)
    msg = e.value.message
    assert msg.startswith("service (logs: ")
    assert "TorchServe starts with no model: the sidecar registers the version declared in " \
           f"{tmp_path / 'run' / 'state.yaml'}" in msg
    assert str(tmp_path / "logs" / "sidecar.out") in msg
    assert f"`curl -s {cfg.sidecar_url}/state`" in msg
    # with an archive loaded at start there is no sidecar to blame
    with pytest.raises(UpstreamUnavailable) as e:
        wait_ready(_cfg(tmp_path, inference_port=port, mar_name="x.mar", sidecar=False), [],
                   timeout_s=0.3)
    assert "sidecar" not in e.value.message


def test_banner_names_the_version_and_the_state_endpoint(store: Path, tmp_path: Path):
    cfg = _cfg(tmp_path, model_store=store)
    state, _ = ensure_state(cfg.path(cfg.state_file), cfg.repository(), "small-int8-s7")
    proc = types.SimpleNamespace(pid=1)
    text = _banner(Service(cfg, proc, sidecar=proc, ready_s=4.2, state=state))  # type: ignore[arg-type]
    assert "ready in 4.2 s" in text
    assert f"predict:    {cfg.inference_url}/predictions/dlrm" in text
    assert ("serving:    version small-int8-s7, batch_size 8, max_batch_delay 5 ms, 1 worker "
            f"(declared in {tmp_path / 'run' / 'state.yaml'})") in text
    assert f"curl -s -H 'Content-Type: application/json' {cfg.inference_url}/predictions/dlrm" in text
    assert f"curl -s {cfg.sidecar_url}/state" in text


def test_a_started_service_is_a_new_pod_so_the_last_drain_record_goes(tmp_path: Path):
    """`make down` drains (the sidecar records it so a restarted sidecar stays drained);
    the next `make up` is a new pod: a kept record left it drained and never ready."""
    cfg = _cfg(tmp_path, model_store=tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    assert _flag(sidecar_command(cfg), "--drain-file") == [str(cfg.drain_file)]
    cfg.delta_dir.mkdir(parents=True)
    for marker in (cfg.drain_file, cfg.delta_dir / ".drained.json"):
        marker.write_text('{"drained": true, "phase": "drained"}')
    with pytest.raises(ConfigError, match="the repository is empty"):
        start(cfg)  # fails later, at the desired state: the records are gone by then
    assert not cfg.drain_file.exists() and not (cfg.delta_dir / ".drained.json").exists()


def test_the_local_route_key_secret_is_made_once_private_and_shared(tmp_path):
    """make up / make fleet: one 0600 secret beside the state file, kept across restarts
    and the same for every pod (they share the state folder)."""
    import stat

    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launch_processes import route_key_salt_file

    a = LaunchConfig(state_file=tmp_path / "run" / "state.yaml", run_dir=tmp_path / "pod-1")
    b = LaunchConfig(state_file=tmp_path / "run" / "state.yaml", run_dir=tmp_path / "pod-2")
    first = route_key_salt_file(a)
    secret = first.read_text()
    assert len(bytes.fromhex(secret)) == 32
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    assert route_key_salt_file(b) == first and first.read_text() == secret
