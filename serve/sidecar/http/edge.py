"""The sidecar's edge: every write authenticated, scoped and size-bounded before a byte
of its body is read.

FastAPI reads and parses a route's declared body before the route's dependencies run, so
a token check written as a dependency comes too late: an unauthenticated ``PUT /state``
announcing 600 MB was read into the event loop (the sidecar's RSS went 74 -> 469 MB, an
OOM kill in a 512Mi container) and got no answer in 20 s. :class:`EdgeGuard` is a pure
ASGI layer around the routes that decides on the request line and headers alone:

1. a write (any method but GET/HEAD/OPTIONS) on the public port: 403 naming the write
   port (``--write-port``); reads are served on both ports;
2. a write route (:data:`WRITE_ROUTES`): the bearer token and its scope
   (:func:`serve.sidecar.http.auth.authorize`): 401 without one, 403 for a wrong one, one
   of another scope, or when no token that may do it is configured;
3. ``Content-Length`` over the route's limit: 413 naming the limit. Without one (a
   chunked body), the bytes are counted as the route reads them, and the guard answers
   413 as soon as they pass the limit; nothing is buffered here. Any other request's body
   is bounded by :data:`SMALL_BODY_BYTES` the same way.

Its answers have the sidecar's JSON shape (:func:`serve.sidecar.http.errors.error_response`)
and ``Connection: close``: the body was not read, so the connection cannot carry another
request (uvicorn closes it). They are counted in ``dlrm_sidecar_requests_total`` under
the route's labels (the routes never see them).

:func:`create_app` refuses to build an app with a write route this table lacks
(:func:`check_write_routes`), so a new write cannot skip the guard.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import Forbidden, InvalidInput, PayloadTooLarge, ServeError
from serve.settings import DLRM_SIDECAR_WRITE_PORT
from serve.sidecar.http import auth
from serve.sidecar.http.errors import error_response
from serve.sidecar.http.middleware import ANSWERED, OTHER
from serve.sidecar.http.schemas import FEEDBACK_MAX_LABELS
from serve.sidecar.root import Sidecar
from serve.state import STATE_MAX_BYTES
from serve.store.deltas.format import MAX_DELTA_BYTES

__all__ = [
    "ANSWERED",
    "READ_METHODS",
    "SMALL_BODY_BYTES",
    "WRITE_ROUTES",
    "EdgeGuard",
    "WriteRoute",
    "check_write_routes",
    "delta_body_limit",
]

#: The body limit of the small writes (PUT /state, /batching, /tuner, POST /drain...) and
#: of any request not in :data:`WRITE_ROUTES`: the desired state's own bound
#: (:data:`serve.state.STATE_MAX_BYTES`, what a state file may hold), the largest of them.
SMALL_BODY_BYTES = STATE_MAX_BYTES
#: Methods that never write; the public port serves them.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def delta_body_limit(sidecar: Sidecar) -> int:
    """POST /embeddings/deltas' limit: the delta service's own
    (:attr:`~serve.sidecar.services.deltas.intake.DeltaIntake.max_bytes`,
    ``--max-delta-bytes``), read at each request, never copied; without a delta folder
    (deltas off: the route answers 409) the format's default."""
    deltas = sidecar.deltas
    return deltas.intake.max_bytes if deltas is not None else MAX_DELTA_BYTES


def _small(_: Sidecar) -> int:
    return SMALL_BODY_BYTES


def _feedback(sidecar: Sidecar) -> int:
    """POST /feedback's limit: the feedback service's own
    (:attr:`~serve.sidecar.config.FeedbackConfig.max_body_bytes`,
    ``--feedback-max-body-bytes``), which the route also enforces while it streams."""
    return sidecar.feedback.config.max_body_bytes


@dataclass(frozen=True)
class WriteRoute:
    """One write route: who may call it and how large its body may be.

    Attributes:
        method, path: as the route declares them (the path is the template, no parameters).
        scopes: the token scopes that may call it (:mod:`serve.sidecar.http.auth`).
        limit: its body limit in bytes, read per request from the sidecar.
        then: what to do about a body over it (the 413's last words).
    """

    method: str
    path: str
    scopes: frozenset[str]
    limit: Callable[[Sidecar], int]
    then: str

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


_OPERATOR = frozenset({auth.OPERATOR})
_SMALL_THEN = "send one desired state or setting, not more"
#: Every write the sidecar serves. Each is the operator's; deltas and feedback also
#: their producers'.
WRITE_ROUTES: tuple[WriteRoute, ...] = (
    WriteRoute("PUT", "/state", _OPERATOR, _small, _SMALL_THEN),
    WriteRoute("PUT", "/batching", _OPERATOR, _small, _SMALL_THEN),
    WriteRoute("PUT", "/tuner", _OPERATOR, _small, _SMALL_THEN),
    WriteRoute("POST", "/drain", _OPERATOR, _small, "send no body"),
    WriteRoute("POST", "/state/rollout/promote", _OPERATOR, _small, "send no body"),
    WriteRoute("POST", "/state/rollout/rollback", _OPERATOR, _small, "send no body"),
    WriteRoute("POST", "/feedback", frozenset({auth.OPERATOR, auth.FEEDBACK}), _feedback,
               f"split the labels over several POSTs (at most {FEEDBACK_MAX_LABELS} "
               f"labels each), or raise --feedback-max-body-bytes"),
    WriteRoute("POST", "/embeddings/deltas", frozenset({auth.OPERATOR, auth.DELTAS}),
               delta_body_limit, "split the rows into several deltas (consecutive "
                                 "sequence numbers)"),
)


def check_write_routes(routes: Iterable[BaseRoute],
                       table: Iterable[WriteRoute] = WRITE_ROUTES) -> None:
    """RuntimeError naming each route of ``routes`` that takes a write method but is not
    in ``table`` (it would be served without a token), or each entry of ``table`` that
    no route serves (a stale entry)."""
    declared = {(w.method, w.path) for w in table}
    served = {(m, str(getattr(r, "path", ""))) for r in routes
              for m in (getattr(r, "methods", None) or ()) if m not in READ_METHODS}
    if served != declared:
        raise RuntimeError(
            f"the edge guard's WRITE_ROUTES (serve/sidecar/http/edge.py) do not match the "
            f"app's write routes: not in the table {sorted(served - declared)}, served by "
            f"no route {sorted(declared - served)}; add or remove the entries")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _content_length(scope: Scope) -> int | None:
    text = _header(scope, b"content-length")
    if text is None:
        return None
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise InvalidInput(f"Content-Length {text[:40]!r} is not a number of bytes; send the "
                           f"body's length in bytes, or a chunked body without it")
    return int(text)


def _too_large(what: str, size: int, limit: int, then: str, *, streamed: bool) -> PayloadTooLarge:
    seen = "read so far, not all of it" if streamed else "its Content-Length"
    return PayloadTooLarge(f"{what}: body: {size} bytes is over the {limit}-byte limit "
                           f"({seen}); {then}")


class EdgeGuard:
    """ASGI middleware: see the module docstring.

    Args:
        app: the application it guards.
        sidecar: the sidecar's parts (its config's tokens, its metrics, the delta limit).
        write_port: the port writes are served on; a write that arrives on another local
            port (``scope["server"]``) answers 403. None: every port takes writes (one
            listener, as in tests through ASGI).
        routes: the write routes (default :data:`WRITE_ROUTES`).
    """

    def __init__(self, app: ASGIApp, *, sidecar: Sidecar, write_port: int | None = None,
                 routes: Iterable[WriteRoute] = WRITE_ROUTES) -> None:
        self.app = app
        self.sidecar = sidecar
        self.write_port = write_port
        self.routes = {(r.method, r.path): r for r in routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = str(scope["method"]), str(scope["path"])
        route = self.routes.get((method, path))
        try:
            limit = self._admit(scope, method, path, route)
        except ServeError as e:
            await self._answer(scope, send, e, route)
            return
        what = route.what if route is not None else f"{method} {path[:200]}"
        then = route.then if route is not None else "send a smaller body"
        body = _BoundedBody(receive, send, limit, lambda size: self._answer(
            scope, send, _too_large(what, size, limit, then, streamed=True), route))
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if not body.rejected:
                raise
            # The guard answered 413 and told the route the client left; what the route
            # made of that (a 400, a ClientDisconnect) was dropped, and is not an error.

    def _admit(self, scope: Scope, method: str, path: str, route: WriteRoute | None) -> int:
        """The body limit of a request allowed through; raises the guard's answer."""
        what = route.what if route is not None else f"{method} {path[:200]}"
        if method not in READ_METHODS and not self._on_write_port(scope):
            raise Forbidden(
                f"{what}: this is the sidecar's public port, which serves metrics, probes "
                f"and reads only; send writes to its write port {self.write_port} "
                f"(--write-port, {DLRM_SIDECAR_WRITE_PORT})")
        if route is not None:
            scope[auth.AUTHORIZED] = auth.authorize(
                what, route.scopes, _header(scope, b"authorization"),
                auth.tokens_of(self.sidecar.config))
        limit = route.limit(self.sidecar) if route is not None else SMALL_BODY_BYTES
        then = route.then if route is not None else "send a smaller body"
        length = _content_length(scope)
        if length is not None and length > limit:
            raise _too_large(what, length, limit, then, streamed=False)
        return limit

    def _on_write_port(self, scope: Scope) -> bool:
        if self.write_port is None:
            return True
        server = scope.get("server")
        return server is not None and server[1] == self.write_port

    async def _answer(self, scope: Scope, send: Send, error: ServeError,
                      route: WriteRoute | None) -> None:
        """Send ``error`` (closing the connection) and count it under the route's labels."""
        scope[ANSWERED] = True
        response = error_response(error, {"Connection": "close"})
        await response(scope, _no_body, send)
        labels = (route.path, route.method) if route is not None else (OTHER, OTHER)
        self.sidecar.metrics.observe_request(*labels, error.status)


async def _no_body() -> Message:
    """A ``receive`` for the guard's own answers: they read nothing."""
    return {"type": "http.disconnect"}


class _BoundedBody:
    """``receive``/``send`` of one request whose body may not pass ``limit`` bytes.

    Counts the body as the application reads it. Past the limit, ``on_over(size)`` answers
    (once, if the application has not started its response) and the application is told
    the client disconnected; whatever it sends after that is dropped.
    """

    def __init__(self, receive: Receive, send: Send, limit: int,
                 on_over: Callable[[int], Awaitable[None]]) -> None:
        self._receive, self._send = receive, send
        self.limit = limit
        self.on_over = on_over
        self.size = 0
        self.started = False
        self.rejected = False

    async def receive(self) -> Message:
        if self.rejected:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limit:
                self.rejected = True
                if not self.started:
                    await self.on_over(self.size)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.rejected:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)
