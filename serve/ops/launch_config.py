"""Where and how the service runs: :class:`LaunchConfig` (ports, folders, the sidecar's
flags), read by every part of :mod:`serve.ops.launcher` and by the fleet, checks and
benchmarks that start a service of their own."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from serve.common.validate import int_in_range
from serve.constants import (
    DEFAULT_GRPC_INFERENCE_PORT,
    DEFAULT_GRPC_MANAGEMENT_PORT,
    DEFAULT_INFERENCE_PORT,
    DEFAULT_MANAGEMENT_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_SIDECAR_OIP_PORT,
    DEFAULT_SIDECAR_PORT,
    DEFAULT_SIDECAR_WRITE_PORT,
)
from serve.errors import ConfigError
from serve.state import LOCAL_STATE_FILE
from serve.store.repository import DEFAULT_PROFILE, ModelRepository, default_version

__all__ = ["LOOPBACK", "REPO", "LaunchConfig", "show_path"]

REPO = Path(__file__).resolve().parents[2]
# TorchServe's addresses that stay on loopback whatever --host says: registering an archive
# is code execution, and TorchServe 0.12 can put no token on management alone.
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how to run the service; paths may be relative to ``REPO``."""

    host: str = "127.0.0.1"
    inference_port: int = DEFAULT_INFERENCE_PORT
    management_port: int = DEFAULT_MANAGEMENT_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    sidecar_port: int = DEFAULT_SIDECAR_PORT
    # The sidecar's write API (every write; the public sidecar_port refuses them).
    sidecar_write_port: int = DEFAULT_SIDECAR_WRITE_PORT
    # The sidecar's Open Inference Protocol (KServe v2) API: /v2/..., infer forwarded to
    # TorchServe (serve.sidecar.http.routes_oip).
    sidecar_oip_port: int = DEFAULT_SIDECAR_OIP_PORT
    # TorchServe 0.12 always starts gRPC; can't be disabled
    grpc_inference_port: int = DEFAULT_GRPC_INFERENCE_PORT
    grpc_management_port: int = DEFAULT_GRPC_MANAGEMENT_PORT
    model_name: str = "dlrm"
    model_store: Path = Path("model_store")
    # The archive in model_store TorchServe loads at start (--models NAME=MAR), for tests
    # and benchmarks. None: with the sidecar, none (TorchServe starts empty and the sidecar
    # registers the version the desired state names: make up / make run); without it,
    # "<model_name>.mar" (build_mar's default name, what the test fixtures build).
    mar_name: str | None = None
    # The desired state the sidecar serves (created declaring initial_version if absent).
    state_file: Path = Path(LOCAL_STATE_FILE)
    # The version a new state file declares: what `make model` builds with the same
    # PROFILE/SEED/VERSION/LABEL_SHUFFLE (serve.store.repository.default_version).
    initial_version: str = field(default_factory=lambda: default_version(DEFAULT_PROFILE))
    # Model repository folders the sidecar reads versions from (empty: model_store).
    repositories: tuple[Path, ...] = ()
    ts_config: Path = Path("config.properties")
    # TorchServe's logging (torchserve --log-config): ours keeps per-request lines off the
    # request path (DLRM_REQUEST_LOG=info brings them back); see the file's header.
    log_config: Path = Path("log4j2.xml")
    run_dir: Path = Path(".run")
    log_dir: Path = Path("logs")
    sidecar: bool = True
    ready_timeout_s: float = 300.0
    # On stop (Ctrl-C, SIGTERM, `down`): longest wait for the sidecar's drain (POST /drain)
    # before TorchServe is stopped anyway.
    drain_timeout_s: float = 60.0
    extra_env: dict[str, str] = field(default_factory=dict)  # TorchServe's (and workers')
    sidecar_env: dict[str, str] = field(default_factory=dict)  # the sidecar's
    ts_overrides: dict[str, str] = field(default_factory=dict)  # config.properties keys to set
    # A fleet (serve.ops.fleet): every pod's sidecar reads one token file (None:
    # run_dir/sidecar-token) and gets these extra flags (--fleet file ...).
    token_path: Path | None = None
    sidecar_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ports = [self.inference_port, self.management_port, self.metrics_port, self.sidecar_port,
                 self.sidecar_write_port, self.sidecar_oip_port, self.grpc_inference_port,
                 self.grpc_management_port]
        for p in ports:
            int_in_range("port", p, 1, 65535)
        if len(set(ports)) != len(ports):
            raise ConfigError(f"ports {ports} must all differ")
        if self.ready_timeout_s <= 0:
            raise ConfigError(f"ready_timeout_s {self.ready_timeout_s} must be > 0")

    def path(self, p: Path) -> Path:
        return p if p.is_absolute() else REPO / p

    @property
    def inference_url(self) -> str:
        return f"http://{self.host}:{self.inference_port}"

    @property
    def management_url(self) -> str:
        """Always loopback: TorchServe's management API never follows ``host``."""
        return f"http://{LOOPBACK}:{self.management_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"

    @property
    def sidecar_url(self) -> str:
        """The sidecar's public port: metrics, probes and reads."""
        return f"http://{self.host}:{self.sidecar_port}"

    @property
    def sidecar_write_url(self) -> str:
        """The sidecar's write port: every write (PUT /state, POST /drain...), reads too."""
        return f"http://{self.host}:{self.sidecar_write_port}"

    @property
    def oip_url(self) -> str:
        """The Open Inference Protocol's base URL (the sidecar's ``--oip-port``)."""
        return f"http://{self.host}:{self.sidecar_oip_port}"

    @property
    def multiproc_dir(self) -> Path:
        return self.path(self.run_dir) / "prometheus"

    @property
    def prediction_log_dir(self) -> Path:
        """The workers' prediction log (serve.store.predlog), joined by POST /feedback."""
        return self.path(self.run_dir) / "predictions"

    @property
    def delta_dir(self) -> Path:
        """The pod's embedding-delta store (serve.store.deltas): the sidecar adds posted deltas,
        the workers follow them and share their tables there. Kept across restarts (a
        restarted service serves the deltas it had); ``make clean`` removes it."""
        return self.path(self.run_dir) / "deltas"

    @property
    def drain_file(self) -> Path:
        """Where the sidecar records a drain (``--drain-file``): a sidecar restarted inside
        this service stays drained, and :func:`start` removes it, since a service it starts
        is a new pod (in Kubernetes the record lives in the pod's emptyDir and dies with it;
        here ``run_dir`` outlives ``make down``, and a kept record left the next
        ``make up`` drained, never ready)."""
        return self.path(self.run_dir) / "drained.json"

    @property
    def token_file(self) -> Path:
        if self.token_path is not None:
            return self.path(self.token_path)
        return self.path(self.run_dir) / "sidecar-token"

    @property
    def startup_archive(self) -> str | None:
        """The archive TorchServe loads at start (see ``mar_name``); None: it starts empty."""
        if self.mar_name is not None:
            return self.mar_name
        return None if self.sidecar else f"{self.model_name}.mar"

    @property
    def repository_dirs(self) -> list[Path]:
        return [self.path(r) for r in (self.repositories or (self.model_store,))]

    def repository(self) -> ModelRepository:
        return ModelRepository(self.repository_dirs, self.model_name)


def show_path(p: Path) -> str:
    """A path relative to the repository root when it lies inside it (shorter messages)."""
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)
