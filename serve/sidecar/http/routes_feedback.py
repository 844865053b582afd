"""``POST /feedback`` (bearer token): click labels for earlier predictions; ``GET
/feedback``: the join's state, the online CTR/calibration/AUC per version and arm beside
each version's build-time baseline.

Labels are joined with the pod's prediction log (:mod:`serve.sidecar.services.feedback`). A label
for an id this pod never logged, or whose log was rotated away, is counted, not refused
(feedback comes late, and from outside); a body that breaks the schema is a 400 naming
the field and the rule.

The body's size is the edge guard's to bound (:mod:`serve.sidecar.http.edge`, outermost in
the app): it answers 413 from the Content-Length, or as soon as the bytes received pass
``FeedbackConfig.max_body_bytes`` (``--feedback-max-body-bytes``), so the route never holds
more than that. The labels are then validated straight from those bytes (pydantic's JSON
parser, no intermediate Python objects), at most ``FEEDBACK_MAX_LABELS`` of them.
"""
from __future__ import annotations

import asyncio
import email.message
import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from serve.sidecar.http.auth import require_token
from serve.sidecar.http.schemas import FeedbackAnswer, FeedbackBody
from serve.sidecar.root import SidecarDep

__all__ = ["router"]

router = APIRouter()


def _is_json(content_type: str | None) -> bool:
    """As FastAPI decides for a JSON body (strict: no Content-Type is not JSON)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


def _parse(body: bytearray, content_type: str | None) -> FeedbackBody:
    """The labels of ``body``; raises RequestValidationError worded as FastAPI's own (the
    sidecar's handler turns it into the 400 naming the field)."""
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    if not _is_json(content_type):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",),
                                       "msg": "Input should be a valid dictionary",
                                       "input": bytes(body[:64])}])
    try:
        return FeedbackBody.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if any(err["type"] == "json_invalid" for err in errors):
            raise _json_invalid(body, errors[0]) from None
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in errors]) from None


def _json_invalid(body: bytearray, err: Any) -> RequestValidationError:
    """Not JSON: worded and located as FastAPI does (its decoder, on this error path only)."""
    try:
        json.loads(body)
    except json.JSONDecodeError as e:
        return RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                        "msg": "JSON decode error", "input": {},
                                        "ctx": {"error": e.msg}}])
    except RecursionError:  # nested deeper than the stdlib parser recurses: pydantic's error
        pass
    return RequestValidationError([{**err, "loc": ("body",)}])


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` references replaced by the definitions (OpenAPI
    has no ``$defs`` of its own for a request body given by hand)."""
    defs = schema.pop("$defs", {})

    def sub(x: Any) -> Any:
        if isinstance(x, dict):
            ref = x.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return sub(defs[ref.rsplit("/", 1)[1]])
            return {k: sub(v) for k, v in x.items()}
        if isinstance(x, list):
            return [sub(v) for v in x]
        return x

    return sub(schema)  # type: ignore[no-any-return]


@router.post("/feedback", response_model=FeedbackAnswer, dependencies=[Depends(require_token)],
             summary="Click labels for earlier predictions (joined with the prediction log)",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": _inlined(FeedbackBody.model_json_schema())}}}},
             responses={400: {"description": "a label breaks the schema"}, 401: {}, 403: {},
                        413: {"description": "the body is over --feedback-max-body-bytes"}})
async def post_feedback(request: Request, sidecar: SidecarDep) -> FeedbackAnswer:
    raw = bytearray(await request.body())  # bounded by the edge guard
    body = _parse(raw, request.headers.get("content-type"))
    del raw
    triples = [(x.request_id, x.index, x.label) for x in body.labels]
    del body
    result = await asyncio.to_thread(sidecar.feedback.post, triples)
    return FeedbackAnswer(**result.to_json())


@router.get("/feedback", summary="Online CTR, calibration and AUC per version and arm, with "
                                 "each version's build-time baseline")
async def get_feedback(sidecar: SidecarDep) -> dict:
    return await asyncio.to_thread(sidecar.feedback.status)
