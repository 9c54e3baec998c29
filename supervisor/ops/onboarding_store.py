"""Where template onboarding records are kept: a protocol a service implements over its own
database, and a JSON file store (ours, for the CLI and small deployments).

The JSON file store upserts atomically: the whole read-modify-write runs under an exclusive
`flock` on a lock file beside the store (the store file itself is replaced by rename, so a
lock on it would be a lock on a file about to disappear), and the new content is written to a
temporary file, fsynced, then renamed over the old one, and the directory fsynced. A writer
killed at any point leaves either the old file or the new one, never a mix; readers never
lock, since a rename is atomic for them.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import ValidationError

from sandbox_supervisor.protocol.onboarding import TemplateOnboarding
from sandbox_supervisor.daemon.state.fsutil import fsync_directory

STORE_FORMAT = "sandbox-supervisor-onboarding/1"
LOCK_SUFFIX = ".lock"
TEMP_SUFFIX = ".tmp"
STORE_FILE_MODE = 0o644  # provenance, not a secret


@runtime_checkable
class OnboardingStore(Protocol):
    """What `onboard-template` needs from a store. Upsert is keyed by (owner.service,
    templateId): onboarding a template again replaces its record."""

    def upsert(self, record: TemplateOnboarding) -> None: ...

    def get(self, service: str, template_id: str) -> TemplateOnboarding | None: ...


class OnboardingStoreError(Exception):
    """The store file exists but is not a store (or cannot be read or written)."""


class JsonFileOnboardingStore:
    """Records in one JSON file: {"format": STORE_FORMAT, "records": [...]}, sorted by key."""

    def __init__(self, path: Path) -> None:
        # The real path: a store reached through a symlink is written (renamed into place)
        # and locked where it lives, not beside the link, which the rename would replace.
        self.path = Path(os.path.realpath(path))

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + LOCK_SUFFIX)

    def upsert(self, record: TemplateOnboarding) -> None:
        with self._locked():
            self._remove_stale_temporaries()
            records = {existing.key: existing for existing in self._read()}
            records[record.key] = record
            try:
                self._write([records[key] for key in sorted(records)])
            except OSError as exc:
                raise OnboardingStoreError(f"cannot write {self.path}: {exc.strerror}") from None

    def get(self, service: str, template_id: str) -> TemplateOnboarding | None:
        for record in self._read():
            if record.key == (service, template_id):
                return record
        return None

    def records(self) -> list[TemplateOnboarding]:
        return self._read()

    # --- file work -----------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, STORE_FILE_MODE)
        except OSError as exc:
            raise OnboardingStoreError(f"cannot open {self.lock_path}: {exc.strerror}") from None
        try:
            # Blocks until the other writer is done; the kernel drops the lock when a writer
            # dies, so a killed writer cannot wedge the store.
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self) -> list[TemplateOnboarding]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise OnboardingStoreError(f"cannot read {self.path}: {exc}") from None
        try:
            data = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
        except ValueError as exc:
            raise OnboardingStoreError(f"{self.path} is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
            raise OnboardingStoreError(f"{self.path} is not an onboarding store ({STORE_FORMAT})")
        raw_records = data.get("records")
        if not isinstance(raw_records, list):
            raise OnboardingStoreError(f"{self.path}: records must be a list")
        try:
            return [TemplateOnboarding.model_validate(raw) for raw in raw_records]
        except ValidationError as exc:
            raise OnboardingStoreError(f"{self.path} holds an invalid record: {exc}") from None

    def _write(self, records: list[TemplateOnboarding]) -> None:
        document = {
            "format": STORE_FORMAT,
            "records": [record.model_dump(mode="json") for record in records],
        }
        payload = (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        directory = self.path.parent
        fd, temp_name = tempfile.mkstemp(
            dir=directory, prefix=f".{self.path.name}.", suffix=TEMP_SUFFIX
        )
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fchmod(handle.fileno(), STORE_FILE_MODE)
                os.fsync(handle.fileno())
            os.replace(temp_name, self.path)
        except BaseException:
            try:
                os.unlink(temp_name)
            except FileNotFoundError:
                pass
            raise
        fsync_directory(directory)

    def _remove_stale_temporaries(self) -> None:
        # Temporaries exist only while a writer holds the lock; we hold it now, so any left
        # over are from a writer that died before its rename.
        for stale in self.path.parent.glob(f".{self.path.name}.*{TEMP_SUFFIX}"):
            try:
                stale.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise OnboardingStoreError(f"cannot remove {stale}: {exc.strerror}") from None


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of repeated keys; a store with two values for one component
    # name is corrupt, not something to resolve silently.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


