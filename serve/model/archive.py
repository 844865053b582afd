"""Pack a serving artifact + the TorchServe handler into a ``.mar`` model archive.

The archive holds: ``handlers/dlrm_handler.py`` (the entry point), the artifact
(``artifact.pt``, the manifest's serialized file: in the repository a format-3 artifact,
whose tables are a reference to the version's tables folder beside the archive, so the
archive is a few MB whatever the model's size) and ``model-config.yaml`` carrying
TorchServe's batching/worker settings plus a ``handler:`` section that the handler
reads into a :class:`serve.api.config.HandlerConfig` (cache and validation limits).

It is stored uncompressed (``--archive-format zip-store``): int8 tables barely
compress, and deflating hundreds of MB costs build time and then TorchServe's unpack
time at every start.

Example::

    build_mar(Path("build/small-s0/artifact.pt"), Path("build/small-s0"),
              version="small-int8-s0", file_name="dlrm-small-int8-s0.mar",
              batch_size=8, max_batch_delay_ms=5,
              handler_config={"cache_load_factor": 0.2})   # -> build/small-s0/dlrm-small-int8-s0.mar

The pipeline builds the archive in its work directory and then stores it as an immutable
version with ``serve.store.repository.ModelRepository.add``; nothing here writes the repository.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from serve.common.validate import int_at_least
from serve.constants import ARTIFACT_NAME
from serve.errors import ArtifactError, ConfigError
from serve.store.repository import TABLES_REF_NAME

__all__ = ["ARTIFACT_NAME", "HANDLER_FILE", "MODEL_CONFIG_NAME", "add_version", "build_mar",
           "model_config"]

log = logging.getLogger(__name__)

HANDLER_FILE = Path(__file__).resolve().parents[2] / "handlers" / "dlrm_handler.py"
MODEL_CONFIG_NAME = "model-config.yaml"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$")  # TorchServe's own model-name rule


def model_config(*, batch_size: int = 8, max_batch_delay_ms: int = 5,
                 handler_config: dict[str, Any] | None = None, min_workers: int = 1,
                 max_workers: int = 1, response_timeout_s: int = 120) -> dict[str, Any]:
    """The ``model-config.yaml`` content (TorchServe keys + our ``handler:`` section).

    Validates every value (``ConfigError`` names the field and the rule); the handler
    section is validated by :class:`serve.api.config.HandlerConfig`, the same class the
    handler loads it with, so a bad value fails here at build time, not in a worker.
    """
    from serve.api.config import HandlerConfig  # light: no torch, no TorchServe

    for name, value, lo in (("batch_size", batch_size, 1), ("max_batch_delay_ms", max_batch_delay_ms, 0),
                            ("min_workers", min_workers, 0), ("max_workers", max_workers, 1),
                            ("response_timeout_s", response_timeout_s, 1)):
        int_at_least(f"build_mar: {name}", value, lo)
    if min_workers > max_workers:
        raise ConfigError(f"build_mar: min_workers={min_workers} > max_workers={max_workers}; "
                          "make min_workers <= max_workers")
    handler = HandlerConfig.from_dict(handler_config or {})
    return {
        "minWorkers": min_workers,
        "maxWorkers": max_workers,
        "batchSize": batch_size,
        "maxBatchDelay": max_batch_delay_ms,  # TorchServe's unit: milliseconds
        "responseTimeout": response_timeout_s,  # seconds a worker may take per batch
        "handler": handler.to_dict(),
    }


def build_mar(artifact: Path, export_dir: Path, *, model_name: str = "dlrm", version: str = "1.0",
              batch_size: int = 8, max_batch_delay_ms: int = 5,
              handler_config: dict | None = None, min_workers: int = 1, max_workers: int = 1,
              response_timeout_s: int = 120, file_name: str | None = None,
              tables_ref: dict[str, Any] | None = None) -> Path:
    """Write ``export_dir/{file_name}`` (overwriting, atomically) and return its path.

    Args:
        artifact: a file written by ``serve.runtime.artifact.save_artifact``.
        export_dir: created if missing (e.g. the pipeline's work directory).
        model_name / version: TorchServe's model name and the archive's version
            (``torch-model-archiver --version``; the pipeline passes the model version).
        file_name: the archive's file name (default ``{model_name}.mar``).
        batch_size / max_batch_delay_ms: TorchServe batching (requests per batch, ms to wait).
        handler_config: keys of :class:`serve.api.config.HandlerConfig` (cache_load_factor,
            cache_policy, max_instances, max_ids_per_feature, ...).
        min_workers / max_workers / response_timeout_s: TorchServe worker settings.
        tables_ref: a format-3 artifact's tables reference (``{"ref", "identity",
            "bytes"}``), packed as ``tables.json`` (:data:`TABLES_REF_NAME`) so the
            repository follows it without torch.

    Raises:
        ArtifactError: the artifact is missing or torch-model-archiver failed.
        ConfigError: a setting is out of range.
    """
    artifact, export_dir = Path(artifact), Path(export_dir)
    if not artifact.is_file():
        raise ArtifactError(f"artifact {artifact} does not exist; build it with `make model`")
    if not _NAME_RE.fullmatch(model_name):
        raise ConfigError(f"build_mar: model_name {model_name!r} must match {_NAME_RE.pattern}")
    file_name = file_name or f"{model_name}.mar"
    if "/" in file_name or not file_name.endswith(".mar"):
        raise ConfigError(f"build_mar: file_name {file_name!r} must be a plain name ending in .mar")
    cfg = model_config(batch_size=batch_size, max_batch_delay_ms=max_batch_delay_ms,
                       handler_config=handler_config, min_workers=min_workers,
                       max_workers=max_workers, response_timeout_s=response_timeout_s)
    export_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mar-", dir=export_dir) as tmp:
        staged = Path(tmp) / ARTIFACT_NAME
        # The archiver copies the serialized file by its own name; a hard link (or a copy
        # across file systems) gives it the name the handler expects without a second copy.
        try:
            os.link(artifact, staged)
        except OSError:
            shutil.copyfile(artifact, staged)
        cfg_path = Path(tmp) / MODEL_CONFIG_NAME
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        out_tmp = Path(tmp) / "out"
        out_tmp.mkdir()
        cmd = [_archiver(), "--model-name", model_name, "--version", version,
               "--handler", str(HANDLER_FILE), "--serialized-file", str(staged),
               "--config-file", str(cfg_path), "--export-path", str(out_tmp),
               "--archive-format", "zip-store", "--force"]
        if tables_ref is not None:
            ref_path = Path(tmp) / TABLES_REF_NAME
            ref_path.write_text(json.dumps(tables_ref))
            cmd += ["--extra-files", str(ref_path)]
        log.info("packing %s (%.1f MB) into %s/%s", artifact,
                 artifact.stat().st_size / 1e6, export_dir, file_name)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ArtifactError(f"torch-model-archiver failed ({proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        built = out_tmp / f"{model_name}.mar"
        final = export_dir / file_name
        os.replace(built, final)  # atomic: a running TorchServe never sees half a file
    return final


def add_version(repo: Any, artifact: Path, version: str, report: dict[str, Any],
                workdir: Path, *, batch_size: int, max_batch_delay_ms: int, workers: int,
                handler_config: dict | None = None, tables: Path | None = None) -> Path:
    """The one way into the model repository (``make model`` and the importer): the
    version's tables folder, then ``<model>-<version>.mar`` packed in ``workdir`` with a
    format-3 artifact that references the folder, then its report, added to ``repo`` (a
    :class:`serve.store.repository.ModelRepository`). The working copies are removed.

    Args:
        artifact: a format-3 artifact whose tables are ``tables`` (the importer streams
            them there), or, with ``tables`` None, an artifact that holds its tables
            (format 1 or 2: a training build), whose tables are written here first, into
            ``workdir/<model>-<version>.tables``.
        workdir: on the repository's file system (the tables folder is moved, not copied).

    Raises:
        ConfigError: the version exists (versions are immutable) or a setting is off.
        ArtifactError: the archiver failed.
    """
    from serve.runtime.artifact import load_artifact, save_artifact, write_tables
    from serve.store.tablefiles import TableFiles

    if repo.exists(version):
        raise ConfigError(f"version {version!r} already exists in {repo.roots[0]} and "
                          "versions are immutable; pick another name (VERSION=...)")
    staged_tables = tables is None
    if tables is None:
        tables = workdir / repo.tables_name(version)
        shutil.rmtree(tables, ignore_errors=True)   # a failed earlier build's
        art = write_tables(load_artifact(artifact), tables)
        artifact = workdir / f".{version}-{ARTIFACT_NAME}"
        save_artifact(art, artifact)
        if art.files is not None:
            art.files.close()
    files = TableFiles.open(tables)
    ref = {"ref": tables.name, "identity": files.manifest.identity(), "bytes": files.nbytes}
    files.close()
    try:
        mar = build_mar(artifact, workdir, model_name=repo.model_name, version=version,
                        file_name=repo.archive_name(version), batch_size=batch_size,
                        max_batch_delay_ms=max_batch_delay_ms, min_workers=workers,
                        max_workers=workers, handler_config=handler_config or None,
                        tables_ref=ref)
        try:
            return Path(repo.add(version, mar, report, tables=tables))
        finally:
            mar.unlink(missing_ok=True)
    finally:
        if staged_tables:
            artifact.unlink(missing_ok=True)
            shutil.rmtree(tables, ignore_errors=True)   # moved in, unless the add failed


def _archiver() -> str:
    # Prefer the archiver installed beside this interpreter (the venv), then PATH.
    here = Path(sys.executable).parent / "torch-model-archiver"
    if here.exists():
        return str(here)
    found = shutil.which("torch-model-archiver")
    if found is None:
        raise ArtifactError("torch-model-archiver is not installed; run `make venv`")
    return found
