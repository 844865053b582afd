"""The bounds of the Open Inference Protocol's process (:mod:`serve.sidecar.http.oip_server`):
what keeps a flood of bodies from taking its memory, its CPU or its upstreams.

Every bound refuses at once, with a JSON error, before the work it would cost:

* :class:`AdmissionGuard`: the budgets checked on an infer's headers, before any of the
  app's machinery, so a refusal costs the event loop least.
* :class:`Budget`: a count with a ceiling, taken and given back on one event loop. Bytes
  of bodies in flight (an announced ``Content-Length`` is taken before a byte is read; a
  chunked body chunk by chunk), and requests at once. Past it: 429
  (:class:`~serve.errors.Overloaded`).
* :func:`read_body`: the body within a deadline (a stalled upload answers 408,
  :class:`~serve.errors.RequestTimeout`, and gives its bytes back) and under the size
  limit (413).
* :class:`ParseSlots`: how many bodies are parsed at once, in worker processes (off the
  event loop's GIL); a parse that cannot start within its wait answers 429.
* :class:`ReadyCache`: one upstream readiness call per ``ttl_s`` however many clients
  ask, so ``GET /v2/health/ready`` cannot amplify load onto the sidecar and TorchServe.

Example::

    inflight = Budget(64 * 2**20, "bytes of bodies in flight")
    with inflight.hold() as held:
        body = await read_body(request.stream(), request.headers.get("content-length"),
                               held=held, max_bytes=8 * 2**20, deadline_s=10)
        parsed = await slots.run(parse, body)
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Generic, TypeVar

import anyio
import anyio.to_thread
import orjson
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.errors import (
    InvalidInput,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ServeError,
    UpstreamUnavailable,
)

__all__ = ["AdmissionGuard", "Budget", "Held", "ParseSlots", "ReadyCache", "read_body"]

T = TypeVar("T")


class Held:
    """What one request holds of a :class:`Budget`; :meth:`take` more as it arrives."""

    def __init__(self, budget: Budget) -> None:
        self._budget = budget
        self.amount = 0

    def take(self, n: int) -> None:
        """Hold ``n`` more; :class:`~serve.errors.Overloaded` (429) when the budget is
        spent (nothing more is held then)."""
        self._budget.take(n)
        self.amount += n


class Budget:
    """A count with a ceiling (bytes in flight, requests at once), on one event loop
    (no lock: every take and give runs on the loop's thread).

    Args:
        capacity: the ceiling (>= 1).
        what: what is counted, for the error message ("bytes of bodies in flight").
    """

    def __init__(self, capacity: int, what: str) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.what = what
        self.in_use = 0
        self.peak = 0

    def check(self, n: int) -> None:
        """Raise :class:`~serve.errors.Overloaded` (429) when ``in_use + n`` would pass
        the capacity; take nothing."""
        if self.in_use + n > self.capacity:
            raise Overloaded(f"this server holds {self.in_use} of its {self.capacity} "
                             f"{self.what} and this request needs {n} more; retry in a "
                             "second or send smaller requests")

    def take(self, n: int) -> None:
        """Take ``n``, or raise :class:`~serve.errors.Overloaded` (429) when
        ``in_use + n`` would pass the capacity."""
        self.check(n)
        self.in_use += n
        self.peak = max(self.peak, self.in_use)

    def give(self, n: int) -> None:
        self.in_use -= n

    @contextmanager
    def hold(self, n: int = 0) -> Iterator[Held]:
        """A :class:`Held` share, taking ``n`` at once; everything it took is given back
        on exit, whatever happened."""
        held = Held(self)
        try:
            if n:
                held.take(n)
            yield held
        finally:
            self.give(held.amount)


def _too_large(size: int, max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"body: {size} bytes is over the {max_bytes}-byte limit; "
                           "send fewer instances per request (binary tensors are the "
                           "smallest form)")


def content_length(text: str | None, max_bytes: int) -> int | None:
    """The ``Content-Length`` header as bytes (None: not sent, chunked): 400 when it is
    not a number, 413 past ``max_bytes``."""
    if text is None:
        return None
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise InvalidInput(f"header Content-Length: {text[:40]!r} is not a number of bytes")
    if int(text) > max_bytes:
        raise _too_large(int(text), max_bytes)
    return int(text)


async def read_body(stream: AsyncIterator[bytes], length_header: str | None, *, held: Held,
                    max_bytes: int, deadline_s: float) -> bytearray:
    """The body, bounded three ways before and while it is read.

    Args:
        stream: the body's chunks (``request.stream()``).
        length_header: the ``Content-Length`` header (None: chunked).
        held: the request's share of the bytes-in-flight budget: an announced length is
            taken whole before a byte is read, a chunked body chunk by chunk (429 when
            the budget is spent).
        max_bytes: the largest body (413 on the announced length, or as soon as a chunked
            count passes it).
        deadline_s: the whole body must arrive within this many seconds (408 after).
    Returns:
        the body (no copy is made of it).
    """
    announced = content_length(length_header, max_bytes)
    if announced:
        held.take(announced)
    body = bytearray()
    try:
        async with asyncio.timeout(deadline_s):
            async for chunk in stream:
                if announced is None:
                    held.take(len(chunk))
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(len(body), max_bytes)
    except ClientDisconnect:
        # No answer can reach it; a 400 keeps it out of the 5xx and the error log.
        raise InvalidInput(f"body: the client closed the connection after {len(body)} "
                           "bytes; send the whole body") from None
    except TimeoutError:
        raise RequestTimeout(f"body: {len(body)} of {announced or 'unknown'} bytes arrived "
                             f"in {deadline_s:g} s, the deadline for a whole body; send it "
                             "at once (a stalled upload holds memory others need)") from None
    return body


class AdmissionGuard:
    """Pure ASGI, outermost: an infer that the requests or bytes budget cannot take now
    is answered 429 on its headers, before routing, dependencies or exception handlers
    (a flood reconnects as fast as it is refused, so a refusal must cost the event loop
    least). The route takes the budgets itself; this only checks them first.

    Args:
        app: the app behind it.
        requests, inflight: the budgets the infer route takes (:class:`Budget`).
        max_bytes: the largest body (a longer announced one is the route's 413).
    """

    def __init__(self, app: ASGIApp, *, requests: Budget, inflight: Budget,
                 max_bytes: int) -> None:
        self.app = app
        self.requests = requests
        self.inflight = inflight
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"].endswith("/infer")):
            try:
                self.requests.check(1)
                length = _announced(scope)
                if length is not None and length <= self.max_bytes:
                    self.inflight.check(length)
            except Overloaded as e:
                body = orjson.dumps({"error": e.message})
                await send({"type": "http.response.start", "status": e.status, "headers": [
                    (b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _announced(scope: Scope) -> int | None:
    for k, v in scope["headers"]:
        if k == b"content-length":
            return int(v) if v.isdigit() else None
    return None


def _parse_worker_priority() -> None:
    """A parse worker yields the CPU to the event loop (nice +10, no privilege needed):
    both share the container's CPU quota, and refusals and health answers must not wait
    behind a bad 8 MiB body's parse."""
    with contextlib.suppress(OSError):
        os.nice(10)


class ParseSlots:
    """At most ``n`` parses at once. A body's parse holds the GIL and up to ~16x its size
    in memory, so their number is the process's CPU and memory bound; and with
    ``processes`` (the default in production) each runs in one of ``n`` worker processes,
    so a parse never holds the event loop's GIL and, at a lower CPU priority, never
    takes the container's CPU quota from it: refusals and health answers stay fast while
    a bad 8 MiB body is parsed. A parse that cannot start within ``wait_s`` answers
    429; a worker that dies (a parse past the container's memory) answers 503 and the
    pool is made again.

    Args:
        n: parses at once (>= 1).
        wait_s: longest wait for a free slot (s).
        processes: parse in worker processes (``spawn``); False: in a worker thread (tests
            with functions that cannot be pickled).
    """

    def __init__(self, n: int, wait_s: float, *, processes: bool = False) -> None:
        self._limiter = anyio.CapacityLimiter(n)
        self.wait_s = wait_s
        self._n = n
        self._pool: ProcessPoolExecutor | None = self._new_pool() if processes else None

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self._n, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_parse_worker_priority)

    @property
    def busy(self) -> int:
        return int(self._limiter.borrowed_tokens)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` once a slot is free, in a worker process (``fn`` is pickled: a
        module-level function or a ``functools.partial`` of one) or thread."""
        try:
            with anyio.fail_after(self.wait_s):
                await self._limiter.acquire()
        except TimeoutError:
            raise Overloaded(f"all {int(self._limiter.total_tokens)} parse slots stayed busy "
                             f"for {self.wait_s:g} s; retry in a second") from None
        try:
            if self._pool is None:
                return await anyio.to_thread.run_sync(fn)
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except BrokenProcessPool:
            self._pool.shutdown(wait=False, cancel_futures=True)  # type: ignore[union-attr]
            self._pool = self._new_pool()
            raise UpstreamUnavailable("the parser process died while parsing this body "
                                      "(out of memory?); retry, or send a smaller "
                                      "request") from None
        finally:
            self._limiter.release()

    def warm_up(self) -> None:
        """Start the worker processes now (each imports the parser once), not on the
        first request."""
        if self._pool is not None:
            list(self._pool.map(int, range(self._n)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class ReadyCache(Generic[T]):
    """One answer of ``fetch`` (a value, or the :class:`~serve.errors.ServeError` it
    raised) serves every caller for ``ttl_s`` seconds; callers that come while it is
    fetched wait for that one fetch (never two at once).

    Args:
        fetch: the upstream call (the sidecar's ``GET /readyz``).
        ttl_s: how long an answer serves (s).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, fetch: Callable[[], Awaitable[T]], ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.ttl_s = ttl_s
        self._clock = clock
        self._at: float | None = None
        self._value: T | None = None
        self._error: ServeError | None = None
        self._lock = asyncio.Lock()
        #: The last value fetched without an error (None before the first).
        self.last_good: T | None = None
        self.fetches = 0

    def _fresh(self) -> bool:
        return self._at is not None and self._clock() - self._at < self.ttl_s

    async def get(self) -> T:
        """The cached answer, fetched first when older than ``ttl_s``; re-raises a cached
        error."""
        if not self._fresh():
            async with self._lock:
                if not self._fresh():
                    self.fetches += 1
                    try:
                        self._value, self._error = await self._fetch(), None
                        self.last_good = self._value
                    except ServeError as e:  # cached as the answer, re-raised to each caller
                        self._value, self._error = None, e
                    self._at = self._clock()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
