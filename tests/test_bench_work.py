"""bench.bench_work on a tiny model: per mix, the handler's time and its CPU per
instance, split into Runtime.predict and the rest."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import bench_work
from serve.constants import ARTIFACT_NAME
from tests.fixtures.torchserve import tiny_random_artifact


def test_bench_work_splits_the_cpu_into_predict_and_the_rest(tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copyfile(tiny_random_artifact(tmp_path / "s0.pt", seed=0), model / ARTIFACT_NAME)
    out = tmp_path / "work.json"
    assert bench_work.main(["--model-dir", str(model), "--batches", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["form"] == "context"
    assert [r["mix"] for r in doc["rows"]] == ["single", "ranking", "mixed"]
    for r in doc["rows"]:
        assert r["cpu_per_instance_us"] > r["predict_cpu_per_instance_us"] > 0, r
        assert r["rest_cpu_per_instance_us"] == pytest.approx(
            r["cpu_per_instance_us"] - r["predict_cpu_per_instance_us"], abs=0.02)
    assert "= predict" in capsys.readouterr().out
