"""The whole model build, idempotent: data -> train -> merge -> quantize -> archive.

Each step writes into ``--workdir`` (default ``build/<profile>``) and records
``<step>.done.json`` holding a fingerprint of what it was built from: the profile,
the step's arguments, a hash of the source files that implement it, and the
fingerprint of the step before it. A step whose outputs exist and whose fingerprint is
unchanged is skipped, so ``make model`` twice does the work once, and editing
``serve/train.py`` retrains (and re-merges, re-quantizes, re-archives) but does not
regenerate the data.

Outputs: ``<model-store>/dlrm.mar`` (``serve.model.archive.build_mar``) and
``<model-store>/dlrm.report.json`` (profile, world size, sharding plan, merge diff,
AUCs, table bytes, parameters, wall time per step, git commit).

Example::

    python -m serve.model.pipeline --profile tiny --workdir build/tiny --model-store model_store
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from serve.clilog import setup_cli_logging
from serve.errors import ConfigError, ServeError
from serve.profiles import PROFILES, Profile, get_profile

__all__ = [
    "REPORT_KEYS",
    "STEPS",
    "PipelineConfig",
    "PipelineResult",
    "main",
    "run_pipeline",
    "source_hash",
]

log = logging.getLogger(__name__)

STEPS = ("data", "train", "merge", "quantize", "archive")
REPORT_KEYS = ("profile", "world_size", "sharding_plan", "merged_max_abs_diff", "auc_fp32",
               "auc_quantized", "quantized_dtype", "table_bytes_fp32", "table_bytes_quantized",
               "num_parameters", "created_at", "git_commit")
_SERVE = Path(__file__).resolve().parent.parent  # serve/
# Source files each step's output depends on (beyond the steps before it).
_STEP_SOURCES: dict[str, tuple[str, ...]] = {
    "data": ("model/data.py", "profiles.py"),
    "train": ("model/train.py", "model/dlrm.py", "model/data.py", "profiles.py"),
    "merge": ("model/merge.py", "model/dlrm.py", "model/train.py"),
    "quantize": ("model/quantize.py", "model/export.py", "runtime/artifact.py", "model/auc.py", "model/merge.py"),
    "archive": ("model/archive.py", "model/pipeline.py", "api/protocol.py",
                "../handlers/dlrm_handler.py"),
}


@dataclass(frozen=True)
class PipelineConfig:
    """One model build. ``None`` fields take the profile's value."""

    profile: Profile
    workdir: Path
    model_store: Path = Path("model_store")
    model_name: str = "dlrm"
    nproc: int = 2
    backend: str = "auto"
    dtype: str = "int8"
    alpha: float | None = None
    samples: int | None = None
    eval_samples: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    threads: int = 1
    num_workers: int = 1
    # Ranking requests carry ~100-700 instances each, so a forward is already large:
    # batching more than 2 requests per worker starves the other worker (measured on 2
    # cores, step load test: knee 118 req/s with batch 8 / 5 ms, 277 req/s with 2 / 2 ms).
    mar_batch_size: int = 2
    mar_max_batch_delay_ms: int = 2
    # Workers x threads must fit the cores: one thread per worker lets one worker parse
    # JSON while another runs a forward (2 x 1 beat 1 x 2 by ~2x at 512 instances/request).
    mar_workers: int = 2
    handler_config: dict[str, Any] = field(default_factory=dict)
    force: bool = False
    check_quality: bool = True

    def __post_init__(self) -> None:
        from serve.model.quantize import QUANT_DTYPES

        if self.dtype not in QUANT_DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} must be one of {', '.join(QUANT_DTYPES)}")
        if self.nproc < 1:
            raise ConfigError(f"--nproc {self.nproc} must be >= 1")

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / "checkpoint"

    @property
    def merged(self) -> Path:
        return self.workdir / "merged.pt"

    @property
    def artifact(self) -> Path:
        return self.workdir / "artifact.pt"

    @property
    def mar(self) -> Path:
        return self.model_store / f"{self.model_name}.mar"

    @property
    def report_path(self) -> Path:
        return self.model_store / f"{self.model_name}.report.json"


@dataclass
class PipelineResult:
    report: dict[str, Any]
    ran: list[str]
    skipped: list[str]


def source_hash(files: tuple[str, ...]) -> str:
    """sha256 over the named files under serve/ (missing files hash as absent)."""
    h = hashlib.sha256()
    for rel in files:
        p = (_SERVE / rel).resolve()
        h.update(rel.encode())
        h.update(p.read_bytes() if p.is_file() else b"<absent>")
    return h.hexdigest()


def _fingerprint(step: str, cfg: PipelineConfig, args: dict[str, Any], upstream: str) -> str:
    blob = json.dumps({"step": step, "profile": dataclasses.asdict(cfg.profile), "args": args,
                       "source": source_hash(_STEP_SOURCES[step]), "upstream": upstream},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_SERVE.parent, capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    commit = out.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=_SERVE.parent, capture_output=True, text=True, timeout=10, check=False)
    return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


class _Runner:
    def __init__(self, cfg: PipelineConfig, say: Callable[[str], None]) -> None:
        self.cfg, self.say = cfg, say
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.records: dict[str, dict] = {}
        self.upstream = ""

    def step(self, name: str, args: dict[str, Any], outputs: list[Path],
             fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        fp = _fingerprint(name, self.cfg, args, self.upstream)
        done = self.cfg.workdir / f"{name}.done.json"
        if not self.cfg.force and done.is_file() and all(o.exists() for o in outputs):
            try:
                rec = json.loads(done.read_text())
            except json.JSONDecodeError:
                rec = {}
            if rec.get("fingerprint") == fp:
                self.say(f"[{name}] up to date (fingerprint {fp}), skipped")
                self.skipped.append(name)
                self.records[name] = rec
                self.upstream = fp
                return rec["result"]
        self.say(f"[{name}] running ...")
        t0 = time.perf_counter()
        result = fn()
        wall = round(time.perf_counter() - t0, 3)
        rec = {"fingerprint": fp, "args": args, "result": result, "wall_seconds": wall,
               "finished_at": datetime.now(UTC).isoformat(timespec="seconds")}
        tmp = done.with_name(done.name + ".tmp")
        tmp.write_text(json.dumps(rec, indent=2, default=str))
        os.replace(tmp, done)
        self.say(f"[{name}] done in {wall:.1f}s")
        self.ran.append(name)
        self.records[name] = rec
        self.upstream = fp
        return result


def _report(cfg: PipelineConfig, tres: dict, mres: dict, qres: dict,
            records: dict[str, dict], mar: Path) -> dict[str, Any]:
    """The build report (``REPORT_KEYS``) from the train, merge and quantize step results."""
    return {
        "profile": cfg.profile.name, "world_size": tres["world_size"],
        "backend": tres.get("backend"), "sharding_plan": tres["sharding_plan"],
        "merged_max_abs_diff": mres["merged_max_abs_diff"],
        "auc_fp32": qres["auc_fp32"], "auc_quantized": qres["auc_quantized"],
        "quantized_dtype": qres["quantized_dtype"], "eval_rows": qres["eval_rows"],
        "table_bytes_fp32": qres["table_bytes_fp32"],
        "table_bytes_quantized": qres["table_bytes_quantized"],
        "num_parameters": mres["num_parameters"],
        "train_rows": tres["rows"], "train_steps": tres["steps"],
        "final_train_loss": tres["final_loss"],
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "wall_seconds": {s: records[s]["wall_seconds"] for s in STEPS[:-1]},
        "artifact": os.fspath(cfg.artifact.resolve()), "mar": os.fspath(mar.resolve()),
    }


def run_pipeline(cfg: PipelineConfig, say: Callable[[str], None] = print) -> PipelineResult:
    """Build (or confirm up to date) every step; return the report."""
    from serve.model.data import DataConfig, generate
    from serve.model.merge import merge_checkpoint
    from serve.model.quantize import quantize
    from serve.model.train import TrainConfig, plan_sharding, train

    p = cfg.profile
    # Validate the world size before generating anything (fails fast, clear message).
    backend = TrainConfig(profile=p, data_dir=cfg.data_dir, out_dir=cfg.checkpoint_dir,
                          backend=cfg.backend).resolved_backend()
    plan_sharding(p, cfg.nproc, "cuda" if backend == "nccl" else "cpu")
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    r = _Runner(cfg, say)

    dcfg = DataConfig.for_profile(p, cfg.alpha, cfg.samples, cfg.eval_samples)
    data_args = {"alpha": dcfg.alpha, "train_samples": dcfg.train_samples,
                 "eval_samples": dcfg.eval_samples, "seed": dcfg.seed}

    def do_data() -> dict:
        generate(dcfg, cfg.data_dir)
        meta = json.loads((cfg.data_dir / "meta.json").read_text())
        return {"train_rows": meta["splits"]["train"]["rows"],
                "eval_rows": meta["splits"]["eval"]["rows"],
                "ctr": meta["splits"]["train"]["ctr"], "alpha": meta["alpha"]}

    r.step("data", data_args, [cfg.data_dir / "meta.json"], do_data)

    tcfg = TrainConfig(profile=p, data_dir=cfg.data_dir, out_dir=cfg.checkpoint_dir,
                       nproc=cfg.nproc, backend=cfg.backend, batch_size=cfg.batch_size,
                       learning_rate=cfg.learning_rate, threads=cfg.threads,
                       num_workers=cfg.num_workers)
    train_args = {"nproc": cfg.nproc, "backend": tcfg.resolved_backend(),
                  "batch_size": tcfg.global_batch, "lr": tcfg.lr,
                  "dense_lr": tcfg.dense_learning_rate, "threads": cfg.threads}
    tres = r.step("train", train_args, [cfg.checkpoint_dir / ".metadata"], lambda: train(tcfg))

    def do_merge() -> dict:
        m = merge_checkpoint(cfg.checkpoint_dir, p, cfg.merged)
        return {"merged_max_abs_diff": m.merged_max_abs_diff, "world_size": m.world_size,
                "num_parameters": m.num_parameters}

    mres = r.step("merge", {}, [cfg.merged], do_merge)

    def do_quantize() -> dict:
        q = quantize(cfg.merged, p, cfg.data_dir, cfg.dtype, cfg.artifact,
                     check=cfg.check_quality)
        say(f"[quantize] AUC fp32 {q.auc_fp32:.4f}  {cfg.dtype} {q.auc_quantized:.4f}  "
            f"tables {q.table_bytes_fp32:,} B -> {q.table_bytes_quantized:,} B")
        return dataclasses.asdict(q)

    qres = r.step("quantize", {"dtype": cfg.dtype, "check": cfg.check_quality},
                  [cfg.artifact], do_quantize)

    def do_archive() -> dict:
        from serve.model.archive import build_mar

        mar = build_mar(cfg.artifact, cfg.model_store, model_name=cfg.model_name,
                        batch_size=cfg.mar_batch_size,
                        max_batch_delay_ms=cfg.mar_max_batch_delay_ms,
                        min_workers=cfg.mar_workers, max_workers=cfg.mar_workers,
                        handler_config=cfg.handler_config or None)
        report = _report(cfg, tres, mres, qres, r.records, mar)
        tmp = cfg.report_path.with_name(cfg.report_path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, cfg.report_path)
        return {"mar": os.fspath(mar), "mar_bytes": mar.stat().st_size}

    r.step("archive", {"model_name": cfg.model_name, "mar_batch_size": cfg.mar_batch_size,
                       "mar_max_batch_delay_ms": cfg.mar_max_batch_delay_ms,
                       "mar_workers": cfg.mar_workers,
                       "handler_config": cfg.handler_config},
           [cfg.mar, cfg.report_path], do_archive)
    report = json.loads(cfg.report_path.read_text())
    report["wall_seconds"]["archive"] = r.records["archive"]["wall_seconds"]
    return PipelineResult(report, r.ran, r.skipped)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.pipeline",
        description="Build the served model end to end: generate click logs, train sharded "
                    "(TorchRec DMP over --nproc ranks), merge the checkpoint, quantize the "
                    "tables, pack model_store/dlrm.mar and dlrm.report.json. Steps whose "
                    "inputs did not change are skipped (--force redoes them).")
    ap.add_argument("--profile", default="small", help=f"profile ({', '.join(PROFILES)}); default small")
    ap.add_argument("--workdir", default=None, help="build directory (default build/<profile>)")
    ap.add_argument("--model-store", default="model_store",
                    help="where dlrm.mar and dlrm.report.json go (default model_store)")
    ap.add_argument("--model-name", default="dlrm", help="TorchServe model name (default dlrm)")
    ap.add_argument("--nproc", type=int, default=2, help="training ranks (default 2)")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                    help="process-group backend (auto: nccl with CUDA, else gloo)")
    ap.add_argument("--dtype", default="int8", choices=("int8", "int4", "fp16"),
                    help="table dtype of the served artifact (default int8)")
    ap.add_argument("--alpha", type=float, default=None, help="Zipf exponent (default: profile)")
    ap.add_argument("--samples", type=int, default=None, help="training rows (default: profile)")
    ap.add_argument("--eval-samples", type=int, default=None, help="held-out rows (default: profile)")
    ap.add_argument("--batch-size", type=int, default=None, help="global training batch")
    ap.add_argument("--lr", type=float, default=None, help="embedding learning rate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training rank")
    ap.add_argument("--mar-batch-size", type=int, default=2,
                    help="TorchServe batch_size written into the .mar (requests per batch)")
    ap.add_argument("--mar-max-batch-delay-ms", type=int, default=2,
                    help="TorchServe max_batch_delay written into the .mar")
    ap.add_argument("--mar-workers", type=int, default=2,
                    help="TorchServe workers in the .mar (default 2: one per core on a 2-core pod, "
                         "each with cores/workers torch threads; use 1 per GPU on GPU pods)")
    ap.add_argument("--force", action="store_true", help="redo every step")
    ap.add_argument("--no-quality-check", action="store_true",
                    help="do not fail when int8 AUC < fp32 AUC - 0.001 (still reported)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_cli_logging()
    t0 = time.perf_counter()
    try:
        profile = get_profile(args.profile)
        cfg = PipelineConfig(
            profile=profile, workdir=Path(args.workdir or f"build/{profile.name}"),
            model_store=Path(args.model_store), model_name=args.model_name, nproc=args.nproc,
            backend=args.backend, dtype=args.dtype, alpha=args.alpha, samples=args.samples,
            eval_samples=args.eval_samples, batch_size=args.batch_size,
            learning_rate=args.lr, threads=args.threads, mar_batch_size=args.mar_batch_size,
            mar_max_batch_delay_ms=args.mar_max_batch_delay_ms, mar_workers=args.mar_workers,
            force=args.force,
            check_quality=not args.no_quality_check)
        res = run_pipeline(cfg, say=lambda s: print(s, flush=True))
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    rep = res.report
    print(f"\nbuilt {rep['mar']} (profile {rep['profile']}, {rep['world_size']} ranks) in "
          f"{time.perf_counter() - t0:.1f}s; ran {', '.join(res.ran) or 'nothing'}"
          f"{'; skipped ' + ', '.join(res.skipped) if res.skipped else ''}")
    print(f"  merged_max_abs_diff {rep['merged_max_abs_diff']:.3g}")
    print(f"  AUC fp32 {rep['auc_fp32']:.4f}  {rep['quantized_dtype']} {rep['auc_quantized']:.4f}")
    print(f"  tables {rep['table_bytes_fp32']:,} B fp32 -> {rep['table_bytes_quantized']:,} B "
          f"{rep['quantized_dtype']}; {rep['num_parameters']:,} parameters")
    print(f"  report {cfg.report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
