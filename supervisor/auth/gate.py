"""The upgrade gate: the ordered checks of docs/protocol.md §2.2 as one pure decision.

Input is the request's headers, the lifecycle, and callables for what the daemon knows (the
sandbox id, the assertion's verification, the durable state); output is either an `Admit`
(what to record before the 101) or a `Refuse` (the exact HTTP answer). The caller does the
I/O; nothing here touches a socket, a file or a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.authority import AssertionClaims, AuthorityError
from sandbox_supervisor.protocol.fencing import fence_admits
from sandbox_supervisor.protocol.headers import RoutingHeaderError, RoutingHeaders, parse_routing_headers
from sandbox_supervisor.daemon.state.upgrade_state import UpgradeState
from sandbox_supervisor.daemon.status import Lifecycle

__all__ = ["Admit", "Lifecycle", "Refuse", "UpgradeState", "decide_upgrade", "fence_admits", "refuse"]


# An assertion sent as an Authorization value would be: "Bearer <jws>". Refused like any
# other malformed assertion (docs/client-contract.md), with its own log detail.
BEARER_PREFIX = "bearer "
BEARER_PREFIX_DETAIL = "assertion has a 'Bearer ' prefix; the header takes the compact JWS alone"


@dataclass(frozen=True, slots=True)
class Admit:
    headers: RoutingHeaders
    claims: AssertionClaims
    # Order of admission (the fence's order): handshakes finish in any order, and a socket
    # admitted earlier must never supersede one admitted later.
    admission: int = 0


@dataclass(frozen=True, slots=True)
class Refuse:
    status: int
    code: str
    message: str
    detail: str  # for the log only; never sent to the peer
    headers: RoutingHeaders | None = None  # when they parsed, so the log can name the session

    @property
    def extra_headers(self) -> list[tuple[bytes, bytes]]:
        if self.code == errors.INVALID_AUTHORITY:
            return [(b"www-authenticate", b'Bearer error="invalid_token"')]
        if self.code == errors.STORAGE_FULL:
            return [(b"retry-after", str(errors.STORAGE_FULL_RETRY_AFTER_S).encode("ascii"))]
        return []


def attempt_ids(headers: RoutingHeaders | None) -> dict[str, str | int]:
    """The fields that name an upgrade attempt in its log lines (none when the headers did
    not parse)."""
    if headers is None:
        return {}
    return {"session_id": headers.session_id, "generation": headers.generation, "attempt_id": headers.attempt_id}


def refuse(code: str, detail: str, headers: RoutingHeaders | None = None) -> Refuse:
    status, message = errors.HTTP_ERRORS[code]
    return Refuse(status, code, message, detail, headers)


def decide_upgrade(
    raw_headers: Iterable[tuple[bytes, bytes]],
    lifecycle: Lifecycle,
    *,
    local_sandbox_id: Callable[[], str | None],
    verify: Callable[[RoutingHeaders], AssertionClaims],
    read_state: Callable[[str], UpgradeState],
) -> Admit | Refuse:
    """Run checks 1–8 in order; the first failure answers.

    The sandbox id, the assertion and the durable state are consulted lazily (callables) so
    that a request that fails an earlier check costs neither a file read, a signature
    verification nor a store read. The state is read once, with the verified assertion's jti:
    the replay check and the checks after it share one transaction.
    """
    if lifecycle is Lifecycle.DRAINING:
        return refuse(errors.DRAINING, "supervisor is draining")
    if lifecycle is Lifecycle.TERMINATED:
        return refuse(errors.TERMINATED, "supervisor is terminated")

    try:
        headers = parse_routing_headers(raw_headers)
    except RoutingHeaderError as exc:
        return refuse(errors.INVALID_ROUTING_HEADERS, f"{exc.header}: {exc.reason}")

    local_id = local_sandbox_id()
    if local_id is None:
        return refuse(errors.SANDBOX_IDENTITY_UNAVAILABLE, "sandbox id unreadable", headers)
    if headers.sandbox_id != local_id:
        return refuse(errors.SANDBOX_MISMATCH, "e2b-sandbox-id differs from local id", headers)

    if headers.authority is None:
        return refuse(errors.INVALID_AUTHORITY, "assertion header missing", headers)
    if headers.authority[: len(BEARER_PREFIX)].lower() == BEARER_PREFIX:
        # The 401's WWW-Authenticate names the kind of credential (a bearer token, RFC 6750),
        # not an Authorization header: the assertion goes alone, and the log says so.
        return refuse(errors.INVALID_AUTHORITY, BEARER_PREFIX_DETAIL, headers)
    try:
        claims = verify(headers)
    except AuthorityError as exc:
        return refuse(errors.INVALID_AUTHORITY, exc.reason, headers)
    state = read_state(claims.jti)
    if state.jti_seen:
        return refuse(errors.INVALID_AUTHORITY, "jti replayed", headers)

    if state.bound_session_id is not None and state.bound_session_id != headers.session_id:
        return refuse(errors.SESSION_MISMATCH, "bound to another session", headers)
    if headers.event_ack > state.local_event_max:
        return refuse(
            errors.ACK_FLOOR_AHEAD,
            f"ack {headers.event_ack} > local event max {state.local_event_max}",
            headers,
        )
    if not fence_admits(
        headers.generation, headers.attempt_id, state.fence_generation, state.fence_attempt_id
    ):
        return refuse(
            errors.STALE_GENERATION,
            f"generation {headers.generation} vs fence {state.fence_generation}",
            headers,
        )
    return Admit(headers, claims)
