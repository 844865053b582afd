"""One request body of any form -> :class:`~serve.api.request.ParsedRequest`.

The request's Content-Type picks the decoder (:func:`~serve.api.request.check_content_type`):
JSON (:mod:`serve.api.json_body`) or binary columnar (:mod:`serve.api.binary`).
:func:`parse_body` decodes a body whose media type is known; :func:`decode_request` one
request of a TorchServe batch (body, Content-Type, route key), as the worker does.
"""
from __future__ import annotations

from typing import Any

import orjson

from serve.api.binary import parse_binary
from serve.api.config import HandlerConfig
from serve.api.context_body import is_context_doc, parse_context_doc
from serve.api.json_body import gc_paused, load_json, parse_doc_fast
from serve.api.request import (
    BINARY_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    ParsedRequest,
    check_content_type,
    check_route_key,
)
from serve.api.spec import Spec, check_size, spec_of
from serve.errors import InvalidInput
from serve.schema import ModelSchema

__all__ = ["decode_request", "parse_body", "parse_json"]


def parse_body(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
               media_type: str = JSON_MEDIA_TYPE, *,
               schema: ModelSchema | None = None) -> ParsedRequest:
    """Decode and validate one request body (any form) against the model's schema.

    Args:
        body: the raw body. JSON may also come as str; binary must be bytes-like.
        media_type: what :func:`check_content_type` returned for the request.
        schema: the served model's schema: its F feature names (and order), N dense
            features and max ids per feature; None: :data:`DEFAULT_SCHEMA`.
    Returns:
        ParsedRequest: dense float32 (B, N), lengths int32 (F, B), values int64 (nnz,)
        feature-major in ``schema.feature_names`` order.
    Raises:
        PayloadTooLarge: body over ``cfg.max_body_bytes`` or more than ``cfg.max_instances``.
        InvalidInput: anything else wrong, with the field path in the message.
        ValueError: ``media_type`` is neither JSON_MEDIA_TYPE nor BINARY_MEDIA_TYPE.
        TypeError: ``schema`` is not a ModelSchema.
    """
    return _parse_any(body, cfg, media_type, spec_of(schema))


def _parse_any(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
               media_type: str, spec: Spec) -> ParsedRequest:
    """:func:`parse_body` with the schema's helpers resolved."""
    if media_type == BINARY_MEDIA_TYPE:
        if isinstance(body, str):
            raise InvalidInput("binary body: arrived as text; send the raw bytes from "
                               "encode_binary")
        check_size(memoryview(body).nbytes, cfg)
        return parse_binary(body, cfg, spec)
    if media_type != JSON_MEDIA_TYPE:
        raise ValueError(f"media_type {media_type!r} must be {JSON_MEDIA_TYPE!r} or "
                         f"{BINARY_MEDIA_TYPE!r}")
    with gc_paused():
        return parse_json(body, cfg, spec)


def parse_json(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
               spec: Spec) -> ParsedRequest:
    """One JSON body of any form: the ranking form (:mod:`serve.api.context_body`) when it
    has ``candidates``, else rows or columnar (:func:`serve.api.json_body.parse_json_body`)."""
    doc = load_json(body, cfg)
    if is_context_doc(doc):
        return parse_context_doc(doc, cfg, spec)
    return parse_doc_fast(doc, cfg, spec)


def decode_request(body: Any, ctype: str | None, key: str | None, cfg: HandlerConfig,
                   spec: Spec) -> ParsedRequest:
    """One request of a batch -> ParsedRequest: its route key checked, its Content-Type
    picking the form (a body TorchServe already decoded from JSON is re-encoded and
    checked by the same rules), ``spec`` from :func:`serve.api.spec.spec_of`.

    Raises:
        ServeError: a bad request (its 4xx: InvalidInput, PayloadTooLarge,
            UnsupportedMediaType), with the message it answers.
    """
    check_route_key(key)
    media = check_content_type(ctype)
    if media == BINARY_MEDIA_TYPE:
        if not isinstance(body, (str, bytes, bytearray, memoryview)):
            raise InvalidInput(f"binary body: arrived decoded as a {type(body).__name__}; "
                               "send the raw bytes from encode_binary")
    elif isinstance(body, str):
        body = body.encode("utf-8")
    elif not isinstance(body, (bytes, bytearray, memoryview)):
        # Already decoded upstream (TorchServe's own json.loads); re-encode so the same
        # exact rules apply. orjson refuses ints beyond 64 bits.
        try:
            body = orjson.dumps(body)
        except TypeError as e:
            raise InvalidInput(f"body could not be read as JSON ({e})") from None
    return _parse_any(body, cfg, media, spec)
