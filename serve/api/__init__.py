"""The HTTP body contract of ``POST /predictions/dlrm`` (runs in the pod).

Where a predict request goes, module by module:

* :mod:`~serve.api.config`: the archive's ``handler:`` section and the environment
  switches a worker reads once at start.
* :mod:`~serve.api.request`: the request schema (B, F, N; the served model's feature
  names and caps), the Content-Type and route-key checks.
* :mod:`~serve.api.json_body` (rows, columnar) and :mod:`~serve.api.binary` (binary
  columnar): the body forms; :mod:`~serve.api.decode`: one body of any form.
* :mod:`~serve.api.batch`: a TorchServe batch, one merged forward per arm, the responses.
* :mod:`~serve.api.protocol`: the old single import, re-exporting the above.

:class:`serve.worker.Worker` runs it; the TorchServe handler only adapts the worker.
"""
