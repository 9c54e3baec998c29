"""The local sandbox id (docs/protocol.md §5.1): read lazily at the first upgrade, then cached."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import structlog
from structlog.typing import FilteringBoundLogger

from sandbox_supervisor.protocol.headers import ID_PATTERN

log: FilteringBoundLogger = structlog.get_logger("supervisor.identity")

SANDBOX_ID_ENV = "E2B_SANDBOX_ID"
MAX_SANDBOX_ID_FILE_BYTES = 4096
# An id the routing header could never carry would make every upgrade a mismatch; calling it
# unavailable (503) tells the operator what is actually wrong.
_ID_RE = re.compile(ID_PATTERN)


class SandboxIdentity:
    """Reads the id from a file, falling back to E2B_SANDBOX_ID only when the file is absent.

    An empty or unreadable file is not cached: the provider may still be writing it, so the
    next upgrade tries again.
    """

    def __init__(self, path: Path, env: Mapping[str, str] = os.environ) -> None:
        self._path = path
        self._env_value = env.get(SANDBOX_ID_ENV)
        self._cached: str | None = None

    def read(self) -> str | None:
        if self._cached is not None:
            return self._cached
        try:
            with open(self._path, "rb") as handle:
                raw = handle.read(MAX_SANDBOX_ID_FILE_BYTES + 1)
            value = raw.decode("utf-8").strip()
        except FileNotFoundError:
            value = (self._env_value or "").strip()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("sandbox_id.unreadable", path=str(self._path), reason=type(exc).__name__)
            return None
        if not value or len(value) > MAX_SANDBOX_ID_FILE_BYTES or not _ID_RE.fullmatch(value):
            log.warning("sandbox_id.unusable", path=str(self._path))
            return None
        self._cached = value
        return value
