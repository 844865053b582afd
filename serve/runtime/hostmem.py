"""Host memory the device reads: page-locked in place, mapped into the device, and the
host side of the embedding cache.

* :func:`device_guard`: run CUDA work of a runtime on its own device;
* :func:`page_exclusive_empty`: host memory of its own pages, so page-locking it in place
  (``cudaHostRegister``, through a process-wide reference-counted registry) can never
  collide with memory registered before;
* :func:`host_mapped_view`: a CUDA tensor aliasing pinned host memory (zero-copy);
* :class:`HostRows`: every row of a cache's table in host memory, and the miss path
  that brings missed rows to the device (``"host"``: a host gather into two pinned
  staging buffers, one async copy each; ``"mapped"``: the GPU gathers them itself).

The memory is page-locked exactly (no copy, and not PyTorch's caching host allocator,
which rounds every block up to a power of two: a 2.3 GB table used to pin 4 GiB per
worker), and unregistered by :meth:`HostRows.close` (or when it is collected).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.dlpack

from serve.errors import ConfigError

__all__ = ["MISS_PATHS", "STAGING_BYTES", "HostRows", "device_guard", "host_mapped_view",
           "page_exclusive_empty", "with_index"]

log = logging.getLogger(__name__)

# "host": gather misses on the host into a pinned buffer, one async copy in (default).
# "mapped": the GPU gathers misses itself from the pinned host table (zero-copy over the
# bus, no host round trip for the miss ids); opt-in, see host_mapped_view.
MISS_PATHS = ("host", "mapped")
#: Bytes of each of the two pinned staging buffers of the host miss path (CUDA). Misses
#: beyond it go through in chunks; 4 MiB is 61k rows of 68 bytes, where the host gather
#: already runs near its best rate (docs/stack.md: 1.9e8 rows/s at 65k rows per call).
STAGING_BYTES = 4 << 20
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every device (a runtime
# on cuda:1) and mapped into the device address space (the "mapped" miss path).
_HOST_REGISTER_FLAGS = 1 | 2

def device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` on CUDA (kernels, streams, events and graphs of a
    runtime on cuda:1 then go to cuda:1 whatever device is current), else a no-op."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


def _no_delete_py(_: int) -> None:   # the pinned tensor owns the memory; nothing to free
    return None


# A C callback made from the function above (the CFUNCTYPE applied as a call rather than
# as a decorator, which mypy would see as untyped).
_no_delete = _DELETER(_no_delete_py)


def with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` of the current device, so streams, events and the mapped view
    name the device the tensors really live on (the current device may change later)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def host_mapped_view(pinned: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
    """A CUDA tensor aliasing a pinned 2-d uint8 host tensor (zero-copy, read over the bus).

    Under unified virtual addressing, page-locked memory (``cudaHostAlloc``, what
    ``pin_memory`` uses, or ``cudaHostRegister``, what the cache uses) is mapped into
    every device at the same address, so a DLPack capsule that labels the host pointer as
    CUDA memory gives a tensor kernels can read (what FBGEMM's UVM tables and CuPy's
    ``UnownedMemory`` do; stock PyTorch has no API). Returns ``(view, keepalive)``: keep
    both, and ``pinned``, alive together, and the memory pinned while the view is used.
    Do not use it where UVA is off or for pageable memory: reads would fault.
    """
    if pinned.dtype != torch.uint8 or pinned.dim() != 2 or not pinned.is_pinned():
        raise ConfigError("host_mapped_view needs a pinned 2-d uint8 tensor")
    if not pinned.is_contiguous():
        raise ConfigError("host_mapped_view needs a contiguous tensor")
    return _alias_via_dlpack(pinned, 2, with_index(device).index or 0)   # 2 = kDLCUDA


def _alias_via_dlpack(t: torch.Tensor, device_type: int,
                      device_id: int) -> tuple[torch.Tensor, object]:
    """A tensor over ``t``'s memory, labelled as on DLPack device (type, id); the CPU
    tests exercise the capsule with type 1 (kDLCPU)."""
    shape = (ctypes.c_int64 * 2)(*t.shape)
    strides = (ctypes.c_int64 * 2)(t.shape[1], 1)
    mt = _DLManagedTensor()
    mt.dl_tensor = _DLTensor(ctypes.c_void_p(t.data_ptr()), _DLDevice(device_type, device_id),
                             2, _DLDataType(1, 8, 1), shape, strides, 0)  # kDLUInt, 8 bits
    mt.manager_ctx = None
    mt.deleter = _no_delete
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(mt), b"dltensor", None)
    view = torch.utils.dlpack.from_dlpack(capsule)
    return view, (mt, shape, strides, capsule, t)


# -- page-locking host memory in place ---------------------------------------------------

def page_exclusive_empty(rows: int, row_bytes: int) -> torch.Tensor:
    """uint8 (rows, row_bytes), uninitialised, in anonymous memory of its own pages.

    The driver page-locks whole pages, and ``cudaHostRegister`` refuses a range that
    shares a page with one registered before; memory from its own ``mmap`` shares a page
    with nothing, so registering it can never collide. The tensor keeps the mapping alive.
    """
    n = rows * row_bytes
    buf = mmap.mmap(-1, max(n, 1))
    return torch.frombuffer(buf, dtype=torch.uint8, count=n).view(rows, row_bytes)


def _cudart() -> Any:
    """The CUDA runtime's bindings (torch ships ``cudart`` without annotations)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _cuda_host_register(ptr: int, nbytes: int) -> int:
    return int(_cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_FLAGS))


def _cuda_host_unregister(ptr: int) -> int:
    return int(_cudart().cudaHostUnregister(ptr))


def _cuda_error_string(err: int) -> str:
    try:
        return str(_cudart().cudaGetErrorString(err))
    except Exception:  # noqa: BLE001 - only for a message
        return "unknown error"


@dataclass
class _Registration:
    storage: torch.UntypedStorage     # keeps the memory alive while it is registered
    first_page: int
    end_page: int
    refs: int


class _HostRegistry:
    """Host memory this process page-locked with ``cudaHostRegister``, by storage.

    Registration is per storage (the allocation behind a tensor), reference-counted: two
    caches over one table register it once, and the last to let go unregisters it. An
    entry holds its storage, so the memory cannot be freed while registered.

    Args:
        register / unregister: ``(ptr, nbytes) -> cudaError`` and ``(ptr) -> cudaError``
            (production: libcudart through ``torch.cuda.cudart()``; tests pass fakes).
        page: the host page size, the driver's granularity.
    """

    def __init__(self, register: Callable[[int, int], int] = _cuda_host_register,
                 unregister: Callable[[int], int] = _cuda_host_unregister,
                 page: int = mmap.PAGESIZE) -> None:
        self._register, self._unregister, self._page = register, unregister, page
        self._lock = threading.Lock()
        self._entries: dict[int, _Registration] = {}

    def acquire(self, t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Page-lock a contiguous CPU tensor's memory; returns ``(table, key)``.

        ``table`` is ``t`` itself, registered in place (no copy), or, only when ``t``
        shares a page with memory registered here before (the driver would refuse it), a
        page-exclusive copy registered instead. ``key`` is for :meth:`release`; None when
        ``t`` was pinned already by someone else (e.g. ``pin_memory()``), who keeps it.

        Raises:
            RuntimeError: the driver refused the registration (message names the error).
        """
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.refs += 1
                return t, key
            first, end = key // self._page, -(-(key + storage.nbytes()) // self._page)
            if any(e.first_page < end and first < e.end_page for e in self._entries.values()):
                log.info("the %d-byte host table shares a page with memory registered "
                         "before; page-locking a page-exclusive copy of it", t.numel())
                copy = page_exclusive_empty(*t.shape)
                copy.copy_(t)
                t, storage = copy, copy.untyped_storage()
                key = storage.data_ptr()
                first, end = key // self._page, -(-(key + storage.nbytes()) // self._page)
            elif t.is_pinned():
                return t, None
            err = self._register(key, storage.nbytes())
            if err != 0:
                raise RuntimeError(
                    f"cudaHostRegister of the {storage.nbytes()}-byte host table failed "
                    f"(cudaError {err}: {_cuda_error_string(err)}); the cache's copies and "
                    "the mapped miss path need it page-locked: check the host's free "
                    "memory, or pass a table pinned with tensor.pin_memory()")
            self._entries[key] = _Registration(storage, first, end, 1)
            return t, key

    def release(self, key: int) -> None:
        """Drop one reference; the last one unregisters the memory."""
        with self._lock:
            entry = self._entries[key]
            entry.refs -= 1
            if entry.refs:
                return
            del self._entries[key]
            err = self._unregister(key)
        if err != 0:
            log.warning("cudaHostUnregister failed (cudaError %d: %s); the host table "
                        "stays page-locked until the process exits", err,
                        _cuda_error_string(err))

    def registered_bytes(self, key: int | None) -> int:
        """Bytes page-locked under ``key`` (0 for None or a released key)."""
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
        return entry.storage.nbytes() if entry is not None else 0


_HOST_REGISTRY = _HostRegistry()


def _release_host(registry: _HostRegistry, key: int, device: torch.device) -> None:
    """Finalizer of a cache: wait for the device's queued work (a mapped gather may still
    read the table), then unregister its host table. Never raises."""
    try:
        torch.cuda.synchronize(device)
        registry.release(key)
    except Exception as e:  # noqa: BLE001 - also runs at interpreter exit
        log.debug("releasing host registration %#x: %s", key, e)


class HostRows:
    """Every row of a table in host memory, and the path that brings missed rows to the
    device (the host side of :class:`serve.runtime.cache.EmbeddingCache`).

    Args:
        table: uint8 (R, row_bytes), contiguous, on the CPU. When ``device`` is CUDA its
            memory is page-locked in place (``cudaHostRegister``, no copy) unless it is
            pinned already; :meth:`close` unregisters it. Give it memory of its own pages
            (:func:`page_exclusive_empty`): a table sharing a page with one registered
            before is copied once to be registered.
        device: where the missed rows go (CUDA: ``cuda:N``, see :func:`with_index`).
        miss_path: one of :data:`MISS_PATHS` (CUDA only; on CPU always "host").
        staging_bytes: bytes of each of the two pinned staging buffers ("host", CUDA).
    """

    def __init__(self, table: torch.Tensor, device: torch.device, miss_path: str = "host",
                 staging_bytes: int = STAGING_BYTES) -> None:
        self.device = device
        self.row_bytes = int(table.shape[1])
        self._staging_rows = staging_bytes // self.row_bytes
        table = table.cpu()
        self._key: int | None = None
        self._finalizer: weakref.finalize[..., HostRows] | None = None
        if device.type == "cuda":
            if not table.is_contiguous():
                raise ConfigError("the host table must be contiguous to be page-locked in "
                                  "place; pass table.contiguous()")
            with device_guard(device):
                table, self._key = _HOST_REGISTRY.acquire(table)
            if self._key is not None:
                self._finalizer = weakref.finalize(self, _release_host, _HOST_REGISTRY,
                                                   self._key, device)
        #: uint8 (R, row_bytes): every row, in host memory (page-locked on CUDA).
        self.table = table
        self.miss_path = miss_path if device.type == "cuda" else "host"
        #: The table as a CUDA tensor over the bus ("mapped"), else None.
        self.mapped: torch.Tensor | None = None
        self._mapped_keep: object = None
        if self.miss_path == "mapped":
            with device_guard(device):
                self.mapped, self._mapped_keep = host_mapped_view(table, device)
        # Host miss path (CUDA): two pinned buffers used in turn, each with the event of
        # the last copy out of it.
        self._staging: list[torch.Tensor] = []
        self._staging_events: list[torch.cuda.Event | None] = [None, None]
        self._next_staging = 0

    @property
    def nbytes(self) -> int:
        return self.table.numel()

    @property
    def total_rows(self) -> int:
        return int(self.table.shape[0])

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Overwrite ``rows`` (int64 (n,) CPU) with ``data`` uint8 (n, row_bytes) CPU."""
        self.table.index_copy_(0, rows, data)

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked here with ``cudaHostRegister`` (0 on CPU, after
        :meth:`close`, or when the table came pinned already); staging buffers excluded."""
        return _HOST_REGISTRY.registered_bytes(self._key)

    @property
    def device_readable(self) -> bool:
        """Whether the device reads the rows itself (CPU, or CUDA with "mapped")."""
        return self.device.type == "cpu" or self.mapped is not None

    def source(self) -> torch.Tensor:
        """The table as the device reads it (check :attr:`device_readable` first)."""
        return self.mapped if self.mapped is not None else self.table

    def _staging_chunks(self, m: int) -> Iterator[tuple[int, int, torch.Tensor,
                                                        torch.cuda.Event | None, int]]:
        """``(lo, hi, buffer, last event of that buffer, buffer index)`` per chunk of ``m``
        rows, alternating between the two pinned staging buffers."""
        n = self._staging_rows
        if not self._staging:
            self._staging = [torch.empty((n, self.row_bytes), dtype=torch.uint8,
                                         pin_memory=True) for _ in range(2)]
        for lo in range(0, m, n):
            k = self._next_staging
            self._next_staging = 1 - k
            yield lo, min(lo + n, m), self._staging[k], self._staging_events[k], k

    def fetch(self, rows: torch.Tensor) -> torch.Tensor:
        """Host rows -> device: uint8 (M, row_bytes). ``rows`` int64 on the device."""
        if self.device.type != "cuda":
            return self.table.index_select(0, rows.cpu())
        if self.mapped is not None:   # the GPU reads the rows over the bus: no sync
            return self.mapped.index_select(0, rows)
        idx = rows.cpu()  # one sync; the host gather needs the indices on the host
        m = idx.numel()
        out = torch.empty((m, self.row_bytes), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        for lo, hi, buf, event, k in self._staging_chunks(m):
            if event is not None:
                event.synchronize()    # the previous copy out of this buffer must be done
            part = buf[: hi - lo]
            torch.index_select(self.table, 0, idx[lo:hi], out=part)
            out[lo:hi].copy_(part, non_blocking=True)
            # Record on the stream the copy went to (the cache device's current stream):
            # with the cache on cuda:1 and cuda:0 current, an event on cuda:0 would not
            # wait for the copy, and a later gather could overwrite rows in flight.
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            done.record(stream)
            self._staging_events[k] = done
        return out

    def close(self) -> None:
        """Unregister the page-locked table once the device's queued work is done
        (idempotent); the mapped view is dropped first."""
        self.mapped = self._mapped_keep = None
        if self._finalizer is not None:
            self._finalizer()          # runs _release_host once
        self._key = None
