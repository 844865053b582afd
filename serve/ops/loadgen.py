"""A closed-loop background load for live-change checks: N clients, every answer counted.

Used by the serving-state tests and ``bench/bench_switch.py`` to prove that a live change
(batching, model version) fails no request: each client posts its body again as soon as
the previous answer arrives, and every answer is tallied by status and by the
``X-DLRM-Model-Version`` header that names the version which computed it.

Not a load test (that is locust, ``loadtest/``): no pacing, no latency goals, just a
count of what was served and what failed, and which versions served it, in order.

Example::

    with BackgroundLoad(url, [body], clients=8) as load:
        load.wait_for(100)            # requests answered so far
        ...change something live...
    assert load.failed == 0, load.failures[:3]
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import httpx

from serve.errors import UpstreamUnavailable

__all__ = ["VERSION_HEADER", "Answer", "BackgroundLoad"]

VERSION_HEADER = "X-DLRM-Model-Version"


@dataclass(frozen=True)
class Answer:
    """One answered request: when it finished (monotonic s), status, serving version,
    whether it was a good answer (200, and the expected predictions when checked), and
    which client sent it (0..clients-1; each client's answers are in the order sent)."""

    t: float
    status: int
    version: str | None
    ok: bool
    client: int = 0


@dataclass
class _Tally:
    answers: list[Answer] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


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
    """

    def __init__(self, url: str, bodies: Sequence[bytes], clients: int = 8,
                 content_type: str = "application/json", timeout_s: float = 120.0,
                 expect_predictions: int | None = None) -> None:
        if clients < 1 or not bodies:
            raise ValueError("BackgroundLoad needs clients >= 1 and at least one body")
        self.url, self.bodies, self.clients = url, list(bodies), clients
        self.content_type, self.timeout_s = content_type, timeout_s
        self.expect_predictions = expect_predictions
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
                try:
                    r = client.post(self.url, content=body)
                except httpx.HTTPError as e:
                    self._record(None, f"{type(e).__name__}: {e}")
                    continue
                failure = self._judge(r)
                self._record(Answer(time.monotonic(), r.status_code,
                                    r.headers.get(VERSION_HEADER), failure is None, k), failure)

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

    def _record(self, answer: Answer | None, failure: str | None) -> None:
        with self._lock:
            if answer is not None:
                self._tally.answers.append(answer)
            if failure is not None:
                self._tally.failures.append(failure)

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
