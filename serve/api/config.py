"""The worker's configuration: the ``handler:`` section of a .mar's model-config.yaml
(:class:`HandlerConfig`, with a rollout's :class:`RolloutWiring`) and what TorchServe's
environment says (:class:`DeltaWiring`, :func:`cache_on_cpu_from_env`).

Loaded once, where a worker starts (:meth:`serve.worker.Worker.load`); the build
(``serve.model.archive``) validates the same section with the same classes. Light: no
torch, no TorchServe.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from serve.common.cpu import available_cpus, threads_per_worker
from serve.common.validate import int_in_range, number_in_range, positive_int
from serve.constants import CACHE_POLICIES, DENSE_PRECISIONS
from serve.errors import ConfigError
from serve.settings import (
    DLRM_CACHE_ON_CPU,
    DLRM_DEBUG_CANDIDATE_SLOWDOWN,
    DLRM_DELTA_DIR,
    DLRM_DELTA_POLL_MS,
    DLRM_HOST_CACHE_BYTES,
    DLRM_HOST_CACHE_FRACTION,
    DLRM_SHARED_TABLES,
)
from serve.state import VERSION_RE

__all__ = [
    "CANDIDATE_SLOWDOWN_MAX",
    "DeltaWiring",
    "HandlerConfig",
    "RolloutWiring",
    "cache_on_cpu_from_env",
    "candidate_slowdown_from_env",
    "default_num_threads",
]


def default_num_threads(workers: int, cores: int | None = None) -> int:
    """torch intra-op threads per worker from the CPU budget: cores / workers, at least 1.

    ``cores`` defaults to the CPUs the process can really use,
    :func:`serve.common.cpu.available_cpus`: min(CPU affinity, ceil(cgroup CPU quota)), so a pod
    with a 4-CPU limit on a 64-core node counts 4, not 64. More threads than that
    oversubscribe the CPUs (docs/stack.md measured up to 10x loss). This is the budget alone:
    the handler's full rule (``handler.num_threads``, then ``OMP_NUM_THREADS``, then this)
    is :func:`serve.common.cpu.choose_threads`.
    """
    return threads_per_worker(max(1, workers), cores if cores is not None else available_cpus())


@dataclass(frozen=True)
class RolloutWiring:
    """The ``handler.rollout`` section: a rollout's candidate packed beside the stable model.

    The sidecar writes it into the archives it derives for a rollout
    (``serve.sidecar.adapters.archives``); the worker (:class:`serve.worker.Worker`) then loads both
    versions and splits each batch as the control file says (:mod:`serve.store.routing`).

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
        if not isinstance(v, str) or not re.fullmatch(VERSION_RE, v):
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
        max_body_bytes: largest body the handler decodes; larger -> 413. 8 MiB, equal to
            TorchServe's ``max_request_size`` (config.properties sizes its queue by it);
            4096 one-hot instances of the largest shipped schema are 2.5 MiB as JSON rows.
        debug_delay_ms: FOR TESTS ONLY: milliseconds the handler sleeps per forward (per
            TorchServe batch), so a test can make a tiny model slow enough that the queue
            holds seconds of work (e.g. to prove a version switch drains it). 0..10000;
            leave it 0 in any archive that serves traffic.
        warmup_batches: forwards each runtime (stable, and a rollout's candidate) runs on
            generated batches when the worker loads, before it answers (TorchServe marks
            it READY after): sizes cycle through 1, 64 and 512 instances (capped by
            ``max_forward_instances``), so the first real batches do not pay first-call
            costs (allocations, kernel selection, cold caches): measured 3.4x the
            stable's p99 on a fresh canary candidate. Not counted in any metric;
            0 = off. 0..1000.
        debug_candidate_slowdown: FOR TESTS AND BENCHMARKS ONLY: a rollout candidate's
            forward takes this many times its measured time (the worker busy-waits
            ``(factor - 1) x`` it after each candidate forward), so a rollout run can
            prove the latency guard rolls a slower model back. >= 1.0 (1.0 = off), at most
            100; the worker's environment ``DLRM_DEBUG_CANDIDATE_SLOWDOWN`` overrides it
            (a rollout's derived archive takes the stable archive's handler settings).
            Leave it 1.0 in any archive that serves traffic.
        dense_precision: the built-in DLRM's dense arithmetic (``DENSE_PRECISIONS``):
            "fp32" (default, exact against TorchRec) or a lossy lever, "bf16" or "int8",
            that a build sets only after its AUC gate (``--dense-precision``,
            :mod:`serve.model.precision`); an imported model's exported dense part runs
            in fp32 or bf16 (``--dense-precision`` of the import; the worker refuses int8).
        rollout: a rollout's candidate loaded beside the stable model
            (:class:`RolloutWiring`); None (the default) serves the stable model alone.
        host_cache_bytes: a version whose tables are on disk (``dlrm-<version>.tables``):
            the host tier's budget in bytes PER WORKER (each worker is its own process;
            the pod holds workers x this); the rows beyond it are read from the table
            files with ``pread``. 0 = read every lookup from disk; None (with no
            fraction) = no bound: serve the mapped files, shared through the page cache.
            See serve.runtime.tiers.
        host_cache_fraction: the same budget as a fraction (0..1) of the version's table
            bytes; at most one of the two.
        disk_read_threads: reads of missed rows in flight per runtime (1..256).
    """

    cache_load_factor: float | None = 0.2
    cache_bytes: int | None = None
    cache_policy: str = "lru"
    num_threads: int | None = None
    max_forward_instances: int | None = 8192
    max_instances: int = 4096
    max_ids_per_feature: int = 64
    max_body_bytes: int = 8 * 1024 * 1024
    debug_delay_ms: int = 0
    warmup_batches: int = 6
    debug_candidate_slowdown: float = 1.0
    dense_precision: str = "fp32"
    rollout: RolloutWiring | None = None
    host_cache_bytes: int | None = None
    host_cache_fraction: float | None = None
    disk_read_threads: int = 16

    def __post_init__(self) -> None:
        lf = self.cache_load_factor
        if lf is not None:
            number_in_range("handler.cache_load_factor", lf, 0, 1, lo_open=True,
                            then=" or null")
        for name in ("cache_bytes", "num_threads", "max_forward_instances"):
            if getattr(self, name) is not None:
                positive_int(f"handler.{name}", getattr(self, name), then=" or null")
        if lf is None and self.cache_bytes is None:
            raise ConfigError("handler: set cache_load_factor or cache_bytes")
        if self.cache_policy not in CACHE_POLICIES:
            raise ConfigError(f"handler.cache_policy={self.cache_policy!r} must be 'lru' or 'lfu'")
        for name in ("max_instances", "max_ids_per_feature", "max_body_bytes"):
            positive_int(f"handler.{name}", getattr(self, name))
        int_in_range("handler.debug_delay_ms", self.debug_delay_ms, 0, 10_000,
                     then=" (ms slept per batch; for tests only)")
        int_in_range("handler.warmup_batches", self.warmup_batches, 0, 1000,
                     then=" (forwards per runtime at load; 0 = no warm-up)")
        number_in_range("handler.debug_candidate_slowdown", self.debug_candidate_slowdown,
                        1, CANDIDATE_SLOWDOWN_MAX,
                        then=" (x the candidate's forward time; 1.0 = off; for tests only)")
        if self.dense_precision not in DENSE_PRECISIONS:
            raise ConfigError(f"handler.dense_precision={self.dense_precision!r} must be one of "
                              f"{', '.join(DENSE_PRECISIONS)} (fp32: exact; the others are "
                              "lossy: build them with --dense-precision, which checks the AUC)")
        self._check_tiers()
        if self.rollout is not None and not isinstance(self.rollout, RolloutWiring):
            raise ConfigError(f"handler.rollout={self.rollout!r} must be a RolloutWiring or "
                              "None; build the config with HandlerConfig.from_dict to read a "
                              "mapping")

    def _check_tiers(self) -> None:
        """The host tier's settings (serve.runtime.tiers)."""
        if self.host_cache_bytes is not None:
            int_in_range("handler.host_cache_bytes", self.host_cache_bytes, 0, 1 << 50,
                         then=" (host tier bytes per worker; 0 = read every row from disk) "
                              "or null (no bound)")
        if self.host_cache_fraction is not None:
            number_in_range("handler.host_cache_fraction", self.host_cache_fraction, 0, 1,
                            then=" (a fraction of the table bytes) or null")
            if self.host_cache_bytes is not None:
                raise ConfigError(f"handler: host_cache_bytes={self.host_cache_bytes} and "
                                  f"host_cache_fraction={self.host_cache_fraction} are both "
                                  "set; give one of the two")
        int_in_range("handler.disk_read_threads", self.disk_read_threads, 1, 256,
                     then=" (reads of missed rows in flight per runtime)")

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
        """Plain data (nested mappings); ``rollout`` is left out when None,
        ``dense_precision`` when "fp32" and the host tier's keys at their defaults, so
        archives without them keep the config they had before they existed."""
        out = asdict(self)
        if out["rollout"] is None:
            del out["rollout"]
        if out["dense_precision"] == "fp32":
            del out["dense_precision"]
        for key, default in (("host_cache_bytes", None), ("host_cache_fraction", None),
                             ("disk_read_threads", 16)):
            if out[key] == default:
                del out[key]
        return out


def host_budget_from_env(cfg: HandlerConfig, environ: Mapping[str, str]) -> HandlerConfig:
    """``cfg`` with the host tier's budget from ``DLRM_HOST_CACHE_BYTES`` or
    ``DLRM_HOST_CACHE_FRACTION`` (TorchServe's environment: the pod's memory decides it,
    not the model), when one is set; else ``cfg`` itself.

    Raises:
        ConfigError: both are set, or one is not a number in its range.
    """
    raw_b = DLRM_HOST_CACHE_BYTES.get(environ)
    raw_f = DLRM_HOST_CACHE_FRACTION.get(environ)
    if not raw_b and not raw_f:
        return cfg
    if raw_b and raw_f:
        raise ConfigError(f"{DLRM_HOST_CACHE_BYTES}={raw_b!r} and {DLRM_HOST_CACHE_FRACTION}"
                          f"={raw_f!r} are both set; set one of the two")
    try:
        values = ({"host_cache_bytes": int(float(raw_b)), "host_cache_fraction": None}
                  if raw_b else {"host_cache_bytes": None, "host_cache_fraction": float(raw_f or 0)})
    except ValueError:
        name = DLRM_HOST_CACHE_BYTES if raw_b else DLRM_HOST_CACHE_FRACTION
        raise ConfigError(f"{name}={raw_b or raw_f!r} must be a number (bytes per worker, "
                          "or a fraction 0..1 of the table bytes)") from None
    return HandlerConfig.from_dict({**cfg.to_dict(), **values})


def cache_on_cpu_from_env(environ: Mapping[str, str]) -> bool:
    """Whether ``DLRM_CACHE_ON_CPU`` (TorchServe's environment, so its workers') asks for
    the cache on CPU ("1"/"0", unset = off). On CPU the cache only costs time (device
    memory *is* host memory), so it is off by default; the Prometheus pipeline test turns
    it on to check the hit-ratio series.

    Raises:
        ConfigError: any other value (names it and the two accepted ones).
    """
    v = DLRM_CACHE_ON_CPU.get(environ)
    if v not in ("0", "1"):
        raise ConfigError(f"{DLRM_CACHE_ON_CPU}={v!r} must be 1 (cache on CPU too) or 0 "
                          "(the default: no cache on CPU)")
    return v == "1"


#: The largest test-only candidate slowdown (x its forward time): the one bound of
#: ``handler.debug_candidate_slowdown``, its environment override and the worker's argument.
CANDIDATE_SLOWDOWN_MAX = 100.0


def candidate_slowdown_from_env(environ: Mapping[str, str], configured: float) -> float:
    """The candidate slowdown in effect (TESTS AND BENCHMARKS ONLY): the environment's
    ``DLRM_DEBUG_CANDIDATE_SLOWDOWN`` when set, else ``configured``
    (``handler.debug_candidate_slowdown``).

    Raises:
        ConfigError: a value that is not a number in 1..100.
    """
    raw = DLRM_DEBUG_CANDIDATE_SLOWDOWN.raw(environ)
    if raw is None:
        return configured
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 1.0 <= value <= CANDIDATE_SLOWDOWN_MAX:  # also NaN
        raise ConfigError(f"{DLRM_DEBUG_CANDIDATE_SLOWDOWN}={raw!r} must be a number in "
                          f"1..{CANDIDATE_SLOWDOWN_MAX:g} (x the candidate's forward time; for tests only); unset "
                          "it to serve at full speed")
    return value


@dataclass(frozen=True)
class DeltaWiring:
    """How a worker follows embedding deltas, from TorchServe's environment.

    ``DLRM_DELTA_DIR``: the pod's delta store (serve.store.deltas), shared with the sidecar;
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
        d = DLRM_DELTA_DIR.get(environ)
        if not d:
            return None
        shared = DLRM_SHARED_TABLES.get(environ)
        if shared not in ("0", "1"):
            raise ConfigError(f"{DLRM_SHARED_TABLES}={shared!r} must be 1 (workers share one "
                              "copy of the tables, the default) or 0 (a copy each)")
        poll = DLRM_DELTA_POLL_MS.get(environ) or ""
        try:
            poll_ms = int(poll)
        except ValueError:
            poll_ms = -1
        if not 10 <= poll_ms <= 60_000:
            raise ConfigError(f"{DLRM_DELTA_POLL_MS}={poll!r} must be an integer number of "
                              f"milliseconds in 10..60000 (default {DLRM_DELTA_POLL_MS.default})")
        return cls(Path(d), shared == "1", poll_ms / 1000.0)
