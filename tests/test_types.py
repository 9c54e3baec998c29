"""`mypy --strict` over the installed packages is part of the test command: `.ci/typecheck`
must report no error, and the runner itself must check what it claims to check.

The type check runs in a subprocess, as a developer runs it. Its cache is the one
`.ci/typecheck` keeps in the virtual environment (cold on a fresh clone, as in CI: about 5 s
here; warm, under a second).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TYPECHECK = ROOT / ".ci" / "typecheck"
# A hang guard, not a speed check: a cold run takes about 5 s here, and far longer would
# still pass on a machine busy with other work.
TYPECHECK_LIMIT_S = 300
# "Success: no issues found in 63 source files" or "Found 2 errors in 1 file (checked 63 source
# files)"
SUMMARY = re.compile(r"(?:in|checked) (\d+) source files?\)?$", re.M)


def run_typecheck(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TYPECHECK), *args],
        capture_output=True,
        text=True,
        timeout=TYPECHECK_LIMIT_S,
        env=env,
    )


def checked_files(output: str) -> int:
    match = SUMMARY.search(output)
    assert match is not None, f"no mypy summary line in:\n{output}"
    return int(match.group(1))


@pytest.mark.slow
def test_installed_packages_are_strict_clean():
    done = run_typecheck()
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mypy --strict (.ci/typecheck) is not clean:\n{output}"
    # Every module of the three packages was checked, not a handful that happened to resolve.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["package-dir"]
    modules = sum(len(list((ROOT / directory).rglob("*.py"))) for directory in packages.values())
    assert checked_files(output) >= modules, output


def _write_project(root: Path) -> None:
    """A checkout laid out like ours: `proto/` installs as `sandbox_supervisor.protocol`,
    under the real [tool.mypy] settings (without the per-module overrides, which name our
    modules). One module has a strict-only error; another imports the first by its installed
    name and misuses what it imports, which mypy can report only if the name resolves."""
    real = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    mypy_settings = {k: v for k, v in real["mypy"].items() if k != "overrides"}
    lines = ["[tool.setuptools.package-dir]", '"sandbox_supervisor.protocol" = "proto"']
    lines += ["", "[tool.mypy]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in mypy_settings.items()]
    lines += ["", "[tool.pydantic-mypy]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in real["pydantic-mypy"].items()]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
    package = root / "proto"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text('NAME = "text"\n\n\ndef untyped(x):\n    return x\n')
    (package / "b.py").write_text(
        "from sandbox_supervisor.protocol.a import NAME\n\nNUMBER: int = NAME\n"
    )


@pytest.mark.slow
def test_errors_fail_the_check_and_name_repository_paths(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    _write_project(project)
    env = {**os.environ, "MYPY_CACHE_DIR": str(tmp_path / "cache")}  # not the venv's cache
    done = run_typecheck("--root", str(project), env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    lines = output.splitlines()
    # Strict is in force (an unannotated function is an error) ...
    assert any(
        line.startswith("proto/a.py:4: error:") and "[no-untyped-def]" in line for line in lines
    ), output
    # ... the installed name resolved to proto/a.py (else: import-not-found, not this) ...
    assert any(
        line.startswith("proto/b.py:3: error: Incompatible types in assignment") for line in lines
    ), output
    assert "import-not-found" not in output, output
    # ... and every file is named by its path in the checkout, never the link tree's.
    assert not any(line.startswith("sandbox_supervisor/") for line in lines), output
    assert "typecheck-" not in output, output  # the link tree's temporary directory
    assert checked_files(output) == 3, output
