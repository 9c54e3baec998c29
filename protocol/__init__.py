"""The wire contract of sandbox-supervisor: pure models and rules, no I/O, no trio."""

from typing import Final

# Final, so its type is Literal[1], as RuntimeStateBody.protocolVersion requires.
PROTOCOL_VERSION: Final = 1
