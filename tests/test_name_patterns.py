"""Names checked with a pattern are checked whole: ``^...$`` with ``re.match`` lets a
trailing newline through (``$`` also matches before a final ``\\n``), so a version
``"v1\\n"`` would pass and later name a file, a TorchServe model version or a metric
label. Every validator here must refuse it."""
from __future__ import annotations

from pathlib import Path

import pytest

from serve.errors import ConfigError, ServeError
from serve.schema import _name
from serve.state import parse_serving_version, parse_state
from serve.store.deltas.files import DeltaStore
from serve.store.repository import ModelRepository

BAD = ["v1\n", "v1\r\n", "v1\n\n"]


@pytest.mark.parametrize("bad", BAD)
def test_a_desired_state_version_with_a_newline_is_refused(bad: str) -> None:
    with pytest.raises(ServeError):
        parse_state({"model": {"version": bad}})
    assert parse_state({"model": {"version": "v1"}}).model.version == "v1"


@pytest.mark.parametrize("bad", BAD)
def test_a_feature_name_with_a_newline_is_refused(bad: str) -> None:
    with pytest.raises(ServeError):
        _name(bad, "feature")
    assert _name("C1", "feature") == "C1"


@pytest.mark.parametrize("bad", BAD)
def test_the_delta_store_and_the_repository_refuse_a_version_with_a_newline(
        tmp_path: Path, bad: str) -> None:
    with pytest.raises(ServeError):
        DeltaStore(tmp_path / "deltas").folder(bad)
    with pytest.raises(ConfigError):
        ModelRepository([tmp_path / "repo"]).add(bad, tmp_path / "x.mar", {})


def test_a_serving_version_with_a_newline_is_not_ours() -> None:
    assert parse_serving_version("v1_b2d2w2") == ("v1", 2, 2, 2)
    assert parse_serving_version("v1_b2d2w2\n") is None


# ------------------------------------------------------------------ unbounded input


BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"]
                 + [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, "
                    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
                    for i in range(9)]
                 + ["model: {version: *j}"])


def test_a_state_file_with_yaml_aliases_is_refused_at_once(tmp_path: Path) -> None:
    """Nested aliases ("billion laughs": 9 x 6^9 items here) are refused while parsing,
    by the loader (reading the file in the sidecar and in the launcher), and the message
    names the alias and its line instead of echoing the value."""
    import time

    from serve.sidecar.control.state_file import DesiredStateFile
    from serve.state import load_state

    path = tmp_path / "state.yaml"
    path.write_text(BOMB)
    t0 = time.monotonic()
    read = DesiredStateFile(path).read()
    assert read.state is None and read.error is not None
    assert "uses a YAML alias (*a) at line 2; write the values out" in read.error
    with pytest.raises(ConfigError, match="uses a YAML alias"):
        load_state(path)
    assert time.monotonic() - t0 < 1.0
    assert len(read.error) < 300


def test_a_state_file_over_its_bound_is_refused_without_reading_it_all(tmp_path: Path
                                                                       ) -> None:
    from serve.sidecar.control.state_file import DesiredStateFile
    from serve.state import STATE_MAX_BYTES

    path = tmp_path / "state.yaml"
    path.write_text("model: {version: v1}\n# " + "x" * (4 * STATE_MAX_BYTES))
    read = DesiredStateFile(path).read()
    assert read.state is None
    assert f"is {STATE_MAX_BYTES + 1} bytes; a desired state is at most {STATE_MAX_BYTES}" \
        in str(read.error)


def test_an_error_echoes_a_bounded_value() -> None:
    """A huge or deeply nested value in a bad field is shown cut, not whole."""
    huge = {"model": {"version": ["v" * 10_000] * 10_000}}
    with pytest.raises(ConfigError) as e:
        parse_state(huge)
    assert len(e.value.message) < 600, len(e.value.message)
    assert "model.version" in e.value.message
