"""The image's vulnerability scan (``make scan``): three scanners, one verdict line each.

    python -m serve.ops.scan --image dlrm-serve:0.1.0 [--strict]

1. ``os+jars (trivy)``: the image's Debian packages, and the jars inside it (TorchServe's frontend:
   netty, log4j2, snakeyaml, gson), with ``trivy image --severity HIGH,CRITICAL
   --exit-code 1 --scanners vuln`` (trivy reads both OS package databases and jar
   manifests; it downloads its vulnerability database from a registry, ghcr.io);
2. ``os+jars (grype)``: the same with ``grype <image> --only-fixed --fail-on high``, a
   second database, for TorchServe's bundled jars above all (they are frozen since TorchServe 0.12.0,
   archived upstream, so nothing will update them for us);
3. ``python``: the serving packages, ``python -m serve.ops.audit --strict`` (what
   ``make lint AUDIT_STRICT=1`` runs).

Each line says ``clean`` only when that scanner ran against its database and found
nothing at or above HIGH; ``VULNERABLE`` when it found something; ``NOT SCANNED`` with
the reason when the tool is not installed, its database or the registry cannot be
reached, or the image is not there. Exit code: 1 when any is VULNERABLE; else 2 with
``--strict`` when any is NOT SCANNED (the scheduled job that has a registry runs it
so); else 0. Never "clean" for what did not run: on a machine without the scanners or a
registry (this project's CI), every line says NOT SCANNED.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Finding", "main", "scan_python", "scan_with"]

_REPO = Path(__file__).resolve().parents[2]
CLEAN, VULNERABLE, NOT_SCANNED = "clean", "VULNERABLE", "NOT SCANNED"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One scanner's verdict: ``what`` was scanned, ``verdict`` one of clean /
    VULNERABLE / NOT SCANNED, ``why`` the reason or the tool's last output lines."""

    what: str
    verdict: str
    why: str = ""

    def line(self) -> str:
        return f"scan {self.what}: {self.verdict}" + (f" ({self.why})" if self.why else "")


def _tail(text: str, n: int = 400) -> str:
    return " ".join(text.strip().split())[-n:]


def scan_with(what: str, tool: str, args: Sequence[str], timeout_s: float) -> Finding:
    """Run ``tool args``: exit 0 clean, 1 VULNERABLE (both scanners' --exit-code /
    --fail-on convention), anything else (database or registry unreachable, no image)
    NOT SCANNED; a missing tool is NOT SCANNED too."""
    exe = shutil.which(tool)
    if exe is None:
        return Finding(what, NOT_SCANNED, f"{tool} is not installed on this machine")
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s,
                             check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Finding(what, NOT_SCANNED, f"{tool} took over {timeout_s:.0f} s")
    if out.returncode == 0:
        return Finding(what, CLEAN, f"{tool}")
    if out.returncode == 1:
        return Finding(what, VULNERABLE, f"{tool}: {_tail(out.stdout or out.stderr)}")
    return Finding(what, NOT_SCANNED, f"{tool} exit {out.returncode}, its database, the "
                                      f"registry or the image is unreachable: "
                                      f"{_tail(out.stderr or out.stdout)}")


def scan_python(pip_audit: str | None, timeout_s: float) -> Finding:
    """``python -m serve.ops.audit --strict``: 0 clean, 1 VULNERABLE, 2 NOT AUDITED."""
    cmd = [sys.executable, "-m", "serve.ops.audit", "--strict", "--timeout-s", str(timeout_s)]
    if pip_audit is not None:
        cmd += ["--pip-audit", pip_audit]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=_REPO, check=False,
                         timeout=timeout_s + 60)
    text = _tail(out.stdout + " " + out.stderr)
    if out.returncode == 0:
        return Finding("python", CLEAN, "pip-audit")
    if out.returncode == 1:
        return Finding("python", VULNERABLE, text)
    return Finding("python", NOT_SCANNED, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.scan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", required=True, help="the built image, e.g. dlrm-serve:0.1.0")
    ap.add_argument("--strict", action="store_true", help="NOT SCANNED fails (exit 2)")
    ap.add_argument("--pip-audit", default=None, help="pip-audit executable (default: the venv's)")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args(argv)
    findings = [
        scan_with("os+jars (trivy)", "trivy", ["image", "--severity", "HIGH,CRITICAL", "--exit-code", "1",
                                  "--scanners", "vuln", "--quiet", args.image], args.timeout_s),
        scan_with("os+jars (grype)", "grype", [args.image, "--only-fixed", "--fail-on", "high", "-q"],
                  args.timeout_s),
        scan_python(args.pip_audit, args.timeout_s),
    ]
    for f in findings:
        print(f.line(), file=sys.stdout if f.verdict == CLEAN else sys.stderr, flush=True)
    verdicts = {f.verdict for f in findings}
    if VULNERABLE in verdicts:
        return 1
    if NOT_SCANNED in verdicts:
        print(f"scan: NOT SCANNED: {sum(f.verdict == NOT_SCANNED for f in findings)} of "
              f"{len(findings)} scanners did not run; this is not a clean result",
              file=sys.stderr, flush=True)
        return 2 if args.strict else 0
    print(f"scan: clean ({args.image}: OS packages, jars, serving packages)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
