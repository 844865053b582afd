"""What goes into a :class:`~serve.worker.Worker` and what comes out: one predict request,
one response, and the headers every response carries.

Plain data, no TorchServe: ``handlers/dlrm_handler.py`` builds a :class:`WorkerRequest`
from each request of a TorchServe batch and copies each :class:`WorkerResponse` back
into TorchServe's context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BATCH_INSTANCES_HEADER",
    "BATCH_REQUESTS_HEADER",
    "MODEL_VERSION_HEADER",
    "TS_BATCH_HEADER",
    "WorkerRequest",
    "WorkerResponse",
]

#: Samples of the merged forward that answered the request (its arm's, in a rollout).
BATCH_INSTANCES_HEADER = "X-DLRM-Batch-Instances"
#: Requests of the merged forward that answered the request (its arm's, in a rollout).
BATCH_REQUESTS_HEADER = "X-DLRM-Batch-Requests"
#: Requests TorchServe handed over together, refused ones included.
TS_BATCH_HEADER = "X-DLRM-TorchServe-Batch"
#: The repository version of the model that answered (the stable one for a refusal).
MODEL_VERSION_HEADER = "X-DLRM-Model-Version"
_PHRASES = {200: "OK", 400: "Bad Request", 413: "Payload Too Large",
            415: "Unsupported Media Type", 500: "Internal Server Error"}


@dataclass(frozen=True)
class WorkerRequest:
    """One predict request of a batch, as the transport handed it over.

    Attributes:
        body: the raw body: bytes-like (TorchServe hands a bytearray over), a str (JSON
            text), or a value some transport already decoded from JSON (re-encoded and
            checked by the same rules).
        content_type: the request's Content-Type header, None when absent; it picks the
            decoder (:func:`serve.api.request.check_content_type`).
        route_key: its ``X-DLRM-Route-Key`` header (None: not sent); keeps it on one arm
            of a rollout.
        request_id: the transport's id of the request (TorchServe's, the response's
            ``x-request-id``): the key of its entry in the prediction log; None: not
            logged.
    """

    body: Any
    content_type: str | None = None
    route_key: str | None = None
    request_id: str | None = None


@dataclass(frozen=True)
class WorkerResponse:
    """One response: HTTP status, the JSON body and the headers to send with it.

    Attributes:
        status: the HTTP status (200, or the 4xx/5xx of a refused or failed request).
        body: ``{"predictions": [...]}`` or ``{"code", "type", "message"}``, JSON bytes.
        headers: header name -> value, in the order they are set (the ``X-DLRM-*``
            headers above and :data:`serve.store.routing.ARM_HEADER`).
        content_type: always ``application/json``.
    """

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"

    @property
    def reason(self) -> str:
        """The status's reason phrase ("" for a status without one here)."""
        return _PHRASES.get(self.status, "")
