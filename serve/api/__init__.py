"""The predict API's codec: decoding and encoding the bodies of ``POST /predictions/dlrm``
(runs in the pod; no model runs here).

Module by module:

* :mod:`~serve.api.config`: the archive's ``handler:`` section and the environment
  switches a worker reads once at start.
* :mod:`~serve.api.request`: the request's data (:class:`~serve.api.request.ParsedRequest`:
  dense (B, N), lengths (F, B), values (nnz,)), the media types, the Content-Type and
  route-key checks.
* :mod:`~serve.api.spec`: the per-schema helpers and the validation wording every
  decoder shares.
* :mod:`~serve.api.json_body` (rows, columnar) and :mod:`~serve.api.binary` (binary
  columnar): the body forms; :mod:`~serve.api.decode`: one body of any form.
* :mod:`~serve.api.batch`: merging a batch's requests into one forward's input, encoding
  the responses.
* :mod:`~serve.api.oip`: Open Inference Protocol v2 bodies (the sidecar serves them).

The worker (:mod:`serve.worker`) runs the forwards (:mod:`serve.worker.arms`); the
TorchServe handler only adapts the worker.
"""
