"""Shared fixtures: a real daemon (in-process or subprocess) on temporary directories."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import cgroup_support
from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.daemon import DaemonLayout, in_process_daemon, make_layout
from sandbox_supervisor.daemon.ops.logs import configure_logging

# Tests read the daemon's decisions from frames and HTTP answers; keep the log quiet.
QUIET_LOG_LEVEL = "error"
configure_logging(QUIET_LOG_LEVEL, "json")

FAST_WEBSOCKET = {"handshake_timeout_s": 2.0, "drain_budget_s": 0.5}


@pytest.fixture(scope="session", autouse=True)
def _no_cgroups_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Daemons the suite kills with SIGKILL (crash tests) never remove their command cgroups,
    and each test's state directory names its own (runtime/cgroups.py base_name): remove the
    empty ones the run made in the machine's hierarchies, so runs do not pile them up. Only
    those of state directories under this run's temporary root: another daemon that started
    meanwhile (a benchmark, another suite) has an empty base between its commands too, and
    removing it failed its next spawn (`internal` `No such file or directory`)."""
    before = set(cgroup_support.base_directories())
    yield
    ours = cgroup_support.bases_named_under(tmp_path_factory.getbasetemp())
    cgroup_support.remove_empty({base for base in set(cgroup_support.base_directories()) - before if base.name in ours})


@pytest.fixture(scope="session")
def authority() -> LoopbackAuthority:
    # Key generation is cheap but not free; one key for the whole run is enough.
    return LoopbackAuthority()


@pytest.fixture
def layout(tmp_path, authority) -> DaemonLayout:
    return make_layout(tmp_path / "daemon", authority=authority, websocket=dict(FAST_WEBSOCKET))


@pytest.fixture
async def daemon(layout):
    async with in_process_daemon(layout) as running:
        yield running


@pytest.fixture(params=["tcp", "unix"])
def transport(request) -> str:
    return request.param


@pytest.fixture
async def session(daemon):
    """A bootstrapped control session on the in-process daemon (agent.cwd = the workspace)."""
    client = daemon.client()
    async with client.connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
        yield session


@pytest.fixture
def log_lines() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The in-process daemon's log at every level, as parsed JSON lines, rendered by the
    daemon's own configuration (tracebacks included); quiet again afterwards."""
    buffer = io.StringIO()
    configure_logging("debug", "json", stream=buffer)
    try:
        yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    finally:
        configure_logging(QUIET_LOG_LEVEL, "json")
