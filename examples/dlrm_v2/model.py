"""MLPerf DLRM-v2 (DCNv2 on Criteo 1TB multi-hot) as a TorchRec ``DLRM_DCN``.

Shapes: B batch, N = 13 dense features, F = 26 sparse features ``cat_0`` .. ``cat_25``
(table ``t_cat_i`` each, sum pooling), D = 128.

    dense (B, 13) -> bottom MLP 13-512-256-128 -> (B, 128)
    kjt [cat_0 .. cat_25], multi-hot (up to MAX_IDS[f] ids) -> pooled (B, 26, 128)
    (B, 27 * 128) -> 3 low-rank (512) cross layers -> top MLP 1024-1024-512-256-1 -> (B, 1)

MLPerf's tables hold up to 40M rows (about 100 GB of fp32 in all). Each table's rows are
capped at ``max_rows`` (argument), else ``DLRMV2_MAX_ROWS`` (env var), default 20000, so the
model builds and trains on a small machine; ``0`` means MLPerf's full row counts. Tables
that would exceed ``META_ABOVE_BYTES`` in all are built on the ``meta`` device (nothing
allocated; ``DistributedModelParallel`` allocates only each rank's shards), so a full-size
model can still be sharded over enough ranks but cannot run unsharded.
"""
from __future__ import annotations

import os

import torch
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

__all__ = ["MAX_IDS", "MLPERF_MULTI_HOT", "MLPERF_ROWS", "NUM_DENSE", "make_model", "table_rows"]

NUM_DENSE = 13
EMBEDDING_DIM = 128
FEATURES = [f"cat_{i}" for i in range(26)]
# MLPerf DLRM-v2 (training v3.0+, Criteo 1TB multi-hot): rows per table ...
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956,
               405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000,
               590152, 12973, 108, 36]
# ... and ids per sample (multi-hot sizes).
MLPERF_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10,
                    3, 1, 1]
MAX_IDS: dict[str, int] = dict(zip(FEATURES, MLPERF_MULTI_HOT))
#: Criteo's features are anonymous: half declared user side, as the built-in DLRM's
#: C1..C13 (the load generator's split; the model does not care).
CONTEXT_FEATURES: tuple[str, ...] = tuple(FEATURES[:13])
DEFAULT_MAX_ROWS = 20_000
# Above this many bytes of fp32 tables, build them on meta (see the module docstring).
META_ABOVE_BYTES = 8 << 30


def table_rows(max_rows: int | None = None) -> list[int]:
    """Rows per table: MLPerf's, capped at ``max_rows`` / ``DLRMV2_MAX_ROWS`` (0 = no cap)."""
    if max_rows is None:
        raw = os.environ.get("DLRMV2_MAX_ROWS", "")
        try:
            max_rows = int(raw) if raw.strip() else DEFAULT_MAX_ROWS
        except ValueError:
            raise ValueError(f"DLRMV2_MAX_ROWS={raw!r} must be a whole number "
                             "(rows per table; 0 = MLPerf's full rows)") from None
    if max_rows < 0:
        raise ValueError(f"DLRMV2_MAX_ROWS / max_rows {max_rows} must be >= 0 (0 = no cap)")
    return [r if max_rows == 0 else min(r, max_rows) for r in MLPERF_ROWS]


def make_model(max_rows: int | None = None, device: str | torch.device | None = None) -> DLRM_DCN:
    """DLRM-v2; forward(dense (B, 13) float32, kjt of cat_0..cat_25) -> logits (B, 1).

    ``device`` places the tables (the MLPs are on CPU unless it is a real device); None =
    ``cpu``, or ``meta`` when the tables exceed ``META_ABOVE_BYTES``.
    """
    rows = table_rows(max_rows)
    if device is None:
        device = "meta" if sum(rows) * EMBEDDING_DIM * 4 > META_ABOVE_BYTES else "cpu"
    device = torch.device(device)
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=EMBEDDING_DIM, num_embeddings=n,
                                 feature_names=[f], pooling=PoolingType.SUM)
              for f, n in zip(FEATURES, rows)]
    ebc = EmbeddingBagCollection(tables=tables, device=device)
    return DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[512, 256, EMBEDDING_DIM],
        over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
        dcn_num_layers=3,
        dcn_low_rank_dim=512,
        dense_device=torch.device("cpu") if device.type == "meta" else device,
    )
