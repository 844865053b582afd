"""Audit the serving image's Python packages for known vulnerabilities (pip-audit).

    python -m serve.ops.audit            # make lint runs this
    python -m serve.ops.audit --strict   # an unreachable vulnerability service fails too

What it audits: the serving closure, i.e. ``requirements-serve.txt`` (what the Dockerfile
installs) and everything those packages require, walked through the installed packages'
metadata, each at the version ``constraints.txt`` pins. pip-audit then checks those exact
pins (``--no-deps --disable-pip``: nothing is installed or resolved).

Exceptions a person accepted live in ``security/accepted-vulnerabilities.txt``, one per
line: the advisory id, then why it does not apply or why it waits. Each is passed as
``--ignore-vuln``; an entry without a reason is an error.

The verdict, one line each, and the exit code:

- ``pip-audit: clean``: every package was checked, no advisory outside the accepted ones (0);
- ``pip-audit: VULNERABLE``: an advisory that is not accepted (1, always);
- ``pip-audit: NOT AUDITED``: the vulnerability service could not be reached or did not
  know a package, so nothing (or not everything) was checked. 0 with the warning, so a
  machine without the service (this project's CI) stays green and says why on every
  run; 2 with ``--strict`` (``make lint AUDIT_STRICT=1``), for a machine that reaches it;
- a bad pin list or accepted-vulnerabilities file: 2.

pip-audit alone cannot be trusted with the third case: when PyPI's per-version JSON
answers 404 it reports every package as skipped and still prints "No known
vulnerabilities found" with exit code 0 (SECURITY.md, "Supply chain").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from serve.errors import ConfigError

__all__ = ["ACCEPTED_FILE", "Verdict", "accepted_vulnerabilities", "interpret", "main",
           "read_pins", "serving_closure", "verdict_lines"]

_REPO = Path(__file__).resolve().parents[2]
#: The accepted exceptions, relative to the repository root.
ACCEPTED_FILE = Path("security") / "accepted-vulnerabilities.txt"
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([0-9][0-9A-Za-z.+!-]*)\s*(?:#.*)?$")
_ADVISORY = re.compile(r"^(PYSEC|GHSA|CVE|OSV|GMS|PVE)-[A-Za-z0-9-]+$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(*paths: Path) -> dict[str, tuple[str, str]]:
    """``normalized name -> (name, version)`` for every ``name==version`` line of the
    files (comments, blank lines and ``-r``/``-c`` lines skipped; a later file wins)."""
    pins: dict[str, tuple[str, str]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            m = _PIN.match(line)
            if m:
                pins[_norm(m.group(1))] = (m.group(1), m.group(2))
    return pins


def _requires(name: str) -> list[str]:
    """The names ``name``'s installed metadata requires (no extras; markers evaluated)."""
    try:
        reqs = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        raise ConfigError(f"{name} is not installed here, so its dependencies cannot be "
                          "walked: run `make venv` (the audit reads the installed metadata)"
                          ) from None
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def serving_closure(requirements: Path, constraints: Path) -> dict[str, str]:
    """``name -> pinned version`` for ``requirements`` and everything it requires.

    Raises:
        ConfigError: a package of the closure has no pin in either file.
    """
    pins = read_pins(constraints, requirements)
    todo = [name for name, _ in read_pins(requirements).values()]
    seen: dict[str, str] = {}
    while todo:
        name = todo.pop()
        key = _norm(name)
        if key in {_norm(n) for n in seen}:
            continue
        if key not in pins:
            raise ConfigError(f"{name} is in the serving closure of {requirements.name} but "
                              f"has no version pinned in {constraints.name} or "
                              f"{requirements.name}: pin it (name==version) in {constraints.name}")
        seen[pins[key][0]] = pins[key][1]
        todo.extend(_requires(name))
    return dict(sorted(seen.items(), key=lambda kv: _norm(kv[0])))


def accepted_vulnerabilities(path: Path) -> dict[str, str]:
    """``advisory id -> reason`` from the accepted-exceptions file (missing file: none).

    Raises:
        ConfigError: a line that is not ``ID reason``.
    """
    if not path.is_file():
        return {}
    out: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        vid, _, reason = line.partition(" ")
        if not _ADVISORY.fullmatch(vid) or not reason.strip():
            raise ConfigError(f"{path.name}:{n}: {line!r} is not 'ADVISORY-ID reason': write "
                              "the id pip-audit prints (PYSEC-..., GHSA-..., CVE-...), a space "
                              "and why it is accepted")
        out[vid] = reason.strip()
    return out


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one pip-audit run found.

    Attributes:
        audited: ``(name, version)`` of each package the service checked.
        vulnerable: ``(name, version, advisory id, fixed in)`` of each advisory found
            (the accepted ones are not reported by pip-audit).
        skipped: ``(name, why)`` of each package the service did not check.
        service_error: pip-audit failed before reporting (e.g. the service's host did not
            resolve): its last line; None when it reported.
    """

    audited: tuple[tuple[str, str], ...] = ()
    vulnerable: tuple[tuple[str, str, str, str], ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    service_error: str | None = None


def interpret(returncode: int, stdout: str, stderr: str) -> Verdict:
    """The verdict of ``pip-audit -f json``'s output (its exit code is 1 for findings
    and for crashes alike, so the JSON decides)."""
    try:
        report: dict[str, Any] = json.loads(stdout)
        deps = report["dependencies"]
    except (ValueError, KeyError, TypeError):
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit code {returncode}, no output"
        return Verdict(service_error=last[:400])
    audited, vulnerable, skipped = [], [], []
    for dep in deps:
        if "skip_reason" in dep:
            skipped.append((dep["name"], dep["skip_reason"]))
            continue
        audited.append((dep["name"], dep.get("version", "?")))
        for v in dep.get("vulns", []):
            fixed = ", ".join(v.get("fix_versions") or []) or "no fix"
            vulnerable.append((dep["name"], dep.get("version", "?"), v["id"], fixed))
    return Verdict(tuple(audited), tuple(vulnerable), tuple(skipped))


def verdict_lines(verdict: Verdict, total: int, strict: bool) -> tuple[list[str], int]:
    """The lines to print and the exit code (module docstring)."""
    if verdict.vulnerable:
        lines = [(f"pip-audit: VULNERABLE: {len(verdict.vulnerable)} advisory(ies) in the "
                  "serving packages:")]
        lines += [f"  {n}=={v}: {vid} (fixed in: {fix})" for n, v, vid, fix in verdict.vulnerable]
        lines.append(f"  upgrade the pin (constraints.txt, requirements-serve.txt), or accept "
                     f"it with a reason in {ACCEPTED_FILE}")
        return lines, 1
    if verdict.service_error is not None or verdict.skipped:
        why = verdict.service_error or verdict.skipped[0][1]
        missed = len(verdict.skipped) if verdict.skipped else total
        lines = [(f"pip-audit: NOT AUDITED: {missed} of {total} serving packages were not "
                  "checked: the vulnerability service could not be reached or did not know "
                  f"them ({why}). This is NOT a clean result.")]
        lines.append("  run `make lint AUDIT_STRICT=1` where the service is reachable; "
                     + ("--strict: failing." if strict else "without --strict: a warning."))
        return lines, 2 if strict else 0
    return [(f"pip-audit: clean: {len(verdict.audited)} serving packages checked, no "
             "advisory outside the accepted ones")], 0


def _run_pip_audit(exe: str, pins: dict[str, str], ignore: list[str],
                   timeout_s: float) -> Verdict:
    with tempfile.TemporaryDirectory(prefix="dlrm-audit-") as tmp:
        req = Path(tmp) / "serving-closure.txt"
        req.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
        cmd = [exe, "-r", str(req), "--no-deps", "--disable-pip", "--progress-spinner", "off",
               "-f", "json", "--timeout", "30"]
        for vid in ignore:
            cmd += ["--ignore-vuln", vid]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                 check=False, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise ConfigError(f"pip-audit not found at {exe}: it is pinned in "
                              "requirements-dev.txt, run `make venv`") from None
        except subprocess.TimeoutExpired:
            return Verdict(service_error=f"pip-audit took over {timeout_s:.0f} s")
    return interpret(out.returncode, out.stdout, out.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.audit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requirements", type=Path, default=_REPO / "requirements-serve.txt")
    ap.add_argument("--constraints", type=Path, default=_REPO / "constraints.txt")
    ap.add_argument("--accepted", type=Path, default=_REPO / ACCEPTED_FILE)
    ap.add_argument("--pip-audit", default=str(Path(sys.executable).with_name("pip-audit")),
                    help="the pip-audit executable (default: the one beside this Python)")
    ap.add_argument("--strict", action="store_true",
                    help="fail (exit 2) when the vulnerability service cannot be reached")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    try:
        pins = serving_closure(args.requirements, args.constraints)
        accepted = accepted_vulnerabilities(args.accepted)
        verdict = _run_pip_audit(args.pip_audit, pins, sorted(accepted), args.timeout_s)
    except ConfigError as e:
        print(f"pip-audit: ERROR: {e.message}", file=sys.stderr, flush=True)
        return 2
    if accepted:
        print(f"pip-audit: {len(accepted)} accepted advisory(ies) ignored ({ACCEPTED_FILE}): "
              + ", ".join(sorted(accepted)), flush=True)
    lines, code = verdict_lines(verdict, len(pins), args.strict)
    clean = code == 0 and lines[0].startswith("pip-audit: clean")
    print("\n".join(lines), file=sys.stdout if clean else sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
