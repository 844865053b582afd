"""The FastAPI sidecar (runs in the pod next to TorchServe): metrics, declared state, live
changes. Run it with ``python -m serve.sidecar --help``.

Layers, from the edge inwards; each imports only the layers after it (``tests/test_layers.py``
checks every import, lazy ones included):

* ``__main__``: ``python -m serve.sidecar`` runs :func:`serve.sidecar.http.app.main`.
* ``http/``: the app (``create_app``, ``main``), the ``routes_*`` modules (thin: parse,
  call, answer), the write token, the one error mapping, the middleware, the docs and the
  request/response bodies.
* :mod:`~serve.sidecar.root`: the composition root; it builds every part from the config
  once and hands them to the routes as one dependency.
* ``services/``: embedding deltas and click feedback. They import no controller: the root
  hands them the controllers' reads as callables.
* ``control/``: the controllers, each a state machine (the reconciler, the one writer of
  TorchServe's registrations; the version switch; the rollout and its guards; the batching
  tuner; PUT /batching's updates; the drain; the fleet's decisions).
* ``adapters/``: what the sidecar talks to outside itself (TorchServe, archives, memory,
  GPUs, the token file, model schemas, the fleet's stores).
* :mod:`~serve.sidecar.config`: the settings and the flags they generate (with the tuner's
  and the feedback join's), the lowest layer: it imports none of the others.

Below the sidecar it imports only the ground floor of ``serve/``, ``serve/store`` and
``serve/api`` (the request contract its OIP route decodes).
"""

__all__: list[str] = []
