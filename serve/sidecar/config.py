"""The sidecar's settings: where TorchServe is, how long each call to it may take, and
where the desired serving state and the model versions are.

Loaded once, at the entry point (``serve.sidecar.http.app.main``); everything else receives a
:class:`SidecarConfig`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from serve.errors import ConfigError
from serve.sidecar.control.tuner import TunerConfig
from serve.sidecar.services.feedback import FeedbackConfig
from serve.state import (  # the limits are the desired state's: defined once there
    BATCH_SIZE_MAX,
    DEFAULT_STATE_FILE,
    MAX_BATCH_DELAY_MS_MAX,
    WORKERS_MAX,
)

__all__ = [
    "AUTOTUNE_ENV",
    "BATCH_SIZE_MAX",
    "DEFAULT_CGROUP_ROOT",
    "DEFAULT_STATE_FILE",
    "DELTA_DIR_ENV",
    "MAX_BATCH_DELAY_MS_MAX",
    "MEMORY_LIMIT_ENV",
    "REPOSITORY_ENV",
    "STATE_FILE_ENV",
    "TOKEN_ENV",
    "WORKERS_MAX",
    "SidecarConfig",
]

#: Environment variable holding the PUT /batching bearer token (wins over the token file).
TOKEN_ENV = "DLRM_SIDECAR_TOKEN"
#: Environment variable naming the desired-state file (``--state-file``). In Kubernetes the
#: Deployment passes :data:`DEFAULT_STATE_FILE` (``/etc/dlrm/state/state.yaml``, the
#: ConfigMap ``dlrm-serving-state`` mounted as a folder); unset, the reconciler is off.
STATE_FILE_ENV = "DLRM_STATE_FILE"
#: Environment variable with the model repository folders, ``:``-separated (``--repository``).
REPOSITORY_ENV = "DLRM_REPOSITORY"
#: Environment variable with TorchServe's memory limit in bytes (``--memory-limit-bytes``).
#: In a pod where TorchServe runs in its own container, the sidecar's cgroup is not
#: TorchServe's: pass the torchserve container's ``limits.memory`` (Downward API
#: ``resourceFieldRef``) here.
MEMORY_LIMIT_ENV = "DLRM_MEMORY_LIMIT_BYTES"
DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Environment variable turning the batching tuner off (``0``, ``false``, ``off``) or on.
AUTOTUNE_ENV = "DLRM_AUTOTUNE"
#: Environment variable naming the pod's embedding-delta folder (``--delta-dir``), shared
#: with the TorchServe workers (:class:`serve.store.delta_files.DeltaStore`); unset, deltas are off.
DELTA_DIR_ENV = "DLRM_DELTA_DIR"


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
        switch_grace_s: how long an old version's queue must stay empty (on top of its
            ``max_batch_delay``) before it is unregistered. TorchServe's description does
            not show a batch a worker has already taken off the queue; unregistering
            while it runs would lose it. Keep it above the slowest batch's handler time.
        drain_timeout_s: how long the old version's queue may take to empty after the
            switch. Past it, the old version stays registered (unregistering it would
            fail the requests still queued) and the update reports no removed version.
        state_file: the desired-state YAML (:mod:`serve.state`) the reconciler moves
            TorchServe toward; None turns the reconciler off (PUT /state and PUT
            /batching then answer 409).
        repositories: model repository folders (:class:`serve.store.repository.ModelRepository`);
            empty: ``model_store`` alone.
        reconcile_interval_s: between two reconcile passes (a PUT wakes it at once). The
            file is re-read by path each pass, so a ConfigMap update (kubelet swaps a
            symlink) is seen within one interval of kubelet's own sync.
        cgroup_root: where the cgroup's memory files are (``memory.max``,
            ``memory.current``; v1: ``memory/memory.limit_in_bytes``...). Tests pass a
            folder of fake files.
        memory_limit_bytes: TorchServe's memory limit when it is not the sidecar's own
            cgroup limit (separate containers); None: read it from ``cgroup_root``.
        memory_headroom: a switch is refused when usage + the new version's estimated
            need exceeds this fraction of the limit (the rest absorbs the estimate's error
            and the page cache; an OOM kill would fail every request in flight).
        feedback: the prediction log folder the workers write and the bounds of the
            click-feedback join (:class:`~serve.sidecar.services.feedback.FeedbackConfig`).
        delta_dir: the pod's embedding-delta store (:class:`serve.store.delta_files.DeltaStore`), a
            folder the TorchServe workers read too; POST /embeddings/deltas adds to it.
            None turns deltas off (POST /embeddings/deltas answers 409).
        delta_sync_s: every this many seconds, take the deltas published on the model
            volume (``<repository>/deltas/<version>/``) for the served versions
            (:meth:`serve.sidecar.services.embedding_deltas.DeltaService.sync`); 0 = never.
        tuner: the batching tuner (:class:`~serve.sidecar.control.tuner.TunerConfig`; on by
            default, acting only with a desired-state file).
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
    state_file: Path | None = None
    repositories: tuple[Path, ...] = ()
    reconcile_interval_s: float = 1.0
    cgroup_root: Path = DEFAULT_CGROUP_ROOT
    memory_limit_bytes: int | None = None
    memory_headroom: float = 0.9
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    delta_dir: Path | None = None
    delta_sync_s: float = 5.0
    tuner: TunerConfig = field(default_factory=TunerConfig)

    def __post_init__(self) -> None:
        if not (self.delta_sync_s >= 0 and self.delta_sync_s != float("inf")):
            raise ConfigError(f"delta_sync_s {self.delta_sync_s} must be a finite number of "
                              "seconds >= 0 (0 = do not read deltas from the model volume)")
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
        for name in ("upstream_timeout_s", "register_timeout_s", "drain_timeout_s",
                     "reconcile_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.switch_grace_s < 0:
            raise ConfigError(f"switch_grace_s={self.switch_grace_s} must be >= 0 seconds")
        if self.multiproc_dir is not None:
            object.__setattr__(self, "multiproc_dir", Path(self.multiproc_dir))
        object.__setattr__(self, "model_store", Path(self.model_store))
        if self.state_file is not None:
            object.__setattr__(self, "state_file", Path(self.state_file))
        if self.delta_dir is not None:
            if not str(self.delta_dir).strip():
                raise ConfigError("delta_dir is empty; pass a folder (shared with the "
                                  f"workers, {DELTA_DIR_ENV}) or None to turn deltas off")
            object.__setattr__(self, "delta_dir", Path(self.delta_dir))
        object.__setattr__(self, "repositories", tuple(Path(r) for r in self.repositories))
        object.__setattr__(self, "cgroup_root", Path(self.cgroup_root))
        limit = self.memory_limit_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise ConfigError(f"memory_limit_bytes={limit!r} must be a positive integer "
                              "(bytes) or None to read the cgroup's limit")
        if not 0 < self.memory_headroom <= 1:
            raise ConfigError(f"memory_headroom={self.memory_headroom} must be in (0, 1]")

    @property
    def repository_roots(self) -> tuple[Path, ...]:
        """The model repository folders: ``repositories``, else ``model_store``."""
        return self.repositories or (self.model_store,)
