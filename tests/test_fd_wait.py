"""Waiting on sockets another task closed (supervisor/fd_wait.py)."""

from __future__ import annotations

import socket

import pytest
import trio

from sandbox_supervisor.daemon import fd_wait


@pytest.mark.parametrize("wait", [fd_wait.wait_readable, fd_wait.wait_writable], ids=["readable", "writable"])
async def test_closed_sockets_are_refused_each_time_and_live_ones_still_wait(wait) -> None:
    # trio itself leaves the first waiter on a closed socket registered under fd -1, and the
    # second such wait in the process raises BusyResourceError: the crash every closed
    # connection after the first logged (tests/test_front.py holds the daemon to it).
    for _ in range(3):
        left, right = socket.socketpair()
        left.close()
        with pytest.raises(trio.ClosedResourceError):
            await wait(left)
        right.close()
    left, right = socket.socketpair()
    left.setblocking(False)
    try:
        right.send(b"x")
        with trio.fail_after(5):
            await wait(left)  # readable (a byte waits) and writable (the buffer is empty)
    finally:
        left.close()
        right.close()


async def test_a_socket_closed_while_waited_on_wakes_its_waiter() -> None:
    left, right = socket.socketpair()
    try:
        async with trio.open_nursery() as nursery:

            async def close_soon() -> None:
                await trio.testing.wait_all_tasks_blocked()
                trio.lowlevel.notify_closing(left)
                left.close()

            nursery.start_soon(close_soon)
            with trio.fail_after(5), pytest.raises(trio.ClosedResourceError):
                await fd_wait.wait_readable(left)
    finally:
        right.close()
