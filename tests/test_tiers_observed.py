"""GET /state's ``observed.tables`` and ``make cache-advice``, from worker metrics written
in a multiprocess directory by real worker processes, read by the real sidecar.

The worker processes write the tier series with prometheus_client under the names of
serve.metrics (the table tiers in serve/runtime write the same families) and the reuse
series with the worker's own ReuseMetrics and ReuseSampler. The sidecar runs as
``python -m serve.sidecar`` with TorchServe down (it is not ours; GET /state and GET
/metrics still answer).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from serve.metrics.aggregate import TierTotals, tier_totals
from serve.ops import cache_advice
from serve.sidecar.services.tiers import TierWindow, observed_tables
from tests.fixtures.sidecar import FakeClock, dead_port, start_sidecar

REPO = Path(__file__).resolve().parents[1]

_WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from serve.common.reuse import ReuseSampler
    from serve.common.zipf import zeta_cdf, zipf_ranks
    from serve.metrics import (TIER_CAPACITY_BYTES, TIER_HITS_TOTAL, TIER_LOOKUPS_TOTAL,
        TIER_MISS_SECONDS, TIER_READ_BYTES_TOTAL, strip_total)
    from serve.metrics.worker import ReuseMetrics
    k = int(sys.argv[1])
    r = CollectorRegistry()
    lookups = Counter(strip_total(TIER_LOOKUPS_TOTAL), "l", ["tier"], registry=r)
    hits = Counter(strip_total(TIER_HITS_TOTAL), "h", ["tier"], registry=r)
    read = Counter(strip_total(TIER_READ_BYTES_TOTAL), "b", ["tier"], registry=r)
    cap = Gauge(TIER_CAPACITY_BYTES, "c", ["tier"], registry=r, multiprocess_mode="livesum")
    miss = Histogram(TIER_MISS_SECONDS, "m", ["tier"], buckets=(0.0001, 0.001, 0.01),
                     registry=r)
    # device: 1000 lookups, 900 hits per worker; host: the 100 misses, 60 hits.
    lookups.labels(tier="device").inc(1000 * k)
    hits.labels(tier="device").inc(900 * k)
    lookups.labels(tier="host").inc(100 * k)
    hits.labels(tier="host").inc(60 * k)
    read.labels(tier="host").inc(40 * 80 * k)
    cap.labels(tier="device").set(80 * 500)
    cap.labels(tier="host").set(80 * 5000)
    for _ in range(99):
        miss.labels(tier="host").observe(0.0005)
    miss.labels(tier="host").observe(0.005)
    rng = np.random.default_rng(k)
    ids = zipf_ranks(rng, 100_000, 20_000, 1.05, zeta_cdf(20_000, 1.05))
    sampler, reuse = ReuseSampler(0.2), ReuseMetrics(r)
    for i in range(0, ids.size, 4096):
        out = sampler.observe(np.zeros(ids[i:i + 4096].size, np.int64), ids[i:i + 4096])
        reuse.observe(out.depths, out.first, out.weight, out.accesses)
""")


def _workers(mp_dir: Path, ks: list[int]) -> None:
    mp_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), OMP_NUM_THREADS="1")
    for k in ks:
        subprocess.run([sys.executable, "-c", _WORKER, str(k)], cwd=REPO, env=env,
                       check=True, timeout=120)


def test_tier_totals_and_the_window_from_worker_files(tmp_path):
    from prometheus_client.multiprocess import MultiProcessCollector
    mp_dir = tmp_path / "prom"
    _workers(mp_dir, [1, 2])

    def families():
        return list(MultiProcessCollector(None, path=str(mp_dir)).collect())

    got = tier_totals(families())
    assert set(got) == {"device", "host"}
    assert (got["device"].lookups, got["device"].hits) == (3000, 2700)
    assert got["host"].capacity_bytes == 2 * 80 * 5000   # livesum over both workers
    assert got["host"].miss_count == 200
    clock = FakeClock()
    window = TierWindow(families, window_s=60, interval_s=5, clock=clock)
    cumulative = window.view()
    assert cumulative is not None and cumulative.window_s is None
    assert cumulative.device is not None and cumulative.device.hit_ratio == pytest.approx(0.9)
    assert cumulative.host is not None and cumulative.host.read_bytes_per_s is None
    assert cumulative.host.miss_p99_s == pytest.approx(0.001)  # rank 198 of 200: le 0.001
    window.sample()
    clock.now += 10
    _workers(mp_dir, [3])          # another worker's traffic within the window
    view = window.view()
    assert view is not None and view.window_s == 10
    assert view.device is not None and view.host is not None
    assert (view.device.lookups, view.device.hits) == (3000, 2700)
    assert view.device.lookups_total == 6000
    assert view.host.hit_ratio == pytest.approx(0.6)
    assert view.host.read_bytes_per_s == pytest.approx(3 * 40 * 80 / 10)
    assert view.host.capacity_bytes == 3 * 80 * 5000


def test_no_tier_reported_is_null_and_a_counter_going_back_is_cumulative():
    assert observed_tables({}, None, None) is None
    now = {"device": TierTotals(lookups=10, hits=5)}
    back = observed_tables(now, {"device": TierTotals(lookups=20, hits=15)}, 10.0)
    assert back is not None and back.window_s is None and back.host is None
    assert back.device is not None and back.device.hit_ratio == 0.5


def test_state_and_cache_advice_against_a_real_sidecar(tmp_path, capsys):
    mp_dir = tmp_path / "prom"
    _workers(mp_dir, [1, 2])
    dead = f"http://127.0.0.1:{dead_port()}"
    sc = start_sidecar(tmp_path / "sc", management_url=dead, metrics_url=dead,
                       inference_url=dead, model_name="dlrm", multiproc_dir=mp_dir,
                       model_store=tmp_path / "store")
    try:
        st = httpx.get(f"{sc.url}/state", timeout=30).json()
        tables = st["observed"]["tables"]
        assert tables["window_s"] is None   # the loop's first sample is under 5 s old
        assert tables["device"] == {
            "hit_ratio": 0.9, "lookups": 3000, "hits": 2700, "miss_p99_s": None,
            "read_bytes_per_s": None, "capacity_bytes": 80_000, "hit_ratio_total": 0.9,
            "lookups_total": 3000}
        assert tables["host"]["hit_ratio"] == pytest.approx(0.6)
        assert tables["host"]["capacity_bytes"] == 800_000
        out_json = tmp_path / "advice.json"
        rc = cache_advice.main(["--sidecar", sc.url, "--row-bytes", "80",
                                "--json", str(out_json)])
        printed = capsys.readouterr().out
        assert rc == 0, printed
        advice = json.loads(out_json.read_text())
        assert advice["row_bytes"] == 80 and advice["workers"] == 1
        assert advice["sampled_accesses"] == 200_000
        curve = [p["hit_ratio"] for p in advice["curve"]]
        assert curve == sorted(curve) and 0.3 < curve[0] < curve[-1] <= 1.0
        assert set(advice["tiers"]) == {"device", "host"}
        assert advice["tiers"]["device"]["capacity_rows_per_worker"] == 1000
        assert advice["tiers"]["device"]["observed_hit_ratio"] == pytest.approx(0.9)
        assert [t["hit_ratio"] for t in advice["targets"]] == [0.9, 0.95, 0.99]
        assert "predicted LRU hit ratio" in printed and "target hit ratio" in printed
        print(printed, file=sys.stderr)   # the sample run, for the report (pytest -s)
    finally:
        sc.stop()


def test_cache_advice_says_when_the_sidecar_is_down_or_nothing_was_sampled(tmp_path, capsys):
    dead = f"http://127.0.0.1:{dead_port()}"
    assert cache_advice.main(["--sidecar", dead]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"cache-advice: GET {dead}/metrics failed (ConnectError")
    assert "is the sidecar running (make up)? else pass --sidecar URL" in err
    with pytest.raises(cache_advice.InvalidInput, match="no dlrm_reuse_distance_rows "
                                                        "histogram in the metrics"):
        cache_advice.parse_reuse("# nothing\n")
    empty = ("# TYPE dlrm_reuse_distance_rows histogram\n"
             'dlrm_reuse_distance_rows_bucket{le="1.0"} 0\n'
             'dlrm_reuse_distance_rows_bucket{le="+Inf"} 0\n'
             "dlrm_reuse_distance_rows_count 0\ndlrm_reuse_distance_rows_sum 0\n")
    with pytest.raises(cache_advice.InvalidInput, match="no ids sampled yet"):
        cache_advice.parse_reuse(empty)
