"""The sidecar's one error mapping: every error answers ``{"code", "type", "message"}``.

* :class:`~serve.errors.ServeError` -> its own status and ``to_json()`` (401 also sends
  ``WWW-Authenticate: Bearer``).
* Request validation -> 400 ``InvalidInput`` naming the request, each bad field and the
  rules.
* Starlette's HTTP errors (404, 405...) -> their status, type ``HTTPError``.
* Anything else -> 500 ``InternalError``. Starlette answers it from its outermost
  middleware and then re-raises, so the server (uvicorn) logs the traceback once.

The Open Inference Protocol's port (:mod:`serve.sidecar.http.routes_oip`) answers the same
errors with the same statuses in OIP's shape, ``{"error": "<message>"}``
(:func:`register_oip_exception_handlers`): a KServe v2 client reads only that.
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.errors import InvalidInput, ServeError, Unauthorized, describe_field_errors
from serve.sidecar.config import BATCH_SIZE_MAX, MAX_BATCH_DELAY_MS_MAX, WORKERS_MAX

__all__ = ["error_response", "internal_error", "oip_error_response",
           "register_exception_handlers", "register_oip_exception_handlers"]

_RULES = (f"batch_size: integer 1..{BATCH_SIZE_MAX}, max_batch_delay_ms: integer "
          f"0..{MAX_BATCH_DELAY_MS_MAX}, workers: integer 1..{WORKERS_MAX}")


def register_exception_handlers(app: FastAPI) -> None:
    """Map every error to one JSON shape, ``{"code", "type", "message"}``, once."""

    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        return error_response(exc)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc, f"{request.method} {request.url.path}")
        return JSONResponse(err.to_json(), status_code=InvalidInput.status)

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = {"code": exc.status_code, "type": "HTTPError", "message": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(ServeError, serve_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    # Exception (not 500): Starlette gives this one to ServerErrorMiddleware, the only
    # place that sees errors no other handler took. It logs nothing: the re-raise does.
    app.add_exception_handler(Exception, internal_error)


def error_response(exc: ServeError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The answer to ``exc``: its status and ``to_json()``; 401 adds ``WWW-Authenticate:
    Bearer``. The exception handlers and the edge guard both answer through it."""
    extra = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else {}
    return JSONResponse(exc.to_json(), status_code=exc.status,
                        headers={**extra, **(headers or {})} or None)


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """500 ``InternalError`` for an exception no other handler maps (a bug)."""
    message = (f"{request.method} {request.url.path} failed with an unexpected "
               f"{type(exc).__name__}: {str(exc)[:300]}; the sidecar's log has the "
               f"traceback: report it")
    # The base ServeError is the 500 "InternalError" of serve.errors.
    return JSONResponse(ServeError(message).to_json(), status_code=ServeError.status)


def _validation_error(exc: RequestValidationError, what: str) -> InvalidInput:
    parts = []
    for e in exc.errors():
        # Two errors are about the body as a whole, not a field: worded here; the field
        # errors are worded by the formatter the desired-state schema uses too.
        if e.get("type") == "json_invalid":
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            parts.append(f"body: the body is not valid JSON "
                         f"({(e.get('ctx') or {}).get('error', 'invalid')} at character "
                         f"{loc[0] if loc else '?'})")
        elif e.get("type") in ("model_attributes_type", "dict_type"):
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: the body must be a JSON object sent with Content-Type: "
                         f"application/json (got {e.get('input')!r})")
        else:
            parts += describe_field_errors([e])
    rules = f". Allowed fields: {_RULES}" if what.endswith("/batching") else ""
    return InvalidInput(f"invalid {what} body: " + "; ".join(parts) + rules)


def register_oip_exception_handlers(app: FastAPI) -> None:
    """The Open Inference Protocol app's mapping: every error answers
    ``{"error": "<message>"}`` with the status :func:`register_exception_handlers` gives it."""

    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        return oip_error_response(exc)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc, f"{request.method} {request.url.path}")
        return oip_error_response(err)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
        if exc.status_code == 404:
            message += ("; the Open Inference Protocol paths here are /v2, /v2/health/live, "
                        "/v2/health/ready, /v2/models/{model}, /v2/models/{model}/ready and "
                        "POST /v2/models/{model}/infer")
        return JSONResponse({"error": message}, status_code=exc.status_code,
                            headers=exc.headers)

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        body = (await internal_error(request, exc)).body
        return JSONResponse({"error": json.loads(bytes(body))["message"]},
                            status_code=ServeError.status)

    app.add_exception_handler(ServeError, serve_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal)


def oip_error_response(exc: ServeError) -> JSONResponse:
    """``exc`` in OIP's shape: its status, ``{"error": message}``. A 408, 413 or 429
    closes the connection (its body was not read, or not all of it)."""
    headers = {"Connection": "close"} if exc.status in (408, 413, 429) else None
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)
