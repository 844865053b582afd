"""Archive digests (review N5): the build records each ``.mar``'s sha256 in the model
repository, and the sidecar registers an archive with TorchServe only when its bytes match
it; an archive whose digest is absent or differs is refused, naming the version and the
rule.

Repository and archive tests use the real classes on files in ``tmp_path``; the HTTP
ones the real sidecar app under uvicorn on a fake TorchServe (tests/test_deltas_sidecar.py's
``start_pod``: version ``tiny-a`` served, ``tiny-b`` in the repository)."""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest

from serve.common.net import wait_until
from serve.errors import ConfigError
from serve.ops import keys
from serve.sidecar.adapters.archives import CandidateArchive, rewrite_mar
from serve.sidecar.adapters.torchserve import Observed
from serve.sidecar.control.switch import plan_switch
from serve.state import Batching, DesiredState, ModelRef, Rollout, write_state
from serve.store.repository import DIGEST_SUFFIX, ModelRepository
from tests.fixtures.sidecar import toy_mar
from tests.test_deltas_sidecar import OTHER, SERVED, TOKEN, start_pod

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _repo(tmp_path: Path, *versions: str) -> ModelRepository:
    repo = ModelRepository([tmp_path / "repo"])
    for i, v in enumerate(versions):
        repo.add(v, toy_mar(tmp_path / f"src-{v}.mar", version=v),
                 {"created_at": f"2026-01-01T00:00:0{i}Z", "version": v})
    return repo


def _digest_file(repo: ModelRepository, version: str) -> Path:
    mar = repo.archive(version)
    return mar.with_name(mar.name + DIGEST_SUFFIX)


def _tamper(path: Path) -> None:
    """Change the archive's bytes in place (a zip comment: it still opens)."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(data[:-2] + (1).to_bytes(2, "little") + b"x")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ the repository


def test_add_records_the_archives_sha256_before_the_report(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "v1")
    mar = repo.archive("v1")
    f = _digest_file(repo, "v1")
    assert f.read_text() == f"{_sha(mar)}  {mar.name}\n"      # sha256sum's format
    assert os.stat(f).st_mode & 0o777 == 0o444
    assert repo.check_archive("v1") == _sha(mar)
    assert repo.versions() == ["v1"]                          # not listed as a version
    repo.remove("v1")
    assert not f.exists()


def test_an_absent_or_different_digest_refuses_the_version(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "v1", "v2")
    mar1 = repo.archive("v1")
    _digest_file(repo, "v1").unlink()
    with pytest.raises(ConfigError, match=r"^model version 'v1': archive digest: no sha256 is "
                                          r"recorded for .*dlrm-v1\.mar \(dlrm-v1\.mar\.sha256 "
                                          r"is missing\), and an archive is registered only "
                                          r"when its bytes match the digest its build "
                                          r"recorded\..*index-archives"):
        repo.check_tables("v1")
    want = _sha(repo.archive("v2"))
    _tamper(repo.archive("v2"))
    with pytest.raises(ConfigError, match=rf"^model version 'v2': archive digest: .*dlrm-v2\.mar "
                                          rf"has sha256 {_sha(repo.archive('v2'))}, but its "
                                          rf"build recorded {want}: the archive was changed "
                                          rf"after it was built"):
        repo.check_tables("v2")
    _digest_file(repo, "v2").chmod(0o644)
    _digest_file(repo, "v2").write_text("not a digest\n")
    with pytest.raises(ConfigError, match=r"must be one line '<sha256>  dlrm-v2\.mar'"):
        repo.check_archive("v2")
    assert mar1.exists()


def test_index_archives_records_only_missing_digests(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    repo = _repo(tmp_path, "v1", "v2")
    _digest_file(repo, "v1").unlink()
    before = _digest_file(repo, "v2").read_text()
    assert keys.main(["index-archives", "--repository", str(tmp_path / "repo")]) == 0
    out = capsys.readouterr().out
    assert "v1: recorded in" in out and "v2: already recorded in" in out
    assert repo.check_archive("v1") == _sha(repo.archive("v1"))
    assert _digest_file(repo, "v2").read_text() == before


# ------------------------------------------------------------------ the switch


def _desired(version: str, candidate: str | None = None) -> DesiredState:
    return DesiredState(model=ModelRef(version=version),
                        batching=Batching(batch_size=8, max_batch_delay_ms=5), workers=1,
                        rollout=None if candidate is None else Rollout(candidate=candidate, weight=0.1))


@pytest.mark.parametrize("how", ["absent", "different"])
def test_a_switch_to_an_archive_without_its_digest_is_refused_before_any_copy(
        tmp_path: Path, how: str) -> None:
    repo = _repo(tmp_path, "v1", "v2")
    if how == "absent":
        _digest_file(repo, "v2").unlink()
    else:
        _tamper(repo.archive("v2"))
    store = tmp_path / "store"
    store.mkdir()
    for desired in (_desired("v2"), _desired("v1", candidate="v2")):
        with pytest.raises(ConfigError, match=r"^model version 'v2': archive digest: "):
            plan_switch(Observed(None), desired, repo, store=store, model="dlrm")
    assert list(store.iterdir()) == []
    plan = plan_switch(Observed(None), _desired("v1"), repo, store=store, model="dlrm")
    assert plan is not None and plan.src_sha256 == _sha(repo.archive("v1"))


def test_rewrite_mar_checks_the_bytes_it_copies(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "v1", "v2")
    src, cand = repo.archive("v1"), repo.archive("v2")
    dst = tmp_path / "store" / "dlrm-v1_b8d5w1.mar"
    dst.parent.mkdir()
    kw = {"version": "v1_b8d5w1", "batch_size": 8, "max_batch_delay_ms": 5, "workers": 1}
    with pytest.raises(ConfigError, match=rf"^archive digest: .*dlrm-v1\.mar has sha256 "
                                          rf"{_sha(src)}, but its build recorded {'0' * 64}: "
                                          rf"it changed after the check"):
        rewrite_mar(src, dst, src_sha256="0" * 64, **kw)  # type: ignore[arg-type]
    bad = CandidateArchive("v2", cand, tmp_path / "store" / "c.json", sha256="1" * 64)
    with pytest.raises(ConfigError, match=re.escape(f"{cand} has sha256 {_sha(cand)}")):
        rewrite_mar(src, dst, src_sha256=_sha(src), candidate=bad, **kw)  # type: ignore[arg-type]
    assert list(dst.parent.iterdir()) == []
    good = CandidateArchive("v2", cand, tmp_path / "store" / "c.json", sha256=_sha(cand))
    assert rewrite_mar(src, dst, src_sha256=_sha(src), candidate=good,  # type: ignore[arg-type]
                       **kw).is_file()


# ------------------------------------------------------------------ the live sidecar


def test_put_state_and_a_declared_switch_to_an_unrecorded_archive_are_refused(
        tmp_path: Path) -> None:
    pod = start_pod(tmp_path, deltas=False)
    repo = ModelRepository([tmp_path / "repo"])
    try:
        with pod.client() as c:
            _digest_file(repo, OTHER).unlink()
            body = {"model": {"version": OTHER}, "batching": {"batch_size": 8,
                                                             "max_batch_delay_ms": 50},
                    "workers": 2}
            r = c.put("/state", json=body, headers=AUTH)
            assert r.status_code == 400, r.text
            assert r.json()["message"].startswith(
                f"invalid PUT /state body: model.version: model version {OTHER!r}: archive "
                f"digest: no sha256 is recorded for ")
            keys.main(["index-archives", "--repository", str(tmp_path / "repo")])
            _tamper(repo.archive(OTHER))
            r = c.put("/state", json=body, headers=AUTH)
            assert r.status_code == 400 and "but its build recorded" in r.json()["message"]
            # declared behind the API's back (the state file): the switch is refused
            write_state(tmp_path / "state" / "state.yaml", _desired(OTHER))
            wait_until(lambda: "archive digest" in str(c.get("/state").json()["last_error"]),
                       timeout_s=30, what="the switch refused", interval_s=0.05)
            err = c.get("/state").json()["last_error"]
            assert f"model version {OTHER!r}: archive digest:" in err
            assert all(v.startswith(SERVED) for v in pod.ts.versions), pod.ts.versions
    finally:
        pod.stop()


# ------------------------------------------------------------------ the signed index


def test_a_signed_digest_is_required_with_an_archive_verify_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from serve.common.signing import load_signing_key, load_verify_key

    assert keys.main(["generate", "--out", str(tmp_path / "keys"), "--name",
                      "model-signing"]) == 0
    key_file, pub_file = tmp_path / "keys" / "model-signing.key", tmp_path / "keys" / "model-signing.pub"
    assert key_file.stat().st_mode & 0o777 == 0o600
    other_key, _ = keys.generate(tmp_path / "other")
    _repo(tmp_path, "v1", "v2")
    strict = ModelRepository([tmp_path / "repo"], verify_key=load_verify_key(pub_file))
    with pytest.raises(ConfigError, match=r"^model version 'v1': archive signature: "
                                          r"dlrm-v1\.mar\.sha256\.sig is missing, and this "
                                          r"sidecar registers only archives whose digest is "
                                          r"signed with the key"):
        strict.check_tables("v1")
    assert keys.main(["sign-archives", "--key", str(key_file), "--repository",
                      str(tmp_path / "repo"), "v1"]) == 0
    assert "v1: signed by key" in capsys.readouterr().out
    assert strict.check_archive("v1") == _sha(strict.archive("v1"))
    # another key's signature, and a digest rewritten with its archive, are refused
    from serve.store.repository import sign_archive_digest
    sign_archive_digest(strict, "v2", load_signing_key(other_key))
    with pytest.raises(ConfigError, match=r"^model version 'v2': archive signature: "
                                          r"dlrm-v2\.mar\.sha256\.sig: the signature does not "
                                          r"verify under the verify key"):
        strict.check_archive("v2")
    sign_archive_digest(strict, "v2", load_signing_key(key_file))
    strict.check_archive("v2")
    _tamper(strict.archive("v2"))
    f = _digest_file(strict, "v2")
    f.chmod(0o644)
    f.write_text(f"{_sha(strict.archive('v2'))}  dlrm-v2.mar\n")  # the forger's digest
    with pytest.raises(ConfigError, match="archive signature: .*does not verify"):
        strict.check_archive("v2")
    ModelRepository([tmp_path / "repo"]).check_archive("v2")  # without a key: digest only
    strict.remove("v1")
    assert not (tmp_path / "repo" / "dlrm-v1.mar.sha256.sig").exists()


def test_the_sidecar_registers_only_signed_archives_with_archive_verify_key(
        tmp_path: Path) -> None:
    _, pub_file = keys.generate(tmp_path / "keys")
    pod = start_pod(tmp_path, deltas=False, converge=False, archive_verify_key=pub_file)
    try:
        with pod.client() as c:
            wait_until(lambda: "archive signature" in str(c.get("/state").json()["last_error"]),
                       timeout_s=30, what="the unsigned archive refused", interval_s=0.05)
            assert pod.ts.versions == {}
            assert keys.main(["sign-archives", "--key", str(tmp_path / "keys" / keys.KEY_NAME),
                              "--repository", str(tmp_path / "repo"), SERVED]) == 0
            wait_until(lambda: c.get("/state").json()["converged"], timeout_s=30,
                       what="the signed archive served", interval_s=0.05)
    finally:
        pod.stop()
