"""`onboard-template`: compute, validate and print (and optionally store) the template
onboarding record (protocol.onboarding.TemplateOnboarding).

Run it inside the built template (the last step of the image build, or in a sandbox started
from it): the hashes describe the supervisor *installed there*.

What is computed, and from what:
- `supervisorEntrySha256`: sha256 of the console script `sandbox-supervisor` of the running
  interpreter's environment (`sysconfig` "scripts" dir), the file the unit's ExecStart runs.
  It pins the interpreter path and the entry function. `--entry FILE` hashes another file.
- `runtimeHash`: sha256 over the distribution's own files, the Python implementation and
  version, and the installed versions of every dependency (transitively, extras excluded).
  "Own files" (shipped.py has the details): for a wheel install, the files its RECORD lists
  under `sandbox_supervisor/` (bytecode caches excluded), so a file dropped into a package
  directory changes nothing while a changed shipped file changes the hash; for an editable
  install, whose RECORD lists only an import hook, the files a wheel built from the checkout
  would contain (each package's `*.py`, plus pyproject.toml's package-data: `py.typed`, the
  schemas, the units), so scratch files and caches in the checkout do not count but a new
  module does. Either way a file is named by its install path, so a wheel and an editable
  install of the same code hash alike. The distribution is the one that holds the packages
  Python imports (never an egg-info a build left in the working directory).
- `supervisor.version`: the installed distribution's version.
- `supervisor.sha`: the commit the supervisor was built from, recorded at build time:
  `--supervisor-sha`, else $SUPERVISOR_BUILD_SHA (set it in the image build), else,
  when the package is a git checkout with no uncommitted changes to tracked files,
  `git rev-parse HEAD` there. Otherwise it is a problem to fix, not a guess.
- `onboardedAt`: now (UTC), unless `--onboarded-at` is given.
The owner, the template id and the components come from flags.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from sandbox_supervisor.protocol.onboarding import (
    MAX_COMPONENTS,
    ComponentName,
    ComponentVersion,
    TemplateOnboarding,
    format_utc,
)
from sandbox_supervisor.daemon.version import DISTRIBUTION, installed_version
from sandbox_supervisor.daemon.ops.shipped import (  # noqa: F401 - RUNTIME_PACKAGES re-exported
    RUNTIME_PACKAGES,
    ShippedFilesError,
    installed_files,
)
from sandbox_supervisor.daemon.ops.onboarding_store import (  # noqa: F401 - re-exported: the store API lives here too
    JsonFileOnboardingStore,
    OnboardingStore,
    OnboardingStoreError,
)

CONSOLE_SCRIPT = "sandbox-supervisor"
# Not SANDBOX_SUPERVISOR_…: every variable of that prefix is a config override, and an
# unknown one is an error (check-config and serve in the image would refuse to start).
BUILD_SHA_ENV = "SUPERVISOR_BUILD_SHA"
# Versioned so that a change to what is hashed is a visible change of format, not a mystery.
# 2: the distribution's own files (shipped.py), named by install path, units included.
RUNTIME_HASH_FORMAT = "sandbox-supervisor-runtime-hash/2"
RUNTIME_HASH_WHERE = "(runtime hash)"
HASH_CHUNK_BYTES = 1024 * 1024
GIT_TIMEOUT_S = 10
COMPONENT_SEPARATOR = "="
# Problems echo the offending value, cut to this many characters.
MAX_SHOWN_INPUT_CHARS = 80
STAND_IN_SHA1 = "0" * 40
STAND_IN_SHA256 = "0" * 64

EXIT_OK = 0
EXIT_STORE_FAILED = 1
EXIT_BAD_INPUT = 2

# Model field location -> the flag that sets it, so a problem names what the user typed.
FLAG_FOR_FIELD = {
    "owner.service": "--service",
    "owner.profileVersion": "--profile-version",
    "provider": "--provider",
    "templateId": "--template-id",
    "supervisor.version": "(installed version)",
    "supervisor.sha": "--supervisor-sha",
    "supervisorEntrySha256": "--entry",
    "runtimeHash": RUNTIME_HASH_WHERE,
    "components": "--component",
    "onboardedAt": "--onboarded-at",
}

_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")
_GIT_SHA = re.compile(r"^[0-9a-f]{40}$")

Problem = tuple[str, str]


class OnboardingInputError(Exception):
    """Every problem found, each as (flag or field, message)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{where}: {what}" for where, what in problems))


# --- hashing -------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def runtime_hash(
    files: Mapping[str, Path],
    *,
    python_version: str,
    dependencies: Mapping[str, str],
) -> str:
    """sha256 over the canonical description of a runtime: one JSON array per line —
    the format marker, the Python version, each dependency (sorted by name) and each file
    (sorted by name, `sandbox_supervisor/daemon/app.py`) with the sha256 of its content.
    JSON keeps a name containing a newline or a space from being read as two fields."""
    lines: list[Any] = [["format", RUNTIME_HASH_FORMAT], ["python", python_version]]
    lines += [["dependency", name, dependencies[name]] for name in sorted(dependencies)]
    for name in sorted(files):
        try:
            lines.append(["file", name, sha256_file(files[name])])
        except OSError as exc:
            # RECORD lists it, so the install is damaged: a record would describe other code.
            raise OnboardingInputError(
                [(RUNTIME_HASH_WHERE, f"cannot read {files[name]}, a file of the installed distribution: {exc.strerror}")]
            ) from exc
    digest = hashlib.sha256()
    for line in lines:
        digest.update(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def python_version() -> str:
    return f"{platform.python_implementation()} {platform.python_version()}"


def package_directories(names: Iterable[str] = RUNTIME_PACKAGES) -> dict[str, Path]:
    """Where each package is imported from (its first search location)."""
    found: dict[str, Path] = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise OnboardingInputError([(f"(package {name})", "not importable as a package")])
        found[name] = Path(list(spec.submodule_search_locations)[0])
    return found


def normalise_name(name: str) -> str:
    # PEP 503: "Pydantic_Core" and "pydantic-core" are one distribution.
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_versions(distribution: str = DISTRIBUTION) -> dict[str, str]:
    """name -> installed version of every runtime dependency, transitively. Requirements
    that apply only to an extra (test tools) are left out; a requirement whose distribution is
    not installed (its environment marker excluded it) is skipped."""
    versions: dict[str, str] = {}
    pending = list(metadata.requires(distribution) or [])
    while pending:
        requirement = pending.pop()
        name_match = _REQUIREMENT_NAME.match(requirement)
        _, _, marker = requirement.partition(";")
        if name_match is None or "extra" in marker:
            continue
        name = normalise_name(name_match.group(1))
        if name in versions:
            continue
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        pending.extend(metadata.requires(name) or [])
    return versions


def installed_runtime_hash() -> str:
    try:
        files = installed_files()
    except ShippedFilesError as exc:
        raise OnboardingInputError([(RUNTIME_HASH_WHERE, str(exc))]) from exc
    return runtime_hash(files, python_version=python_version(), dependencies=dependency_versions())


def entry_point_path() -> Path:
    """The console script of the running interpreter's environment (what ExecStart runs)."""
    return Path(sysconfig.get_path("scripts")) / CONSOLE_SCRIPT


def record_version() -> str:
    # "" when the metadata is missing: refused by the model, a record needs a real version.
    return installed_version() or ""


def build_sha(
    flag: str | None,
    env: Mapping[str, str] = os.environ,
    source_dir: Path | None = None,
) -> tuple[str | None, str]:
    """(commit, where it came from). The commit is None when no source has one."""
    if flag is not None:
        return flag, "--supervisor-sha"
    if env.get(BUILD_SHA_ENV):
        return env[BUILD_SHA_ENV], BUILD_SHA_ENV
    if source_dir is None:
        source_dir = package_directories(["sandbox_supervisor.daemon"])["sandbox_supervisor.daemon"]
    return git_head(source_dir), "git"


def git_head(directory: Path) -> str | None:
    """HEAD of the git checkout holding `directory`, or None when it is not one, or when
    tracked files have uncommitted changes (HEAD would then not describe the code)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(directory), *args],
                capture_output=True,
                text=True,
                timeout=GIT_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None or not _GIT_SHA.match(head):
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    if status is None or status:
        return None
    return head


# --- the record ----------------------------------------------------------------------------


def parse_components(entries: Iterable[str]) -> tuple[dict[str, str], list[Problem]]:
    """NAME=VERSION entries -> mapping; malformed and repeated names are problems (a JSON
    object cannot carry a name twice, and silently keeping one would hide a typo)."""
    components: dict[str, str] = {}
    problems: list[Problem] = []
    for entry in entries:
        name, sep, version = entry.partition(COMPONENT_SEPARATOR)
        if not sep:
            problems.append(("--component", f"{entry!r} is not NAME=VERSION"))
        elif name in components:
            problems.append(("--component", f"{name!r} is given more than once"))
        else:
            components[name] = version
    return components, problems


_COMPONENT_ENTRIES = TypeAdapter(dict[ComponentName, ComponentVersion])


def validate_record(data: Mapping[str, Any]) -> TemplateOnboarding:
    """The record, or OnboardingInputError naming every problem with its flag."""
    try:
        return TemplateOnboarding.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(error) for error in exc.errors()]
    components = data.get("components")
    if isinstance(components, dict) and len(components) > MAX_COMPONENTS:
        # pydantic stops at the count; check the entries too, so every problem is reported.
        try:
            _COMPONENT_ENTRIES.validate_python(components)
        except ValidationError as exc:
            problems += [_describe(error, prefix=("components",)) for error in exc.errors()]
    raise OnboardingInputError(problems)


def _describe(error: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Problem:
    loc = prefix + tuple(str(part) for part in error["loc"])
    # Nested objects are named by their field (owner.service), the rest by the top key.
    depth = 2 if loc[:1] in (("owner",), ("supervisor",)) else 1
    field = ".".join(loc[:depth])
    where = FLAG_FOR_FIELD.get(field, field or "(record)")
    if loc[:1] == ("components",) and len(loc) > 1:
        # loc is ("components", name) or ("components", name, "[key]") for the name itself.
        what = "name" if loc[-1] == "[key]" else "version"
        where = f"--component {loc[1]} ({what})"
    if error["type"] == "missing":
        return where, "required"
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    value = error.get("input")
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        shown = repr(value)
        message += f" (got {shown[:MAX_SHOWN_INPUT_CHARS]}{'…' if len(shown) > MAX_SHOWN_INPUT_CHARS else ''})"
    return where, message


def build_record(
    *,
    service: str | None,
    profile_version: str | None,
    template_id: str | None,
    provider: str,
    components: Iterable[str],
    supervisor_sha: str | None,
    entry: Path | None,
    onboarded_at: str | None,
    env: Mapping[str, str] = os.environ,
    now: datetime | None = None,
) -> TemplateOnboarding:
    """Compute what can be computed, take the rest from the arguments, validate everything.
    Raises OnboardingInputError with every problem found."""
    problems: list[Problem] = []
    parsed_components, component_problems = parse_components(components)
    problems += component_problems

    entry_path = entry if entry is not None else entry_point_path()
    try:
        entry_sha = sha256_file(entry_path)
    except OSError as exc:
        entry_sha = None
        problems.append(("--entry", f"cannot read the entry point {entry_path}: {exc.strerror}"))

    sha, source = build_sha(supervisor_sha, env)
    if sha is None:
        problems.append(
            (
                "--supervisor-sha",
                f"no build commit: pass --supervisor-sha or set {BUILD_SHA_ENV} "
                "(a git checkout counts only without uncommitted changes)",
            )
        )

    try:
        runtime = installed_runtime_hash()
    except OnboardingInputError as exc:
        problems += exc.problems
        runtime = None

    # A value that could not be computed is already a problem above; a well-formed stand-in
    # keeps the model from reporting it a second time while it checks everything else.
    # Flags not given are left out, so the model reports them as "required" under their flag.
    owner = {"service": service, "profileVersion": _integer(profile_version)}
    data: dict[str, Any] = {
        "owner": {key: value for key, value in owner.items() if value is not None},
        "provider": provider,
        "templateId": template_id,
        "supervisor": {"version": record_version(), "sha": sha or STAND_IN_SHA1},
        "supervisorEntrySha256": entry_sha or STAND_IN_SHA256,
        "runtimeHash": runtime or STAND_IN_SHA256,
        "components": parsed_components,
        "onboardedAt": onboarded_at
        if onboarded_at is not None
        else format_utc(now or datetime.now(timezone.utc)),
    }
    data = {key: value for key, value in data.items() if value is not None}
    try:
        record = validate_record(data)
    except OnboardingInputError as exc:
        problems += exc.problems
        record = None
    if problems:
        raise OnboardingInputError(problems)
    assert record is not None
    return record


# Past this the text goes to the model as text (and is refused as not an integer) instead
# of to int(), which raises for more than 4,300 digits.
MAX_INTEGER_DIGITS = 18


def _integer(text: str | None) -> int | str | None:
    # Strict model: hand it an int when the text is plainly one, else the text, so that the
    # problem ("Input should be a valid integer") is reported by the model like any other.
    if text is not None and text.isascii() and text.isdigit() and len(text) <= MAX_INTEGER_DIGITS:
        return int(text)
    return text


# --- the command ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The onboard-template flags. None is required by argparse: missing ones are reported
    together with every other problem."""
    parser.add_argument("--service", metavar="NAME", help="owning service (profile name syntax)")
    parser.add_argument("--profile-version", metavar="N", help="owner's profile version (>= 1)")
    parser.add_argument("--template-id", metavar="ID", help="the E2B template id")
    parser.add_argument("--provider", default="e2b", metavar="P", help="sandbox provider (e2b)")
    parser.add_argument(
        "--component",
        action="append",
        default=[],
        metavar="NAME=VERSION",
        help=f"a versioned component of the template (repeatable, at most {MAX_COMPONENTS})",
    )
    parser.add_argument(
        "--supervisor-sha",
        metavar="SHA",
        help=f"40-hex commit the supervisor was built from (default: ${BUILD_SHA_ENV}, "
        "or git HEAD of a clean checkout)",
    )
    parser.add_argument(
        "--entry", type=Path, metavar="FILE", help="entry point to hash (default: the console script)"
    )
    parser.add_argument("--onboarded-at", metavar="RFC3339", help="UTC timestamp (default: now)")
    parser.add_argument("--store", type=Path, metavar="FILE", help="upsert the record into this JSON store")


def run(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> int:
    try:
        record = build_record(
            service=args.service,
            profile_version=args.profile_version,
            template_id=args.template_id,
            provider=args.provider,
            components=args.component,
            supervisor_sha=args.supervisor_sha,
            entry=args.entry,
            onboarded_at=args.onboarded_at,
            env=env,
        )
    except OnboardingInputError as exc:
        for where, what in exc.problems:
            print(f"{where}: {what}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.store is not None:
        try:
            JsonFileOnboardingStore(args.store).upsert(record)
        except OnboardingStoreError as exc:
            print(f"--store: {exc}", file=sys.stderr)
            return EXIT_STORE_FAILED
    print(record.model_dump_json(indent=2))
    return EXIT_OK
