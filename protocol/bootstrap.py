"""The `session.bootstrap` body and the rules checkable from it alone (docs/protocol.md §5.3, §6.3).

Rules that need the file system or the configuration (cwd exists inside the workspace root,
roots exist, profile allowed) are the binder's; everything here is pure.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from sandbox_supervisor.protocol.fields import (
    MAX_ENV_ENTRIES,
    MAX_PATH_CHARS,
    EnvMap,
    Id,
    StrictModel,
    optional_field,
)

__all__ = [
    "MAX_ENV_ENTRIES",
    "MAX_REPOSITORIES",
    "NORMALISED_ABSOLUTE_PATTERN",
    "PROFILE_PATTERN",
    "REPOSITORY_NAME_PATTERN",
    "AgentSpec",
    "BootstrapBody",
    "Repository",
    "bootstrap_digest",
    "is_normalised_absolute",
    "is_within",
]

MAX_REPOSITORIES = 32
PROFILE_PATTERN = r"^[a-z][a-z0-9.-]{0,63}$"  # 1-64 chars
REPOSITORY_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
# What is_normalised_absolute accepts, as an ECMA-262 regex for the exported JSON Schema
# (pydantic's own regex engine has no lookahead, so validation here uses the function and a
# test keeps the two in agreement): "/" or "/segment"+, no empty, "." or ".." segments.
NORMALISED_ABSOLUTE_PATTERN = r"^(?:/|(?:/(?!\.\.?(?:/|$))[^/\x00]+)+)$"


def is_normalised_absolute(path: str) -> bool:
    """True for "/", "/a", "/a/b"; false for relative, "//a", "/a/", "/a/./b", "/a/../b", NUL."""
    return (
        path.startswith("/")
        # POSIX lets normpath keep a leading "//" (it may mean something else); we do not.
        and not path.startswith("//")
        and "\x00" not in path
        and posixpath.normpath(path) == path
    )


def is_within(path: str, directory: str) -> bool:
    """`path` equals `directory` or lies under it, by whole components ("/a/bc" is not in "/a/b").

    Both must be normalised absolute paths; this is text only (symlinks are the jail's job).
    """
    if directory == "/":
        return path.startswith("/")
    return path == directory or path.startswith(directory + "/")


def _check_normalised_absolute(path: str) -> str:
    if not is_normalised_absolute(path):
        raise ValueError("must be an absolute, normalised path")
    return path


AbsolutePath = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_PATH_CHARS),
    AfterValidator(_check_normalised_absolute),
    Field(json_schema_extra={"pattern": NORMALISED_ABSOLUTE_PATTERN}),
]


class AgentSpec(StrictModel):
    cwd: AbsolutePath
    profile: Annotated[str, StringConstraints(pattern=PROFILE_PATTERN)]
    env: EnvMap | None = optional_field()


class Repository(StrictModel):
    name: Annotated[str, StringConstraints(pattern=REPOSITORY_NAME_PATTERN)]
    root: AbsolutePath


class BootstrapBody(StrictModel):
    """Every repositories[i].root equals agent.cwd or lies under agent.cwd + "/"."""

    sessionId: Id  # camelCase: the wire name of the session frames (§6.1), used as is in code
    agent: AgentSpec
    # Required, as in the seed's closed schema: a body without it is refused like any body
    # that does not match its schema (docs/protocol.md §5.2, §6.2); `[]` says "none".
    repositories: Annotated[list[Repository], Field(max_length=MAX_REPOSITORIES)]

    @model_validator(mode="after")
    def _roots_under_cwd(self) -> BootstrapBody:
        for index, repository in enumerate(self.repositories):
            if not is_within(repository.root, self.agent.cwd):
                raise ValueError(f"repositories[{index}].root is not agent.cwd or under it")
        return self


def bootstrap_digest(body: BootstrapBody) -> str:
    """SHA-256 hex of the canonical body; equal digests mean "the same bootstrap".

    Canonical form (keep it stable: it is persisted with the binding and compared after
    restarts): `body.model_dump(mode="json")`, so an absent or null `env` is left out, serialised by `json.dumps`
    with sorted keys, separators (",", ":") and ensure_ascii=False, encoded as UTF-8.
    Repository order is kept: it is part of what the client said.
    """
    canonical = json.dumps(
        body.model_dump(mode="json"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    # surrogatepass: total even for a Python str with a lone surrogate (JSON input cannot
    # carry one, the frame parser refuses it).
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
