"""The JWKS the verifier trusts, re-read on SIGHUP and whenever the file changes.

A bad file is refused whole (protocol.authority.load_jwks); at start that is fatal, on a
reload the previous key set stays in force so a botched rotation cannot lock the control
plane out.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog
from structlog.typing import FilteringBoundLogger

from sandbox_supervisor.protocol.authority import JwksError, KeySet, load_jwks

log: FilteringBoundLogger = structlog.get_logger("supervisor.keyring")

MAX_JWKS_BYTES = 1024 * 1024


def _read(path: Path) -> KeySet:
    with open(path, "rb") as handle:
        data = handle.read(MAX_JWKS_BYTES + 1)
    if len(data) > MAX_JWKS_BYTES:
        raise JwksError("the JWKS file is larger than 1 MiB")
    return load_jwks(data)


def unusable_jwks(path: Path, exc: OSError | JwksError) -> str:
    """Why the JWKS file at `path` cannot be used, as check-config and the daemon at start
    both say it (under the key `authority.jwks_file`)."""
    if isinstance(exc, OSError):
        return f"cannot read {path}: {exc.strerror or exc}"
    return f"{path} is not a usable JWKS: {exc}"


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    # mtime alone misses two writes within the filesystem's timestamp granularity; size and
    # inode catch most of those (an atomic rename changes the inode).
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeyRing:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp = _stamp(path)
        self.keys = _read(path)  # raises JwksError / OSError: the caller exits 2

    def reload(self, *, reason: str) -> bool:
        """Re-read the file; keep the old keys if the new file is refused. True if replaced."""
        stamp = _stamp(self.path)
        try:
            keys = _read(self.path)
        except (OSError, JwksError) as exc:
            self._stamp = stamp  # do not retry the same bad file on every upgrade
            log.error("jwks.reload_refused", reason=reason, error=str(exc)[:300])
            return False
        self.keys = keys
        self._stamp = stamp
        log.info("jwks.reloaded", reason=reason)
        return True

    def current(self) -> KeySet:
        """The key set, reloaded first if the file changed since it was last read."""
        stamp = _stamp(self.path)
        if stamp != self._stamp:
            self.reload(reason="file_changed")
        return self.keys
