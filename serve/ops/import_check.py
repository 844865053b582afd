"""Own TorchRec models end to end through the real service: fit on 2 gloo ranks, import,
serve, and compare the HTTP answers with TorchRec's own quantized forward.

    python -m serve.ops.import_check                       # all four models (make import-check)
    python -m serve.ops.import_check --examples own_ranker --steps 5 --keep

Models: ``article_dcn``, ``dlrm_v2`` (rows capped by ``DLRMV2_MAX_ROWS``, default 20000),
``own_ranker`` (``examples/<name>/model.py:make_model``) and ``builtin`` (our DLRM, profile
``tiny``, trained by the pipeline's own 2-rank training; a generated factory module over
``serve.model.dlrm.build_dlrm`` imports its checkpoint).

For each model:

1. **fit**: ``python -m serve.model.fit --world-size 2 --steps N`` (2 real gloo ranks under
   ``DistributedModelParallel``; a ``torch.distributed.checkpoint`` directory). ``builtin``:
   ``python -m serve.model.pipeline --profile tiny`` into the temp folder (its
   ``PipelineConfig.checkpoint_dir``; it trains its profile's epoch, ``--steps`` does not
   apply);
2. **import**: ``python -m serve.model.importer`` into a temporary model store (the
   importer's own ``max_abs_diff`` and the wall time are recorded);
3. **serve**: one real service (TorchServe + sidecar, ``serve.ops.launcher``) on free
   127.0.0.1 ports over that store; each version is declared in turn with ``PUT /state``
   until ``converged`` and ``observed.model.version`` is it. A version that does not
   converge fails its own row, and the service is restarted for the next one;
4. **schema**: ``GET /state``'s ``observed.model.schema`` must equal the importer's report
   (names, tables, rows, dims, pooling, max_ids), and the report must describe the model
   loaded from the checkpoint (:func:`serve.model.export.model_schema`);
5. **predictions**: a fixed batch (``--batch`` instances from the schema: multi-hot up to
   each feature's max_ids, empty lists, ids spanning each table up to its last row) in JSON
   rows form to ``POST /predictions/dlrm``, against ``torch.sigmoid`` of TorchRec's
   ``quantize_inference_model(model)`` forward on the same inputs, ``model`` being the
   factory's model loaded from the same checkpoint; max |difference| <= ``--tolerance``;
6. **bad requests**: an unknown feature, a missing feature, more ids than max_ids, a wrong
   dense count: each must be a 400 whose JSON message names the feature (or the dense
   count). No request of the run may get a 5xx;
7. **switch under load** (once, ``own_ranker``): it is fitted twice (seeds 0 and 1) and
   imported as two versions of the same schema; while ``--clients`` threads post the fixed
   batch continuously, ``PUT /state`` switches from one to the other. No request may fail;
   after the switch the answers come from the new version and equal its own reference.

Prints a table and writes JSON (``--out``); exits 1 when a check fails, 2 on a bad option.
The service is stopped and the temporary folder removed at the end unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serve.errors import ConfigError, ServeError, UpstreamUnavailable
from serve.ops.import_check_config import (
    CASES,
    DEFAULT_MODELS,
    DEFAULT_TOLERANCE,
    REPO,
    SWITCH_MODEL,
    CheckConfig,
    ModelCase,
    Say,
    StepFailed,
)
from serve.ops.import_check_fit import fit_model, import_version
from serve.ops.import_check_requests import (
    bad_requests,
    error_message,
    expected_schema,
    fixed_batch,
    instances_body,
    names_each,
    reference_probabilities,
    schema_differences,
)
from serve.ops.import_check_results import (
    BadRequest,
    CheckReport,
    ImportResult,
    ModelRow,
    SwitchResult,
)
from serve.ops.import_check_service import Service

__all__ = [
    "DEFAULT_OUT",
    "FixedBatch",
    "check_model",
    "format_table",
    "main",
    "run_check",
    "switch_under_load",
]

DEFAULT_OUT = Path("bench/results/import_check.json")


# ----------------------------------------------------------------------------- checks

def _predictions(r: httpx.Response, n: int) -> list[float]:
    if r.status_code != 200:
        raise StepFailed(f"the fixed batch got HTTP {r.status_code}: {r.text[:500]}")
    try:
        preds = [float(p) for p in r.json()["predictions"]]
    except (ValueError, KeyError, TypeError) as e:
        raise StepFailed(f"the fixed batch's answer is malformed ({type(e).__name__}: {e}): "
                         f"{r.text[:300]}") from None
    if len(preds) != n:
        raise StepFailed(f"{len(preds)} predictions for {n} instances")
    return preds


def _max_abs_diff(preds: Sequence[float], ref: Any) -> float:
    diffs = [abs(p - float(q)) for p, q in zip(preds, ref.tolist(), strict=True)]
    return max(diffs) if diffs else 0.0


@dataclass
class FixedBatch:
    """The fixed batch of one version: its JSON body and TorchRec's probabilities (B,)."""

    body: dict[str, Any]
    ref: Any
    ids: int
    schema_diffs: list[str]


def _batch_for(imported: ImportResult, cfg: CheckConfig) -> FixedBatch:
    from serve.schema import ModelSchema

    schema = ModelSchema.from_dict(imported.report["schema"])
    dense, values, lengths = fixed_batch(schema, cfg.batch, cfg.seed)
    ref, diffs = reference_probabilities(imported.factory, imported.checkpoint, imported.report,
                                         dense, values, lengths)
    return FixedBatch(instances_body(schema, dense, values, lengths), ref, int(values.numel()),
                  diffs)


def check_model(svc: Service, imported: ImportResult, row: ModelRow, cfg: CheckConfig,
                say: Say = print) -> FixedBatch | None:
    """Steps 3-6 for one imported version; findings go to ``row`` (``errors`` lists what
    failed). Returns its fixed batch (for the switch), None when it did not serve."""
    v = imported.version
    before = (svc.requests, svc.http_5xx)
    say(f"[{row.model}] serve {v} (PUT /state, wait until converged)")
    try:
        row.converge_seconds = round(svc.serve(v), 1)
        say(f"[{row.model}] serving {v} after {row.converge_seconds} s")
        batch = _check_serving(svc, imported, row, cfg, say)
    except (ServeError, httpx.HTTPError) as e:
        row.errors.append(getattr(e, "message", None) or f"{type(e).__name__}: {e}")
        say(f"[{row.model}] FAILED: {row.errors[-1]}")
        batch = None
    row.http_requests = svc.requests - before[0]
    row.http_5xx = svc.http_5xx - before[1]
    if row.http_5xx:
        row.errors.append(f"{row.http_5xx} of {row.http_requests} requests got a 5xx")
    return batch


def _check_serving(svc: Service, imported: ImportResult, row: ModelRow, cfg: CheckConfig,
                   say: Say) -> FixedBatch:
    """Steps 4-6 on the version ``svc`` serves now."""
    from serve.ops.loadgen import VERSION_HEADER
    from serve.schema import ModelSchema

    v = imported.version
    observed = ((svc.state().get("observed") or {}).get("model") or {}).get("schema")
    diffs = schema_differences(expected_schema(imported.report), observed)
    row.schema_match = not diffs
    if diffs:
        row.errors.append(f"GET /state observed.model.schema differs from the report: {diffs}")

    batch = _batch_for(imported, cfg)
    if batch.schema_diffs:
        row.schema_match = False
        row.errors.append("the report's schema does not describe the checkpoint's model: "
                          f"{batch.schema_diffs}")
    row.http_instances, row.http_ids = cfg.batch, batch.ids
    r = svc.post(batch.body)
    try:
        preds = _predictions(r, cfg.batch)
        row.http_max_abs_diff = _max_abs_diff(preds, batch.ref)
        if row.http_max_abs_diff > cfg.tolerance:
            row.errors.append(f"HTTP predictions differ from TorchRec's quantized forward by "
                              f"{row.http_max_abs_diff:.3g} > {cfg.tolerance:g}")
        served_by = r.headers.get(VERSION_HEADER)
        if served_by != v:
            row.errors.append(f"the answer's {VERSION_HEADER} is {served_by!r}, not {v!r}")
    except StepFailed as e:
        row.errors.append(e.message)
    say(f"[{row.model}] {cfg.batch} instances ({batch.ids} ids) over HTTP: " + (
        f"max |HTTP - TorchRec quantized| = {row.http_max_abs_diff:.3g}"
        if row.http_max_abs_diff is not None else f"not compared: {row.errors[-1]}"))

    schema = ModelSchema.from_dict(imported.report["schema"])
    good = batch.body["instances"][2]  # a full instance (0: max ids, 1: empty lists)
    for case, needles, body in bad_requests(schema, good):
        r = svc.post(body)
        try:
            message = error_message(r.json())
        except ValueError:
            message = f"(not JSON) {r.text}"
        b = BadRequest(case, needles, r.status_code, message[:500], names_each(message, needles))
        row.bad_requests.append(b)
        if not b.ok:
            row.errors.append(f"bad request '{case}': HTTP {b.status}, message "
                              f"{b.message[:200]!r} (must be a 400 naming {list(needles)})")
    say(f"[{row.model}] bad requests: {row.bad_ok}/{len(row.bad_requests)} answered 400 "
        "naming the feature / dense count")
    return batch


def switch_under_load(svc: Service, to: ImportResult, body: dict[str, Any],
                      from_version: str, from_preds: Sequence[float] | None, cfg: CheckConfig,
                      say: Say = print) -> SwitchResult:
    """Step 7: ``cfg.clients`` threads post ``body`` continuously while ``PUT /state``
    switches ``from_version`` (serving) to ``to``. Then the new version's answers to the
    fixed batch must equal its own TorchRec reference (and differ from the old ones)."""
    from serve.ops.loadgen import BackgroundLoad

    res = SwitchResult(from_version, to.version, cfg.clients)
    n = len(body["instances"])
    with BackgroundLoad(svc.predict_url, [json.dumps(body).encode()], clients=cfg.clients,
                        timeout_s=120, expect_predictions=n) as load:
        try:
            load.wait_for(4 * cfg.clients, timeout_s=120)
            t0 = time.monotonic()
            res.converge_seconds = round(svc.serve(to.version), 1)
            converged_at = time.monotonic()
            load.wait_for(load.served + 4 * cfg.clients, timeout_s=120)
        except (StepFailed, UpstreamUnavailable) as e:
            res.errors.append(e.message)
            converged_at = t0 = math.inf
    answers = load.answers
    res.served, res.failed = load.served, load.failed
    res.failures = load.failures[:3]
    res.http_5xx = sum(1 for a in answers if a.status >= 500)
    res.served_during_switch = sum(1 for a in answers if a.ok and t0 <= a.t <= converged_at)
    res.versions = {str(k): c for k, c in load.versions().items()}
    res.versions_after = {str(k): c for k, c in load.versions(since=converged_at).items()}
    if res.failed:
        res.errors.append(f"{res.failed} requests failed during the switch: {res.failures}")
    if res.served == 0:
        res.errors.append("no request was served during the switch")
    if res.versions_after and set(res.versions_after) != {to.version}:
        res.errors.append(f"after converging, answers came from {res.versions_after}, not only "
                          f"{to.version}")
    if not res.errors:
        try:
            batch = _batch_for(to, cfg)
            preds = _predictions(svc.post(batch.body), n)
            res.after_max_abs_diff = _max_abs_diff(preds, batch.ref)
            if res.after_max_abs_diff > cfg.tolerance:
                res.errors.append(f"after the switch, {to.version}'s answers differ from its "
                                  f"TorchRec reference by {res.after_max_abs_diff:.3g}")
            if from_preds is not None:
                res.answers_changed = list(preds) != list(from_preds)
                if not res.answers_changed:
                    res.errors.append(f"{to.version} answers exactly as {from_version}: the "
                                      "switch changed nothing")
        except (ServeError, httpx.HTTPError) as e:
            res.errors.append(getattr(e, "message", None) or f"{type(e).__name__}: {e}")
    say(f"[switch] {from_version} -> {to.version} under {cfg.clients} clients: served "
        f"{res.served} ({res.served_during_switch} during the switch), failed {res.failed}, "
        f"converged in {_fmt(res.converge_seconds)} s")
    return res


# ----------------------------------------------------------------------------- the run

def _prepare(case: ModelCase, cfg: CheckConfig, store: Path, row: ModelRow, say: Say
             ) -> list[ImportResult]:
    """Fit and import ``case`` (twice, two seeds, for the switch model); the imports."""
    seeds = cfg.switch_seeds if case.name == SWITCH_MODEL else (0,)
    out: list[ImportResult] = []
    for seed in seeds:
        where = cfg.workdir / case.name / f"s{seed}"
        how = ("pipeline --profile tiny, 2 gloo ranks" if case.factory is None
               else f"2 gloo ranks, {cfg.steps} steps")
        say(f"[{case.name}] fit seed {seed} ({how})")
        fit = fit_model(case, where, steps=cfg.steps, seed=seed, timeout_s=cfg.step_timeout_s)
        loss = "" if fit.final_loss is None else f", final loss {fit.final_loss:.4f}"
        say(f"[{case.name}] trained in {fit.seconds:.1f} s{loss}: {fit.checkpoint}")
        imp = import_version(fit.factory, fit.checkpoint, case.version(seed), store, where,
                             timeout_s=cfg.step_timeout_s)
        say(f"[{case.name}] imported {imp.version} in {imp.seconds:.1f} s (importer's "
            f"max_abs_diff {imp.max_abs_diff:.3g}, dense part {imp.report.get('dense_kind')})")
        if not out:
            schema = imp.report["schema"]
            row.version, row.dense_kind = imp.version, imp.report.get("dense_kind")
            row.dense = schema["dense"]
            row.tables, row.features = len(schema["tables"]), len(schema["features"])
            row.fit_seconds, row.final_loss = round(fit.seconds, 1), fit.final_loss
            row.import_seconds = round(imp.seconds, 1)
            row.import_max_abs_diff = imp.max_abs_diff
        out.append(imp)
    return out


def run_check(cfg: CheckConfig, say: Say = print) -> CheckReport:
    """Steps 1-7 for ``cfg.models``; the service is stopped before returning."""
    t0 = time.monotonic()
    store = cfg.workdir / "model_store"
    rows = [ModelRow(m) for m in cfg.models]
    imports: dict[str, list[ImportResult]] = {}
    # Every fit and import first: training and the service would fight for 2 cores.
    for row in rows:
        try:
            imports[row.model] = _prepare(CASES[row.model], cfg, store, row, say)
        except (StepFailed, ConfigError) as e:
            row.errors.append(e.message)
            say(f"[{row.model}] FAILED: {e.message}")
    switch: SwitchResult | None = None
    switch_errors: list[str] = []
    svc = Service(cfg.workdir / "service", store, workers=cfg.workers,
                  converge_timeout_s=cfg.converge_timeout_s, say=say)
    try:
        for row in rows:
            if row.model not in imports:
                continue
            first = imports[row.model][0]
            batch = check_model(svc, first, row, cfg, say)
            if row.model != SWITCH_MODEL:
                continue
            if batch is None or not svc.running or len(imports[row.model]) < 2:
                switch_errors.append(f"the switch under load did not run: {first.version} "
                                     "never served")
                continue
            try:
                from_preds: list[float] | None = _predictions(svc.post(batch.body),
                                                              len(batch.body["instances"]))
            except (StepFailed, httpx.HTTPError):
                from_preds = None
            switch = switch_under_load(svc, imports[row.model][1], batch.body, first.version,
                                       from_preds, cfg, say)
    finally:
        svc.close()
    load = (switch.served + switch.failed, switch.http_5xx) if switch else (0, 0)
    return CheckReport(rows, switch, time.monotonic() - t0, switch_errors,
                       http_requests=svc.requests + load[0], http_5xx=svc.http_5xx + load[1])


# ----------------------------------------------------------------------------- output

def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def format_table(report: CheckReport) -> str:
    """The result table, one row per model, then the switch and every error."""
    head = ("model", "version", "dense kind", "tables", "features", "import s",
            "HTTP max|diff|", "bad 400/total", "5xx", "result")
    lines = []
    for r in report.rows:
        lines.append((r.model, r.version or "-", r.dense_kind or "-", _fmt(r.tables, "d"),
                      _fmt(r.features, "d"), _fmt(r.import_seconds, ".1f"),
                      _fmt(r.http_max_abs_diff, ".2e"),
                      f"{r.bad_ok}/{len(r.bad_requests)}", str(r.http_5xx),
                      "ok" if r.ok else "FAIL"))
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) for x in lines]
    s = report.switch
    if s is not None:
        out.append(f"switch {s.from_version} -> {s.to_version} under {s.clients} clients: "
                   f"served {s.served} ({s.served_during_switch} during the switch), failed "
                   f"{s.failed}, 5xx {s.http_5xx}, converged in {_fmt(s.converge_seconds)} s; "
                   f"after: max |HTTP - TorchRec| {_fmt(s.after_max_abs_diff, '.2e')}"
                   f"{', answers changed' if s.answers_changed else ''}: "
                   f"{'ok' if s.ok else 'FAIL'}")
    for r in report.rows:
        out += [f"  {r.model}: {e}" for e in r.errors]
    if s is not None:
        out += [f"  switch: {e}" for e in s.errors]
    out += [f"  switch: {e}" for e in report.switch_errors]
    out.append(f"{'PASS' if report.ok else 'FAIL'} in {report.seconds:.0f} s: "
               f"{report.http_requests} HTTP requests, {report.http_5xx} 5xx")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.ops.import_check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Own TorchRec models end to end: fit on 2 gloo ranks (a DCP checkpoint), import,\n"
            "serve through the real TorchServe + sidecar on 127.0.0.1, and check the HTTP\n"
            "answers against TorchRec's own quantized forward. Models: article_dcn, dlrm_v2\n"
            "(rows capped by DLRMV2_MAX_ROWS, default 20000), own_ranker (examples/), builtin\n"
            "(our DLRM, profile tiny, trained by serve.model.pipeline)."),
        epilog=(
            "per model:\n"
            "  1. fit: serve.model.fit --world-size 2 (builtin: serve.model.pipeline --profile tiny)\n"
            "  2. import: serve.model.importer into a temporary model store (its max_abs_diff, time)\n"
            "  3. serve: PUT /state, wait until converged on the version (one service for all;\n"
            "     restarted after a version that never serves)\n"
            "  4. GET /state observed.model.schema == the import report's schema\n"
            "  5. --batch instances (multi-hot up to max_ids, empty lists, each table's last row)\n"
            "     as JSON rows over HTTP vs torch.sigmoid(quantize_inference_model(model)(...)),\n"
            "     model loaded from the same checkpoint: max |diff| <= --tolerance\n"
            "  6. unknown feature, missing feature, too many ids, wrong dense count: each a 400\n"
            "     whose JSON message names it; no 5xx at all\n"
            "once (own_ranker, fitted with seeds 0 and 1, imported as two versions):\n"
            "  7. PUT /state switches versions while --clients threads post continuously:\n"
            "     0 failed requests; afterwards the new version's answers equal its reference\n"
            "\n"
            "Prints a table, writes --out (JSON). Exit status: 0 every check passed, 1 a check\n"
            "failed, 2 a bad option. Needs Java (make java); make import-check runs it."))
    ap.add_argument("--examples", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated models to check, in order (default: all, "
                         f"{','.join(DEFAULT_MODELS)}); the switch under load runs when "
                         f"{SWITCH_MODEL} is among them")
    ap.add_argument("--steps", type=int, default=20,
                    help="training steps of each fit (default 20; the builtin model trains "
                         "its pipeline's tiny-profile epoch instead). Few steps suffice: the "
                         "check is about exactness, not quality")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"the JSON report (default {DEFAULT_OUT})")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temporary folder (checkpoints, model store, service logs) "
                         "and print where it is, to look into a failure")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="use this (new or empty) folder instead of a temporary one; kept")
    ap.add_argument("--batch", type=int, default=64,
                    help="instances in the fixed batch compared over HTTP (default 64, >= 2)")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help="largest accepted |HTTP - TorchRec| probability (default 1e-6, the "
                         "importer's own bar)")
    ap.add_argument("--clients", type=int, default=3,
                    help="client threads posting continuously during the switch (default 3: "
                         "load on 2 cores without starving the switch itself)")
    ap.add_argument("--workers", type=int, default=1,
                    help="TorchServe workers each version is declared with (default 1, one "
                         "torch thread: the reference forward and the clients share the cores)")
    ap.add_argument("--converge-timeout", type=float, default=240.0,
                    help="seconds a version may take to serve after it is declared (default "
                         "240); past it the version fails and the service is restarted")
    ap.add_argument("--step-timeout", type=float, default=1800.0,
                    help="seconds one fit, pipeline or import may run (default 1800)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from serve.common.clilog import setup_cli_logging

    args = _parser().parse_args(argv)
    setup_cli_logging()
    if args.workdir is not None:
        workdir, keep = args.workdir.resolve(), True
        workdir.mkdir(parents=True, exist_ok=True)
        if any(workdir.iterdir()):
            print(f"import_check: --workdir {workdir} is not empty; give a new or empty folder",
                  file=sys.stderr)
            return 2
    else:
        workdir, keep = Path(tempfile.mkdtemp(prefix="import-check-")), args.keep
    try:
        cfg = CheckConfig(workdir=workdir, models=tuple(m.strip() for m in
                                                        args.examples.split(",") if m.strip()),
                          steps=args.steps, batch=args.batch, tolerance=args.tolerance,
                          clients=args.clients, workers=args.workers,
                          converge_timeout_s=args.converge_timeout,
                          step_timeout_s=args.step_timeout)
    except ConfigError as e:
        print(f"import_check: {e.message}", file=sys.stderr)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        return 2
    print(f"import check of {', '.join(cfg.models)} in {workdir}", flush=True)
    try:
        report = run_check(cfg, say=lambda m: print(m, flush=True))
    finally:
        if keep:
            print(f"kept {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    out = args.out if args.out.is_absolute() else REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(cfg), indent=2) + "\n")
    print()
    print(format_table(report))
    print(f"wrote {out}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
