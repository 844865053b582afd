"""serve.metrics: HandlerMetrics on a fresh registry, and across real worker processes in
prometheus_client multiprocess mode, summed by the sidecar's collector."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import BATCH_REQUESTS_BUCKETS, REQUEST_DURATION_BUCKETS
from serve.metrics.aggregate import (
    HandlerAggregateCollector,
    cache_hit_ratio_family,
    torchserve_families,
    workers_family,
)
from serve.metrics.multiprocess import clean_dead_worker_files
from serve.metrics.sidecar import SidecarMetrics
from serve.metrics.worker import HandlerMetrics
from tests.promtext import samples

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Stats:  # the fields of serve.runtime.engine.RuntimeStats that HandlerMetrics reads
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    device_bytes: int = 0
    host_bytes: int = 0




def test_buckets_span_half_a_millisecond_to_a_second():
    assert REQUEST_DURATION_BUCKETS[0] == 0.0005 and REQUEST_DURATION_BUCKETS[-1] == 1.0
    assert list(REQUEST_DURATION_BUCKETS) == sorted(REQUEST_DURATION_BUCKETS)
    assert 4096 in BATCH_REQUESTS_BUCKETS and all(b in BATCH_REQUESTS_BUCKETS for b in range(1, 9))


def test_observe_requests_equals_one_observe_request_per_request():
    one, many = CollectorRegistry(), CollectorRegistry()
    a, b = HandlerMetrics(one), HandlerMetrics(many)
    for _ in range(32):
        a.observe_request(200, 1, 0.25)  # a power of 2: the sums add exactly
    a.observe_request(400, 0, 0.25)
    b.observe_requests(200, 32, 32, 0.25)
    b.observe_requests(400, 1, 0, 0.25)
    def samples(reg):  # *_created is when each series began: it differs by design
        return [ln for ln in generate_latest(reg).decode().splitlines() if "_created" not in ln]
    assert samples(one) == samples(many)
    with pytest.raises(ValueError, match="requests=0"):
        b.observe_requests(200, 0, 0, 0.001)


def test_handler_metrics_counts_exactly_on_a_fresh_registry():
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    for code, n, s in [(200, 512, 0.004), (200, 3, 0.0004), (400, 0, 0.0002), (200, 1, 2.0)]:
        m.observe_request(code, n, s)
    m.observe_batch(instances=515, requests=2)
    m.observe_batch(instances=1, requests=1)
    m.observe_stages({"decode": 0.0001, "embedding": 0.002, "dense": 0.01})
    m.observe_stages({"decode": 0.0003, "bogus": 1.0})  # unknown stage: dropped, no label
    get = reg.get_sample_value
    assert get("dlrm_requests_total", {"code": "200"}) == 3
    assert get("dlrm_requests_total", {"code": "400"}) == 1
    assert get("dlrm_instances_total") == 516
    assert get("dlrm_request_duration_seconds_count") == 4
    assert get("dlrm_request_duration_seconds_bucket", {"le": "0.0005"}) == 2
    assert get("dlrm_request_duration_seconds_bucket", {"le": "1.0"}) == 3
    assert get("dlrm_request_duration_seconds_sum") == pytest.approx(2.0046, abs=1e-12)
    assert get("dlrm_batch_instances_bucket", {"le": "512.0"}) == 1
    assert get("dlrm_batch_instances_bucket", {"le": "1024.0"}) == 2
    assert get("dlrm_batch_requests_bucket", {"le": "1.0"}) == 1
    assert get("dlrm_batch_requests_count") == 2
    assert get("dlrm_stage_duration_seconds_count", {"stage": "decode"}) == 2
    assert get("dlrm_stage_duration_seconds_sum", {"stage": "dense"}) == pytest.approx(0.01)
    assert get("dlrm_stage_duration_seconds_count", {"stage": "bogus"}) is None


def test_set_cache_turns_cumulative_stats_into_counter_deltas():
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    m.set_cache(Stats(hits=10, misses=5, evictions=1, device_bytes=1000, host_bytes=5000))
    m.set_cache(Stats(hits=30, misses=6, evictions=1, device_bytes=1200, host_bytes=5000))
    get = reg.get_sample_value
    assert (get("dlrm_cache_hits_total"), get("dlrm_cache_misses_total"),
            get("dlrm_cache_evictions_total")) == (30, 6, 1)
    assert get("dlrm_cache_device_bytes") == 1200 and get("dlrm_cache_host_bytes") == 5000
    # A rebuilt runtime counts from zero again: counted as a reset, never negative.
    m.set_cache(Stats(hits=4, misses=2))
    assert (get("dlrm_cache_hits_total"), get("dlrm_cache_misses_total")) == (34, 8)
    ratio = cache_hit_ratio_family(reg.collect())
    assert ratio.samples[0].value == pytest.approx(34 / 42)


def test_set_wrapped_counts_each_increase_once_and_skips_a_batch_that_wrapped_nothing():
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    names = ["C1", "C2"]

    def got():
        return tuple(reg.get_sample_value("dlrm_embedding_ids_wrapped_total", {"feature": n})
                     for n in names)

    m.skip_cache(Stats(), names, (5, 0))   # the warm-up's counts: the starting point
    m.set_wrapped(names, (5, 0))           # nothing new (the fast path)
    assert got() == (0, 0)
    m.set_wrapped(names, (7, 3))
    m.set_wrapped(names, (7, 3))           # the same counts again: counted once
    assert got() == (2, 3)
    m.set_wrapped(names, (1, 3))           # a rebuilt runtime counts from zero again
    assert got() == (3, 3)
    m.set_wrapped(names, (1, 6))           # one feature moved: only its series advances
    assert got() == (3, 6)


def test_hit_ratio_is_nan_before_any_lookup():
    assert math.isnan(cache_hit_ratio_family(CollectorRegistry().collect()).samples[0].value)


def test_bad_values_are_refused_with_the_rule():
    m = HandlerMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match=r"HTTP code 42 is outside 100\.\.599"):
        m.observe_request(42, 1, 0.1)
    with pytest.raises(ValueError, match=r"instances=-1 and seconds=0.1 must be >= 0"):
        m.observe_request(200, -1, 0.1)
    with pytest.raises(ValueError, match=r"requests=0 >= 1"):
        m.observe_batch(3, 0)


def test_two_instances_in_one_process_do_not_collide_by_default():
    HandlerMetrics()
    HandlerMetrics()  # private registries: no "Duplicated timeseries"


_WORKER = textwrap.dedent("""
    import os, sys
    from dataclasses import dataclass
    from serve.metrics.worker import HandlerMetrics
    @dataclass
    class S:
        hits: int; misses: int; evictions: int; device_bytes: int; host_bytes: int
    k = int(sys.argv[1])
    m = HandlerMetrics()
    for i in range(k):
        m.observe_request(200, 10, 0.002)
    m.observe_request(413, 0, 0.0001)
    m.observe_batch(instances=10 * k, requests=k)
    m.observe_stages({"decode": 0.0001, "embedding": 0.0002, "dense": 0.003})
    m.set_cache(S(hits=k, misses=1, evictions=0, device_bytes=100 * k, host_bytes=7))
    m.set_cache(S(hits=2 * k, misses=2, evictions=1, device_bytes=100 * k, host_bytes=7))
    print(os.getpid())
""")


def _run_workers(mp_dir: Path, ks: list[int]) -> list[int]:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(k)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True) for k in ks]
    pids = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        pids.append(int(out.strip()))
    return pids


def test_multiprocess_workers_are_summed_by_the_sidecar_collector(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    pid3, pid5 = _run_workers(mp_dir, [3, 5])
    reg = CollectorRegistry()
    collector = HandlerAggregateCollector(mp_dir)
    reg.register(collector)
    got = samples(generate_latest(reg).decode())
    assert got[("dlrm_requests_total", (("code", "200"),))] == 8
    assert got[("dlrm_requests_total", (("code", "413"),))] == 2
    assert got[("dlrm_instances_total", ())] == 80
    assert got[("dlrm_request_duration_seconds_count", ())] == 10
    assert got[("dlrm_batch_requests_bucket", (("le", "3.0"),))] == 1
    assert got[("dlrm_batch_requests_bucket", (("le", "5.0"),))] == 2
    assert got[("dlrm_stage_duration_seconds_count", (("stage", "dense"),))] == 2
    assert got[("dlrm_cache_hits_total", ())] == 16
    assert got[("dlrm_cache_misses_total", ())] == 4
    assert got[("dlrm_cache_evictions_total", ())] == 2
    assert got[("dlrm_cache_hit_ratio", ())] == pytest.approx(16 / 20)
    assert got[("dlrm_cache_device_bytes", ())] == 800  # livesum over both workers
    assert got[("dlrm_cache_host_bytes", ())] == 14

    # Both listed by TorchServe, then worker "5" is gone: its live gauges go, its
    # counters stay (a counter must never go down).
    assert collector.reap([pid3, pid5]) == []
    assert collector.reap([pid3]) == [pid5]
    got = samples(generate_latest(reg).decode())
    assert got[("dlrm_cache_device_bytes", ())] == 300
    assert got[("dlrm_cache_hits_total", ())] == 16
    # A pid never seen alive is never reaped (it may be a worker still starting).
    assert collector.reap([]) == [pid3]
    assert collector.reap([]) == []


def test_forget_drops_gauges_of_workers_never_scraped(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    pid2, _pid4 = _run_workers(mp_dir, [2, 4])
    reg = CollectorRegistry()
    collector = HandlerAggregateCollector(mp_dir)
    reg.register(collector)
    collector.forget([pid2])  # its version was unregistered before any scrape saw it
    got = samples(generate_latest(reg).decode())
    assert got[("dlrm_cache_device_bytes", ())] == 400
    assert got[("dlrm_requests_total", (("code", "200"),))] == 6


def test_missing_multiproc_dir_yields_only_the_ratio(tmp_path):
    reg = CollectorRegistry()
    reg.register(HandlerAggregateCollector(tmp_path / "absent"))
    fams = list(text_string_to_metric_families(generate_latest(reg).decode()))
    assert [f.name for f in fams] == ["dlrm_cache_hit_ratio"]


TS_TEXT = """\
# HELP ts_inference_requests_total Total number of inference requests.
# TYPE ts_inference_requests_total counter
ts_inference_requests_total{uuid="abc",model_name="dlrm",model_version="default",} 7.0
# HELP Requests2XX Torchserve prometheus counter metric with unit: Count
# TYPE Requests2XX counter
Requests2XX{Level="Host",Hostname="h",} 7.0
# HELP MemoryUsed Torchserve prometheus gauge metric with unit: Megabytes
# TYPE MemoryUsed gauge
MemoryUsed{Level="Host",Hostname="h",} 1234.5
"""


def test_torchserve_metrics_are_reexposed_under_ts_prefix():
    reg = CollectorRegistry()

    class Fixed:
        def collect(self):
            return torchserve_families(TS_TEXT)

    reg.register(Fixed())
    got = samples(generate_latest(reg).decode())
    assert got[("ts_inference_requests_total",
                (("model_name", "dlrm"), ("model_version", "default"), ("uuid", "abc")))] == 7
    assert got[("ts_Requests2XX_total", (("Hostname", "h"), ("Level", "Host")))] == 7
    assert got[("ts_MemoryUsed", (("Hostname", "h"), ("Level", "Host")))] == 1234.5


def _ts_text_after_switches(switches: int) -> str:
    """TorchServe's exposition after ``switches`` batching switches of small-int8-s0 and a
    rollout to small-int8-s7: one registration (serving version) per switch, each with
    its own cumulative series (TorchServe keeps them after the unregister)."""
    versions = [f"small-int8-s0_b{2 + i}d{i % 5}w2" for i in range(switches)]
    versions.append("small-int8-s0_b8d5w2_csmall-int8-s7")
    lines = ["# HELP ts_inference_requests_total Total number of inference requests.",
             "# TYPE ts_inference_requests_total counter"]
    lines += [f'ts_inference_requests_total{{uuid="u",model_name="dlrm",model_version="{v}",}} '
              f"{10.0 * (i + 1)}" for i, v in enumerate(versions)]
    lines += ["# HELP ts_queue_latency_microseconds Cumulative queue duration.",
              "# TYPE ts_queue_latency_microseconds counter"]
    lines += [f'ts_queue_latency_microseconds{{uuid="u",model_name="dlrm",model_version="{v}",}} '
              "5.0" for v in versions]
    lines += ["# HELP Requests2XX Count", "# TYPE Requests2XX counter",
              'Requests2XX{Level="Host",Hostname="h",} 7.0']
    return "\n".join(lines) + "\n"


def test_ts_series_do_not_grow_per_serving_version():
    """A scrape after 20 tuner switches (and a rollout) has <= 2 model_version values per
    ts_ family: each registration's series is re-exposed under the model version it
    serves, counters summed (so they stay cumulative); without the mapping it grows."""
    from serve.sidecar.http.routes_metrics import ts_model_version

    text = _ts_text_after_switches(20)

    def scrape(**kw) -> dict:
        reg = CollectorRegistry()

        class Fixed:
            def collect(self):
                return torchserve_families(text, **kw)

        reg.register(Fixed())
        return samples(generate_latest(reg).decode())

    def versions_per_family(got: dict) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for name, labels in got:
            out.setdefault(name, set()).update(v for k, v in labels if k == "model_version")
        return out

    raw = versions_per_family(scrape())
    assert len(raw["ts_inference_requests_total"]) == 21, "the fixture must grow unmapped"
    got = scrape(version_of=ts_model_version)
    per_family = versions_per_family(got)
    assert per_family["ts_inference_requests_total"] == {"small-int8-s0"}
    assert all(len(v) <= 2 for v in per_family.values()), per_family
    key = (("model_name", "dlrm"), ("model_version", "small-int8-s0"), ("uuid", "u"))
    assert got[("ts_inference_requests_total", key)] == sum(10.0 * (i + 1) for i in range(21))
    assert got[("ts_queue_latency_microseconds_total", key)] == 5.0 * 21
    assert got[("ts_Requests2XX_total", (("Hostname", "h"), ("Level", "Host")))] == 7
    assert ts_model_version("foreign") == "foreign"


def test_torchserve_garbage_is_a_value_error():
    with pytest.raises(ValueError):
        torchserve_families("this is {not prometheus\n")


def test_workers_family_counts_by_status_and_always_has_ready():
    fam = workers_family(["READY", "READY", "WORKER_STARTED"])
    assert {s.labels["status"]: s.value for s in fam.samples} == {
        "READY": 2, "WORKER_STARTED": 1}
    assert {s.labels["status"]: s.value for s in workers_family([]).samples} == {"READY": 0}


def test_sidecar_metrics_are_plain_and_bounded():
    sm = SidecarMetrics()
    sm.observe_request("/batching", "PUT", 401)
    sm.observe_request("/batching", "PUT", 401)
    sm.observe_update("applied", 3.5)
    sm.set_up("metrics", True)
    with pytest.raises(ValueError, match="update result 'nope' is not one of"):
        sm.observe_update("nope")
    reg = CollectorRegistry()
    reg.register(sm)
    got = samples(generate_latest(reg).decode())
    assert got[("dlrm_sidecar_requests_total",
                (("code", "401"), ("method", "PUT"), ("route", "/batching")))] == 2
    assert got[("dlrm_batching_updates_total", (("result", "applied"),))] == 1
    assert got[("dlrm_batching_last_update_duration_seconds", ())] == 3.5
    assert got[("dlrm_upstream_up", (("target", "metrics"),))] == 1
    assert got[("dlrm_upstream_up", (("target", "management"),))] == 0


def test_reconcile_metrics_converged_gauge_and_bounded_results():
    import math

    from serve.metrics import RECONCILE_RESULTS

    sm = SidecarMetrics()
    reg = CollectorRegistry()
    reg.register(sm)
    got = samples(generate_latest(reg).decode())
    assert math.isnan(got[("dlrm_state_converged", ())])  # no desired state: unknown
    assert {dict(lab)["result"] for (name, lab) in got if name == "dlrm_reconcile_total"} \
        == set(RECONCILE_RESULTS)
    sm.set_converged(False)
    sm.observe_reconcile("applied")
    sm.observe_reconcile("applied")
    sm.observe_reconcile("refused")
    with pytest.raises(ValueError, match=r"reconcile result 'oops' is not one of \('converged'"):
        sm.observe_reconcile("oops")
    got = samples(generate_latest(reg).decode())
    assert got[("dlrm_state_converged", ())] == 0
    assert got[("dlrm_reconcile_total", (("result", "applied"),))] == 2
    assert got[("dlrm_reconcile_total", (("result", "refused"),))] == 1
    assert got[("dlrm_reconcile_total", (("result", "converged"),))] == 0
    sm.set_converged(True)
    assert samples(generate_latest(reg).decode())[("dlrm_state_converged", ())] == 1


# ------------------------------------------------------------------- rollouts: per-arm series

def _edge_values() -> list[float]:
    """Dyadic values (exact in float64, so any summation order gives the same sum),
    exactly on bucket bounds, between them, below the first and above the last."""
    import numpy as np

    rng = np.random.default_rng(0)
    vals = [0.0, 0.5, 1.0, 0.25, 0.125, 2.0, 1024.0, -0.5, -3.0, float("inf")]
    vals += list(np.round(rng.random(500) * 1024) / 1024)
    return vals


@pytest.mark.parametrize("buckets", ["SCORE_BUCKETS", "SCORE_DIFF_BUCKETS",
                                     "REQUEST_DURATION_BUCKETS"])
def test_observe_many_equals_a_loop_of_observe(buckets):
    """Pins the prometheus_client internals observe_many writes (checked against 0.26.0):
    the exposition must equal the one of a loop of observe() on the same values."""
    import numpy as np
    from prometheus_client import Histogram

    import serve.metrics as sm
    from serve.metrics.worker import observe_many

    bounds = getattr(sm, buckets)
    vals = _edge_values() + [float(b) for b in bounds] + [np.nextafter(b, 2.0) for b in bounds]
    texts = []
    for bulk in (False, True):
        reg = CollectorRegistry()
        h = Histogram("x_seconds", "help", ["arm"], buckets=bounds, registry=reg)
        plain = Histogram("y_seconds", "help", buckets=bounds, registry=reg)
        if bulk:
            assert observe_many(h.labels(arm="stable"), np.array(vals, np.float64)) == len(vals)
            assert observe_many(plain, np.array(vals, np.float32)) == len(vals)
        else:
            for v in vals:
                h.labels(arm="stable").observe(float(v))
                plain.observe(float(np.float32(v)))
        texts.append(generate_latest(reg).decode())
    strip = [re.sub(r"^.*_created.*$", "", t, flags=re.MULTILINE) for t in texts]
    assert strip[0] == strip[1]
    assert 'le="+Inf"' in texts[1]


def test_observe_many_on_random_scores_matches_up_to_the_float_sum():
    import numpy as np
    from prometheus_client import Histogram

    from serve.metrics import SCORE_BUCKETS
    from serve.metrics.worker import observe_many

    vals = np.random.default_rng(3).random(5000).astype(np.float32)
    got = []
    for bulk in (False, True):
        reg = CollectorRegistry()
        h = Histogram("s", "help", buckets=SCORE_BUCKETS, registry=reg)
        if bulk:
            observe_many(h, vals)
        else:
            for v in vals:
                h.observe(float(v))
        got.append(samples(generate_latest(reg).decode()))
    loop, bulk_ = got
    assert {k: v for k, v in loop.items() if k[0] != "s_sum" and "created" not in k[0]} == \
        {k: v for k, v in bulk_.items() if k[0] != "s_sum" and "created" not in k[0]}
    assert bulk_[("s_sum", ())] == pytest.approx(loop[("s_sum", ())], rel=1e-12)


def test_observe_many_skips_nan_and_refuses_a_labelled_parent():
    import numpy as np
    from prometheus_client import Counter, Histogram

    from serve.metrics.worker import observe_many

    reg = CollectorRegistry()
    h = Histogram("h", "help", ["arm"], buckets=(1.0,), registry=reg)
    assert observe_many(h.labels(arm="a"), np.array([0.5, np.nan, 2.0])) == 2
    assert reg.get_sample_value("h_sum", {"arm": "a"}) == 2.5
    assert reg.get_sample_value("h_count", {"arm": "a"}) == 2
    assert observe_many(h.labels(arm="a"), np.array([])) == 0
    with pytest.raises(ValueError, match="missing label values"):
        observe_many(h, np.array([1.0]))
    with pytest.raises(TypeError, match="needs a prometheus_client Histogram"):
        observe_many(Counter("c", "help", registry=reg), np.array([1.0]))  # type: ignore[arg-type]


def test_arm_metrics_count_requests_errors_latency_and_scores():
    import numpy as np

    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    m.observe_arm("stable", "v1", requests=3, errors=0, seconds_per_request=0.004,
                  scores=np.array([0.001, 0.3, 0.3, 0.99]))  # float64: exactly on bounds
    m.observe_arm("candidate", "v2", requests=2, errors=2, seconds_per_request=0.2,
                  scores=None)
    m.observe_arm("candidate", "v2", requests=1, errors=0, seconds_per_request=0.02,
                  scores=np.array([0.6], np.float32))
    m.observe_shadow_diff("v2", np.array([-0.3, 0.0, 0.0004, 0.7]))
    get = reg.get_sample_value
    s, c = {"arm": "stable", "version": "v1"}, {"arm": "candidate", "version": "v2"}
    assert get("dlrm_arm_requests_total", s) == 3 and get("dlrm_arm_errors_total", s) == 0
    assert get("dlrm_arm_requests_total", c) == 3 and get("dlrm_arm_errors_total", c) == 2
    assert get("dlrm_arm_request_duration_seconds_count", s) == 3
    assert get("dlrm_arm_request_duration_seconds_sum", s) == pytest.approx(0.012)
    assert get("dlrm_arm_request_duration_seconds_bucket", {**s, "le": "0.005"}) == 3
    assert get("dlrm_arm_request_duration_seconds_bucket", {**c, "le": "0.025"}) == 1
    assert get("dlrm_arm_request_duration_seconds_bucket", {**c, "le": "0.25"}) == 3
    assert get("dlrm_arm_score_count", s) == 4
    assert get("dlrm_arm_score_bucket", {**s, "le": "0.001"}) == 1
    assert get("dlrm_arm_score_bucket", {**s, "le": "0.3"}) == 3
    assert get("dlrm_arm_score_count", c) == 1
    d = {"version": "v2"}
    assert get("dlrm_shadow_score_diff_count", d) == 4
    assert get("dlrm_shadow_score_diff_bucket", {**d, "le": "-0.2"}) == 1
    assert get("dlrm_shadow_score_diff_bucket", {**d, "le": "0.0"}) == 2
    assert get("dlrm_shadow_score_diff_bucket", {**d, "le": "0.001"}) == 3
    assert get("dlrm_shadow_score_diff_bucket", {**d, "le": "1.0"}) == 4


def test_arm_metrics_refuse_bad_values_with_the_rule():
    m = HandlerMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match=r"arm 'blue' is not one of \('stable', 'candidate'\)"):
        m.observe_arm("blue", "v1", 1, 0, 0.1)
    with pytest.raises(ValueError, match=r"version '' must be a non-empty model version"):
        m.observe_arm("stable", "", 1, 0, 0.1)
    with pytest.raises(ValueError, match=r"errors=2 in 0..requests"):
        m.observe_arm("stable", "v1", 1, 2, 0.1)
    with pytest.raises(ValueError, match=r"seconds_per_request=nan must be finite"):
        m.observe_arm("stable", "v1", 1, 0, float("nan"))


_ARM_WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from prometheus_client import Histogram
    from serve.metrics import SCORE_BUCKETS
    from serve.metrics.worker import HandlerMetrics, observe_many
    vals = np.random.default_rng(int(sys.argv[1])).random(3000).astype(np.float32)
    m = HandlerMetrics()
    if sys.argv[2] == "bulk":
        m.observe_arm("candidate", "v2", 3, 1, 0.01, vals)
    else:
        m.observe_arm("candidate", "v2", 3, 1, 0.01, None)
        child = m._arm_score.labels(arm="candidate", version="v2")
        for v in vals:
            child.observe(float(v))
""")


def test_observe_many_in_multiprocess_mode_equals_observe(tmp_path):
    """The same values through the mmap files (as in a TorchServe worker), bulk vs loop."""
    got = []
    for how in ("loop", "bulk"):
        mp_dir = tmp_path / how
        mp_dir.mkdir()
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-c", _ARM_WORKER, "11", how], cwd=REPO, env=env,
                       check=True, timeout=60)
        reg = CollectorRegistry()
        reg.register(HandlerAggregateCollector(mp_dir))
        got.append({k: v for k, v in samples(generate_latest(reg).decode()).items()
                    if k[0].startswith("dlrm_arm")})
    loop, bulk = got
    assert loop.keys() == bulk.keys()
    key = ("dlrm_arm_score_sum", (("arm", "candidate"), ("version", "v2")))
    for k in loop:
        if k == key:
            assert bulk[k] == pytest.approx(loop[k], rel=1e-12)
        else:
            assert bulk[k] == loop[k], k
    assert bulk[("dlrm_arm_score_count", (("arm", "candidate"), ("version", "v2")))] == 3000
    assert bulk[("dlrm_arm_errors_total", (("arm", "candidate"), ("version", "v2")))] == 1


# ------------------------------------------------- dead workers' files (clean at worker start)

_GAUGES = ("dlrm_cache_device_bytes", "dlrm_cache_host_bytes")


def _exposed(mp_dir: Path) -> dict[tuple[str, tuple], float]:
    """What the sidecar would expose from ``mp_dir`` (summed over the files)."""
    reg = CollectorRegistry()
    reg.register(HandlerAggregateCollector(mp_dir))
    return samples(generate_latest(reg).decode())


def _db_files(mp_dir: Path) -> set[str]:
    return {p.name for p in mp_dir.glob("*.db")}


def _assert_same_sums(before: dict, after: dict, skip: tuple[str, ...] = _GAUGES) -> None:
    """Every counter/histogram series equal: exactly, or to rounding for float ``_sum``s."""
    kept = {k: v for k, v in before.items() if k[0] not in skip}
    assert kept.keys() == {k for k in after if k[0] not in skip}
    for k, v in kept.items():
        if k[0].endswith("_sum") or k[0] == "dlrm_cache_hit_ratio":
            assert after[k] == pytest.approx(v, rel=1e-12), k
        else:
            assert after[k] == v, k


def test_dead_workers_files_are_merged_and_the_sums_never_go_back(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    pid3, pid5 = sorted(_run_workers(mp_dir, [3, 5]))  # both have exited
    assert len(_db_files(mp_dir)) == 6  # counter, histogram, gauge_livesum per worker
    before = _exposed(mp_dir)
    assert before[("dlrm_cache_device_bytes", ())] == 800

    report = clean_dead_worker_files(mp_dir)
    assert report.dead_pids == (pid3, pid5)
    assert sorted(report.gauges_removed) == sorted(f"gauge_livesum_{p}.db" for p in (pid3, pid5))
    assert sorted(report.merged) == sorted(f"{t}_{p}.db" for t in ("counter", "histogram")
                                           for p in (pid3, pid5))
    assert (report.files_before, report.files_after) == (6, 2)
    assert _db_files(mp_dir) == {"counter_merged.db", "histogram_merged.db"}
    assert report.describe() == (f"2 dead workers (pids {pid3}, {pid5}): 2 live-gauge files "
                                 "removed, 4 counter/histogram files merged; 6 -> 2 files")
    after = _exposed(mp_dir)
    _assert_same_sums(before, after)
    # live gauges are the sum over LIVE workers: the dead ones' values are gone
    assert not any(k[0] in _GAUGES for k in after)

    # More workers come and go: the merged file accumulates, the file count stays bounded.
    for ks in ([2, 4], [6], [1, 1, 1]):
        _run_workers(mp_dir, ks)
        before = _exposed(mp_dir)
        report = clean_dead_worker_files(mp_dir)
        assert len(report.dead_pids) == len(ks)
        assert _db_files(mp_dir) == {"counter_merged.db", "histogram_merged.db"}
        _assert_same_sums(before, _exposed(mp_dir))
    got = _exposed(mp_dir)
    ks = [3, 5, 2, 4, 6, 1, 1, 1]
    assert got[("dlrm_requests_total", (("code", "200"),))] == sum(ks)
    assert got[("dlrm_requests_total", (("code", "413"),))] == len(ks)
    assert got[("dlrm_instances_total", ())] == 10 * sum(ks)
    assert got[("dlrm_request_duration_seconds_count", ())] == sum(ks) + len(ks)
    assert got[("dlrm_cache_hits_total", ())] == 2 * sum(ks)
    assert got[("dlrm_cache_misses_total", ())] == 2 * len(ks)
    assert got[("dlrm_stage_duration_seconds_count", (("stage", "dense"),))] == len(ks)

    # Nothing dead: nothing changes.
    again = clean_dead_worker_files(mp_dir)
    assert again.dead_pids == () and again.merged == () and again.files_after == 2
    assert again.describe() == "no dead workers' files; 2 files"
    _assert_same_sums(got, _exposed(mp_dir))


def test_live_workers_and_this_process_keep_their_files(tmp_path):
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    pid3, pid5 = sorted(_run_workers(mp_dir, [3, 5]))
    before = _exposed(mp_dir)
    # pid5 is "alive" (injected), pid3 dead
    report = clean_dead_worker_files(mp_dir, is_alive=lambda pid: pid == pid5)
    assert report.dead_pids == (pid3,)
    assert _db_files(mp_dir) == {"counter_merged.db", "histogram_merged.db",
                                 f"counter_{pid5}.db", f"histogram_{pid5}.db",
                                 f"gauge_livesum_{pid5}.db"}
    after = _exposed(mp_dir)
    _assert_same_sums(before, after)
    assert after[("dlrm_cache_device_bytes", ())] == 500  # the live worker's gauge stays
    # a worker never takes itself for dead (own_pid), whatever is_alive says
    report = clean_dead_worker_files(mp_dir, is_alive=lambda pid: False, own_pid=pid5)
    assert report.dead_pids == ()
    assert f"counter_{pid5}.db" in _db_files(mp_dir)


def test_cleaning_a_missing_directory_does_nothing(tmp_path):
    report = clean_dead_worker_files(tmp_path / "absent")
    assert report.dead_pids == () and report.files_after == 0
    assert not (tmp_path / "absent").exists()


_CLEANER = textwrap.dedent("""
    import sys
    from serve.metrics.multiprocess import clean_dead_worker_files
    print(len(clean_dead_worker_files(sys.argv[1]).merged))
""")


def test_workers_starting_together_merge_each_file_once(tmp_path):
    """Workers start (and clean) concurrently: the lock file serializes them."""
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    _run_workers(mp_dir, [3, 5, 7])
    before = _exposed(mp_dir)
    procs = [subprocess.Popen([sys.executable, "-c", _CLEANER, str(mp_dir)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    merged = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        merged.append(int(out))
    assert sorted(merged) == [0, 0, 0, 6]  # one of them merged all, the others found none
    assert _db_files(mp_dir) == {"counter_merged.db", "histogram_merged.db"}
    _assert_same_sums(before, _exposed(mp_dir))
