"""The embedding cache: hot quantized rows on the device, every row in host memory.

All F tables are concatenated into one uint8 host table of R = sum(rows) rows of
``row_bytes`` each (the artifact row format, still quantized). ``capacity`` slots of
the same format live on the device. One lookup takes the batch's U unique global rows
and returns their bytes (U, row_bytes) on the device, exactly, whatever the capacity:

1. ``row_to_slot[rows]`` (a device int32 map, -1 = absent) splits hits from misses;
2. hits are gathered from the slots, misses from the host table (host ``index_select``
   into a pinned staging buffer, then one non-blocking copy to the device);
3. misses are then admitted by policy into slots this batch did not hit (a hit row is
   never evicted by its own batch), so U > capacity still answers correctly: what does
   not fit is served from host memory and simply not kept.

Policies (victims are chosen among the slots not hit in this batch):

* ``lru``: victims are the slots with the oldest last-use step (empty slots first);
  every miss is admitted while such slots remain, most frequent in the batch first
  (ties: lower global row first). Ties among victims go to the lowest slot index.
* ``lfu``: the cache counts every access of every row (also of rows not resident), and
  a miss replaces the least-frequently used slot only if its count is strictly higher
  than that slot's (empty slots always admit). Misses with the highest counts go in
  first; ties among victims go to the lowest slot index.

LFU counts (int32, one per table row) saturate at 2**31 - 1 instead of wrapping, and
they age: every ``lfu_decay_every`` ids looked up, every count (resident rows' too:
a slot's count is its row's) is halved by one right shift, so a row that was hot
yesterday loses its lead geometrically once the traffic moves on, and a count can
never exceed about 2 x ``lfu_decay_every``. The default period is
``LFU_DECAY_PER_ROW`` x the table's rows (ids, not batches): long enough that the
counts rank rows as well as undecayed ones on static traffic (bench/bench_runtime.py
measures both), short enough that the hot set follows a shift in the traffic.
Without aging, a row's count only grows: under int32 wrap-around one very hot row
of a tiny table went negative within hours at GPU rates, was evicted first and never
admitted again.

Counters are per id (access), not per unique row: ``hits`` counts the ids whose row
was resident when the batch arrived, so ``hits / lookups`` is comparable with the
ideal top-k hit ratio of the id distribution.

Two lookups share this state:

* :meth:`EmbeddingCache.lookup` (any policy, any batch): unique rows in, exact bytes
  out; host syncs only to size the miss gather (and, for LFU, the admitted count).
* :meth:`EmbeddingCache.lookup_static` (LRU, fixed shapes, no host sync, so a CUDA
  graph can capture it): needs the misses readable by the device (``miss_path="mapped"``:
  the GPU reads the pinned host table over the bus) and capacity >= 2 x ids.

Host memory on CUDA: the host table is page-locked in place with ``cudaHostRegister``
(exactly its bytes; no copy, and not PyTorch's caching host allocator, which rounds
every block up to a power of two: a 2.3 GB table used to pin 4 GiB per worker), and
unregistered by :meth:`EmbeddingCache.close` (or when the cache is collected). The
host miss path stages rows through two small pinned buffers (``STAGING_BYTES`` each),
in chunks, so its pinned memory stays fixed whatever a batch misses.

Miss paths on CUDA: "host" (default) gathers on the host into a pinned buffer and copies
once per chunk; "mapped" lets the GPU gather from the pinned table itself. Measured elsewhere on an
H200 (docs/stack.md) the two move rows at about the same rate (1-2.7e8 rows/s); "mapped"
needs no host round trip of the miss ids, which is what makes the captured path possible.
``bench/gpu_check.py`` measures both again.

The code is device-agnostic: ``device="cpu"`` runs exactly the same tensor program,
which is how the CPU tests cover it. On CPU it only costs time (device memory is host
memory), so the runtime does not use it there unless asked to.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.utils.dlpack

from serve.common.validate import int_at_least
from serve.constants import CACHE_POLICIES
from serve.errors import ConfigError

__all__ = ["LFU_DECAY_PER_ROW", "MISS_PATHS", "POLICIES", "STAGING_BYTES", "CacheCounters",
           "EmbeddingCache", "capacity_for", "device_guard", "host_mapped_view",
           "page_exclusive_empty", "resolve_decay_every"]

log = logging.getLogger(__name__)

POLICIES = CACHE_POLICIES  # defined once in serve.constants
# "host": gather misses on the host into a pinned buffer, one async copy in (default).
# "mapped": the GPU gathers misses itself from the pinned host table (zero-copy over the
# bus, no host round trip for the miss ids); opt-in, see host_mapped_view.
MISS_PATHS = ("host", "mapped")
# Key of a slot nobody may take (hit in this batch) when victims are chosen by topk.
_NEVER = torch.iinfo(torch.int64).max
_LOWEST = torch.iinfo(torch.int64).min
# LFU counts saturate here (int32). Victim keys are count * 2**32 + slot: at most
# (2**31 - 1) * 2**32 + (2**31 - 1) < _NEVER, so a saturated count still sorts below a hit.
_FREQ_MAX = torch.iinfo(torch.int32).max
#: Default LFU aging period, in ids looked up per table row: the counts are halved every
#: ``LFU_DECAY_PER_ROW * total_rows`` ids. Measured with bench/bench_runtime.py: 8 costs
#: at most 0.003 of hit ratio against never aging on the static Zipf grid, and gains up
#: to 0.024 over it once the hot set moves (4 gained more there but cost up to 0.005 on
#: static traffic; 1 cost up to 0.03).
LFU_DECAY_PER_ROW = 8
#: Bytes of each of the two pinned staging buffers of the host miss path (CUDA). Misses
#: beyond it go through in chunks; 4 MiB is 61k rows of 68 bytes, where the host gather
#: already runs near its best rate (docs/stack.md: 1.9e8 rows/s at 65k rows per call).
STAGING_BYTES = 4 << 20
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every device (a runtime
# on cuda:1) and mapped into the device address space (the "mapped" miss path).
_HOST_REGISTER_FLAGS = 1 | 2

_F = TypeVar("_F", bound=Callable[..., Any])


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` on CUDA (kernels, streams, events and graphs of a
    runtime on cuda:1 then go to cuda:1 whatever device is current), else a no-op."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _on_own_device(fn: _F) -> _F:
    """Run a method under :func:`device_guard` of ``self.device``."""
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with device_guard(self.device):
            return fn(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def resolve_decay_every(decay_every: int | None, total_rows: int) -> int:
    """The LFU aging period in ids: ``decay_every`` if given (0 = never age), else
    ``LFU_DECAY_PER_ROW * total_rows``."""
    if decay_every is None:
        return LFU_DECAY_PER_ROW * total_rows
    return int_at_least("lfu_decay_every", decay_every, 0,
                        then=" (ids between halvings of the LFU counts; 0 = never), or None "
                             f"for the default {LFU_DECAY_PER_ROW} x the table's rows")


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


def _pin_index(device: torch.device) -> torch.device:
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
    return _alias_via_dlpack(pinned, 2, _pin_index(device).index or 0)   # 2 = kDLCUDA


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


def capacity_for(total_rows: int, row_bytes: int, *, load_factor: float | None,
                 cache_bytes: int | None) -> int:
    """Slots for a cache: ``cache_bytes // row_bytes`` if given, else
    ``ceil(load_factor * total_rows)``; at least 1, at most ``total_rows``.

    ``cache_bytes`` counts slot payload only (the row map and policy state come on top;
    ``EmbeddingCache.device_bytes`` reports all of it).
    """
    if cache_bytes is not None:
        if cache_bytes < row_bytes:
            raise ConfigError(f"cache_bytes {cache_bytes} is smaller than one row "
                              f"({row_bytes} bytes); give at least {row_bytes}")
        cap = cache_bytes // row_bytes
    elif load_factor is not None:
        cap = -(-round(load_factor * total_rows * 1e6) // 1_000_000)  # ceil, float-safe
    else:
        cap = total_rows
    return max(1, min(int(cap), total_rows))


@dataclass
class CacheCounters:
    """Cumulative counters (ids, not unique rows); ``lfu_decays``: halvings of the LFU
    counts so far (0 for LRU)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    lfu_decays: int = 0


class EmbeddingCache:
    """Device-resident slots over a host-resident quantized table.

    Args:
        host_table: uint8 (R, row_bytes), contiguous, on the CPU. When ``device`` is CUDA
            its memory is page-locked in place (``cudaHostRegister``, no copy) unless it
            is pinned already; :meth:`close` unregisters it. Give it memory of its own
            pages (:func:`page_exclusive_empty`, what the runtime does): a table sharing a
            page with one registered before is copied once to be registered.
        capacity: device slots, 1..R.
        policy: "lru" or "lfu".
        device: where the slots and the policy state live.
        miss_path: "host" (host gather + async copy) or "mapped" (the GPU reads the pinned
            host table directly; CUDA only, ignored on CPU).
        lfu_decay_every: LFU only: halve every count after this many ids looked up
            (0 = never; None = ``LFU_DECAY_PER_ROW`` x R).
        staging_bytes: bytes of each of the two pinned staging buffers of the host miss
            path (CUDA); at least one row.

    Not thread-safe: one caller at a time. Do not use it where the host table cannot be
    page-locked (the CUDA copies need it); on CPU nothing is pinned.

    Example::

        cache = EmbeddingCache(table, capacity=1000, policy="lru", device="cpu")
        rows, inverse, counts = torch.unique(global_ids, return_inverse=True, return_counts=True)
        row_bytes = cache.lookup(rows, counts)        # (U, row_bytes) uint8 on the device
    """

    def __init__(self, host_table: torch.Tensor, capacity: int, policy: str = "lru",
                 device: str | torch.device = "cpu", miss_path: str = "host",
                 lfu_decay_every: int | None = None,
                 staging_bytes: int = STAGING_BYTES) -> None:
        if miss_path not in MISS_PATHS:
            raise ConfigError(f"cache miss path {miss_path!r} is not one of {MISS_PATHS}")
        if policy not in POLICIES:
            raise ConfigError(f"cache_policy {policy!r} is not one of {POLICIES}; "
                              "choose 'lru' or 'lfu'")
        if host_table.dtype != torch.uint8 or host_table.dim() != 2:
            raise ConfigError(f"host table must be uint8 (rows, row_bytes), got "
                              f"{host_table.dtype} {tuple(host_table.shape)}")
        total = host_table.shape[0]
        if not 1 <= capacity <= total:
            raise ConfigError(f"cache capacity {capacity} must be in 1..{total} (the table's rows)")
        self.device = _pin_index(torch.device(device))
        self.policy = policy
        self.capacity = int(capacity)
        self.total_rows = int(total)
        self.row_bytes = int(host_table.shape[1])
        if staging_bytes < self.row_bytes:
            raise ConfigError(f"staging_bytes {staging_bytes} is smaller than one row "
                              f"({self.row_bytes} bytes); give at least {self.row_bytes}")
        self.lfu_decay_every = resolve_decay_every(lfu_decay_every, self.total_rows)
        self._staging_rows = staging_bytes // self.row_bytes
        host_table = host_table.cpu()
        self._host_key: int | None = None
        self._finalizer: weakref.finalize[..., EmbeddingCache] | None = None
        if self.device.type == "cuda":
            if not host_table.is_contiguous():
                raise ConfigError("the host table must be contiguous to be page-locked in "
                                  "place; pass table.contiguous()")
            with device_guard(self.device):
                host_table, self._host_key = _HOST_REGISTRY.acquire(host_table)
            if self._host_key is not None:
                self._finalizer = weakref.finalize(self, _release_host, _HOST_REGISTRY,
                                                   self._host_key, self.device)
        self.host_table = host_table
        self.miss_path = miss_path if self.device.type == "cuda" else "host"
        self._mapped: torch.Tensor | None = None
        self._mapped_keep: object = None
        self._closed = False
        with device_guard(self.device):
            self._init_device_state()

    def _init_device_state(self) -> None:
        if self.miss_path == "mapped":
            self._mapped, self._mapped_keep = host_mapped_view(self.host_table, self.device)
        dev = self.device
        cap, rows = self.capacity, self.total_rows
        # Each array has one extra entry at its end (slot `capacity`, row `total_rows`):
        # a dump for the writes the fixed-shape path masks out (see lookup_static), so it
        # needs no data-dependent shapes. It is never resident and never a victim.
        self.slots = torch.zeros((cap + 1, self.row_bytes), dtype=torch.uint8, device=dev)
        self.row_to_slot = torch.full((rows + 1,), -1, dtype=torch.int32, device=dev)
        self.slot_to_row = torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)
        # Last use as a unique key: step * capacity + slot (empty: -capacity + slot), so
        # the LRU victims are the k smallest keys with no extra pass to break ties.
        self.slot_last_use = torch.arange(cap + 1, dtype=torch.int64, device=dev) - cap
        # LFU keeps per-row access counts: int32 (4 bytes per table row on the device),
        # saturating at _FREQ_MAX and halved every lfu_decay_every ids (module docstring).
        self.row_freq = (torch.zeros((rows,), dtype=torch.int32, device=dev)
                         if self.policy == "lfu" else None)
        self._ids_since_decay = 0
        self._decays = 0
        # The step lives on the device so a captured CUDA graph advances it too.
        self._step = torch.zeros((), dtype=torch.int64, device=dev)
        # lookups, hits, evictions: summed on the device so a batch needs no sync for them
        self._count = torch.zeros(3, dtype=torch.int64, device=dev)
        # Host miss path (CUDA): two pinned buffers used in turn, each with the event of
        # the last copy out of it.
        self._staging: list[torch.Tensor] = []
        self._staging_events: list[torch.cuda.Event | None] = [None, None]
        self._next_staging = 0

    @property
    def counters(self) -> CacheCounters:
        """A snapshot of the cumulative counters (one device sync)."""
        with device_guard(self.device):
            lookups, hits, evictions = (int(x) for x in self._count.tolist())
        return CacheCounters(lookups=lookups, hits=hits, misses=lookups - hits,
                             evictions=evictions, lfu_decays=self._decays)

    # -- sizes -------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Slots + row map + policy state, in bytes."""
        n = (self.slots.numel() + self.row_to_slot.numel() * 4 + self.slot_to_row.numel() * 8
             + self.slot_last_use.numel() * 8)
        return n + (self.row_freq.numel() * 4 if self.row_freq is not None else 0)

    @property
    def host_bytes(self) -> int:
        return self.host_table.numel()

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this cache page-locked with ``cudaHostRegister`` (0 on CPU, after
        :meth:`close`, or when the table came pinned already); staging buffers excluded."""
        return _HOST_REGISTRY.registered_bytes(self._host_key)

    @_on_own_device
    def resident_rows(self) -> torch.Tensor:
        """Sorted global rows now on the device (int64, CPU); for tests and tools."""
        res = self.slot_to_row[: self.capacity]
        return torch.sort(res[res >= 0]).values.cpu()

    def close(self) -> None:
        """Unregister the page-locked host table once the device's queued work is done
        (idempotent). The cache answers no lookup afterwards; drop any CUDA graph that
        captured ``lookup_static`` first (``Runtime.close`` does)."""
        self._closed = True
        self._mapped = self._mapped_keep = None
        if self._finalizer is not None:
            self._finalizer()          # runs _release_host once
        self._host_key = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EmbeddingCache is closed (its host table is no longer "
                               "page-locked); build a new one")

    # -- the miss path -------------------------------------------------------------------
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

    def _fetch(self, rows: torch.Tensor) -> torch.Tensor:
        """Host rows -> device: uint8 (M, row_bytes). ``rows`` int64 on the device."""
        if self.device.type != "cuda":
            return self.host_table.index_select(0, rows.cpu())
        if self._mapped is not None:   # the GPU reads the rows over the bus: no sync
            return self._mapped.index_select(0, rows)
        idx = rows.cpu()  # one sync; the host gather needs the indices on the host
        m = idx.numel()
        out = torch.empty((m, self.row_bytes), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        for lo, hi, buf, event, k in self._staging_chunks(m):
            if event is not None:
                event.synchronize()    # the previous copy out of this buffer must be done
            part = buf[: hi - lo]
            torch.index_select(self.host_table, 0, idx[lo:hi], out=part)
            out[lo:hi].copy_(part, non_blocking=True)
            # Record on the stream the copy went to (the cache device's current stream):
            # with the cache on cuda:1 and cuda:0 current, an event on cuda:0 would not
            # wait for the copy, and a later gather could overwrite rows in flight.
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            done.record(stream)
            self._staging_events[k] = done
        return out

    # -- one batch -----------------------------------------------------------------------
    @_on_own_device
    def lookup(self, rows: torch.Tensor, counts: torch.Tensor | None = None,
               n_ids: int | None = None) -> torch.Tensor:
        """Bytes of ``rows`` on the device, then admit misses by policy.

        Args:
            rows: int64 (U,) distinct global rows in [0, R), on the device.
            counts: int64 (U,) accesses of each row in this batch (None: ones); they
                weight the counters and the LFU counts.
            n_ids: ids behind ``rows`` (= ``counts.sum()``), for the LFU aging schedule;
                callers that know it on the host pass it to spare a device sync.
        Returns:
            uint8 (U, row_bytes) on the device, row i holding ``rows[i]``.

        Host syncs per call: the miss count (to size the host gather), the miss rows'
        transfer to the host, and for LFU the number admitted (and ``counts.sum()``
        when ``n_ids`` is not given); counters stay on the device.
        """
        self._check_open()
        dev = self.device
        rows = rows.to(dev)
        u = rows.numel()
        if counts is None:
            counts = torch.ones(u, dtype=torch.int64, device=dev)
            n_ids = u
        else:
            counts = counts.to(device=dev, dtype=torch.int64)
        self._step.add_(1)
        now = self._step * self.capacity  # last-use keys >= now: touched in this batch
        slot = self.row_to_slot.index_select(0, rows).long()       # (U,), -1 = absent
        hit = slot >= 0
        # Gather every row from the slots (misses read slot 0 and are overwritten below):
        # no sync to split hits from misses on this side.
        out = self.slots.index_select(0, slot.clamp_min(0))
        # Refresh the hit slots' last use; amax leaves the slot misses point at alone
        # (their value is below every key, empty slots' negative keys included).
        self.slot_last_use.scatter_reduce_(
            0, slot.clamp_min(0), torch.where(hit, slot + now, torch.full_like(slot, _LOWEST)),
            reduce="amax")
        if self.row_freq is not None:
            # Saturating add (rows are distinct): an int32 index_add_ would wrap negative.
            freq = self.row_freq.index_select(0, rows).long().add_(counts).clamp_max_(_FREQ_MAX)
            self.row_freq.index_copy_(0, rows, freq.int())
        self._count[:2].add_(torch.stack((counts.sum(), (counts * hit).sum())))
        miss_idx = (~hit).nonzero().squeeze(1)                     # sync: sizes the fetch
        n_miss = miss_idx.numel()
        if n_miss:
            miss_rows = rows.index_select(0, miss_idx)
            fetched = self._fetch(miss_rows)
            out.index_copy_(0, miss_idx, fetched)
            self._admit(miss_rows, counts.index_select(0, miss_idx), fetched,
                        n_hits=u - n_miss, now=now)
        if self.row_freq is not None:
            self._age(n_ids if n_ids is not None else int(counts.sum()))
        return out

    def _age(self, n_ids: int) -> None:
        """LFU aging: one right shift of every count per ``lfu_decay_every`` ids seen."""
        if self.row_freq is None or self.lfu_decay_every == 0:
            return
        self._ids_since_decay += n_ids
        k, self._ids_since_decay = divmod(self._ids_since_decay, self.lfu_decay_every)
        if k:
            torch.bitwise_right_shift(self.row_freq, min(k, 31), out=self.row_freq)
            self._decays += k

    def _admit(self, miss_rows: torch.Tensor, miss_counts: torch.Tensor,
               fetched: torch.Tensor, *, n_hits: int, now: torch.Tensor) -> None:
        """Put misses into victim slots, counting evictions (on the device)."""
        k = min(miss_rows.numel(), self.capacity - n_hits)
        if k <= 0:
            return
        if self.policy == "lru":
            # Candidates: the batch's most frequent misses first (ties: lower row first).
            cand_key = miss_counts
            # Hits of this batch hold the largest keys, so the k smallest never include
            # them (k <= capacity - hits); empty slots (negative keys) go first. Keys are
            # unique, so topk's choice, and every later eviction, is deterministic.
            key = self.slot_last_use[: self.capacity]
        else:
            if self.row_freq is None:
                raise RuntimeError("LFU cache without access counts")
            cand_key = self.row_freq.index_select(0, miss_rows).long()
            resident = self.slot_to_row[: self.capacity]
            last = self.slot_last_use[: self.capacity]
            freq = torch.where(resident >= 0,
                               self.row_freq.index_select(0, resident.clamp_min(0)).long(),
                               torch.full_like(resident, -1))
            # LFU key: access count (empty = -1, below every count), ties to the lower
            # slot; hits excluded. Fits int64 even for saturated counts (see _FREQ_MAX).
            slot_ids = torch.remainder(last, self.capacity)
            key = torch.where(last >= now, torch.full_like(freq, _NEVER),
                              freq * (1 << 32) + slot_ids)
        cand = torch.sort(cand_key, descending=True, stable=True).indices[:k]
        victims = torch.topk(key, k, largest=False, sorted=True).indices
        if self.policy == "lfu":
            # Candidates descend in count and victims ascend, so the admitted pairs are a
            # prefix: a miss whose count is not above its victim's stays out (it was
            # served from host memory this time).
            n_ok = int((cand_key.index_select(0, cand) > freq.index_select(0, victims)).sum())
            if n_ok == 0:
                return
            cand, victims = cand[:n_ok], victims[:n_ok]
        new_rows = miss_rows.index_select(0, cand)
        old_rows = self.slot_to_row.index_select(0, victims)
        occupied = old_rows >= 0
        self._count[2:].add_(occupied.sum())
        # Unmap the evicted rows. An empty victim slot has no row (-1): point its write at
        # the incoming row instead, whose entry is set right after (same stream, in order),
        # so no boolean-mask sync is needed.
        self.row_to_slot.index_fill_(0, torch.where(occupied, old_rows, new_rows), -1)
        self.slots.index_copy_(0, victims, fetched.index_select(0, cand))
        self.slot_to_row.index_copy_(0, victims, new_rows)
        self.row_to_slot.index_copy_(0, new_rows, victims.to(torch.int32))
        self.slot_last_use.index_copy_(0, victims, victims + now)

    @_on_own_device
    def update_rows(self, rows: torch.Tensor, data: torch.Tensor) -> int:
        """Overwrite rows in place: the host table, and the device slot of every row that
        is resident (overwrite, not invalidate: the policy state (LRU keys, LFU counts)
        stays as it was, so a delta changes values, never what is cached).

        Args:
            rows: int64 (n,) global rows, unique, in 0..R-1.
            data: uint8 (n, row_bytes) the new rows, in the table's row format.
        Returns:
            how many of them were resident on the device.
        """
        self._check_open()
        rows_cpu = rows.to("cpu", dtype=torch.int64)
        data_cpu = data.to("cpu")
        self.host_table.index_copy_(0, rows_cpu, data_cpu)
        rows_d = rows_cpu.to(self.device, non_blocking=True)
        slot = self.row_to_slot.index_select(0, rows_d).long()
        resident = slot >= 0
        hit = int(resident.sum())
        if hit:
            self.slots.index_copy_(0, slot[resident], data_cpu.to(self.device)[resident])
        return hit

    def static_ok(self, n: int) -> bool:
        """Whether ``lookup_static`` may serve ``n`` ids: LRU, misses readable by the device
        (CPU, or CUDA with the mapped miss path), and at least 2n slots, so the n oldest
        slots never include one this batch hits."""
        readable = self.device.type == "cpu" or self._mapped is not None
        return self.policy == "lru" and readable and self.capacity >= 2 * n

    @_on_own_device
    def lookup_static(self, rows: torch.Tensor) -> torch.Tensor:
        """Fixed-shape lookup + LRU admission with no host sync: CUDA-graph capturable.

        Args:
            rows: int64 (n,) global rows on the device, duplicates allowed.
        Returns:
            uint8 (n, row_bytes): row i holds ``rows[i]``.

        Every id is read from its slot and from host memory (over the bus) and the right
        one kept; misses (first occurrence of each row) take the least recently used of
        the n oldest slots, in order. Writes for positions that admit nothing go to the
        dump entries. Counters as in :meth:`lookup` (per id). Check ``static_ok`` first.
        """
        self._check_open()
        cap, n = self.capacity, rows.numel()
        source = self._mapped if self._mapped is not None else self.host_table
        self._step.add_(1)
        now = self._step * cap
        slot = self.row_to_slot.index_select(0, rows).long()
        hit = slot >= 0
        safe = slot.clamp_min(0)
        out = torch.where(hit.unsqueeze(1), self.slots.index_select(0, safe),
                          source.index_select(0, rows))
        self.slot_last_use.scatter_reduce_(
            0, safe, torch.where(hit, safe + now, torch.full_like(safe, _LOWEST)), reduce="amax")
        # First occurrence of each row: only it may be admitted (one slot per row).
        order = torch.argsort(rows, stable=True)
        sorted_rows = rows.index_select(0, order)
        first_sorted = torch.ones(n, dtype=torch.bool, device=rows.device)
        first_sorted[1:] = sorted_rows[1:] != sorted_rows[:-1]
        first = torch.empty_like(first_sorted).scatter_(0, order, first_sorted)
        admit = ~hit & first
        # The j-th admitted id takes the j-th oldest slot (n oldest: never a hit of this
        # batch, since capacity >= 2n).
        victims = torch.topk(self.slot_last_use[:cap], n, largest=False, sorted=True).indices
        v = victims.index_select(0, (torch.cumsum(admit, 0) - 1).clamp_min(0))
        old = self.slot_to_row.index_select(0, v)
        evict = admit & (old >= 0)
        dump_row = torch.full_like(rows, self.total_rows)
        target = torch.where(admit, v, torch.full_like(v, cap))
        self.row_to_slot.index_fill_(0, torch.where(evict, old, dump_row), -1)
        self.slots.index_copy_(0, target, out)
        self.slot_to_row.index_copy_(0, target, torch.where(admit, rows, torch.full_like(rows, -1)))
        self.slot_last_use.index_copy_(0, target, torch.where(admit, v + now,
                                                              torch.full_like(v, _LOWEST)))
        self.row_to_slot.index_copy_(0, torch.where(admit, rows, dump_row),
                                     torch.where(admit, v, torch.full_like(v, -1)).int())
        self._count.add_(torch.stack((torch.full_like(now, n), hit.sum(), evict.sum())))
        return out
