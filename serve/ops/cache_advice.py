"""``make cache-advice``: the LRU hit ratio the table tiers would reach at other
capacities, from the reuse distances the workers sample of their live id stream.

Each worker samples its stable model's row accesses (:mod:`serve.common.reuse`,
``DLRM_REUSE_SAMPLE``) and records their LRU stack depths in ``dlrm_reuse_distance_rows``
(plus ``dlrm_reuse_first_accesses_total``: rows seen for the first time). This tool reads
them from the sidecar's ``GET /metrics`` (or any Prometheus exposition of them:
``--metrics-url``), the served version's row width and the tiers' capacities and hit
ratios from ``GET /state`` (``observed.model.schema``, ``observed.tables``), and prints:

* the curve: capacity per worker (rows and bytes) -> predicted LRU hit ratio;
* the current device and host capacities with their predicted and observed hit ratio;
* the memory per worker needed for each ``--target`` hit ratio.

What the curve assumes: one LRU over every table's rows per worker (each worker's caches
see its own stream); the host tier behind the device cache sees the device's misses, so
its predicted ratio is ``(h(host + device) - h(device)) / (1 - h(device))`` (inclusive
tiers); first accesses never hit, and over a short sample they overstate the misses of a
warm cache. Bytes use one row width for all tables: the mean over the sparse features
of their table's stored row (``--dtype``, int8 by default), or ``--row-bytes``.

Example::

    python -m serve.ops.cache_advice                    # the local sidecar (make up)
    python -m serve.ops.cache_advice --target 0.8 0.9 --json advice.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serve.common.reuse import hit_ratio_curve
from serve.constants import DEFAULT_SIDECAR_PORT
from serve.errors import InvalidInput, UpstreamUnavailable
from serve.metrics import (
    REUSE_ACCESSES_TOTAL,
    REUSE_DISTANCE_ROWS,
    REUSE_FIRST_ACCESSES_TOTAL,
    TIERS,
)
from serve.rowformat import DTYPES, row_bytes

__all__ = ["Advice", "ReuseHistogram", "advise", "main", "parse_reuse", "row_bytes_of"]

DEFAULT_SIDECAR = f"http://127.0.0.1:{DEFAULT_SIDECAR_PORT}"
DEFAULT_TARGETS = (0.9, 0.95, 0.99)
#: Capacities of the printed curve: 1, 2 and 5 per decade, 100 rows to 1e9 rows.
CURVE_ROWS: tuple[int, ...] = tuple(m * 10**e for e in range(2, 9) for m in (1, 2, 5)) + (
    10**9,)


@dataclass(frozen=True)
class ReuseHistogram:
    """The reuse-depth histogram summed over series: ``bounds`` (rows), ``cumulative``
    (per bound, then +Inf: weighted re-accesses), ``first`` (weighted first accesses),
    ``total`` (every access the samplers saw; None: not exposed)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    first: float
    total: float | None = None

    @property
    def accesses(self) -> float:
        """Accesses seen: ``total``, else what the sample stands for."""
        if self.total:
            return self.total
        return self.cumulative[-1] + self.first if self.cumulative else self.first

    def hit_ratios(self, capacities: list[float]) -> list[float | None]:
        return hit_ratio_curve(self.bounds, self.cumulative, self.first, capacities,
                               self.total)

    def rows_for(self, target: float) -> float | None:
        """The smallest capacity (rows) whose predicted hit ratio reaches ``target``
        (a 50-points-a-decade grid); None when even the largest bound does not."""
        grid = [10 ** (i / 50) for i in range(50 * 9 + 1)]
        for rows, h in zip(grid, self.hit_ratios(grid), strict=True):
            if h is not None and h >= target:
                return rows
        return None


def parse_reuse(text: str) -> ReuseHistogram:
    """The reuse histogram in Prometheus exposition ``text`` (summed over every series:
    pods' or a fleet's).

    Raises:
        InvalidInput: the text holds no ``dlrm_reuse_distance_rows`` samples, or none
            with any access (nothing sampled yet).
    """
    buckets: dict[float, float] = {}
    first, total = 0.0, 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"{REUSE_DISTANCE_ROWS}_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == REUSE_FIRST_ACCESSES_TOTAL:
                first += s.value
            elif s.name == REUSE_ACCESSES_TOTAL:
                total += s.value
    if not buckets or math.inf not in buckets:
        raise InvalidInput(
            f"no {REUSE_DISTANCE_ROWS} histogram in the metrics: the workers sample no "
            "ids (DLRM_REUSE_SAMPLE=0, or a worker built before the sampler); set "
            "DLRM_REUSE_SAMPLE (e.g. 0.001) on TorchServe's container and restart it")
    bounds = tuple(sorted(b for b in buckets if math.isfinite(b)))
    hist = ReuseHistogram(bounds, tuple(buckets[b] for b in bounds) + (buckets[math.inf],),
                          first, total or None)
    if buckets[math.inf] + first <= 0:
        raise InvalidInput("no ids sampled yet: the reuse histogram is empty; send traffic "
                           "(make loadtest) and ask again")
    return hist


def row_bytes_of(state: dict[str, Any], dtype: str = "int8") -> float | None:
    """The mean stored row width (bytes) over the served version's sparse features
    (``observed.model.schema``), as ``dtype`` rows; None without a schema."""
    model = (state.get("observed") or {}).get("model") or {}
    sparse = (model.get("schema") or {}).get("sparse") or []
    if not sparse:
        return None
    return sum(row_bytes(dtype, int(f["dim"])) for f in sparse) / len(sparse)


@dataclass
class Advice:
    """What :func:`advise` found (``--json`` writes it)."""

    row_bytes: float
    workers: int
    sampled_accesses: float
    first_access_share: float
    max_hit_ratio: float | None
    curve: list[dict[str, Any]] = field(default_factory=list)
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)


def _tier_rows(tables: dict[str, Any], tier: str, workers: int, rb: float) -> float | None:
    t = tables.get(tier) or {}
    cap = t.get("capacity_bytes")
    return cap / max(1, workers) / rb if cap else None


def advise(hist: ReuseHistogram, state: dict[str, Any], row_bytes: float,
           targets: list[float]) -> Advice:
    """The curve, the current tiers and the targets (see the module docstring)."""
    observed = state.get("observed") or {}
    tables = observed.get("tables") or {}
    workers = int(observed.get("ready_workers") or 1)
    sampled = hist.cumulative[-1] + hist.first
    advice = Advice(row_bytes=row_bytes, workers=workers, sampled_accesses=hist.accesses,
                    first_access_share=hist.first / sampled,
                    max_hit_ratio=hist.hit_ratios([1e9])[0])
    for n, h in zip(CURVE_ROWS, hist.hit_ratios([float(r) for r in CURVE_ROWS]),
                    strict=True):
        advice.curve.append({"rows": n, "bytes": int(n * row_bytes), "hit_ratio": h})
    device_rows = _tier_rows(tables, "device", workers, row_bytes) or 0.0
    for tier in TIERS:
        rows = _tier_rows(tables, tier, workers, row_bytes)
        if rows is None:
            continue
        if tier == "host" and device_rows:
            h_dev, h_all = hist.hit_ratios([device_rows, device_rows + rows])
            pred = ((h_all - h_dev) / (1 - h_dev) if h_all is not None and h_dev is not None
                    and h_dev < 1 else None)
        else:
            pred = hist.hit_ratios([rows])[0]
        advice.tiers[tier] = {
            "capacity_rows_per_worker": int(rows),
            "capacity_bytes_per_worker": int(rows * row_bytes),
            "predicted_hit_ratio": pred,
            "observed_hit_ratio": (tables.get(tier) or {}).get("hit_ratio")}
    for target in targets:
        need = hist.rows_for(target)
        advice.targets.append({
            "hit_ratio": target, "rows": math.ceil(need) if need else None,
            "bytes": math.ceil(need * row_bytes) if need else None})
    return advice


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(a: Advice) -> str:
    """The tables a person reads."""
    lines = [(f"accesses seen: {a.sampled_accesses:.0f}; first accesses "
             f"(cold misses): {_pct(a.first_access_share)}; row {a.row_bytes:.0f} B; "
             f"{a.workers} worker(s): capacities are per worker"), "",
             f"{'capacity rows':>14} {'bytes':>11} {'predicted LRU hit ratio':>24}"]
    top = None
    for p in a.curve:
        if top is not None and p["hit_ratio"] is not None and p["hit_ratio"] - top < 1e-4:
            break   # the curve is flat from here on (every sampled row fits)
        lines.append(f"{p['rows']:>14,} {_fmt_bytes(p['bytes']):>11} "
                     f"{_pct(p['hit_ratio']):>24}")
        top = p["hit_ratio"]
    lines += ["", (f"{'tier':<7} {'capacity rows':>14} {'bytes':>11} {'predicted':>10} "
                  f"{'observed':>9}")]
    if not a.tiers:
        lines.append("(no tier reports a capacity in GET /state observed.tables)")
    for tier, t in a.tiers.items():
        lines.append(f"{tier:<7} {t['capacity_rows_per_worker']:>14,} "
                     f"{_fmt_bytes(t['capacity_bytes_per_worker']):>11} "
                     f"{_pct(t['predicted_hit_ratio']):>10} {_pct(t['observed_hit_ratio']):>9}")
    lines += ["", f"{'target hit ratio':>16} {'rows per worker':>16} {'bytes':>11}"]
    for t in a.targets:
        rows = f"{t['rows']:,}" if t["rows"] is not None else "unreachable"
        lines.append(f"{_pct(t['hit_ratio']):>16} {rows:>16} {_fmt_bytes(t['bytes']):>11}")
    if any(t["rows"] is None for t in a.targets):
        lines.append(f"(unreachable: above the curve's top, {_pct(a.max_hit_ratio)} at "
                     "1e9 rows: first accesses never hit; a longer sample lowers their share)")
    return "\n".join(lines)


def _get(client: httpx.Client, url: str) -> httpx.Response:
    try:
        r = client.get(url)
    except httpx.HTTPError as e:
        raise UpstreamUnavailable(f"GET {url} failed ({type(e).__name__}: {e}); is the "
                                  "sidecar running (make up)? else pass --sidecar URL") from None
    if r.status_code != 200:
        raise UpstreamUnavailable(f"GET {url} answered {r.status_code}: {r.text[:200]}")
    return r


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.ops.cache_advice", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sidecar", default=DEFAULT_SIDECAR,
                   help=f"the sidecar's read port (GET /state, GET /metrics; default "
                        f"{DEFAULT_SIDECAR})")
    p.add_argument("--metrics-url", default=None,
                   help="where to read the reuse histogram (a sidecar's /metrics, or "
                        "Prometheus' federate URL); default <sidecar>/metrics")
    p.add_argument("--row-bytes", type=float, default=None,
                   help="bytes per stored row (default: from the served version's schema)")
    p.add_argument("--dtype", choices=DTYPES, default="int8",
                   help="the tables' stored type, for the row width from the schema")
    p.add_argument("--target", type=float, nargs="+", default=list(DEFAULT_TARGETS),
                   help="hit ratios (0..1) to size the memory for")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the advice (curve, tiers, targets) as JSON to PATH (- or "
                        "no PATH: stdout, instead of the tables)")
    p.add_argument("--timeout-s", type=float, default=10.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if any(not 0 < t < 1 for t in args.target):
        print(f"--target {args.target}: each must be in (0, 1)", file=sys.stderr)
        return 2
    base = args.sidecar.rstrip("/")
    try:
        with httpx.Client(timeout=args.timeout_s) as client:
            hist = parse_reuse(_get(client, args.metrics_url or f"{base}/metrics").text)
            state = _get(client, f"{base}/state").json()
        rb = args.row_bytes or row_bytes_of(state, args.dtype)
        if not rb:
            raise InvalidInput("the served version's schema is unknown (GET /state "
                               "observed.model.schema is null); pass --row-bytes")
        advice = advise(hist, state, rb, args.target)
    except (UpstreamUnavailable, InvalidInput) as e:
        print(f"cache-advice: {e.message}", file=sys.stderr)
        return 1
    if args.json is not None:
        text = json.dumps(asdict(advice), indent=2)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(render(advice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
