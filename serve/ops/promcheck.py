"""The pipeline from ``/metrics`` to PromQL, checked against what a load generator sent.

A real Prometheus (:mod:`serve.ops.prometheus`) scrapes the sidecar every second and
evaluates the shipped rule files while a closed-loop load runs. At one instant ``T`` near
the end of the load, three values are read from Prometheus and compared with the load
generator's own record of the same window ``(T - 60 s, T]``:

================  =====================================  ===================================
value             Prometheus                             load generator, and the tolerance
================  =====================================  ===================================
QPS (HPA input)   ``dlrm:requests_per_second:rate1m``    answers completed in the window / 60 s;
                  (the prometheus-adapter expression)    within 10 %
p99 latency       ``dlrm:request_duration_seconds:       its exact p99 of the window's
                  p99_1m`` (histogram_quantile)          latencies: Prometheus's value must lie
                                                         in the same bucket of
                                                         ``REQUEST_DURATION_BUCKETS``
cache hit ratio   hits / (hits + misses) over [1m]       the ratio the same requests give in an
                                                         in-process runtime with the same cache
                                                         (exact order: 1 worker, 1 client);
                                                         within 0.01. Without a cache (CPU
                                                         default): reported as n/a
================  =====================================  ===================================

``dlrm_request_duration_seconds`` is the handler's time (decode to response); the client's
latency adds TorchServe's frontend and any wait in its queue. The load therefore runs at a
concurrency the workers absorb without queueing (clients <= workers x batch size), where the
two measure the same requests; the table shows the median gap.

With ``make up`` running::

    make promcheck                                  # 75 s of load, the check, a table, JSON
    python -m serve.ops.promcheck --clients 2 --load-s 90 --json bench/results/promcheck.json
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serve.common.net import free_port
from serve.errors import ServeError
from serve.metrics import CACHE_HITS_TOTAL, CACHE_MISSES_TOTAL, REQUEST_DURATION_BUCKETS
from serve.ops.loadgen import Answer, BackgroundLoad
from serve.ops.monitoring_rules import P50_RECORD, P99_RECORD, QPS_RECORD
from serve.ops.prometheus import PrometheusConfig, PrometheusServer

__all__ = ["CACHE_TOLERANCE", "HIT_RATIO_EXPR", "QPS_TOLERANCE", "WINDOW_S", "bucket_of",
           "check_window", "main", "simulate_hit_ratio"]

REPO = Path(__file__).resolve().parents[2]
WINDOW_S = 60.0           # the recording rules' [1m]
QPS_TOLERANCE = 0.10      # the bar: within 10 % of the load generator's rate
CACHE_TOLERANCE = 0.01    # absolute, on the hit ratio
# hits / (hits + misses) over the same [1m] as the other two (the recorded ratio is [5m])
HIT_RATIO_EXPR = (f"sum(rate({CACHE_HITS_TOTAL}[1m])) / (sum(rate({CACHE_HITS_TOTAL}[1m]))"
                  f" + sum(rate({CACHE_MISSES_TOTAL}[1m])))")

Row = dict[str, Any]


def bucket_of(value: float, bounds: Sequence[float] = REQUEST_DURATION_BUCKETS
              ) -> tuple[float, float]:
    """(lower, upper] bounds of the histogram bucket that holds ``value`` (seconds)."""
    i = bisect.bisect_left(list(bounds), value)
    lo = 0.0 if i == 0 else bounds[i - 1]
    hi = math.inf if i == len(bounds) else bounds[i]
    return lo, hi


def simulate_hit_ratio(artifact: Path, bodies: Sequence[bytes], content_type: str,
                       cache_load_factor: float, cache_policy: str, cycles: int = 2
                       ) -> list[tuple[int, int]]:
    """(hits, misses) of each body when ``bodies`` are sent in order, over and over, to one
    worker: an in-process runtime with the same cache runs them ``cycles`` times; the last
    cycle's per-body counts are the steady state (LRU/LFU on a repeated sequence settle
    after one pass). Returns one pair per body of the last cycle."""
    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.runtime.engine import Runtime, RuntimeConfig

    rt = Runtime.from_artifact(str(artifact), RuntimeConfig(
        cache_on_cpu=True, cache_load_factor=cache_load_factor, cache_policy=cache_policy,
        num_threads=1))
    hcfg = HandlerConfig()
    per_body: list[tuple[int, int]] = []
    prev = rt.stats()
    for c in range(cycles):
        for body in bodies:
            # one request per forward, as the handler runs it at batch size 1
            req = parse_body(body, hcfg, content_type)
            rt.predict_arrays(req.dense, req.values, req.lengths)
            now = rt.stats()
            if c == cycles - 1:
                per_body.append((now.hits - prev.hits, now.misses - prev.misses))
            prev = now
    return per_body


def _percentile99(xs: np.ndarray) -> float:
    # the smallest latency with at least 99 % of the window at or below it: what a
    # histogram's 0.99 quantile estimates
    return float(np.quantile(xs, 0.99, method="inverted_cdf"))


def check_window(prom: PrometheusServer, answers: Sequence[Answer], t_end_wall: float,
                 mono_to_wall: float, *, window_s: float = WINDOW_S,
                 expected_hits: Callable[[list[int]], tuple[int, int]] | None = None
                 ) -> dict[str, Any]:
    """Compare Prometheus at ``t_end_wall`` (unix s) with the requests completed in the
    window before it. ``answers``: every request in the order sent (``BackgroundLoad.
    outcomes``); ``mono_to_wall``: add to a monotonic time to get unix time.
    ``expected_hits``: given the positions (in ``answers``) of the window's requests, the
    (hits, misses) they should have caused (None: the hit ratio is reported, not checked)."""
    lo_wall = t_end_wall - window_s
    positions = [i for i, a in enumerate(answers) if lo_wall < a.t + mono_to_wall <= t_end_wall]
    inside = [answers[i] for i in positions]
    ok_inside = [a for a in inside if a.ok]
    if len(ok_inside) < 20:
        raise ServeError(f"only {len(ok_inside)} answers in the {window_s:g} s window: "
                         "the load is too light to check a p99")
    rate = len(inside) / window_s
    lat = np.array([a.t - a.t0 for a in ok_inside])
    p99 = _percentile99(lat)
    lo, hi = bucket_of(p99)
    prom_qps = prom.value(f"sum({QPS_RECORD})", t_end_wall)
    prom_p99 = prom.value(f"max({P99_RECORD})", t_end_wall)
    prom_p50 = prom.value(f"max({P50_RECORD})", t_end_wall)
    rows: list[Row] = [
        {"check": "QPS (requests/s)", "prometheus": prom_qps, "loadgen": rate,
         "rule": f"within {QPS_TOLERANCE:.0%}",
         "ok": bool(abs(prom_qps - rate) <= QPS_TOLERANCE * rate)},
        {"check": "p99 latency (s)", "prometheus": prom_p99, "loadgen": p99,
         "rule": f"in the loadgen p99's bucket ({lo:g}, {hi:g}] s",
         "ok": bool(lo < prom_p99 <= hi)},
    ]
    hit_ratio = prom.value(HIT_RATIO_EXPR, t_end_wall)
    if expected_hits is not None:
        h, m = expected_hits(positions)
        want = h / (h + m) if h + m else math.nan
        rows.append({"check": "cache hit ratio", "prometheus": hit_ratio, "loadgen": want,
                     "rule": f"within {CACHE_TOLERANCE} (same requests, in-process cache)",
                     "ok": bool(abs(hit_ratio - want) <= CACHE_TOLERANCE)})
    else:
        rows.append({"check": "cache hit ratio", "prometheus": hit_ratio, "loadgen": None,
                     "rule": "reported (no expectation without a cache)", "ok": True})
    return {
        "window_s": window_s, "t_end_unix": t_end_wall, "answers_in_window": len(inside),
        "failed_in_window": len(inside) - len(ok_inside),
        "loadgen_p50_s": float(np.median(lat)), "prometheus_p50_s": prom_p50,
        "rows": rows, "ok": all(r["ok"] for r in rows),
    }


def run_load_and_check(prom: PrometheusServer, url: str, bodies: Sequence[bytes], *,
                       clients: int, load_s: float, content_type: str,
                       expected_hits: Callable[[list[int]], tuple[int, int]] | None = None,
                       progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the closed-loop load for ``load_s`` seconds, then check the last full window
    (it ends 2 s before the load stops, so every scrape in it saw load)."""
    if load_s < WINDOW_S + 10:
        raise ServeError(f"load_s={load_s:g} must be >= {WINDOW_S + 10:g} s: the window is "
                         f"{WINDOW_S:g} s and the rate needs a few scrapes before it")
    prom.wait_for('up{job="dlrm-serve"} == 1', timeout_s=30)
    mono_to_wall = time.time() - time.monotonic()
    with BackgroundLoad(url, bodies, clients=clients, content_type=content_type) as load:
        t0 = time.monotonic()
        while (left := load_s - (time.monotonic() - t0)) > 0:
            time.sleep(min(15.0, left))
            progress(f"  load: {time.monotonic() - t0:5.0f} s, {load.served:,} answered, "
                     f"{load.failed} failed")
        t_end = time.time() - 2.0
    answers = load.outcomes
    # the last scrape and rule evaluation covering t_end
    time.sleep(2.5 * prom.cfg.scrape_interval_s + prom.cfg.evaluation_interval_s)
    res = check_window(prom, answers, t_end, mono_to_wall, expected_hits=expected_hits)
    res.update({"clients": clients, "load_s": load_s, "served": load.served,
                "failed": load.failed})
    return res


def format_table(res: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else (
            f"{x:.4f}" if isinstance(x, float) else str(x))
    lines = [f"{'check':<18} {'prometheus':>11} {'loadgen':>9}  {'rule':<46} ok"]
    for r in res["rows"]:
        lines.append(f"{r['check']:<18} {f(r['prometheus']):>11} {f(r['loadgen']):>9}  "
                     f"{r['rule']:<46} {'yes' if r['ok'] else 'NO'}")
    lines.append(f"window {res['window_s']:g} s: {res['answers_in_window']:,} answers "
                 f"({res['failed_in_window']} failed); p50 handler (Prometheus) "
                 f"{f(res['prometheus_p50_s'])} s, client {f(res['loadgen_p50_s'])} s")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.ops.promcheck",
        description="Start a loopback Prometheus with the shipped rule files scraping the "
                    "running sidecar, run a closed-loop load, and compare Prometheus's QPS "
                    "(the HPA's adapter expression), p99 and cache hit ratio with what the "
                    "load generator saw over the same 60 s window.")
    p.add_argument("--url", default="http://127.0.0.1:8080/predictions/dlrm",
                   help="the inference endpoint")
    p.add_argument("--sidecar", default="127.0.0.1:8090", help="sidecar host:port to scrape")
    p.add_argument("--clients", type=int, default=2,
                   help="closed-loop clients (<= workers x batch size: no queueing)")
    p.add_argument("--instances", type=int, default=256, help="instances per request")
    p.add_argument("--load-s", type=float, default=75.0, help="seconds of load (>= 70)")
    p.add_argument("--port", type=int, default=0, help="Prometheus port (0: a free one)")
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "promcheck.json"),
                   help="where to write the result")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from serve.api.binary import example_binary
    from serve.api.request import BINARY_MEDIA_TYPE

    bodies = [example_binary(args.instances, seed=s) for s in range(16)]
    try:
        httpx.get(f"http://{args.sidecar}/metrics", timeout=5, trust_env=False)
    except httpx.HTTPError as e:
        print(f"promcheck: cannot reach the sidecar at {args.sidecar} ({e}); is the service "
              "running (make up)?", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="promcheck-") as tmp:
        cfg = PrometheusConfig(port=args.port or free_port(), targets=[args.sidecar],
                               data_dir=Path(tmp))
        try:
            with PrometheusServer(cfg) as prom:
                print(f"prometheus on {cfg.url}, scraping {args.sidecar} every "
                      f"{cfg.scrape_interval_s:g} s; {args.clients} clients x "
                      f"{args.instances} instances for {args.load_s:g} s", flush=True)
                res = run_load_and_check(prom, args.url, bodies, clients=args.clients,
                                         load_s=args.load_s, content_type=BINARY_MEDIA_TYPE)
        except ServeError as e:
            print(f"promcheck: {e.message}", file=sys.stderr)
            return 2
    res["instances_per_request"] = args.instances
    print()
    print(format_table(res))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
