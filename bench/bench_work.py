"""Handler seconds per request and per instance, per traffic mix: what one batch adds to
``dlrm_capacity_work_seconds_total``, and the figures behind ``make hpa-sim``'s work model
(serve.ops.hpa_sim.WORK) and ``BUSY_AT_KNEE`` (serve.sidecar.control.utilization).

    python -m bench.bench_work --model-dir DIR   # an unpacked .mar (artifact.pt); ~10 s

One in-process :class:`serve.worker.worker.Worker` (one torch thread, as each of the CPU
pod's 2 workers has), JSON bodies from ``example_request`` (``--form context``, the
default: a ranking request as one user, C1..C13 and dense once, in columnar candidates;
``instances``: the row form); each batch is timed around ``Worker.handle`` (what the worker counts). Mixes, as the tuner serves them:
single = batches of 32 one-instance requests (32 / 2 ms); ranking = one request of
100-700 instances (1 / 2 ms); mixed = batches of 2 requests, 10% of them single-instance.
Medians over ``--batches`` batches after 5 unmeasured ones; beside them, the thread's
CPU per instance in ``Worker.handle``, split into ``Runtime.predict`` (the runtime's
``predict_cpu_seconds``) and the rest (decode, answers, metrics: the worker's own cost). On a shared machine the
per-instance figure moved 2x between runs (2026-12-04: 22.8-26 us in two runs, ~50 us
in one under heavier load): take the lower.

Writes ``bench/results/work.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
from prometheus_client import CollectorRegistry

from serve.api.config import HandlerConfig
from serve.api.json_body import example_request
from serve.api.request import JSON_MEDIA_TYPE
from serve.constants import REQUEST_FORMS
from serve.metrics.worker import HandlerMetrics
from serve.ops.machine import announce
from serve.worker.messages import WorkerRequest
from serve.worker.worker import Worker

OUT = Path("bench/results/work.json")


def _mixes(rng: np.random.Generator, form: str = "context"
           ) -> dict[str, Callable[[int], list[bytes]]]:
    def body(n: int, seed: int) -> bytes:
        doc = example_request(n, seed=seed)
        if form == "context" and n > 1:
            # one user: C1..C13 and the dense vector once (bench_slo's conversion)
            from bench.bench_slo import as_context
            from serve.api.request import DEFAULT_SCHEMA
            from serve.profiles import get_profile

            doc = as_context(doc, DEFAULT_SCHEMA, get_profile("small").context_features)
        return orjson.dumps(doc)

    return {
        "single": lambda i: [body(1, i * 32 + j) for j in range(32)],
        "ranking": lambda i: [body(int(rng.integers(100, 701)), i)],
        "mixed": lambda i: [body(1 if rng.random() < 0.1 else int(rng.integers(100, 701)),
                                 i * 2 + j) for j in range(2)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True,
                    help="an unpacked model archive (holds artifact.pt)")
    ap.add_argument("--batches", type=int, default=55, help="timed batches per mix")
    ap.add_argument("--form", choices=REQUEST_FORMS, default=REQUEST_FORMS[0],
                    help="ranking requests as one user + N candidates (context, default: "
                         "C1..C13 and dense once) or as independent instances")
    ap.add_argument("--out", type=Path, default=OUT, help=f"result file (default {OUT})")
    args = ap.parse_args(argv)
    cfg = HandlerConfig(num_threads=1, max_instances=4096)
    w = Worker.load(args.model_dir, cfg, model_version="bench", device="cpu", workers=2,
                    environ={}, metrics=HandlerMetrics(CollectorRegistry()), freeze_gc=False)
    machine = announce()
    rng = np.random.default_rng(0)
    rows = []
    print(f"request form: {args.form}", flush=True)
    for name, make in _mixes(rng, args.form).items():
        batches = [make(i) for i in range(args.batches + 5)]
        per_request, per_instance, sizes = [], [], []
        cpu = model = 0.0     # this thread's CPU in handle, and in Runtime.predict (s)
        n_inst = 0
        for k, b in enumerate(batches):
            reqs = [WorkerRequest(x, JSON_MEDIA_TYPE) for x in b]
            m0 = w.runtime.stats().predict_cpu_seconds   # read outside the CPU window
            c0 = time.thread_time()
            t0 = time.perf_counter()
            w.handle(reqs)
            dt = time.perf_counter() - t0
            c1, m1 = time.thread_time(), w.runtime.stats().predict_cpu_seconds
            if k < 5:
                continue
            inst = sum(_instances(orjson.loads(x)) for x in b)
            per_request.append(dt / len(reqs))
            per_instance.append(dt / inst)
            sizes.append(inst / len(reqs))
            cpu, model, n_inst = cpu + c1 - c0, model + m1 - m0, n_inst + inst
        row = {"mix": name, "per_request_us": round(float(np.median(per_request)) * 1e6, 2),
               "per_instance_us": round(float(np.median(per_instance)) * 1e6, 2),
               "instances_per_request": round(float(np.mean(sizes)), 1),
               # CPU per instance over all timed batches: in handle, in predict, the rest
               "cpu_per_instance_us": round(cpu / n_inst * 1e6, 2),
               "predict_cpu_per_instance_us": round(model / n_inst * 1e6, 2),
               "rest_cpu_per_instance_us": round((cpu - model) / n_inst * 1e6, 2)}
        rows.append(row)
        print(f"{name:8s} {row['per_request_us']:10.1f} us/request "
              f"{row['per_instance_us']:8.2f} us/instance  "
              f"({row['instances_per_request']:.1f} instances/request); CPU per instance "
              f"{row['cpu_per_instance_us']:.2f} us = predict "
              f"{row['predict_cpu_per_instance_us']:.2f} + the rest "
              f"{row['rest_cpu_per_instance_us']:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "machine": machine, "form": args.form},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0


def _instances(doc: dict) -> int:
    """Pairs a body scores: its instances, or its candidates (rows or columnar)."""
    if "instances" in doc:
        return len(doc["instances"])
    cands = doc["candidates"]
    if isinstance(cands, list):
        return len(cands)
    first = next(iter(cands["sparse"].values()))
    return len(first["lengths"])


if __name__ == "__main__":
    sys.exit(main())
