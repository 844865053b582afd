"""Read a checkpoint's tensors in row ranges, never the whole checkpoint (the streaming import).

Two sources, one interface (:class:`CheckpointSource`): ``shapes()`` (key -> shape),
``read_rows(key, lo, hi)`` (rows ``lo:hi`` of a 2-D tensor) and ``read(key)`` (a whole
tensor: the dense weights):

* :class:`DcpSource`: a ``torch.distributed.checkpoint`` directory (``.metadata`` +
  ``*.distcp``, written by N ranks). The metadata lists each tensor's chunks (offsets and
  sizes: whole tables, row shards or column shards) and where each chunk is stored (file,
  byte offset, length). ``FileSystemWriter`` stores each chunk as a ``torch.save`` blob: a
  zip archive stored uncompressed, whose ``data.pkl`` names the storage record, dtype,
  size, stride and storage offset. We read those few bytes, then ``pread`` exactly the
  rows asked for from the record (column shards are assembled side by side).
* :class:`StateDictSource`: one ``torch.save(state_dict)`` file (the same zip format), read
  the same way.

Why not ``dcp.load`` / ``torch.load(mmap=True)``: the first needs the whole tensor in
memory; the second maps the file, and every page touched stays in the process's resident
set (RSS) until unmapped, so reading a 30 GB table through a map holds up to 30 GB of
(clean, file-backed) pages. ``pread`` into a chunk-sized buffer holds one chunk.

The pickle is read by a restricted unpickler (tensors, storages, ``OrderedDict`` only, as
``torch.load(weights_only=True)`` allows); a record in another form (compressed, or a
DCP item with transforms) is read with ``torch.load`` on its bytes, whole.

Shapes: rows R, columns D; a chunk holds rows ``r0:r0+n`` and columns ``c0:c0+w``.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from serve.errors import CheckpointError

__all__ = [
    "CheckpointSource",
    "DcpSource",
    "StateDictSource",
    "TensorRef",
    "check_keys",
    "open_source",
    "strip_prefixes",
]

_PREFIXES = ("_dmp_wrapped_module.", "module.")
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "DoubleStorage": torch.float64,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")   # a zip local file header (30 bytes)


def strip_prefixes(key: str) -> str:
    """A state-dict key without DistributedModelParallel's / DDP's wrapper prefixes."""
    for p in _PREFIXES:
        while key.startswith(p):
            key = key[len(p):]
    return key


@dataclass(frozen=True)
class TensorRef:
    """Where one saved tensor's elements lie: ``file`` from byte ``data_offset`` (its
    storage record), element ``storage_offset`` on, ``size`` / ``stride`` in elements."""

    file: Path
    data_offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def row_major(self) -> bool:
        """Rows lie one after the other (a contiguous C-order tensor, or 1-D/empty)."""
        want, acc = [], 1
        for s in reversed(self.size):
            want.append(acc)
            acc *= s
        return all(n <= 1 or st == w for n, st, w in
                   zip(self.size, self.stride, reversed(want), strict=True))

    def read_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` along dim 0 (shape ``(hi - lo, *size[1:])``), by one ``pread``."""
        if not self.row_major:
            raise CheckpointError(f"{self.file}: a tensor stored with strides {self.stride} "
                                  f"(size {self.size}) is not row-major; re-save it contiguous")
        inner = 1
        for s in self.size[1:]:
            inner *= s
        item = torch.empty((), dtype=self.dtype).element_size()
        n = (hi - lo) * inner
        if n == 0:
            return torch.empty((hi - lo, *self.size[1:]), dtype=self.dtype)
        buf = np.empty(n * item, dtype=np.uint8)
        start = self.data_offset + (self.storage_offset + lo * inner) * item
        with open(self.file, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf.data], start)
        if got != n * item:
            raise CheckpointError(f"{self.file}: read {got} of {n * item} bytes at byte "
                                  f"{start}; the file is truncated: write the checkpoint again")
        return torch.from_numpy(buf).view(self.dtype).reshape((hi - lo, *self.size[1:]))

    def read(self) -> torch.Tensor:
        return self.read_rows(0, self.size[0]) if self.size else self.read_rows(0, 1).reshape(())


# ----------------------------------------------------------------------------- torch.save zips
class _Slice(io.RawIOBase):
    """Bytes ``base .. base + length`` of an open file, as a seekable read-only stream."""

    def __init__(self, f: Any, base: int, length: int) -> None:
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.base + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


class _Storage:
    def __init__(self, key: str, dtype: torch.dtype) -> None:
        self.key, self.dtype = key, dtype


class _Unpickler(pickle.Unpickler):
    """``data.pkl`` of a ``torch.save`` zip into nested dicts of :class:`TensorRef`-like
    tuples, without reading a storage; any global but tensors, storages and OrderedDict
    is refused (as ``weights_only=True``)."""

    def __init__(self, data: bytes, resolve: Any) -> None:
        super().__init__(io.BytesIO(data))
        self.resolve = resolve

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *_: data
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        raise pickle.UnpicklingError(f"global {module}.{name} is not a tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"persistent id {pid!r} is not a storage")
        return _Storage(str(pid[2]), _STORAGE_DTYPES[pid[1]])

    def _tensor(self, storage: _Storage, offset: int, size: Any, stride: Any, *_: Any) -> Any:
        return self.resolve(storage, int(offset), tuple(int(s) for s in size),
                            tuple(int(s) for s in stride))


def _zip_refs(path: Path, base: int, length: int) -> Any:
    """The pickled object of the ``torch.save`` zip at bytes ``base .. base + length`` of
    ``path``, its tensors as :class:`TensorRef`. Raises ``ValueError`` / ``pickle`` /
    ``zipfile`` errors for a record in another form (the caller falls back)."""
    with open(path, "rb") as f:
        z = zipfile.ZipFile(_Slice(f, base, length))
        infos = {i.filename: i for i in z.infolist()}
        pkl = next((n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise ValueError("no data.pkl")
        prefix = pkl[: -len("data.pkl")]

        def resolve(st: _Storage, offset: int, size: tuple[int, ...],
                    stride: tuple[int, ...]) -> TensorRef:
            info = infos[f"{prefix}data/{st.key}"]
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError("compressed storage record")
            f.seek(base + info.header_offset)
            head = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            start = base + info.header_offset + _LOCAL_HEADER.size + head[-2] + head[-1]
            return TensorRef(path, start, st.dtype, size, stride, offset)

        return _Unpickler(z.read(pkl), resolve).load()


# ----------------------------------------------------------------------------- sources
class CheckpointSource(Protocol):
    """A checkpoint read a piece at a time (keys without wrapper prefixes)."""

    def shapes(self) -> dict[str, tuple[int, ...]]: ...
    def read_rows(self, key: str, lo: int, hi: int) -> torch.Tensor: ...
    def read(self, key: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Chunk:
    """One stored piece of a tensor: rows ``offsets[0]:+sizes[0]``, columns
    ``offsets[1]:+sizes[1]`` (1-D: rows only), at ``relative_path`` bytes
    ``offset .. offset + length``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relative_path: str
    offset: int
    length: int
    plain: bool             # a plain torch.save record (no transforms)


class DcpSource:
    """A DCP directory (see the module docstring). ``hint`` ends every error message."""

    def __init__(self, path: str | os.PathLike[str],
                 hint: str = "write the checkpoint again") -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from serve.model.safe_meta import read_metadata

        self.path, self.hint = Path(path), hint
        if not (self.path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {self.path} is a folder without .metadata; give "
                                  "a torch.distributed.checkpoint directory or a state-dict file")
        md = read_metadata(self.path, hint)   # allow-listed unpickler (review N3)
        where = {(idx.fqn, tuple(int(o) for o in idx.offset or ())): info
                 for idx, info in (md.storage_data or {}).items()}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._chunks: dict[str, list[_Chunk]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for fqn, tmd in md.state_dict_metadata.items():
            if not isinstance(tmd, TensorStorageMetadata):
                continue
            key = strip_prefixes(fqn)
            self._shapes[key] = tuple(int(s) for s in tmd.size)
            self._dtypes[key] = tmd.properties.dtype
            chunks = []
            for c in tmd.chunks:
                off = tuple(int(o) for o in c.offsets)
                info = where.get((fqn, off))
                if info is None:
                    raise CheckpointError(f"checkpoint {self.path}: {fqn} chunk at {off} has no "
                                          f"stored bytes in the metadata; {hint}")
                chunks.append(_Chunk(off, tuple(int(s) for s in c.sizes), info.relative_path,
                                     int(info.offset), int(info.length),
                                     not getattr(info, "transform_descriptors", None)))
            self._chunks[key] = chunks
        self._refs: dict[tuple[str, int], TensorRef | torch.Tensor] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def chunks(self, key: str) -> list[_Chunk]:
        """The stored pieces of ``key`` (rows/columns), as the metadata lists them."""
        return list(self._chunks[key])

    def _item(self, c: _Chunk) -> TensorRef | torch.Tensor:
        """The chunk's record as a :class:`TensorRef` (a plain torch.save zip), else the
        tensor itself read whole (a record written with transforms)."""
        k = (c.relative_path, c.offset)
        if k in self._refs:
            return self._refs[k]
        file = self.path / c.relative_path
        if not file.is_file() or file.stat().st_size < c.offset + c.length:
            raise CheckpointError(f"checkpoint shard {file} is missing or shorter than the "
                                  f"{c.offset + c.length} bytes its metadata needs; {self.hint}")
        try:
            ref: TensorRef | torch.Tensor = _zip_refs(file, c.offset, c.length) \
                if c.plain else self._load_whole(c)
        except (ValueError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError):
            ref = self._load_whole(c)
        if isinstance(ref, TensorRef) and ref.size != c.sizes:
            raise CheckpointError(f"checkpoint shard {file} at byte {c.offset}: holds "
                                  f"{ref.size}, the metadata says {c.sizes}; {self.hint}")
        self._refs[k] = ref
        return ref

    def _load_whole(self, c: _Chunk) -> torch.Tensor:
        file = self.path / c.relative_path
        if not c.plain:
            raise CheckpointError(f"checkpoint shard {file}: the record at byte {c.offset} was "
                                  "written with storage transforms (e.g. compression), which "
                                  "the streaming import does not read; save the checkpoint "
                                  "without FileSystemWriter extensions")
        try:
            with open(file, "rb") as f:
                f.seek(c.offset)
                raw = io.BytesIO(f.read(c.length))
            t = torch.load(raw, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"checkpoint shard {file} is corrupt (record at byte "
                                  f"{c.offset}: {type(e).__name__}); {self.hint}") from e
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"checkpoint shard {file}: the record at byte {c.offset} "
                                  f"holds {type(t).__name__}, not a tensor; {self.hint}")
        return t

    def read_rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of ``key`` (R, D) or (R,), assembled from every chunk they cross."""
        shape = self._shapes[key]
        out = torch.empty((hi - lo, *shape[1:]), dtype=self._dtypes[key])
        for c in self._chunks[key]:
            r0, n = c.offsets[0], c.sizes[0]
            a, b = max(lo, r0), min(hi, r0 + n)
            if a >= b:
                continue
            item = self._item(c)
            piece = item.read_rows(a - r0, b - r0) if isinstance(item, TensorRef) \
                else item[a - r0 : b - r0]
            if len(shape) == 1:
                out[a - lo : b - lo] = piece
            else:
                c0, w = c.offsets[1], c.sizes[1]
                out[a - lo : b - lo, c0 : c0 + w] = piece
        return out

    def read(self, key: str) -> torch.Tensor:
        shape = self._shapes[key]
        if not shape:
            (c,) = self._chunks[key]
            item = self._item(c)
            return item.read() if isinstance(item, TensorRef) else item
        return self.read_rows(key, 0, shape[0])


class StateDictSource:
    """One ``torch.save(state_dict)`` file (or ``{"state_dict": {...}}``), read by ranges."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"checkpoint {self.path} does not exist")
        self._whole: Mapping[str, torch.Tensor] | None = None
        try:
            blob = _zip_refs(self.path, 0, self.path.stat().st_size)
        except (ValueError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError):
            blob = self._load_whole()   # not a plain zip of tensors: torch.load decides
        if isinstance(blob, dict) and isinstance(blob.get("state_dict"), dict):
            blob = blob["state_dict"]
        if not isinstance(blob, dict) or not all(isinstance(v, TensorRef | torch.Tensor)
                                                 for v in blob.values()):
            raise CheckpointError(f"checkpoint {self.path} holds {type(blob).__name__}, not a "
                                  "state dict of tensors; save it with "
                                  "torch.save(model.state_dict(), PATH)")
        self._refs: dict[str, TensorRef | torch.Tensor] = {strip_prefixes(k): v
                                                            for k, v in blob.items()}

    def _load_whole(self) -> Any:
        errors: list[Exception] = []
        for mmap in (True, False):     # mmap needs the zip format; a legacy file loads whole
            try:
                return torch.load(self.path, map_location="cpu", mmap=mmap, weights_only=True)
            except Exception as e:  # noqa: BLE001 - bad bytes raise many types
                errors.append(e)
        first = errors[0]
        raise CheckpointError(f"checkpoint {self.path} is unreadable ({type(first).__name__}: "
                              f"{first}); give torch.save(model.state_dict()) or a DCP "
                              "directory") from first

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.size) if isinstance(v, TensorRef) else tuple(v.shape)
                for k, v in self._refs.items()}

    def read_rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        ref = self._refs[key]
        if isinstance(ref, TensorRef) and ref.row_major:
            return ref.read_rows(lo, hi)
        if isinstance(ref, TensorRef):
            raise CheckpointError(f"checkpoint {self.path}: {key} is stored with strides "
                                  f"{ref.stride}; save contiguous tensors")
        return ref[lo:hi].clone()

    def read(self, key: str) -> torch.Tensor:
        ref = self._refs[key]
        if isinstance(ref, TensorRef):
            if ref.row_major:
                return ref.read()
            raise CheckpointError(f"checkpoint {self.path}: {key} is stored with strides "
                                  f"{ref.stride}; save contiguous tensors")
        return ref.clone()


def open_source(path: str | os.PathLike[str],
                hint: str = "write the checkpoint again") -> DcpSource | StateDictSource:
    """A DCP directory or a state-dict file, opened for reading by ranges."""
    p = Path(path)
    if p.is_dir():
        return DcpSource(p, hint)
    return StateDictSource(p)


def row_ranges(rows: int, step: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` covering ``0 .. rows`` in steps of ``step`` rows."""
    for lo in range(0, rows, max(1, step)):
        yield lo, min(rows, lo + step)


def check_keys(model: torch.nn.Module, saved: Mapping[str, Any], where: str) -> None:
    """The checkpoint's keys and shapes (``saved``: key -> shape) are exactly the
    model's state dict's, both ways.

    Raises:
        CheckpointError: names the missing and unexpected keys, or the first key whose
            shape differs, and what to check.
    """
    state = model.state_dict()
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {where} does not match the model: missing keys {missing[:5]}, "
            f"unexpected keys {unexpected[:5]}; it was written for another model: check "
            "--factory, or re-train")
    for k, t in state.items():
        if tuple(saved[k]) != tuple(t.shape):
            raise CheckpointError(f"checkpoint {where}: {k} has shape {tuple(saved[k])}, the "
                                  f"model needs {tuple(t.shape)}; check --factory, or re-train")
