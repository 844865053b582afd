"""A fake Kubernetes API server: exactly the endpoints serve/sidecar/adapters/kubernetes.py
uses, with the API server's compare-and-set (a PUT whose metadata.resourceVersion is not
the stored one answers 409; a POST of an existing name answers 409).

    GET/PUT  /apis/coordination.k8s.io/v1/namespaces/<ns>/leases/<name>; POST .../leases
    GET/PUT  /api/v1/namespaces/<ns>/configmaps/<name>;               POST .../configmaps
    GET      /api/v1/namespaces/<ns>/{pods,services}?labelSelector=k=v[,k=v]
    GET      /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=...

EndpointSlices are derived as the EndpointSlice controller does: one per stored Service
with a selector, labelled ``kubernetes.io/service-name`` (plus the Service's labels), an
endpoint per stored Pod the selector matches that has an IP, ``ready`` when its Ready
condition is True and it is not being deleted.

``role``: a Role's rules (e.g. k8s/rbac.yaml's); when given, a call no rule allows answers
403, as the API server's RBAC would (verbs: GET by name ``get``, GET of a collection
``list``, PUT ``update``, POST ``create``; ``resourceNames`` never allow list or create).

A threaded http.server on 127.0.0.1 and a free port; every call needs the bearer token.
"""
from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, urlparse

__all__ = ["FakeKubeApi"]

_KINDS = {("coordination.k8s.io/v1", "leases"), ("v1", "configmaps"), ("v1", "pods"),
          ("v1", "services"), ("discovery.k8s.io/v1", "endpointslices")}
_VERBS = {"PUT": "update", "POST": "create", "PATCH": "patch", "DELETE": "delete"}


def _labels_match(labels: dict[str, str] | None, selector: dict[str, str]) -> bool:
    return all((labels or {}).get(k) == v for k, v in selector.items())


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (not (pod.get("metadata") or {}).get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []))


class FakeKubeApi:
    """Start with ``with FakeKubeApi(token) as api:``; ``api.url``, ``api.objects``."""

    def __init__(self, token: str = "fake-token", namespace: str = "serve",
                 role: list[dict[str, Any]] | None = None) -> None:
        self.token = token
        self.namespace = namespace
        self.role = role
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}  # (resource, name) -> obj
        self.calls: list[tuple[str, str, int]] = []
        self._version = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def put_object(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` as the test's setup (a new resourceVersion)."""
        with self._lock:
            return self._store(resource, copy.deepcopy(obj))

    def _store(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._version)
        obj["metadata"].setdefault("namespace", self.namespace)
        self.objects[(resource, obj["metadata"]["name"])] = obj
        return obj

    def _route(self, method: str, path: str, query: dict[str, list[str]],
               body: Any) -> tuple[int, Any]:
        parts = path.strip("/").split("/")
        # api/v1/namespaces/ns/res[/name] or apis/group/v1/namespaces/ns/res[/name]
        if parts[:2] == ["api", "v1"]:
            group, rest = "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) > 3:
            group, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            return 404, {"reason": "NotFound"}
        if len(rest) < 3 or rest[0] != "namespaces" or rest[1] != self.namespace:
            return 404, {"reason": "NotFound"}
        resource, name = rest[2], rest[3] if len(rest) > 3 else None
        if (group, resource) not in _KINDS:
            return 404, {"reason": "NotFound"}
        verb = ("list" if name is None else "get") if method == "GET" else _VERBS.get(method)
        if not self.allows(group.rpartition("/")[0], resource, name, verb or method):
            return 403, {"reason": "Forbidden", "message": f"{verb} {resource}/{name}"}
        with self._lock:
            if name is None and method == "GET":
                selector = dict(kv.split("=", 1) for kv in
                                (query.get("labelSelector", [""])[0] or "").split(",") if kv)
                pool = (self._endpointslices() if resource == "endpointslices" else
                        [o for (r, _), o in self.objects.items() if r == resource])
                items = [o for o in pool
                         if _labels_match(o.get("metadata", {}).get("labels"), selector)]
                return 200, {"kind": "List", "items": copy.deepcopy(items)}
            if name is None and method == "POST":
                new = body["metadata"]["name"]
                if (resource, new) in self.objects:
                    return 409, {"reason": "AlreadyExists"}
                return 201, copy.deepcopy(self._store(resource, body))
            current = self.objects.get((resource, name or ""))
            if method == "GET":
                return (404, {"reason": "NotFound"}) if current is None else (
                    200, copy.deepcopy(current))
            if method == "PUT":
                if current is None:
                    return 404, {"reason": "NotFound"}
                if (body.get("metadata") or {}).get("resourceVersion") != \
                        current["metadata"]["resourceVersion"]:
                    return 409, {"reason": "Conflict"}
                return 200, copy.deepcopy(self._store(resource, body))
        return 405, {"reason": "MethodNotAllowed"}

    def allows(self, group: str, resource: str, name: str | None, verb: str) -> bool:
        """Whether :attr:`role` lets ``verb`` on ``resource``/``name`` (True without one)."""
        if self.role is None:
            return True
        for rule in self.role:
            names = rule.get("resourceNames") or []
            if (group in rule["apiGroups"] and resource in rule["resources"]
                    and verb in rule["verbs"]
                    and (not names or (name is not None and name in names))):
                return True
        return False

    def _endpointslices(self) -> list[dict[str, Any]]:
        """What the EndpointSlice controller would hold now (the module docstring)."""
        out = []
        for (r, svc_name), svc in self.objects.items():
            selector = (svc.get("spec") or {}).get("selector")
            if r != "services" or not selector:
                continue
            endpoints = [
                {"addresses": [pod["status"]["podIP"]],
                 "conditions": {"ready": _ready(pod), "serving": _ready(pod),
                                "terminating": bool(pod["metadata"].get("deletionTimestamp"))},
                 "targetRef": {"kind": "Pod", "name": pod["metadata"]["name"],
                               "namespace": self.namespace}}
                for (k, _), pod in sorted(self.objects.items())
                if k == "pods" and (pod.get("status") or {}).get("podIP")
                and _labels_match(pod["metadata"].get("labels"), selector)]
            labels = {**(svc["metadata"].get("labels") or {}),
                      "kubernetes.io/service-name": svc_name}
            out.append({"metadata": {"name": f"{svc_name}-abcde", "labels": labels,
                                     "namespace": self.namespace},
                        "addressType": "IPv4", "endpoints": endpoints,
                        "ports": [{"name": p.get("name"), "port": p.get("port"),
                                   "protocol": "TCP"} for p in svc["spec"].get("ports", [])]})
        return out

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                url = urlparse(self.path)
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                if self.headers.get("Authorization") != f"Bearer {api.token}":
                    status, out = 401, {"reason": "Unauthorized"}
                else:
                    status, out = api._route(self.command, url.path, parse_qs(url.query), body)
                api.calls.append((self.command, url.path, status))
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = _answer

        return Handler
