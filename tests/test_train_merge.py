"""Sharded training (a real 2-rank gloo run, via ``tiny_build``), the plan, and the merge."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve.common.net import free_port
from serve.errors import CheckpointError, ConfigError, ShardingError
from serve.model.merge import MAX_MERGE_DIFF, load_merged, merge_checkpoint
from serve.model.quantize import evaluate_auc
from serve.model.sharding import max_world_size, plan_sharding
from serve.model.train import OUTPUTS_FILE, PLAN_FILE
from serve.profiles import get_profile

TINY = get_profile("tiny")


@pytest.fixture
def ckpt_copy(tiny_build, tmp_path):
    """A private copy of the tiny checkpoint to damage."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_build.checkpoint, d)
    return d


def test_each_rank_wrote_its_own_shard(tiny_build):
    files = sorted(p.name for p in tiny_build.checkpoint.iterdir())
    assert files == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", OUTPUTS_FILE, PLAN_FILE])
    plan = json.loads((tiny_build.checkpoint / PLAN_FILE).read_text())
    assert plan["world_size"] == 2 and plan["backend"] == "gloo"
    assert plan["steps"] > 0 and plan["final_loss"] < 0.6


def test_plan_is_column_wise_for_large_tables_on_cpu(tiny_build):
    plan = json.loads((tiny_build.checkpoint / PLAN_FILE).read_text())
    for t, rows in zip(TINY.table_names, TINY.cardinalities, strict=True):
        want = "column_wise" if rows > TINY.large_table_rows else "table_wise"
        assert plan["sharding_plan"][t] == want, t
        shards = plan["shards"][t]
        if want == "column_wise":  # split over both ranks, 8 of the 16 columns each
            assert sorted(s["rank"] for s in shards) == [0, 1]
            assert [s["sizes"] for s in shards] == [[rows, 8], [rows, 8]]
        else:
            assert len(shards) == 1 and shards[0]["sizes"] == [rows, 16]
    assert tiny_build.report["sharding_plan"] == plan["sharding_plan"]


def test_merged_model_equals_sharded_model(tiny_build, tmp_path):
    """Re-merge in this process (no ranks) and compare with the sharded logits."""
    res = merge_checkpoint(tiny_build.checkpoint, TINY, tmp_path / "merged.pt")
    assert res.merged_max_abs_diff <= MAX_MERGE_DIFF
    model, _meta = load_merged(tmp_path / "merged.pt", TINY)
    saved = torch.load(tiny_build.checkpoint / OUTPUTS_FILE, weights_only=True)
    from serve.model.data import to_batch
    b = to_batch((saved["dense"], saved["ids"], saved["lengths"], torch.zeros(len(saved["dense"]))),
                 saved["feature_names"])
    with torch.no_grad():
        got = model(b.dense, b.sparse).squeeze(-1)
    assert saved["logits"].shape == (512,)
    torch.testing.assert_close(got, saved["logits"], rtol=0, atol=1e-6)
    # The logits are not trivially equal (a constant model would pass the check above).
    assert saved["logits"].std() > 0.1
    assert tiny_build.report["merged_max_abs_diff"] <= 1e-6


def test_trained_model_learned_something(tiny_build):
    model, _ = load_merged(tiny_build.merged, TINY)
    auc, rows = evaluate_auc(model, tiny_build.data_dir)
    assert rows == TINY.eval_samples
    assert auc > 0.7


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nope does not exist; re-run "
                                              r"`python -m serve\.model\.train`"):
        merge_checkpoint(tmp_path / "nope", TINY, tmp_path / "m.pt")


def test_missing_metadata(ckpt_copy, tmp_path):
    (ckpt_copy / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint metadata .*ckpt/\.metadata is missing"):
        merge_checkpoint(ckpt_copy, TINY, tmp_path / "m.pt")


def test_corrupt_metadata(ckpt_copy, tmp_path):
    (ckpt_copy / ".metadata").write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match=r"checkpoint metadata .*ckpt/\.metadata is unreadable"):
        merge_checkpoint(ckpt_copy, TINY, tmp_path / "m.pt")


def test_missing_shard(ckpt_copy, tmp_path):
    (ckpt_copy / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint shard .*ckpt/__1_0\.distcp is missing "
                                              r"\(named in .*\.metadata\)"):
        merge_checkpoint(ckpt_copy, TINY, tmp_path / "m.pt")


def test_truncated_shard(ckpt_copy, tmp_path):
    f = ckpt_copy / "__0_0.distcp"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"checkpoint shard .*ckpt/__0_0\.distcp is truncated: "
                                              rf"{size // 2} bytes, the metadata needs at least \d+"):
        merge_checkpoint(ckpt_copy, TINY, tmp_path / "m.pt")


def test_corrupt_shard_same_size(ckpt_copy, tmp_path):
    f = ckpt_copy / "__1_0.distcp"
    f.write_bytes(b"\x00" * f.stat().st_size)
    with pytest.raises(CheckpointError, match=r"its shards cannot be read: shard .*ckpt/__1_0\.distcp is corrupt "
                                              r"\(record '.*' at byte \d+: UnpicklingError\); re-run"):
        merge_checkpoint(ckpt_copy, TINY, tmp_path / "m.pt")


def test_wrong_profile_is_named(tiny_build, tmp_path):
    with pytest.raises(ConfigError, match=r"was trained with profile 'tiny', not 'small'; "
                                          r"pass --profile tiny"):
        merge_checkpoint(tiny_build.checkpoint, get_profile("small"), tmp_path / "m.pt")


def test_checkpoint_of_another_shape_is_refused(ckpt_copy, tmp_path):
    plan = json.loads((ckpt_copy / PLAN_FILE).read_text())
    plan["profile"] = "small"  # lie about the profile: the tensor shapes still tell
    (ckpt_copy / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(CheckpointError, match=r"does not match the model: missing keys "
                                              r"\['dense_arch\.model\._mlp\.2\._linear\.bias', .*\], "
                                              r"unexpected keys \[\]; it was written for another model"):
        merge_checkpoint(ckpt_copy, get_profile("small"), tmp_path / "m.pt")


def test_checkpoint_with_other_shapes_is_refused(tiny_build, tmp_path):
    import dataclasses
    narrow = dataclasses.replace(TINY, embedding_dim=8, dense_arch=(32, 8))  # same keys, other shapes
    with pytest.raises(CheckpointError, match=r"checkpoint .*: \S+ has shape \(\d+, 16\), the model "
                                              r"needs \(\d+, 8\); re-train with this profile"):
        merge_checkpoint(tiny_build.checkpoint, narrow, tmp_path / "m.pt")


def test_world_size_too_large_for_the_tables():
    assert max_world_size(TINY) == 9 + 17 * 4  # 9 table-wise tables + 17 column-wise of 16/4 columns
    with pytest.raises(ShardingError, match=r"world size 100 cannot be sharded: profile 'tiny' has 9 "
                                            r"table-wise tables and 17 column-wise tables .* at most "
                                            r"77 shards, so some ranks would hold no table; use "
                                            r"--nproc <= 77"):
        plan_sharding(TINY, 100)
    with pytest.raises(ShardingError, match=r"world size 0 must be >= 1"):
        plan_sharding(TINY, 0)


def test_plan_for_three_ranks_uses_every_rank():
    _, types, shards = plan_sharding(TINY, 3)
    ranks = {s[0] for v in shards.values() for s in v}
    assert ranks == {0, 1, 2}
    assert set(types.values()) == {"column_wise", "table_wise"}


def test_gpu_plan_is_row_wise_for_large_tables():
    """Planning needs no GPU: the plan a 4-GPU run of `small` would use."""
    small = get_profile("small")
    _, types, shards = plan_sharding(small, 4, "cuda")
    for t, rows in zip(small.table_names, small.cardinalities, strict=True):
        if rows > small.large_table_rows:
            assert types[t] == "row_wise"
            assert sorted(r for r, _, _ in shards[t]) == [0, 1, 2, 3]
            assert sum(s[0] for _, _, s in shards[t]) == rows
        else:
            assert types[t] == "table_wise"


def test_train_cli_refuses_unshardable_world_size(tiny_build, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "serve.model.train", "--profile", "tiny", "--data",
                           str(tiny_build.data_dir), "--out", str(tmp_path / "c"), "--nproc", "100"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert "error: world size 100 cannot be sharded" in proc.stderr
    assert not (tmp_path / "c").exists()


def test_runs_unchanged_under_torchrun(tiny_build, tmp_path):
    """The multi-node launcher path: torchrun starts the ranks, serve.model.train joins them."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "serve.model.train", "--profile", "tiny", "--data",
           str(tiny_build.data_dir), "--out", str(tmp_path / "c"), "--max-steps", "5", "--workers", "0"]
    # Own process group: on failure the ranks torchrun started are stopped with it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "train step 5/5" in out
    plan = json.loads((tmp_path / "c" / PLAN_FILE).read_text())
    assert plan["world_size"] == 2 and plan["steps"] == 5
    assert (tmp_path / "c" / "__1_0.distcp").is_file()
    assert merge_checkpoint(tmp_path / "c", TINY, tmp_path / "m.pt").merged_max_abs_diff <= 1e-6


def test_cli_help_documents_multi_node():
    proc = subprocess.run([sys.executable, "-m", "serve.model.train", "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0
    assert "torchrun --nnodes 2" in proc.stdout and "column-wise" in proc.stdout


def test_merge_cli_names_the_missing_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "serve.model.merge", "--checkpoint", str(tmp_path / "x"),
                           "--profile", "tiny", "--out", str(tmp_path / "m.pt")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert f"error: checkpoint directory {tmp_path / 'x'} does not exist" in proc.stderr
