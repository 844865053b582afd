"""A hand-written TorchRec ranker (not DLRM): tables of different dims, a shared table,
sum and mean pooling, and the pooled embeddings concatenated with a dense MLP's output.

Shapes: B batch, N = 8 dense features.

    features (KJT keys)   table   dim  pooling  ids per sample
    user_id               t_user   32  sum      1
    item_id               t_item   16  sum      1
    history               t_item   16  sum      1..20   (same table as item_id)
    category              t_cat     8  mean     1
    tags                  t_tag     8  mean     1..5

    kjt -> EmbeddingBagCollection -> KeyedTensor, regrouped in FEATURES order, i.e. its
           .values() in the unsharded order (B, 32 + 16 + 16 + 8 + 8 = 80)
    dense (B, 8) -> MLP 8-32-16 (ReLU) -> (B, 16)
    cat (B, 96) -> MLP 96-64-32 (ReLU) -> Linear 32-1 -> logits (B, 1)

Trap: ``ebc(kjt).values()`` alone is not stable. Unsharded, the KeyedTensor lists its keys
in config order (tables in order, each table's ``feature_names`` in order); sharded by
``DistributedModelParallel`` its keys come grouped by rank (table-wise over 2 ranks:
user_id, category, item_id, history, tags), so a model trained sharded and served unsharded
would read the wrong columns. ``KeyedTensor.regroup([kt], [FEATURES])`` fixes the order.
"""
from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

__all__ = ["FEATURES", "MAX_IDS", "NUM_DENSE", "OwnRanker", "make_model"]

NUM_DENSE = 8
# The order of the pooled columns (B, 80) the top MLP reads.
FEATURES = ["user_id", "item_id", "history", "category", "tags"]
MAX_IDS: dict[str, int] = {"history": 20, "tags": 5}
#: The user side (the user and their history): what a ranking request sends once, as its
#: context; ``item_id``, ``category`` and ``tags`` are the candidate's.
CONTEXT_FEATURES: tuple[str, ...] = ("user_id", "history")


class OwnRanker(nn.Module):
    """forward(dense (B, 8) float32, kjt) -> logits (B, 1)."""

    def __init__(self, user_rows: int, item_rows: int, cat_rows: int, tag_rows: int,
                 device: torch.device) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t_user", embedding_dim=32, num_embeddings=user_rows,
                               feature_names=["user_id"], pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="t_item", embedding_dim=16, num_embeddings=item_rows,
                               feature_names=["item_id", "history"], pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="t_cat", embedding_dim=8, num_embeddings=cat_rows,
                               feature_names=["category"], pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="t_tag", embedding_dim=8, num_embeddings=tag_rows,
                               feature_names=["tags"], pooling=PoolingType.MEAN),
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        pooled = sum(t.embedding_dim * len(t.feature_names) for t in tables)  # 80
        dense_dev = torch.device("cpu") if device.type == "meta" else device
        self.dense_mlp = nn.Sequential(
            nn.Linear(NUM_DENSE, 32, device=dense_dev), nn.ReLU(),
            nn.Linear(32, 16, device=dense_dev), nn.ReLU())
        self.top = nn.Sequential(
            nn.Linear(pooled + 16, 64, device=dense_dev), nn.ReLU(),
            nn.Linear(64, 32, device=dense_dev), nn.ReLU(),
            nn.Linear(32, 1, device=dense_dev))

    def forward(self, dense_features: torch.Tensor,
                sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """dense_features (B, 8) float32, sparse_features KJT -> logits (B, 1)."""
        # KeyedTensor.values() is (B, 80) in the KeyedTensor's key order, and that order
        # differs once DistributedModelParallel shards the EBC (keys grouped by rank), so
        # reorder to FEATURES first: the same columns sharded and unsharded.
        kt = self.ebc(sparse_features)
        pooled = KeyedTensor.regroup([kt], [FEATURES])[0]      # (B, 80)
        x = torch.cat([pooled, self.dense_mlp(dense_features)], dim=1)  # (B, 96)
        return self.top(x)


def make_model(user_rows: int = 50_000, item_rows: int = 20_000, cat_rows: int = 500,
               tag_rows: int = 2_000, device: str | torch.device = "cpu") -> OwnRanker:
    """The ranker with its (small) default row counts."""
    for name, n in (("user_rows", user_rows), ("item_rows", item_rows),
                    ("cat_rows", cat_rows), ("tag_rows", tag_rows)):
        if n < 1:
            raise ValueError(f"{name} {n} must be >= 1")
    return OwnRanker(user_rows, item_rows, cat_rows, tag_rows, torch.device(device))
