"""One authoritative socket per session (docs/protocol.md §4), over real sockets."""

from __future__ import annotations


import pytest
import trio
import trio_websocket

from sandbox_supervisor.testing.client import UpgradeRejected
from sandbox_supervisor.testing.daemon import in_process_daemon

SUPERSEDED = (1008, "Connection attempt was superseded.")


def endpoint_of(daemon, transport):
    return daemon.tcp if transport == "tcp" else daemon.unix


async def test_lower_generation_is_stale(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    async with client.connect(generation=2) as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
    with pytest.raises(UpgradeRejected) as info:
        async with client.connect(generation=1):
            pass
    assert (info.value.status, info.value.error) == (409, "stale_generation")


async def test_same_generation_other_attempt_is_stale(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    async with client.connect(generation=3, attempt_id="attempt-a"):
        pass
    with pytest.raises(UpgradeRejected) as info:
        async with client.connect(generation=3, attempt_id="attempt-b"):
            pass
    assert (info.value.status, info.value.error) == (409, "stale_generation")


async def test_retry_of_same_attempt_is_admitted_and_supersedes(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    cwd = str(daemon.layout.workspace)
    async with client.connect(generation=1, attempt_id="attempt-a") as first:
        await first.bootstrap(cwd=cwd)
        # Same generation and attempt, fresh jti: a retry of the same attempt.
        async with client.connect(generation=1, attempt_id="attempt-a") as retry:
            reason = await first.closed_reason()
            assert (reason.code, reason.reason) == SUPERSEDED
            state = await retry.bootstrap(cwd=cwd)
            assert state["body"]["generation"] == 1


async def test_higher_generation_supersedes_old_socket(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    cwd = str(daemon.layout.workspace)
    async with client.connect(generation=1) as old:
        await old.bootstrap(cwd=cwd)
        async with client.connect(generation=2) as new:
            reason = await old.closed_reason()
            assert (reason.code, reason.reason) == SUPERSEDED
            state = await new.bootstrap(cwd=cwd)
            assert state["body"]["generation"] == 2
            assert daemon.supervisor.hub.authoritative is not None
            assert daemon.supervisor.hub.authoritative.generation == 2


async def test_frames_of_superseded_socket_never_act(daemon):
    """Once a newer socket is admitted, a bootstrap the old socket sends does not bind: the
    newer socket's (different) bootstrap is the one that binds."""
    import trio_websocket

    client = daemon.client()
    other_cwd = daemon.layout.workspace / "other"
    other_cwd.mkdir()
    async with client.connect(generation=1) as old:
        async with client.connect(generation=2) as new:
            try:
                await old.send(
                    "session.bootstrap",
                    {"sessionId": client.session_id, "agent": {"cwd": str(other_cwd), "profile": "default"}, "repositories": []},
                    generation=1,
                )
            except trio_websocket.ConnectionClosed:
                pass  # already closed by the daemon: equally fine
            reason = await old.closed_reason()
            assert (reason.code, reason.reason) == SUPERSEDED
            state = await new.bootstrap(cwd=str(daemon.layout.workspace))
            assert state["kind"] == "runtime.state"
    binding = daemon.supervisor.store.binding()
    assert '"cwd":"%s"' % daemon.layout.workspace in binding.body_json.replace(" ", "")


async def test_frame_with_other_generation_gets_generation_mismatch(daemon):
    client = daemon.client()
    async with client.connect(generation=4) as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        await session.send("events.ack", {"seq": 0}, generation=3)
        frame = await session.receive()
        assert frame["kind"] == "error"
        assert frame["body"]["code"] == "generation_mismatch"
        # The socket stays usable: a correct frame afterwards is served.
        await session.send("events.ack", {"seq": 1})
        frame = await session.receive()
        assert frame["body"]["code"] == "ack_ahead"


async def test_fence_survives_restart(layout):
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect(generation=5, attempt_id="attempt-5"):
            pass
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        with pytest.raises(UpgradeRejected) as info:
            async with client.connect(generation=4):
                pass
        assert (info.value.status, info.value.error) == (409, "stale_generation")
        with pytest.raises(UpgradeRejected) as info:
            async with client.connect(generation=5, attempt_id="attempt-other"):
                pass
        assert info.value.error == "stale_generation"
        async with client.connect(generation=5, attempt_id="attempt-5"):
            pass
        async with client.connect(generation=6):
            pass


async def test_reconnect_storm_leaves_one_authoritative_socket(daemon):
    """Rising generations in quick succession: at every moment at most one socket is
    authoritative, and every earlier socket is told it was superseded."""
    client = daemon.client()
    cwd = str(daemon.layout.workspace)
    reasons = []

    async def hold(generation, ready, done):
        async with client.connect(generation=generation) as session:
            ready.set()
            reasons.append((generation, await session.closed_reason()))
            done.set()

    async with trio.open_nursery() as nursery:
        previous_done = None
        for generation in range(1, 21):
            ready, done = trio.Event(), trio.Event()
            nursery.start_soon(hold, generation, ready, done)
            await ready.wait()
            if previous_done is not None:
                await previous_done.wait()
            hub = daemon.supervisor.hub
            assert hub.authoritative is not None and hub.authoritative.generation == generation
            # Any other socket still open is on its way out (closing with 1008).
            assert all(c.close_request is not None for c in hub.open if c is not hub.authoritative)
            previous_done = done
        async with client.connect(generation=21) as last:
            await last.bootstrap(cwd=cwd)
            await previous_done.wait()
    assert sorted(g for g, _ in reasons) == list(range(1, 21))
    assert all((r.code, r.reason) == SUPERSEDED for _, r in reasons)


def test_connection_admitted_earlier_never_supersedes_a_later_one():
    """Handshakes finish in any order: the socket whose upgrade was admitted later stays
    authoritative even if the earlier one's 101 completes after it."""
    from types import SimpleNamespace

    from sandbox_supervisor.daemon.session.hub import Connection, SessionHub

    def conn(admission, generation):
        headers = SimpleNamespace(generation=generation, session_id="s")
        return Connection(ws=None, headers=headers, claims=SimpleNamespace(scopes=[]), admission=admission)

    hub = SessionHub()
    later, earlier = conn(2, 6), conn(1, 5)
    hub.admit(later)
    hub.admit(earlier)
    assert hub.authoritative is later
    assert earlier.close_request == SUPERSEDED and later.close_request is None
    newest = conn(3, 7)
    hub.admit(newest)
    assert hub.authoritative is newest and later.close_request == SUPERSEDED


def _upgrade_head(client, generation: int, attempt_id: str) -> bytes:
    token = client.mint(generation=generation, attempt_id=attempt_id, ack_floor=0)
    headers = client.routing_headers(generation=generation, attempt_id=attempt_id, ack_floor=0, assertion=token)
    lines = [
        b"GET /v1/control HTTP/1.1",
        b"Host: localhost",
        b"Upgrade: websocket",
        b"Connection: Upgrade",
        b"Sec-WebSocket-Version: 13",
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        *(name.encode() + b": " + value.encode() for name, value in headers),
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def test_a_fenced_out_socket_cannot_bind_with_its_first_bootstrap(daemon):
    """A newer upgrade passes the gate (the fence moves) but its 101 never reaches the
    client, so nothing supersedes the older, still silent socket. That socket's bootstrap
    must not bind the session: it is closed as superseded, and the session stays unbound.

    The newer upgrade comes over the unix socket, whose client closes right after sending its
    head: the daemon reads the head (it is in the socket's buffer), the gate admits it, and
    the 101 fails at once (EPIPE: a unix socket's closed peer takes no bytes). Over TCP a
    reset peer can still take the 101 into the kernel's buffer, and the upgrade is then
    admitted (superseding the old socket) before its first read fails."""
    client = daemon.client()
    supervisor = daemon.supervisor
    async with client.connect(generation=1) as old:
        # Send a generation-2 head and close at once: when the daemon has read the head
        # before the close, the gate admits it (fencing generation 1 out) and its 101 fails.
        # When the close is seen first nothing is admitted; try again.
        for attempt in range(100):
            stream = await daemon.unix.open_stream()
            await stream.send_all(_upgrade_head(client, 2 + attempt, f"reset-{attempt}"))
            await trio.aclose_forcefully(stream)
            with trio.move_on_after(1):
                while supervisor.status.fence_generation == 1:
                    await trio.sleep(0.01)
            if supervisor.status.fence_generation > 1:
                break
        assert supervisor.status.fence_generation > 1, "no reset upgrade was admitted"
        # Nothing superseded the old socket: only the fence says it is out of date.
        assert supervisor.hub.authoritative is not None and supervisor.hub.authoritative.generation == 1
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await old.bootstrap(cwd=str(daemon.layout.workspace))
    assert (closed.value.reason.code, closed.value.reason.reason) == SUPERSEDED
    assert supervisor.store.binding() is None
