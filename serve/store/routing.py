"""Which arm of a rollout scores a request, and the control file that sets the split.

A rollout serves two model versions from ONE TorchServe registration: every worker holds
the ``stable`` version and a ``candidate`` (``handler.rollout`` in the archive's
model-config.yaml, :class:`serve.api.config.RolloutWiring`). How requests are split is
not in the archive: the sidecar writes it into a small JSON *control file* and rewrites
it (atomically) while the workers run; each worker re-reads it when it changed, at most
once per TorchServe batch (:class:`ControlWatcher`)::

    {"mode": "canary", "weight": 0.1, ...}     # other keys are ignored (informational)

* ``canary``: a request goes to the candidate with probability ``weight`` and is
  answered by it; the others are answered by the stable version.
* ``shadow``: the stable version answers every request; a ``weight`` share is ALSO
  scored by the candidate, whose results reach no response (metrics only).

Which requests: :func:`takes_candidate`. A request that carries ``X-DLRM-Route-Key``
(a user or session id, at most :data:`ROUTE_KEY_MAX_CHARS` characters) is routed by a
stable hash of that key (:func:`key_point`): the same key always gets the same arm at a
given weight, and raising the weight only moves keys from stable to candidate (a user
never flips back and forth during a ramp). Requests without a key are routed at random.
The hash is keyed with the fleet's secret (:func:`route_key_salt`: ``DLRM_ROUTE_KEY_SALT``
or the file ``DLRM_ROUTE_KEY_SALT_FILE`` names), so a client cannot compute a key that
lands in the candidate arm and steer its traffic there (to bias the rollout's guards);
the same secret on every worker of every pod keeps a key on one arm fleet-wide.

Pure Python, no torch: the sidecar imports it too (it writes the file with
:func:`write_control`). A missing or unreadable control file means weight 0: everything
goes to stable, the safe side.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.common.validate import number_in_range
from serve.errors import ConfigError
from serve.settings import DLRM_ROUTE_KEY_SALT, DLRM_ROUTE_KEY_SALT_FILE
from serve.state import ROLLOUT_MODES

__all__ = [
    "ARM_HEADER",
    "ROUTE_KEY_HEADER",
    "ROUTE_KEY_MAX_CHARS",
    "SAFE_CONTROL",
    "Control",
    "ControlWatcher",
    "key_point",
    "read_control",
    "route_key_salt",
    "takes_candidate",
    "write_control",
]

log = logging.getLogger(__name__)

#: Request header whose value routes the request by hash (sticky per key).
ROUTE_KEY_HEADER = "X-DLRM-Route-Key"
#: Response header naming the arm that answered: ``stable`` or ``candidate``.
ARM_HEADER = "X-DLRM-Arm"
#: Longest route key accepted (characters); longer or empty keys get a 400.
ROUTE_KEY_MAX_CHARS = 256
#: Control modes: ``canary`` (the candidate answers its share) and ``shadow`` (the
#: candidate only scores its share; stable answers everything).
_TWO_64 = float(2**64)
# A control file modified less than this long before it was read may still change
# without its stat changing (coarse file-system timestamps, an inode number reused by
# the next tmp + rename, the same size): such a read is not trusted, and the file is
# read again at the next call, until a read happens this long after the modification.
_RACY_NS = 100_000_000


def key_point(key: str, salt: bytes = b"") -> float:
    """The stable position of a route key in [0, 1): the first 8 bytes of its BLAKE2b
    digest, keyed with ``salt`` (the fleet's secret, :func:`route_key_salt`; hashed to
    32 bytes first, BLAKE2b's key limit being 64), as a big-endian integer / 2^64. The
    same on every host and Python version for one salt (unlike ``hash()``, which is
    salted per process); ``b""``: unkeyed, anyone can compute it."""
    mac_key = hashlib.blake2b(salt, digest_size=32).digest() if salt else b""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, key=mac_key).digest()
    return int.from_bytes(digest, "big") / _TWO_64


def route_key_salt(environ: Mapping[str, str] | None = None) -> bytes:
    """The fleet's route-key secret: ``DLRM_ROUTE_KEY_SALT`` when set, else the contents
    of the file ``DLRM_ROUTE_KEY_SALT_FILE`` names (stripped), else ``b""`` (unkeyed,
    logged as a warning: a client can then steer itself into the candidate arm).

    Raises:
        ConfigError: the file is named but cannot be read, or holds nothing.
    """
    value = DLRM_ROUTE_KEY_SALT.get(environ)
    if value is not None:
        return value.encode("utf-8")
    path = DLRM_ROUTE_KEY_SALT_FILE.get(environ)
    if path is None:
        log.warning("no route-key secret (%s or %s): X-DLRM-Route-Key is hashed unkeyed, "
                    "so a client can compute which rollout arm its key takes",
                    DLRM_ROUTE_KEY_SALT, DLRM_ROUTE_KEY_SALT_FILE)
        return b""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{DLRM_ROUTE_KEY_SALT_FILE}={path}: cannot read the route-key "
                          f"secret ({e.strerror}): mount the Secret there or unset it") from None
    if not secret:
        raise ConfigError(f"{DLRM_ROUTE_KEY_SALT_FILE}={path} is empty: write the fleet's "
                          "route-key secret into it (e.g. 32 random bytes, hex)")
    return secret


def takes_candidate(key: str | None, weight: float, rng: random.Random,
                    salt: bytes = b"") -> bool:
    """Whether a request goes to (canary) or is also scored by (shadow) the candidate.

    Args:
        key: the request's route key, or None when it sent none.
        weight: the candidate's share in [0, 1].
        rng: draws the decision for requests without a key (one ``rng.random()`` each).
        salt: the fleet's route-key secret (:func:`route_key_salt`).
    Returns:
        ``key_point(key, salt) < weight`` with a key (sticky, monotonic in the weight),
        else ``rng.random() < weight``. Weight 0 never and weight 1 always takes the
        candidate (without touching ``rng``).
    """
    if weight <= 0.0:
        return False
    if weight >= 1.0:
        return True
    if key is not None:
        return key_point(key, salt) < weight
    return rng.random() < weight


@dataclass(frozen=True)
class Control:
    """The split the control file asks for.

    Attributes:
        mode: ``canary`` or ``shadow`` (:data:`serve.state.ROLLOUT_MODES`).
        weight: the candidate's share of requests, 0..1.
    """

    mode: str
    weight: float

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_MODES:
            raise ConfigError(f"control: mode={self.mode!r} must be one of {list(ROLLOUT_MODES)}")
        object.__setattr__(self, "weight", number_in_range(
            "control: weight", self.weight, 0, 1, then=" (the candidate's share of requests)"))


#: What a worker does without a usable control file: everything to stable.
SAFE_CONTROL = Control("canary", 0.0)


def _control_from(doc: Any, path: str | os.PathLike[str]) -> Control:
    if not isinstance(doc, dict):
        raise ConfigError(f"control file {path}: holds a JSON {type(doc).__name__}; expected an "
                          'object {"mode": "canary"|"shadow", "weight": 0..1}')
    missing = [k for k in ("mode", "weight") if k not in doc]
    if missing:
        raise ConfigError(f"control file {path}: missing keys {missing}; expected an object "
                          '{"mode": "canary"|"shadow", "weight": 0..1}')
    try:
        return Control(doc["mode"], doc["weight"])
    except ConfigError as e:
        raise ConfigError(f"control file {path}: {e.message}") from None


def read_control(path: str | os.PathLike[str]) -> Control:
    """Read and validate a control file.

    Raises:
        ConfigError: the file is missing or unreadable, not JSON, not an object, or its
            ``mode``/``weight`` is missing or out of range (the message names the file,
            the value and the rule).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"control file {path}: cannot be read ({e.strerror or e}); the "
                          "sidecar writes it when a rollout starts") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"control file {path}: is not valid JSON ({e}); write it with "
                          "serve.store.routing.write_control") from None
    return _control_from(doc, path)


def write_control(path: str | os.PathLike[str], mode: str, weight: float, **extra: Any) -> Path:
    """Write a control file atomically (a tmp file in the same folder, then
    ``os.replace``): a worker reading it sees the old or the new content, never a part.

    Args:
        mode / weight: validated as :class:`Control`.
        extra: more JSON-serializable keys, stored as they are (workers ignore them).
    Returns:
        The path written.
    Raises:
        ConfigError: ``mode`` or ``weight`` out of range.
        TypeError: an ``extra`` value is not JSON-serializable.
    """
    control = Control(mode, weight)
    path = Path(path)
    text = json.dumps({"mode": control.mode, "weight": control.weight, **extra}, sort_keys=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class ControlWatcher:
    """The current :class:`Control` of a control file, re-read only when it changed.

    :meth:`current` costs one ``os.stat`` when nothing changed (cheap enough per batch):
    the file is parsed again only when its (mtime_ns, size, inode) differ from the last
    read, or when the last read came within 100 ms of the file's modification (a write
    that quick could keep the same stat). A missing or bad file gives
    :data:`SAFE_CONTROL` (weight 0: all to stable); the problem is logged once per
    change of the file, not per batch.

    Attributes:
        path: the control file.
        reads: how often the file was parsed (for tests and debugging).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.reads = 0
        self._sig: tuple[int, int, int] | None = None
        self._racy = True
        self._control = SAFE_CONTROL
        self._problem: str | None = None
        self._missing = False

    def current(self) -> Control:
        """The control in effect now (see the class docstring)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            if not self._missing:
                self._missing = True
                self._sig = None
                self._control = SAFE_CONTROL
                self._report(f"control file {self.path}: cannot be read ({e.strerror or e}); "
                             "routing everything to stable until it exists")
            return self._control
        self._missing = False
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._sig and not self._racy:
            return self._control
        read_at = time.time_ns()
        self.reads += 1
        try:
            control = read_control(self.path)
        except ConfigError as e:
            control = SAFE_CONTROL
            self._report(f"{e.message}; routing everything to stable until it is fixed")
        else:
            if control != self._control or self._problem is not None:
                log.info("rollout control from %s: mode=%s weight=%.4g", self.path,
                         control.mode, control.weight)
            self._problem = None
        self._sig = sig
        self._racy = read_at - st.st_mtime_ns < _RACY_NS
        self._control = control
        return control

    def _report(self, problem: str) -> None:
        if problem != self._problem:
            log.warning("%s", problem)
        self._problem = problem
