"""Measure what one serving instance sustains of the load test's traffic mix.

``make capacity`` (``python -m serve.ops.capacity``):

1. makes sure one local instance answers (``python -m serve.ops.launcher up`` when nothing
   answers ``/ping``; stopped again afterwards when this started it);
2. runs the step load test (``python -m loadtest.run --shape step``): closed-loop users
   double per step, each step measured after it settled;
   The batching tuner (``serve.sidecar.control.tuner``) is paused for the run (``PUT /tuner
   {"enabled": false}``, turned back on afterwards): the declared batching serves, so the
   knee is one configuration's, not the sum of the tuner's searches across 54-second
   steps (each search switches the serving version three times). The ranking traffic's
   own tuned figure is ``make bench-autotune``'s;
3. finds the knee with the project's one knee rule (:mod:`serve.ops.knee`): walking up
   the judged steps until the first whose p99 is over the goal (default
   ``serve.constants.P99_SLO_MS``, the MLPerf DLRM-v2 server bound) or whose failure
   ratio is over bounds, the step that
   last raised the request rate by at least 5%;
4. target_qps = ``headroom`` (0.8) x knee: what a request-rate HPA target would be for
   THIS mix (``make hpa-sim`` replays it as the old spec);
5. prints the derivation and writes ``loadtest/capacity.json`` (not under k8s/, which
   holds only what ``kubectl apply -f k8s/`` applies).

It does not touch ``k8s/hpa.yaml`` any more: the HPA scales on utilization of capacity
(``dlrm_capacity_utilization_ratio``, target 0.8 for every mix), and its request-rate
backstop is the single-instance knee, not this mix's (docs/autoscaling.md).
``make hpa-sim`` reads capacity.json as the mixed traffic's capacity.

Units: rates in requests/s (one request carries many instances: the HPA's metric,
``dlrm_requests_per_second``, counts requests), latencies in ms.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from serve.common.validate import positive_number
from serve.constants import (
    DEFAULT_INFERENCE_PORT,
    DEFAULT_SIDECAR_WRITE_PORT,
    DEFAULT_TOKEN_FILE,
    P99_SLO_MS,
    REQUEST_FORMS,
)
from serve.errors import CapacityError, ConfigError, ServeError
from serve.ops.knee import Knee, find_knee
from serve.ops.machine import machine_info
from serve.ops.state_client import StateClient, sidecar_token, tuner_paused

__all__ = [
    "CapacityConfig",
    "capacity_document",
    "derive_target",
    "format_quantity",
    "main",
]

_log = logging.getLogger(__name__)

DEFAULT_HOST = f"http://127.0.0.1:{DEFAULT_INFERENCE_PORT}"
#: The sidecar's write API (PUT /tuner pauses the tuner).
DEFAULT_SIDECAR = f"http://127.0.0.1:{DEFAULT_SIDECAR_WRITE_PORT}"
# Not in k8s/: `kubectl apply -f k8s/` reads every .json there and rejects this one (no
# `kind`). The figures belong with the load test that measured them.
DEFAULT_OUTPUT = Path("loadtest/capacity.json")


@dataclass(frozen=True)
class CapacityConfig:
    """Settings of one capacity measurement.

    p99_goal_ms: latency bound a step must meet (default the service's p99 goal,
        ``serve.constants.P99_SLO_MS``).
    headroom: target = headroom x knee; (0, 1].
    max_fail_ratio: failed/all requests a step may have and still count.
    duration: the whole step run (loadtest's format: 90s, 5m); steps share it.
    users: step levels passed to the load test ("1,2,4,8,16"), or "" for its default.
    instances: instances per request passed to the load test, or "" for its default.
    form: the requests' form passed to the load test (``context``: one user, N candidates,
        the default; ``instances``: every candidate repeats the user's features).
    sidecar, token_file: the sidecar whose batching tuner is paused during the run (its
        token: ``DLRM_SIDECAR_TOKEN`` or the file); pause_settle_s: seconds given to the
        switch back to the declared batching before measuring.
    """

    host: str = DEFAULT_HOST
    p99_goal_ms: float = P99_SLO_MS
    headroom: float = 0.8
    max_fail_ratio: float = 0.001
    duration: str = "5m"
    users: str = ""
    instances: str = ""
    form: str = "context"
    output: Path = DEFAULT_OUTPUT
    sidecar: str = DEFAULT_SIDECAR
    token_file: Path = Path(DEFAULT_TOKEN_FILE)
    pause_settle_s: float = 15.0

    def __post_init__(self) -> None:
        positive_number("--p99-goal-ms", self.p99_goal_ms)
        if not 0 < self.headroom <= 1:
            raise ConfigError(f"--headroom {self.headroom} must be in (0, 1]: the target is "
                              "that fraction of the knee")
        if not 0 <= self.max_fail_ratio < 1:
            raise ConfigError(f"--max-fail-ratio {self.max_fail_ratio} must be in [0, 1)")
        if self.form not in REQUEST_FORMS:
            raise ConfigError(f"--form {self.form!r} is not one of "
                              f"{', '.join(REQUEST_FORMS)}")
        if not re.match(r"^https?://[^/]+", self.host):
            raise ConfigError(f"--host {self.host!r} is not an http(s) URL; pass e.g. "
                              f"{DEFAULT_HOST}")


def derive_target(knee_rps: float, headroom: float = 0.8) -> float:
    """The HPA's per-pod target: headroom x knee, rounded down to 0.1 req/s (never 0)."""
    if not knee_rps > 0:
        raise CapacityError(f"knee {knee_rps} req/s must be > 0")
    return max(math.floor(knee_rps * headroom * 10.0 + 1e-9) / 10.0, 0.1)


def format_quantity(value: float) -> str:
    """A Kubernetes quantity string for ``value`` (0.1 resolution): 100 -> "100",
    12.5 -> "12.5" (never an exponent, which Kubernetes would misread)."""
    v = round(value, 1)
    return str(int(v)) if v == int(v) else f"{v:.1f}"


def capacity_document(knee: Knee, cfg: CapacityConfig, target: float,
                      steps: Sequence[dict[str, Any]], machine: dict[str, Any],
                      measured_at: str) -> dict[str, Any]:
    """The loadtest/capacity.json document."""
    return {
        "knee_qps": knee.rps,
        "p99_goal_ms": cfg.p99_goal_ms,
        "headroom": cfg.headroom,
        "target_qps": target,
        "measured_at": measured_at,
        "machine": machine,
        "variant": "gpu" if machine.get("gpu") else "cpu",
        "instances_per_request": round(knee.instances_per_request, 2),
        "knee_instances_per_s": knee.instances_per_s,
        "form": cfg.form,
        "knee": asdict(knee),
        "load_test": {"shape": "step", "duration": cfg.duration, "users": cfg.users or None,
                      "instances": cfg.instances or None, "form": cfg.form,
                      "max_fail_ratio": cfg.max_fail_ratio,
                      "steps": list(steps)},
        "derivation": (f"target_qps = floor({cfg.headroom:g} x knee {knee.rps:.2f} req/s, "
                       f"0.1) = {target:g} req/s per pod"),
    }


# --------------------------------------------------------------------------- running


def _pings(host: str) -> bool:
    try:
        return httpx.get(f"{host.rstrip('/')}/ping", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _launcher(action: str) -> None:
    print(f"==> python -m serve.ops.launcher {action}", flush=True)
    subprocess.run([sys.executable, "-m", "serve.ops.launcher", action], check=True)


def _run_loadtest(cfg: CapacityConfig, summary_path: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "loadtest.run", "--shape", "step", "--duration", cfg.duration,
           "--host", cfg.host, "--summary-json", str(summary_path),
           "--p99-goal-ms", f"{cfg.p99_goal_ms:g}", "--max-fail-ratio", f"{cfg.max_fail_ratio:g}"]
    if cfg.users:
        cmd += ["--users", cfg.users]
    if cfg.instances:
        cmd += ["--instances", cfg.instances]
    cmd += ["--form", cfg.form]
    print("==> " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, check=False).returncode
    # 0: every threshold held; 1: one failed (expected: a step run pushes past the goal).
    if rc not in (0, 1) or not summary_path.is_file():
        raise CapacityError(f"the load test exited with {rc} and wrote no summary; see its "
                            "output above")
    doc: dict[str, Any] = json.loads(summary_path.read_text())
    return doc


def _print_derivation(steps: Sequence[dict[str, Any]], knee: Knee, cfg: CapacityConfig,
                      target: float) -> None:
    print(f"\n{'step':>4} {'users':>5} {'req/s':>9} {'inst/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'fail':>7}")
    for i, s in enumerate(steps):
        mark = "  <- knee" if i == knee.step_index else ""
        if not s.get("slo", True):
            mark = "  (warm-up: not judged)"
        print(f"{i:4d} {s['users']:5d} {s.get('rps') or 0:9.1f} "
              f"{s.get('instances_per_s') or 0:9.0f} {s.get('p50_ms') or 0:8.1f} "
              f"{s.get('p99_ms') or 0:8.1f} {s.get('fail_ratio') or 0:7.4f}{mark}")
    print(f"\nknee: {knee.rps:.2f} req/s ({knee.instances_per_s:.0f} instances/s, "
          f"{knee.instances_per_request:.1f} instances/request) at {knee.users} users, "
          f"p99 {knee.p99_ms:.1f} ms <= goal {cfg.p99_goal_ms:g} ms")
    print(f"stopped at: {knee.stop_reason}")
    if not knee.saturated:
        print("WARNING: no step broke the goal, so the knee is a lower bound")
    print(f"target_qps = floor({cfg.headroom:g} x {knee.rps:.2f}, 0.1) = {target:g} req/s "
          "per pod (a req/s target for this mix only; the HPA scales on utilization)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.ops.capacity",
        description="Measure one instance's knee (highest req/s at p99 <= goal) with the "
                    "step load test, then write loadtest/capacity.json (make hpa-sim "
                    "reads it; k8s/hpa.yaml is not changed).")
    p.add_argument("--host", default=DEFAULT_HOST, help="the instance's inference URL")
    p.add_argument("--p99-goal-ms", type=float, default=P99_SLO_MS,
                   help="latency goal a step must meet (default: the service's p99 goal, "
                        "MLPerf DLRM-v2's server bound)")
    p.add_argument("--headroom", type=float, default=0.8,
                   help="target = headroom x knee: room for metric delay and pod start-up")
    p.add_argument("--max-fail-ratio", type=float, default=0.001,
                   help="failed/all requests a step may have and still count")
    p.add_argument("--duration", default="5m",
                   help="whole step run (steps share it; longer = steadier figures)")
    p.add_argument("--users", default="", help="step levels, e.g. 1,2,4,8,16,32")
    p.add_argument("--instances", default="", help="instances per request (loadtest format)")
    p.add_argument("--form", default="context", choices=REQUEST_FORMS,
                   help="request form the load test sends (recorded in capacity.json)")
    p.add_argument("--sidecar", default=DEFAULT_SIDECAR,
                   help="the sidecar whose batching tuner is paused during the run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="capacity.json path")
    p.add_argument("--from-summary", type=Path, default=None,
                   help="derive from an existing loadtest summary.json instead of running")
    p.add_argument("--no-write", action="store_true", help="print only; change no file")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 40s over 1,2,4,8 users and --no-write (figures too short "
                        "to size an HPA)")
    return p


def _measure(cfg: CapacityConfig) -> dict[str, Any]:
    """The step load test's summary.json, starting the local default instance if needed."""
    started = False
    if not _pings(cfg.host):
        if cfg.host.rstrip("/") != DEFAULT_HOST:
            raise ConfigError(f"nothing answers {cfg.host}/ping; start it first (this "
                              f"only starts the local default at {DEFAULT_HOST})")
        _launcher("up")
        started = True
    try:
        with _tuner_paused(cfg), tempfile.TemporaryDirectory() as tmp:
            return _run_loadtest(cfg, Path(tmp) / "summary.json")
    finally:
        if started:
            _launcher("down")


@contextlib.contextmanager
def _tuner_paused(cfg: CapacityConfig) -> Iterator[None]:
    """Turn the sidecar's batching tuner off for the block when it is on (and on again
    after); nothing when no sidecar or tuner answers at ``cfg.sidecar``."""
    client = StateClient(cfg.sidecar, sidecar_token(cfg.token_file))
    # the reconciler switches back to the declared batching meanwhile
    with tuner_paused(client, settle=lambda: time.sleep(cfg.pause_settle_s)) as was_on:
        if was_on:
            print("==> batching tuner paused for the measurement (the declared batching "
                  "serves)", flush=True)
        yield
    if was_on:
        print("==> batching tuner on again", flush=True)


def _write(cfg: CapacityConfig, knee: Knee, target: float,
           steps: Sequence[dict[str, Any]]) -> None:
    """Write capacity.json."""
    measured_at = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    doc = capacity_document(knee, cfg, target, steps, machine_info(), measured_at)
    cfg.output.parent.mkdir(parents=True, exist_ok=True)
    cfg.output.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m serve.ops.capacity --help``."""
    args = _parser().parse_args(argv)
    if args.quick:
        args.duration, args.users, args.no_write = "40s", args.users or "1,2,4,8", True
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = CapacityConfig(host=args.host, p99_goal_ms=args.p99_goal_ms,
                             headroom=args.headroom, max_fail_ratio=args.max_fail_ratio,
                             duration=args.duration, users=args.users,
                             instances=args.instances, form=args.form, output=args.output,
                             sidecar=args.sidecar)
        if args.from_summary is not None:
            summary = json.loads(args.from_summary.read_text())
            # the summary says what was sent (a summary from before the field: instances)
            sent = (summary.get("traffic") or {}).get("form", "instances")
            cfg = replace(cfg, form=sent)
        else:
            summary = _measure(cfg)
        # The knee rule skips the steps not judged: the step shape's warm-up runs on a
        # cold server and is not a capacity measurement.
        steps = list(summary.get("steps") or [])
        knee = find_knee(steps, cfg.p99_goal_ms, cfg.max_fail_ratio)
        target = derive_target(knee.rps, cfg.headroom)
    except ServeError as e:
        print(f"capacity: {e.message}", file=sys.stderr)
        return 2
    except (subprocess.CalledProcessError, OSError, json.JSONDecodeError) as e:
        print(f"capacity: {e}", file=sys.stderr)
        return 3
    _print_derivation(steps, knee, cfg, target)
    if args.no_write:
        return 0
    try:
        _write(cfg, knee, target, steps)
    except ConfigError as e:
        print(f"capacity: {e.message}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"capacity: {e}", file=sys.stderr)
        return 3
    print(f"wrote {cfg.output} (k8s/hpa.yaml unchanged: it scales on utilization)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
