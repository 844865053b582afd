"""The fleet's Kubernetes side: a small client of the API server, and the lease, decision
store and peer list of :mod:`serve.sidecar.control.fleet` on it.

No ``kubernetes`` package: four endpoints, JSON over ``httpx``, with the pod's service
account (``/var/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt,namespace}``,
``KUBERNETES_SERVICE_HOST``/``_PORT``). Everything is injectable (base URL, token, CA) so
tests drive a fake API server (``tests/fakes/kube_api.py``).

* :class:`KubeLease`: a ``coordination.k8s.io/v1`` Lease, shipped in ``k8s/rbac.yaml``
  (the pods may not create leases: RBAC cannot limit ``create`` to a name). Read it; take
  it (update with its ``resourceVersion``) when this pod holds it or it expired. A 409
  means another pod changed it first: it lost the race.
* :class:`ConfigMapDecisionStore`: the decisions as JSON under ``decisions.json`` of the
  ConfigMap ``dlrm-serve-rollout``, compare-and-set by ``resourceVersion`` (a 409 reads
  and tries again; a decision already there wins). The pods' own object: never a key of
  ``dlrm-serving-state``, which is the operator's declared intent, applied from git
  (``kubectl apply``/GitOps would fight a key the pods write, and a pod that could write
  it could set every pod's version, batching and workers). The leader records the settled
  state there too (:meth:`ConfigMapDecisionStore.publish_state`: ``settled-state.yaml``),
  for the operator to copy into ``k8s/serving-state.yaml``; every pod already serves it
  (the decision is adopted), so nothing waits for that copy.
* :class:`KubePeers`: the fleet's ready pods, from the EndpointSlices of the metrics
  Service (``dlrm-serve-metrics``: its selector names the serving pods only): ready
  addresses and pod names, never pod specs.

The RBAC these need is in ``k8s/rbac.yaml`` (the Lease get/update; the ConfigMap
``dlrm-serve-rollout`` get/update; endpointslices list; nothing on ``dlrm-serving-state``).
"""
from __future__ import annotations

import json
import logging
import os
import ssl
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from serve.errors import ConfigError, UpstreamUnavailable
from serve.sidecar.adapters.fleet_store import (
    KEEP_DECISIONS,
    Peer,
    RolloutDecision,
    decisions_of,
    with_decision,
)

__all__ = ["SA_DIR", "SERVICE_NAME_LABEL", "SETTLED_KEY", "ConfigMapDecisionStore", "KubeClient",
           "KubeLease", "KubePeers"]

_log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: Compare-and-set retries of a ConfigMap write that met a 409 (another pod wrote first).
_CAS_TRIES = 5
_DECISIONS_KEY = "decisions.json"
#: The key of the decisions ConfigMap the leader records the settled desired state under.
SETTLED_KEY = "settled-state.yaml"
#: The label the EndpointSlice controller puts on a Service's slices.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _micro(ts: float) -> str:
    """A Lease's MicroTime: ``2026-12-03T17:40:00.000000Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_micro(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


class KubeClient:
    """The API server, as the pod's service account.

    Args:
        base_url: ``https://<KUBERNETES_SERVICE_HOST>:<PORT>``.
        namespace: the pod's namespace.
        token: the bearer token now (re-read on each call: projected tokens rotate).
        verify: the CA bundle's path (read at the first call), or False (tests over
            plain http need none).
        timeout_s: per call (the reconcile pass waits for it).
    """

    def __init__(self, base_url: str, namespace: str, *, token: Callable[[], str | None],
                 verify: str | bool = True, timeout_s: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.namespace = namespace
        self.token = token
        self.verify = verify
        self.timeout_s = timeout_s
        self._http: httpx.Client | None = None

    def _client(self) -> httpx.Client:
        if self._http is None:
            verify: ssl.SSLContext | bool = (ssl.create_default_context(cafile=self.verify)
                                             if isinstance(self.verify, str) else self.verify)
            self._http = httpx.Client(verify=verify, timeout=self.timeout_s)
        return self._http

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] | None = None,
                   sa_dir: Path = SA_DIR) -> KubeClient:
        """From the service account's files and the API server's environment.

        Raises:
            ConfigError: not in a pod with a mounted service account token.
        """
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        token_file = sa_dir / "token"
        if not host or not port or not token_file.is_file():
            raise ConfigError(
                "--fleet kubernetes needs the API server (KUBERNETES_SERVICE_HOST/PORT) and "
                f"a service account token ({token_file}): run in a pod with "
                "serviceAccountName dlrm-serve and automountServiceAccountToken: true "
                "(k8s/rbac.yaml), or use --fleet none")
        namespace = (sa_dir / "namespace").read_text().strip()
        host = f"[{host}]" if ":" in host else host

        def token() -> str | None:
            return token_file.read_text().strip()

        return cls(f"https://{host}:{port}", namespace, token=token,
                   verify=str(sa_dir / "ca.crt"))

    def request(self, method: str, path: str, body: Any = None,
                params: Mapping[str, str] | None = None) -> httpx.Response:
        """One call; the response whatever its status.

        Raises:
            UpstreamUnavailable: the API server did not answer.
        """
        headers = {"Accept": "application/json"}
        token = self.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            return self._client().request(method, f"{self.base_url}{path}", json=body,
                                      params=params, headers=headers)
        except (httpx.HTTPError, OSError) as e:
            raise UpstreamUnavailable(f"the Kubernetes API server did not answer {method} "
                                      f"{path}: {e}") from None

    def ns_path(self, group: str, resource: str, name: str | None = None) -> str:
        """``/api/v1/namespaces/<ns>/<resource>[/<name>]`` (group ``""``) or
        ``/apis/<group>/namespaces/...``."""
        root = "/api/v1" if not group else f"/apis/{group}"
        path = f"{root}/namespaces/{quote(self.namespace)}/{resource}"
        return path if name is None else f"{path}/{quote(name)}"


def _fail(r: httpx.Response, what: str) -> UpstreamUnavailable:
    return UpstreamUnavailable(f"{what}: the API server answered {r.status_code} "
                               f"{r.text[:200]!r}; check k8s/rbac.yaml is applied")


class KubeLease:
    """A ``coordination.k8s.io/v1`` Lease (see the module docstring).

    Args:
        client: the API server.
        name: the Lease (``dlrm-serve-rollout``).
        duration_s: ``leaseDurationSeconds`` (rounded up to whole seconds).
        clock: unix seconds (the API server compares nothing: the pods' clocks do).
    """

    def __init__(self, client: KubeClient, name: str, duration_s: float = 15.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.name = name
        self.duration_s = max(1, int(-(-duration_s // 1)))
        self.clock = clock

    def _path(self) -> str:
        return self.client.ns_path("coordination.k8s.io/v1", "leases", self.name)

    def _live_holder(self, spec: Mapping[str, Any], now: float) -> str | None:
        holder = spec.get("holderIdentity")
        renewed = _parse_micro(spec.get("renewTime"))
        duration = spec.get("leaseDurationSeconds")
        if not holder or renewed is None or not isinstance(duration, int | float):
            return None
        return str(holder) if now - renewed < duration else None

    def holder(self) -> str | None:
        r = self.client.request("GET", self._path())
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise _fail(r, f"reading Lease {self.name}")
        return self._live_holder(r.json().get("spec") or {}, self.clock())

    def try_acquire(self, identity: str) -> bool:
        """Take or renew the Lease; False when another pod holds it or won the race.

        Raises:
            UpstreamUnavailable: the API server did not answer or refused, or the Lease
                does not exist (``k8s/rbac.yaml`` ships it: the pods may not create one).
        """
        now = self.clock()
        r = self.client.request("GET", self._path())
        if r.status_code == 404:
            raise UpstreamUnavailable(
                f"Lease {self.name} does not exist; apply k8s/rbac.yaml (it ships it: the "
                "pods may not create leases, RBAC cannot limit create to one name)")
        if r.status_code != 200:
            raise _fail(r, f"reading Lease {self.name}")
        lease = r.json()
        spec = dict(lease.get("spec") or {})
        live = self._live_holder(spec, now)
        if live is not None and live != identity:
            return False
        if spec.get("holderIdentity") != identity:
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            spec["acquireTime"] = _micro(now)
            _log.info("%s takes Lease %s (was %s)", identity, self.name,
                      spec.get("holderIdentity"))
        spec.update(holderIdentity=identity, leaseDurationSeconds=self.duration_s,
                    renewTime=_micro(now))
        lease["spec"] = spec  # metadata.resourceVersion kept: compare-and-set
        put = self.client.request("PUT", self._path(), lease)
        if put.status_code == 409:
            return False  # changed since read: another pod renewed or took it
        if put.status_code != 200:
            raise _fail(put, f"updating Lease {self.name}")
        return True


class ConfigMapDecisionStore:
    """Decisions in a ConfigMap key, compare-and-set by ``resourceVersion``.

    Args:
        client: the API server.
        name: the ConfigMap holding the decisions and the settled state
            (``dlrm-serve-rollout``; shipped in ``k8s/rbac.yaml`` so the pods need no
            ``create``). The only ConfigMap the pods write.
        keep: decisions kept.
    """

    def __init__(self, client: KubeClient, name: str, keep: int = KEEP_DECISIONS) -> None:
        self.client = client
        self.name = name
        self.keep = keep

    def _get(self, name: str) -> dict[str, Any]:
        r = self.client.request("GET", self.client.ns_path("", "configmaps", name))
        if r.status_code == 404:
            raise UpstreamUnavailable(f"ConfigMap {name} does not exist; apply "
                                      "k8s/rbac.yaml (it ships it)")
        if r.status_code != 200:
            raise _fail(r, f"reading ConfigMap {name}")
        data: dict[str, Any] = r.json()
        return data

    def read(self, key: str) -> RolloutDecision | None:
        cm = self._get(self.name)
        for d in self._decisions(cm):
            if d.key == key:
                return d
        return None

    @staticmethod
    def _decisions(cm: Mapping[str, Any]) -> list[RolloutDecision]:
        text = (cm.get("data") or {}).get(_DECISIONS_KEY)
        if not text:
            return []
        try:
            return decisions_of(json.loads(text))
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            _log.warning("%s of the rollout ConfigMap is not JSON; treating it as empty",
                         _DECISIONS_KEY)
            return []

    def _put(self, name: str, cm: dict[str, Any]) -> bool:
        """False on a 409 (changed since read)."""
        r = self.client.request("PUT", self.client.ns_path("", "configmaps", name), cm)
        if r.status_code == 409:
            return False
        if r.status_code != 200:
            raise _fail(r, f"updating ConfigMap {name}")
        return True

    def record(self, decision: RolloutDecision) -> RolloutDecision:
        for _ in range(_CAS_TRIES):
            cm = self._get(self.name)
            kept, holds = with_decision(self._decisions(cm), decision, self.keep)
            if holds is not decision:
                return holds  # first writer wins
            cm["data"] = {**(cm.get("data") or {}), _DECISIONS_KEY: json.dumps(
                {"decisions": [d.to_json() for d in kept]}, indent=1)}
            if self._put(self.name, cm):
                _log.info("recorded rollout decision %s: %s (%s)", decision.revision,
                          decision.phase, decision.decided_by)
                return decision
        raise UpstreamUnavailable(f"ConfigMap {self.name} changed under every one of "
                                  f"{_CAS_TRIES} tries to record decision "
                                  f"{decision.revision}; retrying next pass")

    def publish_state(self, text: str) -> bool:
        """Record ``text`` (the settled desired state's YAML) as :data:`SETTLED_KEY` of the
        decisions ConfigMap, the pods' own object (never ``dlrm-serving-state``, the
        operator's); True once written (False: it says so already)."""
        for _ in range(_CAS_TRIES):
            cm = self._get(self.name)
            if (cm.get("data") or {}).get(SETTLED_KEY) == text:
                return False
            cm["data"] = {**(cm.get("data") or {}), SETTLED_KEY: text}
            if self._put(self.name, cm):
                _log.info("recorded the settled desired state in ConfigMap %s (%s); copy it "
                          "into k8s/serving-state.yaml to make it the declared state",
                          self.name, SETTLED_KEY)
                return True
        raise UpstreamUnavailable(f"ConfigMap {self.name} changed under every one of "
                                  f"{_CAS_TRIES} tries to record the settled state")


class KubePeers:
    """The fleet's ready pods, from the EndpointSlices of a Service
    (``discovery.k8s.io/v1``, labelled :data:`SERVICE_NAME_LABEL`): each ready endpoint
    that is a Pod, by its address and pod name. No pod specs are read (``pods list``
    would return every pod's spec in the namespace, env literals included), and only the
    pods the Service selects are peers (``dlrm-serve-metrics`` selects
    ``app.kubernetes.io/name=dlrm-serve,app.kubernetes.io/component=inference``: not the
    model-upload pod).

    Args:
        client: the API server.
        service: the Service whose endpoints are the fleet (``dlrm-serve-metrics``).
        sidecar_port, inference_port: the ports every pod serves on.
    """

    def __init__(self, client: KubeClient, service: str, *, sidecar_port: int = 8090,
                 inference_port: int = 8080) -> None:
        self.client = client
        self.service = service
        self.sidecar_port = sidecar_port
        self.inference_port = inference_port

    def peers(self) -> list[Peer]:
        r = self.client.request("GET", self.client.ns_path("discovery.k8s.io/v1",
                                                           "endpointslices"),
                                params={"labelSelector": f"{SERVICE_NAME_LABEL}={self.service}"})
        if r.status_code != 200:
            raise _fail(r, f"listing the endpoints of Service {self.service}")
        out: dict[str, Peer] = {}
        for slice_ in r.json().get("items") or []:
            for ep in slice_.get("endpoints") or []:
                ref = ep.get("targetRef") or {}
                conditions = ep.get("conditions") or {}
                addresses = ep.get("addresses") or []
                # ready is "serving and not terminating"; unset means unknown: not a peer
                if (ref.get("kind") != "Pod" or not ref.get("name") or not addresses
                        or conditions.get("ready") is not True):
                    continue
                ip = str(addresses[0])
                host = f"[{ip}]" if ":" in ip else ip
                out.setdefault(ref["name"], Peer(
                    name=ref["name"], predict_url=f"http://{host}:{self.inference_port}",
                    sidecar_url=f"http://{host}:{self.sidecar_port}"))
        return [out[name] for name in sorted(out)]
