"""HTTP end-to-end throughput and latency at the knee, vs the in-process runtime.

    python -m bench.bench_e2e [--quick] [--url http://127.0.0.1:8080]

Drives ``POST /predictions/dlrm`` over loopback with a bounded load generator: C threads,
each with one ``httpx.Client`` holding one persistent HTTP/1.1 connection, send
pre-encoded bodies back to back for a fixed time (and at most ``--max-requests`` per
step). For requests of 1, 64 and 512 instances it raises C (1, 2, 4, ...) and reads the
knee off the steps with the project's one knee rule (:mod:`serve.ops.knee`: the step
that last raised throughput by >= 5%, before the first step with an error or a p99 over
``--p99-goal-ms``, by default the service's 60 ms goal, ``serve.constants.P99_SLO_MS``;
``--no-p99-goal``: none, the knee is then where throughput stops rising). It stops
raising C two steps past the knee, or when p99 explodes (> 4x the knee's): more
concurrency would only queue. Every size runs per body form
(``--forms``): JSON rows, JSON columnar and binary columnar
(``application/x-dlrm-columnar``: no JSON decoding in the worker).

Efficiency = e2e samples/s at the knee / in-process ``Runtime.predict`` samples/s at the
same batch (measured here, same artifact and handler settings, same thread count as
the worker). Where time goes: client latency vs the handler's own time (its
``dlrm_request_duration_seconds``) and stages (decode / embedding / dense) read from the
worker's Prometheus multiprocess files; the rest is the frontend + IPC.

Starts the service with ``serve.ops.launcher`` if nothing answers at ``--url`` (and stops it
at the end). Writes ``bench/results/e2e.json``:
``{"rows": [{"instances_per_request", "samples_per_s", "p50_ms", "p99_ms", "efficiency", ...}]}``.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from serve import settings
from serve.constants import P99_SLO_MS
from serve.errors import CapacityError, ConfigError
from serve.ops.knee import find_knee
from serve.ops.machine import announce

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench_e2e")


@dataclass
class Step:
    concurrency: int
    requests: int
    errors: int
    seconds: float
    samples_per_s: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_cores: dict[str, float] | None = None  # CPU seconds / wall seconds per process group


class CpuMeter:
    """CPU use of the TorchServe frontend (java), its workers and this client, per step.

    Answers "what limits it": a part near its core budget is the bottleneck.
    """

    def __init__(self, torchserve_pid: int | None) -> None:
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(torchserve_pid) if torchserve_pid else None
        self.me = psutil.Process()

    def _groups(self) -> dict[str, list]:
        groups: dict[str, list] = {"client": [self.me]}
        if self.root is not None:
            try:
                for p in self.root.children(recursive=True):
                    name = "frontend" if "java" in p.name() else "workers"
                    groups.setdefault(name, []).append(p)
            except self._psutil.Error:
                pass
        return groups

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, procs in self._groups().items():
            for p in procs:
                try:
                    t = p.cpu_times()
                    out[f"{name}:{p.pid}"] = t.user + t.system
                except self._psutil.Error:
                    pass
        return out

    @staticmethod
    def cores(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
        use: dict[str, float] = {}
        for key, v in after.items():
            name = key.split(":")[0]
            use[name] = use.get(name, 0.0) + (v - before.get(key, 0.0)) / wall
        return {k: round(v, 2) for k, v in sorted(use.items())}


FORMS = ("rows", "columnar", "binary")


def _content_type(form: str) -> str:
    from serve.api.request import BINARY_MEDIA_TYPE, JSON_MEDIA_TYPE

    return BINARY_MEDIA_TYPE if form == "binary" else JSON_MEDIA_TYPE


def _bodies(instances: int, count: int, seed: int, form: str = "rows") -> list[bytes]:
    from serve.api.binary import example_binary
    from serve.api.json_body import example_request

    # ids spread over a large range; the runtime wraps them modulo table rows
    if form == "binary":
        return [example_binary(instances, seed=seed + i) for i in range(count)]
    return [orjson.dumps(example_request(instances, seed=seed + i, form=form))
            for i in range(count)]


def run_step(url: str, bodies: list[bytes], instances: int, concurrency: int, seconds: float,
             max_requests: int, meter: CpuMeter | None = None,
             content_type: str = "application/json") -> Step:
    """C threads, persistent connections, closed loop; bounded by time and count."""
    parsed = urllib.parse.urlsplit(url)
    origin, path = f"{parsed.scheme}://{parsed.netloc}", parsed.path
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    budget = [max_requests]
    lock = threading.Lock()
    stop_at = [0.0]
    barrier = threading.Barrier(concurrency + 1)
    # One keep-alive connection per thread, as a closed-loop client holds; httpx reopens
    # it by itself after an error. trust_env=False: loopback, never through a proxy.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

    def worker(k: int) -> None:
        with httpx.Client(base_url=origin, headers={"Content-Type": content_type},
                          timeout=60.0, limits=limits, trust_env=False) as client:
            i = k
            barrier.wait()
            while time.perf_counter() < stop_at[0]:
                with lock:
                    if budget[0] <= 0:
                        break
                    budget[0] -= 1
                body = bodies[i % len(bodies)]
                i += concurrency
                t0 = time.perf_counter()
                try:
                    ok = client.post(path, content=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.perf_counter() - t0
                if ok:
                    lat[k].append(dt)
                else:
                    errors[k] += 1

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    cpu0 = meter.snapshot() if meter else {}
    t_start = time.perf_counter()
    stop_at[0] = t_start + seconds
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    cpu = CpuMeter.cores(cpu0, meter.snapshot(), wall) if meter else None
    all_lat = np.array([x for xs in lat for x in xs]) * 1e3
    n = int(all_lat.size)
    return Step(concurrency, n, sum(errors), wall, n * instances / wall, n / wall,
                float(np.percentile(all_lat, 50)) if n else float("nan"),
                float(np.percentile(all_lat, 99)) if n else float("nan"), cpu)


def _knee_row(s: Step) -> dict[str, Any]:
    """A step as the knee rule reads it (users = concurrency C)."""
    return {"users": s.concurrency, "name": f"C={s.concurrency}", "rps": s.requests_per_s,
            "instances_per_s": s.samples_per_s, "p50_ms": s.p50_ms,
            "p99_ms": s.p99_ms if s.requests else None, "measured_requests": s.requests,
            "fail_ratio": s.errors / (s.requests + s.errors) if s.requests + s.errors else 0.0}


def measure_knee(url: str, instances: int, seconds: float, max_requests: int,
                 levels: list[int], meter: CpuMeter | None = None, form: str = "rows",
                 p99_goal_ms: float = math.inf) -> tuple[Step, list[Step]]:
    """Step C through ``levels``; the knee step (serve.ops.knee's rule) and every step run.

    Raises:
        CapacityError: the first step already has errors or misses ``p99_goal_ms``.
    """
    bodies = _bodies(instances, 16 if instances >= 64 else 64, seed=instances, form=form)
    ctype = _content_type(form)
    # warm connections + caches
    run_step(url, bodies, instances, 1, min(1.0, seconds), 50, content_type=ctype)
    steps: list[Step] = []
    for c in levels:
        s = run_step(url, bodies, instances, c, seconds, max_requests, meter, ctype)
        steps.append(s)
        print(f"  {instances:4d} inst/req {form:8s} C={c:3d}  {s.samples_per_s:10.0f} samples/s  "
              f"{s.requests_per_s:7.0f} req/s  p50 {s.p50_ms:7.2f} ms  p99 {s.p99_ms:7.2f} ms"
              f"  errors {s.errors}  cpu cores {s.cpu_cores}", flush=True)
        knee = find_knee([_knee_row(x) for x in steps], p99_goal_ms)
        # When to stop raising C (not what the knee is): the walk ended (errors, goal
        # missed), two steps past the knee brought no gain, or p99 exploded.
        if (knee.saturated or len(steps) - 1 - knee.step_index >= 2
                or s.p99_ms > 4 * knee.p99_ms):
            break
    if not steps:
        raise CapacityError("measure_knee needs at least one concurrency level")
    knee = find_knee([_knee_row(x) for x in steps], p99_goal_ms)
    return steps[knee.step_index], steps


def inprocess_samples_per_s(artifact: Path, handler_cfg: dict[str, Any], batch: int,
                            threads: int, seconds: float) -> float:
    """Runtime.predict alone on parsed tensors, same settings as the worker."""
    import torch

    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.api.json_body import example_request
    from serve.runtime.engine import Runtime, SparseBatch
    from serve.worker import runtime_config

    cfg = HandlerConfig.from_dict(handler_cfg)
    torch.set_num_threads(threads)
    rt = Runtime.from_artifact(artifact, runtime_config(cfg, device="cpu", threads=threads))
    batches = []
    for i in range(8):
        p = parse_body(orjson.dumps(example_request(batch, seed=batch + i)), cfg)
        batches.append((torch.from_numpy(p.dense),
                        SparseBatch(torch.from_numpy(p.values), torch.from_numpy(p.lengths))))
    return best_predict_rate(rt, batches, windows=5, window_s=max(0.4, seconds / 5))


def best_predict_rate(rt: Any, batches: Sequence[tuple[Any, Any]], *, windows: int,
                      window_s: float) -> float:
    """Samples/s of ``rt.predict`` cycling over ``batches`` ((dense (B, N), SparseBatch)),
    after two warm-up predicts: the best of ``windows`` windows of at least ``window_s``
    seconds and 3 predicts each (on a shared machine the max is the least disturbed
    estimate)."""
    for d, s in batches[:2]:
        rt.predict(d, s)
    best = 0.0
    for _ in range(windows):
        n = samples = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < window_s or n < 3:
            d, s = batches[n % len(batches)]
            rt.predict(d, s)
            samples += d.shape[0]
            n += 1
        best = max(best, samples / (time.perf_counter() - t0))
    return best


def _handler_snapshot(multiproc_dir: Path | None) -> dict[str, float]:
    """Sums of the handler's own timings from the worker's Prometheus files."""
    if multiproc_dir is None or not multiproc_dir.is_dir():
        return {}
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(multiproc_dir))
    out: dict[str, float] = {}
    for m in reg.collect():
        for s in m.samples:
            if s.name == "dlrm_request_duration_seconds_sum":
                out["handler_s"] = out.get("handler_s", 0.0) + s.value
            elif s.name == "dlrm_request_duration_seconds_count":
                out["handler_n"] = out.get("handler_n", 0.0) + s.value
            elif s.name == "dlrm_stage_duration_seconds_sum":
                k = f"stage_{s.labels.get('stage')}_s"
                out[k] = out.get(k, 0.0) + s.value
            elif s.name == "dlrm_batch_requests_count":
                out["forwards"] = out.get("forwards", 0.0) + s.value
            elif s.name == "dlrm_batch_instances_sum":
                out["forward_instances"] = out.get("forward_instances", 0.0) + s.value
    return out


def _mar_contents(mar: Path, dest: Path) -> tuple[Path, dict[str, Any]]:
    import yaml

    from serve.store.repository import extract_artifact

    with zipfile.ZipFile(mar) as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    # the artifact and a link to the tables folder it references (format 3)
    return extract_artifact(mar, dest), cfg


def _running_pid() -> int | None:
    """TorchServe's pid from `make up` (.run/pids.json), for the CPU split; None if unknown."""
    f = REPO / ".run" / "pids.json"
    try:
        return int(json.loads(f.read_text())["torchserve"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(url: str) -> bool:
    try:
        return httpx.get(f"{url.rstrip('/')}/ping", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="short steps (1.5 s) and concurrency up to 8: a smoke run, not a measurement")
    ap.add_argument("--url", default=f"http://127.0.0.1:{settings.TS_INFERENCE_PORT.get_port()}",
                    help="TorchServe inference URL (loopback only)")
    ap.add_argument("--model-name", default="dlrm")
    ap.add_argument("--model-store", default="model_store",
                    help="the model repository (model_store/dlrm-<version>.mar + .json)")
    ap.add_argument("--version", default=None,
                    help="model version to serve when this benchmark starts the service "
                         "(default: the one `make up` would serve: .run/state.yaml's, else "
                         "what `make model` builds)")
    ap.add_argument("--multiproc-dir", default=".run/prometheus",
                    help="the workers' PROMETHEUS_MULTIPROC_DIR (handler timings for the profile)")
    ap.add_argument("--instances", default="1,64,512", help="instances per request, comma-separated")
    ap.add_argument("--forms", default="rows,columnar,binary",
                    help="body forms to measure, comma-separated (rows, columnar: JSON; binary: "
                         "application/x-dlrm-columnar, no JSON decoding in the worker); columnar "
                         "and binary are skipped for 1-instance requests, where decoding is not "
                         "what limits throughput")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per concurrency step")
    ap.add_argument("--max-requests", type=int, default=200_000, help="hard cap per step")
    goal_flags = ap.add_mutually_exclusive_group()
    goal_flags.add_argument("--p99-goal-ms", type=float, default=P99_SLO_MS,
                      help="latency bound of the knee (serve.ops.knee's rule; default the "
                           "service's goal, 60 ms, as MLPerf DLRM-v2's server scenario): a "
                           "knee past the goal is capacity no user would accept")
    goal_flags.add_argument("--no-p99-goal", action="store_true",
                      help="no latency bound (the old behaviour): the knee is where throughput "
                           "stops rising, the in-process runtime's fair comparison")
    ap.add_argument("--out", default="bench/results/e2e.json")
    return ap


def _cases(args: argparse.Namespace) -> tuple[list[tuple[int, str]], str | None]:
    """(instances per request, body form) to measure; or the error line to print."""
    sizes = [int(x) for x in args.instances.split(",")]
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if not forms or set(forms) - set(FORMS):
        return [], f"error: --forms {args.forms!r}: use any of {', '.join(FORMS)}"
    cases = [(n, f) for n in sizes for f in forms if not (f in ("columnar", "binary") and n == 1)]
    if not cases:
        return [], (f"error: --forms {args.forms!r} with --instances {args.instances!r} leaves "
                    "nothing to measure (columnar and binary skip 1-instance requests)")
    return cases, None


def _service_for(args: argparse.Namespace, store: Path, mar: Path) -> tuple[Any, Path]:
    """(the service started here, or None when one answers at ``--url``; the workers'
    multiprocess metrics folder)."""
    if _alive(args.url):
        multiproc = Path(args.multiproc_dir)
        return None, multiproc if multiproc.is_absolute() else REPO / multiproc
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launch_ports import free_port_settings
    from serve.ops.launcher import start

    port = urllib.parse.urlsplit(args.url).port or 8080
    print(f"nothing answers at {args.url}; starting the service from {mar} ...", flush=True)
    # its own run/log dirs and free side ports (every one), so it never collides with `make up`
    ports = {**free_port_settings(), "inference_port": port}
    cfg = LaunchConfig(**ports, model_store=store, mar_name=mar.name, sidecar=False, run_dir=Path(".run/bench-e2e"),
                       log_dir=Path("logs/bench-e2e"))
    service = start(cfg)
    print(f"ready in {service.ready_s:.1f} s", flush=True)
    return service, cfg.multiproc_dir


def _profile(before: dict[str, float], after: dict[str, float],
             steps: list[Step]) -> dict[str, Any] | None:
    """Where the handler's time went over the steps (its multiprocess metrics before and
    after); None when the handler recorded no request."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total_requests = sum(s.requests for s in steps)
    if not delta.get("handler_n"):
        return None
    client_ms = (statistics.fmean([s.p50_ms for s in steps]))
    return {
        "handler_ms_per_request": round(1e3 * delta["handler_s"] / delta["handler_n"], 3),
        "decode_ms_per_request": round(1e3 * delta.get("stage_decode_s", 0.0) / delta["handler_n"], 3),
        "embedding_ms_per_forward": round(1e3 * delta.get("stage_embedding_s", 0.0) / max(1.0, delta.get("forwards", 0.0)), 3),
        "dense_ms_per_forward": round(1e3 * delta.get("stage_dense_s", 0.0) / max(1.0, delta.get("forwards", 0.0)), 3),
        "instances_per_forward": round(delta.get("forward_instances", 0.0) / max(1.0, delta.get("forwards", 0.0)), 1),
        "client_p50_ms_mean_over_steps": round(client_ms, 3),
        "requests_seen_by_handler": int(delta["handler_n"]),
        "requests_sent": total_requests,
    }


@dataclass(frozen=True)
class _Bench:
    """What every case of one run measures against: the service, the model, the steps."""

    url: str
    artifact: Path
    handler_cfg: dict[str, Any]
    inproc_threads: int
    seconds: float
    levels: list[int]
    meter: CpuMeter
    multiproc: Path


def _measure_case(b: _Bench, n: int, form: str, args: argparse.Namespace
                  ) -> dict[str, Any] | None:
    """One row: the knee of ``n``-instance ``form`` requests beside the in-process rate;
    None when there is no knee (said why)."""
    # in-process before and after the HTTP steps (the service idle both times);
    # the higher is the least disturbed by other load on the host
    inproc_before = inprocess_samples_per_s(b.artifact, b.handler_cfg, n, b.inproc_threads,
                                            min(b.seconds, 3.0))
    before = _handler_snapshot(b.multiproc)
    t0 = time.perf_counter()
    try:
        knee, steps = measure_knee(b.url, n, b.seconds, args.max_requests, b.levels, b.meter,
                                   form, args.p99_goal_ms)
    except CapacityError as e:
        print(f"  -> {n} inst/req {form}: no knee: {e.message}", flush=True)
        return None
    after = _handler_snapshot(b.multiproc)
    inproc = max(inproc_before, inprocess_samples_per_s(
        b.artifact, b.handler_cfg, n, b.inproc_threads, min(b.seconds, 3.0)))
    row: dict[str, Any] = {
        "instances_per_request": n, "form": form, "samples_per_s": round(knee.samples_per_s, 1),
        "p50_ms": round(knee.p50_ms, 3), "p99_ms": round(knee.p99_ms, 3),
        "efficiency": round(knee.samples_per_s / inproc, 3),
        "concurrency": knee.concurrency, "cpu_cores_at_knee": knee.cpu_cores, "requests_per_s": round(knee.requests_per_s, 1),
        "inprocess_samples_per_s": round(inproc, 1), "inprocess_threads": b.inproc_threads, "errors": sum(s.errors for s in steps),
        "steps": [asdict(s) for s in steps],
    }
    profile = _profile(before, after, steps)
    if profile is not None:
        row["profile"] = profile
    print(f"  -> knee C={knee.concurrency}: {knee.samples_per_s:.0f} samples/s, "
          f"in-process {inproc:.0f} samples/s, efficiency {row['efficiency']:.2f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if "profile" in row:
        print(f"     profile: {row['profile']}", flush=True)
    return row


def _measure_all(args: argparse.Namespace, mar: Path, cases: list[tuple[int, str]],
                 url: str, seconds: float, levels: list[int], meter: CpuMeter,
                 multiproc: Path) -> list[dict[str, Any]]:
    """Every case's row against the model of ``mar``, in order."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        artifact, mcfg = _mar_contents(mar, Path(tmp))
        handler_cfg = mcfg.get("handler", {})
        workers = int(mcfg.get("maxWorkers", 1))
        from serve.api.config import default_num_threads

        threads = handler_cfg.get("num_threads") or default_num_threads(workers)
        # the in-process reference gets the same cores the service uses in all
        inproc_threads = max(1, min(workers * threads, default_num_threads(1)))
        print(f"model: {mar} (batchSize {mcfg.get('batchSize')}, maxBatchDelay "
              f"{mcfg.get('maxBatchDelay')} ms, {workers} worker(s) x {threads} thread(s))")
        bench = _Bench(url, artifact, handler_cfg, inproc_threads, seconds, levels, meter,
                       multiproc)
        for n, form in cases:
            row = _measure_case(bench, n, form, args)
            if row is not None:
                rows.append(row)
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print()
    print(f"{'inst/req':>8} {'form':>8} {'C':>3} {'samples/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'in-proc/s':>10} {'efficiency':>10}")
    for r in rows:
        print(f"{r['instances_per_request']:8d} {r['form']:>8} {r['concurrency']:3d} {r['samples_per_s']:10.0f} "
              f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['inprocess_samples_per_s']:10.0f} "
              f"{r['efficiency']:10.2f}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM unwinds like an exception, so the service a run started is stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.no_p99_goal:
        args.p99_goal_ms = math.inf
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # httpx logs every request at INFO: on the load generator's hot path that costs CPU.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    host = urllib.parse.urlsplit(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"error: --url {args.url}: this load generator only targets loopback", file=sys.stderr)
        return 2
    seconds = args.seconds or (1.5 if args.quick else 8.0)
    levels = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    cases, error = _cases(args)
    if error is not None:
        print(error, file=sys.stderr)
        return 2

    machine = announce()
    store = Path(args.model_store)
    store = store if store.is_absolute() else REPO / store
    from serve.ops.launch_state import served_version
    from serve.state import LOCAL_STATE_FILE
    from serve.store.repository import DEFAULT_PROFILE, ModelRepository, default_version

    repo = ModelRepository([store], args.model_name)
    # make up's version, never the newest file (an import of another request schema)
    try:
        version = args.version or served_version(REPO / LOCAL_STATE_FILE, repo,
                                                 default_version(DEFAULT_PROFILE))
    except ConfigError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    mar = repo.archive(version)  # ConfigError lists the versions there are
    service, multiproc = _service_for(args, store, mar)
    url = f"{args.url}/predictions/{args.model_name}"
    meter = CpuMeter(service.torchserve.pid if service is not None else _running_pid())
    try:
        rows = _measure_all(args, mar, cases, url, seconds, levels, meter, multiproc)
    finally:
        if service is not None:
            service.stop()
    _print_rows(rows)
    out = Path(args.out)
    out = out if out.is_absolute() else REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    goal = args.p99_goal_ms if math.isfinite(args.p99_goal_ms) else None
    out.write_text(json.dumps({"quick": args.quick, "url": args.url, "mar": str(mar),
                               "p99_goal_ms": goal, "rows": rows, "machine": machine},
                              indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
