"""Read a DCP checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint.FileSystemReader.read_metadata`` is a raw ``pickle.load``
of ``.metadata`` (``torch/distributed/checkpoint/filesystem.py``): a checkpoint someone
else wrote (a training bucket, a colleague's upload) would run its own code on the
build machine, which writes ``model_store/`` and so the image. Here the same file is read
by an unpickler that builds only what DCP writes there (review N3, as PyTorch PR #191326
proposed upstream):

* ``torch.distributed.checkpoint.metadata``: ``Metadata``, ``MetadataIndex``,
  ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
  ``BytesStorageMetadata``, ``StorageMeta`` and ``_MEM_FORMAT_ENCODING`` (the memory
  format, an enum of names);
* ``torch.distributed.checkpoint.filesystem._StorageInfo`` (file, offset, length);
* ``torch.Size``, every ``torch.dtype`` by name, ``torch.serialization._get_layout`` (a
  name -> layout lookup), ``pathlib.PosixPath`` (``StorageMeta.checkpoint_id``) and
  ``collections.OrderedDict``.

Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``...) or a
persistent id stops the read before anything is called: :class:`CheckpointError`.
This is what our fixtures, ``dcp.save`` (one process or N ranks, DMP state dicts) and
:mod:`serve.model.generate` write (checked by ``tests/test_safe_load.py``).

Use :func:`read_metadata` for the metadata, and :func:`safe_dcp_load` instead of
``dcp.load``: its metadata read is the same one, and its planner refuses a "bytes" item
(DCP's default planner reads those with ``torch.load(weights_only=False)``).
"""
from __future__ import annotations

import collections
import os
import pathlib
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from serve.errors import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "SafeFileSystemReader", "read_metadata", "safe_dcp_load"]

_DCP_META = "torch.distributed.checkpoint.metadata"
#: (module, name) pairs a DCP ``.metadata`` may name, besides ``torch.<dtype>``.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_META, "Metadata"), (_DCP_META, "MetadataIndex"),
    (_DCP_META, "TensorStorageMetadata"), (_DCP_META, "ChunkStorageMetadata"),
    (_DCP_META, "TensorProperties"), (_DCP_META, "BytesStorageMetadata"),
    (_DCP_META, "StorageMeta"), (_DCP_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


def _resolve(module: str, name: str) -> Any:
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    if module == "pathlib":
        return getattr(pathlib, name)
    if module == "torch" and name != "Size":
        return getattr(torch, name)        # a dtype, checked by the caller
    import importlib

    return getattr(importlib.import_module(module), name)


class _Refused(pickle.UnpicklingError):
    """A global or persistent id outside the allow-list (not merely damaged bytes)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the :data:`ALLOWED_GLOBALS` and ``torch`` dtypes; anything else raises
    ``pickle.UnpicklingError`` naming it, before it is looked up or called."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in ALLOWED_GLOBALS and not is_dtype:
            raise _Refused(f"global {module}.{name} is not allowed")
        return _resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {str(pid)[:60]!r} is not allowed")


def _load(stream: IO[bytes], where: str, hint: str) -> Metadata:
    try:
        md = _MetadataUnpickler(stream).load()
    except _Refused as e:
        raise CheckpointError(
            f"checkpoint metadata {where} is refused: {e}; a DCP .metadata holds only "
            "DCP's metadata classes, torch.Size, dtypes and paths, so this file would run "
            "code when read. Import only checkpoints you would run as code, from a "
            f"source you trust; {hint}") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises many types
        raise CheckpointError(f"checkpoint metadata {where} is unreadable "
                              f"({type(e).__name__}); {hint}") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"checkpoint metadata {where} holds {type(md).__name__}, not "
                              f"DCP's Metadata; {hint}")
    return md


def read_metadata(ckpt: str | os.PathLike[str],
                  hint: str = "write the checkpoint again") -> Metadata:
    """The ``Metadata`` of the DCP directory ``ckpt``, read with the allow-listed unpickler.

    Raises:
        CheckpointError: ``.metadata`` is missing, unreadable, not a ``Metadata``, or
            names a global outside :data:`ALLOWED_GLOBALS` (the message names it; nothing
            of it ran). ``hint`` ends the message.
    """
    path = Path(ckpt) / ".metadata"
    if not path.is_file():
        raise CheckpointError(f"checkpoint metadata {path} is missing; {hint}")
    with open(path, "rb") as f:
        return _load(f, os.fspath(path), hint)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` is :func:`read_metadata`'s: pass it to
    ``dcp.load(..., storage_reader=SafeFileSystemReader(DIR))``. The shards it reads are
    ``torch.load(weights_only=True)``-style records (DCP's own reader)."""

    def __init__(self, path: str | os.PathLike[str],
                 hint: str = "write the checkpoint again") -> None:
        super().__init__(path)
        self._safe_path, self._hint = Path(path), hint

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(self._safe_path, self._hint)
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id   # as the upstream reader does
        md.storage_meta = meta
        return md


class _TensorOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor ("bytes") item, which it would
    unpickle with ``torch.load(weights_only=False)``, is refused."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"checkpoint item {read_item.dest_index.fqn!r} is pickled "
                              "bytes, not a tensor; only tensors are read from a checkpoint")


def safe_dcp_load(state: dict[str, Any], ckpt: str | os.PathLike[str],
                  hint: str = "write the checkpoint again") -> None:
    """``dcp.load(state, checkpoint_id=ckpt, no_dist=True)`` (one process, into
    ``state``'s own tensors) through :class:`SafeFileSystemReader` and a planner that reads
    tensors only. Raises what ``dcp.load`` raises, and :class:`CheckpointError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(ckpt, hint)   # DCP would fold our error into its own AssertionError
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt, hint),
                 planner=_TensorOnlyPlanner(), no_dist=True)
    except CheckpointException as e:   # DCP wraps each rank's error: give ours back
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                raise CheckpointError(inner.message) from None
        raise
