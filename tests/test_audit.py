"""serve.ops.audit, the pip-audit step of `make lint`: it audits the serving closure, fails
on a found advisory, and says NOT AUDITED (never "clean") when the vulnerability service
could not check the packages.

pip-audit is a tool we run, not one we ship: the verdict cases drive the real module and a
real subprocess through small stand-in executables that print pip-audit's JSON (its
``-f json`` shape: ``{"dependencies": [{"name", "version", "vulns": [...]}|{"name",
"skip_reason"}], "fixes": []}``). The real pip-audit runs where it is installed.
"""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from serve.errors import ConfigError
from serve.ops import audit

REPO = Path(__file__).resolve().parents[1]
SERVE_REQS = REPO / "requirements-serve.txt"
CONSTRAINTS = REPO / "constraints.txt"


def _fake_pip_audit(tmp_path: Path, stdout: str, code: int, stderr: str = "") -> Path:
    """An executable that records its argv and prints ``stdout``/``stderr``, exits ``code``."""
    exe = tmp_path / "pip-audit"
    exe.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"sys.stdout.write({stdout!r}); sys.stderr.write({stderr!r}); sys.exit({code})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _run(tmp_path: Path, exe: Path, *extra: str, accepted: str | None = None) -> int:
    acc = tmp_path / "accepted.txt"
    if accepted is not None:
        acc.write_text(accepted)
    return audit.main(["--pip-audit", str(exe), "--accepted", str(acc), *extra])


def _report(*deps: dict) -> str:
    return json.dumps({"dependencies": list(deps), "fixes": []})


def test_a_found_advisory_fails_and_is_named(tmp_path, capsys):
    exe = _fake_pip_audit(tmp_path, _report(
        {"name": "fastapi", "version": "0.165.0", "vulns": []},
        {"name": "h11", "version": "0.16.0", "vulns": [
            {"id": "GHSA-aaaa-bbbb-cccc", "fix_versions": ["0.17.0"], "aliases": []}]}), 1)
    for strict in ((), ("--strict",)):
        assert _run(tmp_path, exe, *strict) == 1
        err = capsys.readouterr().err
        assert "pip-audit: VULNERABLE: 1 advisory(ies)" in err
        assert "h11==0.16.0: GHSA-aaaa-bbbb-cccc (fixed in: 0.17.0)" in err


def test_an_unreachable_service_is_not_audited_and_strict_fails(tmp_path, capsys):
    """pip-audit's own output here: every package skipped, exit 0 (it would print "No
    known vulnerabilities found"). The audit says NOT AUDITED, loudly."""
    pins = audit.serving_closure(SERVE_REQS, CONSTRAINTS)
    skipped = [{"name": n, "skip_reason": f"Dependency not found on PyPI and could not be "
                f"audited: {n} ({v})"} for n, v in pins.items()]
    exe = _fake_pip_audit(tmp_path, _report(*skipped), 0)
    assert _run(tmp_path, exe) == 0
    out = capsys.readouterr()
    assert "pip-audit: clean" not in out.out + out.err
    assert f"pip-audit: NOT AUDITED: {len(pins)} of {len(pins)} serving packages" in out.err
    assert "This is NOT a clean result." in out.err
    assert _run(tmp_path, exe, "--strict") == 2
    assert "--strict: failing." in capsys.readouterr().err


def test_a_crashed_pip_audit_is_not_audited(tmp_path, capsys):
    """OSV's host not resolving: pip-audit exits 1 with a traceback and no JSON."""
    exe = _fake_pip_audit(tmp_path, "", 1, stderr="Traceback ...\nrequests.exceptions."
                          "ConnectionError: Failed to resolve 'api.osv.dev'\n")
    assert _run(tmp_path, exe) == 0
    err = capsys.readouterr().err
    assert "pip-audit: NOT AUDITED:" in err and "Failed to resolve 'api.osv.dev'" in err
    assert _run(tmp_path, exe, "--strict") == 2


def test_clean_audits_exactly_the_serving_closure_with_the_accepted_ids(tmp_path, capsys):
    pins = audit.serving_closure(SERVE_REQS, CONSTRAINTS)
    exe = _fake_pip_audit(tmp_path, _report(
        *({"name": n, "version": v, "vulns": []} for n, v in pins.items())), 0)
    code = _run(tmp_path, exe, accepted="# comment\nPYSEC-2099-1 not reachable here: loopback only\n")
    assert code == 0
    out = capsys.readouterr().out
    assert f"pip-audit: clean: {len(pins)} serving packages checked" in out
    assert "1 accepted advisory(ies) ignored" in out and "PYSEC-2099-1" in out
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--ignore-vuln") + 1] == "PYSEC-2099-1"
    assert "--no-deps" in argv and "--disable-pip" in argv and argv[argv.index("-f") + 1] == "json"


def test_the_closure_is_pinned_and_has_no_tool():
    pins = audit.serving_closure(SERVE_REQS, CONSTRAINTS)
    names = {n.lower().replace("_", "-") for n in pins}
    assert {"torchserve", "fastapi", "uvicorn", "starlette", "h11", "pillow"} <= names
    assert not names & {"locust", "pytest", "mypy", "ruff", "pip-audit", "torchrec",
                        "fbgemm-gpu-cpu", "matplotlib", "kubernetes-validate"}
    assert all(v[0].isdigit() for v in pins.values())


def test_an_unpinned_dependency_is_an_error(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(ln for ln in CONSTRAINTS.read_text().splitlines()
                                     if not ln.lower().startswith("starlette==")))
    with pytest.raises(ConfigError, match=r"starlette is in the serving closure .* pin it"):
        audit.serving_closure(SERVE_REQS, constraints)


@pytest.mark.parametrize("line", ["PYSEC-2024-1", "not-an-id because", "GHSA-x"])
def test_an_accepted_entry_needs_an_id_and_a_reason(tmp_path, line):
    path = tmp_path / "accepted.txt"
    path.write_text(f"# header\n{line}\n")
    with pytest.raises(ConfigError, match="is not 'ADVISORY-ID reason'"):
        audit.accepted_vulnerabilities(path)


def test_the_repo_accepted_file_parses_and_make_lint_runs_the_audit():
    assert audit.accepted_vulnerabilities(REPO / audit.ACCEPTED_FILE) == {}
    lint = (REPO / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m serve.ops.audit" in lint and "--strict" in lint


@pytest.mark.slow
def test_the_real_pip_audit_gives_an_honest_verdict(capsys):
    """Where pip-audit is installed (make venv): whatever the network allows, the verdict
    is one of the three lines, and never "clean" while a package was skipped. Slow: it
    asks the vulnerability service (a few seconds here; up to its timeout offline)."""
    exe = Path(sys.executable).with_name("pip-audit")
    if not exe.exists():
        pytest.skip(f"pip-audit is not installed beside {sys.executable}: `make venv` "
                    "installs it (requirements-dev.txt)")
    code = audit.main(["--pip-audit", str(exe), "--timeout-s", "120"])
    out = capsys.readouterr()
    text = out.out + out.err
    verdicts = [v for v in ("clean:", "NOT AUDITED:", "VULNERABLE:") if f"pip-audit: {v}" in text]
    assert len(verdicts) == 1, text
    assert code == (1 if verdicts == ["VULNERABLE:"] else 0), text
