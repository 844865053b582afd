"""DLRM serving, in layers (each a package; arrows are the only imports allowed):

* ``serve/model/``: the offline build (data, sharded training, merge, quantization,
  import of the user's own TorchRec model, archives, deltas). Never imported by the pod.
* ``serve/runtime/``: the inference engine (quantized tables, embedding cache, dense part).
* ``serve/api/``: the HTTP contract of ``/predictions`` (request decoding, limits, batching
  of a request).
* ``serve/worker/``: one TorchServe worker: runtime + contract; ``handlers/`` adapts
  TorchServe to it with one call.
* ``serve/sidecar/``: the FastAPI sidecar: ``http/`` -> ``root`` -> ``services/`` ->
  ``control/`` -> ``adapters/`` -> ``config``.
* ``serve/ops/``: operations (launcher, load checks, fault suite, monitoring files).

Floors, lowest first (a module imports only lower floors; ``tests/test_layers.py`` holds
the order): the ground < ``store/`` < ``runtime/``, ``api/`` < ``worker/``, ``sidecar/``,
``model/`` < ``ops/`` < ``handlers/``. The ground is the vocabulary every layer shares, in
its own order: :mod:`serve.errors`, :mod:`serve.constants`, :mod:`serve.settings` (every
environment variable), :mod:`serve.phases` (every controller's phase),
:mod:`serve.metrics` (every metric name; its submodules record and expose them),
``serve/common/`` (helpers with no layer of their own: loopback ports, CLI logging, the
CPU budget, Zipf ids, AUC), :mod:`serve.rowformat` (an embedding table's stored row),
:mod:`serve.schema` (the model's request schema), :mod:`serve.state` (the desired-state
schema) and :mod:`serve.profiles` (the built-in model's profiles). ``serve/store/`` holds
the files the layers hand each other (the model repository, delta files, the prediction
log, the rollout's routing file).

Importing this package imports neither TorchServe nor TorchRec; each module pulls what it
needs.
"""
