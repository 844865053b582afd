"""The fleet on Kubernetes (serve/sidecar/adapters/kubernetes.py) against a fake API server
(tests/fakes/kube_api.py): two pods race for the Lease and one wins; the leader records a
rollback in the ConfigMap; a follower adopts it (same revision); a restarted follower is
born decided; the settled state is written into the serving-state ConfigMap."""
from __future__ import annotations

import json

import pytest

from serve.errors import ConfigError
from serve.sidecar.adapters.kubernetes import (
    ConfigMapDecisionStore,
    KubeClient,
    KubeLease,
    KubePeers,
)
from serve.sidecar.control.fleet import Fleet
from serve.sidecar.control.rollout import RolloutController, RolloutPhase, rollout_key
from serve.store.routing import read_control
from tests.fakes.kube_api import FakeKubeApi
from tests.test_rollout import SERVING, STABLE, Clock, Workers, desired

TOKEN = "fake-token"


@pytest.fixture
def api():
    with FakeKubeApi(TOKEN) as fake:
        fake.put_object("configmaps", {"metadata": {"name": "dlrm-serve-rollout"}})
        fake.put_object("configmaps", {"metadata": {"name": "dlrm-serving-state"},
                                       "data": {"state.yaml": "model: {version: a}\n"}})
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
    assert spec["holderIdentity"] == "pod-b" and spec["leaseTransitions"] == 1
    assert spec["leaseDurationSeconds"] == 15
    assert ("PUT", "/apis/coordination.k8s.io/v1/namespaces/serve/leases/dlrm-serve-rollout",
            409) in api.calls


def test_two_pods_creating_the_lease_at_once_one_gets_409(api):
    clock = Clock()
    a = KubeLease(client(api), "l", 15, clock=clock)
    b = KubeLease(client(api), "l", 15, clock=clock)
    inner = a.client.request

    def racing(method, path, body=None, params=None):
        if method == "POST":
            assert b.try_acquire("pod-b") is True
        return inner(method, path, body, params)

    a.client.request = racing  # type: ignore[method-assign]
    assert a.try_acquire("pod-a") is False
    assert b.try_acquire("pod-b") is True  # renewed


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


def test_the_leader_settles_the_declared_state(api):
    store = ConfigMapDecisionStore(client(api), "dlrm-serve-rollout")
    assert store.publish_state("model: {version: b}\n") is True
    assert api.objects[("configmaps", "dlrm-serving-state")]["data"]["state.yaml"] == \
        "model: {version: b}\n"
    assert store.publish_state("model: {version: b}\n") is False  # says so already


def test_peers_are_the_ready_pods_of_the_label(api):
    def pod(name, ip, ready="True", app="dlrm-serve"):
        return {"metadata": {"name": name, "labels": {"app.kubernetes.io/name": app}},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}

    api.put_object("pods", pod("dlrm-a", "10.0.0.1"))
    api.put_object("pods", pod("dlrm-b", "10.0.0.2", ready="False"))
    api.put_object("pods", pod("other", "10.0.0.3", app="other"))
    peers = KubePeers(client(api), "app.kubernetes.io/name=dlrm-serve").peers()
    assert [(p.name, p.sidecar_url, p.predict_url) for p in peers] == [
        ("dlrm-a", "http://10.0.0.1:8090", "http://10.0.0.1:8080")]


def test_a_wrong_token_is_an_upstream_error_and_the_fleet_follows(api):
    from serve.errors import UpstreamUnavailable

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
