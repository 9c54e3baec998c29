"""Packaging, as a platform engineer meets it on the first install: the package list, the
constraints file, what the wheel holds, and the wheel installed into a fresh virtualenv
beside supervisord's `supervisor` distribution (which owns the top-level `supervisor` import
name that our daemon's directory is called in the checkout)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path, PurePosixPath
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from wheel_build import REPO, built_wheel, pyproject

from sandbox_supervisor.daemon.ops.onboarding import python_version, runtime_hash
from sandbox_supervisor.daemon.ops.shipped import wheel_files

DISTRIBUTION = "sandbox-supervisor"
CONSTRAINTS = REPO / "constraints.txt"
UNIT_SOURCES = sorted((REPO / "systemd").glob("*.service")) + sorted((REPO / "systemd").glob("*.socket"))
EXAMPLE_CONFIG = REPO / "systemd" / "supervisor.toml"
TYPED_PACKAGES = ("sandbox_supervisor/daemon", "sandbox_supervisor/protocol", "sandbox_supervisor/testing")
VENV_TIMEOUT_S = 120
PIP_TIMEOUT_S = 600
COMMAND_TIMEOUT_S = 60
CACHE_PARTS = {"__pycache__"}


# --- the package list ---------------------------------------------------------------------


def test_the_package_list_names_every_package_directory() -> None:
    """pyproject.toml lists packages by hand (a find would need one rule per mapped
    directory): every directory with an __init__.py under a mapped directory must be in the
    list, or the wheel silently ships without it."""
    setuptools = pyproject()["tool"]["setuptools"]
    found = set()
    for package, directory in setuptools["package-dir"].items():
        for init in (REPO / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / directory)
            if CACHE_PARTS.isdisjoint(relative.parts):
                found.add(".".join([package, *relative.parts]))
    assert {"sandbox_supervisor.daemon.runtime", "sandbox_supervisor.units"} <= found  # the walk works
    assert sorted(setuptools["packages"]) == sorted(found)
    assert len(setuptools["packages"]) == len(set(setuptools["packages"]))


# --- the constraints file -----------------------------------------------------------------


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins() -> dict[str, str]:
    """name -> version of every line of constraints.txt; each must be an exact pin."""
    found: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier  # one specifier: ==version
        assert specifier.operator == "==" and "*" not in specifier.version, line
        assert requirement.marker is None and not requirement.extras, line
        name = canonicalize_name(requirement.name)
        assert name not in found, f"{name} pinned twice"
        found[name] = specifier.version
    return found


def closure(requirements: list[str], extra: str) -> set[str]:
    """Canonical names needed, transitively, by `requirements` under `extra`, per the
    installed metadata."""
    names: set[str] = set()
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in names:
            names.add(name)
            pending += [Requirement(text) for text in metadata.requires(name) or []]
    return names


def test_constraints_pin_every_runtime_requirement_and_nothing_for_tests() -> None:
    requirements = metadata.requires(DISTRIBUTION) or []
    runtime = closure(requirements, "")
    for_tests = closure(requirements, "test") - runtime
    pinned = pins()
    assert {"pydantic-core", "wsproto", "cffi"} <= runtime  # transitive ones are there
    assert {"pytest", "hypothesis", "pluggy"} <= for_tests
    assert set(pinned) == runtime
    assert not set(pinned) & for_tests
    # Each direct requirement's pin is one pyproject.toml allows (the file is not stale).
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is None:
            assert requirement.specifier.contains(pinned[canonicalize_name(requirement.name)]), text


def test_constraints_say_how_to_regenerate_and_the_script_agrees() -> None:
    header = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("#")]
    assert any("scripts/write_constraints.py" in line for line in header)
    assert any("pip install -c constraints.txt" in line for line in header)
    script = load_script("write_constraints")
    # The script computes the same set this test checks the file against.
    assert set(script.runtime_closure()) == set(pins())
    rendered = script.render({"a": "1", "b": "2"})
    assert rendered.endswith("a==1\nb==2\n") and rendered.startswith("# ")


def test_the_operations_guide_installs_with_the_constraints() -> None:
    guide = (REPO / "docs" / "operations.md").read_text()
    assert "pip install --no-cache-dir -c /tmp/constraints.txt" in guide
    assert "pip wheel --no-deps -w dist ." in guide
    assert "sandbox-supervisor install-units --root /" in guide


# --- what the wheel holds -----------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built_wheel(tmp_path_factory)


def test_the_wheel_holds_types_license_units_and_config_under_our_namespace(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        for package in TYPED_PACKAGES:
            assert f"{package}/py.typed" in names, package
        assert archive.read(f"{dist_info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        for unit in UNIT_SOURCES:
            assert archive.read(f"sandbox_supervisor/units/{unit.name}") == unit.read_bytes()
        assert archive.read("sandbox_supervisor/units/supervisor.toml") == EXAMPLE_CONFIG.read_bytes()
        wheel_metadata = archive.read(f"{dist_info}/METADATA").decode()
    assert len(UNIT_SOURCES) == 3
    # Nothing outside our namespace and the dist-info: above all no top-level supervisor/,
    # which is supervisord's. sandbox_supervisor/ itself stays a namespace (no __init__.py).
    tops = {PurePosixPath(name).parts[0] for name in names}
    assert tops == {"sandbox_supervisor", dist_info}
    assert "sandbox_supervisor/__init__.py" not in names
    assert not any(CACHE_PARTS & set(PurePosixPath(n).parts) or n.endswith(".pyc") for n in names)
    headers = [line for line in wheel_metadata.splitlines() if ": " in line]
    assert "License-Expression: Apache-2.0" in headers
    assert not any(line.startswith("Classifier: License ::") for line in headers)
    assert "Classifier: Typing :: Typed" in headers
    assert "Classifier: Operating System :: POSIX :: Linux" in headers
    urls = {line.split(", ")[0].removeprefix("Project-URL: ") for line in headers if line.startswith("Project-URL:")}
    assert urls == {"Homepage", "Documentation", "Source", "Issues"}


# --- the wheel in a fresh virtualenv, beside supervisord ---------------------------------


def run(*command: str | Path, cwd: Path, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    # Nothing of the test environment leaks into the fresh one: no PYTHONPATH or VIRTUAL_ENV,
    # and not the checkout as working directory (`python -c` puts it first on sys.path, where
    # our supervisor/ directory would shadow supervisord's `supervisor` package).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def ok(completed: subprocess.CompletedProcess[str]) -> str:
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


VENV_DEPENDENCIES = (
    "import json; from sandbox_supervisor.daemon.ops.onboarding import dependency_versions; "
    "print(json.dumps(dependency_versions()))"
)


@pytest.mark.slow
def test_the_wheel_installs_beside_supervisord_and_survives_its_removal(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"

    def run_here(*command: str | Path, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return run(*command, cwd=tmp_path, timeout=timeout)

    # Without its own pip (ensurepip costs seconds): this environment's pip installs into it.
    ok(run_here(sys.executable, "-m", "venv", "--without-pip", venv, timeout=VENV_TIMEOUT_S))
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    pip = (sys.executable, "-m", "pip", "--python", python)
    # As the image build does: our wheel with the constraints, plus supervisord, from the index.
    ok(run_here(*pip, "install", "-q", "-c", CONSTRAINTS, wheel, "supervisor", timeout=PIP_TIMEOUT_S))

    version = metadata.version(DISTRIBUTION)
    assert ok(run_here(bin_dir / "sandbox-supervisor", "--version")) == f"sandbox-supervisor {version}\n"
    ok(run_here(python, "-c", "import sandbox_supervisor.daemon.app"))
    assert ok(run_here(bin_dir / "supervisord", "--version")).strip() == ok(
        run_here(python, "-c", "from importlib.metadata import version; print(version('supervisor'))")
    ).strip()
    where = ok(run_here(python, "-c", "import supervisor.supervisord, sandbox_supervisor.daemon as d; "
                               "print(supervisor.supervisord.__file__); print(d.__file__)")).split()
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert where == [str(site / "supervisor" / "supervisord.py"), str(site / "sandbox_supervisor" / "daemon" / "__init__.py")]

    # The constraints are complete: the resolver installed exactly the pinned closure.
    assert json.loads(ok(run_here(python, "-c", VENV_DEPENDENCIES))) == pins()

    # install-units from the wheel writes the files the repository verifies.
    root = tmp_path / "root"
    root.mkdir()
    ok(run_here(bin_dir / "sandbox-supervisor", "install-units", "--root", root))
    for unit in UNIT_SOURCES:
        assert (root / "etc/systemd/system" / unit.name).read_bytes() == unit.read_bytes()
    assert (root / "etc/sandbox-supervisor/supervisor.toml").read_bytes() == EXAMPLE_CONFIG.read_bytes()

    # The onboarding hash of the wheel install (RECORD) is the checkout's (the editable rule).
    record = json.loads(ok(run_here(
        bin_dir / "sandbox-supervisor", "onboard-template", "--service", "svc", "--profile-version", "1",
        "--template-id", "tmpl-1", "--supervisor-sha", "0" * 40,
    )))
    expected = runtime_hash(wheel_files(REPO), python_version=python_version(), dependencies=pins())
    assert record["runtimeHash"] == expected

    # Removing supervisord takes none of our files with it.
    ok(run_here(*pip, "uninstall", "-y", "-q", "supervisor", timeout=PIP_TIMEOUT_S))
    gone = run_here(python, "-c", "import supervisor")
    assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr
    ok(run_here(python, "-c", "import sandbox_supervisor.daemon.app, sandbox_supervisor.units"))
    assert ok(run_here(bin_dir / "sandbox-supervisor", "--version")) == f"sandbox-supervisor {version}\n"
