"""Start TorchServe and the sidecar as processes of their own: TorchServe's rendered config
(addresses, ``allowed_urls``), its environment and command line, the sidecar's flags."""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from serve import settings
from serve.common.filemodes import PRIVATE_DIR, PRIVATE_UMASK, private_opener
from serve.errors import ConfigError
from serve.ops.launch_config import LOOPBACK, REPO, LaunchConfig

__all__ = [
    "allowed_urls",
    "render_ts_config",
    "route_key_salt_file",
    "sidecar_command",
    "start_sidecar",
    "start_torchserve",
    "torchserve_command",
    "without_blacklisted",
]

log = logging.getLogger(__name__)

_ADDRESS_KEYS = {"inference_address": "inference_port", "management_address": "management_port",
                 "metrics_address": "metrics_port"}
# Addresses kept on LOOPBACK whatever --host says (why: serve.ops.launch_config.LOOPBACK).
_LOOPBACK_ONLY = frozenset({"management_address", "grpc_inference_address",
                            "grpc_management_address"})
_PORT_KEYS = {"grpc_inference_port": "grpc_inference_port",
              "grpc_management_port": "grpc_management_port"}


def allowed_urls(store: Path, model_name: str) -> str:
    """TorchServe's ``allowed_urls`` (a Java regex, matched against the whole URL): only
    ``file://<store>/<model_name>-<version>.mar``, so no http(s) URL is ever fetched and
    no file outside ``store`` is registered. Written as a .properties value (the
    backslash doubled).

    The version part is looser than :data:`serve.state.VERSION_RE` on purpose: the sidecar
    registers *serving* versions, a model version plus its batching (``small-s7_b2d2w2``,
    a candidate's ``_c<version>``), and ``_`` is what VERSION_RE refuses."""
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
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, PRIVATE_DIR)  # tables, deltas, request ids, tokens: this user's only
    ts_dir = run_dir / "torchserve"
    tmp = _empty_dir(ts_dir / "tmp")
    _empty_dir(cfg.multiproc_dir)
    log_dir = cfg.path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    conf = ts_dir / "config.properties"
    rendered = render_ts_config(src.read_text(), cfg)
    with open(conf, "w", opener=private_opener) as f:
        f.write(rendered)
    env = without_blacklisted(dict(os.environ), rendered)
    env.update({
        "TMPDIR": str(tmp), "TEMP": str(tmp),  # pid file + .mar unpack dir per instance
        "LOG_LOCATION": str(log_dir), "METRICS_LOCATION": str(log_dir),
        settings.PROMETHEUS_MULTIPROC_DIR.name: str(cfg.multiproc_dir),
        settings.DLRM_PREDICTION_LOG_DIR.name: str(cfg.prediction_log_dir),
        settings.DLRM_DELTA_DIR.name: str(cfg.delta_dir),
        # where the workers find each version's tables folder (the archive references it)
        settings.DLRM_REPOSITORY.name: os.pathsep.join(str(d) for d in cfg.repository_dirs),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(cfg.extra_env)
    if (settings.DLRM_ROUTE_KEY_SALT.get(env) is None
            and settings.DLRM_ROUTE_KEY_SALT_FILE.get(env) is None):
        env[settings.DLRM_ROUTE_KEY_SALT_FILE.name] = str(route_key_salt_file(cfg))
    cmd = torchserve_command(cfg, conf)
    log.info("starting TorchServe: %s", " ".join(cmd))
    with open(log_dir / "torchserve.out", "ab") as out:  # the child keeps its own copy
        return subprocess.Popen(cmd, cwd=ts_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                umask=PRIVATE_UMASK)


def route_key_salt_file(cfg: LaunchConfig) -> Path:
    """The local fleet's route-key secret (serve.store.routing, review N10): a file of 32
    random bytes (hex, ``0600``) beside the desired-state file, made once and kept, so
    every pod of ``make fleet`` and every restart keys the X-DLRM-Route-Key hash alike.
    The environment's ``DLRM_ROUTE_KEY_SALT``/``_FILE`` win over it."""
    import secrets

    path = cfg.path(cfg.state_file).parent / "route-key.salt"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


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
                                start_new_session=True, umask=PRIVATE_UMASK)
