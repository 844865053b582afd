"""serve.store.routing: sticky hash routing, the control file and its watcher (fast, no torch)."""
from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from serve.errors import ConfigError
from serve.state import ROLLOUT_MODES
from serve.store.routing import (
    ROUTE_KEY_MAX_CHARS,
    SAFE_CONTROL,
    Control,
    ControlWatcher,
    key_point,
    read_control,
    route_key_salt,
    takes_candidate,
    write_control,
)

REPO = Path(__file__).resolve().parents[1]
KEYS = [f"user-{i}" for i in range(500)]


def test_key_point_is_deterministic_and_in_unit_interval():
    points = [key_point(k) for k in KEYS]
    assert points == [key_point(k) for k in KEYS]
    assert all(0.0 <= p < 1.0 for p in points)
    assert len(set(points)) == len(points)
    # Pinned: the same on every host and Python version (the sidecar and every worker
    # must agree); blake2b-64 of "user-0", big-endian, / 2^64.
    import hashlib
    want = int.from_bytes(hashlib.blake2b(b"user-0", digest_size=8).digest(), "big") / 2**64
    assert key_point("user-0") == want
    assert key_point("") == key_point("")  # any str hashes; the handler refuses empty keys
    assert 0.0 <= key_point("é" * ROUTE_KEY_MAX_CHARS) < 1.0


def test_salted_route_keys_map_differently_under_two_salts_and_alike_under_one():
    """N10: keyed by the fleet's secret, the same key lands elsewhere under another salt
    (a client without the secret cannot pick a key for the candidate arm), identically
    under one salt (every worker and pod agree), still in [0, 1) and sticky."""
    a, b = b"fleet-a-secret", b"fleet-b-secret"
    under_a = [key_point(k, a) for k in KEYS]
    assert under_a == [key_point(k, a) for k in KEYS]
    assert all(0.0 <= p < 1.0 for p in under_a)
    under_b = [key_point(k, b) for k in KEYS]
    assert sum(x != y for x, y in zip(under_a, under_b, strict=True)) == len(KEYS)
    assert under_a != [key_point(k) for k in KEYS], "the salt must change the hash"
    # Which keys take a 20 % candidate differs between salts (no fixed "candidate keys").
    rng = random.Random(0)
    arm_a = {k for k in KEYS if takes_candidate(k, 0.2, rng, a)}
    arm_b = {k for k in KEYS if takes_candidate(k, 0.2, rng, b)}
    assert arm_a == {k for k in KEYS if takes_candidate(k, 0.2, rng, a)}
    assert 50 < len(arm_a) < 150 and 50 < len(arm_b) < 150
    assert len(arm_a & arm_b) < 0.5 * len(arm_a)
    # A salt longer than BLAKE2b's 64-byte key limit works (it is hashed first).
    assert 0.0 <= key_point("user-0", b"x" * 1000) < 1.0


def test_route_key_salt_comes_from_the_env_or_its_file(tmp_path, caplog):
    secret = tmp_path / "route-key-salt"
    secret.write_text("s3cret-from-file\n")
    assert route_key_salt({"DLRM_ROUTE_KEY_SALT": "from-env",
                           "DLRM_ROUTE_KEY_SALT_FILE": str(secret)}) == b"from-env"
    assert route_key_salt({"DLRM_ROUTE_KEY_SALT_FILE": str(secret)}) == b"s3cret-from-file"
    with caplog.at_level(logging.WARNING, logger="serve.store.routing"):
        assert route_key_salt({}) == b""
    assert "unkeyed" in caplog.text
    with pytest.raises(ConfigError, match="cannot read"):
        route_key_salt({"DLRM_ROUTE_KEY_SALT_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        route_key_salt({"DLRM_ROUTE_KEY_SALT_FILE": str(tmp_path / "empty")})


def test_keyed_routing_is_sticky_and_close_to_the_weight():
    rng = random.Random(1)
    arms: dict[str, set[bool]] = {}
    taken = 0
    for _ in range(4):  # 500 keys x 4 requests = 2,000 requests
        for k in KEYS:
            t = takes_candidate(k, 0.2, rng)
            arms.setdefault(k, set()).add(t)
            taken += t
    assert all(len(v) == 1 for v in arms.values()), "a key changed arms at a fixed weight"
    assert abs(taken / 2000 - 0.2) <= 0.03, taken / 2000
    # The rng is not used for keyed requests.
    assert rng.random() == random.Random(1).random()


def test_raising_the_weight_only_moves_keys_from_stable_to_candidate():
    rng = random.Random(0)
    low = {k for k in KEYS if takes_candidate(k, 0.2, rng)}
    high = {k for k in KEYS if takes_candidate(k, 0.5, rng)}
    assert low <= high
    assert len(high) > len(low)
    assert abs(len(high) / len(KEYS) - 0.5) <= 0.06


def test_unkeyed_routing_follows_the_weight_with_a_seeded_rng():
    for weight in (0.1, 0.2, 0.7):
        rng = random.Random(42)
        share = sum(takes_candidate(None, weight, rng) for _ in range(10_000)) / 10_000
        assert abs(share - weight) <= 0.02, (weight, share)
    a = [takes_candidate(None, 0.3, random.Random(7)) for _ in range(5)]
    b = [takes_candidate(None, 0.3, random.Random(7)) for _ in range(5)]
    assert a == b


@pytest.mark.parametrize("key", [None, "user-1", "user-2", ""])
def test_weight_zero_never_and_one_always_takes_the_candidate(key):
    rng = random.Random(3)
    assert not any(takes_candidate(key, 0.0, rng) for _ in range(200))
    assert all(takes_candidate(key, 1.0, rng) for _ in range(200))
    assert rng.random() == random.Random(3).random()  # the edges draw nothing


def test_control_validation():
    assert Control("shadow", 1).weight == 1.0 and isinstance(Control("canary", 1).weight, float)
    assert ROLLOUT_MODES == ("canary", "shadow")
    with pytest.raises(ConfigError, match=r"mode='blue' must be one of \['canary', 'shadow'\]"):
        Control("blue", 0.1)
    for bad in (-0.1, 1.5, float("nan"), True, "0.5", None):
        with pytest.raises(ConfigError, match=r"weight=.* must be a number in \[0, 1\]"):
            Control("canary", bad)  # type: ignore[arg-type]


def test_write_then_read_control(tmp_path):
    path = tmp_path / "control.json"
    assert write_control(path, "shadow", 0.25, candidate="v2", step=1) == path
    assert read_control(path) == Control("shadow", 0.25)
    doc = json.loads(path.read_text())
    assert doc == {"mode": "shadow", "weight": 0.25, "candidate": "v2", "step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["control.json"]  # no tmp file left
    with pytest.raises(ConfigError, match=r"weight=2 must be a number"):
        write_control(path, "canary", 2)
    assert read_control(path) == Control("shadow", 0.25)  # a refused write changes nothing


@pytest.mark.parametrize("text,match", [
    (None, r"cannot be read \(No such file or directory\)"),
    ("{not json", r"is not valid JSON"),
    ("[1, 2]", r"holds a JSON list; expected an object"),
    ('{"mode": "canary"}', r"missing keys \['weight'\]"),
    ('{"mode": "canary", "weight": 3}', r"control file .*: control: weight=3 must be a number"),
    ('{"mode": "ab", "weight": 0.5}', r"mode='ab' must be one of"),
])
def test_read_control_refuses_bad_files(tmp_path, text, match):
    path = tmp_path / "control.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_control(path)


def _age(path: Path, seconds: float = 5.0) -> None:
    """Move the file's mtime into the past, as if written a while ago (the watcher
    re-reads files modified just before its last read; see serve.store.routing._RACY_NS)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def test_watcher_missing_file_is_weight_zero_then_picks_up_the_file(tmp_path, caplog):
    path = tmp_path / "control.json"
    w = ControlWatcher(path)
    with caplog.at_level(logging.WARNING, logger="serve.store.routing"):
        assert w.current() == SAFE_CONTROL == Control("canary", 0.0)
        assert w.current() == SAFE_CONTROL
    assert w.reads == 0
    assert len([r for r in caplog.records if "cannot be read" in r.message]) == 1  # once
    write_control(path, "canary", 0.3)
    assert w.current() == Control("canary", 0.3)
    path.unlink()
    assert w.current() == SAFE_CONTROL  # gone again: back to the safe side


def test_watcher_bad_json_is_weight_zero_logged_once(tmp_path, caplog):
    path = tmp_path / "control.json"
    path.write_text('{"mode": "canary", "weight": 0.5')
    _age(path)
    w = ControlWatcher(path)
    with caplog.at_level(logging.WARNING, logger="serve.store.routing"):
        for _ in range(5):
            assert w.current() == SAFE_CONTROL
    assert w.reads == 1
    assert len([r for r in caplog.records if "is not valid JSON" in r.message]) == 1
    write_control(path, "shadow", 0.5)
    assert w.current() == Control("shadow", 0.5)


def test_watcher_reads_only_when_the_file_changed(tmp_path):
    path = tmp_path / "control.json"
    write_control(path, "canary", 0.1)
    _age(path)
    w = ControlWatcher(path)
    for _ in range(100):
        assert w.current() == Control("canary", 0.1)
    assert w.reads == 1
    write_control(path, "canary", 0.9)  # new inode, size and mtime
    assert w.current() == Control("canary", 0.9)
    _age(path)
    for _ in range(10):
        w.current()
    assert w.reads == 3  # the change, then once more after the ageing (a new mtime)
    # Same size, rewritten at once: the stat may not change (coarse timestamps, a
    # reused inode), but a file modified just before the read is read again.
    write_control(path, "shadow", 0.9)
    assert w.current() == Control("shadow", 0.9)
    write_control(path, "canary", 0.9)
    assert w.current() == Control("canary", 0.9)


def test_routing_imports_no_torch():
    code = "import sys, serve.store.routing; sys.exit(1 if 'torch' in sys.modules else 0)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
