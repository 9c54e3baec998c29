"""Attacks on the scope bounds (docs/protocol.md §8, §9.1) by a delegated assertion, on a real
daemon: each reproduces a way a review found to see, or to be denied, more than the rules
say, and holds the fix."""

from __future__ import annotations

import json
import os

import pytest
import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.frames import EVENT_WITHHELD
from sandbox_supervisor.daemon.state.keys import CallKey, key_space

SECRET = "TOPSECRET-rv-5d1e"
OWNER_SCOPE = "files:read files:write shell:exec session:control"


def as_reader(client, scope: str = "files:read"):
    client.scope = scope
    client.state.events.clear()
    client.state.acked = 0
    return client


async def drain(session, until_seq: int) -> list[dict]:
    frames: list[dict] = []
    with trio.fail_after(10):
        while not frames or frames[-1].get("seq", 0) < until_seq:
            frames.append(await session.receive())
    return [f for f in frames if "seq" in f]



async def test_own_result_of_a_symlink_loop_in_src_reaches_its_caller(daemon):
    """Was a bug: a file tool's failure raised inside resolve_in_jail other than
    path_outside_workspace (a symlink loop, EACCES on a component) leaves view_path None, so
    the result is stored with UNKNOWN_PATH and withheld from the restricted caller itself."""
    ws = daemon.layout.workspace
    (ws / "src").mkdir()
    os.symlink("loop", ws / "src" / "loop")
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(ws))
    async with as_reader(client).connect(ack_floor=0, claim_overrides={"allowed_paths": ["src"]}) as reader:
        await reader.bootstrap(cwd=str(ws))
        before = daemon.supervisor.journal.last_seq
        call_id = await reader.call("read_file", {"path": "src/loop/x"})
        # Its answer is the next event, whatever it is sent as.
        frame = await reader.receive_until(
            lambda f: f.get("seq") == before + 1 or f.get("body", {}).get("call_id") == call_id
        )
        assert frame["kind"] == "tool.result", frame  # is event.withheld: its own answer is hidden
        assert frame["body"]["error"]["code"] == errors.INVALID_PARAMETERS



async def test_allowed_path_with_dotdot_below_a_missing_dir_admits_nothing_in_view_either(daemon):
    """Was a bug: the jail treats `missing/../secret` as unresolvable (admits nothing), the audience
    resolves it with os.path.realpath to <cwd>/secret: the restricted socket cannot read
    secret itself, but receives the owner's reads of it."""
    ws = daemon.layout.workspace
    (ws / "secret").mkdir()
    (ws / "secret" / "x.txt").write_text(SECRET)
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(ws))
        assert (await owner.call_and_wait("read_file", {"path": "secret/x.txt"}))["ok"]
    last = daemon.supervisor.journal.last_seq
    paths = ["missing/../secret"]
    async with as_reader(client).connect(ack_floor=0, claim_overrides={"allowed_paths": paths}) as reader:
        await reader.bootstrap(cwd=str(ws))
        frames = await drain(reader, last)
        # The jail: nothing under secret is admitted for this assertion.
        own = await reader.call_and_wait("read_file", {"path": "secret/x.txt"})
        assert own["error"]["code"] == errors.PATH_OUTSIDE_WORKSPACE
    assert SECRET not in json.dumps(frames)



async def test_audience_follows_a_changed_symlink_in_allowed_paths(daemon):
    """BUG (stale audience, low): allowed_paths are resolved once at attach. `src` was a
    symlink to `secret` then; it is replaced by a real directory (the jail now admits only
    src), yet a retry of the owner's key still replays the secret to this socket."""
    ws = daemon.layout.workspace
    (ws / "secret").mkdir()
    (ws / "secret" / "x.txt").write_text(SECRET)
    (ws / "src").symlink_to(ws / "secret")
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(ws))
        assert (await owner.call_and_wait("read_file", {"path": "secret/x.txt"}, idempotency_key="k-s"))["ok"]
    async with as_reader(client).connect(ack_floor=0, claim_overrides={"allowed_paths": ["src"]}) as reader:
        await reader.bootstrap(cwd=str(ws))
        (ws / "src").unlink()
        (ws / "src").mkdir()
        own = await reader.call_and_wait("read_file", {"path": "secret/x.txt"})
        assert own["error"]["code"] == errors.PATH_OUTSIDE_WORKSPACE  # the jail has moved on
        retry = await reader.call("read_file", {"path": "secret/x.txt"}, idempotency_key="k-s")
        frame = await reader.receive_until(
            lambda f: f["kind"] in ("tool.result", "tool.replayed") and f["body"].get("call_id") == retry
        )
        assert SECRET not in json.dumps(frame), frame



async def test_a_recovered_call_of_a_restricted_socket_replays_to_it(layout):
    """Was a bug: crash recovery completes file-tool calls without a view (UNKNOWN_PATH), although
    the intent holds cwd, allowed_paths and (once planned) the target. The restricted socket
    whose patch was in flight can then never learn its outcome: its retry with the same key
    and parameters is refused path_outside_workspace for a path its jail admits."""
    from sandbox_supervisor.protocol.tools import ApplyFilePatchParams, call_digest
    from sandbox_supervisor.daemon.state.store import StateStore
    from sandbox_supervisor.testing.daemon import in_process_daemon

    ws = layout.workspace
    (ws / "src").mkdir(parents=True, exist_ok=True)
    (ws / "src" / "a.txt").write_text("one\n")
    diff = "--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1 +1 @@\n-one\n+two\n"
    import hashlib

    base = hashlib.sha1(b"blob 4\x00one\n").hexdigest()
    params = {"path": "src/a.txt", "diff": diff, "base_sha": base}
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        async with client.connect() as owner:
            await owner.bootstrap(cwd=str(ws))
            session_id = client.session_id
    # The restricted socket's call was recorded (in its own key space), then the daemon died
    # before it ran.
    intent = {"parameters": params, "cwd": str(ws), "allowed_paths": ["src"], "session_id": session_id, "generation": 2}
    digest = call_digest("apply_file_patch", ApplyFilePatchParams.model_validate(params))
    with StateStore.open(layout.state_dir) as store:
        store.begin_call(key=CallKey(key_space({"files:write"}, ["src"], None), "k-p"), tool_name="apply_file_patch", digest=digest, call_id="0f1f0360-0000-4000-8000-000000000001", intent_json=json.dumps(intent))
    async with in_process_daemon(layout) as daemon:
        assert (ws / "src" / "a.txt").read_text() == "two\n"  # recovery applied it
        client.endpoint = daemon.tcp
        as_reader(client, "files:write")
        async with client.connect(ack_floor=0, claim_overrides={"allowed_paths": ["src"]}) as reader:
            await reader.bootstrap(cwd=str(ws))
            retry = await reader.call("apply_file_patch", params, idempotency_key="k-p")
            frame = await reader.receive_until(
                lambda f: f["kind"] in ("tool.result", "tool.replayed") and f["body"].get("call_id") == retry
            )
            assert frame["kind"] == "tool.replayed", frame["body"].get("error")
            # Recovered in the socket's key space, echoed with the key as the socket sent it.
            assert frame["body"]["original"]["body"]["idempotency_key"] == "k-p"


async def test_allowed_commands_bound_what_shell_output_a_socket_sees(daemon):
    """Was a design gap: shell events are shown to every shell:exec socket because "a command can
    read anything its user can"; that premise fails for an assertion with allowed_commands
    (and allowed_paths). A socket limited to `ls` in src receives the owner's `cat
    secret/x.txt` output on replay (and through the owner's key: §8 does not re-check
    allowed_commands on a replay)."""
    ws = daemon.layout.workspace
    (ws / "src").mkdir()
    (ws / "secret").mkdir()
    (ws / "secret" / "x.txt").write_text(SECRET)
    client = daemon.client()
    async with client.connect() as owner:
        await owner.bootstrap(cwd=str(ws))
        assert (await owner.call_and_wait("execute_shell_command", {"command": "cat secret/x.txt"}, idempotency_key="k-cat"))["ok"]
    last = daemon.supervisor.journal.last_seq
    claims = {"allowed_paths": ["src"], "allowed_commands": ["ls"]}
    async with as_reader(client, "shell:exec").connect(ack_floor=0, claim_overrides=claims) as reader:
        await reader.bootstrap(cwd=str(ws))
        frames = await drain(reader, last)
        own = await reader.call_and_wait("execute_shell_command", {"command": "cat secret/x.txt"})
        assert not own["ok"]  # it may not run cat itself
    assert SECRET not in json.dumps(frames)
