"""`sandbox-supervisor demo`: one whole session against a real daemon, narrated.

The daemon is started as users start it (`python -m sandbox_supervisor.daemon serve --config …`, a
subprocess) on temporary directories, with a freshly generated test authority; the
reference client plays the control plane.
"""

from __future__ import annotations

import base64
import hashlib
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import trio

from sandbox_supervisor.testing.authority import LoopbackAuthority
from sandbox_supervisor.testing.client import ControlSession, JsonObject, UpgradeRejected
from sandbox_supervisor.testing.daemon import DaemonProcess, make_layout

ZERO = "0" * 40

# One line for each term a reader meets, printed where it first appears (Narrator.explain).
EXPLANATIONS = {
    "generation": "a number the control plane raises with each connection: the daemon acts "
    "only on the newest, and refuses an older one (409 stale_generation), so two control "
    "planes never drive one sandbox at once",
    "seq": "every event the daemon sends (output, results) is journaled first and numbered "
    "in order, so a dropped connection loses none of them",
    "ack floor": "the highest seq up to which the client holds every event: acking it lets "
    "the daemon delete those events, and a reconnect asks for everything after it",
    "replay": "on a reconnect the daemon first sends every journaled event after the ack "
    "floor, in seq order, then goes on live, with no gap and no repeat at the seam",
    "idempotency key": "the client's name for a call: a retry with the same key runs nothing "
    "again and is answered from the stored result (tool.replayed)",
}
CLOSING = (
    "Read on: docs/protocol.md (the wire protocol, every frame and code) and "
    "docs/client-contract.md (what a client does after each close code and refusal)"
)


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Narrator:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.step = 0
        self.explained: set[str] = set()

    def title(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def say(self, text: str) -> None:
        self.step += 1
        print(f"{self.step:>2}. {text}", file=self.out, flush=True)

    def detail(self, text: str) -> None:
        print(f"      {text}", file=self.out, flush=True)

    def explain(self, *terms: str) -> None:
        """One line per term, the first time it appears only."""
        for term in terms:
            if term not in self.explained:
                self.explained.add(term)
                self.detail(f"({term}: {EXPLANATIONS[term]})")


def is_output(frame: JsonObject, call_id: str) -> bool:
    return frame.get("kind") == "exec.output" and frame["body"]["call_id"] == call_id


async def run_shell_steps(n: Narrator, session: ControlSession) -> None:
    # Output streams live, throttled, while the command runs.
    command = "for i in 1 2 3 4; do echo tick $i; sleep 0.2; done"
    call_id = await session.call("execute_shell_command", {"command": command}, idempotency_key="demo-ticks")
    n.say(f"execute_shell_command {command!r}")
    while True:
        frame = await session.receive()
        if is_output(frame, call_id):
            for line in frame["body"]["text"].splitlines():
                n.detail(f"live {frame['body']['stream']}: {line}")
        elif frame.get("kind") == "tool.result" and frame["body"]["call_id"] == call_id:
            n.detail(f"tool.result: exit_code {frame['body']['result']['exit_code']}")
            break

    # An interrupt reaches the command's whole process group.
    call_id = await session.call(
        "execute_shell_command", {"command": "echo waiting for SIGINT; sleep 30"}, idempotency_key="demo-int"
    )
    await session.receive_until(lambda f: is_output(f, call_id))
    await session.send("exec.signal", {"call_id": call_id, "signal": "SIGINT"})
    result = await session.result(call_id)
    n.say(f"exec.signal SIGINT to 'sleep 30' -> ended by {result['result']['signal']}")

    # A timeout: SIGTERM to the group, SIGKILL after the grace.
    result = await session.call_and_wait(
        "execute_shell_command", {"command": "sleep 30", "timeout_ms": 500}, idempotency_key="demo-timeout"
    )
    n.say(
        f"'sleep 30' with timeout_ms 500 -> timed_out {result['result']['timed_out']}, "
        f"signal {result['result']['signal']}, {result['result']['duration_ms']} ms"
    )

    # More output than the live view keeps: the spool has every byte.
    call_id = await session.call(
        "execute_shell_command", {"command": "seq 1 200000"}, idempotency_key="demo-seq"
    )
    result = await session.result(call_id)
    live = sum(f["body"]["bytes"] for f in session.client.state.events.values() if is_output(f, call_id))
    data = bytearray()
    while True:
        await session.send(
            "exec.read_output", {"call_id": call_id, "stream": "stdout", "offset": len(data), "length": 65536}
        )
        page = await session.receive_until(lambda f: f.get("kind") == "exec.output_page")
        data += base64.b64decode(page["body"]["data"])
        if page["body"]["eof"]:
            break
    lines = data.decode().split()
    assert lines == [str(i) for i in range(1, 200001)]
    n.say(
        f"'seq 1 200000' -> {result['result']['stdout']['bytes']} bytes; live events carried {live}, "
        f"exec.read_output paged back all {len(data)} (200000 lines, exact)"
    )


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def output_text(session: ControlSession, call_id: str) -> str:
    return "".join(
        f["body"]["text"] for _, f in sorted(session.client.state.events.items()) if is_output(f, call_id)
    )


async def wait_for_text(session: ControlSession, call_id: str, needle: str, after: int = 0) -> None:
    with trio.fail_after(20):
        while needle not in output_text(session, call_id)[after:]:
            await session.receive()


async def run_terminal_steps(n: Narrator, session: ControlSession) -> None:
    """A terminal: an interactive shell on a PTY, typed into with offsets, resized."""
    command = "PS1='$ ' exec bash --norc --noprofile -i"
    call_id = await session.call(
        "start_process", {"command": command, "pty": {"rows": 24, "cols": 80}}, idempotency_key="demo-pty"
    )
    started = await session.result(call_id)
    n.say(f"start_process with a pty (24x80): an interactive bash, pid {started['result']['pid']}")
    offset = 0
    for line, needle in (("stty size\n", "24 80"), ("RESIZE", "40 120"), ("exit 0\n", None)):
        if line == "RESIZE":
            await session.send("exec.resize", {"call_id": call_id, "rows": 40, "cols": 120})
            line = "stty size\n"
            n.detail("exec.resize to 40x120")
        before = len(output_text(session, call_id))
        await session.send("exec.write_stdin", {"call_id": call_id, "offset": offset, "data": b64(line)})
        ack = await session.receive_until(lambda f: f.get("kind") == "exec.stdin_ack")
        offset = ack["body"]["next_offset"]
        if needle is not None:
            await wait_for_text(session, call_id, needle, before)
            n.detail(f"typed {line.strip()!r} (stdin offset now {offset}) -> the terminal shows {needle!r}")
    completed = await session.receive_until(
        lambda f: f.get("kind") == "exec.completed" and f["body"]["call_id"] == call_id
    )
    n.detail(f"typed 'exit 0' -> exec.completed exit_code {completed['body']['exit_code']}")


async def run_survivor_steps(n: Narrator, process: DaemonProcess, client: Any, cwd: str) -> None:
    """A process that outlives a restart of the daemon (SIGUSR2: restart, keep processes)."""
    command = 'i=0; while :; do echo "count $i"; i=$((i+1)); sleep 0.2; done'
    async with client.connect() as session:
        await session.bootstrap(cwd=cwd)
        call_id = await session.call("start_process", {"command": command}, idempotency_key="demo-survivor")
        started = await session.result(call_id)
        await wait_for_text(session, call_id, "count 2")
        n.say(f"start_process of a counter, pid {started['result']['pid']}: 'count 0' … 'count 2' live")
    process.send_signal(signal.SIGUSR2)
    code = await process.wait()
    n.say(f"SIGUSR2 -> the daemon exits {code} (a restart that keeps processes); the counter runs on")
    running = await process.start()
    assert running is not None  # start() waits until the daemon listens (or raises)
    client.endpoint = running.tcp
    async with client.connect() as session:
        await session.bootstrap(cwd=cwd)
        seen = len(output_text(session, call_id))
        await wait_for_text(session, call_id, "count", seen)
        await session.send("exec.list", {})
        listing = await session.receive_until(lambda f: f.get("kind") == "exec.processes")
        mine = next(p for p in listing["body"]["processes"] if p["call_id"] == call_id)
        n.say(
            f"the new daemon adopted it: exec.list shows pid {mine['pid']} running {mine['running']}, "
            f"and its output goes on: {output_text(session, call_id)[seen:].split(chr(10))[0]!r}"
        )
        await session.send("exec.signal", {"call_id": call_id, "signal": "SIGTERM"})
        completed = await session.receive_until(
            lambda f: f.get("kind") == "exec.completed" and f["body"]["call_id"] == call_id
        )
        n.detail(f"exec.signal SIGTERM -> exec.completed signal {completed['body']['signal']}, reported once")
        await session.ack()


async def run_demo(root: Path, out: TextIO = sys.stdout) -> int:
    n = Narrator(out)
    layout = make_layout(root, authority=LoopbackAuthority(kid="demo-key"))
    (layout.workspace / "README.md").write_text("# demo project\nhello\n")
    process = DaemonProcess(layout)
    running = await process.start()
    # start() waits until the daemon listens (or raises), so both are there.
    assert running is not None and process.proc is not None
    n.title("sandbox-supervisor demo: a real daemon on temporary directories")
    n.detail(f"daemon pid {process.proc.pid}, listening on {running.tcp} and {running.unix}")
    n.detail(f"state dir {layout.state_dir}, workspace {layout.workspace}")
    cwd = str(layout.workspace)
    try:
        client = running.client()

        # A control plane holding the wrong key gets nowhere, and costs the daemon nothing.
        forger = running.client()
        forger.authority = LoopbackAuthority(kid="demo-key")  # same kid, different key
        try:
            async with forger.connect():
                pass
            raise AssertionError("a forged assertion was accepted")
        except UpgradeRejected as rejection:
            n.say(f"forged assertion (same kid, other key) -> HTTP {rejection.status} {rejection.error}")

        async with client.connect() as session:
            state = await session.bootstrap(cwd=cwd)
            body = state["body"]
            n.say(
                f"connect generation {session.generation} over TCP, bootstrap -> runtime.state "
                f"{body['status']} (scopes {' '.join(body['scopes'])})"
            )
            n.explain("generation")
            read = await session.call_and_wait("read_file", {"path": "README.md"})
            n.say(f"read_file README.md -> {read['result']['size']} bytes, sha {read['result']['sha'][:12]}")
            old = (layout.workspace / "README.md").read_bytes()
            diff = "--- a/README.md\n+++ b/README.md\n@@ -2 +2 @@\n-hello\n+hello, supervised world\n"
            patched = await session.call_and_wait(
                "apply_file_patch",
                {"path": "README.md", "diff": diff, "base_sha": blob_sha(old)},
                idempotency_key="demo-patch-1",
            )
            n.say(
                f"apply_file_patch README.md -> ok, {patched['result']['old_sha'][:12]} -> "
                f"{patched['result']['new_sha'][:12]}"
            )
            await run_shell_steps(n, session)
            await session.ack()
            n.detail(f"events.ack through seq {client.state.acked}: the ack floor is now {client.state.acked}")
            n.explain("seq", "ack floor")

            # The response to this call is lost: the connection drops before it is read.
            lost_params = {
                "path": "NOTES.md",
                "diff": "--- /dev/null\n+++ b/NOTES.md\n@@ -0,0 +1 @@\n+written exactly once\n",
                "base_sha": ZERO,
            }
            await session.call("apply_file_patch", lost_params, idempotency_key="demo-patch-2")
            n.say("apply_file_patch NOTES.md sent, then the connection drops before the result is read")

        # Reconnect (over the unix socket this time) with the floor the client has stored:
        # the daemon replays what was missed, then the retry is answered from the record.
        client.endpoint = running.unix
        async with client.connect() as session:
            floor = client.state.ack_floor
            await session.bootstrap(cwd=cwd)
            # Everything after the floor arrives in seq order: the replay of what the daemon
            # journaled meanwhile, then live events, with no gap at the seam.
            lost = await session.receive_until(
                lambda f: f.get("kind") == "tool.result"
                and f["body"].get("idempotency_key") == "demo-patch-2"
            )
            n.say(
                f"reconnect generation {session.generation} over unix with ack floor {floor} -> "
                f"the replay brings seq {lost['seq']}: tool.result of the lost call arrives (ok: {lost['body']['ok']})"
            )
            n.explain("replay")
            retry = await session.call("apply_file_patch", lost_params, idempotency_key="demo-patch-2")
            frame = await session.receive_until(lambda f: f["kind"] == "tool.replayed")
            assert frame["body"]["call_id"] == retry
            n.say(
                f"retry with the same idempotency key -> tool.replayed of seq "
                f"{frame['body']['original']['seq']}; NOTES.md written once: "
                f"{(layout.workspace / 'NOTES.md').read_text().strip()!r}"
            )
            n.explain("idempotency key")
            await run_terminal_steps(n, session)
            await session.ack()
        await run_survivor_steps(n, process, client, cwd)
    finally:
        code = await process.stop()
    n.say(f"SIGTERM -> daemon exited with status {code}")
    n.title(CLOSING)
    return 0 if code == 0 else 1


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="sandbox-supervisor-demo-") as tmp:
        return trio.run(run_demo, Path(tmp) / "demo")


if __name__ == "__main__":
    raise SystemExit(main())
