"""The batching tuner against the best static batching, on three traffics (wrk load).

    make up && make bench-autotune        # ~15 minutes
    python -m bench.bench_autotune [--traffics single,ranking,mixed] [--quick] [--static-only]

Against the service `make up` started (TorchServe on :8080, the sidecar's writes on
:8091; its token in ``.run/sidecar-token``), with wrk (``make wrk``) posting row-form JSON
bodies through ``bench/wrk/post.lua``, it measures three traffics:

* ``single``: 1-instance requests (``--single-bodies`` distinct, seeded) over
  ``--single-connections`` (64) connections;
* ``ranking``: requests of ``--ranking-instances`` (100-700, uniform, seeded;
  ``--ranking-bodies`` of them) over ``--ranking-connections`` (3) connections (at 4,
  no static setting held p99 <= 60 ms in one run);
* ``mixed``: single traffic for ``--mixed-first-s`` (90) s, then ranking, wrk run after
  wrk run with the tuner left running across the change.

For single and ranking:

1. static sweep: the tuner off (``PUT /tuner {"enabled": false}``), then for each setting
   (``--single-settings``, ``--ranking-settings``: "B/D,B/D", batch size / max batch
   delay in ms) ``PUT /batching``, a ``--warmup-s`` run, then a ``--measure-s`` run. The
   best static setting is the one with the most samples/s among those whose p99 meets
   ``--p99-goal-ms``; when none does, the one with the lowest p99 (marked).
2. tuned: ``PUT /batching`` back to the shipped default 2/2 (which also turns the tuner
   off), ``PUT /tuner {"enabled": true}``, then the traffic runs while ``GET /tuner`` is
   polled until the tuner has settled (its phase is ``settled`` after a decision, or no
   decision for ``--quiet-s``), then a ``--measure-s`` run is the tuned figure. Right
   after it, the sweep's best static setting is pinned and measured again: that figure
   is ``best_static_samples_per_s`` and the ratio's denominator (the sweep's is kept as
   ``best_static_sweep_samples_per_s``), because the same setting measured minutes apart
   moved by up to 25% on this machine. For single, static 32/5 is measured right before
   the tuner is turned on and again after the tuned figures, and the ``--measure-s`` run
   that starts ``--single-probe-at-s`` (60) s into the tuner-on traffic is compared with
   the mean of the two (``at_60s_samples_per_s``, ``static_32_5_samples_per_s``, its
   ``_before_``/``_after_`` parts, ``ratio_vs_32_5``).

For mixed, the tuner starts from 2/2 as above; ``settle_s`` counts from the switch to
ranking, and the tuned figure is a ranking run after it settled, compared with ranking's
best static (the traffic it ends in).

``settle_s`` is measured on this side, polling ``GET /tuner`` every ``--poll-s``: the
time it first showed the tuner's last change of setting applied (serving, nothing
pending), minus the time the tuner was turned on, just before the traffic started (for
mixed: minus the switch to ranking); 0 when the tuner changed nothing. A tuned measured
run during which the tuner decided anything is run again once it settles. ``failed`` counts
non-2xx answers and socket errors (connect, read, write, timeout) of every wrk run of the
tuned phase (for mixed: all of it, both traffics).

Samples/s = requests/s x mean instances of the requests sent (post.lua counts them; see
its header). Latencies are wrk's, per request, in ms.

Prints progress to stderr, tables to stdout; writes ``bench/results/autotune.json``; puts
the batching (and the tuner) back as they were at the start. Exit code 1 if any request
failed, 2 if the service or an argument is not as needed (e.g. the sidecar has no
``/tuner``: ``--static-only`` runs the sweeps alone), 3 on a local error (wrk missing).
``--quick`` is a smoke run: short runs, two settings per sweep; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from serve.api.json_body import example_request
from serve.constants import DEFAULT_SIDECAR_WRITE_PORT, DEFAULT_TOKEN_FILE, P99_SLO_MS
from serve.errors import ConfigError, ServeError, UpstreamUnavailable
from serve.ops.machine import machine_info

__all__ = ["Setting", "WrkResult", "best_static", "main", "parse_settings"]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "autotune.json"
POST_LUA = REPO / "bench" / "wrk" / "post.lua"
TRAFFICS = ("single", "ranking", "mixed")
# The issue compares the tuner on single traffic against this static setting.
REFERENCE_SINGLE = "32/5"


_T0 = time.monotonic()


def _log(msg: str) -> None:
    """A progress line on stderr, stamped with seconds since start (the run takes ~15 min)."""
    print(f"[{time.monotonic() - _T0:6.0f} s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, order=True)
class Setting:
    """One TorchServe batching setting: batch size (requests) and max batch delay (ms)."""

    batch_size: int
    max_batch_delay_ms: int

    def __str__(self) -> str:
        return f"{self.batch_size}/{self.max_batch_delay_ms}"

    def to_json(self) -> dict[str, int]:
        return {"batch_size": self.batch_size, "max_batch_delay_ms": self.max_batch_delay_ms}

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``"B/D"`` -> Setting(B, D)."""
        parts = text.strip().split("/")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"setting {text!r} must be BATCH/DELAY_MS, e.g. 32/5")
        b, d = (int(p) for p in parts)
        if b < 1:
            raise ConfigError(f"setting {text!r}: batch size {b} must be >= 1")
        return cls(b, d)

    @classmethod
    def from_json(cls, d: Any) -> Setting | None:
        """``{"batch_size": B, "max_batch_delay_ms": D}`` -> Setting; None for null."""
        if d is None:
            return None
        if not (isinstance(d, dict) and isinstance(d.get("batch_size"), int)
                and isinstance(d.get("max_batch_delay_ms"), int)):
            raise UpstreamUnavailable(f"not a batching setting: {json.dumps(d)}")
        return cls(d["batch_size"], d["max_batch_delay_ms"])


def parse_settings(text: str) -> list[Setting]:
    """``"8/2,16/5"`` -> [Setting(8, 2), Setting(16, 5)] (duplicates dropped, order kept)."""
    out: list[Setting] = []
    for part in text.split(","):
        if part.strip():
            s = Setting.parse(part)
            if s not in out:
                out.append(s)
    if not out:
        raise ConfigError(f"no settings in {text!r}; give e.g. 8/2,32/5")
    return out


DEFAULT_SETTING = Setting(2, 2)  # the shipped default the tuned runs start from
# Sweeps: the full run's and --quick's (two each, 32/5 kept for the single comparison).
DEFAULTS = {"single": "8/2,16/5,24/2,24/5,32/2,32/5,48/5", "ranking": "1/0,2/2,4/2,8/5"}
QUICK = {"single": "8/2,32/5", "ranking": "1/0,4/2"}
# Durations (s): the full run's and --quick's, for the flags left unset. The quiet time
# stays 30 s in --quick: the tuner needs about two 10 s windows before its first decision.
DURATIONS = {"warmup_s": (5.0, 2.0), "measure_s": (15.0, 5.0), "quiet_s": (30.0, 30.0),
             "settle_timeout_s": (300.0, 60.0), "single_probe_at_s": (60.0, 15.0),
             "mixed_first_s": (90.0, 20.0)}


# --------------------------------------------------------------------------- wrk


@dataclass(frozen=True)
class Traffic:
    """A load shape: the bodies wrk cycles through and its connections."""

    name: str
    connections: int
    bodies_dir: Path
    bodies: int
    mean_instances: float


@dataclass(frozen=True)
class WrkResult:
    """One wrk run's summary (post.lua's JSON line). Durations in s, latencies in ms."""

    traffic: str
    requests: int
    duration_s: float
    errors: int
    non2xx: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    requests_sent: int
    instances_sent: int

    @property
    def failed(self) -> int:
        """Non-2xx answers plus socket errors (connect, read, write, timeout)."""
        return self.errors + self.non2xx

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        # Completed requests x the mean instances of what was sent: post.lua cannot tell
        # which request an answer belongs to, and the two differ by the requests in flight.
        if self.requests_sent == 0:
            return 0.0
        return self.requests_per_s * self.instances_sent / self.requests_sent

    def to_json(self) -> dict[str, Any]:
        return {"samples_per_s": round(self.samples_per_s, 1),
                "requests_per_s": round(self.requests_per_s, 1),
                "p50_ms": round(self.p50_ms, 2), "p90_ms": round(self.p90_ms, 2),
                "p99_ms": round(self.p99_ms, 2), "max_ms": round(self.max_ms, 2),
                "requests": self.requests, "duration_s": round(self.duration_s, 2),
                "errors": self.errors, "non2xx": self.non2xx, "failed": self.failed}


class WrkRun:
    """A wrk process in flight; :meth:`stop` ends it early (SIGINT: wrk still reports)."""

    def __init__(self, traffic: Traffic, cmd: list[str]) -> None:
        self.traffic = traffic
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self.running():
            self.proc.kill()
            self.proc.wait()

    def result(self, timeout_s: float) -> WrkResult:
        """Wait for wrk's end and parse post.lua's line (UpstreamUnavailable: none)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise UpstreamUnavailable(f"wrk did not end within {timeout_s:.0f} s: "
                                      f"{' '.join(self.cmd)}") from None
        line = next((ln for ln in out.splitlines() if ln.startswith("JSON ")), None)
        if line is None:
            raise UpstreamUnavailable(f"wrk exited with {self.proc.returncode} and no summary "
                                      f"({' '.join(self.cmd)}): {out.strip()[-800:]}")
        d = json.loads(line[5:])
        return WrkResult(
            traffic=self.traffic.name, requests=int(d["requests"]),
            duration_s=d["duration_us"] / 1e6, errors=int(d["errors"]),
            non2xx=int(d["non2xx"]), p50_ms=d["p50_us"] / 1e3, p90_ms=d["p90_us"] / 1e3,
            p99_ms=d["p99_us"] / 1e3, max_ms=d["max_us"] / 1e3,
            requests_sent=int(d["requests_sent"]), instances_sent=int(d["instances_sent"]))


@dataclass(frozen=True)
class Wrk:
    """How wrk is run: the URL, its threads and its per-request timeout (s)."""

    url: str
    threads: int
    timeout_s: float

    def start(self, traffic: Traffic, duration_s: float) -> WrkRun:
        threads = max(1, min(self.threads, traffic.connections))
        cmd = ["wrk", f"-t{threads}", f"-c{traffic.connections}",
               f"-d{max(1, math.ceil(duration_s))}s", f"--timeout={self.timeout_s:g}s",
               "-s", str(POST_LUA), self.url, "--", str(traffic.bodies_dir), str(threads)]
        return WrkRun(traffic, cmd)

    def run(self, traffic: Traffic, duration_s: float,
            tick: Callable[[], bool] | None = None, poll_s: float = 0.5) -> WrkResult:
        """Run ``traffic`` for up to ``duration_s``; ``tick`` is called every ``poll_s``
        meanwhile and ends the run early by returning True."""
        run = self.start(traffic, duration_s)
        try:
            while run.running():
                if tick is not None and tick():
                    run.stop()
                    break
                time.sleep(poll_s)
            return run.result(timeout_s=30.0)
        finally:
            run.kill()


def write_bodies(root: Path, name: str, sizes: Sequence[int], seed: int,
                 connections: int) -> Traffic:
    """Row-form JSON bodies of ``sizes`` instances in ``root/name`` + the list post.lua reads."""
    d = root / name
    d.mkdir(parents=True)
    lines = []
    for i, n in enumerate(sizes):
        path = d / f"{i:04d}.json"
        path.write_bytes(orjson.dumps(example_request(n, seed=seed + i)))
        lines.append(f"{path.name} {n}\n")
    (d / "index.txt").write_text("".join(lines))
    return Traffic(name=name, connections=connections, bodies_dir=d, bodies=len(sizes),
                   mean_instances=sum(sizes) / len(sizes))


# --------------------------------------------------------------------------- sidecar


# GET /tuner: 404 from a build without the route, 409 from a sidecar without a tuner.
NO_TUNER = (404, 409)


class Sidecar:
    """The sidecar's batching and tuner API (writes need the bearer token)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=30.0,
                                 headers={"Authorization": f"Bearer {token}"})

    def _json(self, r: httpx.Response, what: str) -> dict[str, Any]:
        if what == "GET /tuner" and r.status_code in NO_TUNER:
            raise UpstreamUnavailable(
                f"this sidecar has no /tuner: {what} answered {r.status_code} "
                f"({r.text[:200]}); a build without the batching tuner, or one started "
                "without it. --static-only runs the static sweeps alone")
        if r.status_code in (401, 403):
            raise UpstreamUnavailable(f"{what} answered {r.status_code}: the token "
                                      f"(--token-file) is not the sidecar's: {r.text[:200]}")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"{what} answered {r.status_code}: {r.text[:500]}")
        body = r.json()
        if not isinstance(body, dict):
            raise UpstreamUnavailable(f"{what} answered a non-object: {r.text[:500]}")
        return body

    def batching(self, which: str = "observed") -> Setting:
        """What TorchServe serves now (GET /state observed.batching), or with ``which``
        "desired", the declared batching."""
        st = self._json(self.http.get("/state"), "GET /state")
        s = Setting.from_json((st.get(which) or {}).get("batching"))
        if s is None:
            raise UpstreamUnavailable(f"GET /state: no {which} batching: "
                                      f"{json.dumps(st)[:500]}")
        return s

    def put_batching(self, s: Setting, timeout_s: float = 300.0) -> float:
        """PUT /batching ``s`` and wait until it serves (a 409 -- another change running,
        the tuner's or someone's -- is retried until ``timeout_s``); seconds taken."""
        t0 = time.monotonic()
        while True:
            r = self.http.put("/batching", json=s.to_json(), timeout=timeout_s)
            if r.status_code != 409 or time.monotonic() - t0 > timeout_s:
                break
            time.sleep(1.0)
        body = self._json(r, f"PUT /batching {s}")
        got = Setting.from_json(body)
        if got != s:
            raise UpstreamUnavailable(f"PUT /batching {s} answered {got}: {json.dumps(body)}")
        return time.monotonic() - t0

    def has_tuner(self) -> bool:
        """Whether the sidecar has a tuner (GET /tuner is neither 404 nor 409)."""
        return self.http.get("/tuner").status_code not in NO_TUNER

    def tuner(self) -> dict[str, Any]:
        return self._checked_tuner(self.http.get("/tuner"), "GET /tuner")

    def put_tuner(self, enabled: bool) -> dict[str, Any]:
        return self._checked_tuner(self.http.put("/tuner", json={"enabled": enabled}),
                                   f"PUT /tuner enabled={str(enabled).lower()}")

    def _checked_tuner(self, r: httpx.Response, what: str) -> dict[str, Any]:
        body = self._json(r, what)
        if not (isinstance(body.get("enabled"), bool) and isinstance(body.get("phase"), str)
                and isinstance(body.get("decisions"), list)):
            raise UpstreamUnavailable(f"{what}: not a tuner status (enabled, phase, "
                                      f"decisions): {json.dumps(body)[:500]}")
        return body


# --------------------------------------------------------------------------- the tuner


@dataclass
class Decision:
    """A tuner decision as seen here. ``seen_s``: when GET /tuner first listed it (the
    tuner lists a decision when it makes it, before the switch); ``applied_s``: when GET
    /tuner first showed its setting serving with nothing pending (None: not seen, e.g. a
    later decision overtook it). Both on this side's monotonic clock; ``at_s`` is the
    sidecar's, kept for the record (only its differences mean anything here)."""

    seen_s: float
    at_s: float
    from_: Setting | None
    to: Setting
    reason: str
    applied_s: float | None = None

    @property
    def changed(self) -> bool:
        """True for a change of setting (not a failed switch's "keep what serves")."""
        return self.from_ is not None and self.from_ != self.to

    @property
    def done_s(self) -> float:
        """When it took effect, as far as seen: applied, else listed."""
        return self.applied_s if self.applied_s is not None else self.seen_s

    def to_json(self, ref_s: float) -> dict[str, Any]:
        return {"seen_s": round(self.seen_s - ref_s, 2),
                "applied_s": round(self.applied_s - ref_s, 2)
                if self.applied_s is not None else None,
                "at_s": self.at_s, "from": str(self.from_) if self.from_ else None,
                "to": str(self.to), "reason": self.reason}


# Tuner phases in which it is mid-search: never "settled", however long since a decision.
BUSY = ("switching", "trying", "paused")


class TunerWatch:
    """Polls GET /tuner and keeps the decisions that were not there when it was created.

    A decision is known by (at_s, from, to, reason): the list may be capped by the
    sidecar, and a restarted tuner may keep older entries.
    """

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.body = sidecar.tuner()
        self._known = {self._key(d) for d in self.body["decisions"]}
        self.decisions: list[Decision] = []

    @staticmethod
    def _key(d: Any) -> str:
        return json.dumps(d, sort_keys=True)

    def take(self, body: dict[str, Any]) -> dict[str, Any]:
        """Record ``body``'s new decisions (seen now); ``body``."""
        now = time.monotonic()
        for d in body["decisions"]:
            key = self._key(d)
            if key in self._known:
                continue
            self._known.add(key)
            to = Setting.from_json(d.get("to"))
            if to is None:
                raise UpstreamUnavailable(f"GET /tuner: a decision without 'to': {key}")
            dec = Decision(seen_s=now, at_s=float(d.get("at_s", math.nan)),
                           from_=Setting.from_json(d.get("from")), to=to,
                           reason=str(d.get("reason", "")))
            self.decisions.append(dec)
            _log(f"  tuner: {dec.from_} -> {dec.to} ({dec.reason}); phase {body['phase']}")
        serving = Setting.from_json(body.get("serving"))
        if body.get("pending") is None and serving is not None:
            for dec in self.decisions:
                if dec.changed and dec.applied_s is None and dec.to == serving:
                    dec.applied_s = now
        self.body = body
        return body

    def poll(self) -> dict[str, Any]:
        return self.take(self.sidecar.tuner())

    def since(self, t: float) -> list[Decision]:
        return [d for d in self.decisions if d.seen_s >= t]

    def settled(self, ref_s: float, quiet_s: float, instances: float) -> bool:
        """Settled since ``ref_s``: phase ``settled`` after a decision seen since then, or
        no decision for ``quiet_s`` -- but never while a switch or a search runs (a
        switching/trying/paused phase, a pending setting, settings queued to try), nor
        before the tuner's serving setting was chosen for this traffic (its
        ``searched_for`` window holds about ``instances`` per request: within 1.5x)."""
        phase = self.body.get("phase")
        if phase in BUSY or self.body.get("pending") is not None or self.body.get("queue"):
            return False
        shape = self.body.get("searched_for") or {}
        m = shape.get("instances_per_request")
        if not isinstance(m, (int, float)) or not (
                instances / 1.5 <= max(float(m), 1e-9) <= instances * 1.5):
            return False
        recent = self.since(ref_s)
        if phase == "settled" and recent:
            return True
        last = recent[-1].done_s if recent else ref_s
        return time.monotonic() - last >= quiet_s

    def settle_s(self, ref_s: float) -> float:
        """Seconds from ``ref_s`` to when the last change since then was applied (0:
        none; a change never seen applied counts from when it was listed)."""
        changes = [d for d in self.since(ref_s) if d.changed]
        return round(max(0.0, changes[-1].done_s - ref_s), 1) if changes else 0.0

    def setting(self) -> Setting | None:
        """What serves by the tuner's account (its ``serving``; else its ``setting``)."""
        return (Setting.from_json(self.body.get("serving"))
                or Setting.from_json(self.body.get("setting")))


# --------------------------------------------------------------------------- measuring


@dataclass
class Config:
    """What one bench run does; durations in s, latencies in ms."""

    traffics: list[str]
    static_only: bool
    settings: dict[str, list[Setting]]
    connections: dict[str, int]
    warmup_s: float
    measure_s: float
    quiet_s: float
    settle_timeout_s: float
    single_probe_at_s: float
    mixed_first_s: float
    p99_goal_ms: float
    poll_s: float
    quick: bool
    notes: list[str] = field(default_factory=list)


def best_static(rows: Sequence[dict[str, Any]], p99_goal_ms: float) -> dict[str, Any]:
    """The sweep row with the most samples/s among those with p99 <= goal (``meets_goal``
    true); when none meets it, the one with the lowest p99 (``meets_goal`` false)."""
    if not rows:
        raise ConfigError("an empty sweep has no best setting")
    ok = [r for r in rows if r["p99_ms"] <= p99_goal_ms]
    if ok:
        return {**max(ok, key=lambda r: r["samples_per_s"]), "meets_goal": True}
    return {**min(rows, key=lambda r: r["p99_ms"]), "meets_goal": False}


class Bench:
    """One run against the service: sweeps, tuned runs, the document."""

    def __init__(self, cfg: Config, sidecar: Sidecar, wrk: Wrk,
                 traffic: dict[str, Traffic], has_tuner: bool) -> None:
        self.cfg = cfg
        self.has_tuner = has_tuner
        self.sidecar = sidecar
        self.wrk = wrk
        self.traffic = traffic
        self.sweeps: dict[str, list[dict[str, Any]]] = {}
        self.best: dict[str, dict[str, Any]] = {}

    def sweep(self, name: str) -> list[dict[str, Any]]:
        """The static sweep of traffic ``name``: one row per setting."""
        t = self.traffic[name]
        if self.has_tuner:
            # PUT /batching would turn it off too; off first, so that it cannot move the
            # setting between here and the first PUT. (--static-only may run on a sidecar
            # without a tuner: nothing else moves the setting there.)
            self.sidecar.put_tuner(False)
        rows = []
        for s in self.cfg.settings[name]:
            _log(f"{name}: static {s}: PUT /batching")
            switch_s = self.sidecar.put_batching(s)
            warm = self.wrk.run(t, self.cfg.warmup_s)
            m = self.wrk.run(t, self.cfg.measure_s)
            after = self.sidecar.batching()
            row = {"setting": str(s), **m.to_json(), "failed": warm.failed + m.failed,
                   "warmup_failed": warm.failed, "switch_s": round(switch_s, 2),
                   "served_after": str(after)}
            if after != s:
                # Someone (another bench, the tuner) changed it during the run.
                row["disturbed"] = True
                _log(f"WARNING {name} {s}: {after} served at the end of the run")
            _log(f"{name}: static {s}: {m.samples_per_s:.0f} samples/s, p99 "
                 f"{m.p99_ms:.1f} ms, failed {row['failed']}")
            rows.append(row)
        self.sweeps[name] = rows
        self.best[name] = best_static(rows, self.cfg.p99_goal_ms)
        _print_sweep(name, rows, self.best[name], self.cfg.p99_goal_ms)
        return rows

    def _start_tuner(self) -> tuple[TunerWatch, float]:
        """2/2 (tuner off), then the tuner on; its watch and the time it was enabled (the
        traffic starts right after: that is the start of the settle time)."""
        self.sidecar.put_batching(DEFAULT_SETTING)
        watch = TunerWatch(self.sidecar)
        t0 = time.monotonic()
        watch.take(self.sidecar.put_tuner(True))
        return watch, t0

    def _run(self, name: str, seconds: float, watch: TunerWatch, runs: list[WrkResult],
             until: Callable[[], bool] | None = None) -> WrkResult:
        """A wrk run of traffic ``name`` polling the tuner; ends early when ``until``."""
        def tick() -> bool:
            watch.poll()
            return until is not None and until()

        r = self.wrk.run(self.traffic[name], seconds, tick, self.cfg.poll_s)
        watch.poll()
        runs.append(r)
        return r

    def _until_settled(self, name: str, watch: TunerWatch, ref_s: float,
                       runs: list[WrkResult]) -> bool:
        """Run ``name`` until the tuner settled since ``ref_s``; False: timed out."""
        instances = self.traffic[name].mean_instances
        if watch.settled(ref_s, self.cfg.quiet_s, instances):
            return True
        left = self.cfg.settle_timeout_s - (time.monotonic() - ref_s)
        if left > 0:
            _log(f"{name}: waiting for the tuner to settle (up to {left:.0f} s more)")
            self._run(name, left, watch, runs,
                      until=lambda: watch.settled(ref_s, self.cfg.quiet_s, instances))
        ok = watch.settled(ref_s, self.cfg.quiet_s, instances)
        if not ok:
            _log(f"WARNING {name}: the tuner did not settle within "
                 f"{self.cfg.settle_timeout_s:.0f} s (phase {watch.body.get('phase')})")
        return ok

    def _settle_and_measure(self, name: str, watch: TunerWatch, ref_s: float,
                            runs: list[WrkResult]) -> tuple[WrkResult, bool, float]:
        """Run ``name`` until the tuner settled, then a measured run; again while the
        tuner decided something during it (a "settled" judged too early: the quiet rule
        can fire while the tuner confirms a new traffic), within the settle timeout.
        The measured run, whether it settled, and when the measured run started."""
        while True:
            settled = self._until_settled(name, watch, ref_s, runs)
            start = time.monotonic()
            m = self._run(name, self.cfg.measure_s, watch, runs)
            if (not watch.since(start) or not settled
                    or time.monotonic() - ref_s > self.cfg.settle_timeout_s):
                return m, settled, start
            _log(f"{name}: the tuner decided during the measured run; measuring again once "
                 "it settles")

    def static_run(self, name: str, setting: Setting) -> WrkResult:
        """``setting`` pinned (PUT /batching: the tuner goes off), a warm-up, a measured
        run of traffic ``name``."""
        self.sidecar.put_batching(setting)
        self.wrk.run(self.traffic[name], self.cfg.warmup_s)
        return self.wrk.run(self.traffic[name], self.cfg.measure_s)

    def adjacent(self, best_of: str) -> dict[str, Any]:
        """The best static setting of ``best_of`` measured again right after a tuned run:
        the same setting measured minutes apart moved by up to 16% on this machine, so
        the ratio compares figures taken back to back."""
        best = self.best[best_of]
        m = self.static_run(best_of, Setting.parse(best["setting"]))
        _log(f"{best_of}: best static {best['setting']} again, right after: "
             f"{m.samples_per_s:.0f} samples/s, p99 {m.p99_ms:.1f} ms (sweep: "
             f"{best['samples_per_s']:.0f})")
        return {**best, "samples_per_s": round(m.samples_per_s, 1),
                "p99_ms": round(m.p99_ms, 2), "sweep_samples_per_s": best["samples_per_s"],
                "failed": m.failed}

    def _row(self, traffic: str, best_of: str, m: WrkResult, watch: TunerWatch,
             ref_s: float, runs: list[WrkResult], settled: bool,
             measure_start: float) -> dict[str, Any]:
        best = self.adjacent(best_of)
        tuned = watch.setting()
        try:
            served = str(self.sidecar.batching())
        except ServeError as e:
            served = f"unknown: {e.message}"
        return {
            "traffic": traffic,
            "tuned_samples_per_s": round(m.samples_per_s, 1),
            "tuned_p99_ms": round(m.p99_ms, 2),
            "best_static": best["setting"],
            "best_static_samples_per_s": best["samples_per_s"],
            "ratio": round(m.samples_per_s / best["samples_per_s"], 3)
            if best["samples_per_s"] else None,
            "settle_s": watch.settle_s(ref_s),
            "failed": sum(r.failed for r in runs) + best["failed"],
            "best_static_sweep_samples_per_s": best["sweep_samples_per_s"],
            "tuned_setting": str(tuned) if tuned else None,
            "served_after": served,
            "best_static_meets_goal": best["meets_goal"],
            "best_static_p99_ms": best["p99_ms"],
            "settled": settled,
            "tuner_phase": watch.body.get("phase"),
            "changes": sum(d.changed for d in watch.since(ref_s)),
            "decisions_during_measure": len(watch.since(measure_start)),
            "tuned": m.to_json(),
            "traffic_s": round(sum(r.duration_s for r in runs), 1),
            "decisions": [d.to_json(ref_s) for d in watch.decisions],
        }

    def tuned(self, name: str) -> dict[str, Any]:
        """The tuner from 2/2 on traffic ``name`` until settled, then a measured run."""
        ref_run = None
        if name == "single":
            # The reference, measured right before the tuner's run (not minutes
            # earlier in the sweep): static 32/5 on the same traffic.
            ref_run = self.static_run(name, Setting.parse(REFERENCE_SINGLE))
            _log(f"single: static {REFERENCE_SINGLE} right before: "
                 f"{ref_run.samples_per_s:.0f} samples/s")
        _log(f"{name}: tuner on from {DEFAULT_SETTING}")
        watch, t0 = self._start_tuner()
        runs: list[WrkResult] = []
        if ref_run is not None:
            # The check: the figure after the tuner has seen probe_at_s of traffic.
            self._run(name, self.cfg.single_probe_at_s, watch, runs)
            probe = self._run(name, self.cfg.measure_s, watch, runs)
            _log(f"single: after {self.cfg.single_probe_at_s:.0f} s: "
                 f"{probe.samples_per_s:.0f} samples/s vs static {REFERENCE_SINGLE} "
                 f"{ref_run.samples_per_s:.0f} before")
        m, settled, measure_start = self._settle_and_measure(name, watch, t0, runs)
        row = self._row(name, name, m, watch, t0, runs, settled, measure_start)
        if ref_run is not None:
            # ...and again after (A-B-A): this machine's speed wanders by 25% within
            # minutes, so the reference is the mean of the two around the probe.
            after = self.static_run(name, Setting.parse(REFERENCE_SINGLE))
            ref = round((ref_run.samples_per_s + after.samples_per_s) / 2, 1)
            row.update({"at_60s_samples_per_s": round(probe.samples_per_s, 1),
                        "at_60s_p99_ms": round(probe.p99_ms, 2),
                        "at_60s_probe_start_s": self.cfg.single_probe_at_s,
                        "static_32_5_samples_per_s": ref,
                        "static_32_5_before_samples_per_s": round(ref_run.samples_per_s, 1),
                        "static_32_5_after_samples_per_s": round(after.samples_per_s, 1),
                        "static_32_5_p99_ms": round(max(ref_run.p99_ms, after.p99_ms), 2),
                        "ratio_vs_32_5": round(probe.samples_per_s / ref, 3) if ref else None})
            _log(f"single: static {REFERENCE_SINGLE} again, after: {after.samples_per_s:.0f} "
                 f"samples/s; reference (mean) {ref:.0f}")
        _log(f"{name}: tuned {row['tuned_setting']}: {m.samples_per_s:.0f} samples/s, p99 "
             f"{m.p99_ms:.1f} ms, settle {row['settle_s']} s, failed {row['failed']}")
        return row

    def mixed(self) -> dict[str, Any]:
        """Tuner on from 2/2: single, then ranking (settle counted from the switch)."""
        _log(f"mixed: tuner on from {DEFAULT_SETTING}; single for {self.cfg.mixed_first_s:.0f} s")
        watch, t0 = self._start_tuner()
        runs: list[WrkResult] = []
        self._run("single", self.cfg.mixed_first_s, watch, runs)
        first = watch.setting()
        switch = time.monotonic()  # just after a poll: later decisions are ranking's
        _log(f"mixed: switch to ranking (tuner at {first})")
        m, settled, measure_start = self._settle_and_measure("ranking", watch, switch, runs)
        row = self._row("mixed", "ranking", m, watch, switch, runs, settled, measure_start)
        row.update({"setting_at_switch": str(first) if first else None,
                    "single_phase_s": round(runs[0].duration_s, 1),
                    "single_phase": runs[0].to_json(),
                    "decisions_single_phase": sum(
                        1 for d in watch.decisions if t0 <= d.seen_s < switch)})
        _log(f"mixed: tuned {row['tuned_setting']}: {m.samples_per_s:.0f} samples/s, p99 "
             f"{m.p99_ms:.1f} ms, settle {row['settle_s']} s after the switch, "
             f"failed {row['failed']}")
        return row


# --------------------------------------------------------------------------- output


def _print_sweep(name: str, rows: Sequence[dict[str, Any]], best: dict[str, Any],
                 goal_ms: float) -> None:
    rule = ("best = most samples/s within it" if best["meets_goal"]
            else "none meets it: best = lowest p99")
    print(f"\n{name}: static sweep (p99 goal {goal_ms:g} ms; {rule})")
    print("| setting | samples/s | req/s | p50 ms | p99 ms | failed | |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mark = []
        if r["setting"] == best["setting"]:
            mark.append("best" if best["meets_goal"] else "best (misses the p99 goal)")
        if r["p99_ms"] > goal_ms:
            mark.append("p99 over goal")
        if r.get("disturbed"):
            mark.append(f"DISTURBED: {r['served_after']} at the end")
        print(f"| {r['setting']} | {r['samples_per_s']:.0f} | {r['requests_per_s']:.0f} "
              f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['failed']} | {', '.join(mark)} |")
    sys.stdout.flush()


def _print_rows(rows: Sequence[dict[str, Any]]) -> None:
    print("\n| traffic | tuned samples/s | tuned p99 ms | tuned setting | best static "
          "| best static samples/s | ratio | settle s | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = r["best_static"] + ("" if r["best_static_meets_goal"] else " (p99 > goal)")
        settled = "" if r["settled"] else " (not settled)"
        print(f"| {r['traffic']} | {r['tuned_samples_per_s']:.0f} | {r['tuned_p99_ms']:.1f} "
              f"| {r['tuned_setting']} | {best} | {r['best_static_samples_per_s']:.0f} "
              f"| {r['ratio']} | {r['settle_s']}{settled} | {r['failed']} |")
    for r in rows:
        if "ratio_vs_32_5" in r:
            print(f"\nsingle after {r['at_60s_probe_start_s']:g} s of tuner-on traffic: "
                  f"{r['at_60s_samples_per_s']:.0f} samples/s (p99 {r['at_60s_p99_ms']:.1f} "
                  f"ms) vs static {REFERENCE_SINGLE} {r['static_32_5_samples_per_s']:.0f}: "
                  f"ratio {r['ratio_vs_32_5']}")


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_autotune", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inference-url", default="http://127.0.0.1:8080")
    ap.add_argument("--sidecar-url", default=f"http://127.0.0.1:{DEFAULT_SIDECAR_WRITE_PORT}",
                    help="the sidecar's write API (its --write-port)")
    ap.add_argument("--token-file", default=DEFAULT_TOKEN_FILE,
                    help="the sidecar's bearer token (make up writes it)")
    ap.add_argument("--traffics", default=",".join(TRAFFICS),
                    help="which to run, of single,ranking,mixed (mixed needs ranking's "
                         "sweep, which then runs too)")
    ap.add_argument("--static-only", action="store_true",
                    help="the static sweeps alone (no /tuner call needed)")
    ap.add_argument("--single-settings", default=None,
                    help=f"B/D,... of the single sweep (default {DEFAULTS['single']}; "
                         f"{REFERENCE_SINGLE} is added when missing: the single row "
                         "compares against it)")
    ap.add_argument("--ranking-settings", default=None,
                    help=f"B/D,... of the ranking sweep (default {DEFAULTS['ranking']})")
    ap.add_argument("--single-connections", type=int, default=64)
    ap.add_argument("--ranking-connections", type=int, default=3)
    ap.add_argument("--single-bodies", type=int, default=256,
                    help="distinct 1-instance bodies")
    ap.add_argument("--ranking-bodies", type=int, default=48, help="distinct ranking bodies")
    ap.add_argument("--ranking-instances", default="100-700",
                    help="instances per ranking request, LO-HI (uniform)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the bodies and their sizes")
    helps = {"warmup_s": "unmeasured run after each static change",
             "measure_s": "each measured run",
             "quiet_s": "the tuner counts as settled after this long without a decision",
             "settle_timeout_s": "longest wait for the tuner to settle (then it is measured "
                                 "as it is, marked not settled)",
             "single_probe_at_s": "single: also measure the --measure-s run that starts "
                                  "this long into tuner-on traffic (vs static 32/5)",
             "mixed_first_s": "mixed: seconds of single traffic before the switch to ranking"}
    for name, (full, quick) in DURATIONS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=None,
                        help=f"{helps[name]} (default {full:g}; --quick: {quick:g})")
    ap.add_argument("--p99-goal-ms", type=float, default=P99_SLO_MS,
                    help="a static setting must meet it to be the best")
    ap.add_argument("--poll-s", type=float, default=0.5, help="GET /tuner every this long")
    ap.add_argument("--wrk-threads", type=int, default=1,
                    help="wrk threads (1 holds 64 connections; more take the service's cores)")
    ap.add_argument("--wrk-timeout-s", type=float, default=10.0,
                    help="wrk counts a request unanswered this long as a timeout (a failure)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 settings per sweep, 2 s warm-ups, 5 s runs, shorter "
                         "tuner waits; figures mean nothing")
    ap.add_argument("--out", default=str(OUT))
    return ap


def _config(args: argparse.Namespace) -> Config:
    traffics = [t.strip() for t in args.traffics.split(",") if t.strip()]
    bad = [t for t in traffics if t not in TRAFFICS]
    if bad or not traffics:
        raise ConfigError(f"--traffics {args.traffics!r}: each must be one of "
                          f"{','.join(TRAFFICS)}")
    if args.static_only and traffics == ["mixed"]:
        raise ConfigError("--static-only with --traffics mixed measures nothing of mixed; "
                          "ask for ranking")
    for name in ("single_connections", "ranking_connections", "single_bodies",
                 "ranking_bodies", "wrk_threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for name in ("p99_goal_ms", "poll_s", "wrk_timeout_s"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    durations = {name: quick if args.quick else full
                 for name, (full, quick) in DURATIONS.items()}
    durations.update({k: getattr(args, k) for k in DURATIONS if getattr(args, k) is not None})
    for name, v in durations.items():
        if not (v >= 0 and math.isfinite(v)) or (name == "measure_s" and v == 0):
            raise ConfigError(f"--{name.replace('_', '-')} {v} must be a finite number "
                              f"{'> 0' if name == 'measure_s' else '>= 0'}")
    quick = QUICK if args.quick else DEFAULTS
    settings = {"single": parse_settings(args.single_settings or quick["single"]),
                "ranking": parse_settings(args.ranking_settings or quick["ranking"])}
    notes = []
    ref = Setting.parse(REFERENCE_SINGLE)
    if "single" in traffics and not args.static_only and ref not in settings["single"]:
        settings["single"].append(ref)
        notes.append(f"{REFERENCE_SINGLE} added to the single sweep: the single row "
                     "compares against it")
    cfg = Config(traffics=traffics, static_only=args.static_only, settings=settings,
                 connections={"single": args.single_connections,
                              "ranking": args.ranking_connections},
                 p99_goal_ms=args.p99_goal_ms, poll_s=args.poll_s, quick=args.quick,
                 notes=notes, **durations)
    return cfg


def _ranking_sizes(spec: str, n: int, seed: int) -> list[int]:
    lo_hi = spec.split("-")
    if len(lo_hi) != 2 or not all(p.strip().isdigit() for p in lo_hi):
        raise ConfigError(f"--ranking-instances {spec!r} must be LO-HI, e.g. 100-700")
    lo, hi = int(lo_hi[0]), int(lo_hi[1])
    if not 1 <= lo <= hi:
        raise ConfigError(f"--ranking-instances {spec!r}: need 1 <= LO <= HI")
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def _traffics(args: argparse.Namespace, cfg: Config, root: Path) -> dict[str, Traffic]:
    # Body seeds far apart, so that no two bodies (of either traffic) share instances.
    single = write_bodies(root, "single", [1] * args.single_bodies, args.seed * 100_003,
                          cfg.connections["single"])
    sizes = _ranking_sizes(args.ranking_instances, args.ranking_bodies, args.seed)
    ranking = write_bodies(root, "ranking", sizes, args.seed * 100_003 + 50_000,
                           cfg.connections["ranking"])
    return {"single": single, "ranking": ranking}


def _restore(sidecar: Sidecar, declared: Setting, tuner_was_on: bool | None) -> None:
    """Put back the declared batching of the start, and the tuner when it was on (it then
    tunes from there, as after a restart). The declared value, not what served: with the
    tuner on, what served was its override, which PUT /batching would write into the
    desired state."""
    try:
        _log(f"restoring the declared batching {declared}"
             + (" and the tuner (on)" if tuner_was_on else ""))
        sidecar.put_batching(declared)  # also turns the tuner off
        if tuner_was_on:
            sidecar.put_tuner(True)
    except (ServeError, httpx.HTTPError) as e:
        msg = e.message if isinstance(e, ServeError) else str(e)
        _log(f"WARNING could not restore batching {declared} / the tuner: {msg}")


def _measure(cfg: Config, args: argparse.Namespace, sidecar: Sidecar, wrk: Wrk,
             root: Path) -> tuple[Bench, list[dict[str, Any]], Setting]:
    """Sweeps and tuned runs (bodies written under ``root``); the bench, its rows and the
    setting that served at the start (put back at the end, with the tuner, whatever
    happens)."""
    start = sidecar.batching()
    declared = sidecar.batching("desired")
    has_tuner = sidecar.has_tuner()
    tuner_was_on: bool | None = None
    if has_tuner or not cfg.static_only:
        # Without a tuner this fails here, before anything is measured.
        tuner_was_on = bool(sidecar.tuner()["enabled"])
    traffic = _traffics(args, cfg, root)
    _log(f"serving {start}; tuner "
         f"{'absent' if tuner_was_on is None else 'on' if tuner_was_on else 'off'}; "
         f"traffics {','.join(cfg.traffics)}" + (" (static sweeps only)" if cfg.static_only
                                                  else ""))
    bench = Bench(cfg, sidecar, wrk, traffic, has_tuner)
    rows: list[dict[str, Any]] = []
    swept = [t for t in ("single", "ranking")
             if t in cfg.traffics or (t == "ranking" and "mixed" in cfg.traffics)]
    try:
        for name in swept:
            bench.sweep(name)
            if name in cfg.traffics and not cfg.static_only:
                rows.append(bench.tuned(name))
        if "mixed" in cfg.traffics and not cfg.static_only:
            rows.append(bench.mixed())
    finally:
        _restore(sidecar, declared, tuner_was_on)
    return bench, rows, start


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = _config(args)
        token = (REPO / args.token_file).read_text().strip()
    except ServeError as e:
        print(f"bench_autotune: {e.message}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"bench_autotune: {e} (is `make up` running? it writes the token)",
              file=sys.stderr)
        return 3
    if shutil.which("wrk") is None:
        print("bench_autotune: wrk is not installed: make wrk", file=sys.stderr)
        return 3
    sidecar = Sidecar(args.sidecar_url, token)
    wrk = Wrk(f"{args.inference_url.rstrip('/')}/predictions/dlrm", args.wrk_threads,
              args.wrk_timeout_s)
    with tempfile.TemporaryDirectory(prefix="bench_autotune_") as tmp:
        try:
            bench, rows, start = _measure(cfg, args, sidecar, wrk, Path(tmp))
        except ServeError as e:
            print(f"bench_autotune: {e.message}", file=sys.stderr)
            return 2
        except httpx.HTTPError as e:
            print(f"bench_autotune: the sidecar at {args.sidecar_url} did not answer as "
                  f"needed: {e} (is `make up` running?)", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"bench_autotune: {e}", file=sys.stderr)
            return 3
    if rows:
        _print_rows(rows)
    failed = (sum(r["failed"] for sweep in bench.sweeps.values() for r in sweep)
              + sum(r["failed"] for r in rows))
    doc = {
        "measured_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "machine": machine_info(),
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "settings"},
                   "settings": {k: [str(s) for s in v] for k, v in cfg.settings.items()},
                   "start_setting": str(start), "default_setting": str(DEFAULT_SETTING),
                   "bodies": {t.name: {"count": t.bodies, "connections": t.connections,
                                       "mean_instances": round(t.mean_instances, 1)}
                              for t in bench.traffic.values()},
                   "ranking_instances": args.ranking_instances, "seed": args.seed,
                   "wrk_threads": args.wrk_threads, "wrk_timeout_s": args.wrk_timeout_s,
                   "samples_per_s": "requests/s x mean instances of the requests sent"},
        "sweeps": bench.sweeps,
        "best_static": {k: v["setting"] for k, v in bench.best.items()},
        "rows": rows,
        "failed": failed,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"-> {out}")
    if failed:
        print(f"bench_autotune: {failed} requests failed (non-2xx or socket errors)",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
