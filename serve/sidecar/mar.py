"""Model archives the sidecar derives for serving: named by serving version, rewritten.

TorchServe fixes ``batch_size``/``max_batch_delay`` at registration and the
``model-config.yaml`` inside a ``.mar`` wins over the registration parameters, so each
(model version, batching, workers) is served from its own archive: a copy of the model
version's repository archive with ``modelVersion`` set to the serving version
(:func:`serve.state.serving_version`, ``<version>_b<batch>d<delay>w<workers>``) and the
settings written into its model config. It lives in TorchServe's model store as
``<model>-<serving version>.mar`` (TorchServe registers local archives only from there)
and is deleted when its version is unregistered; repository archives are never touched.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

from serve.errors import ConfigError, UpstreamUnavailable
from serve.state import parse_serving_version

__all__ = ["is_sidecar_archive", "mar_path", "rewrite_mar"]


def mar_path(model_store: Path, model_name: str, serving_version: str) -> Path:
    """Where the sidecar writes the archive of a serving version:
    ``<store>/<model>-<version>_b..d..w...mar``."""
    return model_store / f"{model_name}-{serving_version}.mar"


def is_sidecar_archive(path: Path, model_store: Path, model_name: str) -> bool:
    """Whether ``path`` is an archive the sidecar derived (only those may be deleted):
    in the model store, named ``<model>-<serving version>.mar``. A repository archive,
    ``<model>-<version>.mar``, never is: a model version has no ``_``."""
    m = re.fullmatch(rf"{re.escape(model_name)}-(.+)\.mar", path.name)
    return (Path(path).parent == Path(model_store) and m is not None
            and parse_serving_version(m.group(1)) is not None)


def _rewrite_model_config(text: str, settings: dict[str, int]) -> str:
    import yaml  # TorchServe depends on pyyaml; import lazily to keep imports light

    config = yaml.safe_load(text) or {}
    if not isinstance(config, dict):
        raise ConfigError("the .mar's model config is not a YAML mapping")
    config.update(settings)
    return yaml.safe_dump(config, sort_keys=False)


def rewrite_mar(src: Path, dst: Path, *, version: str, batch_size: int,
                max_batch_delay_ms: int, workers: int) -> Path:
    """Copy the model archive ``src`` to ``dst`` with ``modelVersion = version`` in
    ``MAR-INF/MANIFEST.json`` and the batching settings in its model config (the file
    the manifest's ``configFile`` names), which TorchServe prefers over registration
    parameters. Other entries are copied unchanged; ``dst`` is written atomically."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise UpstreamUnavailable(
            f"the model archive {src} does not exist; check --repository (where the model "
            f"versions are) and --model-store (TorchServe's)")
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        with zipfile.ZipFile(src) as zin:
            try:
                manifest = json.loads(zin.read("MAR-INF/MANIFEST.json"))
            except KeyError:
                raise UpstreamUnavailable(
                    f"{src} has no MAR-INF/MANIFEST.json; not a .mar") from None
            manifest.setdefault("model", {})["modelVersion"] = version
            config_name = manifest["model"].get("configFile")
            settings = {"batchSize": batch_size, "maxBatchDelay": max_batch_delay_ms,
                        "minWorkers": workers, "maxWorkers": workers}
            with zipfile.ZipFile(tmp, "w") as zout:
                for info in zin.infolist():
                    if info.filename == "MAR-INF/MANIFEST.json":
                        zout.writestr(info, json.dumps(manifest, indent=2))
                    elif config_name and info.filename == config_name:
                        text = zin.read(info).decode()
                        zout.writestr(info, _rewrite_model_config(text, settings))
                    else:
                        with zin.open(info) as fin, zout.open(info, "w") as fout:
                            shutil.copyfileobj(fin, fout, 1 << 20)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)  # a failed copy leaves no half-written file behind
    return dst
