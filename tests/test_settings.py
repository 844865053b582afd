"""One source of truth for configuration: the environment registry (serve/settings.py),
the sidecar's command line generated from its config dataclasses, the generated
docs/configuration.md, the shared validators, and the p99 goal and guard defaults defined
once (serve/constants.py)."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve import settings
from serve.common import validate
from serve.common.flags import build
from serve.constants import (
    GUARD_FAILURE_LIMIT,
    GUARD_INTERVAL_S,
    GUARD_MAX_ERROR_RATIO,
    GUARD_MAX_LATENCY_RATIO,
    GUARD_MAX_SCORE_PSI,
    GUARD_MIN_INSTANCES,
    GUARD_MIN_REQUESTS,
    P99_SLO_MS,
)
from serve.errors import ConfigError, InvalidDelta
from serve.ops import configdoc
from serve.sidecar.config import ServerOptions, SidecarConfig, cli_options
from serve.sidecar.http.app import build_parser

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("serve", "handlers", "loadtest", "bench")
# A quoted "DLRM_..." / "TS_..." string: an environment variable's name spelled out.
_LITERAL = re.compile(r"""(?P<q>["'])(?P<name>(?:DLRM|TS)_[A-Z0-9_]+)(?P=q)""")
# Every flag the sidecar had before its parser was generated: the launcher, the test
# fixtures, k8s/deployment.yaml and people pass them.
SIDECAR_FLAGS = (
    "--host", "--port", "--inference-url", "--management-url", "--metrics-url",
    "--model-name", "--token-file", "--create-token", "--multiproc-dir", "--model-store",
    "--state-file", "--repository", "--reconcile-interval", "--register-timeout",
    "--drain-timeout", "--cgroup-root", "--memory-limit-bytes", "--prediction-log-dir",
    "--feedback-window-s", "--feedback-index-entries", "--feedback-max-body-bytes",
    "--delta-dir", "--max-delta-bytes", "--max-delta-store-bytes", "--delta-verify-key",
    "--archive-verify-key", "--drain-file",
    "--autotune",
    "--p99-goal-ms", "--tune-window-s", "--tune-settle-s", "--tune-min-dwell-s",
    "--tune-min-switch-interval-s", "--log-level",
    # the edge (serve/sidecar/http/edge.py): the write port and the scoped tokens
    "--write-port", "--oip-port", "--oip-mode", "--delta-token-file", "--feedback-token-file",
    # embedding deltas in a fleet: POSTs refused, the model volume followed
    "--deltas-post",
    # the published deltas from a volume of their own (k8s: the PVC dlrm-deltas)
    "--delta-volume",
    # one rollout decision per fleet (serve/sidecar/control/fleet.py)
    "--fleet", "--fleet-identity", "--fleet-lease-s", "--fleet-dir",
    # the workers' host tier budget, which a switch's memory check counts (issue 53)
    "--host-cache-bytes", "--host-cache-fraction")


# --------------------------------------------------------------------------- the registry


def test_each_variable_is_registered_once_under_its_own_name():
    names = [v.name for v in settings.REGISTRY]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for var in settings.REGISTRY:
        assert getattr(settings, var.name) is var, var.name
        assert var.name in settings.__all__, var.name
        assert var.help.strip() and var.where, var.name
        assert settings.by_name(var.name) is var
    with pytest.raises(KeyError, match="DLRM_NOPE is not in serve.settings.REGISTRY"):
        settings.by_name("DLRM_NOPE")


def _scanned_files() -> list[Path]:
    return [p for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))
            if p != REPO / "serve" / "settings.py"]


def _python_names(text: str) -> set[str]:
    """Names the file uses as identifiers (unquoted): ``TS_BATCH_HEADER = ...``, imports."""
    unquoted = _LITERAL.sub("", text)
    return set(re.findall(r"\b((?:DLRM|TS)_[A-Z0-9_]+)\b", unquoted))


def test_variable_names_are_spelled_only_in_the_registry():
    """No "DLRM_..." / "TS_..." string outside serve/settings.py: a module reads its
    variable through the registry's EnvVar. The only other such strings allowed are
    Python names (an ``__all__`` entry such as "TS_BATCH_HEADER", a header constant)."""
    registered = {v.name for v in settings.REGISTRY}
    bad = []
    for path in _scanned_files():
        text = path.read_text()
        own = _python_names(text)
        for m in _LITERAL.finditer(text):
            name = m["name"]
            if name in registered or name not in own:
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{path.relative_to(REPO)}:{line}: {m.group(0)}")
    assert not bad, ("environment variable names spelled outside serve/settings.py (import "
                     "the EnvVar from serve.settings instead):\n" + "\n".join(bad))


def test_the_scan_finds_a_spelled_out_variable():
    text = ('x = os.environ.get("DLRM_NEW_THING")\n'
            '__all__ = ["TS_BATCH_HEADER"]\nTS_BATCH_HEADER = 1\n')
    found = [m["name"] for m in _LITERAL.finditer(text) if m["name"] not in _python_names(text)]
    assert found == ["DLRM_NEW_THING"]


def test_a_variable_that_sets_a_field_has_no_default_of_its_own():
    """Its default is the field's (written once); the registry's stays None."""
    linked = configdoc.linked_options()
    assert {o.spec.env.name for o in linked} >= {"DLRM_TUNE_WINDOW_S", "DLRM_DELTA_DIR",
                                                 "DLRM_PREDICTION_LOG_MAX_BYTES"}
    for opt in linked:
        assert opt.spec.env.default is None, opt.spec.env.name


def test_the_deployment_sets_only_registered_variables():
    registered = {v.name for v in settings.REGISTRY}
    names = set()
    for path in sorted((REPO / "k8s").rglob("*.yaml")):
        names |= set(re.findall(r"name: ((?:DLRM|TS)_[A-Z0-9_]+)", path.read_text()))
    assert names and names <= registered, sorted(names - registered)


def test_readers_parse_at_call_time_and_name_the_variable():
    var = settings.DLRM_DELTA_POLL_MS
    assert var.get({}) == "100" and var.raw({}) is None and var.raw({var.name: "  "}) is None
    assert var.get_int({var.name: " 250 "}) == 250
    with pytest.raises(ConfigError, match=r"^DLRM_DELTA_POLL_MS='x' is not an integer"):
        var.get_int({var.name: "x"})
    goal = settings.DLRM_P99_GOAL_MS
    assert goal.get_float({}) is None and goal.get_float({}, default=1.5) == 1.5
    with pytest.raises(ConfigError, match=r"^DLRM_P99_GOAL_MS='fast' is not a number"):
        goal.get_float({goal.name: "fast"})
    tune = settings.DLRM_AUTOTUNE
    assert [tune.get_bool({tune.name: v}) for v in ("0", "off", "No", "1", "TRUE", "on")] == \
        [False, False, False, True, True, True]
    with pytest.raises(ConfigError, match=r"^DLRM_AUTOTUNE='maybe' must be one of"):
        tune.get_bool({tune.name: "maybe"})
    port = settings.TS_INFERENCE_PORT
    assert port.get_port({}) == 8080 and port.get_port({port.name: "8180"}) == 8180
    for bad in ("0", "70000", "80a"):
        with pytest.raises(ConfigError, match=r"^TS_INFERENCE_PORT='.*' must be a port number"):
            port.get_port({port.name: bad})
    assert settings.DLRM_REPOSITORY.get_list({"DLRM_REPOSITORY": "a::b:"}) == ("a", "b")


def test_the_registry_is_light():
    """The pod and the handler import it: no torch, no web framework, no numpy."""
    code = ("import sys, serve.settings, serve.common.flags, serve.common.validate\n"
            "heavy = {'torch', 'torchrec', 'numpy', 'pydantic', 'fastapi', 'yaml', 'httpx'}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout.strip()
    assert out == "[]"


# --------------------------------------------------------------------------- sidecar CLI


def test_every_existing_sidecar_flag_still_parses():
    help_text = build_parser({}).format_help()
    for flag in SIDECAR_FLAGS:
        assert flag in help_text, flag


def test_the_generated_parser_defaults_are_the_dataclass_defaults():
    parser = build_parser({})
    opts = cli_options()
    assert {o.spec.name for o in opts if o.spec.name} == set(SIDECAR_FLAGS)
    for opt in opts:
        if opt.spec.name is None:
            continue
        assert opt.from_cli(parser.get_default(opt.dest)) == opt.default, opt.spec.name
    args = parser.parse_args([])
    assert build(ServerOptions, args) == ServerOptions()
    assert build(SidecarConfig, args, {"token": None}) == dataclasses.replace(
        SidecarConfig(), multiproc_dir=Path(".run/prometheus"))


def test_a_variable_sets_a_flags_default_and_the_flag_wins():
    env = {"DLRM_TUNE_WINDOW_S": "7", "DLRM_AUTOTUNE": "0", "DLRM_REPOSITORY": "/a:/b",
           "DLRM_MEMORY_LIMIT_BYTES": "1000000", "DLRM_PREDICTION_LOG_DIR": "/logs"}
    cfg = build(SidecarConfig, build_parser(env).parse_args([]))
    assert (cfg.tuner.window_s, cfg.tuner.enabled, cfg.repositories, cfg.memory_limit_bytes,
            cfg.feedback.log_dir) == (7.0, False, (Path("/a"), Path("/b")), 1_000_000,
                                      Path("/logs"))
    cfg = build(SidecarConfig, build_parser(env).parse_args(
        ["--tune-window-s", "5", "--autotune", "on", "--repository", "/c"]))
    assert (cfg.tuner.window_s, cfg.tuner.enabled, cfg.repositories) == (5.0, True, (Path("/c"),))
    with pytest.raises(ConfigError, match=r"^DLRM_FEEDBACK_WINDOW_S='long' is not a number"):
        build_parser({"DLRM_FEEDBACK_WINDOW_S": "long"})


def test_sidecar_help_lists_every_flag_with_its_default_and_variable():
    out = subprocess.run([sys.executable, "-m", "serve.sidecar", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"}).stdout
    flat = " ".join(out.split())
    for opt in cli_options():
        if opt.spec.name is None:
            continue
        assert opt.spec.name in flat
        shown = "off" if opt.spec.switch else opt.shown(opt.default)
        assert f"(default: {shown})" in flat, opt.spec.name
        if opt.spec.env is not None:
            assert f"[{opt.spec.env.name}]" in flat, opt.spec.name


# --------------------------------------------------------------------------- the doc


def test_the_configuration_doc_is_generated_and_fresh():
    path = REPO / configdoc.DOC_PATH
    assert path.is_file(), "run python -m serve.ops.configdoc --write"
    assert path.read_text() == configdoc.render(), (
        "docs/configuration.md is stale: run python -m serve.ops.configdoc --write")
    text = path.read_text()
    for var in settings.REGISTRY:
        assert f"| `{var.name}` |" in text, var.name
    for flag in SIDECAR_FLAGS:
        assert f"| `{flag}` |" in text, flag


def test_configdoc_check_fails_on_a_stale_copy(tmp_path):
    assert configdoc.main(["--check", "--root", str(tmp_path)]) == 1
    assert configdoc.main(["--write", "--root", str(tmp_path)]) == 0
    assert configdoc.main(["--check", "--root", str(tmp_path)]) == 0
    doc = tmp_path / configdoc.DOC_PATH
    doc.write_text(doc.read_text().replace("60", "61"))
    assert configdoc.main(["--check", "--root", str(tmp_path)]) == 1


def test_make_check_reruns_the_generators_and_ci_calls_it():
    make = (REPO / "Makefile").read_text()
    target = make.split("\ncheck:", 1)[1].split("\n\n", 1)[0]
    assert "## " in target.splitlines()[0]
    for generator in ("serve.ops.monitoring", "serve.ops.configdoc"):
        assert f"-m {generator} --write" in target, generator
    assert "git diff --exit-code" in target and "git status --porcelain" in target
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
          if ln.strip().startswith("make ")]
    assert ci == ["make lint", "make check", "make test"]


# --------------------------------------------------------------------------- defined once


def test_the_p99_goal_is_defined_once():
    from loadtest.stats import Thresholds
    from serve.ops import monitoring_rules
    from serve.ops.capacity import CapacityConfig
    from serve.sidecar.config import TunerConfig

    assert TunerConfig().p99_goal_ms == CapacityConfig().p99_goal_ms == \
        Thresholds().p99_goal_ms == P99_SLO_MS
    assert pytest.approx(P99_SLO_MS) == monitoring_rules.P99_SLO_SECONDS * 1000
    # `grep -rn "60.0\|60 ms" serve/` finds the goal once; its other hits are timeouts.
    hits = []
    for path in sorted((REPO / "serve").rglob("*.py")):
        for line in path.read_text().splitlines():
            if re.search(r"\b60(\.0)? ?ms\b|\b60\.0\b|\b0\.060?\b", line) \
                    and re.search(r"p99|goal|slo", line, re.IGNORECASE):
                hits.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert hits == ["serve/constants.py: P99_SLO_MS = 60.0"]


def test_the_guard_defaults_are_defined_once():
    from serve.sidecar.control.guards import GuardLimits
    from serve.state import Guards

    g, limits = Guards(), GuardLimits()
    assert (g.max_error_ratio, g.max_latency_ratio, g.max_score_psi, g.min_requests,
            g.min_instances, g.interval_s, g.failure_limit) == (
        GUARD_MAX_ERROR_RATIO, GUARD_MAX_LATENCY_RATIO, GUARD_MAX_SCORE_PSI,
        GUARD_MIN_REQUESTS, GUARD_MIN_INSTANCES, GUARD_INTERVAL_S, GUARD_FAILURE_LIMIT)
    for name in ("max_error_ratio", "max_latency_ratio", "max_score_psi", "min_requests",
                 "min_instances", "min_forwards"):
        assert getattr(limits, name) == getattr(g, name), name
    # docs/rollouts.md's example guards block says "these are the defaults": keep it in step.
    page = (REPO / "docs" / "rollouts.md").read_text()
    block = page.split("  guards:", 1)[1].split("```", 1)[0]
    shown = yaml.safe_load("\n".join(ln.split("#")[0].rstrip()[4:]
                                     for ln in block.splitlines()[1:] if ln.strip()))
    assert set(shown) == set(Guards.model_fields)
    for name, value in shown.items():
        assert getattr(g, name) == value, (name, value)


# --------------------------------------------------------------------------- validators


@pytest.mark.parametrize(("call", "message"), [
    (lambda: validate.positive_int("handler.max_instances", 0),
     "handler.max_instances=0 must be an integer >= 1"),
    (lambda: validate.positive_int("feedback max_series", True),
     "feedback max_series=True must be an integer >= 1"),
    (lambda: validate.int_at_least("--batch", 1, 2), "--batch 1 must be an integer >= 2"),
    (lambda: validate.int_at_least("X", "5", 0, then=" (bytes)"),
     "X='5' must be an integer >= 0 (bytes)"),
    (lambda: validate.int_in_range("port", 70000, 1, 65535),
     "port=70000 must be an integer in 1..65535"),
    (lambda: validate.positive_number("--p99-goal-ms", 0.0),
     "--p99-goal-ms 0.0 must be a finite number > 0"),
    (lambda: validate.nonneg_number("s", float("inf")), "s=inf must be a finite number >= 0"),
    (lambda: validate.number_in_range("r", 0, 0, 1, lo_open=True, then=" or null"),
     "r=0 must be a number in (0, 1] or null"),
    (lambda: validate.boolean("label_shuffle", 1, then="; pass --label-shuffle"),
     "label_shuffle=1 must be true or false; pass --label-shuffle"),
])
def test_validators_name_the_value_and_the_rule(call, message):
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.message == message


def test_validators_return_what_passes_and_raise_what_they_are_told():
    assert validate.positive_int("n", 3) == 3
    assert validate.int_in_range("n", 0, 0, 0) == 0
    assert validate.number_in_range("r", 1, 0, 1) == 1.0
    with pytest.raises(ValueError, match="n=-1 must be an integer >= 0") as info:
        validate.int_at_least("n", -1, 0, error=ValueError)
    assert type(info.value) is ValueError
    assert validate.boolean("b", False) is False
    assert not validate.is_int(True) and validate.is_int(0) and not validate.is_number(True)


def test_validators_take_an_error_factory():
    # an error that also names a field (InvalidDelta: 400 with "field" in the body)
    with pytest.raises(InvalidDelta) as info:
        validate.int_at_least("sequence", 0, 1,
                              error=lambda m: InvalidDelta("header.sequence", m))
    assert info.value.field == "header.sequence" and info.value.status == 400
    assert info.value.message == "header.sequence: sequence=0 must be an integer >= 1"
