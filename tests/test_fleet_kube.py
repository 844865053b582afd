"""The fleet on Kubernetes (serve/sidecar/adapters/kubernetes.py) against a fake API server
(tests/fakes/kube_api.py) that enforces the Role of k8s/rbac.yaml and holds the objects
the manifests ship: two pods race for the Lease and one wins; the leader records a
rollback in the ConfigMap; a follower adopts it (same revision); a restarted follower is
born decided; the settled state goes into the pods' own ConfigMap, never the operator's
dlrm-serving-state; the peers are the ready endpoints of the metrics Service (never the
model-upload pod)."""
from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from serve.errors import ConfigError, UpstreamUnavailable
from serve.sidecar.adapters.archives import control_path
from serve.sidecar.adapters.kubernetes import (
    SETTLED_KEY,
    ConfigMapDecisionStore,
    KubeClient,
    KubeLease,
    KubePeers,
)
from serve.sidecar.adapters.torchserve import TorchServeClient
from serve.sidecar.config import FleetConfig, SidecarConfig
from serve.sidecar.control.fleet import Fleet, FleetFamilies
from serve.sidecar.control.reconciler import Reconciler
from serve.sidecar.control.rollout import RolloutController, RolloutPhase, rollout_key
from serve.sidecar.control.state_file import DesiredStateFile
from serve.sidecar.control.switch import VersionSwitch
from serve.state import load_state, write_state
from serve.store.repository import ModelRepository
from serve.store.routing import read_control
from tests.fakes.kube_api import FakeKubeApi
from tests.fixtures.sidecar import FakeClock, FakeTorchServe, add_versions
from tests.test_rollout import CANDIDATE, SERVING, STABLE, Clock, Workers, desired, traffic

K8S = Path(__file__).resolve().parent.parent / "k8s"
TOKEN = "fake-token"


def manifests(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def shipped(kind: str, name: str, path: Path) -> dict:
    return copy.deepcopy(next(d for d in manifests(path)
                              if d["kind"] == kind and d["metadata"]["name"] == name))


FC = FleetConfig()
ROLE = shipped("Role", "dlrm-serve-rollout", K8S / "rbac.yaml")["rules"]


@pytest.fixture
def api():
    """The API server after `kubectl apply -f k8s/`: the Lease, the decisions ConfigMap
    and the serving state as shipped; every call checked against the shipped Role."""
    with FakeKubeApi(TOKEN, role=ROLE) as fake:
        fake.put_object("leases", shipped("Lease", FC.lease_name, K8S / "rbac.yaml"))
        fake.put_object("configmaps", shipped("ConfigMap", FC.decisions_configmap,
                                              K8S / "rbac.yaml"))
        fake.put_object("configmaps", shipped("ConfigMap", "dlrm-serving-state",
                                              K8S / "serving-state.yaml"))
        yield fake


def client(api: FakeKubeApi, token: str = TOKEN) -> KubeClient:
    return KubeClient(api.url, api.namespace, token=lambda: token, verify=False)


def test_two_pods_race_for_the_lease_and_one_wins(api):
    clock = Clock()
    a = KubeLease(client(api), "dlrm-serve-rollout", 15, clock=clock)
    b = KubeLease(client(api), "dlrm-serve-rollout", 15, clock=clock)
    assert a.try_acquire("pod-a") is True  # created
    assert b.try_acquire("pod-b") is False and b.holder() == "pod-a"
    clock.t += 16  # pod-a stopped renewing: expired
    # Both read the expired lease; pod-b writes first; pod-a's write is a 409: lost.
    inner = a.client.request

    def racing(method, path, body=None, params=None):
        if method == "PUT":
            assert b.try_acquire("pod-b") is True
        return inner(method, path, body, params)

    a.client.request = racing  # type: ignore[method-assign]
    assert a.try_acquire("pod-a") is False
    a.client.request = inner  # type: ignore[method-assign]
    assert a.holder() == "pod-b"
    spec = api.objects[("leases", "dlrm-serve-rollout")]["spec"]
    assert spec["holderIdentity"] == "pod-b" and spec["leaseTransitions"] == 2
    assert spec["leaseDurationSeconds"] == 15
    assert ("PUT", "/apis/coordination.k8s.io/v1/namespaces/serve/leases/dlrm-serve-rollout",
            409) in api.calls


def test_the_pods_never_create_a_lease(api):
    """The Lease is shipped (k8s/rbac.yaml): RBAC cannot limit create to a name, so the
    Role has no create; a missing Lease is an error naming the fix, and no POST is made."""
    shipped_lease = api.objects.pop(("leases", FC.lease_name))  # deleted by someone
    lease = KubeLease(client(api), FC.lease_name, 15)
    with pytest.raises(UpstreamUnavailable, match="does not exist; apply k8s/rbac.yaml"):
        lease.try_acquire("pod-a")
    assert not [c for c in api.calls if c[0] == "POST"]
    assert not api.allows("coordination.k8s.io", "leases", None, "create")
    api.put_object("leases", shipped_lease)  # kubectl apply -f k8s/
    assert lease.try_acquire("pod-a") is True


def controller(tmp_path, store, identity: str) -> RolloutController:
    return RolloutController(read_families=Workers().families,
                             control_file=lambda v: tmp_path / f"{identity}-{v}.json",
                             clock=Clock(), wall_clock=lambda: 1.7e9, decisions=store,
                             identity=identity)


def test_leader_records_follower_adopts_restarted_follower_is_born_decided(api, tmp_path):
    d = desired()
    key = rollout_key(STABLE, d.rollout)
    leader = controller(tmp_path, ConfigMapDecisionStore(client(api), "dlrm-serve-rollout"),
                        "pod-a")
    follower = controller(tmp_path, ConfigMapDecisionStore(client(api), "dlrm-serve-rollout"),
                          "pod-b")
    for ctl in (leader, follower):
        ctl.declare(d)
        ctl.on_serving(d, SERVING)
    leader.rollback("guard error_ratio breached")
    leader.sync_decision("pods_judged: 2 of 2")
    stored = json.loads(api.objects[("configmaps", "dlrm-serve-rollout")]["data"]
                        ["decisions.json"])["decisions"]
    assert [s["key"] for s in stored] == [key] and stored[0]["decided_by"] == "pod-a"
    assert follower.sync_decision() == "rolled_back"
    assert read_control(tmp_path / f"pod-b-{SERVING}.json").weight == 0.0
    assert follower.status().revision == leader.status().revision == stored[0]["revision"]
    restarted = controller(tmp_path, ConfigMapDecisionStore(client(api),
                                                            "dlrm-serve-rollout"), "pod-b")
    run = restarted.declare(d)
    assert run is not None and run.phase is RolloutPhase.ROLLED_BACK
    assert run.revision == stored[0]["revision"]
    assert restarted.effective(d).rollout is None


def test_decision_store_compare_and_set_retries_and_first_writer_wins(api):
    from tests.test_fleet import decision

    store = ConfigMapDecisionStore(client(api), "dlrm-serve-rollout")
    other = ConfigMapDecisionStore(client(api), "dlrm-serve-rollout")
    inner = store.client.request
    raced = {"done": False}

    def racing(method, path, body=None, params=None):
        if method == "PUT" and not raced["done"]:
            raced["done"] = True
            other.record(decision(key="k-other", by="pod-b"))  # changes the version
        return inner(method, path, body, params)

    store.client.request = racing  # type: ignore[method-assign]
    mine = store.record(decision(key="k1", by="pod-a"))
    assert mine.decided_by == "pod-a"
    assert {d for d in ("k1", "k-other") if other.read(d) is not None} == {"k1", "k-other"}
    assert other.record(decision(key="k1", by="pod-c", phase="promoted")) == mine


def test_the_leader_records_the_settled_state_in_the_pods_own_configmap(api):
    before = copy.deepcopy(api.objects[("configmaps", "dlrm-serving-state")])
    store = ConfigMapDecisionStore(client(api), FC.decisions_configmap)
    assert store.publish_state("model: {version: b}\n") is True
    assert api.objects[("configmaps", FC.decisions_configmap)]["data"][SETTLED_KEY] == \
        "model: {version: b}\n"
    assert store.publish_state("model: {version: b}\n") is False  # says so already
    assert api.objects[("configmaps", "dlrm-serving-state")] == before
    # and the shipped Role would refuse a pod that tried: the operator's object is not theirs
    r = client(api).request("PUT", client(api).ns_path("", "configmaps", "dlrm-serving-state"),
                            before)
    assert r.status_code == 403


def pod(name: str, ip: str, labels: dict[str, str], ready: str = "True") -> dict:
    return {"metadata": {"name": name, "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}


def test_peers_are_the_ready_endpoints_of_the_metrics_service_never_the_upload_pod(api):
    """The Services of k8s/service.yaml and the pods of k8s/deployment.yaml's template,
    plus the model-upload pod of k8s/templates (Ready, same app name, another component):
    the peers are the ready serving pods only, read from EndpointSlices (no pod list)."""
    for svc in manifests(K8S / "service.yaml"):
        api.put_object("services", svc)
    serving = next(d for d in manifests(K8S / "deployment.yaml")
                   if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    upload = shipped("Pod", "dlrm-model-upload", K8S / "templates" / "model-upload-pod.yaml")
    upload["status"] = {"podIP": "10.0.0.9",
                        "conditions": [{"type": "Ready", "status": "True"}]}
    api.put_object("pods", upload)
    api.put_object("pods", pod("dlrm-a", "10.0.0.1", serving))
    api.put_object("pods", pod("dlrm-b", "10.0.0.2", serving, ready="False"))
    api.put_object("pods", pod("dlrm-c", "fd00::3", serving))
    api.put_object("pods", pod("other", "10.0.0.4", {"app.kubernetes.io/name": "other"}))
    gone = pod("dlrm-d", "10.0.0.5", serving)
    gone["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    api.put_object("pods", gone)
    peers = KubePeers(client(api), FC.peer_service).peers()
    assert [(p.name, p.sidecar_url, p.predict_url) for p in peers] == [
        ("dlrm-a", "http://10.0.0.1:8090", "http://10.0.0.1:8080"),
        ("dlrm-c", "http://[fd00::3]:8090", "http://[fd00::3]:8080")]
    assert not [c for c in api.calls if "/pods" in c[1]], "no pod is listed or read"
    assert not api.allows("", "pods", None, "list")


def test_a_wrong_token_is_an_upstream_error_and_the_fleet_follows(api):
    lease = KubeLease(client(api, token="wrong"), "l", 15)
    with pytest.raises(UpstreamUnavailable, match="answered 401"):
        lease.try_acquire("pod-a")
    fleet = Fleet("pod-a", decisions=ConfigMapDecisionStore(client(api), "x"), lease=lease)
    assert fleet.elect() is False and "401" in (fleet.error or "")


def test_in_cluster_config_reads_the_service_account(tmp_path):
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "namespace").write_text("serve\n")
    c = KubeClient.in_cluster({"KUBERNETES_SERVICE_HOST": "10.96.0.1",
                               "KUBERNETES_SERVICE_PORT": "443"}, sa_dir=tmp_path)
    assert (c.base_url, c.namespace, c.token()) == ("https://10.96.0.1:443", "serve", "tok")
    with pytest.raises(ConfigError, match="automountServiceAccountToken: true"):
        KubeClient.in_cluster({}, sa_dir=tmp_path)


# --------------------------------------------------------------------------- the settle


class KubePod:
    """A sidecar's reconciler with the Kubernetes fleet (the fake API server), its own fake
    TorchServe and the serving state as a read-only file (a ConfigMap mount)."""

    def __init__(self, tmp: Path, name: str, api: FakeKubeApi, repo: ModelRepository,
                 state_file: Path, workers: Workers) -> None:
        self.store = tmp / name / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.ts = FakeTorchServe(self.store, initial=None)
        self.clock = FakeClock()
        cfg = SidecarConfig(management_url="http://ts", model_store=self.store,
                            switch_grace_s=0.0, state_file=state_file,
                            repositories=tuple(repo.roots))
        ts = TorchServeClient(cfg, httpx.AsyncClient(transport=self.ts.transport()))
        store = ConfigMapDecisionStore(client(api), FC.decisions_configmap)
        fam = FleetFamilies(workers.families, KubePeers(client(api), FC.peer_service), name)
        self.fleet = Fleet(name, decisions=store, lease=KubeLease(client(api), FC.lease_name),
                           families=fam, publish_state=store.publish_state)
        self.ctl = RolloutController(
            read_families=fam, control_file=lambda v: control_path(self.store, "dlrm", v),
            clock=self.clock, decisions=store, identity=name)
        self.rec = Reconciler(ts, cfg, switch=VersionSwitch(ts, cfg, clock=self.clock,
                                                            sleep=self.clock.sleep),
                              repository=repo, rollouts=self.ctl, clock=self.clock,
                              fleet=self.fleet)

    def tick(self):
        return asyncio.run(self.rec.tick())


def test_a_settle_writes_only_the_pods_own_configmap(api, tmp_path, monkeypatch):
    """The leader rolls a bad candidate back and settles: with the declared state
    read-only (the operator's ConfigMap), the settled state goes into the decisions
    ConfigMap; every write the pod makes names the Lease or that ConfigMap, and
    dlrm-serving-state is never written."""
    monkeypatch.setattr(DesiredStateFile, "writable_error",
                        lambda self: self.read_only("a ConfigMap mount"))
    repo = ModelRepository([add_versions(tmp_path / "repo", [STABLE, CANDIDATE])])
    d = desired(bake_s=60)
    d = d.model_copy(update={"batching": d.batching.model_copy(
        update={"batch_size": 8, "max_batch_delay_ms": 50}), "workers": 1})
    state_file = tmp_path / "state" / "state.yaml"
    write_state(state_file, d)
    before = copy.deepcopy(api.objects[("configmaps", "dlrm-serving-state")])
    workers = Workers()
    leader = KubePod(tmp_path, "pod-a", api, repo, state_file, workers)
    assert leader.tick().target == f"{STABLE}_b8d50w1_c{CANDIDATE}"
    assert leader.fleet.leading, leader.fleet.error
    traffic(workers, candidate_scores=np.full(200, 0.5))  # the candidate scores badly
    for _ in range(d.rollout.guards.failure_limit + 1):
        leader.clock.now += 5.0
        leader.tick()
    cm = api.objects[("configmaps", FC.decisions_configmap)]["data"]
    decisions = json.loads(cm["decisions.json"])["decisions"]
    assert [x["phase"] for x in decisions] == ["rolled_back"]
    assert decisions[0]["key"] == rollout_key(STABLE, d.rollout)
    settled = yaml.safe_load(cm[SETTLED_KEY])
    assert settled["rollout"] is None and settled["model"]["version"] == STABLE
    assert load_state(state_file).rollout is not None  # the declared file: not written
    assert api.objects[("configmaps", "dlrm-serving-state")] == before
    writes = {(m, path.rsplit("/", 2)[-2], path.rsplit("/", 1)[-1])
              for m, path, _ in api.calls if m != "GET"}
    assert writes == {("PUT", "leases", FC.lease_name),
                      ("PUT", "configmaps", FC.decisions_configmap)}, writes
    assert all(status != 403 for _, _, status in api.calls), api.calls
