"""Routing header parsing (docs/protocol.md §2.1, gate step 2)."""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from sandbox_supervisor.protocol.headers import (
    ATTEMPT_ID_HEADER,
    AUTHORITY_HEADER,
    EVENT_ACK_HEADER,
    GENERATION_HEADER,
    MAX_SAFE_INTEGER,
    ROUTING_HEADERS,
    SANDBOX_ID_HEADER,
    SESSION_ID_HEADER,
    SESSION_SANDBOX_ID_HEADER,
    RoutingHeaderError,
    RoutingHeaders,
    parse_routing_headers,
)
from sandbox_supervisor.testing.fuzzing import fuzz_settings

VALID = {
    SANDBOX_ID_HEADER: "sbx-1",
    SESSION_ID_HEADER: "session:42",
    SESSION_SANDBOX_ID_HEADER: "rec_7.a",
    ATTEMPT_ID_HEADER: "attempt-9",
    GENERATION_HEADER: "3",
    EVENT_ACK_HEADER: "0",
    AUTHORITY_HEADER: "a.b.c",
}
ID_HEADERS = (SANDBOX_ID_HEADER, SESSION_ID_HEADER, SESSION_SANDBOX_ID_HEADER, ATTEMPT_ID_HEADER)
REQUIRED_HEADERS = (*ID_HEADERS, GENERATION_HEADER, EVENT_ACK_HEADER)
DROP = object()


def header_list(**changes: object) -> list[tuple[bytes, bytes]]:
    """VALID as h11 gives it, with header values replaced (by python-ish name) or dropped."""
    values: dict[str, object] = dict(VALID)
    for key, value in changes.items():
        name = key.replace("_", "-")
        if value is DROP:
            values.pop(name)
        else:
            values[name] = value
    return [
        (name.encode(), value if isinstance(value, bytes) else str(value).encode())
        for name, value in values.items()
    ]


def parse_with(name: str, value: str | bytes) -> RoutingHeaders:
    return parse_routing_headers(header_list(**{name.replace("-", "_"): value}))


def test_valid_headers_parse_into_typed_values() -> None:
    parsed = parse_routing_headers([(b"host", b"x"), *header_list()])
    assert parsed == RoutingHeaders(
        sandbox_id="sbx-1",
        session_id="session:42",
        session_sandbox_id="rec_7.a",
        attempt_id="attempt-9",
        generation=3,
        event_ack=0,
        authority="a.b.c",
    )


def test_names_are_case_insensitive() -> None:
    shouted = [(name.upper(), value) for name, value in header_list()]
    assert parse_routing_headers(shouted).generation == 3


def test_absent_authority_is_none_not_an_error() -> None:
    assert (
        parse_routing_headers(header_list(x_coding_agent_control_authority=DROP)).authority is None
    )


def test_empty_authority_is_present_and_empty() -> None:
    assert parse_with(AUTHORITY_HEADER, "").authority == ""


def test_non_ascii_authority_is_left_to_the_verifier() -> None:
    # A bad assertion is a 401 at step 5, never a 400 here.
    assert parse_with(AUTHORITY_HEADER, "é".encode()).authority == "é".encode().decode("latin-1")


@pytest.mark.parametrize("name", REQUIRED_HEADERS)
def test_each_missing_routing_header_is_named(name: str) -> None:
    with pytest.raises(RoutingHeaderError) as caught:
        parse_routing_headers(header_list(**{name.replace("-", "_"): DROP}))
    assert caught.value.header == name
    assert caught.value.reason == "missing"


@pytest.mark.parametrize("name", ROUTING_HEADERS)
def test_a_routing_header_present_twice_is_malformed(name: str) -> None:
    headers = header_list()
    # The second copy differs in case: names compare case-insensitively.
    headers.append((name.upper().encode(), dict(headers)[name.encode()]))
    with pytest.raises(RoutingHeaderError) as caught:
        parse_routing_headers(headers)
    assert caught.value.header == name
    assert caught.value.reason == "duplicate"


def test_other_headers_may_repeat() -> None:
    headers = [(b"cookie", b"a"), (b"cookie", b"b"), *header_list()]
    assert parse_routing_headers(headers).event_ack == 0


@pytest.mark.parametrize(
    "value",
    ["0", "+1", " 1", "1 ", "0x1", "-1", "1.0", "1e3", "1_0", "", "１", str(MAX_SAFE_INTEGER + 1)],
)
def test_bad_generations_are_refused(value: str) -> None:
    with pytest.raises(RoutingHeaderError) as caught:
        parse_with(GENERATION_HEADER, value)
    assert caught.value.header == GENERATION_HEADER


@pytest.mark.parametrize(
    "value", ["-1", "+0", " 0", "0x0", "", str(MAX_SAFE_INTEGER + 1), "2" * 40]
)
def test_bad_acks_are_refused(value: str) -> None:
    with pytest.raises(RoutingHeaderError) as caught:
        parse_with(EVENT_ACK_HEADER, value)
    assert caught.value.header == EVENT_ACK_HEADER


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (GENERATION_HEADER, "01", 1),
        (GENERATION_HEADER, "0001", 1),
        (GENERATION_HEADER, str(MAX_SAFE_INTEGER), MAX_SAFE_INTEGER),
        (EVENT_ACK_HEADER, "00", 0),
        (EVENT_ACK_HEADER, str(MAX_SAFE_INTEGER), MAX_SAFE_INTEGER),
    ],
)
def test_numbers_compare_as_integers(name: str, value: str, expected: int) -> None:
    parsed = parse_with(name, value)
    assert (parsed.generation if name == GENERATION_HEADER else parsed.event_ack) == expected


def test_numbers_longer_than_the_cap_are_refused_before_int() -> None:
    # 33 characters of a small value: refused by length, whatever its value.
    with pytest.raises(RoutingHeaderError) as caught:
        parse_with(GENERATION_HEADER, "0" * 32 + "1")
    assert caught.value.reason == "too long"


@pytest.mark.parametrize("name", ID_HEADERS)
@pytest.mark.parametrize(
    "value",
    ["", "a" * 129, "a b", "a/b", "é".encode(), "a\n", " a", "a\t", "a,b", "a;b", b"\xff"],
)
def test_illegal_ids_are_refused(name: str, value: str | bytes) -> None:
    with pytest.raises(RoutingHeaderError) as caught:
        parse_with(name, value)
    assert caught.value.header == name


@pytest.mark.parametrize("name", ID_HEADERS)
def test_ids_of_128_legal_characters_are_accepted(name: str) -> None:
    value = ("Az09._:-" * 16)[:128]
    parsed = parse_with(name, value)
    assert value in {
        parsed.sandbox_id,
        parsed.session_id,
        parsed.session_sandbox_id,
        parsed.attempt_id,
    }


def test_str_pairs_are_accepted_too() -> None:
    pairs = [(name.decode(), value.decode()) for name, value in header_list()]
    assert parse_routing_headers(pairs).attempt_id == "attempt-9"


@pytest.mark.parametrize("headers", [None, 5, [b"not-a-pair"], [(b"a", b"b", b"c")], [(1, 2)]])
def test_malformed_header_lists_raise_only_routing_header_error(headers: object) -> None:
    with pytest.raises(RoutingHeaderError):
        parse_routing_headers(headers)  # type: ignore[arg-type]


_names = st.one_of(
    st.sampled_from([name.encode() for name in ROUTING_HEADERS]).map(
        lambda name: name.upper() if len(name) % 2 else name
    ),
    st.binary(max_size=20),
)
_values = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"0", b"1", b"01", b"+1", b"9007199254740992", b"abc", b"", b"\xff"]),
    st.integers(min_value=-5, max_value=2**60).map(lambda n: str(n).encode()),
)


@pytest.mark.fuzz
@fuzz_settings(500)
@given(
    extra=st.lists(st.tuples(_names, _values), max_size=12),
    keep=st.lists(st.booleans(), min_size=len(VALID), max_size=len(VALID)),
)
def test_arbitrary_header_lists_raise_nothing_but_routing_header_error(
    extra: list[tuple[bytes, bytes]], keep: list[bool]
) -> None:
    base = [pair for pair, kept in zip(header_list(), keep, strict=True) if kept]
    try:
        parsed = parse_routing_headers(base + extra)
    except RoutingHeaderError as error:
        assert error.header and error.reason
    else:
        assert 1 <= parsed.generation <= MAX_SAFE_INTEGER
        assert 0 <= parsed.event_ack <= MAX_SAFE_INTEGER


# One draw per header (valid most of the time), so that every header's own value parser sees
# arbitrary input; in the list-level test above, most inputs stop at a duplicate or a gap.
_SHAPES = st.sampled_from(["valid"] * 6 + ["arbitrary"] * 3 + ["absent", "duplicated"])


@pytest.mark.fuzz
@fuzz_settings(500)
@given(data=st.data())
def test_each_header_value_is_parsed_or_refused_naming_its_header(data: st.DataObject) -> None:
    headers: list[tuple[bytes, bytes]] = []
    for name, value in header_list():
        shape = data.draw(_SHAPES)
        if shape == "absent":
            continue
        headers.append((name, data.draw(_values) if shape == "arbitrary" else value))
        if shape == "duplicated":
            headers.append((name, data.draw(_values)))
    try:
        parsed = parse_routing_headers(headers)
    except RoutingHeaderError as error:
        event(f"refused: {error.header}")
        assert error.header and error.reason
    else:
        event("parsed")
        assert 1 <= parsed.generation <= MAX_SAFE_INTEGER
        assert 0 <= parsed.event_ack <= MAX_SAFE_INTEGER
