"""A small client of the sidecar's state API, for tools and tests that change what serves.

``GET /state``, ``PUT /state`` (bearer token) and waiting until ``converged``, against
the sidecar's write port (``--write-port``, 8091; the public port refuses writes): the one copy
used by ``bench/bench_switch.py``, the serving-state tests and the sidecar test fixtures.
:func:`tuner_paused` is the one way a measurement turns the batching tuner off for its
duration (``make capacity``, ``make faults``, ``make bench-switch``).

Example::

    client = StateClient("http://127.0.0.1:8091", token=Path(".run/sidecar-token").read_text())
    seconds = client.declare({"model": {"version": "small-int8-s7"},
                              "batching": {"batch_size": 2, "max_batch_delay_ms": 2},
                              "workers": 2, "rollout": None}, timeout_s=60)
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from serve.common.net import wait_until
from serve.errors import UpstreamUnavailable
from serve.settings import DLRM_SIDECAR_TOKEN

__all__ = ["StateClient", "describe_served", "served_state", "sidecar_token", "tuner_paused"]


def sidecar_token(token_file: str | os.PathLike[str] | None) -> str | None:
    """The sidecar's bearer token for a tool: ``DLRM_SIDECAR_TOKEN`` when set and not
    blank, else the contents of ``token_file`` when it exists (``make up`` writes
    ``.run/sidecar-token``), else None. Stripped."""
    env = DLRM_SIDECAR_TOKEN.get()
    if env is not None:
        return env
    if token_file is not None and Path(token_file).is_file():
        return Path(token_file).read_text().strip()
    return None


def served_state(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """What the sidecar at ``url`` declares served, for a measurement to print and record
    beside its figures: ``{"version", "batching", "workers", "converged",
    "tuner_enabled"}``, or ``{"error": ...}`` when it cannot be read (a measurement still
    runs; it says it could not tell)."""
    client = StateClient(url, timeout_s=timeout_s)
    try:
        st = client.state()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": f"GET {client.url}/state: {type(e).__name__}: {e}"}
    desired = st.get("desired") or {}
    return {"version": (desired.get("model") or {}).get("version"),
            "batching": desired.get("batching"), "workers": desired.get("workers"),
            "converged": st.get("converged"), "tuner_enabled": client.tuner_on()}


def describe_served(s: dict[str, Any]) -> str:
    """One line of :func:`served_state`'s result."""
    if "error" in s:
        return f"unknown ({s['error']})"
    b = s.get("batching") or {}
    on = s.get("tuner_enabled")
    tuner = "absent" if on is None else ("on" if on else "off")
    return (f"version {s.get('version')}, batching {b.get('batch_size')} / "
            f"{b.get('max_batch_delay_ms')} ms, {s.get('workers')} workers, tuner {tuner}"
            + ("" if s.get("converged") else " (not converged)"))


class StateClient:
    """The sidecar at ``url``; ``token`` is needed only for :meth:`put_state`."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.token = token.strip() if token else None
        self.timeout_s = timeout_s

    def state(self) -> dict[str, Any]:
        """``GET /state``'s body."""
        r = httpx.get(f"{self.url}/state", timeout=self.timeout_s)
        r.raise_for_status()
        return dict(r.json())

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def put_state(self, desired: dict[str, Any]) -> httpx.Response:
        """``PUT /state`` as is (the caller reads the status: 202, 400, 409...)."""
        return httpx.put(f"{self.url}/state", json=desired, headers=self._auth(), timeout=30)

    def tuner(self) -> dict[str, Any]:
        """``GET /tuner``'s body (UpstreamUnavailable: no tuner answers there)."""
        try:
            r = httpx.get(f"{self.url}/tuner", timeout=self.timeout_s)
            body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise UpstreamUnavailable(f"GET {self.url}/tuner: {e}") from None
        if r.status_code != 200 or not isinstance(body, dict):
            raise UpstreamUnavailable(f"GET {self.url}/tuner answered {r.status_code}: "
                                      f"{r.text[:300]}")
        return body

    def put_tuner(self, body: dict[str, Any]) -> httpx.Response:
        """``PUT /tuner`` as is (``{"enabled": ...}`` and/or ``{"p99_goal_ms": ...}``)."""
        return httpx.put(f"{self.url}/tuner", json=body, headers=self._auth(), timeout=30)

    def tuner_on(self) -> bool | None:
        """Whether the batching tuner is on; None when no tuner answers."""
        try:
            return self.tuner().get("enabled") is True
        except UpstreamUnavailable:
            return None

    def set_tuner(self, enabled: bool) -> None:
        """``PUT /tuner {"enabled": enabled}`` (UpstreamUnavailable unless it answers 200)."""
        r = self.put_tuner({"enabled": enabled})
        if r.status_code != 200:
            raise UpstreamUnavailable(f"PUT {self.url}/tuner {{'enabled': {enabled}}} "
                                      f"answered {r.status_code}: {r.text[:300]}")

    def wait_declared_batching(self, timeout_s: float = 60.0) -> None:
        """Wait until TorchServe serves the declared batching, converged (after the tuner
        is turned off, the reconciler switches a setting it chose back)."""
        def serving() -> bool:
            st = self.state()
            desired = st.get("desired") or {}
            want = {k: (desired.get("batching") or {}).get(k)
                    for k in ("batch_size", "max_batch_delay_ms")}
            return bool(st.get("converged")) and (st["observed"].get("batching") or {}) == want

        wait_until(serving, timeout_s=timeout_s, interval_s=0.25,
                   what=f"{self.url}/state serving the declared batching")

    def rollout_action(self, action: str) -> httpx.Response:
        """``POST /state/rollout/{promote|rollback}`` as is."""
        if action not in ("promote", "rollback"):
            raise ValueError(f"rollout action {action!r} must be 'promote' or 'rollback'")
        return httpx.post(f"{self.url}/state/rollout/{action}", headers=self._auth(),
                          timeout=30)

    def wait_rollout(self, *, phase: str | None = None, serving: bool | None = None,
                     converged: bool = False, timeout_s: float = 60.0) -> dict[str, Any]:
        """Poll ``GET /state`` until its ``rollout`` is in ``phase`` (and ``serving`` is
        as asked, and the state ``converged`` when asked); that body.

        Raises:
            UpstreamUnavailable: not within ``timeout_s``; the message holds the last body.
        """
        def reached() -> dict[str, Any] | None:
            body = self.state()
            r = body.get("rollout") or {}
            ok = (bool(r) and (phase is None or r.get("phase") == phase)
                  and (serving is None or r.get("serving") == serving)
                  and (not converged or body.get("converged")))
            return body if ok else None

        try:
            return wait_until(reached, timeout_s=timeout_s, interval_s=0.25,
                              what=f"{self.url}/state rollout {phase}")
        except UpstreamUnavailable:
            raise UpstreamUnavailable(
                f"rollout not {phase or ''} (serving={serving}, converged={converged}) within "
                f"{timeout_s:.0f} s: {json.dumps(self.state())}") from None

    def wait_converged(self, desired: dict[str, Any] | None = None, *,
                       timeout_s: float = 60.0) -> dict[str, Any]:
        """Poll ``GET /state`` until ``converged`` (on ``desired``, when given); that body.

        Raises:
            UpstreamUnavailable: not within ``timeout_s``; the message holds the last body.
        """
        def converged() -> dict[str, Any] | None:
            body = self.state()
            ok = body.get("converged") and (desired is None or body.get("desired") == desired)
            return body if ok else None

        try:
            return wait_until(converged, timeout_s=timeout_s, interval_s=0.25,
                              what=f"{self.url}/state converged")
        except UpstreamUnavailable:
            raise UpstreamUnavailable(
                f"not converged within {timeout_s:.0f} s: {json.dumps(self.state())}") from None

    def declare(self, desired: dict[str, Any], *, timeout_s: float = 60.0) -> float:
        """``PUT /state`` (must answer 202), then wait until it serves; seconds taken."""
        t0 = time.monotonic()
        r = self.put_state(desired)
        if r.status_code != 202:
            raise UpstreamUnavailable(f"PUT /state answered {r.status_code}: {r.text}")
        self.wait_converged(desired, timeout_s=max(0.0, timeout_s - (time.monotonic() - t0)))
        return time.monotonic() - t0


@contextlib.contextmanager
def tuner_paused(client: StateClient, settle: Callable[[], None]) -> Iterator[bool | None]:
    """Turn the batching tuner off for the block when it is on, and on again after.

    ``settle`` runs once it is off (waiting until the declared batching serves again).
    Yields whether it was on (None: no tuner answers; then nothing is changed)."""
    was_on = client.tuner_on()
    if not was_on:
        yield was_on
        return
    client.set_tuner(False)
    try:
        settle()
        yield True
    finally:
        client.set_tuner(True)
