"""Request decoding: the validating parse alone ("before") vs ``parse_body`` ("after").

    python -m bench.bench_decode               # ~5 s on 2 cores
    python -m bench.bench_decode --repeat 41   # steadier medians

Writes ``bench/results/decode.json``:
``{"rows": [{"form", "instances", "before_ms", "after_ms", "speedup", "loads_ms"}]}``

Bodies are ``orjson.dumps(example_request(n, form=...))`` (one-hot, seed 0) and, as
``rows-multihot`` / ``columnar-multihot``, the same instances with 0..3 ids per feature
(seed 1). "before" is what ``parse_body`` did before the fast path: orjson, then the
validating parse (``parse_doc``), with the garbage collector paused as ``parse_body``
does. "after" is ``parse_body`` itself. ``loads_ms`` is ``orjson.loads`` alone, the floor
both share. The ``binary`` rows (``example_binary``, no JSON) are for reference: they have
no "before" (null). The ``custom-*`` rows decode against a small non-Criteo schema
(:data:`CUSTOM_SCHEMA`: N=3; user_id and item_id one id each, history up to 20, two of
them reading one table), bodies from ``example_request(n, schema=..., multi_hot=True)``
(seed 2): the fast path must stay fast for any model's schema. Each figure is the median over ``--repeat`` rounds of the per-call
time (``time.perf_counter``) of a loop sized to ~5 ms; before and after alternate within
each round, so background load hits both alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from serve.api.binary import example_binary
from serve.api.config import HandlerConfig
from serve.api.decode import parse_body

# The decoding steps are timed from the modules that hold them.
from serve.api.json_body import example_request, gc_paused, load_json, parse_doc
from serve.api.request import BINARY_MEDIA_TYPE
from serve.api.spec import spec_of
from serve.ops.machine import announce
from serve.profiles import SPARSE_FEATURES
from serve.schema import FeatureSpec, ModelSchema, TableSpec

SIZES = (1, 64, 512)
OUT = Path(__file__).resolve().parent / "results" / "decode.json"
ROUND_S = 0.005  # each timed loop runs about this long
#: A small model unlike the built-in one: 3 dense, 3 features, 2 tables.
CUSTOM_SCHEMA = ModelSchema(
    dense=3,
    tables=(TableSpec("t_user", rows=1000, dim=8), TableSpec("t_item", rows=5000, dim=8)),
    features=(FeatureSpec("user_id", "t_user", 1), FeatureSpec("item_id", "t_item", 1),
              FeatureSpec("history", "t_item", 20)))


def _multi_hot(n: int, form: str, seed: int = 1) -> dict[str, Any]:
    """``example_request(n)`` with 0..3 random ids per (instance, feature)."""
    rng = np.random.default_rng(seed)
    body = example_request(n, seed=seed)
    for inst in body["instances"]:
        for f in SPARSE_FEATURES:
            inst["sparse"][f] = rng.integers(0, 2**40, size=int(rng.integers(0, 4))).tolist()
    if form == "rows":
        return body
    insts = body["instances"]
    return {"dense": [i["dense"] for i in insts],
            "sparse": {f: {"values": [v for i in insts for v in i["sparse"][f]],
                           "lengths": [len(i["sparse"][f]) for i in insts]}
                       for f in SPARSE_FEATURES}}


def _slow(body: bytes, cfg: HandlerConfig, schema: ModelSchema | None = None) -> Any:
    with gc_paused():
        return parse_doc(load_json(body, cfg), cfg, spec_of(schema))


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def _calls_for(fn: Callable[[], Any]) -> int:
    fn()  # warm up
    return max(1, int(ROUND_S / max(_per_call(fn, 3), 1e-7)))


def measure(form: str, n: int, repeat: int, cfg: HandlerConfig) -> dict[str, Any]:
    """One table row: medians in ms over ``repeat`` interleaved rounds."""
    if form == "custom-binary":
        raw = example_binary(n, seed=2, schema=CUSTOM_SCHEMA, multi_hot=True)
        fns = {"after": lambda: parse_body(raw, cfg, BINARY_MEDIA_TYPE, schema=CUSTOM_SCHEMA)}
    elif form.startswith("custom-"):
        doc = example_request(n, seed=2, form=form.removeprefix("custom-"),
                              schema=CUSTOM_SCHEMA, multi_hot=True)
        body = orjson.dumps(doc)
        fns = {"before": lambda: _slow(body, cfg, CUSTOM_SCHEMA),
               "after": lambda: parse_body(body, cfg, schema=CUSTOM_SCHEMA),
               "loads": lambda: orjson.loads(body)}
    elif form == "binary":
        raw = example_binary(n)
        fns = {"after": lambda: parse_body(raw, cfg, BINARY_MEDIA_TYPE)}
    else:
        base, _, multi = form.partition("-")
        doc = _multi_hot(n, base) if multi else example_request(n, form=base)
        body = orjson.dumps(doc)
        fns = {"before": lambda: _slow(body, cfg), "after": lambda: parse_body(body, cfg),
               "loads": lambda: orjson.loads(body)}
    calls = {k: _calls_for(fn) for k, fn in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            times[k].append(_per_call(fn, calls[k]))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    before = ms.get("before")
    return {"form": form, "instances": n,
            "before_ms": None if before is None else round(before, 4),
            "after_ms": round(ms["after"], 4),
            "speedup": None if before is None else round(before / ms["after"], 2),
            "loads_ms": round(ms["loads"], 4) if "loads" in ms else None}


def _cell(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=15,
                    help="timed rounds per figure; the median is reported (default 15)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"result file (default {OUT})")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    cfg = HandlerConfig()
    forms = ("rows", "columnar", "rows-multihot", "columnar-multihot", "binary",
             "custom-rows", "custom-columnar", "custom-binary")
    machine = announce()
    rows = []
    print(f"{'form':<18} {'instances':>9} {'before_ms':>10} {'after_ms':>9} {'speedup':>8} "
          f"{'loads_ms':>9}")
    for form in forms:
        for n in SIZES:
            r = measure(form, n, args.repeat, cfg)
            rows.append(r)
            print(f"{r['form']:<18} {n:>9} {_cell(r['before_ms'], '.4f'):>10} "
                  f"{r['after_ms']:>9.4f} {_cell(r['speedup'], '.2f'):>8} "
                  f"{_cell(r['loads_ms'], '.4f'):>9}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "machine": machine}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
