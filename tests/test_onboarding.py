"""Template onboarding: the record model, the hashes, the build commit, the CLI (every problem
reported, exit 2) and the JSON file store (atomic, locked, crash-safe)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
from datetime import datetime, timedelta, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from wheel_build import built_wheel, install_to_target

from sandbox_supervisor.protocol.onboarding import MAX_COMPONENTS, TemplateOnboarding, format_utc
from sandbox_supervisor.protocol.schema_export import DEFAULT_OUT_DIR, EXPORTED
from sandbox_supervisor.daemon.ops import onboarding
from sandbox_supervisor.daemon.ops.onboarding import (
    BUILD_SHA_ENV,
    RUNTIME_PACKAGES,
    OnboardingInputError,
    build_sha,
    dependency_versions,
    package_directories,
    python_version,
    runtime_hash,
    sha256_file,
)
from sandbox_supervisor.daemon.ops.shipped import (
    ShippedFilesError,
    installed_files,
    shipped_files,
    source_directory,
    wheel_files,
)
from sandbox_supervisor.daemon.ops.onboarding_store import (
    STORE_FORMAT,
    JsonFileOnboardingStore,
    OnboardingStore,
    OnboardingStoreError,
)

REPO = Path(__file__).resolve().parents[1]
SHA1 = "0123456789abcdef0123456789abcdef01234567"
SHA256 = "ab" * 32
CLI_TIMEOUT_S = 60
EXIT_BAD_INPUT = 2


def record_data(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "owner": {"service": "my-service", "profileVersion": 3},
        "provider": "e2b",
        "templateId": "tmpl-abc123",
        "supervisor": {"version": "0.1.0", "sha": SHA1},
        "supervisorEntrySha256": SHA256,
        "runtimeHash": "cd" * 32,
        "components": {"node": "22.11.0", "python": "3.11.7"},
        "onboardedAt": "2025-01-31T12:00:00.5Z",
    }
    data.update(overrides)
    return data


def record(**overrides: Any) -> TemplateOnboarding:
    return TemplateOnboarding.model_validate(record_data(**overrides))


# --- the model ----------------------------------------------------------------------------


def test_a_complete_record_validates_and_round_trips() -> None:
    parsed = record()
    assert parsed.key == ("my-service", "tmpl-abc123")
    assert TemplateOnboarding.model_validate_json(parsed.model_dump_json()) == parsed
    assert "TemplateOnboarding" in EXPORTED
    schema = json.loads((DEFAULT_OUT_DIR / "TemplateOnboarding.json").read_text())
    assert schema["properties"]["provider"]["const"] == "e2b"
    assert schema["properties"]["components"]["maxProperties"] == MAX_COMPONENTS


@pytest.mark.parametrize(
    ("overrides", "location"),
    [
        ({"provider": "aws"}, ("provider",)),
        ({"owner": {"service": "My_Service", "profileVersion": 1}}, ("owner", "service")),
        ({"owner": {"service": "svc", "profileVersion": 0}}, ("owner", "profileVersion")),
        ({"owner": {"service": "svc", "profileVersion": "1"}}, ("owner", "profileVersion")),
        ({"owner": {"service": "svc", "profileVersion": True}}, ("owner", "profileVersion")),
        ({"owner": {"service": "svc"}}, ("owner", "profileVersion")),
        ({"templateId": ""}, ("templateId",)),
        ({"templateId": "x" * 513}, ("templateId",)),
        ({"templateId": "line\nbreak"}, ("templateId",)),
        ({"supervisor": {"version": "1", "sha": SHA1.upper()}}, ("supervisor", "sha")),
        ({"supervisor": {"version": "1", "sha": SHA1[:39]}}, ("supervisor", "sha")),
        ({"supervisor": {"version": "", "sha": SHA1}}, ("supervisor", "version")),
        ({"supervisorEntrySha256": SHA256[:63]}, ("supervisorEntrySha256",)),
        ({"runtimeHash": "g" * 64}, ("runtimeHash",)),
        ({"components": {"Node": "1"}}, ("components", "Node", "[key]")),
        ({"components": {"9lives": "1"}}, ("components", "9lives", "[key]")),
        ({"components": {"a" * 65: "1"}}, ("components", "a" * 65, "[key]")),
        ({"components": {"node": ""}}, ("components", "node")),
        ({"components": {f"c{i}": "1" for i in range(MAX_COMPONENTS + 1)}}, ("components",)),
        ({"onboardedAt": "2025-01-31T12:00:00+01:00"}, ("onboardedAt",)),
        ({"onboardedAt": "2025-01-31 12:00:00Z"}, ("onboardedAt",)),
        ({"onboardedAt": "2025-02-30T12:00:00Z"}, ("onboardedAt",)),
        ({"onboardedAt": "2025-01-31T24:00:00Z"}, ("onboardedAt",)),
        ({"agentCore": {"version": "1", "sha": SHA1}}, ("agentCore",)),
    ],
)
def test_invalid_records_are_refused_where_they_are_wrong(overrides, location) -> None:
    with pytest.raises(ValidationError) as excinfo:
        record(**overrides)
    assert location in [tuple(str(p) for p in error["loc"]) for error in excinfo.value.errors()]


def test_sixty_four_components_are_allowed() -> None:
    assert len(record(components={f"c{i}": "1" for i in range(MAX_COMPONENTS)}).components) == 64


def test_format_utc_writes_the_record_form() -> None:
    moment = datetime(2025, 1, 31, 13, 0, 0, 250000, tzinfo=timezone(timedelta(hours=1)))
    assert format_utc(moment) == "2025-01-31T12:00:00.25Z"
    assert format_utc(datetime(2025, 1, 31, tzinfo=timezone.utc)) == "2025-01-31T00:00:00Z"
    record(onboardedAt=format_utc(datetime.now(timezone.utc)))  # always valid
    with pytest.raises(ValueError):
        format_utc(datetime(2025, 1, 31))


# --- hashes -------------------------------------------------------------------------------


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


TREE = {"__init__.py": b"", "app.py": b"print('hi')\n", "sub/data.json": b"{}\n"}
DEPS = {"trio": "0.35.0", "pydantic": "2.14.4"}


def tree_hash(root: Path, *, python: str = "CPython 3.11.7", deps: dict | None = None) -> str:
    files = {f"pkg/{p.relative_to(root).as_posix()}": p for p in root.rglob("*") if p.is_file()}
    return runtime_hash(files, python_version=python, dependencies=DEPS if deps is None else deps)


def test_runtime_hash_is_stable_and_independent_of_creation_order(tmp_path: Path) -> None:
    first = make_tree(tmp_path / "a", TREE)
    second = make_tree(tmp_path / "b", dict(reversed(list(TREE.items()))))
    assert tree_hash(first) == tree_hash(first) == tree_hash(second)
    assert len(tree_hash(first)) == 64


@pytest.mark.parametrize(
    "change",
    ["edit", "add", "rename", "remove", "python", "dependency", "dependency-added"],
)
def test_runtime_hash_changes_with_code_python_or_dependencies(tmp_path: Path, change: str) -> None:
    root = make_tree(tmp_path / "pkg", TREE)
    before = tree_hash(root)
    python, deps = "CPython 3.11.7", dict(DEPS)
    if change == "edit":
        (root / "app.py").write_bytes(b"print('hi!')\n")
    elif change == "add":
        (root / "sub" / "new.py").write_bytes(b"")
    elif change == "rename":
        (root / "app.py").rename(root / "main.py")
    elif change == "remove":
        (root / "sub" / "data.json").unlink()
    elif change == "python":
        python = "CPython 3.11.8"
    elif change == "dependency":
        deps["trio"] = "0.36.0"
    else:
        deps["sniffio"] = "1.3.1"
    assert tree_hash(root, python=python, deps=deps) != before




# --- which files are hashed: the distribution's own -------------------------------------


@pytest.fixture(scope="module")
def pristine_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_to_target(built_wheel(tmp_path_factory), tmp_path_factory.mktemp("wheel") / "site")


@pytest.fixture
def wheel_install(pristine_install: Path, tmp_path: Path) -> Path:
    """A wheel install of the checkout (pip --target, with RECORD) this test may change."""
    return Path(shutil.copytree(pristine_install, tmp_path / "site", symlinks=True))


def install_dist(site: Path) -> metadata.Distribution:
    (dist,) = metadata.distributions(name="sandbox-supervisor", path=[str(site)])
    return dist


def install_hash(site: Path) -> str:
    return runtime_hash(shipped_files(install_dist(site)), python_version=python_version(), dependencies=DEPS)


def test_a_stray_file_in_a_wheel_install_does_not_change_the_runtime_hash(wheel_install: Path) -> None:
    before = install_hash(wheel_install)
    package = wheel_install / "sandbox_supervisor"
    assert (package / "daemon" / "app.py").is_file()  # the installed code is there
    (package / "daemon" / "stray.py").write_text("raise SystemExit('not ours')\n")
    (package / "units" / "override.service").write_text("[Service]\n")
    (package / "protocol" / "schemas" / "Extra.json").write_text("{}\n")
    (package / "notes.txt").write_text("left by someone\n")
    assert install_hash(wheel_install) == before


@pytest.mark.parametrize(
    "shipped", ["daemon/app.py", "daemon/ops/cli.py", "units/supervisor.toml", "protocol/schemas/ServerFrame.json", "testing/py.typed"]
)
def test_a_changed_shipped_file_changes_the_runtime_hash(wheel_install: Path, shipped: str) -> None:
    before = install_hash(wheel_install)
    path = wheel_install / "sandbox_supervisor" / shipped
    path.write_bytes(path.read_bytes() + b"\n")
    assert install_hash(wheel_install) != before


def test_bytecode_the_installer_recorded_is_not_hashed(wheel_install: Path) -> None:
    recorded = [str(entry) for entry in install_dist(wheel_install).files or ()]
    assert any("__pycache__" in name and name.endswith(".pyc") for name in recorded)  # pip compiled them
    names = shipped_files(install_dist(wheel_install))
    assert names and not any("__pycache__" in name or name.endswith(".pyc") for name in names)
    assert all(name.startswith("sandbox_supervisor/") for name in names)  # no dist-info, no scripts
    before = install_hash(wheel_install)
    for compiled in (wheel_install / "sandbox_supervisor").rglob("*.pyc"):
        compiled.write_bytes(b"recompiled at another time")
    assert install_hash(wheel_install) == before


def test_a_missing_shipped_file_is_a_problem_not_a_crash(wheel_install: Path) -> None:
    missing = wheel_install / "sandbox_supervisor" / "daemon" / "app.py"
    missing.unlink()
    with pytest.raises(OnboardingInputError) as excinfo:
        install_hash(wheel_install)
    assert excinfo.value.problems == [
        ("(runtime hash)", f"cannot read {missing}, a file of the installed distribution: No such file or directory")
    ]


def test_an_editable_install_hashes_what_a_wheel_of_the_checkout_holds(pristine_install: Path) -> None:
    from_wheel = shipped_files(install_dist(pristine_install))
    from_checkout = wheel_files(REPO)
    assert sorted(from_checkout) == sorted(from_wheel)
    assert {n: sha256_file(p) for n, p in from_checkout.items()} == {n: sha256_file(p) for n, p in from_wheel.items()}
    assert any(name.endswith("/py.typed") for name in from_checkout)
    assert "sandbox_supervisor/units/sandbox-supervisor.service" in from_checkout


PROJECT = """
[tool.setuptools]
packages = ["ns.pkg", "ns.pkg.sub", "ns.data"]
[tool.setuptools.package-dir]
"ns.pkg" = "src"
"ns.data" = "units"
[tool.setuptools.package-data]
"*" = ["py.typed"]
"ns.pkg" = ["schemas/*.json"]
"ns.data" = ["*.service"]
"""
PROJECT_FILES = {
    "pyproject.toml": PROJECT.encode(),
    "src/__init__.py": b"",
    "src/mod.py": b"x = 1\n",
    "src/py.typed": b"",
    "src/schemas/a.json": b"{}",
    "src/sub/__init__.py": b"",
    "src/sub/x.py": b"",
    "units/__init__.py": b"",
    "units/a.service": b"[Unit]\n",
}
SHIPPED_NAMES = [
    "ns/data/__init__.py",
    "ns/data/a.service",
    "ns/pkg/__init__.py",
    "ns/pkg/mod.py",
    "ns/pkg/py.typed",
    "ns/pkg/schemas/a.json",
    "ns/pkg/sub/__init__.py",
    "ns/pkg/sub/x.py",
]


def test_the_editable_rule_takes_modules_and_declared_data_only(tmp_path: Path) -> None:
    project = make_tree(tmp_path / "checkout", PROJECT_FILES)
    assert sorted(wheel_files(project)) == SHIPPED_NAMES
    assert wheel_files(project)["ns/pkg/mod.py"] == project / "src" / "mod.py"
    before = runtime_hash(wheel_files(project), python_version="CPython 3.11.7", dependencies=DEPS)
    make_tree(
        project,
        {
            "src/notes.txt": b"scratch",
            "src/.hidden.py": b"",  # setuptools' glob skips hidden files
            "src/__pycache__/mod.cpython-311.pyc": b"\x00",
            "src/schemas/a.txt": b"not *.json",
            "src/sub/deeper/y.py": b"",  # not a listed package
            "units/b.conf": b"",
            "other/z.py": b"",  # not mapped at all
        },
    )
    assert sorted(wheel_files(project)) == SHIPPED_NAMES
    assert runtime_hash(wheel_files(project), python_version="CPython 3.11.7", dependencies=DEPS) == before
    make_tree(project, {"src/new_module.py": b""})  # the next wheel ships it
    assert "ns/pkg/new_module.py" in wheel_files(project)


def fake_editable_install(site: Path, project: Path, *, url: str | None = None) -> metadata.Distribution:
    """A dist-info as pip writes it for an editable install: RECORD lists the hook only."""
    make_tree(
        site / "ns_dist-1.0.dist-info",
        {
            "METADATA": b"Metadata-Version: 2.1\nName: ns-dist\nVersion: 1.0\n",
            "RECORD": b"__editable__.ns_dist-1.0.pth,,\nns_dist-1.0.dist-info/RECORD,,\n",
            "direct_url.json": json.dumps(
                {"url": url or project.as_uri(), "dir_info": {"editable": True}}
            ).encode(),
        },
    )
    (dist,) = metadata.distributions(name="ns-dist", path=[str(site)])
    return dist


def test_an_editable_install_is_found_through_its_direct_url(tmp_path: Path) -> None:
    project = make_tree(tmp_path / "check out", PROJECT_FILES)  # a space: the URL is quoted
    assert "%20" in project.as_uri()
    assert sorted(shipped_files(fake_editable_install(tmp_path / "site", project))) == SHIPPED_NAMES
    remote = fake_editable_install(tmp_path / "other-site", project, url="https://example.invalid/x")
    with pytest.raises(ShippedFilesError, match="lists no file under sandbox_supervisor/ and is not an editable install"):
        shipped_files(remote)


def test_an_editable_checkout_without_a_package_list_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ShippedFilesError, match="cannot read .*pyproject.toml"):
        wheel_files(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.setuptools.packages.find]\n")
    with pytest.raises(ShippedFilesError, match="does not list its packages"):
        wheel_files(tmp_path)


@pytest.mark.parametrize(
    ("package", "expected"),
    [
        ("sandbox_supervisor.daemon", "supervisor"),
        ("sandbox_supervisor.daemon.ops", "supervisor/ops"),
        ("sandbox_supervisor.units", "systemd"),
        ("other.pkg", "src/other/pkg"),  # the root mapping ""
    ],
)
def test_source_directory_follows_the_longest_mapped_prefix(package: str, expected: str) -> None:
    mapping = {"sandbox_supervisor.daemon": "supervisor", "sandbox_supervisor.units": "systemd", "": "src"}
    assert str(source_directory(package, mapping)) == expected


def test_an_egg_info_left_in_the_working_directory_is_not_the_installation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = installed_files()
    # What `python -m` from a checkout sees: a build's egg-info first on sys.path.
    make_tree(
        tmp_path / "sandbox_supervisor.egg-info",
        {"PKG-INFO": b"Metadata-Version: 2.1\nName: sandbox-supervisor\nVersion: 0.0.1\n", "SOURCES.txt": b"supervisor/app.py\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    first = next(iter(metadata.distributions(name="sandbox-supervisor")))
    assert first.version == "0.0.1"  # importlib.metadata would pick it
    assert installed_files() == expected


def test_a_distribution_that_does_not_hold_the_imported_code_is_refused() -> None:
    with pytest.raises(ShippedFilesError, match="no installed pytest distribution provides the code Python imports"):
        installed_files("pytest")


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "entry"
    path.write_bytes(b"#!/usr/bin/python3\n" * 100_000)
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_hashed_packages_are_the_distributions_and_are_imported_from_here() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapped = pyproject["tool"]["setuptools"]["package-dir"]
    assert set(RUNTIME_PACKAGES) == set(mapped)
    assert package_directories()["sandbox_supervisor.daemon"] == Path(onboarding.__file__).parent.parent


def test_dependency_versions_are_transitive_without_test_extras() -> None:
    versions = dependency_versions()
    for name in ("trio", "pydantic", "structlog", "pydantic-core", "sniffio", "cffi"):
        assert name in versions, name  # pydantic-core, sniffio, cffi come in transitively
    assert "pytest" not in versions and "hypothesis" not in versions


# --- the build commit ---------------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()


def test_build_sha_prefers_the_flag_then_the_environment_then_a_clean_checkout(tmp_path: Path) -> None:
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "tracked.py").write_text("x = 1\n")
    git(repo, "add", "tracked.py")
    git(repo, "commit", "-q", "-m", "one")
    head = git(repo, "rev-parse", "HEAD")

    assert build_sha("f" * 40, {BUILD_SHA_ENV: "e" * 40}, repo) == ("f" * 40, "--supervisor-sha")
    assert build_sha(None, {BUILD_SHA_ENV: "e" * 40}, repo) == ("e" * 40, BUILD_SHA_ENV)
    assert build_sha(None, {}, repo) == (head, "git")
    (repo / "untracked.txt").write_text("build output\n")
    assert build_sha(None, {}, repo) == (head, "git")  # untracked files do not change the code
    (repo / "tracked.py").write_text("x = 2\n")
    assert build_sha(None, {}, repo) == (None, "git")  # HEAD no longer describes the code
    not_a_repo = tmp_path / "plain"
    not_a_repo.mkdir()
    assert build_sha(None, {}, not_a_repo) == (None, "git")


# --- the command --------------------------------------------------------------------------


def cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != BUILD_SHA_ENV}


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.daemon", "onboard-template", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=cli_env(),
        cwd=cwd,
    )


VALID_FLAGS = (
    "--service", "my-service",
    "--profile-version", "3",
    "--template-id", "tmpl-abc123",
    "--component", "node=22.11.0",
    "--component", "python=3.11.7",
    "--supervisor-sha", SHA1,
    "--onboarded-at", "2025-01-31T12:00:00Z",
)


def test_cli_prints_a_valid_record_with_stable_hashes(tmp_path: Path) -> None:
    first = run_cli(*VALID_FLAGS, cwd=tmp_path)
    second = run_cli(*VALID_FLAGS, cwd=REPO)  # another process, another working directory
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    printed = TemplateOnboarding.model_validate_json(first.stdout)
    assert first.stdout == second.stdout  # same installed code: same record, byte for byte
    assert printed.owner.service == "my-service" and printed.owner.profileVersion == 3
    assert printed.supervisor.sha == SHA1
    assert printed.components == {"node": "22.11.0", "python": "3.11.7"}
    entry = Path(sysconfig.get_path("scripts")) / "sandbox-supervisor"
    assert printed.supervisorEntrySha256 == sha256_file(entry)
    assert printed.runtimeHash == onboarding.installed_runtime_hash()


def test_cli_takes_the_build_commit_from_the_environment(tmp_path: Path) -> None:
    flags = [f for f in VALID_FLAGS]
    index = flags.index("--supervisor-sha")
    del flags[index : index + 2]
    completed = subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.daemon", "onboard-template", *flags],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={**cli_env(), BUILD_SHA_ENV: "e" * 40},
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr
    assert TemplateOnboarding.model_validate_json(completed.stdout).supervisor.sha == "e" * 40


def test_cli_hashes_the_entry_point_it_is_given(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    entry.write_bytes(b"#!/bin/sh\n")
    completed = run_cli(*VALID_FLAGS, "--entry", str(entry))
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["supervisorEntrySha256"] == hashlib.sha256(b"#!/bin/sh\n").hexdigest()


def problems(completed: subprocess.CompletedProcess[str]) -> list[str]:
    assert completed.returncode == EXIT_BAD_INPUT, completed.stdout + completed.stderr
    assert completed.stdout == ""  # no record is printed when anything is wrong
    return completed.stderr.strip().splitlines()


def test_cli_refuses_sixty_five_components() -> None:
    components = [arg for i in range(MAX_COMPONENTS + 1) for arg in ("--component", f"c{i}=1")]
    lines = problems(run_cli(*VALID_FLAGS, *components))
    assert any(line.startswith("--component:") and "at most 64" in line for line in lines), lines


def test_cli_refuses_a_bad_commit_sha() -> None:
    flags = list(VALID_FLAGS)
    flags[flags.index(SHA1)] = "abc123"
    lines = problems(run_cli(*flags))
    assert lines == ["--supervisor-sha: String should match pattern '^[0-9a-f]{40}$' (got 'abc123')"]


def test_cli_names_every_bad_component_name() -> None:
    lines = problems(
        run_cli(*VALID_FLAGS, "--component", "Node=1", "--component", "9lives=2", "--component", "a_b=3")
    )
    for name in ("Node", "9lives", "a_b"):
        assert any(line.startswith(f"--component {name} (name):") for line in lines), (name, lines)
    assert len(lines) == 3


def test_cli_prints_every_problem_at_once() -> None:
    components = [arg for i in range(MAX_COMPONENTS + 1) for arg in ("--component", f"c{i}=1")]
    lines = problems(
        run_cli(
            "--profile-version", "zero",
            "--provider", "aws",
            "--supervisor-sha", "xyz",
            "--onboarded-at", "2025-01-31T12:00:00+01:00",
            "--component", "BAD=1",
            "--component", "c0=2",  # a repeat of c0 below
            "--component", "novalue",
            "--entry", "/nonexistent/entry",
            *components,
        )
    )
    starts = [line.split(":")[0] for line in lines]
    for flag in (
        "--service",  # missing
        "--template-id",  # missing
        "--profile-version",
        "--provider",
        "--supervisor-sha",
        "--onboarded-at",
        "--component BAD (name)",
        "--entry",
    ):
        assert flag in starts, (flag, lines)
    assert any("'c0' is given more than once" in line for line in lines), lines
    assert any("'novalue' is not NAME=VERSION" in line for line in lines), lines
    assert any("at most 64" in line for line in lines), lines  # the count and the names


def test_cli_without_a_build_commit_says_how_to_give_one(tmp_path: Path) -> None:
    flags = list(VALID_FLAGS)
    index = flags.index("--supervisor-sha")
    del flags[index : index + 2]
    # Not a checkout we can trust here (the repo may have uncommitted work): force "no git".
    completed = subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.daemon", "onboard-template", *flags],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={**cli_env(), "GIT_DIR": str(tmp_path / "no-such-git-dir")},
        cwd=tmp_path,
    )
    lines = problems(completed)
    assert len(lines) == 1 and lines[0].startswith("--supervisor-sha: no build commit"), lines
    assert BUILD_SHA_ENV in lines[0]


# --- the JSON file store ------------------------------------------------------------------


def test_store_upserts_by_service_and_template(tmp_path: Path) -> None:
    store = JsonFileOnboardingStore(tmp_path / "store.json")
    assert isinstance(store, OnboardingStore)
    assert store.get("my-service", "tmpl-abc123") is None
    store.upsert(record())
    store.upsert(record(templateId="tmpl-other"))
    store.upsert(record(owner={"service": "other-service", "profileVersion": 1}))
    replaced = record(components={"node": "23.0.0"}, onboardedAt="2025-02-01T00:00:00Z")
    store.upsert(replaced)
    assert store.get("my-service", "tmpl-abc123") == replaced
    assert [r.key for r in store.records()] == [
        ("my-service", "tmpl-abc123"),
        ("my-service", "tmpl-other"),
        ("other-service", "tmpl-abc123"),
    ]
    document = json.loads((tmp_path / "store.json").read_text())
    assert document["format"] == STORE_FORMAT and len(document["records"]) == 3
    assert (tmp_path / "store.json").stat().st_mode & 0o777 == 0o644


def test_cli_store_flag_upserts(tmp_path: Path) -> None:
    store_path = tmp_path / "nested" / "store.json"
    first = run_cli(*VALID_FLAGS, "--store", str(store_path))
    assert first.returncode == 0, first.stderr
    flags = list(VALID_FLAGS)
    flags[flags.index("tmpl-abc123")] = "tmpl-second"
    second = run_cli(*flags, "--store", str(store_path))
    assert second.returncode == 0, second.stderr
    store = JsonFileOnboardingStore(store_path)
    assert store.get("my-service", "tmpl-abc123") == TemplateOnboarding.model_validate_json(first.stdout)
    assert store.get("my-service", "tmpl-second") == TemplateOnboarding.model_validate_json(second.stdout)


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[]", b'{"format": "other", "records": []}', b'{"format": "%s", "records": [{}]}' % STORE_FORMAT.encode()],
)
def test_a_file_that_is_not_a_store_is_refused_and_left_alone(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "store.json"
    path.write_bytes(content)
    with pytest.raises(OnboardingStoreError):
        JsonFileOnboardingStore(path).upsert(record())
    assert path.read_bytes() == content
    completed = run_cli(*VALID_FLAGS, "--store", str(path))
    assert completed.returncode == 1
    assert completed.stderr.startswith("--store: ")
    assert path.read_bytes() == content


def test_a_store_with_a_repeated_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    good = record().model_dump(mode="json")
    text = json.dumps({"format": STORE_FORMAT, "records": [good]})
    path.write_text(text.replace('"node": "22.11.0"', '"node": "22.11.0", "node": "99"'))
    with pytest.raises(OnboardingStoreError, match="duplicate key 'node'"):
        JsonFileOnboardingStore(path).get("my-service", "tmpl-abc123")


WRITER = """
import sys
from sandbox_supervisor.protocol.onboarding import TemplateOnboarding
from sandbox_supervisor.daemon.ops.onboarding_store import JsonFileOnboardingStore
path, template_prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = TemplateOnboarding.model_validate_json(sys.argv[4])
store = JsonFileOnboardingStore(path)
for i in range(count):
    store.upsert(base.model_copy(update={"templateId": f"{template_prefix}-{i}"}))
"""


def start_writer(path: Path, prefix: str, count: int, *, script: str = WRITER) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path), prefix, str(count), record().model_dump_json()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )


def test_concurrent_upserts_lose_no_record(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    writers = [start_writer(path, f"w{n}", 10) for n in range(8)]
    for writer in writers:
        _, err = writer.communicate(timeout=CLI_TIMEOUT_S)
        assert writer.returncode == 0, err
    templates = {r.templateId for r in JsonFileOnboardingStore(path).records()}
    assert templates == {f"w{n}-{i}" for n in range(8) for i in range(10)}


def _waits_for_a_lock(pid: int) -> bool:
    """/proc/locks marks a blocked waiter with '->' before the lock type."""
    with open("/proc/locks") as locks:
        return any("->" in line and f" {pid} " in line for line in locks)


def test_an_upsert_waits_for_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    store = JsonFileOnboardingStore(path)
    store.upsert(record())
    before = path.read_bytes()
    with open(store.lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        writer = start_writer(path, "late", 1)
        # Wait until the kernel lists the writer as a blocked waiter on a lock (a fixed
        # sleep could pass with a writer that simply had not started yet).
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while not _waits_for_a_lock(writer.pid) and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.poll() is None and _waits_for_a_lock(writer.pid)
        assert path.read_bytes() == before
        fcntl.flock(lock, fcntl.LOCK_UN)
    _, err = writer.communicate(timeout=CLI_TIMEOUT_S)
    assert writer.returncode == 0, err
    assert store.get("my-service", "late-0") is not None
    assert store.get("my-service", "tmpl-abc123") is not None


# Dies between writing (and fsyncing) the temporary file and renaming it over the store.
KILLED_WRITER = """
import os, sys, time
from sandbox_supervisor.daemon.ops import onboarding_store
def stop_before_rename(src, dst):
    print(src, flush=True)
    time.sleep(600)
onboarding_store.os.replace = stop_before_rename
""" + WRITER


def test_a_writer_killed_mid_write_leaves_the_old_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    store = JsonFileOnboardingStore(path)
    store.upsert(record())
    before = path.read_bytes()
    writer = start_writer(path, "doomed", 1, script=KILLED_WRITER)
    assert writer.stdout is not None
    temp = Path(writer.stdout.readline().strip())
    try:
        # The new content is complete on disk, but only in the temporary file.
        staged = json.loads(temp.read_text())
        assert {r["templateId"] for r in staged["records"]} == {"tmpl-abc123", "doomed-0"}
        assert temp.parent == path.parent
        assert path.read_bytes() == before
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate(timeout=CLI_TIMEOUT_S)
    assert path.read_bytes() == before
    assert [r.templateId for r in store.records()] == ["tmpl-abc123"]
    # The dead writer's lock died with it, and its leftover is cleaned by the next writer.
    started = time.monotonic()
    store.upsert(record(templateId="after"))
    assert time.monotonic() - started < 5
    assert not temp.exists()
    assert {r.templateId for r in store.records()} == {"tmpl-abc123", "after"}


def test_a_store_reached_through_a_symlink_is_written_where_it_lives(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    JsonFileOnboardingStore(tmp_path / "real" / "s.json").upsert(record())
    (tmp_path / "link.json").symlink_to(tmp_path / "real" / "s.json")
    JsonFileOnboardingStore(tmp_path / "link.json").upsert(record(templateId="tmpl-other"))
    assert (tmp_path / "link.json").is_symlink()  # not replaced by the rename
    stored = JsonFileOnboardingStore(tmp_path / "real" / "s.json")
    assert [r.key for r in stored.records()] == [("my-service", "tmpl-abc123"), ("my-service", "tmpl-other")]


def test_a_store_whose_parent_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OnboardingStoreError, match="cannot open"):
        JsonFileOnboardingStore(tmp_path / "afile" / "s.json").upsert(record())


def test_a_profile_version_too_long_for_an_integer_is_a_problem_not_a_crash() -> None:
    flags = list(VALID_FLAGS)
    flags[flags.index("--profile-version") + 1] = "9" * 5000
    completed = run_cli(*flags)
    assert completed.returncode == 2, completed.stderr
    assert "Traceback" not in completed.stderr
    assert any(line.startswith("--profile-version") for line in problems(completed))
