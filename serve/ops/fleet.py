"""A local fleet: N pods (TorchServe + sidecar each) judging one rollout together.

    python -m serve.ops.fleet up --pods 3      # make fleet PODS=3
    python -m serve.ops.fleet down             # make fleet-down (drains each pod first)

Reuses the launcher (:mod:`serve.ops.launcher`): each pod is a :class:`LaunchConfig` with
its own ports (pod ``i`` of ``--base-port`` B: inference B+100i+80, management +81,
metrics +82, sidecar +90 (public) / +91 (writes) / +92 (Open Inference Protocol), gRPC
+70/+71; B=8100 gives pod-1
8180/8181/8182/8190/8191), its own ``.run/fleet/<name>/`` (TorchServe's config and tmp,
the workers' metrics, prediction log and delta folders, pids) and logs under
``logs/fleet/<name>/``. Shared by every pod:

* the declared state, ``.run/state.yaml`` (created from the latest version with
  ``--workers`` workers when absent; left alone when present);
* the model repository, ``model_store/`` (each pod's TorchServe gets its own model store,
  ``.run/fleet/<name>/model-store``, for the archives its sidecar derives: a pod cleaning up
  its derived archives must not delete one another pod is registering);
* the write token, ``.run/sidecar-token``;
* the fleet (``--fleet file``): ``.run/fleet.json`` (the pods, written before they
  start), ``.run/rollout-lease.json`` and ``.run/rollout-decisions.json``.

Workers: ``--workers 1`` by default (three pods of one worker each already keep two cores
busy under load; the declared state's ``workers`` is the fleet's, every pod serves it).
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.errors import ConfigError, UpstreamUnavailable
from serve.ops.launch_config import REPO, LaunchConfig
from serve.ops.launch_ports import check_ports
from serve.ops.launch_processes import start_sidecar, start_torchserve
from serve.ops.launch_state import default_state, describe_state, ensure_state
from serve.ops.launcher import Service, wait_ready
from serve.ops.process_groups import group_alive, stop_group
from serve.sidecar.adapters.fleet_store import Peer, read_fleet_file, write_fleet_file
from serve.sidecar.config import SidecarConfig
from serve.state import LOCAL_STATE_FILE, DesiredState, write_state

__all__ = ["FleetPlan", "main", "pod_config", "pod_pids", "restart_sidecar", "start_fleet",
           "stop_fleet"]

log = logging.getLogger(__name__)

#: Port of each API relative to a pod's block of 100 (see the module docstring).
_OFFSETS = {"grpc_inference_port": 70, "grpc_management_port": 71, "inference_port": 80,
            "management_port": 81, "metrics_port": 82, "sidecar_port": 90,
            "sidecar_write_port": 91, "sidecar_oip_port": 92}
MAX_PODS = 9


@dataclass(frozen=True)
class FleetPlan:
    """What ``make fleet`` starts; paths relative to the repository root."""

    pods: int = 3
    workers: int = 1
    base_port: int = 8100
    host: str = "127.0.0.1"
    run_dir: Path = Path(".run")
    log_dir: Path = Path("logs")
    model_store: Path = Path("model_store")
    state_file: Path = Path(LOCAL_STATE_FILE)
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.pods <= MAX_PODS:
            raise ConfigError(f"pods={self.pods} must be 1..{MAX_PODS}")
        if not 1 <= self.workers <= 8:
            raise ConfigError(f"workers={self.workers} must be 1..8 per pod")
        top = self.base_port + 100 * (self.pods - 1) + max(_OFFSETS.values())
        if self.base_port < 1024 or top > 65535:
            raise ConfigError(f"base_port={self.base_port}: the pods' ports would run "
                              f"past 65535 or below 1024; pick 1024..{65535 - 100 * self.pods}")

    def names(self) -> list[str]:
        return [f"pod-{i + 1}" for i in range(self.pods)]

    def path(self, p: Path) -> Path:
        return p if p.is_absolute() else REPO / p

    @property
    def fleet_file(self) -> Path:
        return self.path(self.run_dir) / "fleet.json"


def pod_config(plan: FleetPlan, index: int) -> LaunchConfig:
    """The :class:`LaunchConfig` of pod ``index`` (0-based)."""
    name = plan.names()[index]
    run = plan.run_dir / "fleet" / name
    ports: dict[str, Any] = {k: plan.base_port + 100 * index + v for k, v in _OFFSETS.items()}
    return LaunchConfig(
        host=plan.host, model_store=run / "model-store", repositories=(plan.model_store,),
        state_file=plan.state_file, run_dir=run, log_dir=plan.log_dir / "fleet" / name,
        ready_timeout_s=plan.ready_timeout_s, drain_timeout_s=plan.drain_timeout_s,
        token_path=plan.run_dir / "sidecar-token",
        sidecar_args=("--fleet", "file", "--fleet-identity", name,
                      "--fleet-dir", str(plan.path(plan.run_dir))), **ports)


def _peer(name: str, cfg: LaunchConfig) -> Peer:
    return Peer(name=name, predict_url=f"{cfg.inference_url}/predictions/{cfg.model_name}",
                sidecar_url=cfg.sidecar_url, write_url=cfg.sidecar_write_url)


def pod_pids(cfg: LaunchConfig) -> dict[str, int | None]:
    """A pod's process groups from ``run_dir/pids.json``: ``{"torchserve": pid, "sidecar":
    pid or None}``; empty when the file is missing or unreadable."""
    path = cfg.path(cfg.run_dir) / "pids.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: int(v) if v else None for k, v in data.items()}


def _write_pids(cfg: LaunchConfig, ts: int | None, sidecar: int | None) -> None:
    path = cfg.path(cfg.run_dir) / "pids.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"torchserve": ts, "sidecar": sidecar}))


def _fleet_state(plan: FleetPlan, cfg: LaunchConfig) -> tuple[DesiredState, bool]:
    """The shared declared state; created with ``plan.workers`` workers when absent."""
    path = plan.path(plan.state_file)
    if path.exists():
        return ensure_state(path, cfg.repository(), cfg.initial_version)
    state = default_state(cfg.repository(), cfg.initial_version).model_copy(
        update={"workers": plan.workers})
    write_state(path, state)
    return state, True


def drain_records(cfg: LaunchConfig) -> list[Path]:
    """Where pod ``cfg``'s sidecar may have recorded a drain: the ``--drain-file`` it is
    started with (:attr:`LaunchConfig.drain_file`, what the sidecar reads) and the
    default of sidecars started without one (``<delta dir>/.drained.json``, where a
    fleet-down of an older checkout left it). :func:`start_fleet` removes both: clearing
    only the old location left every pod of ``make fleet`` after ``make fleet-down``
    drained, never ready."""
    legacy = SidecarConfig(delta_dir=cfg.delta_dir).drain_marker
    return [cfg.drain_file] + ([legacy] if legacy is not None else [])


def start_fleet(plan: FleetPlan, say: Callable[[str], None] = log.info) -> list[Service]:
    """Start every pod (all at once), write ``.run/fleet.json`` first, wait until each
    answers a predict. On any failure every pod started is stopped.

    Raises:
        ConfigError: a pod of this fleet runs already, or a port is busy.
        UpstreamUnavailable: a pod did not get ready.
    """
    cfgs = [pod_config(plan, i) for i in range(plan.pods)]
    running = [c.run_dir.name for c in cfgs if any(
        p and group_alive(p) for p in pod_pids(c).values())]
    if running:
        raise ConfigError(f"pods {running} of a fleet are running; stop them first: "
                          "make fleet-down")
    for c in cfgs:
        check_ports(c)
    state, created = _fleet_state(plan, cfgs[0])
    say(f"declared state {plan.state_file} ({'created' if created else 'existing'}): "
        f"{describe_state(state)}")
    write_fleet_file(plan.fleet_file, [_peer(n, c) for n, c in zip(plan.names(), cfgs,
                                                                     strict=True)])
    services: list[Service] = []
    t0 = time.monotonic()
    try:
        for c in cfgs:
            # A new pod: the drain record the last fleet-down left (its run folder is
            # kept) must not keep it drained. A pod's emptyDir is new too.
            # restart_sidecar keeps it: a restarted container in a draining pod stays so.
            for marker in drain_records(c):
                marker.unlink(missing_ok=True)
            ts = start_torchserve(c)
            svc = Service(c, ts, state=state)
            services.append(svc)
            svc.sidecar = start_sidecar(c)
            _write_pids(c, ts.pid, svc.sidecar.pid if svc.sidecar else None)
        for svc in services:
            procs = [p for p in (svc.torchserve, svc.sidecar) if p is not None]
            wait_ready(svc.config, procs)
            svc.ready_s = time.monotonic() - t0
            say(f"{svc.config.run_dir.name} ready in {svc.ready_s:.1f} s")
    except BaseException:
        for svc in services:
            svc.stop()
        raise
    return services


def restart_sidecar(cfg: LaunchConfig) -> subprocess.Popen[bytes]:
    """Start pod ``cfg``'s sidecar again (after it died) and record its pid."""
    proc = start_sidecar(cfg)
    if proc is None:  # pragma: no cover - fleet pods always run a sidecar
        raise ConfigError("this pod runs no sidecar")
    _write_pids(cfg, pod_pids(cfg).get("torchserve"), proc.pid)
    return proc


def stop_fleet(plan: FleetPlan, say: Callable[[str], None] = log.info) -> int:
    """Drain each pod (accepted requests answered, new ones 503), then stop its processes;
    remove ``.run/fleet.json``. Returns the pods stopped."""
    from serve.ops.drain import request_drain

    stopped = 0
    names = [p.name for p in read_fleet_file(plan.fleet_file)] or plan.names()
    for i, name in enumerate(names):
        cfg = pod_config(FleetPlan(**{**plan.__dict__, "pods": max(plan.pods, i + 1)}), i)
        pids = pod_pids(cfg)
        if not any(p and group_alive(p) for p in pids.values()):
            continue
        token = cfg.token_file.read_text().strip() if cfg.token_file.is_file() else None
        if pids.get("sidecar"):
            try:
                report = request_drain(cfg.sidecar_write_url, token, cfg.drain_timeout_s)
                say(f"{name}: drained in {report.get('seconds')} s")
            except UpstreamUnavailable as e:
                say(f"{name}: drain failed ({e.message}); stopping anyway")
        for what, pid in pids.items():
            if pid:
                stop_group(pid)
                say(f"{name}: stopped {what} (process group {pid})")
        (cfg.path(cfg.run_dir) / "pids.json").unlink(missing_ok=True)
        stopped += 1
    plan.fleet_file.unlink(missing_ok=True)
    return stopped


def table(plan: FleetPlan) -> str:
    """One line per pod: name, predict URL, sidecar (public) and write URLs."""
    rows = [("pod", "predict", "sidecar (reads)", "writes")]
    for i, name in enumerate(plan.names()):
        p = _peer(name, pod_config(plan, i))
        rows.append((p.name, p.predict_url, p.sidecar_url, p.write_url or ""))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("up", "down"),
                    help="up: start the pods, return when each answers; down: drain and stop")
    ap.add_argument("--pods", type=int, default=3, help="pods to start (1..9)")
    ap.add_argument("--workers", type=int, default=1,
                    help="workers per pod when the declared state is created (an existing "
                         ".run/state.yaml keeps its own)")
    ap.add_argument("--base-port", type=int, default=8100,
                    help="pod i listens on base + 100 i + 70..91 (see the module docstring)")
    ap.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds each pod may take to answer its first predict")
    ap.add_argument("--model-store", default="model_store",
                    help="the model repository every pod serves from (read only)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        plan = FleetPlan(pods=args.pods, workers=args.workers, base_port=args.base_port,
                         ready_timeout_s=args.ready_timeout,
                         model_store=Path(args.model_store))
        if args.command == "down":
            n = stop_fleet(plan, say=lambda line: print(line, flush=True))
            print(f"stopped {n} pod(s)")
            return 0
        start_fleet(plan, say=lambda line: print(line, flush=True))
        print(table(plan))
        print(f"fleet: {plan.fleet_file}; decisions and lease next to {plan.state_file}; "
              "`make fleet-down` stops it", flush=True)
        return 0
    except (ConfigError, UpstreamUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
