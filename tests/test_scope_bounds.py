"""Scopes bound what a socket sees and changes, not only which tools it calls
(docs/protocol.md §3.5, §8, §9.1), on a real daemon over real sockets.

The setting of every test: the control plane's own assertion (all scopes, session:control)
binds the session and does work; then a delegated assertion — `files:read` limited to `src` —
attaches to the same session. It must not see file content outside `src` or any shell output,
neither in a replay nor through an idempotency key, must not prune the journal, and must not
be able to bind or end the session.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio_websocket

from sandbox_supervisor.protocol import closes, errors
from sandbox_supervisor.protocol.frames import EVENT_WITHHELD
from sandbox_supervisor.testing.client import ControlClient, default_bootstrap_body
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout

SECRET = "TOPSECRET-9f3a"
SHELL_SECRET = "SHELLSECRET-71c2"
VISIBLE = "visible-in-src"
READER_SCOPE = "files:read"
READER_PATHS = ["src"]


def workspace_files(daemon) -> None:
    workspace = daemon.layout.workspace
    (workspace / "src").mkdir()
    (workspace / "src" / "a.txt").write_text(VISIBLE)
    (workspace / "secret").mkdir()
    (workspace / "secret" / "x.txt").write_text(SECRET)
    # A symlink inside src that leads to the secret: its result is the secret's, and the
    # view goes by the real path, not by the name the owner used.
    (workspace / "src" / "link.txt").symlink_to(workspace / "secret" / "x.txt")


async def owner_does_work(daemon, client: ControlClient) -> None:
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
        assert (await owner.call_and_wait("read_file", {"path": "secret/x.txt"}, idempotency_key="k-secret"))["ok"]
        assert (await owner.call_and_wait("read_file", {"path": "src/link.txt"}, idempotency_key="k-link"))["ok"]
        assert (await owner.call_and_wait("read_file", {"path": "src/a.txt"}, idempotency_key="k-src"))["ok"]
        shell = await owner.call_and_wait(
            "execute_shell_command", {"command": f"echo {SHELL_SECRET}"}, idempotency_key="k-shell"
        )
        assert shell["ok"] and SHELL_SECRET in shell["result"]["stdout"]["head"], shell["error"]


def as_reader(client: ControlClient) -> ControlClient:
    """The same control plane's client, now holding a delegated assertion; its stored events
    are forgotten so that what it receives next is all it has seen."""
    client.scope = READER_SCOPE
    client.state.events.clear()
    client.state.acked = 0
    return client


def reader_connect(client: ControlClient, **kwargs):
    return client.connect(ack_floor=0, claim_overrides={"allowed_paths": READER_PATHS}, **kwargs)


async def drain_frames(session, until_seq: int) -> list[dict]:
    frames = []
    with trio.fail_after(10):
        while not frames or frames[-1].get("seq", 0) < until_seq:
            frames.append(await session.receive())
    return frames


async def test_a_replay_withholds_what_the_assertion_does_not_cover(daemon):
    workspace_files(daemon)
    client = daemon.client()
    await owner_does_work(daemon, client)
    last = daemon.supervisor.journal.last_seq
    async with reader_connect(as_reader(client)) as reader:
        state = await reader.bootstrap(cwd=str(daemon.layout.workspace))
        assert state["body"]["scopes"] == [READER_SCOPE]
        frames = [f for f in await drain_frames(reader, last) if "seq" in f]
    # Every seq arrives once, in order: the client's seq handling does not change.
    assert [f["seq"] for f in frames] == list(range(1, last + 1))
    shown = [f for f in frames if f["kind"] != EVENT_WITHHELD]
    withheld = [f for f in frames if f["kind"] == EVENT_WITHHELD]
    assert [f["body"]["result"]["content"] for f in shown] == [VISIBLE]
    # The secret (directly and through the symlink in src) and the whole shell command.
    assert len(withheld) == last - 1
    assert all(f == {"kind": EVENT_WITHHELD, "seq": f["seq"], "body": {}} for f in withheld)
    text = json.dumps(frames)
    assert SECRET not in text and SHELL_SECRET not in text


async def test_an_idempotency_key_does_not_replay_what_the_paths_hide(daemon):
    """A socket in the owner's key space (it holds session:control) but limited to some
    paths: a retry of another socket's key replays only what its paths cover."""
    workspace_files(daemon)
    client = daemon.client()
    await owner_does_work(daemon, client)
    as_reader(client).scope = f"{READER_SCOPE} session:control"
    async with reader_connect(client) as reader:
        await reader.bootstrap(cwd=str(daemon.layout.workspace))
        for key, path in (("k-secret", "secret/x.txt"), ("k-link", "src/link.txt")):
            retry = await reader.call("read_file", {"path": path}, idempotency_key=key)
            frame = await reader.receive_until(
                lambda f, retry=retry: f["body"].get("call_id") == retry and f["kind"] in ("tool.result", "tool.replayed")
            )
            assert frame["kind"] == "tool.result"
            assert frame["body"]["error"]["code"] == errors.PATH_OUTSIDE_WORKSPACE
            assert frame["body"]["error"]["message"] == "The call's recorded result is not under any of allowed_paths."
            assert SECRET not in json.dumps(frame)
        # Inside its paths, a key replays as for anyone.
        retry = await reader.call("read_file", {"path": "src/a.txt"}, idempotency_key="k-src")
        frame = await reader.receive_until(lambda f: f["kind"] == "tool.replayed" and f["body"]["call_id"] == retry)
        assert frame["body"]["original"]["body"]["result"]["content"] == VISIBLE
    # The owner's records are untouched: its own retry still replays the secret.
    client.scope = "files:read files:write shell:exec session:control"
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
        again = await owner.call("read_file", {"path": "secret/x.txt"}, idempotency_key="k-secret")
        frame = await owner.receive_until(lambda f: f["kind"] == "tool.replayed" and f["body"]["call_id"] == again)
        assert frame["body"]["original"]["body"]["result"]["content"] == SECRET


async def test_a_delegated_retry_of_an_owner_key_runs_in_its_own_space(daemon):
    """Without session:control the same key names another record: the owner's result is
    neither replayed nor refused; the call runs fresh, as the reader's own."""
    workspace_files(daemon)
    client = daemon.client()
    await owner_does_work(daemon, client)
    async with reader_connect(as_reader(client)) as reader:
        await reader.bootstrap(cwd=str(daemon.layout.workspace))
        retry = await reader.call("read_file", {"path": "src/a.txt"}, idempotency_key="k-src")
        frame = await reader.receive_until(
            lambda f: f["body"].get("call_id") == retry and f["kind"] in ("tool.result", "tool.replayed")
        )
        assert frame["kind"] == "tool.result" and frame["body"]["result"]["content"] == VISIBLE


async def test_live_events_are_bounded_and_a_socket_sees_its_own_refusals(daemon):
    workspace_files(daemon)
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
    async with reader_connect(as_reader(client)) as reader:
        await reader.bootstrap(cwd=str(daemon.layout.workspace))
        inside = await reader.call_and_wait("read_file", {"path": "src/a.txt"})
        assert inside["result"]["content"] == VISIBLE
        # Its own refusals reach it: a path outside its view, a tool outside its scopes.
        outside = await reader.call_and_wait("read_file", {"path": "secret/x.txt"})
        assert outside["error"]["code"] == errors.PATH_OUTSIDE_WORKSPACE
        shell = await reader.call_and_wait("execute_shell_command", {"command": "true"}, idempotency_key="k-r")
        assert shell["error"]["code"] == errors.FORBIDDEN


async def test_an_ack_needs_session_control(daemon):
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
        await owner.call_and_wait("execute_shell_command", {"command": "true"}, idempotency_key="k-true")
    journal_before = daemon.supervisor.store.snapshot()
    async with reader_connect(as_reader(client)) as reader:
        await reader.bootstrap(cwd=str(daemon.layout.workspace))
        await reader.send("events.ack", {"seq": journal_before.local_event_max})
        frame = await reader.receive_until(lambda f: f["kind"] == "error")
        assert frame["body"]["code"] == errors.FORBIDDEN
    after = daemon.supervisor.store.snapshot()
    assert after.ack_floor == journal_before.ack_floor == 0
    assert after.oldest_retained_seq == 1  # nothing was pruned


async def test_a_different_bootstrap_without_session_control_terminates_nothing(daemon):
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
    digest = daemon.supervisor.store.binding().digest
    other = default_bootstrap_body(client.session_id, str(daemon.layout.workspace))
    other["agent"]["env"] = {"BASH_ENV": "/tmp/x"}
    as_reader(client)
    # As the first frame: refused, closed 1008, nothing terminated.
    async with reader_connect(client) as reader:
        await reader.send("session.bootstrap", other)
        frame = await reader.receive()
        assert frame["kind"] == "error" and frame["body"]["code"] == errors.FORBIDDEN
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await reader.receive()
        assert (closed.value.reason.code, closed.value.reason.reason) == (
            closes.CLOSE_POLICY_VIOLATION, closes.BIND_FORBIDDEN_REASON
        )
    # On an attached socket: refused, the socket stays attached.
    async with reader_connect(client) as reader:
        await reader.bootstrap(cwd=str(daemon.layout.workspace))
        await reader.send("session.bootstrap", other)
        frame = await reader.receive_until(lambda f: f["kind"] == "error")
        assert frame["body"]["code"] == errors.FORBIDDEN
        (daemon.layout.workspace / "still.txt").write_text("ok")
        assert (await reader.call_and_wait("read_file", {"path": "still.txt"}))["ok"] is False  # outside src
    snapshot = daemon.supervisor.store.snapshot()
    assert snapshot.terminated is None
    assert daemon.supervisor.store.binding().digest == digest
    assert daemon.supervisor.status.serving


async def test_an_assertion_without_session_control_cannot_bind(daemon):
    client = daemon.client(scope="files:read files:write shell:exec")
    async with client.connect() as session:
        await session.send("session.bootstrap", default_bootstrap_body(client.session_id, str(daemon.layout.workspace)))
        frame = await session.receive()
        assert frame["kind"] == "error" and frame["body"]["code"] == errors.FORBIDDEN
    assert daemon.supervisor.store.binding() is None
    assert daemon.supervisor.store.snapshot().terminated is None


async def test_the_legacy_setting_gives_every_assertion_session_control(tmp_path):
    layout = make_layout(tmp_path / "d")
    # Not through make_layout's keywords: its `authority` is the signing authority.
    layout.settings["authority"] = {"legacy_session_control": True}
    async with in_process_daemon(layout) as daemon:
        client = daemon.client(scope="files:read")
        async with client.connect() as session:
            state = await session.bootstrap(cwd=str(layout.workspace))
            assert state["body"]["scopes"] == ["files:read", "session:control"]
            await session.call_and_wait("read_file", {"path": "nothing-here"})
            await session.ack(daemon.supervisor.journal.last_seq)
            await session.call_and_wait("read_file", {"path": "nothing-here"})  # the ack was processed
        assert daemon.supervisor.store.snapshot().ack_floor >= 1


async def test_a_socket_limited_in_commands_sees_only_output_run_under_its_limit(daemon):
    """allowed_commands bounds the shell output a socket sees (§9.1): its own commands' output
    reaches it; a command run without that limit (the owner's) is withheld, live or replayed,
    and a retry of the owner's key is refused rather than replayed. (It holds session:control,
    so it shares the owner's key space: without it, the key would name its own record.)"""
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
        ran = await owner.call_and_wait("execute_shell_command", {"command": f"echo {SHELL_SECRET}"}, idempotency_key="k-own")
        assert ran["ok"]
    last = daemon.supervisor.journal.last_seq
    client.scope = "shell:exec session:control"
    client.state.events.clear()
    limited = {"allowed_commands": ["echo"]}
    async with client.connect(ack_floor=0, claim_overrides=limited) as worker:
        await worker.bootstrap(cwd=str(daemon.layout.workspace))
        replayed = await drain_frames(worker, last)
        assert {f["kind"] for f in replayed if "seq" in f} == {EVENT_WITHHELD}
        mine = await worker.call_and_wait("execute_shell_command", {"command": "echo mine-42"}, idempotency_key="k-w")
        assert mine["ok"] and mine["result"]["stdout"]["head"] == "mine-42\n"
        retry = await worker.call("execute_shell_command", {"command": f"echo {SHELL_SECRET}"}, idempotency_key="k-own")
        frame = await worker.receive_until(
            lambda f: f["body"].get("call_id") == retry and f["kind"] in ("tool.result", "tool.replayed")
        )
        assert frame["kind"] == "tool.result" and frame["body"]["error"]["code"] == errors.FORBIDDEN
    seen = [f for f in client.state.events.values() if f["kind"] != EVENT_WITHHELD]
    assert {f["kind"] for f in seen} == {"exec.started", "exec.output", "exec.completed", "tool.result"}
    assert SHELL_SECRET not in json.dumps(seen)


async def test_a_socket_limited_in_commands_cannot_read_or_signal_a_command_run_without_its_limit(daemon):
    """exec.read_output and exec.signal are bounded like the events (§9.1): a command the
    control plane ran without allowed_commands is unknown to a socket limited to `echo`, running
    or finished; the socket's own command (run under its limit) it reads and signals."""
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
        theirs = await owner.call("execute_shell_command", {"command": f"echo {SHELL_SECRET}; sleep 30"}, idempotency_key="k-o")
        await owner.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == theirs)
    client.scope = "shell:exec"
    client.state.events.clear()
    async with client.connect(ack_floor=0, claim_overrides={"allowed_commands": ["echo"]}) as worker:
        await worker.bootstrap(cwd=str(daemon.layout.workspace))
        for kind, body in (
            ("exec.read_output", {"call_id": theirs, "stream": "stdout", "offset": 0, "length": 1024}),
            ("exec.signal", {"call_id": theirs, "signal": "SIGKILL"}),
        ):
            await worker.send(kind, body)
            answer = await worker.receive_until(lambda f: f["kind"] in ("error", "exec.output_page"))
            assert answer["kind"] == "error" and answer["body"]["code"] == errors.UNKNOWN_CALL, answer
            assert SHELL_SECRET not in json.dumps(answer)
        mine = await worker.call("execute_shell_command", {"command": "echo mine-7"}, idempotency_key="k-w7")
        assert (await worker.result(mine))["ok"]
        await worker.send("exec.read_output", {"call_id": mine, "stream": "stdout", "offset": 0, "length": 1024})
        page = await worker.receive_until(lambda f: f["kind"] == "exec.output_page")
        assert page["body"]["data"] == "bWluZS03Cg=="  # base64 of "mine-7\n"
    client.scope = "files:read files:write shell:exec session:control"
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(daemon.layout.workspace))
        await owner.send("exec.signal", {"call_id": theirs, "signal": "SIGKILL"})  # still running: the worker could not
        assert (await owner.exec_completed(theirs))["signal"] == "SIGKILL"
