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
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from serve.common.net import wait_until
from serve.constants import DENSE_PRECISIONS
from serve.errors import ConfigError, ServeError, UpstreamUnavailable
from serve.ops.launch_config import LaunchConfig, show_path
from serve.ops.launch_ports import PORTS, check_ports, free_port_settings
from serve.ops.launch_processes import start_sidecar, start_torchserve
from serve.ops.launch_state import default_state, describe_state, ensure_state
from serve.ops.process_groups import group_alive, stop_group
from serve.schema import ModelSchema
from serve.state import LOCAL_STATE_FILE, DesiredState, write_state
from serve.store.repository import DEFAULT_PROFILE, default_version

__all__ = [
    "Service",
    "main",
    "post_json",
    "running_service",
    "start",
    "wait_ready",
]

log = logging.getLogger(__name__)


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
            f"{show_path(cfg.path(cfg.state_file))}. See {show_path(cfg.path(cfg.log_dir) / 'sidecar.out')} "
            f"and `curl -s {cfg.sidecar_url}/state` (desired vs observed state, phase, last error)")


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
        if any(group_alive(int(p)) for p in pids.values() if p):
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
        say(f"desired state {show_path(cfg.path(cfg.state_file))} ({how}): {describe_state(state)}")
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
        serving = f"{describe_state(svc.state)} (declared in {show_path(cfg.path(cfg.state_file))})"
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
    for setting, _, flag, var in PORTS:
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
    for _, what, flag, var in PORTS:
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
