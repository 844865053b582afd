"""Check a ``torch.export`` program's bytes before ``torch.export.load`` runs them.

``torch.export.load`` is not a data reader (review N3): in torch 2.13 it unpickles weights
and constants whose payload config says ``use_pickle`` with ``torch.load(...,
weights_only=False)``, ``custom_obj_*`` constants with ``torch._C._pickle_load_obj``,
``opaque_obj_*`` with ``pickle.loads``, legacy ``data/weights/<model>.pt`` /
``data/constants/<model>.pt`` files and the sample inputs with a ``weights_only=False``
fallback, loads AOTInductor shared libraries, and falls back to the pre-2.8 format
(``serialized_*``, unpickled the same way) when the archive is not a ``pt2`` archive
(``torch/export/pt2_archive/_package.py``, ``torch/_export/serde/serialize.py``).

What :func:`check_program` accepts is exactly what ``torch.export.save`` writes for a
program of plain tensors, under one root folder:

* ``archive_format`` (``pt2``), ``archive_version``, ``byteorder``, ``.data/version``,
  ``.data/serialization_id``;
* ``models/model.json`` (the graph, JSON);
* ``data/weights/model_weights_config.json`` and
  ``data/constants/model_constants_config.json``, every entry ``use_pickle: false`` and
  its ``path_name`` a ``weight_N`` / ``tensor_N`` record, and those raw records;
* ``data/sample_inputs/model.pt``, which must load with ``torch.load(weights_only=True)``
  (then torch's own read of it never falls back).

Anything else (a pickled weight or constant, a custom or opaque object, a legacy ``.pt``,
AOTInductor code, extra files, a second model, a member outside the root) is refused
with :class:`ArtifactError` naming the member, and nothing of it is unpickled.
"""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from typing import Any

import torch

from serve.errors import ArtifactError

__all__ = ["check_program", "program_sha256"]

_MODEL = "model"
_PLAIN = {"archive_format", "archive_version", "byteorder", ".data/version",
          ".data/serialization_id", f"models/{_MODEL}.json"}
_CONFIGS = {f"data/weights/{_MODEL}_weights_config.json": ("data/weights/", "weight_"),
            f"data/constants/{_MODEL}_constants_config.json": ("data/constants/", "tensor_")}
_SAMPLE = f"data/sample_inputs/{_MODEL}.pt"
_DO = ("re-import the model with `python -m serve.model.importer`; a program that needs "
       "pickled objects is code, and the pod runs programs of plain tensors only")


def program_sha256(program: torch.Tensor | bytes) -> str:
    """Hex sha256 of the program's bytes (a uint8 (n,) tensor or bytes)."""
    raw = program if isinstance(program, bytes) else program.numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def _records(z: zipfile.ZipFile, root: str, config: str, folder: str,
             prefix: str) -> set[str]:
    """The raw records a payload config names; refuses a pickled or non-tensor entry."""
    try:
        entries: dict[str, Any] = json.loads(z.read(root + config))["config"]
        records = set()
        for fqn, meta in entries.items():
            name = str(meta["path_name"])
            if meta.get("use_pickle") is not False or not name.startswith(prefix):
                raise ArtifactError(
                    f"the exported program's {config} entry {fqn!r} is {name!r} with "
                    f"use_pickle {meta.get('use_pickle')!r}: a pickled object, which "
                    f"torch.export.load would unpickle as code; {_DO}")
            records.add(folder + name)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ArtifactError(f"the exported program's {config} is not a payload config "
                            f"({type(e).__name__}: {e}); {_DO}") from None
    return records


def _check_sample(z: zipfile.ZipFile, root: str) -> None:
    try:
        torch.load(io.BytesIO(z.read(root + _SAMPLE)), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refusals raise several types
        raise ArtifactError(f"the exported program's {_SAMPLE} does not load as plain "
                            f"tensors ({type(e).__name__}); torch.export.load would "
                            f"unpickle it as code; {_DO}") from None


def check_program(program: torch.Tensor | bytes) -> None:
    """Refuse a program whose archive holds anything :mod:`this module <serve.runtime.
    program_check>` does not accept; nothing is unpickled but the sample inputs, with
    ``weights_only=True``.

    Raises:
        ArtifactError: not a zip, not a ``pt2`` archive, or a member that would run as
            code (named in the message).
    """
    raw = program if isinstance(program, bytes) else program.numpy().tobytes()
    try:
        z = zipfile.ZipFile(io.BytesIO(raw))
    except zipfile.BadZipFile:
        raise ArtifactError(f"the exported program is not a torch.export archive (not a "
                            f"zip); {_DO}") from None
    names = z.namelist()
    root = names[0].split("/", 1)[0] + "/" if names and "/" in names[0] else ""
    if not root or any(not n.startswith(root) for n in names):
        raise ArtifactError(f"the exported program's members are not under one root "
                            f"folder ({names[:3]}); {_DO}")
    rel = {n[len(root):] for n in names}
    if f"models/{_MODEL}.json" not in rel or "archive_format" not in rel \
            or z.read(root + "archive_format").decode(errors="replace").strip() != "pt2":
        raise ArtifactError("the exported program is not a pt2 archive of one model "
                            f"(archive_format 'pt2', models/{_MODEL}.json); the older "
                            f"format unpickles its weights; {_DO}")
    allowed = _PLAIN | set(_CONFIGS) | {_SAMPLE}
    for config, (folder, prefix) in _CONFIGS.items():
        if config in rel:
            allowed |= _records(z, root, config, folder, prefix)
    extra = sorted(rel - allowed)
    if extra:
        raise ArtifactError(f"the exported program holds {extra[:3]} ({len(extra)} members "
                            "beyond plain tensors and the graph: pickled objects, legacy "
                            f".pt files or native code, which torch.export.load runs); {_DO}")
    if _SAMPLE in rel:
        _check_sample(z, root)
