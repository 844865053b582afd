"""The offline model build (runs on the build/training machine, never in the pod).

data -> train (sharded, TorchRec DistributedModelParallel) -> merge -> quantize -> archive,
driven by :mod:`serve.model.pipeline` (``make model``; its settings:
:mod:`serve.model.pipeline_config`); :mod:`serve.model.sharding` plans the tables' shards
for :mod:`serve.model.train`. This is the only layer that imports
TorchRec; nothing under ``serve.runtime``, ``serve.api``, ``serve.sidecar`` imports it.
"""
