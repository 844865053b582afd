"""Loopback ports and waiting for things to come up: the one copy of each for the project.

Used by the launcher, the training ranks' rendezvous, the load-test runner, the
benchmarks and the test fixtures. HTTP goes through httpx everywhere (one client library).

Example::

    port = free_port()
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/ping").status_code == 200,
               timeout_s=30, what="TorchServe /ping")
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

from serve.errors import UpstreamUnavailable

__all__ = ["free_port", "free_ports", "wait_until"]

T = TypeVar("T")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports on ``host`` that are free right now (the OS picks them).

    All sockets are held open until every port is picked, so the ports differ. Another
    process can still take one before the caller binds it: use them at once.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port on ``host`` that is free right now."""
    return free_ports(1, host)[0]


def wait_until(probe: Callable[[], T | None], *, timeout_s: float, what: str,
               interval_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep,
               check: Callable[[], None] | None = None) -> T:
    """Call ``probe`` until it returns a truthy value; return that value.

    ``probe`` may raise ``OSError`` or an httpx error (the thing is not up yet): that counts
    as "not yet" and the last such error is quoted if time runs out. ``check`` runs before
    each try and may raise to give up early (for example, when the process being waited
    for has exited).

    Raises:
        UpstreamUnavailable: ``what`` did not come up within ``timeout_s`` seconds.
    """
    import httpx  # lazy: keeps `import serve.common.net` light

    deadline = clock() + timeout_s
    last = "no answer yet"
    while True:
        if check is not None:
            check()
        try:
            value = probe()
            if value:
                return value
            last = f"not ready (got {value!r})"
        except (OSError, httpx.HTTPError) as e:
            last = f"{type(e).__name__}: {e}"
        if clock() >= deadline:
            raise UpstreamUnavailable(f"{what} not ready after {timeout_s:.0f} s (last: {last})")
        sleep(interval_s)
