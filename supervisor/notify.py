"""sd_notify(3): one datagram per message to $NOTIFY_SOCKET; a no-op outside systemd."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


class SystemdNotifier:
    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        address = env.get(NOTIFY_SOCKET_ENV, "")
        # An address starting with "@" is in the abstract namespace: a leading NUL byte.
        self._address = "\0" + address[1:] if address.startswith("@") else address

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
