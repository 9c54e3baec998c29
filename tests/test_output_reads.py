"""The output path's costs per read and per page, held to their behaviour: a command's pipe is
read a pipeful at a time into one reused buffer whose bytes are never another stream's, and a
large binary message is written as its frame header and its own bytes, framed as wsproto
frames it."""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path

import pytest
import trio
import wsproto.frame_protocol

from sandbox_supervisor.daemon.runtime.command_output import CommandOutput, OutputLimits, StreamOutput
from sandbox_supervisor.daemon.runtime.holder import OUTPUT_PIPE_BYTES
from sandbox_supervisor.daemon.runtime.output import LiveOutput
from sandbox_supervisor.daemon.runtime.spool import SpoolWriter, stream_path
from sandbox_supervisor.daemon.websocket import LARGE_MESSAGE_BYTES
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.store import StateStore
from tests.ws_support import server_websocket_pair

DEADLINE_S = 10
POLL_S = 0.001
LIMITS = OutputLimits(throttle_ms=10, max_chunk_bytes=4096, buffer_bytes=65536, spool_max_bytes=1 << 24)


class Counter:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def output_spooled(self, nbytes: int) -> None:
        self.calls.append(nbytes)


def full_pipe(content: bytes) -> tuple[trio.lowlevel.FdStream, int]:
    """A pipe of exactly len(content) bytes holding `content`: (its read end, its write end)."""
    read_fd, write_fd = os.pipe()
    assert fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, len(content)) == len(content)
    assert os.write(write_fd, content) == len(content)
    return trio.lowlevel.FdStream(read_fd), write_fd


def spooled(state_dir: Path, call_id: str, name: str) -> bytes:
    return stream_path(state_dir, call_id, name).read_bytes()


async def test_a_full_pipe_is_read_in_one_read_per_stream_and_each_keeps_its_own_bytes(tmp_path):
    """The pipes holder.open_stdio makes hold OUTPUT_PIPE_BYTES: one read takes all of it."""
    with StateStore.open(tmp_path / "state") as store:
        state_dir = store.path.parent
        counter = Counter()
        output = CommandOutput.open(state_dir, str(uuid.uuid4()), LIMITS, Journal(store), counter)
        out = bytes(range(256)) * (OUTPUT_PIPE_BYTES // 256)
        err = b"e" * OUTPUT_PIPE_BYTES
        (stdout, out_w), (stderr, err_w) = full_pipe(out), full_pipe(err)
        os.close(out_w)
        os.close(err_w)
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(output.pump, {"stdout": stdout, "stderr": stderr})
                await output.closed.wait()
                output.complete()
        assert counter.calls == [OUTPUT_PIPE_BYTES, OUTPUT_PIPE_BYTES]
        assert spooled(state_dir, output.call_id, "stdout") == out
        assert spooled(state_dir, output.call_id, "stderr") == err
        assert output.summary_body("stdout")["bytes"] == output.summary_body("stderr")["bytes"] == OUTPUT_PIPE_BYTES
        assert output.summary_body("stderr")["tail"] == "e" * 8192


class HeldPrune:
    """Stands in for a SpoolBudget whose prune is slow: while stdout's reader waits for it,
    stderr's reader reads (into the same buffer)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.limit = self.prune_at = 1  # any read asks for a prune
        self.waiting = trio.Event()
        self.release = trio.Event()

    async def prune(self, keep: set[str] | None = None, *, need: int = 0) -> None:
        self.waiting.set()
        await self.release.wait()
        self.limit = self.prune_at = 1 << 40  # room made


async def test_a_read_that_waits_for_a_prune_keeps_its_bytes_while_another_stream_reads(tmp_path):
    """The one await between a read and its use of the buffer: the bytes are copied first."""
    with StateStore.open(tmp_path / "state") as store:
        state_dir = store.path.parent
        call_id = str(uuid.uuid4())
        budget = HeldPrune()
        streams = {
            name: StreamOutput(
                SpoolWriter(stream_path(state_dir, call_id, name), 1 << 24),
                LiveOutput(10, 4096, 65536),
                budget=budget if name == "stdout" else None,  # type: ignore[arg-type]
            )
            for name in ("stdout", "stderr")
        }
        output = CommandOutput(call_id, streams, Journal(store))  # type: ignore[arg-type]
        out, err = b"o" * 4096, b"e" * 4096
        stdout, out_w = full_pipe(out)
        stderr_r, err_w = os.pipe()
        stderr = trio.lowlevel.FdStream(stderr_r)
        os.close(out_w)
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(output.pump, {"stdout": stdout, "stderr": stderr})
                await budget.waiting.wait()  # stdout's bytes are read, their prune waits
                os.write(err_w, err)
                os.close(err_w)
                while not streams["stderr"].closed:  # stderr read and ended meanwhile
                    await trio.sleep(POLL_S)
                budget.release.set()
                await output.closed.wait()
                output.complete()
        assert spooled(state_dir, call_id, "stdout") == out
        assert spooled(state_dir, call_id, "stderr") == err
        assert output.summary_body("stdout")["head"] == "o" * 4096


async def with_pair(body) -> None:
    """A real WebSocket over loopback TCP; `body(server_ws, client_ws)` with the server's
    stream's writes recorded (`server_ws.writes`)."""
    async with server_websocket_pair() as (ws, recorded, client):
        ws.writes = recorded.writes
        with trio.fail_after(DEADLINE_S):
            await body(ws, client)


@pytest.mark.parametrize("size", [LARGE_MESSAGE_BYTES, 1 << 20])
async def test_a_large_binary_message_goes_out_as_its_header_and_its_own_bytes(size):
    page = os.urandom(size)
    texts = ['{"kind":"before"}', page, '{"kind":"after"}']

    async def body(ws, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.send_messages, texts)
            received = [await client.get_message() for _ in texts]
        assert received == texts
        # The page itself was written, not a copy; the text before it went first.
        index = next(i for i, data in enumerate(ws.writes) if data is page)
        header = ws.writes[index - 1]
        # Byte for byte what wsproto would have framed.
        framed = wsproto.frame_protocol.FrameProtocol(client=False, extensions=[]).send_data(page, True)
        assert bytes(header) + page == bytes(framed)
        assert json.loads(received[2]) == {"kind": "after"}

    await with_pair(body)


@pytest.mark.parametrize("size", [100, LARGE_MESSAGE_BYTES, (1 << 20) - 4096])  # the client takes up to 1 MiB
async def test_a_binary_page_in_two_parts_goes_out_unjoined_and_arrives_as_one_message(size):
    """A binary exec.output_page is handed over as (its header, its bytes): on the wire one
    binary message, byte for byte what wsproto frames for the joined page; a large page's
    bytes are written as themselves (never copied into a joined buffer)."""
    from sandbox_supervisor.protocol.frames import ExecOutputPageHeaderBody, binary_page_parts, encode_binary_page

    data = os.urandom(size)
    body = ExecOutputPageHeaderBody(
        call_id=str(uuid.uuid4()), stream="stdout", offset=0, bytes=size, eof=True, truncated=False
    )
    parts = binary_page_parts(body, data)
    joined = encode_binary_page(body, data)
    assert parts[0] + parts[1] == joined

    async def body_(ws, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.send_messages, ['{"kind":"before"}', parts, '{"kind":"after"}'])
            received = [await client.get_message() for _ in range(3)]
        assert received == ['{"kind":"before"}', joined, '{"kind":"after"}']
        framer = wsproto.frame_protocol.FrameProtocol(client=False, extensions=[])
        wire = b"".join(bytes(w) for w in ws.writes)
        assert bytes(framer.send_data(joined, True)) in wire
        if size >= LARGE_MESSAGE_BYTES:
            assert any(w is data for w in ws.writes)  # the page's bytes, written as themselves

    await with_pair(body_)
