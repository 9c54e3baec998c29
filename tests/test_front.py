"""Listeners, plain HTTP routes, WebSocket limits and liveness, over real sockets."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import sqlite3
import stat
import struct

import pytest
import trio
from hypothesis import event, given
from hypothesis import strategies as st

from sandbox_supervisor.daemon.edge.http_front import (
    HeadReader,
    HeadTooLarge,
    MalformedHead,
    Route,
    RoutePaths,
    classify,
)
from sandbox_supervisor.daemon.edge.server import FIRST_LINE_TIMEOUT_S
from sandbox_supervisor.daemon.state.store import DB_FILENAME
from sandbox_supervisor.daemon.runtime.shell import STOPPING_MESSAGE
from sandbox_supervisor.testing.client import Endpoint, UpgradeRejected, http_request
from sandbox_supervisor.testing.daemon import DaemonExitedEarly, in_process_daemon, make_layout, running_daemon
from sandbox_supervisor.testing.fuzzing import fuzz_settings
from test_preauth import FromLegitHost

MAX_MESSAGE = 128 * 1024


def endpoint_of(daemon, transport):
    return daemon.tcp if transport == "tcp" else daemon.unix


async def test_health_fields_and_no_session_data(daemon, transport):
    endpoint = endpoint_of(daemon, transport)
    response = await http_request(endpoint, "GET", "/healthz")
    assert response.status == 200
    body = response.json()
    assert set(body) == {"status", "version", "bound", "uptimeS", "privilegeSeparation", "isolation"}
    assert set(body["isolation"]) == {"mode", "memoryMax", "pidsMax"}
    assert body["status"] == "ok" and body["bound"] is False
    assert body["privilegeSeparation"] is False  # no [exec] user: commands run as the daemon
    assert isinstance(body["uptimeS"], int)
    async with daemon.client(endpoint).connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
    response = await http_request(endpoint, "GET", "/healthz")
    assert response.json()["bound"] is True
    text = response.body.decode()
    for secret in ("session-1", daemon.layout.sandbox_id, str(daemon.layout.root)):
        assert secret not in text


async def test_a_real_sigterm_drains_health_upgrades_and_new_commands(tmp_path, authority):
    """SIGTERM to the daemon while a command ignores SIGTERM: until the kill grace ends the
    command, /healthz says draining (503), an upgrade is refused 503 draining, and a new
    command on the still open socket is refused `supervisor_stopping` with its key freed."""
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": 4000})
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            stubborn = await session.call(
                "execute_shell_command", {"command": "trap '' TERM; echo up; sleep 30"}, idempotency_key="stubborn"
            )
            await session.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == stubborn)
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                while (health := await http_request(running.tcp, "GET", "/healthz")).status == 200:
                    await trio.sleep(0.02)
            assert (health.status, health.json()["status"]) == (503, "draining")
            with pytest.raises(UpgradeRejected) as upgrade:
                async with running.client().connect(generation=2):
                    pass
            assert (upgrade.value.status, upgrade.value.error) == (503, "draining")
            refused = await session.call_and_wait(
                "execute_shell_command", {"command": "echo never"}, idempotency_key="late"
            )
            assert refused["ok"] is False and refused["error"] == {"code": "supervisor_stopping", "message": STOPPING_MESSAGE}
        assert await process.wait(timeout=15) == 0
    conn = sqlite3.connect(layout.state_dir / DB_FILENAME)
    try:  # the refused command's key was freed with its result (a later retry may run)
        assert conn.execute("SELECT COUNT(*) FROM idempotency WHERE key = 'late'").fetchone()[0] == 0
    finally:
        conn.close()


@pytest.mark.parametrize(
    "method, path",
    [("GET", "/"), ("GET", "/nope"), ("POST", "/healthz"), ("POST", "/v1/control"), ("GET", "/metrics")],
)
async def test_other_routes_are_404(daemon, transport, method, path):
    response = await http_request(endpoint_of(daemon, transport), method, path)
    assert response.status == 404
    assert response.json()["error"] == "not_found"


async def test_control_path_without_upgrade_is_426(daemon, transport):
    response = await http_request(endpoint_of(daemon, transport), "GET", "/v1/control")
    assert response.status == 426
    assert response.json()["error"] == "upgrade_required"


async def test_unix_socket_mode_and_stale_path(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    # A stale socket node left by a crashed instance is replaced at start.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(layout.unix_socket))
    stale.close()
    async with in_process_daemon(layout) as daemon:
        mode = stat.S_IMODE(os.stat(layout.unix_socket).st_mode)
        assert mode == 0o600
        assert (await http_request(daemon.unix, "GET", "/healthz")).status == 200
        listening = json.loads((layout.state_dir / "listening.json").read_text())
        assert listening["unix"] == [str(layout.unix_socket)]
        host, port = listening["tcp"][0].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    # Removed on a clean exit.
    assert not layout.unix_socket.exists()


async def test_a_unix_path_in_use_is_refused_not_taken_over(tmp_path, authority):
    """A second daemon configured with the first one's unix socket path must not delete the
    live socket and bind its own (cutting the first off); it fails to start, and the first
    keeps its socket."""
    first = make_layout(tmp_path / "one", authority=authority)
    second = make_layout(tmp_path / "two", authority=authority, listen={"unix": [str(first.unix_socket)]})
    async with in_process_daemon(first) as daemon:
        before = os.stat(first.unix_socket).st_ino
        with pytest.raises(DaemonExitedEarly) as exited:
            async with running_daemon(second):
                pass
        assert exited.value.returncode == 1 and "in use" in exited.value.log
        assert os.stat(first.unix_socket).st_ino == before
        assert (await http_request(daemon.unix, "GET", "/healthz")).status == 200


async def test_a_unix_path_whose_listener_cannot_be_reached_is_not_taken_over(tmp_path, authority):
    """A listener with a full backlog answers a probe with EAGAIN, not a refusal: it may be
    serving, so the daemon refuses to start rather than delete its socket."""
    path = tmp_path / "busy.sock"
    owner = socket.socket(socket.AF_UNIX)
    owner.bind(str(path))
    owner.listen(0)
    waiting = []
    try:
        while True:  # fill the backlog
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            waiting.append(client)
            try:
                client.connect(str(path))
            except BlockingIOError:
                break
        layout = make_layout(tmp_path / "d", authority=authority, listen={"unix": [str(path)]})
        with pytest.raises(DaemonExitedEarly) as exited:
            async with running_daemon(layout):
                pass
        assert exited.value.returncode == 1 and "may be in use" in exited.value.log
        assert path.is_socket()
    finally:
        for client in waiting:
            client.close()
        owner.close()


async def test_a_unix_socket_given_with_a_non_canonical_path_is_removed_at_exit(tmp_path, authority):
    spelled = str(tmp_path) + "//run/./x.sock"  # the same file as tmp_path/run/x.sock
    (tmp_path / "run").mkdir()
    layout = make_layout(tmp_path / "d", authority=authority, listen={"unix": [spelled]})
    async with in_process_daemon(layout):
        assert (tmp_path / "run" / "x.sock").is_socket()
    assert not (tmp_path / "run" / "x.sock").exists()


# --- WebSocket frame limits ---------------------------------------------------------------


async def _bootstrapped(daemon, endpoint):
    client = daemon.client(endpoint)
    return client


async def test_message_of_exactly_max_size_is_accepted(daemon, transport):
    async with daemon.client(endpoint_of(daemon, transport)).connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        prefix = '{"kind":"events.ack","connectionGeneration":1,"body":{"seq":0},"pad":"'
        message = prefix + "x" * (MAX_MESSAGE - len(prefix) - 2) + '"}'
        assert len(message.encode()) == MAX_MESSAGE
        await session.ws.send_message(message)
        frame = await session.receive()
        assert frame["kind"] == "error" and frame["body"]["code"] == "invalid_frame"


async def test_message_one_byte_over_closes_1009(daemon, transport):
    async with daemon.client(endpoint_of(daemon, transport)).connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        await session.ws.send_message("x" * (MAX_MESSAGE + 1))
        reason = await session.closed_reason()
    assert reason.code == 1009


async def test_the_log_names_the_close_the_websocket_library_made(tmp_path, authority):
    """trio-websocket closes an oversized message with 1009 itself; socket.closed must say
    1009 and its reason, not the default close the daemon would have sent."""
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await session.ws.send_message("x" * (MAX_MESSAGE + 1))
            assert (await session.closed_reason()).code == 1009
        with trio.fail_after(10):
            while not (closed := [e for e in process.log_events() if e.get("event") == "socket.closed"]):
                await trio.sleep(0.02)
    assert process.returncode == 0
    assert (closed[0]["code"], closed[0]["reason"]) == (1009, "Exceeded maximum message size: 131072 bytes")


async def test_connections_ending_every_way_leave_no_crash_in_the_log(tmp_path, authority):
    """Closed sockets report -1 as their descriptor; a reader waiting on one once poisoned
    trio's registrations, and every later connection crashed at its close with a logged
    traceback (supervisor/fd_wait.py). Ends here: the client's close, a newer connection
    superseding, the peer vanishing without a close, on TCP and unix, several times each."""
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client()
        ended = 0
        for endpoint in (running.tcp, running.unix):
            state, client = client.state, running.client(endpoint)
            client.state = state  # one control plane's generations, over either listener
            for _ in range(3):
                async with client.connect() as session:  # closed by the client, 1000
                    await session.bootstrap(cwd=str(layout.workspace))
                ended += 1
            async with client.connect() as old:
                await old.bootstrap(cwd=str(layout.workspace))
                async with client.connect() as new:  # supersedes `old`
                    await new.bootstrap(cwd=str(layout.workspace))
                    assert (await old.closed_reason()).code != 1000
                ended += 2
            for _ in range(2):
                async with client.connect() as session:  # the peer vanishes: no close frame
                    await session.bootstrap(cwd=str(layout.workspace))
                    await trio.aclose_forcefully(session.ws._stream)
                ended += 1
        with trio.fail_after(10):
            while len([e for e in process.log_events() if e.get("event") == "socket.closed"]) < ended:
                await trio.sleep(0.02)
        # A last connection after all of them still works.
        async with client.connect() as session:
            assert (await session.bootstrap(cwd=str(layout.workspace)))["kind"] == "runtime.state"
    errors = [e for e in process.log_events() if e.get("level") == "error"]
    assert errors == []


async def test_binary_frame_after_bootstrap_closes_1003(daemon, transport):
    async with daemon.client(endpoint_of(daemon, transport)).connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        await session.ws.send_message(b"binary")
        reason = await session.closed_reason()
    assert reason.code == 1003


async def test_bad_frames_after_bootstrap_keep_socket_usable(daemon):
    async with daemon.client().connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        for raw, code in [
            ("[]", "invalid_frame"),
            ('{"kind":"no.such.kind","connectionGeneration":1,"body":{}}', "unknown_kind"),
            ('{"kind":"events.ack","connectionGeneration":1,"body":{"seq":-1}}', "invalid_frame"),
            ('{"kind":"events.ack","connectionGeneration":1,"body":{"seq":0},"extra":1}', "invalid_frame"),
        ]:
            await session.ws.send_message(raw)
            frame = await session.receive()
            assert (frame["kind"], frame["body"]["code"]) == ("error", code)
        await session.send("events.ack", {"seq": 0})  # no reply to a valid ack
        await session.send("events.ack", {"seq": 99})
        frame = await session.receive()
        assert frame["body"]["code"] == "ack_ahead"


# --- slow loris, handshake limit, idle ----------------------------------------------------


async def _raw_partial_head(endpoint: Endpoint) -> trio.SocketStream:
    stream = await endpoint.open_stream()
    await stream.send_all(b"GET /v1/control HTTP/1.1\r\nhost: x\r\n")
    return stream


async def test_handshake_limit_and_health_under_slow_loris(tmp_path, authority):
    """Eight partial heads fill the TCP pool (or are dropped early on the way): a ninth TCP
    request that is not a health check is refused, health still answers (a probe slot), and
    the unix listener, with a pool of its own, is untouched."""
    layout = make_layout(
        tmp_path / "d", authority=authority, websocket={"max_handshakes": 8, "max_handshakes_per_peer": 8}
    )
    async with in_process_daemon(layout) as daemon:
        streams = [await _raw_partial_head(daemon.tcp) for _ in range(8)]
        # Once the daemon has taken the eight partial heads in (how soon depends on the
        # machine's load), a ninth TCP connection is refused unless it asks for health.
        with trio.fail_after(5):
            while (response := await http_request(daemon.tcp, "GET", "/nope")).status == 404:
                await trio.sleep(0.01)
        assert (response.status, response.json()["error"]) == (503, "too_many_handshakes")
        # From another address: this one's probe slots may hold partial heads that random
        # early drop sent there.
        assert (await http_request(FromLegitHost(tcp=daemon.tcp.tcp), "GET", "/healthz")).status == 200
        assert (await http_request(daemon.unix, "GET", "/nope")).status == 404
        async with daemon.client(daemon.unix).connect():
            pass
        await streams.pop().aclose()
        with trio.fail_after(10):
            while daemon.supervisor is not None:
                response = await http_request(daemon.tcp, "GET", "/nope")
                if response.status == 404:
                    break
                await trio.sleep(0.01)
        for stream in streams:
            await stream.aclose()


async def test_idle_connection_is_dropped_after_the_first_line_timeout(tmp_path, authority):
    """An idle connection (or one whose request line never ends) holds its slot for
    FIRST_LINE_TIMEOUT_S, not the whole handshake_timeout_s."""
    layout = make_layout(tmp_path / "d", authority=authority, websocket={"handshake_timeout_s": 30})
    async with in_process_daemon(layout) as daemon:
        for opener in [b"", b"GET /v1/con"]:
            stream = await daemon.tcp.open_stream()
            if opener:
                await stream.send_all(opener)
            started = trio.current_time()
            with trio.fail_after(FIRST_LINE_TIMEOUT_S + 2):
                data = await stream.receive_some(1024)
            assert data == b""  # closed without an answer
            assert trio.current_time() - started >= FIRST_LINE_TIMEOUT_S * 0.9
            await stream.aclose()


async def test_slow_head_is_dropped_after_handshake_timeout(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, websocket={"handshake_timeout_s": 0.3})
    async with in_process_daemon(layout) as daemon:
        stream = await _raw_partial_head(daemon.tcp)
        # Well under the default timeout (10 s), so only the configured 0.3 s can pass this.
        with trio.fail_after(5):
            data = await stream.receive_some(1024)
        assert data == b""  # closed without an answer
        await stream.aclose()


def _read_server_frames(buffer: bytearray):
    """Parse unmasked server frames: yields (opcode, payload)."""
    frames = []
    while len(buffer) >= 2:
        opcode = buffer[0] & 0x0F
        length = buffer[1] & 0x7F
        offset = 2
        if length == 126:
            if len(buffer) < 4:
                break
            length = struct.unpack("!H", buffer[2:4])[0]
            offset = 4
        if len(buffer) < offset + length:
            break
        frames.append((opcode, bytes(buffer[offset : offset + length])))
        del buffer[: offset + length]
    return frames


async def test_silent_peer_is_pinged_then_closed_when_idle(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d", authority=authority, websocket={"ping_interval_s": 0.2, "idle_timeout_s": 0.8}
    )
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        headers = client.routing_headers(
            generation=1,
            attempt_id="raw",
            ack_floor=0,
            assertion=client.mint(generation=1, attempt_id="raw", ack_floor=0),
        )
        key = base64.b64encode(os.urandom(16)).decode()
        head = (
            "GET /v1/control HTTP/1.1\r\nhost: localhost\r\nupgrade: websocket\r\n"
            f"connection: Upgrade\r\nsec-websocket-key: {key}\r\nsec-websocket-version: 13\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers)
            + "\r\n"
        )
        stream = await daemon.tcp.open_stream()
        await stream.send_all(head.encode())
        buffer = bytearray()
        started = trio.current_time()
        opcodes = []
        with trio.fail_after(5):
            while 0x8 not in opcodes:
                data = await stream.receive_some(4096)
                assert data, "closed without a close frame"
                buffer += data
                if buffer.startswith(b"HTTP/1.1 101"):
                    del buffer[: buffer.index(b"\r\n\r\n") + 4]
                for opcode, payload in _read_server_frames(buffer):
                    opcodes.append(opcode)
                    if opcode == 0x8:
                        code = struct.unpack("!H", payload[:2])[0]
        elapsed = trio.current_time() - started
        assert 0x9 in opcodes  # pinged first
        assert code == 1011
        assert 0.7 <= elapsed < 3
        await stream.aclose()


async def test_live_peer_answering_pings_is_not_closed(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d", authority=authority, websocket={"ping_interval_s": 0.1, "idle_timeout_s": 0.4}
    )
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            await trio.sleep(1.2)  # three idle timeouts of silence, pongs only
            await session.send("events.ack", {"seq": 5})
            frame = await session.receive()
            assert frame["body"]["code"] == "ack_ahead"


# --- graceful stop --------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_stop_signal_closes_sockets_1001_and_exits_0(tmp_path, authority, signum):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        running = process.running
        async with running.client(running.unix).connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
            started = trio.current_time()
            process.send_signal(signum)
            reason = await session.closed_reason(timeout=5)
            assert (reason.code, reason.reason) == (1001, "Supervisor listener stopping.")
        assert await process.wait(timeout=5) == 0
    assert trio.current_time() - started < 3
    assert not layout.unix_socket.exists()


# --- handshakes wsproto would refuse never move the fence ---------------------------------


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: [(k, "websocket, h2c" if k == "upgrade" else v) for k, v in h],
        lambda h: h + [("connection", "keep-alive")],
        lambda h: [(k, v) for k, v in h if k != "sec-websocket-key"],
        lambda h: [(k, "12" if k == "sec-websocket-version" else v) for k, v in h],
    ],
    ids=["upgrade-list", "two-connection-headers", "no-key", "version-12"],
)
async def test_malformed_handshake_is_426_and_records_nothing(daemon, mutate):
    client = daemon.client()
    routing = client.routing_headers(
        generation=1, attempt_id="a-1", ack_floor=0, assertion=client.mint(generation=1, attempt_id="a-1", ack_floor=0)
    )
    handshake = [
        ("upgrade", "websocket"),
        ("connection", "Upgrade"),
        ("sec-websocket-key", base64.b64encode(os.urandom(16)).decode()),
        ("sec-websocket-version", "13"),
    ]
    response = await http_request(daemon.tcp, "GET", "/v1/control", mutate(handshake) + routing)
    assert response.status == 426
    assert daemon.supervisor.store.snapshot().fence_generation == 0


async def test_http_1_0_upgrade_is_refused_before_the_gate(daemon):
    stream = await daemon.tcp.open_stream()
    await stream.send_all(
        b"GET /v1/control HTTP/1.0\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    )
    data = b""
    with trio.fail_after(3):
        while True:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            data += chunk
    await stream.aclose()
    assert data.startswith(b"HTTP/1.1 426")
    assert daemon.supervisor.store.snapshot().fence_generation == 0


async def test_message_limit_counts_bytes_not_characters(daemon):
    async with daemon.client().connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        # 44,000 three-byte characters: under the limit in characters, over it in bytes.
        await session.ws.send_message("€" * 44000)
        reason = await session.closed_reason()
    assert reason.code == 1009


# --- the request-head parser under arbitrary bytes -----------------------------------------

_HEAD_PIECES = st.sampled_from(
    [b"GET ", b"POST ", b"/control", b"/healthz", b"/metrics", b" HTTP/1.1", b" HTTP/1.0", b"\r\n",
     b"\n", b"\r", b"Host: x", b"Upgrade: websocket", b"Connection: Upgrade", b"Sec-WebSocket-Key: ",
     b"Sec-WebSocket-Version: 13", b": ", b"\x00", b"\xff", b" ", b"\t", b"?", b"%", b"Transfer-Encoding: chunked",
     b"Content-Length: 5", b"x" * 300]
)


def _mostly(valid: list[bytes], other: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A valid value nine times in ten, else anything from `other`."""
    return st.integers(0, 9).flatmap(lambda n: other if n == 0 else st.sampled_from(valid))


_HEADER_NAMES = _mostly(
    [b"Host", b"Upgrade", b"Connection", b"Sec-WebSocket-Key", b"Sec-WebSocket-Version", b"X-Sandbox-Id",
     b"Content-Length", b"Transfer-Encoding"],
    st.binary(max_size=12),
)
_HEADER_VALUES = _mostly(
    [b"x", b"websocket", b"Upgrade", b"keep-alive, Upgrade", b"13", b"dGhlIHNhbXBsZSBub25jZQ==", b"0", b"chunked"],
    st.binary(max_size=40),
)
# Mostly well-formed heads with arbitrary parts, so the parser's accepting paths are fuzzed
# too, not only its first refusal.
_REQUESTS = st.builds(
    lambda method, target, version, headers, tail: (
        method + b" " + target + b" " + version + b"\r\n"
        + b"".join(name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n" + tail
    ),
    _mostly([b"GET", b"POST", b"HEAD"], st.binary(max_size=6)),
    _mostly([b"/control", b"/healthz", b"/metrics", b"/healthz?x=1", b"*"], st.binary(max_size=20)),
    _mostly([b"HTTP/1.1", b"HTTP/1.0"], st.binary(max_size=9)),
    st.lists(st.tuples(_HEADER_NAMES, _HEADER_VALUES), max_size=6),
    st.binary(max_size=20),
)


@pytest.mark.fuzz
@fuzz_settings(500)
@given(
    data=_REQUESTS | st.lists(_HEAD_PIECES | st.binary(max_size=40), max_size=30).map(b"".join),
    cuts=st.lists(st.integers(min_value=1, max_value=64), max_size=10),
    max_bytes=st.sampled_from([128, 16 * 1024, 16 * 1024]),
)
def test_arbitrary_bytes_give_a_head_or_a_typed_refusal(data, cuts, max_bytes) -> None:
    """Whatever arrives, in whatever chunks, the sans-IO reader answers with a head, asks
    for more, or refuses with HeadTooLarge / MalformedHead, and a head always classifies."""
    chunks, position = [], 0
    for cut in cuts:
        chunks.append(data[position : position + cut])
        position += cut
    chunks.append(data[position:])
    chunks.append(b"")  # then EOF
    reader = HeadReader(max_bytes)
    for chunk in chunks:
        try:
            head = reader.feed(chunk)
        except (HeadTooLarge, MalformedHead) as refusal:
            event(type(refusal).__name__)
            return
        if head is not None:
            event("head")
            assert len(reader.head_bytes) <= max_bytes
            assert classify(head, RoutePaths(control="/control", health="/healthz", metrics="/metrics")) in Route
            return
    raise AssertionError("EOF must end the head or refuse it")
