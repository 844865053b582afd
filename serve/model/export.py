"""Export a trained TorchRec DLRM into the serving artifact format (build side only).

The runtime (:mod:`serve.runtime.artifact`) defines the format and reads it; this module
reads TorchRec modules (duck-typed: ``sparse_arch.embedding_bag_collection``, FBGEMM TBEs)
and writes it, so the pod never needs TorchRec or this module.
"""
from __future__ import annotations

from typing import Any

import torch

from serve.errors import ArtifactError
from serve.runtime.artifact import (
    _SCALE_BIAS_BYTES,
    Artifact,
    QuantTable,
    quantize_rows_reference,
    row_bytes,
)

__all__ = ["artifact_from_float_dlrm", "artifact_from_quantized_dlrm"]


def _mlp_layers(state: dict[str, torch.Tensor], prefix: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # TorchRec names: dense_arch.model._mlp.{i}._linear.{weight,bias};
    # over_arch.model.0._mlp.{i}._linear.* then over_arch.model.1.{weight,bias}.
    weights = sorted(
        (k for k in state if k.startswith(prefix) and k.endswith(".weight")),
        key=lambda k: [int(p) if p.isdigit() else -1 for p in k[len(prefix):].split(".")],
    )
    return [(state[w].detach().float().contiguous().clone(),
             state[w[: -len("weight")] + "bias"].detach().float().contiguous().clone())
            for w in weights]


def _dense_layers(model: torch.nn.Module) -> tuple[list, list]:
    state = model.state_dict()
    return _mlp_layers(state, "dense_arch."), _mlp_layers(state, "over_arch.")


_TORCH_QDTYPE = {"int8": "INT8", "int4": "INT4", "fp16": "FP16"}


def artifact_from_quantized_dlrm(qmodel: Any, dtype: str,
                                 meta: dict[str, Any] | None = None) -> Artifact:
    """Convert a DLRM quantized by ``torchrec.inference.modules.quantize_inference_model``.

    Reads each table through the TBE's ``split_embedding_weights`` (FBGEMM layout:
    scale/bias first, then data, then padding) and drops the padding.
    """
    if dtype not in _TORCH_QDTYPE:
        raise ArtifactError(f"quantized dtype {dtype!r} not in {tuple(_TORCH_QDTYPE)}")
    qebc = qmodel.sparse_arch.embedding_bag_collection
    configs = qebc.embedding_bag_configs()
    split: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for tbe in qebc._emb_modules:  # one TBE per (dtype, device) group; tables in config order
        split.extend((w, sb) for w, sb, *_ in tbe.split_embedding_weights())
    if len(split) != len(configs):
        raise ArtifactError(f"{len(split)} quantized tables for {len(configs)} configs")
    tables: list[QuantTable] = []
    for cfg, (w, sb) in zip(configs, split):
        dim, rows = cfg.embedding_dim, cfg.num_embeddings
        out = torch.zeros((rows, row_bytes(dtype, dim)), dtype=torch.uint8)
        if dtype == "fp16":
            out[:, : 2 * dim] = w[:, : 2 * dim]
        else:
            if sb is None:
                raise ArtifactError(f"table {cfg.name}: no scale/bias in {dtype} weights")
            out[:, :_SCALE_BIAS_BYTES] = sb[:, :_SCALE_BIAS_BYTES]
            width = dim if dtype == "int8" else dim // 2
            out[:, _SCALE_BIAS_BYTES : _SCALE_BIAS_BYTES + width] = w[:, :width]
        tables.append(QuantTable(cfg.name, cfg.feature_names[0], rows, dim, dtype, out))
    dense, over = _dense_layers(qmodel)
    return Artifact([t.feature for t in tables], dense[0][0].shape[1], tables[0].dim, dtype,
                    tables, dense, over, dict(meta or {}))


def artifact_from_float_dlrm(model: Any, meta: dict[str, Any] | None = None,
                             dtype: str = "fp32") -> Artifact:
    """An fp32 (or plain-torch-quantized) artifact from an unquantized TorchRec DLRM."""
    ebc = model.sparse_arch.embedding_bag_collection
    tables = []
    for cfg in ebc.embedding_bag_configs():
        w = ebc.embedding_bags[cfg.name].weight.detach().float().cpu()
        tables.append(QuantTable(cfg.name, cfg.feature_names[0], cfg.num_embeddings,
                                 cfg.embedding_dim, dtype, quantize_rows_reference(w, dtype)))
    dense, over = _dense_layers(model)
    return Artifact([t.feature for t in tables], dense[0][0].shape[1], tables[0].dim, dtype,
                    tables, dense, over, dict(meta or {}))
