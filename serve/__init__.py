"""DLRM serving, in layers (each a package; arrows are the only imports allowed):

* ``serve/model/``: the offline build (data, sharded training, merge, quantization,
  import of the user's own TorchRec model, archives, deltas). Never imported by the pod.
* ``serve/runtime/``: the inference engine (quantized tables, embedding cache, dense part).
* ``serve/api/``: the HTTP contract of ``/predictions`` (request decoding, limits, batching
  of a request).
* ``serve/worker/``: one TorchServe worker: runtime + contract; ``handlers/`` adapts
  TorchServe to it with one call.
* ``serve/sidecar/``: the FastAPI sidecar: ``http/`` -> ``control/`` -> ``adapters/``.
* ``serve/ops/``: operations (launcher, load checks, fault suite, monitoring files).

What stays at the top is the vocabulary every layer shares: :mod:`serve.errors`,
:mod:`serve.constants`, :mod:`serve.state` (the desired-state schema),
:mod:`serve.schema` (the model's request schema), :mod:`serve.profiles` (the built-in
model's profiles), :mod:`serve.metrics` (every metric name) and :mod:`serve.settings`
(every environment variable). Two packages hold what several layers hand each other:
``serve/store/`` (files: the model repository, delta files, the prediction log, the
rollout's routing file, the row format) and ``serve/common/`` (helpers with no layer of
their own: loopback ports, CLI logging, the CPU budget, Zipf ids, AUC).

Importing this package imports neither TorchServe nor TorchRec; each module pulls what it
needs.
"""
