"""k8s/ manifests, validated offline: schemas, the CPU overlay, and semantics that schema
validation passes (selectors, ports, probes, hardening, HPA vs measured capacity).

The cross-checks read the real sources: the repo's config.properties, the sidecar's own
defaults, serve.model.archive's response timeout, and (integration) the real sidecar's /metrics
and OpenAPI and TorchServe's /ping.
"""
from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from serve.constants import DEFAULT_SIDECAR_OIP_PORT
from tests.fixtures.tools import require_tool

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
VERSIONS = ("1.30.0", "1.33.0")
UID = 10001
HPA_METRIC = "dlrm_requests_per_second"
SIDECAR_COUNTER = "dlrm_requests_total"
UTILIZATION_METRIC = "dlrm_capacity_utilization_ratio"
WORK_COUNTER = "dlrm_capacity_work_seconds_total"
# The sidecar's write port (every route, writes included); 8090 serves reads and metrics.
WRITE_PORT = 8091
# The Open Inference Protocol's port (the sidecar's --oip-port; make up's default too).
OIP_PORT = 8092
TOKEN_SECRET = "dlrm-sidecar-token"
# Keys of the token Secret -> required? (the operator token is; the scoped ones are not)
TOKEN_KEYS = {"token": True, "delta-token": False, "feedback-token": False}
TOKEN_FLAGS = {"token": "--token-file", "delta-token": "--delta-token-file",
               "feedback-token": "--feedback-token-file"}
WRITER_LABEL = {"dlrm-serve/writer": "true"}


# --------------------------------------------------------------------------- helpers


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifest_files(folder: Path) -> list[Path]:
    """What `kubectl apply -f FOLDER` reads: every .yaml/.yml/.json directly in it (so
    every one must be a Kubernetes object; subfolders are read only with -R)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and p.suffix in (".yaml", ".yml", ".json"))


def base_files() -> list[Path]:
    """What `kubectl apply -f k8s/` applies."""
    return manifest_files(K8S)


def base_docs() -> list[dict]:
    return [d for p in base_files() for d in _load(p)]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def container(docs: list[dict], name: str) -> dict:
    cs = [c for c in pod_spec(docs)["containers"] if c["name"] == name]
    assert len(cs) == 1, f"no container {name!r}"
    return cs[0]


def all_containers(docs: list[dict]) -> list[dict]:
    spec = pod_spec(docs)
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def read_properties(text: str) -> dict[str, str]:
    """Java .properties as TorchServe writes them: key=value lines, # comments."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip()
    return out


def pod_properties(docs: list[dict]) -> dict[str, str]:
    cm = one(docs, "ConfigMap", "dlrm-serve-torchserve")
    return read_properties(cm["data"]["config.properties"])


def repo_properties() -> dict[str, str]:
    return read_properties((REPO / "config.properties").read_text())


def kubectl() -> str:
    """kubectl's path; a test without it skips (fails under DLRM_REQUIRE_TOOLS=1)."""
    return require_tool("kubectl", "it builds k8s/cpu and checks that `kubectl apply -f "
                        "k8s/` decodes every file", "bash scripts/ensure_kubectl.sh")


def kustomize_cpu() -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", "--load-restrictor", "LoadRestrictionsNone",
                          str(K8S / "cpu")], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return base_docs()


@pytest.fixture(scope="module")
def cpu_docs() -> list[dict]:
    return kustomize_cpu()


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_strict_schema_validation(version):
    import kubernetes_validate

    paths = base_files() + manifest_files(K8S / "templates")
    assert len(paths) >= 8
    for path in paths:
        for doc in _load(path):
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.needs_kubectl
@pytest.mark.parametrize("version", VERSIONS)
def test_cpu_overlay_passes_strict_schema_validation(cpu_docs, version):
    import kubernetes_validate

    for doc in cpu_docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_an_unknown_field(docs):
    """Negative control: the validator really checks (a typo'd field fails)."""
    import kubernetes_validate

    dep = copy.deepcopy(one(docs, "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContex"):
        kubernetes_validate.validate(dep, "1.30.0", strict=True)


def test_kubernetes_validate_cli_passes_for_both_versions():
    """The documented command, as CI and people run it."""
    exe = Path(sys.executable).with_name("kubernetes-validate")
    files = [str(p) for p in base_files()]
    for version in VERSIONS:
        out = subprocess.run([str(exe), "--strict", "--quiet", "-k", version, *files],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stdout + out.stderr


def kubectl_apply_dry_run(folder: Path, tmp_path: Path) -> list[str]:
    """`kubectl apply -f FOLDER --dry-run=client --validate=false`, offline; its output lines.

    There is no API server here, so kubectl reads and decodes every file, then fails to
    map each object to the (unreachable) server: "unable to recognize" lines are expected.
    It must never reach a real cluster: an empty KUBECONFIG, a server on a free loopback
    port that nothing listens on (never kubectl's default localhost:8080, TorchServe's
    port), a placeholder token (else kubectl prompts for a user name), no stdin, and a
    throwaway cache dir.
    """
    from serve.common.net import free_port

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    out = subprocess.run(
        [kubectl(), "apply", "-f", str(folder), "--dry-run=client", "--validate=false",
         f"--server=https://127.0.0.1:{free_port()}", "--token=offline-dry-run",
         "--request-timeout=5s", f"--cache-dir={tmp_path / 'kube-cache'}"],
        capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(kubeconfig)})
    lines = (out.stdout + out.stderr).splitlines()
    # Only an unreachable server is acceptable: a dry run that "created" anything talked
    # to a real API server.
    assert not [ln for ln in lines if "(dry run)" in ln], lines
    return lines


def _decode_errors(lines: list[str]) -> list[str]:
    return [ln for ln in lines if "unable to decode" in ln or "error parsing" in ln]


@pytest.mark.needs_kubectl
def test_kubectl_apply_decodes_every_file_in_k8s(tmp_path):
    """`kubectl apply -f k8s/` must not trip over a file that is not a Kubernetes object
    (as k8s/capacity.json once did: "Object 'Kind' is missing")."""
    lines = kubectl_apply_dry_run(K8S, tmp_path)
    assert _decode_errors(lines) == [], "\n".join(lines)
    # Positive evidence that kubectl read every file: each one reached the server lookup.
    recognized = {m.group(1) for ln in lines
                  if (m := re.match(r'unable to recognize "([^"]+)"', ln))}
    assert recognized == {str(p) for p in base_files()}, "\n".join(lines)


@pytest.mark.needs_kubectl
def test_kubectl_apply_check_catches_a_file_without_kind(tmp_path):
    """Negative control: the same check fails on a JSON file that is not an object."""
    folder = tmp_path / "k8s"
    folder.mkdir()
    shutil.copy(K8S / "hpa.yaml", folder / "hpa.yaml")
    (folder / "capacity.json").write_text('{"knee_qps": 184.2}\n')
    errors = _decode_errors(kubectl_apply_dry_run(folder, tmp_path))
    assert len(errors) == 1 and "capacity.json" in errors[0] and "Kind" in errors[0], errors


def test_optional_servicemonitor_is_outside_the_applied_folder(docs):
    """A CRD kind in k8s/ would break `kubectl apply -f k8s/` without the operator."""
    core = {"ConfigMap", "Deployment", "Service", "ServiceAccount", "HorizontalPodAutoscaler",
            "PodDisruptionBudget", "NetworkPolicy", "PersistentVolumeClaim", "Role",
            "RoleBinding", "Lease"}  # Lease: coordination.k8s.io/v1, built in (the fleet's)
    assert {d["kind"] for d in docs} == core
    sm = one(_load(K8S / "monitoring" / "servicemonitor.yaml"), "ServiceMonitor")
    metrics_svc = one(docs, "Service", "dlrm-serve-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= metrics_svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in metrics_svc["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= port_names


def test_secret_is_a_template_with_a_placeholder_only(docs):
    assert not find(docs, "Secret"), "no Secret in k8s/: re-applying would reset the token"
    secret = one(_load(K8S / "templates" / "sidecar-token-secret.yaml"), "Secret")
    assert secret["metadata"]["name"] == TOKEN_SECRET
    # One clearly-marked placeholder (the sidecar refuses it at start); the scoped keys are
    # shown commented out, with the same placeholder.
    assert secret["stringData"] == {"token": "REPLACE-ME-with-openssl-rand-hex-32"}
    text = (K8S / "templates" / "sidecar-token-secret.yaml").read_text()
    for key in TOKEN_KEYS:
        assert f"--from-literal={key}=" in text, key
    for how in ("kubectl create secret generic dlrm-sidecar-token",
                "secrets.token_urlsafe(32)", "kubectl rollout restart deployment/dlrm-serve"):
        assert how in text, how


def _token_volume(docs: list[dict]) -> tuple[str, dict]:
    vols = [v for v in pod_spec(docs)["volumes"] if "projected" in v
            and any(s.get("secret", {}).get("name") == TOKEN_SECRET
                    for s in v["projected"]["sources"])]
    assert len(vols) == 1, "one projected volume holds the token files"
    return vols[0]["name"], vols[0]["projected"]


def test_the_token_secret_is_required_and_scoped_tokens_are_files(docs):
    """Shutdown never depends on an optional Secret: the operator token is required in
    both containers (the pod does not start without it); the sidecar reads every token
    from a file of a 0400 projected volume mounted in it alone; the scoped keys are optional."""
    ts = container(docs, "torchserve")
    # The container that runs model code holds no credential at all.
    assert not [e["name"] for e in ts.get("env", []) if "valueFrom" in e
                and "secretKeyRef" in e["valueFrom"]], "no Secret in the torchserve container"
    assert not [m for m in ts.get("volumeMounts", []) if "token" in m["name"]]
    for c in all_containers(docs):
        for e in c.get("env", []):
            sk = e.get("valueFrom", {}).get("secretKeyRef")
            assert sk is None or not sk.get("optional", False), (c["name"], e["name"])
    sc = container(docs, "sidecar")
    assert "DLRM_SIDECAR_TOKEN" not in {e["name"] for e in sc["env"]}, "files, not env"
    assert "--create-token" not in sc["args"]
    vol, projected = _token_volume(docs)
    assert projected["defaultMode"] == 0o400
    assert pod_spec(docs)["securityContext"]["fsGroup"] == UID
    paths: dict[str, str] = {}
    for src in projected["sources"]:
        secret = src["secret"]
        assert secret["name"] == TOKEN_SECRET
        for item in secret["items"]:
            assert secret.get("optional", False) is not TOKEN_KEYS[item["key"]], item
            paths[item["key"]] = item["path"]
    assert set(paths) == set(TOKEN_KEYS)
    (mount,) = _mounts_of(sc, vol)
    assert mount["readOnly"] is True
    assert not _mounts_of(container(docs, "torchserve"), vol), "model code must not see them"
    for key, flag in TOKEN_FLAGS.items():
        assert arg_value(sc["args"], flag) == f"{mount['mountPath']}/{paths[key]}", flag


# --------------------------------------------------------------------------- CPU overlay


def test_cpu_overlay_lists_every_manifest():
    kust = yaml.safe_load((K8S / "cpu" / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == [f"../{p.name}" for p in base_files()]


@pytest.mark.needs_kubectl
def test_cpu_overlay_drops_the_gpu_and_uses_the_cpu_image(docs, cpu_docs):
    assert sorted((d["kind"], d["metadata"]["name"]) for d in cpu_docs) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert "nvidia.com/gpu" not in json.dumps(cpu_docs)
    assert "tolerations" not in pod_spec(cpu_docs)
    for c in all_containers(cpu_docs):
        assert re.fullmatch(r"dlrm-serve:0\.1\.0-cpu@sha256:[0-9a-f]{64}", c["image"])
        res = c["resources"]
        assert res["requests"] == res["limits"]
    # Everything else is the base's (the overlay changes only what it says it does).
    hpa = one(cpu_docs, "HorizontalPodAutoscaler")
    assert hpa == one(docs, "HorizontalPodAutoscaler")


# --------------------------------------------------------------------------- selectors


def test_selectors_match_the_pod_labels(docs):
    dep = one(docs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    sel = dep["spec"]["selector"]["matchLabels"]
    assert sel.items() <= labels.items()
    for svc in find(docs, "Service"):
        assert svc["spec"]["selector"].items() <= labels.items(), svc["metadata"]["name"]
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for np_ in find(docs, "NetworkPolicy"):
        assert np_["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    for tsc in pod_spec(docs)["topologySpreadConstraints"]:
        assert tsc["labelSelector"]["matchLabels"].items() <= labels.items()


def test_service_target_ports_name_container_ports(docs):
    named = {p["name"]: p["containerPort"] for c in pod_spec(docs)["containers"]
             for p in c.get("ports", [])}
    for svc in find(docs, "Service"):
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in named, (svc["metadata"]["name"], p)
            assert named[p["targetPort"]] == p["port"]


def test_hpa_targets_the_deployment(docs):
    hpa = one(docs, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    dep = one(docs, "Deployment")
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == \
        (dep["apiVersion"], "Deployment", dep["metadata"]["name"])
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"


def test_serviceaccount_is_used_and_mounts_no_token(docs):
    sa = one(docs, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    spec = pod_spec(docs)
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False


SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_only_the_sidecar_holds_an_api_token(docs):
    """The fleet's rollout (serve/sidecar/adapters/kubernetes.py) needs the API: a bound
    token, the CA and the namespace, projected into the sidecar container alone."""
    volume = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "kube-api")
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[0]["serviceAccountToken"]["expirationSeconds"] <= 3600
    assert sources[1]["configMap"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert sources[2]["downwardAPI"]["items"][0]["path"] == "namespace"
    for c in all_containers(docs):
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        if c["name"] == "sidecar":
            assert mounts["kube-api"]["mountPath"] == SA_MOUNT
            assert mounts["kube-api"]["readOnly"] is True
        else:
            assert "kube-api" not in mounts, c["name"]


def test_the_sidecar_runs_the_kubernetes_fleet_as_its_pod(docs):
    from serve.settings import POD_NAME
    from serve.sidecar.config import POD_SELECTOR, FleetConfig

    sc = container(docs, "sidecar")
    assert arg_value(sc["args"], "--fleet") == "kubernetes"
    env = {e["name"]: e for e in sc["env"]}
    assert env[POD_NAME.name]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    fc = FleetConfig()
    serving = dict(kv.split("=", 1) for kv in POD_SELECTOR.split(","))
    assert set(serving) == {"app.kubernetes.io/name", "app.kubernetes.io/component"}
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert serving.items() <= labels.items(), "every serving pod carries the selector"
    # The peers are the endpoints of this Service: its selector names the serving pods
    # only (the upload pod has the same name label, another component).
    assert one(docs, "Service", fc.peer_service)["spec"]["selector"] == serving
    upload = _load(K8S / "templates" / "model-upload-pod.yaml")[0]["metadata"]["labels"]
    assert not serving.items() <= upload.items()
    for name in ("dlrm-serve", "dlrm-serve-egress"):
        assert one(docs, "NetworkPolicy", name)["spec"]["podSelector"] == {
            "matchLabels": serving}
    assert one(docs, "ConfigMap", fc.decisions_configmap).get("data") is None, \
        "shipped empty: an apply must never erase the pods' decisions"
    lease = one(docs, "Lease", fc.lease_name)
    assert "spec" not in lease, "shipped without a holder: an apply never takes it away"


def test_rbac_grants_the_fleet_exactly_what_it_uses(docs):
    """The Lease get/update by name (it is shipped: no create, which RBAC cannot limit to
    a name), the pods' own ConfigMap get/update by name, endpointslices list; nothing on
    the operator's dlrm-serving-state, no pods; bound to the pod's ServiceAccount."""
    from serve.sidecar.config import FleetConfig

    fc = FleetConfig()
    role = one(docs, "Role", "dlrm-serve-rollout")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r.get("resourceNames", ())),
              tuple(sorted(r["verbs"]))) for r in role["rules"]}
    assert rules == {
        (("coordination.k8s.io",), ("leases",), (fc.lease_name,), ("get", "update")),
        (("",), ("configmaps",), (fc.decisions_configmap,), ("get", "update")),
        (("discovery.k8s.io",), ("endpointslices",), (), ("list",)),
    }
    state = _volume(docs, "serving-state")["configMap"]["name"]
    writes = {"create", "update", "patch", "delete", "deletecollection"}
    for r in role["rules"]:
        assert "*" not in r["verbs"] and "*" not in r["resources"]
        assert "*" not in r["apiGroups"]
        assert not {"delete", "deletecollection", "watch", "escalate", "bind"} & set(r["verbs"])
        assert "pods" not in r["resources"], "no pod specs (env literals) of the namespace"
        assert "create" not in r["verbs"]
        if writes & set(r["verbs"]):
            assert r.get("resourceNames"), "every write names its object"
            assert state not in r["resourceNames"], "the operator's state is not the pods'"
        assert state not in r.get("resourceNames", ())
    binding = one(docs, "RoleBinding", "dlrm-serve-rollout")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": pod_spec(docs)["serviceAccountName"]}]


# --------------------------------------------------------------------------- HPA


def test_hpa_metrics_replicas_and_behavior(docs):
    spec = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert 2 <= spec["minReplicas"] <= spec["maxReplicas"]
    pods = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in spec["metrics"]
            if m["type"] == "Pods"}
    assert set(pods) == {UTILIZATION_METRIC, HPA_METRIC}
    assert all(t["type"] == "AverageValue" for t in pods.values())
    (cpu,) = [m for m in spec["metrics"] if m["type"] == "Resource"]
    assert cpu["resource"]["name"] == "cpu"
    assert cpu["resource"]["target"]["type"] == "Utilization"
    assert 0 < cpu["resource"]["target"]["averageUtilization"] <= 100
    up, down = spec["behavior"]["scaleUp"], spec["behavior"]["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0
    assert all(p["periodSeconds"] <= 15 for p in up["policies"]), "scale-up must be fast"
    assert down["stabilizationWindowSeconds"] == 300


def test_hpa_targets_are_the_designs_numbers(docs):
    """Utilization at 0.8 of capacity (the module's constant, what the sim judges against);
    the req/s backstop at 0.8 x the single-instance knee, above every other mix's knee, so
    it only ever fires for small requests."""
    from serve.ops.hpa_sim import MIXES, load_capacity, parse_quantity
    from serve.sidecar.control.utilization import UTILIZATION_TARGET

    spec = one(docs, "HorizontalPodAutoscaler")["spec"]
    pods = {m["pods"]["metric"]["name"]: parse_quantity(m["pods"]["target"]["averageValue"])
            for m in spec["metrics"] if m["type"] == "Pods"}
    assert pods[UTILIZATION_METRIC] == pytest.approx(UTILIZATION_TARGET)
    single = MIXES["single"].knee_rps
    assert pods[HPA_METRIC] <= 0.8 * single and pods[HPA_METRIC] >= 0.79 * single
    mixed_knee = load_capacity(REPO / "loadtest" / "capacity.json")["knee_qps"]
    assert pods[HPA_METRIC] > 10 * max(mixed_knee, MIXES["ranking"].knee_rps)


def test_make_capacity_no_longer_writes_the_hpa():
    from serve.ops.capacity import DEFAULT_OUTPUT
    from serve.ops.hpa_sim import DEFAULT_CAPACITY

    # The writer (make capacity) and the reader (make hpa-sim) agree on the file, and it
    # is not in k8s/, where `kubectl apply -f k8s/` would try to decode it.
    assert DEFAULT_OUTPUT == DEFAULT_CAPACITY and DEFAULT_OUTPUT.parts[0] != "k8s"
    from serve.ops import capacity

    assert not hasattr(capacity, "update_hpa_target")
    assert "--hpa" not in (REPO / "serve" / "ops" / "capacity.py").read_text()
    assert "capacity.json target_qps" not in (K8S / "hpa.yaml").read_text()


@pytest.mark.parametrize("metric,series", [(HPA_METRIC, SIDECAR_COUNTER),
                                           (UTILIZATION_METRIC, WORK_COUNTER)])
def test_adapter_rules_turn_the_counters_into_the_hpa_metrics(docs, metric, series):
    """Static half: each rule maps its counter to the HPA's metric as a 1 m rate per pod.
    The integration test below feeds them the real sidecar's exposition."""
    rule = _adapter_rule(docs, metric)
    assert _adapter_metric_name(rule, series) == metric
    assert re.search(r"rate\(<<\.Series>>\{<<\.LabelMatchers>>\}\[1m\]\)", rule["metricsQuery"])
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}


def test_utilization_rule_divides_by_ready_workers_times_busy_at_knee(docs):
    from serve.sidecar.control.utilization import BUSY_AT_KNEE

    q = _adapter_rule(docs, UTILIZATION_METRIC)["metricsQuery"]
    assert q.endswith(f' / ({BUSY_AT_KNEE:g} * clamp_min(sum(dlrm_workers{{<<.LabelMatchers>>,'
                      'status="READY"}) by (<<.GroupBy>>), 1))'), q


def _adapter_rule(docs: list[dict], metric: str = HPA_METRIC) -> dict:
    cm = one(docs, "ConfigMap", "dlrm-serve-adapter-rules")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    (rule,) = [r for r in rules if r["name"]["as"] == metric]
    return rule


def _adapter_metric_name(rule: dict, series: str) -> str | None:
    """What prometheus-adapter names ``series`` by ``rule`` (None: the rule skips it).

    The adapter discovers series by seriesQuery's metric name, then renames them with
    name.matches (a regex) -> name.as (with $1-style groups).
    """
    wanted = re.match(r"^\s*'?([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
    if series != wanted:
        return None
    m = re.search(rule["name"]["matches"], series)
    if m is None:
        return None
    return re.sub(r"\$(\d+)", lambda g: m.group(int(g.group(1))), rule["name"]["as"]) \
        if rule["name"].get("as") else series


# --------------------------------------------------------------------------- resources


def test_resources_requests_equal_limits_and_gpu_only_in_limits(docs):
    for c in all_containers(docs):
        res = c["resources"]
        for r in ("cpu", "memory"):
            assert res["requests"][r] == res["limits"][r], (c["name"], r)
        assert "nvidia.com/gpu" not in res["requests"], c["name"]
    assert container(docs, "torchserve")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(docs, "sidecar")["resources"]["limits"]


@pytest.mark.needs_kubectl
def test_worker_threads_follow_the_cpu_limit(docs, cpu_docs):
    """The workers size their torch threads from the container's CPU quota / workers
    (serve/common/cpu.py). OMP_NUM_THREADS would override that for every model, so the manifest
    leaves it unset; limits.cpu is whole CPUs (a fractional quota is rounded up)."""
    for variant in (docs, cpu_docs):
        ts = container(variant, "torchserve")
        assert "OMP_NUM_THREADS" not in {e["name"] for e in ts.get("env", [])}
        cpu = str(ts["resources"]["limits"]["cpu"])
        assert re.fullmatch(r"[1-9]\d*", cpu), f"limits.cpu {cpu!r}: use whole CPUs"


def test_every_container_is_hardened(docs):
    spec = pod_spec(docs)
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == UID
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in all_containers(docs):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == UID, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
        assert "command" not in c, f"{c['name']}: keep the image's tini ENTRYPOINT (use args)"


def test_the_drain_record_is_on_the_sidecars_own_emptydir(docs):
    """--drain-file (a drained pod stays drained across a sidecar restart) lies on an
    emptyDir that only the sidecar mounts: the torchserve container (model code) can
    neither forge it (the pod never ready again) nor delete it (review N7)."""
    sc = container(docs, "sidecar")
    marker = Path(arg_value(sc["args"], "--drain-file"))
    mounts = sorted(((Path(m["mountPath"]), m) for m in sc["volumeMounts"]),
                    key=lambda pm: len(pm[0].parts), reverse=True)
    path, mount = next((p, m) for p, m in mounts if marker.is_relative_to(p))
    assert not mount.get("readOnly") and "subPath" not in mount
    assert "emptyDir" in _volume(docs, mount["name"]), "pod-local: it dies with the pod"
    for c in all_containers(docs):
        if c["name"] != "sidecar":
            assert mount["name"] not in {m["name"] for m in c.get("volumeMounts", [])}, \
                f"{mount['name']} ({path}) is mounted in {c['name']} too"
    delta_dir = Path(arg_value(sc["args"], "--delta-dir"))
    assert not marker.is_relative_to(delta_dir), "not the default in the shared delta folder"


def test_writable_paths_are_emptydirs(docs):
    """Read-only root: everything TorchServe and the sidecar write is an emptyDir."""
    spec = pod_spec(docs)
    empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    ts, sc = container(docs, "torchserve"), container(docs, "sidecar")

    def mounts(c):
        return {m["mountPath"]: m["name"] for m in c["volumeMounts"]}

    def env(c):
        return {e["name"]: e.get("value") for e in c["env"]}

    tsm, scm, tse, sce = mounts(ts), mounts(sc), env(ts), env(sc)
    for var in ("TEMP", "TMPDIR", "LOG_LOCATION", "HOME"):
        assert tsm.get(tse[var]) in empty, var
    assert scm.get(sce["TMPDIR"]) in empty
    # The handler's multiprocess metrics: one emptyDir, the same path in both containers.
    mp = tse["PROMETHEUS_MULTIPROC_DIR"]
    assert sce["PROMETHEUS_MULTIPROC_DIR"] == mp == arg_value(sc["args"], "--multiproc-dir")
    assert tsm[mp] == scm[mp] and tsm[mp] in empty
    # The model store: written by the sidecar (the archives it registers), read by
    # TorchServe. Nothing seeds it: TorchServe starts empty (test_torchserve_starts_empty).
    store = pod_properties(docs)["model_store"]
    assert arg_value(ts["args"], "--model-store") == store
    assert arg_value(sc["args"], "--model-store") == store
    assert tsm[store] == scm[store] and tsm[store] in empty
    # The token files are a read-only Secret volume, never a writable path.
    vol, _ = _token_volume(docs)
    token_dir = str(Path(arg_value(sc["args"], "--token-file")).parent)
    assert scm[token_dir] == vol and vol not in empty


# --------------------------------------------------------------------------- config + ports


def _port(url: str) -> int:
    port = urlparse(url).port
    assert port is not None, url
    return port


def test_pod_config_is_the_repo_config_with_pinned_differences(docs):
    repo, pod = repo_properties(), pod_properties(docs)
    differ = {"inference_address", "management_address", "metrics_address", "model_store",
              "allowed_urls"}
    assert set(pod) - set(repo) == set()
    assert set(repo) - set(pod) == set()
    for key in set(repo) - differ:
        assert pod[key] == repo[key], key
    for key in ("inference_address", "management_address", "metrics_address"):
        assert _port(pod[key]) == _port(repo[key]), key
    assert urlparse(pod["management_address"]).hostname == "127.0.0.1"
    assert urlparse(pod["inference_address"]).hostname == "0.0.0.0"
    assert urlparse(pod["metrics_address"]).hostname == "0.0.0.0"
    for key in ("grpc_inference_address", "grpc_management_address"):
        assert pod.get(key) == "127.0.0.1", key  # unused gRPC APIs stay inside the pod
    assert pod["disable_token_authorization"] == "true"
    assert pod["enable_model_api"] == "true"
    # Registering by URL: only archives of the pod's model store (no download, no other file).
    assert pod["allowed_urls"] == \
        "file://" + pod["model_store"] + r"/dlrm-[A-Za-z0-9][A-Za-z0-9._-]*\\.mar"


def test_pod_log_config_is_the_repo_file_and_torchserve_reads_it(docs):
    """The ConfigMap's log4j2.xml is the repo's byte for byte (per-request lines off), and
    the torchserve container passes it as --log-config from where the ConfigMap is mounted."""
    cm = one(docs, "ConfigMap", "dlrm-serve-torchserve")
    assert cm["data"]["log4j2.xml"] == (REPO / "log4j2.xml").read_text(), \
        "k8s/configmap.yaml's log4j2.xml drifted from the repo's log4j2.xml: copy it over"
    ts = container(docs, "torchserve")
    path = arg_value(ts["args"], "--log-config")
    conf = arg_value(ts["args"], "--ts-config")
    assert path.rsplit("/", 1)[0] == conf.rsplit("/", 1)[0]  # the same ConfigMap folder
    mounts = {m["mountPath"]: m["name"] for m in ts["volumeMounts"]}
    volume = mounts[path.rsplit("/", 1)[0]]
    vols = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert vols[volume]["configMap"]["name"] == "dlrm-serve-torchserve"


def test_container_ports_equal_config_and_sidecar_defaults(docs, monkeypatch):
    from serve.sidecar.config import SidecarConfig
    from serve.sidecar.http.app import build_parser

    for var in ("DLRM_SIDECAR_PORT", "TS_INFERENCE_URL", "TS_MANAGEMENT_URL", "TS_METRICS_URL"):
        monkeypatch.delenv(var, raising=False)
    repo, pod = repo_properties(), pod_properties(docs)
    ts, sc = container(docs, "torchserve"), container(docs, "sidecar")
    ts_ports = {p["name"]: p["containerPort"] for p in ts["ports"]}
    assert ts_ports == {"inference": _port(repo["inference_address"]),
                        "ts-metrics": _port(repo["metrics_address"])}
    # Management has no containerPort: it is never exposed.
    assert _port(pod["management_address"]) not in ts_ports.values()
    defaults = SidecarConfig()
    sidecar_port = build_parser().get_default("port")
    assert {p["name"]: p["containerPort"] for p in sc["ports"]} == \
        {"sidecar": sidecar_port, "write": WRITE_PORT}  # OIP: the "oip" container's
    assert int(arg_value(sc["args"], "--port")) == sidecar_port
    assert int(arg_value(sc["args"], "--write-port")) == WRITE_PORT
    assert int(arg_value(sc["args"], "--oip-port")) == OIP_PORT == DEFAULT_SIDECAR_OIP_PORT
    assert arg_value(sc["args"], "--host") == "0.0.0.0"
    for flag, key, default in (("--inference-url", "inference_address", defaults.inference_url),
                               ("--management-url", "management_address", defaults.management_url),
                               ("--metrics-url", "metrics_address", defaults.metrics_url)):
        url = arg_value(sc["args"], flag)
        assert urlparse(url).hostname == "127.0.0.1", flag  # same pod: loopback
        assert _port(url) == _port(pod[key]) == _port(default), flag
    ann = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == sidecar_port
    assert ann["prometheus.io/path"] == "/metrics"


def test_the_oip_runs_in_a_container_of_its_own_that_the_real_process_accepts(docs):
    """Review N1: the Open Inference Protocol is its own container (its own CPU and
    memory, requests = limits), started with args the real ``oip_server`` parses, on the
    port the Service's ``oip`` names; the sidecar only names it (``--oip-mode
    external``) and has no OIP port."""
    from serve.sidecar.http.oip_options import OipOptions
    from serve.sidecar.http.oip_server import build_parser as oip_parser

    oip, sc = container(docs, "oip"), container(docs, "sidecar")
    args = oip["args"]
    assert args[:3] == ["python", "-m", "serve.sidecar.http.oip_server"]
    ns, unknown = oip_parser({}).parse_known_args(args[3:])
    assert unknown == [], f"oip_server does not know {unknown}"
    assert ns.port == OIP_PORT and ns.host == "0.0.0.0"
    assert urlparse(ns.inference_url).hostname == "127.0.0.1"
    assert _port(ns.inference_url) == _port(pod_properties(docs)["inference_address"])
    sidecar_port = {p["name"]: p["containerPort"] for p in sc["ports"]}["sidecar"]
    assert ns.sidecar_url == f"http://127.0.0.1:{sidecar_port}"  # the read port, never 8091
    opts = OipOptions(max_parses=ns.max_parses, max_inflight_bytes=ns.max_inflight_bytes,
                      max_requests=ns.max_requests, limit_concurrency=ns.limit_concurrency,
                      body_deadline_s=ns.body_deadline_s)
    assert opts.max_parses == 1 and opts.body_deadline_s <= 30
    assert {p["name"]: p["containerPort"] for p in oip["ports"]} == {"oip": OIP_PORT}
    svc = one(docs, "Service", "dlrm-serve")
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}["oip"] == "oip"
    assert arg_value(sc["args"], "--oip-mode") == "external"
    res = oip["resources"]
    assert res["requests"] == res["limits"]
    # its own, bounded, and what make oip-flood measured (bench/oip_flood.py OIP_LIMITS):
    # a flood spends this container's memory and CPU, no more
    from bench.oip_flood import OIP_LIMITS
    from serve.ops.hpa_sim import parse_quantity
    assert parse_quantity(res["limits"]["memory"]) == OIP_LIMITS[0] <= 512 * 2**20
    assert parse_quantity(res["limits"]["cpu"]) == OIP_LIMITS[1] <= 1


def test_the_oip_container_holds_no_credential_and_no_readiness(docs):
    """No token file, no API token, no Secret in its environment; no readiness or
    startup probe (a busy OIP must never take the pod, 8080 included, out of the
    Service); its liveness is its own /v2/health/live; every mount read-only."""
    oip = container(docs, "oip")
    mounts = {m["name"]: m for m in oip.get("volumeMounts", [])}
    vol, _ = _token_volume(docs)
    assert vol not in mounts and "kube-api" not in mounts
    assert all(m.get("readOnly") is True for m in mounts.values()), mounts
    for e in oip.get("env", []):
        assert "secretKeyRef" not in e.get("valueFrom", {}), e
        assert "TOKEN" not in e["name"].upper(), e
    assert "envFrom" not in oip
    assert "--token-file" not in oip["args"]
    assert "readinessProbe" not in oip and "startupProbe" not in oip
    assert oip["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "oip"}


@pytest.mark.integration
def test_the_oip_liveness_path_answers_on_the_real_process(docs, sidecar):
    path = container(docs, "oip")["livenessProbe"]["httpGet"]["path"]
    assert httpx.get(f"{sidecar.oip_url}{path}", timeout=10).status_code == 200


def test_networkpolicy_exposes_inference_and_limits_metrics_and_writes(docs):
    """Ingress: 8080 and the Open Inference Protocol's 8092 (forwarded to 8080) from
    anywhere, 8082/8090 from the monitoring namespace, 8090 from the
    other serving pods (the fleet's leader), 8091 from labelled writer pods only;
    management (and gRPC) never."""
    pod = pod_properties(docs)
    inference, management, metrics = (_port(pod[k]) for k in
                                      ("inference_address", "management_address", "metrics_address"))
    sidecar_port = {p["name"]: p["containerPort"]
                    for p in container(docs, "sidecar")["ports"]}["sidecar"]
    np_ = one(docs, "NetworkPolicy", "dlrm-serve")
    assert np_["spec"]["policyTypes"] == ["Ingress"]
    open_ports, monitoring_ports, writer_ports, peer_ports = set(), set(), set(), set()
    for rule in np_["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if "from" not in rule:
            open_ports |= ports
        elif rule["from"] == [{"podSelector": {"matchLabels": WRITER_LABEL}}]:
            writer_ports |= ports
        elif rule["from"] == [{"podSelector": np_["spec"]["podSelector"]}]:
            peer_ports |= ports
        else:
            assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "monitoring"}}}]
            monitoring_ports |= ports
    assert open_ports == {inference, OIP_PORT}
    assert monitoring_ports == {metrics, sidecar_port}
    assert writer_ports == {WRITE_PORT}
    assert peer_ports == {sidecar_port}, "the peers read /metrics, never write"
    closed = {management, 7070, 7071}
    assert not closed & (open_ports | monitoring_ports | writer_ports | peer_ports)


APISERVER_EGRESS = K8S / "templates" / "apiserver-egress.yaml"
OPEN_CIDRS = {"0.0.0.0/0", "::/0"}


def _egress_targets(rule: dict) -> list[str]:
    """The ipBlock CIDRs of an egress rule's `to` (pod/namespace selectors: none)."""
    return [t["ipBlock"]["cidr"] for t in rule["to"] if "ipBlock" in t]


def test_egress_is_only_the_api_server_and_the_peers_read_port(docs):
    """The pod opens no connection out (loopback is not subject to NetworkPolicy) but to
    the other serving pods' sidecar read port (the leader reads their /metrics) and, by
    the install-time policy of k8s/templates/, the API server's own addresses (the
    fleet's Lease, ConfigMap and EndpointSlices). Every rule has a `to`: a rule with
    ports and no `to` opens those ports to every address, for the model code too."""
    np_ = one(docs, "NetworkPolicy", "dlrm-serve-egress")
    api = _load(APISERVER_EGRESS)
    assert [d["kind"] for d in api] == ["NetworkPolicy"]
    serving = one(docs, "NetworkPolicy", "dlrm-serve")["spec"]["podSelector"]
    sidecar_port = {p["name"]: p["containerPort"]
                    for p in container(docs, "sidecar")["ports"]}["sidecar"]
    for policy in (np_, api[0]):
        assert policy["spec"]["policyTypes"] == ["Egress"]
        assert policy["spec"]["podSelector"] == serving
        for rule in policy["spec"]["egress"]:
            assert rule.get("to"), f"{policy['metadata']['name']}: a rule without a `to`"
            assert rule.get("ports") and all(p["protocol"] == "TCP" for p in rule["ports"])
            for cidr in _egress_targets(rule):
                assert cidr not in OPEN_CIDRS and "except" not in rule["to"][0]["ipBlock"]
                assert cidr.endswith(("/32", "/128")), f"{cidr}: one address per block"
    rules = [({p["port"] for p in r["ports"]}, r["to"]) for r in np_["spec"]["egress"]]
    assert rules == [({sidecar_port}, [{"podSelector": serving}])], \
        "the peers' read port, to the serving pods only"
    # The API server: placeholders from the documentation range until installed.
    api_rules = [({p["port"] for p in r["ports"]}, _egress_targets(r))
                 for r in api[0]["spec"]["egress"]]
    assert api_rules == [({6443}, ["192.0.2.1/32"]), ({443}, ["192.0.2.2/32"])]
    assert api[0]["metadata"]["name"] not in {d["metadata"]["name"] for d in docs
                                              if d["kind"] == "NetworkPolicy"}, \
        "not in k8s/: `kubectl apply -f k8s/` must never reset the installed addresses"
    # Nothing in the pod points outside it: every URL the sidecar is given is loopback.
    sc = container(docs, "sidecar")
    urls = [a for a in sc["args"] if a.startswith("http")]
    assert urls and all(urlparse(u).hostname == "127.0.0.1" for u in urls)


def test_the_apiserver_egress_script_fills_in_this_clusters_addresses(tmp_path):
    """scripts/k8s_apiserver_egress.sh with a kubectl that answers like a cluster with a
    3-address control plane (one IPv6): one /32 or /128 block per endpoint on the
    endpoints' port, the ClusterIP on the Service's port, nothing else changed; with an
    unreadable address it prints nothing and fails."""
    stub = tmp_path / "bin" / "kubectl"
    stub.parent.mkdir()
    stub.write_text("#!/usr/bin/env bash\n"
                    'case "$2 $*" in\n'
                    '  endpoints*ports*) echo -n 6444 ;;\n'
                    '  endpoints*) echo -n "$EPS" ;;\n'
                    '  service*ports*) echo -n 443 ;;\n'
                    '  service*) echo -n 10.96.0.1 ;;\n'
                    "esac\n")
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}:/usr/bin:/bin", "EPS": "172.18.0.2 172.18.0.3 fd00::1 "}
    script = REPO / "scripts" / "k8s_apiserver_egress.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env,
                         timeout=30, check=True).stdout
    filled = yaml.safe_load(out)
    rules = [({p["port"] for p in r["ports"]}, _egress_targets(r))
             for r in filled["spec"]["egress"]]
    assert rules == [({6444}, ["172.18.0.2/32", "172.18.0.3/32", "fd00::1/128"]),
                     ({443}, ["10.96.0.1/32"])]
    template = _load(APISERVER_EGRESS)[0]
    assert {k: v for k, v in filled.items() if k != "spec"} == \
        {k: v for k, v in template.items() if k != "spec"}
    assert filled["spec"]["podSelector"] == template["spec"]["podSelector"]
    failed = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                            env={**env, "EPS": ""}, timeout=30, check=False)
    assert failed.returncode != 0 and failed.stdout == ""
    assert "could not read the API server's addresses" in failed.stderr


def test_the_write_port_has_its_own_cluster_service(docs):
    """Writers in the cluster reach 8091 through dlrm-serve-control (ClusterIP); the
    inference Service and the metrics Service never carry it."""
    svc = one(docs, "Service", "dlrm-serve-control")
    assert svc["spec"]["type"] == "ClusterIP"
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(WRITE_PORT, "write")]
    for other in find(docs, "Service"):
        if other is not svc:
            assert WRITE_PORT not in {p["port"] for p in other["spec"]["ports"]}, \
                other["metadata"]["name"]


def test_the_sidecar_memory_holds_the_delta_store_bound(docs):
    """The deltas the sidecar stores sit in the memory-backed delta folder, charged to its
    container, up to --max-delta-store-bytes: its limit holds that bound + 384 MiB for the
    process (measured peak: tests/test_deltas_memory.py)."""
    from serve.sidecar.config import SidecarConfig

    sc = container(docs, "sidecar")
    limits = sc["resources"]["limits"]
    assert limits["memory"] == sc["resources"]["requests"]["memory"]
    mem = {"Mi": 1 << 20, "Gi": 1 << 30}
    limit = int(limits["memory"][:-2]) * mem[limits["memory"][-2:]]
    bound = SidecarConfig().max_delta_store_bytes
    args = sc["args"]
    if "--max-delta-store-bytes" in args:
        bound = int(args[args.index("--max-delta-store-bytes") + 1])
    assert limit >= bound + (384 << 20), (limit, bound)


# --------------------------------------------------------------------------- probes, shutdown


def test_probes_on_ping_readyz_healthz(docs):
    ts, sc = container(docs, "torchserve"), container(docs, "sidecar")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert ts[probe]["httpGet"] == {"path": "/ping", "port": "inference"}
        assert sc[probe]["httpGet"]["port"] == "sidecar"
    assert sc["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sc["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sc["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_graceful_shutdown_budget(docs):
    from serve.model.archive import build_mar

    spec = pod_spec(docs)
    mar_timeout = inspect.signature(build_mar).parameters["response_timeout_s"].default
    response_timeout = max(int(pod_properties(docs)["default_response_timeout"]), mar_timeout)
    from serve.ops.drain import main as drain_main  # noqa: F401 - the preStop's module exists

    for c in spec["containers"]:
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:3] == ["python", "-m", "serve.ops.drain"], cmd
        settle = float(cmd[cmd.index("--settle-s") + 1]) if "--settle-s" in cmd else 0.0
        drain = float(cmd[cmd.index("--timeout-s") + 1])
        # the drain outlasts the longest response, and the grace period the drain + the stop
        assert drain >= response_timeout
        assert spec["terminationGracePeriodSeconds"] >= settle + drain + 15
        if c["name"] == "sidecar":
            # The drain is a write: the write port, with the sidecar's own token file.
            assert cmd[cmd.index("--sidecar-url") + 1] == f"http://127.0.0.1:{WRITE_PORT}"
            assert cmd[cmd.index("--token-file") + 1] == arg_value(c["args"], "--token-file")
            assert "--wait" not in cmd
        else:
            # TorchServe's hook only waits (a read, no token) for the sidecar's drain, at
            # least as long as the sidecar's settle + drain.
            assert "--wait" in cmd and "--token-file" not in cmd
            assert cmd[cmd.index("--sidecar-url") + 1] == "http://127.0.0.1:8090"
            sidecar_cmd = container(docs, "sidecar")["lifecycle"]["preStop"]["exec"]["command"]
            assert drain >= float(sidecar_cmd[sidecar_cmd.index("--settle-s") + 1]) + float(
                sidecar_cmd[sidecar_cmd.index("--timeout-s") + 1])
    assert "--foreground" in container(docs, "torchserve")["args"]


def test_topology_spread_across_nodes(docs):
    keys = {t["topologyKey"] for t in pod_spec(docs)["topologySpreadConstraints"]}
    assert "kubernetes.io/hostname" in keys


# --------------------------------------------------------------------------- serving state, model volume

STATE_CONFIGMAP = "dlrm-serving-state"
MODELS_PVC = "dlrm-models"
# Memory rule for the torchserve container (deployment.yaml says why): a version switch
# runs two versions side by side. Per worker: the Python/torch/TorchRec runtime (measured
# 310-330 MB RSS per worker of the small model on TorchServe 0.12, tables included) with
# room for the embedding cache and request buffers, plus the version's tables; the JVM:
# its -Xmx plus off-heap (metaspace, threads, Netty buffers).
WORKER_RUNTIME_BYTES = 450e6
JVM_OFF_HEAP_BYTES = 256 * 1024**2


def _volume(docs: list[dict], name: str) -> dict:
    vols = [v for v in pod_spec(docs)["volumes"] if v["name"] == name]
    assert len(vols) == 1, f"no volume {name!r}"
    return vols[0]


def _mounts_of(c: dict, volume: str) -> list[dict]:
    return [m for m in c.get("volumeMounts", []) if m["name"] == volume]


def _volume_named(docs: list[dict], key: str, field: str, value: str) -> str:
    """The name of the pod volume whose ``key`` source has ``field`` == ``value``."""
    names = [v["name"] for v in pod_spec(docs)["volumes"] if v.get(key, {}).get(field) == value]
    assert len(names) == 1, f"expected one {key} volume with {field}={value!r}, found {names}"
    return names[0]


def _state_text(docs: list[dict]) -> str:
    from serve.state import DEFAULT_STATE_FILE

    cm = one(docs, "ConfigMap", STATE_CONFIGMAP)
    key = Path(DEFAULT_STATE_FILE).name
    assert set(cm["data"]) == {key}, f"{STATE_CONFIGMAP} must hold exactly {key}"
    return cm["data"][key]


def _state(docs: list[dict]):
    from serve.state import parse_state

    return parse_state(yaml.safe_load(_state_text(docs)), source=f"ConfigMap {STATE_CONFIGMAP}")


def _sidecar_repositories(docs: list[dict]) -> list[str]:
    args = container(docs, "sidecar")["args"]
    return [args[i + 1] for i, a in enumerate(args) if a == "--repository"]


def _baked_repository() -> str:
    """Where the Dockerfile bakes model_store/ (COPY model_store/ DEST)."""
    m = re.search(r"^COPY\s+model_store/\s+(\S+)\s*$", (REPO / "Dockerfile").read_text(),
                  re.MULTILINE)
    assert m, "the Dockerfile bakes model_store/ into the image"
    return m.group(1).rstrip("/")


def test_serving_state_configmap_parses_and_names_the_default_build():
    """The ConfigMap's state.yaml is a valid desired state, naming the version `make model`
    builds by default (so `make model image` bakes it) with the batching and workers its
    .mar ships with."""
    from serve.model.pipeline_config import PipelineConfig
    from serve.profiles import get_profile
    from serve.store.repository import default_version

    docs = _load(K8S / "serving-state.yaml")
    state = _state(docs)
    shipped = PipelineConfig(profile=get_profile("small"), workdir=Path("unused"))
    assert state.model.version == default_version("small", shipped.dtype,
                                                  get_profile("small").seed)
    assert (state.batching.batch_size, state.batching.max_batch_delay_ms, state.workers) == \
        (shipped.mar_batch_size, shipped.mar_max_batch_delay_ms, shipped.mar_workers)
    assert state.rollout is None
    text = (K8S / "serving-state.yaml").read_text()
    for how in ("kubectl apply -f k8s/serving-state.yaml",
                f"kubectl edit configmap {STATE_CONFIGMAP}", "/state"):
        assert how in text, f"serving-state.yaml must say how to change it: {how}"


def test_state_configmap_is_a_folder_mount_at_the_sidecars_default(docs):
    """The sidecar reads serve.state.DEFAULT_STATE_FILE: the ConfigMap mounted as a folder
    (kubelet updates it by a symlink swap; a subPath mount would never see an update),
    and the Deployment's --state-file says the same."""
    from serve.state import DEFAULT_STATE_FILE

    vol = _volume_named(docs, "configMap", "name", STATE_CONFIGMAP)
    assert "items" not in _volume(docs, vol)["configMap"], "keep the key's own file name"
    sc = container(docs, "sidecar")
    (mount,) = _mounts_of(sc, vol)
    assert "subPath" not in mount and "subPathExpr" not in mount
    assert mount["readOnly"] is True
    assert str(Path(mount["mountPath"]) / "state.yaml") == DEFAULT_STATE_FILE
    assert arg_value(sc["args"], "--state-file") == DEFAULT_STATE_FILE
    for c in all_containers(docs):
        for m in _mounts_of(c, vol):
            assert "subPath" not in m and "subPathExpr" not in m, c["name"]


def test_model_volume_is_mounted_read_only_where_the_sidecar_looks(docs):
    """The sidecar's repositories: the image's baked versions first (they win a name
    clash), then the dlrm-models PVC, mounted read-only (one writer: the upload pod); the
    torchserve container mounts the volume at the same path, read-only, and names the
    same folders in the same order in DLRM_REPOSITORY (its workers map each version's
    tables folder from there: the archive carries only a reference)."""
    from serve.settings import DLRM_REPOSITORY

    pvc = one(docs, "PersistentVolumeClaim", MODELS_PVC)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"]
    vol = _volume_named(docs, "persistentVolumeClaim", "claimName", MODELS_PVC)
    assert _volume(docs, vol)["persistentVolumeClaim"]["readOnly"] is True
    sc = container(docs, "sidecar")
    (mount,) = _mounts_of(sc, vol)
    assert mount["readOnly"] is True
    assert _sidecar_repositories(docs) == [_baked_repository(), mount["mountPath"]]
    ts = container(docs, "torchserve")
    (ts_mount,) = _mounts_of(ts, vol)
    assert ts_mount["readOnly"] is True and ts_mount["mountPath"] == mount["mountPath"]
    env = {e["name"]: e.get("value") for e in ts.get("env", [])}
    assert env[DLRM_REPOSITORY.name] == ":".join(_sidecar_repositories(docs))


DELTAS_PVC = "dlrm-deltas"


def test_deltas_come_from_their_own_volume_never_a_repository(docs):
    """Review N5 (the Kubernetes part): the published deltas are read from a volume of
    their own (the PVC dlrm-deltas, its own upload pod), not from the model volume whose
    archives are code: the repository mounts and the delta-source mount are different
    volumes and claims, the delta volume is never a --repository (nor under one), and each
    upload pod writes one volume only."""
    sc = container(docs, "sidecar")
    source = Path(arg_value(sc["args"], "--delta-volume"))
    (mount,) = [m for m in sc["volumeMounts"] if Path(m["mountPath"]) == source]
    assert mount["readOnly"] is True
    vol = _volume(docs, mount["name"])
    assert vol["persistentVolumeClaim"] == {"claimName": DELTAS_PVC, "readOnly": True}
    assert one(docs, "PersistentVolumeClaim", DELTAS_PVC)["spec"]["accessModes"] == [
        "ReadWriteMany"]
    repos = [Path(r) for r in _sidecar_repositories(docs)]
    assert source not in repos
    assert not any(source.is_relative_to(r) or r.is_relative_to(source) for r in repos)
    repo_volumes = {m["name"] for m in sc["volumeMounts"]
                    if any(Path(m["mountPath"]) == r for r in repos)}
    assert mount["name"] not in repo_volumes
    assert _volume_named(docs, "persistentVolumeClaim", "claimName", MODELS_PVC) != \
        mount["name"]
    for c in all_containers(docs):  # the workers read the pod's delta folder, not this
        if c["name"] != "sidecar":
            assert not _mounts_of(c, mount["name"]), c["name"]
    # The sidecar reads exactly there (its parsed config, not the flag's text).
    from serve.common.flags import build
    from serve.sidecar.config import SidecarConfig
    from serve.sidecar.http.app import build_parser

    config = build(SidecarConfig, build_parser().parse_args(sc["args"][3:]))
    assert config.delta_volume_roots == (source,)
    claims = {}
    for name in ("model-upload-pod.yaml", "delta-upload-pod.yaml"):
        (pod,) = _load(K8S / "templates" / name)
        claims[name] = {v["persistentVolumeClaim"]["claimName"]
                        for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"model-upload-pod.yaml": {MODELS_PVC},
                      "delta-upload-pod.yaml": {DELTAS_PVC}}, "one writer per volume"


def test_torchserve_starts_empty(docs):
    """No --models, no load_models, nothing seeding the model store: the sidecar registers
    the declared version into TorchServe's writable store."""
    ts = container(docs, "torchserve")
    assert "--models" not in ts["args"] and not any(a.endswith(".mar") for a in ts["args"])
    assert "load_models" not in pod_properties(docs)
    assert "load_models" not in repo_properties()
    assert "initContainers" not in pod_spec(docs)


def test_sidecar_accepts_the_deployments_args(docs):
    """Every flag the Deployment passes is one the real sidecar parses, with the values
    the Deployment means (catches a renamed or missing flag before a pod crash-loops)."""
    from serve.sidecar.http.app import build_parser
    from serve.state import DEFAULT_STATE_FILE

    args = container(docs, "sidecar")["args"]
    assert args[:3] == ["python", "-m", "serve.sidecar"]
    try:
        ns, unknown = build_parser().parse_known_args(args[3:])
    except SystemExit:
        pytest.fail(f"python -m serve.sidecar rejects the Deployment's args {args[3:]} "
                    "(see the argparse error above): a flag k8s/deployment.yaml passes does "
                    "not exist in serve/sidecar/http/app.py")
    assert str(ns.state_file) == DEFAULT_STATE_FILE
    assert [str(r) for r in ns.repository] == _sidecar_repositories(docs)
    assert unknown == [], f"python -m serve.sidecar does not know {unknown}"
    assert ns.write_port == 8091 and ns.port == 8090
    assert str(ns.delta_token_file).startswith("/etc/dlrm/tokens/")
    assert str(ns.feedback_token_file).startswith("/etc/dlrm/tokens/")



def test_rollout_deadline_covers_the_first_registration(docs):
    """A new pod is Ready only once the sidecar registered the declared version: the
    rollout's deadline must outlast the sidecar's own registration timeout."""
    from serve.sidecar.http.app import build_parser

    deadline = one(docs, "Deployment")["spec"]["progressDeadlineSeconds"]
    assert deadline > build_parser().get_default("register_timeout")
    # TorchServe's probes do not wait for the model (/ping is Healthy while it is empty
    # and while a version loads); the sidecar's liveness never depends on TorchServe.
    sc = container(docs, "sidecar")
    assert sc["livenessProbe"]["httpGet"]["path"] == sc["startupProbe"]["httpGet"]["path"] \
        == "/healthz"


def _table_bytes(version: str) -> float:
    """Table bytes in memory per worker of a version named <profile>-<dtype>-s<seed>:
    an int8 row is D bytes + fp16 scale and bias, padded to 16 bytes in memory (docs/stack.md:
    80 B at D = 64; the build report's table_bytes_quantized counts the unpadded 68 B)."""
    from serve.profiles import PROFILES

    names = [n for n in PROFILES if version.startswith(f"{n}-")]
    assert names, f"version {version!r} does not start with a profile name"
    prof = PROFILES[max(names, key=len)]
    assert "-int8-" in version, f"add the row size of {version!r}'s dtype here"
    return prof.total_rows * -(-(prof.embedding_dim + 4) // 16) * 16


def _jvm_heap_bytes(docs: list[dict], flag: str = "-Xmx") -> float:
    m = re.search(rf"{flag}(\d+)([kKmMgG])", pod_properties(docs)["vmargs"])
    assert m, f"vmargs must bound the JVM's memory ({flag})"
    return int(m.group(1)) * 1024 ** {"k": 1, "m": 2, "g": 3}[m.group(2).lower()]


@pytest.mark.needs_kubectl
@pytest.mark.parametrize("variant", ["base", "cpu-overlay"])
def test_memory_limit_holds_two_versions_during_a_switch(docs, cpu_docs, variant):
    """headroom x limit >= JVM + 2 versions x workers x (runtime + tables), for the
    version and workers the serving state declares; and the sidecar is told TorchServe's
    limit (its own cgroup is another container's)."""
    from serve.ops.hpa_sim import parse_quantity
    from serve.settings import DLRM_MEMORY_LIMIT_BYTES
    from serve.sidecar.config import SidecarConfig

    d = docs if variant == "base" else cpu_docs
    state = _state(docs)
    limit = parse_quantity(container(d, "torchserve")["resources"]["limits"]["memory"])
    per_version = state.workers * (WORKER_RUNTIME_BYTES + _table_bytes(state.model.version))
    # the JVM: its heap, its direct memory (request bodies in flight: make ts-heap filled
    # it with 200 trickling connections and two queues) and the rest of its off-heap
    jvm = (_jvm_heap_bytes(d) + _jvm_heap_bytes(d, "-XX:MaxDirectMemorySize=")
           + JVM_OFF_HEAP_BYTES)
    need = jvm + 2 * per_version
    usable = SidecarConfig().memory_headroom * limit
    assert usable >= need, (f"{variant}: 0.9 x limit {limit / 1e9:.2f} GB = {usable / 1e9:.2f} "
                            f"GB < {need / 1e9:.2f} GB for two versions")
    env = {e["name"]: e for e in container(d, "sidecar")["env"]}
    assert env[DLRM_MEMORY_LIMIT_BYTES.name]["valueFrom"]["resourceFieldRef"] == {
        "containerName": "torchserve", "resource": "limits.memory", "divisor": "1"}


@pytest.mark.needs_kubectl
def test_cpu_overlay_keeps_the_serving_state_and_model_volume(docs, cpu_docs):
    """The overlay changes images, GPU bits and TorchServe's resources only."""
    for kind, name in (("ConfigMap", STATE_CONFIGMAP), ("PersistentVolumeClaim", MODELS_PVC)):
        assert one(cpu_docs, kind, name) == one(docs, kind, name)
    assert pod_spec(cpu_docs)["volumes"] == pod_spec(docs)["volumes"]
    base_sc, cpu_sc = container(docs, "sidecar"), container(cpu_docs, "sidecar")
    assert {k: v for k, v in cpu_sc.items() if k != "image"} == \
        {k: v for k, v in base_sc.items() if k != "image"}
    assert container(cpu_docs, "torchserve")["args"] == container(docs, "torchserve")["args"]
    assert one(cpu_docs, "Deployment")["spec"]["progressDeadlineSeconds"] == \
        one(docs, "Deployment")["spec"]["progressDeadlineSeconds"]


def test_upload_pod_template_writes_the_model_volume(docs):
    """k8s/templates/model-upload-pod.yaml: the PVC read-write at /models, hardened like
    the serving pod, and the documented copy puts the tables folder first and the report
    after the archive."""
    path = K8S / "templates" / "model-upload-pod.yaml"
    pod = one(_load(path), "Pod")
    spec = pod["spec"]
    (vol,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert vol["persistentVolumeClaim"] == {"claimName": MODELS_PVC}
    (c,) = spec["containers"]
    (mount,) = _mounts_of(c, vol["name"])
    assert mount["mountPath"] == "/models" and not mount.get("readOnly", False)
    assert c["image"] == container(docs, "sidecar")["image"]
    assert spec["securityContext"]["runAsUser"] == UID and spec["activeDeadlineSeconds"] > 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and "command" not in c
    for doc_path in (path, K8S / "models-pvc.yaml"):
        copies = re.findall(r"kubectl cp \S+\.(tables|mar|json)\s+dlrm-model-upload:/models/",
                            doc_path.read_text())
        assert copies == ["tables", "mar", "json"], \
            f"{doc_path.name}: copy the .tables folder first, then the .mar, the report last"


# --------------------------------------------------------------------------- real services


def _metric_sample_names(text: str) -> dict[str, list[dict]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s.labels)
    return out


@pytest.mark.integration
def test_hpa_metric_comes_from_what_the_real_sidecar_exports(docs, torchserve, sidecar):
    """One real predict through TorchServe, then the sidecar's real /metrics: the adapter
    rule must turn a series it exports into exactly the HPA's metric name."""
    from serve.api.json_body import example_request

    r = httpx.post(f"{torchserve.inference_url}/predictions/{torchserve.model_name}",
                   json=example_request(3, seed=1), timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.get(f"{sidecar.url}/metrics", timeout=30).text
    samples = _metric_sample_names(text)
    for metric, counter in ((HPA_METRIC, SIDECAR_COUNTER), (UTILIZATION_METRIC, WORK_COUNTER)):
        rule = _adapter_rule(docs, metric)
        made = {name: _adapter_metric_name(rule, name) for name in samples}
        hits = {name for name, m in made.items() if m == metric}
        assert hits == {counter}, sorted(samples)
    codes = {labels.get("code") for labels in samples[SIDECAR_COUNTER]}
    assert "200" in codes


@pytest.mark.integration
def test_probe_paths_exist_on_the_real_services(docs, torchserve, sidecar):
    assert httpx.get(f"{torchserve.inference_url}/ping", timeout=10).status_code == 200
    spec = httpx.get(f"{sidecar.url}/openapi.json", timeout=10).json()
    sc = container(docs, "sidecar")
    paths = {sc[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    paths.add(one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
              ["prometheus.io/path"])
    for path in sorted(paths):
        assert "get" in spec["paths"].get(path, {}), f"sidecar has no GET {path}"
        assert httpx.get(f"{sidecar.url}{path}", timeout=10).status_code == 200, path
    ts = container(docs, "torchserve")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = ts[probe]["httpGet"]["path"]
        # No Authorization header, as the kubelet sends it: token auth must be off.
        assert httpx.get(f"{torchserve.inference_url}{path}", timeout=10).status_code == 200


@pytest.mark.needs_kubectl
def test_monitoring_kustomization_applies_the_operator_objects_only():
    """`kubectl apply -k k8s/monitoring/` (the documented command) builds exactly the
    ServiceMonitor, the PrometheusRule and the dashboard ConfigMap; the plain rule files,
    their promtool tests and dashboard.json in that folder are not Kubernetes objects."""
    out = subprocess.run([kubectl(), "kustomize", str(K8S / "monitoring")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout)
                   if d)
    assert kinds == [("ConfigMap", "dlrm-serve-dashboard"), ("PrometheusRule", "dlrm-serve"),
                     ("ServiceMonitor", "dlrm-serve")]
    sm_doc = (K8S / "monitoring" / "servicemonitor.yaml").read_text()
    assert "kubectl apply -k k8s/monitoring/" in sm_doc


def test_the_route_key_secret_reaches_the_workers_only(docs):
    """Review N10: the workers key the X-DLRM-Route-Key hash with the fleet's secret, a
    required Secret of its own mounted read-only in the torchserve container alone (not
    the sidecar's token Secret, and nowhere else)."""
    from serve.settings import DLRM_ROUTE_KEY_SALT_FILE

    ts = container(docs, "torchserve")
    env = {e["name"]: e for e in ts["env"]}
    path = Path(env[DLRM_ROUTE_KEY_SALT_FILE.name]["value"])
    mounts = {m["name"]: m for m in ts["volumeMounts"]}
    mount = next(m for m in mounts.values() if path.parent == Path(m["mountPath"]))
    assert mount["readOnly"] is True
    vol = _volume(docs, mount["name"])
    assert vol["secret"]["secretName"] == "dlrm-route-key" != TOKEN_SECRET
    assert not vol["secret"].get("optional", False)
    assert [i["path"] for i in vol["secret"]["items"]] == [path.name]
    others = [c["name"] for c in pod_spec(docs)["containers"] if c["name"] != "torchserve"
              and any(m["name"] == mount["name"] for m in c.get("volumeMounts", []))]
    assert others == []
