"""The explicit sharding plan of the built-in DLRM's embedding tables, computed without a
process group (deterministic): large tables row-wise on GPU / column-wise on CPU, the rest
table-wise. :mod:`serve.model.train` shards by it; ``plan.json`` records it."""
from __future__ import annotations

import torch

from serve.errors import ShardingError
from serve.profiles import Profile

__all__ = ["format_plan", "max_world_size", "plan_sharding"]

# fbgemm needs column shards whose width is a multiple of 4.
_MIN_COLUMN_SHARD = 4


def _sharding_types(profile: Profile, compute_device: str) -> dict[str, str]:
    """Our rule: large tables row-wise on GPU / column-wise on CPU (TorchRec offers no
    row-wise on CPU), the rest table-wise."""
    big = "row_wise" if compute_device == "cuda" else "column_wise"
    return {t: (big if rows > profile.large_table_rows else "table_wise")
            for t, rows in zip(profile.table_names, profile.cardinalities, strict=True)}


def max_world_size(profile: Profile, compute_device: str = "cpu") -> int:
    """The most ranks that each get at least one shard under our plan rule.

    Table-wise tables are one shard each; a column-wise table splits into at most
    D / 4 column shards; a row-wise one into as many as there are ranks.
    """
    types = _sharding_types(profile, compute_device)
    if "row_wise" in types.values():
        return 1 << 30
    return sum(1 if t == "table_wise" else profile.embedding_dim // _MIN_COLUMN_SHARD
               for t in types.values())


def plan_sharding(profile: Profile, world_size: int, compute_device: str = "cpu",
                  local_world_size: int | None = None, batch_size: int | None = None):
    """The explicit sharding plan, computed without a process group (deterministic).

    Returns (ShardingPlan, {table: sharding type}, {table: [(rank, offsets, sizes)]}).
    Raises ShardingError when ``world_size`` cannot be used with these tables.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingPlan  # noqa: F401  (return type)

    from serve.model.dlrm import table_configs

    if world_size < 1:
        raise ShardingError(f"world size {world_size} must be >= 1")
    limit = max_world_size(profile, compute_device)
    types = _sharding_types(profile, compute_device)
    if world_size > limit:
        n_tw = sum(t == "table_wise" for t in types.values())
        raise ShardingError(
            f"world size {world_size} cannot be sharded: profile {profile.name!r} has "
            f"{n_tw} table-wise tables and {len(types) - n_tw} column-wise tables "
            f"(dim {profile.embedding_dim}, column shards of >= {_MIN_COLUMN_SHARD}), at most "
            f"{limit} shards, so some ranks would hold no table; use --nproc <= {limit}")
    # Column-wise: ask for shards narrow enough that the table spreads over the ranks.
    min_part = max(_MIN_COLUMN_SHARD,
                   (profile.embedding_dim // max(1, world_size)) // _MIN_COLUMN_SHARD * _MIN_COLUMN_SHARD)
    constraints = {
        t: ParameterConstraints(sharding_types=[st],
                                min_partition=min_part if st == "column_wise" else None)
        for t, st in types.items()
    }
    topology = Topology(world_size=world_size, compute_device=compute_device,
                        local_world_size=local_world_size or world_size)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints,
                                       batch_size=batch_size, debug=False)
    module = _meta_ebc_holder(table_configs(profile))
    try:
        plan = planner.plan(module, [EmbeddingBagCollectionSharder()])
    except Exception as e:
        raise ShardingError(
            f"the TorchRec planner cannot shard profile {profile.name!r} over world size "
            f"{world_size} on {compute_device}: {type(e).__name__}: {str(e).splitlines()[0]}; "
            "use fewer ranks or another profile") from e
    shards: dict[str, list] = {}
    module_plan = plan.plan.get("sparse_arch.embedding_bag_collection", {})
    for t in profile.table_names:
        ps = module_plan[t]
        shards[t] = [(int(str(s.placement).split("rank:")[1].split("/")[0]),
                      list(s.shard_offsets), list(s.shard_sizes))
                     for s in ps.sharding_spec.shards] if ps.sharding_spec else []
        types[t] = ps.sharding_type
    return plan, types, shards


def _meta_ebc_holder(configs: list) -> torch.nn.Module:
    """A module shaped like DLRM's sparse part (same fqn) with tables on ``meta``."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    holder = torch.nn.Module()
    holder.sparse_arch = torch.nn.Module()
    holder.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(
        tables=configs, device=torch.device("meta"))
    return holder


def format_plan(types: dict[str, str], shards: dict[str, list]) -> str:
    lines = []
    for t, st in types.items():
        where = ", ".join(f"rank{r} cols {o[1]}:{o[1] + s[1]}" if st == "column_wise"
                          else f"rank{r} rows {o[0]}:{o[0] + s[0]}" for r, o, s in shards[t])
        lines.append(f"  {t:7s} {st:12s} {where}")
    return "\n".join(lines)
