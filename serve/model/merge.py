"""Merge a sharded TorchRec checkpoint into one unsharded DLRM state dict, in one process.

No ranks, no process group: ``torch.distributed.checkpoint``'s metadata says where
every shard of every tensor lies (which ``.distcp`` file, which rows/columns), so one
process can read all of them straight into the tensors of an unsharded
:func:`serve.model.dlrm.build_dlrm` (``dcp.load`` in its single-process mode), checked
strictly (same keys, same shapes, then ``load_state_dict(strict=True)``). We then
prove the merge exact: on the fixed batch the trainer saved, the merged model's
logits equal the sharded model's (``merged_max_abs_diff``, must be <= 1e-6).

Output (``--out merged.pt``): ``torch.save`` of
``{"format", "profile", "state_dict", "merged_max_abs_diff", "world_size", "sharding_plan"}``.

Example::

    python -m serve.model.merge --checkpoint build/tiny/checkpoint --profile tiny --out build/tiny/merged.pt
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from serve.common.clilog import setup_cli_logging
from serve.errors import CheckpointError, ConfigError, ServeError
from serve.profiles import PROFILES, Profile, get_profile

__all__ = [
    "MAX_MERGE_DIFF",
    "MERGED_FORMAT",
    "MergeResult",
    "check_checkpoint",
    "checked_plan",
    "fixed_batch",
    "load_dcp_into",
    "load_merged",
    "load_outputs",
    "logits_diff",
    "main",
    "merge_checkpoint",
]

log = logging.getLogger(__name__)

MERGED_FORMAT = "dlrm-merged/1"
MAX_MERGE_DIFF = 1e-6
_PREFIXES = ("_dmp_wrapped_module.", "module.")


@dataclass
class MergeResult:
    path: Path
    merged_max_abs_diff: float
    world_size: int
    sharding_plan: dict[str, str]
    num_parameters: int


def check_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check a checkpoint directory before reading it; return its plan.json.

    Raises CheckpointError naming the file: directory, ``.metadata`` or ``plan.json``
    missing or unreadable, a ``.distcp`` shard the metadata names missing or shorter
    than the byte ranges it must hold.
    """
    from serve.model.safe_meta import read_metadata

    hint = "re-run `python -m serve.model.train` (or `make model`) to write it again"
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist; {hint}")
    meta_file = ckpt / ".metadata"
    metadata = read_metadata(ckpt, hint)   # allow-listed unpickler (review N3)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    if not need:
        raise CheckpointError(f"checkpoint metadata {meta_file} lists no shard files; {hint}")
    for rel, size in sorted(need.items()):
        f = ckpt / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint shard {f} is missing (named in {meta_file}); {hint}")
        got = f.stat().st_size
        if got < size:
            raise CheckpointError(f"checkpoint shard {f} is truncated: {got} bytes, the metadata "
                                  f"needs at least {size}; {hint}")
    plan_file = ckpt / "plan.json"
    if not plan_file.is_file():
        raise CheckpointError(f"checkpoint plan {plan_file} is missing; {hint}")
    try:
        return json.loads(plan_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint plan {plan_file} is not valid JSON ({e}); {hint}") from e


def _strip(key: str) -> str:
    for p in _PREFIXES:
        while key.startswith(p):
            key = key[len(p):]
    return key


def _find_corrupt_shard(ckpt: Path) -> tuple[str, str] | None:
    """(file, reason) of the first tensor record that does not deserialize, if any."""
    import io

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from serve.model.safe_meta import read_metadata

    md = read_metadata(ckpt)
    for idx, info in (md.storage_data or {}).items():
        if not isinstance(md.state_dict_metadata.get(idx.fqn), TensorStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            continue  # compressed records: leave the verdict to the reader
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        try:
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - bad bytes raise many types
            return info.relative_path, f"record {idx.fqn!r} at byte {info.offset}: {type(e).__name__}"
    return None


def load_dcp_into(model: torch.nn.Module, ckpt: Path,
                  hint: str = "re-train with this profile") -> None:
    """Read every shard of ``ckpt`` into ``model``'s own tensors, in this one process.

    ``torch.distributed.checkpoint.load`` without a process group runs single-process
    ("no_dist"): its planner maps each saved shard (rows or columns of a table, written
    by whichever rank held it) onto the matching slice of the unsharded tensor, so peak
    memory is one model, not the two or three copies a torch.save round trip
    (``format_utils.dcp_to_torch_save``) would need at criteo-kaggle scale (8.7 GB).
    Keys and shapes are checked both ways first (strict).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from serve.model.safe_meta import read_metadata, safe_dcp_load

    md = read_metadata(ckpt, hint)   # allow-listed unpickler (review N3)
    saved = {_strip(k): v for k, v in md.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    state = model.state_dict()
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {ckpt} does not match the model: missing keys {missing[:3]}, "
            f"unexpected keys {unexpected[:3]}; it was written for another model; {hint}")
    for k, t in state.items():
        if tuple(saved[k].size) != tuple(t.shape):
            raise CheckpointError(f"checkpoint {ckpt}: {k} has shape {tuple(saved[k].size)}, the "
                                  f"model needs {tuple(t.shape)}; {hint}")
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.simplefilter("ignore", UserWarning)
            safe_dcp_load(state, ckpt, hint)
    # CheckpointException derives from BaseException, so name it explicitly.
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - bad bytes raise many types
        bad = _find_corrupt_shard(ckpt)
        where = (f"shard {ckpt / bad[0]} is corrupt ({bad[1]})" if bad
                 else f"a .distcp file is corrupt ({type(e).__name__})")
        raise CheckpointError(f"checkpoint {ckpt}: its shards cannot be read: {where}; "
                              "re-run `python -m serve.model.train` to write it again") from None
    model.load_state_dict(state, strict=True)  # same tensors; the formal strict check


def fixed_batch(outputs: dict) -> Any:
    """The trainer's fixed batch (``sharded_outputs.pt``) as a :class:`serve.model.data.Batch`:
    dense (B, 13) float32 and a feature-major KeyedJaggedTensor of its rows."""
    from serve.model.data import to_batch

    return to_batch((outputs["dense"], outputs["ids"], outputs["lengths"],
                     torch.zeros(outputs["dense"].shape[0])), list(outputs["feature_names"]))


def logits_diff(logits: torch.Tensor, outputs: dict) -> float:
    """max |logits - the sharded model's logits| on the fixed batch (B,)."""
    return float((logits.reshape(-1).float() - outputs["logits"].float()).abs().max().item())


def _fixed_batch_diff(model: torch.nn.Module, outputs: dict) -> float:
    b = fixed_batch(outputs)
    model.eval()
    with torch.no_grad():
        got = model(b.dense, b.sparse)
    return logits_diff(got, outputs)


def load_outputs(ckpt: Path) -> dict:
    """The trainer's fixed batch and its sharded logits (``ckpt/sharded_outputs.pt``).

    Raises:
        CheckpointError: the file is missing or unreadable.
    """
    from serve.model.train import OUTPUTS_FILE

    outputs_file = ckpt / OUTPUTS_FILE
    if not outputs_file.is_file():
        raise CheckpointError(f"checkpoint outputs {outputs_file} are missing; cannot prove the "
                              "merge exact; re-run `python -m serve.model.train`")
    try:
        return dict(torch.load(outputs_file, map_location="cpu", weights_only=True))
    except Exception as e:
        raise CheckpointError(f"checkpoint outputs {outputs_file} are unreadable "
                              f"({type(e).__name__}); re-run `python -m serve.model.train`") from e


def checked_plan(ckpt: Path, profile: Profile) -> dict[str, Any]:
    """:func:`check_checkpoint`, and the plan's profile is ``profile``.

    Raises:
        ConfigError: the checkpoint was trained with another profile.
    """
    plan = check_checkpoint(ckpt)
    if plan.get("profile") != profile.name:
        raise ConfigError(f"checkpoint {ckpt} was trained with profile {plan.get('profile')!r}, "
                          f"not {profile.name!r}; pass --profile {plan.get('profile')}")
    return plan


def merge_checkpoint(ckpt: str | os.PathLike, profile: Profile, out: str | os.PathLike,
                     max_diff: float = MAX_MERGE_DIFF) -> MergeResult:
    """Merge, load strictly into an unsharded DLRM, verify, save (atomically)."""
    from serve.model.dlrm import build_dlrm

    ckpt, out = Path(ckpt), Path(out)
    plan = checked_plan(ckpt, profile)
    # Built on CPU, not meta + to_empty: DLRM has non-persistent buffers (the interaction's
    # triu indices) that no checkpoint holds, so they must be initialised for real.
    model = build_dlrm(profile, device="cpu")
    load_dcp_into(model, ckpt)
    outputs = load_outputs(ckpt)
    diff = _fixed_batch_diff(model, outputs)
    if not diff <= max_diff:
        raise CheckpointError(f"merged model differs from the sharded one by {diff:.3g} on the "
                              f"saved batch (limit {max_diff:g}); the checkpoint is inconsistent")
    clean = {k: v.detach() for k, v in model.state_dict().items()}
    nparams = sum(p.numel() for p in model.parameters())
    blob = {"format": MERGED_FORMAT, "profile": profile.name, "state_dict": clean,
            "merged_max_abs_diff": diff, "world_size": plan["world_size"],
            "sharding_plan": plan["sharding_plan"], "num_parameters": nparams}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, out)
    return MergeResult(out, diff, int(plan["world_size"]), dict(plan["sharding_plan"]), nparams)


def load_merged(path: str | os.PathLike, profile: Profile) -> tuple[torch.nn.Module, dict]:
    """An unsharded fp32 DLRM from ``merged.pt`` (strict), and the file's metadata."""
    from serve.model.dlrm import build_dlrm

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"merged checkpoint {path} does not exist; run `python -m serve.model.merge`")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"merged checkpoint {path} is unreadable ({type(e).__name__}); "
                              "run `python -m serve.model.merge` again") from e
    if not isinstance(blob, dict) or blob.get("format") != MERGED_FORMAT:
        raise CheckpointError(f"merged checkpoint {path} is not a {MERGED_FORMAT} file; "
                              "run `python -m serve.model.merge` again")
    if blob["profile"] != profile.name:
        raise ConfigError(f"merged checkpoint {path} is profile {blob['profile']!r}, not "
                          f"{profile.name!r}; pass --profile {blob['profile']}")
    model = build_dlrm(profile, device="cpu")
    model.load_state_dict(blob["state_dict"], strict=True)
    model.eval()
    meta = {k: v for k, v in blob.items() if k != "state_dict"}
    return model, meta


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.model.merge",
        description="Merge a sharded torch.distributed.checkpoint (written by serve.model.train) into "
                    "one unsharded DLRM state dict, in one process, and prove it exact on the "
                    "batch the trainer saved (max abs logit diff <= 1e-6).")
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory from serve.model.train")
    ap.add_argument("--profile", required=True, help=f"profile name ({', '.join(PROFILES)})")
    ap.add_argument("--out", required=True, help="output file, e.g. build/tiny/merged.pt")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_cli_logging()
    try:
        t0 = time.perf_counter()
        print(f"merging {args.checkpoint} ...", flush=True)
        res = merge_checkpoint(Path(args.checkpoint), get_profile(args.profile), Path(args.out))
    except ServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(f"wrote {res.path}: {res.num_parameters:,} parameters from {res.world_size} ranks, "
          f"merged_max_abs_diff {res.merged_max_abs_diff:.3g}, {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
