"""The request schema side of the predict API: what every request form is checked against.

Requests are decoded against the served model's schema (:class:`serve.schema.ModelSchema`;
default :data:`DEFAULT_SCHEMA`, the built-in DLRM: N = 13 dense features, F = 26 sparse
features C1..C26, at most 64 ids each). Shapes: B samples, F sparse features (the schema's
``feature_names``, in that order), N dense features (``schema.dense``), nnz = total ids
of a request. A feature may carry at most ``min(schema.max_ids[f], max_ids_per_feature)``
ids per instance.

Every form decodes into one :class:`ParsedRequest` (dense float32 (B, N), lengths int32
(F, B), values int64 (nnz,) feature-major). Ids are integers in [0, 2^63-1]; dense values
are finite numbers that fit float32. Every violation raises a :mod:`serve.errors`
exception whose message names the field path, the value, the rule and what to do.

Here: the request's data (:class:`ParsedRequest`), the media types, and the
Content-Type and ``X-DLRM-Route-Key`` checks. The per-schema helpers and the validation
wording every decoder shares: :mod:`serve.api.spec`. The forms themselves:
:mod:`serve.api.json_body` (rows, columnar) and :mod:`serve.api.binary`; one body of any
form: :mod:`serve.api.decode`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve.errors import InvalidInput, UnsupportedMediaType
from serve.profiles import get_profile
from serve.schema import ModelSchema
from serve.store.routing import ROUTE_KEY_HEADER, ROUTE_KEY_MAX_CHARS

__all__ = [
    "BINARY_MEDIA_TYPE",
    "DEFAULT_SCHEMA",
    "INT64_MAX",
    "JSON_MEDIA_TYPE",
    "ParsedRequest",
    "check_content_type",
    "check_route_key",
]


INT64_MAX = 2**63 - 1
JSON_MEDIA_TYPE = "application/json"
BINARY_MEDIA_TYPE = "application/x-dlrm-columnar"
# Media types we decode. `application/json` with or without `; charset=utf-8` (JSON is
# UTF-8 by RFC 8259). A missing Content-Type is accepted too (TorchServe passes none for
# bare clients). `application/x-dlrm-columnar` exactly (no parameters: a charset means
# nothing for binary). Anything else (form-urlencoded, as `curl -d` sends by default;
# text/plain; multipart) gets 415 and names the headers to send.
_JSON_TYPES = frozenset((JSON_MEDIA_TYPE, ""))

#: The built-in DLRM's request schema (N = 13, F = 26: C1..C26, at most 64 ids each): what
#: the decoders check when no ``schema`` is given.
DEFAULT_SCHEMA: ModelSchema = get_profile("small").schema()


@dataclass
class ParsedRequest:
    """One validated request.

    dense: float32 (B, N); lengths: int32 (F, B) ids per (feature, sample);
    values: int64 (nnz,) feature-major (all of C1's ids for samples 0..B-1, then C2 ...).
    A context feature (``shared``) has its ids once, in sample 0's cell.
    """

    dense: np.ndarray
    lengths: np.ndarray
    values: np.ndarray
    #: The features sent once for all samples (a ranking request's context), in schema
    #: order: their ids sit in sample 0's cell, every other sample's length there is 0.
    #: Empty: every sample carries its own ids (the instance form).
    shared: tuple[int, ...] = ()

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])


def check_content_type(content_type: str | bytes | None) -> str:
    """The media type the body is decoded as: JSON_MEDIA_TYPE or BINARY_MEDIA_TYPE.

    JSON: ``application/json`` (charset utf-8 only) or no Content-Type at all. Binary:
    ``application/x-dlrm-columnar`` without parameters. Media types compare
    case-insensitively (RFC 9110).

    Raises:
        UnsupportedMediaType: any other Content-Type (415), naming the ones to send.
    """
    if isinstance(content_type, (bytes, bytearray)):
        content_type = content_type.decode("latin-1")
    raw = (content_type or "").strip()
    parts = [p.strip().lower() for p in raw.split(";")]
    mime = parts[0]
    if mime == BINARY_MEDIA_TYPE and len(parts) == 1:
        return BINARY_MEDIA_TYPE
    charset_ok = all(not p.startswith("charset=") or p.strip('"') in ("charset=utf-8", 'charset="utf-8')
                     for p in parts[1:])
    if mime not in _JSON_TYPES or not charset_ok:
        raise UnsupportedMediaType(
            f"Content-Type {raw!r} is not supported; send the body as JSON with "
            "'Content-Type: application/json' (charset utf-8), or binary columnar with "
            f"'Content-Type: {BINARY_MEDIA_TYPE}'")
    return JSON_MEDIA_TYPE


def check_route_key(key: str | None) -> str | None:
    """A request's ``X-DLRM-Route-Key`` value, checked: None (no header) or 1 to
    ``ROUTE_KEY_MAX_CHARS`` characters.

    Raises:
        InvalidInput: an empty or too long key (400), naming the header and the rule.
    """
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: is a {type(key).__name__}; send text "
                           f"of 1 to {ROUTE_KEY_MAX_CHARS} characters")
    if not key:
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: is empty; send 1 to "
                           f"{ROUTE_KEY_MAX_CHARS} characters (e.g. a user or session id), or "
                           "leave the header out")
    if len(key) > ROUTE_KEY_MAX_CHARS:
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: has {len(key)} characters; at most "
                           f"{ROUTE_KEY_MAX_CHARS} are allowed; send a shorter key (e.g. a hash "
                           "of the user id) or leave the header out")
    return key
