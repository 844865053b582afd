"""Model archives for new versions: the next version name and a ``.mar`` rewritten for it.

TorchServe fixes ``batch_size``/``max_batch_delay`` at registration and the
``model-config.yaml`` inside a ``.mar`` wins over the registration parameters, so a new
batching setting needs a new archive: a copy of the default version's with a new
``modelVersion`` and the settings written into its model config.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

from serve.errors import ConfigError, UpstreamUnavailable

__all__ = ["is_sidecar_archive", "mar_path", "next_version", "rewrite_mar"]


def next_version(current: str, taken: set[str] | frozenset[str]) -> str:
    """The version after ``current`` not in ``taken``: ``1.0`` -> ``1.1``; a version that
    is not ``MAJOR.MINOR`` gets ``.1``, ``.2``... appended."""
    m = re.fullmatch(r"(\d+)\.(\d+)", current)
    for i in range(1, 100_000):
        candidate = f"{m.group(1)}.{int(m.group(2)) + i}" if m else f"{current}.{i}"
        if candidate not in taken:
            return candidate
    raise ConfigError(f"no free version after {current!r}; unregister old versions")


def mar_path(model_store: Path, model_name: str, version: str) -> Path:
    """Where the sidecar writes the archive of ``version``: ``<store>/<model>-v<version>.mar``."""
    return model_store / f"{model_name}-v{version}.mar"


def is_sidecar_archive(path: Path, model_store: Path, model_name: str) -> bool:
    """Whether ``path`` is an archive the sidecar wrote (only those may be deleted; the
    pipeline's own ``.mar`` stays)."""
    return (path.parent == model_store
            and re.fullmatch(rf"{re.escape(model_name)}-v.+\.mar", path.name) is not None)


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
            f"the model archive {src} of the default version is not in the model store; "
            f"pass --model-store with TorchServe's --model-store directory")
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
