"""One request body of any form -> :class:`~serve.api.request.ParsedRequest`.

The request's Content-Type picks the decoder (:func:`~serve.api.request.check_content_type`):
JSON (:mod:`serve.api.json_body`) or binary columnar (:mod:`serve.api.binary`).
"""
from __future__ import annotations

from typing import Any

import orjson

from serve.api.binary import _parse_binary
from serve.api.config import HandlerConfig
from serve.api.json_body import _gc_paused, _parse_body
from serve.api.request import (
    BINARY_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    ParsedRequest,
    _check_size,
    _Spec,
    _spec_of,
    check_content_type,
    check_route_key,
)
from serve.errors import InvalidInput
from serve.schema import ModelSchema

__all__ = ["parse_body"]


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
    return _parse_any(body, cfg, media_type, _spec_of(schema))


def _parse_any(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
               media_type: str, spec: _Spec) -> ParsedRequest:
    """:func:`parse_body` with the schema's helpers resolved."""
    if media_type == BINARY_MEDIA_TYPE:
        if isinstance(body, str):
            raise InvalidInput("binary body: arrived as text; send the raw bytes from "
                               "encode_binary")
        _check_size(memoryview(body).nbytes, cfg)
        return _parse_binary(body, cfg, spec)
    if media_type != JSON_MEDIA_TYPE:
        raise ValueError(f"media_type {media_type!r} must be {JSON_MEDIA_TYPE!r} or "
                         f"{BINARY_MEDIA_TYPE!r}")
    with _gc_paused():
        return _parse_body(body, cfg, spec)


def _decode(body: Any, ctype: str | None, key: str | None, cfg: HandlerConfig,
            spec: _Spec) -> ParsedRequest:
    """One request of a batch -> ParsedRequest (raises a ServeError for a bad one)."""
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
