"""Exception-group unwrapping for context managers that yield inside a trio nursery.

Trio wraps whatever the `with` body raises in an ExceptionGroup when the body runs inside
a nursery; callers of our context managers expect the exception they raised themselves.
"""

from __future__ import annotations

import trio


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    """The one meaningful exception of a group (Cancelled aside), or None if there are more."""
    meaningful = [leaf for leaf in leaves(group) if not isinstance(leaf, trio.Cancelled)]
    return meaningful[0] if len(meaningful) == 1 else None
