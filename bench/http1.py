"""A lean HTTP/1.1 keep-alive client for the open-loop load generator.

The benchmark's client shares the machine with the service it measures (2 cores here),
so every millisecond of CPU it spends per query is taken from the service and charged to
the service's latency. :class:`Http1Pool` does the least a load generator needs: one
request head per body, built once and reused, written with the body on a kept-alive
connection; the answer read by its ``Content-Length`` (or chunks, or to the end of the
stream). No redirects, cookies, proxies, compression or TLS: loopback only, as the
benchmarks are.

    async with Http1Pool("http://127.0.0.1:8080", max_connections=64, timeout_s=30,
                         headers={"Content-Type": "application/json"}) as pool:
        status, body = await pool.request("POST", "/predictions/dlrm", b'{"instances": []}')

Connections: up to ``max_connections`` at once (more requests wait for one); an answer
with ``Connection: close``, a timeout or any error closes its connection, and the next
request opens a new one. Errors raise :class:`Http1Error` (its message names the cause).
"""
from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Mapping
from types import TracebackType
from typing import Self

__all__ = ["Http1Error", "Http1Pool"]

#: The largest response head (status line + headers) accepted, bytes.
MAX_HEAD = 64 * 1024


class Http1Error(Exception):
    """A request that got no complete answer: refused, reset, timed out or malformed."""


class Http1Pool:
    """Kept-alive HTTP/1.1 connections to one ``http://host:port`` (see the module)."""

    def __init__(self, root: str, *, max_connections: int, timeout_s: float,
                 headers: Mapping[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(root)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"root {root!r}: an http://host:port URL is needed (no TLS here)")
        if max_connections < 1:
            raise ValueError(f"max_connections {max_connections}: must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s {timeout_s}: must be > 0 seconds")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.timeout_s = timeout_s
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._heads: dict[tuple[str, str, int], bytes] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection (requests still running close theirs after)."""
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
        for _, writer in idle:
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _head(self, method: str, path: str, length: int) -> bytes:
        key = (method, path, length)
        head = self._heads.get(key)
        if head is None:
            head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"{self._extra}Content-Length: {length}\r\n\r\n").encode("latin-1")
            if len(self._heads) < 4096:   # bodies of a few sizes: the heads repeat
                self._heads[key] = head
        return head

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """Send one request; (status, body) of its answer. Raises :class:`Http1Error`."""
        async with self._slots:
            conn = self._reusable()
            try:
                if conn is None:
                    conn = await asyncio.wait_for(
                        asyncio.open_connection(self.host, self.port, limit=MAX_HEAD),
                        self.timeout_s)
                reader, writer = conn
                writer.write(self._head(method, path, len(body)))
                if body:
                    writer.write(body)
                status, payload, keep = await asyncio.wait_for(
                    self._exchange(reader, writer), self.timeout_s)
            except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    TimeoutError, ValueError) as e:
                if conn is not None:
                    conn[1].close()
                what = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                raise Http1Error(f"{method} http://{self.host}:{self.port}{path}: {what}") from e
            if keep:
                self._idle.append(conn)
            else:
                conn[1].close()
            return status, payload

    def _reusable(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """An idle connection the server has not closed meanwhile (else None: open one).
        A server may close a kept-alive connection without saying so (an idle timeout,
        an error answer); writing into it would fail a request the server never saw."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not (reader.at_eof() or writer.is_closing()):
                return reader, writer
            writer.close()
        return None

    @staticmethod
    async def _exchange(reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> tuple[int, bytes, bool]:
        """Flush the request, read the answer: (status, body, keep the connection)."""
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(rest[:3])
        length: int | None = None
        chunked = False
        keep = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"connection":
                keep = value == b"keep-alive" or (keep and value != b"close")
        if chunked:
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")       # no trailers expected
                    break
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            return status, b"".join(parts), keep
        if length is not None:
            return status, await reader.readexactly(length), keep
        if status in (204, 304) or 100 <= status < 200:
            return status, b"", keep
        return status, await reader.read(), False      # the body runs to the end
