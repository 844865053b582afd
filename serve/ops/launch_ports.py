"""The ports a service binds (:data:`PORTS`: setting, listener, flag, variable), free ones
for a service of its own, and the check that refuses to start while one is busy."""
from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve import settings
from serve.common.net import free_ports
from serve.errors import ConfigError
from serve.ops.launch_config import LaunchConfig
from serve.settings import EnvVar

__all__ = [
    "PORTS",
    "PortUse",
    "check_ports",
    "free_port_settings",
    "planned_ports",
    "port_holder",
]


@dataclass(frozen=True)
class PortUse:
    """One port the launcher will bind, what it is for and how to move it.

    Attributes:
        port: the port number.
        setting: the LaunchConfig field (``inference_port``, ...).
        what: who listens there (``TorchServe inference API``).
        flag: the launcher's command-line flag that moves it (None: no flag).
        env: the environment variable that moves it; ``make up``/``make run`` pass it
            through (``make up TS_INFERENCE_PORT=8180``).
    """

    port: int
    setting: str
    what: str
    flag: str | None
    env: str

    def how_to_move(self) -> str:
        """``--inference-port PORT or TS_INFERENCE_PORT=PORT (make up TS_INFERENCE_PORT=PORT)``."""
        by_env = f"{self.env}=PORT (make up {self.env}=PORT)"
        return f"{self.flag} PORT or {by_env}" if self.flag else by_env


# (setting, what listens there, flag, env): the order TorchServe and the sidecar bind them.
PORTS: tuple[tuple[str, str, str | None, EnvVar], ...] = (
    ("inference_port", "TorchServe inference API", "--inference-port",
     settings.TS_INFERENCE_PORT),
    ("management_port", "TorchServe management API", "--management-port",
     settings.TS_MANAGEMENT_PORT),
    ("metrics_port", "TorchServe metrics API", "--metrics-port", settings.TS_METRICS_PORT),
    ("grpc_inference_port", "TorchServe gRPC inference API (always started)", None,
     settings.GRPC_INFERENCE_PORT),
    ("grpc_management_port", "TorchServe gRPC management API (always started)", None,
     settings.GRPC_MANAGEMENT_PORT),
    ("sidecar_port", "the sidecar (FastAPI)", "--sidecar-port", settings.SIDECAR_PORT),
    ("sidecar_write_port", "the sidecar's write API", "--sidecar-write-port",
     settings.SIDECAR_WRITE_PORT),
    ("sidecar_oip_port", "the sidecar's Open Inference Protocol (KServe v2) API",
     "--sidecar-oip-port", settings.SIDECAR_OIP_PORT),
)
_SIDECAR_PORTS = ("sidecar_port", "sidecar_write_port", "sidecar_oip_port")


def free_port_settings() -> dict[str, Any]:  # Any: LaunchConfig's ** keywords (ints)
    """A free loopback port (the OS picks it) for every port setting of
    :class:`LaunchConfig`, as its keywords: a service of its own for a test, a benchmark
    or a check, beside whatever already listens (``make up`` holds the defaults)."""
    return dict(zip((setting for setting, *_ in PORTS), free_ports(len(PORTS)),
                    strict=True))


def planned_ports(cfg: LaunchConfig) -> list[PortUse]:
    """Every port ``start`` will have bound on ``cfg.host``: TorchServe's five, and the
    sidecar's when ``cfg.sidecar`` is on."""
    return [PortUse(getattr(cfg, setting), setting, what, flag, env.name)
            for setting, what, flag, env in PORTS
            if setting not in _SIDECAR_PORTS or cfg.sidecar]


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port``: ``pid 4242 (python3 -m http.server 8080)``, or None
    when that cannot be known (another user's process, or listing sockets is not
    permitted here)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    pids = sorted({c.pid for c in conns if c.pid and c.laddr and c.laddr.port == port
                   and c.status == psutil.CONN_LISTEN})
    if not pids:
        return None
    described = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline()) or proc.name()
        except (psutil.Error, OSError):
            cmd = "name unknown"
        described.append(f"pid {pid} ({cmd if len(cmd) <= 100 else cmd[:97] + '...'})")
    return ", ".join(described)


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (None: it can).

    SO_REUSEADDR as the servers set it: a port in TIME_WAIT after ``make down`` is free
    for them, and for this check; a listening socket is not.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"host {host!r} does not resolve ({e.strerror}); pass --host ADDRESS"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "in use"
            if e.errno == errno.EACCES:
                return "not permitted (ports below 1024 need privileges)"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine; pass --host ADDRESS"
            return f"cannot be bound ({e.strerror})"
    return None


def check_ports(cfg: LaunchConfig,
                holder: Callable[[int], str | None] = port_holder) -> None:
    """Refuse to start while a port the service needs cannot be bound on ``cfg.host``.

    Without this a busy port shows only as TorchServe exiting before ready. Every port
    of :func:`planned_ports` is tried (bind, then closed at once); the error lists each
    one that fails, with its setting, who holds it (``holder``; "unknown" when that
    cannot be known) and the flag / variable that moves it.

    Raises:
        ConfigError: at least one port cannot be bound.
    """
    lines = []
    for use in planned_ports(cfg):
        problem = _bind_problem(cfg.host, use.port)
        if problem is None:
            continue
        who = ""
        if problem == "in use":
            who = f", held by {holder(use.port) or 'unknown (not visible to this user)'}"
        lines.append(f"  port {use.port} ({use.setting}: {use.what}) on {cfg.host} is "
                     f"{problem}{who}; move it with {use.how_to_move()}")
    if lines:
        raise ConfigError(
            f"cannot start: {len(lines)} port{'s' if len(lines) != 1 else ''} the service "
            "needs cannot be bound:\n" + "\n".join(lines)
            + "\nstop what holds them (`make down` if it is this service), or move the ports")
