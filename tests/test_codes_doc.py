"""docs/codes.md: generated from protocol/, complete, and current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sandbox_supervisor.protocol import closes, codes_doc, errors

REPO = Path(__file__).resolve().parents[1]
CODES_MD = REPO / "docs" / "codes.md"


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the table (the header and the rule are left out)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith(("| where ", "| --- ")):
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _error_code_constants() -> dict[str, str]:
    """Every code constant of protocol.errors: an upper-case name bound to a str."""
    return {
        name: value
        for name, value in vars(errors).items()
        if name.isupper() and isinstance(value, str)
    }


def test_checked_in_codes_md_is_current() -> None:
    assert CODES_MD.read_text(encoding="utf-8") == codes_doc.render_codes_doc(), f"run: {codes_doc.REGENERATE}"


def test_check_mode_passes_on_the_repository_and_reports_drift(tmp_path: Path) -> None:
    assert codes_doc.main(["--check"]) == 0
    stale = tmp_path / "codes.md"
    stale.write_text(codes_doc.render_codes_doc().replace("`bad_request`", "`bad_request_`"), encoding="utf-8")
    assert codes_doc.main(["--check", "--out", str(stale)]) == 1
    assert codes_doc.main(["--check", "--out", str(tmp_path / "missing.md")]) == 1
    # Without --check the file is (re)written, after which the check passes.
    assert codes_doc.main(["--out", str(stale)]) == 0
    assert codes_doc.main(["--check", "--out", str(stale)]) == 0


def test_the_module_runs_as_documented() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.protocol.codes_doc", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_every_code_constant_of_protocol_errors_is_in_the_table() -> None:
    in_table = {row[1].strip("`") for row in _table_rows(codes_doc.render_codes_doc())}
    constants = _error_code_constants()
    # The two answers the front gives before routing, named by the brief of this table.
    assert constants["REQUEST_HEAD_TOO_LARGE"] == "request_head_too_large"
    assert constants["BAD_REQUEST"] == "bad_request"
    missing = {name: value for name, value in constants.items() if value not in in_table}
    assert missing == {}


def test_every_http_refusal_has_its_status_and_fixed_message() -> None:
    rows = {
        (row[1].strip("`"), row[2]): row[4].strip("`")
        for row in _table_rows(codes_doc.render_codes_doc())
        if row[0] == "HTTP refusal"
    }
    assert rows == {(code, str(status)): message for code, (status, message) in errors.HTTP_ERRORS.items()}


def test_every_close_has_its_code_reason_and_sender() -> None:
    rows = [
        (int(row[2]), row[4], row[3])
        for row in _table_rows(codes_doc.render_codes_doc())
        if row[0] == "WebSocket close"
    ]
    expected = [
        (close.code, f"`{close.reason}`" if close.reason else "(empty)", close.sender) for close in closes.CLOSES
    ]
    assert rows == expected
    assert (1009, "`Exceeded maximum message size: 131072 bytes`", "supervisor") in rows  # the library's own


def test_each_family_has_exactly_one_meaning_per_code() -> None:
    assert set(errors.HTTP_ERROR_MEANINGS) == set(errors.HTTP_ERRORS)
    assert set(errors.TOOL_ERROR_MEANINGS) == errors.TOOL_ERROR_CODES
    assert set(errors.BOOTSTRAP_REJECTION_MEANINGS) == errors.BOOTSTRAP_REJECTION_CODES
    meanings = [
        *errors.HTTP_ERROR_MEANINGS.values(),
        *errors.FRAME_ERROR_MEANINGS.values(),
        *errors.TOOL_ERROR_MEANINGS.values(),
        *errors.BOOTSTRAP_REJECTION_MEANINGS.values(),
        *(meaning for _, meaning in errors.HTTP_OTHER_ANSWERS),
        *(close.when for close in closes.CLOSES),
    ]
    for meaning in meanings:
        assert meaning.strip() and "\n" not in meaning, meaning


def test_every_code_is_in_a_family() -> None:
    """A constant added to protocol.errors without a family would have no meaning and no row."""
    families = (
        set(errors.HTTP_ERRORS)
        | set(errors.FRAME_ERROR_MEANINGS)
        | errors.TOOL_ERROR_CODES
        | errors.BOOTSTRAP_REJECTION_CODES
    )
    assert set(_error_code_constants().values()) <= families


def test_every_http_status_the_daemon_answers_is_listed() -> None:
    statuses = {int(row[2]) for row in _table_rows(codes_doc.render_codes_doc()) if row[0].startswith("HTTP")}
    assert statuses == {101, 200, 400, 401, 404, 409, 426, 431, 500, 503}
