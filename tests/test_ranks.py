"""serve.model.ranks: a rank that dies after every rank finished does not fail the
training; one that dies before does. Real spawned processes, as training uses."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from serve.model.ranks import all_done, settle, spawn_ranks


def _rank(rank: int, out_dir: str, abort: str) -> None:
    out = Path(out_dir)
    if abort == "before" and rank == 1:
        os.abort()  # SIGABRT before its work is done
    (out / f"part{rank}").write_text("x")
    settle(out, rank, 2, timeout_s=60.0)
    if abort == "after" and rank == 1:
        os.abort()  # what a gloo teardown abort looks like to the launcher


def test_an_abort_after_every_rank_settled_is_not_a_failure(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    spawn_ranks(_rank, (str(tmp_path), "after"), 2, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part0", "part1"]  # markers gone
    assert "exited with code -6 after every rank had finished" in caplog.text


def test_an_abort_before_the_work_is_done_fails(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessExitedException) as e:
        spawn_ranks(_rank, (str(tmp_path), "before"), 2, tmp_path)
    assert e.value.exit_code == -6
    assert not all_done(tmp_path, 2)


def test_a_clean_run_leaves_no_markers(tmp_path: Path) -> None:
    spawn_ranks(_rank, (str(tmp_path), "none"), 2, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part0", "part1"]


def test_settle_gives_up_after_its_timeout(tmp_path: Path) -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    assert settle(tmp_path, 0, 2, timeout_s=3.0, clock=clock) is False
    assert settle(tmp_path, 1, 2, timeout_s=3.0, clock=clock) is True


def test_a_failed_step_reports_stderrs_tail_and_stdouts(tmp_path: Path) -> None:
    """The import check's step runner: stderr (a rank's abort message) comes first in the
    log, stdout after it; a failure names both."""
    import sys

    from serve.ops.import_check_config import StepFailed
    from serve.ops.import_check_fit import _run

    code = ("import sys; print('step 4/4', flush=True); "
            "sys.stderr.write('terminate called after throwing gloo::IoException\\n'); "
            "sys.exit(3)")
    with pytest.raises(StepFailed) as e:
        _run([sys.executable, "-c", code], tmp_path / "fit.log", "fit", 60.0)
    msg = str(e.value)
    assert "exited with 3" in msg
    assert msg.index("gloo::IoException") < msg.index("stdout: | step 4/4")


def test_settle_ends_when_rank_zero_renamed_the_directory(tmp_path: Path) -> None:
    """Under torchrun rank 0 renames the output folder once it saw every marker; a peer
    still polling must not wait out its timeout for markers that moved."""
    out = tmp_path / "c.tmp"
    out.mkdir()
    (out / "rank0.done").touch()
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        if calls[0] == 2:  # rank 0 renames between rank 1's marker and its first poll
            out.rename(tmp_path / "c")
        return float(calls[0])  # the old code polled until its timeout: False

    assert settle(out, 1, 3, timeout_s=60.0, clock=clock) is True
    assert calls[0] >= 2
