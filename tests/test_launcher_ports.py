"""The launcher refuses a busy port before it starts anything, naming the port, its
setting, its holder and how to move it (fast: nothing is started)."""
from __future__ import annotations

import os
import socket
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve.errors import ConfigError
from serve.ops import launcher
from serve.ops.launch_config import LaunchConfig
from serve.ops.launch_ports import check_ports, free_port_settings, planned_ports
from serve.ops.launcher import start
from serve.store.repository import ModelRepository


@pytest.fixture
def held() -> Iterator[int]:
    """A port on 127.0.0.1 held by a listening socket of this test process."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


def _cfg(tmp_path: Path, **kw: object) -> LaunchConfig:
    """Free ports (the OS picks them) and every path under ``tmp_path``."""
    base: dict = {**free_port_settings(), "model_store": tmp_path / "model_store", "run_dir": tmp_path / "run",
                  "log_dir": tmp_path / "logs", "state_file": tmp_path / "run" / "state.yaml"}
    return LaunchConfig(**{**base, **kw})


def test_planned_ports_name_every_port_and_how_to_move_it(tmp_path: Path):
    cfg = _cfg(tmp_path)
    uses = {u.setting: u for u in planned_ports(cfg)}
    assert set(uses) == {"inference_port", "management_port", "metrics_port",
                         "grpc_inference_port", "grpc_management_port", "sidecar_port",
                         "sidecar_write_port", "sidecar_oip_port"}
    assert uses["inference_port"].port == cfg.inference_port
    assert uses["inference_port"].how_to_move() == (
        "--inference-port PORT or TS_INFERENCE_PORT=PORT (make up TS_INFERENCE_PORT=PORT)")
    # the gRPC ports have no flag: only their variables move them
    assert uses["grpc_inference_port"].how_to_move() == (
        "GRPC_INFERENCE_PORT=PORT (make up GRPC_INFERENCE_PORT=PORT)")
    # without the sidecar its port is not needed
    assert "sidecar_port" not in {u.setting for u in planned_ports(_cfg(tmp_path, sidecar=False))}


def test_the_flags_and_variables_named_are_the_launchers_own(monkeypatch: pytest.MonkeyPatch):
    """What the message tells people to use really moves the port."""
    seen: list[LaunchConfig] = []
    monkeypatch.setattr(launcher, "_cmd_up", lambda cfg: seen.append(cfg) or 0)
    env = {u.env: str(9100 + i) for i, u in enumerate(planned_ports(LaunchConfig()))}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launcher.main(["up"]) == 0
    by_env = {u.env: u.port for u in planned_ports(seen[-1])}
    assert by_env == {k: int(v) for k, v in env.items()}
    flags = [u for u in planned_ports(LaunchConfig()) if u.flag]
    argv = ["up"] + [a for i, u in enumerate(flags) for a in (u.flag, str(9200 + i))]
    assert launcher.main(argv) == 0
    assert [getattr(seen[-1], u.setting) for u in flags] == [9200 + i for i in range(len(flags))]


def test_a_held_port_is_named_with_its_setting_holder_and_fix(tmp_path: Path, held: int):
    cfg = _cfg(tmp_path, inference_port=held)
    with pytest.raises(ConfigError) as info:
        check_ports(cfg)
    msg = info.value.message
    assert msg.startswith("cannot start: 1 port the service needs cannot be bound:\n")
    assert (f"  port {held} (inference_port: TorchServe inference API) on 127.0.0.1 is in "
            f"use, held by pid {os.getpid()} (") in msg  # this test process holds it
    assert msg.splitlines()[1].endswith(
        "; move it with --inference-port PORT or TS_INFERENCE_PORT=PORT "
        "(make up TS_INFERENCE_PORT=PORT)")
    assert msg.endswith("stop what holds them (`make down` if it is this service), or move "
                        "the ports")


def test_an_unknown_holder_says_unknown(tmp_path: Path, held: int):
    cfg = _cfg(tmp_path, grpc_management_port=held)
    with pytest.raises(ConfigError) as info:
        check_ports(cfg, holder=lambda port: None)
    assert (f"port {held} (grpc_management_port: TorchServe gRPC management API (always "
            "started)) on 127.0.0.1 is in use, held by unknown (not visible to this user); "
            "move it with GRPC_MANAGEMENT_PORT=PORT") in info.value.message


def test_every_busy_port_is_listed_at_once(tmp_path: Path, held: int):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        second = int(other.getsockname()[1])
        cfg = _cfg(tmp_path, metrics_port=held, sidecar_port=second)
        with pytest.raises(ConfigError) as info:
            check_ports(cfg, holder=lambda port: f"pid 1 (fake {port})")
    lines = info.value.message.splitlines()
    assert lines[0] == "cannot start: 2 ports the service needs cannot be bound:"
    assert lines[1].startswith(f"  port {held} (metrics_port: ")
    assert f"held by pid 1 (fake {held}); move it with --metrics-port PORT" in lines[1]
    assert lines[2].startswith(f"  port {second} (sidecar_port: the sidecar (FastAPI))")
    assert "--sidecar-port PORT or SIDECAR_PORT=PORT" in lines[2]


def test_free_ports_pass(tmp_path: Path):
    check_ports(_cfg(tmp_path))  # no exception


def test_a_closed_server_leaves_its_port_usable(tmp_path: Path):
    """A port with only TIME_WAIT connections (after `make down`) is free: the servers
    bind with SO_REUSEADDR, and so does the check."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = int(srv.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    client.close()
    srv.close()
    check_ports(_cfg(tmp_path, inference_port=port))


def test_start_refuses_a_busy_port_before_anything_starts(
        tmp_path: Path, held: int, monkeypatch: pytest.MonkeyPatch):
    store = tmp_path / "model_store"
    src = tmp_path / "v.mar"
    src.write_bytes(b"mar")
    ModelRepository([store]).add("small-int8-s0", src, {"version": "small-int8-s0",
                                                        "created_at": "2026-12-01T09:00:00+00:00"})
    spawned: list[str] = []
    monkeypatch.setattr(launcher, "start_torchserve", lambda cfg: spawned.append("torchserve"))
    monkeypatch.setattr(launcher, "start_sidecar", lambda cfg: spawned.append("sidecar"))
    cfg = _cfg(tmp_path, model_store=store, inference_port=held)
    with pytest.raises(ConfigError, match=rf"port {held} \(inference_port: .* is in use"):
        start(cfg)
    assert spawned == []
    # nothing written either: no desired state, no pid file, no logs, no run folder
    assert not (tmp_path / "run").exists() and not (tmp_path / "logs").exists()
    # the same config with the port free goes on to declare the state and start
    cfg = _cfg(tmp_path, model_store=store)
    monkeypatch.setattr(launcher, "wait_ready", lambda cfg, procs: 0.0)
    proc = types.SimpleNamespace(pid=999_999_999)  # recorded in pids.json, never signalled
    monkeypatch.setattr(launcher, "start_torchserve",
                        lambda cfg: spawned.append("torchserve") or proc)
    monkeypatch.setattr(launcher, "start_sidecar",
                        lambda cfg: spawned.append("sidecar") or None)
    start(cfg)
    assert spawned == ["torchserve", "sidecar"]
    assert (tmp_path / "run" / "state.yaml").exists()
