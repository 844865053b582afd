"""bench.bench_slo: the Poisson schedule, the reused size law, the rate search on a
synthetic latency model, the FLOPs formula, the results schema, and (slow) a very short
real run against TorchServe + sidecar."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Self

import numpy as np
import pytest
import torch

from bench import bench_slo
from bench.bench_slo import (
    REQUIRED_RUN_KEYS,
    Trial,
    dense_flops_per_pair,
    poisson_schedule,
    query_sizes,
    search_rate,
    trial_queries,
    validate_results,
)
from loadtest.traffic import InstancesDistribution
from serve.ops.machine import machine_info

# --- the schedule ---------------------------------------------------------------------

def test_poisson_schedule_mean_rate_at_fixed_seed() -> None:
    rate, n = 200.0, 20_000
    t = poisson_schedule(rate, n, np.random.default_rng(0))
    assert t.shape == (n,) and np.all(np.diff(t) > 0) and t[0] > 0
    # n / T estimates the rate with relative SE 1/sqrt(n) = 0.7%: 3% is > 4 SE
    assert n / t[-1] == pytest.approx(rate, rel=0.03)
    gaps = np.diff(t)
    # exponential gaps: coefficient of variation 1 (a fixed-interval schedule has 0)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    again = poisson_schedule(rate, n, np.random.default_rng(0))
    np.testing.assert_array_equal(t, again)


@pytest.mark.parametrize("rate,n", [(0.0, 10), (-1.0, 10), (math.inf, 10), (1.0, 0)])
def test_poisson_schedule_rejects(rate: float, n: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        poisson_schedule(rate, n, np.random.default_rng(0))


def test_trial_queries_takes_both_minimums() -> None:
    assert trial_queries(10.0, 60.0, 3000) == 3000       # count binds at a low rate
    assert trial_queries(100.0, 60.0, 3000) == 6000      # duration binds at a high rate
    assert trial_queries(33.3, 1.0, 1) == 34


# --- the size law is the load test's ----------------------------------------------------

def test_query_sizes_reuse_the_load_tests_law() -> None:
    law = InstancesDistribution()           # loadtest's default: 100-700:270 (+10% singles)
    assert (law.min, law.max, law.mean) == (100, 700, 270.0)
    sizes = query_sizes(4096, seed=0)
    assert sizes.min() >= 100 and sizes.max() <= 700
    assert sizes.mean() == pytest.approx(270.0, abs=3.0)
    # the same stratified draw loadtest's RequestPool makes
    want = InstancesDistribution(single_fraction=0.0).stratified(
        np.random.default_rng([0, 32]), 4096)
    np.testing.assert_array_equal(sizes, want)
    with_singles = query_sizes(4096, seed=0, single_fraction=0.1)
    assert (with_singles == 1).mean() == pytest.approx(0.1, abs=0.01)


def test_bench_slo_does_not_copy_the_law() -> None:
    src = Path(bench_slo.__file__).read_text()
    assert "from loadtest.traffic import InstancesDistribution" in src
    assert "_fit_lognormal_probs" not in src and "lognormal" not in src


# --- the search on a synthetic latency model --------------------------------------------

def _queue_p99(rate: float, capacity: float = 400.0, base_ms: float = 10.0) -> float:
    """An M/M/1-like p99: base + a tail that explodes as rate -> capacity."""
    if rate >= capacity:
        return math.inf
    return base_ms + 4.6 * 1e3 / (capacity - rate)     # ln(100) / (mu - lambda), in ms


def _synthetic(goal_ms: float, client_max: float = math.inf, calls: list | None = None):
    def measure(rate: float) -> Trial:
        if calls is not None:
            calls.append(rate)
        p99 = _queue_p99(rate)
        client_ok = rate <= client_max
        return Trial(rate_qps=rate, queries=1000, seconds=1000 / rate, failed=0,
                     pairs=270_000, p50_ms=p99 / 3, p99_ms=p99, lag_p99_ms=0.1,
                     lag_max_ms=0.5, client_ok=client_ok,
                     passed=client_ok and p99 <= goal_ms)
    return measure


def test_search_finds_the_rate_where_p99_meets_the_goal() -> None:
    goal = 60.0
    # p99 = goal at capacity - 4600 / (goal - base) = 400 - 92 = 308 q/s
    true_rate = 400.0 - 4.6e3 / (goal - 10.0)
    calls: list[float] = []
    res = search_rate(_synthetic(goal, calls=calls), start_qps=20.0, rel_tol=0.02,
                      max_trials=20)
    assert res.best is not None and res.best.passed
    assert true_rate * 0.98 <= res.best.rate_qps <= true_rate
    assert calls[:5] == [20.0, 40.0, 80.0, 160.0, 320.0]          # coarse: doubling
    assert all(calls[i] < 320.0 for i in range(5, len(calls)))   # then bisect below the fail
    assert not res.client_limited and "bracketed" in res.stop_reason


def test_search_goes_down_when_the_first_trial_fails() -> None:
    res = search_rate(_synthetic(60.0), start_qps=1000.0, rel_tol=0.05, max_trials=20)
    assert res.trials[0].rate_qps == 1000.0 and not res.trials[0].passed
    assert res.trials[1].rate_qps == 500.0
    assert res.best is not None and 290.0 <= res.best.rate_qps <= 308.0


def test_search_flags_a_client_limited_bound() -> None:
    res = search_rate(_synthetic(60.0, client_max=100.0), start_qps=20.0, rel_tol=0.05)
    assert res.client_limited
    assert res.best is not None and res.best.rate_qps <= 100.0


def test_search_reports_when_nothing_passes() -> None:
    res = search_rate(_synthetic(5.0), start_qps=8.0, min_qps=1.0)
    assert res.best is None and "no rate" in res.stop_reason
    assert [t.rate_qps for t in res.trials] == [8.0, 4.0, 2.0, 1.0]


# --- FLOPs -------------------------------------------------------------------------------

def test_flops_formula_matches_torchs_counter_for_a_small_mlp() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    sizes = [13, 32, 16, 1]
    layers = list(itertools.pairwise(sizes))
    assert dense_flops_per_pair(layers) == 2 * (13 * 32 + 32 * 16 + 16 * 1) == 1888
    mlp = torch.nn.Sequential(*[torch.nn.Linear(i, o) for i, o in layers])
    with FlopCounterMode(display=False) as fc:
        mlp(torch.randn(5, 13))
    assert fc.get_total_flops() == 5 * dense_flops_per_pair(layers)


def test_flops_interactions() -> None:
    # dot: V = 3 vectors of D = 4: 3 dots of 8 FLOPs
    assert dense_flops_per_pair([], interaction="dot", num_vectors=3, dim=4) == 24
    # one low-rank cross layer, d 6, r 2: V (2x6) and W (6x2) matmuls + 3 elementwise ops
    assert dense_flops_per_pair([], interaction="dcn", cross_layers=1, cross_rank=2,
                                cross_width=6) == 4 * 6 * 2 + 3 * 6
    with pytest.raises(ValueError, match="interaction 'x'"):
        dense_flops_per_pair([], interaction="x")


def test_dlrm_v2_flops_per_pair() -> None:
    """MLPerf DLRM-v2's dense part: 13-512-256-128, 3 cross layers (d 27 x 128, r 512),
    3456-1024-1024-512-256-1: about 32.09 MFLOP per pair."""
    bottom = [(13, 512), (512, 256), (256, 128)]
    top = [(3456, 1024), (1024, 1024), (1024, 512), (512, 256), (256, 1)]
    f = dense_flops_per_pair(bottom + top, interaction="dcn", cross_layers=3, cross_rank=512,
                             cross_width=27 * 128)
    assert f == 2 * (170_496 + 5_243_136) + 3 * (4 * 3456 * 512 + 3 * 3456) == 32_092_032


# --- the results document -----------------------------------------------------------------

def _doc() -> dict:
    run = {"model": "small", "queries_per_s": 50.0, "pairs_per_s": 13_500.0,
           "pairs_per_s_per_core": 6750.0, "p99_ms": 55.0, "in_process_pairs_per_s": 40_000.0,
           "p50_ms": 20.0, "failed": 0, "form": "context", "served_cpu_per_pair_ratio": 1.2}
    return {"runs": [run], "meta": {"cores": 2}, "command": "python -m bench.bench_slo"}


def test_results_schema() -> None:
    assert validate_results(_doc()) == []
    assert set(REQUIRED_RUN_KEYS) == {"model", "queries_per_s", "pairs_per_s",
                                      "pairs_per_s_per_core", "p99_ms",
                                      "in_process_pairs_per_s", "form",
                                      "served_cpu_per_pair_ratio"}
    bad = _doc()
    del bad["runs"][0]["p99_ms"]
    bad["runs"][0]["pairs_per_s"] = "fast"
    del bad["command"]
    assert validate_results(bad) == ["runs[0]['pairs_per_s'] = 'fast' is not a number",
                                     "runs[0] lacks 'p99_ms'",
                                     "document lacks 'command'"]
    assert validate_results({"runs": []}) == ["'runs' must be a non-empty list"]
    # no rate met the goal: zero rates and no p99 is a valid (honest) answer ...
    none = _doc()
    none["runs"][0] |= {"queries_per_s": 0.0, "pairs_per_s": 0.0, "p99_ms": None,
                        "served_cpu_per_pair_ratio": None}
    assert validate_results(none) == []
    odd = _doc()
    odd["runs"][0]["form"] = "batch"
    assert validate_results(odd) == ["runs[0]['form'] = 'batch' is not one of context, instances"]
    # ... but a p99 is missing only then
    none["runs"][0]["queries_per_s"] = 5.0
    assert validate_results(none) == ["runs[0]['p99_ms'] = None is not a number",
                                      ("runs[0]['served_cpu_per_pair_ratio'] = None is not a "
                                       "number")]


def test_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_slo.main(["--help"])
    assert e.value.code == 0 and "--min-duration-s" in capsys.readouterr().out
    assert bench_slo.main(["--models", "huge"]) == 2
    assert "use any of small, dlrm-v2" in capsys.readouterr().err
    assert bench_slo.main(["--models", "small,dlrm-v2", "--version", "x"]) == 2
    assert bench_slo.main(["--models", "small", "--url", "http://10.0.0.1:8080"]) == 2
    assert bench_slo.main(["--models", "small", "--settle-s", "-1"]) == 2
    assert "--settle-s -1.0 must be between 0 and 600" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_slo.main(["--models", "small", "--body", "xml"])


# --- the open-loop client's early stop --------------------------------------------------

class _SlowServer:
    """A double of the service for the client alone: a loopback HTTP server that answers
    every POST 200 after ``delay_s`` (many at once, like a server with a deep queue), and
    counts what it received."""

    def __init__(self, delay_s: float) -> None:
        import http.server
        import socketserver
        import threading

        self.received = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.received += 1
                import time as _t
                _t.sleep(delay_s)
                body = b'{"probabilities": [0.5]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            request_queue_size = 256     # the stdlib's 5 would refuse a burst of sends

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/predictions/dlrm"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_trial_over_the_goal_stops_early_and_sends_no_more() -> None:
    """Every answer takes 120 ms against a 60 ms goal: once more than 1% of the planned
    queries are known to be late (answered late, or unanswered past the goal) the trial
    stops sending, fails, and says why; the queries it sent are all answered (none
    refused), far fewer than planned."""
    bodies = [(b'{"x": 1}', 270)]
    with _SlowServer(0.12) as srv:
        t = bench_slo.run_trial(srv.url, bodies, 200.0, min_duration_s=5.0, min_queries=1000,
                                p99_goal_ms=60.0, max_client_lag_ms=math.inf,
                                content_type="application/json", seed=3)
    assert t.stopped_early == "late" and not t.passed
    assert t.failed == 0 and t.p99_ms > 60.0
    # unanswered queries count as late once past the goal: the stop comes before the
    # first 11 late answers are even in (about 60 ms of sends after the first is overdue)
    assert 10 < t.queries < 100 and srv.received == t.queries


def test_trial_stops_before_the_services_queue_would_overflow() -> None:
    """A goal the server meets (1 s) but more in flight than its queue holds: the trial
    stops at ``max_in_flight`` unanswered queries instead of pushing on into 503s."""
    bodies = [(b'{"x": 1}', 270)]
    with _SlowServer(0.5) as srv:
        t = bench_slo.run_trial(srv.url, bodies, 200.0, min_duration_s=2.0, min_queries=100,
                                p99_goal_ms=1000.0, max_client_lag_ms=math.inf,
                                content_type="application/json", seed=3, max_in_flight=20)
    assert t.stopped_early == "in_flight" and not t.passed
    assert t.queries == srv.received == 20 and t.failed == 0


def test_trial_within_the_goal_sends_every_query() -> None:
    bodies = [(b'{"x": 1}', 270)]
    with _SlowServer(0.002) as srv:
        t = bench_slo.run_trial(srv.url, bodies, 100.0, min_duration_s=0.5, min_queries=60,
                                p99_goal_ms=1000.0, max_client_lag_ms=math.inf,
                                content_type="application/json", seed=3)
    assert t.stopped_early is None and t.passed
    assert t.queries == srv.received == trial_queries(100.0, 0.5, 60)
    assert t.pairs == 270 * t.queries
    assert t.cpu_ms_per_query is None           # not asked for


def test_trial_splits_its_cpu_per_query_when_asked() -> None:
    """With ``watch`` (here: the client alone, no service run dir) the trial carries the
    CPU split; the double's server threads live in this process, so it is all "client"."""
    from bench.cpu_account import GROUPS, service_processes

    bodies = [(b'{"x": 1}', 270)]
    with _SlowServer(0.002) as srv:
        t = bench_slo.run_trial(srv.url, bodies, 200.0, min_duration_s=0.5, min_queries=100,
                                p99_goal_ms=1000.0, max_client_lag_ms=math.inf,
                                content_type="application/json", seed=3,
                                watch=lambda: service_processes(None))
    cpu = t.cpu_ms_per_query
    assert cpu is not None and set(cpu) == set(GROUPS) | {"total", "busy_cores"}
    assert cpu["client"] > 0 and cpu["frontend"] == cpu["workers"] == cpu["sidecar"] == 0
    assert cpu["total"] >= cpu["client"] and cpu["busy_cores"] > 0


def test_binary_bodies_parse_to_what_the_json_ones_do() -> None:
    import orjson

    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.api.json_body import example_request
    from serve.api.request import BINARY_MEDIA_TYPE, JSON_MEDIA_TYPE

    cfg = HandlerConfig.from_dict({})
    bodies = [(orjson.dumps(example_request(n, seed=n, form="columnar")), n) for n in (1, 7, 300)]
    out = bench_slo.as_binary(bodies, None)
    assert [n for _, n in out] == [1, 7, 300]
    for (j, _), (b, _) in zip(bodies, out, strict=True):
        pj = parse_body(j, cfg, JSON_MEDIA_TYPE)
        pb = parse_body(b, cfg, BINARY_MEDIA_TYPE)
        for f in ("dense", "lengths", "values"):
            assert np.array_equal(getattr(pj, f), getattr(pb, f))


def test_binary_bodies_keep_the_versions_limits() -> None:
    """``as_binary`` parses under the version's own ``handler`` limits, not the defaults:
    a feature of 30 ids converts under the defaults (64) and is refused by a version whose
    handler allows 16 (DLRM-v2's multi-hot bodies need its own, larger limits)."""
    import orjson

    from serve.api.json_body import example_request
    from serve.errors import InvalidInput

    doc = example_request(2, seed=3, form="columnar")
    first = next(iter(doc["sparse"]))
    doc["sparse"][first] = {"values": list(range(40)), "lengths": [30, 10]}
    bodies = [(orjson.dumps(doc), 2)]
    out = bench_slo.as_binary(bodies, None)
    assert len(out) == 1 and out[0][1] == 2
    with pytest.raises(InvalidInput, match="30 ids"):
        bench_slo.as_binary(bodies, None, {"max_ids_per_feature": 16})


def test_gemm_peak_skips_larger_sizes_once_one_product_outlasts_a_window() -> None:
    # a window of 0 s: the first product already outlasts it, so it stands for its size
    # and the larger ones are skipped (a CPU with no fast bf16 kernel would otherwise
    # spend minutes on 2048 squares)
    slow = bench_slo.gemm_peak(1, sizes=(32, 64, 128), dtypes=("fp32",), seconds=0.0)
    assert list(slow["by_size"]) == ["fp32_32"] and slow["by_size"]["fp32_32"] > 0
    assert slow["skipped"] == ["fp32_64", "fp32_128"]
    assert slow["peak"]["fp32"] == slow["by_size"]["fp32_32"]
    # fast products: every size measured over its windows, nothing skipped
    fast = bench_slo.gemm_peak(1, sizes=(8, 16), dtypes=("fp32",), seconds=0.03)
    assert list(fast["by_size"]) == ["fp32_8", "fp32_16"] and fast["skipped"] == []
    assert fast["peak"]["fp32"] == max(fast["by_size"].values())


# --- the real thing, briefly ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_real_run_briefly(tiny_build, tmp_path: Path) -> None:
    """Own TorchServe + sidecar on free ports, a few 1.5 s trials: the document is whole,
    nothing failed at the rate found, and the state measured is declared."""
    out = tmp_path / "slo.json"
    rc = bench_slo.main(["--models", "small", "--version", tiny_build.version,
                         "--model-store", str(tiny_build.repository),
                         "--min-duration-s", "1.5", "--min-queries", "10", "--start-qps", "4",
                         "--max-trials", "2", "--pool", "8", "--inprocess-s", "0.5",
                         "--gemm-s", "0.1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert validate_results(doc) == []
    # both forms against the same service: the context form first, then the instances
    assert [r["form"] for r in doc["runs"]] == ["context", "instances"]
    ctx = doc["runs"][0]
    assert ctx["context_features"] == [f"C{i}" for i in range(1, 14)]
    for r in doc["runs"]:
        assert r["in_process_cpu_ms_per_pair"] > 0
        if r["queries_per_s"] > 0:
            assert r["served_cpu_ms_per_pair"] > 0 and r["served_cpu_per_pair_ratio"] > 0
    run = doc["runs"][1]
    assert run["model"] == "small" and run["version"] == tiny_build.version
    assert run["in_process_pairs_per_s"] > 0 and run["cores"] >= 1
    assert run["trials"] and all(t["queries"] >= 10 for t in run["trials"])
    # the CPU split per query, from the service's own process groups (its pids.json)
    for t in run["trials"]:
        cpu = t["cpu_ms_per_query"]
        assert cpu["workers"] > 0 and cpu["frontend"] > 0 and cpu["client"] > 0, cpu
        # the workers' CPU inside predict (their dlrm_predict_cpu_seconds_total, read
        # from the sidecar): part of the workers' CPU, never more (tick rounding aside)
        assert 0 < cpu["workers_predict"] <= cpu["workers"] + 0.5, cpu
    for r in doc["runs"]:
        if r["queries_per_s"] > 0:
            assert r["served_predict_cpu_ms_per_pair"] > 0 and r["served_predict_ratio"] > 0
            assert r["served_overhead_cpu_ms_per_pair"] == pytest.approx(
                r["served_cpu_ms_per_pair"] - r["served_predict_cpu_ms_per_pair"], abs=1e-4)
    assert run["in_process_cpu_ms_per_query"] > 0 and run["body"] == "json"
    if run["queries_per_s"] > 0:
        assert run["failed"] == 0 and run["p99_ms"] <= 60.0
    st = run["state"]
    assert st["version"] == tiny_build.version and st["workers"] >= 1
    assert set(st["batching"]) == {"batch_size", "max_batch_delay_ms"}
    assert doc["meta"]["gemm"]["peak"]["fp32"] > 0
    # where it ran: this machine's CPU, as serve.ops.machine reads it
    assert doc["meta"]["machine"]["cpu_model"] == machine_info()["cpu_model"]
    assert doc["meta"]["machine"]["logical_cores"] == run["cores"]
    assert "--min-duration-s 1.5" in doc["command"]


def test_flops_read_from_an_exported_dcn_artifact() -> None:
    """A tiny DLRM_DCN exported as the importer exports it: the shapes the benchmark reads
    from the program give the formula's count (and match torch's own counter)."""
    from types import SimpleNamespace

    from torch.utils.flop_counter import FlopCounterMode
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from bench.bench_slo import artifact_dense_flops
    from serve.model.export import export_dense, model_schema

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10,
                                 feature_names=[f"f{i}"]) for i in range(3)]
    model = DLRM_DCN(embedding_bag_collection=EmbeddingBagCollection(tables=tables),
                     dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                     over_arch_layer_sizes=[12, 1], dcn_num_layers=2, dcn_low_rank_dim=4).eval()
    schema = model_schema(model, 5)
    got = artifact_dense_flops(SimpleNamespace(schema=schema, dense=export_dense(model, schema)))
    d = 4 * 8                                   # (F + 1) * D
    want = dense_flops_per_pair([(5, 16), (16, 8), (d, 12), (12, 1)], interaction="dcn",
                                cross_layers=2, cross_rank=4, cross_width=d)
    assert got["flops_per_pair"] == want
    assert got["interaction"] == {"cross_layers": 2, "rank": 4, "width": d}
    # torch's counter sees the matmuls only (no bias, no elementwise): 4 d r per layer
    with FlopCounterMode(display=False) as fc:
        model.over_arch(model.inter_arch(model.dense_arch(torch.randn(1, 5)),
                                         torch.randn(1, 3, 8)))
    assert fc.get_total_flops() == want - 2 * 3 * d


def test_cpu_per_pair_splits_the_served_cpu_into_predict_and_the_rest() -> None:
    """Served CPU per pair = frontend + workers + sidecar over the pairs; the workers'
    share inside predict against the in-process figure; the rest is serving."""
    from bench.bench_slo import cpu_per_pair

    cpu = {"client": 1.0, "frontend": 2.0, "workers": 6.0, "sidecar": 0.2, "other": 0.0,
           "workers_predict": 4.4}
    got = cpu_per_pair(cpu, 200.0, 0.02)
    assert got["served_cpu_ms_per_pair"] == pytest.approx(8.2 / 200)
    assert got["served_cpu_per_pair_ratio"] == pytest.approx(8.2 / 200 / 0.02, abs=1e-3)
    assert got["served_predict_cpu_ms_per_pair"] == pytest.approx(4.4 / 200)
    assert got["served_predict_ratio"] == pytest.approx(1.1)
    assert got["served_overhead_cpu_ms_per_pair"] == pytest.approx(3.8 / 200)
    # without the workers' counter: no split, the served figure as before
    old = cpu_per_pair({k: v for k, v in cpu.items() if k != "workers_predict"}, 200.0, 0.02)
    assert old["served_predict_ratio"] is None and old["served_overhead_cpu_ms_per_pair"] is None
    assert old["served_cpu_per_pair_ratio"] == got["served_cpu_per_pair_ratio"]
