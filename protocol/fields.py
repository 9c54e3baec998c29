"""Field types and the base model shared by every schema of the protocol.

Kept apart so that frames, bootstrap, tools and authority agree on one definition of an id,
a uuid, a seq or an environment map instead of each spelling its own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeGuard, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from sandbox_supervisor.protocol.headers import ID_PATTERN, MAX_SAFE_INTEGER
# Defined in plain.py (stdlib only, for code that must not import pydantic), re-exported here
# so that the rest of the protocol keeps importing its fields from one module.
from sandbox_supervisor.protocol.plain import STREAMS as STREAMS
from sandbox_supervisor.protocol.plain import UUID_PATTERN as UUID_PATTERN
from sandbox_supervisor.protocol.plain import Stream as Stream


class StrictModel(BaseModel):
    """Closed (unknown field = error), strict (no coercion: `true` is not 1) and immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _is_none(value: object) -> bool:
    return value is None


def optional_field() -> Any:
    """A field the spec marks optional: None by default and then absent from the JSON
    (not `"x": null`), so what we send matches what the spec shows.

    Typed Any as pydantic's own Field() is: it stands as the default of a field of any type."""
    return Field(default=None, exclude_if=_is_none)


ENV_NAME_PATTERN = r"^[A-Z_][A-Z0-9_]*$"
MAX_ENV_ENTRIES = 64
# Longest path accepted anywhere in the protocol (Linux PATH_MAX).
MAX_PATH_CHARS = 4096
MAX_IDEMPOTENCY_KEY_CHARS = 128

Id = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
CallId = Annotated[str, StringConstraints(pattern=UUID_PATTERN)]
IdempotencyKey = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS)
]

# A journaled event's seq: dense from 1.
Seq = Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER)]
# Ack floors, offsets, byte counts: 0 is meaningful.
Count = Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)]
Generation = Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER)]

Scope = Literal["files:read", "files:write", "shell:exec", "session:control"]
# The scope of the session itself, not of a tool (docs/protocol.md §3.2): binding the session
# (and so rebinding it, which terminates the sandbox) and pruning the journal with events.ack.
# The control plane grants it to its own sessions; a delegated assertion goes without.
SESSION_CONTROL: Literal["session:control"] = "session:control"


def is_scope(value: str) -> TypeGuard[Scope]:
    return value in get_args(Scope)




# A NUL cannot reach the OS (paths, argv, environ); refusing it in the schema turns a later
# ValueError deep in a spawn or an open() into a clean invalid-input answer. A pattern rather
# than a Python validator, so the exported JSON Schema says it too.
NO_NUL_PATTERN = r"^[^\x00]*$"

NoNulText = Annotated[str, StringConstraints(pattern=NO_NUL_PATTERN)]
RelativePath = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS, pattern=NO_NUL_PATTERN)
]
EnvName = Annotated[str, StringConstraints(pattern=ENV_NAME_PATTERN)]
EnvMap = Annotated[
    dict[EnvName, NoNulText],
    # pydantic exports the name rule as patternProperties only; without this a JSON Schema
    # validator elsewhere would let a lower-case name through that the model refuses.
    Field(max_length=MAX_ENV_ENTRIES, json_schema_extra={"additionalProperties": False}),
]
