"""Run a headless locust load test of the DLRM service and judge it.

    python -m loadtest.run --shape step --duration 60s
    python -m loadtest.run --shape steady --duration 5m -H http://dlrm-serve.ml:8080 --allow-remote
    python -m loadtest.run --from-results loadtest/results/20261129T201500Z --p99-goal-ms 40

Steps:
1. Check the target: loopback only unless ``--allow-remote`` (a load test aimed at the
   wrong URL is an incident). If nothing answers ``/ping`` on a loopback target, start
   the service with ``python -m serve.ops.launcher up`` and stop it (``down``) afterwards.
2. Preflight: one real predict, checked like every load-test answer, so a wrong model
   name or a broken handler fails in a second with its reason, not after the whole run.
3. Run locust headless as a subprocess (``loadtest/locustfile.py``) with the chosen
   shape; bounded by the shape's duration plus a grace period, then killed.
4. Write into ``--out`` (default ``loadtest/results/<UTC timestamp>/``): locust's CSVs
   (``locust_stats.csv``, ``locust_stats_history.csv``, ``locust_failures.csv``,
   ``locust_exceptions.csv``), ``report.html``, ``stages.json`` (exact per-stage figures),
   ``chart.png`` (RPS, p50/p99 and failures over time), ``locust.log`` and
   ``summary.json`` (per-stage rows, the knee of a step run, thresholds, verdict).
5. Exit 0 when every threshold holds, 1 when one fails, 2 on bad arguments, 3 when the
   service is unreachable or the preflight fails, 4 when locust crashed or overran.
"""
from __future__ import annotations

import argparse
import csv
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtest import plan, stats, traffic
from serve import settings
from serve.constants import DEFAULT_SIDECAR_PORT, P99_SLO_MS
from serve.errors import ConfigError, ServeError, UpstreamUnavailable
from serve.ops.machine import describe as describe_machine
from serve.ops.machine import machine_info
from serve.ops.state_client import describe_served, served_state
from serve.profiles import PROFILES, get_profile

__all__ = [
    "EXIT_LOCUST",
    "EXIT_OK",
    "EXIT_THRESHOLD",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "RunConfig",
    "check_host",
    "default_host",
    "evaluate",
    "main",
    "run",
]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
RESULTS = Path(__file__).resolve().parent / "results"
EXIT_OK, EXIT_THRESHOLD, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_LOCUST = 0, 1, 2, 3, 4
# Locust needs a few seconds to import, build the request pool and stop its users;
# past duration + this, the run is killed (a stuck run must not block CI).
_GRACE_S = 60.0
_PING_TIMEOUT_S = 3.0


def default_host() -> str:
    """``$LOADTEST_HOST``, else TorchServe's loopback inference address."""
    env = settings.LOADTEST_HOST.get()
    if env:
        return env
    return f"http://127.0.0.1:{settings.TS_INFERENCE_PORT.get_port()}"


def check_host(url: str, allow_remote: bool) -> tuple[str, bool]:
    """Normalise ``url`` (no trailing slash); return (url, is_loopback).

    Raises ConfigError for a malformed URL, or a non-loopback host without
    ``allow_remote`` (names other than ``localhost`` count as remote: no DNS lookup).
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"--host {url!r} must be an http(s) URL such as http://127.0.0.1:8080")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise ConfigError(f"--host {url!r} must be the server root (scheme://host:port); "
                          "the path /predictions/<model> is added by the test")
    host = parsed.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not allow_remote:
        raise ConfigError(
            f"--host {url!r} is not a loopback address; a load test sends real traffic, so "
            "aiming it at another machine takes --allow-remote (e.g. for a cluster: "
            "-H http://<service> --allow-remote)")
    return f"{parsed.scheme}://{parsed.netloc}", loopback


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; built once from the command line."""

    shape: plan.ShapeConfig
    traffic: traffic.TrafficConfig
    host: str
    loopback: bool
    model: str
    thresholds: stats.Thresholds
    out: Path
    summary_json: Path | None = None
    start_service: bool = True
    preflight: bool = True
    think_ms: float = 0.0
    locust_log_level: str = "INFO"
    model_store: Path | None = None  # for `serve.ops.launcher up` (None: its default)
    sidecar: str | None = None       # sidecar read URL for the served state (None: not read)

    def __post_init__(self) -> None:
        if not self.model or "/" in self.model:
            raise ConfigError(f"--model {self.model!r} must be a plain model name, e.g. dlrm")
        if not (0.0 <= self.think_ms <= 60_000):
            raise ConfigError(f"--think-ms {self.think_ms} must be in [0, 60000]")

    def locust_args(self) -> list[str]:
        t = self.traffic
        return [
            "-f", str(LOCUSTFILE), "--headless", "-H", self.host,
            "--csv", str(self.out / "locust"), "--csv-full-history",
            "--html", str(self.out / "report.html"), "--only-summary",
            "--loglevel", self.locust_log_level, "--stop-timeout", "5",
            "--dlrm-shape", self.shape.shape, "--dlrm-duration", f"{self.shape.duration_s:g}",
            "--dlrm-users", ",".join(map(str, self.shape.user_values)),
            "--dlrm-model", self.model, "--dlrm-profile", t.profile.name,
            "--dlrm-instances", t.instances.spec(),
            "--dlrm-single-fraction", f"{t.instances.single_fraction:g}",
            "--dlrm-zipf-alpha", f"{t.zipf_alpha:g}", "--dlrm-format", t.body_format,
            "--dlrm-pool-size", str(t.pool_size), "--dlrm-seed", str(t.seed),
            "--dlrm-form", t.form,
            "--dlrm-context-features", ",".join(t.context_features or ()),
            "--dlrm-think-ms", f"{self.think_ms:g}",
            "--dlrm-stages-json", str(self.out / "stages.json"),
        ]


# ----------------------------------------------------------------------------- service

def _ping(host: str, timeout: float = _PING_TIMEOUT_S) -> bool:
    try:
        return httpx.get(f"{host}/ping", timeout=timeout).status_code == 200
    except (httpx.HTTPError, httpx.InvalidURL):
        return False


def _launcher(command: str, host: str, model_store: Path | None = None
              ) -> subprocess.CompletedProcess:
    port = urllib.parse.urlsplit(host).port or 80
    cmd = [sys.executable, "-m", "serve.ops.launcher", command]
    if command == "up":
        cmd += ["--inference-port", str(port)]
        if model_store is not None:
            cmd += ["--model-store", str(model_store)]
    log.info("running %s", " ".join(cmd))
    return subprocess.run(cmd, check=False, cwd=REPO, text=True, capture_output=True,
                          timeout=600)


def default_sidecar(host: str, loopback: bool) -> str | None:
    """``$LOADTEST_SIDECAR``, else for a loopback target the sidecar's read port on the
    same host, else None (a remote target's sidecar is not guessed)."""
    env = settings.LOADTEST_SIDECAR.get()
    if env:
        return env.rstrip("/")
    if not loopback:
        return None
    hostname = urllib.parse.urlsplit(host).hostname or "127.0.0.1"
    if ":" in hostname:
        hostname = f"[{hostname}]"
    return f"http://{hostname}:{DEFAULT_SIDECAR_PORT}"


def _served(cfg: RunConfig) -> dict[str, Any]:
    """The served state (:func:`serve.ops.state_client.served_state`), or why not."""
    if cfg.sidecar is None:
        return {"error": "no sidecar to ask (--sidecar or $LOADTEST_SIDECAR)"}
    return served_state(cfg.sidecar)


def _preflight(cfg: RunConfig) -> None:
    """One single-instance predict from the same generator, checked like the load test."""
    one = traffic.TrafficConfig(profile=cfg.traffic.profile,
                                instances=traffic.InstancesDistribution(1, 1, 1.0, 0.0),
                                zipf_alpha=cfg.traffic.zipf_alpha,
                                body_format=cfg.traffic.body_format, pool_size=1,
                                seed=cfg.traffic.seed, form=cfg.traffic.form,
                                context_features=cfg.traffic.context_features)
    req = traffic.RequestPool(one).pick()
    url = f"{cfg.host}/predictions/{cfg.model}"
    try:
        r = httpx.post(url, content=req.body, headers={"Content-Type": "application/json"},
                       timeout=30)
    except httpx.HTTPError as e:
        raise UpstreamUnavailable(f"preflight POST {url} failed: {e}") from None
    status, content = r.status_code, r.content
    reason = traffic.check_response(status, content, 1)
    if reason:
        hint = (f"; is the model registered as {cfg.model!r}? (--model)" if status == 404 else "")
        raise UpstreamUnavailable(f"preflight POST {url} got a wrong answer: {reason}{hint}")


# ----------------------------------------------------------------------------- locust

def _run_locust(cfg: RunConfig) -> int:
    """Run locust to completion (or kill it after duration + grace); return its exit code."""
    cmd = [sys.executable, "-m", "locust", *cfg.locust_args()]
    env = dict(os.environ)
    # One thread each for numpy (pool build) and friends: the load generator shares the
    # machine with the service under test on small hosts.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log.info("locust: %s", " ".join(cmd))
    logfile = (cfg.out / "locust.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def pump() -> None:  # tee locust's output: progress on the console, all of it in the log
        if proc.stdout is None:  # never: Popen(stdout=PIPE); keeps the type checker calm
            return
        for line in proc.stdout:
            logfile.write(line)
            if "stage " in line or "ERROR" in line or "Traceback" in line or "request pool" in line:
                sys.stderr.write("  locust| " + line)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    limit = cfg.shape.duration_s + _GRACE_S
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        log.error("locust still running %.0fs after start; killing it", limit)
        _kill_group(proc)
        rc = -9
    except KeyboardInterrupt:
        _kill_group(proc)
        raise
    finally:
        t.join(timeout=5)
        logfile.close()
    return rc


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _locust_totals(out: Path) -> dict[str, Any]:
    """Locust's own Aggregated counts and the number of distinct exceptions (cross-check)."""
    totals: dict[str, Any] = {}
    stats_csv = out / "locust_stats.csv"
    if stats_csv.is_file():
        with stats_csv.open() as f:
            for row in csv.DictReader(f):
                if row.get("Name") == "Aggregated":
                    totals["requests"] = int(row["Request Count"])
                    totals["failures"] = int(row["Failure Count"])
                    totals["p99_ms_rounded"] = _num(row.get("99%"))
    exc_csv = out / "locust_exceptions.csv"
    if exc_csv.is_file():
        with exc_csv.open() as f:
            totals["exceptions"] = sum(1 for _ in csv.DictReader(f))
    return totals


def _num(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "", "N/A") else None
    except ValueError:
        return None


# ----------------------------------------------------------------------------- judging

def evaluate(out: Path, thresholds: stats.Thresholds, summary_json: Path | None = None,
             extra: dict[str, Any] | None = None, chart: bool = True) -> dict[str, Any]:
    """Read ``out/stages.json`` (+ locust CSVs), write summary.json and chart.png; return it."""
    stages_path = out / "stages.json"
    if not stages_path.is_file():
        raise ConfigError(f"{stages_path} does not exist: locust did not finish (see "
                          f"{out / 'locust.log'}), or {out} is not a results directory")
    doc = json.loads(stages_path.read_text())
    recorded = [stats.StageStats.from_json(s) for s in doc["stages"]]
    locust_totals = _locust_totals(out)
    info: dict[str, Any] = {"config": doc.get("shape"), "traffic": doc.get("traffic"),
                            "locust": locust_totals, "out": str(out)}
    info.update(extra or {})
    summary = stats.summarize(doc["shape"]["shape"], recorded, thresholds, info)
    if locust_totals.get("exceptions"):
        # An exception inside the user code (not a failed request) means the test itself
        # broke; its figures cannot be trusted.
        summary["thresholds"]["checks"].append(
            {"name": "no exceptions in the load generator", "value": locust_totals["exceptions"],
             "limit": 0, "passed": False})
        summary["passed"] = False
    if chart:
        from loadtest import report

        totals = summary["totals"]
        png = report.plot_history(out / "locust_stats_history.csv", out / "chart.png",
                                  stages=doc["stages"], started_at=doc.get("started_at_epoch"),
                                  p99_goal_ms=thresholds.p99_goal_ms,
                                  title=f"{doc['shape']['shape']} load test: {out.name}",
                                  totals=(totals["requests"], totals["failures"]))
        summary["chart"] = str(png) if png else None
    text = json.dumps(summary, indent=2)
    (out / "summary.json").write_text(text)
    if summary_json is not None and summary_json.resolve() != (out / "summary.json").resolve():
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(text)
    return summary


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_summary(summary: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    print(f"{'stage':<10} {'users':>5} {'req/s':>8} {'inst/s':>10} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'fail':>8}  slo", file=file)
    for r in summary["steps"]:
        print(f"{r['name']:<10} {r['users']:>5} {_fmt(r['rps'], '8.1f')} "
              f"{_fmt(r['instances_per_s'], '10.0f')} {_fmt(r['p50_ms'], '8.1f')} "
              f"{_fmt(r['p99_ms'], '8.1f')} {r['failures']:>8}  {'yes' if r['slo'] else 'no'}",
              file=file)
    t = summary["totals"]
    print(f"total: {t['requests']} requests, {t['failures']} failed "
          f"(ratio {t['fail_ratio']:.4f}), {t['instances']} instances", file=file)
    tr = summary.get("traffic") or {}
    if tr:
        ctx = tr.get("context_features") or []
        sent = (f"context form ({len(ctx)} features + dense once per request)"
                if tr.get("form", "instances") == "context" else "instances form")
        print(f"traffic: {sent}, {tr.get('format')} bodies, profile {tr.get('profile')}, "
              f"{tr.get('instances')} candidates", file=file)
    knee = summary.get("knee")
    if summary["shape"] == "step":
        if knee:
            print(f"knee: {knee['name']} ({knee['users']} users): {knee['rps']:.1f} req/s, "
                  f"{knee['instances_per_s']:.0f} instances/s, p99 {knee['p99_ms']:.1f} ms",
                  file=file)
        else:
            print("knee: none (the first step already misses the goal)", file=file)
    for reason, n in list(summary.get("failure_reasons", {}).items())[:5]:
        print(f"  failure x{n}: {reason}", file=file)
    for c in summary["thresholds"]["checks"]:
        print(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']}: {c['value']} "
              f"(limit {c['limit']})", file=file)
    if summary.get("machine"):
        print(f"machine (load generator): {describe_machine(summary['machine'])}", file=file)
    served = summary.get("served") or {}
    if served:
        before, after = served.get("before") or {}, served.get("after") or {}
        print(f"served before: {describe_served(before)}", file=file)
        if after != before:
            print(f"served after:  {describe_served(after)}", file=file)
    print(f"verdict: {'PASSED' if summary['passed'] else 'FAILED'}", file=file)


def run(cfg: RunConfig) -> int:
    """Steps 1-5 of the module docstring; returns the exit code."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    for stale in ("stages.json", "summary.json", "chart.png"):  # never judge an old run
        (cfg.out / stale).unlink(missing_ok=True)
    started_service = False
    try:
        if not _ping(cfg.host):
            if not (cfg.loopback and cfg.start_service):
                log.error("nothing answers %s/ping; start the service (make up) or fix --host",
                          cfg.host)
                return EXIT_UNREACHABLE
            log.info("nothing answers %s/ping: starting the service (serve.ops.launcher up)",
                     cfg.host)
            res = _launcher("up", cfg.host, cfg.model_store)
            sys.stderr.write(res.stdout + res.stderr)
            if res.returncode != 0:
                log.error("`python -m serve.ops.launcher up` failed (exit %d); build the model with "
                          "`make model` if model_store/ holds no model version", res.returncode)
                return EXIT_UNREACHABLE
            started_service = True
            if not _ping(cfg.host, timeout=10):
                log.error("the service started but %s/ping does not answer", cfg.host)
                return EXIT_UNREACHABLE
        if cfg.preflight:
            _preflight(cfg)
            log.info("preflight predict OK")
        served_before = _served(cfg)
        log.info("served: %s", describe_served(served_before))
        log.info("running %s shape for %.0fs against %s; results in %s",
                 cfg.shape.shape, cfg.shape.duration_s, cfg.host, cfg.out)
        t0 = time.monotonic()
        rc = _run_locust(cfg)
        wall = time.monotonic() - t0
        served_after = _served(cfg)
        if not (cfg.out / "stages.json").is_file():
            log.error("locust exited with %d and wrote no stages.json; see %s", rc,
                      cfg.out / "locust.log")
            return EXIT_LOCUST
        summary = evaluate(cfg.out, cfg.thresholds, cfg.summary_json,
                           extra={"host": cfg.host, "locust_exit_code": rc,
                                  "wall_s": round(wall, 1),
                                  "command": " ".join(sys.argv),
                                  # Where locust ran (the service too, on loopback).
                                  "machine": machine_info(),
                                  "served": {"before": served_before,
                                             "after": served_after}})
        print_summary(summary)
        print(f"results: {cfg.out}")
        if rc == -9:
            return EXIT_LOCUST
        return EXIT_OK if summary["passed"] else EXIT_THRESHOLD
    except UpstreamUnavailable as e:
        log.error("%s", e.message)
        return EXIT_UNREACHABLE
    finally:
        if started_service:
            res = _launcher("down", cfg.host)
            sys.stderr.write(res.stdout + res.stderr)


# ----------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=settings.LOAD_SHAPE.get(), choices=plan.SHAPES,
                    help=f"load shape (env {settings.LOAD_SHAPE}; default "
                         f"{settings.LOAD_SHAPE.default}): steady, step (find the knee), spike "
                         "(burst and recovery), soak (drift over a long run)")
    ap.add_argument("--duration", default=settings.LOAD_DURATION.get(),
                    help="total run time, e.g. 40s, 5m, 1h; every stage scales with it (env "
                         f"{settings.LOAD_DURATION}; default {settings.LOAD_DURATION.default})")
    ap.add_argument("-H", "--host", default=None,
                    help=f"service root URL (default $LOADTEST_HOST or {default_host()})")
    ap.add_argument("--allow-remote", action="store_true",
                    help="allow a non-loopback --host (a cluster Service); off so a typo "
                         "cannot load-test the wrong machine")
    ap.add_argument("--users", default=None,
                    help="closed-loop users: N, or step levels 1,2,4,8 (step: N means "
                         "doubling up to N; spike: PEAK or BASE,PEAK). Default per shape: "
                         + ", ".join(f"{k} {','.join(map(str, v))}"
                                     for k, v in plan.DEFAULT_USERS.items()))
    ap.add_argument("--p99-goal-ms", type=float, default=P99_SLO_MS,
                    help=f"latency bound (default {P99_SLO_MS:g}: the service's goal, MLPerf "
                         "DLRM-v2's server bound). step: some step must meet it; other shapes: "
                         "the SLO stages must")
    ap.add_argument("--max-fail-ratio", type=float, default=0.0,
                    help="failed/all requests allowed (0: any wrong answer fails the run)")
    ap.add_argument("--min-gain", type=float, default=0.05,
                    help="step: throughput gain below which more users no longer help (knee)")
    ap.add_argument("--summary-json", type=Path, default=None,
                    help="also write summary.json here")
    ap.add_argument("--out", type=Path, default=None,
                    help="results directory (default loadtest/results/<UTC timestamp>)")
    ap.add_argument("--model", default="dlrm", help="model name in /predictions/<model>")
    ap.add_argument("--profile", default=settings.PROFILE.get(), choices=sorted(PROFILES),
                    help="profile of the served model: table sizes for the id draws (env "
                         f"{settings.PROFILE}; default {settings.PROFILE.default}, as "
                         "`make model`)")
    ap.add_argument("--instances", default="100-700:270",
                    help="instances per ranking request: MIN-MAX[:MEAN] or N (default: "
                         "MLPerf DLRM-v2 server, 100-700 with mean 270)")
    ap.add_argument("--single-fraction", type=float, default=0.1,
                    help="fraction of single-instance requests mixed in")
    ap.add_argument("--zipf-alpha", type=float, default=None,
                    help="id skew (default: the profile's 1.05, as the training data); "
                         "higher = hotter head = higher cache hit ratio")
    ap.add_argument("--format", dest="body_format", default="row", choices=traffic.BODY_FORMATS,
                    help="body form: row ({\"instances\": [...]}) or columnar (cheaper to parse)")
    ap.add_argument("--form", default="context", choices=traffic.REQUEST_FORMS,
                    help="ranking request form: context (default: the user's features and "
                         "the dense vector once per request, the items' per candidate) or "
                         "instances (every candidate repeats everything)")
    ap.add_argument("--context-features", default="",
                    help="comma-separated features the context form sends once (default: "
                         "the profile's user-side features, C1..C13 built in)")
    ap.add_argument("--pool-size", type=int, default=256,
                    help="distinct bodies generated before the run (locust CPU goes to sending)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request pool")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="pause between a user's requests (0: each user keeps one in flight)")
    ap.add_argument("--sidecar", default=None,
                    help="sidecar read URL to record the served state (version, batching, "
                         "workers, tuner) before and after the run (default "
                         f"${settings.LOADTEST_SIDECAR}, else port {DEFAULT_SIDECAR_PORT} on a "
                         "loopback target's host, else not read)")
    ap.add_argument("--no-start", action="store_true",
                    help="never start the service; fail when nothing answers")
    ap.add_argument("--model-store", type=Path, default=None,
                    help="model store for `serve.ops.launcher up` when this run starts the "
                         "service (default: the launcher's, model_store/)")
    ap.add_argument("--no-preflight", action="store_true",
                    help="skip the single checked predict before the run")
    ap.add_argument("--from-results", type=Path, default=None, metavar="DIR",
                    help="do not run: re-judge an earlier results directory with the given "
                         "thresholds (rewrites its summary.json and chart)")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        thresholds = stats.Thresholds(args.p99_goal_ms, args.max_fail_ratio, args.min_gain)
        if args.from_results is not None:
            summary = evaluate(args.from_results, thresholds, args.summary_json)
            print_summary(summary)
            return EXIT_OK if summary["passed"] else EXIT_THRESHOLD
        shape_cfg = plan.ShapeConfig(args.shape, plan.parse_duration(args.duration),
                                       plan.parse_users(args.users))
        profile = get_profile(args.profile)
        traffic_cfg = traffic.TrafficConfig(
            profile=profile,
            instances=traffic.InstancesDistribution.parse(args.instances, args.single_fraction),
            zipf_alpha=args.zipf_alpha if args.zipf_alpha is not None else profile.zipf_alpha,
            body_format=args.body_format, pool_size=args.pool_size, seed=args.seed,
            form=args.form, context_features=traffic.parse_features(args.context_features))
        host, loopback = check_host(args.host or default_host(), args.allow_remote)
        out = args.out or RESULTS / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        cfg = RunConfig(shape=shape_cfg, traffic=traffic_cfg, host=host, loopback=loopback,
                        model=args.model, thresholds=thresholds, out=out,
                        summary_json=args.summary_json, start_service=not args.no_start,
                        preflight=not args.no_preflight, think_ms=args.think_ms,
                        model_store=args.model_store,
                        sidecar=(args.sidecar.rstrip("/") if args.sidecar
                                 else default_sidecar(host, loopback)))
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run(cfg)
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
