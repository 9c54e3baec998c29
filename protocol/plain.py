"""The protocol's definitions that need nothing beyond the standard library.

`fields.py` re-exports them beside its pydantic types; they live here so that code which must
not import pydantic (the spool writer, which the per-process holder shares with the daemon)
uses the same single definition.
"""

from __future__ import annotations

from typing import Literal, get_args

# Canonical RFC 4122 text form. Other spellings uuid.UUID accepts ("{…}", "urn:uuid:…", no
# hyphens) are refused so that a call_id has exactly one textual form: it is kept as given
# and compared as text (idempotency records, exec.signal lookups).
UUID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"

Stream = Literal["stdout", "stderr"]
# A command's output streams, in the order results and the spool list them; derived from
# `Stream` so that the type and the iteration can never disagree.
STREAMS: tuple[Stream, ...] = get_args(Stream)
