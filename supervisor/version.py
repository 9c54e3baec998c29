"""The distribution's name and installed version, read from its metadata (never a second copy
in code): for `--version`, `/healthz` and runtime.state, and the onboarding record."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "sandbox-supervisor"
# Shown by --version, /healthz and runtime.state when the package metadata is missing (run
# from a source tree that was never installed).
UNKNOWN_VERSION = "0+unknown"


def installed_version() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
