"""The desired-state schema (serve.state) and the model repository (serve.store.repository)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from serve.errors import ConfigError
from serve.state import (
    DesiredState,
    dump_state,
    load_state,
    parse_serving_version,
    parse_state,
    serving_version,
    write_state,
)
from serve.store.repository import ModelRepository

GOOD = {"model": {"version": "small-int8-s0"},
        "batching": {"batch_size": 2, "max_batch_delay_ms": 2}, "workers": 2, "rollout": None}


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    state = parse_state(GOOD)
    write_state(tmp_path / "s.yaml", state)
    assert load_state(tmp_path / "s.yaml") == state
    assert dump_state(state).splitlines()[0] == "model:"
    assert state.model_dump(mode="json") == GOOD


def test_defaults_fill_batching_and_workers() -> None:
    state = parse_state({"model": {"version": "v1"}})
    # the shipped batching: two requests, merged only when both are already queued
    assert (state.batching.batch_size, state.batching.max_batch_delay_ms, state.workers) == (2, 0, 2)


@pytest.mark.parametrize("body,match", [
    ({**GOOD, "extra": 1}, r"extra: unknown field"),
    ({**GOOD, "batching": {"batch_size": 0, "max_batch_delay_ms": 2}},
     r"batching\.batch_size: Input should be greater than or equal to 1 \(got 0\)"),
    ({**GOOD, "batching": {"batch_size": "8", "max_batch_delay_ms": 2}},
     r"batching\.batch_size: Input should be a valid integer \(got '8'\)"),
    ({**GOOD, "workers": 65}, r"workers: Input should be less than or equal to 64 \(got 65\)"),
    ({**GOOD, "model": {"version": "a_b"}}, r"model\.version: String should match pattern"),
    ({**GOOD, "rollout": {"canary": 1}},
     r"rollout\.candidate: Field required; rollout\.weight: Field required; rollout\.canary"),
    ({**GOOD, "rollout": {"candidate": "small-int8-s0", "weight": 0.1}},
     r"rollout: candidate 'small-int8-s0' is model\.version itself"),
    ({**GOOD, "rollout": {"candidate": "c", "weight": 0.5, "steps": [0.2]}},
     r"rollout\.steps: each step must be above"),
    ({**GOOD, "rollout": {"candidate": "c", "weight": 1.5}},
     r"rollout\.weight: Input should be less than or equal to 1"),
    ({**GOOD, "rollout": {"candidate": "c", "weight": 0.1, "mode": "ab"}},
     r"rollout\.mode: Input should be 'canary' or 'shadow'"),
    ({**GOOD, "rollout": {"candidate": "c", "weight": 0.1, "guards": {"max_psi": 1}}},
     r"rollout\.guards\.max_psi: unknown field"),
    ({"batching": GOOD["batching"]}, r"model: Field required"),
    ([1, 2], r"must be a mapping"),
])
def test_bad_states_name_the_field_and_the_rule(body: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_state(body)


def test_missing_and_invalid_files_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist; create it with `make up`"):
        load_state(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML"):
        load_state(tmp_path / "bad.yaml")


def test_serving_version_round_trip() -> None:
    name = serving_version("small-int8-s7", 16, 5, 2)
    assert name == "small-int8-s7_b16d5w2"
    assert parse_serving_version(name) == ("small-int8-s7", 16, 5, 2)
    assert parse_serving_version("1.0") is None
    assert DesiredState.model_validate(GOOD).serving_version() == "small-int8-s0_b2d2w2"
    with pytest.raises(ConfigError, match="must match"):
        serving_version("bad_name", 1, 1, 1)


def _add(repo: ModelRepository, tmp_path: Path, version: str, created: str) -> Path:
    src = tmp_path / f"src-{version}.mar"
    src.write_bytes(version.encode())
    return repo.add(version, src, {"created_at": created, "version": version})


def test_repository_lists_complete_versions_oldest_first(tmp_path: Path) -> None:
    repo = ModelRepository([tmp_path / "store"])
    assert repo.versions() == [] and repo.latest() is None
    _add(repo, tmp_path, "b-s7", "2026-12-01T10:00:00+00:00")
    _add(repo, tmp_path, "a-s0", "2026-12-01T09:00:00+00:00")
    # Noise that is not a complete version: a derived serving archive, a report without
    # its archive, an archive without its report.
    (tmp_path / "store" / "dlrm-a-s0_b2d2w2.mar").write_bytes(b"x")
    (tmp_path / "store" / "dlrm-c.json").write_text("{}")
    (tmp_path / "store" / "dlrm-d.mar").write_bytes(b"x")
    assert repo.versions() == ["a-s0", "b-s7"]
    assert repo.latest() == "b-s7"
    assert repo.archive("a-s0").read_bytes() == b"a-s0"
    assert repo.report("b-s7")["version"] == "b-s7"


def test_versions_are_immutable(tmp_path: Path) -> None:
    repo = ModelRepository([tmp_path / "store"])
    mar = _add(repo, tmp_path, "v1", "2026-12-01T09:00:00+00:00")
    assert not os.stat(mar).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    with pytest.raises(ConfigError, match=r"already exists .* versions are immutable"):
        _add(repo, tmp_path, "v1", "2026-12-02T09:00:00+00:00")
    with pytest.raises(ConfigError, match=r"must match"):
        _add(repo, tmp_path, "v_1", "2026-12-02T09:00:00+00:00")
    assert json.loads((tmp_path / "store" / "dlrm-v1.json").read_text())["created_at"].startswith("2026-12-01")


def test_unknown_version_lists_what_there_is(tmp_path: Path) -> None:
    repo = ModelRepository([tmp_path / "a", tmp_path / "b"])
    _add(ModelRepository([tmp_path / "b"]), tmp_path, "v1", "2026-12-01T09:00:00+00:00")
    assert repo.versions() == ["v1"]
    with pytest.raises(ConfigError, match=r"'v9' is not in the repository .* available: \['v1'\]"):
        repo.archive("v9")
