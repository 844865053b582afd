"""`make faults`: faults against a real running service, each under load.

    python -m serve.ops.faults [--cases kill9_worker,sigterm,slow_clients,burst,soak]
                               [--soak-s 600] [--clients 8] [--out bench/results/faults.json]

It starts its own service (TorchServe + sidecar, `serve.ops.launcher`) on free loopback
ports (every one, the OIP port too: it runs beside ``make up``) with the model version
``make up`` would serve (:func:`stable_version`: the one ``.run/state.yaml`` declares,
else the one ``make model`` builds with the same ``--profile/--seed/--version``; never
simply the newest file of ``model_store/``, which may be an import of another request
schema), 2 workers, batch 2 / 2 ms with the batching tuner off (``PUT /tuner {"enabled": false}``:
the cases measure the declared batching, and a tuner switch mid-case would replace the
workers ``burst`` checks), and runs each case under 512-instance binary requests:

``kill9_worker``
    ``kill -9`` of one TorchServe worker under 8 closed-loop clients: failed requests
    (at most the killed worker's batch) and seconds until all workers are READY again
    (within 60 s), and the service answers afterwards.
``sigterm``
    a foreground `python -m serve.ops.launcher run` under 16 clients gets SIGTERM: every
    request started before the signal must be answered 200; every one started after
    must be answered 200 or refused cleanly (a JSON 503, or a refused connection: never
    a reset or a timeout); the process exits within ``--grace-s``. Clients stop sending
    after a 503, as a load balancer stops routing to a pod that turned unready.
``slow_clients``
    200 connections to the inference port and 200 to the sidecar sending one byte a
    second: the 8 normal clients keep at least half their throughput with 0 failed, and
    ``GET /state`` answers within 2 s.
``burst``
    ``job_queue_size`` (config.properties' as shipped: 64) + 200 requests at once, on
    connections opened beforehand and driven by one thread (:func:`raw_burst`: the case
    measures TorchServe's answer, not 264 TCP handshakes or 264 Python threads queueing
    for the interpreter lock on a 2-core host): every one gets an HTTP answer (200 or
    503), the 503s come fast (p99 < 1 s from the burst's start), the workers TorchServe reports
    (id and pid, management API) are the same before and after, and the service answers
    normally afterwards. It starts only once TorchServe reports every worker READY.
``soak``
    ``--soak-s`` (``SOAK`` in make; default 600) at 70% of the knee (open loop, paced):
    0 errors, and the RSS of the workers (summed), the TorchServe frontend (java) and the
    sidecar each grows under 5% from minute 2 (20% of the soak when shorter) to the end.

Prints a table; writes ``{"cases": [{"case", "ok", ...figures}], ...}`` to ``--out``.
Exit code 0 only when every case holds. Whatever ends it (a failed case, an exception,
Ctrl-C, SIGTERM), it stops every TorchServe and sidecar it started.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from serve.api.binary import example_binary
from serve.api.request import BINARY_MEDIA_TYPE, DEFAULT_SCHEMA
from serve.common.net import wait_until
from serve.constants import DENSE_PRECISIONS
from serve.errors import ConfigError, ServeError, UpstreamUnavailable
from serve.ops.launch_config import LaunchConfig
from serve.ops.launch_ports import PORTS, free_port_settings
from serve.ops.launch_signals import sigterm_unwinds, stop_launcher
from serve.ops.launch_state import served_version
from serve.ops.loadgen import Answer, BackgroundLoad, PacedLoad
from serve.ops.state_client import StateClient
from serve.profiles import schema_from_report
from serve.settings import DLRM_AUTOTUNE
from serve.state import LOCAL_STATE_FILE, parse_state, write_state
from serve.store.repository import DEFAULT_PROFILE, ModelRepository, default_version

__all__ = ["CASES", "classify_signal", "harness_config", "main", "raw_burst", "rss_growth",
           "sigterm_command", "stable_version"]

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "faults.json"
INSTANCES = 512
BATCH = {"batch_size": 2, "max_batch_delay_ms": 2}
WORKERS = 2
BURST_EXTRA = 200  # requests beyond job_queue_size in the burst case


def shipped_queue_size(conf: Path = REPO / "config.properties") -> int:
    """config.properties' ``job_queue_size``: the harness runs TorchServe as shipped."""
    for line in conf.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "job_queue_size" and not key.lstrip().startswith("#"):
            return int(value.strip())
    raise ConfigError(f"{conf} sets no job_queue_size; the burst case needs it")


# ------------------------------------------------------------------ pure parts (tested)


def classify_signal(outcomes: Sequence[Answer], signal_t: float) -> dict[str, Any]:
    """Requests around a signal: those started before it must be 200; those after must be
    200, a JSON 503 or a refused connection. Returns counts and the bad ones' reasons."""
    before = [a for a in outcomes if a.t0 < signal_t]
    after = [a for a in outcomes if a.t0 >= signal_t]
    pre_bad = [a for a in before if a.status != 200]
    post_bad = [a for a in after if not _clean_after(a)]
    return {
        "before": len(before), "before_failed": len(pre_bad),
        "after": len(after), "after_by_outcome": dict(Counter(_outcome(a) for a in after)),
        "after_unclean": len(post_bad),
        "bad": [f"{'before' if a.t0 < signal_t else 'after'}: {_outcome(a)} {a.detail[:120]}"
                for a in (pre_bad + post_bad)[:10]],
    }


def _outcome(a: Answer) -> str:
    return a.error or str(a.status)


def _clean_after(a: Answer) -> bool:
    if a.status == 200 or a.error == "ConnectError":
        return True
    if a.status == 503:
        try:
            return json.loads(a.detail).get("code") == 503
        except ValueError:
            return False
    return False


def rss_growth(series: Sequence[tuple[float, float]], mark_s: float) -> dict[str, float]:
    """RSS growth from the first sample at or after ``mark_s`` to the last sample, of a
    series of (seconds since start, bytes). Raises ``ValueError`` without such samples."""
    after = [(t, v) for t, v in series if t >= mark_s]
    if len(after) < 2:
        raise ValueError(f"need >= 2 RSS samples after {mark_s:.0f} s, got {len(after)}")
    start, end = after[0][1], after[-1][1]
    if start <= 0:
        raise ValueError(f"RSS at the mark is {start}; expected > 0")
    return {"mark_mib": round(start / 2**20, 1), "end_mib": round(end / 2**20, 1),
            "growth_pct": round(100.0 * (end - start) / start, 2)}


def soak_mark_s(soak_s: float) -> float:
    """Where RSS growth is measured from: minute 2, or 20% of a soak shorter than 600 s."""
    return 120.0 if soak_s >= 600 else 0.2 * soak_s


# ------------------------------------------------------------------ the service


@dataclass
class Harness:
    """The service under test (started by :func:`harness`) and how to reach it."""

    svc: Any
    client: StateClient
    body: bytes

    @property
    def cfg(self) -> Any:
        return self.svc.config

    @property
    def url(self) -> str:
        return f"{self.cfg.inference_url}/predictions/dlrm"

    def load(self, clients: int, **kw: Any) -> BackgroundLoad:
        return BackgroundLoad(self.url, [self.body], clients=clients,
                              content_type=BINARY_MEDIA_TYPE, timeout_s=60,
                              expect_predictions=INSTANCES, **kw)

    def workers(self) -> list[psutil.Process]:
        return _workers(self.svc.torchserve.pid)

    def ready_workers(self) -> int:
        return int((self.client.state().get("observed") or {}).get("ready_workers") or 0)

    def ts_workers(self) -> dict[str, tuple[int, str]]:
        """TorchServe's own view of the default version's workers: id -> (pid, status)."""
        r = httpx.get(f"{self.cfg.management_url}/models/dlrm", timeout=30)
        r.raise_for_status()
        return {str(w["id"]): (int(w.get("pid") or 0), str(w.get("status")))
                for m in r.json() for w in m.get("workers", [])}

    def wait_all_ready(self, timeout_s: float = 60) -> dict[str, tuple[int, str]]:
        """TorchServe's workers once it reports ``WORKERS`` of them READY (the sidecar's
        observation lags: it is refreshed on its own schedule)."""
        def ready() -> dict[str, tuple[int, str]] | None:
            w = self.ts_workers()
            return w if sum(s == "READY" for _, s in w.values()) >= WORKERS else None
        return wait_until(ready, timeout_s=timeout_s, interval_s=0.2,
                          what=f"{WORKERS} workers READY in TorchServe")

    def answers(self) -> bool:
        r = httpx.post(self.url, content=self.body, timeout=30,
                       headers={"Content-Type": BINARY_MEDIA_TYPE})
        return r.status_code == 200


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _workers(pid: int) -> list[psutil.Process]:
    out = []
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            if any("model_service_worker" in part for part in p.cmdline()):
                out.append(p)
    return out


def _is_java(p: psutil.Process) -> bool:
    try:
        return "java" in p.name()
    except psutil.Error:
        return False


def _rss(procs: Sequence[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def stable_version(store: Path, state_file: Path = REPO / LOCAL_STATE_FILE,
                   initial: str | None = None) -> str:
    """The version ``make up`` would serve from ``store``
    (:func:`serve.ops.launch_state.served_version`: what ``state_file`` declares, else
    ``initial``, by default what ``make model`` builds), never simply the newest file.

    The cases send the built-in request schema (13 dense, 26 one-id features), so a
    version of another request schema is refused here, at once, instead of a service
    that never answers a predict.

    Raises:
        ConfigError: the version is not in ``store``, or takes other requests.
    """
    repo = ModelRepository([store])
    version = served_version(state_file, repo, initial or default_version(DEFAULT_PROFILE))
    try:
        schema = schema_from_report(repo.report(version))
    except (ServeError, OSError, ValueError):
        return version  # no report to compare with: the built-in bodies are tried
    differences = DEFAULT_SCHEMA.request_differences(schema)
    if differences:
        raise ConfigError(
            f"model version {version!r} (what `make up` serves: {state_file} or the version "
            f"`make model` builds) takes other requests than the built-in model "
            f"({'; '.join(differences)}; first is the built-in); the fault cases send "
            "built-in requests: serve a built-in version (`make faults VERSION=<name>`, or "
            f"edit model.version in {state_file})")
    return version


def _state_file(root: Path, version: str) -> Path:
    path = root / "state.yaml"
    write_state(path, parse_state({"model": {"version": version}, "batching": BATCH,
                                   "workers": WORKERS}))
    return path


def harness_config(root: Path, store: Path, version: str) -> LaunchConfig:
    """The harness's service: ``version`` with the cases' batching and workers, every
    port free (none left at its default: it runs beside ``make up``), files under ``root``."""
    return LaunchConfig(
        **free_port_settings(), model_store=store,
        state_file=_state_file(root, version), run_dir=root / "run",
        log_dir=root / "logs", sidecar=True, ready_timeout_s=300)


@contextlib.contextmanager
def harness(root: Path, store: Path, version: str) -> Iterator[Harness]:
    """A background service on free ports (config.properties as shipped), stopped at the
    end (:func:`serve.ops.launcher.start` stops it when it fails to start)."""
    from serve.ops.launcher import start

    cfg = harness_config(root, store, version)
    svc = start(cfg)
    try:
        client = StateClient(cfg.sidecar_write_url, cfg.token_file.read_text().strip(), timeout_s=30)
        client.wait_converged(timeout_s=180)
        # the declared batching for the whole run (the service stops with the tuner off)
        client.set_tuner(False)
        client.wait_declared_batching(timeout_s=180)
        yield Harness(svc, client, example_binary(INSTANCES, seed=1))
    finally:
        svc.stop()


# ------------------------------------------------------------------ the cases


def case_kill9_worker(h: Harness, args: argparse.Namespace) -> dict[str, Any]:
    with h.load(args.clients) as load:
        load.wait_for(4 * args.clients, timeout_s=120)
        victim = h.workers()[0]
        pid = victim.pid
        victim.kill()
        t0 = time.monotonic()
        with contextlib.suppress(UpstreamUnavailable):
            # TorchServe's own READY (the sidecar's observation lags, and a worker process
            # exists before it is READY): the next case starts from all workers serving
            wait_until(lambda: _all_ready_without(h.ts_workers(), pid),
                       timeout_s=60, interval_s=0.2, what="all workers READY again")
        recovery = time.monotonic() - t0
        n = load.served
        load.wait_for(n + 2 * args.clients, timeout_s=60)
    ok = load.failed <= BATCH["batch_size"] and recovery < 60 and h.answers()
    return {"case": "kill9_worker", "ok": ok, "failed": load.failed, "served": load.served,
            "recovery_s": round(recovery, 2), "killed_pid": pid, "failures": load.failures[:3],
            **({} if ok else {"why": f"failed {load.failed} (max {BATCH['batch_size']}) or "
                              f"recovery {recovery:.1f} s (max 60)"})}


def _all_ready_without(workers: dict[str, tuple[int, str]], pid: int) -> bool:
    """``WORKERS`` workers READY in TorchServe's view, none of them process ``pid``."""
    ready = [p for p, s in workers.values() if s == "READY"]
    return len(ready) >= WORKERS and pid not in ready and pid not in {p for p, _ in
                                                                       workers.values()}


def _rate(load: BackgroundLoad, seconds: float) -> float:
    n0, t0 = load.served, time.monotonic()
    time.sleep(seconds)
    return (load.served - n0) / (time.monotonic() - t0)


class _Slowloris:
    """``n`` connections to (host, port) each sending one byte of a request a second."""

    def __init__(self, host: str, port: int, n: int) -> None:
        self.socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(b"POST /predictions/dlrm HTTP/1.1\r\nHost: x\r\n")
            self.socks.append(s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drip, daemon=True)
        self._thread.start()

    def _drip(self) -> None:
        while not self._stop.wait(1.0):
            for s in list(self.socks):
                try:
                    s.sendall(b"X")
                except OSError:
                    self.socks.remove(s)  # the server closed it: fine

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        alive = len(self.socks)
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
        return alive


def case_slow_clients(h: Harness, args: argparse.Namespace) -> dict[str, Any]:
    n = 200
    with h.load(args.clients) as load:
        load.wait_for(4 * args.clients, timeout_s=120)
        base = _rate(load, 10)
        slow = [_Slowloris("127.0.0.1", h.cfg.inference_port, n),
                _Slowloris("127.0.0.1", h.cfg.sidecar_port, n)]
        try:
            during = _rate(load, 10)
            t0 = time.monotonic()
            h.client.state()
            state_s = time.monotonic() - t0
        finally:
            still_open = [s.close() for s in slow]
    ok = load.failed == 0 and during >= 0.5 * base and state_s < 2.0
    return {"case": "slow_clients", "ok": ok, "failed": load.failed, "served": load.served,
            "rps_before": round(base, 1), "rps_during": round(during, 1),
            "get_state_s": round(state_s, 3), "slow_connections": 2 * n,
            "still_open_inference_sidecar": still_open,
            **({} if ok else {"why": "normal clients starved or GET /state slow"})}


class _RawRequest:
    """One burst request on its own connection: the bytes still to send, what came back."""

    def __init__(self, sock: socket.socket, request: bytes) -> None:
        self.sock, self.out, self.buf = sock, memoryview(request), b""
        self.status: int | str | None = None
        self.seconds = 0.0

    def response_done(self) -> bool:
        """Whether ``buf`` holds a whole response (status line, headers, Content-Length)."""
        head, sep, body = self.buf.partition(b"\r\n\r\n")
        if not sep:
            return False
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if len(body) < length:
            return False
        self.status = int(head.split(b" ", 2)[1])
        return True


def raw_burst(host: str, port: int, path: str, body: bytes, n: int, content_type: str,
              timeout_s: float = 120.0) -> list[tuple[int | str, float]]:
    """``n`` POSTs of ``body`` at once, from ONE thread: ``n`` connections opened first,
    then every request written without blocking and every response read as it comes.
    Returns (status or error, seconds from the burst's start to the whole response).

    One thread, not ``n``: with hundreds of Python threads the interpreter lock's
    hand-offs (5 ms each) add up to about a second, measured as TorchServe's latency."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    reqs = [_RawRequest(socket.create_connection((host, port), timeout=30), head + body)
            for _ in range(n)]
    sel = selectors.DefaultSelector()
    for r in reqs:
        r.sock.setblocking(False)
        sel.register(r.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, r)
    t0 = time.monotonic()
    pending = n
    while pending and time.monotonic() - t0 < timeout_s:
        for key, events in sel.select(timeout=1.0):
            r = key.data
            try:
                if events & selectors.EVENT_WRITE and len(r.out):
                    r.out = r.out[r.sock.send(r.out):]
                    if not len(r.out):
                        sel.modify(r.sock, selectors.EVENT_READ, r)
                if events & selectors.EVENT_READ:
                    chunk = r.sock.recv(1 << 16)
                    r.buf += chunk
                    if not chunk and not r.response_done():
                        r.status = "closed"
            except OSError as e:
                r.status = type(e).__name__
            if r.status is not None or r.response_done():
                r.seconds = time.monotonic() - t0
                sel.unregister(r.sock)
                r.sock.close()
                pending -= 1
    for r in reqs:
        if r.status is None:
            r.status, r.seconds = "timeout", timeout_s
            r.sock.close()
    return [(r.status if r.status is not None else "timeout", r.seconds) for r in reqs]


def case_burst(h: Harness, args: argparse.Namespace) -> dict[str, Any]:
    queue = shipped_queue_size()
    total = queue + BURST_EXTRA
    before = h.wait_all_ready()
    procs_before = {p.pid for p in h.workers()}
    results = raw_burst("127.0.0.1", h.cfg.inference_port, "/predictions/dlrm", h.body,
                        total, BINARY_MEDIA_TYPE)
    after = h.ts_workers()
    procs_after = {p.pid for p in h.workers()}
    by = Counter(str(s) for s, _ in results)
    rejected = sorted(d for s, d in results if s == 503)
    p99 = rejected[min(len(rejected) - 1, int(0.99 * len(rejected)))] if rejected else None
    same = after == before and procs_after == procs_before
    answers = h.answers()
    ok = (set(by) <= {"200", "503"} and bool(rejected) and p99 is not None and p99 < 1.0
          and same and answers)
    return {"case": "burst", "ok": ok,
            "failed": sum(n for s, n in by.items() if s not in ("200", "503")),
            "rejected_503": by.get("503", 0), "requests": total, "job_queue_size": queue,
            "by_status": dict(by), "rejection_p99_s": round(p99, 3) if p99 is not None else None,
            "workers_unchanged": same, "answers_after": answers,
            **({} if same else {"workers_before": before, "workers_after": after,
                                "processes_gone": sorted(procs_before - procs_after),
                                "processes_new": sorted(procs_after - procs_before)}),
            **({} if ok else {"why": "a non-HTTP outcome, no rejection at all, slow "
                                     "rejections, a worker died, or no answer after"})}


def case_soak(h: Harness, args: argparse.Namespace) -> dict[str, Any]:
    rate = _soak_rate(h)
    mark = soak_mark_s(args.soak_s)
    series: dict[str, list[tuple[float, float]]] = {"workers": [], "frontend": [], "sidecar": []}
    ts_pid, sc_pid = h.svc.torchserve.pid, h.svc.sidecar.pid
    with PacedLoad(h.url, [h.body], rate_rps=rate, senders=32,
                   content_type=BINARY_MEDIA_TYPE, expect_predictions=INSTANCES) as load:
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < args.soak_s:
            java = [p for p in _tree(ts_pid) if _is_java(p)]
            series["workers"].append((now, _rss(_workers(ts_pid))))
            series["frontend"].append((now, _rss(java)))
            series["sidecar"].append((now, _rss(_tree(sc_pid))))
            print(f"  soak {now:5.0f}/{args.soak_s:.0f} s: {load.served} served, "
                  f"{load.failed} failed", flush=True)
            time.sleep(min(10.0, max(0.5, args.soak_s - now)))
        lags = sorted(load.lags)
    rss = {k: rss_growth(v, mark) for k, v in series.items()}
    ok = load.failed == 0 and all(r["growth_pct"] < 5.0 for r in rss.values())
    return {"case": "soak", "ok": ok, "failed": load.failed, "served": load.served,
            "seconds": args.soak_s, "rate_rps": round(rate, 1),
            "lag_p99_s": round(lags[int(0.99 * (len(lags) - 1))], 3) if lags else None,
            "rss_from_s": mark, "rss": rss,
            **({} if ok else {"why": "errors or RSS growth >= 5%"})}


def _soak_rate(h: Harness) -> float:
    """70% of the knee (requests/s of 512 instances): loadtest/capacity.json's knee in
    instances/s when present, else the closed-loop throughput of 8 clients over 15 s."""
    cap = REPO / "loadtest" / "capacity.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return 0.7 * float(json.loads(cap.read_text())["knee_instances_per_s"]) / INSTANCES
    with h.load(8) as load:
        load.wait_for(16, timeout_s=120)
        return 0.7 * _rate(load, 15)


def sigterm_command(root: Path, store: Path, version: str, grace_s: float
                    ) -> tuple[list[str], dict[str, str], dict[str, int]]:
    """The sigterm case's foreground launcher: (command, environment, ports). Every port
    of :data:`serve.ops.launch_ports.PORTS` is a free one, by its flag or, where it has
    none (gRPC), its variable: none is left at its default."""
    ports = free_port_settings()
    env = dict(os.environ)
    env[DLRM_AUTOTUNE.name] = "off"  # the declared batching, as in the harness
    cmd = [sys.executable, "-m", "serve.ops.launcher", "run"]
    for setting, _what, flag, var in PORTS:
        if flag is not None:
            cmd += [flag, str(ports[setting])]
        else:
            env[var.name] = str(ports[setting])
    run = root / "sigterm"
    cmd += ["--model-store", str(store), "--state-file", str(_state_file(root, version)),
            "--run-dir", str(run / "run"), "--log-dir", str(run / "logs"),
            "--drain-timeout", str(grace_s - 5)]
    return cmd, env, ports


def case_sigterm(root: Path, store: Path, version: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Its own foreground service: SIGTERM goes to `launcher run` (the pod's TorchServe
    container gets it after the preStop drain; locally the launcher drains itself)."""
    cmd, env, ports = sigterm_command(root, store, version, args.grace_s)
    run = root / "sigterm"
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{ports['inference_port']}/predictions/dlrm"
    body = example_binary(INSTANCES, seed=2)
    try:
        def ready() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.post(url, content=body, timeout=10, headers={
                    "Content-Type": BINARY_MEDIA_TYPE}).status_code == 200
            return False

        wait_until(ready, timeout_s=300, interval_s=0.5, what="the foreground service")
        with BackgroundLoad(url, [body], clients=16, content_type=BINARY_MEDIA_TYPE,
                            timeout_s=60, expect_predictions=INSTANCES, error_pause_s=0.05,
                            stop_on=frozenset({503})) as load:
            load.wait_for(32, timeout_s=120)
            signal_t = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=args.grace_s)
                exit_s: float | None = time.monotonic() - signal_t
            except subprocess.TimeoutExpired:
                exit_s = None
            time.sleep(1.0)  # requests after the exit: refused connections
        found = classify_signal(load.outcomes, signal_t)
    finally:
        # SIGTERM, then SIGKILL, and the groups it recorded: a launcher killed outright
        # would leave its TorchServe and sidecar running, holding their ports.
        stop_launcher(proc, run / "run")
    ok = found["before_failed"] == 0 and found["after_unclean"] == 0 and exit_s is not None
    return {"case": "sigterm", "ok": ok, "failed": found["before_failed"] + found["after_unclean"],
            "exit_s": round(exit_s, 2) if exit_s is not None else None,
            "grace_s": args.grace_s, **found,
            **({} if ok else {"why": "a request accepted before the signal failed, a later "
                              "one was not refused cleanly, or no exit within the grace"})}


CASES: tuple[str, ...] = ("kill9_worker", "sigterm", "slow_clients", "burst", "soak")
_HARNESS_CASES: dict[str, Callable[[Harness, argparse.Namespace], dict[str, Any]]] = {
    "kill9_worker": case_kill9_worker, "slow_clients": case_slow_clients,
    "burst": case_burst, "soak": case_soak}


# ------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.faults", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--soak-s", type=float, default=600.0,
                    help="soak seconds (make faults SOAK=N passes --soak-s N)")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients per case")
    ap.add_argument("--grace-s", type=float, default=60.0,
                    help="the sigterm case's grace period (seconds to exit)")
    ap.add_argument("--model-store", default="model_store")
    ap.add_argument("--state-file", default=LOCAL_STATE_FILE,
                    help="the version to serve is the one this file declares (`make up`'s), "
                         "else the one `make model` builds with the flags below")
    # make faults passes MODEL_ARGS, as make up does: the same version.
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--label-shuffle", action="store_true")
    ap.add_argument("--mapping", default="modulo", choices=("modulo", "managed"))
    ap.add_argument("--dense-precision", default="fp32", choices=DENSE_PRECISIONS)
    ap.add_argument("--version", default=None)
    ap.add_argument("--out", default=str(OUT))
    return ap


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"state: batching {BATCH}, {WORKERS} workers, tuner off, {INSTANCES} instances "
          "per request")
    print("| case | ok | failed | recovery / exit s | figures |")
    print("|---|---|---:|---:|---|")
    skip = {"case", "ok", "failed", "recovery_s", "exit_s", "failures", "bad", "rss"}
    for r in rows:
        rec = r.get("recovery_s", r.get("exit_s", ""))
        figs = ", ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
        print(f"| {r['case']} | {'yes' if r['ok'] else 'NO'} | {r['failed']} | {rec} | {figs} |")
    for r in rows:
        if "rss" in r:
            for name, g in r["rss"].items():
                print(f"  soak RSS {name}: {g['mark_mib']} MiB at {r['rss_from_s']:.0f} s -> "
                      f"{g['end_mib']} MiB at the end ({g['growth_pct']:+.2f}%)")
        if r.get("bad"):
            print(f"  {r['case']}: " + "; ".join(r["bad"]))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    if args.soak_s < 10:
        raise SystemExit(f"--soak-s {args.soak_s} must be >= 10 (RSS needs samples)")
    store = Path(args.model_store).resolve()
    state_file = Path(args.state_file)
    try:
        version = stable_version(
            store, state_file if state_file.is_absolute() else REPO / state_file,
            args.version or default_version(
                args.profile, seed=args.seed, label_shuffle=args.label_shuffle,
                mapping=args.mapping, dense_precision=args.dense_precision))
    except ConfigError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(f"serving {version} (the version `make up` would serve)", flush=True)
    root = Path(tempfile.mkdtemp(prefix="dlrm-faults-"))
    rows: list[dict[str, Any]] = []
    with sigterm_unwinds():  # SIGTERM runs the finally blocks that stop the services
        try:
            if "sigterm" in cases:
                print("==> sigterm", flush=True)
                rows.append(case_sigterm(root, store, version, args))
            rest = [c for c in cases if c != "sigterm"]
            if rest:
                with harness(root / "harness", store, version) as h:
                    for name in rest:
                        print(f"==> {name}", flush=True)
                        rows.append(_HARNESS_CASES[name](h, args))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    _print(rows)
    doc = {"cases": rows, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "instances": INSTANCES, "batching": BATCH, "workers": WORKERS, "tuner": "off"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"-> {args.out}")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
