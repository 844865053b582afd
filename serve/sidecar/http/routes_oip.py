"""The Open Inference Protocol v2 (KServe v2) over HTTP, in a process of its own.

TorchServe 0.12 does not route ``/v2/health/*`` or model metadata, so the protocol has a
port and a process of its own (:mod:`serve.sidecar.http.oip_server`, holding no token and
none of the sidecar's memory or CPU), which forwards each infer to TorchServe's ``POST
/predictions/{model}`` as our binary columnar body: TorchServe batches it with our API's
requests, a rollout splits it the same way, and the workers' metrics count it. The
protocol itself (tensors, the binary extension) is :mod:`serve.api.oip`; errors answer
``{"error": "..."}`` (:func:`serve.sidecar.http.errors.register_oip_exception_handlers`).

* ``GET /v2``: server metadata.
* ``GET /v2/health/live``: the process is alive (200).
* ``GET /v2/health/ready``, ``GET /v2/models/{model}/ready``: 200 when the sidecar's
  ``GET /readyz`` is, else 503 with its reason; one ``/readyz`` call per second at most
  (:class:`~serve.sidecar.http.oip_guard.ReadyCache`).
* ``GET /v2/models/{model}``: the served version's inputs (from its schema) and output.
* ``POST /v2/models/{model}/infer``: JSON tensors or the binary-tensor extension,
  bounded before and while it is read (:mod:`serve.sidecar.http.oip_guard`): infers at
  once and bytes in flight (429 at once past them), the body's size (:data:`MAX_BODY_BYTES`,
  413 on its announced length) and its arrival (408 past the deadline), parses at once
  (429 when no slot frees in time). ``X-DLRM-Route-Key`` goes to TorchServe;
  TorchServe's ``X-DLRM-*`` headers come back.

Not served: versioned paths (``/v2/models/{m}/versions/{v}/...``: the sidecar's
desired state picks the version), gRPC, and shared-memory extensions.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

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
from serve.sidecar.http.oip_guard import read_body
from serve.sidecar.http.oip_state import OipDep, OipState
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
async def server_ready(oip: OipDep) -> JSONResponse:
    await oip.readiness()
    return JSONResponse({"ready": True})


@router.get("/v2/models/{model_name}/ready", summary="The model can answer",
            responses={404: {}, 503: {"description": "not ready, with the reason"}})
async def model_ready(model_name: str, oip: OipDep) -> JSONResponse:
    _check_model(model_name, oip)
    await oip.readiness()
    return JSONResponse({"name": model_name, "ready": True})


@router.get("/v2/models/{model_name}", summary="The served version's inputs and output",
            responses={404: {}, 503: {}})
async def metadata(model_name: str, oip: OipDep) -> JSONResponse:
    _check_model(model_name, oip)
    version, schema = await oip.served()
    return JSONResponse(model_metadata(schema, name=model_name, versions=[version]))


@router.post("/v2/models/{model_name}/infer", summary="Predict (JSON or binary tensors)",
             responses={400: {}, 404: {}, 408: {}, 413: {}, 415: {}, 429: {}, 503: {}})
async def infer(model_name: str, request: Request, oip: OipDep) -> Response:
    _check_model(model_name, oip)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"header Content-Encoding: {encoding[:40]!r} is not "
                                   "supported; send the body uncompressed")
    with oip.requests.hold(1):
        return await _infer(model_name, request, oip)


async def _infer(model_name: str, request: Request, oip: OipState) -> Response:
    """One admitted infer: its body held in the bytes budget until it is parsed (a
    parse holds the GIL: in a worker thread, one slot of :attr:`OipState.parses`)."""
    with oip.inflight.hold() as held:
        body = await read_body(request.stream(), request.headers.get("content-length"),
                               held=held, max_bytes=MAX_BODY_BYTES,
                               deadline_s=oip.options.body_deadline_s)
        _, schema = await oip.served()
        header_length = parse_header_length(request.headers.get(HEADER_LENGTH), len(body))
        req = await oip.parses.run(partial(parse_infer, body, schema, _LIMITS,
                                           header_length=header_length))
        del body
    forward = {ROUTE_KEY_HEADER: request.headers[ROUTE_KEY_HEADER]} \
        if ROUTE_KEY_HEADER in request.headers else None
    r = await oip.torchserve.predict(to_predict_body(req, schema), BINARY_MEDIA_TYPE, forward)
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


def _check_model(model_name: str, oip: OipState) -> None:
    served = oip.options.model_name
    if model_name != served:
        raise NotFound(f"model {model_name[:130]!r} is not served here; this server serves "
                       f"{served!r} (GET /v2/models/{served})")


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
