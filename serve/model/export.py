"""A TorchRec model into the serving artifact (build side only; the pod never imports it).

The runtime (:mod:`serve.runtime.artifact`) defines the format and reads it; this module
reads TorchRec modules and writes it:

* :func:`model_schema`: the request schema from the model's ``EmbeddingBagCollection``
  modules (every one found, in ``named_modules`` order; in each, its tables in config
  order and each table's features in order: the order of the KeyedTensor it returns);
* :func:`quantize_for_serving`: TorchRec's own ``quantize_inference_model`` with each
  table's dtype, on a copy;
* :func:`tables_from_quantized`: the quantized rows of every table, read from the FBGEMM
  TBEs by table name (TBEs group tables by dtype, so their order is not the config's);
* :func:`export_dense`: the model after pooling as a ``torch.export`` program, made by
  swapping each collection for a stub that returns its slice of a pooled input;
* :func:`dlrm_dense`: TorchRec ``DLRM``'s layers as plain weights (the runtime's own fast
  :class:`serve.runtime.dense.DenseDLRM`).

Shapes: B batch, N dense features, F sparse features, D_f the dim of feature f's table.
"""
from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from serve.errors import ArtifactError, ConfigError
from serve.rowformat import SCALE_BIAS_BYTES as _SCALE_BIAS_BYTES
from serve.runtime.artifact import (
    Artifact,
    DLRMDense,
    ExportedDense,
    QuantTable,
    quantize_rows_reference,
    row_bytes,
)
from serve.schema import DEFAULT_MAX_IDS, FeatureSpec, ModelSchema, TableSpec

__all__ = ["TORCH_DTYPES", "artifact_from_float_dlrm", "artifact_from_quantized_dlrm",
           "collections", "dlrm_dense", "export_dense", "foreign_ops", "is_torchrec_dlrm",
           "model_schema",
           "pooled_reference", "quantize_for_serving", "tables_from_quantized"]

#: Our table dtypes as ``quantize_inference_model`` takes them (per table).
TORCH_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "int4": torch.quint4x2,
                                        "fp16": torch.float16, "fp32": torch.float32}
#: Largest batch the exported program is traced for (its batch dimension is symbolic).
MAX_EXPORT_BATCH = 1 << 20


def collections(model: nn.Module) -> list[tuple[str, Any]]:
    """Every embedding-bag collection of ``model`` (float or quantized), in
    ``named_modules`` order, as (qualified name, module)."""
    return [(n, m) for n, m in model.named_modules()
            if n and callable(getattr(m, "embedding_bag_configs", None))]


def _pooling(cfg: Any) -> str:
    name = getattr(cfg.pooling, "name", str(cfg.pooling)).lower()
    if name not in ("sum", "mean"):
        raise ConfigError(f"table {cfg.name}: pooling {name!r} is not served; the contract "
                          "takes sum or mean pooling")
    return name


def model_schema(model: nn.Module, num_dense: int, *, dtype: str = "int8",
                 table_dtypes: Mapping[str, str] | None = None,
                 max_ids: Mapping[str, int] | None = None,
                 default_max_ids: int = DEFAULT_MAX_IDS) -> ModelSchema:
    """The schema of a TorchRec model: its collections' tables and features.

    Args:
        num_dense: N, dense features the model's forward takes.
        dtype: the stored dtype of every table not named in ``table_dtypes``.
        max_ids: most ids per instance, per feature (others: ``default_max_ids``).
    Raises:
        ConfigError: no collection, an unknown table or feature named in the options, a
            pooling other than sum/mean, names that clash.
    """
    table_dtypes = dict(table_dtypes or {})
    max_ids = dict(max_ids or {})
    found = collections(model)
    if not found:
        seq = [n for n, m in model.named_modules() if type(m).__name__ == "EmbeddingCollection"]
        raise ConfigError("the model has no torchrec EmbeddingBagCollection"
                          + (f" (sequence EmbeddingCollection at {seq} is out of scope)"
                             if seq else "") + "; the contract keeps embeddings in "
                          "EmbeddingBagCollection modules")
    tables: list[TableSpec] = []
    features: list[FeatureSpec] = []
    for _, ebc in found:
        for cfg in ebc.embedding_bag_configs():
            tables.append(TableSpec(cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim),
                                    _pooling(cfg), table_dtypes.pop(cfg.name, dtype)))
            features.extend(FeatureSpec(f, cfg.name, int(max_ids.pop(f, default_max_ids)))
                            for f in cfg.feature_names)
    if table_dtypes:
        raise ConfigError(f"--table-dtype names tables {sorted(table_dtypes)} that the model "
                          f"does not have; its tables: {[t.name for t in tables]}")
    if max_ids:
        raise ConfigError(f"max ids are given for features {sorted(max_ids)} that the model "
                          f"does not have; its features: {[f.name for f in features]}")
    return ModelSchema(num_dense, tuple(tables), tuple(features))


def quantize_for_serving(model: nn.Module, schema: ModelSchema) -> nn.Module:
    """TorchRec's ``quantize_inference_model`` on a deep copy, each table in its dtype."""
    from torchrec.inference.modules import quantize_inference_model

    per_table = {t.name: TORCH_DTYPES[t.dtype] for t in schema.tables}
    q = quantize_inference_model(copy.deepcopy(model), per_table_weight_dtype=per_table)
    return q.eval()


def tables_from_quantized(qmodel: nn.Module, schema: ModelSchema) -> list[QuantTable]:
    """Each table's rows in our row format, read from its FBGEMM TBE (FBGEMM's layout:
    scale/bias kept apart by ``split_embedding_weights``, rows padded: padding dropped)."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for _, qebc in collections(qmodel):
        for tbe in getattr(qebc, "_emb_modules", []):
            names = [spec[0] for spec in tbe.embedding_specs]
            for name, (w, sb, *_) in zip(names, tbe.split_embedding_weights(), strict=True):
                weights[name] = (w, sb)
    out: list[QuantTable] = []
    for spec in schema.tables:
        if spec.name not in weights:
            raise ArtifactError(f"table {spec.name}: not found in the quantized model's TBEs "
                                f"({sorted(weights)})")
        w, sb = weights[spec.name]
        dim, dtype = spec.dim, spec.dtype
        rows = torch.zeros((spec.rows, row_bytes(dtype, dim)), dtype=torch.uint8)
        if dtype in ("fp16", "fp32"):
            width = (2 if dtype == "fp16" else 4) * dim
            rows[:, :width] = w[:, :width]
        else:
            if sb is None:
                raise ArtifactError(f"table {spec.name}: no scale/bias in {dtype} weights")
            rows[:, :_SCALE_BIAS_BYTES] = sb[:, :_SCALE_BIAS_BYTES]
            width = dim if dtype == "int8" else dim // 2
            rows[:, _SCALE_BIAS_BYTES : _SCALE_BIAS_BYTES + width] = w[:, :width]
        out.append(QuantTable(spec.name, spec.rows, dim, dtype, rows))
    return out


class _PooledStub(nn.Module):
    """Stands in for one collection in the exported program: returns a KeyedTensor of its
    features over ``pooled`` (B, sum of its features' dims), set just before the call."""

    def __init__(self, keys: list[str], dims: list[int]) -> None:
        super().__init__()
        self.keys_ = keys
        self.dims = dims
        self.pooled: torch.Tensor | None = None

    def forward(self, features: Any) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        return KeyedTensor(keys=self.keys_, length_per_key=self.dims, values=self.pooled)


class _AfterPooling(nn.Module):
    """``forward(dense (B, N), pooled (B, sum_f D_f)) -> logits (B,)``: the model with each
    collection replaced by a :class:`_PooledStub` over its slice of ``pooled``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._slices: list[tuple[_PooledStub, int, int]] = []
        lo = 0
        for name, ebc in collections(model):
            keys: list[str] = []
            dims: list[int] = []
            for cfg in ebc.embedding_bag_configs():
                keys.extend(cfg.feature_names)
                dims.extend([int(cfg.embedding_dim)] * len(cfg.feature_names))
            stub = _PooledStub(keys, dims)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, stub)
            self._slices.append((stub, lo, lo + sum(dims)))
            lo += sum(dims)
        self.width = lo

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        for stub, a, b in self._slices:
            stub.pooled = pooled[:, a:b]
        return self.model(dense, None).reshape(-1)


#: Operator namespaces a stock PyTorch runs (the pod has no FBGEMM, no TorchRec).
STOCK_OP_NAMESPACES = frozenset(("aten", "prims"))


@contextlib.contextmanager
def _plain_regroup() -> Iterator[None]:
    """While tracing: ``KeyedTensor.regroup``'s fast path (an FBGEMM operator the pod
    cannot load) replaced by TorchRec's own plain-torch path (split + cat, same values)."""
    import torchrec.sparse.jagged_tensor as jt

    fast = jt._fbgemm_permute_pooled_embs
    jt._fbgemm_permute_pooled_embs = jt._regroup_keyed_tensors
    try:
        yield
    finally:
        jt._fbgemm_permute_pooled_embs = fast


def foreign_ops(program: torch.export.ExportedProgram) -> list[str]:
    """Operators of ``program`` that stock PyTorch does not provide (e.g. ``fbgemm.*``),
    by name, sorted: the pod could not load the program."""
    out = set()
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            if t.namespace not in STOCK_OP_NAMESPACES:
                out.add(str(t))
        elif isinstance(t, torch._ops.HigherOrderOperator):
            out.add(t.name())
        elif getattr(t, "__module__", None) not in ("_operator", "operator", "builtins"):
            out.add(getattr(t, "__qualname__", repr(t)))
    return sorted(out)


def export_dense(model: nn.Module, schema: ModelSchema) -> ExportedDense:
    """The model after pooling as serialized ``torch.export`` bytes, batch dim symbolic.

    Raises:
        ConfigError: the model cannot be traced this way, typically because its forward
            reads the KeyedJaggedTensor outside its collections (it receives None here);
            or the traced program calls operators stock PyTorch lacks (the pod has no
            FBGEMM or TorchRec).
    """
    after = _AfterPooling(copy.deepcopy(model)).eval()
    if after.width != schema.pooled_dim:
        raise ArtifactError(f"the collections pool {after.width} values per sample, the "
                            f"schema {schema.pooled_dim}")
    batch = torch.export.Dim("B", min=1, max=MAX_EXPORT_BATCH)
    example = (torch.zeros(2, schema.dense), torch.zeros(2, schema.pooled_dim))
    try:
        with torch.no_grad(), _plain_regroup():
            program = torch.export.export(after, example, dynamic_shapes=({0: batch}, {0: batch}),
                                          strict=False)
    except Exception as e:
        raise ConfigError(
            f"the model's layers after pooling do not export with torch.export "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the contract: "
            "forward(dense (B, N) float32, sparse KeyedJaggedTensor) uses the "
            "KeyedJaggedTensor only through its EmbeddingBagCollection modules, and "
            "returns logits (B,) or (B, 1)") from e
    foreign = foreign_ops(program)
    if foreign:
        raise ConfigError(
            f"the model's layers after pooling call {foreign}, which stock PyTorch does not "
            "provide; the pod runs them without FBGEMM or TorchRec. Use plain torch "
            "operations after the EmbeddingBagCollections (KeyedTensor.regroup, to_dict() "
            "and values() are fine)")
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return ExportedDense(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))


def is_torchrec_dlrm(model: nn.Module) -> bool:
    """Exactly TorchRec's plain ``DLRM`` (not a subclass such as ``DLRM_DCN``)."""
    try:
        from torchrec.models.dlrm import DLRM
    except ImportError:  # pragma: no cover - the build always has TorchRec
        return False
    return type(model) is DLRM


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


def dlrm_dense(model: nn.Module) -> DLRMDense:
    """TorchRec ``DLRM``'s bottom and top MLPs as plain fp32 weights."""
    state = model.state_dict()
    return DLRMDense(_mlp_layers(state, "dense_arch."), _mlp_layers(state, "over_arch."))


def pooled_reference(model: nn.Module, kjt: Any) -> torch.Tensor:
    """(B, sum_f D_f): each collection's pooled output, in schema order (for checks)."""
    return torch.cat([ebc(kjt).values() for _, ebc in collections(model)], dim=1)


def artifact_from_quantized_dlrm(qmodel: Any, dtype: str,
                                 meta: dict[str, Any] | None = None) -> Artifact:
    """Our built-in DLRM quantized by ``quantize_inference_model``: one table per feature."""
    if dtype not in TORCH_DTYPES:
        raise ArtifactError(f"quantized dtype {dtype!r} not in {tuple(TORCH_DTYPES)}")
    configs = qmodel.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    dense = dlrm_dense(qmodel)
    schema = ModelSchema(
        int(dense.dense_arch[0][0].shape[1]),
        tuple(TableSpec(c.name, c.num_embeddings, c.embedding_dim, "sum", dtype) for c in configs),
        tuple(FeatureSpec(c.feature_names[0], c.name, DEFAULT_MAX_IDS) for c in configs))
    tables = tables_from_quantized(qmodel, schema)
    return Artifact(schema, tables, dense, dict(meta or {}))


def artifact_from_float_dlrm(model: Any, meta: dict[str, Any] | None = None,
                             dtype: str = "fp32") -> Artifact:
    """An fp32 (or plain-torch-quantized) artifact from an unquantized TorchRec DLRM."""
    ebc = model.sparse_arch.embedding_bag_collection
    tables = []
    for cfg in ebc.embedding_bag_configs():
        w = ebc.embedding_bags[cfg.name].weight.detach().float().cpu()
        tables.append(QuantTable(cfg.name, cfg.num_embeddings, cfg.embedding_dim, dtype,
                                 quantize_rows_reference(w, dtype)))
    dense = dlrm_dense(model)
    feats = [c.feature_names[0] for c in ebc.embedding_bag_configs()]
    return Artifact.dlrm(feats, dense.dense_arch[0][0].shape[1], dtype, tables,
                         dense.dense_arch, dense.over_arch, dict(meta or {}))
