"""Waiting on a socket that another task may have closed.

trio's `wait_readable` and `wait_writable` register the socket's `fileno()`, and a closed
socket's is -1. `epoll.modify(-1)` raises ValueError, which trio's registration does not
expect (it handles OSError): the waiting task stays registered under -1 for good, and the next
wait on any closed socket in the process fails with BusyResourceError (trio 0.35). Every
connection that ended after the first then crashed its reader at the close, logging a
traceback, and the first reader task was never released. So a closed socket is refused here,
as trio refuses a socket it knows is closing, before trio sees the -1. No checkpoint lies
between the check and the registration, so a close in another task comes before both or
after both (then `notify_closing` wakes the waiter)."""

from __future__ import annotations

import socket

import trio


def _open_fd(sock: socket.socket | trio.socket.SocketType) -> int:
    fd = sock.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the socket was closed")
    return fd


async def wait_readable(sock: socket.socket | trio.socket.SocketType) -> None:
    """trio's `wait_readable`; a closed socket raises ClosedResourceError."""
    await trio.lowlevel.wait_readable(_open_fd(sock))


async def wait_writable(sock: socket.socket | trio.socket.SocketType) -> None:
    """trio's `wait_writable`; a closed socket raises ClosedResourceError."""
    await trio.lowlevel.wait_writable(_open_fd(sock))
