"""In-process runtime vs TorchRec's quantized DLRM, CPU levers, and cache hit ratios.

    python -m bench.bench_runtime            # full: small-profile-sized model (~7 min)
    python -m bench.bench_runtime --quick    # smoke: tiny model, few iterations

Writes ``bench/results/runtime.json``:
``{"throughput": [{"batch", "torchrec_samples_per_s", "runtime_samples_per_s", ...}],
   "levers": [...], "remap": {"batch", "modulo_samples_per_s", "managed_samples_per_s",
   "remap_cost", "equal"}, "hit_ratio": [{"scenario", "load_factor", "alpha", "policy",
   "hit_ratio", "ideal", ...}]}``

Throughput: both sides get the same prebuilt inputs (a KJT for TorchRec, a SparseBatch
for us); each point is the best of 5 interleaved timed rounds. Ids follow Zipf(1.05) per feature.
Hit ratio: the real EmbeddingCache on CPU, replaying Zipf traffic (one-hot, batch 512)
over the 26 criteo-kaggle tables capped at 20,000 rows each, beside the ideal static top-k
hit ratio (the sum of the k most likely rows' probabilities), measured over the second
half of the batches (the first half warms the cache up). Policies: LRU, LFU with its
default aging (``LFU_DECAY_PER_ROW`` x the rows), LFU without aging. Scenarios:
``static`` (one Zipf distribution throughout; every alpha and load factor) and ``shift``
(alpha 1.05: the measured half draws from a new random permutation of the ids, i.e.
yesterday's hot rows turn cold and others turn hot; ideal = the new distribution's).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from serve.ops.machine import announce
from serve.profiles import CRITEO_KAGGLE_CARDINALITIES, get_profile
from serve.runtime.cache import LFU_DECAY_PER_ROW, EmbeddingCache, capacity_for
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

log = logging.getLogger("bench.runtime")

BATCHES = (1, 64, 512, 4096)
LOAD_FACTORS = (0.05, 0.1, 0.2, 0.5)
ALPHAS = (0.8, 1.05, 1.2)
SHIFT_ALPHA = 1.05
# (name in the results, policy, lfu_decay_every: None = the default aging, 0 = none)
CACHE_POLICIES = (("lru", "lru", None), ("lfu", "lfu", None), ("lfu, no aging", "lfu", 0))


class ZipfIds:
    """Per-feature truncated Zipf(alpha) ids: rank r has probability ~ 1/(r+1)^alpha and
    maps to an id through a fixed random permutation (hot ids spread over the table)."""

    def __init__(self, cardinalities: list[int], alpha: float, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.probs = [1.0 / torch.arange(1, c + 1, dtype=torch.float64) ** alpha
                      for c in cardinalities]
        self.probs = [p / p.sum() for p in self.probs]
        self.perms = [torch.randperm(c, generator=self.g) for c in cardinalities]

    def sample(self, b: int) -> torch.Tensor:
        """int64 (F, B) ids, one per (feature, sample)."""
        return torch.stack([perm[torch.multinomial(p, b, replacement=True, generator=self.g)]
                            for p, perm in zip(self.probs, self.perms, strict=True)])

    def ideal_hit_ratio(self, capacity: int) -> float:
        """Best static cache of ``capacity`` rows: the top rows of the id mixture."""
        allp = torch.cat(self.probs) / len(self.probs)
        return float(torch.topk(allp, min(capacity, allp.numel())).values.sum())


def _time_pair(fa, fb, min_seconds: float, rounds: int = 5) -> tuple[float, float]:
    """Seconds per call of ``fa`` and ``fb``: best of ``rounds`` interleaved rounds, each
    at least ``min_seconds`` long, so load from other processes hits both alike."""
    fa()
    fb()  # warm up
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, fn in enumerate((fa, fb)):
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                el = time.perf_counter() - t0
                if el >= min_seconds:
                    break
            best[i] = min(best[i], el / n)
    return best[0], best[1]


def _timeit(fn, min_seconds: float) -> float:
    """Seconds per call: best of 5 rounds, each at least ``min_seconds`` long."""
    return _time_pair(fn, fn, min_seconds)[0]


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    order = torch.argsort(scores)
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def throughput(profile_name: str, batches: tuple[int, ...], min_seconds: float,
               threads: int) -> tuple[list[dict], list[dict], dict[str, Any]]:
    from torchrec.inference.modules import quantize_inference_model

    from serve.model.dlrm import build_dlrm, make_kjt
    from serve.model.export import artifact_from_quantized_dlrm

    profile = get_profile(profile_name)
    torch.set_num_threads(threads)
    print(f"building a random {profile_name} DLRM ({profile.total_rows:,} rows x "
          f"{profile.embedding_dim}) and quantizing it with TorchRec ...", flush=True)
    model = build_dlrm(profile, seed=0).eval()
    qmodel = quantize_inference_model(copy.deepcopy(model), quantization_dtype=torch.int8).eval()
    del model
    art = artifact_from_quantized_dlrm(qmodel, "int8")
    rt = Runtime.from_artifact(art, RuntimeConfig())
    zipf = ZipfIds(list(profile.cardinalities), 1.05, seed=1)
    nf = profile.num_sparse
    rows_out = []
    inputs = {}
    for b in batches:
        ids = zipf.sample(b)
        dense = torch.rand(b, 13)
        lengths = torch.ones((nf, b), dtype=torch.int32)
        kjt = make_kjt(profile.feature_names, list(ids), list(lengths))
        sb = SparseBatch(ids.reshape(-1), lengths)
        inputs[b] = (dense, kjt, sb)
        with torch.inference_mode():
            ref = torch.sigmoid(qmodel(dense, kjt).squeeze(1))
            diff = (rt.predict(dense, sb) - ref).abs().max().item()
            t_ref, t_rt = _time_pair(lambda d=dense, k=kjt: qmodel(d, k),
                                     lambda d=dense, s=sb: rt.predict(d, s), min_seconds)
        row: dict[str, Any] = {"batch": b, "torchrec_samples_per_s": b / t_ref, "runtime_samples_per_s": b / t_rt,
               "ratio": t_ref / t_rt, "max_abs_diff": diff, "threads": threads}
        rows_out.append(row)
        print(f"  batch {b:>5}: torchrec {row['torchrec_samples_per_s']:>10,.0f}/s  runtime "
              f"{row['runtime_samples_per_s']:>10,.0f}/s  ratio {row['ratio']:.2f}  "
              f"max|dp| {diff:.1e}", flush=True)

    remap = _remap_cost(art, inputs, batches, min_seconds)

    # Levers at the batch closest to 512; accuracy against the exact default path, AUC on
    # labels drawn from the exact model's own probabilities (no trained model needed).
    b = min(batches, key=lambda x: abs(x - 512))
    dense, kjt, sb = inputs[b]
    ids = zipf.sample(8192)
    eval_dense = torch.rand(8192, 13) * 3
    eval_sb = SparseBatch(ids.reshape(-1), torch.ones((nf, 8192), dtype=torch.int32))
    exact = rt.predict(eval_dense, eval_sb)
    labels = torch.bernoulli(exact, generator=torch.Generator().manual_seed(2))
    auc0 = _auc(exact, labels)
    levers = []
    candidates = [("fp32 (default)", RuntimeConfig(), threads),
                  ("fp32, 1 thread", RuntimeConfig(), 1),
                  ("bf16 dense (opt-in)", RuntimeConfig(dense_precision="bf16"), threads),
                  ("int8 dynamic dense (opt-in)", RuntimeConfig(dense_precision="int8"), threads),
                  # last: once torch.compile has run, other ops in the process can slow down
                  ("torch.compile", RuntimeConfig(compile=True), threads)]
    for name, cfg, th in candidates:
        torch.set_num_threads(th)
        try:
            r = Runtime.from_artifact(art, cfg)
            p = r.predict(eval_dense, eval_sb)
            t = _timeit(lambda r=r: r.predict(dense, sb), min_seconds)
        except Exception as e:  # noqa: BLE001 - a lever that fails is reported, not fatal
            print(f"  lever {name}: failed ({type(e).__name__}: {e})")
            continue
        row = {"lever": name, "batch": b, "threads": th, "samples_per_s": b / t,
               "max_abs_diff": (p - exact).abs().max().item(), "auc_delta": _auc(p, labels) - auc0}
        levers.append(row)
        print(f"  lever {name:<28} batch {b}: {row['samples_per_s']:>10,.0f}/s  max|dp| "
              f"{row['max_abs_diff']:.1e}  dAUC {row['auc_delta']:+.1e}", flush=True)
    torch.set_num_threads(threads)
    return rows_out, levers, remap


def _remap_cost(art: Any, inputs: dict[int, tuple], batches: tuple[int, ...],
                min_seconds: float) -> dict[str, Any]:
    """The managed id map's cost, in the same process and run: the artifact's managed twin
    (every table managed and full, :func:`bench.gpu_check.managed_twin`) fed the raw ids of
    the very rows the modulo runtime is fed, at the batch closest to 512. Same rows, so
    the probabilities must be equal (checked with ``torch.equal``); the difference in
    time is the map lookup (:class:`serve.runtime.idmap.MapIndex`: a hash probe per id)."""
    from bench.gpu_check import managed_twin

    b = min(batches, key=lambda x: abs(x - 512))
    dense, _kjt, sb = inputs[b]
    twin, raws = managed_twin(art, seed=5)
    nf = sb.lengths.shape[0]
    ids = sb.values.view(nf, -1)
    ftab = art.schema.feature_tables
    raw_sb = SparseBatch(torch.stack([raws[ftab[f]][ids[f]] for f in range(nf)]).reshape(-1),
                         sb.lengths)
    modulo, managed = Runtime.from_artifact(art, RuntimeConfig()), Runtime.from_artifact(twin, RuntimeConfig())
    with torch.inference_mode():
        equal = torch.equal(modulo.predict(dense, sb), managed.predict(dense, raw_sb))
        t_mod, t_man = _time_pair(lambda: modulo.predict(dense, sb),
                                  lambda: managed.predict(dense, raw_sb), min_seconds)
    out = {"batch": b, "modulo_samples_per_s": b / t_mod, "managed_samples_per_s": b / t_man,
           "remap_cost": t_man / t_mod - 1.0, "equal": equal,
           "probe": managed.id_probe,
           "ids_per_table": [int(m.size) for m in twin.id_maps.values()]}
    print(f"  id map (managed, every table full) batch {b}: modulo {out['modulo_samples_per_s']:,.0f}/s"
          f"  managed {out['managed_samples_per_s']:,.0f}/s  cost {out['remap_cost']:+.1%}"
          f"  torch.equal {equal}  probe {out['probe']}", flush=True)
    return out


def hit_ratios(sim_rows: int, batches: int, warmup: int, batch: int) -> list[dict]:
    """Static grid (every alpha x load factor) and the shift scenario (SHIFT_ALPHA), for
    each of CACHE_POLICIES: one row per point."""
    cards = [min(c, sim_rows) for c in CRITEO_KAGGLE_CARDINALITIES]
    total = sum(cards)
    print(f"hit-ratio simulation: {total:,} rows in 26 tables, batch {batch}, "
          f"{warmup} warm-up + {batches} measured batches per point; LFU ages every "
          f"{LFU_DECAY_PER_ROW} x {total:,} ids", flush=True)
    table = torch.zeros((total, 4), dtype=torch.uint8)   # payload is irrelevant here
    offsets = torch.tensor([0] + cards[:-1]).cumsum(0).unsqueeze(1)
    out = []
    for scenario, alphas in (("static", ALPHAS), ("shift", (SHIFT_ALPHA,))):
        for alpha in alphas:
            before = ZipfIds(cards, alpha, seed=3)
            after = ZipfIds(cards, alpha, seed=4) if scenario == "shift" else before
            traffic = [(before.sample(batch) + offsets).reshape(-1) for _ in range(warmup)]
            traffic += [(after.sample(batch) + offsets).reshape(-1) for _ in range(batches)]
            for lf in LOAD_FACTORS:
                cap = capacity_for(total, 4, load_factor=lf, cache_bytes=None)
                ideal = after.ideal_hit_ratio(cap)
                for name, policy, decay in CACHE_POLICIES:
                    out.append(_replay(EmbeddingCache(table, cap, policy, "cpu",
                                                      lfu_decay_every=decay),
                                       traffic, warmup)
                               | {"scenario": scenario, "load_factor": lf, "alpha": alpha,
                                  "policy": name, "ideal": ideal, "capacity": cap})
                    print(f"  {scenario:<6} lf {lf:<4} alpha {alpha:<4} {name:<13}: hit "
                          f"{out[-1]['hit_ratio']:.3f}  ideal {ideal:.3f}", flush=True)
    return out


def _replay(cache: EmbeddingCache, traffic: list[torch.Tensor], warmup: int) -> dict[str, Any]:
    """Feed the batches of global ids; the hit ratio over those after ``warmup``."""
    h0 = l0 = 0
    for i, g in enumerate(traffic):
        if i == warmup:
            h0, l0 = cache.counters.hits, cache.counters.lookups
        rows, counts = torch.unique(g, return_counts=True)
        cache.lookup(rows, counts, n_ids=g.numel())
    c = cache.counters
    return {"hit_ratio": (c.hits - h0) / (c.lookups - l0), "evictions": c.evictions,
            "lfu_decays": c.lfu_decays}


def _print_hit_ratios(hr: list[dict]) -> None:
    names = [n for n, _, _ in CACHE_POLICIES]
    shown = {"lru": "LRU", "lfu": "LFU (aging)", "lfu, no aging": "LFU, no aging"}
    for scenario, title in (("static", "static Zipf"),
                            ("shift", f"hot set moved (alpha {SHIFT_ALPHA})")):
        print(f"\nhit ratio, {title}\n| load factor | alpha | "
              + " | ".join(shown.get(n, n) for n in names)
              + " | ideal |\n|---:|---:|" + "---:|" * (len(names) + 1))
        for lf in LOAD_FACTORS:
            for a in ALPHAS:
                pts = {r["policy"]: r for r in hr if r["scenario"] == scenario
                       and r["load_factor"] == lf and r["alpha"] == a}
                if pts:
                    print(f"| {lf} | {a} | " + " | ".join(f"{pts[n]['hit_ratio']:.3f}" for n in names)
                          + f" | {pts[names[0]]['ideal']:.3f} |")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and few iterations (smoke test)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for both sides (default: torch's, = cores)")
    p.add_argument("--out", type=Path, default=Path("bench/results/runtime.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    threads = args.threads or torch.get_num_threads()
    machine = announce()
    if args.quick:
        tp, levers, remap = throughput("tiny", (1, 64, 512), 0.05, threads)
        hr = hit_ratios(sim_rows=2000, batches=10, warmup=5, batch=128)
    else:
        tp, levers, remap = throughput("small", BATCHES, 0.5, threads)
        hr = hit_ratios(sim_rows=20_000, batches=300, warmup=300, batch=512)
    result = {"throughput": tp, "levers": levers, "remap": remap, "hit_ratio": hr,
              "quick": args.quick, "torch": torch.__version__, "threads": threads,
              "machine": machine}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("\n| batch | TorchRec samples/s | runtime samples/s | ratio |\n|---:|---:|---:|---:|")
    for r in tp:
        print(f"| {r['batch']} | {r['torchrec_samples_per_s']:,.0f} | "
              f"{r['runtime_samples_per_s']:,.0f} | {r['ratio']:.2f} |")
    print("\n| lever | samples/s | max abs dp | AUC delta |\n|---|---:|---:|---:|")
    for r in levers:
        print(f"| {r['lever']} ({r['threads']} thr) | {r['samples_per_s']:,.0f} | "
              f"{r['max_abs_diff']:.1e} | {r['auc_delta']:+.1e} |")
    print(f"\n| id mapping (batch {remap['batch']}) | samples/s |\n|---|---:|\n"
          f"| modulo | {remap['modulo_samples_per_s']:,.0f} |\n"
          f"| managed (every table full) | {remap['managed_samples_per_s']:,.0f} |\n"
          f"remap cost {remap['remap_cost']:+.1%} of the forward; predictions equal: "
          f"{remap['equal']}")
    _print_hit_ratios(hr)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
