"""Render docs/codes.md, every HTTP status, close code and error code, from protocol/ (or check it).

    python -m sandbox_supervisor.protocol.codes_doc            # (re)write docs/codes.md
    python -m sandbox_supervisor.protocol.codes_doc --check    # exit 1 when the file differs

The codes, their fixed messages and their meanings are data in `protocol.errors` and
`protocol.closes`; this module only lays them out, so a code added there without a meaning
fails the tests rather than the table. `render_codes_doc` is pure; only `main` touches the
file system.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox_supervisor.protocol import closes, errors

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "codes.md"
REGENERATE = "python -m sandbox_supervisor.protocol.codes_doc"
NONE = "—"
PER_CASE = "per case (see)"  # messages that name what failed are given in protocol.md

# Where each family is explained in docs/protocol.md (the anchors are its headings').
SEE_ROUTES = "[§1](protocol.md#1-listeners-and-routes)"
SEE_GATE = "[§2.2](protocol.md#22-checks-in-order)"
SEE_CLOSES = "[§4.4](protocol.md#44-close-codes)"
SEE_FRAME_ERRORS = "[§6.5](protocol.md#65-server-frames-that-are-not-journaled)"
SEE_TOOL_ERRORS = "[§7.6](protocol.md#76-error-codes-of-toolresult)"
SEE_REJECTIONS = "[§5.4](protocol.md#54-rejection-and-termination)"
# HTTP refusals answered before the gate runs; every other one is a gate answer.
FRONT_REFUSALS = frozenset(
    {
        errors.BAD_REQUEST,
        errors.NOT_FOUND_ROUTE,
        errors.UPGRADE_REQUIRED,
        errors.REQUEST_HEAD_TOO_LARGE,
        errors.TOO_MANY_HANDSHAKES,
    }
)


@dataclass(frozen=True, slots=True)
class Row:
    where: str
    code: str  # the `code` / `error` text, or NONE
    number: str  # the HTTP status or the close code, or NONE
    sender: str
    text: str  # the fixed message or close reason; PER_CASE when it names what failed
    meaning: str
    see: str


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else "(empty)"


def _sentence(text: str) -> str:
    # CLOSES writes its `when` as a clause; the table's meanings are sentences.
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def rows() -> Iterator[Row]:
    """Every row of the table, in its order: HTTP, closes, error frames, tool errors, rejections."""
    for status, meaning in errors.HTTP_OTHER_ANSWERS:
        yield Row("HTTP answer", NONE, str(status), "supervisor", NONE, meaning, SEE_ROUTES)
    for code, (status, message) in errors.HTTP_ERRORS.items():
        see = SEE_ROUTES if code in FRONT_REFUSALS else SEE_GATE
        yield Row(
            "HTTP refusal", _code(code), str(status), "supervisor", _code(message),
            errors.HTTP_ERROR_MEANINGS[code], see,
        )
    for close in closes.CLOSES:
        yield Row("WebSocket close", NONE, str(close.code), close.sender, _code(close.reason), _sentence(close.when), SEE_CLOSES)
    for code, meaning in errors.FRAME_ERROR_MEANINGS.items():
        yield Row("`error` frame", _code(code), NONE, "supervisor", PER_CASE, meaning, SEE_FRAME_ERRORS)
    for code, meaning in errors.TOOL_ERROR_MEANINGS.items():
        yield Row("`tool.result` error", _code(code), NONE, "supervisor", PER_CASE, meaning, SEE_TOOL_ERRORS)
    for code, meaning in errors.BOOTSTRAP_REJECTION_MEANINGS.items():
        yield Row(
            "`session.bootstrap.rejected` (terminal)", _code(code), NONE, "supervisor", PER_CASE,
            meaning, SEE_REJECTIONS,
        )


def render_codes_doc() -> str:
    """The exact text of docs/codes.md."""
    lines = [
        "# Codes: every HTTP status, close code and error code",
        "",
        f"<!-- Generated from protocol/errors.py and protocol/closes.py by `{REGENERATE}`.",
        "     Do not edit by hand; `--check` reports drift, and a test runs it. -->",
        "",
        "Everything a peer of the supervisor can be answered with, in one table: HTTP statuses",
        "(with the `error` code and fixed `message` of a refusal), WebSocket close codes (with",
        "their reasons), and the `code` of `error` frames, of `tool.result` errors and of",
        "`session.bootstrap.rejected`. The rules around each are in [protocol.md](protocol.md),",
        "in the section the last column links to; where the message depends on the case, that",
        "section gives each one.",
        "",
        "| where | code | status / close code | sent by | fixed message or reason | meaning | see |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows():
        cells = (row.where, row.code, row.number, row.sender, row.text, row.meaning, row.see)
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    expected = render_codes_doc()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != expected:
            print(f"drifted: {args.out}", file=sys.stderr)
            print(f"run: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(expected, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
