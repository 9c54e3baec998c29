"""`HOST:PORT` listen addresses, as the configuration, `listening.json` and clients write them
(IPv6 in brackets: `[::1]:8787`): one parser and one formatter for all of them."""

from __future__ import annotations

import ipaddress
import re

MAX_PORT = 65535
_HOST_NAME_PATTERN = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})$")


def parse_host_port(value: str) -> tuple[str, int]:
    """Split `HOST:PORT` (IPv6 in brackets: `[::1]:8787`) and validate both parts."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if not port_text.isascii() or not port_text.isdigit():
        raise ValueError(f"port must be decimal digits in {value!r}")
    port = int(port_text)
    if port > MAX_PORT:
        raise ValueError(f"port must be 0..{MAX_PORT} in {value!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"invalid IPv6 address in {value!r}") from None
        return host[1:-1], port
    if ":" in host:
        raise ValueError(f"an IPv6 host must be in brackets, as [::1]:PORT, in {value!r}")
    if not _HOST_NAME_PATTERN.match(host):
        raise ValueError(f"invalid host in {value!r}")
    return host, port


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
