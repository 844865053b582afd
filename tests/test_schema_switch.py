"""A direct switch of ``model.version`` to another request schema (issue 54, "found by
trying it"): PUT /state refuses it with 409 naming the difference and changes nothing,
unless the declaration says the change is intended (``model.schema_change: true``).

The comparison is the rollout's (:func:`check_rollout_schema`): dense count, sparse
features and their order, max ids; table sizes and dims may differ."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from serve.errors import Conflict
from serve.sidecar.adapters.model_schemas import SchemaCache, check_switch_schema
from serve.state import ALLOWED_FIELDS, DesiredState, dump_state, load_state, write_state
from serve.store.repository import ModelRepository
from tests.fixtures.sidecar import FakeTorchServe
from tests.test_reconciler import (
    OWN,
    OWN_WIDER,
    World,
    desired,
    make_app,
    requests,
    schema_repo,  # noqa: F401 - the fixture
)

WIDER = ["dense features: 2 vs 3", "sparse features only in the second: ['user_id']"]


# ------------------------------------------------------------------ the check (pure)


def test_the_switch_check_compares_requests_and_honours_the_flag() -> None:
    reports: dict[str, dict[str, Any]] = {"a": {"schema": OWN.to_dict()}, "b": {},
                                          "c": {"schema": OWN_WIDER.to_dict()}}
    schemas = SchemaCache(reports.__getitem__)
    check_switch_schema(schemas, "a", "a")
    check_switch_schema(schemas, "a", "b")        # b's schema is unknown: not compared
    check_switch_schema(schemas, "a", "missing")  # no report
    check_switch_schema(schemas, "a", "c", intended=True)
    with pytest.raises(Conflict) as e:
        check_switch_schema(schemas, "a", "c")
    message = e.value.message
    assert message.startswith("model.version: 'c' takes other requests than the declared "
                              "version 'a' (dense features: 2 vs 3; ")
    assert 'declare it intended: "model": {"version": "c", "schema_change": true}' in message


def test_the_flag_is_written_only_when_set() -> None:
    plain = desired("own-a")
    assert "schema_change" not in dump_state(plain)
    assert plain.model_dump(mode="json")["model"] == {"version": "own-a"}
    flagged = DesiredState.model_validate({"model": {"version": "own-c",
                                                     "schema_change": True}})
    assert yaml.safe_load(dump_state(flagged))["model"] == {"version": "own-c",
                                                            "schema_change": True}
    assert "model.schema_change" in ALLOWED_FIELDS
    with pytest.raises(ValueError, match="schema_change"):
        DesiredState.model_validate({"model": {"version": "own-c", "schema_change": "yes"}})


# ------------------------------------------------------------------ the reconciler's write


def test_the_reconcilers_write_refuses_and_writes_nothing(tmp_path: Path,
                                                          schema_repo: ModelRepository) -> None:  # noqa: F811
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired("own-a"))
    before = state_file.read_text()
    w = World(FakeTorchServe(tmp_path / "store"), schema_repo, state_file)
    w.tick()
    with pytest.raises(Conflict, match=r"'own-c' takes other requests than the declared "
                                       r"version 'own-a'"):
        w.rec.write(desired("own-c"))
    assert state_file.read_text() == before
    assert w.rec.desired == desired("own-a")
    w.rec.write(desired("own-b"))  # the same requests, other tables: a plain switch
    assert load_state(state_file).model.version == "own-b"


def test_an_edit_of_the_state_file_to_another_schema_is_refused_until_declared(
        tmp_path: Path, schema_repo: ModelRepository) -> None:  # noqa: F811
    """The same rule for the file (a hand edit, the ConfigMap in Kubernetes): the last
    accepted state stays served and the refusal is the pass's error; with
    ``model.schema_change: true`` the edit is taken."""
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired("own-a"))
    w = World(FakeTorchServe(tmp_path / "store"), schema_repo, state_file)
    w.tick()
    assert w.rec.desired == desired("own-a")
    write_state(state_file, desired("own-c"))
    w.tick()
    assert w.rec.desired == desired("own-a")
    status = w.status()
    assert "'own-c' takes other requests than the declared version 'own-a'" in \
        status["last_error"]
    assert status["desired"]["model"]["version"] == "own-a"
    write_state(state_file, DesiredState.model_validate(
        {"model": {"version": "own-c", "schema_change": True}}))
    w.tick()
    assert w.rec.desired.model.version == "own-c"
    assert w.rec.file_error is None


# ------------------------------------------------------------------ PUT /state


@pytest.mark.parametrize("stable, target, differences", [
    ("own-a", "own-c", WIDER),
    ("tiny-s0", "own-a", ["dense features: 13 vs 2"]),
])
def test_a_direct_switch_to_another_request_schema_is_409_and_changes_nothing(
        tmp_path: Path, schema_repo: ModelRepository, stable: str, target: str,  # noqa: F811
        differences: list[str]) -> None:
    ts = FakeTorchServe(tmp_path / "store")
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired(stable))
    before = state_file.read_text()
    body = {"model": {"version": target}, "batching": {"batch_size": 3,
                                                       "max_batch_delay_ms": 1}}
    _, put, get, tuner = requests(make_app(ts, schema_repo, state_file), ("WAIT", "", None),
                                  ("PUT", "/state", body), ("GET", "/state", None),
                                  ("GET", "/tuner", None))
    assert put.status_code == 409, put.text
    answer = put.json()
    assert (answer["code"], answer["type"]) == (409, "Conflict")
    assert answer["message"].startswith(f"model.version: {target!r} takes other requests "
                                        f"than the declared version {stable!r} (")
    for difference in differences:
        assert difference in answer["message"]
    assert state_file.read_text() == before
    state = get.json()
    assert state["desired"]["model"] == {"version": stable}
    assert state["observed"]["model"]["version"] == stable and state["converged"]
    assert "PUT /state" not in str(tuner.json())  # the tuner was not pinned either


def test_a_declared_schema_change_is_accepted_and_served(
        tmp_path: Path, schema_repo: ModelRepository) -> None:  # noqa: F811
    ts = FakeTorchServe(tmp_path / "store")
    state_file = tmp_path / "state.yaml"
    write_state(state_file, desired("own-a"))
    body = {"model": {"version": "own-c", "schema_change": True}}
    _, put, done = requests(make_app(ts, schema_repo, state_file), ("WAIT", "", None),
                            ("PUT", "/state", body), ("WAIT", "", None))
    assert put.status_code == 202, put.text
    assert put.json()["desired"]["model"] == {"version": "own-c", "schema_change": True}
    assert load_state(state_file).model.schema_change is True
    assert done.json()["observed"]["model"]["version"] == "own-c"
    assert done.json()["converged"]


# ------------------------------------------------------------------ the real service


@pytest.mark.integration
@pytest.mark.slow
def test_a_real_sidecar_refuses_the_switch_and_keeps_serving(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The launcher, TorchServe and the sidecar (uvicorn) over a tiny built-in version and
    (newer) an import of another request schema: PUT /state to the import is a 409 and
    the built-in version keeps answering its clients."""
    import httpx

    from serve.api.binary import example_binary
    from serve.model.archive import build_mar
    from tests.fixtures.served import serve_repository
    from tests.fixtures.sidecar import toy_mar
    from tests.fixtures.torchserve import tiny_random_artifact

    root = tmp_path_factory.mktemp("switch")
    art = tiny_random_artifact(root / "artifact.pt", seed=4)
    mar = build_mar(art, root / "build", model_name="dlrm", version="tiny-b", batch_size=1,
                    max_batch_delay_ms=0, handler_config={"num_threads": 1},
                    min_workers=1, max_workers=1, file_name="tiny-b.mar")
    repo = ModelRepository([root / "model_store"])
    repo.add("tiny-b", mar, {"version": "tiny-b", "profile": "tiny",
                             "quantized_dtype": "int8",
                             "created_at": "2026-12-01T00:00:00+00:00"})
    repo.add("own-c", toy_mar(root / "own.mar", version="own-c"),
             {"version": "own-c", "schema": OWN_WIDER.to_dict(),
              "created_at": "2026-12-07T00:00:00+00:00"})
    with serve_repository(root, state={"model": {"version": "tiny-b"}, "workers": 1}) as s:
        before = s.cfg.path(s.cfg.state_file).read_text()
        put = httpx.put(f"{s.write_url}/state", json={"model": {"version": "own-c"}},
                        headers={"Authorization": f"Bearer {s.token}"}, timeout=30)
        assert put.status_code == 409, put.text
        assert put.json()["message"].startswith(
            "model.version: 'own-c' takes other requests than the declared version 'tiny-b' "
            "(dense features: 13 vs 3")
        assert s.cfg.path(s.cfg.state_file).read_text() == before
        state = s.state()
        assert state["desired"]["model"] == {"version": "tiny-b"} and state["converged"]
        assert len(s.predictions(example_binary(4, seed=2, max_id=100))) == 4
