"""Measure what one serving instance sustains and derive the HPA's QPS target.

``make capacity`` (``python -m serve.capacity``):

1. makes sure one local instance answers (``python -m serve.launcher up`` when nothing
   answers ``/ping``; stopped again afterwards when this started it);
2. runs the step load test (``python -m loadtest.run --shape step``): closed-loop users
   double per step, each step measured after it settled;
3. finds the knee: walking up the steps, the highest request rate of a step whose p99 is
   within the goal (default 60 ms, the MLPerf DLRM-v2 server bound) and whose failure
   ratio is within bounds, stopping at the first step that breaks either;
4. target = ``headroom`` (0.8) x knee: the HPA scales out at 80% of what one pod
   sustains, leaving room for the metric's delay and pod start-up (``make hpa-sim``);
5. prints the derivation, writes ``k8s/capacity.json`` and sets the QPS
   ``averageValue`` in ``k8s/hpa.yaml`` to the target.

Units: rates in requests/s (one request carries many instances: the HPA's metric,
``dlrm_requests_per_second``, counts requests), latencies in ms.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from serve.errors import CapacityError, ConfigError, ServeError

__all__ = [
    "CapacityConfig",
    "Knee",
    "capacity_document",
    "derive_target",
    "find_knee",
    "format_quantity",
    "machine_info",
    "main",
    "update_hpa_target",
]

_log = logging.getLogger(__name__)

DEFAULT_HOST = "http://127.0.0.1:8080"
DEFAULT_OUTPUT = Path("k8s/capacity.json")
DEFAULT_HPA = Path("k8s/hpa.yaml")
# The line in k8s/hpa.yaml this module rewrites (the marker comment makes it unambiguous).
_HPA_LINE = re.compile(r'^(?P<indent>\s*)averageValue:\s*"?(?P<value>[0-9.]+[a-zA-Z]*)"?'
                       r'(?P<comment>\s*#\s*capacity\.json target_qps.*)$', re.MULTILINE)


@dataclass(frozen=True)
class CapacityConfig:
    """Settings of one capacity measurement.

    p99_goal_ms: latency bound a step must meet (MLPerf DLRM-v2 server: 60 ms).
    headroom: target = headroom x knee; (0, 1].
    max_fail_ratio: failed/all requests a step may have and still count.
    duration: the whole step run (loadtest's format: 90s, 5m); steps share it.
    users: step levels passed to the load test ("1,2,4,8,16"), or "" for its default.
    instances: instances per request passed to the load test, or "" for its default.
    """

    host: str = DEFAULT_HOST
    p99_goal_ms: float = 60.0
    headroom: float = 0.8
    max_fail_ratio: float = 0.001
    duration: str = "5m"
    users: str = ""
    instances: str = ""
    output: Path = DEFAULT_OUTPUT
    hpa: Path = DEFAULT_HPA

    def __post_init__(self) -> None:
        if not (self.p99_goal_ms > 0 and math.isfinite(self.p99_goal_ms)):
            raise ConfigError(f"--p99-goal-ms {self.p99_goal_ms} must be a finite number > 0")
        if not 0 < self.headroom <= 1:
            raise ConfigError(f"--headroom {self.headroom} must be in (0, 1]: the target is "
                              "that fraction of the knee")
        if not 0 <= self.max_fail_ratio < 1:
            raise ConfigError(f"--max-fail-ratio {self.max_fail_ratio} must be in [0, 1)")
        if not re.match(r"^https?://[^/]+", self.host):
            raise ConfigError(f"--host {self.host!r} is not an http(s) URL; pass e.g. "
                              f"{DEFAULT_HOST}")


@dataclass(frozen=True)
class Knee:
    """The sustainable step. ``saturated`` is False when no step broke the goal: the
    knee is then only a lower bound (the load test did not push hard enough)."""

    rps: float
    instances_per_s: float
    users: int
    p50_ms: float
    p99_ms: float
    fail_ratio: float
    step_index: int
    saturated: bool
    stop_reason: str

    @property
    def instances_per_request(self) -> float:
        return self.instances_per_s / self.rps if self.rps else 0.0


def find_knee(steps: Sequence[dict[str, Any]], p99_goal_ms: float,
              max_fail_ratio: float = 0.001) -> Knee:
    """The highest-rps step that meets the goals, walking up until one breaks them.

    Args:
        steps: load-test steps in order, each with "users", "rps", "instances_per_s",
            "p50_ms", "p99_ms", "fail_ratio" (loadtest's summary.json "steps").
    Raises:
        CapacityError: no steps, or the first step already misses the goals.
    """
    best: tuple[int, dict[str, Any]] | None = None
    reason = "every step met the goals: the knee is a lower bound; add users or duration"
    saturated = False
    if not steps:
        raise CapacityError("the load test reported no steps; check its log")
    for i, s in enumerate(steps):
        missing = [k for k in ("users", "rps", "p99_ms", "fail_ratio") if s.get(k) is None]
        if missing or not s.get("rps"):
            # No answer measured in the step: overloaded past any latency (or too short).
            saturated = True
            reason = (f"step {i} ({s.get('users')} users) measured no requests "
                      f"(no {', '.join(missing) or 'rps'}): overloaded, or lengthen --duration")
            break
        if s["p99_ms"] > p99_goal_ms or s["fail_ratio"] > max_fail_ratio:
            saturated = True
            reason = (f"step {i} ({s['users']} users, {s['rps']:.1f} req/s) has p99 "
                      f"{s['p99_ms']:.1f} ms (goal {p99_goal_ms:g}) and fail ratio "
                      f"{s['fail_ratio']:.4f} (max {max_fail_ratio:g})")
            break
        if best is None or s["rps"] > best[1]["rps"]:
            best = (i, s)
    if best is None:
        raise CapacityError(f"no step meets the goals ({reason}); one instance cannot serve "
                            f"at p99 <= {p99_goal_ms:g} ms even with one user: profile it "
                            "before scaling it")
    i, s = best
    return Knee(rps=float(s["rps"]), instances_per_s=float(s.get("instances_per_s") or 0.0),
                users=int(s["users"]), p50_ms=float(s.get("p50_ms") or 0.0),
                p99_ms=float(s["p99_ms"]), fail_ratio=float(s["fail_ratio"]), step_index=i,
                saturated=saturated, stop_reason=reason)


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


def update_hpa_target(text: str, target_qps: float) -> str:
    """``text`` (k8s/hpa.yaml) with the QPS averageValue set to ``target_qps``.

    Only the line marked ``# capacity.json target_qps`` changes, comments included.
    """
    matches = list(_HPA_LINE.finditer(text))
    if len(matches) != 1:
        raise ConfigError(f"k8s/hpa.yaml must have exactly one 'averageValue: \"N\"  # "
                          f"capacity.json target_qps' line, found {len(matches)}; restore it")
    m = matches[0]
    line = f'{m["indent"]}averageValue: "{format_quantity(target_qps)}"{m["comment"]}'
    return text[:m.start()] + line + text[m.end():]


def machine_info() -> dict[str, Any]:
    """Where the measurement ran: CPU model, cores, memory, accelerator, versions."""
    cpu_model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_model": cpu_model,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["gpu"] = None
    try:
        from importlib.metadata import version

        info["torchserve"] = version("torchserve")
    except Exception as e:  # noqa: BLE001 - optional detail, never fatal
        _log.debug("no torchserve version: %s", e)
    return info


def capacity_document(knee: Knee, cfg: CapacityConfig, target: float,
                      steps: Sequence[dict[str, Any]], machine: dict[str, Any],
                      measured_at: str) -> dict[str, Any]:
    """The k8s/capacity.json document."""
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
        "knee": asdict(knee),
        "load_test": {"shape": "step", "duration": cfg.duration, "users": cfg.users or None,
                      "instances": cfg.instances or None, "max_fail_ratio": cfg.max_fail_ratio,
                      "steps": list(steps)},
        "derivation": (f"target_qps = floor({cfg.headroom:g} x knee {knee.rps:.2f} req/s, "
                       f"0.1) = {target:g} req/s per pod"),
    }


# --------------------------------------------------------------------------- running


def _pings(host: str) -> bool:
    try:
        with urllib.request.urlopen(f"{host.rstrip('/')}/ping", timeout=2.0) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _launcher(action: str) -> None:
    print(f"==> python -m serve.launcher {action}", flush=True)
    subprocess.run([sys.executable, "-m", "serve.launcher", action], check=True)


def _run_loadtest(cfg: CapacityConfig, summary_path: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "loadtest.run", "--shape", "step", "--duration", cfg.duration,
           "--host", cfg.host, "--summary-json", str(summary_path),
           "--p99-goal-ms", f"{cfg.p99_goal_ms:g}", "--max-fail-ratio", f"{cfg.max_fail_ratio:g}"]
    if cfg.users:
        cmd += ["--users", cfg.users]
    if cfg.instances:
        cmd += ["--instances", cfg.instances]
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
        print(f"{i:4d} {s['users']:5d} {s['rps']:9.1f} {s.get('instances_per_s') or 0:9.0f} "
              f"{s.get('p50_ms') or 0:8.1f} {s['p99_ms']:8.1f} {s['fail_ratio']:7.4f}{mark}")
    print(f"\nknee: {knee.rps:.2f} req/s ({knee.instances_per_s:.0f} instances/s, "
          f"{knee.instances_per_request:.1f} instances/request) at {knee.users} users, "
          f"p99 {knee.p99_ms:.1f} ms <= goal {cfg.p99_goal_ms:g} ms")
    print(f"stopped at: {knee.stop_reason}")
    if not knee.saturated:
        print("WARNING: no step broke the goal, so the knee is a lower bound")
    print(f"target_qps = floor({cfg.headroom:g} x {knee.rps:.2f}, 0.1) = {target:g} req/s "
          "per pod (the HPA scales out above it)")


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m serve.capacity --help``."""
    p = argparse.ArgumentParser(
        prog="python -m serve.capacity",
        description="Measure one instance's knee (highest req/s at p99 <= goal) with the "
                    "step load test, then write k8s/capacity.json and the HPA's QPS target "
                    "(headroom x knee) into k8s/hpa.yaml.")
    p.add_argument("--host", default=DEFAULT_HOST, help="the instance's inference URL")
    p.add_argument("--p99-goal-ms", type=float, default=60.0,
                   help="latency goal a step must meet (MLPerf DLRM-v2 server: 60 ms)")
    p.add_argument("--headroom", type=float, default=0.8,
                   help="target = headroom x knee: room for metric delay and pod start-up")
    p.add_argument("--max-fail-ratio", type=float, default=0.001,
                   help="failed/all requests a step may have and still count")
    p.add_argument("--duration", default="5m",
                   help="whole step run (steps share it; longer = steadier figures)")
    p.add_argument("--users", default="", help="step levels, e.g. 1,2,4,8,16,32")
    p.add_argument("--instances", default="", help="instances per request (loadtest format)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="capacity.json path")
    p.add_argument("--hpa", type=Path, default=DEFAULT_HPA, help="HPA manifest to update")
    p.add_argument("--from-summary", type=Path, default=None,
                   help="derive from an existing loadtest summary.json instead of running")
    p.add_argument("--no-write", action="store_true", help="print only; change no file")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 40s over 1,2,4,8 users and --no-write (figures too short "
                        "to size an HPA)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.users, args.no_write = "40s", args.users or "1,2,4,8", True
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = CapacityConfig(host=args.host, p99_goal_ms=args.p99_goal_ms,
                             headroom=args.headroom, max_fail_ratio=args.max_fail_ratio,
                             duration=args.duration, users=args.users,
                             instances=args.instances, output=args.output, hpa=args.hpa)
        if args.from_summary is not None:
            summary = json.loads(args.from_summary.read_text())
        else:
            started = False
            if not _pings(cfg.host):
                if cfg.host.rstrip("/") != DEFAULT_HOST:
                    raise ConfigError(f"nothing answers {cfg.host}/ping; start it first (this "
                                      f"only starts the local default at {DEFAULT_HOST})")
                _launcher("up")
                started = True
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    summary = _run_loadtest(cfg, Path(tmp) / "summary.json")
            finally:
                if started:
                    _launcher("down")
        # Only judged steps: the step shape's warm-up runs on a cold server and is not
        # a capacity measurement.
        steps = [st for st in summary.get("steps") or [] if st.get("slo", True)]
        knee = find_knee(steps, cfg.p99_goal_ms, cfg.max_fail_ratio)
        target = derive_target(knee.rps, cfg.headroom)
    except ServeError as e:
        print(f"capacity: {e.message}", file=sys.stderr)
        return 2
    except (subprocess.CalledProcessError, OSError, json.JSONDecodeError) as e:
        print(f"capacity: {e}", file=sys.stderr)
        return 3
    _print_derivation(steps, knee, cfg, target)
    if summary.get("knee"):
        k = summary["knee"]
        print(f"(the load test's own knee, which also requires rising throughput: "
              f"{k.get('rps', 0):.2f} req/s at {k.get('users')} users)")
    if args.no_write:
        return 0
    measured_at = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    doc = capacity_document(knee, cfg, target, steps, machine_info(), measured_at)
    cfg.output.parent.mkdir(parents=True, exist_ok=True)
    cfg.output.write_text(json.dumps(doc, indent=2) + "\n")
    try:
        cfg.hpa.write_text(update_hpa_target(cfg.hpa.read_text(), target))
    except ConfigError as e:
        print(f"capacity: {e.message}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.output}; set {cfg.hpa} averageValue to \"{format_quantity(target)}\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
