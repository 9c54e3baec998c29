"""Write constraints.txt: the installed version of every runtime dependency of
sandbox-supervisor, transitively (the `test` extra and requirements whose environment marker
does not hold here left out), so that image builds install exactly what was tested.

Run it with the interpreter of an environment where the project is installed, e.g. the
README's test install (which provides `packaging`, used to evaluate markers):

    .venv/bin/python scripts/write_constraints.py

It pins what is installed now; to take newer releases, recreate that environment first
(`rm -rf .venv`, then the README's install command) and run it again.
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DISTRIBUTION = "sandbox-supervisor"
OUTPUT = Path(__file__).resolve().parents[1] / "constraints.txt"
HEADER = """\
# Exact versions of every runtime dependency of sandbox-supervisor, transitively (the [test]
# extra is not pinned), for reproducible image builds (docs/operations.md, "Installing into
# a sandbox image"):
#     pip install -c constraints.txt sandbox_supervisor-*.whl
# Written by scripts/write_constraints.py from the packages installed where it ran
# ({python}, {system}). Regenerate after changing the dependencies in pyproject.toml,
# or, to take newer releases, after recreating .venv with the README's install command:
#     .venv/bin/python scripts/write_constraints.py
"""


def runtime_closure(distribution: str = DISTRIBUTION) -> dict[str, str]:
    """Canonical name -> installed version of every requirement the distribution needs at
    run time here, transitively."""
    versions: dict[str, str] = {}
    pending = [Requirement(text) for text in metadata.requires(distribution) or []]
    while pending:
        requirement = pending.pop()
        # An empty extra: requirements of an extra (ours or a dependency's) do not apply.
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in versions:
            continue
        versions[name] = metadata.version(name)  # a missing one is a broken environment: raise
        pending += [Requirement(text) for text in metadata.requires(name) or []]
    return versions


def render(versions: dict[str, str]) -> str:
    header = HEADER.format(
        python=f"{platform.python_implementation()} {platform.python_version()}",
        system=f"{platform.system()} {platform.machine()}",
    )
    return header + "".join(f"{name}=={versions[name]}\n" for name in sorted(versions))


def main() -> int:
    OUTPUT.write_text(render(runtime_closure()))
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
