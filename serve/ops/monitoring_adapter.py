"""The prometheus-adapter rules that make the HPA's two custom metrics from the sidecar's
counters, and :func:`adapter_query`, which renders a rule's query the way the adapter does
(the QPS and utilization records of :mod:`serve.ops.monitoring_rules` are those queries)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from serve.metrics import (
    CAPACITY_UTILIZATION_RATIO,
    CAPACITY_WORK_SECONDS_TOTAL,
    REQUESTS_TOTAL,
    WORKERS,
)
from serve.sidecar.control.utilization import BUSY_AT_KNEE

__all__ = [
    "ADAPTER_ABOUT",
    "ADAPTER_RULES_FILE",
    "QPS_METRIC",
    "adapter_config_map",
    "adapter_query",
    "adapter_rules",
]

#: Where the adapter's rules are generated, relative to the repository root.
ADAPTER_RULES_FILE = Path("k8s") / "prometheus-adapter-rules.yaml"
#: The HPA's request-rate metric (the backstop), made by the adapter from REQUESTS_TOTAL.
QPS_METRIC = "dlrm_requests_per_second"


def _adapter_rule(series: str, metric: str, query: str) -> dict[str, Any]:
    return {"seriesQuery": f'{series}{{namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                        "pod": {"resource": "pod"}}},
            "name": {"matches": f"^{series}$", "as": metric},
            "metricsQuery": query}


def adapter_rules() -> list[dict[str, Any]]:
    """prometheus-adapter's rules for the HPA's two Pods metrics (k8s/hpa.yaml).

    * ``dlrm_requests_per_second``: requests/s over 1 m, all codes (errors cost capacity
      too): the backstop for traffic whose cost is outside the handler.
    * ``dlrm_capacity_utilization_ratio``: handler work-seconds per second over 1 m, over
      the pod's capacity, READY workers x ``BUSY_AT_KNEE``
      (:func:`serve.sidecar.control.utilization.utilization_ratio`); ``clamp_min(.., 1)``
      keeps a pod with no READY worker (it did no work) at 0 instead of NaN.
    """
    work = ("sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)"
            f" / ({BUSY_AT_KNEE:g} * clamp_min(sum({WORKERS}{{<<.LabelMatchers>>,"
            'status="READY"}) by (<<.GroupBy>>), 1))')
    return [
        _adapter_rule(REQUESTS_TOTAL, QPS_METRIC,
                      "sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)"),
        _adapter_rule(CAPACITY_WORK_SECONDS_TOTAL, CAPACITY_UTILIZATION_RATIO, work),
    ]


def adapter_config_map() -> dict[str, Any]:
    """The adapter's rules in a ConfigMap (``data["config.yaml"]``)."""
    config = yaml.safe_dump({"rules": adapter_rules()}, sort_keys=False, width=1000)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "dlrm-serve-adapter-rules",
                         "labels": {"app.kubernetes.io/name": "dlrm-serve",
                                    "app.kubernetes.io/part-of": "dlrm-serve"}},
            "data": {"config.yaml": config}}


ADAPTER_ABOUT = r"""
prometheus-adapter rules that make k8s/hpa.yaml's two Pods metrics from the sidecar's
counters: dlrm_capacity_utilization_ratio (dlrm_capacity_work_seconds_total's 1 m rate
over READY workers x the handler's busy fraction at the knee; 1.0 = the pod at its knee)
and dlrm_requests_per_second (dlrm_requests_total's 1 m rate, all codes).

The adapter reads its rules from its own ConfigMap in its own namespace (often
"monitoring"); this copy lives with the app so `kubectl apply -f k8s/` works on any
cluster. Merge the `rules:` entries into the adapter's config, e.g. with the
prometheus-community/prometheus-adapter Helm chart:
  kubectl get configmap dlrm-serve-adapter-rules \
    -o jsonpath='{.data.config\.yaml}' > dlrm-rules.yaml   # then add to rules.custom
Then `kubectl get --raw \
  "/apis/custom.metrics.k8s.io/v1beta1/namespaces/default/pods/*/dlrm_capacity_utilization_ratio"`
lists one value per pod.""".strip()


def adapter_query(rules_file: Path | None = None, metric: str = QPS_METRIC) -> str:
    """The prometheus-adapter's ``metricsQuery`` for ``metric`` (default
    ``dlrm_requests_per_second``), rendered for every pod of every namespace.

    The adapter's Go template gets ``.Series`` (the series name its ``seriesQuery``
    found), ``.LabelMatchers`` (matchers joined with ``","``) and ``.GroupBy`` (label
    names joined with ``","``; ``strings.Join`` in pkg/naming/metrics_query.go). For an
    HPA's request it pins ``namespace="<ns>"`` and groups by ``pod`` alone; here the
    matchers are the seriesQuery's own (``namespace!="",pod!=""``) and the group-by is
    the resource labels, namespace first, so one expression covers all pods with the
    same per-pod values.

    Args:
        rules_file: an adapter ConfigMap to read (default: :func:`adapter_config_map`,
            what ``k8s/prometheus-adapter-rules.yaml`` is generated from).
        metric: the rule's ``name.as``.
    Returns:
        e.g. ``sum(rate(dlrm_requests_total{namespace!="",pod!=""}[1m])) by (namespace,pod)``.
    Raises:
        ValueError: the ConfigMap does not hold exactly one rule for ``metric``, or its
            template uses something other than Series, LabelMatchers and GroupBy.
    """
    path = rules_file if rules_file is not None else ADAPTER_RULES_FILE
    cm = (yaml.safe_load(rules_file.read_text()) if rules_file is not None
          else adapter_config_map())
    rules = [r for r in yaml.safe_load(cm["data"]["config.yaml"])["rules"]
             if r.get("name", {}).get("as") == metric]
    if len(rules) != 1:
        raise ValueError(f"{path}: expected one adapter rule naming {metric!r}, found "
                         f"{len(rules)}")
    rule = rules[0]
    m = re.fullmatch(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\s*", rule["seriesQuery"])
    if m is None:
        raise ValueError(f"{path}: seriesQuery {rule['seriesQuery']!r} is not "
                         "name{matchers}")
    series, matchers = m.group(1), m.group(2)
    if re.search(rule["name"]["matches"], series) is None:
        raise ValueError(f"{path}: name.matches {rule['name']['matches']!r} does not match "
                         f"the series {series!r}")
    overrides = rule["resources"]["overrides"]
    by_resource = {v["resource"]: label for label, v in overrides.items()}
    group_by = [by_resource[r] for r in ("namespace", "pod") if r in by_resource]
    query = (rule["metricsQuery"].replace("<<.Series>>", series)
             .replace("<<.LabelMatchers>>", matchers)
             .replace("<<.GroupBy>>", ",".join(group_by)))
    if "<<" in query:
        raise ValueError(f"{path}: metricsQuery {rule['metricsQuery']!r} uses template "
                         "fields other than Series, LabelMatchers and GroupBy")
    return str(query)
