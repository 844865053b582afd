"""The dense part of a model (everything after pooling) in plain PyTorch.

Two kinds (:mod:`serve.runtime.artifact`): our built-in DLRM, numerically as TorchRec's
``DLRM`` (:class:`DenseDLRM`, written out so that the precision levers and CUDA graphs
apply), and any other model's layers as a ``torch.export`` program
(:class:`ExportedDenseModule`).

Shapes: B batch, F sparse features, D embedding dim, N dense features.

``DenseArch``: Linear+ReLU for every layer (N -> ... -> D).
``InteractionArch``: pairwise dot products of [dense_embedding, sparse_embeddings...],
upper triangle with offset 1, concatenated after the dense embedding.
``OverArch``: Linear+ReLU for every layer but the last, which gives the logit.
"""
from __future__ import annotations

import io

import torch
from torch import nn

from serve.constants import DENSE_PRECISIONS
from serve.errors import ConfigError
from serve.runtime.program_check import check_program

__all__ = ["PRECISIONS", "DenseDLRM", "ExportedDenseModule", "convert_precision"]

# "fp32" is exact against TorchRec; the others are lossy and opt-in (see RuntimeConfig).
PRECISIONS = DENSE_PRECISIONS


def _mlp(layers: list[tuple[torch.Tensor, torch.Tensor]], relu_last: bool) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i, (w, b) in enumerate(layers):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=True)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        mods.append(lin)
        if relu_last or i < len(layers) - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


class DenseDLRM(nn.Module):
    """Bottom MLP + interaction + top MLP; ``forward`` returns logits (B,).

    Args:
        dense_arch / over_arch: fp32 (weight (out, in), bias (out,)) per Linear layer.
        num_sparse: F.
    """

    def __init__(self, dense_arch: list[tuple[torch.Tensor, torch.Tensor]],
                 over_arch: list[tuple[torch.Tensor, torch.Tensor]], num_sparse: int) -> None:
        super().__init__()
        self.dense_arch = _mlp(dense_arch, relu_last=True)
        self.over_arch = _mlp(over_arch, relu_last=False)
        self.num_sparse = num_sparse
        tri = torch.triu_indices(num_sparse + 1, num_sparse + 1, offset=1)
        self.triu_flat: torch.Tensor
        self.register_buffer("triu_flat", tri[0] * (num_sparse + 1) + tri[1], persistent=False)
        d = dense_arch[-1][0].shape[0]
        want = d + num_sparse * (num_sparse + 1) // 2
        if over_arch[0][0].shape[1] != want:
            raise ConfigError(f"over_arch takes {over_arch[0][0].shape[1]} inputs but D={d} and "
                              f"F={num_sparse} give {want}; the artifact is inconsistent")

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor,
                expand: torch.Tensor | None = None) -> torch.Tensor:
        """dense (B, N) float32, sparse (B, F, D) (or (B, F*D)) float32 -> logits (B,) float32.

        ``expand`` int64 (B,): ``dense`` holds U distinct rows (U, N), and sample s's row
        is ``dense[expand[s]]``: the bottom MLP runs once per distinct row (a ranking
        request's shared dense vector), its output copied to the samples."""
        x = self.dense_arch(dense)                                     # (U or B, D)
        if expand is not None:
            x = x.index_select(0, expand)                              # (B, D)
        if sparse.dim() == 2:
            sparse = sparse.view(sparse.shape[0], self.num_sparse, -1)
        combined = torch.cat((x.unsqueeze(1), sparse.to(x.dtype)), 1)  # (B, F+1, D)
        inter = torch.bmm(combined, combined.transpose(1, 2))          # (B, F+1, F+1)
        flat = inter.flatten(1).index_select(1, self.triu_flat)        # (B, F(F+1)/2)
        logits: torch.Tensor = self.over_arch(torch.cat((x, flat), 1))
        return logits.squeeze(1).float()


class ExportedDenseModule(nn.Module):
    """Any model's layers after pooling, from its ``torch.export`` program bytes
    (:class:`serve.runtime.artifact.ExportedDense`), loaded with stock PyTorch.

    ``forward(dense (B, N), pooled (B, sum_f D_f) or (B, F, D)) -> logits (B,)``.

    ``precision`` "bf16" casts the program's weights and its inputs to bfloat16 (the
    lossy lever an import admits only through its check, ``--dense-precision``); the
    logits come back float32 either way. "int8" is not offered for an exported program.

    Raises ArtifactError before ``torch.export.load`` when the program's archive holds a
    pickled payload (:func:`serve.runtime.program_check.check_program`).
    """

    def __init__(self, program: torch.Tensor, device: torch.device,
                 precision: str = "fp32") -> None:
        super().__init__()
        if precision not in ("fp32", "bf16"):
            raise ConfigError(f"dense_precision {precision!r}: an exported dense part runs in "
                              "fp32 or bf16 only")
        check_program(program)   # pickled payloads refused before torch unpickles them
        ep = torch.export.load(io.BytesIO(program.numpy().tobytes()))
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.program = ep.module().to(device=device, dtype=self.dtype)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if pooled.dim() == 3:
            pooled = pooled.reshape(pooled.shape[0], -1)
        out: torch.Tensor = self.program(dense.to(self.dtype), pooled.to(self.dtype))
        return out.reshape(-1).float()


def convert_precision(model: DenseDLRM, precision: str, device: torch.device) -> nn.Module:
    """Apply a (lossy) CPU/GPU lever to the dense part; "fp32" returns it unchanged."""
    if precision not in PRECISIONS:
        raise ConfigError(f"dense_precision {precision!r} is not one of {PRECISIONS}")
    if precision == "bf16":
        return model.to(torch.bfloat16)
    if precision == "int8":
        if device.type != "cpu":
            raise ConfigError("dense_precision 'int8' (dynamic quantization) runs on CPU only; "
                              "use 'fp32' or 'bf16' on CUDA")
        from torch.ao.quantization import quantize_dynamic

        # torch ships quantize_dynamic without annotations.
        quantized: nn.Module = quantize_dynamic(  # type: ignore[no-untyped-call]
            model, {nn.Linear}, dtype=torch.qint8)
        return quantized
    return model
