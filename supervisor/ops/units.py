"""`install-units`: write the systemd units and the example configuration that ship in the
wheel (package `sandbox_supervisor.units`, the repository's systemd/) under a root directory.

Units are always written: they belong to this release, and an upgrade must replace them. The
configuration is the operator's: an existing one is kept unless `force`. Every file is
written to a temporary file beside it and renamed into place, so a reader (systemd's
daemon-reload, a second install) never sees half a file, and a symlink at the destination
(a masked unit points at /dev/null) is replaced, never written through.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path, PurePosixPath

UNITS_PACKAGE = "sandbox_supervisor.units"
UNIT_SUFFIXES = (".service", ".socket")
EXAMPLE_CONFIG = "supervisor.toml"
# Where, under the root, each kind of file goes (paths of the unit's ExecStart and
# ConfigurationDirectory=).
UNIT_DIRECTORY = PurePosixPath("etc/systemd/system")
CONFIG_DIRECTORY = PurePosixPath("etc/sandbox-supervisor")
DEFAULT_ROOT = Path("/")
# Root-owned and world-readable, as systemd expects of units; the configuration holds no
# secret (the JWKS is public keys) and the daemon's account must read it.
FILE_MODE = 0o644
DIRECTORY_MODE = 0o755


class InstallUnitsError(Exception):
    """The files cannot be installed there (bad root, or the file system refused)."""


class Outcome(Enum):
    WROTE = "wrote"
    KEPT = "kept"


@dataclass(frozen=True)
class Installed:
    path: Path
    outcome: Outcome

    def describe(self) -> str:
        if self.outcome is Outcome.KEPT:
            return f"kept {self.path} (it exists; --force replaces it)"
        return f"wrote {self.path}"


def shipped_units() -> list[Traversable]:
    """The unit files of the installed package, by name."""
    found = [
        entry
        for entry in resources.files(UNITS_PACKAGE).iterdir()
        if entry.is_file() and entry.name.endswith(UNIT_SUFFIXES)
    ]
    if not found:  # a broken install; writing nothing and saying "done" would hide it
        raise InstallUnitsError(f"the installed package {UNITS_PACKAGE} holds no unit files")
    return sorted(found, key=lambda entry: entry.name)


def example_config() -> Traversable:
    return resources.files(UNITS_PACKAGE) / EXAMPLE_CONFIG


def install_units(root: Path = DEFAULT_ROOT, *, force: bool = False) -> list[Installed]:
    """Write every unit into ROOT/etc/systemd/system/ and the example configuration to
    ROOT/etc/sandbox-supervisor/supervisor.toml (kept when it exists, unless `force`)."""
    if not root.is_dir():
        raise InstallUnitsError(f"--root {root} is not a directory")
    done: list[Installed] = []
    unit_directory = root / UNIT_DIRECTORY
    for unit in shipped_units():
        target = unit_directory / unit.name
        _write(target, unit.read_bytes())
        done.append(Installed(target, Outcome.WROTE))
    config = example_config()
    target = root / CONFIG_DIRECTORY / EXAMPLE_CONFIG
    if os.path.lexists(target) and not force:
        done.append(Installed(target, Outcome.KEPT))
    else:
        _write(target, config.read_bytes())
        done.append(Installed(target, Outcome.WROTE))
    return done


def _write(target: Path, content: bytes) -> None:
    try:
        _make_directories(target.parent)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(content)
                out.flush()
                os.fchmod(out.fileno(), FILE_MODE)  # mkstemp makes 0600; the umask is not asked
                os.fsync(out.fileno())
            os.replace(temporary, target)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        raise InstallUnitsError(f"cannot write {target}: {exc.strerror or exc}") from exc


def _make_directories(directory: Path) -> None:
    # Directories we create get 0755 whatever the umask (an image build may run with 077,
    # which would hide the units from systemd's unprivileged generators and the daemon's user
    # from its configuration); existing ones are left as they are.
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        path.mkdir()
        os.chmod(path, DIRECTORY_MODE)
