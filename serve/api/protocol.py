"""The predict API: parse and validate request bodies, merge a batch, split results.

No TorchServe import: ``handlers/dlrm_handler.py`` adapts this to TorchServe, and the
tests drive it directly.

Requests are decoded against the served model's schema (:class:`serve.schema.ModelSchema`,
passed as ``schema=`` to :func:`parse_body` and :func:`handle_batch`; default
:data:`DEFAULT_SCHEMA`, the built-in DLRM: N = 13 dense features, F = 26 sparse features
C1..C26, at most 64 ids each). Shapes: B samples, F sparse features (the schema's
``feature_names``, in that order), N dense features (``schema.dense``), nnz = total ids
of a batch. A feature may carry at most ``min(schema.max_ids[f], max_ids_per_feature)``
ids per instance.

Three request forms, all answered with ``{"predictions": [p_0, ..., p_{B-1}]}`` (JSON,
click probabilities in (0, 1), in request order). For the built-in schema:

* rows::

      {"instances": [{"dense": [13 numbers], "sparse": {"C1": [ids], ..., "C26": [ids]}}, ...]}

* columnar (no per-instance objects: ~30% smaller and faster to parse)::

      {"dense": [[13 numbers], ...B rows],
       "sparse": {"C1": {"values": [ids...], "lengths": [B ints]}, ..., "C26": {...}}}

  ``lengths[b]`` ids of ``values`` belong to sample b, in order.

* binary columnar, ``Content-Type: application/x-dlrm-columnar`` (no JSON decoding at all:
  for high-throughput clients with large requests; build it with :func:`encode_binary`).
  Little-endian, no padding::

      offset          size      field
      0               4         magic b"DLRM"
      4               4         uint32 version = 1
      8               4         uint32 B  (instances, 1..max_instances)
      12              4         uint32 F  (must be the model's F: 26 built in)
      16              4         uint32 N  (must be the model's N: 13 built in)
      20              4*B*N     dense   float32 (B, N) row-major
      20+4BN          4*F*B     lengths int32 (F, B) feature-major: ids of feature f, sample b
      20+4BN+4FB      8*nnz     values  int64 (nnz,) feature-major, nnz = sum(lengths)

  The body must be exactly ``20 + 4*B*N + 4*F*B + 8*nnz`` bytes. It is read with
  ``numpy.frombuffer`` (views into the body where it is writable and aligned, as the
  bytearray TorchServe hands over is; copies otherwise) into the same
  :class:`ParsedRequest` the JSON forms give, so merging, the forward and the response
  are shared. Rules as for JSON: B >= 1 (more than ``max_instances`` -> 413), lengths in
  [0, the feature's cap], ids >= 0, dense finite. ``values`` starts 8-byte aligned
  only when 20 + 4*B*(N+F) is a multiple of 8 (built in: odd B); otherwise it is copied
  (a memcpy: 3 us for the 13k ids of 512 one-hot instances, whose whole parse takes
  ~35 us). Not worth it for a few instances per request, where decoding is not the
  limit: use JSON there (readable, curl-able).

Ids are JSON integers in [0, 2^63-1], parsed exactly (orjson keeps 64-bit integers;
nothing goes through float) or int64 in the binary form. Dense values are finite numbers
that fit float32.
Every violation raises a :mod:`serve.errors` exception whose message names the field
path, the value, the rule and what to do.

Rollouts (:mod:`serve.routing`): a request may send ``X-DLRM-Route-Key`` (1 to 256
characters, else 400), which keeps it on one arm of a canary or shadow rollout.
:func:`handle_batch` takes the routing as data (:class:`Split`: a mode, the candidate's
predict, a per-request decision) and runs ONE merged forward per arm; the handler binds
them to the worker's two runtimes and the control file.
"""
from __future__ import annotations

import gc
import logging
import operator
import os
import re
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from serve.constants import CACHE_POLICIES
from serve.cpu import available_cpus, threads_per_worker
from serve.errors import (
    ConfigError,
    InvalidInput,
    PayloadTooLarge,
    ServeError,
    UnsupportedMediaType,
)
from serve.profiles import get_profile
from serve.routing import MODES, ROUTE_KEY_HEADER, ROUTE_KEY_MAX_CHARS
from serve.schema import ModelSchema
from serve.state import VERSION_RE

__all__ = [
    "BINARY_MEDIA_TYPE",
    "BINARY_VERSION",
    "CACHE_ON_CPU_ENV",
    "DEFAULT_SCHEMA",
    "DELTA_DIR_ENV",
    "INT64_MAX",
    "JSON_MEDIA_TYPE",
    "ArmRun",
    "DeltaWiring",
    "HandlerConfig",
    "MergedBatch",
    "Outcome",
    "ParsedRequest",
    "RolloutWiring",
    "Split",
    "cache_on_cpu_from_env",
    "check_content_type",
    "check_route_key",
    "default_num_threads",
    "encode_binary",
    "encode_error",
    "encode_predictions",
    "example_binary",
    "example_request",
    "handle_batch",
    "merge_requests",
    "parse_body",
]

logger = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1
_F32_MAX = float(np.finfo(np.float32).max)
_INSTANCE_KEYS = frozenset(("dense", "sparse"))
_COLUMN_KEYS = frozenset(("values", "lengths"))
_ID_RULE = "ids must be JSON integers in [0, 2^63-1]"
_DENSE_RULE = "dense values must be finite JSON numbers within float32 range"
JSON_MEDIA_TYPE = "application/json"
BINARY_MEDIA_TYPE = "application/x-dlrm-columnar"
BINARY_VERSION = 1
# Media types we decode. `application/json` with or without `; charset=utf-8` (JSON is
# UTF-8 by RFC 8259). A missing Content-Type is accepted too (TorchServe passes none for
# bare clients). `application/x-dlrm-columnar` exactly (no parameters: a charset means
# nothing for binary). Anything else (form-urlencoded, as `curl -d` sends by default;
# text/plain; multipart) gets 415 and names the headers to send.
_JSON_TYPES = frozenset((JSON_MEDIA_TYPE, ""))
_MAGIC = b"DLRM"
# magic, then uint32 version, B, F, N; little-endian
_HEADER = np.dtype([("magic", "S4"), ("version", "<u4"), ("b", "<u4"), ("f", "<u4"),
                    ("n", "<u4")])
_HEADER_BYTES = _HEADER.itemsize  # 20
_BINARY_DENSE_RULE = "dense values must be finite"
_LENGTH_RULE = "lengths must be integers >= 0"

#: The built-in DLRM's request schema (N = 13, F = 26: C1..C26, at most 64 ids each): what
#: the decoders check when no ``schema`` is given.
DEFAULT_SCHEMA: ModelSchema = get_profile("small").schema()


def _names_text(names: Sequence[str]) -> str:
    """Feature names for messages, in order: ``C1..C26`` when they are a prefix numbered
    1..F (F >= 3), else all of them comma-separated."""
    m = re.fullmatch(r"(.*?)1", names[0]) if len(names) >= 3 else None
    if m is not None and all(n == f"{m.group(1)}{i}" for i, n in enumerate(names, 1)):
        return f"{names[0]}..{names[-1]}"
    return ", ".join(names)


class _Caps:
    """The effective most ids per feature for one ``cfg.max_ids_per_feature``.

    Attributes:
        arr: int64 (F,) ``min(schema.max_ids[f], cfg_cap)``.
        lo, hi: its min and max (``lo == hi``: one cap for every feature, a scalar check).
        by_model: per feature, whether the schema's max_ids is the tighter bound (the
            message then names the model's limit, not the handler's).
    """

    __slots__ = ("_cells", "arr", "by_model", "hi", "lo")

    def __init__(self, max_ids: tuple[int, ...], cfg_cap: int) -> None:
        self.arr = np.minimum(np.array(max_ids, dtype=np.int64), cfg_cap)
        self.lo, self.hi = int(self.arr.min()), int(self.arr.max())
        self.by_model = tuple(m < cfg_cap for m in max_ids)
        self._cells: dict[int, tuple[int, ...]] = {}

    def per_cell(self, n: int) -> tuple[int, ...]:
        """The cap of each (feature, sample) cell of B = ``n`` samples, feature-major
        (F*n,): for Python's reductions over small requests (memoized per n)."""
        t = self._cells.get(n)
        if t is None:
            if len(self._cells) >= 64:
                self._cells.clear()
            t = self._cells[n] = tuple(c for c in self.arr.tolist() for _ in range(n))
        return t

    def exceeded(self, lengths: np.ndarray) -> np.ndarray | None:
        """lengths (F, B) -> bool (F, B) where a cap is exceeded, or None: none is."""
        if not lengths.size or int(lengths.max()) <= self.lo:
            return None
        over = lengths > self.arr[:, None]
        return over if over.any() else None


class _Spec:
    """What the decoders need of one request schema, computed once (:func:`_spec_of`).

    Only the request-facing part of a schema matters (N, the feature names in order,
    max ids per feature; :meth:`ModelSchema.request_differences`): models that differ in
    table rows, dims or dtypes share one ``_Spec``.

    Attributes:
        names: the F feature names, request order.
        name_set: frozenset of ``names``.
        features_of: a dict -> the tuple of its F values in request order (an
            ``operator.itemgetter``; KeyError when one is missing).
        nf, nd: F and N.
        max_ids: the schema's most ids of each feature (F,).
        names_text: the names as the messages show them (:func:`_names_text`).
    """

    __slots__ = ("_caps", "features_of", "max_ids", "name_set", "names", "names_text", "nd",
                 "nf")

    def __init__(self, dense: int, names: tuple[str, ...], max_ids: tuple[int, ...]) -> None:
        self.names = names
        self.name_set = frozenset(names)
        self.nf, self.nd = len(names), dense
        self.max_ids = max_ids
        if self.nf == 1:  # itemgetter of one key returns the value, not a 1-tuple
            only = self.names[0]
            self.features_of: Callable[[Any], tuple] = lambda d: (d[only],)
        else:
            self.features_of = operator.itemgetter(*self.names)
        self.names_text = _names_text(self.names)
        self._caps: dict[int, _Caps] = {}

    def caps(self, cfg_cap: int) -> _Caps:
        """The effective caps under ``cfg.max_ids_per_feature == cfg_cap`` (memoized)."""
        c = self._caps.get(cfg_cap)
        if c is None:
            if len(self._caps) >= 16:
                self._caps.clear()
            c = self._caps[cfg_cap] = _Caps(self.max_ids, cfg_cap)
        return c

    def sparse_example(self, cell: str) -> str:
        """``{"C1": <cell>, ..., "C26": <cell>}`` for messages (all names when F <= 2)."""
        if self.nf <= 2:
            return "{" + ", ".join(f'"{n}": {cell}' for n in self.names) + "}"
        return f'{{"{self.names[0]}": {cell}, ..., "{self.names[-1]}": {cell}}}'


@lru_cache(maxsize=16)
def _build_spec(dense: int, names: tuple[str, ...], max_ids: tuple[int, ...]) -> _Spec:
    return _Spec(dense, names, max_ids)


def _request_key(schema: ModelSchema) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    """What requests must match of ``schema``: (N, feature names, max ids per feature)."""
    return schema.dense, schema.feature_names, schema.max_ids


_DEFAULT_SPEC = _build_spec(*_request_key(DEFAULT_SCHEMA))
# id(schema) -> (schema, spec): reading a ModelSchema's request key costs ~5 us (and
# hashing it ~7 us), a good part of a small request's fast path; an identity hit ~0.1 us.
_SPEC_BY_ID: dict[int, tuple[ModelSchema, _Spec]] = {}


def _spec_of(schema: ModelSchema | None) -> _Spec:
    """The decoders' helpers for ``schema`` (None: :data:`DEFAULT_SCHEMA`), built once per
    request schema (``functools.lru_cache`` keyed by N, names and max ids) and found by
    the schema object's identity afterwards.

    Raises:
        TypeError: ``schema`` is not a ModelSchema.
    """
    if schema is None:
        return _DEFAULT_SPEC
    hit = _SPEC_BY_ID.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    if not isinstance(schema, ModelSchema):
        raise TypeError(f"schema must be a serve.schema.ModelSchema or None, got "
                        f"{type(schema).__name__}")
    spec = _build_spec(*_request_key(schema))
    if len(_SPEC_BY_ID) >= 16:
        _SPEC_BY_ID.clear()
    _SPEC_BY_ID[id(schema)] = (schema, spec)
    return spec


def default_num_threads(workers: int, cores: int | None = None) -> int:
    """torch intra-op threads per worker from the CPU budget: cores / workers, at least 1.

    ``cores`` defaults to the CPUs the process can really use,
    :func:`serve.cpu.available_cpus`: min(CPU affinity, ceil(cgroup CPU quota)), so a pod
    with a 4-CPU limit on a 64-core node counts 4, not 64. More threads than that
    oversubscribe the CPUs (STACK.md measured up to 10x loss). This is the budget alone:
    the handler's full rule (``handler.num_threads``, then ``OMP_NUM_THREADS``, then this)
    is :func:`serve.cpu.choose_threads`.
    """
    return threads_per_worker(max(1, workers), cores if cores is not None else available_cpus())


@dataclass(frozen=True)
class RolloutWiring:
    """The ``handler.rollout`` section: a rollout's candidate packed beside the stable model.

    The sidecar writes it into the archives it derives for a rollout
    (``serve.sidecar.mar``); the handler then loads both versions and splits each batch
    as the control file says (:mod:`serve.routing`).

    Attributes:
        candidate_version: the candidate's model version (``serve.state.VERSION_RE``),
            named in the ``X-DLRM-Model-Version`` header and the ``version`` label of the
            per-arm metrics.
        candidate_artifact: the candidate's artifact file, relative to the model dir
            (e.g. ``candidate/artifact.pt``); loaded with the same runtime settings as
            the stable artifact.
        control_file: absolute path of the JSON control file (``{"mode", "weight"}``)
            the sidecar rewrites while the workers run.
    """

    candidate_version: str
    candidate_artifact: str
    control_file: str

    def __post_init__(self) -> None:
        v = self.candidate_version
        if not isinstance(v, str) or not re.match(VERSION_RE, v):
            raise ConfigError(f"handler.rollout.candidate_version={v!r} must be a model version "
                              f"matching {VERSION_RE} (letters, digits, '.', '-'; as in "
                              "model_store/)")
        a = self.candidate_artifact
        if (not isinstance(a, str) or not a or a.startswith("/") or "\\" in a
                or any(part in ("", ".", "..") for part in a.split("/"))):
            raise ConfigError(f"handler.rollout.candidate_artifact={a!r} must be a normalized "
                              "path relative to the model dir, without '.', '..' or empty "
                              "parts (e.g. 'candidate/artifact.pt')")
        c = self.control_file
        if not isinstance(c, str) or not os.path.isabs(c):
            raise ConfigError(f"handler.rollout.control_file={c!r} must be an absolute path "
                              "(the sidecar and the workers must name the same file)")

    @classmethod
    def from_dict(cls, d: Any) -> RolloutWiring:
        """Build from a mapping; unknown or missing keys are an error naming the known ones."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ConfigError(f"handler.rollout must be a mapping with keys "
                              f"{sorted(f.name for f in fields(cls))} or null; got "
                              f"{type(d).__name__} {d!r}")
        known = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(d) - known), sorted(known - set(d))
        if unknown:
            raise ConfigError(f"handler.rollout: unknown keys {unknown}; known keys: "
                              f"{sorted(known)}")
        if missing:
            raise ConfigError(f"handler.rollout: missing keys {missing}; all of "
                              f"{sorted(known)} are required")
        return cls(**d)


@dataclass(frozen=True)
class HandlerConfig:
    """The ``handler:`` section of the .mar's model-config.yaml.

    Attributes:
        cache_load_factor: fraction of all table rows kept on the device (runtime cache);
            None with ``cache_bytes`` set instead; 1.0 keeps every row.
        cache_bytes: device cache size in bytes (alternative to the load factor).
        cache_policy: "lru" | "lfu".
        num_threads: torch intra-op threads per worker; None = cores / workers.
        max_forward_instances: most samples per forward; a larger TorchServe batch is
            split into chunks (RuntimeConfig.max_forward_instances); None = no cap.
        max_instances: most instances (samples) per HTTP request; more -> 413.
        max_ids_per_feature: most ids in one feature of one instance; more -> 400.
        max_body_bytes: largest body the handler decodes; larger -> 413. Keep it below
            TorchServe's ``max_request_size`` so ours is the limit users meet.
        debug_delay_ms: FOR TESTS ONLY: milliseconds the handler sleeps per forward (per
            TorchServe batch), so a test can make a tiny model slow enough that the queue
            holds seconds of work (e.g. to prove a version switch drains it). 0..10000;
            leave it 0 in any archive that serves traffic.
        rollout: a rollout's candidate loaded beside the stable model
            (:class:`RolloutWiring`); None (the default) serves the stable model alone.
    """

    cache_load_factor: float | None = 0.2
    cache_bytes: int | None = None
    cache_policy: str = "lru"
    num_threads: int | None = None
    max_forward_instances: int | None = 8192
    max_instances: int = 4096
    max_ids_per_feature: int = 64
    max_body_bytes: int = 16 * 1024 * 1024
    debug_delay_ms: int = 0
    rollout: RolloutWiring | None = None

    def __post_init__(self) -> None:
        lf = self.cache_load_factor
        if lf is not None and (isinstance(lf, bool) or not isinstance(lf, (int, float))
                               or not 0.0 < lf <= 1.0):
            raise ConfigError(f"handler.cache_load_factor={lf!r} must be in (0, 1] or null")
        for name in ("cache_bytes", "num_threads", "max_forward_instances"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"handler.{name}={v!r} must be an integer >= 1 or null")
        if lf is None and self.cache_bytes is None:
            raise ConfigError("handler: set cache_load_factor or cache_bytes")
        if self.cache_policy not in CACHE_POLICIES:
            raise ConfigError(f"handler.cache_policy={self.cache_policy!r} must be 'lru' or 'lfu'")
        for name in ("max_instances", "max_ids_per_feature", "max_body_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"handler.{name}={v!r} must be an integer >= 1")
        d = self.debug_delay_ms
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= 10_000:
            raise ConfigError(f"handler.debug_delay_ms={d!r} must be an integer in 0..10000 "
                              "(ms slept per batch; for tests only)")
        if self.rollout is not None and not isinstance(self.rollout, RolloutWiring):
            raise ConfigError(f"handler.rollout={self.rollout!r} must be a RolloutWiring or "
                              "None; build the config with HandlerConfig.from_dict to read a "
                              "mapping")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> HandlerConfig:
        """Build from a mapping; unknown keys are an error naming the known ones."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"handler: unknown keys {unknown}; known keys: {sorted(known)}")
        if d.get("rollout") is not None:
            d["rollout"] = RolloutWiring.from_dict(d["rollout"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (nested mappings); ``rollout`` is left out when None, so archives
        without a rollout keep the config they had before rollouts existed."""
        out = asdict(self)
        if out["rollout"] is None:
            del out["rollout"]
        return out


#: Environment variable of TorchServe (and so of its workers): "1" runs the embedding cache
#: on CPU too. On CPU the cache only costs time (device memory *is* host memory), so it is
#: off by default; the Prometheus pipeline test turns it on to check the hit-ratio series.
CACHE_ON_CPU_ENV = "DLRM_CACHE_ON_CPU"


def cache_on_cpu_from_env(environ: Mapping[str, str]) -> bool:
    """Whether ``DLRM_CACHE_ON_CPU`` asks for the cache on CPU ("1"/"0", unset = off).

    Raises:
        ConfigError: any other value (names it and the two accepted ones).
    """
    v = environ.get(CACHE_ON_CPU_ENV, "0").strip()
    if v not in ("0", "1"):
        raise ConfigError(f"{CACHE_ON_CPU_ENV}={v!r} must be 1 (cache on CPU too) or 0 "
                          "(the default: no cache on CPU)")
    return v == "1"


DELTA_DIR_ENV = "DLRM_DELTA_DIR"
SHARED_TABLES_ENV = "DLRM_SHARED_TABLES"
DELTA_POLL_ENV = "DLRM_DELTA_POLL_MS"


@dataclass(frozen=True)
class DeltaWiring:
    """How a worker follows embedding deltas, from TorchServe's environment.

    ``DLRM_DELTA_DIR``: the pod's delta store (serve.deltas), shared with the sidecar;
    unset = no deltas, each worker keeps its own copy of the tables.
    ``DLRM_SHARED_TABLES``: "1" (default) = on CPU without a cache, the workers share one
    copy of the tables in ``<dir>/<version>/tables.bin`` (serve.runtime.shared); "0" = a
    private copy each (what the memory benchmark compares with).
    ``DLRM_DELTA_POLL_MS``: how often a worker looks for new deltas (default 100 ms).
    """

    directory: Path
    shared_tables: bool = True
    poll_s: float = 0.1

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> DeltaWiring | None:
        """None when ``DLRM_DELTA_DIR`` is unset or empty.

        Raises:
            ConfigError: a value out of its rule (named with the rule).
        """
        d = environ.get(DELTA_DIR_ENV, "").strip()
        if not d:
            return None
        shared = environ.get(SHARED_TABLES_ENV, "1").strip()
        if shared not in ("0", "1"):
            raise ConfigError(f"{SHARED_TABLES_ENV}={shared!r} must be 1 (workers share one "
                              "copy of the tables, the default) or 0 (a copy each)")
        poll = environ.get(DELTA_POLL_ENV, "100").strip()
        try:
            poll_ms = int(poll)
        except ValueError:
            poll_ms = -1
        if not 10 <= poll_ms <= 60_000:
            raise ConfigError(f"{DELTA_POLL_ENV}={poll!r} must be an integer number of "
                              "milliseconds in 10..60000 (default 100)")
        return cls(Path(d), shared == "1", poll_ms / 1000.0)


@dataclass
class ParsedRequest:
    """One validated request.

    dense: float32 (B, N); lengths: int32 (F, B) ids per (feature, sample);
    values: int64 (nnz,) feature-major (all of C1's ids for samples 0..B-1, then C2 ...).
    """

    dense: np.ndarray
    lengths: np.ndarray
    values: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])


@dataclass
class MergedBatch:
    """Several requests merged into one forward; ``sizes[i]`` samples belong to request i."""

    dense: np.ndarray     # float32 (B, N)
    lengths: np.ndarray   # int32 (F, B)
    values: np.ndarray    # int64 (nnz,), feature-major
    sizes: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------- parsing

def check_content_type(content_type: str | bytes | None) -> str:
    """The media type the body is decoded as: JSON_MEDIA_TYPE or BINARY_MEDIA_TYPE.

    JSON: ``application/json`` (charset utf-8 only) or no Content-Type at all. Binary:
    ``application/x-dlrm-columnar`` without parameters. Media types compare
    case-insensitively (RFC 9110).

    Raises:
        UnsupportedMediaType: any other Content-Type (415), naming the ones to send.
    """
    if isinstance(content_type, (bytes, bytearray)):
        content_type = content_type.decode("latin-1")
    raw = (content_type or "").strip()
    parts = [p.strip().lower() for p in raw.split(";")]
    mime = parts[0]
    if mime == BINARY_MEDIA_TYPE and len(parts) == 1:
        return BINARY_MEDIA_TYPE
    charset_ok = all(not p.startswith("charset=") or p.strip('"') in ("charset=utf-8", 'charset="utf-8')
                     for p in parts[1:])
    if mime not in _JSON_TYPES or not charset_ok:
        raise UnsupportedMediaType(
            f"Content-Type {raw!r} is not supported; send the body as JSON with "
            "'Content-Type: application/json' (charset utf-8), or binary columnar with "
            f"'Content-Type: {BINARY_MEDIA_TYPE}'")
    return JSON_MEDIA_TYPE


class _gc_paused:  # lower case: used like a function, ``with _gc_paused():``
    """Pause Python's cyclic garbage collector while a request is decoded.

    A 512-instance body becomes ~15k lists and dicts; every 700 container allocations
    the collector runs, and its older generations walk the whole heap (torch's objects
    included). Measured on a 2-core host: handling two 512-instance requests cost 44 ms
    of CPU with the collector on and 26 ms with it paused. JSON trees hold no cycles, so
    reference counting frees them anyway. Process-wide: the worker is single-threaded.
    A class, not a ``@contextmanager`` generator: 0.4 us instead of 2 us a request.
    """

    __slots__ = ("_was_enabled",)

    def __enter__(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was_enabled:
            gc.enable()


def parse_body(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
               media_type: str = JSON_MEDIA_TYPE, *,
               schema: ModelSchema | None = None) -> ParsedRequest:
    """Decode and validate one request body (any form) against the model's schema.

    Args:
        body: the raw body. JSON may also come as str; binary must be bytes-like.
        media_type: what :func:`check_content_type` returned for the request.
        schema: the served model's schema: its F feature names (and order), N dense
            features and max ids per feature; None: :data:`DEFAULT_SCHEMA`.
    Returns:
        ParsedRequest: dense float32 (B, N), lengths int32 (F, B), values int64 (nnz,)
        feature-major in ``schema.feature_names`` order.
    Raises:
        PayloadTooLarge: body over ``cfg.max_body_bytes`` or more than ``cfg.max_instances``.
        InvalidInput: anything else wrong, with the field path in the message.
        ValueError: ``media_type`` is neither JSON_MEDIA_TYPE nor BINARY_MEDIA_TYPE.
        TypeError: ``schema`` is not a ModelSchema.
    """
    return _parse_any(body, cfg, media_type, _spec_of(schema))


def _parse_any(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
               media_type: str, spec: _Spec) -> ParsedRequest:
    """:func:`parse_body` with the schema's helpers resolved."""
    if media_type == BINARY_MEDIA_TYPE:
        if isinstance(body, str):
            raise InvalidInput("binary body: arrived as text; send the raw bytes from "
                               "encode_binary")
        _check_size(memoryview(body).nbytes, cfg)
        return _parse_binary(body, cfg, spec)
    if media_type != JSON_MEDIA_TYPE:
        raise ValueError(f"media_type {media_type!r} must be {JSON_MEDIA_TYPE!r} or "
                         f"{BINARY_MEDIA_TYPE!r}")
    with _gc_paused():
        return _parse_body(body, cfg, spec)


def _check_size(size: int, cfg: HandlerConfig) -> None:
    if size > cfg.max_body_bytes:
        raise PayloadTooLarge(
            f"body is {size} bytes; the limit is {cfg.max_body_bytes} bytes; "
            "split the instances over several requests")


def _parse_body(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
                spec: _Spec = _DEFAULT_SPEC) -> ParsedRequest:
    doc = _load_json(body, cfg)
    # The common valid body takes the fast path; anything it does not prove valid goes
    # through the validating parse, which raises the precise error (or accepts it).
    parsed = _fast_parse(doc, cfg, spec)
    return parsed if parsed is not None else _parse_doc(doc, cfg, spec)


def _load_json(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig) -> Any:
    """The body's JSON value (size and syntax checked; nothing else)."""
    size = len(body)
    _check_size(size, cfg)
    if size == 0:
        raise InvalidInput("body is empty; send a JSON object "
                           '{"instances": [...]} or {"dense": [...], "sparse": {...}}')
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInput(f"body is not valid JSON ({e}); send UTF-8 JSON (NaN and Infinity "
                           "are not JSON numbers)") from None


def _parse_doc(doc: Any, cfg: HandlerConfig, spec: _Spec = _DEFAULT_SPEC) -> ParsedRequest:
    """The validating parse of a decoded body against ``spec``'s schema: checks every rule
    in order and raises the first violation with its field path. The reference for
    :func:`_fast_parse`."""
    if not isinstance(doc, dict):
        raise InvalidInput(
            f"body is a JSON {_json_type(doc)}; expected an object "
            '{"instances": [...]} (rows) or {"dense": [...], "sparse": {...}} (columnar)')
    keys = set(doc)
    if "instances" in doc:
        if keys != {"instances"}:
            raise InvalidInput(f"body: unknown keys {sorted(keys - {'instances'})} next to "
                               '"instances"; the row form has only "instances"')
        return _parse_rows(doc["instances"], cfg, spec)
    if keys == {"dense", "sparse"}:
        return _parse_columnar(doc["dense"], doc["sparse"], cfg, spec)
    raise InvalidInput(
        f"body has keys {sorted(keys)}; expected {{\"instances\": [...]}} (rows) "
        'or {"dense": [...], "sparse": {...}} (columnar)')


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _not_a(v: Any, what: str) -> str:
    """'"abc" is a string, not a number' / 'null is not a number'."""
    if v is None:
        return f"null is not a{'n' if what[0] in 'aeiou' else ''} {what}"
    return f"{_show(v)} is a {_json_type(v)}, not a{'n' if what[0] in 'aeiou' else ''} {what}"


def _show(v: Any) -> str:
    """A value as JSON text, cut short (messages must stay small)."""
    try:
        s = orjson.dumps(v).decode()
    except TypeError:
        s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _check_count(n: int, what: str, cfg: HandlerConfig) -> None:
    if n == 0:
        raise InvalidInput(f"{what}: is empty; send 1 to {cfg.max_instances} instances")
    if n > cfg.max_instances:
        raise PayloadTooLarge(
            f"{what}: {n} instances exceed the limit of {cfg.max_instances} per request; "
            "split them over several requests")


def _dense_matrix(rows: Any, path: Callable[[int], str], nd: int) -> np.ndarray:
    """list of B lists of N = ``nd`` numbers -> float32 (B, N), or InvalidInput naming the
    cell."""
    types = set(map(type, rows))
    if types != {list}:
        for i, r in enumerate(rows):
            if not isinstance(r, list):
                raise InvalidInput(f"{path(i)}: is a JSON {_json_type(r)}; expected an array "
                                   f"of {nd} numbers (the model's dense features)")
    lens = set(map(len, rows))
    if lens != {nd}:
        for i, r in enumerate(rows):
            if len(r) != nd:
                raise InvalidInput(f"{path(i)}: has {len(r)} values; it must have exactly "
                                   f"{nd} (the model's dense features)")
    cell_types = set(map(type, chain.from_iterable(rows)))
    if not cell_types <= {int, float}:
        for i, r in enumerate(rows):
            for j, v in enumerate(r):
                if type(v) not in (int, float):
                    raise InvalidInput(f"{path(i)}[{j}]: {_not_a(v, 'number')}; {_DENSE_RULE}")
    try:
        wide = np.array(rows, dtype=np.float64)
    except OverflowError:  # an integer beyond float64: cannot happen via orjson, kept safe
        wide = np.array([[float(v) for v in r] for r in rows], dtype=np.float64)
    wide = wide.reshape(len(rows), nd)  # (B, 0) when the model has no dense features
    bad = ~(np.abs(wide) <= _F32_MAX)  # also catches NaN (comparison is False)
    if bad.any():
        i, j = map(int, np.argwhere(bad)[0])
        raise InvalidInput(f"{path(i)}[{j}]: {_show(rows[i][j])} is outside float32 range; "
                           f"{_DENSE_RULE}")
    return wide.astype(np.float32)


def _ids_array(vals: list, where: Callable[[int], str]) -> np.ndarray:
    """Flat list of ids -> int64 (nnz,), or InvalidInput naming the first bad id.

    ``where(k)`` returns the field path of flat position k (only called on errors).
    """
    if not vals:
        return np.zeros(0, dtype=np.int64)
    if set(map(type, vals)) == {int}:
        try:
            arr = np.array(vals, dtype=np.int64)
        except OverflowError:
            arr = None
        if arr is not None and arr.min() >= 0:
            return arr
    for k, v in enumerate(vals):  # slow path: find and describe the first offender
        msg = _id_problem(v)
        if msg:
            raise InvalidInput(f"{where(k)}: {msg}")
    raise InvalidInput(f"{where(0)}: ids are invalid; {_ID_RULE}")  # unreachable in practice


def _id_problem(v: Any) -> str | None:
    t = type(v)
    if t is int:
        if v < 0:
            return f"{v} is negative; ids must be integers >= 0"
        if v > INT64_MAX:
            return f"{v} is greater than 2^63-1 ({INT64_MAX}); {_ID_RULE}"
        return None
    if t is float:
        if v.is_integer() and abs(v) > INT64_MAX:
            return f"{_show(v)} is beyond the 64-bit integer range; {_ID_RULE}"
        return f"{_show(v)} is not an integer; {_ID_RULE} (no decimal point or exponent)"
    return f"{_not_a(v, 'integer')}; {_ID_RULE}"


def _cap_rule(caps: _Caps, f: int, spec: _Spec) -> str:
    """Why feature ``f`` may carry no more ids, as the tail of a message."""
    cap = int(caps.arr[f])
    if caps.by_model[f]:
        return (f"the model accepts at most {cap} id{'s' if cap != 1 else ''} in "
                f"{spec.names[f]} (its max_ids); drop or hash the extra ids")
    return f"at most {cap} ids per feature are allowed; drop or hash the extra ids"


def _lengths_cap(lengths: np.ndarray, caps: _Caps, spec: _Spec,
                 where: Callable[[int, int], str]) -> None:
    """lengths (F, B): every entry within its feature's cap, else InvalidInput at (f, b)."""
    over = caps.exceeded(lengths)
    if over is not None:
        f, b = map(int, np.argwhere(over)[0])
        raise InvalidInput(f"{where(f, b)}: has {int(lengths[f, b])} ids; "
                           f"{_cap_rule(caps, f, spec)}")


def _parse_rows(instances: Any, cfg: HandlerConfig, spec: _Spec) -> ParsedRequest:
    if not isinstance(instances, list):
        raise InvalidInput(f"instances: is a JSON {_json_type(instances)}; expected an array "
                           "of objects {\"dense\": [...], \"sparse\": {...}}")
    n = len(instances)
    _check_count(n, "instances", cfg)
    if set(map(type, instances)) != {dict}:
        for i, inst in enumerate(instances):
            if not isinstance(inst, dict):
                raise InvalidInput(f"instances[{i}]: is a JSON {_json_type(inst)}; expected an "
                                   'object {"dense": [...], "sparse": {...}}')
    for i, inst in enumerate(instances):
        if inst.keys() != _INSTANCE_KEYS:
            _key_error(f"instances[{i}]", set(inst), _INSTANCE_KEYS)
    sparse = [inst["sparse"] for inst in instances]
    names = spec.names
    # Feature names before the dense values: a body meant for another model is told which
    # features this one takes, not only that its dense count is off.
    for i, sp in enumerate(sparse):
        if not isinstance(sp, dict):
            raise InvalidInput(f"instances[{i}].sparse: is a JSON {_json_type(sp)}; expected an "
                               f"object {spec.sparse_example('[ids]')}")
        if sp.keys() != spec.name_set:
            _feature_error(f"instances[{i}].sparse", set(sp), spec)
    dense = _dense_matrix([inst["dense"] for inst in instances],
                          lambda i: f"instances[{i}].dense", spec.nd)
    # per_feature[f][b]: the id list of feature f for instance b (F x B)
    per_feature = [[sp[f] for sp in sparse] for f in names]
    cells = list(chain.from_iterable(per_feature))
    if set(map(type, cells)) != {list}:
        for k, c in enumerate(cells):
            if not isinstance(c, list):
                f, b = divmod(k, n)
                raise InvalidInput(f"instances[{b}].sparse.{names[f]}: is a JSON "
                                   f"{_json_type(c)}; expected an array of ids, e.g. [42]")
    lengths = np.fromiter(map(len, cells), dtype=np.int32, count=len(cells)).reshape(spec.nf, n)
    _lengths_cap(lengths, spec.caps(cfg.max_ids_per_feature), spec,
                 lambda f, b: f"instances[{b}].sparse.{names[f]}")
    flat = list(chain.from_iterable(cells))

    def where(k: int) -> str:
        ends = np.cumsum(lengths.reshape(-1))
        cell = int(np.searchsorted(ends, k, side="right"))
        f, b = divmod(cell, n)
        start = int(ends[cell - 1]) if cell else 0
        return f"instances[{b}].sparse.{names[f]}[{k - start}]"

    values = _ids_array(flat, where)
    return ParsedRequest(dense, lengths, values)


def _parse_columnar(dense_rows: Any, sparse: Any, cfg: HandlerConfig,
                    spec: _Spec) -> ParsedRequest:
    if not isinstance(dense_rows, list):
        raise InvalidInput(f"dense: is a JSON {_json_type(dense_rows)}; expected an array of "
                           f"B arrays of {spec.nd} numbers")
    n = len(dense_rows)
    _check_count(n, "dense", cfg)
    # Feature names before the dense values, as in the row form.
    if not isinstance(sparse, dict):
        raise InvalidInput(f"sparse: is a JSON {_json_type(sparse)}; expected an object "
                           f'{{"{spec.names[0]}": {{"values": [...], "lengths": [...]}}, ...}}')
    if sparse.keys() != spec.name_set:
        _feature_error("sparse", set(sparse), spec)
    dense = _dense_matrix(dense_rows, lambda i: f"dense[{i}]", spec.nd)
    caps = spec.caps(cfg.max_ids_per_feature)
    lengths = np.empty((spec.nf, n), dtype=np.int32)
    chunks: list[np.ndarray] = []
    for fi, f in enumerate(spec.names):
        col = sparse[f]
        p = f"sparse.{f}"
        if not isinstance(col, dict):
            raise InvalidInput(f"{p}: is a JSON {_json_type(col)}; expected an object "
                               '{"values": [ids...], "lengths": [B counts]}')
        if col.keys() != _COLUMN_KEYS:
            _key_error(p, set(col), _COLUMN_KEYS)
        lens, vals = col["lengths"], col["values"]
        for name, v in (("lengths", lens), ("values", vals)):
            if not isinstance(v, list):
                raise InvalidInput(f"{p}.{name}: is a JSON {_json_type(v)}; expected an array")
        if len(lens) != n:
            raise InvalidInput(f"{p}.lengths: has {len(lens)} entries; it must have one per "
                               f"dense row ({n})")
        if set(map(type, lens)) != {int} or min(lens) < 0:
            for b, v in enumerate(lens):
                if type(v) is not int or v < 0:
                    raise InvalidInput(f"{p}.lengths[{b}]: {_show(v)} is not a count; lengths "
                                       "must be integers >= 0")
        cap = int(caps.arr[fi])
        if max(lens) > cap:
            b = next(b for b, v in enumerate(lens) if v > cap)
            raise InvalidInput(f"{p}.lengths[{b}]: has {lens[b]} ids; "
                               f"{_cap_rule(caps, fi, spec)}")
        total = sum(lens)
        if total != len(vals):
            raise InvalidInput(f"{p}: lengths sum to {total} but values has {len(vals)} ids; "
                               "they must be equal")
        lengths[fi] = lens
        chunks.append(_ids_array(vals, _values_path(p)))
    values = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    return ParsedRequest(dense, lengths, values)


def _values_path(p: str) -> Callable[[int], str]:
    return lambda k: f"{p}.values[{k}]"


def _key_error(path: str, got: set, want: frozenset) -> None:
    missing, unknown = sorted(want - got), sorted(got - want)
    parts = []
    if missing:
        parts.append(f"missing keys {missing}")
    if unknown:
        parts.append(f"unknown keys {unknown}")
    raise InvalidInput(f"{path}: {'; '.join(parts)}; expected exactly {sorted(want)}")


def _feature_error(path: str, got: set, spec: _Spec) -> None:
    """Name the missing and unknown features at ``path`` and list the model's, in order."""
    missing = [f for f in spec.names if f not in got]
    unknown = sorted(map(str, got - spec.name_set))
    parts = []
    if missing:
        parts.append(f"missing features {', '.join(missing)}")
    if unknown:
        parts.append(f"unknown features {', '.join(unknown)}")
    raise InvalidInput(f"{path}: {'; '.join(parts)}; every instance needs exactly the sparse "
                       f"features {spec.names_text} (an empty list [] for no ids)")


# ----------------------------------------------------------------------------- fast path
#
# The validating parse above walks the decoded JSON many times (type sets, per-instance
# key checks, F per-feature loops): ~4.7 ms of a 512-instance row body beside orjson's
# ~3.2 ms, and ~45 us of a 1-instance one. For a valid body the functions below prove the
# same rules in fewer passes and build bit-identical arrays. Whatever they cannot prove (a
# wrong shape, type, key or limit) makes them return None, and the validating parse runs
# from the start: errors and their wording come from one place only.

# What a malformed value raises inside the fast path (a missing key, a number where a
# list belongs, an id beyond int64): all mean "let the validating parse describe it".
_NOT_FAST = (KeyError, TypeError, ValueError, OverflowError)
# Lists up to this long are reduced (min/max) by Python's builtins: ~0.5 us against
# ~1.5 us per numpy reduction, whose fixed cost dominates a 1-instance request.
_PY_REDUCE_MAX = 64


def _fast_parse(doc: Any, cfg: HandlerConfig, spec: _Spec = _DEFAULT_SPEC
                ) -> ParsedRequest | None:
    """A valid body (either JSON form) for ``spec``'s schema -> its ParsedRequest, or None:
    not proven valid."""
    if type(doc) is not dict:
        return None
    try:
        if len(doc) == 1:
            return _fast_rows(doc["instances"], cfg, spec)
        if len(doc) == 2:
            return _fast_columnar(doc["dense"], doc["sparse"], cfg, spec)
    except _NOT_FAST:
        pass
    return None


def _fast_rows(instances: Any, cfg: HandlerConfig, spec: _Spec) -> ParsedRequest | None:
    """The row form's ``instances`` -> ParsedRequest, or None (see :func:`_fast_parse`)."""
    if type(instances) is not list or not 0 < len(instances) <= cfg.max_instances:
        return None
    n = len(instances)
    # Two keys each, and both looked up: exactly {dense, sparse} (a non-object raises).
    if set(map(len, instances)) != {2}:
        return None
    dense = _fast_dense([inst["dense"] for inst in instances], n, spec.nd)
    sparse = [inst["sparse"] for inst in instances]
    nf = spec.nf
    # F keys each, and all F looked up: exactly the schema's features.
    if dense is None or set(map(len, sparse)) != {nf}:
        return None
    try:
        # One-hot (the usual DLRM request): every cell unpacks to exactly one item. A
        # non-list cell of one item yields a str (a character, an object key), which
        # _fast_ids refuses. Sample-major: one C-level gather per instance. One id is
        # within every cap (caps are >= 1).
        flat = [x for cells in map(spec.features_of, sparse) for [x] in cells]
    except (TypeError, ValueError):  # some cell is not one item: the general case
        return _fast_rows_multi_hot(dense, sparse, cfg, spec)
    values = _fast_ids(flat)
    if values is None:
        return None
    if n > 1:  # (B, F) sample-major -> (F, B) feature-major (a copy)
        values = values.reshape(n, nf).T.reshape(-1)
    return ParsedRequest(dense, np.ones((nf, n), dtype=np.int32), values)


def _fast_rows_multi_hot(dense: np.ndarray, sparse: list, cfg: HandlerConfig, spec: _Spec
                         ) -> ParsedRequest | None:
    """The row form with any number of ids per cell (``sparse``: B objects of F keys)."""
    n = len(sparse)
    cells = [sp[f] for f in spec.names for sp in sparse]  # (F*B) feature-major
    if not _all_of_type(cells, list):
        return None
    caps = spec.caps(cfg.max_ids_per_feature)
    if len(cells) <= _PY_REDUCE_MAX:
        lens = list(map(len, cells))
        if not _within_caps_py(lens, max(lens), caps, n):
            return None
        lengths = np.array(lens, dtype=np.int32).reshape(spec.nf, n)
    else:
        lengths = np.fromiter(map(len, cells), dtype=np.int32, count=len(cells))
        lengths = lengths.reshape(spec.nf, n)
        if not _within_caps(lengths, int(lengths.max()), caps):
            return None
    flat: list = []
    extend = flat.extend  # list.extend copies a list without an iterator: ~2x chain's speed
    for cell in cells:
        extend(cell)
    values = _fast_ids(flat)
    if values is None:
        return None
    return ParsedRequest(dense, lengths, values)


def _within_caps(lengths: np.ndarray, top: int, caps: _Caps) -> bool:
    """Whether lengths (F, B), whose max is ``top``, keeps every feature's cap: a scalar
    check unless ``top`` falls between the smallest and the largest cap."""
    if top <= caps.lo:
        return True
    if top > caps.hi:
        return False
    return not bool((lengths > caps.arr[:, None]).any())


def _within_caps_py(lens: list[int], top: int, caps: _Caps, n: int) -> bool:
    """:func:`_within_caps` of a small request's lengths as a Python list (F*n,),
    feature-major: Python's reductions beat numpy's fixed cost there."""
    if top <= caps.lo:
        return True
    if top > caps.hi:
        return False
    return all(map(operator.le, lens, caps.per_cell(n)))


def _fast_columnar(dense_rows: Any, sparse: Any, cfg: HandlerConfig, spec: _Spec
                   ) -> ParsedRequest | None:
    """The columnar form -> ParsedRequest, or None (see :func:`_fast_parse`)."""
    if type(dense_rows) is not list or not 0 < len(dense_rows) <= cfg.max_instances:
        return None
    n = len(dense_rows)
    nf = spec.nf
    dense = _fast_dense(dense_rows, n, spec.nd)
    if dense is None or type(sparse) is not dict or len(sparse) != nf:
        return None
    cols = spec.features_of(sparse)
    if set(map(len, cols)) != {2}:  # exactly {values, lengths}: both looked up below
        return None
    lens = [col["lengths"] for col in cols]
    vals = [col["values"] for col in cols]
    if (not _all_of_type(lens, list) or not _all_of_type(vals, list)
            or set(map(len, lens)) != {n}):
        return None
    lflat = list(chain.from_iterable(lens))
    if not _all_of_type(lflat, int):
        return None
    if lflat.count(1) == len(lflat):  # one-hot (ints, so 1 exactly): nothing to convert
        lengths = np.ones((nf, n), dtype=np.int32)
    else:
        lengths = np.array(lflat, dtype=np.int32).reshape(nf, n)  # OverflowError beyond int32
        caps = spec.caps(cfg.max_ids_per_feature)
        if len(lflat) <= _PY_REDUCE_MAX:
            if min(lflat) < 0 or not _within_caps_py(lflat, max(lflat), caps, n):
                return None
        elif int(lengths.min()) < 0 or not _within_caps(lengths, int(lengths.max()), caps):
            return None
    if lengths.sum(axis=1).tolist() != list(map(len, vals)):
        return None
    values = _fast_ids(list(chain.from_iterable(vals)))
    return None if values is None else ParsedRequest(dense, lengths, values)


def _all_of_type(items: list, *types: type) -> bool:
    """Whether every item's exact type is one of ``types`` (so a bool is no int here).

    When all items have the first type (the usual case), one C-level pass and a count
    that compares type objects by identity: ~2/3 the cost of ``set(map(type, items))``.
    """
    found = list(map(type, items))
    return found.count(types[0]) == len(found) or set(found) <= set(types)


def _fast_dense(rows: list, n: int, nd: int) -> np.ndarray | None:
    """B rows of N = ``nd`` numbers -> float32 (B, N) as :func:`_dense_matrix` builds it,
    or None."""
    if set(map(len, rows)) != {nd}:
        return None
    flat = list(chain.from_iterable(rows))
    # Exact types: numpy would take a bool as 0/1 and parse a numeric string. (A non-list
    # row of N items yields str items too: characters or object keys.)
    if not _all_of_type(flat, float, int):
        return None
    if not flat:  # N = 0: every row is empty, and must be a list (not "" or {})
        return np.zeros((n, 0), dtype=np.float32) if all(type(r) is list for r in rows) else None
    # |v| <= float32 max, as _dense_matrix checks it (NaN fails both ways).
    if len(flat) <= _PY_REDUCE_MAX:
        # Python compares an int with the bound exactly, numpy after rounding it to
        # float64: at worst a huge int falls back, never the other way round. numpy
        # converts to float32 through float64, as _dense_matrix does in two steps.
        if not (-_F32_MAX <= min(flat) and max(flat) <= _F32_MAX):
            return None
        return np.array(flat, dtype=np.float32).reshape(n, nd)
    # struct packs Python numbers 2-3x faster than np.array converts them (45 against
    # 130 us for 512 rows); both convert an int as float(int) does.
    wide = np.frombuffer(struct.pack(f"{len(flat)}d", *flat), dtype=np.float64)
    if not (-_F32_MAX <= wide.min() and wide.max() <= _F32_MAX):
        return None
    return wide.astype(np.float32).reshape(n, nd)


def _fast_ids(flat: list) -> np.ndarray | None:
    """Flat ids -> int64 (nnz,) as :func:`_ids_array` builds it, or None."""
    if not flat:
        return np.zeros(0, dtype=np.int64)
    if not _all_of_type(flat, int):  # exact: no bool, float or str
        return None
    small = len(flat) <= _PY_REDUCE_MAX
    if small and min(flat) < 0:
        return None
    # OverflowError beyond int64; fromiter: ~15% faster than np.array on 10k ints
    values = np.fromiter(flat, dtype=np.int64, count=len(flat))
    return values if small or values.min() >= 0 else None


def _binary_array(buf: memoryview, dtype: str, count: int, offset: int) -> np.ndarray:
    """``count`` items of little-endian ``dtype`` at ``offset``, as a native-endian array.

    A view into ``buf`` when that is writable and aligned (the bytearray TorchServe hands
    over); otherwise a copy, so every ParsedRequest is writable and aligned whatever the
    source (``torch.from_numpy`` warns on read-only arrays).
    """
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    native = arr.astype(np.dtype(dtype).newbyteorder("="), copy=False)  # no-op on LE hosts
    if native is arr and (not arr.flags.writeable or not arr.flags.aligned):
        native = arr.copy()
    return native


def _parse_binary(body: bytes | bytearray | memoryview, cfg: HandlerConfig,
                  spec: _Spec = _DEFAULT_SPEC) -> ParsedRequest:
    """The binary columnar form (layout in the module docstring) -> ParsedRequest; F and
    N must be ``spec``'s schema's."""
    buf = memoryview(body).cast("B")
    size = buf.nbytes
    if size < _HEADER_BYTES:
        raise InvalidInput(f"binary body: is {size} bytes; the header needs {_HEADER_BYTES} "
                           "bytes (magic b'DLRM', then uint32 version, B, F, N, little-endian)")
    head = np.frombuffer(buf, dtype=_HEADER, count=1)[0]
    magic = bytes(buf[:4])
    if magic != _MAGIC:
        raise InvalidInput(f"binary body: magic is {magic!r}; expected {_MAGIC!r} as the "
                           f"first 4 bytes (JSON bodies need 'Content-Type: {JSON_MEDIA_TYPE}')")
    version, b, nf, nd = (int(head[k]) for k in ("version", "b", "f", "n"))
    if version != BINARY_VERSION:
        raise InvalidInput(f"binary body: version is {version}; only version {BINARY_VERSION} "
                           "is supported")
    if nf != spec.nf:
        raise InvalidInput(f"binary body: F is {nf}; it must be {spec.nf} "
                           f"({spec.names_text})")
    if nd != spec.nd:
        raise InvalidInput(f"binary body: N is {nd}; it must be {spec.nd} (the model's dense "
                           "features)")
    if b == 0:
        raise InvalidInput(f"binary body: B is 0; send 1 to {cfg.max_instances} instances")
    if b > cfg.max_instances:
        raise PayloadTooLarge(
            f"binary body: B={b} instances exceed the limit of {cfg.max_instances} per request; "
            "split them over several requests")
    lengths_at = _HEADER_BYTES + 4 * b * nd
    values_at = lengths_at + 4 * nf * b
    if size < values_at:
        raise InvalidInput(f"binary body: is {size} bytes; the header (B={b}) needs at least "
                           f"{values_at} bytes for dense and lengths; send the whole body")
    lengths = _binary_array(buf, "<i4", nf * b, lengths_at).reshape(nf, b)
    if int(lengths.min()) < 0:
        f, s = map(int, np.argwhere(lengths < 0)[0])
        raise InvalidInput(f"binary body: lengths[{spec.names[f]}][{s}] is "
                           f"{int(lengths[f, s])}; {_LENGTH_RULE}")
    caps = spec.caps(cfg.max_ids_per_feature)
    over = caps.exceeded(lengths) if int(lengths.max()) > caps.lo else None
    if over is not None:
        f, s = map(int, np.argwhere(over)[0])
        raise InvalidInput(f"binary body: lengths[{spec.names[f]}][{s}] is "
                           f"{int(lengths[f, s])}; {_cap_rule(caps, f, spec)}")
    nnz = int(lengths.sum(dtype=np.int64))
    want = values_at + 8 * nnz
    if size != want:
        raise InvalidInput(f"binary body: is {size} bytes; the header (B={b}, nnz={nnz}) needs "
                           f"{want} bytes; nnz is the sum of lengths and each id is 8 bytes")
    dense = _binary_array(buf, "<f4", b * nd, _HEADER_BYTES).reshape(b, nd)
    finite = np.isfinite(dense)
    if not finite.all():
        i, j = map(int, np.argwhere(~finite)[0])
        raise InvalidInput(f"binary body: dense[{i}][{j}] is {float(dense[i, j])!r}; "
                           f"{_BINARY_DENSE_RULE}")
    values = _binary_array(buf, "<i8", nnz, values_at)
    if nnz and int(values.min()) < 0:
        k = int(np.argmax(values < 0))
        ends = np.cumsum(lengths.reshape(-1), dtype=np.int64)
        f, s = divmod(int(np.searchsorted(ends, k, side="right")), b)
        raise InvalidInput(f"binary body: values[{k}] ({spec.names[f]}, sample {s}): "
                           f"{_id_problem(int(values[k]))}")
    return ParsedRequest(dense, lengths, values)


def encode_binary(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray, *,
                  schema: ModelSchema | None = None) -> bytes:
    """One binary columnar body (``Content-Type: application/x-dlrm-columnar``).

    Args:
        dense: (B, N) numbers, sent as float32 (float64 is rounded like the JSON path).
        lengths: (F, B) integers: ids of feature f for sample b, feature-major.
        values: (nnz,) integer ids in [0, 2^63-1], feature-major (the first feature's ids
            of samples 0..B-1, then the second's ...); nnz = lengths.sum().
        schema: the model's schema, whose N and F the arrays must have (the features in
            ``schema.feature_names`` order); None: :data:`DEFAULT_SCHEMA` (N=13, F=26).
    Returns:
        ``20 + 4*B*N + 4*F*B + 8*nnz`` bytes (layout in the module docstring).
    Raises:
        ValueError: shapes or integer types off, a negative length, or values.size !=
            lengths.sum(). The server checks the rest (negative ids, non-finite dense,
            limits), so this can build bodies it rejects.

    Example::

        body = encode_binary(np.zeros((2, 13), np.float32), np.ones((26, 2), np.int32),
                             np.arange(52, dtype=np.int64))
        httpx.post(url, content=body, headers={"Content-Type": BINARY_MEDIA_TYPE})
    """
    d = np.asarray(dense)
    ln = np.asarray(lengths)
    v = np.asarray(values)
    spec = _spec_of(schema)
    nf, nd = spec.nf, spec.nd
    if d.ndim != 2 or d.shape[1] != nd:
        raise ValueError(f"dense has shape {d.shape}; it must be (B, {nd})")
    b = d.shape[0]
    if ln.shape != (nf, b):
        raise ValueError(f"lengths has shape {ln.shape}; it must be ({nf}, B={b}), feature-major")
    if v.ndim != 1:
        raise ValueError(f"values has shape {v.shape}; it must be 1-d (nnz,)")
    for name, a in (("lengths", ln), ("values", v)):
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"{name} has dtype {a.dtype}; it must hold integers")
    if ln.size and (int(ln.min()) < 0 or int(ln.max()) >= 2**31):
        raise ValueError(f"lengths must be in [0, 2^31-1]; got {int(ln.min())}..{int(ln.max())}")
    if v.size and v.dtype.kind == "u" and int(v.max()) > INT64_MAX:
        raise ValueError(f"values: {int(v.max())} is greater than 2^63-1; ids must fit int64")
    nnz = int(ln.sum(dtype=np.int64)) if ln.size else 0
    if v.size != nnz:
        raise ValueError(f"values has {v.size} ids but lengths sum to {nnz}; they must be equal")
    head = np.array([(_MAGIC, BINARY_VERSION, b, nf, nd)], dtype=_HEADER)
    return b"".join((head.tobytes(), d.astype("<f4").tobytes(), ln.astype("<i4").tobytes(),
                     v.astype("<i8").tobytes()))


# ----------------------------------------------------------------------------- batching

def merge_requests(parsed: Sequence[ParsedRequest]) -> MergedBatch:
    """Concatenate requests into one feature-major batch (request order kept).

    Feature-major means: for each feature, request 0's ids, then request 1's ... One
    gather over all the requests' ids (not a split per request and feature: with 32
    single-instance requests that was 832 tiny arrays and 12% of the worker's time).
    """
    if len(parsed) == 1:
        p = parsed[0]
        return MergedBatch(p.dense, p.lengths, p.values, [p.batch_size for p in parsed])
    dense = np.concatenate([p.dense for p in parsed])
    lengths = np.concatenate([p.lengths for p in parsed], axis=1)
    values = np.concatenate([p.values for p in parsed])
    return MergedBatch(dense, lengths, values[_feature_major_order(parsed)],
                       [p.batch_size for p in parsed])


def _feature_major_order(parsed: Sequence[ParsedRequest]) -> np.ndarray:
    """int64 (nnz,): positions in the requests' concatenated ids, in feature-major order.

    Each request's ids are feature-major already, so each (request r, feature f) pair is
    one contiguous segment: at ``base[r] + start-in-request[r, f]``, ``seg[r, f]`` long.
    The merged order takes the segments feature by feature, request by request.
    """
    seg = np.stack([p.lengths.sum(axis=1, dtype=np.int64) for p in parsed])  # (R, F)
    within = np.cumsum(seg, axis=1) - seg                                      # (R, F)
    totals = seg.sum(axis=1)
    base = np.cumsum(totals) - totals                                          # (R,)
    starts = (base[:, None] + within).T.reshape(-1)   # (F*R,) feature-major segments
    counts = seg.T.reshape(-1)
    # position k of segment s: starts[s] + (k - first output position of s)
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


@dataclass
class Outcome:
    """One response: HTTP status and the JSON body bytes.

    ``instances``: samples answered (0 unless the status is 200). ``arm``: the arm whose
    forward answered (``stable`` or ``candidate``); None when the request never reached a
    forward (its body, Content-Type or route key was refused).
    """

    status: int
    body: bytes
    instances: int = 0
    arm: str | None = None


@dataclass(frozen=True)
class Split:
    """How :func:`handle_batch` shares a batch between the two arms of a rollout.

    Attributes:
        mode: ``canary``: requests for which ``choose`` is true are answered by
            ``candidate`` instead of the stable ``predict``. ``shadow``: the stable
            ``predict`` answers every request; those for which ``choose`` is true are
            ALSO scored by ``candidate``, after the stable forward, and its results reach
            no response.
        candidate: the candidate's forward: MergedBatch -> float32 (B,) probabilities.
        choose: route key (None when the request sent none) -> whether the request takes
            the candidate. Called once per request that parsed, in request order (the
            handler binds :func:`serve.routing.takes_candidate` to the control's weight
            and the worker's rng).
    """

    mode: str
    candidate: Callable[[MergedBatch], np.ndarray]
    choose: Callable[[str | None], bool]

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Split.mode={self.mode!r} must be one of {list(MODES)}")


@dataclass
class ArmRun:
    """One arm's merged forward over its requests of a batch (``info["arms"][arm]``).

    Attributes:
        arm: ``stable`` or ``candidate``.
        answered: True when its results are the responses; False for the shadow
            candidate (scored for the metrics only).
        indices: positions of its requests in the batch, in order.
        sizes: instances of each of those requests.
        forward_s: seconds of its forward (merge + predict + checks).
        scores: float32 (instances,) its probabilities in request order; None when the
            forward failed.
        error: what the forward raised (a ServeError, or any other exception: the
            model's fault), else None.
    """

    arm: str
    answered: bool
    indices: list[int]
    sizes: list[int]
    forward_s: float = 0.0
    scores: np.ndarray | None = None
    error: Exception | None = None

    @property
    def requests(self) -> int:
        return len(self.indices)

    @property
    def instances(self) -> int:
        return sum(self.sizes)

    @property
    def failed(self) -> bool:
        return self.error is not None


def encode_predictions(probs: np.ndarray) -> bytes:
    return orjson.dumps({"predictions": probs}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_error(err: ServeError) -> bytes:
    return orjson.dumps(err.to_json())


def check_route_key(key: str | None) -> str | None:
    """A request's ``X-DLRM-Route-Key`` value, checked: None (no header) or 1 to
    ``ROUTE_KEY_MAX_CHARS`` characters.

    Raises:
        InvalidInput: an empty or too long key (400), naming the header and the rule.
    """
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: is a {type(key).__name__}; send text "
                           f"of 1 to {ROUTE_KEY_MAX_CHARS} characters")
    if not key:
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: is empty; send 1 to "
                           f"{ROUTE_KEY_MAX_CHARS} characters (e.g. a user or session id), or "
                           "leave the header out")
    if len(key) > ROUTE_KEY_MAX_CHARS:
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: has {len(key)} characters; at most "
                           f"{ROUTE_KEY_MAX_CHARS} are allowed; send a shorter key (e.g. a hash "
                           "of the user id) or leave the header out")
    return key


def _decode(body: Any, ctype: str | None, key: str | None, cfg: HandlerConfig,
            spec: _Spec) -> ParsedRequest:
    """One request of a batch -> ParsedRequest (raises a ServeError for a bad one)."""
    check_route_key(key)
    media = check_content_type(ctype)
    if media == BINARY_MEDIA_TYPE:
        if not isinstance(body, (str, bytes, bytearray, memoryview)):
            raise InvalidInput(f"binary body: arrived decoded as a {type(body).__name__}; "
                               "send the raw bytes from encode_binary")
    elif isinstance(body, str):
        body = body.encode("utf-8")
    elif not isinstance(body, (bytes, bytearray, memoryview)):
        # Already decoded upstream (TorchServe's own json.loads); re-encode so the same
        # exact rules apply. orjson refuses ints beyond 64 bits.
        try:
            body = orjson.dumps(body)
        except TypeError as e:
            raise InvalidInput(f"body could not be read as JSON ({e})") from None
    return _parse_any(body, cfg, media, spec)


def _run_arm(arm: str, answered: bool, requests: Sequence[tuple[int, ParsedRequest]],
             predict: Callable[[MergedBatch], np.ndarray],
             clock: Callable[[], float]) -> ArmRun:
    """ONE merged forward of ``predict`` over ``requests``; never raises (a failure is
    kept in ``ArmRun.error``, and logged with its traceback unless it is a ServeError
    of an answering arm, which its requests report themselves)."""
    run = ArmRun(arm, answered, [i for i, _ in requests], [p.batch_size for _, p in requests])
    t = clock()
    try:
        merged = merge_requests([p for _, p in requests])
        probs = np.asarray(predict(merged), dtype=np.float32).reshape(-1)
        if probs.shape[0] != merged.dense.shape[0]:
            raise RuntimeError(f"predict returned {probs.shape[0]} scores for "
                               f"{merged.dense.shape[0]} samples")
        run.scores = probs
    except Exception as e:  # this arm's fault: only its requests fail
        run.error = e
        if not (answered and isinstance(e, ServeError)):
            logger.exception("the %s model's forward failed on %d requests (%d instances)%s",
                             arm, run.requests, run.instances,
                             "" if answered else " (shadow: no response affected)")
    run.forward_s = clock() - t
    return run


def _answer(run: ArmRun, outcomes: list[Outcome | None]) -> None:
    """Fill the outcomes of ``run``'s requests: their predictions, or the arm's error
    (a ServeError as it is; anything else as a 500 naming the model log)."""
    if run.scores is not None:
        start = 0
        for i, size in zip(run.indices, run.sizes):
            outcomes[i] = Outcome(200, encode_predictions(run.scores[start:start + size]), size,
                                  run.arm)
            start += size
        return
    err = run.error if isinstance(run.error, ServeError) else ServeError(
        f"internal error while predicting with the {run.arm} model; see the TorchServe "
        "model log")
    body = encode_error(err)
    for i in run.indices:
        outcomes[i] = Outcome(err.status, body, 0, run.arm)


def _shadow_diff(stable: ArmRun, candidate: ArmRun) -> np.ndarray | None:
    """float32 (k,): candidate minus stable score, instance by instance, over the
    candidate's (shadow) requests; None unless both forwards succeeded."""
    if stable.scores is None or candidate.scores is None:
        return None
    where: dict[int, tuple[int, int]] = {}
    start = 0
    for i, size in zip(stable.indices, stable.sizes):
        where[i] = (start, start + size)
        start += size
    base = np.concatenate([stable.scores[slice(*where[i])] for i in candidate.indices])
    return candidate.scores - base


def handle_batch(bodies: Sequence[Any], content_types: Sequence[str | None],
                 predict: Callable[[MergedBatch], np.ndarray], cfg: HandlerConfig,
                 clock: Callable[[], float] = time.perf_counter, *,
                 route_keys: Sequence[str | None] | None = None,
                 split: Split | None = None,
                 schema: ModelSchema | None = None) -> tuple[list[Outcome], dict[str, Any]]:
    """Parse every request separately, run ONE forward per arm for the good ones, split back.

    Args:
        bodies: the raw body of each request (bytes; a JSON str is encoded as UTF-8).
        content_types: each request's Content-Type header (None if absent); it selects
            JSON or binary columnar decoding (:func:`check_content_type`).
        predict: the stable model's forward: MergedBatch -> float32 (B,) probabilities.
        route_keys: each request's ``X-DLRM-Route-Key`` (None: no header); checked by
            :func:`check_route_key` whether or not a rollout runs. None: no keys at all.
        split: a rollout's split (:class:`Split`); None: every good request is answered
            by ``predict`` (one forward).
        schema: the served model's schema every body is decoded against (a rollout's
            candidate shares the stable model's request schema); None:
            :data:`DEFAULT_SCHEMA`.
    Returns:
        (one Outcome per request in order, info). info holds, summed over the arms:
        ``decode_s`` (parsing all bodies), ``forward_s`` (all forwards, the shadow one
        included), ``instances`` and ``requests`` (those routed to an answering arm:
        every request that parsed); and ``arms``: {arm: :class:`ArmRun`} for each arm
        that ran a forward, ``mode`` (the split's mode or None) and ``shadow_diff``
        (float32 (k,) candidate minus stable score over the shadow-scored instances, or
        None).

    A bad request gets its own 4xx Outcome; the others are unaffected. A forward that
    raises fails only its arm's requests: a ServeError (e.g. InvalidInput from the
    runtime) with its status, anything else with a 500 (logged with its traceback). A
    failing shadow forward affects no response.
    """
    n = len(bodies)
    if len(content_types) != n or (route_keys is not None and len(route_keys) != n):
        raise ValueError(f"handle_batch: {n} bodies, {len(content_types)} content types and "
                         f"{'no' if route_keys is None else len(route_keys)} route keys; give "
                         "one of each per request")
    keys: Sequence[str | None] = route_keys if route_keys is not None else [None] * n
    spec = _spec_of(schema)
    t0 = clock()
    outcomes: list[Outcome | None] = [None] * n
    good: list[tuple[int, ParsedRequest]] = []
    for i, (body, ctype) in enumerate(zip(bodies, content_types)):
        try:
            good.append((i, _decode(body, ctype, keys[i], cfg, spec)))
        except ServeError as e:
            outcomes[i] = Outcome(e.status, encode_error(e))
    t1 = clock()
    arms: dict[str, ArmRun] = {}
    shadow_diff = None
    if good:
        stable, candidate = good, []
        if split is not None:
            chosen = [bool(split.choose(keys[i])) for i, _ in good]
            candidate = [g for g, c in zip(good, chosen) if c]
            if split.mode == "canary":
                stable = [g for g, c in zip(good, chosen) if not c]
        if stable:
            arms["stable"] = _run_arm("stable", True, stable, predict, clock)
        if candidate and split is not None:
            arms["candidate"] = _run_arm("candidate", split.mode == "canary", candidate,
                                         split.candidate, clock)
        for run in arms.values():
            if run.answered:
                _answer(run, outcomes)
        if split is not None and split.mode == "shadow" and "candidate" in arms:
            shadow_diff = _shadow_diff(arms["stable"], arms["candidate"])
    answering = [r for r in arms.values() if r.answered]
    info: dict[str, Any] = {
        "decode_s": t1 - t0,
        "forward_s": sum(r.forward_s for r in arms.values()),
        "instances": sum(r.instances for r in answering),
        "requests": sum(r.requests for r in answering),
        "arms": arms,
        "mode": split.mode if split is not None else None,
        "shadow_diff": shadow_diff,
    }
    return [o for o in outcomes if o is not None], info


def _example_arrays(n: int, seed: int, max_id: int, spec: _Spec, multi_hot: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dense float64 (n, N) rounded to 4 decimals, lengths int32 (F, n), ids int64 (nnz,)
    feature-major.

    One-hot: every length is 1 (the ids are drawn as (F, n) right after the dense values,
    so a seed gives the same instances whatever ``multi_hot`` later adds). Multi-hot:
    feature f has 0..``max_ids[f]`` ids per instance.
    """
    rng = np.random.default_rng(seed)
    dense = np.round(rng.random((n, spec.nd)) * 4, 4)
    ids = rng.integers(0, max_id, size=(spec.nf, n))
    if not multi_hot:
        return dense, np.ones((spec.nf, n), dtype=np.int32), ids.reshape(-1)
    top = np.array(spec.max_ids, dtype=np.int64)[:, None]
    lengths = rng.integers(0, top + 1, size=(spec.nf, n)).astype(np.int32)
    return dense, lengths, rng.integers(0, max_id, size=int(lengths.sum()))


def example_request(n: int = 1, *, seed: int = 0, form: str = "rows", max_id: int = 2**31,
                    schema: ModelSchema | None = None, multi_hot: bool = False
                    ) -> dict[str, Any]:
    """A valid request body (as a dict) of ``n`` random instances for ``schema``.

    For smoke tests, the launcher's readiness probe and benchmarks; ``form`` is
    "rows" or "columnar". :func:`example_binary` encodes the same instances as binary.

    Args:
        schema: the model's schema (N dense values, the F features by name); None:
            :data:`DEFAULT_SCHEMA`.
        multi_hot: False: one id per feature and instance (ids in [0, max_id)); True:
            0..``schema.max_ids[f]`` ids in feature f (valid when the handler's
            ``max_ids_per_feature`` is no lower).
    """
    spec = _spec_of(schema)
    dense_arr, lengths_arr, ids_arr = _example_arrays(n, seed, max_id, spec, multi_hot)
    dense, ids = dense_arr.tolist(), ids_arr.tolist()
    names = spec.names
    if form not in ("rows", "columnar"):
        raise ValueError(f"form {form!r} must be 'rows' or 'columnar'")
    if not multi_hot:
        if form == "rows":
            return {"instances": [
                {"dense": dense[b], "sparse": {f: [ids[fi * n + b]] for fi, f in enumerate(names)}}
                for b in range(n)]}
        return {"dense": dense, "sparse": {f: {"values": ids[fi * n:(fi + 1) * n],
                                               "lengths": [1] * n}
                                           for fi, f in enumerate(names)}}
    lengths = lengths_arr.tolist()
    ends = np.cumsum(lengths_arr.reshape(-1)).tolist()
    cell = [ids[e - ln:e] for e, ln in zip(ends, lengths_arr.reshape(-1).tolist())]  # F*n
    if form == "rows":
        return {"instances": [
            {"dense": dense[b], "sparse": {f: cell[fi * n + b] for fi, f in enumerate(names)}}
            for b in range(n)]}
    return {"dense": dense, "sparse": {
        f: {"values": [x for b in range(n) for x in cell[fi * n + b]], "lengths": lengths[fi]}
        for fi, f in enumerate(names)}}


def example_binary(n: int = 1, *, seed: int = 0, max_id: int = 2**31,
                   schema: ModelSchema | None = None, multi_hot: bool = False) -> bytes:
    """The instances of ``example_request(n, seed=seed, max_id=max_id, schema=schema,
    multi_hot=multi_hot)`` as a binary body.

    Parses to exactly the same ParsedRequest as the JSON forms (send it with
    ``Content-Type: application/x-dlrm-columnar``).
    """
    spec = _spec_of(schema)
    dense, lengths, ids = _example_arrays(n, seed, max_id, spec, multi_hot)
    return encode_binary(dense, lengths, ids, schema=schema)
