"""The upgrade gate's decision as a table, without sockets (docs/protocol.md §2.2, §4.1).

`decide_upgrade` is pure apart from three callables it is handed; here they are fakes that
record whether they were consulted. Each row of CHECKS breaks one check of an otherwise
admitted request; the table asserts that row N answers with check N's code, that an earlier
failing check wins over every later one, and that a check's lazy callables are never called
when an earlier check refuses. The same rows over real sockets are in tests/test_gate.py
(row1…row8) and test_front.py (draining).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from sandbox_supervisor.daemon.auth.gate import Admit, Lifecycle, Refuse, UpgradeState, decide_upgrade, fence_admits
from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol import headers as H
from sandbox_supervisor.protocol.authority import AssertionClaims, AuthorityError
from sandbox_supervisor.protocol.headers import RoutingHeaders

SANDBOX = "sbx-table"
SESSION = "session-table"
GENERATION = 5
ATTEMPT = "attempt-5"
ACK = 3
LOCAL_EVENT_MAX = 10
JTI = "jti-table"


@dataclass
class Request:
    """One upgrade as the gate sees it: headers, durable state, and the lazy probes."""

    headers: dict[str, str] = field(
        default_factory=lambda: {
            H.SANDBOX_ID_HEADER: SANDBOX,
            H.SESSION_ID_HEADER: SESSION,
            H.SESSION_SANDBOX_ID_HEADER: SANDBOX,
            H.ATTEMPT_ID_HEADER: ATTEMPT,
            H.GENERATION_HEADER: str(GENERATION),
            H.EVENT_ACK_HEADER: str(ACK),
            H.AUTHORITY_HEADER: "header.payload.signature",
        }
    )
    lifecycle: Lifecycle = Lifecycle.SERVING
    state: UpgradeState = UpgradeState(
        bound_session_id=SESSION,
        local_event_max=LOCAL_EVENT_MAX,
        fence_generation=GENERATION - 1,
        fence_attempt_id="attempt-4",
        jti_seen=False,
    )
    local_sandbox_id: str | None = SANDBOX
    verify_error: str | None = None  # the AuthorityError reason verify raises, if any
    called: list[str] = field(default_factory=list)  # which probes ran, in order

    def decide(self) -> Admit | Refuse:
        def local_sandbox_id() -> str | None:
            self.called.append("local_sandbox_id")
            return self.local_sandbox_id

        def verify(headers: RoutingHeaders) -> AssertionClaims:
            self.called.append("verify")
            if self.verify_error is not None:
                raise AuthorityError(self.verify_error)
            return CLAIMS

        def read_state(jti: str) -> UpgradeState:
            self.called.append("read_state")
            assert jti == JTI  # the verified assertion's: the replay check reads with it
            return self.state

        raw = [(name.encode(), value.encode()) for name, value in self.headers.items()]
        return decide_upgrade(
            raw, self.lifecycle, local_sandbox_id=local_sandbox_id, verify=verify, read_state=read_state
        )


CLAIMS = AssertionClaims.model_validate(
    {
        "iss": "https://issuer.example",
        "aud": "sandbox-supervisor",
        "iat": 1_700_000_000,
        "exp": 1_700_000_060,
        "jti": JTI,
        "sandbox_id": SANDBOX,
        "session_id": SESSION,
        "session_sandbox_id": SANDBOX,
        "connection_generation": GENERATION,
        "connection_attempt_id": ATTEMPT,
        "event_ack_floor": ACK,
        "scope": "",
    }
)


def _state(**changes: object) -> Callable[[Request], None]:
    def apply(request: Request) -> None:
        request.state = replace(request.state, **changes)  # type: ignore[arg-type]

    return apply


def _header(name: str, value: str | None) -> Callable[[Request], None]:
    def apply(request: Request) -> None:
        if value is None:
            request.headers.pop(name)
        else:
            request.headers[name] = value

    return apply


def _set(attribute: str, value: object) -> Callable[[Request], None]:
    def apply(request: Request) -> None:
        setattr(request, attribute, value)

    return apply


@dataclass(frozen=True)
class Check:
    name: str
    breaks: Callable[[Request], None]  # makes exactly this check fail
    code: str
    probes: tuple[str, ...]  # the lazy callables consulted up to and including this check


# In the gate's order. The state-changing rows use different state fields, except the two
# lifecycle rows (one field, one value at a time), which are never combined.
CHECKS = [
    Check("draining", _set("lifecycle", Lifecycle.DRAINING), errors.DRAINING, ()),
    Check("terminated", _set("lifecycle", Lifecycle.TERMINATED), errors.TERMINATED, ()),
    Check("routing-headers", _header(H.GENERATION_HEADER, None), errors.INVALID_ROUTING_HEADERS, ()),
    Check("identity-unavailable", _set("local_sandbox_id", None), errors.SANDBOX_IDENTITY_UNAVAILABLE, ("local_sandbox_id",)),
    Check("sandbox-mismatch", _header(H.SANDBOX_ID_HEADER, "sbx-other"), errors.SANDBOX_MISMATCH, ("local_sandbox_id",)),
    Check("assertion-missing", _header(H.AUTHORITY_HEADER, None), errors.INVALID_AUTHORITY, ("local_sandbox_id",)),
    Check("assertion-invalid", _set("verify_error", "bad signature"), errors.INVALID_AUTHORITY, ("local_sandbox_id", "verify")),
    Check("jti-replayed", _state(jti_seen=True), errors.INVALID_AUTHORITY, ("local_sandbox_id", "verify", "read_state")),
    Check("session-mismatch", _state(bound_session_id="session-other"), errors.SESSION_MISMATCH, ("local_sandbox_id", "verify", "read_state")),
    Check("ack-floor-ahead", _header(H.EVENT_ACK_HEADER, str(LOCAL_EVENT_MAX + 1)), errors.ACK_FLOOR_AHEAD, ("local_sandbox_id", "verify", "read_state")),
    Check("stale-generation", _state(fence_generation=GENERATION + 1), errors.STALE_GENERATION, ("local_sandbox_id", "verify", "read_state")),
]
ALL_PROBES = ("local_sandbox_id", "verify", "read_state")
STATUS = {code: status for code, (status, _) in errors.HTTP_ERRORS.items()}


def test_the_unbroken_request_is_admitted_after_every_probe() -> None:
    request = Request()
    decision = request.decide()
    assert isinstance(decision, Admit)
    assert decision.claims is CLAIMS
    assert (decision.headers.generation, decision.headers.attempt_id) == (GENERATION, ATTEMPT)
    assert request.called == list(ALL_PROBES)


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_each_check_refuses_with_its_code_and_consults_nothing_later(check: Check) -> None:
    request = Request()
    check.breaks(request)
    decision = request.decide()
    assert isinstance(decision, Refuse)
    assert (decision.status, decision.code) == (STATUS[check.code], check.code)
    assert tuple(request.called) == check.probes


PAIRS = [
    (earlier, later)
    for earlier, later in itertools.combinations(CHECKS, 2)
    if {earlier.name, later.name} != {"draining", "terminated"}
]


@pytest.mark.parametrize("earlier, later", PAIRS, ids=[f"{a.name}-before-{b.name}" for a, b in PAIRS])
def test_an_earlier_failing_check_wins_over_a_later_one(earlier: Check, later: Check) -> None:
    request = Request()
    later.breaks(request)
    earlier.breaks(request)
    decision = request.decide()
    assert isinstance(decision, Refuse)
    assert decision.code == earlier.code
    # The probes say which check answered, also among the three invalid_authority rows.
    assert tuple(request.called) == earlier.probes


def test_invalid_authority_carries_the_bearer_challenge_and_no_other_refusal_does() -> None:
    for check in CHECKS:
        request = Request()
        check.breaks(request)
        decision = request.decide()
        assert isinstance(decision, Refuse)
        expected = [(b"www-authenticate", b'Bearer error="invalid_token"')] if check.code == errors.INVALID_AUTHORITY else []
        assert decision.extra_headers == expected, check.name


def test_a_refusal_after_the_headers_parsed_names_them_for_the_log() -> None:
    for check in CHECKS:
        request = Request()
        check.breaks(request)
        decision = request.decide()
        assert isinstance(decision, Refuse)
        parsed = check.name not in {"draining", "terminated", "routing-headers"}
        assert (decision.headers is not None) is parsed, check.name
        if parsed:
            assert decision.headers is not None and decision.headers.session_id == SESSION


# --- the fence predicate (docs/protocol.md §4.1) -----------------------------------------

FENCE_ROWS = [
    # generation, attempt, fence generation, fence attempt, admitted
    pytest.param(6, "a-6", 5, "a-5", True, id="higher-generation"),
    pytest.param(6, "a-5", 5, "a-5", True, id="higher-generation-same-attempt-id"),
    pytest.param(5, "a-5", 5, "a-5", True, id="equal-generation-same-attempt"),
    pytest.param(5, "a-other", 5, "a-5", False, id="equal-generation-other-attempt"),
    pytest.param(4, "a-4", 5, "a-5", False, id="lower-generation"),
    pytest.param(4, "a-5", 5, "a-5", False, id="lower-generation-same-attempt-id"),
    pytest.param(1, "a-1", 0, None, True, id="first-ever"),
    pytest.param(0, "a-0", 0, None, False, id="generation-0-never-matches-the-empty-fence"),
]


@pytest.mark.parametrize("generation, attempt, fence_generation, fence_attempt, admitted", FENCE_ROWS)
def test_fence_admits(generation: int, attempt: str, fence_generation: int, fence_attempt: str | None, admitted: bool) -> None:
    assert fence_admits(generation, attempt, fence_generation, fence_attempt) is admitted


@pytest.mark.parametrize("generation, attempt, fence_generation, fence_attempt, admitted", FENCE_ROWS)
def test_the_gate_applies_the_fence_predicate(
    generation: int, attempt: str, fence_generation: int, fence_attempt: str | None, admitted: bool
) -> None:
    """The last check is exactly the predicate (generation 0 is refused earlier, as a header)."""
    request = Request()
    request.headers[H.GENERATION_HEADER] = str(generation)
    request.headers[H.ATTEMPT_ID_HEADER] = attempt
    request.state = replace(request.state, fence_generation=fence_generation, fence_attempt_id=fence_attempt)
    decision = request.decide()
    if generation == 0:
        assert isinstance(decision, Refuse) and decision.code == errors.INVALID_ROUTING_HEADERS
    elif admitted:
        assert isinstance(decision, Admit)
    else:
        assert isinstance(decision, Refuse) and decision.code == errors.STALE_GENERATION
