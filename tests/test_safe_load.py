"""What the build machine and the pod load is checked before it runs (review N3).

* DCP ``.metadata`` is read with an allow-listed unpickler (``serve.model.safe_meta``) by
  the importer (CLI, streaming source), the merge path and ``dcp.load``: what ``dcp.save``
  and our 2-rank training write reads exactly as ``pickle.load`` reads it; a ``.metadata``
  that pickles ``os.system`` fails every reader with ``CheckpointError`` (the CLI exits 2)
  and the payload never runs. Each test proves its payload is live: the stock reader, run
  last on a copy, does run it.
* An exported program (``dense.kind == "export"``) whose archive carries a pickled
  payload is refused with ``ArtifactError`` before ``torch.export.load``
  (``serve.runtime.program_check``), for each way torch 2.13 would unpickle or run it.
* The program's sha256 is recorded at import (report and artifact) and checked at load.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from serve.errors import ArtifactError, CheckpointError
from serve.model.safe_meta import read_metadata, safe_dcp_load
from serve.runtime.artifact import ExportedDense, load_artifact, save_artifact
from serve.runtime.engine import Runtime, RuntimeConfig
from serve.runtime.program_check import check_program, program_sha256
from tests.fixtures.own_models import random_artifact

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "own_models.py"
REFUSED = r"is refused: global posix\.system is not allowed"


class _Payload:
    """Pickles as ``os.system("touch <marker>")``: the attack, made harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _ranker_dcp(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    from serve.model.importer import load_factory

    fn, _ = load_factory(f"{FIXTURE}:make_ranker")
    torch.manual_seed(seed)
    state = fn().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def _poison(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))


def _stock_reader_runs_it(ckpt: Path, marker: Path) -> bool:
    """The control: torch's own reader on the same file runs the payload."""
    from torch.distributed.checkpoint import FileSystemReader

    with contextlib.suppress(Exception):   # os.system returns an int, not a Metadata
        FileSystemReader(str(ckpt)).read_metadata()
    return marker.exists()


# ----------------------------------------------------------------------------- DCP metadata
def test_what_dcp_and_our_training_write_reads_as_pickle_does(tmp_path: Path) -> None:
    _ranker_dcp(tmp_path / "ck")
    want = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    got = read_metadata(tmp_path / "ck")
    assert got.state_dict_metadata == want.state_dict_metadata
    assert got.storage_data == want.storage_data and got.planner_data == want.planner_data
    assert got.storage_meta.checkpoint_id == want.storage_meta.checkpoint_id
    # the 2-rank DMP checkpoints of our tiny trainings (cached by the fixtures), if built
    for md_file in sorted((REPO / "build" / "test-cache").glob("*/checkpoint/.metadata")):
        ours = read_metadata(md_file.parent)
        assert ours.state_dict_metadata == pickle.loads(md_file.read_bytes()).state_dict_metadata


def test_a_malicious_metadata_fails_the_importer_cli_with_exit_2(tmp_path: Path) -> None:
    ckpt, marker, store = tmp_path / "ck", tmp_path / "pwned", tmp_path / "store"
    _ranker_dcp(ckpt)
    _poison(ckpt, marker)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMP": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "serve.model.importer",
                        "--factory", f"{FIXTURE}:make_ranker", "--checkpoint", str(ckpt),
                        "--version", "evil", "--model-store", str(store)],
                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "import failed: checkpoint metadata" in r.stderr
    assert "global posix.system is not allowed" in r.stderr
    assert not marker.exists()
    assert not store.exists() or not any(store.iterdir())
    assert _stock_reader_runs_it(ckpt, marker)


def test_a_malicious_metadata_fails_every_reader_and_never_runs(tmp_path: Path) -> None:
    from serve.model.ckpt_stream import DcpSource
    from serve.model.importer import load_checkpoint, load_factory
    from serve.model.merge import check_checkpoint, load_dcp_into

    ckpt, marker = tmp_path / "ck", tmp_path / "pwned"
    _ranker_dcp(ckpt)
    _poison(ckpt, marker)
    fn, _ = load_factory(f"{FIXTURE}:make_ranker")
    with pytest.raises(CheckpointError, match=REFUSED):
        check_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=REFUSED):
        load_dcp_into(fn(), ckpt)
    with pytest.raises(CheckpointError, match=REFUSED):
        load_checkpoint(fn(), ckpt)
    with pytest.raises(CheckpointError, match=REFUSED):
        DcpSource(ckpt)
    with pytest.raises(CheckpointError, match=REFUSED):
        safe_dcp_load(fn().state_dict(), ckpt)
    assert not marker.exists()
    assert _stock_reader_runs_it(ckpt, marker)


def test_dcp_load_reads_tensors_and_refuses_a_pickled_item(tmp_path: Path) -> None:
    """DCP's default planner unpickles a non-tensor item with weights_only=False."""
    import torch.distributed.checkpoint as dcp

    ckpt, marker = tmp_path / "ck", tmp_path / "pwned"
    want = _ranker_dcp(ckpt, seed=3)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    safe_dcp_load(got, ckpt)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(3), "obj": _Payload(marker)},
                 checkpoint_id=str(tmp_path / "obj"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"item 'obj' is pickled bytes, not a tensor"):
        safe_dcp_load({"w": torch.zeros(3), "obj": None}, tmp_path / "obj")
    assert not marker.exists()
    with warnings.catch_warnings():   # the control: stock dcp.load runs it
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"w": torch.zeros(3), "obj": None}, checkpoint_id=str(tmp_path / "obj"),
                 no_dist=True)
    assert marker.exists()


# ----------------------------------------------------------------------------- programs
def _art():
    return random_artifact((("t", 40, 8, "sum", "int8"),), (("f", "t", 2),), seed=1)


def _rewrite(program: bytes, edit) -> bytes:
    """The program's zip with ``edit(root, members)`` applied (members: name -> bytes)."""
    src = zipfile.ZipFile(io.BytesIO(program))
    members = {n: src.read(n) for n in src.namelist()}
    root = src.namelist()[0].split("/", 1)[0] + "/"
    edit(root, members)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n, b in members.items():
            z.writestr(n, b)
    return out.getvalue()


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _pickled_constant(marker: Path):
    def edit(root: str, m: dict[str, bytes]) -> None:
        m[root + "data/constants/tensor_0"] = _saved(_Payload(marker))
        m[root + "data/constants/model_constants_config.json"] = (
            b'{"config": {"evil": {"path_name": "tensor_0", "is_param": false, '
            b'"use_pickle": true, "tensor_meta": null}}}')
    return edit


def _custom_obj(marker: Path):
    def edit(root: str, m: dict[str, bytes]) -> None:
        m[root + "data/constants/custom_obj_0"] = pickle.dumps(_Payload(marker))
        m[root + "data/constants/model_constants_config.json"] = (
            b'{"config": {"evil": {"path_name": "custom_obj_0", "is_param": false, '
            b'"use_pickle": true, "tensor_meta": null}}}')
    return edit


def _opaque_obj(marker: Path):
    def edit(root: str, m: dict[str, bytes]) -> None:
        m[root + "data/constants/opaque_obj_0"] = pickle.dumps(_Payload(marker))
        m[root + "data/constants/model_constants_config.json"] = (
            b'{"config": {"evil": {"path_name": "opaque_obj_0", "is_param": false, '
            b'"use_pickle": true, "tensor_meta": null}}}')
    return edit


def _legacy_weights(marker: Path):
    def edit(root: str, m: dict[str, bytes]) -> None:
        m[root + "data/weights/model.pt"] = _saved(_Payload(marker))
    return edit


def _sample_inputs(marker: Path):
    def edit(root: str, m: dict[str, bytes]) -> None:
        m[root + "data/sample_inputs/model.pt"] = _saved((_Payload(marker),))
    return edit


def _native_code(marker: Path):
    def edit(root: str, m: dict[str, bytes]) -> None:
        m[root + "data/aotinductor/model/model.so"] = b"\x7fELF"
    return edit


# live: the control shows stock torch.export.load running the payload. A custom object
# goes through TorchScript's unpickler and AOTInductor code through dlopen: refused all the
# same, without a control here.
@pytest.mark.parametrize("attack,match,live", [
    (_pickled_constant, r"entry 'evil' is 'tensor_0' with use_pickle True: a pickled object",
     True),
    (_opaque_obj, r"entry 'evil' is 'opaque_obj_0' with use_pickle True", True),
    (_custom_obj, r"entry 'evil' is 'custom_obj_0' with use_pickle True", False),
    (_legacy_weights, r"holds \['data/weights/model\.pt'\]", True),
    (_sample_inputs, r"data/sample_inputs/model\.pt does not load as plain tensors", True),
    (_native_code, r"holds \['data/aotinductor/model/model\.so'\]", False),
], ids=["pickled-constant", "opaque-obj", "custom-obj", "legacy-weights", "sample-inputs",
        "aoti"])
def test_a_program_with_a_pickled_payload_is_refused_before_it_runs(
        tmp_path: Path, attack, match: str, live: bool) -> None:
    marker = tmp_path / "pwned"
    art = _art()
    evil = _rewrite(art.dense.program.numpy().tobytes(), attack(marker))
    art.dense = ExportedDense(torch.frombuffer(bytearray(evil), dtype=torch.uint8))
    save_artifact(art, tmp_path / "artifact.pt")
    loaded = load_artifact(tmp_path / "artifact.pt")   # its digest is its own: accepted
    with pytest.raises(ArtifactError, match=match):
        Runtime(loaded, RuntimeConfig())
    assert not marker.exists()
    if live:   # the control: stock torch.export.load runs it
        with contextlib.suppress(Exception):   # what it unpickled is not a tensor
            torch.export.load(io.BytesIO(evil))
        assert marker.exists()


def test_a_program_in_the_older_format_or_not_a_zip_is_refused() -> None:
    def legacy(root: str, m: dict[str, bytes]) -> None:
        del m[root + "archive_format"]
    good = _art().dense.program.numpy().tobytes()
    check_program(good)
    with pytest.raises(ArtifactError, match=r"not a pt2 archive of one model"):
        check_program(_rewrite(good, legacy))
    with pytest.raises(ArtifactError, match=r"not a torch.export archive \(not a zip\)"):
        check_program(b"not a zip")


def test_a_program_changed_after_the_import_is_refused_at_load(tmp_path: Path) -> None:
    art = _art()
    save_artifact(art, tmp_path / "artifact.pt")
    blob = torch.load(tmp_path / "artifact.pt", weights_only=True)
    assert blob["dense"]["program_sha256"] == program_sha256(art.dense.program)
    # the same head with other weights: a plain, valid program, but not the imported one
    other_bytes = random_artifact((("t", 40, 8, "sum", "int8"),), (("f", "t", 2),),
                                  seed=2).dense.program
    assert program_sha256(other_bytes) != program_sha256(art.dense.program)
    blob["dense"]["program"] = other_bytes
    torch.save(blob, tmp_path / "swapped.pt")
    with pytest.raises(ArtifactError, match=r"artifact .*swapped\.pt: the exported program's "
                                            r"sha256 is [0-9a-f]{64}, the artifact recorded "
                                            r"[0-9a-f]{64} at import"):
        load_artifact(tmp_path / "swapped.pt")
    del blob["dense"]["program_sha256"]   # an artifact from before the digest still loads
    torch.save(blob, tmp_path / "old.pt")
    assert load_artifact(tmp_path / "old.pt").dense.sha256 == program_sha256(other_bytes)


def test_the_import_records_the_programs_sha256_in_report_and_artifact(tmp_path: Path) -> None:
    from serve.model.importer import ImportConfig, import_model, load_factory
    from serve.store.repository import ModelRepository

    fn, _ = load_factory(f"{FIXTURE}:make_ranker")
    torch.manual_seed(0)
    torch.save(fn().state_dict(), tmp_path / "ranker.pt")
    import_model(ImportConfig(factory=f"{FIXTURE}:make_ranker", checkpoint=tmp_path / "ranker.pt",
                              version="own-d", model_store=tmp_path / "store"),
                 say=lambda m: None)
    repo = ModelRepository([tmp_path / "store"])
    report = repo.report("own-d")
    work = tmp_path / "mar"
    with zipfile.ZipFile(repo.archive("own-d")) as z:
        z.extract("artifact.pt", work)
    art = load_artifact(work / "artifact.pt", tables_path=[tmp_path / "store"])
    assert report["program_sha256"] == art.dense.sha256 == program_sha256(art.dense.program)
    shutil.rmtree(work)
