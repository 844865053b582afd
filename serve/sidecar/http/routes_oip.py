"""The Open Inference Protocol v2 (KServe v2) over HTTP, on the sidecar's ``--oip-port``.

TorchServe 0.12 does not route ``/v2/health/*`` or model metadata, so the sidecar serves
the protocol on a port of its own (:func:`serve.sidecar.http.app.create_oip_app`) and
forwards each infer to TorchServe's ``POST /predictions/{model}`` as our binary columnar
body: TorchServe batches it with our API's requests, a rollout splits it the same way,
and the workers' metrics count it. The protocol itself (tensors, the binary extension)
is :mod:`serve.api.oip`; errors answer ``{"error": "..."}``
(:func:`serve.sidecar.http.errors.register_oip_exception_handlers`).

* ``GET /v2``: server metadata.
* ``GET /v2/health/live``: the sidecar is alive (200).
* ``GET /v2/health/ready``, ``GET /v2/models/{model}/ready``: 200 when ``GET /readyz``
  would be (:func:`serve.sidecar.http.routes_health.readiness`), else 503 with the reason.
* ``GET /v2/models/{model}``: the served version's inputs (from its schema) and output.
* ``POST /v2/models/{model}/infer``: JSON tensors or the binary-tensor extension. The
  body is bounded (:data:`MAX_BODY_BYTES`, the handler's own limit) before it is read.
  ``X-DLRM-Route-Key`` goes to TorchServe; TorchServe's ``X-DLRM-*`` headers come back.

Not served: versioned paths (``/v2/models/{m}/versions/{v}/...``: the sidecar's
desired state picks the version), gRPC, and shared-memory extensions.
"""
from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from serve.api.config import HandlerConfig
from serve.api.oip import (
    HEADER_LENGTH,
    encode_infer_response,
    model_metadata,
    parse_header_length,
    parse_infer,
    to_predict_body,
)
from serve.api.request import BINARY_MEDIA_TYPE
from serve.errors import (
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    ServeError,
    UnsupportedMediaType,
    UpstreamUnavailable,
)
from serve.schema import ModelSchema
from serve.sidecar.http.routes_health import readiness
from serve.sidecar.root import Sidecar, SidecarDep
from serve.state import parse_serving_version
from serve.store.routing import ROUTE_KEY_HEADER

__all__ = ["MAX_BODY_BYTES", "router"]

router = APIRouter()

_LIMITS = HandlerConfig()
#: Largest infer body read (bytes): the handler's ``max_body_bytes`` (8 MiB, TorchServe's
#: ``max_request_size``). Checked on Content-Length before reading, and counted while
#: reading a chunked body; more -> 413.
MAX_BODY_BYTES = _LIMITS.max_body_bytes


@router.get("/v2", summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    return {"name": "dlrm-serve", "version": "0.1.0", "extensions": ["binary_tensor_data"]}


@router.get("/v2/health/live", summary="The server is alive")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/v2/health/ready", summary="The model can answer (as GET /readyz)",
            responses={503: {"description": "not ready, with the reason"}})
async def server_ready(sidecar: SidecarDep) -> JSONResponse:
    await readiness(sidecar)
    return JSONResponse({"ready": True})


@router.get("/v2/models/{model_name}/ready", summary="The model can answer",
            responses={404: {}, 503: {"description": "not ready, with the reason"}})
async def model_ready(model_name: str, sidecar: SidecarDep) -> JSONResponse:
    _check_model(model_name, sidecar)
    await readiness(sidecar)
    return JSONResponse({"name": model_name, "ready": True})


@router.get("/v2/models/{model_name}", summary="The served version's inputs and output",
            responses={404: {}, 503: {}})
async def metadata(model_name: str, sidecar: SidecarDep) -> JSONResponse:
    _check_model(model_name, sidecar)
    version, schema = await _served(sidecar)
    return JSONResponse(model_metadata(schema, name=model_name, versions=[version]))


@router.post("/v2/models/{model_name}/infer", summary="Predict (JSON or binary tensors)",
             responses={400: {}, 404: {}, 413: {}, 415: {}, 503: {}})
async def infer(model_name: str, request: Request, sidecar: SidecarDep) -> Response:
    _check_model(model_name, sidecar)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"header Content-Encoding: {encoding[:40]!r} is not "
                                   "supported; send the body uncompressed")
    body = await _read_body(request)
    _, schema = await _served(sidecar)
    header_length = parse_header_length(request.headers.get(HEADER_LENGTH), len(body))
    # Parsing up to 8 MiB of JSON takes tens of ms: off the event loop, which also runs
    # the reconciler and answers the probes.
    req = await run_in_threadpool(parse_infer, body, schema, _LIMITS,
                                  header_length=header_length)
    forward = {ROUTE_KEY_HEADER: request.headers[ROUTE_KEY_HEADER]} \
        if ROUTE_KEY_HEADER in request.headers else None
    r = await sidecar.torchserve.predict(to_predict_body(req, schema), BINARY_MEDIA_TYPE,
                                         forward)
    if r.status_code != 200:
        raise _upstream_error(r.status_code, r.content)
    try:
        answer = orjson.loads(r.content)
        probabilities = answer["predictions"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise UpstreamUnavailable(f"TorchServe answered 200 without predictions: "
                                  f"{r.content[:200]!r}") from None
    headers = {k: v for k, v in r.headers.items() if k.lower().startswith("x-dlrm-")}
    out, json_length = encode_infer_response(
        probabilities, model_name=model_name, model_version=headers.get("x-dlrm-model-version"),
        request_id=req.id, binary=req.binary_output)
    if json_length is not None:
        headers[HEADER_LENGTH] = str(json_length)
    return Response(out, headers=headers, media_type="application/octet-stream"
                    if json_length is not None else "application/json")


def _check_model(model_name: str, sidecar: Sidecar) -> None:
    served = sidecar.config.model_name
    if model_name != served:
        raise NotFound(f"model {model_name[:130]!r} is not served here; this server serves "
                       f"{served!r} (GET /v2/models/{served})")


async def _served(sidecar: Sidecar) -> tuple[str, ModelSchema | None]:
    """The served repository version and its schema (None: its build report has none,
    a build from before schemas: the built-in DLRM's). The desired state's version when
    the sidecar has one; else TorchServe's default version, asked now."""
    versions = sidecar.served_versions()
    if versions:
        version = versions[0]
    else:
        name = str((await sidecar.torchserve.describe()).get("modelVersion"))
        parsed = parse_serving_version(name)
        version = parsed[0] if parsed else name
    return version, sidecar.schemas.schema(version) if sidecar.schemas is not None else None


async def _read_body(request: Request) -> bytes:
    """The body, refused (413) past :data:`MAX_BODY_BYTES` before it is read when it
    announces its length, and as soon as the count passes it when chunked."""
    text = request.headers.get("content-length")
    if text is not None:
        text = text.strip()
        if not (text.isascii() and text.isdigit()):
            raise InvalidInput(f"header Content-Length: {text[:40]!r} is not a number of bytes")
        if int(text) > MAX_BODY_BYTES:
            raise _too_large(int(text))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large(len(body))
    return bytes(body)


def _too_large(size: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"body: {size} bytes is over the {MAX_BODY_BYTES}-byte limit; "
                           "send fewer instances per request (binary tensors are the "
                           "smallest form)")


def _upstream_error(status: int, content: bytes) -> ServeError:
    """TorchServe's answer to a forwarded predict as our error: its 400/413/415 (the
    handler's own checks, e.g. a limit of the served archive) keep their status and
    message; anything else is 503."""
    try:
        message = str(orjson.loads(content).get("message"))
    except (orjson.JSONDecodeError, AttributeError):
        message = content[:300].decode("utf-8", "replace")
    message = message or f"TorchServe's predictions API answered {status} with no message"
    for error in (InvalidInput, PayloadTooLarge, UnsupportedMediaType):
        if status == error.status:
            return error(message)
    return UpstreamUnavailable(f"TorchServe's predictions API answered {status}: {message}")
