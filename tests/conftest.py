"""Shared fixtures: a real daemon (in-process or subprocess) on temporary directories."""

from __future__ import annotations

import pytest

from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.daemon import DaemonLayout, in_process_daemon, make_layout
from sandbox_supervisor.daemon.ops.logs import configure_logging

# Tests read the daemon's decisions from frames and HTTP answers; keep the log quiet.
configure_logging("error", "json")

FAST_WEBSOCKET = {"handshake_timeout_s": 2.0, "drain_budget_s": 0.5}


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
