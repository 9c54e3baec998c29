"""The project's wheel, built once per test session with `pip wheel --no-deps`, the way
docs/operations.md builds it for an image (tests/test_packaging.py, tests/test_onboarding.py).

It is built from a copy of the checkout's packaged files, not in place: an in-tree build
writes build/ and an egg-info into the checkout, and setuptools reuses build/lib, so a module
deleted since the last build would still ship. pip fetches the build backend (setuptools) from
the package index; when the index cannot be reached, the tests that need a wheel are skipped
with a message that says so (never a failure of the code under test).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTION = "sandbox-supervisor"
# A pure-Python distribution on the index, fetched (no install) to tell "the index cannot be
# reached" from a failure of our own build or install.
INDEX_PROBE = "supervisor"
INDEX_PROBE_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 300
COPY_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")

_cache: dict[str, object] = {}  # what one session computed once: "index", "wheel"


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def index_unreachable() -> str | None:
    """None when pip reaches the package index, else why not (asked once per session)."""
    if "index" not in _cache:
        with tempfile.TemporaryDirectory() as scratch:
            try:
                probe = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", scratch, INDEX_PROBE],
                    capture_output=True,
                    text=True,
                    timeout=INDEX_PROBE_TIMEOUT_S,
                    stdin=subprocess.DEVNULL,
                )
                lines = (probe.stderr or probe.stdout).strip().splitlines()
                reason = None if probe.returncode == 0 else (lines[-1] if lines else f"exit {probe.returncode}")
            except subprocess.TimeoutExpired:
                reason = f"no answer in {INDEX_PROBE_TIMEOUT_S} s"
        _cache["index"] = reason
    value = _cache["index"]
    return value if isinstance(value, str) else None


def skip_without_index() -> None:
    reason = index_unreachable()
    if reason is not None:
        pytest.skip(f"the package index cannot be reached (pip download {INDEX_PROBE} failed: {reason})")


def source_copy(destination: Path) -> Path:
    """The files a build reads: pyproject.toml, the readme, the license files and every
    directory package-dir maps (without caches and build output)."""
    project = pyproject()["project"]
    destination.mkdir(parents=True)
    for name in ["pyproject.toml", project["readme"], *project["license-files"]]:
        shutil.copy2(REPO / name, destination / name)
    for directory in set(pyproject()["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / directory, destination / directory, ignore=COPY_IGNORED)
    return destination


def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the checkout as it is now (built once per session)."""
    cached = _cache.get("wheel")
    if isinstance(cached, Path):
        return cached
    skip_without_index()
    work = tmp_path_factory.mktemp("wheel-build")
    source = source_copy(work / "source")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(work / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    wheel: Path
    (wheel,) = (work / "dist").glob("sandbox_supervisor-*.whl")
    _cache["wheel"] = wheel
    return wheel


def install_to_target(wheel: Path, target: Path) -> Path:
    """A wheel install into a plain directory (`pip install --target`): a real RECORD and the
    installer's bytecode, without a virtualenv. Our code only, from the wheel file alone."""
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return target
