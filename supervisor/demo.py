"""`sandbox-supervisor demo`: the narrated session lives with the reference client in
`testing.demo` (the demo *is* a control plane); this is the CLI's entry to it."""

from __future__ import annotations


def main(args=None) -> int:
    from testing.demo import main as run

    return run(args)
