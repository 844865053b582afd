"""TorchServe handler of the *closed* version: answers every request 503, at once.

While a pod shuts down, the sidecar (``POST /drain``, :mod:`serve.sidecar.control.drain`)
registers this archive and makes it the model's default version: requests that arrive
from then on get a clean JSON 503 ("this replica is shutting down; retry"), while the
requests already queued for the serving version are still answered by it. No model, no
torch work: it loads in the time a worker process takes to start.
"""
from __future__ import annotations

import json
from typing import Any

from ts.torch_handler.base_handler import BaseHandler

BODY = json.dumps({
    "code": 503, "type": "ShuttingDown",
    "message": "this replica is shutting down and takes no new requests; retry: another "
               "replica answers (the requests it had accepted are still being answered)",
}).encode()


class ClosedHandler(BaseHandler):
    """Every request: 503 JSON with ``Retry-After: 1`` and ``Connection: close``."""

    def initialize(self, context: Any) -> None:
        self.initialized = True

    def handle(self, data: list[Any], context: Any) -> list[bytes]:
        for idx in range(len(data)):
            context.set_response_status(503, "Service Unavailable", idx)
            context.set_response_content_type(idx, "application/json")
            context.set_response_header(idx, "Retry-After", "1")
            context.set_response_header(idx, "Connection", "close")
        return [BODY for _ in data]
