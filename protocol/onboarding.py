"""The template onboarding record: immutable provenance a service keeps for each E2B template
it onboards (docs/operations.md, "Onboarding the template").

The owning service persists it; there is deliberately no global template registry. Records are
keyed by (owner.service, templateId): onboarding the same template again replaces the record.
Everything here is pure; computing the hashes and storing records is `supervisor.onboarding`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints

from sandbox_supervisor.protocol.bootstrap import PROFILE_PATTERN
from sandbox_supervisor.protocol.fields import StrictModel
from sandbox_supervisor.protocol.headers import MAX_SAFE_INTEGER
from sandbox_supervisor.protocol.tools import GIT_SHA_PATTERN

__all__ = [
    "COMPONENT_NAME_PATTERN",
    "MAX_COMPONENTS",
    "SHA256_PATTERN",
    "OnboardingOwner",
    "SupervisorBuild",
    "TemplateOnboarding",
    "format_utc",
]

MAX_COMPONENTS = 64
SHA256_PATTERN = r"^[0-9a-f]{64}$"
COMPONENT_NAME_PATTERN = r"^[a-z][a-z0-9.-]{0,63}$"  # 1-64 chars
MAX_COMPONENT_VERSION_CHARS = 256
MAX_VERSION_CHARS = 256
MAX_TEMPLATE_ID_CHARS = 512
# RFC 3339 in UTC with a "Z" (no offsets: one spelling per instant), seconds required,
# fractions up to nanoseconds.
UTC_TIMESTAMP_PATTERN = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?Z$"
)
# Printed in errors and logs: no control characters.
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f]+$"

Sha256Hex = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]
ComponentName = Annotated[str, StringConstraints(pattern=COMPONENT_NAME_PATTERN)]
ComponentVersion = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=MAX_COMPONENT_VERSION_CHARS, pattern=PRINTABLE_PATTERN
    ),
]


def _check_calendar(value: str) -> str:
    # The pattern fixes the shape; this refuses dates that do not exist (2025-02-30, 25:00).
    try:
        datetime.strptime(value[:19], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise ValueError("not a real date and time") from None
    return value


UtcTimestamp = Annotated[
    str,
    StringConstraints(pattern=UTC_TIMESTAMP_PATTERN),
    AfterValidator(_check_calendar),
    Field(json_schema_extra={"format": "date-time"}),
]


def format_utc(moment: datetime) -> str:
    """An aware datetime as the record's timestamp form: 2025-01-31T12:00:00.123456Z."""
    if moment.tzinfo is None:
        raise ValueError("the time must be timezone-aware")
    text = moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")
    return text.rstrip("0").rstrip(".") + "Z"


class OnboardingOwner(StrictModel):
    """The service that owns the template, and the version of its session profile."""

    service: Annotated[str, StringConstraints(pattern=PROFILE_PATTERN)]
    profileVersion: Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER)]


class SupervisorBuild(StrictModel):
    """The supervisor installed in the template: its version and the commit it was built from."""

    version: Annotated[
        str, StringConstraints(min_length=1, max_length=MAX_VERSION_CHARS, pattern=PRINTABLE_PATTERN)
    ]
    sha: Annotated[str, StringConstraints(pattern=GIT_SHA_PATTERN)]


class TemplateOnboarding(StrictModel):
    owner: OnboardingOwner
    provider: Literal["e2b"]
    templateId: Annotated[
        str,
        StringConstraints(
            min_length=1, max_length=MAX_TEMPLATE_ID_CHARS, pattern=PRINTABLE_PATTERN
        ),
    ]
    supervisor: SupervisorBuild
    # sha256 of the entry point systemd runs (supervisor.onboarding.entry_point_path).
    supervisorEntrySha256: Sha256Hex
    # sha256 over the installed code, the Python version and the dependency versions
    # (supervisor.onboarding.runtime_hash).
    runtimeHash: Sha256Hex
    # name -> version of the other things baked into the template (toolchains, agents).
    components: Annotated[
        dict[ComponentName, ComponentVersion],
        # A JSON object cannot repeat a name; as in protocol.fields.EnvMap, say in the schema
        # that names outside the pattern are refused, not merely unconstrained.
        Field(max_length=MAX_COMPONENTS, json_schema_extra={"additionalProperties": False}),
    ]
    onboardedAt: UtcTimestamp

    @property
    def key(self) -> tuple[str, str]:
        """What a store upserts by: one record per (service, template)."""
        return (self.owner.service, self.templateId)
