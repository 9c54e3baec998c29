"""The local sandbox id (docs/protocol.md §5.1): read lazily at the first upgrade, then cached."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
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


# Why no sandbox id is usable (SandboxIdStatus.problem): stable words for /readyz and the
# start warning.
ID_MISSING = "missing"  # no file, and E2B_SANDBOX_ID unset or empty
ID_UNREADABLE = "unreadable"  # the file exists but cannot be read (permissions, not UTF-8)
ID_UNUSABLE = "unusable"  # read, but empty or not an id the routing header can carry


@dataclass(frozen=True, slots=True)
class SandboxIdStatus:
    value: str | None
    problem: str | None = None  # one of ID_MISSING, ID_UNREADABLE, ID_UNUSABLE
    detail: str = ""


class SandboxIdentity:
    """Reads the id from a file, falling back to E2B_SANDBOX_ID only when the file is absent.

    An empty or unreadable file is not cached: the provider may still be writing it, so the
    next upgrade tries again.
    """

    def __init__(self, path: Path, env: Mapping[str, str] = os.environ) -> None:
        self.path = path
        self._env_value = env.get(SANDBOX_ID_ENV)
        self._cached: str | None = None

    def read(self) -> str | None:
        status = self.status()
        if status.problem == ID_UNREADABLE:
            log.warning("sandbox_id.unreadable", path=str(self.path), reason=status.detail.rpartition(": ")[2])
        elif status.value is None:
            log.warning("sandbox_id.unusable", path=str(self.path))
        self._cached = status.value
        return status.value

    def status(self) -> SandboxIdStatus:
        """The id, or why there is none. Logs nothing (readiness probes ask often) and caches
        nothing: the id is fixed by the first upgrade that reads it (`read`), as before
        there were probes."""
        if self._cached is not None:
            return SandboxIdStatus(self._cached)
        from_file = True
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read(MAX_SANDBOX_ID_FILE_BYTES + 1)
            value = raw.decode("utf-8").strip()
        except FileNotFoundError:
            from_file = False
            value = (self._env_value or "").strip()
        except (OSError, UnicodeDecodeError) as exc:
            return SandboxIdStatus(None, ID_UNREADABLE, f"{self.path} cannot be read: {type(exc).__name__}")
        if not value and not from_file:
            return SandboxIdStatus(
                None, ID_MISSING, f"{self.path} does not exist and {SANDBOX_ID_ENV} is not set"
            )
        if not value or len(value) > MAX_SANDBOX_ID_FILE_BYTES or not _ID_RE.fullmatch(value):
            source = str(self.path) if from_file else SANDBOX_ID_ENV
            return SandboxIdStatus(None, ID_UNUSABLE, f"{source} does not hold a valid sandbox id")
        return SandboxIdStatus(value)
