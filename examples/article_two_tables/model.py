"""The article's two tables at their stated size: ``user_id`` 100M x 64, ``item_id`` 50M x 32.

Shapes: B batch, N = 16 dense features, F = 2 sparse features (one id each, sum pooling).

    kjt [user_id, item_id] -> EmbeddingBagCollection -> KeyedTensor, regrouped as
         user (B, 64) and item (B, 32)
    dense (B, 16) -> MLP 16-64-32 (ReLU) -> (B, 32)
    cat (B, 32 + 64 + 32 = 128) -> MLP 128-256-64 (ReLU) -> Linear 64-1 -> logits (B, 1)

``DLRM_DCN`` stacks every pooled embedding with the bottom MLP's output, so it needs one dim
for all tables; the article's dims differ (64 and 32), so the dense part here is a plain
MLP tower over the concatenation (built from ``torch.nn`` modules; the importer exports it
with ``torch.export``).

Rows: 200k users and 100k items by default (CI size, 64 MB of fp32). The article's full
size (100M x 64 + 50M x 32 = 7.4B parameters, 29.6 GB of fp32, about 8.6 GB of int8 rows)
with ``ARTICLE_SCALE=full``; ``ARTICLE_USER_ROWS`` / ``ARTICLE_ITEM_ROWS`` (or the
arguments) set each table's rows. Tables above ``META_ABOVE_BYTES`` of fp32 in all are
built on the ``meta`` device (nothing allocated; the dense layers stay on the CPU), so
building the full-size model costs nothing: ``python -m serve.model.generate`` writes its
checkpoint chunk by chunk and the importer streams it.
"""
from __future__ import annotations

import os

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

__all__ = ["FULL_ITEM_ROWS", "FULL_USER_ROWS", "MAX_IDS", "NUM_DENSE", "TwoTowerRanker",
           "make_model", "table_rows"]

NUM_DENSE = 16
USER_DIM = 64
ITEM_DIM = 32
# One id per sample for both features.
MAX_IDS: dict[str, int] = {"user_id": 1, "item_id": 1}
#: The user side: what a ranking request sends once, as its context (the importer records
#: it; the load generator and bench-slo read it).
CONTEXT_FEATURES: tuple[str, ...] = ("user_id",)
DEFAULT_USER_ROWS = 200_000
DEFAULT_ITEM_ROWS = 100_000
FULL_USER_ROWS = 100_000_000
FULL_ITEM_ROWS = 50_000_000
# Above this many bytes of fp32 tables, build them on meta (see the module docstring).
META_ABOVE_BYTES = 8 << 30


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


def table_rows(user_rows: int | None = None, item_rows: int | None = None) -> tuple[int, int]:
    """(user rows, item rows): the arguments, else ``ARTICLE_USER_ROWS`` /
    ``ARTICLE_ITEM_ROWS``, else the article's full size when ``ARTICLE_SCALE=full``, else
    the CI default (``ARTICLE_SCALE=small`` or unset)."""
    scale = os.environ.get("ARTICLE_SCALE", "small").strip() or "small"
    if scale not in ("small", "full"):
        raise ValueError(f"ARTICLE_SCALE={scale!r} must be small (200k x 64, 100k x 32) or "
                         "full (the article's 100M x 64, 50M x 32)")
    users, items = ((FULL_USER_ROWS, FULL_ITEM_ROWS) if scale == "full"
                    else (DEFAULT_USER_ROWS, DEFAULT_ITEM_ROWS))
    return (_rows(user_rows, "ARTICLE_USER_ROWS", users),
            _rows(item_rows, "ARTICLE_ITEM_ROWS", items))


class TwoTowerRanker(nn.Module):
    """forward(dense (B, 16) float32, kjt of user_id, item_id) -> logits (B, 1)."""

    def __init__(self, user_rows: int, item_rows: int, device: torch.device) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t_user", embedding_dim=USER_DIM, num_embeddings=user_rows,
                               feature_names=["user_id"], pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="t_item", embedding_dim=ITEM_DIM, num_embeddings=item_rows,
                               feature_names=["item_id"], pooling=PoolingType.SUM),
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        dense_dev = torch.device("cpu") if device.type == "meta" else device
        self.dense_mlp = nn.Sequential(
            nn.Linear(NUM_DENSE, 64, device=dense_dev), nn.ReLU(),
            nn.Linear(64, 32, device=dense_dev), nn.ReLU())
        self.top = nn.Sequential(
            nn.Linear(32 + USER_DIM + ITEM_DIM, 256, device=dense_dev), nn.ReLU(),
            nn.Linear(256, 64, device=dense_dev), nn.ReLU(),
            nn.Linear(64, 1, device=dense_dev))

    def forward(self, dense_features: torch.Tensor,
                sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """dense_features (B, 16) float32, sparse_features KJT -> logits (B, 1)."""
        # regroup by name: the same columns whether the EBC is sharded or not
        user, item = KeyedTensor.regroup([self.ebc(sparse_features)],
                                         [["user_id"], ["item_id"]])   # (B, 64), (B, 32)
        x = torch.cat([self.dense_mlp(dense_features), user, item], dim=1)   # (B, 128)
        return self.top(x)


def make_model(user_rows: int | None = None, item_rows: int | None = None,
               device: str | torch.device | None = None) -> TwoTowerRanker:
    """The ranker; rows from :func:`table_rows`. ``device`` places the tables (None =
    ``cpu``, or ``meta`` above ``META_ABOVE_BYTES`` of fp32 tables)."""
    users, items = table_rows(user_rows, item_rows)
    if device is None:
        fp32 = 4 * (users * USER_DIM + items * ITEM_DIM)
        device = "meta" if fp32 > META_ABOVE_BYTES else "cpu"
    return TwoTowerRanker(users, items, torch.device(device))
