"""The guard's one quoting scanner (supervisor/runtime/guard.py `_scan`), as tables.

Three questions once had a scanner each: which characters the shell may still expand, where
a backslash-newline joins lines, and whether a command name is expanded at all. They now
share one state machine; these rows pin its edges (a quote of one kind inside the other, a
backslash in each state and at the very end, here-document bodies where quotes are text),
first on the scanner, then through `simple_command_names`, which tests/test_guard.py covers
for everything else.
"""

from __future__ import annotations

import pytest

from sandbox_supervisor.daemon.runtime.guard import (
    GuardRefusal,
    _expands,
    _join_continuations,
    _live_characters,
    _Role,
    _scan,
    simple_command_names,
)

L, E, Q = _Role.LIVE, _Role.ESCAPED, _Role.QUOTED
D, S = '"', "'"

SCAN_ROWS = [
    # raw, quotes, units (start, role, quote)
    pytest.param("a'b'c", True, [(0, L, None), (1, L, None), (2, Q, S), (3, Q, S), (4, L, None)], id="single-quotes"),
    pytest.param('"a\'b"', True, [(0, L, None), (1, L, D), (2, L, D), (3, L, D), (4, L, D)], id="single-inside-double-is-live"),
    pytest.param("'a\"b'", True, [(0, L, None), (1, Q, S), (2, Q, S), (3, Q, S), (4, Q, S)], id="double-inside-single-is-text"),
    pytest.param("\\'a", True, [(0, E, None), (2, L, None)], id="escaped-quote-opens-nothing"),
    pytest.param("'\\'", True, [(0, L, None), (1, Q, S), (2, Q, S)], id="backslash-in-single-quotes-is-text"),
    pytest.param('"\\""', True, [(0, L, None), (1, E, D), (3, L, D)], id="escaped-double-quote-inside-double"),
    pytest.param("a\\", True, [(0, L, None), (1, E, None)], id="backslash-at-the-end"),
    pytest.param("'$x'", False, [(0, L, None), (1, L, None), (2, L, None), (3, L, None)], id="heredoc-quotes-are-text"),
    pytest.param("\\$x", False, [(0, E, None), (2, L, None)], id="heredoc-backslash-still-escapes"),
    pytest.param("", True, [], id="empty"),
]


@pytest.mark.parametrize("raw, quotes, units", SCAN_ROWS)
def test_scan(raw: str, quotes: bool, units: list[tuple[int, _Role, str | None]]) -> None:
    assert list(_scan(raw, quotes=quotes)) == units


def test_the_units_cover_the_text_once_in_order() -> None:
    # Every character belongs to exactly one unit: two for an escape pair, else one.
    for raw in ["a'b\\'c\"d\\\"e'f", "\\\\\\", "'''\"\"\"", "x\\\ny'\\\n'\"\\\n\""]:
        for quotes in (True, False):
            position = 0
            for start, role, _ in _scan(raw, quotes=quotes):
                assert start == position
                position += min(2, len(raw) - start) if role is E else 1
            assert position == len(raw)


LIVE_ROWS = [
    # raw, in_heredoc, live (index, quote)
    pytest.param("$'x'", False, [(0, None), (1, None)], id="ansi-c-opening"),
    pytest.param('"$\'"', False, [(0, None), (1, D), (2, D), (3, D)], id="dollar-quote-inside-double"),
    pytest.param("\\$(", False, [(2, None)], id="escaped-dollar"),
    pytest.param("'$('", True, [(0, None), (1, None), (2, None), (3, None)], id="heredoc-single-quotes-do-not-hide"),
]


@pytest.mark.parametrize("raw, in_heredoc, live", LIVE_ROWS)
def test_live_characters(raw: str, in_heredoc: bool, live: list[tuple[int, str | None]]) -> None:
    assert list(_live_characters(raw, in_heredoc=in_heredoc)) == live


JOIN_ROWS = [
    # raw, quotes, joined
    pytest.param("ma\\\nke", True, "make", id="bare"),
    pytest.param('"ma\\\nke"', True, '"make"', id="in-double-quotes"),
    pytest.param("'ma\\\nke'", True, "'ma\\\nke'", id="kept-in-single-quotes"),
    pytest.param("'ma\\\nke'", False, "'make'", id="heredoc-single-quotes-are-text"),
    pytest.param("a\\\\\nb", True, "a\\\\\nb", id="escaped-backslash-then-newline"),
    pytest.param("a\\", True, "a\\", id="backslash-at-the-end-stays"),
    pytest.param("\\\n\\\n", True, "", id="only-continuations"),
    pytest.param("'a'\\\n'b'", True, "'a''b'", id="between-single-quotes"),
]


@pytest.mark.parametrize("raw, quotes, joined", JOIN_ROWS)
def test_join_continuations(raw: str, quotes: bool, joined: str) -> None:
    assert _join_continuations(raw, quotes=quotes) == joined


EXPANDS_ROWS = [
    ("$x", True),
    ("'$x'", False),
    ('"$x"', True),
    ("\\$x", False),
    ('"\'"$x', True),  # a single quote inside double quotes opens nothing
    ("'\"'$x", True),  # a double quote inside single quotes opens nothing
    ("*", True),
    ("'*'", False),
    ('"*"', False),
    ("\\*", False),
    ("[a]", True),
    ("[a", False),
    ("'['a]", False),  # the bracket is quoted
    ("[a']'", True),  # an unquoted bracket with a "]" anywhere after it, quoted or not: refuse
    ("{a,b}", True),
    ("'{a,b}'", False),
    ("\\{a,b}", False),
    ("make", False),
]


@pytest.mark.parametrize("raw, expands", EXPANDS_ROWS)
def test_expands(raw: str, expands: bool) -> None:
    assert _expands(raw) is expands


# --- the same edges, through the guard ----------------------------------------------------

NAMED = [
    pytest.param("echo \"it's\"; rm x", ["echo", "rm"], id="single-quote-inside-double"),
    pytest.param("echo 'a\\'; rm x", ["echo", "rm"], id="backslash-does-not-escape-in-single-quotes"),
    pytest.param('echo "\\`rm x\\`"', ["echo"], id="escaped-backticks-in-double-quotes"),
    pytest.param('"ma\\\nke" test', ["make"], id="continuation-inside-double-quotes"),
    pytest.param("'ma\\\nke' test", ["ma\\\nke"], id="no-continuation-inside-single-quotes"),
    pytest.param("cat <<EOF\n\\$(rm x)\nEOF", ["cat"], id="heredoc-escaped-substitution"),
    pytest.param("cat <<EOF\n$'x'\nEOF", ["cat"], id="heredoc-dollar-quote-is-text"),
    pytest.param("cat <<EOF\n$\\\n(rm x)\nEOF\n", None, id="heredoc-continuation-joins-a-substitution"),
    pytest.param("cat <<EOF\n'$(rm x)'\nEOF", None, id="heredoc-single-quotes-hide-nothing"),
    pytest.param('echo "a\\"`rm x`"', None, id="live-backtick-after-escaped-quote"),
    pytest.param("'*' x", ["*"], id="quoted-glob-name"),
    pytest.param("\\* x", ["*"], id="escaped-glob-name"),
    pytest.param("'\"'$X", None, id="dollar-after-single-quoted-double-quote"),
]


@pytest.mark.parametrize("command, names", NAMED)
def test_the_edges_through_the_guard(command: str, names: list[str] | None) -> None:
    if names is None:
        with pytest.raises(GuardRefusal):
            simple_command_names(command)
    else:
        assert simple_command_names(command) == names
