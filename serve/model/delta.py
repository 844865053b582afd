"""Build an embedding delta: continue a version's training on one more day of click logs.

A delta (:mod:`serve.store.deltas.format`) carries the embedding rows that embedding-only continued
training changed, quantized exactly as a full build would store them, for ONE base
version. Deltas of a version form a chain, one folder per sequence number::

    <build_dir>/deltas/<version>/<seq:08d>/
        checkpoint/                      resumed sparse-only training (+ changed_rows.npz)
        merged.pt                        the merged fp32 model
        artifact.pt                      full quantized artifact of the updated model
        dlrm-<version>-<seq:08d>.delta   the delta file (what the pods get)
        done.json                        written last: the sequence is finished

Sequence n continues from sequence n-1's checkpoint and artifact (n = 1: the version's
own build, ``<build_dir>/checkpoint`` and ``<build_dir>/artifact.pt``), and its file names
what it builds on, ``parent_digest``: the sha256 of sequence n-1's delta file, or for
n = 1 the version's identity (:func:`serve.store.deltas.format.version_digest` of its build
report), so a pod holding other deltas refuses it (409) instead of mixing two chains.
done.json records both ``parent_digest`` and the file's own ``digest``. The steps:

1. day D's click logs (:func:`serve.model.data.ensure_day_data`, the profile's seed);
2. training resumed from the previous checkpoint with ``sparse_only`` (the MLPs stay
   bit-identical), sharded over the checkpoint's world size;
3. merge, then quantize with the full build's code path (:func:`serve.model.quantize.quantize`);
4. the delta = the rows whose stored bytes differ from the previous artifact's, table by
   table. Checked: the dense layers are equal, and every changed row is one the training
   touched (``changed_rows.npz``); otherwise ``ServeError``.

Both AUCs in done.json (previous artifact, new artifact) are measured the same way: the
serving runtime (:class:`serve.runtime.engine.Runtime`) on day D's eval split (raw ids:
the runtime maps them itself, by modulo or by the artifact's id maps).

A **managed** version (its report has ``id_mapping``; :mod:`serve.model.admission`) also
moves its id space: the training continues the previous step's admission state
(``admission.npz`` of delta n-1, or the build's checkpoint) on day D's ids (admit, evict,
with the version's policy) and trains on rows mapped by the NEW maps; the state is saved
as ``admission.npz`` in the sequence folder (delta n+1 continues from it), and the delta
carries, per table, ``assign_ids``/``assign_rows``/``evict_ids`` =
:meth:`serve.runtime.idmap.IdMap.diff` of the previous and the new map, plus the changed
rows, where the rows of newly assigned ids are always shipped (even when their bytes
happen to be equal: the row now means another id). The "changed rows were trained" check
allows rows of assigned ids. done.json records ``id_changes``: per table name the ids
admitted and evicted, and ``id_mapping``: the policy and per table the occupancy after the
day (plus that day's admitted/evicted).

**Signing** (``--sign-key FILE``, an ed25519 private key of mode 0600 from ``python -m
serve.ops.keys generate``): the delta's header carries a signature over its checksum and
chain fields (:mod:`serve.store.deltas.signature`), which pods started with
``--delta-verify-key`` require. The key is loaded and checked before any training runs.

Example::

    python -m serve.model.delta --day 1 --version small-int8-s0 --sign-key keys/delta-signing.key
    make delta DAY=1                 # base: the declared serving version (.run/state.yaml)

The last line of stdout is the delta file's path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from serve.common.clilog import setup_cli_logging
from serve.common.signing import SigningKey, load_signing_key
from serve.common.validate import positive_int
from serve.errors import ConfigError, ServeError
from serve.profiles import Profile, get_profile

if TYPE_CHECKING:  # imported where used: loading the build steps is slow
    from serve.store.deltas.format import Delta

__all__ = [
    "DONE_FILE",
    "DeltaBuild",
    "DeltaConfig",
    "artifact_auc",
    "build_delta",
    "delta_file_name",
    "diff_artifacts",
    "id_changes",
    "main",
    "next_sequence",
    "parent_digest",
]

DONE_FILE = "done.json"
_SEQ_RE = re.compile(r"^\d{8}$")


def delta_file_name(version: str, sequence: int, model_name: str = "dlrm") -> str:
    """``dlrm-<version>-<seq:08d>.delta``."""
    return f"{model_name}-{version}-{sequence:08d}.delta"


@dataclass(frozen=True)
class DeltaConfig:
    """One delta build. ``None`` fields are resolved from the repository and state file.

    Attributes:
        day: day of the click logs to train on (>= 1; day 0 is what the base saw).
        version: base version (None: the declared serving version in ``state_file``).
        build_dir: the base version's build directory (None: its report's ``build_dir``).
        work_root: where the sequence folders go (None: ``<build_dir>/deltas/<version>``).
        data_dir: day D's data directory (None: ``build/<profile>-data/day<D>``).
        nproc: training ranks (None: the checkpoint's world size; another value fails).
        max_steps: stop training after this many steps (None: one pass over the day).
        eval_limit: evaluate AUCs on at most this many eval rows (None: all).
        sign_key: the ed25519 private key file (mode 0600) the delta is signed with
            (None: unsigned; pods with ``--delta-verify-key`` refuse it).
    """

    day: int
    version: str | None = None
    model_store: Path = Path("model_store")
    model_name: str = "dlrm"
    state_file: Path = Path(".run/state.yaml")
    build_dir: Path | None = None
    work_root: Path | None = None
    data_dir: Path | None = None
    nproc: int | None = None
    threads: int = 1
    backend: str = "auto"
    max_steps: int | None = None
    eval_limit: int | None = None
    sign_key: Path | None = None

    def __post_init__(self) -> None:
        positive_int("--day", self.day,
                     then=": a delta trains on a later day than the base model (day 0)")
        if self.nproc is not None and self.nproc < 1:
            raise ConfigError(f"--nproc {self.nproc} must be >= 1 (or omit it: the "
                              "checkpoint's world size)")
        if self.threads < 1:
            raise ConfigError(f"--threads {self.threads} must be >= 1")
        for name in ("max_steps", "eval_limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {v} must be >= 1")


@dataclass
class DeltaBuild:
    """What :func:`build_delta` produced: the delta file, its folder and done.json."""

    path: Path
    folder: Path
    done: dict[str, Any]


# ----------------------------------------------------------------------------- pieces

def _resolve_version(cfg: DeltaConfig) -> str:
    if cfg.version is not None:
        return cfg.version
    from serve.state import load_state

    if not Path(cfg.state_file).is_file():
        raise ConfigError(f"no --version given and the desired-state file {cfg.state_file} "
                          "does not exist, so there is no declared serving version to build "
                          "on; pass --version V (make delta VERSION=V) or run `make up`")
    return load_state(cfg.state_file).model.version


def next_sequence(work_root: Path) -> int:
    """1 + the highest sequence folder of ``work_root`` holding a finished delta (done.json)."""
    done = [int(d.name) for d in work_root.glob("*")
            if d.is_dir() and _SEQ_RE.fullmatch(d.name) and (d / DONE_FILE).is_file()]
    return max(done, default=0) + 1


def _iter_runtime_batches(data_dir: Path, limit: int | None,
                          batch_size: int = 4096) -> Any:
    """(dense (B, N) f32, SparseBatch feature-major, labels (B,) uint8) over the eval split."""
    from serve.model.data import ClickLogDataset
    from serve.runtime.engine import SparseBatch

    ds = ClickLogDataset(data_dir, "eval", batch_size, limit=limit)
    for i in range(len(ds)):
        dense, ids, lengths, labels = ds[i]
        m = ids.shape[2]
        if m == 1:
            values = ids[:, :, 0].t().reshape(-1)
        else:
            mask = torch.arange(m)[None, :] < lengths[:, :, None]  # (B, F, M)
            values = torch.cat([ids[:, j, :][mask[:, j, :]] for j in range(ids.shape[1])])
        yield dense, SparseBatch(values=values.contiguous(),
                                 lengths=lengths.t().contiguous().to(torch.int32)), labels


def artifact_auc(artifact: str | os.PathLike, data_dir: str | os.PathLike,
                 limit: int | None = None) -> tuple[float, int]:
    """AUC of an artifact served by the runtime (CPU) on a data directory's eval split;
    returns (auc, rows)."""
    from serve.common.quality import roc_auc
    from serve.runtime.engine import Runtime, RuntimeConfig

    rt = Runtime.from_artifact(artifact, RuntimeConfig(device="cpu"))
    try:
        scores, labels = [], []
        for dense, sparse, y in _iter_runtime_batches(Path(data_dir), limit):
            scores.append(rt.predict(dense, sparse).numpy())
            labels.append(y.numpy())
    finally:
        rt.close()
    y_all = np.concatenate(labels).astype(np.uint8)
    return roc_auc(y_all, np.concatenate(scores)), int(y_all.shape[0])


def diff_artifacts(old: Any, new: Any) -> list[tuple[int, str, np.ndarray, np.ndarray]]:
    """Changed rows of ``new`` vs ``old`` (both :class:`serve.runtime.artifact.Artifact`).

    Returns [(table index, feature, ids int64 (n,) sorted, rows uint8 (n, row_bytes))] for
    tables with n > 0 changed rows (a row changed when any of its stored bytes differ).

    Raises:
        ServeError: the artifacts do not have the same tables and row format, or their
            dense layers differ (dense weights ship only as a new version).
    """
    if (old.feature_names != new.feature_names or old.dtype != new.dtype
            or old.embedding_dim != new.embedding_dim or len(old.tables) != len(new.tables)):
        raise ServeError(f"the new artifact ({new.dtype}, dim {new.embedding_dim}, "
                         f"{len(new.tables)} tables) does not match the previous one "
                         f"({old.dtype}, dim {old.embedding_dim}, {len(old.tables)} tables); "
                         "a delta needs the same model layout: build a new version instead")
    for name in ("dense_arch", "over_arch"):
        for i, ((wo, bo), (wn, bn)) in enumerate(zip(getattr(old.dense, name),
                                                     getattr(new.dense, name), strict=True)):
            if not (torch.equal(wo, wn) and torch.equal(bo, bn)):
                raise ServeError(f"{name} layer {i} changed in continued training; deltas carry "
                                 "embedding rows only: train with sparse_only (--sparse-only) "
                                 "or ship a new version")
    out = []
    for ti, (to, tn) in enumerate(zip(old.tables, new.tables, strict=True)):
        if to.data.shape != tn.data.shape:
            raise ServeError(f"table {tn.name} is {tuple(tn.data.shape)} in the new artifact, "
                             f"{tuple(to.data.shape)} in the previous one; build a new version")
        changed = (to.data != tn.data).any(dim=1)
        ids = torch.nonzero(changed).flatten().to(torch.int64)
        if ids.numel():
            out.append((ti, new.table_feature(ti), ids.numpy().copy(),
                        tn.data.index_select(0, ids).numpy().copy()))
    return out


# ----------------------------------------------------------------------------- the build

@dataclass(frozen=True)
class _DeltaPlan:
    """Where delta ``seq`` of ``version`` builds from and into (:func:`_plan_delta`)."""

    version: str
    report: dict[str, Any]          # the version's build report
    profile: Profile
    dtype: str                      # the version's row format
    seq: int
    prev: Path                      # the previous step: the build dir or delta seq - 1
    nproc: int                      # training ranks (the checkpoint's world size by default)
    folder: Path                    # this delta's work folder
    parent_digest: str              # what the delta builds on (:func:`parent_digest`)

    @property
    def prev_ckpt(self) -> Path:
        return self.prev / "checkpoint"

    @property
    def admission(self) -> Any:
        """The version's :class:`serve.model.admission.AdmissionConfig` (None: modulo)."""
        from serve.model.admission import AdmissionConfig

        idm = self.report.get("id_mapping")
        if not isinstance(idm, dict) or idm.get("mapping") != "managed":
            return None
        return AdmissionConfig(policy=str(idm["policy"]), threshold=int(idm["threshold"]),
                               ttl_days=int(idm["ttl_days"]),
                               recency_days=int(idm["recency_days"]),
                               fallback_share=float(idm.get("fallback_share", 0.0)))

    @property
    def prev_admission(self) -> Path:
        """The admission state this delta continues: delta n-1's ``admission.npz``, or the
        build's (next to its checkpoint)."""
        from serve.model.admission import ADMISSION_FILE

        own = self.prev / ADMISSION_FILE
        return own if own.is_file() else self.prev_ckpt / ADMISSION_FILE

    @property
    def prev_art(self) -> Path:
        return self.prev / "artifact.pt"


def build_delta(cfg: DeltaConfig, say: Callable[[str], None] = print) -> DeltaBuild:
    """Build the next delta of the base version (module docstring); return it.

    Steps: plan (which version, sequence and base; a fresh work folder), update the model
    (train embeddings only on the day, merge, quantize), diff the artifacts into the delta
    file, evaluate both artifacts and write ``done.json``.

    Raises:
        ConfigError: no version to build on, its build dir or checkpoint is gone, bad
            settings (e.g. ``nproc`` other than the checkpoint's world size).
        ServeError: the update changed dense layers or rows the training did not touch.
    """
    from serve.model.data import ensure_day_data
    from serve.store.deltas.format import file_sha256

    t_all = time.perf_counter()
    seconds: dict[str, float] = {}
    # checked first: a bad key must not cost a training run
    key = None if cfg.sign_key is None else load_signing_key(cfg.sign_key)
    plan = _plan_delta(cfg, say)

    t = time.perf_counter()
    data = ensure_day_data(plan.profile, cfg.day, cfg.data_dir, say=say)
    seconds["data"] = round(time.perf_counter() - t, 3)

    tres, auc_quantized = _update_model(cfg, plan, data, seconds, say)
    delta, path, nbytes, tables, id_changes = _write_delta(cfg, plan, seconds, say, key)
    digest = file_sha256(path)  # what delta seq + 1 names as its parent

    t = time.perf_counter()
    auc_before, rows = artifact_auc(plan.prev_art, data, cfg.eval_limit)
    auc_after, _ = artifact_auc(plan.folder / "artifact.pt", data, cfg.eval_limit)
    seconds["eval"] = round(time.perf_counter() - t, 3)
    seconds["total"] = round(time.perf_counter() - t_all, 3)
    done = {
        "version": plan.version, "sequence": plan.seq, "day": cfg.day,
        "profile": plan.profile.name, "dtype": plan.dtype, "rows": delta.rows,
        "bytes": nbytes, "file": path.name, "base": os.fspath(plan.prev), "tables": tables,
        "rows_touched": int(tres["changed_rows"]),
        "auc_before": auc_before, "auc_after": auc_after, "eval_rows": rows,
        "auc_after_quantize_step": auc_quantized, "train_steps": tres["steps"],
        "train_rows": tres["rows"], "world_size": plan.nproc, "seconds": seconds,
        "created_at": delta.created_at, "parent_digest": plan.parent_digest,
        "digest": digest, "signed_by": None if key is None else key.key_id,
    }
    if plan.admission is not None:
        done["id_changes"] = id_changes
        done["id_mapping"] = tres.get("id_mapping")
    tmp = plan.folder / (DONE_FILE + ".tmp")
    tmp.write_text(json.dumps(done, indent=2))
    os.replace(tmp, plan.folder / DONE_FILE)
    return DeltaBuild(path, plan.folder, done)


def _plan_delta(cfg: DeltaConfig, say: Callable[[str], None]) -> _DeltaPlan:
    """Resolve the version, the next sequence and its base (checked to exist); make the
    delta's work folder afresh.

    Raises:
        ConfigError: no version to build on, or the base's checkpoint or artifact is gone.
    """
    from serve.model.train import PLAN_FILE
    from serve.store.repository import ModelRepository

    version = _resolve_version(cfg)
    report = ModelRepository([cfg.model_store], cfg.model_name).report(version)
    profile: Profile = get_profile(str(report["profile"]))
    dtype = str(report["quantized_dtype"])
    build_dir = Path(cfg.build_dir) if cfg.build_dir is not None else Path(report["build_dir"])
    work_root = (Path(cfg.work_root) if cfg.work_root is not None
                 else build_dir / "deltas" / version)
    seq = next_sequence(work_root) if work_root.is_dir() else 1
    prev = build_dir if seq == 1 else work_root / f"{seq - 1:08d}"
    prev_ckpt, prev_art = prev / "checkpoint", prev / "artifact.pt"
    need = [("checkpoint", prev_ckpt / ".metadata"), ("artifact", prev_art)]
    if isinstance(report.get("id_mapping"), dict):
        from serve.model.admission import ADMISSION_FILE

        need.append(("admission state", prev / ADMISSION_FILE if seq > 1
                     else prev_ckpt / ADMISSION_FILE))
    for what, p in need:
        if not p.is_file():
            raise ConfigError(
                f"the base of delta {seq} of version {version} is gone: {what} {p} does not "
                f"exist (build dir {build_dir}); rebuild the version with `make model` "
                "(same SEED/VERSION) or pass --build-dir where it lives")
    parent = parent_digest(report, work_root, seq, cfg.model_name)
    plan = json.loads((prev_ckpt / PLAN_FILE).read_text())
    nproc = cfg.nproc if cfg.nproc is not None else int(plan["world_size"])
    folder = work_root / f"{seq:08d}"
    if folder.exists():  # an unfinished attempt (no done.json): start it over
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    say(f"delta: version {version} ({profile.name}, {dtype}), sequence {seq}, day {cfg.day}, "
        f"from {prev}; into {folder}")
    return _DeltaPlan(version, report, profile, dtype, seq, prev, nproc, folder, parent)


def parent_digest(report: dict[str, Any], work_root: Path, seq: int,
                  model_name: str = "dlrm") -> str:
    """What delta ``seq`` of the version whose build report is ``report`` builds on: for
    seq 1 the version's identity (:func:`serve.store.deltas.format.version_digest`), else the
    sha256 of delta ``seq - 1``'s file in ``work_root`` (the one its done.json names).

    Raises:
        ConfigError: delta ``seq - 1``'s file is gone.
    """
    from serve.store.deltas.format import file_sha256, version_digest

    if seq == 1:
        return version_digest(report)
    prev = work_root / f"{seq - 1:08d}"
    done = json.loads((prev / DONE_FILE).read_text())
    path = prev / str(done.get("file") or delta_file_name(str(report["version"]), seq - 1,
                                                            model_name))
    if not path.is_file():
        raise ConfigError(f"delta {seq} builds on delta {seq - 1}, whose file {path} is gone "
                          f"(its done.json is there): delta {seq} must name that file's "
                          f"sha256 as its parent; restore the file, or remove {prev} and "
                          f"build delta {seq - 1} again")
    return file_sha256(path)


def _update_model(cfg: DeltaConfig, plan: _DeltaPlan, data: Path, seconds: dict[str, float],
                  say: Callable[[str], None]) -> tuple[dict[str, Any], float]:
    """Train the embeddings on the day from the base checkpoint, merge, quantize into the
    work folder; return the training summary and the quantized AUC. Adds each step's
    seconds to ``seconds``."""
    from serve.model.merge import merge_checkpoint
    from serve.model.quantize import quantize
    from serve.model.train import TrainConfig, train

    profile, folder = plan.profile, plan.folder
    admission = plan.admission
    t = time.perf_counter()
    say(f"[train] resuming {plan.prev_ckpt} on day {cfg.day}, embeddings only, "
        f"{plan.nproc} ranks ...")
    tres = train(TrainConfig(profile=profile, data_dir=data, out_dir=folder / "checkpoint",
                             nproc=plan.nproc, backend=cfg.backend, threads=cfg.threads,
                             max_steps=cfg.max_steps, seed=plan.report.get("seed"),
                             resume_from=plan.prev_ckpt, sparse_only=True,
                             admission=admission,
                             admission_from=plan.prev_admission if admission else None))
    seconds["train"] = round(time.perf_counter() - t, 3)
    say(f"[train] {tres['steps']} steps, {tres['rows']:,} rows, loss {tres['final_loss']:.4f}, "
        f"{tres['changed_rows']:,} rows touched, {seconds['train']:.1f}s")
    id_maps = None
    if admission is not None:
        from serve.model.admission import ADMISSION_FILE, load_state

        state_file = folder / "checkpoint" / ADMISSION_FILE
        shutil.copyfile(state_file, folder / ADMISSION_FILE)  # what delta n+1 continues
        id_maps = load_state(state_file).id_maps()
        idm = tres["id_mapping"]
        say("[admission] " + ", ".join(
            f"{n} +{t['admitted_today']}/-{t['evicted_today']}"
            for n, t in idm["tables"].items() if t["admitted_today"] or t["evicted_today"])
            + f" ({idm['policy']}, day {idm['day']})")

    t = time.perf_counter()
    m = merge_checkpoint(folder / "checkpoint", profile, folder / "merged.pt")
    seconds["merge"] = round(time.perf_counter() - t, 3)
    say(f"[merge] merged_max_abs_diff {m.merged_max_abs_diff:.3g}, {seconds['merge']:.1f}s")

    t = time.perf_counter()
    q = quantize(folder / "merged.pt", profile, data, plan.dtype, folder / "artifact.pt",
                 eval_limit=cfg.eval_limit, check=False, progress=False, float_artifact=False,
                 id_maps=id_maps)
    seconds["quantize"] = round(time.perf_counter() - t, 3)
    say(f"[quantize] AUC fp32 {q.auc_fp32:.4f} {plan.dtype} {q.auc_quantized:.4f}, "
        f"{seconds['quantize']:.1f}s")
    return tres, q.auc_quantized


def id_changes(old: Any, new: Any) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per table index with a change, ``(assign_ids, assign_rows, evict_ids)`` int64 =
    :meth:`serve.runtime.idmap.IdMap.diff` of ``old``'s and ``new``'s id maps (both
    :class:`serve.runtime.artifact.Artifact`; tables without maps: none).

    Raises:
        ServeError: the two artifacts do not manage the same tables.
    """
    from serve.runtime.idmap import IdMap

    if set(old.id_maps) != set(new.id_maps):
        raise ServeError(f"the new artifact manages tables {sorted(new.id_maps)}, the previous "
                         f"one {sorted(old.id_maps)}; a delta keeps the id spaces: build a new "
                         "version instead")
    out = {}
    for ti, spec in enumerate(new.schema.tables):
        if spec.name not in new.id_maps:
            continue
        a_ids, a_rows, e_ids = IdMap.diff(old.id_maps[spec.name], new.id_maps[spec.name])
        if a_ids.size or e_ids.size:
            out[ti] = (np.asarray(a_ids, np.int64), np.asarray(a_rows, np.int64),
                       np.asarray(e_ids, np.int64))
    return out


def _write_delta(cfg: DeltaConfig, plan: _DeltaPlan, seconds: dict[str, float],
                 say: Callable[[str], None], key: SigningKey | None = None
                 ) -> tuple[Delta, Path, int, dict[str, int], dict[str, dict[str, int]]]:
    """Diff the base and the new artifact, check every changed row was trained (or belongs
    to a newly assigned id), write the delta file (atomically); return the delta, its path,
    its size, rows per table and, per managed table, the ids admitted and evicted. With
    ``key``, the file is signed (module docstring, Signing).

    Raises:
        ServeError: dense layers changed, or rows changed that no training batch touched.
    """
    from serve.model.train import load_changed_rows
    from serve.rowformat import row_bytes
    from serve.runtime.artifact import load_artifact
    from serve.store.deltas.format import Delta, DeltaTable, encode_delta

    t = time.perf_counter()
    old, new = load_artifact(plan.prev_art), load_artifact(plan.folder / "artifact.pt")
    changed = {ti: (f, ids) for ti, f, ids, _rows in diff_artifacts(old, new)}
    moves = id_changes(old, new)
    touched = load_changed_rows(plan.folder / "checkpoint")
    tables = []
    for ti in range(len(new.schema.tables)):
        feature = new.table_feature(ti)
        ids = changed[ti][1] if ti in changed else np.zeros(0, np.int64)
        empty = np.zeros(0, np.int64)
        a_ids, a_rows, e_ids = moves.get(ti, (empty, empty, empty))
        outside = np.setdiff1d(ids, np.union1d(touched.get(feature, empty), a_rows))
        if outside.size:
            raise ServeError(f"table {feature}: {outside.size} changed rows (e.g. row "
                             f"{int(outside[0])}) were not in any training batch "
                             "(changed_rows.npz) nor assigned to a new id; the artifacts are "
                             "not one update apart")
        ids = np.union1d(ids, a_rows).astype(np.int64)  # assigned rows always ship
        if not (ids.size or e_ids.size):
            continue
        rows = new.tables[ti].data.index_select(0, torch.from_numpy(ids)).numpy().copy()
        tables.append(DeltaTable(feature, ti, ids, rows, assign_ids=a_ids,
                                 assign_rows=a_rows, evict_ids=e_ids))
    dim = plan.profile.embedding_dim
    delta = Delta(base_version=plan.version, sequence=plan.seq, created_at=time.time(),
                  dtype=plan.dtype, dim=dim, row_bytes=row_bytes(plan.dtype, dim),
                  tables=tuple(tables), parent_digest=plan.parent_digest)
    blob = encode_delta(delta, key)
    path = plan.folder / delta_file_name(plan.version, plan.seq, cfg.model_name)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    seconds["diff"] = round(time.perf_counter() - t, 3)
    admitted = sum(int(x.assign_ids.shape[0]) for x in tables)
    evicted = sum(int(x.evict_ids.shape[0]) for x in tables)
    moved = f", {admitted:,} ids assigned, {evicted:,} evicted" if moves else ""
    say(f"[diff] {delta.rows:,} rows changed in {len(tables)} tables{moved}, {len(blob):,} B, "
        f"{seconds['diff']:.1f}s")
    changes = {new.schema.tables[x.table].name: {"admitted": int(x.assign_ids.shape[0]),
                                                 "evicted": int(x.evict_ids.shape[0])}
               for x in tables if x.assign_ids.shape[0] or x.evict_ids.shape[0]}
    return (delta, path, len(blob),
            {x.feature: int(x.ids.shape[0]) for x in tables if x.ids.shape[0]}, changes)


# ----------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.delta",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build the next embedding delta of a model version: continue its "
                    "training on day D's click logs (embeddings only, sharded like the "
                    "original), quantize like a full build, and keep the rows whose bytes "
                    "changed. Writes <build_dir>/deltas/<version>/<seq>/dlrm-<version>-<seq>.delta "
                    "and prints its path as the last line.",
        epilog="Sequence n builds on sequence n-1 (n = 1: the version's own build). done.json "
               "in the sequence folder records rows, bytes, per-table rows, the AUC on day D's "
               "eval before and after (serving runtime) and seconds per step.\n"
               "Example: python -m serve.model.delta --day 1 --version small-int8-s0")
    ap.add_argument("--day", type=int, required=True,
                    help="day of the click logs to train on (>= 1), generated if missing "
                         "into build/<profile>-data/day<D>")
    ap.add_argument("--version", default=None,
                    help="base version (default: the declared serving version, model.version "
                         "in --state-file)")
    ap.add_argument("--model-store", default="model_store",
                    help="model repository holding the version's report (default model_store)")
    ap.add_argument("--model-name", default="dlrm", help="model name (default dlrm)")
    ap.add_argument("--state-file", default=".run/state.yaml",
                    help="desired-state file naming the serving version (default .run/state.yaml)")
    ap.add_argument("--build-dir", default=None,
                    help="the version's build directory (default: build_dir of its report)")
    ap.add_argument("--work-root", default=None,
                    help="where sequence folders go (default <build_dir>/deltas/<version>)")
    ap.add_argument("--data-dir", default=None,
                    help="day D's data directory (default build/<profile>-data/day<D>)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="training ranks (default: the checkpoint's world size, which is the "
                         "only one that works)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                    help="process-group backend (auto: nccl with CUDA, else gloo)")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="stop training after N steps (default: one pass over the day)")
    ap.add_argument("--eval-limit", type=int, default=None,
                    help="measure AUCs on at most N eval rows (default: all)")
    ap.add_argument("--sign-key", default=None,
                    help="ed25519 private key file (PEM, mode 0600; python -m serve.ops.keys "
                         "generate) to sign the delta with: pods started with "
                         "--delta-verify-key take only signed deltas (default: unsigned)")
    return ap


def config_from_args(args: argparse.Namespace) -> DeltaConfig:
    def opt(v: str | None) -> Path | None:
        return Path(v) if v else None

    return DeltaConfig(day=args.day, version=args.version, model_store=Path(args.model_store),
                       model_name=args.model_name, state_file=Path(args.state_file),
                       build_dir=opt(args.build_dir), work_root=opt(args.work_root),
                       data_dir=opt(args.data_dir), nproc=args.nproc, threads=args.threads,
                       backend=args.backend, max_steps=args.max_steps,
                       eval_limit=args.eval_limit, sign_key=opt(args.sign_key))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_cli_logging()
    try:
        res = build_delta(config_from_args(args), say=lambda s: print(s, flush=True))
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    d = res.done
    s = d["seconds"]
    print(f"delta {d['version']} #{d['sequence']} (day {d['day']}): {d['rows']:,} rows in "
          f"{len(d['tables'])} tables, {d['bytes']:,} B; AUC on day {d['day']} eval "
          f"{d['auc_before']:.4f} -> {d['auc_after']:.4f} ({d['auc_after'] - d['auc_before']:+.4f}, "
          f"{d['eval_rows']:,} rows)")
    print("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in s.items()))
    print(f"  done {res.folder / DONE_FILE}")
    print(os.fspath(res.path), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
