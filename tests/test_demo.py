"""`sandbox-supervisor-demo` runs as a new user runs it, and shows what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sandbox_supervisor.testing.demo import CLOSING, EXPLANATIONS


def test_demo_runs_a_whole_session_and_exits_0():
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "sandbox-supervisor-demo")], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    for promise in (
        "401 invalid_authority",
        "runtime.state ready",
        "read_file README.md",
        "apply_file_patch README.md -> ok",
        "live stdout: tick 4",
        "ended by SIGINT",
        "timed_out True",
        "200000 lines, exact",
        "tool.result of the lost call arrives (ok: True)",
        "tool.replayed",
        "written exactly once",
        "the terminal shows '40 120'",
        "exec.completed exit_code 0",
        "the daemon exits 75",
        "the new daemon adopted it",
        "reported once",
        "exited with status 0",
    ):
        assert promise in out, promise
    # Each term is explained once, where it first appears: after the line that shows it.
    lines = out.splitlines()
    for term, text in EXPLANATIONS.items():
        explained = [i for i, line in enumerate(lines) if line.strip() == f"({term}: {text})"]
        assert len(explained) == 1, term
        assert term in lines[explained[0] - 1] or term in lines[explained[0] - 2], term
    assert lines[-1] == CLOSING
    for doc in ("docs/protocol.md", "docs/client-contract.md"):
        assert doc in CLOSING
