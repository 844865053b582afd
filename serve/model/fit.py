"""Train any TorchRec ranking model from a factory on generated data, sharded, and save a
``torch.distributed.checkpoint`` (the input of ``serve.model.importer``).

Shapes: B batch (global; B / W per rank), W world size (ranks), N dense features,
F sparse features (all features of all ``EmbeddingBagCollection`` s), D embedding dims.

Usage::

    python -m serve.model.fit --factory examples/own_ranker/model.py:make_model \
        --out build/ckpt [--world-size 2] [--steps 20] [--state-dict build/model.pt]

The model contract: ``FUNCTION()`` returns a ``torch.nn.Module`` (built on CPU or on
``meta``) whose ``forward(dense_features, sparse_features)`` takes float32 (B, N) and a
``torchrec.KeyedJaggedTensor`` and returns float logits (B,) or (B, 1), with its
embeddings in ``torchrec.EmbeddingBagCollection`` module(s) pooled by sum or mean. The
factory module may define ``NUM_DENSE`` (N; else ``--num-dense``) and
``MAX_IDS = {feature: n}`` (ids per sample drawn from 1..n; default 1).

Design:

* The parent loads the factory, builds the model once and checks the contract (EBCs,
  pooling, N, and, when no parameter is on ``meta``, a forward on a 4-row batch), so a
  wrong factory fails in one line (exit 2) before any rank starts.
* It spawns W ranks (gloo, 127.0.0.1 on a free port). Each seeds torch with ``--seed``
  (identical dense weights; DDP also broadcasts rank 0's), builds the model from the
  factory, plans every table ``table_wise`` (one of the sharding types TorchRec offers on
  CPU; a table lives whole on one rank) with ``EmbeddingShardingPlanner`` over a CPU
  ``Topology`` of W devices, and wraps it in ``DistributedModelParallel``. Embedding tables
  are updated by TorchRec's fused in-backward optimizer at ``--lr`` (``--optimizer
  adagrad``, the default: row-wise Adagrad; ``sgd``: exact SGD), the dense parameters by
  the torch optimizer of the same name at ``--dense-lr`` (``KeyedOptimizerWrapper``).
  Plain SGD at 0.05 barely moves the loss in 20 steps (0.696 -> 0.694 on own_ranker);
  Adagrad at 0.05 on the dense layers diverges on DLRM_DCN, hence the separate, smaller
  dense rate (0.01; DLRM-v2's wide layers need 0.001).
* Data (:class:`SyntheticData`) comes from the model's own ``EmbeddingBagConfig`` s. The
  KJT carries the features in :func:`feature_order`: EBCs in ``named_modules`` order,
  within one its tables in config order, within a table its ``feature_names`` in order,
  each name once (a feature read by two EBCs appears once). Per feature: lengths uniform in
  1..MAX_IDS[f], ids uniform (or Zipf, ``--ids zipf``) in [0, rows of its table). Dense
  float32 N(0, 1). Labels are Bernoulli(sigmoid(z)) of a fixed random logistic rule
  z = 2 (x . w) / sqrt(N) + sum_f c_f mean_ids s_f(id) - 0.3, with w, c_f from ``--seed``
  and s_f a fixed +-1 hash of the id: learnable from the dense part within a few steps.
  Batch ``(rank, step)`` is drawn from ``numpy.random.default_rng([seed, rank, step])``,
  so each rank trains its own slice, reproducibly.
* After training every rank runs the same fixed batch (``FIXED_BATCH_FILE``) through the
  sharded model in eval mode (the answer of the sharded model), then all ranks write
  ``dcp.save(dmp.state_dict(), checkpoint_id=DIR)``. DMP's state-dict keys are those of
  the unsharded model (it strips its own wrappers), tables as ``ShardedTensor`` s.
* With ``--state-dict FILE`` the parent, after the ranks end, merges the directory into a
  plain state dict (``dcp_to_torch_save``, then drops a leading ``module.`` if any), loads
  it with ``strict=True`` into the model it built from the factory, and (when that model is
  not on ``meta``) checks that its forward on the fixed batch equals the sharded logits
  (``merged_max_abs_diff`` in the summary).

Output directory (``--out``), written as ``DIR.tmp`` then renamed:

    .metadata, __{rank}_0.distcp   the checkpoint (one file per rank)
    fit.json                        summary: factory, features (KJT order), table -> rank,
                                    steps, losses, seconds
    fixed_batch.pt                  {"keys", "dense" (B, N), "values", "lengths" (F * B,),
                                     "logits" (B,)}: a fixed batch and the sharded logits

The last stdout line is JSON: {"checkpoint", "state_dict", "steps", "final_loss",
"world_size", ...}.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from serve.common.validate import positive_int
from serve.errors import ConfigError, ModelContractError, ServeError
from serve.model.ranks import settle, spawn_ranks

__all__ = [
    "FIT_FILE",
    "FIXED_BATCH_FILE",
    "FeatureSpec",
    "FitConfig",
    "ModelContractError",
    "SyntheticData",
    "check_forward",
    "embedding_bag_collections",
    "feature_order",
    "feature_specs",
    "fit",
    "load_factory",
    "main",
    "merge_state_dict",
    "plan_table_wise",
    "resolve_num_dense",
]

log = logging.getLogger(__name__)

FIT_FILE = "fit.json"
FIXED_BATCH_FILE = "fixed_batch.pt"
FIXED_BATCH_ROWS = 64
_FIXED_STREAM = 0xF1CED      # second word of the fixed batch's seed (not a rank number)
_RULE_STREAM = 0x1AB31       # second word of the label rule's seed
_ZIPF_ALPHA = 1.05
_ZIPF_PERMUTE_MAX = 1 << 21  # Zipf ids: hot ranks spread over the table up to this many rows
_ERROR_FILE = "error.txt"


# ----------------------------------------------------------------------------- config

@dataclass(frozen=True)
class FitConfig:
    """One ``serve.model.fit`` run."""

    factory: str                     # "FILE.py:FUNCTION"
    out_dir: Path
    world_size: int = 2
    steps: int = 20
    batch_size: int = 256            # global batch B, split evenly over the ranks
    seed: int = 0                    # weights, data and label rule
    lr: float = 0.05                 # embedding tables (fused optimizer)
    dense_lr: float = 0.01           # dense parameters (torch optimizer)
    optimizer: str = "adagrad"       # "adagrad" | "sgd"
    num_dense: int | None = None     # N; None: the factory module's NUM_DENSE
    state_dict: Path | None = None   # also write a merged plain state dict here
    ids: str = "uniform"             # "uniform" | "zipf"
    threads: int = 1                 # torch intra-op threads per rank
    log_every: int = 5

    def __post_init__(self) -> None:
        if ":" not in self.factory:
            raise ConfigError(f"--factory {self.factory!r} must be FILE.py:FUNCTION, e.g. "
                              "examples/own_ranker/model.py:make_model")
        for name in ("world_size", "steps", "threads", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.batch_size < self.world_size:
            raise ConfigError(f"--batch-size {self.batch_size} must be >= --world-size "
                              f"{self.world_size} (each rank takes batch-size / world-size rows)")
        if self.seed < 0:
            raise ConfigError(f"--seed {self.seed} must be >= 0")
        for flag, v in (("--lr", self.lr), ("--dense-lr", self.dense_lr)):
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{flag} {v} must be a positive number")
        if self.optimizer not in ("sgd", "adagrad"):
            raise ConfigError(f"--optimizer {self.optimizer!r} must be sgd or adagrad")
        if self.ids not in ("uniform", "zipf"):
            raise ConfigError(f"--ids {self.ids!r} must be uniform or zipf")
        if self.num_dense is not None and self.num_dense < 1:
            raise ConfigError(f"--num-dense {self.num_dense} must be >= 1")

    @property
    def local_batch(self) -> int:
        """Rows per rank and step: B / W (rounded down)."""
        return self.batch_size // self.world_size


# ----------------------------------------------------------------------------- factory

def load_factory(spec: str) -> tuple[Callable[[], torch.nn.Module], ModuleType]:
    """Import ``FILE.py:FUNCTION`` by path; return (the function, its module).

    Raises:
        ModelContractError: malformed spec, no such file, the file fails to import, or it
            has no callable FUNCTION.
    """
    path_s, sep, func = spec.rpartition(":")
    if not sep or not path_s or not func:
        raise ModelContractError(f"--factory {spec!r} must be FILE.py:FUNCTION, e.g. "
                                 "examples/own_ranker/model.py:make_model")
    path = Path(path_s).resolve()
    if not path.is_file():
        raise ModelContractError(f"--factory {spec!r}: no file {path_s} (from {os.getcwd()})")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"_fit_factory_{path.stem}_{digest}"
    module = sys.modules.get(mod_name)
    if module is None:
        mspec = importlib.util.spec_from_file_location(mod_name, path)
        if mspec is None or mspec.loader is None:
            raise ModelContractError(f"--factory {spec!r}: {path_s} is not a Python file")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module  # dataclasses and pickling look modules up by name
        try:
            mspec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise ModelContractError(f"--factory {spec!r}: importing {path_s} failed: "
                                     f"{type(e).__name__}: {_first_line(e)}") from e
    fn = getattr(module, func, None)
    if fn is None:
        raise ModelContractError(f"--factory {spec!r}: {path_s} defines no {func!r}")
    if not callable(fn):
        raise ModelContractError(f"--factory {spec!r}: {func!r} in {path_s} is not callable")
    return fn, module


def build_model(spec: str) -> tuple[torch.nn.Module, ModuleType]:
    """Call the factory; the model must be an ``nn.Module`` with at least one EBC."""
    fn, module = load_factory(spec)
    try:
        model = fn()
    except Exception as e:
        raise ModelContractError(f"--factory {spec!r}: calling it failed: "
                                 f"{type(e).__name__}: {_first_line(e)}") from e
    if not isinstance(model, torch.nn.Module):
        raise ModelContractError(f"--factory {spec!r} returned {type(model).__name__}, "
                                 "not a torch.nn.Module")
    if not embedding_bag_collections(model):
        raise ModelContractError(f"--factory {spec!r}: the model has no "
                                 "torchrec.EmbeddingBagCollection (embeddings must live in one)")
    return model, module


def resolve_num_dense(cfg_num_dense: int | None, module: ModuleType) -> int:
    """N: ``--num-dense``, else the factory module's ``NUM_DENSE``."""
    if cfg_num_dense is not None:
        return cfg_num_dense
    n = getattr(module, "NUM_DENSE", None)
    if n is None:
        raise ModelContractError("the number of dense features is unknown: pass --num-dense N "
                                 "or define NUM_DENSE = N in the factory's module")
    return positive_int("NUM_DENSE", n, then=" in the factory's module (or pass --num-dense N)",
                        error=ModelContractError)


# ----------------------------------------------------------------------------- features

@dataclass(frozen=True)
class FeatureSpec:
    """One KJT key: its table, the table's rows and dim, pooling and ids per sample."""

    name: str
    table: str
    rows: int
    dim: int
    pooling: str      # "SUM" | "MEAN"
    max_ids: int


def embedding_bag_collections(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Every ``EmbeddingBagCollection`` in ``model`` as (fqn, module), in named_modules order."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return [(n, m) for n, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)]


def feature_specs(model: torch.nn.Module, max_ids: dict[str, int] | None = None
                  ) -> list[FeatureSpec]:
    """The features the KJT must carry, in the trainer's order (see the module docstring).

    Raises:
        ModelContractError: a pooling other than sum/mean, a feature read from two tables
            of different rows, or ``MAX_IDS`` naming an unknown feature or a count < 1.
    """
    from torchrec.modules.embedding_configs import PoolingType

    max_ids = dict(max_ids or {})
    specs: dict[str, FeatureSpec] = {}
    for fqn, ebc in embedding_bag_collections(model):
        for cfg in ebc.embedding_bag_configs():
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ModelContractError(f"table {cfg.name!r} in {fqn or 'the model'} pools by "
                                         f"{cfg.pooling.name}; the contract allows SUM or MEAN")
            for f in cfg.feature_names:
                spec = FeatureSpec(f, cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim),
                                   cfg.pooling.name, 1)
                if f in specs and specs[f].rows != spec.rows:
                    raise ModelContractError(
                        f"feature {f!r} is read from tables of {specs[f].rows} and {spec.rows} "
                        "rows; one KJT key cannot serve both")
                specs.setdefault(f, spec)
    unknown = sorted(set(max_ids) - set(specs))
    if unknown:
        raise ModelContractError(f"MAX_IDS names {unknown}, which no EmbeddingBagCollection "
                                 f"reads; the features are {list(specs)}")
    out = []
    for f, s in specs.items():
        n = positive_int(f"MAX_IDS[{f!r}]", max_ids.get(f, 1), error=ModelContractError)
        out.append(dataclasses.replace(s, max_ids=n))
    return out


def feature_order(model: torch.nn.Module) -> list[str]:
    """The KJT keys in the order the trainer sends them (see the module docstring)."""
    return [s.name for s in feature_specs(model)]


def _max_ids(module: ModuleType) -> dict[str, int]:
    m = getattr(module, "MAX_IDS", None)
    if m is None:
        return {}
    if not isinstance(m, dict):
        raise ModelContractError(f"MAX_IDS in the factory's module is {type(m).__name__}; it "
                                 "must be a dict {feature name: max ids per sample}")
    return m


# ----------------------------------------------------------------------------- data

@dataclass
class Batch:
    """dense (B, N) float32, sparse KJT (F keys, lengths (F * B,)), labels (B,) float32."""

    dense: torch.Tensor
    sparse: Any
    labels: torch.Tensor


class SyntheticData:
    """Seeded batches for ``specs`` and ``num_dense`` features; see the module docstring."""

    def __init__(self, specs: Sequence[FeatureSpec], num_dense: int, seed: int,
                 ids: str = "uniform") -> None:
        if not specs:
            raise ConfigError("synthetic data needs at least one sparse feature")
        self.specs = list(specs)
        self.keys = [s.name for s in self.specs]
        self.num_dense = num_dense
        self.seed = seed
        self.ids = ids
        rule = np.random.default_rng([seed, _RULE_STREAM])
        self._w = rule.standard_normal(num_dense)                  # (N,)
        self._c = rule.uniform(-0.6, 0.6, len(self.specs))           # (F,)
        self._salt = rule.integers(1, 1 << 31, len(self.specs))       # (F,)
        self._zipf: dict[int, tuple[np.ndarray | None, np.ndarray | None]] = {}

    def _ids(self, rng: np.random.Generator, j: int, n: int) -> np.ndarray:
        rows = self.specs[j].rows
        if self.ids == "uniform":
            return rng.integers(0, rows, n, dtype=np.int64)
        from serve.common.zipf import id_permutation, zeta_cdf, zipf_ranks

        if j not in self._zipf:
            perm = id_permutation(self.seed, j, rows) if rows <= _ZIPF_PERMUTE_MAX else None
            self._zipf[j] = (zeta_cdf(rows, _ZIPF_ALPHA), perm)
        cdf, perm = self._zipf[j]
        ranks = zipf_ranks(rng, n, rows, _ZIPF_ALPHA, cdf)
        return perm[ranks] if perm is not None else ranks

    def _arrays(self, rng: np.random.Generator, b: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """dense (B, N) float32, values (nnz,) int64, lengths (F * B,) int64, labels (B,)."""
        dense = rng.standard_normal((b, self.num_dense)).astype(np.float32)
        z = 2.0 * (dense.astype(np.float64) @ self._w) / math.sqrt(self.num_dense) - 0.3
        values, lengths = [], []
        for j, s in enumerate(self.specs):
            ln = rng.integers(1, s.max_ids + 1, b, dtype=np.int64)
            ids = self._ids(rng, j, int(ln.sum()))
            sign = (((ids * 2654435761 + int(self._salt[j])) >> 13) & 1) * 2.0 - 1.0
            per_sample = np.add.reduceat(sign, np.concatenate([[0], np.cumsum(ln)[:-1]])) / ln
            z = z + self._c[j] * per_sample
            values.append(ids)
            lengths.append(ln)
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-z))).astype(np.float32)
        return dense, np.concatenate(values), np.concatenate(lengths), labels

    def _batch(self, rng: np.random.Generator, b: int) -> Batch:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        dense, values, lengths, labels = self._arrays(rng, b)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=self.keys,
                                                  values=torch.from_numpy(values),
                                                  lengths=torch.from_numpy(lengths))
        return Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))

    def batch(self, rank: int, step: int, b: int) -> Batch:
        """Rank ``rank``'s training batch number ``step`` of ``b`` rows."""
        return self._batch(np.random.default_rng([self.seed, rank, step]), b)

    def fixed_batch(self, b: int = FIXED_BATCH_ROWS) -> Batch:
        """The same ``b`` rows on every rank and run (for checks), unlike any training batch."""
        return self._batch(np.random.default_rng([self.seed, _FIXED_STREAM]), b)


# ----------------------------------------------------------------------------- contract

def check_output(out: Any, b: int) -> torch.Tensor:
    """The logits (B,) of a forward output; raises ModelContractError if it is not
    a float tensor of shape (B,) or (B, 1)."""
    if not isinstance(out, torch.Tensor):
        raise ModelContractError(f"forward returned {type(out).__name__}; the contract is a "
                                 "float tensor of logits (B,) or (B, 1)")
    if tuple(out.shape) not in ((b,), (b, 1)):
        raise ModelContractError(f"forward returned shape {tuple(out.shape)} for a batch of "
                                 f"{b}; the contract is logits ({b},) or ({b}, 1)")
    if not out.is_floating_point():
        raise ModelContractError(f"forward returned dtype {out.dtype}; logits must be float")
    return out.reshape(b)


def check_forward(model: torch.nn.Module, data: SyntheticData, b: int = 4) -> None:
    """Run ``model`` (unsharded, not on meta) on a ``b``-row batch in eval mode and check
    the output against the contract (the model's mode is restored)."""
    batch = data.fixed_batch(b)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(batch.dense, batch.sparse)
    except Exception as e:
        raise ModelContractError(
            f"forward(dense (B, {data.num_dense}) float32, KJT {data.keys}) failed: "
            f"{type(e).__name__}: {_first_line(e)}") from e
    finally:
        model.train(was_training)
    check_output(out, b)


def _on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


# ----------------------------------------------------------------------------- sharding

def plan_table_wise(model: torch.nn.Module, world_size: int, batch_size: int) -> Any:
    """A ``ShardingPlan`` placing every table of every EBC whole on one rank (CPU).

    ``batch_size`` is the per-rank batch (the planner's cost model). Raises ConfigError
    when the planner finds no placement.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {cfg.name: ParameterConstraints(sharding_types=["table_wise"])
                   for _, ebc in embedding_bag_collections(model)
                   for cfg in ebc.embedding_bag_configs()}
    topology = Topology(world_size=world_size, compute_device="cpu",
                        local_world_size=world_size)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints,
                                       batch_size=batch_size, debug=False)
    try:
        return planner.plan(model, [EmbeddingBagCollectionSharder()])
    except Exception as e:
        raise ConfigError(f"the TorchRec planner cannot place the tables table-wise on "
                          f"{world_size} CPU ranks: {type(e).__name__}: {_first_line(e)}") from e


def _table_ranks(plan: Any) -> dict[str, list[int]]:
    """{table: [ranks holding it]} from a plan (table-wise: one rank each)."""
    out: dict[str, list[int]] = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            out[table] = list(ps.ranks or [])
    return out


# ----------------------------------------------------------------------------- ranks

def _sharded(cfg: FitConfig, model: torch.nn.Module, plan: Any) -> tuple[Any, Any]:
    """DistributedModelParallel of ``model`` and its combined (fused + dense) optimizer."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    sparse_cls: Any = torch.optim.SGD if cfg.optimizer == "sgd" else RowWiseAdagrad
    sparse_kw: dict[str, Any] = {"lr": cfg.lr} if cfg.optimizer == "sgd" else {"lr": cfg.lr,
                                                                               "eps": 1e-8}
    for _, ebc in embedding_bag_collections(model):
        apply_optimizer_in_backward(sparse_cls, ebc.parameters(), sparse_kw)
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan)
    dense_cls: Any = torch.optim.SGD if cfg.optimizer == "sgd" else torch.optim.Adagrad
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opts: list[Any] = [dmp.fused_optimizer]
    if dense_params:
        opts.append(KeyedOptimizerWrapper(dense_params,
                                          lambda ps: dense_cls(ps, lr=cfg.dense_lr)))
    return dmp, CombinedOptimizer(opts)


def _rank_main(rank: int, world_size: int, cfg: FitConfig, tmp_dir: str, port: int) -> None:
    """One rank: build, shard, train, record the fixed batch, save its part of the DCP."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from serve.common.clilog import setup_cli_logging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    setup_cli_logging(f"%(asctime)s [rank{rank}] %(message)s", force=True)
    torch.set_num_threads(cfg.threads)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    try:
        _rank_body(rank, world_size, cfg, Path(tmp_dir), dist, dcp)
        settle(Path(tmp_dir), rank, world_size)
    except ModelContractError as e:  # every rank meets it at the same step: all stop
        if rank == 0:
            (Path(tmp_dir) / _ERROR_FILE).write_text(e.message)
        raise
    finally:
        dist.destroy_process_group()


def _rank_body(rank: int, world_size: int, cfg: FitConfig, tmp: Path, dist: Any,
               dcp: Any) -> None:
    torch.manual_seed(cfg.seed)
    model, module = build_model(cfg.factory)
    specs = feature_specs(model, _max_ids(module))
    data = SyntheticData(specs, resolve_num_dense(cfg.num_dense, module), cfg.seed, cfg.ids)
    plan = plan_table_wise(model, world_size, cfg.local_batch)
    log.info("rank %d: table -> ranks %s", rank, _table_ranks(plan))
    dmp, opt = _sharded(cfg, model, plan)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses: list[float] = []
    step_s: list[float] = []
    t_start = time.perf_counter()
    dmp.train()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        batch = data.batch(rank, step, cfg.local_batch)
        logits = check_output(dmp(batch.dense, batch.sparse), cfg.local_batch)
        loss = loss_fn(logits, batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
        step_s.append(time.perf_counter() - t0)
        if rank == 0 and (step == 0 or (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
            print(f"step {step + 1}/{cfg.steps} loss {losses[-1]:.4f} "
                  f"({step_s[-1]:.3f} s/step)", flush=True)
    train_s = time.perf_counter() - t_start
    fixed = data.fixed_batch()
    dmp.eval()
    with torch.no_grad():
        fixed_logits = check_output(dmp(fixed.dense, fixed.sparse), FIXED_BATCH_ROWS)
    dcp.save(dmp.state_dict(), checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        torch.save({"keys": list(fixed.sparse.keys()), "dense": fixed.dense,
                    "values": fixed.sparse.values(), "lengths": fixed.sparse.lengths(),
                    "logits": fixed_logits.detach().float()}, tmp / FIXED_BATCH_FILE)
        later = step_s[1:] or step_s
        meta = {
            "factory": cfg.factory, "world_size": world_size, "backend": "gloo",
            "steps": cfg.steps, "batch_size": cfg.local_batch * world_size,
            "seed": cfg.seed, "lr": cfg.lr, "dense_lr": cfg.dense_lr,
            "optimizer": cfg.optimizer, "ids": cfg.ids,
            "num_dense": data.num_dense,
            "features": [dataclasses.asdict(s) for s in specs],
            "sharding": "table_wise", "table_ranks": _table_ranks(plan),
            "first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
            "train_seconds": round(train_s, 3),
            "mean_step_seconds": round(sum(later) / len(later), 4),
        }
        (tmp / FIT_FILE).write_text(json.dumps(meta, indent=2))
    dist.barrier()


# ----------------------------------------------------------------------------- merge

def merge_state_dict(ckpt_dir: Path, out_file: Path) -> dict[str, torch.Tensor]:
    """Merge a DCP directory into a plain state dict file (keys without a ``module.``
    prefix); returns the state dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    raw = out_file.with_name(out_file.name + ".raw")
    dcp_to_torch_save(str(ckpt_dir), str(raw))
    state = torch.load(raw, map_location="cpu", weights_only=True)
    raw.unlink()
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    tmp = out_file.with_name(out_file.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out_file)
    return state


def _check_merged(model: torch.nn.Module, state: dict[str, torch.Tensor], ckpt: Path
                  ) -> float | None:
    """Strict-load ``state`` into ``model``; the max |merged - sharded| logit on the fixed
    batch, or None when the model is on meta (it cannot run unsharded)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    meta = _on_meta(model)
    try:
        model.load_state_dict(state, strict=True, assign=meta)
    except RuntimeError as e:
        raise ConfigError(f"the merged state dict does not load strictly into the factory's "
                          f"model: {_first_line(e)}") from e
    if meta:
        return None
    fixed = torch.load(ckpt / FIXED_BATCH_FILE, weights_only=True)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=fixed["keys"], values=fixed["values"],
                                              lengths=fixed["lengths"])
    model.eval()
    with torch.no_grad():
        out = check_output(model(fixed["dense"], kjt), fixed["dense"].shape[0])
    return float((out.float() - fixed["logits"]).abs().max())


# ----------------------------------------------------------------------------- driver

def fit(cfg: FitConfig) -> dict[str, Any]:
    """Check the factory, train over ``cfg.world_size`` spawned ranks, write ``cfg.out_dir``
    (and ``cfg.state_dict``); return the summary (the CLI's last JSON line)."""
    import torch.multiprocessing as mp

    from serve.common.net import free_port

    torch.manual_seed(cfg.seed)
    model, module = build_model(cfg.factory)
    specs = feature_specs(model, _max_ids(module))
    num_dense = resolve_num_dense(cfg.num_dense, module)
    data = SyntheticData(specs, num_dense, cfg.seed, cfg.ids)
    if not _on_meta(model):
        check_forward(model, data)
    plan_table_wise(model, cfg.world_size, cfg.local_batch)  # fails here, not in every rank
    print(f"fit: {cfg.factory}, {cfg.world_size} ranks (gloo, table-wise), {cfg.steps} steps "
          f"of {cfg.local_batch * cfg.world_size} rows, N={num_dense}, features "
          + ", ".join(f"{s.name}->{s.table}[{s.rows}x{s.dim},{s.pooling.lower()},"
                      f"<={s.max_ids}]" for s in specs), flush=True)
    out = Path(cfg.out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        spawn_ranks(_rank_main, (cfg.world_size, cfg, str(tmp), free_port()), cfg.world_size,
                    tmp)
    except mp.ProcessRaisedException as e:
        err = tmp / _ERROR_FILE
        msg = err.read_text() if err.is_file() else None
        shutil.rmtree(tmp, ignore_errors=True)
        if msg is not None:
            raise ModelContractError(msg) from None
        raise ConfigError(f"a training rank failed: {_last_line(str(e))}") from None
    except mp.ProcessExitedException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"a training rank exited with code {e.exit_code} "
                          "(killed, or out of memory?)") from None
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    meta = json.loads((out / FIT_FILE).read_text())
    summary: dict[str, Any] = {
        "checkpoint": str(out), "state_dict": None, "steps": meta["steps"],
        "final_loss": meta["final_loss"], "world_size": meta["world_size"],
        "first_loss": meta["first_loss"], "mean_step_seconds": meta["mean_step_seconds"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if cfg.state_dict is not None:
        sd_path = Path(cfg.state_dict)
        sd_path.parent.mkdir(parents=True, exist_ok=True)
        state = merge_state_dict(out, sd_path)
        summary["state_dict"] = str(sd_path)
        summary["merged_max_abs_diff"] = _check_merged(model, state, out)
    return summary


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else "(no message)"


def _last_line(s: str) -> str:
    lines = [ln for ln in s.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no message)"


# ----------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.fit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a TorchRec ranking model from a factory on generated data, sharded "
                    "table-wise over N gloo ranks on CPU with DistributedModelParallel, and "
                    "write a torch.distributed.checkpoint directory (the input of "
                    "serve.model.importer).",
        epilog="Model contract: FUNCTION() returns an nn.Module (CPU or meta) whose\n"
               "forward(dense (B, N) float32, KeyedJaggedTensor) returns logits (B,) or (B, 1),\n"
               "with its embeddings in torchrec EmbeddingBagCollection(s), sum or mean pooled.\n"
               "The factory's module may set NUM_DENSE = N and MAX_IDS = {feature: n}.\n"
               "The KJT carries every EBC feature once: EBCs in named_modules order, tables in\n"
               "config order, each table's feature_names in order.\n"
               "The last stdout line is JSON: checkpoint, state_dict, steps, final_loss, "
               "world_size.")
    ap.add_argument("--factory", required=True, metavar="FILE.py:FUNCTION",
                    help="Python file and the function in it that returns the model")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="checkpoint directory to write (replaced if it exists)")
    ap.add_argument("--world-size", type=int, default=2,
                    help="training ranks to spawn (gloo on 127.0.0.1; default 2)")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--batch-size", type=int, default=256,
                    help="global batch per step, split evenly over the ranks (default 256)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the weights, the generated data and the label rule (default 0)")
    ap.add_argument("--lr", type=float, default=0.05,
                    help="learning rate of the embedding tables (default 0.05)")
    ap.add_argument("--dense-lr", type=float, default=0.01,
                    help="learning rate of the dense parameters, MLPs etc. (default 0.01)")
    ap.add_argument("--optimizer", choices=("adagrad", "sgd"), default="adagrad",
                    help="adagrad (default): fused row-wise Adagrad for the tables, torch "
                         "Adagrad for dense; sgd: fused exact SGD and torch SGD (learns little "
                         "in 20 steps)")
    ap.add_argument("--num-dense", type=int, default=None, metavar="N",
                    help="dense features per sample (default: NUM_DENSE of the factory's module)")
    ap.add_argument("--state-dict", default=None, metavar="FILE",
                    help="also merge the checkpoint into a plain torch.save state dict FILE that "
                         "the factory's unsharded model loads with strict=True (checked, with its "
                         "logits compared with the sharded model's)")
    ap.add_argument("--ids", choices=("uniform", "zipf"), default="uniform",
                    help="distribution of the generated ids over each table's rows "
                         "(zipf: alpha 1.05; default uniform)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank; ranks x threads should not exceed the cores")
    ap.add_argument("--log-every", type=int, default=5, help="progress line every N steps")
    return ap


def config_from_args(args: argparse.Namespace) -> FitConfig:
    return FitConfig(factory=args.factory, out_dir=Path(args.out), world_size=args.world_size,
                     steps=args.steps, batch_size=args.batch_size, seed=args.seed, lr=args.lr,
                     dense_lr=args.dense_lr,
                     optimizer=args.optimizer, num_dense=args.num_dense,
                     state_dict=Path(args.state_dict) if args.state_dict else None,
                     ids=args.ids, threads=args.threads, log_every=args.log_every)


def main(argv: list[str] | None = None) -> int:
    from serve.common.clilog import setup_cli_logging

    args = _parser().parse_args(argv)
    setup_cli_logging()
    try:
        summary = fit(config_from_args(args))
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
