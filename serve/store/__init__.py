"""The files the layers hand each other, each format defined once.

* :mod:`~serve.store.repository`: immutable model versions (archive + build report).
* :mod:`~serve.store.deltas`: the embedding-delta file format and the pod's delta store.
* :mod:`~serve.store.predlog`: the prediction log the workers write and the sidecar joins.
* :mod:`~serve.store.routing`: the rollout's routing control file (which arm scores a
  request).

The pod imports these (the worker writes, the sidecar reads); none imports torch at module
level except where a format needs tensors.
"""
