"""TorchServe handler for the DLRM: a thin adapter over :class:`serve.worker.Worker`.

* ``initialize``: reads TorchServe's context (the model dir, the archive's
  ``modelVersion``, the ``handler:`` section of its model-config.yaml as
  :class:`serve.api.config.HandlerConfig`, the worker's ``gpu_id``, the model's worker
  count) and makes one call: :meth:`serve.worker.Worker.load`.
* ``handle``: turns each request of a TorchServe batch into a
  :class:`serve.worker.WorkerRequest` (raw body, Content-Type, ``X-DLRM-Route-Key``,
  TorchServe's request id), makes one call, :meth:`serve.worker.Worker.handle`, and
  copies each :class:`serve.worker.WorkerResponse` back into the context (status,
  Content-Type, ``X-DLRM-*`` headers).

What a batch does (one forward per arm, rollouts, the prediction log, deltas, metrics)
is the worker's: see :mod:`serve.worker.worker`. This file imports only ``serve.*`` (and
TorchServe): the build packs it into each archive (``serve.model.archive``) and the
sidecar into the archives it derives (``serve.sidecar.adapters.archives``).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from ts.torch_handler.base_handler import BaseHandler

from serve.api.config import HandlerConfig
from serve.settings import TS_DECODE_INPUT_REQUEST
from serve.store.routing import ROUTE_KEY_HEADER
from serve.worker import Worker, WorkerRequest, model_version, worker_device

__all__ = ["DLRMHandler"]


class DLRMHandler(BaseHandler):
    """BaseHandler subclass; TorchServe calls ``initialize`` once and ``handle`` per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.worker: Worker | None = None

    def initialize(self, context: Any) -> None:
        # Keep bodies as raw bytes: TorchServe's own json.loads would accept NaN and turn
        # huge ids into Python ints before we see them; we parse with orjson ourselves.
        # The worker reads this variable per request, so setting it here takes effect.
        # Binary columnar bodies (application/x-dlrm-columnar) arrive as a bytearray
        # either way (TorchServe decodes only JSON and text/*); numpy views it in place.
        os.environ[TS_DECODE_INPUT_REQUEST.name] = "false"
        _quiet_per_batch_lines()
        props = context.system_properties
        yaml_cfg = context.model_yaml_config or {}
        self.worker = Worker.load(
            props.get("model_dir"), HandlerConfig.from_dict(yaml_cfg.get("handler")),
            model_version=model_version(getattr(context, "manifest", None)),
            device=worker_device(props.get("gpu_id")),
            workers=int(yaml_cfg.get("maxWorkers") or yaml_cfg.get("minWorkers") or 1),
            environ=os.environ)
        self.initialized = True

    def handle(self, data: list[dict], context: Any) -> list[bytes]:
        if self.worker is None:
            raise RuntimeError("DLRMHandler.handle before initialize")
        requests = [_worker_request(req, context, idx) for idx, req in enumerate(data)]
        responses = self.worker.handle(requests)
        for idx, resp in enumerate(responses):
            context.set_response_status(resp.status, resp.reason, idx)
            context.set_response_content_type(idx, resp.content_type)
            for name, value in resp.headers.items():
                context.set_response_header(idx, name, value)
        return [resp.body for resp in responses]


#: TorchServe's worker writes two lines to its stdout per batch: "Backend received
#: inference at: <time>" (root logger, INFO) and its HandlerTime/PredictionTime metrics
#: (``ts.metrics.caching_metric``, INFO). The frontend reads, parses and logs every line;
#: our log4j2.xml discards the metrics lines, and the dlrm_* metrics measure the same
#: stages. So the lines are not written (docs/observability.md): worker and frontend CPU
#: that was no model's work.
_PER_BATCH_LINE = "Backend received inference at"


def _quiet_per_batch_lines() -> None:
    """Drop TorchServe's per-batch log and metric lines in this worker process; its
    warnings and errors, and every other log line, still reach the model log."""
    logging.getLogger("ts.metrics.caching_metric").setLevel(logging.WARNING)
    root = logging.getLogger()
    if _keep_line not in root.filters:
        # a function, not a Filter subclass: TorchServe loads a handler module with one class
        root.addFilter(_keep_line)


def _keep_line(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith(_PER_BATCH_LINE))


def _worker_request(req: dict, context: Any, idx: int) -> WorkerRequest:
    """Request ``idx`` of a TorchServe batch: raw body, Content-Type, X-DLRM-Route-Key
    and TorchServe's request id (the response's ``x-request-id``)."""
    params = context.get_all_request_header(idx) or {}
    body, ctype = _body_and_type(req, params)
    rid = context.get_request_id(idx)
    return WorkerRequest(body, ctype, _header(params, ROUTE_KEY_HEADER.lower()),
                         str(rid) if rid else None)


def _body_and_type(req: dict, params: dict) -> tuple[Any, str | None]:
    """The raw body and its Content-Type of one request of a TorchServe batch
    (``params``: its headers).

    TorchServe hands a plain body over as parameter ``body`` (``data`` for some
    clients); form posts arrive split into form fields, which we answer with 415. The
    request's own Content-Type header comes first: the parameter's content type is the
    bare media type (TorchServe drops parameters such as ``; charset=latin-1``), which
    would let a body in a charset we do not decode, or ``application/x-dlrm-columnar;
    charset=utf-8``, through.
    """
    if "body" in req or "data" in req:
        name = "body" if "body" in req else "data"
        ctype = _header(params, "content-type")
        if ctype is None:
            per_param = params.get(name)
            ctype = per_param.get("content-type") if isinstance(per_param, dict) else None
        return req[name], ctype
    # e.g. application/x-www-form-urlencoded (curl -d without -H) decoded into fields
    return b"", _header(params, "content-type") or "application/x-www-form-urlencoded"


def _header(params: dict, name: str) -> str | None:
    """The value of header ``name`` (lower case), matched case-insensitively."""
    for k, v in params.items():
        if isinstance(k, str) and k.lower() == name and isinstance(v, str):
            return v
    return None
