"""Which files are the installed distribution's own: what the onboarding runtime hash covers.

Files are named as Python imports them, relative to the install location
(`sandbox_supervisor/daemon/app.py`), so the names do not depend on where or how the
distribution was installed.

- A regular (wheel) install: the entries of the distribution's RECORD under
  `sandbox_supervisor/`, bytecode caches excluded. A file someone drops into a package
  directory is not in RECORD and is not ours; the console scripts (outside the package
  directories; they embed the interpreter's path) and the dist-info directory (the installer
  writes its own INSTALLER, REQUESTED, direct_url.json) are left out as well.
- An editable install (PEP 660): RECORD lists only the import hook, so the files are those a
  wheel built from the checkout would contain, read from its pyproject.toml
  (`[tool.setuptools]` packages, package-dir, package-data): each listed package's own
  `*.py` modules (not recursive: subpackages are listed themselves) and the files its
  package-data globs match (`"*"` applies to every package), bytecode caches excluded, hidden
  files not matched (as setuptools globs them). A new module in a package directory is
  shipped by the next wheel, so it counts; scratch files, caches and other stray files do not.
  The checkout is found through the install's direct_url.json (PEP 610).

The distribution is the one whose files include the `__init__.py` Python actually imports
for every runtime package: an egg-info directory left in a checkout by a build (which
`python -m` puts on sys.path from the working directory) has no RECORD and is never chosen.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

from sandbox_supervisor.daemon.version import DISTRIBUTION

# Every package the distribution installs lives under this (PEP 420) namespace.
IMPORT_NAMESPACE = "sandbox_supervisor"
RUNTIME_PACKAGES = (
    "sandbox_supervisor.daemon",
    "sandbox_supervisor.protocol",
    "sandbox_supervisor.testing",
    "sandbox_supervisor.units",
)
PYPROJECT = "pyproject.toml"
# setuptools' build_py takes each listed package's modules with this glob.
MODULE_GLOB = "*.py"
# package-data keys that apply to every package.
ALL_PACKAGES_KEYS = ("", "*")
# Compiled bytecode embeds source mtimes and depends on when imports happened: not content.
CACHE_DIRECTORY = "__pycache__"
CACHE_SUFFIXES = (".pyc", ".pyo")
INIT_MODULE = "__init__.py"


class ShippedFilesError(Exception):
    """The distribution's files cannot be determined (the message says why)."""


def is_cache(name: PurePosixPath) -> bool:
    return CACHE_DIRECTORY in name.parts or name.name.endswith(CACHE_SUFFIXES)


def installed_files(
    distribution: str = DISTRIBUTION, packages: Iterable[str] = RUNTIME_PACKAGES
) -> dict[str, Path]:
    """name -> file, for the installed distribution that provides the imported `packages`."""
    imported = {package: _imported_init(package) for package in packages}
    refused: list[str] = []
    for candidate in metadata.distributions(name=distribution):
        if candidate.read_text("RECORD") is None:
            continue  # build output (egg-info), not an installation
        try:
            files = shipped_files(candidate)
        except ShippedFilesError as exc:
            refused.append(str(exc))
            continue
        if all(_same_file(files.get(_init_name(package)), path) for package, path in imported.items()):
            return files
        refused.append(f"{describe(candidate)} does not hold the imported packages")
    where = ", ".join(f"{package} from {path}" for package, path in imported.items())
    raise ShippedFilesError(
        f"no installed {distribution} distribution provides the code Python imports ({where})"
        + "".join(f"; {reason}" for reason in refused)
    )


def shipped_files(dist: metadata.Distribution) -> dict[str, Path]:
    """name -> file for one installed distribution (module docstring: the rule)."""
    recorded: dict[str, Path] = {}
    for name in recorded_names(dist):
        if name.parts[:1] == (IMPORT_NAMESPACE,) and not is_cache(name):
            recorded[str(name)] = Path(str(dist.locate_file(str(name))))
    if recorded:
        return recorded
    project = editable_project(dist)
    if project is None:
        raise ShippedFilesError(
            f"{describe(dist)} lists no file under {IMPORT_NAMESPACE}/ and is not an editable install"
        )
    return wheel_files(project)


def recorded_names(dist: metadata.Distribution) -> list[PurePosixPath]:
    """Every path RECORD lists (its first CSV column). Read here rather than through
    Distribution.files, which from Python 3.12 on drops files that no longer exist: a shipped
    file that went missing must be noticed, not silently left out."""
    text = dist.read_text("RECORD")
    if text is None:
        return []
    return [PurePosixPath(row[0]) for row in csv.reader(text.splitlines()) if row and row[0]]


def describe(dist: metadata.Distribution) -> str:
    return f"{dist.metadata['Name']} {dist.version} in {dist.locate_file('')}"


def editable_project(dist: metadata.Distribution) -> Path | None:
    """The checkout of an editable install (PEP 610 direct_url.json), else None."""
    text = dist.read_text("direct_url.json")
    if text is None:
        return None
    try:
        direct_url = json.loads(text)
    except ValueError:
        return None
    if not isinstance(direct_url, dict):
        return None
    dir_info = direct_url.get("dir_info")
    url = direct_url.get("url")
    if not (isinstance(dir_info, dict) and dir_info.get("editable") is True and isinstance(url, str)):
        return None
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    return Path(unquote(parts.path))


def wheel_files(project: Path) -> dict[str, Path]:
    """name -> file for what a wheel built from `project` would hold in its packages."""
    pyproject_path = project / PYPROJECT
    try:
        pyproject = tomllib.loads(pyproject_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ShippedFilesError(f"cannot read {pyproject_path} of the editable install: {exc}") from exc
    setuptools = _table(pyproject.get("tool", {})).get("setuptools", {})
    packages = _table(setuptools).get("packages")
    if not (isinstance(packages, list) and all(isinstance(p, str) for p in packages)):
        raise ShippedFilesError(f"{pyproject_path} does not list its packages (tool.setuptools.packages)")
    package_dir = _string_table(_table(setuptools).get("package-dir", {}))
    package_data = _table(_table(setuptools).get("package-data", {}))
    found: dict[str, Path] = {}
    for package in packages:
        directory = project / source_directory(package, package_dir)
        patterns = [MODULE_GLOB]
        for key in (*ALL_PACKAGES_KEYS, package):
            globs = package_data.get(key, [])
            patterns += [g for g in globs if isinstance(g, str)] if isinstance(globs, list) else []
        prefix = PurePosixPath(*package.split("."))
        for pattern in patterns:
            # glob.glob as setuptools uses it: `**` recursive, hidden files not matched.
            for relative in glob.glob(pattern, root_dir=directory, recursive=True):
                name = PurePosixPath(Path(relative).as_posix())
                path = directory / relative
                if path.is_file() and not is_cache(name):
                    found[str(prefix / name)] = path
    return found


def source_directory(package: str, package_dir: Mapping[str, str]) -> PurePosixPath:
    """Where setuptools takes `package` from: the longest mapped prefix of its name, then
    the rest of the name as directories ("" maps the root)."""
    parts = package.split(".")
    for cut in range(len(parts), -1, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return PurePosixPath(package_dir[prefix], *parts[cut:])
    return PurePosixPath(*parts)


def _table(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _string_table(value: Any) -> dict[str, str]:
    return {k: v for k, v in _table(value).items() if isinstance(v, str)}


def _init_name(package: str) -> str:
    return str(PurePosixPath(*package.split("."), INIT_MODULE))


def _imported_init(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None or Path(spec.origin).name != INIT_MODULE:
        raise ShippedFilesError(f"{package} is not importable as a regular package")
    return Path(spec.origin)


def _same_file(candidate: Path | None, imported: Path) -> bool:
    if candidate is None:
        return False
    try:
        return os.path.samefile(candidate, imported)
    except OSError:
        return False
