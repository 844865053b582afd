"""Deltas form one chain per version: each names its parent (``parent_digest``), a pod
refuses a delta built on another delta than the one it holds, and a pod of a fleet
(``--deltas-post refuse``) takes deltas from the model volume only.

Store-level tests use :class:`DeltaStore` directly; the HTTP ones the real sidecar app
under uvicorn on 127.0.0.1 (tests/test_deltas_sidecar.py's ``start_pod``)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from serve.common.net import wait_until
from serve.errors import ConfigError, DeltaConflict, InvalidDelta
from serve.metrics import DELTA_REFUSAL_REASONS, DELTA_SKIP_REASONS
from serve.model.delta import DONE_FILE, delta_file_name, parent_digest
from serve.sidecar.config import SidecarConfig
from serve.sidecar.services.deltas.intake import refusal_reason
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import decode_delta, encode_delta, scan_delta_file, version_digest
from tests.fixtures.deltas import digest, store_delta
from tests.fixtures.sidecar import FakeClock
from tests.promtext import samples
from tests.test_deltas_sidecar import (
    REPORTS,
    SERVED,
    TOKEN,
    _service,
    base_digest,
    make_delta,
    post,
    snapshot,
    start_pod,
)

OTHER_CHAIN = "0" * 64


def _chain(n: int) -> list[bytes]:
    """Deltas 1..n of SERVED, each naming the one before (delta 1: the version)."""
    out: list[bytes] = []
    for seq in range(1, n + 1):
        parent = digest(out[-1]) if out else base_digest()
        out.append(make_delta(seq, parent=parent))
    return out


def _add(store: DeltaStore, blob: bytes) -> Path:
    return store_delta(store, blob, decode_delta(blob), base_digest=base_digest())


# ------------------------------------------------------------------ the file


def test_parent_digest_round_trips_and_an_old_file_has_none(tmp_path: Path) -> None:
    blob = make_delta(1)
    assert decode_delta(blob).parent_digest == base_digest()
    (tmp_path / "d").write_bytes(blob)
    assert scan_delta_file(tmp_path / "d").parent_digest == base_digest()
    assert decode_delta(blob).summary()["parent_digest"] == base_digest()
    assert decode_delta(make_delta(1, parent=None)).parent_digest is None
    assert b"parent_digest" not in make_delta(1, parent=None)


def test_a_parent_that_is_not_a_sha256_is_400() -> None:
    with pytest.raises(InvalidDelta, match=r"^header.parent_digest: 'ABC' is not a sha256 "
                                           r"\(64 lowercase hex digits\)"):
        decode_delta(make_delta(2, parent="ABC"))


def test_version_digest_is_the_reports_content_not_its_layout() -> None:
    report = REPORTS[SERVED]
    assert version_digest(report) == version_digest(json.loads(json.dumps(report, indent=2)))
    assert version_digest(report) == version_digest(dict(reversed(list(report.items()))))
    assert version_digest(report) != version_digest({**report, "created_at": "2026-01-02"})
    assert len(version_digest(report)) == 64


# ------------------------------------------------------------------ the store


def test_a_chain_of_three_is_taken_and_the_same_bytes_again_are_unchanged(
        tmp_path: Path) -> None:
    store = DeltaStore(tmp_path)
    chain = _chain(3)
    assert store.head_digest(SERVED, base_digest()) == base_digest()
    for blob in chain:
        _add(store, blob)
    assert store.sequences(SERVED) == [1, 2, 3]
    assert store.head_digest(SERVED, base_digest()) == digest(chain[-1])
    assert [store.digest(SERVED, s) for s in (1, 2, 3)] == [digest(b) for b in chain]
    incoming = store.incoming(len(chain[-1]))
    incoming.write(chain[-1])
    assert store.commit(incoming, decode_delta(chain[-1]),
                        base_digest=base_digest()).outcome == "unchanged"
    assert store.sequences(SERVED) == [1, 2, 3]


def test_another_parent_is_409_naming_both_digests_and_changes_nothing(tmp_path: Path) -> None:
    store = DeltaStore(tmp_path)
    one, two = _chain(2)
    _add(store, one)
    before = snapshot(tmp_path)
    stray = make_delta(2, parent=OTHER_CHAIN)
    with pytest.raises(DeltaConflict) as e:
        _add(store, stray)
    assert e.value.field == "header.parent_digest" and e.value.reason == "parent_mismatch"
    assert e.value.details == {"parent_digest": OTHER_CHAIN,
                               "expected_parent_digest": digest(one)}
    assert e.value.message == (
        f"header.parent_digest: delta 2 of version {SERVED} builds on parent {OTHER_CHAIN}, "
        f"but this pod's delta 1 of version {SERVED} is {digest(one)}; nothing was "
        f"changed. The delta belongs to another chain of deltas: build it on top of the "
        f"deltas this pod holds (GET /embeddings/deltas, head_digest), or publish every "
        f"delta of one chain on the model volume so that every pod holds the same ones")
    assert e.value.to_json()["expected_parent_digest"] == digest(one)
    assert snapshot(tmp_path) == before              # same files, same bytes, no .incoming
    assert store.last_sequence(SERVED) == 1
    _add(store, two)                                  # the right parent still goes in
    assert store.sequences(SERVED) == [1, 2]


def test_delta_1_of_another_build_of_the_version_is_409(tmp_path: Path) -> None:
    store = DeltaStore(tmp_path)
    other_build = version_digest({**REPORTS[SERVED], "created_at": "2026-02-02T00:00:00Z"})
    with pytest.raises(DeltaConflict, match=(
            f"delta 1 of version {SERVED} builds on parent {other_build}, but this pod's "
            f"build of version {SERVED} \\(sha256 of its build report\\) is {base_digest()}"
            f"; nothing was changed. The delta was built on another build of")):
        _add(store, make_delta(1, parent=other_build))
    assert snapshot(tmp_path) == {}
    # without a report to compare with (a tool's store), delta 1's parent is not checked
    store_delta(store, make_delta(1, parent=other_build),
                decode_delta(make_delta(1, parent=other_build)))
    assert store.sequences(SERVED) == [1]


def test_an_old_delta_1_is_taken_and_an_old_delta_2_is_400(tmp_path: Path) -> None:
    store = DeltaStore(tmp_path)
    _add(store, make_delta(1, parent=None))
    with pytest.raises(InvalidDelta, match=r"^header.parent_digest: missing: delta 2 of "
                                           r"version tiny-a does not name the delta it "
                                           r"builds on .*rebuild it with `make delta`"):
        _add(store, make_delta(2, parent=None))
    assert store.sequences(SERVED) == [1]


def test_a_damaged_parent_says_to_repost_it(tmp_path: Path) -> None:
    store = DeltaStore(tmp_path)
    one, two = _chain(2)
    path = _add(store, one)
    path.write_bytes(one[:-3])
    with pytest.raises(DeltaConflict, match="Its stored file is damaged .*re-post delta "
                                            "1's bytes first"):
        _add(store, two)
    incoming = store.incoming(len(one))
    incoming.write(one)
    assert store.commit(incoming, decode_delta(one), base_digest=base_digest()).outcome \
        == "repaired"
    _add(store, two)
    assert store.sequences(SERVED) == [1, 2]


# ------------------------------------------------------------------ make delta


def test_make_delta_names_the_version_then_the_previous_file(tmp_path: Path) -> None:
    report = REPORTS[SERVED]
    assert parent_digest(report, tmp_path, 1) == version_digest(report)
    prev = tmp_path / "00000001"
    prev.mkdir()
    name = delta_file_name(SERVED, 1)
    (prev / name).write_bytes(b"delta one")
    (prev / DONE_FILE).write_text(json.dumps({"file": name}))
    assert parent_digest(report, tmp_path, 2) == digest(b"delta one")
    (prev / name).unlink()
    with pytest.raises(ConfigError, match="delta 2 builds on delta 1, whose file .* is gone"):
        parent_digest(report, tmp_path, 2)


# ------------------------------------------------------------------ the sidecar


def test_post_a_chain_then_a_stray_delta_409_with_both_digests(tmp_path: Path) -> None:
    pod = start_pod(tmp_path)
    try:
        chain = _chain(3)
        with pod.client() as c:
            for blob in chain:
                assert post(c, blob).status_code == 202
            again = post(c, chain[-1])
            assert again.status_code == 202
            assert again.json()["message"].startswith("already stored with the same bytes")
            got = c.get("/embeddings/deltas").json()["versions"][SERVED]
            assert (got["last_sequence"], got["head_digest"]) == (3, digest(chain[-1]))
            assert pod.delta_dir is not None
            before = snapshot(pod.delta_dir)
            r = post(c, make_delta(4, parent=OTHER_CHAIN))
            assert r.status_code == 409
            assert r.json() == {
                "code": 409, "type": "DeltaConflict", "field": "header.parent_digest",
                "reason": "parent_mismatch", "parent_digest": OTHER_CHAIN,
                "expected_parent_digest": digest(chain[-1]),
                "message": f"header.parent_digest: delta 4 of version {SERVED} builds on "
                           f"parent {OTHER_CHAIN}, but this pod's delta 3 of version "
                           f"{SERVED} is {digest(chain[-1])}; nothing was changed. The "
                           f"delta belongs to another chain of deltas: build it on top of "
                           f"the deltas this pod holds (GET /embeddings/deltas, "
                           f"head_digest), or publish every delta of one chain on the "
                           f"model volume so that every pod holds the same ones"}
            assert snapshot(pod.delta_dir) == before
            m = samples(c.get("/metrics").text)
        assert m[("dlrm_delta_posts_refused_total", (("reason", "parent_mismatch"),))] == 1
        assert m[("dlrm_delta_posts_refused_total", (("reason", "sequence"),))] == 0
    finally:
        pod.stop()


def test_the_volume_sync_skips_and_counts_a_stray_delta(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc = _service(tmp_path / "store", [], FakeClock())
    volume = tmp_path / "repo" / "deltas" / SERVED
    volume.mkdir(parents=True)
    one, two = _chain(2)
    (volume / f"dlrm-{SERVED}-00000001.delta").write_bytes(one)
    (volume / f"dlrm-{SERVED}-00000002.delta").write_bytes(make_delta(2, parent=OTHER_CHAIN))
    with caplog.at_level(logging.ERROR):
        assert [a.sequence for a in svc.volume.sync([tmp_path / "repo"])] == [1]
        assert svc.volume.sync([tmp_path / "repo"]) == []   # retried, counted once
    assert svc.store.sequences(SERVED) == [1]
    assert svc.intake.skipped.counts() == {"parent_mismatch": 1}
    (logged,) = [r.getMessage() for r in caplog.records if "not taken" in r.getMessage()]
    assert "(parent_mismatch)" in logged and OTHER_CHAIN in logged and digest(one) in logged
    fams = {f.name: f for f in svc.report.collect()}
    skipped = {s.labels["reason"]: s.value for s in fams["dlrm_delta_files_skipped"].samples
               if s.name.endswith("_total")}
    assert skipped["parent_mismatch"] == 1 and set(skipped) == set(DELTA_SKIP_REASONS)
    (volume / f"dlrm-{SERVED}-00000002.delta").write_bytes(two)   # the right one
    assert [a.sequence for a in svc.volume.sync([tmp_path / "repo"])] == [2]


# ------------------------------------------------------------------ --deltas-post refuse


def test_refuse_mode_answers_where_to_publish_and_still_follows_the_volume(
        tmp_path: Path) -> None:
    volume = tmp_path / "repo" / "deltas" / SERVED
    volume.mkdir(parents=True)
    pod = start_pod(tmp_path, deltas_post="refuse", delta_sync_s=0.05)
    try:
        with pod.client() as c:
            assert pod.delta_dir is not None
            before = snapshot(pod.delta_dir)
            r = post(c, make_delta(1))
            assert r.status_code == 409
            where = f"{tmp_path / 'repo'}/deltas/<version>/dlrm-<version>-NNNNNNNN.delta"
            assert r.json() == {
                "code": 409, "type": "DeltaConflict", "field": "deltas_post",
                "reason": "volume_only", "publish_to": [where],
                "message": "deltas_post: this pod takes no POSTed delta (--deltas-post "
                           "refuse): it is one pod of a fleet, and a delta posted here "
                           "would live in this pod only. Publish the file `make delta` "
                           f"wrote on the delta volume instead, as {where} (in Kubernetes "
                           "copy it to /deltas/deltas/<version>/ with the delta upload pod, "
                           "k8s/templates/delta-upload-pod.yaml): every pod's sidecar takes "
                           "it from there "
                           "within 0.05 s, in sequence order and through the same checks; "
                           "GET /embeddings/deltas shows each pod's last_sequence and "
                           "head_digest"}
            assert snapshot(pod.delta_dir) == before
            assert post(c, make_delta(1), Authorization="Bearer wrong").status_code in (401, 403)
            m = samples(c.get("/metrics").text)
            assert m[("dlrm_delta_posts_refused_total", (("reason", "volume_only"),))] == 1
            one = make_delta(1)
            (volume / f"dlrm-{SERVED}-00000001.delta").write_bytes(one)
            wait_until(lambda: pod.store.sequences(SERVED) == [1], timeout_s=30,
                       what="the volume's delta taken", interval_s=0.05)
            got = c.get("/embeddings/deltas").json()["versions"][SERVED]
            assert got["head_digest"] == digest(one)
    finally:
        pod.stop()


def test_with_a_delta_volume_only_its_deltas_are_taken(tmp_path: Path) -> None:
    """--delta-volume (k8s: the PVC dlrm-deltas, its own writer): the 409 names it, the
    sync takes its delta, and a delta left on the model volume (the repository's deltas/
    folder, writable by whoever publishes archives) is never read."""
    volume = tmp_path / "delta-volume"
    (volume / "deltas" / SERVED).mkdir(parents=True)
    stray = tmp_path / "repo" / "deltas" / SERVED
    stray.mkdir(parents=True)
    (stray / f"dlrm-{SERVED}-00000001.delta").write_bytes(make_delta(1, tables=((1, [2]),)))
    pod = start_pod(tmp_path, deltas_post="refuse", delta_sync_s=0.05, delta_volume=volume)
    try:
        with pod.client() as c:
            r = post(c, make_delta(1))
            assert r.status_code == 409
            assert r.json()["publish_to"] == [
                f"{volume}/deltas/<version>/dlrm-<version>-NNNNNNNN.delta"]
            time.sleep(0.3)  # several sync intervals: the model volume's delta is not read
            assert pod.store.sequences(SERVED) == []
            one = make_delta(1)
            (volume / "deltas" / SERVED / f"dlrm-{SERVED}-00000001.delta").write_bytes(one)
            wait_until(lambda: pod.store.sequences(SERVED) == [1], timeout_s=30,
                       what="the delta volume's delta taken", interval_s=0.05)
            got = c.get("/embeddings/deltas").json()["versions"][SERVED]
            assert got["head_digest"] == digest(one)
    finally:
        pod.stop()


def test_deltas_post_setting_is_checked_and_parsed() -> None:
    from serve.sidecar.http.app import build_parser

    kw = {"token": TOKEN, "delta_dir": Path("/tmp/d")}
    assert SidecarConfig(**kw).deltas_post == "store"  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="deltas_post='volume' must be one of store, refuse"):
        SidecarConfig(deltas_post="volume", **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="would take embedding deltas neither by POST nor "
                                          "from the model volume"):
        SidecarConfig(deltas_post="refuse", delta_sync_s=0, **kw)  # type: ignore[arg-type]
    assert build_parser().parse_args(["--deltas-post", "refuse"]).deltas_post == "refuse"
    assert build_parser().parse_args([]).deltas_post == "store"


def test_refusal_reasons_are_bounded() -> None:
    assert refusal_reason(DeltaConflict("f", "m", reason="parent_mismatch")) == "parent_mismatch"
    assert refusal_reason(InvalidDelta("f", "m")) == "invalid"
    assert {"parent_mismatch", "volume_only", "sequence", "base_version"} <= set(
        DELTA_REFUSAL_REASONS)
    assert "parent_mismatch" in DELTA_SKIP_REASONS
    assert encode_delta(decode_delta(make_delta(1))) == make_delta(1)


def test_the_deployment_refuses_posts_so_deltas_go_on_the_volume() -> None:
    """Kubernetes pods are a fleet: k8s/deployment.yaml runs the sidecar with
    ``--deltas-post refuse`` and the volume sync on (the default 5 s)."""
    import yaml

    from serve.sidecar.http.app import build_parser

    path = Path(__file__).resolve().parents[1] / "k8s" / "deployment.yaml"
    (deploy,) = [d for d in yaml.safe_load_all(path.read_text())
                 if d and d.get("kind") == "Deployment"]
    (sidecar,) = [c for c in deploy["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "sidecar"]
    ns, _ = build_parser().parse_known_args(sidecar["args"][3:])
    assert ns.deltas_post == "refuse" and ns.delta_dir is not None


# ------------------------------------------------------------------ make delta-check


def test_delta_check_names_a_stray_parent_before_measuring_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from serve.ops.delta_check import check_parent, main

    one, two = _chain(2)
    status = {"versions": {SERVED: {"last_sequence": 1, "head_digest": digest(one)}}}
    assert check_parent(decode_delta(two), status) is None
    assert check_parent(decode_delta(make_delta(3, parent=OTHER_CHAIN)), status) is None  # gap
    assert "rebuild it with `make delta`" in str(
        check_parent(decode_delta(make_delta(2, parent=None)), status))
    assert check_parent(decode_delta(two), {"versions": {}}) is None
    pod = start_pod(tmp_path)
    try:
        with pod.client() as c:
            assert post(c, one).status_code == 202
        (tmp_path / "token").write_text(TOKEN)
        (tmp_path / "stray.delta").write_bytes(make_delta(2, parent=OTHER_CHAIN))
        code = main(["--delta", str(tmp_path / "stray.delta"), "--sidecar", pod.url,
                     "--token-file", str(tmp_path / "token"), "--json",
                     str(tmp_path / "out.json")])
    finally:
        pod.stop()
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out.json").exists()
    assert f"builds on parent {OTHER_CHAIN}, but the pod holds {digest(one)} (sequence 1)" \
        in err
