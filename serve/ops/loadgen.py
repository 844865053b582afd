"""A closed-loop background load for live-change checks: N clients, every answer counted.

Used by the serving-state tests and ``bench/bench_switch.py`` to prove that a live change
(batching, model version) fails no request: each client posts its body again as soon as
the previous answer arrives, and every answer is tallied by status and by the
``X-DLRM-Model-Version`` header that names the version which computed it.

Not a load test (that is locust, ``loadtest/``): no pacing, no latency goals, just a
count of what was served and what failed, and which versions served it, in order.
Every request also keeps when it started (``Answer.t0``), and :attr:`BackgroundLoad.outcomes`
lists every request, the unanswered ones too (status 0, ``error`` naming the transport
exception), for checks that judge each request by when it began (``serve.ops.faults``).

Example::

    with BackgroundLoad(url, [body], clients=8) as load:
        load.wait_for(100)            # requests answered so far
        ...change something live...
    assert load.failed == 0, load.failures[:3]
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import httpx

from serve.errors import UpstreamUnavailable

__all__ = ["VERSION_HEADER", "Answer", "BackgroundLoad", "PacedLoad", "pacing_schedule"]

VERSION_HEADER = "X-DLRM-Model-Version"


@dataclass(frozen=True)
class Answer:
    """One request: when it finished (monotonic s), status, serving version, whether it
    was a good answer (200, and the expected predictions when checked), and which client
    sent it (0..clients-1; each client's answers are in the order sent).

    ``t0`` is when it started (monotonic s; 0.0 when unknown). ``error`` is the transport
    exception's class name (``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``...)
    for a request that got no HTTP answer, which then has status 0; ``detail`` is the
    answer's body for a non-200 (at most 2000 characters) or the exception's message.
    """

    t: float
    status: int
    version: str | None
    ok: bool
    client: int = 0
    t0: float = 0.0
    error: str | None = None
    detail: str = ""


@dataclass
class _Tally:
    answers: list[Answer] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unanswered: list[Answer] = field(default_factory=list)  # status 0: no HTTP answer


class BackgroundLoad:
    """``clients`` threads posting ``bodies`` (round robin) to ``url`` until stopped.

    Args:
        url: the predict URL, e.g. ``http://127.0.0.1:8080/predictions/dlrm``.
        bodies: request bodies (bytes), sent in turn.
        clients: concurrent closed-loop clients (one keep-alive connection each).
        content_type: of every body.
        timeout_s: per request; a request slower than this counts as failed.
        expect_predictions: when set, a 200 whose JSON body does not hold exactly this many
            ``predictions`` counts as failed too (a wrong answer is a lost request).
        error_pause_s: seconds a client waits after a request that got no HTTP answer
            before its next one (0: none); keeps a stopped server's refused connections
            from spinning the clients.
        stop_on: statuses after which a client sends no more (a 503 "shutting down":
            a load balancer stops routing to a pod that is not ready).
    """

    def __init__(self, url: str, bodies: Sequence[bytes], clients: int = 8,
                 content_type: str = "application/json", timeout_s: float = 120.0,
                 expect_predictions: int | None = None, error_pause_s: float = 0.0,
                 stop_on: frozenset[int] = frozenset()) -> None:
        if clients < 1 or not bodies:
            raise ValueError("BackgroundLoad needs clients >= 1 and at least one body")
        if error_pause_s < 0:
            raise ValueError(f"error_pause_s {error_pause_s} must be >= 0")
        self.url, self.bodies, self.clients = url, list(bodies), clients
        self.content_type, self.timeout_s = content_type, timeout_s
        self.expect_predictions = expect_predictions
        self.error_pause_s = error_pause_s
        self.stop_on = stop_on
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._tally = _Tally()
        self._threads: list[threading.Thread] = []

    def _client(self, k: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        with httpx.Client(timeout=self.timeout_s, limits=limits, trust_env=False,
                          headers={"Content-Type": self.content_type}) as client:
            i = k
            while not self._stop.is_set():
                body = self.bodies[i % len(self.bodies)]
                i += self.clients
                status = self._send(client, k, body, time.monotonic())
                if status in self.stop_on:
                    return  # as a load balancer stops sending to a pod that refuses
                if status == 0 and self.error_pause_s:
                    self._stop.wait(self.error_pause_s)

    def _send(self, client: httpx.Client, k: int, body: bytes, t0: float) -> int:
        """Post ``body``, record the outcome; its HTTP status (0: no HTTP answer)."""
        try:
            r = client.post(self.url, content=body)
        except httpx.HTTPError as e:
            self._record(None, f"{type(e).__name__}: {e}",
                         Answer(time.monotonic(), 0, None, False, k, t0,
                                type(e).__name__, str(e)[:2000]))
            return 0
        failure = self._judge(r)
        detail = "" if r.status_code == 200 else r.text[:2000]
        self._record(Answer(time.monotonic(), r.status_code, r.headers.get(VERSION_HEADER),
                            failure is None, k, t0, None, detail), failure)
        return r.status_code

    def _judge(self, r: httpx.Response) -> str | None:
        """Why the answer counts as failed, or None when it is good."""
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:300]}"
        if self.expect_predictions is None:
            return None
        try:
            n = len(r.json()["predictions"])
        except (ValueError, KeyError, TypeError) as e:
            return f"malformed answer ({type(e).__name__}: {e}): {r.text[:200]}"
        if n != self.expect_predictions:
            return f"{n} predictions for {self.expect_predictions} instances"
        return None

    def _record(self, answer: Answer | None, failure: str | None,
                unanswered: Answer | None = None) -> None:
        with self._lock:
            if answer is not None:
                self._tally.answers.append(answer)
            if failure is not None:
                self._tally.failures.append(failure)
            if unanswered is not None:
                self._tally.unanswered.append(unanswered)

    def start(self) -> Self:
        for k in range(self.clients):
            t = threading.Thread(target=self._client, args=(k,), daemon=True,
                                 name=f"load-{k}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self._tally.answers)

    @property
    def outcomes(self) -> list[Answer]:
        """Every request sent, answered or not (status 0), in the order they started."""
        with self._lock:
            every = self._tally.answers + self._tally.unanswered
        return sorted(every, key=lambda a: a.t0)

    @property
    def failures(self) -> list[str]:
        with self._lock:
            return list(self._tally.failures)

    @property
    def served(self) -> int:
        """Requests answered well (200, and the expected predictions when checked)."""
        return sum(1 for a in self.answers if a.ok)

    @property
    def failed(self) -> int:
        """Requests answered with another status, or not answered at all."""
        return len(self.failures)

    def versions(self, since: float = 0.0) -> Counter[str | None]:
        """Good answers per serving version, for answers finished after ``since``."""
        return Counter(a.version for a in self.answers if a.ok and a.t >= since)

    def wait_for(self, n: int, timeout_s: float = 120.0) -> None:
        """Block until ``n`` requests have been answered well in all."""
        deadline = time.monotonic() + timeout_s
        while self.served < n:
            if time.monotonic() > deadline:
                raise UpstreamUnavailable(
                    f"only {self.served} of {n} requests answered within {timeout_s:.0f} s "
                    f"({self.failed} failed; first: {self.failures[:1]})")
            time.sleep(0.05)


def pacing_schedule(rate_rps: float, duration_s: float) -> list[float]:
    """When an open-loop load at ``rate_rps`` starts its requests within ``duration_s``:
    offsets in seconds from the start, ``i / rate_rps`` for every ``i`` below
    ``rate_rps * duration_s`` (evenly spaced, the first at 0).

    Raises:
        ValueError: ``rate_rps`` is not > 0, or ``duration_s`` is negative.
    """
    if not rate_rps > 0 or math.isinf(rate_rps):
        raise ValueError(f"rate {rate_rps} requests/s must be a finite number > 0")
    if not duration_s >= 0:
        raise ValueError(f"duration {duration_s} s must be >= 0")
    n = math.ceil(rate_rps * duration_s - 1e-9)
    return [i / rate_rps for i in range(max(0, n))]


class PacedLoad(BackgroundLoad):
    """An open-loop load: request ``i`` starts at ``start + i / rate_rps``, whatever the
    answers before it do (a closed loop slows down with the server and hides its stalls).

    ``senders`` threads (one keep-alive connection each) take the slots in turn; a slot
    whose sender is still busy starts late, and :attr:`lags` keeps each request's delay
    behind its slot (seconds), so a run can tell whether it held its rate. Everything of
    :class:`BackgroundLoad` (``answers``, ``outcomes``, ``served``, ``failed``...) applies.

    Args:
        url, bodies, content_type, timeout_s, expect_predictions: as BackgroundLoad.
        rate_rps: requests started per second.
        senders: threads; more than ``rate_rps`` x the slowest latency expected.
    """

    def __init__(self, url: str, bodies: Sequence[bytes], rate_rps: float, senders: int = 32,
                 content_type: str = "application/json", timeout_s: float = 60.0,
                 expect_predictions: int | None = None) -> None:
        pacing_schedule(rate_rps, 0.0)  # validates the rate
        super().__init__(url, bodies, clients=senders, content_type=content_type,
                         timeout_s=timeout_s, expect_predictions=expect_predictions)
        self.rate_rps = rate_rps
        self._next = 0
        self._slot_lock = threading.Lock()
        self._lags: list[float] = []
        self.started_at: float | None = None

    def start(self) -> Self:
        self.started_at = time.monotonic()
        return super().start()

    def _take_slot(self) -> tuple[int, float]:
        with self._slot_lock:
            i = self._next
            self._next += 1
        start = self.started_at if self.started_at is not None else time.monotonic()
        return i, start + i / self.rate_rps

    def _client(self, k: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        with httpx.Client(timeout=self.timeout_s, limits=limits, trust_env=False,
                          headers={"Content-Type": self.content_type}) as client:
            while not self._stop.is_set():
                i, slot = self._take_slot()
                wait = slot - time.monotonic()
                if wait > 0 and self._stop.wait(wait):
                    return
                body = self.bodies[i % len(self.bodies)]
                t0 = time.monotonic()
                with self._lock:
                    self._lags.append(max(0.0, t0 - slot))
                self._send(client, k, body, t0)

    @property
    def lags(self) -> list[float]:
        """Each started request's delay behind its slot (s), in the order they started."""
        with self._lock:
            return list(self._lags)

    @property
    def sent(self) -> int:
        """Requests started so far."""
        with self._lock:
            return len(self._lags)
