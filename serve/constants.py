"""Names shared across layers, defined once: the runtime, the handler, the HTTP contract and
the metrics all import them from here.

- ``STAGES``: the stages of one predict, timed per batch and exported as the ``stage``
  label of ``dlrm_stage_duration_seconds`` (decode = body parse in the handler,
  embedding = row lookup + pooling, dense = MLPs + interaction).
- ``CACHE_POLICIES``: eviction policies of the embedding cache (``lru``, ``lfu``).
"""
from __future__ import annotations

__all__ = ["ARTIFACT_NAME", "CACHE_POLICIES", "CANDIDATE_ARTIFACT", "STAGES"]

STAGES: tuple[str, ...] = ("decode", "embedding", "dense")
CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu")

#: The artifact's file name inside a model archive (.mar) and the folder TorchServe
#: unpacks it into; a rollout's candidate artifact sits beside it.
ARTIFACT_NAME = "artifact.pt"
CANDIDATE_ARTIFACT = "candidate/artifact.pt"
