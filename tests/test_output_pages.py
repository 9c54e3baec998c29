"""Binary exec.output_page (docs/protocol.md §6.5.1) through a real daemon: what a client that
asks for `"format": "binary"` gets is the spool's bytes exactly, at the offsets it asked for;
a client that does not ask gets JSON pages as before; bad requests get typed errors."""

from __future__ import annotations

import uuid

import pytest
import trio
import trio.testing

from sandbox_supervisor.daemon.runtime.spool import stream_path
from sandbox_supervisor.daemon.session.sender import REPLY_QUEUE_MAX_CHARS, SocketSender
from sandbox_supervisor.protocol.frames import (
    MAX_BINARY_OUTPUT_PAGE_LENGTH,
    MAX_OUTPUT_PAGE_LENGTH,
    ExecOutputPageHeaderBody,
    FrameError,
    decode_binary_page,
    encode_binary_page,
)
from sandbox_supervisor.testing.client import ExecRefused

# Every byte value, then more than one large page of a pattern: a page boundary falls inside
# it whatever the page length, and bytes that are not UTF-8 must pass untouched.
COMMAND = "printf \"$(printf '\\\\%03o' $(seq 0 255))\"; head -c 1500000 /dev/urandom"
TOTAL = 256 + 1_500_000


async def _finished_command(session) -> str:
    call_id = await session.call("execute_shell_command", {"command": COMMAND}, idempotency_key=f"k-{uuid.uuid4()}")
    result = await session.result(call_id, timeout=30)
    assert result["ok"] is True and result["result"]["stdout"]["bytes"] == TOTAL, result
    return call_id


def _spooled(daemon, call_id: str) -> bytes:
    return stream_path(daemon.layout.state_dir, call_id, "stdout").read_bytes()


async def test_binary_pages_are_the_spool_bytes_at_exact_offsets(daemon, session):
    call_id = await _finished_command(session)
    spooled = _spooled(daemon, call_id)
    assert len(spooled) == TOTAL and spooled[:256] == bytes(range(256))
    # One page at an odd offset and length: exactly those bytes, the offset echoed.
    body, data = await session.read_output(call_id, "stdout", 255, 70_001, binary=True)
    assert data == spooled[255 : 255 + 70_001]
    assert body == {
        "call_id": call_id, "stream": "stdout", "offset": 255, "bytes": 70_001, "eof": False, "truncated": False,
    }
    # The whole stream in the largest pages, several in flight: byte for byte, eof at the end.
    whole, last = await session.read_stream(call_id, "stdout", page_length=MAX_BINARY_OUTPUT_PAGE_LENGTH, in_flight=3)
    assert whole == spooled
    assert last["eof"] is True and last["offset"] + last["bytes"] == TOTAL
    # At and past the end: empty pages, eof.
    for offset in (TOTAL, TOTAL + 10):
        body, data = await session.read_output(call_id, "stdout", offset, 10, binary=True)
        assert (data, body["bytes"], body["eof"]) == (b"", 0, True)


async def test_a_client_that_does_not_ask_gets_json_pages_as_before(daemon, session):
    call_id = await _finished_command(session)
    spooled = _spooled(daemon, call_id)
    await session.send("exec.read_output", {"call_id": call_id, "stream": "stdout", "offset": 100, "length": 1000})
    with trio.fail_after(10):
        raw = await session.ws.get_message()
    assert isinstance(raw, str)  # a text message, the JSON page of §6.5
    whole, last = await session.read_stream(call_id, "stdout", page_length=MAX_OUTPUT_PAGE_LENGTH, in_flight=8, binary=False)
    assert whole == spooled and last["eof"] is True
    assert "data" in last and "bytes" not in last


async def test_binary_pages_of_a_stream_still_written(session):
    call_id = await session.call(
        "execute_shell_command", {"command": "printf 'partial'; sleep 30"}, idempotency_key="running"
    )
    await session.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == call_id)
    body, data = await session.read_output(call_id, "stdout", 2, MAX_BINARY_OUTPUT_PAGE_LENGTH, binary=True)
    assert data == b"rtial" and body["eof"] is False  # still running: more may come
    await session.send("exec.signal", {"call_id": call_id, "signal": "SIGKILL"})
    assert (await session.result(call_id))["result"]["signal"] == "SIGKILL"


@pytest.mark.parametrize(
    "change",
    [
        {"format": "binary", "length": MAX_BINARY_OUTPUT_PAGE_LENGTH + 1},
        {"length": MAX_OUTPUT_PAGE_LENGTH + 1},  # a JSON page keeps its limit
        {"format": "json", "length": MAX_OUTPUT_PAGE_LENGTH + 1},
        {"format": "base64"},
        {"format": "binary", "length": 0},
    ],
)
async def test_bad_page_requests_get_invalid_frame_naming_the_call(session, change):
    call_id = str(uuid.uuid4())
    request = {"call_id": call_id, "stream": "stdout", "offset": 0, "length": 10, **change}
    await session.send("exec.read_output", request)
    frame = await session.receive_until(lambda f: f["kind"] in ("error", "exec.output_page"))
    assert frame["kind"] == "error"
    assert (frame["body"]["code"], frame["body"]["call_id"]) == ("invalid_frame", call_id)


async def test_a_binary_request_for_an_unknown_call_gets_a_json_error(session):
    call_id = str(uuid.uuid4())
    with pytest.raises(ExecRefused) as refused:
        await session.read_output(call_id, "stdout", 0, 10, binary=True)
    assert (refused.value.code, refused.value.call_id) == ("unknown_call", call_id)


def test_binary_page_encoding_round_trips_and_refuses_what_is_not_a_page():
    body = ExecOutputPageHeaderBody(
        call_id=str(uuid.uuid4()), stream="stderr", offset=7, bytes=3, eof=True, truncated=False
    )
    message = encode_binary_page(body, b"\x00\xff\n")
    header, data = decode_binary_page(message)
    assert (header.kind, header.body, data) == ("exec.output_page", body, b"\x00\xff\n")
    with pytest.raises(ValueError):
        encode_binary_page(body, b"four")  # the header must say how many bytes follow
    for broken in (message[:10], message + b"x", message[:-1], b"\x00\x00\x00\x02{}"):
        with pytest.raises(FrameError):
            decode_binary_page(broken)


class _HeldSocket:
    """A WebSocket whose writes wait until released: the reply queue fills up behind it. It
    has what the sender writes with (`send_messages`; nothing is ever left in its carry), and
    records what was written."""

    carrying = False

    def __init__(self) -> None:
        self.sent: list[str | bytes] = []
        self.release = trio.Event()

    async def send_messages(self, texts: list[str | bytes], **_: object) -> None:
        await self.release.wait()
        self.sent.extend(texts)


class _NoJournal:
    last_seq = 0
    pruned_through = 0

    def subscribe(self, wake) -> None: ...

    def unsubscribe(self, wake) -> None: ...


async def test_the_reply_queue_holds_a_bounded_number_of_bytes():
    ws = _HeldSocket()
    sender = SocketSender(ws, _NoJournal(), 0)  # type: ignore[arg-type]
    page = b"x" * MAX_BINARY_OUTPUT_PAGE_LENGTH
    fits = REPLY_QUEUE_MAX_CHARS // len(page)
    queued = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.run)

        async def produce() -> None:
            nonlocal queued
            for _ in range(fits + 3):
                await sender.reply(page)
                queued += 1

        nursery.start_soon(produce)
        await trio.testing.wait_all_tasks_blocked()
        # One page is being sent (held), `fits` wait in the queue; the next reply waits.
        assert queued == fits + 1
        ws.release.set()
        with trio.fail_after(10):
            while len(ws.sent) < fits + 3:
                await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert ws.sent == [page] * (fits + 3)
