"""Pre-authentication availability: budgets per listener kind and per peer, random early
drop, health outside the handshake pool, aggregated refusal logging — and a flood test."""

from __future__ import annotations

import resource
import socket

import pytest
import trio

from sandbox_supervisor.daemon.edge import server
from sandbox_supervisor.daemon.edge.server import (
    EARLY_DROP_RATE,
    PROBE_SLOTS_PER_PEER,
    FrontBudgets,
    FrontLimits,
    PeerSlots,
    Refusals,
    early_drop,
)
from sandbox_supervisor.testing.client import Endpoint, http_request
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

ATTACKERS = 1000
ATTACKER_HOST = "127.0.0.1"
LEGIT_HOST = "127.0.0.2"  # the whole of 127/8 is loopback on Linux
FDS_NEEDED = 3 * ATTACKERS  # both ends live in this process, plus the daemon's own


class FromLegitHost(Endpoint):
    """A TCP endpoint whose connections leave from LEGIT_HOST, not the attackers' address."""

    async def open_stream(self) -> trio.SocketStream:
        assert self.tcp is not None
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            await sock.bind((LEGIT_HOST, 0))
            await sock.connect(self.tcp)
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)


# --- pure parts --------------------------------------------------------------------------


def test_peer_slots_limit_each_address_and_forget_idle_ones():
    peers = PeerSlots(2)
    assert peers.try_acquire("a") and peers.try_acquire("a")
    assert not peers.try_acquire("a")
    assert peers.try_acquire("b")  # another address has its own share
    peers.release("a")
    assert peers.try_acquire("a")
    for _ in range(2):
        peers.release("a")
    peers.release("b")
    assert peers.pending == {}


def test_early_drop_rises_linearly_from_start_to_full():
    def never(_value: float):
        return lambda: _value

    # Below start: never dropped, whatever the draw.
    assert not early_drop(9, start=10, rate=0.3, full=20, draw=never(0.0))
    # At start: dropped with probability `rate`.
    assert early_drop(10, start=10, rate=0.3, full=20, draw=never(0.29))
    assert not early_drop(10, start=10, rate=0.3, full=20, draw=never(0.31))
    # Half way: 0.3 + 0.7 * 0.5 = 0.65.
    assert early_drop(15, start=10, rate=0.3, full=20, draw=never(0.64))
    assert not early_drop(15, start=10, rate=0.3, full=20, draw=never(0.66))
    # At full and past it: always.
    assert early_drop(20, start=10, rate=0.3, full=20, draw=never(0.999))
    assert early_drop(25, start=10, rate=0.3, full=20, draw=never(0.999))


def test_budgets_separate_listener_kinds_peers_and_probes():
    budgets = FrontBudgets(
        FrontLimits(max_tcp_handshakes=4, max_unix_handshakes=2, max_handshakes_per_peer=2),
        draw=lambda: 0.999,  # early drop only where its probability is 1
    )
    a1, a2 = budgets.admit("10.0.0.1"), budgets.admit("10.0.0.1")
    assert a1 is not None and a2 is not None and not a1.probe and not a2.probe
    # Over its share, the address gets a probe slot (health only), then nothing.
    probes = [budgets.admit("10.0.0.1") for _ in range(PROBE_SLOTS_PER_PEER)]
    assert all(t is not None and t.probe for t in probes)
    assert budgets.admit("10.0.0.1") is None
    # TCP being busy does not touch the unix pool.
    u = budgets.admit(None)
    assert u is not None and not u.probe
    b = budgets.admit("10.0.0.2")
    assert b is not None and not b.probe
    a1.release()
    a1.release()  # idempotent
    again = budgets.admit("10.0.0.1")
    assert again is not None and not again.probe
    assert budgets.refusals.drain() == {"peer_limit": 1}


def test_budgets_drop_early_as_the_pool_fills():
    draws = iter([0.5, 0.2])
    budgets = FrontBudgets(
        FrontLimits(max_tcp_handshakes=10, max_unix_handshakes=1, max_handshakes_per_peer=100),
        draw=lambda: next(draws),
    )
    for n in range(5):  # below start (half the pool): no draw at all
        assert budgets.admit("p") is not None
    # At start the drop probability is EARLY_DROP_RATE (0.3): a draw of 0.5 passes.
    assert (ticket := budgets.admit("p")) is not None and not ticket.probe
    # Next pending 6: probability 0.3 + 0.7/5 = 0.44; a draw of 0.2 is dropped — to a probe slot.
    assert (ticket := budgets.admit("p")) is not None and ticket.probe
    assert EARLY_DROP_RATE == 0.3
    assert budgets.refusals.drain() == {}


def test_an_idle_pool_of_one_and_the_unix_pool_never_drop_early():
    """A draw that would drop every time: an idle one-slot TCP pool still admits (start is at
    least 1), and the unix pool never draws at all (its peers are local processes)."""
    budgets = FrontBudgets(
        FrontLimits(max_tcp_handshakes=1, max_unix_handshakes=4, max_handshakes_per_peer=8),
        draw=lambda: 0.0,
    )
    tcp = budgets.admit("10.0.0.1")
    assert tcp is not None and not tcp.probe
    unix = [budgets.admit(None) for _ in range(4)]
    assert all(t is not None and not t.probe for t in unix)
    assert budgets.refusals.drain() == {}


def test_refusals_are_counted_and_drained_per_interval():
    refusals = Refusals()
    for reason in ["peer_limit", "peer_limit", "first_line_timeout"]:
        refusals.note(reason)
    assert refusals.drain() == {"peer_limit": 2, "first_line_timeout": 1}
    assert refusals.drain() == {}


# --- over sockets ------------------------------------------------------------------------


async def test_health_is_answered_when_every_handshake_slot_is_taken(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d", authority=authority, websocket={"max_handshakes": 4, "max_handshakes_per_peer": 4}
    )
    async with in_process_daemon(layout) as daemon:
        holders = []
        for _ in range(4):
            stream = await daemon.tcp.open_stream()
            await stream.send_all(b"GET /v1/control HTTP/1.1\r\nhost: x\r\n")
            holders.append(stream)
        budgets_full = False
        with trio.fail_after(5):
            while not budgets_full:
                # A non-health request from another address shows when the pool is full.
                response = await http_request(FromLegitHost(tcp=daemon.tcp.tcp), "GET", "/nope")
                budgets_full = response.status == 503
                await trio.sleep(0.01)
        assert response.json()["error"] == "too_many_handshakes"
        with trio.fail_after(1):
            response = await http_request(FromLegitHost(tcp=daemon.tcp.tcp), "GET", "/healthz")
        assert response.status == 200
        for stream in holders:
            await stream.aclose()


# A mix: idle, a first byte only, a request line then nothing more.
HOSTILE_OPENERS = [b"", b"G", b"GET /v1/control HTTP/1.1\r\nhost: x\r\n"]
# The replacing attacker opens at most this many more connections (a bounded loop).
MAX_REPLACEMENTS = 3 * ATTACKERS


async def _open_hostile(address: tuple[str, int], n: int) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await sock.bind((ATTACKER_HOST, 0))
        await sock.connect(address)
        if HOSTILE_OPENERS[n % len(HOSTILE_OPENERS)]:
            await sock.send(HOSTILE_OPENERS[n % len(HOSTILE_OPENERS)])
    except BaseException:
        sock.close()
        raise
    return sock


async def _control_plane_gets_in(daemon, client, timings: dict[str, float], phase: str) -> None:
    """The upgrade completes within 1 s over unix and over TCP from another address, and
    health answers within 100 ms on both."""
    legit_tcp = FromLegitHost(tcp=daemon.tcp.tcp)
    for name, endpoint in [("unix", daemon.unix), ("tcp", legit_tcp)]:
        client.endpoint = endpoint
        started = trio.current_time()
        with trio.fail_after(1):
            # The upgrade completes (101) or connect() raises UpgradeRejected.
            async with client.connect():
                pass
        timings[f"{phase} {name} upgrade"] = trio.current_time() - started
    for name, endpoint in [("unix", daemon.unix), ("tcp", legit_tcp)]:
        started = trio.current_time()
        with trio.fail_after(0.1):
            response = await http_request(endpoint, "GET", "/healthz")
        timings[f"{phase} {name} health"] = trio.current_time() - started
        assert response.status == 200


async def test_control_plane_and_health_survive_a_thousand_hostile_connections(tmp_path, authority):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below the {FDS_NEEDED} descriptors this test needs")
    if soft != resource.RLIM_INFINITY and soft < FDS_NEEDED:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS_NEEDED, hard))
    try:
        layout = make_layout(tmp_path / "d", authority=authority)
        async with in_process_daemon(layout) as daemon:
            assert daemon.tcp.tcp is not None
            address = daemon.tcp.tcp
            hostile: list[trio.socket.SocketType] = []
            timings: dict[str, float] = {}
            client = daemon.client(daemon.unix)
            first_idle = None
            try:
                with trio.fail_after(15):
                    for n in range(ATTACKERS):
                        hostile.append(await _open_hostile(address, n))
                # The flood is in effect: the attackers' address is refused anything but health.
                response = await http_request(daemon.tcp, "GET", "/")
                assert (response.status, response.json()["error"]) == (503, "too_many_handshakes")
                await _control_plane_gets_in(daemon, client, timings, "fresh")

                # Steady state: the attacker replaces what the daemon drops, keeping ATTACKERS
                # open, until the daemon has timed out the first (idle) connection.
                async def replace() -> None:
                    for n in range(MAX_REPLACEMENTS):
                        hostile.append(await _open_hostile(address, n))
                        if len(hostile) > ATTACKERS:
                            hostile.pop(0).close()

                # Watched, so never closed by the replacer (which closes the oldest).
                first_idle = hostile.pop(0)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(replace)
                    with trio.fail_after(10):
                        assert await first_idle.recv(1024) == b""  # dropped, no answer
                    await _control_plane_gets_in(daemon, client, timings, "replaced")
                    nursery.cancel_scope.cancel()
                print("timings under flood:", {k: round(v, 4) for k, v in timings.items()})
            finally:
                for sock in [*hostile, *([first_idle] if first_idle else [])]:
                    sock.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_refusals_are_logged_as_one_summary_per_interval(tmp_path, authority, monkeypatch):
    """Refused connections make one line per interval with counts, not one line each."""
    monkeypatch.setattr(server, "REFUSAL_SUMMARY_INTERVAL_S", 0.2)
    # The probe slots' holders must outlast the test's requests, however loaded the machine.
    monkeypatch.setattr(server, "PROBE_HEAD_TIMEOUT_S", 30.0)
    monkeypatch.setattr(server, "FIRST_LINE_TIMEOUT_S", 30.0)
    logs: list[dict] = []

    class Recorder:
        def info(self, event: str, **fields: object) -> None:
            logs.append({"event": event, **fields})

        exception = info

    # The front's own logger, whatever the process-wide structlog configuration filters.
    monkeypatch.setattr(server, "log", Recorder())
    layout = make_layout(tmp_path / "d", authority=authority, websocket={"max_handshakes_per_peer": 2})
    refused = 12
    async with in_process_daemon(layout) as daemon:
        # Two handshake slots and two probe slots for this address, held by partial heads.
        holders = []
        for _ in range(2 + PROBE_SLOTS_PER_PEER):
            stream = await daemon.tcp.open_stream()
            await stream.send_all(b"GET /v1/control HTTP/1.1\r\nhost: x\r\n")
            holders.append(stream)
        with trio.fail_after(5):
            while (await http_request(daemon.tcp, "GET", "/nope")).status != 503:
                await trio.sleep(0.01)
        for _ in range(refused - 1):
            response = await http_request(daemon.tcp, "GET", "/nope")
            assert response.status == 503

        def counted() -> int:
            return sum(e["counts"].get("peer_limit", 0) for e in logs if e["event"] == "http.refused_summary")

        with trio.fail_after(5):
            while counted() < refused:
                await trio.sleep(0.05)
        for stream in holders:
            await stream.aclose()
    assert counted() == refused
    summaries = [e for e in logs if e["event"] == "http.refused_summary"]
    # One detail line per interval at most (the first refusal of it), never one per refusal.
    assert len([e for e in logs if e["event"] == "http.refused"]) <= len(summaries) < refused
