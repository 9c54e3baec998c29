"""session.bootstrap over real sockets (docs/protocol.md §5), including the terminal rejection
with a real daemon subprocess that exits 78."""

from __future__ import annotations

import contextlib
import json

import pytest
import trio
import trio_websocket

from sandbox_supervisor.daemon.auth.gate import Lifecycle
from sandbox_supervisor.testing.client import BootstrapRejected, default_bootstrap_body, http_request
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout, running_daemon

EXPECTED_BOOTSTRAP = (1002, "Expected session bootstrap as first frame.")
MISMATCH = (1008, "Bootstrap does not match upgrade headers.")


def body(daemon, **agent):
    base = default_bootstrap_body(daemon.client().session_id, str(daemon.layout.workspace))
    base["agent"].update(agent)
    return base


@pytest.mark.parametrize(
    "first",
    [
        {"kind": "events.ack", "connectionGeneration": 1, "body": {"seq": 0}},
        "not json at all",
        {"kind": "session.bootstrap", "connectionGeneration": 1, "body": {"sessionId": "session-1"}},
    ],
    ids=["other-kind", "not-json", "schema-violation"],
)
async def test_first_frame_must_be_a_bootstrap(daemon, transport, first):
    client = daemon.client(daemon.tcp if transport == "tcp" else daemon.unix)
    async with client.connect(generation=1) as session:
        await session.ws.send_message(first if isinstance(first, str) else json.dumps(first))
        reason = await session.closed_reason()
    assert (reason.code, reason.reason) == EXPECTED_BOOTSTRAP
    assert daemon.supervisor.store.binding() is None
    assert daemon.supervisor.store.snapshot().terminated is None


def without_repositories(daemon):
    missing = body(daemon)
    del missing["repositories"]
    return missing


async def test_first_bootstrap_without_repositories_closes_1002(daemon):
    # The seed's schema requires `repositories`: a body without it does not match the schema,
    # so as a first frame it closes like any other schema violation, and binds nothing.
    async with daemon.client().connect() as session:
        await session.send("session.bootstrap", without_repositories(daemon))
        reason = await session.closed_reason()
    assert (reason.code, reason.reason) == EXPECTED_BOOTSTRAP
    assert daemon.supervisor.store.binding() is None


async def test_binary_first_frame_closes_1003(daemon):
    async with daemon.client().connect() as session:
        await session.ws.send_message(b"\x00\x01")
        reason = await session.closed_reason()
    assert reason.code == 1003


async def test_session_id_mismatch_closes_1008(daemon):
    async with daemon.client().connect() as session:
        wrong = body(daemon)
        wrong["sessionId"] = "another-session"
        await session.send("session.bootstrap", wrong)
        reason = await session.closed_reason()
    assert (reason.code, reason.reason) == MISMATCH
    assert daemon.supervisor.store.binding() is None


async def test_generation_mismatch_closes_1008(daemon):
    async with daemon.client().connect(generation=2) as session:
        await session.send("session.bootstrap", body(daemon), generation=1)
        reason = await session.closed_reason()
    assert (reason.code, reason.reason) == MISMATCH


async def test_accepted_bootstrap_reports_every_runtime_state_field(daemon, transport):
    client = daemon.client(daemon.tcp if transport == "tcp" else daemon.unix, scope="files:read shell:exec session:control")
    async with client.connect(generation=3) as session:
        state = await session.bootstrap(body(daemon))
    assert state["kind"] == "runtime.state"
    assert state["body"] == {
        "status": "ready",
        "sessionId": client.session_id,
        "generation": 3,
        "ackFloor": 0,
        "localEventMax": 0,
        "oldestRetainedSeq": 1,
        "supervisorVersion": daemon.supervisor.status.version,
        "protocolVersion": 1,
        "scopes": ["files:read", "session:control", "shell:exec"],
    }
    binding = daemon.supervisor.store.binding()
    assert binding is not None and binding.session_id == client.session_id


async def test_identical_bootstrap_after_reconnect_is_accepted(daemon):
    client = daemon.client()
    async with client.connect() as session:
        await session.bootstrap(body(daemon))
    digest = daemon.supervisor.store.binding().digest
    async with client.connect() as session:
        state = await session.bootstrap(body(daemon))
        assert state["body"]["generation"] == 2
    assert daemon.supervisor.store.binding().digest == digest


async def test_bootstrap_resent_on_attached_socket_is_rechecked(daemon):
    async with daemon.client().connect() as session:
        await session.bootstrap(body(daemon))
        await session.send("session.bootstrap", body(daemon))
        again = await session.receive()
        assert again["kind"] == "runtime.state"
        # A schema failure there is an ordinary bad frame, not a close.
        await session.send("session.bootstrap", {"sessionId": "session-1"})
        error = await session.receive()
        assert error["kind"] == "error" and error["body"]["code"] == "invalid_frame"
        await session.send("session.bootstrap", without_repositories(daemon))
        error = await session.receive()
        assert error["body"] == {"code": "invalid_frame", "message": "Frame does not match the session.bootstrap schema."}


@pytest.mark.parametrize(
    "agent, repositories",
    [
        ({"cwd": "relative/path"}, []),
        ({"cwd": "/tmp/../etc"}, []),
        ({"cwd": "/tmp/ws/"}, []),
        (None, [{"name": "repo", "root": "/somewhere/else"}]),
        (None, [{"name": "repo", "root": "{cwd}/../escape"}]),
        ({"profile": "Bad Profile"}, []),
    ],
    ids=["relative-cwd", "dotdot-cwd", "trailing-slash", "root-outside-cwd", "root-dotdot", "bad-profile"],
)
async def test_body_rule_violations_close_1002_and_bind_nothing(daemon, agent, repositories):
    payload = body(daemon)
    if agent:
        payload["agent"].update(agent)
    payload["repositories"] = [
        {**repo, "root": repo["root"].replace("{cwd}", payload["agent"]["cwd"])} for repo in repositories
    ]
    async with daemon.client().connect() as session:
        await session.send("session.bootstrap", payload)
        reason = await session.closed_reason()
    assert reason.code == 1002
    assert daemon.supervisor.store.binding() is None
    assert daemon.supervisor.store.snapshot().terminated is None


async def test_rejection_receipt_terminates_and_exits_78(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
        other = layout.workspace / "elsewhere"
        other.mkdir()
        with pytest.raises(BootstrapRejected) as info:
            async with client.connect() as session:
                await session.bootstrap(cwd=str(other))  # sends the 4400 receipt
        assert info.value.code == "session_binding_mismatch"
        assert await process.wait(timeout=10) == 78
    events = process.log_events()
    assert any(e.get("event") == "bootstrap.rejection_receipt" and e.get("observed") for e in events)
    # Started again, it finds itself terminated and exits 78 at once, before listening.
    async with running_daemon(layout, wait_ready=False) as restarted:
        assert await restarted.wait(timeout=10) == 78


async def test_receipt_makes_daemon_terminated_in_process(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d",
        authority=authority,
        bootstrap={"rejection_receipt_timeout_s": 2.0, "profiles": ["allowed"]},
        websocket={"drain_budget_s": 3.0},
    )
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            await session.send("session.bootstrap", body(daemon, profile="forbidden"))
            frame = await session.receive()
            assert frame["kind"] == "session.bootstrap.rejected"
            assert frame["body"]["code"] == "profile_not_allowed"
            # Before the receipt: the daemon is not terminated yet.
            health = await http_request(daemon.tcp, "GET", "/healthz")
            assert health.status == 200
            await session.ws.aclose(4400, "bootstrap rejection received")
        with trio.fail_after(5):
            await daemon.supervisor.status.stop_requested.wait()
        # From the receipt on, the gate refuses every upgrade until the process is gone.
        assert daemon.supervisor.status.lifecycle is Lifecycle.TERMINATED
        terminated = daemon.supervisor.store.snapshot().terminated
        assert terminated is not None and terminated.code == "profile_not_allowed"
    assert daemon.supervisor.status.stop.exit_code == 78


async def test_missing_receipt_closes_1011_after_budget(tmp_path, authority):
    layout = make_layout(
        tmp_path / "d",
        authority=authority,
        bootstrap={"rejection_receipt_timeout_s": 0.3, "profiles": ["allowed"]},
    )
    async with in_process_daemon(layout) as daemon:
        async with daemon.client().connect() as session:
            await session.send("session.bootstrap", body(daemon, profile="other"))
            frame = await session.receive()
            assert frame["kind"] == "session.bootstrap.rejected"
            started = trio.current_time()
            reason = await session.closed_reason(timeout=5)
            waited = trio.current_time() - started
        assert (reason.code, reason.reason) == (1011, "Supervisor rejection receipt was not observed.")
        assert waited >= 0.25
        assert daemon.supervisor.store.snapshot().terminated is not None
    assert daemon.supervisor.status.stop.exit_code == 78


@pytest.mark.parametrize(
    "cwd_of, code",
    [
        (lambda ws: "/", "cwd_not_in_workspace"),
        (lambda ws: str(ws / "missing"), "cwd_not_in_workspace"),
        (lambda ws: str(ws / "link-out"), "cwd_not_in_workspace"),
    ],
    ids=["outside-root", "missing-dir", "symlink-out"],
)
async def test_cwd_outside_workspace_is_rejected(tmp_path, authority, cwd_of, code):
    layout = make_layout(tmp_path / "d", authority=authority, bootstrap={"rejection_receipt_timeout_s": 1.0})
    (layout.workspace / "link-out").symlink_to(tmp_path)
    async with in_process_daemon(layout) as daemon:
        with pytest.raises(BootstrapRejected) as info:
            async with daemon.client().connect() as session:
                await session.bootstrap(body(daemon, cwd=cwd_of(layout.workspace)))
        assert info.value.code == code
        assert daemon.supervisor.store.binding() is None


async def test_missing_repository_root_is_rejected(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority, bootstrap={"rejection_receipt_timeout_s": 1.0})
    async with in_process_daemon(layout) as daemon:
        payload = body(daemon)
        payload["repositories"] = [{"name": "app", "root": str(layout.workspace / "app")}]
        with pytest.raises(BootstrapRejected) as info:
            async with daemon.client().connect() as session:
                await session.bootstrap(payload)
        assert info.value.code == "repository_root_missing"


async def test_startup_stage_facts_are_logged(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        async with process.running.client().connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
    assert process.returncode == 0
    facts = [e for e in process.log_events() if e.get("event") == "sandbox.startup-stage"]
    assert [(f["stage"], f["outcome"]) for f in facts] == [
        ("bootstrap-persisted", "success"),
        ("bootstrap-readiness-sent", "success"),
    ]
    assert all(f["sessionId"] == "session-1" and isinstance(f["duration"], (int, float)) for f in facts)


async def test_startup_stage_facts_when_the_readiness_snapshot_cannot_be_read(tmp_path, authority, log_lines, monkeypatch):
    """The persisted stage's line is written with the readiness stage's, after runtime.state
    went out or failed to: when the state cannot be read for runtime.state, both lines are
    still written, in order, the second a failure, and the socket closes 1011."""
    from sandbox_supervisor.daemon.state.store import StoreError

    layout = make_layout(tmp_path / "d", authority=authority)
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as session:
            await session.bootstrap(cwd=str(layout.workspace))
        before = len(log_lines())
        store = daemon.supervisor.store

        def snapshot():
            raise StoreError("disk I/O error")

        monkeypatch.setattr(store, "snapshot", snapshot)
        with pytest.raises(trio_websocket.ConnectionClosed) as info:
            async with client.connect() as session:
                await session.bootstrap(cwd=str(layout.workspace))
        assert info.value.reason.code == 1011
    facts = [e for e in log_lines()[before:] if e.get("event") == "sandbox.startup-stage"]
    assert [(f["stage"], f["outcome"]) for f in facts] == [
        ("bootstrap-persisted", "success"),
        ("bootstrap-readiness-sent", "failure"),
    ]


async def test_startup_stage_facts_when_the_socket_is_superseded_while_sending_readiness(
    tmp_path, authority, log_lines, monkeypatch
):
    """A socket superseded while its runtime.state is being written still logs both stage
    lines, in order (the binding was persisted), the readiness one a failure."""
    from sandbox_supervisor.daemon.websocket import ServerWebSocket

    real_send_message = ServerWebSocket.send_message
    stuck = trio.Event()

    async def send_message(self, message, *args, **kwargs):
        if not stuck.is_set() and '"runtime.state"' in str(message):
            stuck.set()
            await trio.sleep_forever()  # a peer that does not read: only a cancel ends it
        return await real_send_message(self, message, *args, **kwargs)

    monkeypatch.setattr(ServerWebSocket, "send_message", send_message)
    layout = make_layout(tmp_path / "d", authority=authority)
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with trio.open_nursery() as nursery:

            async def first() -> None:
                with trio.move_on_after(10), contextlib.suppress(trio_websocket.ConnectionClosed):
                    async with client.connect() as session:
                        await session.bootstrap(cwd=str(layout.workspace))

            nursery.start_soon(first)
            with trio.fail_after(10):
                await stuck.wait()
            assert daemon.supervisor.store.binding() is not None  # persisted before the send
            async with client.connect() as session:  # supersedes the stuck socket
                await session.bootstrap(cwd=str(layout.workspace))
            nursery.cancel_scope.cancel()
    facts = [(e["stage"], e["outcome"]) for e in log_lines() if e.get("event") == "sandbox.startup-stage"]
    assert facts == [
        ("bootstrap-persisted", "success"),
        ("bootstrap-readiness-sent", "failure"),
        ("bootstrap-persisted", "success"),
        ("bootstrap-readiness-sent", "success"),
    ]
