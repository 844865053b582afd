"""Counting the sidecar's own requests with bounded labels.

``dlrm_sidecar_requests_total{route, method, code}``: ``route`` is the template of the
route the request was routed to (``/batching``) and ``method`` the request's method when
that route accepts it. Labels come only from routes the app declares: a path no route
matches (a scanner's ``GET /wp-login.php``) or a method the route does not take (``BREW
/healthz``, answered 405) is counted as ``other``, so no request can create a new series.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.responses import Response
from starlette.types import Scope

from serve.sidecar.root import get_sidecar

__all__ = ["ANSWERED", "OTHER", "count_requests", "request_labels"]

#: The label of every path or method the app does not declare.
OTHER = "other"
#: The ASGI scope key the edge guard (:mod:`serve.sidecar.http.edge`) sets once it has
#: answered a request itself: it counted that answer, so :func:`count_requests` does not
#: count what the route made of it (a dropped 400 after a body cut short).
ANSWERED = "dlrm.edge_answered"


def request_labels(scope: Scope) -> tuple[str, str]:
    """``(route, method)`` labels for the request in ``scope`` once it was routed.

    The router puts the matched route in ``scope["route"]``; its template and the methods
    it accepts are the only label values (plus :data:`OTHER`). A route matched by path
    but not by method may or may not be recorded there (that is up to the router); its
    method is :data:`OTHER` either way.
    """
    route = scope.get("route")
    path = getattr(route, "path", None)
    if not isinstance(path, str):
        return OTHER, OTHER
    methods = getattr(route, "methods", None) or ()
    method = scope.get("method", "")
    return path, method if method in methods else OTHER


async def count_requests(request: Request,
                         call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """HTTP middleware: count each request by route, method and status code.

    An exception that escapes the route is counted as a 500 (the catch-all handler
    answers it further out) and re-raised.
    """
    metrics = get_sidecar(request).metrics
    try:
        response = await call_next(request)
    except Exception:
        if not request.scope.get(ANSWERED):
            metrics.observe_request(*request_labels(request.scope), 500)
        raise
    if not request.scope.get(ANSWERED):
        metrics.observe_request(*request_labels(request.scope), response.status_code)
    return response
