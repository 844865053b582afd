"""Model archives the sidecar derives for serving: named by serving version, rewritten.

TorchServe fixes ``batch_size``/``max_batch_delay`` at registration and the
``model-config.yaml`` inside a ``.mar`` wins over the registration parameters, so each
(model version, batching, workers) is served from its own archive: a copy of the model
version's repository archive with ``modelVersion`` set to the serving version
(:func:`serve.state.serving_version`, ``<version>_b<batch>d<delay>w<workers>``) and the
settings written into its model config. It lives in TorchServe's model store as
``<model>-<serving version>.mar`` (TorchServe registers local archives only from there)
and is deleted when its version is unregistered; repository archives are never touched.

A repository archive holds no table bytes (artifact format 3): its artifact references the
version's tables folder, ``<model>-<version>.tables`` beside it in the repository, which
the workers map in place, found through ``DLRM_REPOSITORY``. So a derived archive is as
small as its source (the handler, the config and the dense part: a few MB however large
the tables), and nothing here reads, copies or moves a tables folder.

A serving version that holds a rollout's candidate (``..._c<candidate>``) gets the
candidate's artifact packed beside the stable one (``candidate/artifact.pt``) and a
``handler.rollout`` section naming it and the *control file*
(``<store>/<model>-<serving version>.control.json``, :func:`control_path`): the JSON
mode and weight the sidecar's rollout controller rewrites while the workers run
(:mod:`serve.store.routing`). The candidate's artifact is copied as it is, so its
reference still names the candidate's own tables folder in the repository (the stable's
and the candidate's tables are both mapped, each from its own folder). The model store is shared by TorchServe and the sidecar (an
``emptyDir`` mounted at the same path in both containers), so the path is the same on
both sides.

**Digests.** A repository archive is code. :func:`rewrite_mar` opens a source archive
(and a candidate's) once, hashes it through that open file and checks the sha256 against
the digest its build recorded (``src_sha256``,
:meth:`serve.store.repository.ModelRepository.check_archive`), then derives the new
archive from the same open file: a file swapped (renamed over) between the check and the
copy is not read. (Changing the bytes of the open file in place needs write access to a
0444 file of the repository, whose writer can also rewrite the digest: SECURITY.md.)
The derived archive itself is not recorded: the sidecar writes it from verified bytes and
registers it at once; the only other writer of the model store is the torchserve
container, which already runs the model's code.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from serve.api.config import RolloutWiring
from serve.common.durable import temp_beside
from serve.constants import ARTIFACT_NAME, CANDIDATE_ARTIFACT
from serve.errors import ConfigError, UpstreamUnavailable
from serve.state import parse_serving_version

__all__ = ["POD_HANDLER", "CandidateArchive", "control_path",
           "is_sidecar_archive", "mar_path", "rewrite_mar"]


# The handler this pod ships (the image holds handlers/ beside serve/). Derived archives
# carry it instead of the copy packed at build time: the handler imports serve.* from the
# pod, so an older handler beside newer serve code (or the reverse) must never run; and a
# version built before rollouts existed can still be a rollout's stable arm.
POD_HANDLER = Path(__file__).resolve().parents[3] / "handlers" / "dlrm_handler.py"


@dataclass(frozen=True)
class CandidateArchive:
    """A rollout's candidate to pack beside the stable model: its version, its repository
    archive, the control file the workers read its weight from, and its archive's
    recorded sha256 (None: not checked)."""

    version: str
    src: Path
    control_file: Path
    sha256: str | None = None


def mar_path(model_store: Path, model_name: str, serving_version: str) -> Path:
    """Where the sidecar writes the archive of a serving version:
    ``<store>/<model>-<version>_b..d..w...mar``."""
    return model_store / f"{model_name}-{serving_version}.mar"


def control_path(model_store: Path, model_name: str, serving_version: str) -> Path:
    """The rollout control file of a serving version that holds a candidate."""
    return model_store / f"{model_name}-{serving_version}.control.json"


def is_sidecar_archive(path: Path, model_store: Path, model_name: str) -> bool:
    """Whether ``path`` is an archive the sidecar derived (only those may be deleted):
    in the model store, named ``<model>-<serving version>.mar``. A repository archive,
    ``<model>-<version>.mar``, never is: a model version has no ``_``."""
    m = re.fullmatch(rf"{re.escape(model_name)}-(.+)\.mar", path.name)
    return (Path(path).parent == Path(model_store) and m is not None
            and parse_serving_version(m.group(1)) is not None)


def _rewrite_model_config(text: str, settings: dict[str, int],
                          rollout: dict[str, str] | None = None) -> str:
    import yaml  # TorchServe depends on pyyaml; import lazily to keep imports light

    config = yaml.safe_load(text) or {}
    if not isinstance(config, dict):
        raise ConfigError("the .mar's model config is not a YAML mapping")
    config.update(settings)
    if rollout is not None:
        handler: Any = config.setdefault("handler", {})
        if not isinstance(handler, dict):
            raise ConfigError("the .mar's model config has a handler section that is not a "
                              "mapping")
        handler["rollout"] = rollout
    return yaml.safe_dump(config, sort_keys=False)


def _missing(src: Path) -> UpstreamUnavailable:
    return UpstreamUnavailable(
        f"the model archive {src} does not exist; check --repository (where the model "
        f"versions are) and --model-store (TorchServe's)")


@contextmanager
def _verified(src: Path, sha256: str | None) -> Iterator[zipfile.ZipFile]:
    """The archive ``src`` as a zip over one open file, which, with ``sha256``, was
    hashed and checked first (module docstring, Digests).

    Raises:
        ConfigError: its bytes differ from ``sha256`` (names both digests).
    """
    with open(src, "rb") as f:
        if sha256 is not None:
            h = hashlib.sha256()
            while chunk := f.read(1 << 20):
                h.update(chunk)
            if h.hexdigest() != sha256:
                raise ConfigError(
                    f"archive digest: {src} has sha256 {h.hexdigest()}, but its build "
                    f"recorded {sha256}: it changed after the check (damaged or replaced) "
                    f"and is not registered; copy the version again from its build")
            f.seek(0)
        with zipfile.ZipFile(f) as z:
            yield z


def rewrite_mar(src: Path, dst: Path, *, version: str, batch_size: int,
                max_batch_delay_ms: int, workers: int,
                candidate: CandidateArchive | None = None,
                handler_file: Path | None = POD_HANDLER,
                src_sha256: str | None = None) -> Path:
    """Copy the model archive ``src`` to ``dst`` with ``modelVersion = version`` in
    ``MAR-INF/MANIFEST.json`` and the batching settings in its model config (the file
    the manifest's ``configFile`` names), which TorchServe prefers over registration
    parameters. With ``candidate``, its archive's artifact is added as
    :data:`CANDIDATE_ARTIFACT` and the model config's ``handler.rollout`` names it and
    the control file. The manifest's handler entry is replaced by ``handler_file`` when
    that exists (None or missing: kept). Other entries are copied unchanged; ``dst`` is
    written atomically. With ``src_sha256`` (and the candidate's ``sha256``) the source
    bytes are checked first (module docstring, Digests: ``ConfigError`` when they
    differ)."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise _missing(src)
    if candidate is not None and not Path(candidate.src).is_file():
        raise _missing(Path(candidate.src))
    # The section the workers parse (serve.api.config.RolloutWiring), written from it: one
    # spelling of the contract, checked here as the workers will check it.
    rollout = None if candidate is None else asdict(RolloutWiring(
        candidate_version=candidate.version, candidate_artifact=CANDIDATE_ARTIFACT,
        control_file=str(Path(candidate.control_file).resolve())))
    fd, tmp = temp_beside(dst)  # never a predictable name: the store is shared
    try:
        with os.fdopen(fd, "wb") as out, _verified(src, src_sha256) as zin:
            try:
                manifest = json.loads(zin.read("MAR-INF/MANIFEST.json"))
            except KeyError:
                raise UpstreamUnavailable(
                    f"{src} has no MAR-INF/MANIFEST.json; not a .mar") from None
            manifest.setdefault("model", {})["modelVersion"] = version
            config_name = manifest["model"].get("configFile")
            handler_name = str(manifest["model"].get("handler") or "").split(":")[0]
            handler_text = (Path(handler_file).read_bytes()
                            if handler_file is not None and Path(handler_file).is_file()
                            else None)
            settings = {"batchSize": batch_size, "maxBatchDelay": max_batch_delay_ms,
                        "minWorkers": workers, "maxWorkers": workers}
            with zipfile.ZipFile(out, "w") as zout:
                for info in zin.infolist():
                    if info.filename == "MAR-INF/MANIFEST.json":
                        zout.writestr(info, json.dumps(manifest, indent=2))
                    elif config_name and info.filename == config_name:
                        text = zin.read(info).decode()
                        zout.writestr(info, _rewrite_model_config(text, settings, rollout))
                    elif handler_text is not None and info.filename == handler_name:
                        zout.writestr(info, handler_text)
                    elif info.filename != CANDIDATE_ARTIFACT:
                        with zin.open(info) as fin, zout.open(info, "w") as fout:
                            shutil.copyfileobj(fin, fout, 1 << 20)
                if candidate is not None:
                    _add_candidate(zout, Path(candidate.src), candidate.sha256)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)  # a failed copy leaves no half-written file behind
    return dst


def _add_candidate(zout: zipfile.ZipFile, src: Path, sha256: str | None = None) -> None:
    """Copy ``src``'s artifact into ``zout`` as :data:`CANDIDATE_ARTIFACT`, unchanged: a
    format-3 artifact keeps the reference to the candidate's own tables folder."""
    with _verified(src, sha256) as cin:
        try:
            info = cin.getinfo(ARTIFACT_NAME)
        except KeyError:
            raise UpstreamUnavailable(
                f"the candidate's archive {src} has no {ARTIFACT_NAME}; is it a model "
                f"version built by `make model`?") from None
        out = zipfile.ZipInfo(CANDIDATE_ARTIFACT, date_time=info.date_time)
        out.compress_type = info.compress_type
        with cin.open(info) as fin, zout.open(out, "w") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
