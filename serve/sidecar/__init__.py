"""The FastAPI sidecar (runs in the pod next to TorchServe): metrics, declared state, live
changes. Run it with ``python -m serve.sidecar --help``.

Layers, from the edge inwards (imports only point down the list):

* ``http/``: :mod:`~serve.sidecar.http.app` (``create_app`` and ``main``), the
  ``routes_*`` modules (thin: parse, call, answer), :mod:`~serve.sidecar.http.auth` (the
  write token), :mod:`~serve.sidecar.http.errors` (the one error mapping),
  :mod:`~serve.sidecar.http.middleware`, :mod:`~serve.sidecar.http.docs`,
  :mod:`~serve.sidecar.http.schemas` (bodies).
* ``services/``: :mod:`~serve.sidecar.services.deltas`,
  :mod:`~serve.sidecar.services.feedback`.
* ``control/``: :mod:`~serve.sidecar.control.reconciler` (the one writer of TorchServe's
  registrations), :mod:`~serve.sidecar.control.switch`,
  :mod:`~serve.sidecar.control.rollout`, :mod:`~serve.sidecar.control.guards`,
  :mod:`~serve.sidecar.control.tuner`, :mod:`~serve.sidecar.control.drain`.
* ``adapters/``: :mod:`~serve.sidecar.adapters.torchserve`,
  :mod:`~serve.sidecar.adapters.archives`, :mod:`~serve.sidecar.adapters.memory`,
  :mod:`~serve.sidecar.adapters.gpu`, :mod:`~serve.sidecar.adapters.tokens`,
  :mod:`~serve.sidecar.adapters.model_schemas`.

:mod:`~serve.sidecar.root` is the composition root: it builds the parts from
:mod:`~serve.sidecar.config` and hands them to the routes as one dependency.
"""

__all__: list[str] = []
