"""The write token on disk (the bearer token every write of the sidecar needs): a
development token, and reading a mounted one.

In Kubernetes the token comes from a Secret (env ``DLRM_SIDECAR_TOKEN`` or a mounted
file); :func:`ensure_dev_token` is for local runs only.
"""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from serve.errors import ConfigError
from serve.settings import DLRM_SIDECAR_TOKEN

_log = logging.getLogger(__name__)

__all__ = ["ensure_dev_token", "load_optional_token", "load_token"]


def ensure_dev_token(path: str | os.PathLike[str]) -> str:
    """Return the token in ``path``, first writing a random one (mode 0600) if absent.

    For local runs only; in Kubernetes mount a Secret and pass its file or env.
    """
    path = Path(path)
    if path.exists():
        return load_token(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL + mode: the file is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def load_token(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (surrounding whitespace stripped); ConfigError if empty/absent.

    A file other users may read or write (``o+r``/``o+w``) is used, but logged as a
    WARNING naming its mode and the fix (``chmod 600``): refusing it would stop a pod
    over a mode it cannot change. A group-readable file is accepted: Kubernetes mounts a
    projected Secret with the pod's ``fsGroup`` as ``0440`` (k8s/deployment.yaml).
    """
    path = Path(path)
    try:
        token = path.read_text().strip()
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        raise ConfigError(
            f"token file {path} does not exist; create it (python -m serve.sidecar "
            f"--create-token --token-file {path}) or set {DLRM_SIDECAR_TOKEN}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty; write a token into it")
    if mode & 0o006:
        _log.warning("token file %s has mode %04o: other users of this host can %s it; "
                     "make it private with `chmod 600 %s` (or the Secret's defaultMode 0400)",
                     path, mode, "read" if mode & 0o004 else "write", path)
    return token


def load_optional_token(path: str | os.PathLike[str] | None) -> str | None:
    """The token in ``path`` (a scoped token's file); None when no file is given or the
    file does not exist: in Kubernetes the scoped tokens are optional keys of the Secret,
    and a projected volume leaves an absent key's file out (then only the operator's
    token may do that write; logged once, at start)."""
    if path is None:
        return None
    if not Path(path).exists():
        _log.warning("scoped token file %s does not exist: no such token, so only the "
                     "operator's token may do its writes (add the key to the Secret to "
                     "give its producers their own)", path)
        return None
    return load_token(path)
