"""The article's DCN ranker: TorchRec ``DLRM_DCN`` over a user and an item table.

Shapes: B batch, N = 256 dense features, F = 2 sparse features (``user_id``, ``item_id``,
one id each), D = 64 embedding dim.

    dense (B, 256) -> bottom MLP 256-128-64 -> (B, 64)
    kjt [user_id, item_id] -> EmbeddingBagCollection (tables user_id, item_id; D 64, sum)
    (B, 3 * 64) -> DCN, 3 low-rank (64) cross layers -> top MLP 32-1 -> logits (B, 1)

``DLRM_DCN`` stacks the bottom MLP's output with every pooled embedding as (B, F + 1, D),
so every table's dim must equal the bottom MLP's last layer (64): the article's dim 32 for
items does not build. Rows are scaled down from the article's (200k users, 100k items by
default); pass ``user_rows`` / ``item_rows`` or set ``ARTICLE_DCN_USER_ROWS`` /
``ARTICLE_DCN_ITEM_ROWS``.
"""
from __future__ import annotations

import os

import torch
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

__all__ = ["EMBEDDING_DIM", "MAX_IDS", "NUM_DENSE", "make_model"]

NUM_DENSE = 256
EMBEDDING_DIM = 64
# One id per sample for both features (the trainer's default; listed for clarity).
MAX_IDS: dict[str, int] = {"user_id": 1, "item_id": 1}
#: The user side: what a ranking request sends once, as its context (the importer records
#: it; the load generator and bench-slo read it).
CONTEXT_FEATURES: tuple[str, ...] = ("user_id",)
DEFAULT_USER_ROWS = 200_000
DEFAULT_ITEM_ROWS = 100_000


def _rows(value: int | None, env: str, default: int) -> int:
    """``value``, else the env var ``env``, else ``default``; must be >= 1."""
    if value is None:
        raw = os.environ.get(env, "")
        try:
            value = int(raw) if raw.strip() else default
        except ValueError:
            raise ValueError(f"{env}={raw!r} must be a whole number of table rows") from None
    if value < 1:
        raise ValueError(f"{env} / row count {value} must be >= 1")
    return value


def make_model(user_rows: int | None = None, item_rows: int | None = None,
               device: str | torch.device = "cpu") -> DLRM_DCN:
    """The article's DLRM_DCN; forward(dense (B, 256) float32, kjt) -> logits (B, 1)."""
    users = _rows(user_rows, "ARTICLE_DCN_USER_ROWS", DEFAULT_USER_ROWS)
    items = _rows(item_rows, "ARTICLE_DCN_ITEM_ROWS", DEFAULT_ITEM_ROWS)
    tables = [
        EmbeddingBagConfig(name="user_id", embedding_dim=EMBEDDING_DIM, num_embeddings=users,
                           feature_names=["user_id"], pooling=PoolingType.SUM),
        EmbeddingBagConfig(name="item_id", embedding_dim=EMBEDDING_DIM, num_embeddings=items,
                           feature_names=["item_id"], pooling=PoolingType.SUM),
    ]
    device = torch.device(device)
    ebc = EmbeddingBagCollection(tables=tables, device=device)
    return DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[128, EMBEDDING_DIM],
        over_arch_layer_sizes=[32, 1],
        dcn_num_layers=3,
        dcn_low_rank_dim=64,
        dense_device=torch.device("cpu") if device.type == "meta" else device,
    )
