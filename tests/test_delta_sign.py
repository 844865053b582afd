"""Signed embedding deltas (review N5): a pod with ``--delta-verify-key`` takes only deltas
signed with the matching private key, from the model volume and by POST; without a key
it says that it does not verify.

The volume tests use the sidecar's delta parts directly; the HTTP ones the real sidecar
app under uvicorn (tests/test_deltas_sidecar.py's ``start_pod``)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from serve.common.signing import load_signing_key, load_verify_key
from serve.errors import ConfigError
from serve.metrics import DELTA_REFUSAL_REASONS, DELTA_SKIP_REASONS
from serve.model.delta import DeltaConfig, _parser, build_delta, config_from_args
from serve.ops import keys
from serve.sidecar.config import SidecarConfig
from serve.sidecar.services.deltas.intake import DeltaIntake, refusal_reason
from serve.sidecar.services.deltas.volume import VolumeSync
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import decode_delta, encode_delta
from serve.store.deltas.header import canonical_json, read_header
from serve.store.deltas.signature import (
    DeltaSignatureError,
    check_signature,
    read_file_header,
)
from tests.promtext import samples
from tests.test_deltas_sidecar import REPORTS, SERVED, make_delta, post, snapshot, start_pod


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A fresh key pair (private 0600, public) written by the key tool."""
    return keys.generate(tmp_path / "keys")


@pytest.fixture
def other_pair(tmp_path: Path) -> tuple[Path, Path]:
    return keys.generate(tmp_path / "other-keys")


def signed(blob: bytes, key_file: Path) -> bytes:
    """``blob`` (an unsigned delta) re-encoded with a signature by ``key_file``."""
    return encode_delta(decode_delta(blob), load_signing_key(key_file))


def header_of(blob: bytes) -> dict:
    return read_header(memoryview(blob), len(blob))[0]


# ------------------------------------------------------------------ keys and the header


def test_the_key_tool_writes_a_private_key_only_its_owner_reads(pair: tuple[Path, Path]) -> None:
    key_file, pub_file = pair
    assert (os.stat(key_file).st_mode & 0o777, os.stat(pub_file).st_mode & 0o777) == (0o600,
                                                                                      0o644)
    assert load_signing_key(key_file).key_id == load_verify_key(pub_file).key_id
    with pytest.raises(FileExistsError, match="pass --force"):
        keys.generate(key_file.parent)
    os.chmod(key_file, 0o644)
    with pytest.raises(ConfigError, match=rf"^signing key {key_file} has mode 0644: a private "
                                          rf"key must be readable by its owner only .*run "
                                          rf"`chmod 600 {key_file}`"):
        load_signing_key(key_file)
    with pytest.raises(ConfigError, match="holds a private key: the pods verify with the "
                                          "public key only"):
        load_verify_key(key_file)


def test_a_signature_covers_the_checksum_and_the_chain_fields(
        pair: tuple[Path, Path], other_pair: tuple[Path, Path]) -> None:
    pub = load_verify_key(pair[1])
    blob = signed(make_delta(1), pair[0])
    header = header_of(blob)
    assert header["signature"]["alg"] == "ed25519"
    assert header["signature"]["key_id"] == pub.key_id
    check_signature(header, pub)                          # verifies
    assert decode_delta(blob).rows == decode_delta(make_delta(1)).rows  # checksum still holds
    # the checksum does not cover the signature: signing leaves an unsigned file's bytes
    assert encode_delta(decode_delta(blob)) == make_delta(1)
    for field, value in (("sequence", 2), ("parent_digest", "0" * 64), ("sha256", "1" * 64),
                         ("base_version", "tiny-b")):
        with pytest.raises(DeltaSignatureError, match="does not verify under the verify key") as e:
            check_signature({**header, field: value}, pub)
        assert (e.value.reason, e.value.field) == ("bad_signature", "header.signature")
    with pytest.raises(DeltaSignatureError, match="does not verify") as e:
        check_signature(header, load_verify_key(other_pair[1]))
    assert e.value.reason == "bad_signature"
    with pytest.raises(DeltaSignatureError, match=r"^header.signature: delta 1 of version "
                                                  r"'tiny-a' is not signed, and this pod "
                                                  r"verifies deltas with the key") as e:
        check_signature(header_of(make_delta(1)), pub)
    assert e.value.reason == "unsigned"
    bad = {**header["signature"], "value": "AAAA"}
    with pytest.raises(DeltaSignatureError, match="base64 of a 64-byte ed25519 signature"):
        check_signature({**header, "signature": bad}, pub)


def test_the_rows_changed_after_signing_fail_the_checksum(pair: tuple[Path, Path]) -> None:
    blob = bytearray(signed(make_delta(1), pair[0]))
    blob[-1] ^= 0xFF  # the last row byte: the header (and its signature) unchanged
    check_signature(header_of(bytes(blob)), load_verify_key(pair[1]))
    with pytest.raises(Exception, match="sha256: checksum"):
        decode_delta(bytes(blob))


def test_the_key_tool_signs_and_verifies_files(tmp_path: Path, pair: tuple[Path, Path],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "d.delta"
    f.write_bytes(make_delta(1))
    assert keys.main(["verify", "--key", str(pair[1]), str(f)]) == 1
    assert "is not signed" in capsys.readouterr().err
    assert keys.main(["sign", "--key", str(pair[0]), str(f)]) == 0
    assert f.read_bytes() == signed(make_delta(1), pair[0])
    assert keys.main(["verify", "--key", str(pair[1]), str(f)]) == 0
    assert "signature verifies under key" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        keys.main(["--help"])
    assert "generate" in capsys.readouterr().out


# ------------------------------------------------------------------ the volume


def _volume_parts(tmp_path: Path, pub: Path | None) -> tuple[DeltaIntake, VolumeSync]:
    intake = DeltaIntake(DeltaStore(tmp_path / "store"), versions=lambda: [SERVED],
                         report_of=lambda v: REPORTS[v],
                         verify_key=None if pub is None else load_verify_key(pub))
    return intake, VolumeSync(intake, lambda: [SERVED])


@pytest.mark.parametrize("how", ["unsigned", "bad_signature"])
def test_a_volume_delta_without_the_right_signature_is_skipped_counted_and_not_copied(
        tmp_path: Path, pair: tuple[Path, Path], other_pair: tuple[Path, Path], how: str,
        caplog: pytest.LogCaptureFixture) -> None:
    intake, volume = _volume_parts(tmp_path, pair[1])
    folder = tmp_path / "repo" / "deltas" / SERVED
    folder.mkdir(parents=True)
    name = folder / f"dlrm-{SERVED}-00000001.delta"
    name.write_bytes(make_delta(1) if how == "unsigned" else signed(make_delta(1), other_pair[0]))
    with caplog.at_level(logging.ERROR):
        assert volume.sync([tmp_path / "repo"]) == []
        assert volume.sync([tmp_path / "repo"]) == []   # retried, counted once
    assert intake.skipped.counts() == {how: 1}
    assert snapshot(tmp_path / "store") == {}            # not a byte copied
    (logged,) = [r.getMessage() for r in caplog.records if "not taken" in r.getMessage()]
    assert f"({how})" in logged and "header.signature" in logged
    from serve.metrics.deltas import delta_files_skipped_family
    fam = delta_files_skipped_family(intake.skipped.counts())
    got = {s.labels["reason"]: s.value for s in fam.samples if s.name.endswith("_total")}
    assert got[how] == 1 and set(got) == set(DELTA_SKIP_REASONS)
    name.write_bytes(signed(make_delta(1), pair[0]))    # the publisher's signed file
    assert [a.sequence for a in volume.sync([tmp_path / "repo"])] == [1]
    assert intake.signatures == f"verified (key {load_verify_key(pair[1]).key_id})"


def test_without_a_verify_key_an_unsigned_volume_delta_is_taken_as_before(
        tmp_path: Path) -> None:
    intake, volume = _volume_parts(tmp_path, None)
    folder = tmp_path / "repo" / "deltas" / SERVED
    folder.mkdir(parents=True)
    (folder / f"dlrm-{SERVED}-00000001.delta").write_bytes(make_delta(1))
    assert [a.sequence for a in volume.sync([tmp_path / "repo"])] == [1]
    assert intake.signatures == "not verified"


def test_a_file_swapped_after_its_signature_was_checked_is_checked_again(
        tmp_path: Path, pair: tuple[Path, Path]) -> None:
    """The signature is read from the volume file before the copy and again from the
    copy, so a file replaced in between is refused, never stored."""
    intake, _ = _volume_parts(tmp_path, pair[1])
    src = tmp_path / "d.delta"
    src.write_bytes(signed(make_delta(1), pair[0]))
    real_check = intake.check_signed
    calls: list[Path] = []

    def swap_after_first(path: Path) -> None:
        real_check(path)
        calls.append(path)
        if len(calls) == 1:
            src.write_bytes(make_delta(1))  # unsigned bytes now

    intake.check_signed = swap_after_first  # type: ignore[method-assign]
    with pytest.raises(DeltaSignatureError, match="is not signed"):
        intake.receive_file(src)
    assert intake.store.sequences(SERVED) == []


def test_signature_reasons_are_bounded_labels() -> None:
    assert {"unsigned", "bad_signature"} <= set(DELTA_SKIP_REASONS)
    assert {"unsigned", "bad_signature"} <= set(DELTA_REFUSAL_REASONS)
    assert refusal_reason(DeltaSignatureError("unsigned", "m")) == "unsigned"
    assert DeltaSignatureError("bad_signature", "m").to_json()["reason"] == "bad_signature"


# ------------------------------------------------------------------ POST and GET /state


def test_with_a_verify_key_an_unsigned_post_is_400_and_a_signed_one_is_taken(
        tmp_path: Path, pair: tuple[Path, Path], other_pair: tuple[Path, Path]) -> None:
    pod = start_pod(tmp_path, delta_verify_key=pair[1])
    key_id = load_verify_key(pair[1]).key_id
    try:
        with pod.client() as c:
            assert pod.delta_dir is not None
            before = snapshot(pod.delta_dir)
            r = post(c, make_delta(1))
            assert r.status_code == 400, r.text
            assert r.json() == {
                "code": 400, "type": "DeltaSignatureError", "field": "header.signature",
                "reason": "unsigned",
                "message": f"header.signature: delta 1 of version {SERVED!r} is not signed, "
                           f"and this pod verifies deltas with the key {key_id} "
                           f"(--delta-verify-key {pair[1]}); build it with `python -m "
                           f"serve.model.delta --sign-key FILE` (make delta SIGN_KEY=FILE) "
                           f"using the private key of that pair"}
            r = post(c, signed(make_delta(1), other_pair[0]))
            assert (r.status_code, r.json()["reason"]) == (400, "bad_signature")
            assert snapshot(pod.delta_dir) == before
            assert post(c, signed(make_delta(1), pair[0])).status_code == 202
            assert pod.store.sequences(SERVED) == [1]
            state = c.get("/state").json()
            assert state["deltas"] == {"signatures": f"verified (key {key_id})"}
            assert c.get("/embeddings/deltas").json()["signatures"] == \
                f"verified (key {key_id})"
            m = samples(c.get("/metrics").text)
        for reason in ("unsigned", "bad_signature"):
            assert m[("dlrm_delta_posts_refused_total", (("reason", reason),))] == 1
    finally:
        pod.stop()


def test_without_a_verify_key_the_pod_says_it_does_not_verify(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        pod = start_pod(tmp_path)
    try:
        with pod.client() as c:
            assert c.get("/state").json()["deltas"] == {"signatures": "not verified"}
            assert post(c, make_delta(1)).status_code == 202
    finally:
        pod.stop()
    assert any("signatures are NOT verified (no --delta-verify-key)" in r.getMessage()
               for r in caplog.records)
    off = start_pod(tmp_path / "off", deltas=False)
    try:
        with off.client() as c:
            assert "deltas" not in c.get("/state").json()
    finally:
        off.stop()


def test_the_verify_key_flag_env_and_a_bad_key_file(tmp_path: Path, pair: tuple[Path, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from serve.sidecar.http.app import build_parser

    args = build_parser().parse_args(["--delta-verify-key", str(pair[1])])
    assert args.delta_verify_key == pair[1] or Path(args.delta_verify_key) == pair[1]
    monkeypatch.setenv("DLRM_DELTA_VERIFY_KEY", str(pair[1]))
    assert Path(build_parser().parse_args([]).delta_verify_key) == pair[1]
    with pytest.raises(ConfigError, match="holds a private key"):
        start_pod(tmp_path, delta_verify_key=pair[0])
    assert SidecarConfig(token="t" * 32, delta_verify_key=str(pair[1])  # type: ignore[arg-type]
                         ).delta_verify_key == pair[1]


# ------------------------------------------------------------------ the builder


def test_the_builder_signs_with_sign_key_and_checks_it_before_any_training(
        tmp_path: Path, pair: tuple[Path, Path]) -> None:
    args = _parser().parse_args(["--day", "1", "--sign-key", str(pair[0])])
    assert config_from_args(args).sign_key == pair[0]
    os.chmod(pair[0], 0o640)
    with pytest.raises(ConfigError, match="has mode 0640"):
        # an unknown version and no state file: the key is refused first
        build_delta(DeltaConfig(day=1, version="no-such-version", sign_key=pair[0],
                                model_store=tmp_path / "none"))


def test_a_header_key_file_read_is_bounded(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    f = tmp_path / "d.delta"
    f.write_bytes(signed(make_delta(1), pair[0]))
    assert read_file_header(f)["signature"]["key_id"] == load_verify_key(pair[1]).key_id
    assert canonical_json(read_file_header(f)) in f.read_bytes()


def test_what_the_workers_import_does_not_load_cryptography() -> None:
    """The workers read deltas and repositories but never sign or verify: the modules
    they import keep cryptography out of every worker process."""
    import subprocess
    import sys

    code = ("import sys, serve.store.deltas.format, serve.store.deltas.files, "
            "serve.store.deltas.signature, serve.store.repository\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cryptography'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert out == "[]"
