"""The sidecar's settings: where TorchServe is and how long each call to it may take.

Loaded once, at the entry point (``serve.sidecar.app.main``); everything else receives a
:class:`SidecarConfig`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from serve.errors import ConfigError

__all__ = [
    "BATCH_SIZE_MAX",
    "MAX_BATCH_DELAY_MS_MAX",
    "TOKEN_ENV",
    "WORKERS_MAX",
    "SidecarConfig",
]

#: Environment variable holding the PUT /batching bearer token (wins over the token file).
TOKEN_ENV = "DLRM_SIDECAR_TOKEN"
BATCH_SIZE_MAX = 4096
MAX_BATCH_DELAY_MS_MAX = 10_000
WORKERS_MAX = 64


@dataclass(frozen=True)
class SidecarConfig:
    """Where TorchServe is and how the sidecar talks to it.

    Args:
        inference_url, management_url, metrics_url: TorchServe's APIs (loopback).
        model_name: the TorchServe model the sidecar manages.
        token: bearer token for PUT /batching; None disables writes (403).
        multiproc_dir: the workers' PROMETHEUS_MULTIPROC_DIR; None: no handler metrics.
        model_store: TorchServe's ``--model-store``: new versions' ``.mar`` files go there,
            because TorchServe registers local archives only from its model store.
        upstream_timeout_s: per call to TorchServe for reads (metrics, describe, probes);
            short so that a hung TorchServe cannot hang a Prometheus scrape or a probe.
        register_timeout_s: how long a new version may take to load and get READY.
        switch_grace_s: the least time between making the new version default and
            unregistering the old one. The drain waits for the old version's queue to be
            empty, but TorchServe's description does not show a batch a worker has already
            taken off the queue; this settle time lets that last batch finish.
        drain_timeout_s: how long the old version's queue may take to empty after the
            switch. Past it, the old version stays registered (unregistering it would
            fail the requests still queued) and the update reports no removed version.
    """

    inference_url: str = "http://127.0.0.1:8080"
    management_url: str = "http://127.0.0.1:8081"
    metrics_url: str = "http://127.0.0.1:8082"
    model_name: str = "dlrm"
    token: str | None = field(default=None, repr=False)
    multiproc_dir: Path | None = None
    model_store: Path = Path("model_store")
    upstream_timeout_s: float = 2.0
    register_timeout_s: float = 600.0
    switch_grace_s: float = 1.0
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("inference_url", "management_url", "metrics_url"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.match(r"^https?://[^/]+", value):
                raise ConfigError(
                    f"{name}={value!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8081")
            object.__setattr__(self, name, value.rstrip("/"))
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$", self.model_name):
            raise ConfigError(f"model_name={self.model_name!r} must be letters, digits, _ or -")
        if self.token is not None and not self.token.strip():
            raise ConfigError("token is empty; pass a non-empty token or None to disable writes")
        for name in ("upstream_timeout_s", "register_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.switch_grace_s < 0:
            raise ConfigError(f"switch_grace_s={self.switch_grace_s} must be >= 0 seconds")
        if self.multiproc_dir is not None:
            object.__setattr__(self, "multiproc_dir", Path(self.multiproc_dir))
        object.__setattr__(self, "model_store", Path(self.model_store))
