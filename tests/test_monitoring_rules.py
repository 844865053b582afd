"""k8s/monitoring/: the generated rules and dashboard are current, consistent with the HPA's
adapter rule, parse in promtool, and every alert is unit-tested both ways.

promtool is required (never skipped): `make test` installs it with
scripts/ensure_prometheus.sh.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import serve.metrics
from serve.ops import monitoring, monitoring_dashboard, monitoring_rules
from serve.ops.monitoring import MONITORING_DIR
from serve.ops.monitoring_adapter import adapter_query
from serve.ops.monitoring_dashboard import dashboard_queries
from serve.ops.monitoring_rules import QPS_RECORD
from tests.fixtures.tools import require_tool

REPO = Path(__file__).resolve().parents[1]
MON = REPO / MONITORING_DIR
HPA_METRIC = "dlrm_requests_per_second"


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def promtool() -> str:
    """promtool's path; a test without it skips (fails under DLRM_REQUIRE_TOOLS=1)."""
    return require_tool("promtool", "the alert and recording rules are checked and "
                        "unit-tested with it", "bash scripts/ensure_prometheus.sh")


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def _rules(kind: str) -> list[dict]:
    return [r for g in _load(MON / f"{kind}.rules.yaml")["groups"] for r in g["rules"]]


# --------------------------------------------------------------------------- generated


def test_generated_files_are_up_to_date():
    stale = monitoring.check()
    assert stale == [], (f"{[str(p.relative_to(REPO)) for p in stale]} differ from what "
                         "serve/ops/monitoring.py generates: run "
                         "`python -m serve.ops.monitoring --write` (never edit them by hand)")


def test_check_names_a_hand_edited_file(tmp_path, capsys):
    """--check exits 1 naming the edited file, and --write repairs it."""
    adapter = tmp_path / "k8s" / "prometheus-adapter-rules.yaml"
    adapter.parent.mkdir(parents=True)
    shutil.copy(REPO / "k8s" / "prometheus-adapter-rules.yaml", adapter)
    assert monitoring.main(["--write", "--root", str(tmp_path)]) == 0
    assert monitoring.main(["--check", "--root", str(tmp_path)]) == 0
    edited = tmp_path / MONITORING_DIR / "alerts.rules.yaml"
    edited.write_text(edited.read_text().replace("for: 5m", "for: 1m"))
    capsys.readouterr()
    assert monitoring.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "alerts.rules.yaml differs" in err and "--write" in err
    assert "recording.rules.yaml" not in err
    assert monitoring.main(["--write", "--root", str(tmp_path)]) == 0
    assert monitoring.main(["--check", "--root", str(tmp_path)]) == 0


def test_generated_yaml_says_so_and_loads_back_to_the_source():
    expected = {"recording.rules.yaml": monitoring_rules.rule_file("recording"),
                "alerts.rules.yaml": monitoring_rules.rule_file("alerts"),
                "prometheusrule.yaml": monitoring_rules.prometheus_rule(),
                "dashboard-configmap.yaml": monitoring_dashboard.dashboard_configmap()}
    for name, doc in expected.items():
        text = (MON / name).read_text()
        assert text.startswith(monitoring.GENERATED_HEADER), name
        assert yaml.safe_load(text) == doc, name


def test_help_works(capsys):
    with pytest.raises(SystemExit) as exc:
        monitoring.main(["--help"])
    assert exc.value.code == 0
    assert "--check" in capsys.readouterr().out


# --------------------------------------------------------------------------- consistency


def test_qps_record_is_the_adapters_query():
    """The QPS record is exactly what prometheus-adapter asks Prometheus for the HPA's
    dlrm_requests_per_second (rendered for all pods), so the dashboard shows what the HPA
    scales on."""
    cm = _load(REPO / "k8s" / "prometheus-adapter-rules.yaml")
    (rule,) = [r for r in yaml.safe_load(cm["data"]["config.yaml"])["rules"]
               if r["name"]["as"] == HPA_METRIC]
    hpa = _load(REPO / "k8s" / "hpa.yaml")
    assert HPA_METRIC in [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]
                          if m["type"] == "Pods"]
    rendered = (rule["metricsQuery"].replace("<<.Series>>", serve.metrics.REQUESTS_TOTAL)
                .replace("<<.LabelMatchers>>", 'namespace!="",pod!=""')
                .replace("<<.GroupBy>>", "namespace,pod"))
    assert adapter_query() == rendered == (
        'sum(rate(dlrm_requests_total{namespace!="",pod!=""}[1m])) by (namespace,pod)')
    (qps,) = [r for r in _rules("recording") if r.get("record") == QPS_RECORD]
    assert qps["expr"] == adapter_query()


def test_utilization_record_is_the_adapters_query():
    """The utilization record is what the adapter computes for the HPA's primary metric:
    the work counter's 1 m rate over READY workers x BUSY_AT_KNEE."""
    from serve.ops.monitoring_rules import UTILIZATION_RECORD
    from serve.sidecar.control.utilization import BUSY_AT_KNEE

    want = ('sum(rate(dlrm_capacity_work_seconds_total{namespace!="",pod!=""}[1m])) '
            f'by (namespace,pod) / ({BUSY_AT_KNEE:g} * clamp_min(sum(dlrm_workers'
            '{namespace!="",pod!="",status="READY"}) by (namespace,pod), 1))')
    assert adapter_query(metric=serve.metrics.CAPACITY_UTILIZATION_RATIO) == want
    assert adapter_query(REPO / "k8s" / "prometheus-adapter-rules.yaml",
                         serve.metrics.CAPACITY_UTILIZATION_RATIO) == want
    (rec,) = [r for r in _rules("recording") if r.get("record") == UTILIZATION_RECORD]
    assert rec["expr"] == want


def test_adapter_query_names_a_missing_rule(tmp_path):
    with pytest.raises(ValueError, match="expected one adapter rule naming 'dlrm_nope', "
                                         "found 0"):
        adapter_query(metric="dlrm_nope")


def test_adapter_query_refuses_a_template_it_cannot_render(tmp_path):
    cm = _load(REPO / "k8s" / "prometheus-adapter-rules.yaml")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    config["rules"][0]["metricsQuery"] = "sum(<<.Series>>{<<.LabelValuesByName>>})"
    cm["data"]["config.yaml"] = yaml.safe_dump(config)
    path = tmp_path / "adapter.yaml"
    path.write_text(yaml.safe_dump(cm))
    with pytest.raises(ValueError, match="template fields other than"):
        adapter_query(path)


def test_prometheusrule_holds_exactly_the_plain_files_groups():
    pr = _load(MON / "prometheusrule.yaml")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1" and pr["kind"] == "PrometheusRule"
    assert pr["metadata"]["name"] == "dlrm-serve"
    assert pr["metadata"]["labels"]["app.kubernetes.io/name"] == "dlrm-serve"
    assert pr["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dlrm-serve"
    plain = (_load(MON / "recording.rules.yaml")["groups"]
             + _load(MON / "alerts.rules.yaml")["groups"])
    assert pr["spec"]["groups"] == plain
    assert [g["name"] for g in plain] == ["dlrm-serve-recording", "dlrm-serve-alerts"]


def test_p99_slo_is_the_goal_the_capacity_was_measured_at():
    capacity = json.loads((REPO / "loadtest" / "capacity.json").read_text())
    assert pytest.approx(capacity["p99_goal_ms"] / 1000) == monitoring_rules.P99_SLO_SECONDS


def _metric_names() -> set[str]:
    """Every dlrm_ family name serve.metrics defines, with the sample suffixes."""
    names = {v for k, v in vars(serve.metrics).items()
             if k.isupper() and isinstance(v, str) and v.startswith("dlrm_")}
    return names | {n + s for n in names for s in ("_bucket", "_sum", "_count")}


def test_every_dlrm_series_named_is_one_serve_metrics_defines():
    """A typo in a series name would make a rule or panel silently empty."""
    exprs = [r["expr"] for kind in ("recording", "alerts") for r in _rules(kind)]
    exprs += [e for _, e in dashboard_queries(json.loads((MON / "dashboard.json").read_text()))]
    used = {m for e in exprs for m in re.findall(r"(?<![\w:])(dlrm_[a-z0-9_]+)", e)}
    assert used and used <= _metric_names(), sorted(used - _metric_names())


def test_every_alert_has_for_severity_summary_and_description():
    alerts = _rules("alerts")
    assert {a["alert"] for a in alerts} == {
        "DlrmHighErrorRatio", "DlrmP99OverSlo", "DlrmNoReadyWorkers",
        "DlrmCacheHitRatioFalling", "DlrmPredictedCtrShift", "DlrmCalibrationOff",
        "DlrmRolloutRolledBack", "DlrmEmbeddingDeltasStale", "DlrmEmbeddingFallbackRising"}
    for a in alerts:
        assert "for" in a, a["alert"]
        assert a["labels"]["severity"] in ("page", "ticket"), a["alert"]
        assert a["annotations"]["summary"] and len(a["annotations"]["description"]) > 80


# --------------------------------------------------------------------------- promtool


@pytest.mark.needs_promtool
def test_promtool_check_rules_passes():
    out = _run("check", "rules", "recording.rules.yaml", "alerts.rules.yaml", cwd=MON)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.needs_promtool
def test_promtool_unit_tests_pass():
    out = _run("test", "rules", "alerts.test.yaml", cwd=MON)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.needs_promtool
def test_promtool_unit_tests_catch_a_wrong_expectation(tmp_path):
    """Negative control: the same tests fail once one expected annotation is off."""
    for name in ("recording.rules.yaml", "alerts.rules.yaml"):
        shutil.copy(MON / name, tmp_path / name)
    text = (MON / "alerts.test.yaml").read_text()
    bad = text.replace("1.5% of DLRM prediction requests", "1.6% of DLRM prediction requests")
    assert bad != text
    (tmp_path / "alerts.test.yaml").write_text(bad)
    out = _run("test", "rules", "alerts.test.yaml", cwd=tmp_path)
    assert out.returncode != 0 and "1.6% of DLRM" in out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_test():
    tests = _load(MON / "alerts.test.yaml")
    assert tests["rule_files"] == ["recording.rules.yaml", "alerts.rules.yaml"]
    fires: set[str] = set()
    quiet: set[str] = set()
    for t in tests["tests"]:
        for case in t.get("alert_rule_test", []):
            exp = case.get("exp_alerts")
            if exp == []:
                quiet.add(case["alertname"])
            elif exp:
                fires.add(case["alertname"])
                for alert in exp:  # what operators see is pinned, not just that it fired
                    assert alert["exp_labels"]["severity"] in ("page", "ticket")
                    assert set(alert["exp_annotations"]) == {"summary", "description"}
    names = {a["alert"] for a in _rules("alerts")}
    assert names - fires == set(), f"alerts without a firing test: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts without a quiet test: {sorted(names - quiet)}"


@pytest.mark.needs_promtool
def test_every_dashboard_expr_parses(tmp_path):
    """A cheap PromQL parse of each panel query: promtool checks a rules file recording
    each one. (Whether each returns data is checked against a live Prometheus elsewhere.)"""
    queries = dashboard_queries(json.loads((MON / "dashboard.json").read_text()))
    assert len(queries) >= 15
    rules = {"groups": [{"name": "dashboard-parse", "rules": [
        {"record": f"dashboard:check_{i}:expr", "expr": expr}
        for i, (_, expr) in enumerate(queries)]}]}
    (tmp_path / "dashboard.rules.yaml").write_text(yaml.safe_dump(rules))
    out = _run("check", "rules", "dashboard.rules.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------- dashboard


def test_dashboard_model():
    dash = json.loads((MON / "dashboard.json").read_text())
    assert dash["uid"] == "dlrm-serve" and dash["schemaVersion"] >= 39
    (var,) = dash["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource", "prometheus")
    ds = {"type": "prometheus", "uid": "${datasource}"}
    titles = [p["title"] for p in dash["panels"]]
    for want in ("QPS", "Instances/s", "Latency p50 / p99", "Errors (non-2xx) by code",
                 "Batch size", "Cache hit ratio", "Replicas", "CPU", "GPU",
                 "Predicted CTR by arm", "Calibration", "AUC", "Feedback labels", "Rollout"):
        assert want in titles
    cells = set()
    for p in dash["panels"]:
        assert p["type"] == "timeseries" and p["datasource"] == ds, p["title"]
        assert p["description"], p["title"]
        assert all(t["datasource"] == ds for t in p["targets"]), p["title"]
        g = p["gridPos"]
        cells.add((g["x"], g["y"]))
        assert g["x"] + g["w"] <= 24
    assert len(cells) == len(dash["panels"]), "panels overlap"
    queries = dashboard_queries(dash)
    assert len(queries) == sum(len(p["targets"]) for p in dash["panels"])
    assert not [e for _, e in queries if "$" in e], "no Grafana variables in PromQL"
    assert (f"sum({QPS_RECORD})" in [e for t, e in queries if t == "QPS"])


def test_dashboard_queries_walks_rows():
    nested = {"panels": [{"type": "row", "title": "r", "panels": [
        {"title": "inner", "targets": [{"expr": "up"}, {"refId": "B"}]}]}]}
    assert dashboard_queries(nested) == [("inner", "up")]


def test_dashboard_configmap_holds_the_dashboard():
    cm = _load(MON / "dashboard-configmap.yaml")
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "dlrm-serve-dashboard"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["dashboard.json"] == (MON / "dashboard.json").read_text()
