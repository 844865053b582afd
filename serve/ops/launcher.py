"""Start, wait for and stop the service: TorchServe and the sidecar.

    python -m serve.ops.launcher run    # foreground; Ctrl-C / SIGTERM stops everything
    python -m serve.ops.launcher up     # background; pids in .run/, returns once ready
    python -m serve.ops.launcher down   # stops what `up` started

Builds nothing (``make run`` adds a model version to ``model_store/`` first if it holds
none). What to serve is the **desired state**, ``.run/state.yaml`` (``serve.state``): when
it is absent it is created declaring the version ``make model`` builds with the same
``--profile/--seed/--version`` (never simply the newest file) and that version's
report (its ``.mar`` batching and workers); when it exists it is left alone, so
``make down && make up`` comes back to the same state. TorchServe starts with **no
model**; the sidecar (``--state-file``, ``--repository``) registers the version the state
names. Tests and benchmarks load an archive of the model store at start instead
(``--mar NAME``; with ``--no-sidecar`` the default is ``dlrm.mar``, the name the test
fixtures build).

"Ready" means a real predict was answered, not just ``/ping``. Ports come from flags, else the env
(TS_INFERENCE_PORT, TS_MANAGEMENT_PORT, TS_METRICS_PORT, SIDECAR_PORT, SIDECAR_WRITE_PORT,
SIDECAR_OIP_PORT, and GRPC_INFERENCE_PORT / GRPC_MANAGEMENT_PORT for TorchServe's unused gRPC
APIs), else 8080/8081/8082/8090/8091/8092 (7070/7071); every server binds 127.0.0.1 unless ``--host`` says otherwise.
Before anything starts, each of these ports is test-bound (``check_ports``): a busy one
fails at once, naming the port, its setting, its holder and the flag/variable that moves it.

Each server runs in its own process group (TorchServe's Java frontend and its Python
workers share one), so stopping kills the whole tree and leaves no orphan workers.
The test fixture ``tests/fixtures/torchserve.py`` uses the same functions.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from serve import settings
from serve.common.net import free_ports, wait_until
from serve.common.validate import int_in_range, is_int
from serve.constants import (
    DEFAULT_GRPC_INFERENCE_PORT,
    DEFAULT_GRPC_MANAGEMENT_PORT,
    DEFAULT_INFERENCE_PORT,
    DEFAULT_MANAGEMENT_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_SIDECAR_OIP_PORT,
    DEFAULT_SIDECAR_PORT,
    DEFAULT_SIDECAR_WRITE_PORT,
    DENSE_PRECISIONS,
)
from serve.errors import ConfigError, ServeError, UpstreamUnavailable
from serve.schema import ModelSchema
from serve.settings import EnvVar
from serve.state import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BATCH_DELAY_MS,
    DEFAULT_WORKERS,
    LOCAL_STATE_FILE,
    Batching,
    DesiredState,
    ModelRef,
    load_state,
    write_state,
)
from serve.store.repository import DEFAULT_PROFILE, ModelRepository, default_version

__all__ = [
    "LaunchConfig",
    "PortUse",
    "Service",
    "allowed_urls",
    "check_ports",
    "default_state",
    "describe_state",
    "ensure_state",
    "free_port_settings",
    "main",
    "planned_ports",
    "port_holder",
    "post_json",
    "render_ts_config",
    "running_service",
    "sidecar_command",
    "start",
    "start_sidecar",
    "start_torchserve",
    "stop_group",
    "torchserve_command",
    "wait_ready",
    "without_blacklisted",
]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
_ADDRESS_KEYS = {"inference_address": "inference_port", "management_address": "management_port",
                 "metrics_address": "metrics_port"}
# TorchServe's addresses that stay on loopback whatever --host says: registering an archive
# is code execution, and TorchServe 0.12 can put no token on management alone.
LOOPBACK = "127.0.0.1"
_LOOPBACK_ONLY = frozenset({"management_address", "grpc_inference_address",
                            "grpc_management_address"})
_PORT_KEYS = {"grpc_inference_port": "grpc_inference_port",
              "grpc_management_port": "grpc_management_port"}


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


@dataclass
class Service:
    """What ``start`` launched: processes (one group each) and where they answer."""

    config: LaunchConfig
    torchserve: subprocess.Popen
    sidecar: subprocess.Popen | None = None
    ready_s: float | None = None
    state: DesiredState | None = None   # what the sidecar was told to serve (None: --mar)

    def stop(self) -> None:
        for proc in (self.sidecar, self.torchserve):
            if proc is not None:
                stop_group(proc.pid, proc)
        _pidfile(self.config).unlink(missing_ok=True)


def allowed_urls(store: Path, model_name: str) -> str:
    """TorchServe's ``allowed_urls`` (a Java regex, matched against the whole URL): only
    ``file://<store>/<model_name>-<version>.mar``, so no http(s) URL is ever fetched and
    no file outside ``store`` is registered. Written as a .properties value (the
    backslash doubled)."""
    name = f"{re.escape(model_name)}-[A-Za-z0-9][A-Za-z0-9._-]*" + r"\.mar"
    pattern = f"file://{re.escape(str(store))}/{name}"
    return pattern.replace("\\", "\\\\")


def render_ts_config(text: str, cfg: LaunchConfig) -> str:
    """config.properties with the addresses and model store of ``cfg`` substituted.

    Only the inference and metrics addresses follow ``cfg.host``; management and both
    gRPC APIs stay on 127.0.0.1 (``_LOOPBACK_ONLY``), even against ``cfg.ts_overrides``.
    ``allowed_urls`` is rewritten to admit only archives of ``cfg.model_store``.
    ``load_models`` is dropped (config.properties no longer sets it): TorchServe loads
    what the command line names (``--models``, a startup archive), else nothing.
    ``cfg.ts_overrides`` replace (or add) the other keys.

    Raises:
        ConfigError: ``cfg.ts_overrides`` moves a loopback-only address.
    """
    moved = sorted(_LOOPBACK_ONLY & set(cfg.ts_overrides))
    if moved:
        raise ConfigError(f"ts_overrides {moved} would move TorchServe's management/gRPC "
                          f"APIs; they stay on {LOOPBACK} (only inference and metrics follow "
                          "--host): drop those keys")
    out = []
    pending = dict(cfg.ts_overrides)
    store = cfg.path(cfg.model_store)
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        if key in pending and not line.lstrip().startswith("#"):
            line = f"{key}={pending.pop(key)}"
        elif key == "management_address":
            line = f"{key}=http://{LOOPBACK}:{cfg.management_port}"
        elif key in _ADDRESS_KEYS:
            line = f"{key}=http://{cfg.host}:{getattr(cfg, _ADDRESS_KEYS[key])}"
        elif key in _PORT_KEYS:
            line = f"{key}={getattr(cfg, _PORT_KEYS[key])}"
        elif key in _LOOPBACK_ONLY:
            line = f"{key}={LOOPBACK}"
        elif key == "allowed_urls":
            line = f"allowed_urls={allowed_urls(store, cfg.model_name)}"
        elif key == "model_store":
            line = f"model_store={cfg.path(cfg.model_store)}"
        elif key == "load_models":
            continue
        out.append(line)
    out += [f"{k}={v}" for k, v in pending.items()]
    return "\n".join(out) + "\n"


def default_state(repo: ModelRepository, version: str) -> DesiredState:
    """The state ``make up`` declares first: ``version`` (the one ``make model`` builds with
    the same arguments, :func:`serve.store.repository.default_version`; never simply the
    newest file, which may be a shuffled-label experiment), with its ``.mar``'s batching.

    Batching and workers come from the version's report (``mar_batch_size``,
    ``mar_max_batch_delay_ms``, ``mar_workers``), else the shipped defaults
    (:data:`serve.state.DEFAULT_BATCH_SIZE` and the two beside it).

    Raises:
        ConfigError: ``version`` is not in the repository (the message lists what is).
    """
    if not repo.exists(version):
        where = ", ".join(f"{_show(r)}/" for r in repo.roots)
        have = repo.versions()
        hint = (f"available: {', '.join(have)}; serve one of them with `make up VERSION=<name>`"
                if have else "the repository is empty")
        raise ConfigError(f"model version {version!r} is not in {where} ({hint}); "
                          f"build it with `make model` (same PROFILE/SEED/VERSION)")
    report = repo.report(version)

    def pick(key: str, fallback: int) -> int:
        value = report.get(key)
        return value if is_int(value) else fallback

    return DesiredState(
        model=ModelRef(version=version),
        batching=Batching(batch_size=pick("mar_batch_size", DEFAULT_BATCH_SIZE),
                          max_batch_delay_ms=pick("mar_max_batch_delay_ms", DEFAULT_MAX_BATCH_DELAY_MS)),
        workers=pick("mar_workers", DEFAULT_WORKERS))


def ensure_state(path: Path, repo: ModelRepository, version: str) -> tuple[DesiredState, bool]:
    """Read the desired-state file, creating it with :func:`default_state` (declaring
    ``version``) if absent.

    An existing file is never rewritten (``make down && make up`` serves the same state),
    but it is validated, and the version it names must be in the repository: the sidecar
    could never converge otherwise. Returns (state, created).
    """
    if path.exists():
        state = load_state(path)
        if not repo.exists(state.model.version):
            raise ConfigError(
                f"{_show(path)} declares model version {state.model.version!r}, which is not in "
                f"the repository ({', '.join(map(_show, repo.roots))}); available: "
                f"{', '.join(repo.versions()) or 'none'}. Build it (`make model VERSION=...`), "
                f"edit model.version in {_show(path)}, or delete the file to declare "
                f"{version!r}")
        return state, False
    state = default_state(repo, version)
    write_state(path, state)
    return state, True


def describe_state(state: DesiredState) -> str:
    """``version small-int8-s0, batch_size 2, max_batch_delay 2 ms, 2 workers``."""
    b = state.batching
    return (f"version {state.model.version}, batch_size {b.batch_size}, max_batch_delay "
            f"{b.max_batch_delay_ms} ms, {state.workers} worker{'s' if state.workers != 1 else ''}")


def _show(p: Path) -> str:
    """A path relative to the repository root when it lies inside it (shorter messages)."""
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def without_blacklisted(env: dict[str, str], ts_config: str) -> dict[str, str]:
    """``env`` less the variables TorchServe's ``blacklist_env_vars`` (in ``ts_config``, a
    regex matched against the whole name) keeps from its workers: TorchServe itself need
    not hold them either (the sidecar's token stays in the sidecar). No such key: ``env``."""
    pattern = ""
    for line in ts_config.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "blacklist_env_vars" and not key.lstrip().startswith("#"):
            pattern = value.strip()
    if not pattern:
        return env
    try:
        deny = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"blacklist_env_vars={pattern!r} is not a valid regex ({e}); "
                          "fix it in the TorchServe config") from None
    return {k: v for k, v in env.items() if not deny.fullmatch(k)}


def _empty_dir(d: Path) -> Path:
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def torchserve_command(cfg: LaunchConfig, conf: Path) -> list[str]:
    """TorchServe's command line: foreground, no config snapshots, rendered ``conf``.

    ``--models`` only with a startup archive (``cfg.startup_archive``); without one
    TorchServe starts with no model and the sidecar registers the desired state's version.
    """
    torchserve = Path(sys.executable).parent / "torchserve"
    cmd = [str(torchserve) if torchserve.exists() else "torchserve", "--start", "--foreground",
           "--ncs", "--model-store", str(cfg.path(cfg.model_store)),
           "--log-config", str(cfg.path(cfg.log_config))]
    if cfg.startup_archive is not None:
        cmd += ["--models", f"{cfg.model_name}={cfg.startup_archive}"]
    return cmd + ["--ts-config", str(conf)]


def start_torchserve(cfg: LaunchConfig) -> subprocess.Popen:
    """Start TorchServe in the foreground mode, in its own process group; don't wait.

    Per-instance state lives under ``run_dir``: the rendered config, a private TMPDIR
    (TorchServe's pid file and .mar unpacking go there, so several instances on one
    host don't collide) and PROMETHEUS_MULTIPROC_DIR (emptied: stale worker files would
    be summed into the metrics).
    """
    store = cfg.path(cfg.model_store)
    archive = cfg.startup_archive
    if archive is not None and not (store / archive).is_file():
        raise ConfigError(
            f"{store / archive} does not exist: name an archive of {store} to load at start "
            f"(--mar; `make model` stores versions as {cfg.model_name}-<version>.mar), or start "
            "with the sidecar, which registers the desired state's version")
    src = cfg.path(cfg.ts_config)
    if not src.is_file():
        raise ConfigError(f"TorchServe config {src} does not exist")
    if not cfg.path(cfg.log_config).is_file():
        raise ConfigError(f"TorchServe log config {cfg.path(cfg.log_config)} does not exist: "
                          "pass --log-config FILE (the repo ships log4j2.xml)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise ConfigError("no Java runtime found; TorchServe needs Java 11+: run `make java`")
    store.mkdir(parents=True, exist_ok=True)  # the sidecar copies archives into it
    run_dir = cfg.path(cfg.run_dir)
    ts_dir = run_dir / "torchserve"
    tmp = _empty_dir(ts_dir / "tmp")
    _empty_dir(cfg.multiproc_dir)
    log_dir = cfg.path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    conf = ts_dir / "config.properties"
    rendered = render_ts_config(src.read_text(), cfg)
    conf.write_text(rendered)
    env = without_blacklisted(dict(os.environ), rendered)
    env.update({
        "TMPDIR": str(tmp), "TEMP": str(tmp),  # pid file + .mar unpack dir per instance
        "LOG_LOCATION": str(log_dir), "METRICS_LOCATION": str(log_dir),
        settings.PROMETHEUS_MULTIPROC_DIR.name: str(cfg.multiproc_dir),
        settings.DLRM_PREDICTION_LOG_DIR.name: str(cfg.prediction_log_dir),
        settings.DLRM_DELTA_DIR.name: str(cfg.delta_dir),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(cfg.extra_env)
    cmd = torchserve_command(cfg, conf)
    log.info("starting TorchServe: %s", " ".join(cmd))
    with open(log_dir / "torchserve.out", "ab") as out:  # the child keeps its own copy
        return subprocess.Popen(cmd, cwd=ts_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def sidecar_command(cfg: LaunchConfig) -> list[str]:
    """``python -m serve.sidecar`` with every flag the launcher decides.

    ``--model-store`` is TorchServe's (where the sidecar puts the archives it registers),
    ``--repository`` (one per folder) where the versions are, ``--state-file`` what to serve.
    """
    cmd = [sys.executable, "-m", "serve.sidecar", "--host", cfg.host, "--port", str(cfg.sidecar_port),
           "--write-port", str(cfg.sidecar_write_port), "--oip-port", str(cfg.sidecar_oip_port),
           "--inference-url", cfg.inference_url, "--management-url", cfg.management_url,
           "--metrics-url", cfg.metrics_url, "--model-name", cfg.model_name,
           "--token-file", str(cfg.token_file), "--multiproc-dir", str(cfg.multiproc_dir),
           "--model-store", str(cfg.path(cfg.model_store)),
           "--state-file", str(cfg.path(cfg.state_file)),
           "--prediction-log-dir", str(cfg.prediction_log_dir),
           "--delta-dir", str(cfg.delta_dir), "--drain-file", str(cfg.drain_file)]
    for d in cfg.repository_dirs:
        cmd += ["--repository", str(d)]
    return cmd + list(cfg.sidecar_args)


def start_sidecar(cfg: LaunchConfig) -> subprocess.Popen | None:
    """Start ``python -m serve.sidecar`` (own process group) unless ``cfg.sidecar`` is off."""
    if not cfg.sidecar:
        return None
    from serve.sidecar.adapters.tokens import ensure_dev_token

    ensure_dev_token(str(cfg.token_file))
    log_dir = cfg.path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # the sidecar reads the dir; it must not write there
    env.pop(settings.PROMETHEUS_MULTIPROC_DIR.name, None)
    env.update(cfg.sidecar_env)
    with open(log_dir / "sidecar.out", "ab") as out:
        return subprocess.Popen(sidecar_command(cfg), cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def post_json(url: str, body: Any, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """POST JSON (a dict, or bytes sent as is); return (status, headers, body)."""
    data = body if isinstance(body, (bytes, bytearray)) else json.dumps(body).encode()
    r = httpx.post(url, content=bytes(data), timeout=timeout,
                   headers={"Content-Type": "application/json"})
    return r.status_code, dict(r.headers), r.content


def wait_ready(cfg: LaunchConfig, procs: list[subprocess.Popen], timeout_s: float | None = None,
               log_hint: str | None = None) -> float:
    """Block until a real predict answers 200; return seconds waited.

    Without a startup archive the model only appears once the sidecar has registered the
    desired state's version, so a failure points at the sidecar's log and ``GET /state``.

    Raises UpstreamUnavailable if a process exits or ``timeout_s`` passes.
    """
    from serve.api.json_body import example_request

    timeout_s = timeout_s or cfg.ready_timeout_s
    where = log_hint or cfg.path(cfg.log_dir)
    t0 = time.monotonic()
    body = json.dumps(example_request(1, seed=0)).encode()
    url = f"{cfg.inference_url}/predictions/{cfg.model_name}"

    def alive() -> None:
        for p in procs:
            if p.poll() is not None:
                name = " ".join(str(a) for a in p.args[:3]) if isinstance(p.args, list) \
                    else str(p.args)
                raise UpstreamUnavailable(
                    f"process {name} exited with {p.returncode} before ready; see {where}")

    def answered() -> bool:
        status, headers, data = post_json(url, body, timeout=5)
        if status == 400:
            # The built-in DLRM's request does not fit an imported model: ask again with the
            # schema of the version that answered (it names itself in every response).
            own = _example_for(cfg, headers.get("x-dlrm-model-version"))
            if own is not None:
                status, _, data = post_json(url, own, timeout=5)
        if status != 200:
            raise OSError(f"HTTP {status}: {data[:200].decode(errors='replace')}")
        return True

    try:
        wait_until(answered, timeout_s=timeout_s, what=f"service (logs: {where})", check=alive)
    except UpstreamUnavailable as e:
        hint = _registration_hint(cfg)
        raise UpstreamUnavailable(f"{e.message}. {hint}" if hint else e.message) from None
    return time.monotonic() - t0


def _example_for(cfg: LaunchConfig, version: str | None) -> bytes | None:
    """A one-instance JSON request for ``version``'s schema (None: unknown version)."""
    from serve.api.json_body import example_request
    from serve.api.request import DEFAULT_SCHEMA

    schema = _schema_of(cfg, version)
    if schema is DEFAULT_SCHEMA:
        return None
    return json.dumps(example_request(1, seed=0, schema=schema)).encode()


def _registration_hint(cfg: LaunchConfig) -> str:
    if cfg.startup_archive is not None:
        return ""
    return (f"TorchServe starts with no model: the sidecar registers the version declared in "
            f"{_show(cfg.path(cfg.state_file))}. See {_show(cfg.path(cfg.log_dir) / 'sidecar.out')} "
            f"and `curl -s {cfg.sidecar_url}/state` (desired vs observed state, phase, last error)")


def stop_group(pid: int, proc: subprocess.Popen | None = None, timeout_s: float = 20.0) -> None:
    """SIGTERM the process group led by ``pid``, SIGKILL what is left after ``timeout_s``."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    leads = pgid == pid  # else not a group we lead: only signal the process itself
    try:
        os.killpg(pgid, signal.SIGTERM) if leads else os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None and not _group_alive(pid):
                return
        elif not _group_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL) if leads else os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # zombies still count for killpg; reap check via /proc where available
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        parts = stat.rsplit(")", 1)[-1].split()
        if len(parts) > 3 and parts[0] != "Z" and int(parts[2]) == pgid:
            return True
    return False


# ----------------------------------------------------------------------------- ports

@dataclass(frozen=True)
class PortUse:
    """One port the launcher will bind, what it is for and how to move it.

    Attributes:
        port: the port number.
        setting: the LaunchConfig field (``inference_port``, ...).
        what: who listens there (``TorchServe inference API``).
        flag: the launcher's command-line flag that moves it (None: no flag).
        env: the environment variable that moves it; ``make up``/``make run`` pass it
            through (``make up TS_INFERENCE_PORT=8180``).
    """

    port: int
    setting: str
    what: str
    flag: str | None
    env: str

    def how_to_move(self) -> str:
        """``--inference-port PORT or TS_INFERENCE_PORT=PORT (make up TS_INFERENCE_PORT=PORT)``."""
        by_env = f"{self.env}=PORT (make up {self.env}=PORT)"
        return f"{self.flag} PORT or {by_env}" if self.flag else by_env


# (setting, what listens there, flag, env): the order TorchServe and the sidecar bind them.
_PORTS: tuple[tuple[str, str, str | None, EnvVar], ...] = (
    ("inference_port", "TorchServe inference API", "--inference-port",
     settings.TS_INFERENCE_PORT),
    ("management_port", "TorchServe management API", "--management-port",
     settings.TS_MANAGEMENT_PORT),
    ("metrics_port", "TorchServe metrics API", "--metrics-port", settings.TS_METRICS_PORT),
    ("grpc_inference_port", "TorchServe gRPC inference API (always started)", None,
     settings.GRPC_INFERENCE_PORT),
    ("grpc_management_port", "TorchServe gRPC management API (always started)", None,
     settings.GRPC_MANAGEMENT_PORT),
    ("sidecar_port", "the sidecar (FastAPI)", "--sidecar-port", settings.SIDECAR_PORT),
    ("sidecar_write_port", "the sidecar's write API", "--sidecar-write-port",
     settings.SIDECAR_WRITE_PORT),
    ("sidecar_oip_port", "the sidecar's Open Inference Protocol (KServe v2) API",
     "--sidecar-oip-port", settings.SIDECAR_OIP_PORT),
)
_SIDECAR_PORTS = ("sidecar_port", "sidecar_write_port", "sidecar_oip_port")


def free_port_settings() -> dict[str, Any]:  # Any: LaunchConfig's ** keywords (ints)
    """A free loopback port (the OS picks it) for every port setting of
    :class:`LaunchConfig`, as its keywords: a service of its own for a test, a benchmark
    or a check, beside whatever already listens (``make up`` holds the defaults)."""
    return dict(zip((setting for setting, *_ in _PORTS), free_ports(len(_PORTS)),
                    strict=True))


def planned_ports(cfg: LaunchConfig) -> list[PortUse]:
    """Every port ``start`` will have bound on ``cfg.host``: TorchServe's five, and the
    sidecar's when ``cfg.sidecar`` is on."""
    return [PortUse(getattr(cfg, setting), setting, what, flag, env.name)
            for setting, what, flag, env in _PORTS
            if setting not in _SIDECAR_PORTS or cfg.sidecar]


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port``: ``pid 4242 (python3 -m http.server 8080)``, or None
    when that cannot be known (another user's process, or listing sockets is not
    permitted here)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    pids = sorted({c.pid for c in conns if c.pid and c.laddr and c.laddr.port == port
                   and c.status == psutil.CONN_LISTEN})
    if not pids:
        return None
    described = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline()) or proc.name()
        except (psutil.Error, OSError):
            cmd = "name unknown"
        described.append(f"pid {pid} ({cmd if len(cmd) <= 100 else cmd[:97] + '...'})")
    return ", ".join(described)


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (None: it can).

    SO_REUSEADDR as the servers set it: a port in TIME_WAIT after ``make down`` is free
    for them, and for this check; a listening socket is not.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"host {host!r} does not resolve ({e.strerror}); pass --host ADDRESS"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "in use"
            if e.errno == errno.EACCES:
                return "not permitted (ports below 1024 need privileges)"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine; pass --host ADDRESS"
            return f"cannot be bound ({e.strerror})"
    return None


def check_ports(cfg: LaunchConfig,
                holder: Callable[[int], str | None] = port_holder) -> None:
    """Refuse to start while a port the service needs cannot be bound on ``cfg.host``.

    Without this a busy port shows only as TorchServe exiting before ready. Every port
    of :func:`planned_ports` is tried (bind, then closed at once); the error lists each
    one that fails, with its setting, who holds it (``holder``; "unknown" when that
    cannot be known) and the flag / variable that moves it.

    Raises:
        ConfigError: at least one port cannot be bound.
    """
    lines = []
    for use in planned_ports(cfg):
        problem = _bind_problem(cfg.host, use.port)
        if problem is None:
            continue
        who = ""
        if problem == "in use":
            who = f", held by {holder(use.port) or 'unknown (not visible to this user)'}"
        lines.append(f"  port {use.port} ({use.setting}: {use.what}) on {cfg.host} is "
                     f"{problem}{who}; move it with {use.how_to_move()}")
    if lines:
        raise ConfigError(
            f"cannot start: {len(lines)} port{'s' if len(lines) != 1 else ''} the service "
            "needs cannot be bound:\n" + "\n".join(lines)
            + "\nstop what holds them (`make down` if it is this service), or move the ports")


@contextlib.contextmanager
def running_service(root: Path, model_store: Path, version: str,
                    extra_env: dict[str, str] | None = None, ready_timeout_s: float = 300
                    ) -> Iterator[tuple[LaunchConfig, Any]]:
    """A service of its own (TorchServe + sidecar, shipped defaults, every port free on
    127.0.0.1, state and run files under ``root``) serving ``version`` with its declared
    batching and workers (:func:`default_state`, as ``make up``) and converged,
    stopped on exit: what the benchmarks that must not touch ``make up``'s service
    (``bench.rollout_trials``, ``bench.delta_compare``) run against. Yields the launch
    config (its URLs and token file) and a :class:`serve.ops.state_client.StateClient`."""
    from serve.ops.state_client import StateClient

    root.mkdir(parents=True, exist_ok=True)
    cfg = LaunchConfig(
        **free_port_settings(), model_store=model_store, state_file=root / "state.yaml",
        run_dir=root / "run", log_dir=root / "logs", sidecar=True,
        ready_timeout_s=ready_timeout_s, extra_env=dict(extra_env or {}))
    # Declared as `make up` declares it: the version's own batching and workers (its
    # report), so a benchmark measures what the version ships with.
    write_state(root / "state.yaml", default_state(cfg.repository(), version))
    svc = start(cfg)
    try:
        client = StateClient(cfg.sidecar_write_url, cfg.token_file.read_text().strip(),
                             timeout_s=30)
        client.wait_converged(timeout_s=ready_timeout_s)
        yield cfg, client
    finally:
        svc.stop()


def start(cfg: LaunchConfig, say: Callable[[str], None] = log.info) -> Service:
    """Start TorchServe (+ sidecar) and wait until a predict is answered.

    With the sidecar, the desired state is ensured first (:func:`ensure_state`; ``say``
    tells which version and batching it declares), so a repository without versions fails
    before anything starts. Records the process groups in ``run_dir/pids.json`` (``down``
    reads it) and refuses to start while a service recorded there is alive: both would
    share ``run_dir``. Before anything is written or started, every port is checked
    (:func:`check_ports`): a busy one fails at once, naming it, its holder and how to
    move it.
    """
    pidfile = _pidfile(cfg)
    if pidfile.exists():
        try:
            pids = json.loads(pidfile.read_text())
        except ValueError:
            pids = {}
        if any(_group_alive(int(p)) for p in pids.values() if p):
            raise ConfigError(f"a service started from {cfg.path(cfg.run_dir)} is running "
                              f"(pids {pids}); stop it first: `make down`")
    check_ports(cfg)
    cfg.drain_file.unlink(missing_ok=True)  # a new pod: the last one's drain is over
    (cfg.delta_dir / ".drained.json").unlink(missing_ok=True)  # where it was recorded before
    state = None
    if cfg.sidecar:
        state, created = ensure_state(cfg.path(cfg.state_file), cfg.repository(),
                                      cfg.initial_version)
        how = (f"created: {cfg.initial_version}, the version `make model` builds"
               if created else "existing, left as is")
        say(f"desired state {_show(cfg.path(cfg.state_file))} ({how}): {describe_state(state)}")
    t0 = time.monotonic()
    ts = start_torchserve(cfg)
    svc = Service(cfg, ts, state=state)
    try:
        svc.sidecar = start_sidecar(cfg)
        pidfile.write_text(json.dumps({"torchserve": ts.pid,
                                       "sidecar": svc.sidecar.pid if svc.sidecar else None}))
        procs = [p for p in (ts, svc.sidecar) if p is not None]
        wait_ready(cfg, procs)
        svc.ready_s = time.monotonic() - t0
    except BaseException:
        svc.stop()
        raise
    return svc


def _schema_of(cfg: LaunchConfig, version: str | None) -> ModelSchema:
    """``version``'s request schema from its build report (the built-in one if unknown)."""
    from serve.api.request import DEFAULT_SCHEMA
    from serve.profiles import schema_from_report

    if version:
        try:
            return schema_from_report(cfg.repository().report(version))
        except (ServeError, OSError, ValueError):
            pass
    return DEFAULT_SCHEMA


def _banner(svc: Service) -> str:
    cfg = svc.config
    schema = _schema_of(cfg, svc.state.model.version if svc.state is not None else None)
    body = json.dumps({"instances": [{
        "dense": [0.5] * schema.dense,
        "sparse": {f: [i * 1000 + 7] for i, f in enumerate(schema.feature_names, 1)}}]})
    if svc.state is not None and cfg.startup_archive is None:
        serving = f"{describe_state(svc.state)} (declared in {_show(cfg.path(cfg.state_file))})"
    else:
        serving = f"{cfg.path(cfg.model_store) / str(cfg.startup_archive)}"
    lines = [
        f"ready in {svc.ready_s:.1f} s",
        f"  predict:    {cfg.inference_url}/predictions/{cfg.model_name}",
        f"  serving:    {serving}",
        f"  management: {cfg.management_url}   metrics: {cfg.metrics_url}",
    ]
    if svc.sidecar is not None:
        lines.append(f"  sidecar:    {cfg.sidecar_url}  writes: {cfg.sidecar_write_url}  "
                     f"(token in {cfg.token_file})")
        lines.append(f"  OIP v2:     {cfg.oip_url}/v2/models/{cfg.model_name}/infer  "
                     f"(KServe v2 / tritonclient; docs/oip.md)")
    lines += [f"  logs:       {cfg.path(cfg.log_dir)}", "try:",
              (f"  curl -s -H 'Content-Type: application/json' "
               f"{cfg.inference_url}/predictions/{cfg.model_name} -d '{body}'")]
    if svc.sidecar is not None:
        lines.append(f"  curl -s {cfg.sidecar_url}/state    # desired vs observed serving state")
    return "\n".join(lines)


def _pidfile(cfg: LaunchConfig) -> Path:
    return cfg.path(cfg.run_dir) / "pids.json"


def _cmd_run(cfg: LaunchConfig) -> int:
    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # explicit: a shell starting us in the background leaves SIGINT ignored
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting TorchServe on {cfg.inference_url} (logs in {cfg.path(cfg.log_dir)}) ...",
          flush=True)
    try:
        svc = start(cfg, say=_say)
    except KeyboardInterrupt:
        print("interrupted while starting; stopped", flush=True)
        return 130
    print(_banner(svc), "\nCtrl-C stops everything.", flush=True)
    try:
        while True:
            for name, p in (("TorchServe", svc.torchserve), ("sidecar", svc.sidecar)):
                if p is not None and p.poll() is not None:
                    print(f"{name} exited with {p.returncode}; stopping", flush=True)
                    svc.stop()
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        _drain_then_stop(svc)
        return 0


def _drain_then_stop(svc: Service) -> None:
    """Drain through the sidecar (new requests refused with 503, accepted ones answered),
    then stop; a second signal stops at once. TorchServe does not drain on SIGTERM."""
    cfg = svc.config
    if svc.sidecar is not None and svc.sidecar.poll() is None:
        from serve.ops.drain import request_drain

        print(f"draining (new requests get 503, accepted ones are answered; at most "
              f"{cfg.drain_timeout_s:.0f} s; signal again to stop now) ...", flush=True)
        try:
            token = cfg.token_file.read_text().strip() if cfg.token_file.is_file() else None
            report = request_drain(cfg.sidecar_write_url, token, cfg.drain_timeout_s)
            print(f"drained in {report.get('seconds')} s", flush=True)
        except UpstreamUnavailable as e:
            print(f"drain failed ({e.message}); stopping anyway", flush=True)
        except KeyboardInterrupt:
            print("stopping now", flush=True)
    print("stopping ...", flush=True)
    svc.stop()
    print("stopped", flush=True)


def _cmd_up(cfg: LaunchConfig) -> int:
    print(f"starting TorchServe on {cfg.inference_url} in the background ...", flush=True)
    svc = start(cfg, say=_say)
    print(_banner(svc), "\n`python -m serve.ops.launcher down` (or `make down`) stops it.", flush=True)
    return 0


def _say(line: str) -> None:
    print(line, flush=True)


def _cmd_down(cfg: LaunchConfig) -> int:
    pidfile = _pidfile(cfg)
    if not pidfile.exists():
        print("nothing to stop (no .run/pids.json)")
        return 0
    pids = json.loads(pidfile.read_text())
    if pids.get("sidecar"):
        from serve.ops.drain import request_drain

        print("draining (accepted requests are answered, new ones get 503) ...", flush=True)
        try:
            token = cfg.token_file.read_text().strip() if cfg.token_file.is_file() else None
            report = request_drain(cfg.sidecar_write_url, token, cfg.drain_timeout_s)
            print(f"drained in {report.get('seconds')} s", flush=True)
        except UpstreamUnavailable as e:
            print(f"drain failed ({e.message}); stopping anyway", flush=True)
    for name, pid in pids.items():
        if pid:
            print(f"stopping {name} (process group {pid}) ...", flush=True)
            stop_group(int(pid))
    pidfile.unlink()
    print("stopped")
    return 0


def _ports(args: argparse.Namespace) -> dict[str, Any]:
    """Each port: its flag, else its variable (``TS_INFERENCE_PORT``...), else its default
    (:mod:`serve.constants`, the variable's default in :mod:`serve.settings`)."""
    ports: dict[str, Any] = {}  # setting -> port (Any: LaunchConfig's ** keywords)
    for setting, _, flag, var in _PORTS:
        port = (getattr(args, setting, None) if flag else None) or var.get_port()
        if port is not None:
            ports[setting] = port
    return ports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.launcher", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("run", "up", "down"),
                    help="run: foreground; up: background, returns when ready; down: stop `up`")
    ap.add_argument("--host", default="127.0.0.1",
                    help="bind address of every server (loopback: nothing is exposed)")
    for _, what, flag, var in _PORTS:
        if flag is not None:
            ap.add_argument(flag, type=int, default=None,
                            help=f"{what}'s port (default ${var} or {var.default})")
    ap.add_argument("--model-store", default="model_store",
                    help="TorchServe's model store, and the model repository unless --repository")
    ap.add_argument("--repository", action="append", default=None, metavar="DIR",
                    help="a model repository folder (repeatable; default: the model store)")
    ap.add_argument("--state-file", default=LOCAL_STATE_FILE,
                    help="the desired serving state (created declaring the version `make model` "
                         "builds with the same --profile/--seed/--version if absent; "
                         f"default {LOCAL_STATE_FILE})")
    ap.add_argument("--profile", default=DEFAULT_PROFILE,
                    help="with --seed, --label-shuffle and --version: the version a new state "
                         "file declares, named as `make model` names what it builds (default "
                         f"{default_version(DEFAULT_PROFILE)})")
    ap.add_argument("--seed", type=int, default=None, help="see --profile (default: the "
                                                          "profile's seed)")
    ap.add_argument("--label-shuffle", action="store_true", help="see --profile")
    ap.add_argument("--mapping", default="modulo", choices=("modulo", "managed"),
                    help="see --profile: a build with --mapping managed (its version ends "
                         "in -managed)")
    ap.add_argument("--dense-precision", default="fp32", choices=DENSE_PRECISIONS,
                    help="see --profile: a build with --dense-precision bf16|int8 (its version "
                         "ends in -dense-<precision>)")
    ap.add_argument("--version", default=None, help="see --profile: this version by name")
    ap.add_argument("--mar", default=None,
                    help="load this archive of the model store at start (tests, benchmarks; "
                         "with --no-sidecar, default <model-name>.mar). Without it, TorchServe "
                         "starts empty and the sidecar registers the desired state's version")
    ap.add_argument("--ts-config", default="config.properties", help="TorchServe config to start from")
    ap.add_argument("--log-config", default="log4j2.xml",
                    help="TorchServe's log4j2 config (default: the repo's, per-request lines "
                         "off; DLRM_REQUEST_LOG=info turns the access log on)")
    ap.add_argument("--no-sidecar", action="store_true", help="start TorchServe only")
    ap.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for the first answered predict (the artifact loads first)")
    ap.add_argument("--run-dir", default=".run",
                    help="per-instance state: rendered config, token, pids (default .run)")
    ap.add_argument("--log-dir", default="logs", help="TorchServe's and the sidecar's logs")
    ap.add_argument("--drain-timeout", type=float, default=60.0,
                    help="on stop (Ctrl-C, SIGTERM, down): longest wait for the accepted "
                         "requests to be answered before TorchServe is stopped")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: the readiness poll would print a line per try.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = replace(LaunchConfig(
            host=args.host,
            model_store=Path(args.model_store), mar_name=args.mar,
            ts_config=Path(args.ts_config), log_config=Path(args.log_config),
            state_file=Path(args.state_file),
            initial_version=args.version or default_version(
                args.profile, seed=args.seed, label_shuffle=args.label_shuffle,
                mapping=args.mapping, dense_precision=args.dense_precision),
            repositories=tuple(Path(d) for d in args.repository or ()),
            sidecar=not args.no_sidecar, ready_timeout_s=args.ready_timeout,
            drain_timeout_s=args.drain_timeout, run_dir=Path(args.run_dir),
            log_dir=Path(args.log_dir)), **_ports(args))
        return {"run": _cmd_run, "up": _cmd_up, "down": _cmd_down}[args.command](cfg)
    except (ConfigError, UpstreamUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
