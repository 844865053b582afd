"""bench.http1: the open-loop load generator's HTTP/1.1 client, against a stdlib HTTP
server on a free loopback port (a peer we do not ship) and against nothing at all."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from bench.http1 import Http1Error, Http1Pool
from tests.fakes.http_peer import local_http_server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"          # keep-alive unless an answer says close
    connections: ClassVar[set[tuple[str, int]]] = set()

    def log_message(self, *args: object) -> None:   # quiet
        pass

    def _send(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        type(self).connections.add(self.client_address)
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/close":
            self.close_connection = True
            self._send(200, b"bye", {"Connection": "close"})
        elif self.path == "/silent-close":   # closes after answering, without saying so
            self.close_connection = True
            self._send(200, b"gone")
        elif self.path == "/slow":
            time.sleep(0.5)
            self._send(200, b"late")
        else:
            self._send(404, b'{"error": "no such path"}')

    def do_POST(self) -> None:
        type(self).connections.add(self.client_address)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        echo = self.headers.get("Content-Type", "").encode() + b"|" + body
        self._send(200 if body else 400, echo)


@pytest.fixture()
def server() -> Iterator[str]:
    _Handler.connections = set()
    with local_http_server(_Handler) as url:
        yield url


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_posts_keep_their_connection_alive_and_read_by_length(server: str) -> None:
    async def go() -> list[tuple[int, bytes]]:
        async with Http1Pool(server, max_connections=2, timeout_s=5,
                             headers={"Content-Type": "application/json"}) as pool:
            out = [await pool.request("POST", "/predictions/dlrm", b'{"n": %d}' % i)
                   for i in range(5)]
            out.append(await pool.request("POST", "/predictions/dlrm", b""))
            return out

    got = _run(go())
    assert got[:5] == [(200, b'application/json|{"n": %d}' % i) for i in range(5)]
    assert got[5] == (400, b"application/json|")
    assert len(_Handler.connections) == 1      # one connection served all six, in turn


def test_concurrent_requests_open_at_most_max_connections(server: str) -> None:
    async def go() -> list[tuple[int, bytes]]:
        async with Http1Pool(server, max_connections=3, timeout_s=5) as pool:
            return list(await asyncio.gather(
                *(pool.request("POST", "/x", b"%d" % i) for i in range(12))))

    got = _run(go())
    assert got == [(200, b"|%d" % i) for i in range(12)]
    assert 1 <= len(_Handler.connections) <= 3


def test_chunked_close_and_error_answers(server: str) -> None:
    async def go() -> list[tuple[int, bytes]]:
        async with Http1Pool(server, max_connections=1, timeout_s=5) as pool:
            return [await pool.request("GET", "/chunked"), await pool.request("GET", "/close"),
                    await pool.request("GET", "/missing")]   # after close: a new connection

    assert _run(go()) == [(200, b"hello chunked world"), (200, b"bye"),
                          (404, b'{"error": "no such path"}')]
    assert len(_Handler.connections) == 2


def test_a_connection_the_server_closed_while_idle_is_not_reused(server: str) -> None:
    async def go() -> list[tuple[int, bytes]]:
        async with Http1Pool(server, max_connections=1, timeout_s=5) as pool:
            first = await pool.request("GET", "/silent-close")
            await asyncio.sleep(0.2)          # the server's FIN arrives meanwhile
            return [first, await pool.request("POST", "/p", b"after")]

    assert _run(go()) == [(200, b"gone"), (200, b"|after")]
    assert len(_Handler.connections) == 2


def test_a_timeout_or_nobody_listening_raises_and_names_the_request(server: str) -> None:
    async def slow() -> None:
        async with Http1Pool(server, max_connections=1, timeout_s=0.1) as pool:
            await pool.request("GET", "/slow")

    with pytest.raises(Http1Error, match=r"GET http://127\.0\.0\.1:\d+/slow: timed out"):
        _run(slow())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]      # nothing listens there once closed

    async def refused() -> None:
        async with Http1Pool(f"http://127.0.0.1:{free}", max_connections=1,
                             timeout_s=2) as pool:
            await pool.request("POST", "/p", b"x")

    with pytest.raises(Http1Error, match=r"POST http://127\.0\.0\.1:\d+/p: ConnectionRefused"):
        _run(refused())


@pytest.mark.parametrize(("root", "kw", "match"), [
    ("https://127.0.0.1:1", {}, "an http://host:port URL"),
    ("127.0.0.1:8080", {}, "an http://host:port URL"),
    ("http://127.0.0.1:1", {"max_connections": 0}, "max_connections 0: must be >= 1"),
    ("http://127.0.0.1:1", {"timeout_s": 0}, "timeout_s 0: must be > 0 seconds"),
])
def test_bad_settings_are_refused(root: str, kw: dict[str, float], match: str) -> None:
    args = {"max_connections": 1, "timeout_s": 1.0, **kw}
    with pytest.raises(ValueError, match=match):
        Http1Pool(root, **args)  # type: ignore[arg-type]
