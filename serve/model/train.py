"""Sharded DLRM training with TorchRec ``DistributedModelParallel``, and its checkpoint.

Shapes: B batch (per rank), F = 26 sparse features, D embedding dim, N = 13 dense.

Each rank holds its shards of the embedding tables (explicit plan, see
:func:`serve.model.sharding.plan_sharding`) and a replica of the dense MLPs (data
parallel). Embeddings are updated by a fused row-wise Adagrad inside the backward pass;
the MLPs by Adam.

Output directory (``--out``), written atomically (``DIR.tmp`` then rename):

    .metadata, __{rank}_0.distcp   torch.distributed.checkpoint, one file per rank
    plan.json                       world size, backend, table -> sharding type, shards
    sharded_outputs.pt              a fixed eval batch and the sharded model's logits
                                    on it, so ``serve.model.merge`` can prove it is exact
    changed_rows.npz                (--resume only) per feature name, int64 sorted unique
                                    rows the training touched (rows in any rank's
                                    batches); plan.json "changed_rows" counts them
    admission.npz                   (managed id spaces only) the admission state after
                                    this data's day (:mod:`serve.model.admission`)

Ids to rows: the sharded tables train on **rows**, not raw ids (:class:`RowMapper`). A
modulo table reads row ``id % rows`` (what the runtime serves; on day-0 data every id is
< rows, so this is the identity and day-0 training is unchanged); a managed table
(``TrainConfig.admission`` set) reads the row its id map gives, and ids not admitted read
the fallback row 0, which thereby learns the "unknown id" embedding. The maps come from
the admission state: a new one (or ``admission_from``'s, for a delta) observes the whole
training split of the data's day and decides; every rank computes the same state (it reads
the whole split, deterministically) and rank 0 saves it next to the checkpoint. The fixed
merge-check batch is mapped the same way.

Continued training (``--resume CKPT_DIR``): every rank builds the sharded model as
usual, then reads the checkpoint's weights into its own shards
(``torch.distributed.checkpoint.load`` into ``dmp.state_dict()``, then
``load_state_dict``) and trains on ``--data`` from there. The world size must be the
checkpoint's (plan.json). Optimizer state is not restored: Adagrad's accumulators
start fresh. ``--sparse-only`` (needs ``--resume``) steps only the embedding optimizer:
the dense MLPs are bit-identical to the checkpoint's, so the only change is embedding
rows, exactly those listed in changed_rows.npz (what ``serve.model.delta`` ships).

Launch: by default this command spawns ``--nproc`` local ranks itself on a free
loopback port. Under ``torchrun`` (RANK/WORLD_SIZE set) it runs as one of its ranks, so
multi-node is::

    torchrun --nnodes 2 --node-rank {0|1} --nproc-per-node 2 \
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        -m serve.model.train --profile small --data DIR --out CKPT_DIR

with DIR readable and CKPT_DIR writable (shared filesystem) on every node.

Label shuffle (``--label-shuffle``, :func:`shuffled_labels`): trains a deliberately bad
model on the same click logs. The labels of the **training split only** are permuted
(the row order, dense features and ids stay as they are) by a permutation drawn from a
generator seeded with the training seed, so the labels become independent of the
features while keeping their exact multiset (same CTR). The eval split, its labels and
the fixed merge-check batch are untouched, so the model's AUC on eval is about 0.5. Every
rank computes the same permutation of the whole split (same seed, same file) and then
reads its own batches of it, exactly as without shuffle (rank r takes global batches r,
r + N, r + 2N, ...), so the ranks together see one consistent permuted data set.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve.common.clilog import setup_cli_logging
from serve.common.net import free_port
from serve.common.validate import boolean
from serve.errors import CheckpointError, ConfigError, ServeError, ShardingError
from serve.model.admission import AdmissionConfig
from serve.model.data import ClickLogDataset
from serve.model.ranks import settle, spawn_ranks
from serve.model.sharding import format_plan, plan_sharding
from serve.profiles import NUM_DENSE, PROFILES, Profile, get_profile

__all__ = [
    "CHANGED_ROWS_FILE",
    "OUTPUTS_FILE",
    "PLAN_FILE",
    "RowMappedDataset",
    "RowMapper",
    "ShuffledLabelDataset",
    "TrainConfig",
    "label_permutation",
    "load_changed_rows",
    "main",
    "managed_state",
    "shuffled_labels",
    "train",
    "train_dataset",
]

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
OUTPUTS_FILE = "sharded_outputs.pt"
CHANGED_ROWS_FILE = "changed_rows.npz"
# Second word of the label permutation's seed: its stream is [training seed, this tag], so
# it is unrelated to any other use of the training seed (torch.manual_seed for weights).
_LABEL_SHUFFLE_STREAM = 0x1ABE15


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``None`` fields take the profile's value."""

    profile: Profile
    data_dir: Path
    out_dir: Path
    nproc: int = 2
    backend: str = "auto"            # "auto" (nccl with CUDA, else gloo) | "gloo" | "nccl"
    batch_size: int | None = None    # global batch (split evenly over ranks)
    learning_rate: float | None = None   # embeddings (row-wise Adagrad)
    dense_learning_rate: float = 3e-3    # MLPs (Adam)
    epochs: int | None = None
    max_steps: int | None = None
    num_workers: int = 1             # DataLoader workers per rank
    threads: int = 1                 # torch intra-op threads per rank
    eval_batch: int = 512            # rows of the fixed batch saved for the merge check
    log_every: int = 50
    seed: int | None = None          # initial weights (None: the profile's seed)
    # Permute the training labels (seeded by resolved_seed): a model with eval AUC ~0.5.
    label_shuffle: bool = False
    # Continued training: start from this checkpoint's weights (same world size).
    resume_from: Path | None = None
    # Step only the embedding optimizer (needs resume_from): the MLPs stay bit-identical.
    sparse_only: bool = False
    # Managed id spaces (every table): the policy; None = modulo (row = id % rows).
    admission: AdmissionConfig | None = None
    # Managed: continue this admission.npz (a delta) instead of starting empty.
    admission_from: Path | None = None

    def __post_init__(self) -> None:
        boolean("sparse_only", self.sparse_only)
        if self.sparse_only and self.resume_from is None:
            raise ConfigError("--sparse-only without --resume would train embeddings against "
                              "randomly initialised MLPs that never learn; pass --resume "
                              "CKPT_DIR (the checkpoint to continue from) or drop --sparse-only")
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"--seed {self.seed} must be >= 0")
        boolean("label_shuffle", self.label_shuffle,
                then="; pass --label-shuffle to permute the training labels, or omit it")
        if self.nproc < 1:
            raise ConfigError(f"--nproc {self.nproc} must be >= 1")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"--backend {self.backend!r} must be one of auto, gloo, nccl")
        for name in ("batch_size", "epochs", "max_steps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {v} must be >= 1")
        if self.admission_from is not None and self.admission is None:
            raise ConfigError("admission_from (a previous admission.npz) needs a managed id "
                              "space: pass the admission policy too")
        if self.threads < 1 or self.num_workers < 0 or self.eval_batch < 1:
            raise ConfigError("--threads and --eval-batch must be >= 1, --workers >= 0")

    @property
    def global_batch(self) -> int:
        return self.batch_size or self.profile.batch_size

    @property
    def resolved_seed(self) -> int:
        return self.profile.seed if self.seed is None else self.seed

    @property
    def lr(self) -> float:
        return self.learning_rate if self.learning_rate is not None else self.profile.learning_rate

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"


# ----------------------------------------------------------------------------- labels

def label_permutation(n: int, seed: int) -> np.ndarray:
    """The permutation of ``n`` training rows that ``--label-shuffle`` applies: int64 (n,).

    Drawn from ``numpy.random.default_rng([seed, tag])`` (a stream of its own), so it is the
    same in every process for the same ``n`` and ``seed``, and differs between seeds.

    Raises:
        ConfigError: ``n`` or ``seed`` is negative.
    """
    if n < 0:
        raise ConfigError(f"label permutation of {n} rows: the row count must be >= 0 "
                          "(pass the number of training rows)")
    if seed < 0:
        raise ConfigError(f"label permutation seed {seed} must be >= 0; "
                          "pass --seed S with S >= 0")
    return np.random.default_rng([seed, _LABEL_SHUFFLE_STREAM]).permutation(n)


def shuffled_labels(labels: np.ndarray, seed: int) -> np.ndarray:
    """``labels[label_permutation(len(labels), seed)]``: row i gets the label of row perm[i].

    A true permutation: the same multiset of labels (same CTR), only no longer tied to
    the rows' features. Returns a new in-memory array; ``labels`` (a memmap) is unchanged.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ConfigError(f"labels have shape {labels.shape}; expected one label per row (n,)")
    return labels[label_permutation(int(labels.shape[0]), seed)]


class ShuffledLabelDataset(ClickLogDataset):
    """The **training** split with its labels permuted by :func:`shuffled_labels`.

    Rows, batches and the rank split are those of :class:`ClickLogDataset` (rank r takes
    global batches r, r + world_size, ...); only the labels differ. The permutation spans
    the whole split and is computed identically on every rank from ``seed``, so batch b
    has the same (shuffled) labels whichever rank reads it. The eval split cannot be
    shuffled: evaluation must measure the model against the true labels.
    """

    def __init__(self, data_dir: str | os.PathLike, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False,
                 limit: int | None = None) -> None:
        super().__init__(data_dir, "train", batch_size, rank=rank, world_size=world_size,
                         drop_last=drop_last, limit=limit)
        self.seed = seed
        self.labels = shuffled_labels(self._data().labels, seed)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        dense, ids, lengths, _ = super().__getitem__(i)
        b = self.batches[i]
        lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self.rows)
        return dense, ids, lengths, torch.from_numpy(self.labels[lo:hi].astype(np.float32))


def train_dataset(cfg: TrainConfig, batch_size: int, rank: int = 0,
                  world_size: int = 1) -> ClickLogDataset:
    """This rank's training batches (raw ids): labels permuted when ``cfg.label_shuffle``.
    Training reads them through :class:`RowMappedDataset`."""
    if cfg.label_shuffle:
        return ShuffledLabelDataset(cfg.data_dir, batch_size, cfg.resolved_seed, rank=rank,
                                    world_size=world_size, drop_last=True)
    return ClickLogDataset(cfg.data_dir, "train", batch_size, rank=rank,
                           world_size=world_size, drop_last=True)


# ----------------------------------------------------------------------------- ids -> rows

class RowMapper:
    """Raw ids to table rows, per feature (the built-in DLRM: feature j reads table j).

    ``rows``: each feature's table rows; ``id_maps``: feature index -> its table's
    :class:`serve.runtime.idmap.IdMap` for managed tables (others: ``id % rows``, as the
    runtime serves modulo tables). Picklable (DataLoader workers get a copy).
    """

    def __init__(self, rows: tuple[int, ...] | list[int], id_maps: dict[int, Any] | None = None
                 ) -> None:
        self.rows = tuple(int(r) for r in rows)
        self.id_maps = dict(id_maps or {})

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 (B, F, M) -> rows int64 (B, F, M); padding positions map too (they
        are never read)."""
        out = torch.empty_like(ids)
        for j, rows in enumerate(self.rows):
            col = ids[:, j, :]
            m = self.id_maps.get(j)
            out[:, j, :] = (col % rows if m is None
                            else m.lookup(col.reshape(-1).contiguous()).reshape(col.shape))
        return out


class RowMappedDataset(torch.utils.data.Dataset):
    """A :class:`serve.model.data.ClickLogDataset` (or subclass) whose items carry rows
    instead of raw ids (same items otherwise: dense, rows (B, F, M), lengths, labels)."""

    def __init__(self, inner: ClickLogDataset, mapper: RowMapper) -> None:
        self.inner, self.mapper = inner, mapper
        self.feature_names = inner.feature_names
        self.rows, self.batch_size, self.batches = inner.rows, inner.batch_size, inner.batches

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        dense, ids, lengths, labels = self.inner[i]
        return dense, self.mapper(ids), lengths, labels


def managed_state(cfg: TrainConfig) -> Any:
    """The admission state after the data's day (managed builds; None for modulo): the
    previous state (``admission_from``) or a new one for the profile's tables, which
    observes the whole training split and decides. Deterministic: every rank gets the same.

    Raises:
        ConfigError: the previous state is unreadable, names other tables, or has already
            seen this day.
    """
    if cfg.admission is None:
        return None
    from serve.model.admission import AdmissionState, load_state, observe_split

    p = cfg.profile
    tables = dict(zip(p.table_names, p.cardinalities, strict=True))
    if cfg.admission_from is not None:
        state = load_state(cfg.admission_from)
        if {n: t.rows for n, t in state.tables.items()} != tables:
            raise ConfigError(f"admission state {cfg.admission_from} is for other tables than "
                              f"profile {p.name!r}'s; continue the state of this model's build")
        if state.config != cfg.admission:
            raise ConfigError(f"admission state {cfg.admission_from} was made with "
                              f"{state.config.to_dict()}, this run asks for "
                              f"{cfg.admission.to_dict()}; a model keeps its policy")
    else:
        state = AdmissionState.new(cfg.admission, tables)
    day = _data_day(cfg.data_dir) or 0
    observe_split(state, day, cfg.data_dir, "train",
                  dict(zip(p.feature_names, p.table_names, strict=True)))
    return state


def _mapper(cfg: TrainConfig, state: Any) -> RowMapper:
    p = cfg.profile
    if state is None:
        return RowMapper(p.cardinalities)
    maps = state.id_maps()
    return RowMapper(p.cardinalities, {j: maps[t] for j, t in enumerate(p.table_names)})


# ----------------------------------------------------------------------------- resume

def check_resume(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """Validate ``cfg.resume_from`` for a run over ``world_size`` ranks; its plan.json.

    Raises:
        ConfigError: no such checkpoint, no plan.json, another profile, or another world
            size than the checkpoint's (its shards are laid out for that many ranks).
    """
    ckpt = Path(cfg.resume_from) if cfg.resume_from is not None else None
    if ckpt is None:
        return {}
    if not (ckpt / ".metadata").is_file():
        raise ConfigError(f"--resume {ckpt}: no checkpoint there (no .metadata); pass the "
                          "directory `python -m serve.model.train --out` wrote")
    try:
        plan = json.loads((ckpt / PLAN_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--resume {ckpt}: {PLAN_FILE} is missing or unreadable ({e}); "
                          "the checkpoint is incomplete, re-train it") from None
    if plan.get("profile") != cfg.profile.name:
        raise ConfigError(f"--resume {ckpt} was trained with profile {plan.get('profile')!r}, "
                          f"this run is {cfg.profile.name!r}; use --profile "
                          f"{plan.get('profile')}")
    if plan.get("world_size") != world_size:
        raise ConfigError(f"--resume {ckpt} was saved by {plan.get('world_size')} ranks but "
                          f"this run has {world_size}; resume with --nproc "
                          f"{plan.get('world_size')} (the checkpoint's world size)")
    return dict(plan)


def _touched(batch: Any, masks: list[np.ndarray]) -> None:
    """Mark the ids of a batch's KJT (feature-major) in the per-feature masks (rows,) bool."""
    values = batch.sparse.values().numpy()
    pos = 0
    for mask, n in zip(masks, batch.sparse.length_per_key(), strict=True):
        mask[values[pos:pos + n]] = True
        pos += n


def load_changed_rows(ckpt: str | os.PathLike) -> dict[str, np.ndarray]:
    """``changed_rows.npz`` of a resumed checkpoint: feature name -> int64 (n,) sorted
    unique ids.

    Raises:
        CheckpointError: the file is missing (not a resumed run, or an older checkpoint).
    """
    path = Path(ckpt) / CHANGED_ROWS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint was written without the "
                              "touched-row list; re-run `python -m serve.model.train`")
    with np.load(path) as z:
        return {k: z[k].astype(np.int64) for k in z.files}


# ----------------------------------------------------------------------------- ranks

def _build_model(profile: Profile, device: torch.device) -> Any:
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from serve.model.dlrm import table_configs

    # Tables on meta: DMP allocates only this rank's shards (criteo-kaggle is 8.7 GB).
    ebc = EmbeddingBagCollection(tables=table_configs(profile), device=torch.device("meta"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                dense_arch_layer_sizes=list(profile.dense_arch),
                over_arch_layer_sizes=list(profile.over_arch), dense_device=device)


@dataclass
class _RankRun:
    """What one rank's training produced, for the checkpoint metadata."""

    steps: int
    rows: int
    seconds: float
    final_loss: float | None
    epochs: int
    touched: list[np.ndarray]   # per feature: bool (rows,), ids in this rank's batches


def _rank_device(cfg: TrainConfig, rank: int) -> tuple[str, torch.device]:
    """The backend and this rank's device (cuda:LOCAL_RANK under nccl, else cpu)."""
    backend = cfg.resolved_backend()
    if backend != "nccl":
        return backend, torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    return backend, device


def _sharded_model(cfg: TrainConfig, device: torch.device, plan: Any) -> tuple[Any, Any]:
    """The DistributedModelParallel DLRM and its combined optimizer.

    Sparse tables get row-wise Adagrad fused into the backward pass (TorchRec's
    in-backward optimizer, no gradient tensors for the tables); the dense MLPs get Adam.
    """
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    model = _build_model(cfg.profile, device)
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(),
                                {"lr": cfg.lr, "eps": 1e-8})
    dmp = DistributedModelParallel(module=model, device=device, plan=plan)
    if cfg.resume_from is not None:
        _resume(dmp, Path(cfg.resume_from))
    if cfg.sparse_only:  # no dense optimizer: the MLPs' gradients are computed, never applied
        return dmp, CombinedOptimizer([dmp.fused_optimizer])
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=cfg.dense_learning_rate))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt])


def _resume(dmp: Any, ckpt: Path) -> None:
    """Read ``ckpt`` into this rank's shards and dense replica (collective: every rank)."""
    import torch.distributed.checkpoint as dcp

    from serve.model.safe_meta import SafeFileSystemReader

    state = dmp.state_dict()
    # its .metadata through the allow-listed unpickler (review N3), as every reader of ours
    dcp.load(state, storage_reader=SafeFileSystemReader(ckpt, "train again without --resume"))
    dmp.load_state_dict(state)


def _train_loop(dmp: Any, opt: Any, cfg: TrainConfig, rank: int, world_size: int,
                local_batch: int, device: torch.device, mapper: RowMapper) -> _RankRun:
    """Train this rank's share of the click log; rank 0 prints progress every log_every."""
    from serve.model.data import iter_batches

    loss_fn = torch.nn.BCEWithLogitsLoss()
    ds = RowMappedDataset(train_dataset(cfg, local_batch, rank, world_size), mapper)
    touched = [np.zeros(c, dtype=bool) for c in cfg.profile.cardinalities]
    epochs = cfg.epochs or cfg.profile.epochs
    total = len(ds) * epochs if cfg.max_steps is None else min(cfg.max_steps, len(ds) * epochs)
    step, rows, t0, ema = 0, 0, time.perf_counter(), None
    dmp.train()
    for _ in range(epochs):
        for batch in iter_batches(ds, cfg.num_workers):
            if step >= total:
                break
            _touched(batch, touched)
            logits = dmp(batch.dense.to(device), batch.sparse.to(device)).squeeze(-1)
            loss = loss_fn(logits, batch.labels.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            rows += len(batch) * world_size
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            if rank == 0 and (step % cfg.log_every == 0 or step == total):
                el = time.perf_counter() - t0
                print(f"train step {step}/{total} rows {rows} rows/s {rows / el:,.0f} "
                      f"loss {ema:.4f}", flush=True)
    return _RankRun(step, rows, time.perf_counter() - t0, ema, epochs, touched)


def _fixed_batch_outputs(dmp: Any, cfg: TrainConfig, device: torch.device,
                         mapper: RowMapper) -> dict[str, Any]:
    """The sharded model's logits on a fixed eval batch, for the merge check.

    The same rows on every rank, so each rank's output is the sharded model's answer.
    ``ids`` are the batch's table rows (mapped like training), what the merged model reads.
    """
    from serve.model.data import load_split, to_batch

    dmp.eval()
    n = min(cfg.eval_batch, len(load_split(cfg.data_dir, "eval")))
    fixed = RowMappedDataset(ClickLogDataset(cfg.data_dir, "eval", n, limit=n), mapper)
    item = fixed[0]
    b = to_batch(item, fixed.feature_names)
    with torch.no_grad():
        out = dmp(b.dense.to(device), b.sparse.to(device)).squeeze(-1).float().cpu()
    return {"dense": b.dense, "ids": item[1], "lengths": item[2], "logits": out,
            "feature_names": fixed.feature_names}


def _rank_main(rank: int, world_size: int, cfg: TrainConfig, tmp_dir: str,
               port: int | None) -> None:
    """Body of one rank (spawned by us, or started by torchrun)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if port is not None:  # spawned by us: we are the rendezvous
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
    setup_cli_logging(f"%(asctime)s [rank{rank}] %(message)s", force=True)
    torch.set_num_threads(cfg.threads)
    backend, device = _rank_device(cfg, rank)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    try:
        p = cfg.profile
        seed = cfg.resolved_seed
        torch.manual_seed(seed)
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        local_batch = max(1, cfg.global_batch // world_size)
        plan, types, shards = plan_sharding(p, world_size, device.type, local_ws, local_batch)
        state = managed_state(cfg)  # the same on every rank (reads the whole split)
        mapper = _mapper(cfg, state)
        dmp, opt = _sharded_model(cfg, device, plan)
        run = _train_loop(dmp, opt, cfg, rank, world_size, local_batch, device, mapper)
        outputs = _fixed_batch_outputs(dmp, cfg, device, mapper)
        dcp.save(dmp.state_dict(), checkpoint_id=tmp_dir)
        mine = [np.flatnonzero(m).astype(np.int64) for m in run.touched]
        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, mine)
        dist.barrier()
        if rank == 0:
            torch.save(outputs, Path(tmp_dir) / OUTPUTS_FILE)
            changed: dict[str, Any] = {f: np.unique(np.concatenate([r[j] for r in every]))
                       for j, f in enumerate(p.feature_names)}
            if cfg.resume_from is not None:  # what a delta of this update may contain
                np.savez(Path(tmp_dir) / CHANGED_ROWS_FILE, **changed)
            meta = {
                "profile": p.name, "world_size": world_size, "backend": backend,
                "device": device.type, "sharding_plan": types,
                "shards": {t: [{"rank": r, "offsets": o, "sizes": s} for r, o, s in v]
                           for t, v in shards.items()},
                "steps": run.steps, "rows": run.rows, "train_seconds": round(run.seconds, 3),
                "final_loss": run.final_loss, "global_batch": local_batch * world_size,
                "learning_rate": cfg.lr, "dense_learning_rate": cfg.dense_learning_rate,
                "epochs": run.epochs, "seed": seed, "label_shuffle": cfg.label_shuffle,
                "resumed_from": (os.fspath(cfg.resume_from) if cfg.resume_from is not None
                                 else None),
                "sparse_only": cfg.sparse_only, "day": _data_day(cfg.data_dir),
                "changed_rows": int(sum(v.shape[0] for v in changed.values())),
            }
            if state is not None:
                from serve.model.admission import ADMISSION_FILE

                state.save(Path(tmp_dir) / ADMISSION_FILE)
                meta["id_mapping"] = _id_mapping(state)
            (Path(tmp_dir) / PLAN_FILE).write_text(json.dumps(meta, indent=2))
        dist.barrier()
        settle(Path(tmp_dir), rank, world_size)
    finally:
        dist.destroy_process_group()


def _id_mapping(state: Any) -> dict[str, Any]:
    """plan.json's record of a managed build's admission: the policy, and per table the
    admitted ids, capacity and occupancy after the day, and the day's admitted/evicted."""
    summary = state.summary()
    for name, d in state.last_decisions.items():
        summary[name].update({"admitted_today": d.to_dict()["admitted"],
                              "evicted_today": d.to_dict()["evicted"]})
    return {"mapping": "managed", **state.config.to_dict(), "day": state.day,
            "tables": summary}


def _data_day(data_dir: Path) -> int | None:
    """The day of the click logs (meta.json "day"; None when not recorded)."""
    try:
        day = json.loads((Path(data_dir) / "meta.json").read_text()).get("day")
    except (OSError, json.JSONDecodeError):
        return None
    return day if isinstance(day, int) else None


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def train(cfg: TrainConfig) -> dict:
    """Run training (spawning ranks unless under torchrun); return plan.json's content."""
    out = Path(cfg.out_dir)
    tmp = out.with_name(out.name + ".tmp")
    torchrun = _under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else cfg.nproc
    rank = int(os.environ["RANK"]) if torchrun else 0
    backend = cfg.resolved_backend()
    dev = "cuda" if backend == "nccl" else "cpu"
    if not torchrun and dev == "cuda" and world > torch.cuda.device_count():
        raise ShardingError(f"--nproc {world} needs {world} GPUs with nccl but this machine has "
                            f"{torch.cuda.device_count()}; use --nproc <= that or --backend gloo")
    check_resume(cfg, world)  # a wrong checkpoint fails here, not in every rank
    if cfg.admission_from is not None:  # likewise a wrong admission state
        from serve.model.admission import load_state

        prev = load_state(cfg.admission_from)
        day = _data_day(cfg.data_dir) or 0
        if day <= prev.day:
            raise ConfigError(f"admission state {cfg.admission_from} has seen day {prev.day}; "
                              f"the data is day {day}: a managed model continues on a later day")
    # Validate (and show) the plan before any rank starts.
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    _, types, shards = plan_sharding(cfg.profile, world, dev, local_ws,
                                     max(1, cfg.global_batch // world))
    if rank == 0:
        print(f"sharding plan: profile {cfg.profile.name}, world size {world}, {backend} on {dev}\n"
              + format_plan(types, shards), flush=True)
        if cfg.label_shuffle:
            print(f"label shuffle: the training labels are permuted (seed {cfg.resolved_seed}); "
                  "eval is untouched, so expect eval AUC ~0.5", flush=True)
        if cfg.admission is not None:
            a = cfg.admission
            print(f"id mapping: managed, policy {a.policy}, admit after {a.threshold} "
                  f"sightings" + (f", continuing {cfg.admission_from}"
                                  if cfg.admission_from is not None else ""), flush=True)
        if cfg.resume_from is not None:
            what = "embeddings only (MLPs frozen)" if cfg.sparse_only else "all weights"
            print(f"resume: continuing from {cfg.resume_from}, training {what}", flush=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if torchrun:
        _rank_main(rank, world, cfg, str(tmp), None)
    else:
        spawn_ranks(_rank_main, (world, cfg, str(tmp), free_port()), world, tmp)
    if rank == 0:
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return json.loads((out / PLAN_FILE).read_text())
    return {}


# ----------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a DLRM sharded over N ranks with TorchRec DistributedModelParallel "
                    "and save a torch.distributed.checkpoint (one shard file per rank).",
        epilog="Single node: this command spawns --nproc ranks on a free loopback port.\n"
               "Multi-node: start it under torchrun on every node, e.g.\n"
               "  torchrun --nnodes 2 --node-rank R --nproc-per-node 2 --rdzv-backend c10d \\\n"
               "      --rdzv-endpoint HOST0:29500 -m serve.model.train --profile small --data DIR --out CKPT\n"
               "(--nproc is then ignored; DIR and CKPT must be on a filesystem all nodes share).\n"
               "Plan: tables with more rows than the profile's large_table_rows are column-wise\n"
               "on CPU (row-wise needs CUDA) and row-wise on GPU; smaller tables table-wise.")
    ap.add_argument("--profile", required=True, help=f"profile name ({', '.join(PROFILES)})")
    ap.add_argument("--data", required=True, help="data directory written by serve.model.data")
    ap.add_argument("--out", required=True, help="checkpoint directory (replaced atomically)")
    ap.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                    help="auto = nccl when CUDA is available, else gloo")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="global batch size, split over ranks (default: the profile's)")
    ap.add_argument("--lr", type=float, default=None,
                    help="embedding row-wise Adagrad learning rate (default: the profile's)")
    ap.add_argument("--dense-lr", type=float, default=3e-3, help="MLP Adam learning rate")
    ap.add_argument("--epochs", type=int, default=None, help="passes over the data (default: profile)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--workers", type=int, default=1,
                    help="DataLoader worker processes per rank (0 = read in the rank)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank; ranks x threads should not exceed cores")
    ap.add_argument("--log-every", type=int, default=50, help="progress line every N steps")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the initial weights (default: the profile's); the data's own "
                         "seed is set when it is generated (serve.model.data --seed)")
    ap.add_argument("--label-shuffle", action="store_true",
                    help="permute the training split's labels with a generator seeded by --seed "
                         "(eval data and labels untouched): a deliberately bad model whose eval "
                         "AUC is ~0.5")
    ap.add_argument("--resume", default=None, metavar="CKPT_DIR",
                    help="continue training from this checkpoint (written by this command; "
                         "same profile and --nproc as it was saved with); optimizer state "
                         "starts fresh")
    ap.add_argument("--sparse-only", action="store_true",
                    help="with --resume: update only the embedding rows (no dense optimizer "
                         "step, the MLPs stay bit-identical), as embedding deltas need")
    return ap


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(profile=get_profile(args.profile), data_dir=Path(args.data),
                       out_dir=Path(args.out), nproc=args.nproc, backend=args.backend,
                       batch_size=args.batch_size, learning_rate=args.lr,
                       dense_learning_rate=args.dense_lr, epochs=args.epochs,
                       max_steps=args.max_steps, num_workers=args.workers,
                       threads=args.threads, log_every=args.log_every, seed=args.seed,
                       label_shuffle=args.label_shuffle,
                       resume_from=Path(args.resume) if args.resume else None,
                       sparse_only=args.sparse_only)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_cli_logging()
    try:
        cfg = config_from_args(args)
        from serve.model.data import load_split
        load_split(cfg.data_dir, "train")  # fail here, not in every rank
        t0 = time.perf_counter()
        meta = train(cfg)
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    if meta:
        print(f"wrote {args.out}: {meta['steps']} steps, {meta['rows']} rows, final loss "
              f"{meta['final_loss']:.4f}, {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
