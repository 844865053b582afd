"""Build TorchRec DLRMs for a profile, and the KeyedJaggedTensor input they take.

Shapes: B batch, F sparse features, D embedding dim, N = 13 dense features.
Table ``t_C{i}`` serves feature ``C{i}``; one table per feature.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from serve.profiles import NUM_DENSE, Profile

__all__ = ["build_dlrm", "make_kjt", "table_configs"]


def table_configs(profile: Profile) -> list:
    """One ``EmbeddingBagConfig`` per sparse feature (sum pooling)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=t, embedding_dim=profile.embedding_dim, num_embeddings=rows,
            feature_names=[f], pooling=PoolingType.SUM,
        )
        for t, f, rows in zip(profile.table_names, profile.feature_names,
                              profile.cardinalities, strict=True)
    ]


def build_dlrm(profile: Profile, device: str | torch.device = "cpu",
               seed: int | None = None) -> torch.nn.Module:
    """An unsharded TorchRec ``DLRM`` for ``profile``; ``device="meta"`` allocates nothing.

    Returns a module mapping (dense: B x N float32, sparse: KJT) -> logits B x 1.
    """
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    if seed is not None:
        torch.manual_seed(seed)
    device = torch.device(device)
    ebc = EmbeddingBagCollection(tables=table_configs(profile), device=device)
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=list(profile.dense_arch),
        over_arch_layer_sizes=list(profile.over_arch),
        dense_device=device,
    )


def make_kjt(feature_names: Sequence[str], values: Sequence[torch.Tensor],
             lengths: Sequence[torch.Tensor]):
    """A KeyedJaggedTensor from per-feature jagged ids.

    Args:
        values[f]: int64 ids of feature f for all B samples, concatenated (nnz_f,).
        lengths[f]: int32/int64 (B,) ids per sample of feature f.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(feature_names),
        values=torch.cat([v.to(torch.int64) for v in values]),
        lengths=torch.cat([ln.to(torch.int32) for ln in lengths]),
    )
