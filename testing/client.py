"""A reference control-plane client: what a control plane does, in a few hundred lines.

It builds the routing headers and a fresh signed assertion for every connection attempt,
connects over TCP or a unix socket, bootstraps, receives frames, acks what it has stored, and
reconnects with a higher generation. The demo and the tests drive the daemon with it; a
control plane in another language can read it as an executable description of the protocol.
"""

from __future__ import annotations

import base64
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import trio
import trio_websocket

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol import headers as H
from sandbox_supervisor.protocol.addresses import format_host_port, parse_host_port
from sandbox_supervisor.protocol.closes import CLOSE_REJECTION_RECEIPT, REJECTION_RECEIPT_REASON
from sandbox_supervisor.testing._groups import single_leaf
from sandbox_supervisor.testing.authority import ALL_SCOPES, LoopbackAuthority

DEFAULT_CONTROL_PATH = "/v1/control"
CONNECT_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
RECEIVE_BUFFER_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # what the daemon sends can be large (replays, pages)
# Binary exec.output_page (docs/protocol.md §6.5.1): the header's length field, and what
# read_stream asks for by default (the largest page, a few in flight).
BINARY_HEADER_LENGTH_BYTES = 4
BINARY_PAGE_LENGTH = 1024 * 1024
PAGES_IN_FLIGHT = 4
FRAME_ERRORS = (errors.INVALID_FRAME, errors.UNKNOWN_KIND, errors.GENERATION_MISMATCH)
# Results that never held the idempotency key (docs/protocol.md §8): after a tool.pending
# they are not the one result the key's first execution will produce.
NON_CLAIMING_CODES = frozenset(
    {errors.TOO_MANY_PROCESSES, errors.RESOURCE_EXHAUSTED, errors.SUPERVISOR_STOPPING, errors.IDEMPOTENCY_KEY_REUSED}
)
# The body field of an exec.* request that its answer echoes (docs/protocol.md §6.3): the
# helpers below send one with every request and take the answer that carries it.
REQUEST_ID = "request_id"
# How often call_and_wait sends a call again (same key) after the daemon said it could not
# record its result yet (error frame `internal` for the call).
RECORD_RETRIES = 3
RECORD_RETRY_DELAY_S = 0.2

# A frame, or a body within one, as json.loads gives it: the client reads the wire as the
# documented JSON rather than through the daemon's models, so values are whatever JSON holds.
JsonObject = dict[str, Any]


class UnexpectedMessage(Exception):
    """The daemon sent something that is not a JSON object where a frame (or a body) goes."""


def _object(value: object, what: str) -> JsonObject:
    if not isinstance(value, dict):
        raise UnexpectedMessage(f"{what} is not a JSON object: {value!r:.200}")
    return value


class CallNotAnswered(Exception):
    """The daemon answered a tool.call with an `error` frame instead of a result: the frame
    was refused (invalid_frame, generation_mismatch …), (`internal`) the call or its result
    could not be recorded, or (`journal_full`) too many events are unacknowledged (ack them,
    then send it again). `retryable` when sending it again with the same key is the fix."""

    def __init__(self, call_id: str, body: JsonObject, *, keyed: bool) -> None:
        super().__init__(f"error frame for call {call_id}: {body}")
        self.call_id = call_id
        self.code = body.get("code")
        self.message = body.get("message")
        self.retryable = keyed and self.code == errors.INTERNAL


class ExecRefused(Exception):
    """The daemon answered an exec.* frame with an `error` frame (unknown_call, not_running …)."""

    def __init__(self, call_id: str, body: JsonObject) -> None:
        super().__init__(f"error frame for {call_id}: {body}")
        self.call_id = call_id
        self.code = body.get("code")
        self.message = body.get("message")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the daemon listens: `tcp` as (host, port), or `unix` as a path."""

    tcp: tuple[str, int] | None = None
    unix: str | None = None

    @classmethod
    def parse(cls, value: str) -> Endpoint:
        """"unix:/path" or "HOST:PORT" (as in listening.json)."""
        if value.startswith("unix:"):
            return cls(unix=value[len("unix:"):])
        return cls(tcp=parse_host_port(value))

    def __str__(self) -> str:
        return f"unix:{self.unix}" if self.unix is not None else self._host_port()

    def _host_port(self) -> str:
        assert self.tcp is not None, "an Endpoint has tcp or unix"
        return format_host_port(*self.tcp)

    async def open_stream(self) -> trio.SocketStream:
        if self.unix is not None:
            return await trio.open_unix_socket(self.unix)
        assert self.tcp is not None
        return await trio.open_tcp_stream(*self.tcp)

    @property
    def host_header(self) -> str:
        return "localhost" if self.unix is not None else self._host_port()


class UpgradeRejected(Exception):
    """The daemon answered the upgrade with an HTTP error instead of a 101."""

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.raw_body = body
        self.headers = headers
        try:
            self.body = json.loads(body) if body else None
        except ValueError:
            self.body = None
        super().__init__(f"upgrade rejected: {status} {self.error}")

    @property
    def error(self) -> str | None:
        return self.body.get("error") if isinstance(self.body, dict) else None

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.decode("latin-1").lower() == name.lower():
                return value.decode("latin-1")
        return None


class BootstrapRejected(Exception):
    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"bootstrap rejected: {code}: {message}")


def _find_rejection(exc: BaseException) -> trio_websocket.ConnectionRejected | None:
    if isinstance(exc, trio_websocket.ConnectionRejected):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_rejection(inner)
            if found is not None:
                return found
    return None


@asynccontextmanager
async def open_websocket(
    endpoint: Endpoint,
    path: str,
    headers: Iterable[tuple[str, str]],
    *,
    timeout: float = CONNECT_TIMEOUT_S,
) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """One WebSocket over TCP or unix, the same way for both; raises UpgradeRejected."""
    extra = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    connected = False
    try:
        async with trio.open_nursery() as nursery:
            stream = await endpoint.open_stream()
            try:
                with trio.fail_after(timeout):
                    ws = await trio_websocket.wrap_client_stream(
                        nursery,
                        stream,
                        endpoint.host_header,
                        path,
                        extra_headers=extra,
                        max_message_size=MAX_MESSAGE_BYTES,
                        receive_buffer_size=RECEIVE_BUFFER_BYTES,
                        message_queue_size=64,
                    )
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            connected = True
            try:
                yield ws
            finally:
                with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
                    scope.shield = True
                    await ws.aclose()
                nursery.cancel_scope.cancel()
    except BaseException as exc:
        # The library reports a rejection from its reader task, so it surfaces from the
        # nursery (in a group); the body's own exception is unwrapped for the caller.
        rejection = None if connected else _find_rejection(exc)
        if rejection is not None:
            raise UpgradeRejected(
                rejection.status_code, rejection.body or b"", list(rejection.headers or [])
            ) from None
        if isinstance(exc, BaseExceptionGroup):
            leaf = single_leaf(exc)
            if leaf is not None:
                raise leaf from None
        raise


def default_bootstrap_body(
    session_id: str, cwd: str, profile: str = "default", **extra: Any
) -> JsonObject:
    body: JsonObject = {
        "sessionId": session_id,
        "agent": {"cwd": cwd, "profile": profile},
        "repositories": [],
    }
    body.update(extra)
    return body


@dataclass
class SessionState:
    """What a control plane keeps about its session between connections."""

    generation: int = 0
    events: dict[int, JsonObject] = field(default_factory=dict)  # seq → frame, as stored
    acked: int = 0  # the highest seq acked to the daemon (it may have pruned up to there)
    # For each call sent: the highest seq stored when it was sent. Its result is journaled
    # after that, so an older result with the same call_id or key is not its answer.
    sent_after: dict[str, int] = field(default_factory=dict)

    @property
    def max_seq(self) -> int:
        return max(self.events, default=self.acked)

    @property
    def ack_floor(self) -> int:
        """The highest seq up to which every event is stored (what the client may ack)."""
        floor = self.acked
        while floor + 1 in self.events:
            floor += 1
        return floor

    def results(self) -> dict[str, JsonObject]:
        """tool.result bodies by call_id, from the stored events."""
        return {
            frame["body"]["call_id"]: frame["body"]
            for frame in self.events.values()
            if frame.get("kind") == "tool.result"
        }


class ControlClient:
    """Connects to one daemon on behalf of one session."""

    def __init__(
        self,
        endpoint: Endpoint,
        authority: LoopbackAuthority,
        *,
        sandbox_id: str,
        session_id: str = "session-1",
        session_sandbox_id: str = "session-sandbox-1",
        scope: str = ALL_SCOPES,
        path: str = DEFAULT_CONTROL_PATH,
    ) -> None:
        self.endpoint = endpoint
        self.authority = authority
        self.sandbox_id = sandbox_id
        self.session_id = session_id
        self.session_sandbox_id = session_sandbox_id
        self.scope = scope
        self.path = path
        self.state = SessionState()

    def routing_headers(
        self,
        *,
        generation: int,
        attempt_id: str,
        ack_floor: int,
        assertion: str | None,
    ) -> list[tuple[str, str]]:
        headers = [
            (H.SANDBOX_ID_HEADER, self.sandbox_id),
            (H.SESSION_ID_HEADER, self.session_id),
            (H.SESSION_SANDBOX_ID_HEADER, self.session_sandbox_id),
            (H.ATTEMPT_ID_HEADER, attempt_id),
            (H.GENERATION_HEADER, str(generation)),
            (H.EVENT_ACK_HEADER, str(ack_floor)),
        ]
        if assertion is not None:
            headers.append((H.AUTHORITY_HEADER, assertion))
        return headers

    def mint(self, *, generation: int, attempt_id: str, ack_floor: int, **claim_overrides: Any) -> str:
        claims = self.authority.claims_for(
            sandbox_id=self.sandbox_id,
            session_id=self.session_id,
            session_sandbox_id=self.session_sandbox_id,
            generation=generation,
            attempt_id=attempt_id,
            ack_floor=ack_floor,
            scope=self.scope,
            **claim_overrides,
        )
        return self.authority.mint(claims)

    @asynccontextmanager
    async def connect(
        self,
        *,
        generation: int | None = None,
        attempt_id: str | None = None,
        ack_floor: int | None = None,
        assertion: str | None | bool = True,
        header_overrides: dict[str, str | None] | None = None,
        claim_overrides: dict[str, Any] | None = None,
    ) -> AsyncIterator[ControlSession]:
        """Open a control socket. By default: the next generation, a fresh attempt id, the
        client's ack floor and a freshly minted assertion. `assertion=None` sends none;
        a string sends that token. `header_overrides` replaces (or with None removes) headers.
        """
        if generation is None:
            generation = self.state.generation + 1
        attempt_id = attempt_id or f"attempt-{uuid.uuid4()}"
        ack = self.state.ack_floor if ack_floor is None else ack_floor
        token: str | None
        if assertion is True:
            token = self.mint(
                generation=generation, attempt_id=attempt_id, ack_floor=ack, **(claim_overrides or {})
            )
        else:
            token = assertion or None
        headers = self.routing_headers(
            generation=generation, attempt_id=attempt_id, ack_floor=ack, assertion=token
        )
        if header_overrides:
            names = {name.lower() for name in header_overrides}
            headers = [(k, v) for k, v in headers if k.lower() not in names]
            headers += [(k, v) for k, v in header_overrides.items() if v is not None]
        self.state.generation = max(self.state.generation, generation)
        async with open_websocket(self.endpoint, self.path, headers) as ws:
            yield ControlSession(self, ws, generation, attempt_id)


def _read_request(call_id: str, stream: str, offset: int, length: int, binary: bool, request_id: str) -> JsonObject:
    body: JsonObject = {"call_id": call_id, "stream": stream, "offset": offset, "length": length, REQUEST_ID: request_id}
    if binary:
        body["format"] = "binary"
    return body


def _binary_page(raw: bytes) -> JsonObject:
    """A binary exec.output_page (docs/protocol.md §6.5.1), read as documented: a 4-byte
    big-endian header length, the JSON header, then exactly header.body.bytes bytes."""
    size = int.from_bytes(raw[:BINARY_HEADER_LENGTH_BYTES], "big")
    end = BINARY_HEADER_LENGTH_BYTES + size
    if len(raw) < end:
        raise UnexpectedMessage(f"a binary message shorter than its header length ({len(raw)} bytes)")
    try:
        frame = _object(json.loads(raw[BINARY_HEADER_LENGTH_BYTES:end]), "a binary page header")
    except ValueError as exc:
        raise UnexpectedMessage(f"a binary page header that is not JSON: {exc}") from None
    body = _object(frame.get("body"), "a binary page header's body")
    data = raw[end:]
    if frame.get("kind") != "exec.output_page" or body.get("bytes") != len(data):
        raise UnexpectedMessage(f"a binary message that is not an exec.output_page of its length: {frame!r}")
    return {**frame, "data": data}


def _without_request_id(body: object) -> JsonObject:
    return {name: value for name, value in _object(body, "a frame's body").items() if name != REQUEST_ID}


def _non_claiming(body: JsonObject) -> bool:
    return not body.get("ok") and body.get("error", {}).get("code") in NON_CLAIMING_CODES


class ControlSession:
    """One open control socket."""

    def __init__(
        self, client: ControlClient, ws: trio_websocket.WebSocketConnection, generation: int, attempt_id: str
    ) -> None:
        self.client = client
        self.ws = ws
        self.generation = generation
        self.attempt_id = attempt_id
        self.keys: dict[str, str] = {}  # call_id → idempotency key of the calls sent here
        self._request_numbers = itertools.count(1)
        # Answers that carry a request_id, kept from the moment they arrive until a helper
        # takes the one it asked for: whatever else was received meanwhile, none is lost.
        self.answers: dict[str, JsonObject] = {}

    def new_request_id(self) -> str:
        return f"r{next(self._request_numbers)}"

    async def answer(self, request_id: str, timeout: float = 10.0) -> JsonObject:
        """The answer (a frame, or a binary page as `receive` returns it) whose body echoes
        `request_id`: already received, or awaited."""
        with trio.fail_after(timeout):
            while request_id not in self.answers:
                await self.receive(timeout=timeout)
        return self.answers.pop(request_id)

    async def send(self, kind: str, body: JsonObject, *, generation: int | None = None) -> None:
        frame = {
            "kind": kind,
            "connectionGeneration": self.generation if generation is None else generation,
            "body": body,
        }
        await self.ws.send_message(json.dumps(frame, separators=(",", ":")))

    async def receive(self, timeout: float = 10.0) -> JsonObject:
        """The next frame; journaled events are stored in the client's session state.
        UnexpectedMessage when the message is not a JSON object, or a binary message that is
        not a binary exec.output_page. A binary page (docs/protocol.md §6.5.1) is returned as
        its header frame with the page's bytes under "data" (beside "kind" and "body")."""
        with trio.fail_after(timeout):
            raw = await self.ws.get_message()
        frame = _binary_page(raw) if isinstance(raw, bytes) else _object(json.loads(raw), "a frame")
        if isinstance(frame.get("seq"), int):
            self.client.state.events.setdefault(frame["seq"], frame)
        else:
            body = frame.get("body")
            if isinstance(body, dict) and isinstance(body.get(REQUEST_ID), str):
                self.answers[body[REQUEST_ID]] = frame
        return frame

    async def bootstrap(
        self, body: JsonObject | None = None, *, cwd: str | None = None
    ) -> JsonObject:
        """Send session.bootstrap; return runtime.state, or raise BootstrapRejected after
        sending the rejection receipt (close 4400) as the protocol asks."""
        if body is None:
            assert cwd is not None, "give a body or a cwd"
            body = default_bootstrap_body(self.client.session_id, cwd)
        await self.send("session.bootstrap", body)
        frame = await self.receive()
        if frame.get("kind") == "session.bootstrap.rejected":
            await self.ws.aclose(CLOSE_REJECTION_RECEIPT, REJECTION_RECEIPT_REASON)
            raise BootstrapRejected(frame["body"]["code"], frame["body"]["message"])
        if frame.get("kind") != "runtime.state":
            raise AssertionError(f"expected runtime.state, got {frame!r}")
        # The daemon's floor is what was acked before (perhaps by another instance of this
        # control plane): those events are pruned, so this client's floor starts there.
        state = self.client.state
        state.acked = max(state.acked, frame["body"].get("ackFloor", 0))
        return frame

    async def ack(self, seq: int | None = None) -> None:
        seq = self.client.state.ack_floor if seq is None else seq
        await self.send("events.ack", {"seq": seq})
        self.client.state.acked = max(self.client.state.acked, seq)

    async def call(
        self,
        tool_name: str,
        parameters: JsonObject,
        *,
        idempotency_key: str | None = None,
        call_id: str | None = None,
    ) -> str:
        """Send a tool.call; returns its call_id."""
        call_id = call_id or str(uuid.uuid4())
        body: dict[str, Any] = {"tool_name": tool_name, "call_id": call_id, "parameters": parameters}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        self.client.state.sent_after[call_id] = self.client.state.max_seq
        await self.send("tool.call", body)
        if idempotency_key is not None:
            self.keys[call_id] = idempotency_key
        return call_id

    # --- held processes (docs/protocol.md §7.7) -------------------------------------------

    async def write_stdin(self, call_id: str, offset: int, data: bytes, timeout: float = 10.0) -> JsonObject:
        """exec.write_stdin; the exec.stdin_ack body (`next_offset`: where to go on from).
        Raises ExecRefused when the daemon answers with an `error` frame."""
        request_id = self.new_request_id()
        body = {"call_id": call_id, "offset": offset, "data": base64.b64encode(data).decode("ascii"), REQUEST_ID: request_id}
        await self.send("exec.write_stdin", body)
        return await self._exec_answer(request_id, call_id, "exec.stdin_ack", timeout)

    async def close_stdin(self, call_id: str, offset: int, timeout: float = 10.0) -> JsonObject:
        """exec.close_stdin once every byte below `offset` is written; the exec.stdin_ack body."""
        request_id = self.new_request_id()
        await self.send("exec.close_stdin", {"call_id": call_id, "offset": offset, REQUEST_ID: request_id})
        return await self._exec_answer(request_id, call_id, "exec.stdin_ack", timeout)

    async def _exec_answer(self, request_id: str, call_id: str, kind: str, timeout: float) -> JsonObject:
        """The answer to one exec.* request: its body, or ExecRefused for an error frame.
        The body comes without the echoed request_id: that was this helper's bookkeeping."""
        return _without_request_id((await self._exec_frame(request_id, call_id, kind, timeout))["body"])

    async def _exec_frame(self, request_id: str, call_id: str, kind: str, timeout: float) -> JsonObject:
        frame = await self.answer(request_id, timeout)
        if frame.get("kind") == "error":
            raise ExecRefused(call_id, _without_request_id(frame["body"]))
        if frame.get("kind") != kind:
            raise UnexpectedMessage(f"{frame.get('kind')!r} answered a request that {kind} answers")
        return frame

    async def exec_completed(self, call_id: str, timeout: float = 10.0) -> JsonObject:
        """The exec.completed body of a command or held process: already received, or awaited."""

        def stored() -> JsonObject | None:
            for frame in self.client.state.events.values():
                body = _object(frame.get("body", {}), "a frame's body")
                if frame.get("kind") == "exec.completed" and body.get("call_id") == call_id:
                    return body
            return None

        with trio.fail_after(timeout):
            while (body := stored()) is None:
                await self.receive(timeout=timeout)
        return body

    async def read_output(
        self, call_id: str, stream: str, offset: int, length: int, *, binary: bool = False, timeout: float = 10.0
    ) -> tuple[JsonObject, bytes]:
        """One exec.read_output: the page's body and its bytes (decoded from base64 for a
        JSON page). Raises ExecRefused when the answer is an error frame."""
        request_id = self.new_request_id()
        await self.send("exec.read_output", _read_request(call_id, stream, offset, length, binary, request_id))
        return await self._page(request_id, call_id, timeout)

    async def read_stream(
        self,
        call_id: str,
        stream: str = "stdout",
        *,
        page_length: int = BINARY_PAGE_LENGTH,
        in_flight: int = PAGES_IN_FLIGHT,
        binary: bool = True,
        timeout: float = 10.0,
    ) -> tuple[bytes, JsonObject]:
        """A whole stream from offset 0 to its end (`eof`), with up to `in_flight` requests
        outstanding at the offsets that follow one another; the bytes and the last page's
        body. Meant for an ended stream: while the command still writes, a short page makes
        it ask again from where the bytes stop (polling until `timeout`). Raises
        ExecRefused when the daemon answers with an error frame."""
        data = bytearray()
        next_offset = 0
        outstanding: list[str] = []  # the request ids in flight, oldest first
        with trio.fail_after(timeout):
            while True:
                while len(outstanding) < in_flight:
                    request_id = self.new_request_id()
                    await self.send(
                        "exec.read_output", _read_request(call_id, stream, next_offset, page_length, binary, request_id)
                    )
                    next_offset += page_length
                    outstanding.append(request_id)
                body, page = await self._page(outstanding.pop(0), call_id, timeout)
                if body["offset"] != len(data):
                    raise UnexpectedMessage(f"a page at offset {body['offset']} where {len(data)} was next")
                data += page
                if body["eof"] or len(page) < page_length:
                    # The answers to requests past the end are dropped; a stream still
                    # growing is asked again from where its bytes stop.
                    while outstanding:
                        await self._page(outstanding.pop(0), call_id, timeout)
                    if body["eof"]:
                        return bytes(data), body
                    next_offset = len(data)

    async def _page(self, request_id: str, call_id: str, timeout: float) -> tuple[JsonObject, bytes]:
        frame = await self._exec_frame(request_id, call_id, "exec.output_page", timeout)
        body = _without_request_id(frame["body"])
        data = frame["data"] if "data" in frame else base64.b64decode(body["data"], validate=True)
        return body, data

    async def list_processes(self, timeout: float = 10.0) -> list[JsonObject]:
        """exec.list; the processes of exec.processes."""
        request_id = self.new_request_id()
        await self.send("exec.list", {REQUEST_ID: request_id})
        frame = await self.answer(request_id, timeout)
        if frame.get("kind") != "exec.processes":
            raise UnexpectedMessage(f"{frame.get('kind')!r} answered exec.list")
        processes = _object(frame["body"], "a frame's body").get("processes")
        assert isinstance(processes, list)
        return [_object(p, "a process") for p in processes]

    async def receive_until(
        self, predicate: Callable[[JsonObject], bool], timeout: float = 10.0
    ) -> JsonObject:
        """Receive (storing events) until a frame satisfies `predicate`; return it."""
        with trio.fail_after(timeout):
            while True:
                frame = await self.receive(timeout=timeout)
                if predicate(frame):
                    return frame

    async def result(self, call_id: str, timeout: float = 10.0) -> JsonObject:
        """The outcome of a call: its tool.result body, or the original one carried by a
        tool.replayed. After a tool.pending the result of the first execution (same
        idempotency key, the first call's call_id) is awaited. Raises CallNotAnswered when
        the daemon answers the call with an `error` frame."""
        key = self.keys.get(call_id)
        after = self.client.state.sent_after.get(call_id, -1)
        pending = False  # set by a tool.pending: then the first execution's result answers

        def stored() -> JsonObject | None:
            for seq, frame in sorted(self.client.state.events.items()):
                body = _object(frame.get("body", {}), "a frame's body")
                if frame.get("kind") != "tool.result" or seq <= after:
                    continue  # journaled before this call was sent: another call's answer
                if body.get("call_id") == call_id:
                    return body
                if pending and body.get("idempotency_key") == key and not _non_claiming(body):
                    return body
            return None

        found = stored()
        if found is not None:
            return found
        with trio.fail_after(timeout):
            while True:
                frame = await self.receive(timeout=timeout)
                kind, body = frame.get("kind"), _object(frame.get("body", {}), "a frame's body")
                if kind == "tool.replayed" and body.get("call_id") == call_id:
                    original = _object(body.get("original"), "tool.replayed original")
                    return _object(original.get("body"), "tool.replayed original body")
                if kind == "tool.pending" and body.get("call_id") == call_id:
                    pending = True
                # An error about the tool.call itself (exec.* frames for the same call get
                # their own errors, such as not_running, which do not end the wait).
                if kind == "error" and body.get("call_id") == call_id and (
                    body.get("code") in FRAME_ERRORS or body.get("code") in (errors.INTERNAL, errors.JOURNAL_FULL)
                ):
                    raise CallNotAnswered(call_id, body, keyed=key is not None)
                if kind in ("tool.result", "tool.pending"):
                    found = stored()
                    if found is not None:
                        return found

    async def call_and_wait(
        self,
        tool_name: str,
        parameters: JsonObject,
        *,
        idempotency_key: str | None = None,
        call_id: str | None = None,
    ) -> JsonObject:
        """Call and wait for the outcome. When the daemon could not record the call or its
        result (a full disk, say) and the call has a key, send it again with the same key,
        as docs/protocol.md §8 says a control plane should: the call still runs at most once."""
        for attempt in range(RECORD_RETRIES + 1):
            sent = await self.call(
                tool_name, parameters, idempotency_key=idempotency_key, call_id=call_id
            )
            try:
                return await self.result(sent)
            except CallNotAnswered as refused:
                if not refused.retryable or attempt == RECORD_RETRIES:
                    raise
            # A retry is a new call with the same key: under the old call_id the daemon may
            # still journal the first call's own result (a refusal that freed the key).
            call_id = None
            await trio.sleep(RECORD_RETRY_DELAY_S)
        raise AssertionError("unreachable")

    async def closed_reason(self, timeout: float = 10.0) -> trio_websocket.CloseReason:
        """Wait until the daemon closes the socket; return its code and reason."""
        with trio.fail_after(timeout):
            try:
                while True:
                    await self.ws.get_message()
            except trio_websocket.ConnectionClosed as exc:
                # None only before a close; trio-websocket records the reason, then raises.
                assert exc.reason is not None
                return exc.reason


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.decode("latin-1").lower() == name.lower():
                return value.decode("latin-1")
        return None


async def http_request(
    endpoint: Endpoint,
    method: str,
    path: str,
    headers: Iterable[tuple[str, str]] = (),
    *,
    timeout: float = CONNECT_TIMEOUT_S,
) -> HttpResponse:
    """A plain HTTP/1.1 request on its own connection (health, 404, 426, raw gate checks)."""
    conn = h11.Connection(h11.CLIENT)
    all_headers = [("host", endpoint.host_header), *headers]
    with trio.fail_after(timeout):
        stream = await endpoint.open_stream()
        try:
            await stream.send_all(
                conn.send(h11.Request(method=method, target=path, headers=all_headers))
                + conn.send(h11.EndOfMessage())
            )
            response = None
            body = bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                    continue
                if isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            assert response is not None
            return HttpResponse(response.status_code, list(response.headers), bytes(body))
        finally:
            await trio.aclose_forcefully(stream)
