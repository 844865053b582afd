"""The highest query rate the real service holds at p99 <= 60 ms: open-loop Poisson
arrivals of ranking queries, in the manner of MLPerf Inference's Server scenario.

    python -m bench.bench_slo                               # small and dlrm-v2, own service
    python -m bench.bench_slo --models small --min-duration-s 5 --min-queries 100   # smoke
    python -m bench.bench_slo --url http://127.0.0.1:8080   # against a running `make up`

What it measures, per model (a served version): queries arrive as a Poisson process at
a rate R (queries/s); each query ranks B user-item pairs, B drawn from the load test's
law (:class:`loadtest.traffic.InstancesDistribution`: 100-700 pairs, mean 270, with
``--single-fraction`` single-pair queries mixed in, 0 by default as in MLPerf). A trial
sends at R until it has lasted ``--min-duration-s`` *and* sent ``--min-queries``
(LoadGen's two minimums). The search starts below both half the rate the in-process
reference could sustain and 0.7 x what the workers answer one query at a time at the
unloaded latency. A trial passes when every query was answered 200, its p99 latency
(measured from the query's *scheduled* time, so a late send is charged to the latency,
not hidden) is <= ``--p99-goal-ms``, and the client kept to its schedule. The search
(:func:`search_rate`) multiplies R by ``--growth`` (1.5) from the start until a trial
fails (dividing if the first one fails), then bisects between the best passing and the
lowest failing rate until they are within ``--rel-tol``. The service idles ``--settle-s``
before each trial.

Where a query's CPU goes: each trial splits the machine's CPU time between the client,
TorchServe's frontend, its workers, the sidecar and the rest (:mod:`bench.cpu_account`,
from the service's process groups), per query answered; beside the in-process
reference's CPU per query (``in_process_cpu_ms_per_query``), it shows what the serving
path adds. ``--body binary`` sends the same queries in the binary columnar form.

A trial over capacity stops early, failed, with its verdict already certain: once more
than 1% of its planned queries are known to be late (answered late, refused, or still
unanswered past the goal) its p99 cannot pass; and once ``--max-in-flight`` queries
(TorchServe's ``job_queue_size``) are unanswered, the service is about to refuse
requests, which would fail it too. So overload trials end before the service sheds a
request: 0 failed requests in every trial is a property of a healthy run, and
``failed_all_trials`` in the results says whether it held.

The client must never be the bottleneck: one asyncio loop sends each query at its
scheduled time without waiting for earlier answers (open loop), over kept-alive HTTP/1.1
connections (:class:`bench.http1.Http1Pool`: request heads built once, answers read by
length): it shares the cores with the service, so every millisecond of CPU it spends is
the service's loss (docs/benchmarks-slo.md compares it with the ``httpx`` client it
replaced). Its own lag (actual - scheduled send time) is reported; a trial whose p99 lag
exceeds ``--max-client-lag-ms`` is invalid (it counts as failed and is flagged: the rate found is
then a lower bound set by the client, not by the service).

Beside the HTTP figures, in the same run: ``Runtime.predict`` in process on the same
bodies (same request sizes), with as many torch threads as the service has in all
(workers x threads per worker), and for each model its dense FLOPs per pair
(:func:`dense_flops_per_pair`) against this CPU's measured GEMM peak
(:func:`gemm_peak`, fp32 and bf16, same threads).

State: without ``--url`` it starts its own service (real TorchServe + sidecar, shipped
defaults, free loopback ports, :func:`serve.ops.launcher.running_service`) per model.
The state measured (version, batching, workers, threads, tuner on/off) is read from the
sidecar's ``GET /state`` and ``GET /tuner`` before and after, printed with the figures and
written to ``bench/results/slo.json``:
``{"runs": [{"model", "queries_per_s", "pairs_per_s", "pairs_per_s_per_core", "p99_ms",
"in_process_pairs_per_s", ...}], "meta": {...}, "command": "..."}``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import math
import os
import shlex
import signal
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.traffic import InstancesDistribution, parse_features
from serve.constants import P99_SLO_MS, REQUEST_FORMS

__all__ = [
    "MODELS",
    "REQUIRED_RUN_KEYS",
    "SearchResult",
    "Trial",
    "as_context",
    "dense_flops_per_pair",
    "gemm_peak",
    "main",
    "poisson_schedule",
    "query_sizes",
    "search_rate",
    "trial_queries",
    "validate_results",
]

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench.slo")

#: Model name on the command line -> served version (what `make model` / `make
#: example-dlrmv2` build) and how to build it when it is missing.
MODELS: dict[str, tuple[str, str]] = {
    "small": ("small-int8-s0", "make model"),
    "dlrm-v2": ("dlrm-v2-int8", "make example-dlrmv2"),
}
#: Keys every entry of results["runs"] has (tests pin the schema).
REQUIRED_RUN_KEYS = ("model", "queries_per_s", "pairs_per_s", "pairs_per_s_per_core", "p99_ms",
                     "in_process_pairs_per_s", "form", "served_cpu_per_pair_ratio")
#: MLPerf Inference DLRM-v2 Server anchor (CPU, INT8 AMX, one Xeon 6980P socket, 128 cores,
#: p99 < 50 ms), for the comparison printed beside ours; see docs/benchmarks-slo.md.
MLPERF_ANCHOR = {"queries_per_s_per_socket": 9.2e3, "pairs_per_s_per_socket": 2.5e6,
                 "cores": 128, "pairs_per_s_per_core": 19.5e3, "p99_ms": 50.0}


# --- pure parts: schedule, sizes, search, FLOPs ---------------------------------------

def poisson_schedule(rate_qps: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Send times (s, float64 (n,), increasing from the first gap) of ``n`` Poisson
    arrivals at ``rate_qps``: cumulative sums of exponential gaps of mean 1/rate."""
    if not (rate_qps > 0 and math.isfinite(rate_qps)):
        raise ValueError(f"rate {rate_qps} queries/s must be a finite number > 0")
    if n < 1:
        raise ValueError(f"query count {n} must be >= 1")
    return np.cumsum(rng.exponential(1.0 / rate_qps, size=n))


def trial_queries(rate_qps: float, min_duration_s: float, min_queries: int) -> int:
    """Queries a trial at ``rate_qps`` sends: enough to last ``min_duration_s`` and at
    least ``min_queries`` (LoadGen's minimum duration and minimum query count)."""
    return max(int(min_queries), math.ceil(rate_qps * min_duration_s))


def query_sizes(n: int, seed: int, single_fraction: float = 0.0) -> np.ndarray:
    """Pairs per query, int64 (n,): the load test's ranking law (``loadtest.traffic``'s
    default 100-700:270), stratified so a small pool keeps the law's mean."""
    law = InstancesDistribution(single_fraction=single_fraction)
    return law.stratified(np.random.default_rng([seed, 32]), n)


#: Connections a trial opens before its first query (:func:`_open_loop`).
WARM_CONNECTIONS = 32

#: Why a trial stopped before its planned queries (:func:`_open_loop`).
STOP_REASONS = {"late": "over the goal for sure",
                "in_flight": "the service's queue about to overflow"}


@dataclass(frozen=True)
class Trial:
    """One trial at an offered rate. Latencies in ms from the scheduled send time."""

    rate_qps: float
    queries: int
    seconds: float              # trial start to last scheduled send (the rates' denominator)
    failed: int
    pairs: int                  # pairs of the queries answered 200
    p50_ms: float
    p99_ms: float
    lag_p99_ms: float           # client: actual - scheduled send time
    lag_max_ms: float
    client_ok: bool
    passed: bool
    first_error: str | None = None
    wall_s: float = 0.0         # first scheduled send to last answer
    stopped_early: str | None = None  # why it ended before its planned queries: "late"
                                      # (over the goal for sure) or "in_flight" (the
                                      # service's queue about to overflow)
    # CPU ms per query answered by part (bench.cpu_account.GROUPS, "total", "busy_cores",
    # and "workers_predict": the workers' CPU inside Runtime.predict, from their
    # dlrm_predict_cpu_seconds_total, where the sidecar serves it); None when not measured
    cpu_ms_per_query: dict[str, float] | None = None

    @property
    def queries_per_s(self) -> float:
        return self.queries / self.seconds if self.seconds > 0 else 0.0

    @property
    def pairs_per_s(self) -> float:
        return self.pairs / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SearchResult:
    """The best passing trial (None: none passed), every trial in order, and whether a
    client-limited (invalid) trial bounded the search from above."""

    best: Trial | None
    trials: list[Trial] = field(default_factory=list)
    client_limited: bool = False
    stop_reason: str = ""


def search_rate(measure: Callable[[float], Trial], start_qps: float, *, growth: float = 2.0,
                rel_tol: float = 0.05, max_trials: int = 14, min_qps: float = 0.5) -> SearchResult:
    """The highest rate whose trial passes: coarse then bisect.

    Coarse: from ``start_qps``, multiply by ``growth`` while trials pass (divide while
    they fail, down to ``min_qps``). Bisect: between the best passing rate and the lowest
    failing one until ``hi / lo - 1 <= rel_tol``. ``measure(rate)`` runs one trial; it
    may be a pure function (rate -> Trial) in tests. Latency grows with rate, so one
    crossing is assumed; a noisy pass above a failure only raises ``lo`` if it is
    still below ``hi``.
    """
    if not (start_qps > 0 and growth > 1 and 0 < rel_tol < 1 and max_trials >= 1):
        raise ValueError(f"search needs start_qps > 0, growth > 1, 0 < rel_tol < 1, "
                         f"max_trials >= 1; got {start_qps}, {growth}, {rel_tol}, {max_trials}")
    out = SearchResult(best=None)
    lo: Trial | None = None
    hi: float | None = None
    hi_client = False
    rate = start_qps
    while len(out.trials) < max_trials:
        t = measure(rate)
        out.trials.append(t)
        if t.passed and (hi is None or t.rate_qps < hi):
            if lo is None or t.rate_qps > lo.rate_qps:
                lo = t
        elif not t.passed and (hi is None or t.rate_qps < hi):
            hi, hi_client = t.rate_qps, not t.client_ok
        if lo is not None and hi is not None:
            if hi / lo.rate_qps - 1.0 <= rel_tol:
                out.stop_reason = f"bracketed within {rel_tol:.0%}: pass {lo.rate_qps:.1f}, fail {hi:.1f}"
                break
            rate = 0.5 * (lo.rate_qps + hi)
        elif lo is not None:
            rate = lo.rate_qps * growth
        else:
            rate = t.rate_qps / growth
            if rate < min_qps:
                out.stop_reason = f"no rate >= {min_qps} queries/s passes"
                break
    else:
        out.stop_reason = f"stopped after {max_trials} trials"
    out.best = lo
    out.client_limited = hi_client
    return out


def dense_flops_per_pair(linear: Sequence[tuple[int, int]], *, interaction: str = "none",
                         num_vectors: int = 0, dim: int = 0, cross_layers: int = 0,
                         cross_rank: int = 0, cross_width: int = 0) -> int:
    """Dense FLOPs per pair (multiply and add counted as 2), biases and activations left out.

    Formula: ``2 * sum(in * out)`` over every matrix of the bottom and top MLPs
    (``linear``: (in, out) per layer), plus the interaction:

    - ``"dot"`` (TorchRec ``DLRM``): pairwise dot products of V = ``num_vectors`` vectors
      (F pooled embeddings + the bottom MLP's output) of ``dim`` D: ``D * V * (V - 1)``
      (V choose 2 dots of 2D FLOPs each).
    - ``"dcn"`` (``DLRM_DCN``, low-rank DCNv2): per cross layer, x_{l+1} = x_0 * (W (V x_l)
      + b) + x_l with V (r x d), W (d x r): ``4 d r + 3 d`` (two matmuls, bias, product,
      sum), d = ``cross_width`` = (F + 1) D, r = ``cross_rank``.
    """
    flops = 2 * sum(int(i) * int(o) for i, o in linear)
    if interaction == "dot":
        flops += dim * num_vectors * (num_vectors - 1)
    elif interaction == "dcn":
        flops += cross_layers * (4 * cross_width * cross_rank + 3 * cross_width)
    elif interaction != "none":
        raise ValueError(f"interaction {interaction!r} must be 'none', 'dot' or 'dcn'")
    return flops


def artifact_dense_flops(artifact: Any) -> dict[str, Any]:
    """:func:`dense_flops_per_pair` of an artifact, from its dense layers' weight shapes,
    with the shapes it read (so the figure can be checked by hand)."""
    import torch

    from serve.runtime.artifact import DLRMDense

    schema = artifact.schema
    dense = artifact.dense
    if isinstance(dense, DLRMDense):
        linear = [(int(w.shape[1]), int(w.shape[0])) for w, _ in dense.dense_arch]
        linear += [(int(w.shape[1]), int(w.shape[0])) for w, _ in dense.over_arch]
        nf = len(schema.feature_names)
        d = int(dense.dense_arch[-1][0].shape[0])
        flops = dense_flops_per_pair(linear, interaction="dot", num_vectors=nf + 1, dim=d)
        return {"flops_per_pair": flops, "kind": "dlrm (dot interaction)", "linear": linear,
                "interaction": {"vectors": nf + 1, "dim": d}}
    from serve.runtime.program_check import check_program

    check_program(dense.program)   # refuses pickled payloads before torch runs them (N3)
    ep = torch.export.load(io.BytesIO(dense.program.numpy().tobytes()))
    params = dict(ep.state_dict)
    linear = []
    v_kernels = sorted((k, tuple(p.shape)) for k, p in params.items() if ".V_kernels." in k)
    for k, p in params.items():
        if p.dim() == 2 and ("dense_arch" in k or "over_arch" in k) and k.endswith("weight"):
            linear.append((int(p.shape[1]), int(p.shape[0])))
    if v_kernels:
        r, width = v_kernels[0][1]
        flops = dense_flops_per_pair(linear, interaction="dcn", cross_layers=len(v_kernels),
                                     cross_rank=int(r), cross_width=int(width))
        kind = f"dcn ({len(v_kernels)} low-rank cross layers, r {r}, d {width})"
        inter = {"cross_layers": len(v_kernels), "rank": int(r), "width": int(width)}
    else:
        flops = dense_flops_per_pair(linear)
        kind, inter = "linear layers only (interaction not recognised: left out)", {}
    return {"flops_per_pair": flops, "kind": kind, "linear": linear, "interaction": inter}


# --- the GEMM peak and the in-process reference --------------------------------------

def gemm_peak(threads: int, sizes: Sequence[int] = (512, 1024, 2048),
              dtypes: Sequence[str] = ("fp32", "bf16"), seconds: float = 1.0) -> dict[str, Any]:
    """This CPU's matmul FLOP/s (``torch.matmul`` of n x n by n x n: 2 n^3 FLOPs) per dtype
    and size, best of 3 windows of ``seconds / 3`` each, with ``threads`` torch threads;
    ``peak`` per dtype.

    A dtype this CPU has no fast kernel for (bf16 without AVX-512 BF16 or AMX: ~1 GFLOP/s,
    a 2048 square takes ~10 s) would take minutes for the windows: once one product takes
    longer than a window, that product's own rate stands for its size and the larger sizes
    of the dtype are skipped (listed in ``skipped``; they could only confirm a slow peak).
    """
    import torch

    torch.set_num_threads(threads)
    kinds = {"fp32": torch.float32, "bf16": torch.bfloat16}
    out: dict[str, Any] = {"threads": threads, "by_size": {}, "peak": {}, "skipped": []}
    window = seconds / 3
    for name in dtypes:
        best_of_dtype = 0.0
        for i, n in enumerate(sizes):
            a = torch.randn(n, n).to(kinds[name])
            b = torch.randn(n, n).to(kinds[name])
            t0 = time.perf_counter()
            torch.matmul(a, b)
            once = time.perf_counter() - t0
            slow = once > window
            best = 2.0 * n ** 3 / once if slow else 0.0
            for _ in range(0 if slow else 3):
                k, t0 = 0, time.perf_counter()
                while k < 2 or time.perf_counter() - t0 < window:
                    torch.matmul(a, b)
                    k += 1
                best = max(best, 2.0 * n ** 3 * k / (time.perf_counter() - t0))
            out["by_size"][f"{name}_{n}"] = best
            best_of_dtype = max(best_of_dtype, best)
            if slow:
                out["skipped"].extend(f"{name}_{m}" for m in sizes[i + 1:])
                break
        out["peak"][name] = best_of_dtype
    return out


def inprocess_pairs_per_s(artifact_path: Path, handler_cfg: dict[str, Any], schema: Any,
                          bodies: Sequence[tuple[bytes, int]], content_type: str, threads: int,
                          seconds: float) -> float:
    """``Runtime.predict`` alone over the same bodies (parsed up front), one predict per
    query, ``threads`` torch threads, the worker's runtime settings; best of 3 windows (the
    least disturbed on a shared machine)."""
    from bench.bench_e2e import best_predict_rate

    rt, batches = _inprocess_batches(artifact_path, handler_cfg, schema, bodies, content_type,
                                     threads)
    return best_predict_rate(rt, batches, windows=3, window_s=max(0.3, seconds / 3))


def _inprocess_batches(artifact_path: Path, handler_cfg: dict[str, Any], schema: Any,
                       bodies: Sequence[tuple[bytes, int]], content_type: str, threads: int
                       ) -> tuple[Any, list[tuple[Any, Any]]]:
    """A runtime with the worker's settings and ``threads`` torch threads, and the bodies
    parsed up front as the worker merges them ((dense, SparseBatch) per query, a ranking
    request's context kept once)."""
    import torch

    from serve.api.batch import merge_requests
    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.runtime.engine import Runtime, SparseBatch
    from serve.worker import runtime_config

    cfg = HandlerConfig.from_dict(handler_cfg)
    torch.set_num_threads(threads)
    rt = Runtime.from_artifact(artifact_path, runtime_config(cfg, device="cpu", threads=threads))
    batches = []
    for body, _ in bodies:
        m = merge_requests([parse_body(body, cfg, content_type, schema=schema)])
        batches.append((torch.from_numpy(m.dense), SparseBatch(
            torch.from_numpy(m.values), torch.from_numpy(m.lengths), m.shared,
            None if m.bag_of is None else torch.from_numpy(m.bag_of))))
    return rt, batches


def inprocess_cpu_ms_per_pair(artifact_path: Path, handler_cfg: dict[str, Any], schema: Any,
                              bodies: Sequence[tuple[bytes, int]], content_type: str,
                              threads: int, seconds: float) -> float:
    """CPU ms per candidate pair of ``Runtime.predict`` alone on the same queries, with one
    worker's ``threads``: the least of 3 windows of ``seconds / 3`` (the least disturbed).

    The clock: with one thread, this thread's own CPU (``time.thread_time``). The whole
    process's clock also counted the OpenMP threads of the 2-thread throughput run just
    before, which spin for a while after their last region, and this process's other
    threads: it read 18.6 and 27.6 us per pair in two runs of the same code. With more
    threads, the process's CPU (the work is spread over them)."""
    rt, batches = _inprocess_batches(artifact_path, handler_cfg, schema, bodies,
                                     content_type, threads)
    for d, sb in batches[:2]:
        rt.predict(d, sb)
    clock = time.thread_time if threads == 1 else time.process_time
    best = math.inf
    for _ in range(3):
        n = pairs = 0
        c0, t0 = clock(), time.perf_counter()
        while time.perf_counter() - t0 < max(0.3, seconds / 3) or n < 3:
            d, sb = batches[n % len(batches)]
            rt.predict(d, sb)
            pairs += d.shape[0]
            n += 1
        best = min(best, (clock() - c0) * 1e3 / pairs)
    return best


# --- the open-loop client --------------------------------------------------------------

class _Tally:
    """Per-query results of one open-loop trial (``lag``, ``lat`` in s, ``ok``) and its
    count of queries known to miss ``late_s``."""

    def __init__(self, n: int, late_s: float) -> None:
        self.late_s = late_s
        self.lag = np.zeros(n)
        self.lat = np.full(n, np.nan)
        self.ok = np.zeros(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)
        self.counted = np.zeros(n, dtype=bool)      # already counted as late
        self.errors: list[str] = []
        self.late = self.answered = 0
        self.overdue = 0      # queries before this one were due more than late_s ago

    def error(self, message: str) -> None:
        if len(self.errors) < 3:
            self.errors.append(message)

    def answered_at(self, i: int, due: float) -> None:
        """Query ``i`` (scheduled at ``due``) has its answer, or its error."""
        self.lat[i] = time.perf_counter() - due
        self.done[i] = True
        self.answered += 1
        if (self.lat[i] > self.late_s or not self.ok[i]) and not self.counted[i]:
            self.counted[i] = True
            self.late += 1

    def count_overdue(self, i: int, t0: float, offsets: np.ndarray, now: float) -> None:
        """Count as late the queries before ``i`` still unanswered ``late_s`` after their
        scheduled time (``t0 + offsets``): late for sure."""
        while self.overdue < i and t0 + offsets[self.overdue] < now - self.late_s:
            if not self.done[self.overdue] and not self.counted[self.overdue]:
                self.counted[self.overdue] = True
                self.late += 1
            self.overdue += 1

    def stop_reason(self, i: int, max_late: int | None,
                    max_in_flight: int | None) -> str | None:
        """Why query ``i`` is not sent (see :func:`_open_loop`); None: send it."""
        if max_late is not None and self.late > max_late:
            return "late"
        if max_in_flight is not None and i - self.answered >= max_in_flight:
            return "in_flight"
        return None


async def _open_loop(url: str, bodies: Sequence[tuple[bytes, int]], offsets: np.ndarray,
                     picks: np.ndarray, content_type: str, timeout_s: float,
                     max_connections: int, late_s: float = math.inf,
                     max_late: int | None = None,
                     max_in_flight: int | None = None) -> dict[str, Any]:
    """Send query i at ``offsets[i]`` without waiting for earlier answers.

    Early stop (no further query is sent; the ones in flight are awaited):

    - ``late``: once more than ``max_late`` queries are known to miss ``late_s``
      (answered late or not 200, or still unanswered ``late_s`` after their scheduled
      time), the trial's p99 is over the goal whatever comes next;
    - ``in_flight``: once ``max_in_flight`` queries are unanswered, the service's queue
      is about to overflow, and a refused query fails the trial anyway.

    Either way an overloaded trial ends before the server has to refuse requests.
    Result: per query sent ``lag``, ``lat`` (s), ``ok``; ``sent``; ``stopped``: None,
    ``"late"`` or ``"in_flight"``."""
    from bench.http1 import Http1Error, Http1Pool

    n = len(offsets)
    tally = _Tally(n, late_s)
    stopped: str | None = None
    parts = urllib.parse.urlsplit(url)
    root, path = f"{parts.scheme}://{parts.netloc}", parts.path
    async with Http1Pool(root, max_connections=max_connections, timeout_s=timeout_s,
                         headers={"Content-Type": content_type}) as client:

        async def one(i: int, due: float) -> None:
            tally.lag[i] = time.perf_counter() - due
            body = bodies[picks[i]][0]
            try:
                status, answer = await client.request("POST", path, body)
                tally.ok[i] = status == 200
                if not tally.ok[i]:
                    tally.error(f"HTTP {status}: {answer[:200].decode('utf-8', 'replace')}")
            except Http1Error as e:
                tally.error(str(e))
            tally.answered_at(i, due)

        # Open the connections a trial keeps in flight before it starts, as a long-lived
        # client has them: connecting (TorchServe's accept, TCP set-up) inside the first
        # queries would charge the client's start-up to the service's tail.
        with contextlib.suppress(Http1Error):
            await asyncio.gather(*(client.request("GET", "/ping")
                                   for _ in range(min(WARM_CONNECTIONS, max_connections))))
        tasks = []
        t0 = time.perf_counter() + 0.05
        for i in range(n):
            now = time.perf_counter()
            tally.count_overdue(i, t0, offsets, now)
            stopped = tally.stop_reason(i, max_late, max_in_flight)
            if stopped is not None:
                break
            due = t0 + float(offsets[i])
            delay = due - now
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
        end = time.perf_counter()
    sent = len(tasks)
    return {"lag": tally.lag[:sent], "lat": tally.lat[:sent], "ok": tally.ok[:sent],
            "errors": tally.errors, "seconds": end - t0, "sent": sent, "stopped": stopped}


def unloaded_latency_ms(url: str, bodies: Sequence[tuple[bytes, int]], n: int,
                        content_type: str, timeout_s: float = 60.0) -> np.ndarray:
    """Latencies (ms, (n,)) of ``n`` queries sent one at a time (the next after the answer):
    the service time with no queueing. Open-loop arrivals at any rate only add queueing to
    it, so when its p99 is over the goal no rate can pass."""
    from bench.http1 import Http1Pool

    parts = urllib.parse.urlsplit(url)

    async def one_at_a_time() -> np.ndarray:
        out = np.zeros(n)
        async with Http1Pool(f"{parts.scheme}://{parts.netloc}", max_connections=1,
                             timeout_s=timeout_s,
                             headers={"Content-Type": content_type}) as client:
            for i in range(n):
                t0 = time.perf_counter()
                status, answer = await client.request("POST", parts.path,
                                                      bodies[i % len(bodies)][0])
                out[i] = (time.perf_counter() - t0) * 1e3
                if status != 200:
                    raise RuntimeError(
                        f"POST {url} answered {status} with no load at all: "
                        f"{answer[:300].decode('utf-8', 'replace')}; see the service's logs")
        return out

    return asyncio.run(one_at_a_time())


def run_trial(url: str, bodies: Sequence[tuple[bytes, int]], rate_qps: float, *,
              min_duration_s: float, min_queries: int, p99_goal_ms: float,
              max_client_lag_ms: float, content_type: str, seed: int = 0,
              timeout_s: float = 30.0, max_connections: int = 1024,
              max_in_flight: int | None = None,
              watch: Callable[[], dict[int, str]] | None = None,
              predict_cpu: Callable[[], float | None] | None = None) -> Trial:
    """One open-loop trial at ``rate_qps`` (see the module docstring). It stops early
    (failed) once more than 1% of its planned queries are known to miss ``p99_goal_ms``
    (its p99 can no longer pass), or once ``max_in_flight`` queries are unanswered (the
    service's queue is about to overflow, and a refused query fails it anyway): running
    on would only push the service into refusing requests for a verdict already known.

    ``watch``: the processes whose CPU to account (pid -> part, see
    :func:`bench.cpu_account.service_processes`), asked before and after the trial (the
    tuner may restart workers in between); the trial then carries ``cpu_ms_per_query``.
    ``predict_cpu``: the workers' CPU seconds in predict so far (:func:`predict_cpu_reader`),
    read before and after: ``cpu_ms_per_query["workers_predict"]``."""
    from bench import cpu_account

    n = trial_queries(rate_qps, min_duration_s, min_queries)
    rng = np.random.default_rng([seed, int(rate_qps * 1000)])
    offsets = poisson_schedule(rate_qps, n, rng)
    picks = rng.integers(0, len(bodies), size=n)
    max_late = None if math.isinf(p99_goal_ms) else int(0.01 * n)
    pids = watch() if watch is not None else {}
    cpu0, w0 = cpu_account.snapshot(pids), time.perf_counter()
    model0 = predict_cpu() if predict_cpu is not None else None
    r = asyncio.run(_open_loop(url, bodies, offsets, picks, content_type, timeout_s,
                               max_connections, late_s=p99_goal_ms / 1e3, max_late=max_late,
                               max_in_flight=max_in_flight))
    cpu = None
    if watch is not None and r["sent"]:
        pids = {**pids, **watch()}      # workers started during the trial count from 0
        cpu = cpu_account.cpu_ms_per_query(pids, cpu0, cpu_account.snapshot(pids), r["sent"],
                                           time.perf_counter() - w0)
        model1 = predict_cpu() if predict_cpu is not None else None
        if model0 is not None and model1 is not None and model1 >= model0:
            cpu["workers_predict"] = round((model1 - model0) / r["sent"] * 1e3, 3)
    sent = r["sent"]
    offsets, picks = offsets[:sent], picks[:sent]
    lat_ms = r["lat"] * 1e3
    lag_ms = r["lag"] * 1e3
    failed = int((~r["ok"]).sum())
    pairs = int(sum(bodies[i][1] for i in picks[r["ok"]]))
    p99 = float(np.percentile(lat_ms, 99))
    lag_p99 = float(np.percentile(lag_ms, 99))
    client_ok = lag_p99 <= max_client_lag_ms
    return Trial(rate_qps=round(rate_qps, 3), queries=sent, seconds=float(offsets[-1]),
                 wall_s=r["seconds"], failed=failed,
                 pairs=pairs, p50_ms=float(np.percentile(lat_ms, 50)), p99_ms=p99,
                 lag_p99_ms=lag_p99, lag_max_ms=float(lag_ms.max()), client_ok=client_ok,
                 passed=client_ok and failed == 0 and p99 <= p99_goal_ms and sent == n,
                 first_error=r["errors"][0] if r["errors"] else None,
                 stopped_early=r["stopped"], cpu_ms_per_query=cpu)


# --- bodies, state, one model ----------------------------------------------------------

def make_bodies(report: Mapping[str, Any], schema: Any, pool: int, seed: int,
                single_fraction: float, form: str = "instances",
                context: Sequence[str] | None = None) -> list[tuple[bytes, int]]:
    """``pool`` columnar JSON bodies with the load test's sizes, in ``form`` (``context``:
    one user's features, ``context`` or the profile's declared ones, and the dense vector
    once per query; ``instances``: every pair carries everything). The built-in DLRM's
    profiles get the load test's own generator (:class:`loadtest.traffic.RequestPool`:
    Zipf ids, training-like dense); an imported schema gets
    :func:`serve.api.json_body.example_request` (multi-hot up to each feature's max),
    its first instance's ``context`` features and dense copied to every pair."""
    import orjson

    from serve.profiles import PROFILES

    sizes = query_sizes(pool, seed, single_fraction)
    profile = PROFILES.get(str(report.get("profile")))
    if profile is not None and tuple(profile.feature_names) == tuple(schema.feature_names):
        from loadtest.traffic import RequestPool, TrafficConfig

        rp = RequestPool(TrafficConfig(
            profile=profile,
            instances=InstancesDistribution(single_fraction=single_fraction),
            body_format="columnar", pool_size=pool, seed=seed, form=form,
            context_features=tuple(context) if context else None))
        return [(r.body, r.instances) for r in rp.requests]
    from serve.api.json_body import example_request

    out = []
    for i, b in enumerate(sizes.tolist()):
        doc = example_request(int(b), seed=seed + i, form="columnar", schema=schema,
                              multi_hot=True)
        if form == "context":
            doc = as_context(doc, schema, context or ())
        out.append((orjson.dumps(doc), int(b)))
    return out


def as_context(doc: dict[str, Any], schema: Any, context: Sequence[str]) -> dict[str, Any]:
    """A columnar instances body -> the context form of one user: the first instance's
    ``context`` features and dense vector sent once (the others' dropped)."""
    import orjson

    from serve.api.config import HandlerConfig
    from serve.api.context_body import ranking_request
    from serve.api.decode import parse_body
    from serve.api.spec import spec_of

    spec = spec_of(schema)
    p = parse_body(orjson.dumps(doc), HandlerConfig(max_instances=100_000,
                                                    max_body_bytes=1 << 30), schema=schema)
    b = p.batch_size
    lengths, cells = p.lengths.copy(), []
    ends = np.cumsum(p.lengths.reshape(-1))
    starts = ends - p.lengths.reshape(-1)
    for f, name in enumerate(spec.names):
        row = [p.values[starts[f * b + s]:ends[f * b + s]] for s in range(b)]
        if name in context:
            row = [row[0]] * b
            lengths[f] = len(row[0])
        cells.extend(row)
    values = np.concatenate(cells) if cells else np.zeros(0, np.int64)
    dense = np.repeat(p.dense[:1], b, axis=0)
    return ranking_request(dense, lengths, values, set(context), dense_in_context=True,
                           spec=spec, form="columnar")


def as_binary(bodies: Sequence[tuple[bytes, int]], schema: Any,
              handler_cfg: Mapping[str, Any] | None = None) -> list[tuple[bytes, int]]:
    """The same queries as binary columnar bodies (``application/x-dlrm-columnar``,
    :func:`serve.api.binary.encode_binary`): they parse to exactly what the JSON ones do.
    ``handler_cfg``: the version's ``handler`` settings (its limits, e.g. ids per
    feature of a multi-hot model); None: the defaults."""
    from serve.api.binary import encode_binary, encode_binary_ranking
    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.api.request import JSON_MEDIA_TYPE

    cfg = HandlerConfig.from_dict(dict(handler_cfg or {}))
    out = []
    for body, pairs in bodies:
        p = parse_body(body, cfg, JSON_MEDIA_TYPE, schema=schema)
        if p.shared:   # a context: binary version 2, the dense vector once
            same = bool((p.dense == p.dense[:1]).all())
            out.append((encode_binary_ranking(p.dense[:1] if same else p.dense, p.lengths,
                                              p.values, p.shared, dense_shared=same,
                                              schema=schema), pairs))
        else:
            out.append((encode_binary(p.dense, p.lengths, p.values, schema=schema), pairs))
    return out


def _cpu_line(cpu: Mapping[str, float]) -> str:
    """One trial's CPU split as a line: ms per query by part, total, busy cores."""
    from bench.cpu_account import GROUPS

    model = cpu.get("workers_predict")
    return (", ".join(f"{g} {cpu[g]:.2f}"
                      + (f" (in predict {model:.2f})" if g == "workers" and model is not None
                         else "") for g in GROUPS)
            + f" = {cpu['total']:.2f} ms; machine {cpu['busy_cores']:.2f} cores busy")


def predict_cpu_reader(sidecar_url: str) -> Callable[[], float | None]:
    """A reader of the workers' CPU seconds in ``Runtime.predict`` so far: the sum of
    ``dlrm_predict_cpu_seconds_total`` on the sidecar's ``/metrics`` (None when it cannot
    be read or the workers do not export it)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from serve.metrics import PREDICT_CPU_SECONDS_TOTAL

    def read() -> float | None:
        try:
            with urllib.request.urlopen(f"{sidecar_url}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        values = [s.value for fam in text_string_to_metric_families(text)
                  for s in fam.samples if s.name == PREDICT_CPU_SECONDS_TOTAL]
        return sum(values) if values else None

    return read


def read_state(sidecar_url: str) -> dict[str, Any]:
    """What is served, from the sidecar: version, batching, workers, tuner on/off."""
    from serve.ops.state_client import StateClient

    client = StateClient(sidecar_url)
    try:
        st = client.state()
    except Exception as e:  # noqa: BLE001 - a state we cannot read is reported, not fatal
        return {"error": f"GET {sidecar_url}/state: {e}"}
    desired = st.get("desired") or {}
    observed = st.get("observed") or {}
    return {"desired": desired, "observed": observed, "converged": st.get("converged"),
            "tuner_enabled": client.tuner_on()}


def _served(state: Mapping[str, Any]) -> tuple[str | None, dict[str, Any], int]:
    d = state.get("desired") or {}
    return ((d.get("model") or {}).get("version"), dict(d.get("batching") or {}),
            int(d.get("workers") or 1))


@dataclass
class _Setup:
    """One model's inputs to the search: its bodies and what the sidecar serves, how.
    ``handler_cfg`` and ``threads`` come from the version's archive."""

    name: str
    version: str
    schema: Any
    bodies: list[tuple[bytes, int]]
    ctype: str
    mean_pairs: float
    state: dict[str, Any]
    served_version: str | None
    batching: dict[str, Any]
    workers: int
    handler_cfg: dict[str, Any] = field(default_factory=dict)
    threads: int = 1
    form: str = "instances"
    context: tuple[str, ...] = ()
    predict_cpu: Callable[[], float | None] | None = None

    @property
    def total_threads(self) -> int:
        return self.workers * self.threads


def context_features(report: Mapping[str, Any], args: argparse.Namespace
                     ) -> tuple[str, ...] | None:
    """The features the context form sends once: ``--context-features``, else the built-in
    profile's declaration, else the imported model's (its report's ``context_features``,
    from the example's factory module); None: none declared."""
    from serve.profiles import PROFILES

    given = parse_features(args.context_features)
    if given is not None:
        return given
    profile = PROFILES.get(str(report.get("profile")))
    if profile is not None:
        return profile.context_features
    declared = report.get("context_features")
    return tuple(declared) if declared else None


def _setup(name: str, version: str, store: Path, args: argparse.Namespace,
           sidecar_url: str, form: str = "instances") -> _Setup:
    """The version's bodies (JSON) in ``form`` and the sidecar's state, which must serve
    ``version``."""
    from serve.api.request import JSON_MEDIA_TYPE
    from serve.profiles import schema_from_report
    from serve.store.repository import ModelRepository

    report = ModelRepository([store], "dlrm").report(version)
    schema = schema_from_report(report)
    context = context_features(report, args) if form == "context" else ()
    if context is None:
        raise RuntimeError(f"{version}: no context features declared for the context form; "
                           "pass --context-features C1,C2,... (or --forms instances)")
    bodies = make_bodies(report, schema, args.pool, args.seed, args.single_fraction, form,
                         context)
    mean_pairs = sum(b for _, b in bodies) / len(bodies)
    state = read_state(sidecar_url)
    served_version, batching, workers = _served(state)
    if served_version is not None and served_version != version:
        raise RuntimeError(f"the sidecar at {sidecar_url} serves {served_version!r}, not "
                           f"{version!r}: pass --models for what it serves")
    return _Setup(name, version, schema, bodies, JSON_MEDIA_TYPE, mean_pairs, state,
                  served_version, batching, workers, form=form, context=tuple(context))


def _probe(s: _Setup, artifact_path: Path, url: str,
           args: argparse.Namespace) -> tuple[float, np.ndarray, float]:
    """In process first (the service idle), then one query at a time: (in-process
    pairs/s, unloaded latencies in ms, the rate the search starts at)."""
    name = s.name
    inproc_before = inprocess_pairs_per_s(artifact_path, s.handler_cfg, s.schema, s.bodies,
                                          s.ctype, s.total_threads, args.inprocess_s)
    floor = unloaded_latency_ms(url, s.bodies, args.probe_queries, s.ctype)
    floor_p50 = float(np.percentile(floor, 50))
    floor_p99 = float(np.percentile(floor, 99))
    print(f"  [{name}] unloaded (one query at a time, {args.probe_queries} queries): p50 "
          f"{floor_p50:.1f} ms, p99 {floor_p99:.1f} ms", flush=True)
    # Where the search starts: below both the in-process rate and what the workers can
    # answer one query at a time at the unloaded latency (a start far above capacity
    # would only overload the service, and teach the tuner a traffic that never comes).
    start_qps = args.start_qps or max(0.5, min(
        0.5 * inproc_before / s.mean_pairs, 0.7 * s.workers * 1e3 / max(floor_p50, 1e-3)))
    print(f"  [{name}] in process {inproc_before:.0f} pairs/s ({s.total_threads} threads); "
          f"search starts at {start_qps:.1f} queries/s", flush=True)
    return inproc_before, floor, start_qps


def _measurer(s: _Setup, url: str, args: argparse.Namespace,
              watch: Callable[[], dict[int, str]]) -> Callable[[float], Trial]:
    """One judged trial at a rate, printed as it ends."""
    name = s.name

    def measure(rate: float) -> Trial:
        # The service idle for a moment first: what an overloaded trial left behind
        # (queued work, a busy tuner window) is not charged to the next one.
        time.sleep(args.settle_s)
        t = run_trial(url, s.bodies, rate, min_duration_s=args.min_duration_s,
                      min_queries=args.min_queries, p99_goal_ms=args.p99_goal_ms,
                      max_client_lag_ms=args.max_client_lag_ms,
                      content_type=s.ctype, seed=args.seed,
                      max_in_flight=args.max_in_flight, watch=watch,
                      predict_cpu=s.predict_cpu)
        verdict = "pass" if t.passed else ("INVALID (client lag)" if not t.client_ok
                                           else "fail")
        print(f"  [{name}] {rate:8.1f} q/s offered: {t.queries} queries in {t.wall_s:5.1f} s"
              + (f" (stopped early: {STOP_REASONS[t.stopped_early]})"
                 if t.stopped_early else "") + ", "
              f"{t.pairs_per_s:9.0f} pairs/s, p50 {t.p50_ms:7.1f} ms, p99 {t.p99_ms:7.1f} ms, "
              f"failed {t.failed}, client lag p99 {t.lag_p99_ms:.1f} ms -> {verdict}"
              + (f" ({t.first_error})" if t.first_error else ""), flush=True)
        if t.cpu_ms_per_query:
            print(f"  [{name}] {'':8s}   CPU per query: {_cpu_line(t.cpu_ms_per_query)}",
                  flush=True)
        return t

    return measure


def _search(s: _Setup, url: str, args: argparse.Namespace, start_qps: float,
            floor_p50: float, watch: Callable[[], dict[int, str]]
            ) -> tuple[Trial, SearchResult, float]:
    """A warm-up trial (not judged), then the search: (warm-up, result, seconds)."""
    name = s.name
    warm = run_trial(url, s.bodies, start_qps, min_duration_s=min(2.0, args.min_duration_s),
                     min_queries=10, p99_goal_ms=math.inf, max_client_lag_ms=math.inf,
                     content_type=s.ctype, seed=args.seed + 1,
                     max_in_flight=args.max_in_flight)   # warm-up, not judged
    if warm.failed:
        print(f"  [{name}] warm-up: {warm.failed} of {warm.queries} failed "
              f"({warm.first_error})", flush=True)
    t0 = time.perf_counter()
    if floor_p50 > args.p99_goal_ms:
        # Half the queries miss the goal with no queueing at all: no rate can meet it.
        # (Not the probe's p99: of --probe-queries queries it is their maximum, and one
        # slow query, a tuner switch, say, would skip a search that could pass.)
        found = SearchResult(best=None, stop_reason=(
            f"unloaded p50 {floor_p50:.1f} ms > goal {args.p99_goal_ms:g} ms: no rate "
            "can pass (one query at a time already misses it)"))
        print(f"  [{name}] {found.stop_reason}", flush=True)
    else:
        found = search_rate(_measurer(s, url, args, watch), start_qps, growth=args.growth,
                            rel_tol=args.rel_tol, max_trials=args.max_trials)
    return warm, found, time.perf_counter() - t0


def measure_model(name: str, version: str, store: Path, args: argparse.Namespace,
                  infer_url: str, sidecar_url: str, peak: dict[str, Any],
                  run_dir: Path | None = None, form: str = "instances") -> dict[str, Any]:
    """Search one served model's rate with requests in ``form``; the in-process reference
    (rate and CPU per pair) and FLOPs beside it. ``run_dir``: the service's run folder
    (its ``pids.json``), for the CPU split per query (:mod:`bench.cpu_account`); None:
    only the client's and the machine's CPU."""
    import zipfile

    import yaml

    from bench import cpu_account
    from serve.api.request import BINARY_MEDIA_TYPE
    from serve.common.cpu import choose_threads
    from serve.runtime.artifact import load_artifact
    from serve.store.repository import ModelRepository, extract_artifact

    s = _setup(name, version, store, args, sidecar_url, form)
    s.predict_cpu = predict_cpu_reader(sidecar_url)

    def watch() -> dict[int, str]:
        return cpu_account.service_processes(run_dir)

    archive = ModelRepository([store], "dlrm").archive(version)
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(archive) as z:
        # the artifact, and a link to the tables folder it references (format 3)
        artifact_path = extract_artifact(archive, tmp)
        s.handler_cfg = (yaml.safe_load(z.read("model-config.yaml")) or {}).get("handler", {})
        if args.body == "binary":
            s.bodies, s.ctype = as_binary(s.bodies, s.schema, s.handler_cfg), BINARY_MEDIA_TYPE
        s.threads = choose_threads(s.workers, s.handler_cfg.get("num_threads")).threads
        flops = artifact_dense_flops(load_artifact(artifact_path))
        print(f"[{name}] {version}, {form} form"
              + (f" ({len(s.context)} features + dense once per query)" if s.context else "")
              + f": {len(s.bodies)} bodies, {s.mean_pairs:.0f} pairs/query on "
              f"average; serving {s.batching} x {s.workers} worker(s) x {s.threads} thread(s), "
              f"tuner {'on' if s.state.get('tuner_enabled') else 'off'}; dense "
              f"{flops['flops_per_pair'] / 1e6:.2f} MFLOP/pair ({flops['kind']})", flush=True)
        url = f"{infer_url}/predictions/dlrm"
        inproc_before, floor, start_qps = _probe(s, artifact_path, url, args)
        warm, found, search_s = _search(s, url, args, start_qps,
                                        float(np.percentile(floor, 50)), watch)
        state_after = read_state(sidecar_url)
        if _served(state_after)[1] != s.batching:
            print(f"  [{name}] WARNING: batching changed during the search ({s.batching} -> "
                  f"{_served(state_after)[1]}; the tuner is "
                  f"{'on' if s.state.get('tuner_enabled') else 'off'}): the trials measured "
                  "more than one state", flush=True)
        # and again after (the service idle again): the higher is the least disturbed
        inproc = max(inproc_before, inprocess_pairs_per_s(
            artifact_path, s.handler_cfg, s.schema, s.bodies, s.ctype, s.total_threads,
            args.inprocess_s))
        inproc_cpu = inprocess_cpu_ms_per_pair(artifact_path, s.handler_cfg, s.schema,
                                               s.bodies, s.ctype, s.threads, args.inprocess_s)
    run = _run_record(s, args, found, warm, inproc, floor, search_s, state_after)
    run |= cpu_per_pair(run.get("cpu_ms_per_query"), s.mean_pairs, inproc_cpu)
    run["dense_flops"] = flops | _flops_shares(flops, inproc, found.best, peak)
    return run


def _run_record(s: _Setup, args: argparse.Namespace, found: SearchResult, warm: Trial,
                inproc: float, floor: np.ndarray, search_s: float,
                state_after: Mapping[str, Any]) -> dict[str, Any]:
    """One model's entry of ``runs`` (``dense_flops`` is added by the caller)."""
    cores = os.cpu_count() or 1
    best = found.best
    # Runtime.predict's CPU per query in process: total_threads busy for the time one
    # query's pairs take at the in-process rate (the floor of what serving one costs)
    inproc_cpu_ms = s.total_threads * 1e3 * s.mean_pairs / inproc if inproc else None
    return {
        "model": s.name, "version": s.version, "form": s.form,
        "context_features": list(s.context),
        "queries_per_s": round(best.queries_per_s, 2) if best else 0.0,
        "offered_queries_per_s": best.rate_qps if best else 0.0,
        "pairs_per_s": round(best.pairs_per_s, 1) if best else 0.0,
        "pairs_per_s_per_core": round(best.pairs_per_s / cores, 1) if best else 0.0,
        "cores": cores,
        "p50_ms": round(best.p50_ms, 2) if best else None,
        "p99_ms": round(best.p99_ms, 2) if best else None,
        "failed": best.failed if best else None,
        # every trial's, overload trials included (they stop early, before the server's
        # queue fills, so this stays 0 unless something else went wrong)
        "failed_all_trials": sum(t.failed for t in found.trials),
        "warmup_failed": warm.failed,
        "trials_stopped_early": sum(t.stopped_early is not None for t in found.trials),
        "client_lag_p99_ms": round(best.lag_p99_ms, 2) if best else None,
        "in_process_pairs_per_s": round(inproc, 1),
        "in_process_threads": s.total_threads,
        # where the CPU of a query goes at the rate found (bench.cpu_account), beside what
        # the forward alone costs in process
        "cpu_ms_per_query": best.cpu_ms_per_query if best else None,
        "in_process_cpu_ms_per_query": round(inproc_cpu_ms, 3) if inproc_cpu_ms else None,
        "body": args.body,
        "service_vs_in_process": round(best.pairs_per_s / inproc, 3) if best and inproc else None,
        "mean_pairs_per_query": round(s.mean_pairs, 1),
        "client_limited": found.client_limited, "stop_reason": found.stop_reason,
        "met_goal": best is not None,
        "unloaded_p50_ms": round(float(np.percentile(floor, 50)), 2),
        "unloaded_p99_ms": round(float(np.percentile(floor, 99)), 2),
        "search_seconds": round(search_s, 1),
        "state": {"batching": s.batching, "workers": s.workers, "threads_per_worker": s.threads,
                  "tuner_enabled": s.state.get("tuner_enabled"), "version": s.served_version,
                  "batching_after": _served(state_after)[1],
                  "tuner_enabled_after": state_after.get("tuner_enabled")},
        "dense_flops": None,
        "trials": [asdict(t) | {"queries_per_s": t.queries_per_s, "pairs_per_s": t.pairs_per_s}
                   for t in found.trials],
    }


#: The parts of the served path whose CPU counts against the model's (not the client).
SERVED_PARTS = ("frontend", "workers", "sidecar")


def cpu_per_pair(cpu_per_query: Mapping[str, float] | None, mean_pairs: float,
                 inproc_ms_per_pair: float) -> dict[str, Any]:
    """CPU ms per candidate pair of the served path (TorchServe's frontend, its workers,
    the sidecar: not the load generator) at the rate found, of ``Runtime.predict`` in
    process on the same queries, and their ratio (``served_cpu_per_pair_ratio``)."""
    served = (sum(cpu_per_query[g] for g in SERVED_PARTS) / mean_pairs
              if cpu_per_query and mean_pairs else None)
    model = (cpu_per_query.get("workers_predict") if cpu_per_query else None)
    model = model / mean_pairs if model is not None and mean_pairs else None

    def ratio(v: float | None) -> float | None:
        return round(v / inproc_ms_per_pair, 3) if v is not None and inproc_ms_per_pair else None

    return {"served_cpu_ms_per_pair": round(served, 5) if served is not None else None,
            "in_process_cpu_ms_per_pair": round(inproc_ms_per_pair, 5),
            "served_cpu_per_pair_ratio": ratio(served),
            # the same split inside the workers: predict there (the model's work, on
            # cores it shares with the frontend, the other worker and the client) and
            # the rest of the served path (protocol, decode, answers, metrics, frontend)
            "served_predict_cpu_ms_per_pair": round(model, 5) if model is not None else None,
            "served_predict_ratio": ratio(model),
            "served_overhead_cpu_ms_per_pair": (round(served - model, 5)
                                                if served is not None and model is not None
                                                else None)}


def _flops_shares(flops: Mapping[str, Any], inproc: float, best: Trial | None,
                  peak: Mapping[str, Any]) -> dict[str, Any]:
    """FLOP/s in process and at the rate found, and their shares of the GEMM peak."""
    fp32_peak = peak.get("peak", {}).get("fp32")
    in_flops = inproc * flops["flops_per_pair"]
    out: dict[str, Any] = {
        "in_process_flops_per_s": in_flops,
        "in_process_share_of_fp32_peak": in_flops / fp32_peak if fp32_peak else None}
    if best:
        achieved = best.pairs_per_s * flops["flops_per_pair"]
        out |= {
            "achieved_flops_per_s": achieved,
            "share_of_fp32_peak": achieved / peak["peak"]["fp32"] if peak.get("peak") else None,
            "share_of_bf16_peak": (achieved / peak["peak"]["bf16"]
                                   if peak.get("peak", {}).get("bf16") else None)}
    return out


def validate_results(doc: Mapping[str, Any]) -> list[str]:
    """What is wrong with a results document (empty: nothing)."""
    problems = []
    runs = doc.get("runs")
    if not isinstance(runs, list) or not runs:
        return ["'runs' must be a non-empty list"]
    for i, r in enumerate(runs):
        for k in REQUIRED_RUN_KEYS:
            if k not in r:
                problems.append(f"runs[{i}] lacks {k!r}")
            elif k in ("p99_ms", "served_cpu_per_pair_ratio") and r[k] is None \
                    and r.get("queries_per_s") == 0:
                continue    # no rate met the goal: there is no p99 at a passing rate
            elif k == "form":
                if r[k] not in REQUEST_FORMS:
                    problems.append(f"runs[{i}]['form'] = {r[k]!r} is not one of "
                                    f"{', '.join(REQUEST_FORMS)}")
            elif k != "model" and not isinstance(r[k], (int, float)):
                problems.append(f"runs[{i}][{k!r}] = {r[k]!r} is not a number")
    for k in ("meta", "command"):
        if k not in doc:
            problems.append(f"document lacks {k!r}")
    return problems


def _ms(v: float | None) -> str:
    return f"{v:7.1f}" if v is not None else f"{'none':>7}"


def _cpu_pair_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """CPU per candidate pair: served (frontend + workers + sidecar) against in process,
    and the served figure split: predict inside the workers, the rest."""
    lines = [(f"{'model':>8} {'form':>9} {'served us/pair':>14} {'in-proc us/pair':>15} "
              f"{'ratio':>6} {'in predict':>10} {'ratio':>6} {'rest':>6}")]

    def us(v: float | None, width: int) -> str:
        return f"{(f'{v * 1e3:.2f}' if v is not None else '-'):>{width}}"

    for r in runs:
        lines.append(f"{r['model']:>8} {r.get('form', '-'):>9} "
                     f"{us(r.get('served_cpu_ms_per_pair'), 14)} "
                     f"{us(r.get('in_process_cpu_ms_per_pair'), 15)} "
                     f"{r.get('served_cpu_per_pair_ratio') or '-':>6} "
                     f"{us(r.get('served_predict_cpu_ms_per_pair'), 10)} "
                     f"{r.get('served_predict_ratio') or '-':>6} "
                     f"{us(r.get('served_overhead_cpu_ms_per_pair'), 6)}")
    return "\n".join(lines)


def _form_comparison(runs: Sequence[Mapping[str, Any]]) -> str:
    """Per model measured in both forms: the context form's pairs/s over the instances'."""
    out = []
    by = {(r["model"], r.get("form")): r for r in runs}
    for (model, form), r in by.items():
        other = by.get((model, "instances"))
        if form == "context" and other is not None:
            gain = r["pairs_per_s"] / other["pairs_per_s"] if other["pairs_per_s"] else None
            out.append(f"{model}: context form {r['pairs_per_s']:.0f} pairs/s vs instances "
                       f"{other['pairs_per_s']:.0f} at p99 <= goal: "
                       + (f"x{gain:.2f}" if gain is not None else "instances met no rate"))
    return "\n".join(out)


def _table(runs: Sequence[Mapping[str, Any]]) -> str:
    header = (f"{'model':>8} {'form':>9} {'q/s':>8} {'pairs/s':>10} {'pairs/s/core':>12} {'p50 ms':>7} "
              f"{'p99 ms':>7} {'failed':>6} {'in-proc pairs/s':>15} {'ratio':>6} "
              f"{'MFLOP/pair':>10} {'fp32 peak share':>15}  state")
    lines = [header]
    for r in runs:
        fl = r.get("dense_flops", {})
        share = fl.get("share_of_fp32_peak")
        st = r["state"]
        lines.append(
            f"{r['model']:>8} {r.get('form', '-'):>9} {r['queries_per_s']:8.1f} "
            f"{r['pairs_per_s']:10.0f} "
            f"{r['pairs_per_s_per_core']:12.0f} {_ms(r['p50_ms'])} {_ms(r['p99_ms'])} "
            f"{r['failed'] if r['failed'] is not None else '-':>6} "
            f"{r['in_process_pairs_per_s']:15.0f} {r['service_vs_in_process'] or 0:6.2f} "
            f"{fl.get('flops_per_pair', 0) / 1e6:10.2f} "
            f"{(f'{share:.3f}' if share is not None else '-'):>15}  "
            f"{st['version']} batching {st['batching']} x{st['workers']}w x{st['threads_per_worker']}t "
            f"tuner {'on' if st['tuner_enabled'] else 'off'}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_slo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,dlrm-v2",
                    help=f"comma-separated, of {', '.join(MODELS)} (versions "
                         f"{', '.join(v for v, _ in MODELS.values())})")
    ap.add_argument("--url", default=None,
                    help="measure a running service (`make up`) at this TorchServe inference URL "
                         "instead of starting one per model; it must serve the one model named "
                         "by --models (loopback only)")
    ap.add_argument("--sidecar-url", default="http://127.0.0.1:8090",
                    help="with --url: the sidecar whose GET /state and /tuner say what is served")
    ap.add_argument("--model-store", default="model_store")
    ap.add_argument("--version", default=None,
                    help="serve this version as the one model of --models instead of its "
                         "default (e.g. a test's tiny build)")
    ap.add_argument("--p99-goal-ms", type=float, default=P99_SLO_MS,
                    help="latency bound a trial must meet (MLPerf DLRM-v2 server: 60 ms)")
    ap.add_argument("--min-duration-s", type=float, default=60.0,
                    help="each trial sends for at least this long (MLPerf: 600 s); shorter trials "
                         "make p99 noisy")
    ap.add_argument("--min-queries", type=int, default=1000,
                    help="each trial sends at least this many queries (the p99 of 1000 is the "
                         "10th-worst; MLPerf's 270,336 would take hours at a few queries/s)")
    ap.add_argument("--start-qps", type=float, default=None,
                    help="first trial's rate (queries/s); default half the in-process rate "
                         "(in-process pairs/s / mean pairs per query / 2), so the coarse "
                         "steps start near the answer whatever the model's cost")
    ap.add_argument("--rel-tol", type=float, default=0.05,
                    help="stop bisecting when the failing rate is within this of the passing one")
    ap.add_argument("--max-trials", type=int, default=10, help="trials per model at most")
    ap.add_argument("--growth", type=float, default=1.5,
                    help="coarse search: multiply the rate by this while trials pass (> 1)")
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="stop a trial (failed) once this many queries are unanswered "
                         "(default: TorchServe's job_queue_size in config.properties, where "
                         "it starts refusing requests)")
    ap.add_argument("--max-client-lag-ms", type=float, default=10.0,
                    help="a trial whose client sent its p99 query later than this past the "
                         "schedule is invalid (the client, not the service, was the limit)")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="seconds the service idles before each trial, so that one trial's "
                         "backlog is not the next one's")
    ap.add_argument("--single-fraction", type=float, default=0.0,
                    help="single-pair queries mixed in (the load test mixes 0.1; MLPerf none)")
    ap.add_argument("--probe-queries", type=int, default=50,
                    help="queries sent one at a time before the search: if even their p99 "
                         "misses the goal, no rate can meet it and the search is skipped")
    ap.add_argument("--body", choices=("json", "binary"), default="json",
                    help="request bodies: columnar JSON (what most clients send) or the binary "
                         "columnar form (application/x-dlrm-columnar: no JSON to parse)")
    ap.add_argument("--forms", default=",".join(REQUEST_FORMS),
                    help="request forms to measure, in order, against the same service: "
                         "context (one user's features and dense once per query, the items' "
                         "per pair) and/or instances (every pair carries everything)")
    ap.add_argument("--context-features", default="",
                    help="features the context form sends once (default: the built-in "
                         "profile's declared user side, C1..C13; an imported model's "
                         "context_features from its example's factory)")
    ap.add_argument("--run-dir", default=".run",
                    help="with --url: the service's run folder, whose pids.json names its "
                         "processes for the CPU split per query")
    ap.add_argument("--pool", type=int, default=128, help="distinct request bodies per model")
    ap.add_argument("--inprocess-s", type=float, default=6.0,
                    help="seconds of the in-process Runtime.predict reference per model")
    ap.add_argument("--gemm-s", type=float, default=1.0, help="seconds per GEMM size and dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/slo.json")
    return ap


def _usage_error(args: argparse.Namespace, names: list[str]) -> str | None:
    """What is wrong with the options, as the error line to print; None: nothing."""
    unknown = [m for m in names if m not in MODELS]
    if not names or unknown:
        return f"error: --models {args.models!r}: use any of {', '.join(MODELS)}"
    if args.version is not None and len(names) != 1:
        return "error: --version replaces the version of one model: name it alone in --models"
    if not args.growth > 1 or (args.max_in_flight is not None and args.max_in_flight < 1):
        return (f"error: --growth {args.growth} must be > 1 and --max-in-flight "
                f"{args.max_in_flight} >= 1")
    if not 0 <= args.settle_s <= 600:
        return f"error: --settle-s {args.settle_s} must be between 0 and 600 seconds"
    return None


def _url_error(args: argparse.Namespace, names: list[str]) -> str | None:
    """What is wrong with ``--url`` (one model, on loopback); None: nothing or no --url."""
    if args.url is None:
        return None
    if len(names) != 1:
        return "error: --url measures the one model it serves: name it alone in --models"
    if urllib.parse.urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        return f"error: --url {args.url}: this load generator only targets loopback"
    return None


def _measure_all(names: list[str], versions: Mapping[str, str], store: Path,
                 args: argparse.Namespace, peak: dict[str, Any]) -> list[dict[str, Any]]:
    """Each model's run: against ``--url``, or a service of its own started per model."""
    runs: list[dict[str, Any]] = []
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    for name in names:
        version = versions[name]
        if args.url is not None:
            run_dir = Path(args.run_dir)
            for form in forms:
                runs.append(measure_model(name, version, store, args, args.url.rstrip("/"),
                                          args.sidecar_url.rstrip("/"), peak,
                                          run_dir if run_dir.is_absolute() else REPO / run_dir,
                                          form))
            continue
        from serve.ops.launcher import running_service

        with tempfile.TemporaryDirectory(prefix="bench-slo-") as root:
            print(f"[{name}] starting TorchServe + sidecar (shipped defaults, free ports) "
                  f"serving {version} ...", flush=True)
            with running_service(Path(root), store, version) as (cfg, _client):
                for form in forms:   # both forms against the same service, one after the other
                    runs.append(measure_model(name, version, store, args, cfg.inference_url,
                                              cfg.sidecar_url, peak, cfg.path(cfg.run_dir),
                                              form))
    return runs


def _document(args: argparse.Namespace, argv: list[str] | None, runs: list[dict[str, Any]],
              peak: dict[str, Any], machine: Any, cores: int) -> dict[str, Any]:
    """The results document: ``runs``, ``meta`` (the run's settings and machine) and
    ``command``."""
    import torch

    from serve.common.cpu import available_cpus

    return {
        "runs": runs,
        "meta": {"p99_goal_ms": args.p99_goal_ms, "min_duration_s": args.min_duration_s,
                 "min_queries": args.min_queries, "rel_tol": args.rel_tol,
                 "max_client_lag_ms": args.max_client_lag_ms,
                 "sizes": InstancesDistribution(single_fraction=args.single_fraction).spec(),
                 "single_fraction": args.single_fraction,
                 "body_form": ("columnar JSON" if args.body == "json"
                               else "binary columnar (application/x-dlrm-columnar)"),
                 "cores": cores, "cores_note": "os.cpu_count() of this machine/pod",
                 "available_cpus": available_cpus(), "gemm": peak,
                 "torch": torch.__version__, "machine": machine,
                 "service": "own (started per model)" if args.url is None else args.url,
                 "mlperf_anchor": MLPERF_ANCHOR,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "command": "python -m bench.bench_slo " + shlex.join(argv if argv is not None
                                                             else sys.argv[1:]),
    }


def _print_summary(args: argparse.Namespace, runs: list[dict[str, Any]],
                   peak: Mapping[str, Any], cores: int, out: Path) -> None:
    print()
    print(f"highest rate with p99 <= {args.p99_goal_ms:g} ms (trials >= {args.min_duration_s:g} s "
          f"and >= {args.min_queries} queries; cores = os.cpu_count() = {cores})")
    print(_table(runs))
    for r in runs:
        if r.get("cpu_ms_per_query"):
            print(f"{r['model']} ({r['form']}): CPU per query at that rate (ms; {r['body']} "
                  f"bodies): {_cpu_line(r['cpu_ms_per_query'])}; Runtime.predict in process: "
                  f"{r['in_process_cpu_ms_per_query']:.2f} ms")
    print(_cpu_pair_table(runs))
    print(_form_comparison(runs))
    for r in runs:
        if not r["met_goal"]:
            print(f"{r['model']}: no rate met the goal ({r['stop_reason']})")
        fl = r["dense_flops"]
        print(f"{r['model']}: dense {fl['flops_per_pair'] / 1e6:.2f} MFLOP/pair; in process "
              f"{fl['in_process_flops_per_s'] / 1e9:.1f} GFLOP/s = "
              f"{fl['in_process_share_of_fp32_peak'] or 0:.3f} of the fp32 GEMM peak "
              f"({peak['peak']['fp32'] / 1e9:.0f} GFLOP/s; bf16 {peak['peak']['bf16'] / 1e9:.0f})")
    print(f"MLPerf anchor (Xeon 6980P socket, 128 cores, INT8 AMX, p99 < 50 ms): "
          f"{MLPERF_ANCHOR['pairs_per_s_per_core']:,.0f} pairs/s per core")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    error = _usage_error(args, names)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    if args.max_in_flight is None:
        from serve.ops.faults import shipped_queue_size

        args.max_in_flight = shipped_queue_size()
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the service this run started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    versions = {m: args.version or MODELS[m][0] for m in names}
    error = _url_error(args, names)
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    store = Path(args.model_store)
    store = store if store.is_absolute() else REPO / store
    from serve.store.repository import ModelRepository

    repo = ModelRepository([store], "dlrm")
    missing = [f"{m} (version {versions[m]}: `{MODELS[m][1]}`)" for m in names
               if not repo.exists(versions[m])]
    if missing and args.url is None:
        print(f"error: not in {store}: {', '.join(missing)}; build them first", file=sys.stderr)
        return 2

    from serve.common.cpu import available_cpus
    from serve.ops.machine import announce

    cores = os.cpu_count() or 1
    # One peak for every model: the service's largest thread count is the CPU budget.
    gemm_threads = max(1, available_cpus())
    machine = announce()
    print(f"GEMM peak: torch.matmul fp32/bf16, {gemm_threads} threads ...", flush=True)
    peak = gemm_peak(gemm_threads, seconds=args.gemm_s)
    print("  " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peak["peak"].items())
          + (f" (skipped, one product outlasted a window: {', '.join(peak['skipped'])})"
             if peak["skipped"] else ""), flush=True)
    runs = _measure_all(names, versions, store, args, peak)
    doc = _document(args, argv, runs, peak, machine, cores)
    problems = validate_results(doc)
    if problems:
        print("error: results malformed: " + "; ".join(problems), file=sys.stderr)
        return 1
    out = Path(args.out)
    out = out if out.is_absolute() else REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    _print_summary(args, runs, peak, cores, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
