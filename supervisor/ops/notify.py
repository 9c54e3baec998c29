"""sd_notify(3) and sd_watchdog_enabled(3): a no-op outside systemd.

Messages are one datagram each to $NOTIFY_SOCKET (a path, or an abstract address when it
starts with "@"). The watchdog interval comes from WATCHDOG_USEC / WATCHDOG_PID, read the way
libsystemd reads them; the daemon pings at half of it, as sd_watchdog_enabled(3) advises.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import trio

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"
# An abstract-namespace address is written with a leading "@" and sent with a leading NUL.
ABSTRACT_PREFIX = "@"
# systemd's USEC_INFINITY: "no timeout", which cannot be a watchdog interval.
USEC_INFINITY = 2**64 - 1
USEC_PER_S = 1_000_000
# Ping at this fraction of the interval: a ping late by scheduling jitter is still on time.
WATCHDOG_PING_FRACTION = 0.5

READY = "READY=1"
STOPPING = "STOPPING=1"
WATCHDOG = "WATCHDOG=1"


def notify_address(env: Mapping[str, str]) -> str:
    """The socket address for connect(), or "" when not running under systemd."""
    address = env.get(NOTIFY_SOCKET_ENV, "")
    if address.startswith(ABSTRACT_PREFIX):
        return "\0" + address[len(ABSTRACT_PREFIX):]
    return address


def watchdog_interval_s(env: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when there is no
    watchdog for this process.

    As sd_watchdog_enabled(3): WATCHDOG_USEC must be a positive integer below USEC_INFINITY;
    when WATCHDOG_PID is set it must be our pid (the variables may have been inherited from a
    parent the watchdog is really meant for). Malformed values mean no watchdog: libsystemd
    reports them as an error, and a daemon cannot ping a watchdog it cannot read.
    """
    text = env.get(WATCHDOG_USEC_ENV)
    if text is None:
        return None
    usec = _decimal(text)
    if usec is None or usec == 0 or usec >= USEC_INFINITY:
        return None
    pid_text = env.get(WATCHDOG_PID_ENV)
    if pid_text is not None:
        watched = _decimal(pid_text)
        if watched is None or watched == 0 or watched != (os.getpid() if pid is None else pid):
            return None
    return usec * WATCHDOG_PING_FRACTION / USEC_PER_S


def _decimal(text: str) -> int | None:
    # Strictly digits: int() would also take "+5", " 5", "5_0" and non-ASCII digits.
    if not text or not text.isascii() or not text.isdigit():
        return None
    return int(text)


class SystemdNotifier:
    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        self._address = notify_address(env)

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *lines: str) -> bool:
        """Send `READY=1`-style lines in one datagram. Best effort: False when it failed."""
        if not self._address:
            return False
        payload = "\n".join(lines).encode("utf-8")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall(payload)
            return True
        except OSError:
            return False


async def send_watchdog_pings(notifier: SystemdNotifier, interval_s: float) -> None:
    """Send WATCHDOG=1 every `interval_s` until cancelled. Run it in the daemon's nursery:
    if the trio loop stalls, the pings stop and systemd restarts the daemon."""
    while True:
        notifier.notify(WATCHDOG)
        await trio.sleep(interval_s)
