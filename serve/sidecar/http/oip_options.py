"""The Open Inference Protocol process's options (``python -m serve.sidecar.http.oip_server``):
where it listens, what it forwards to, and the bounds that keep a flood of it from costing
more than its own container (review N1; docs/oip.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from serve import settings
from serve.common.flags import Option, flag, options
from serve.common.validate import int_in_range, number_in_range, positive_int
from serve.constants import DEFAULT_INFERENCE_PORT, DEFAULT_SIDECAR_OIP_PORT, DEFAULT_SIDECAR_PORT
from serve.errors import ConfigError
from serve.sidecar.config import LOG_LEVELS

__all__ = ["OipOptions", "oip_cli_options"]


@dataclass(frozen=True)
class OipOptions:
    """How ``python -m serve.sidecar.http.oip_server`` runs and what bounds it: the Open
    Inference Protocol's process, which holds no token and shares no memory, CPU or
    readiness with the sidecar (:mod:`serve.sidecar.http.oip_server` says why).

    Each field's flag help says what it is (``--help``). The bounds: ``max_requests``
    handled at once (JSON 503 past it; uvicorn's ``limit_concurrency`` is the backstop),
    ``max_inflight_bytes`` of bodies held at once (announced lengths reserved before a byte
    is read; 429 past it), the whole body within ``body_deadline_s`` (408), ``max_parses``
    parses at once (each holds the GIL and up to ~130 MB while an 8 MiB JSON body becomes
    arrays; ``parse_in="process"`` keeps them off the event loop's GIL), a parse slot
    within ``parse_wait_s`` (503), the sidecar's ``/readyz`` (ready paths, served version)
    read at most once per ``ready_cache_s``; ``repositories`` are read only (each version's
    schema from its build report; none: the built-in DLRM's).
    """

    host: str = field(default="127.0.0.1", metadata=flag(
        "--host", help="bind address; 0.0.0.0 in a pod"))
    port: int = field(default=DEFAULT_SIDECAR_OIP_PORT, metadata=flag(
        "--port", help="the Open Inference Protocol's port"))
    model_name: str = field(default="dlrm", metadata=flag(
        "--model-name", env=settings.DLRM_MODEL_NAME, help="the TorchServe model served"))
    inference_url: str = field(default=f"http://127.0.0.1:{DEFAULT_INFERENCE_PORT}",
                               metadata=flag("--inference-url", env=settings.TS_INFERENCE_URL,
                                             help="TorchServe inference API"))
    sidecar_url: str = field(default=f"http://127.0.0.1:{DEFAULT_SIDECAR_PORT}", metadata=flag(
        "--sidecar-url", help="the sidecar's public read port (GET /readyz)"))
    repositories: tuple[Path, ...] = field(default=(), metadata=flag(
        "--repository", help="model repository folder, read only (the served version's "
                             "schema); repeat for several; none: the built-in DLRM"))
    max_parses: int = field(default=1, metadata=flag(
        "--max-parses", help="bodies parsed at once (CPU and ~16x the body in memory each)"))
    parse_wait_s: float = field(default=2.0, metadata=flag(
        "--parse-wait-s", help="longest wait for a parse slot before 503 (s)"))
    parse_in: str = field(default="process", metadata=flag(
        "--parse-in", choices=("process", "thread"),
        help="where bodies are parsed: worker processes (off the event loop's GIL) or "
             "threads"))
    max_inflight_bytes: int = field(default=64 * 2**20, metadata=flag(
        "--max-inflight-bytes", help="bytes of bodies held at once; past it 429 at once"))
    body_deadline_s: float = field(default=10.0, metadata=flag(
        "--body-deadline-s", help="seconds the whole body may take to arrive; then 408"))
    max_requests: int = field(default=64, metadata=flag(
        "--max-requests", help="requests handled at once; more answer 503 at once"))
    limit_concurrency: int = field(default=256, metadata=flag(
        "--limit-concurrency", help="uvicorn's bound on connections and tasks (backstop)"))
    ready_cache_s: float = field(default=1.0, metadata=flag(
        "--ready-cache-s", help="seconds one answer of the sidecar's /readyz serves"))
    log_level: str = field(default="info", metadata=flag(
        "--log-level", env=settings.DLRM_LOG_LEVEL, choices=LOG_LEVELS, help="log level"))

    def __post_init__(self) -> None:
        int_in_range("port", self.port, 1, 65535)
        for name in ("inference_url", "sidecar_url"):
            url = getattr(self, name)
            if not re.fullmatch(r"https?://[^/\s]+", url):
                raise ConfigError(f"{name}={url!r} must be http(s)://host:port with no path")
        for name in ("max_parses", "max_inflight_bytes", "max_requests", "limit_concurrency"):
            positive_int(name, getattr(self, name))
        if self.limit_concurrency <= self.max_requests:
            raise ConfigError(
                f"limit_concurrency={self.limit_concurrency} must exceed max_requests="
                f"{self.max_requests}: past max_requests the app answers a JSON 503, and "
                "uvicorn's plain 503 is only the backstop")
        for name in ("parse_wait_s", "body_deadline_s", "ready_cache_s"):
            number_in_range(name, getattr(self, name), 0, 3600, lo_open=True)
        if self.parse_in not in ("process", "thread"):
            raise ConfigError(f"parse_in={self.parse_in!r} must be 'process' or 'thread'")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r} must be one of {LOG_LEVELS}")
        object.__setattr__(self, "repositories", tuple(Path(p) for p in self.repositories))

    def argv(self) -> list[str]:
        """These options as ``python -m serve.sidecar.http.oip_server``'s arguments (what
        the sidecar and the launcher start)."""
        out: list[str] = []
        for opt in oip_cli_options():  # every flagged field, so none is ever left out
            value = getattr(self, opt.path[-1])
            for v in (value if opt.kind == "paths" else (value,)):
                out += [str(opt.spec.name), str(v)]
        return out




def oip_cli_options() -> list[Option]:
    """The flags of ``python -m serve.sidecar.http.oip_server`` (:class:`OipOptions`)."""
    return options(OipOptions)
