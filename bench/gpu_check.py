"""GPU check: exactness vs CPU, throughput with and without the cache, batch-1 latency.

    python -m bench.gpu_check [--quick] [--out bench/results/gpu_check.json]

``make gpu-check`` runs two things on the CUDA machine, without the venv (stock PyTorch,
pytest, numpy; no TorchRec/FBGEMM/TorchServe there): first the ``gpu`` tests
(``tests/test_gpu.py``: each CUDA-only path of the runtime against the CPU result), then
this benchmark. This module alone needs only ``torch``.

1. Exactness: the ``tiny`` int8 artifact and the CPU runtime's probabilities carried in
   ``bench/gpu_fixture/`` (``python -m bench.make_gpu_fixture``), served on the GPU without
   a cache, through the cache (LRU and LFU, 1 slot and 20%; LFU also with its counts
   halved every 100 ids and batches split into forwards of 16) and as CUDA graphs.
2. Scale: random int8 tables at ``criteo-kaggle`` size (33.8M rows x 64) quantized on the
   GPU with ``quantize_rows_reference`` in chunks, random fp32 MLPs.
3. Throughput at batch 1, 64, 512, 4096, 32768 with every row on the device and with the
   cache (load factor 0.2, LRU), on fresh Zipf(1.05) one-hot traffic (never replayed, so
   the cache cannot memorise the benchmark), after a warm-up; the cache's hit ratio beside
   the ideal static top-k ratio, and its page-locked host bytes (= the table's bytes).
   The runtimes keep the default ``max_forward_instances`` (8192), as served: batch 32768
   runs as 4 forwards (``forwards_per_batch``).
4. Batch-1 p50/p99 latency of the whole ``predict`` call (CPU tensors in, CPU out): eager
   without cache, CUDA-graph replay without cache, and eager with the cache.

``--device cpu`` is a dry run of the same flow for the CPU test suite: its numbers mean
nothing, and the rows that need CUDA (CUDA graphs, the mapped miss path) are left out
rather than filled with eager timings under their names.

Exit codes: 0 all checks ran and exactness passed; 1 exactness failed; 2 no CUDA device.
Goals (reported, not enforced): cache >= 85% of all-on-device samples/s at batch 4096,
batch-1 p50 <= 0.1 ms.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from serve.ops.machine import machine_info
from serve.profiles import NUM_DENSE, get_profile
from serve.runtime.artifact import Artifact, QuantTable, load_artifact, quantize_rows_reference
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

__all__ = ["ZipfTraffic", "build_random_artifact", "check_exactness", "main"]

BATCHES = (1, 64, 512, 4096, 32768)
# CPU (MKL/oneDNN) and GPU (cuBLAS) sum in different orders: a few float32 ulp.
CPU_GPU_TOL = 1e-5
# CPU runtime today vs the CPU probabilities carried in the fixture: the same arithmetic,
# but computed when the fixture was made, on another machine (MKL picks its GEMM kernels
# and thread split by CPU and thread count): a few float32 ulp, not bit-identical.
CACHE_TOL = 1e-6
_PRIME = 2_147_483_647   # rank -> id bijection: (rank * P) % rows, P prime > every table


class ZipfTraffic:
    """One-hot Zipf(alpha) ids per feature, sampled on ``device`` by inverse CDF.

    Rank r (0-based) has probability ~ 1/(r+1)^alpha; id = (r * P) % rows spreads the
    hot ids over the table (a bijection since P is a prime above every table size).
    """

    def __init__(self, cardinalities: list[int], alpha: float, device: torch.device,
                 seed: int = 0) -> None:
        self.device = device
        self.rows = torch.tensor(cardinalities, dtype=torch.int64, device=device)
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.cdfs, self.probs = [], []
        for c in cardinalities:
            p = 1.0 / torch.arange(1, c + 1, dtype=torch.float64, device=device) ** alpha
            p /= p.sum()
            self.probs.append(p)
            self.cdfs.append(torch.cumsum(p, 0))

    def sample(self, b: int) -> torch.Tensor:
        """int64 (F, B) ids on the device."""
        out = []
        for f, cdf in enumerate(self.cdfs):
            u = torch.rand(b, dtype=torch.float64, device=self.device, generator=self.g)
            rank = torch.searchsorted(cdf, u).clamp_max(cdf.numel() - 1)
            out.append(rank * _PRIME % self.rows[f])
        return torch.stack(out)

    def ideal_hit_ratio(self, capacity: int) -> float:
        """Hit ratio of the best static cache of ``capacity`` rows (top rows of the mixture)."""
        allp = torch.cat(self.probs)
        top = torch.sort(allp, descending=True).values[:capacity]
        return float(top.sum() / len(self.probs))


def build_random_artifact(profile_name: str, device: torch.device, seed: int = 0,
                          chunk_rows: int = 1 << 22) -> Artifact:
    """Random int8 tables + MLPs for a profile, built on ``device`` (tables stay there).

    Weights ~ U(-0.05, 0.05) per row, quantized in chunks of ``chunk_rows`` rows so the
    fp32 staging never exceeds chunk_rows x D x 4 bytes.
    """
    p = get_profile(profile_name)
    g = torch.Generator(device=device).manual_seed(seed)
    tables = []
    for name, rows in zip(p.table_names, p.cardinalities, strict=True):
        parts = []
        for lo in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - lo)
            w = (torch.rand((n, p.embedding_dim), device=device, generator=g) - 0.5) * 0.1
            parts.append(quantize_rows_reference(w, "int8"))
        tables.append(QuantTable(name, rows, p.embedding_dim, "int8", torch.cat(parts)))

    def mlp(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for i, o in itertools.pairwise(sizes):
            bound = 1.0 / math.sqrt(i)
            out.append((((torch.rand((o, i), generator=g, device=device) * 2 - 1) * bound).cpu(),
                        ((torch.rand((o,), generator=g, device=device) * 2 - 1) * bound).cpu()))
        return out

    f = p.num_sparse
    over_in = p.embedding_dim + f * (f + 1) // 2
    return Artifact.dlrm(list(p.feature_names), NUM_DENSE, "int8", tables,
                         mlp([NUM_DENSE, *p.dense_arch]), mlp([over_in, *p.over_arch]),
                         {"origin": "bench.gpu_check random"})


def managed_twin(art: Artifact, seed: int = 0) -> tuple[Artifact, list[torch.Tensor]]:
    """The same tables and dense part with every table ``mapping="managed"`` and full:
    row r >= 1 of table t owns a random raw id (spread over the int64 range), row 0 is the
    fallback. Returns the artifact and, per table, ``raw`` int64 (rows,) with ``raw[r]``
    the id of row r (``raw[0]``: an id the map does not hold), so ``raw[t][ids]`` are raw
    ids that the managed twin serves exactly as the original serves ``ids``: the map is
    the only extra work (bench.bench_runtime measures its cost this way)."""
    import dataclasses

    from serve.runtime.idmap import IdMap
    from serve.schema import ModelSchema

    g = torch.Generator().manual_seed(seed)
    maps, raws = {}, []
    for spec in art.schema.tables:
        n = spec.rows
        raw = torch.randint(0, 2**62, (n,), generator=g, dtype=torch.int64)
        raw = torch.unique(raw)
        while raw.numel() < n:     # collisions in 2**62 draws: practically never, but exact
            raw = torch.unique(torch.cat([raw, torch.randint(0, 2**62, (n,), generator=g)]))
        raw = raw[torch.randperm(raw.numel(), generator=g)[:n]]
        maps[spec.name] = IdMap.from_arrays(raw[1:], torch.arange(1, n), n)
        raws.append(raw)
    schema = ModelSchema(art.schema.dense,
                         tuple(dataclasses.replace(t, mapping="managed") for t in art.schema.tables),
                         art.schema.features)
    return Artifact(schema, art.tables, art.dense, dict(art.meta), maps), raws


def check_exactness(device: str, fixture: Path, mapped: bool = False) -> list[dict[str, Any]]:
    """Serve the carried tiny artifact on ``device`` in several configurations and compare
    with the CPU probabilities stored beside it. Returns one row per configuration."""
    art = load_artifact(fixture / "tiny_int8.pt", mmap=False)
    blob = torch.load(fixture / "expected.pt", weights_only=True)
    batches = blob["batches"]
    rb = art.tables[0].data.shape[1]
    on_cuda = torch.device(device).type == "cuda"
    configs = {
        "no cache": RuntimeConfig(device=device, cache_load_factor=1.0),
        "cache lru 20%": RuntimeConfig(device=device, cache_load_factor=0.2, cache_on_cpu=True),
        "cache lfu 20%": RuntimeConfig(device=device, cache_load_factor=0.2,
                                       cache_policy="lfu", cache_on_cpu=True),
        "cache lru 1 slot": RuntimeConfig(device=device, cache_bytes=rb, cache_on_cpu=True),
        "cache lfu 20%, aging every 100 ids, 16 per forward": RuntimeConfig(
            device=device, cache_load_factor=0.2, cache_policy="lfu", cache_on_cpu=True,
            lfu_decay_every=100, max_forward_instances=16),
    }
    if on_cuda:
        configs["cuda graphs"] = RuntimeConfig(device=device, cache_load_factor=1.0,
                                               cuda_graphs=True)
    if on_cuda and mapped:
        configs["cache lru 1 slot, mapped misses"] = RuntimeConfig(
            device=device, cache_bytes=rb, cache_miss_path="mapped")
        configs["cache lru 20%, mapped misses, CUDA graphs"] = RuntimeConfig(
            device=device, cache_load_factor=0.2, cache_miss_path="mapped", cuda_graphs=True)
    rows = []
    for name, cfg in configs.items():
        rt = Runtime.from_artifact(art, cfg)
        worst = 0.0
        for _ in range(2):   # twice: the second pass hits a warm cache / replays graphs
            for bt in batches:
                got = rt.predict(bt["dense"], SparseBatch(bt["values"], bt["lengths"]))
                worst = max(worst, (got - bt["expected"]).abs().max().item())
        st = rt.stats()
        rows.append({"config": name, "max_abs_diff_vs_cpu": worst, "ok": worst <= CPU_GPU_TOL,
                     "hit_ratio": st.hit_ratio, "evictions": st.evictions})
    return rows


def miss_path_probe(device: torch.device, table_rows: int = 8_000_000,
                    row_bytes: int = 68) -> dict[str, Any]:
    """Rows/s of the two miss paths on one pinned table, and whether they agree.

    Runs in a child process from ``main`` (``--miss-path-probe``) because the mapped
    path hands the GPU a host pointer: if the platform does not map pinned memory the
    child dies, not the check.
    """
    from serve.runtime.cache import EmbeddingCache

    table = torch.randint(0, 256, (table_rows, row_bytes), dtype=torch.uint8,
                          device=device).cpu().pin_memory()
    host = EmbeddingCache(table, 1, "lru", device, miss_path="host")
    mapped = EmbeddingCache(table, 1, "lru", device, miss_path="mapped")
    points: list[dict[str, Any]] = []
    for m in (4096, 65536, 1 << 20):
        rows = torch.randint(0, table_rows, (m,), device=device)
        same = torch.equal(host.host.fetch(rows), mapped.host.fetch(rows))
        res: dict[str, Any] = {"rows": m, "equal": same}
        for name, cache in (("host", host), ("mapped", mapped)):
            cache.host.fetch(rows)
            torch.cuda.synchronize()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.5:
                cache.host.fetch(rows)
                torch.cuda.synchronize()
                n += 1
            res[f"{name}_rows_per_s"] = n * m / (time.perf_counter() - t0)
        points.append(res)
    return {"table_rows": table_rows, "row_bytes": row_bytes, "points": points,
            "ok": all(p["equal"] for p in points)}


def _run_probe(device: str) -> dict[str, Any]:
    import subprocess

    try:
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--miss-path-probe",
                               "--device", device], check=False, capture_output=True, text=True,
                              timeout=180)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "probe timed out after 180 s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": f"probe exited {proc.returncode}: {proc.stderr[-800:]}"}
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def _traffic(zipf: ZipfTraffic, b: int, n: int) -> list[tuple[torch.Tensor, SparseBatch]]:
    """``n`` fresh batches as a request handler has them: CPU tensors."""
    nf = zipf.rows.numel()
    lengths = torch.ones((nf, b), dtype=torch.int32)
    out = []
    for _ in range(n):
        ids = zipf.sample(b).reshape(-1).cpu()
        out.append((torch.rand(b, NUM_DENSE), SparseBatch(ids, lengths)))
    return out


def _throughput(rt: Runtime, batches: list[tuple[torch.Tensor, SparseBatch]]) -> float:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    t0 = time.perf_counter()
    for dense, sb in batches:
        rt.predict(dense, sb)   # returns CPU tensors: every call is complete here
    el = time.perf_counter() - t0
    return sum(d.shape[0] for d, _ in batches) / el


def _latency(rt: Runtime, batches: list[tuple[torch.Tensor, SparseBatch]]) -> dict[str, float]:
    for dense, sb in batches[:20]:
        rt.predict(dense, sb)
    times = []
    for dense, sb in batches[20:]:
        t0 = time.perf_counter()
        rt.predict(dense, sb)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small profile and fewer iterations (a smoke run, ~1 min)")
    p.add_argument("--profile", default=None,
                   help="table sizes for the throughput part (default criteo-kaggle; quick: small)")
    p.add_argument("--device", default="cuda",
                   help="cuda[:N]; 'cpu' runs the whole flow as a dry run for tests (the "
                        "numbers mean nothing there)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help="comma-separated batch sizes for the throughput part")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per batch size in the throughput part "
                        "(default 1,000,000; quick: 100,000)")
    p.add_argument("--fixture", type=Path, default=Path("bench/gpu_fixture"))
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
    p.add_argument("--miss-path-probe", action="store_true",
                   help="internal: measure the two cache miss paths and print one JSON line")
    p.epilog = ("`make gpu-check` runs `python3 -m pytest -m gpu tests/test_gpu.py` and then "
                "this check, both with the machine's own python3 (no venv needed).")
    return p


class _Runtimes:
    """The runtimes of the throughput and latency parts, built once from one artifact.

    ``graphs`` (CUDA graphs, no cache) exists only on CUDA; ``cached_mapped`` and
    ``cached_graphs`` (mapped misses, the latter also as CUDA graphs) only where the
    mapped miss path works (the probe said so).
    """

    def __init__(self, art: Artifact, device: str, on_cuda: bool, mapped_ok: bool) -> None:
        def rt(**kw: Any) -> Runtime:
            return Runtime.from_artifact(art, RuntimeConfig(device=device, **kw))

        self.full = rt(cache_load_factor=1.0)
        self.cached = rt(cache_load_factor=0.2, cache_on_cpu=True)
        # On CPU a cuda_graphs runtime runs eagerly: timing it would label eager as a graph.
        self.graphs = rt(cache_load_factor=1.0, cuda_graphs=True) if on_cuda else None
        self.cached_mapped = (rt(cache_load_factor=0.2, cache_miss_path="mapped")
                              if mapped_ok else None)
        # Batch 1 only: the fixed-shape cache step inside a CUDA graph (LRU, mapped misses).
        self.cached_graphs = (rt(cache_load_factor=0.2, cache_miss_path="mapped",
                                 cuda_graphs=True) if mapped_ok else None)
        if self.cached.cache is None:   # 0.2 of the rows is always below all of them
            raise RuntimeError("the lf 0.2 runtime has no cache; this is a bug in "
                               "serve.runtime.engine")
        self.capacity = self.cached.cache.capacity


def _probe_phase(device: str, on_cuda: bool) -> dict[str, Any]:
    print("0/4 cache miss paths: host gather + copy vs GPU reading pinned memory (child) ...",
          flush=True)
    probe: dict[str, Any] = (_run_probe(device) if on_cuda
                             else {"ok": False, "error": "not a CUDA device (dry run)"})
    for pt in probe.get("points", []):
        print(f"    {pt['rows']:>8} rows: host {pt['host_rows_per_s']:.3g} rows/s, mapped "
              f"{pt['mapped_rows_per_s']:.3g} rows/s, equal {pt['equal']}", flush=True)
    if not probe["ok"]:
        print(f"    mapped path unavailable: {probe.get('error', 'rows differ')}", flush=True)
    return probe


def _build_phase(profile: str, dev: torch.device) -> tuple[Artifact, dict[str, Any]]:
    print(f"2/4 building random int8 {profile} tables on {dev} ...", flush=True)
    t0 = time.perf_counter()
    art = build_random_artifact(profile, dev)
    total = sum(t.rows for t in art.tables)
    info = {"name": profile, "rows": total, "table_bytes": art.table_bytes,
            "build_s": time.perf_counter() - t0}
    print(f"    {total:,} rows, {art.table_bytes / 2**30:.2f} GiB int8 in "
          f"{info['build_s']:.1f} s", flush=True)
    return art, info


def _throughput_phase(rts: _Runtimes, zipf: ZipfTraffic, batch_sizes: list[int],
                      samples_per_size: int) -> list[dict[str, Any]]:
    print("3/4 throughput (fresh Zipf 1.05 traffic; warming the cache first) ...", flush=True)
    warm_samples = 2 * samples_per_size
    for dense, sb in _traffic(zipf, 4096, max(1, warm_samples // 4096)):
        rts.cached.predict(dense, sb)
        if rts.cached_mapped is not None:
            rts.cached_mapped.predict(dense, sb)
    tp = []
    for b in batch_sizes:
        n = max(4, min(2000 if b > 1 else 3000, samples_per_size // b))
        batches = _traffic(zipf, b, n)
        rts.full.predict(*batches[0])            # warm-up: allocator, kernels
        s_full = _throughput(rts.full, batches)
        before = rts.cached.stats()
        s_cache = _throughput(rts.cached, batches)
        after = rts.cached.stats()
        hr = (after.hits - before.hits) / max(1, after.lookups - before.lookups)
        cap = rts.full.config.max_forward_instances
        row = {"batch": b, "all_on_device_samples_per_s": s_full,
               "cache_samples_per_s": s_cache, "cache_vs_all": s_cache / s_full,
               "hit_ratio": hr, "forwards_per_batch": 1 if cap is None else -(-b // cap)}
        if rts.cached_mapped is not None:
            row["cache_mapped_samples_per_s"] = _throughput(rts.cached_mapped, batches)
        tp.append(row)
        print(f"    batch {b:>6}: all-on-device {s_full:>13,.0f}/s  cache {s_cache:>13,.0f}/s "
              f"({s_cache / s_full:.0%})  hit ratio {hr:.3f}"
              + (f"  mapped-miss cache {row['cache_mapped_samples_per_s']:>13,.0f}/s"
                 if rts.cached_mapped is not None else "")
              + (f"  ({row['forwards_per_batch']} forwards per batch)"
                 if row["forwards_per_batch"] > 1 else ""), flush=True)
    return tp


def _latency_phase(rts: _Runtimes, zipf: ZipfTraffic, samples_per_size: int,
                   result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Batch-1 latency rows, each named for what it timed (no graph rows without CUDA)."""
    print("4/4 batch-1 latency of the whole predict call ...", flush=True)
    n_lat = max(40, min(2000, samples_per_size // 500))
    lat = {"all on device, eager": _latency(rts.full, _traffic(zipf, 1, n_lat))}
    if rts.graphs is not None:
        lat["all on device, CUDA graph"] = _latency(rts.graphs, _traffic(zipf, 1, n_lat))
    lat["cache lf 0.2, eager"] = _latency(rts.cached, _traffic(zipf, 1, n_lat))
    if rts.cached_mapped is not None and rts.cached_graphs is not None:
        lat["cache lf 0.2 mapped misses, eager"] = _latency(rts.cached_mapped,
                                                            _traffic(zipf, 1, n_lat))
        warm = _traffic(zipf, 1, 4 * n_lat)   # fill this runtime's own cache first
        for dense, sb in warm:
            rts.cached_graphs.predict(dense, sb)
        lat["cache lf 0.2 mapped misses, CUDA graph"] = _latency(rts.cached_graphs,
                                                                 _traffic(zipf, 1, n_lat))
        st = rts.cached_graphs.stats()
        result["cache_graph_batch1"] = {"hit_ratio": st.hit_ratio, "evictions": st.evictions}
    return lat


def _print_summary(result: dict[str, Any], out: Path) -> None:
    print("\n| exactness config | max abs diff vs CPU | ok |\n|---|---:|---|")
    for r in result["exactness"]:
        print(f"| {r['config']} | {r['max_abs_diff_vs_cpu']:.2e} | {r['ok']} |")
    print("\n| batch | all on device samples/s | cache (lf 0.2) samples/s | cache/all | hit ratio "
          "| cache, mapped misses |\n|---:|---:|---:|---:|---:|---:|")
    tp = result["throughput"]
    for r in tp:
        mp = r.get("cache_mapped_samples_per_s")
        print(f"| {r['batch']} | {r['all_on_device_samples_per_s']:,.0f} | "
              f"{r['cache_samples_per_s']:,.0f} | {r['cache_vs_all']:.0%} | {r['hit_ratio']:.3f} "
              f"| {f'{mp:,.0f}' if mp else 'n/a'} |")
    c = result["cache"]
    print(f"\ncache: {c['capacity']:,} slots, hit ratio {c['hit_ratio_overall']:.3f} since load "
          f"(ideal static top-k {c['ideal_hit_ratio']:.3f}), device {c['device_bytes'] / 2**30:.2f} "
          f"GiB, host {c['host_bytes'] / 2**30:.2f} GiB, of which page-locked "
          f"{c['pinned_bytes'] / 2**30:.2f} GiB")
    lat = result["latency_batch1"]
    print("\n| batch-1 predict | p50 ms | p99 ms |\n|---|---:|---:|")
    for name, v in lat.items():
        print(f"| {name} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} |")
    at4096 = next((r for r in tp if r["batch"] == 4096), None)
    best_p50 = min(v["p50_ms"] for v in lat.values())
    if at4096 is not None:
        print(f"\ngoal: cache/all at batch 4096 = {at4096['cache_vs_all']:.0%} (>= 85%): "
              f"{'met' if at4096['cache_vs_all'] >= 0.85 else 'NOT met'}")
    print(f"goal: best batch-1 p50 {best_p50:.3f} ms (<= 0.1 ms): "
          f"{'met' if best_p50 <= 0.1 else 'NOT met'}")
    print(f"wrote {out} in {result['wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dev = torch.device(args.device)
    on_cuda = dev.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); this check "
              "needs a machine with a GPU: run `make gpu-check` there", file=sys.stderr)
        return 2
    if args.miss_path_probe:
        print(json.dumps(miss_path_probe(dev)))
        return 0
    t_start = time.perf_counter()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if on_cuda
                              else "cpu (dry run)", "torch": torch.__version__,
                              "machine": machine_info()}
    print(f"gpu-check on {result['device']} (torch {torch.__version__})", flush=True)
    probe = result["miss_paths"] = _probe_phase(args.device, on_cuda)
    print("1/4 exactness vs CPU on the carried tiny artifact ...", flush=True)
    result["exactness"] = check_exactness(args.device, args.fixture, mapped=bool(probe["ok"]))

    profile = args.profile or ("small" if args.quick else "criteo-kaggle")
    art, result["profile"] = _build_phase(profile, dev)
    rts = _Runtimes(art, args.device, on_cuda, mapped_ok=bool(probe["ok"]))
    del art
    zipf = ZipfTraffic(list(get_profile(profile).cardinalities), 1.05, dev, seed=1)
    samples_per_size = args.samples or (100_000 if args.quick else 1_000_000)
    batch_sizes = [int(x) for x in args.batches.split(",") if x.strip()]
    result["throughput"] = _throughput_phase(rts, zipf, batch_sizes, samples_per_size)
    st = rts.cached.stats()
    cache = rts.cached.cache
    result["cache"] = {"load_factor": 0.2, "alpha": 1.05, "capacity": rts.capacity,
                       "hit_ratio_overall": st.hit_ratio,
                       "ideal_hit_ratio": zipf.ideal_hit_ratio(rts.capacity),
                       "device_bytes": st.device_bytes, "host_bytes": st.host_bytes,
                       "pinned_bytes": cache.pinned_bytes if cache is not None else 0,
                       "evictions": st.evictions}
    result["latency_batch1"] = _latency_phase(rts, zipf, samples_per_size, result)
    result["wall_s"] = time.perf_counter() - t_start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _print_summary(result, args.out)
    return 0 if all(r["ok"] for r in result["exactness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
