"""The table tiers in process: batches/s and per-batch p50/p99 of a runtime whose tables
are on disk, at host budgets of 10/30/100% of the table bytes (and unbounded: the mapped
files), with Zipf ids; the hit ratio of each tier.

    python -m bench.bench_tiers_runtime                 # 2 tables x 2M rows x dim 64
    python -m bench.bench_tiers_runtime --rows 200000 --batches 30    # smoke

Writes ``bench/results/tiers_runtime.json``: ``{"state": {...}, "machine": {...},
"points": [{"config", "host_budget", "policy", "threads", "device_tier",
"batches_per_s", "p50_ms", "p99_ms", "host_hit_ratio", "device_hit_ratio",
"disk_read_mb", "disk_reads_per_batch"}]}``.

State it declares: the tables (rows, dim, int8), the batch (samples, one id per feature),
Zipf alpha, the read threads, the policy, CPU only (no device cache unless a config says
so: then the cache on the CPU), the torch threads. Before each config the tables' pages
are dropped from the page cache (``posix_fadvise DONTNEED``), so its first reads go to
the disk; ``--warm`` batches then fill the host tier before the timed ones.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve.common.zipf import id_permutation, zeta_cdf, zipf_ranks
from serve.ops.machine import announce
from serve.runtime.artifact import (
    Artifact,
    ExportedDense,
    quantize_rows_reference,
    tables_from_files,
)
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.schema import FeatureSpec, ModelSchema, TableSpec
from serve.store.tablefiles import TableFiles, TableWriter

RESULT = Path(__file__).parent / "results" / "tiers_runtime.json"
NUM_DENSE = 13
CHUNK = 1 << 16


class _Head(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat((dense, pooled), 1)).reshape(-1)


def build(folder: Path, tables: int, rows: int, dim: int) -> Artifact:
    """Random int8 tables written to ``folder`` (chunk by chunk) and a linear head."""
    schema = ModelSchema(NUM_DENSE,
                         tuple(TableSpec(f"t{i}", rows, dim) for i in range(tables)),
                         tuple(FeatureSpec(f"f{i}", f"t{i}", 1) for i in range(tables)))
    if not folder.exists():
        g = torch.Generator().manual_seed(0)
        with TableWriter(folder, schema.tables) as w:
            for i in range(tables):
                for lo in range(0, rows, CHUNK):
                    n = min(CHUNK, rows - lo)
                    w.write(i, lo, quantize_rows_reference(
                        torch.rand((n, dim), generator=g) - 0.5, "int8"))
            w.commit()
    files = TableFiles.open(folder)
    torch.manual_seed(0)
    head = _Head(NUM_DENSE + tables * dim).eval()
    b = torch.export.Dim("B", min=1, max=1 << 16)
    ep = torch.export.export(head, (torch.zeros(2, NUM_DENSE), torch.zeros(2, tables * dim)),
                             dynamic_shapes=({0: b}, {0: b}), strict=False)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    dense = ExportedDense(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    return Artifact(schema, tables_from_files(files), dense, files=files)


def zipf_batches(n: int, b: int, tables: int, rows: int, alpha: float,
                 seed: int) -> list[tuple[torch.Tensor, SparseBatch]]:
    rng = np.random.default_rng(seed)
    perms = [id_permutation(7, f, rows) for f in range(tables)]
    cdf = zeta_cdf(rows, alpha)
    out = []
    for _ in range(n):
        vals = np.concatenate([perms[f][zipf_ranks(rng, b, rows, alpha, cdf)]
                               for f in range(tables)])
        out.append((torch.from_numpy(rng.standard_normal((b, NUM_DENSE), dtype=np.float32)),
                    SparseBatch(torch.from_numpy(vals.astype(np.int64)),
                                torch.ones((tables, b), dtype=torch.int32))))
    return out


def drop_page_cache(art: Artifact) -> None:
    files = art.files
    if files is None:
        return
    for i in range(len(files.tables)):
        os.posix_fadvise(files.fd(i), 0, 0, os.POSIX_FADV_DONTNEED)


def run_config(art: Artifact, cfg: RuntimeConfig, warm: list, timed: list) -> dict[str, Any]:
    drop_page_cache(art)
    rt = Runtime(art, cfg)
    for dense, sparse in warm:
        rt.predict(dense, sparse)
    before = rt.stats().tiers
    times = []
    t_all = time.perf_counter()
    for dense, sparse in timed:
        t0 = time.perf_counter()
        rt.predict(dense, sparse)
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_all
    after = rt.stats().tiers
    rt.close()

    def ratio(tier: str) -> float | None:
        lk = after[tier].lookups - before[tier].lookups
        return round((after[tier].hits - before[tier].hits) / lk, 4) if lk else None

    host_reads = after["host"].miss_rows - before["host"].miss_rows
    ms = np.asarray(times) * 1e3
    return {"batches_per_s": round(len(timed) / wall, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "host_hit_ratio": ratio("host"), "device_hit_ratio": ratio("device"),
            "disk_read_mb": round((after["host"].read_bytes - before["host"].read_bytes)
                                  / 1e6, 2),
            "disk_reads_per_batch": round(host_reads / len(timed), 1)}


CONFIGS: tuple[tuple[str, float | None, bool], ...] = (
    # (name, host budget as a fraction of the table bytes (None: unbounded), device tier)
    ("host 10%", 0.10, False),
    ("host 30%", 0.30, False),
    ("host 100%", 1.00, False),
    ("unbounded (mapped)", None, False),
    ("device 1% + host 10%", 0.10, True),
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--warm", type=int, default=50)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--threads", type=int, default=16, help="disk reads in flight")
    p.add_argument("--policy", default="lru")
    p.add_argument("--folder", type=Path, default=Path("/tmp/dlrm-bench-tiers"))
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    machine = announce()
    folder = args.folder / f"t{args.tables}x{args.rows}x{args.dim}.tables"
    folder.parent.mkdir(parents=True, exist_ok=True)
    art = build(folder, args.tables, args.rows, args.dim)
    warm = zipf_batches(args.warm, args.batch, args.tables, args.rows, args.alpha, 1)
    timed = zipf_batches(args.batches, args.batch, args.tables, args.rows, args.alpha, 2)
    state = {"tables": args.tables, "rows_per_table": args.rows, "dim": args.dim,
             "dtype": "int8", "table_mb": round(art.files.nbytes / 1e6, 1) if art.files else 0,
             "batch": args.batch, "ids_per_batch": args.batch * args.tables,
             "alpha": args.alpha, "warm_batches": args.warm, "timed_batches": args.batches,
             "policy": args.policy, "disk_read_threads": args.threads, "device": "cpu",
             "torch_threads": torch.get_num_threads(),
             "page_cache": "dropped (fadvise DONTNEED) before each config"}
    print(json.dumps(state))
    points = []
    head = (f"{'config':24} {'batch/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'host hit':>9} "
            f"{'dev hit':>8} {'disk MB':>8} {'reads/b':>8}")
    print(head)
    for name, frac, dev in CONFIGS:
        cfg = RuntimeConfig(cache_policy=args.policy, host_cache_fraction=frac,
                            disk_read_threads=args.threads, cache_on_cpu=dev,
                            cache_load_factor=0.01, max_forward_instances=None)
        r = run_config(art, cfg, warm, timed)
        points.append({"config": name, "host_budget": frac, "policy": args.policy,
                       "threads": args.threads, "device_tier": dev, **r})
        print(f"{name:24} {r['batches_per_s']:8.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['host_hit_ratio'] or 0:9.3f} {r['device_hit_ratio'] or 0:8.3f} "
              f"{r['disk_read_mb']:8.2f} {r['disk_reads_per_batch']:8.1f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"state": state, "machine": machine, "points": points,
                                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime())}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
