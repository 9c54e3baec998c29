"""Whose idempotency key a call claims (docs/protocol.md §8), as pure values.

A key is unique within a *key space*. The sockets that hold `session:control` (the control
plane's own) share one space, the owner's: their keys mean what they always meant. A socket
without it (a delegated assertion) claims keys in a space of its own, named by a fingerprint
of what its assertion allows. So a delegated socket can neither decide the control plane's
next call by claiming its key first (its refusal would be replayed in place of the real
call), nor learn whether a key was used. Two delegated assertions with the same bounds share
a space (a party that reconnects with a new assertion keeps its keys), so two parties given
the very same bounds can decide each other's keyed calls: a control plane that must keep
them apart gives them different bounds. Paths are compared normalised (`src`, `./src` and
`src/` are one path), as the jail resolves them.

The same split bounds retention: records of delegated spaces are forgotten before the
owner's (store.py), so keyed calls of a delegated socket never push the control plane's
records out of the budget.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterable
from typing import NamedTuple

from sandbox_supervisor.protocol.fields import SESSION_CONTROL

# The space of the control plane's own sockets (and of every record written before spaces
# existed): stored as the empty string, so old rows need no rewriting to mean the same.
OWNER_SPACE = ""
_DELEGATED_PREFIX = "delegated:"
# The space of records claimed before key spaces existed (schema 4 and older): whose they
# were is not recorded (a delegated socket's or the control plane's), so every space finds
# them. No new record is ever claimed in it, so it cannot be used to squat; it empties as
# retention forgets its records.
LEGACY_SPACE = "legacy:"


class CallKey(NamedTuple):
    """An idempotency key as stored: its space and the key the client sent (the wire key,
    echoed as `idempotency_key` unchanged)."""

    space: str
    key: str


def owner_key(key: str) -> CallKey:
    return CallKey(OWNER_SPACE, key)


def key_space(
    scopes: Iterable[str], allowed_paths: Iterable[str] | None, allowed_commands: Iterable[str] | None
) -> str:
    """The key space of a socket with these scopes (claimed and granted) and limits: the
    owner's with `session:control`, else a fingerprint of the bounds (order and repeats do
    not matter; None, no limit, differs from every list)."""
    scopes = frozenset(scopes)
    if SESSION_CONTROL in scopes:
        return OWNER_SPACE
    bounds = {
        "scope": sorted(scopes),
        "allowed_paths": None if allowed_paths is None else sorted({posixpath.normpath(p) for p in allowed_paths}),
        "allowed_commands": None if allowed_commands is None else sorted(set(allowed_commands)),
    }
    text = json.dumps(bounds, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return _DELEGATED_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()
