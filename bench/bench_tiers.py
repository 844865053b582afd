"""Tables beyond memory, end to end: ranking traffic with Zipf ids over the real service,
at several host-memory budgets, with the hit ratio of every tier beside every latency.

    python -m bench.bench_tiers                          # the article model, CI size
    python -m bench.bench_tiers --scale full             # 100M x 64 + 50M x 32 (29.6 GB DCP)
    python -m bench.bench_tiers --version V --budgets 0.1 all --memory-limit-bytes 6e9

What one run does, and records in ``bench/results/tiers.json`` (and, through
``python -m serve.ops.benchdoc --write``, a dated page):

1. The version: unless ``--version`` names one, the article's two-table model
   (``examples/article_two_tables``) is generated as a random-weight DCP checkpoint
   (``python -m serve.model.generate checkpoint``) and imported by the streaming importer
   (``python -m serve.model.importer --max-memory-bytes``): its wall seconds and peak RSS
   come from the importer's last JSON line. The checkpoint is deleted afterwards.
2. Disk per version: its tables folder, archive and report, against its table bytes.
3. For each host budget (``--budgets``: fractions of the table bytes, per worker, or
   ``all``: no bound, the mapped files): a service of its own (real TorchServe + sidecar,
   free loopback ports; ``DLRM_HOST_CACHE_FRACTION`` in TorchServe's environment), its
   start-up time (launch to the first answered query), then for each Zipf exponent
   (``--alphas``): ``--clients`` closed-loop clients sending ranking queries (one user id
   per query, ``--pairs`` item ids, ids Zipf-distributed over each table through a fixed
   affine permutation) for ``--duration-s`` after ``--warmup-s``: pairs/s, p50/p99 per
   query, failed requests, and per tier (device, host) the hit ratio and bytes read over
   the trial, from the sidecar's ``GET /state`` ``observed.tables`` counters.
   ``--memory-limit-bytes`` runs each service's whole process tree (TorchServe, its
   workers, the sidecar) in a memory cgroup of that size (cgroup v1, needs root); the
   ``all`` budget then runs without it, as the in-memory reference.

State: the served version, batching, workers and tuner are read from ``GET /state`` and
``GET /tuner`` and printed with the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.http1 import Http1Error, Http1Pool
from serve.common.zipf import zeta_cdf, zipf_ranks
from serve.ops.machine import machine_info

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "tiers.json"
ARTICLE_FACTORY = "examples/article_two_tables/model.py:make_model"
#: An odd multiplier for the affine rank -> id permutation (made coprime with rows).
_PERM_MUL = 2654435761
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


# --------------------------------------------------------------------------- traffic
def _affine(rows: int) -> int:
    a = _PERM_MUL % rows or 1
    while math.gcd(a, rows) != 1:
        a += 1
    return a


def zipf_ids(rng: np.random.Generator, n: int, rows: int, alpha: float) -> np.ndarray:
    """n ids (int64) of a table of ``rows`` rows: Zipf ranks through a fixed affine
    permutation, so the hot rows are spread over the table (and over its file's pages)."""
    ranks = zipf_ranks(rng, n, rows, alpha, zeta_cdf(rows, alpha))
    return (ranks * _affine(rows) + 7) % rows


def ranking_queries(schema: Any, alpha: float, *, queries: int, pairs: int, seed: int
                    ) -> list[tuple[bytes, np.ndarray, np.ndarray]]:
    """Columnar JSON ranking queries of ``pairs`` instances, with their arrays: ``(body,
    dense float32 (B, N), values int64 (F * B,) feature-major)``, one id per bag. The
    first feature (the user) has one id per query, repeated; every other feature one
    Zipf id per pair."""
    rng = np.random.default_rng([seed, int(alpha * 1000)])
    rows = {t.name: t.rows for t in schema.tables}
    out = []
    for _ in range(queries):
        dense = rng.standard_normal((pairs, schema.dense), dtype=np.float32).round(3)
        sparse, cols = {}, []
        for i, f in enumerate(schema.features):
            ids = zipf_ids(rng, 1 if i == 0 else pairs, rows[f.table], alpha)
            vals = np.repeat(ids, pairs) if i == 0 else ids
            cols.append(vals)
            sparse[f.name] = {"values": vals.tolist(), "lengths": [1] * pairs}
        body = orjson.dumps({"dense": dense.tolist(), "sparse": sparse})
        out.append((body, dense, np.concatenate(cols)))
    return out


def ranking_bodies(schema: Any, alpha: float, *, queries: int, pairs: int, seed: int
                   ) -> list[bytes]:
    """:func:`ranking_queries`' bodies alone."""
    return [q[0] for q in ranking_queries(schema, alpha, queries=queries, pairs=pairs,
                                          seed=seed)]


def exact_check(url: str, reference: Any, schema: Any, *, queries: int, pairs: int
                ) -> dict[str, Any]:
    """Send ``queries`` ranking queries and compare each answer with ``reference`` (an
    in-process :class:`serve.runtime.engine.Runtime` over the same tables): the largest
    |HTTP - in process| and whether every answer is bit-equal."""
    import httpx
    import torch

    from serve.runtime.engine import SparseBatch

    worst, equal = 0.0, True
    for body, dense, values in ranking_queries(schema, 1.05, queries=queries, pairs=pairs,
                                               seed=12345):
        r = httpx.post(f"{url}/predictions/dlrm", content=body, timeout=60,
                       headers={"Content-Type": "application/json"})
        r.raise_for_status()
        got = torch.tensor(orjson.loads(r.content)["predictions"], dtype=torch.float32)
        lengths = torch.ones((len(schema.features), pairs), dtype=torch.int32)
        want = reference.predict(torch.from_numpy(dense), SparseBatch(
            torch.from_numpy(values), lengths))
        equal = equal and torch.equal(got, want)
        worst = max(worst, float((got - want).abs().max()))
    return {"queries": queries, "max_abs_diff": worst, "bit_equal": equal}


@dataclass
class Trial:
    """One closed-loop run: latencies (s) of the answered queries, and the failures."""

    seconds: float
    latencies: list[float]
    failed: int
    pairs: int

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies) * 1e3 if self.latencies else np.array([np.nan])
        return {"queries": len(self.latencies), "failed": self.failed,
                "pairs_per_s": round(self.pairs * len(self.latencies) / self.seconds, 1),
                "p50_ms": round(float(np.percentile(lat, 50)), 2),
                "p99_ms": round(float(np.percentile(lat, 99)), 2)}


async def _closed_loop(url: str, bodies: Sequence[bytes], clients: int, seconds: float,
                       pairs: int) -> Trial:
    lat: list[float] = []
    failed = 0
    end = time.perf_counter() + seconds

    async def client(k: int, pool: Http1Pool) -> None:
        nonlocal failed
        i = k
        while time.perf_counter() < end:
            t = time.perf_counter()
            try:
                status, _ = await pool.request("POST", "/predictions/dlrm",
                                               bodies[i % len(bodies)])
            except Http1Error:
                status = 0
            if status == 200:
                lat.append(time.perf_counter() - t)
            else:
                failed += 1
            i += clients

    t0 = time.perf_counter()
    async with Http1Pool(url, max_connections=clients, timeout_s=60,
                         headers={"Content-Type": "application/json"}) as pool:
        await asyncio.gather(*(client(k, pool) for k in range(clients)))
    return Trial(time.perf_counter() - t0, lat, failed, pairs)


def closed_loop(url: str, bodies: Sequence[bytes], clients: int, seconds: float,
                pairs: int) -> Trial:
    return asyncio.run(_closed_loop(url, bodies, clients, seconds, pairs))


# --------------------------------------------------------------------------- tiers
def tier_counts(state: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Cumulative lookups and hits per tier from ``GET /state``'s ``observed.tables``."""
    tables = (state.get("observed") or {}).get("tables") or {}
    out = {}
    for tier in ("device", "host"):
        t = tables.get(tier)
        if t:
            lookups = float(t.get("lookups_total") or 0)
            out[tier] = {"lookups": lookups,
                         "hits": lookups * float(t.get("hit_ratio_total") or 0),
                         "capacity_bytes": t.get("capacity_bytes")}
    return out


def tier_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """Hit ratio per tier over a trial (None: the tier saw no lookups)."""
    out: dict[str, Any] = {}
    for tier, a in after.items():
        b = before.get(tier, {"lookups": 0.0, "hits": 0.0})
        n = a["lookups"] - b["lookups"]
        out[tier] = {"lookups": int(n), "hit_ratio": round((a["hits"] - b["hits"]) / n, 4)
                     if n > 0 else None, "capacity_bytes": a.get("capacity_bytes")}
    return out


# --------------------------------------------------------------------------- cgroup
@contextlib.contextmanager
def memory_cgroup(limit_bytes: int | None, name: str) -> Iterator[Path | None]:
    """A cgroup v1 memory group of ``limit_bytes`` below this process's own, or None."""
    if not limit_bytes:
        yield None
        return
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text()
               .splitlines() if line.split(":", 2)[1] == "memory")
    parent = CGROUP_ROOT / own.lstrip("/")
    group = parent / name
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()


@contextlib.contextmanager
def inside(group: Path | None) -> Iterator[None]:
    """This process inside ``group`` meanwhile: what it starts stays there after."""
    if group is None:
        yield
        return
    parent = group.parent
    (group / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield
    finally:
        (parent / "cgroup.procs").write_text(str(os.getpid()))


@contextlib.contextmanager
def _sidecar_env(limit: int | None, env: Mapping[str, str]) -> Iterator[None]:
    """The sidecar's environment while the service starts (it inherits this process's):
    the host budget ``env`` the workers get (its memory check counts it), and the
    cgroup's limit as ``DLRM_MEMORY_LIMIT_BYTES`` (it reads the cgroup mounted at
    /sys/fs/cgroup, not this child group), so a switch that does not fit is refused."""
    from serve.settings import DLRM_MEMORY_LIMIT_BYTES

    extra = dict(env)
    if limit:
        extra[DLRM_MEMORY_LIMIT_BYTES.name] = str(int(limit))
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cgroup_peak(group: Path | None) -> int | None:
    if group is None:
        return None
    return int((group / "memory.max_usage_in_bytes").read_text())


# --------------------------------------------------------------------------- the version
def _last_json(out: str) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"no JSON line in the output:\n{out[-2000:]}")


def _run(cmd: list[str], env: Mapping[str, str]) -> dict[str, Any]:
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, text=True,
                          stdout=subprocess.PIPE, stderr=None, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return _last_json(proc.stdout)


def import_article(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Generate the article model's checkpoint at ``args.scale`` and import it; the
    version name and the import's figures (seconds, peak RSS)."""
    version = f"article-{args.scale}-s{args.seed}"
    env = {"ARTICLE_SCALE": args.scale}
    ckpt = args.work_dir / f"ckpt-{version}"
    shutil.rmtree(ckpt, ignore_errors=True)
    gen = _run([sys.executable, "-m", "serve.model.generate", "checkpoint", "--out",
                str(ckpt), "--factory", ARTICLE_FACTORY, "--seed", str(args.seed)], env)
    try:
        imp = _run([sys.executable, "-m", "serve.model.importer", "--factory",
                    ARTICLE_FACTORY, "--checkpoint", str(ckpt), "--version", version,
                    "--model-store", str(args.model_store),
                    "--max-memory-bytes", str(int(args.import_memory_bytes))], env)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return version, {"generate": gen, "import": {
        k: imp.get(k) for k in ("version", "max_abs_diff", "seconds", "peak_rss_bytes")},
        "checkpoint_bytes": gen.get("bytes")}


def build_figures(repo: Any, version: str) -> dict[str, Any]:
    """An existing version's build figures, from its report (an import records its wall
    seconds per step, peak RSS and check; a generated version its table bytes)."""
    report = repo.report(version)
    seconds = report.get("wall_seconds") or {}
    check = report.get("check") or {}
    return {"from": "the version's report (built before this run)",
            "origin": report.get("origin"),
            "import": {"version": version, "seconds": round(sum(seconds.values()), 3)
                       if isinstance(seconds, dict) and seconds else None,
                       "peak_rss_bytes": report.get("peak_rss_bytes"),
                       "max_abs_diff": check.get("max_abs_diff")}}


def disk_per_version(store: Path, version: str) -> dict[str, Any]:
    from serve.store.repository import ModelRepository
    from serve.store.tablefiles import tables_folder_bytes

    repo = ModelRepository([store])
    mar, folder = repo.archive(version), repo.tables(version)
    report = mar.with_suffix(".json")
    table_bytes = repo.table_bytes(version)
    if folder is None or not table_bytes:
        return {"tables_folder": None}
    disk = tables_folder_bytes(folder) + mar.stat().st_size + report.stat().st_size
    return {"table_bytes": table_bytes, "disk_bytes": disk,
            "ratio": round(disk / table_bytes, 4), "archive_bytes": mar.stat().st_size}


def warm_page_cache(store: Path, version: str) -> float:
    """Read every table file of ``version`` once (into the page cache): the "all in
    memory" reference then serves warm rows, as a pod whose tables fit its memory does
    after a while. Returns the seconds it took."""
    from serve.store.repository import ModelRepository

    folder = ModelRepository([store]).tables(version)
    t0 = time.perf_counter()
    if folder is not None:
        for f in sorted(folder.iterdir()):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(1 << 26):
                    pass
    took = time.perf_counter() - t0
    print(f"  page cache warmed with {folder} in {took:.1f} s", flush=True)
    return took


# --------------------------------------------------------------------------- one budget
def _served_state(client: Any) -> dict[str, Any]:
    st = client.state()
    tuner = client.tuner()
    desired = st.get("desired") or {}
    return {"version": (desired.get("model") or {}).get("version"),
            "batching": desired.get("batching"), "workers": desired.get("workers"),
            "tuner_enabled": (tuner or {}).get("enabled")}


def run_budget(args: argparse.Namespace, version: str, schema: Any, budget: str,
               reference: Any = None) -> dict[str, Any]:
    """Start a service at host budget ``budget`` and run every alpha against it."""
    from serve.ops.launcher import running_service
    from serve.settings import DLRM_HOST_CACHE_FRACTION

    env = {} if budget == "all" else {DLRM_HOST_CACHE_FRACTION.name: budget}
    limit = None if budget == "all" or not args.memory_limit_bytes else int(
        args.memory_limit_bytes)
    root = args.work_dir / f"svc-{budget}"
    shutil.rmtree(root, ignore_errors=True)
    if budget == "all" and args.warm_all:
        warm_page_cache(args.model_store, version)
    record: dict[str, Any] = {"budget": budget, "memory_limit_bytes": limit, "alphas": []}
    with memory_cgroup(limit, f"bench-tiers-{os.getpid()}") as group:
        t0 = time.perf_counter()
        cm = running_service(root, args.model_store, version, extra_env=env,
                             ready_timeout_s=args.ready_timeout_s)
        with inside(group), _sidecar_env(limit, env):
            cfg, client = cm.__enter__()
        try:
            # The tuner off: a batching trial registers a second set of workers beside
            # the serving ones (a switch), which this benchmark must not measure.
            client.set_tuner(False)
            url = cfg.inference_url
            first = ranking_bodies(schema, 1.05, queries=1, pairs=args.pairs, seed=99)
            trial = closed_loop(url, first, 1, 0.01, args.pairs)
            record["startup_s"] = round(time.perf_counter() - t0, 2)
            record["first_query_ok"] = trial.failed == 0
            record["state"] = _served_state(client)
            if reference is not None:
                record["exact"] = exact_check(url, reference, schema, queries=8,
                                              pairs=args.pairs)
                print(f"  HTTP vs in process: {record['exact']}", flush=True)
            for alpha in args.alphas:
                record["alphas"].append(_one_alpha(args, url, client, schema, alpha))
            record["cgroup_peak_bytes"] = cgroup_peak(group)
        finally:
            cm.__exit__(None, None, None)
    return record


def _one_alpha(args: argparse.Namespace, url: str, client: Any, schema: Any,
               alpha: float) -> dict[str, Any]:
    bodies = ranking_bodies(schema, alpha, queries=args.queries, pairs=args.pairs,
                            seed=args.seed)
    closed_loop(url, bodies, args.clients, args.warmup_s, args.pairs)
    before = tier_counts(client.state())
    trial = closed_loop(url, bodies, args.clients, args.duration_s, args.pairs)
    tiers = tier_delta(before, tier_counts(client.state()))
    row = {"alpha": alpha, **trial.summary(), "tiers": tiers}
    hits = " ".join(f"{t} {v['hit_ratio']:.3f}" for t, v in tiers.items()
                    if v["hit_ratio"] is not None) or "no tier (all mapped)"
    print(f"  alpha {alpha:<5} {row['pairs_per_s']:>10,.0f} pairs/s  p50 {row['p50_ms']:7.1f}"
          f" ms  p99 {row['p99_ms']:7.1f} ms  failed {row['failed']}  hit ratio: {hits}",
          flush=True)
    return row


# --------------------------------------------------------------------------- report
def table(runs: Sequence[Mapping[str, Any]]) -> str:
    lines = [(f"{'budget':>7} {'alpha':>5} {'pairs/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
             f"{'failed':>6} {'host hit':>9} {'device hit':>10} {'start s':>8}")]
    for r in runs:
        for a in r["alphas"]:
            hit = {t: v["hit_ratio"] for t, v in a["tiers"].items()}
            lines.append(
                f"{r['budget']:>7} {a['alpha']:>5} {a['pairs_per_s']:>10,.0f} "
                f"{a['p50_ms']:>8.1f} {a['p99_ms']:>8.1f} {a['failed']:>6} "
                f"{_pct(hit.get('host')):>9} {_pct(hit.get('device')):>10} "
                f"{r['startup_s']:>8.1f}")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_tiers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", help="serve this version (default: generate and import "
                    "the article model at --scale)")
    ap.add_argument("--scale", default="small", choices=("small", "full"),
                    help="the article model's size when it is generated (default small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-store", type=Path, default=REPO / "model_store")
    ap.add_argument("--work-dir", type=Path, default=REPO / "build" / "bench-tiers")
    ap.add_argument("--budgets", nargs="+", default=["0.1", "0.3", "1.0"],
                    help="host budgets per worker: fractions of the table bytes, or 'all' "
                         "(no bound: the mapped files); default 0.1 0.3 1.0")
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.9, 1.05, 1.2])
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients (4)")
    ap.add_argument("--pairs", type=int, default=100, help="pairs per ranking query (100)")
    ap.add_argument("--queries", type=int, default=2000,
                    help="distinct queries per alpha (2000 x 100 pairs: far more ids than a "
                         "small budget holds, so the hit ratios are the traffic's)")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--memory-limit-bytes", type=float, default=None,
                    help="run each bounded-budget service in a memory cgroup this big")
    ap.add_argument("--warm-all", action="store_true",
                    help="read the table files into the page cache before the 'all' budget "
                         "(the in-memory reference of a pod whose tables fit)")
    ap.add_argument("--import-memory-bytes", type=float, default=2e9,
                    help="the importer's --max-memory-bytes (default 2e9)")
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM unwinds like an exception, so the service a run started is stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from serve.runtime.artifact import load_artifact
    from serve.store.repository import ModelRepository

    args.work_dir.mkdir(parents=True, exist_ok=True)
    repo = ModelRepository([args.model_store])
    version = args.version or f"article-{args.scale}-s{args.seed}"
    if args.version is None and not repo.exists(version):
        version, built = import_article(args)
    else:
        built = build_figures(repo, version)
    import zipfile
    with zipfile.ZipFile(repo.archive(version)) as z:
        (args.work_dir / "artifact.pt").write_bytes(z.read("artifact.pt"))
    from serve.runtime.engine import Runtime, RuntimeConfig

    art = load_artifact(args.work_dir / "artifact.pt", tables_path=[args.model_store])
    schema = art.schema
    # The exactness reference: the same files read in process, every lookup from disk
    # (no host tier: a few MB whatever the model's size).
    reference = Runtime(art, RuntimeConfig(host_cache_bytes=0))
    disk = disk_per_version(args.model_store, version)
    print(f"version {version}: {disk}", flush=True)
    runs = []
    for budget in args.budgets:
        print(f"budget {budget}:", flush=True)
        runs.append(run_budget(args, version, schema, budget, reference))
    print(table(runs))
    doc = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python -m bench.bench_tiers " + " ".join(argv or sys.argv[1:]),
           "machine": machine_info(), "version": version, "build": built, "disk": disk,
           "traffic": {"clients": args.clients, "pairs": args.pairs,
                       "alphas": args.alphas, "duration_s": args.duration_s},
           "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(a["failed"] == 0 for r in runs for a in r["alphas"]) else 1


if __name__ == "__main__":
    sys.exit(main())
