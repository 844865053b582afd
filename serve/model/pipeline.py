"""The whole model build, idempotent: data -> train -> merge -> quantize -> archive.

Every build adds one **immutable version** to the model repository
(:class:`serve.store.repository.ModelRepository`, ``--model-store``, default ``model_store/``):
``dlrm-<version>.mar`` and its build report ``dlrm-<version>.json``, both read-only. The
version name defaults to ``<profile>-<dtype>-s<seed>`` (``small-int8-s0``); ``--version``
names it. ``--seed`` picks the training seed (initial weights); the data keeps the
profile's seed, so two seeds train on the same click logs and give two different models.

``--label-shuffle`` builds a deliberately bad candidate (to test that a rollout's guards
roll it back): the same click logs, but the training split's labels permuted by a
generator seeded with the training seed (:func:`serve.model.train.shuffled_labels`; eval
untouched), so its eval AUC is about 0.5. Its version defaults to
``<profile>-<dtype>-s<seed>-shuffled`` and its workdir to ``build/<profile>-s<seed>-shuffled``;
the shuffle is one of the train step's arguments, so it is in every fingerprint from the
train step on (a shuffled and a normal build never share a step or a version), and the
report records ``label_shuffle``. The int8 quality bar (int8 AUC >= fp32 AUC - 0.001) is
not applied to it: on a model with AUC ~0.5 that difference is noise (both AUCs are still
reported).

Each step writes into ``--workdir`` (default ``build/<profile>-s<seed>``, one per seed so
two seeds keep their own checkpoints) and records ``<step>.done.json`` holding a
fingerprint of what it was built from: the profile, the step's arguments, a hash of the
source files that implement it, and the fingerprint of the step before it. A step whose
outputs exist and whose fingerprint is unchanged is skipped, so ``make model`` twice does
the work once, and editing ``serve/model/train.py`` retrains (and re-merges,
re-quantizes, re-archives) but does not regenerate the data.

The archive step's fingerprint chains all the others, so it identifies the build; the
report keeps it as ``build_fingerprint``. Fingerprints depend only on arguments and
sources, so the repository is checked before any work:

- the version exists with this build's fingerprint: nothing to do, every step is up to date;
- it exists with another fingerprint (or ``--force`` is given): ``ConfigError`` — versions
  are immutable, so a different build needs another name (``--version``).

``--data-day N`` (N >= 1) builds the same model from scratch on day N of the click logs
(:mod:`serve.model.data`: drifted hot ids and effects), the reference an embedding delta
(:mod:`serve.model.delta`) is compared with. Its version defaults to
``<profile>-<dtype>-s<seed>-day<N>`` and its workdir to ``build/<profile>-s<seed>-day<N>``;
the day is one of the data step's arguments (only when N > 0, so day-0 builds keep their
arguments) and the report records ``data_day``.

``--mapping managed`` gives every table a managed id space (:mod:`serve.model.admission`):
ids seen ``--admit-threshold`` times in the training split get rows of their own, the
others read the fallback row 0, and ``--eviction`` (lru, lfu, ttl, lfu_lru; with
``--ttl-days``, ``--recency-days``) decides who leaves a full table on later days (deltas).
The training maps ids to rows through the admission state it writes next to the checkpoint
(``admission.npz``); the artifact carries the id maps (``Artifact.id_maps``) and its schema's
tables ``mapping="managed"``. The policy is in the train step's arguments only when
managed (modulo builds keep their arguments), the version defaults to ``...-managed`` and
the workdir to ``build/<profile>-s<seed>[...]-managed`` (a managed and a modulo build never
share a step), and the report records ``id_mapping``: the mapping, the policy, threshold,
ttl_days, recency_days and per table admitted ids, capacity (rows - 1) and occupancy.

``--stream`` (the default when the profile's fp32 tables exceed half of
``--max-memory-bytes``, 2 GB by default; ``--no-stream`` never) merges and quantizes
straight from the DCP checkpoint, a table chunk at a time (:mod:`serve.model.stream_build`):
no ``merged.pt`` and no fp32 twin; the quantize step writes the version's tables folder
and a format-3 artifact, which the archive step adds as the importer does. The stream is
in the merge and quantize steps' arguments only when on (in-memory builds keep theirs);
the report records ``streamed`` and ``max_memory_bytes``.

The report (``REPORT_KEYS``): version, seed, label shuffle, build fingerprint, the
archive's batching and workers, profile, world size, sharding plan, merge diff, AUCs,
table bytes, parameters, wall time per step, git commit, and the ``baseline``: the served
(int8) model on the held-out rows (observed and predicted CTR, calibration ratio, AUC, score
bins; :func:`serve.common.quality.summarize`), which the pod's online metrics are compared with.
``peak_rss_bytes``: the largest peak resident set of the merge and quantize steps (each
step's own, measured in this process; ``peak_rss_bytes_steps`` per step).

Example::

    python -m serve.model.pipeline --profile tiny --seed 7    # -> model_store/dlrm-tiny-int8-s7.mar
    python -m serve.model.pipeline --profile tiny --seed 8 --label-shuffle
                                                # -> model_store/dlrm-tiny-int8-s8-shuffled.mar
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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from serve.common.clilog import setup_cli_logging
from serve.constants import DENSE_MAX_AUC_DROP, DENSE_PRECISIONS
from serve.errors import ConfigError, ServeError
from serve.model.admission import DEFAULT_FALLBACK_SHARE
from serve.model.pipeline_config import MAPPING_CHOICES, PipelineConfig, default_workdir
from serve.profiles import PROFILES, get_profile
from serve.state import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_DELAY_MS, DEFAULT_WORKERS
from serve.store.repository import DEFAULT_PROFILE, ModelRepository

__all__ = [
    "REPORT_KEYS",
    "STEPS",
    "PipelineResult",
    "config_from_args",
    "id_mapping_line",
    "main",
    "run_pipeline",
    "source_hash",
    "step_fingerprints",
]

log = logging.getLogger(__name__)

STEPS = ("data", "train", "merge", "quantize", "archive")
REPORT_KEYS = ("version", "seed", "data_seed", "label_shuffle", "build_fingerprint", "archive",
               "mar_batch_size", "mar_max_batch_delay_ms", "mar_workers", "profile",
               "world_size", "sharding_plan", "merged_max_abs_diff", "auc_fp32", "auc_quantized", "quantized_dtype", "baseline", "schema",
               "table_bytes_fp32", "table_bytes_quantized", "num_parameters", "created_at",
               "git_commit", "peak_rss_bytes")
_SERVE = Path(__file__).resolve().parent.parent  # serve/
# Source files each step's output depends on (beyond the steps before it).
_STEP_SOURCES: dict[str, tuple[str, ...]] = {
    "data": ("model/data.py", "profiles.py"),
    "train": ("model/train.py", "model/sharding.py", "model/dlrm.py", "model/data.py",
              "profiles.py"),
    "merge": ("model/merge.py", "model/dlrm.py", "model/train.py"),
    "quantize": ("model/quantize.py", "model/export.py", "runtime/artifact.py",
                 "common/quality.py", "model/merge.py", "model/importer.py", "schema.py"),
    "archive": ("model/archive.py", "model/pipeline.py", "model/pipeline_config.py",
                "api/config.py", "../handlers/dlrm_handler.py"),
    # Only a lossy dense precision's build runs the gate (see _step_args).
    "precision": ("model/precision.py", "runtime/dense.py"),
    # Only a streamed build's merge and quantize read these (see _step_args).
    "stream": ("model/stream_build.py", "model/stream_import.py", "model/ckpt_stream.py",
               "model/rowquant.py", "store/tablefiles.py"),
}


@dataclass
class PipelineResult:
    """``report`` is the version's report as stored in the repository."""

    version: str
    archive: Path   # the version's .mar in the repository
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
    profile = dataclasses.asdict(cfg.profile)
    if profile.get("id_cardinalities") is None:   # profiles before the field: same prints
        profile.pop("id_cardinalities", None)
    blob = json.dumps({"step": step, "profile": profile, "args": args,
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
    def __init__(self, cfg: PipelineConfig, args: dict[str, dict[str, Any]],
                 say: Callable[[str], None]) -> None:
        self.cfg, self.args, self.say = cfg, args, say
        self.fingerprints = _chain(cfg, args)
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.records: dict[str, dict] = {}

    def step(self, name: str, outputs: list[Path],
             fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        fp = self.fingerprints[name]
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
                return rec["result"]
        from serve.model.stream_build import peak_rss_bytes, reset_peak_rss

        self.say(f"[{name}] running ...")
        reset = reset_peak_rss()
        t0 = time.perf_counter()
        result = fn()
        wall = round(time.perf_counter() - t0, 3)
        # The step's own peak (this process; training's ranks are processes of their own),
        # or the process's so far where the peak cannot be reset.
        rec = {"fingerprint": fp, "args": self.args[name], "result": result,
               "wall_seconds": wall, "peak_rss_bytes": peak_rss_bytes(),
               "peak_rss_reset": reset,
               "finished_at": datetime.now(UTC).isoformat(timespec="seconds")}
        tmp = done.with_name(done.name + ".tmp")
        tmp.write_text(json.dumps(rec, indent=2, default=str))
        os.replace(tmp, done)
        self.say(f"[{name}] done in {wall:.1f}s")
        self.ran.append(name)
        self.records[name] = rec
        return result


def _train_config(cfg: PipelineConfig) -> Any:
    from serve.model.train import TrainConfig

    return TrainConfig(profile=cfg.profile, data_dir=cfg.data_dir, out_dir=cfg.checkpoint_dir,
                       nproc=cfg.nproc, backend=cfg.backend, batch_size=cfg.batch_size,
                       learning_rate=cfg.learning_rate, threads=cfg.threads,
                       num_workers=cfg.num_workers, seed=cfg.seed,
                       label_shuffle=cfg.label_shuffle, admission=cfg.admission)


def _data_config(cfg: PipelineConfig) -> Any:
    from serve.model.data import DataConfig

    # The profile's data seed, whatever the training seed: two seeds, same click logs.
    return DataConfig.for_profile(cfg.profile, cfg.alpha, cfg.samples, cfg.eval_samples,
                                  day=cfg.data_day)


def _step_args(cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    """Each step's arguments, in ``STEPS`` order (they and the sources make the fingerprints)."""
    dcfg, tcfg = _data_config(cfg), _train_config(cfg)
    data: dict[str, Any] = {"alpha": dcfg.alpha, "train_samples": dcfg.train_samples,
                            "eval_samples": dcfg.eval_samples, "seed": dcfg.seed}
    if dcfg.day > 0:  # only then: day-0 builds keep the arguments they always had
        data["day"] = dcfg.day
    train: dict[str, Any] = {"nproc": cfg.nproc, "backend": tcfg.resolved_backend(),
                             "batch_size": tcfg.global_batch, "lr": tcfg.lr,
                             "dense_lr": tcfg.dense_learning_rate, "threads": cfg.threads,
                             "seed": tcfg.resolved_seed, "label_shuffle": tcfg.label_shuffle}
    if cfg.admission is not None:  # only then: modulo builds keep the arguments they had
        train["id_mapping"] = {"mapping": cfg.mapping, **cfg.admission.to_dict(),
                               "source": source_hash(("model/admission.py",))}
    archive: dict[str, Any] = {"model_name": cfg.model_name, "version": cfg.version_name,
                               "mar_batch_size": cfg.mar_batch_size,
                               "mar_max_batch_delay_ms": cfg.mar_max_batch_delay_ms,
                               "mar_workers": cfg.mar_workers,
                               "handler_config": cfg.handler_config}
    if cfg.dense_precision != "fp32":  # only then: fp32 builds keep the arguments they had
        archive["dense_precision"] = {"precision": cfg.dense_precision,
                                      "check": cfg.check_quality,
                                      "source": source_hash(_STEP_SOURCES["precision"])}
    merge: dict[str, Any] = {}
    quantize: dict[str, Any] = {"dtype": cfg.dtype, "check": cfg.quality_check}
    if cfg.streamed:  # only then: in-memory builds keep the arguments they had
        merge["stream"] = quantize["stream"] = source_hash(_STEP_SOURCES["stream"])
    return {
        "data": data,
        "train": train,
        "merge": merge,
        "quantize": quantize,
        "archive": archive,
    }


def step_fingerprints(cfg: PipelineConfig) -> dict[str, str]:
    """Every step's fingerprint, computed without running anything.

    ``step_fingerprints(cfg)["archive"]`` chains them all: it is the build's fingerprint,
    stored in the report as ``build_fingerprint``.
    """
    return _chain(cfg, _step_args(cfg))


def _chain(cfg: PipelineConfig, step_args: dict[str, dict[str, Any]]) -> dict[str, str]:
    fps: dict[str, str] = {}
    upstream = ""
    for name in STEPS:
        upstream = fps[name] = _fingerprint(name, cfg, step_args[name], upstream)
    return fps


def _report(cfg: PipelineConfig, tres: dict, mres: dict, qres: dict,
            records: dict[str, dict], data_seed: int, build_fingerprint: str,
            archive_name: str) -> dict[str, Any]:
    """The build report (``REPORT_KEYS``) from the train, merge and quantize step results."""
    return {
        "version": cfg.version_name, "model_name": cfg.model_name,
        "seed": cfg.train_seed, "data_seed": data_seed,
        # True: trained on permuted labels (serve.model.train.shuffled_labels), AUC ~0.5.
        "label_shuffle": cfg.label_shuffle, "data_day": cfg.data_day,
        "build_fingerprint": build_fingerprint, "archive": archive_name,
        # What the archive's model-config.yaml says: `make up` declares these by default.
        "mar_batch_size": cfg.mar_batch_size,
        "mar_max_batch_delay_ms": cfg.mar_max_batch_delay_ms, "mar_workers": cfg.mar_workers,
        "profile": cfg.profile.name, "world_size": tres["world_size"],
        "backend": tres.get("backend"), "sharding_plan": tres["sharding_plan"],
        "merged_max_abs_diff": mres["merged_max_abs_diff"],
        "auc_fp32": qres["auc_fp32"], "auc_quantized": qres["auc_quantized"],
        "quantized_dtype": qres["quantized_dtype"], "eval_rows": qres["eval_rows"],
        # The served (int8) model on the held-out rows: what the pod's predicted-CTR and
        # calibration metrics are compared with (dlrm_baseline_*; serve.common.quality).
        "baseline": qres.get("baseline"),
        # The request schema and tables (serve.schema), and the import check's result.
        "schema": qres.get("schema"),
        "check": {"max_abs_diff": qres.get("check_max_abs_diff")},
        **({"id_mapping": _id_mapping_report(tres["id_mapping"])}
           if cfg.mapping == "managed" else {}),
        "table_bytes_fp32": qres["table_bytes_fp32"],
        "table_bytes_quantized": qres["table_bytes_quantized"],
        "num_parameters": mres["num_parameters"],
        "train_rows": tres["rows"], "train_steps": tres["steps"],
        "final_train_loss": tres["final_loss"],
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "wall_seconds": {s: records[s]["wall_seconds"] for s in STEPS[:-1]},
        "build_dir": os.fspath(cfg.workdir),
        **_memory_report(cfg, records),
    }


def _memory_report(cfg: PipelineConfig, records: dict[str, dict]) -> dict[str, Any]:
    """``streamed``, ``max_memory_bytes`` and the peak resident set: ``peak_rss_bytes``
    the largest of the merge and quantize steps' (what the memory bound is about), and
    per step (None: a step recorded before peaks were)."""
    steps = {s: records[s].get("peak_rss_bytes") for s in STEPS[:-1]}
    tail = [v for s, v in steps.items() if s in ("merge", "quantize") and v is not None]
    return {"streamed": cfg.streamed, "max_memory_bytes": cfg.memory_budget,
            "peak_rss_bytes": max(tail) if tail else None, "peak_rss_bytes_steps": steps}


def _id_mapping_report(plan: dict[str, Any]) -> dict[str, Any]:
    """The report's ``id_mapping`` from plan.json's: mapping, policy (named), threshold,
    ttl_days, recency_days and per table admitted ids, capacity and occupancy."""
    return {"mapping": plan["mapping"], "policy": plan["policy"],
            "threshold": plan["threshold"], "ttl_days": plan["ttl_days"],
            "recency_days": plan["recency_days"],
            "fallback_share": plan.get("fallback_share", 0.0),
            "tables": {n: {k: t[k] for k in ("admitted", "capacity", "occupancy")}
                       for n, t in plan["tables"].items()}}


def _immutable(cfg: PipelineConfig, existing: dict[str, Any], build_fp: str) -> ConfigError:
    v = cfg.version_name
    head = (f"version {v!r} already exists and versions are immutable; pass --version NAME "
            f"(make model VERSION=NAME)")
    if cfg.force:
        return ConfigError(f"{head}: --force rebuilds every step, which makes a new version")
    shuffle = ""
    if bool(existing.get("label_shuffle", False)) != cfg.label_shuffle:
        shuffle = (f"; it was trained with label_shuffle={bool(existing.get('label_shuffle'))}, "
                   f"this build has label_shuffle={cfg.label_shuffle}")
    return ConfigError(
        f"{head}: {cfg.model_store}/{cfg.model_name}-{v}.json was built from fingerprint "
        f"{existing.get('build_fingerprint')} ({existing.get('created_at')}), this build is "
        f"{build_fp} (its arguments or sources differ{shuffle})")


def _already_built(cfg: PipelineConfig, fps: dict[str, str],
                   say: Callable[[str], None]) -> PipelineResult | None:
    """The result when the repository holds this very build; None when the version is new.

    Raises:
        ConfigError: the version exists with another build (or ``force``): immutable.
    """
    repo, version, build_fp = cfg.repository, cfg.version_name, fps["archive"]
    if not repo.exists(version):
        return None
    existing = repo.report(version)
    if cfg.force or existing.get("build_fingerprint") != build_fp:
        raise _immutable(cfg, existing, build_fp)
    say(f"version {version} is in {cfg.model_store} with this build's fingerprint "
        f"{build_fp}: nothing to build")
    for name in STEPS:
        say(f"[{name}] up to date (fingerprint {fps[name]}), skipped")
    return PipelineResult(version, repo.archive(version), existing, [], list(STEPS))


def _trained_id_maps(cfg: PipelineConfig) -> dict[str, Any] | None:
    """A managed build's id maps, from the admission state its training wrote next to the
    checkpoint; None for modulo."""
    if cfg.mapping != "managed":
        return None
    from serve.model.admission import ADMISSION_FILE, load_state

    return load_state(cfg.checkpoint_dir / ADMISSION_FILE).id_maps()


def run_pipeline(cfg: PipelineConfig, say: Callable[[str], None] = print) -> PipelineResult:
    """Add version ``cfg.version_name`` to the repository, or confirm it holds this build.

    Raises:
        ConfigError: the version exists with another build (or ``force``); a bad setting.
        ShardingError: ``nproc`` ranks cannot share the tables.
    """
    from serve.model.data import generate
    from serve.model.sharding import plan_sharding
    from serve.model.train import train

    p = cfg.profile
    tcfg = _train_config(cfg)
    step_args = _step_args(cfg)
    fps = _chain(cfg, step_args)
    build_fp = fps["archive"]
    repo, version = cfg.repository, cfg.version_name
    # The repository first: fingerprints need no work, so "up to date" costs only the
    # imports, and a name clash fails before hours of training.
    done = _already_built(cfg, fps, say)
    if done is not None:
        return done
    # Validate the world size before generating anything (fails fast, clear message).
    plan_sharding(p, cfg.nproc, "cuda" if tcfg.resolved_backend() == "nccl" else "cpu")

    cfg.workdir.mkdir(parents=True, exist_ok=True)
    r = _Runner(cfg, step_args, say)
    dcfg = _data_config(cfg)

    def do_data() -> dict:
        generate(dcfg, cfg.data_dir)
        meta = json.loads((cfg.data_dir / "meta.json").read_text())
        return {"train_rows": meta["splits"]["train"]["rows"],
                "eval_rows": meta["splits"]["eval"]["rows"],
                "ctr": meta["splits"]["train"]["ctr"], "alpha": meta["alpha"]}

    r.step("data", [cfg.data_dir / "meta.json"], do_data)
    tres = r.step("train", [cfg.checkpoint_dir / ".metadata"], lambda: train(tcfg))

    mres = r.step("merge", [cfg.checkpoint_dir / ".metadata"] if cfg.streamed
                  else [cfg.merged], lambda: _merge(cfg))
    qres = r.step("quantize", _quantize_outputs(cfg), lambda: _quantize(cfg, say))

    def do_archive() -> dict:
        from serve.model.archive import add_version

        # Built in the work directory, then stored: the repository only ever sees a
        # complete archive, and its report is written last (serve.store.repository).
        report = _report(cfg, tres, mres, qres, r.records, dcfg.seed, build_fp,
                         repo.archive_name(version))
        handler_config = _gate_dense_precision(cfg, report, say)
        stored = add_version(repo, cfg.stream_artifact if cfg.streamed else cfg.artifact,
                             version, report, cfg.workdir, batch_size=cfg.mar_batch_size,
                             max_batch_delay_ms=cfg.mar_max_batch_delay_ms,
                             workers=cfg.mar_workers, handler_config=handler_config,
                             tables=cfg.stream_tables if cfg.streamed else None)
        say(f"[archive] added version {version}: {stored}")
        return {"version": version, "archive": os.fspath(stored),
                "mar_bytes": stored.stat().st_size}

    # The version is not in the repository (checked above), so this step always runs.
    r.step("archive", [cfg.model_store / repo.archive_name(version)], do_archive)
    report = repo.report(version)
    report["wall_seconds"]["archive"] = r.records["archive"]["wall_seconds"]
    return PipelineResult(version, repo.archive(version), report, r.ran, r.skipped)


def _merge(cfg: PipelineConfig) -> dict[str, Any]:
    """The merge step: ``merged.pt`` proved exact, or (streamed) the proof alone."""
    if cfg.streamed:
        from serve.model.stream_build import stream_merge

        return stream_merge(cfg.checkpoint_dir, cfg.profile)
    from serve.model.merge import merge_checkpoint

    m = merge_checkpoint(cfg.checkpoint_dir, cfg.profile, cfg.merged)
    return {"merged_max_abs_diff": m.merged_max_abs_diff, "world_size": m.world_size,
            "num_parameters": m.num_parameters}


def _quantize_outputs(cfg: PipelineConfig) -> list[Path]:
    """What the quantize step leaves for the archive step."""
    return [cfg.stream_artifact, cfg.stream_tables] if cfg.streamed else [cfg.artifact]


def _quantize(cfg: PipelineConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """The quantize step: the artifact (and, in memory, its fp32 twin), or (streamed) the
    version's tables folder and a format-3 artifact over it; AUCs and checks either way."""
    if cfg.label_shuffle and cfg.check_quality:
        say("[quantize] label shuffle: the int8 AUC bar is not applied (AUC ~0.5 by design)")
    if cfg.streamed:
        from serve.model.stream_build import stream_quantize

        q = stream_quantize(cfg.checkpoint_dir, cfg.profile, cfg.data_dir, cfg.dtype,
                            cfg.stream_artifact, cfg.stream_tables,
                            max_memory_bytes=cfg.memory_budget, check=cfg.quality_check,
                            say=say)
    else:
        from serve.model.quantize import quantize

        q = quantize(cfg.merged, cfg.profile, cfg.data_dir, cfg.dtype, cfg.artifact,
                     check=cfg.quality_check, id_maps=_trained_id_maps(cfg))
    say(f"[quantize] AUC fp32 {q.auc_fp32:.4f}  {cfg.dtype} {q.auc_quantized:.4f}  "
        f"tables {q.table_bytes_fp32:,} B -> {q.table_bytes_quantized:,} B")
    return dataclasses.asdict(q)


def _gate_dense_precision(cfg: PipelineConfig, report: dict[str, Any],
                          say: Callable[[str], None]) -> dict[str, Any]:
    """The archive's handler config: ``cfg.handler_config``, plus ``dense_precision`` for a
    lossy dense precision once its AUC gate passed (the gate's figures go to ``report``)."""
    handler_config = dict(cfg.handler_config)
    if cfg.dense_precision != "fp32":
        from serve.model.precision import dense_precision_gate

        gate = dense_precision_gate(cfg.artifact, cfg.data_dir, cfg.dense_precision,
                                    check=cfg.quality_check, say=say)
        report["dense_precision"] = gate.to_dict()
        handler_config["dense_precision"] = cfg.dense_precision
    return handler_config


def _add_mapping_args(ap: argparse.ArgumentParser) -> None:
    """--mapping and the managed id space's policy settings."""
    ap.add_argument("--mapping", default="modulo", choices=MAPPING_CHOICES,
                    help="id space of every table: modulo (default; row = id %% rows, so ids "
                         "beyond a table or new after the build share rows with unrelated ids) "
                         "or managed (ids seen --admit-threshold times get rows of their own, "
                         "the rest a fallback row; later days admit and evict, and deltas "
                         "carry the id changes). Version and workdir get a -managed suffix")
    ap.add_argument("--admit-threshold", type=int, default=2, metavar="N",
                    help="managed: sightings in the training data before an id gets a row "
                         "(default 2; 1 admits every id seen, higher keeps one-off ids out)")
    ap.add_argument("--eviction", default="lfu_lru", choices=("lru", "lfu", "ttl", "lfu_lru"),
                    help="managed: who leaves a full table (default lfu_lru: ids seen within "
                         "--recency-days are protected, the least frequent of the rest go)")
    ap.add_argument("--ttl-days", type=int, default=2,
                    help="managed, --eviction ttl: days unseen before an id is evicted (default 2)")
    ap.add_argument("--recency-days", type=int, default=1,
                    help="managed, --eviction lfu_lru: ids seen within this many days are "
                         "never evicted (default 1: seen on the latest day)")
    ap.add_argument("--fallback-share", type=float, default=None,
                    help="managed: share of each table's rows reserved as fallback rows that "
                         "ids without a row of their own share by id %% k (default 0: one "
                         "fallback row; about 0.25 where tables hold fewer rows than there "
                         "are ids, as make delta-compare measured on small-half)")


def _add_stream_args(ap: argparse.ArgumentParser) -> None:
    """--stream / --no-stream and the streamed build's memory budget."""
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                    help="merge and quantize streamed from the checkpoint, a table chunk at "
                         "a time, within --max-memory-bytes (no merged.pt, no fp32 twin; the "
                         "tables go straight to the version's tables folder). Default: only "
                         "when the profile's fp32 tables exceed half of --max-memory-bytes "
                         "(the in-memory path holds them twice: criteo-kaggle's 8.6 GB "
                         "peaked at 17.2 GB); --no-stream forces the in-memory path")
    ap.add_argument("--max-memory-bytes", type=int, default=None,
                    help="memory a streamed build may hold beyond the interpreter and its "
                         "libraries, in bytes (default 2000000000 = 2 GB, the importer's): "
                         "half for a table chunk, a quarter for the AUC gate's host tier")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.pipeline",
        description="Build a model version end to end: generate click logs, train sharded "
                    "(TorchRec DMP over --nproc ranks), merge the checkpoint, quantize the "
                    "tables, pack the .mar, and add it to the model repository as "
                    "model_store/dlrm-<version>.mar + dlrm-<version>.json (read-only: "
                    "versions are immutable). Steps whose inputs did not change are skipped "
                    "(--force redoes them).")
    ap.add_argument("--profile", default=DEFAULT_PROFILE,
                    help=f"profile ({', '.join(PROFILES)}); default {DEFAULT_PROFILE}")
    ap.add_argument("--seed", type=int, default=None,
                    help="training seed (initial weights; default: the profile's). The data keeps "
                         "the profile's seed, so seeds differ only in the trained weights")
    ap.add_argument("--label-shuffle", action="store_true",
                    help="build a deliberately bad candidate: train on the same click logs with "
                         "the training split's labels randomly permuted (a generator seeded by "
                         "the training seed; eval data and labels untouched), so eval AUC is "
                         "~0.5. Default version <profile>-<dtype>-s<seed>-shuffled, workdir "
                         "build/<profile>-s<seed>-shuffled; the report records label_shuffle; "
                         "the int8 AUC quality bar is not applied")
    ap.add_argument("--data-day", type=int, default=0, metavar="N",
                    help="build from scratch on day N of the click logs (default 0; N >= 1 has "
                         "N days of drift, see serve.model.data): default version "
                         "<profile>-<dtype>-s<seed>-day<N>, workdir build/<profile>-s<seed>-day<N>; "
                         "the full-rebuild reference for `make delta`")
    _add_mapping_args(ap)
    ap.add_argument("--version", default=None,
                    help="name of the model version to add (default <profile>-<dtype>-s<seed>, "
                         "e.g. small-int8-s0, plus -shuffled with --label-shuffle); letters, "
                         "digits, '.', '-'. A version is never replaced: a different build "
                         "needs a new name")
    ap.add_argument("--workdir", default=None,
                    help="build directory (default build/<profile>-s<seed>, or "
                         "build/<profile>-s<seed>-shuffled with --label-shuffle: one per seed "
                         "and shuffle, so each keeps its own step cache)")
    ap.add_argument("--model-store", default="model_store",
                    help="the model repository the version is added to (default model_store)")
    ap.add_argument("--if-missing", action="store_true",
                    help="do nothing when the repository already holds this version, whatever "
                         "build made it (what `make run`/`make up` need: they declare it)")
    ap.add_argument("--model-name", default="dlrm", help="TorchServe model name (default dlrm)")
    ap.add_argument("--nproc", type=int, default=2, help="training ranks (default 2)")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                    help="process-group backend (auto: nccl with CUDA, else gloo)")
    ap.add_argument("--dense-precision", default="fp32", choices=DENSE_PRECISIONS,
                    help="the dense part's arithmetic when served: fp32 (default, exact), or bf16 "
                         "(AMX/AVX-512 BF16: ~1.8x the dense MLPs' speed) / int8, admitted only "
                         f"if the held-out AUC stays within {DENSE_MAX_AUC_DROP:g} of fp32's "
                         "(the version gets a -dense-<precision> suffix)")
    ap.add_argument("--dtype", default="int8", choices=("int8", "int4", "fp16"),
                    help="table dtype of the served artifact (default int8)")
    ap.add_argument("--alpha", type=float, default=None, help="Zipf exponent (default: profile)")
    ap.add_argument("--samples", type=int, default=None, help="training rows (default: profile)")
    ap.add_argument("--eval-samples", type=int, default=None, help="held-out rows (default: profile)")
    ap.add_argument("--batch-size", type=int, default=None, help="global training batch")
    ap.add_argument("--lr", type=float, default=None, help="embedding learning rate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training rank")
    ap.add_argument("--mar-batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                    help="TorchServe batch_size written into the .mar (requests per batch)")
    ap.add_argument("--mar-max-batch-delay-ms", type=int, default=DEFAULT_MAX_BATCH_DELAY_MS,
                    help="TorchServe max_batch_delay written into the .mar (0: merge only "
                         "requests already queued)")
    ap.add_argument("--mar-workers", type=int, default=DEFAULT_WORKERS,
                    help="TorchServe workers in the .mar (default 2: one per core on a 2-core pod, "
                         "each with cores/workers torch threads; use 1 per GPU on GPU pods)")
    ap.add_argument("--force", action="store_true",
                    help="redo every step (a forced rebuild is a new version: give --version)")
    ap.add_argument("--no-quality-check", action="store_true",
                    help="do not fail when int8 AUC < fp32 AUC - 0.001 (still reported)")
    _add_stream_args(ap)
    return ap


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The build the command line asks for (``--workdir`` defaults per seed and shuffle).

    Raises:
        ConfigError: a bad setting; UnknownProfileError: no such profile.
    """
    profile = get_profile(args.profile)
    seed = profile.seed if args.seed is None else args.seed
    workdir = args.workdir or default_workdir(profile.name, seed, args.label_shuffle,
                                              args.data_day, args.mapping)
    return PipelineConfig(
        profile=profile, workdir=Path(workdir),
        model_store=Path(args.model_store), model_name=args.model_name, seed=args.seed,
        version=args.version, nproc=args.nproc,
        backend=args.backend, dtype=args.dtype, alpha=args.alpha, samples=args.samples,
        eval_samples=args.eval_samples, batch_size=args.batch_size,
        learning_rate=args.lr, threads=args.threads, mar_batch_size=args.mar_batch_size,
        mar_max_batch_delay_ms=args.mar_max_batch_delay_ms, mar_workers=args.mar_workers,
        force=args.force, check_quality=not args.no_quality_check,
        label_shuffle=args.label_shuffle, data_day=args.data_day, mapping=args.mapping,
        admit_threshold=args.admit_threshold, eviction=args.eviction, ttl_days=args.ttl_days,
        recency_days=args.recency_days, dense_precision=args.dense_precision,
        stream=args.stream, max_memory_bytes=args.max_memory_bytes,
        fallback_share=(DEFAULT_FALLBACK_SHARE if args.fallback_share is None
                        else args.fallback_share))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_cli_logging()
    t0 = time.perf_counter()
    try:
        get_profile(args.profile)  # an unknown profile fails first, even with --if-missing
        store = Path(args.model_store)
        cfg = config_from_args(args)
        if args.if_missing and ModelRepository([store], args.model_name).exists(cfg.version_name):
            print(f"{store} holds version {cfg.version_name}; not building (--if-missing)")
            return 0
        res = run_pipeline(cfg, say=lambda s: print(s, flush=True))
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(_summary(res, time.perf_counter() - t0))
    print(f"  versions in {cfg.model_store}: {', '.join(cfg.repository.versions())}")
    return 0


def id_mapping_line(idm: dict[str, Any]) -> str:
    """The build summary's id-mapping line: policy and admitted ids / capacity, all tables."""
    tables = idm["tables"].values()
    admitted = sum(int(t["admitted"]) for t in tables)
    capacity = sum(int(t["capacity"]) for t in tables)
    return (f"  id mapping {idm['mapping']} ({idm['policy']}, threshold {idm['threshold']}): "
            f"{admitted:,} admitted ids / {capacity:,} capacity "
            f"({admitted / max(capacity, 1):.1%}) over {len(idm['tables'])} tables")


def _summary(res: PipelineResult, seconds: float) -> str:
    rep = res.report
    ran = ", ".join(res.ran) or "nothing"
    skipped = f"; skipped {', '.join(res.skipped)}" if res.skipped else ""
    shuffled = ", labels shuffled" if rep.get("label_shuffle") else ""
    head = (f"version {res.version}: {res.archive} (profile {rep.get('profile')}, seed "
            f"{rep.get('seed')}{shuffled}, {rep.get('world_size')} ranks) in {seconds:.1f}s; "
            f"ran {ran}{skipped}")
    lines = ["", head]
    try:  # a version stored by an older pipeline may lack some keys: show what there is
        dtype = rep["quantized_dtype"]
        tables = (f"  tables {rep['table_bytes_fp32']:,} B fp32 -> "
                  f"{rep['table_bytes_quantized']:,} B {dtype}; "
                  f"{rep['num_parameters']:,} parameters")
        lines += [f"  merged_max_abs_diff {rep['merged_max_abs_diff']:.3g}",
                  f"  AUC fp32 {rep['auc_fp32']:.4f}  {dtype} {rep['auc_quantized']:.4f}",
                  tables]
        if rep.get("peak_rss_bytes") is not None:
            how = "streamed" if rep.get("streamed") else "in memory"
            lines.append(f"  peak RSS of merge/quantize {rep['peak_rss_bytes']:,} B ({how})")
    except (KeyError, TypeError, ValueError):
        pass
    idm = rep.get("id_mapping")
    if isinstance(idm, dict) and isinstance(idm.get("tables"), dict):
        lines.append(id_mapping_line(idm))
    lines.append(f"  report {res.archive.with_suffix('.json')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
