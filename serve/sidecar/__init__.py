"""The FastAPI sidecar (runs in the pod next to TorchServe): metrics, config, live changes.

Run it with ``python -m serve.sidecar --help``. The parts, from the edge inwards:

* :mod:`~serve.sidecar.app`: ``create_app`` (wires the routers, handlers and
  middleware) and the ``main`` entry point.
* :mod:`~serve.sidecar.routes_health`, :mod:`~serve.sidecar.routes_metrics`,
  :mod:`~serve.sidecar.routes_state`, :mod:`~serve.sidecar.routes_batching`: the
  endpoints, thin; :mod:`~serve.sidecar.auth`: the writes' bearer token.
* :mod:`~serve.sidecar.error_handlers`, :mod:`~serve.sidecar.middleware`: the one error
  mapping and the request counts.
* :mod:`~serve.sidecar.state`: what the routes share, injected as a dependency.
* :mod:`~serve.sidecar.reconciler`: the one writer of TorchServe's registrations; moves
  TorchServe toward the desired-state file (``--state-file``), pass by pass.
* :mod:`~serve.sidecar.switch`: the version switch it runs, step by step;
  :mod:`~serve.sidecar.memory`: the memory guard and the peak of a switch.
* :mod:`~serve.sidecar.torchserve`, :mod:`~serve.sidecar.mar`,
  :mod:`~serve.sidecar.tokens`, :mod:`~serve.sidecar.schemas`,
  :mod:`~serve.sidecar.config`: TorchServe's API, archives, tokens, bodies, settings.
"""

__all__: list[str] = []
