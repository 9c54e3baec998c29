"""The documents agree with the code and with themselves.

- Every ```json block in docs/*.md, README.md and bench/README.md decodes. A block whose
  top-level object has a `kind` is a frame: client kinds are decoded with
  `decode_client_frame`, server kinds with `decode_server_frame`, and what the frame carries
  (a tool call, a tool result, an error code) is checked against its own model too. Any other
  block must be announced on the line before it by `<!-- example: NAME -->`, NAME being one of
  NON_FRAME_EXAMPLES below, and is validated with that; an unannounced one fails.
- Links between the documents, and their tables of contents, point at headings that exist.
- The index of frames, the tables of codes and the limits constants match the code.
- Every `§N` a document or a comment cites is a section of docs/protocol.md.
- No file of the repository cites a document that exists only outside it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox_supervisor.protocol import authority, closes, codes_doc, errors, frames, tools
from sandbox_supervisor.protocol.addresses import parse_host_port

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PROTOCOL_MD = DOCS / "protocol.md"
INTERNALS_MD = DOCS / "internals.md"
SCHEMAS = REPO / "protocol" / "schemas"
EXAMPLE_DOCUMENTS = sorted([*DOCS.glob("*.md"), REPO / "README.md", REPO / "bench" / "README.md"])
LINKED_DOCUMENTS = EXAMPLE_DOCUMENTS
# Directories that are not the project's own text (virtualenvs, caches, build output).
SKIPPED_DIRECTORIES = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", "build", "dist", "node_modules"}

FENCE = re.compile(r"^```")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MARKER = re.compile(r"^<!-- example: (\S+) -->$")
SECTION_NUMBER = re.compile(r"^(\d+(?:\.\d+)*)\.? ")
SECTION_CITATION = re.compile(r"§(\d+(?:\.\d+)*)")

def _listening_file(text: str) -> object:
    """What supervisor/app.py's write_listening_file writes: {"tcp": [host:port…], "unix": [path…]},
    and "metrics": [host:port] when websocket.metrics_listen is set."""
    document = json.loads(text)
    assert {"tcp", "unix"} <= set(document) <= {"tcp", "unix", "metrics"}, document
    for address in [*document["tcp"], *document.get("metrics", [])]:
        parse_host_port(address)
    assert all(isinstance(path, str) and path.startswith("/") for path in document["unix"])
    return document


NON_FRAME_EXAMPLES: dict[str, Callable[[str], object]] = {
    "AssertionClaims": authority.AssertionClaims.model_validate_json,
    "JWKS": authority.load_jwks,
    "ExecOutputPageHeaderBody": frames.ExecOutputPageHeaderBody.model_validate_json,
    "ListeningFile": _listening_file,
}
RESULT_MODELS = {spec.name: spec.result for spec in tools.TOOL_SPECS}


# --- reading markdown ------------------------------------------------------------------------


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[tuple[int, str]]:
    """(level, text) of every heading outside code blocks."""
    found = []
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, text in headings(path):
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def protocol_sections() -> set[str]:
    """Section numbers of docs/protocol.md: "7", "7.4", "7.4.1", …"""
    sections = set()
    for _, text in headings(PROTOCOL_MD):
        match = SECTION_NUMBER.match(text)
        if match:
            sections.add(match.group(1))
    return sections


def tables_under(path: Path, heading: str) -> list[list[list[str]]]:
    """The tables between `heading` and the next heading: their body rows, as cells (code
    spans kept; the header row and the rule left out)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if (m := HEADING.match(line)) and m.group(2) == heading)
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for _, line in _prose_lines("\n".join(lines[start + 1 :])):
        if HEADING.match(line):
            break
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            current.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
        else:
            current = None
    return [table[2:] for table in tables]


def table_after(path: Path, heading: str) -> list[list[str]]:
    """The body rows of the first table under `heading`."""
    return tables_under(path, heading)[0]


# --- the JSON examples -----------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    path: Path
    line: int
    marker: str | None
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def json_examples() -> list[Example]:
    examples = []
    for path in EXAMPLE_DOCUMENTS:
        lines = path.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            if lines[index].strip() == "```json":
                previous = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
                marker = MARKER.match(previous)
                end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
                examples.append(
                    Example(path, index + 1, marker.group(1) if marker else None, "\n".join(lines[index + 1 : end]))
                )
                index = end
            index += 1
    return examples


EXAMPLES = json_examples()


def _check_tool_result(body: frames.ToolResultBody) -> None:
    if body.ok:
        assert body.tool_name in RESULT_MODELS, body.tool_name
        RESULT_MODELS[body.tool_name].model_validate(body.result, strict=True)
    else:
        assert body.error is not None and body.error.code in errors.TOOL_ERROR_CODES, body.error


def check_frame(text: str) -> str:
    """Decode one frame example by its kind's direction; return the kind."""
    kind = json.loads(text)["kind"]
    if kind in frames.CLIENT_KINDS:
        frame: Any = frames.decode_client_frame(text)
        if isinstance(frame, frames.ToolCallFrame):
            tools.parse_tool_call(frame.body)  # the call itself, not only its envelope
    elif kind in frames.SERVER_KINDS:
        frame = frames.decode_server_frame(text)
        if isinstance(frame, frames.ToolResultEvent):
            _check_tool_result(frame.body)
        elif isinstance(frame, frames.ToolReplayedFrame):
            _check_tool_result(frame.body.original.body)
        elif isinstance(frame, frames.ErrorFrame):
            assert frame.body.code in errors.FRAME_ERROR_MEANINGS, frame.body.code
        elif isinstance(frame, frames.BootstrapRejectedFrame):
            assert frame.body.code in errors.BOOTSTRAP_REJECTION_CODES, frame.body.code
    else:
        raise AssertionError(f"{kind!r} is neither a client nor a server kind")
    return kind


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_every_json_example_decodes(example: Example) -> None:
    document = json.loads(example.text)
    is_frame = isinstance(document, dict) and "kind" in document
    if example.marker is None:
        assert is_frame, f"{example}: a JSON block that is not a frame needs <!-- example: NAME --> before it"
        check_frame(example.text)
    else:
        assert not is_frame, f"{example}: frames are decoded by kind; drop the marker"
        assert example.marker in NON_FRAME_EXAMPLES, f"{example}: unknown example model {example.marker!r}"
        NON_FRAME_EXAMPLES[example.marker](example.text)


def test_the_examples_cover_every_frame_kind() -> None:
    kinds = {json.loads(example.text).get("kind") for example in EXAMPLES if example.marker is None}
    assert kinds >= frames.CLIENT_KINDS | frames.SERVER_KINDS
    assert {example.marker for example in EXAMPLES} >= set(NON_FRAME_EXAMPLES)


def test_a_broken_example_is_caught() -> None:
    """The check is not vacuous: a frame with an extra field, a bad call, or a wrong code fails."""
    good = '{"kind": "events.ack", "connectionGeneration": 3, "body": {"seq": 9}}'
    assert check_frame(good) == "events.ack"
    for bad in (
        '{"kind": "events.ack", "connectionGeneration": 3, "body": {"seq": 9, "x": 1}}',
        '{"kind": "tool.call", "connectionGeneration": 3, "body": {"tool_name": "read_file",'
        ' "call_id": "7bc11259-f6ff-47e1-b5bc-02ddbe8c902a", "parameters": {"path": ""}}}',
        '{"kind": "error", "body": {"code": "no_such_code", "message": "m"}}',
        '{"kind": "tool.result", "seq": 5, "body": {"call_id": "7bc11259-f6ff-47e1-b5bc-02ddbe8c902a",'
        ' "idempotency_key": null, "tool_name": "read_file", "ok": true, "result": {"path": "a"}}}',
    ):
        with pytest.raises(Exception):  # noqa: B017 - any refusal will do: FrameError, ToolCallError, …
            check_frame(bad)


# --- links, contents, sections ---------------------------------------------------------------


def _links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        # Code spans may hold brackets and parentheses that are not links.
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            yield number, target


@pytest.mark.parametrize("path", LINKED_DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(path: Path) -> None:
    broken = []
    for number, target in _links(path):
        if re.match(r"^[a-z]+:", target):
            continue  # an external URL
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append((number, target, "no such file"))
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append((number, target, "no such heading"))
    assert broken == []


@pytest.mark.parametrize("path", [PROTOCOL_MD, INTERNALS_MD], ids=lambda p: p.name)
def test_contents_list_every_section(path: Path) -> None:
    """The contents at the top list the level-2 and level-3 headings after them, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index("## Contents")
    listed = []
    for line in lines[start + 1 :]:
        if HEADING.match(line):
            break
        match = re.match(r"^( *)- \[(.+)\]\(#([^)]+)\)$", line)
        if match:
            listed.append((2 + len(match.group(1)) // 2, match.group(2), match.group(3)))
    after = [(level, text) for level, text in headings(path)[1:] if level in (2, 3) and text != "Contents"]
    assert [(level, text) for level, text, _ in listed] == after
    assert [anchor for _, _, anchor in listed] == [slug(text) for _, text in after]


def test_every_section_citation_names_a_section_of_protocol_md() -> None:
    sections = protocol_sections()
    assert {"1", "2.2", "4.4", "7.4.1", "10.2", "12"} <= sections  # the parser found them
    unknown = []
    for path in _project_text_files():
        if path == PROTOCOL_MD:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            unknown += [(str(path.relative_to(REPO)), number, cited) for cited in SECTION_CITATION.findall(line) if cited not in sections]
    assert unknown == []


# --- the index of frames and the tables of codes -----------------------------------------------


def test_index_of_frames_matches_the_models() -> None:
    rows = table_after(PROTOCOL_MD, "Index of frames")
    by_kind = {row[0].strip("`"): row for row in rows}
    assert set(by_kind) == frames.CLIENT_KINDS | frames.SERVER_KINDS
    for kind, (_, direction, journaled, schema, _section) in by_kind.items():
        assert direction == ("client → supervisor" if kind in frames.CLIENT_KINDS else "supervisor → client"), kind
        assert journaled == ("yes" if kind in frames.EVENT_KINDS else "no"), kind
        frame_schema = re.match(r"`(\w+\.json)`", schema).group(1)
        document = json.loads((SCHEMAS / frame_schema).read_text(encoding="utf-8"))
        assert document["properties"]["kind"]["const"] == kind, (kind, frame_schema)
        for named in re.findall(r"`(\w+\.json)`", schema):
            assert (SCHEMAS / named).is_file(), named


def test_gate_tables_in_protocol_md_match_the_code() -> None:
    checks, messages = tables_under(PROTOCOL_MD, "2.2 Checks, in order")[:2]
    for row in checks:
        codes = re.findall(r"`(\w+)`", row[3])
        assert codes, row
        for code in codes:
            assert row[2] == str(errors.HTTP_ERRORS[code][0]), code
    documented = {row[0].strip("`"): row[1].strip("`") for row in messages}
    gate = {code: message for code, (_, message) in errors.HTTP_ERRORS.items() if code not in codes_doc.FRONT_REFUSALS}
    assert documented == gate


def test_every_http_error_body_in_the_docs_matches_the_code() -> None:
    bodies = []
    for path in LINKED_DOCUMENTS:
        bodies += re.findall(r'\{"error":"(\w+)","message":"([^"]+)"\}', path.read_text(encoding="utf-8"))
    assert {code for code, _ in bodies} >= {errors.BAD_REQUEST, errors.REQUEST_HEAD_TOO_LARGE, errors.UPGRADE_REQUIRED}
    for code, message in bodies:
        assert errors.HTTP_ERRORS[code][1] == message, code


def test_close_table_in_protocol_md_matches_closes() -> None:
    rows = table_after(PROTOCOL_MD, "4.4 Close codes")
    documented = [(int(row[0]), "" if row[1] == "(empty)" else row[1].strip("`")) for row in rows]
    expected = [(close.code, close.reason) for close in closes.CLOSES if close.sender == "supervisor"]
    assert documented == expected


CLIENT_CONTRACT_MD = DOCS / "client-contract.md"


def _contract_rows(heading: str) -> list[list[str]]:
    return table_after(CLIENT_CONTRACT_MD, heading)


def test_the_client_contract_covers_every_close_the_supervisor_sends() -> None:
    """Every close code and reason the supervisor can send (protocol/closes.py) has a row on
    the client contract page saying what the client does."""
    documented = {(int(row[0]), "" if row[1] == "(empty)" else row[1].strip("`")) for row in _contract_rows("After a close")}
    expected = {(close.code, close.reason) for close in closes.CLOSES if close.sender == "supervisor"}
    assert expected - documented == set()
    assert all(row[3] for row in _contract_rows("After a close"))


def test_the_client_contract_covers_every_http_refusal() -> None:
    """Every HTTP refusal code (errors.HTTP_ERRORS: the front's and the gate's) has a row with
    its status, and every bootstrap rejection and error frame code is on the page too."""
    documented = {(row[1].strip("`"), int(row[0])) for row in _contract_rows("After an HTTP refusal")}
    expected = {(code, status) for code, (status, _) in errors.HTTP_ERRORS.items()}
    assert expected - documented == set()
    rejections = {row[0].strip("`") for row in _contract_rows("After a bootstrap rejection")}
    assert errors.BOOTSTRAP_REJECTION_CODES - rejections == set()
    frame_errors = {row[0].strip("`") for row in _contract_rows("After an error frame")}
    assert set(errors.FRAME_ERROR_MEANINGS) - frame_errors == set()
    tool_codes = set()
    for row in _contract_rows("Tool results: may the key be sent again"):
        tool_codes |= set(re.findall(r"`(\w+)`", row[0]))
    assert errors.TOOL_ERROR_CODES - tool_codes == set()


def test_the_client_contract_is_linked_from_the_readme_and_the_protocol() -> None:
    for path in (REPO / "README.md", PROTOCOL_MD):
        assert "client-contract.md" in path.read_text(encoding="utf-8"), path


def test_limits_in_the_code_name_existing_constants() -> None:
    rows = table_after(INTERNALS_MD, "Limits in the code")
    assert len(rows) > 40
    missing = []
    for row in rows:
        path_match = re.match(r"`([\w/.]+\.py)` (.+)$", row[2])
        assert path_match, row
        source = (REPO / path_match.group(1)).read_text(encoding="utf-8")
        for name in re.findall(r"`(\w+)`", path_match.group(2)):
            if not re.search(rf"^{name}\b(: [^=]+)? = ", source, re.MULTILINE):
                missing.append((path_match.group(1), name))
    assert missing == []


def test_repository_paths_named_in_the_docs_exist() -> None:
    path_span = re.compile(r"`((?:supervisor|protocol|testing|tests|systemd|bench|docs)/[\w./-]*)`")
    missing = []
    for path in LINKED_DOCUMENTS:
        for number, line in _prose_lines(path.read_text(encoding="utf-8")):
            missing += [(str(path.relative_to(REPO)), number, named) for named in path_span.findall(line) if not (REPO / named).exists()]
    assert missing == []


# --- nothing cites a document from outside the repository ----------------------------------------

# Built from parts, so that this file does not match itself.
EXTERNAL_DOCUMENTS = ("OPERATIONS", "TARGETS", "PROTOCOL", "STACK", "ARCHITECTURE")
EXTERNAL_CITATION = re.compile(
    r"\b(?:" + "|".join(EXTERNAL_DOCUMENTS) + r")\.md\b"
    r"|\bPROTOCOL(?:'s| (?:\d|section|says))"  # the original's numbered sections, cited by name
    r"|\bseed 0\d\d\b"  # the original design notes the specification was drawn from
)


def _project_text_files() -> Iterator[Path]:
    for path in sorted(REPO.rglob("*")):
        relative = path.relative_to(REPO)
        if any(part in SKIPPED_DIRECTORIES or part.endswith(".egg-info") for part in relative.parts):
            continue
        if not path.is_file() or path.suffix in {".pyc", ".sqlite3"}:
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        yield path


def test_no_file_cites_a_document_outside_the_repository() -> None:
    cited = []
    for path in _project_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if EXTERNAL_CITATION.search(line):
                cited.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert cited == []


def test_the_citation_pattern_catches_what_it_names() -> None:
    for line in ("see OPERATIONS" + ".md", "(PROTOCOL" + " 7.1)", "PROTOCOL" + " section 4", "seed " + "001's"):
        assert EXTERNAL_CITATION.search(line), line
    for line in ("docs/protocol.md §7.1", "PROTOCOL_VERSION = 1", "CLOSE_PROTOCOL_ERROR"):
        assert not EXTERNAL_CITATION.search(line), line
