"""The predict API in one import: a facade over the modules that hold it.

Kept so that ``from serve.api.protocol import ...`` goes on working; new code imports
from the module that holds a name:

* :mod:`serve.api.config`: :class:`HandlerConfig` (the archive's ``handler:`` section),
  :class:`RolloutWiring`, :class:`DeltaWiring`, the environment switches
  (their variables are in :mod:`serve.settings`).
* :mod:`serve.api.request`: the request schema side (:data:`DEFAULT_SCHEMA`,
  :class:`ParsedRequest`, the Content-Type and route-key checks).
* :mod:`serve.api.json_body`: the rows and columnar JSON forms, :func:`example_request`.
* :mod:`serve.api.binary`: the binary columnar form, :func:`encode_binary`,
  :func:`example_binary`.
* :mod:`serve.api.decode`: one body of any form, :func:`parse_body`.
* :mod:`serve.api.batch`: one TorchServe batch, :func:`handle_batch` (one forward per
  arm), :class:`Outcome`, :class:`BatchInfo`.

No TorchServe import: the worker (:mod:`serve.worker`) runs it, ``handlers/`` adapts the
worker to TorchServe, and the tests drive it directly.
"""
from __future__ import annotations

from serve.api.batch import (
    ArmRun,
    MergedBatch,
    Outcome,
    Split,
    encode_error,
    encode_predictions,
    handle_batch,
    merge_requests,
)
from serve.api.binary import BINARY_VERSION, encode_binary, example_binary
from serve.api.config import (
    DeltaWiring,
    HandlerConfig,
    RolloutWiring,
    cache_on_cpu_from_env,
    default_num_threads,
)
from serve.api.decode import parse_body
from serve.api.json_body import example_request
from serve.api.request import (
    BINARY_MEDIA_TYPE,
    DEFAULT_SCHEMA,
    INT64_MAX,
    JSON_MEDIA_TYPE,
    ParsedRequest,
    check_content_type,
    check_route_key,
)

__all__ = [
    "BINARY_MEDIA_TYPE",
    "BINARY_VERSION",
    "DEFAULT_SCHEMA",
    "INT64_MAX",
    "JSON_MEDIA_TYPE",
    "ArmRun",
    "DeltaWiring",
    "HandlerConfig",
    "MergedBatch",
    "Outcome",
    "ParsedRequest",
    "RolloutWiring",
    "Split",
    "cache_on_cpu_from_env",
    "check_content_type",
    "check_route_key",
    "default_num_threads",
    "encode_binary",
    "encode_error",
    "encode_predictions",
    "example_binary",
    "example_request",
    "handle_batch",
    "merge_requests",
    "parse_body",
]
