"""The wire contract of sandbox-supervisor: pure models and rules, no I/O, no trio."""

PROTOCOL_VERSION = 1
