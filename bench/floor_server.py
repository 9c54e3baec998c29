"""The floor server: the least a trio-websocket server on this machine can do for each
benchmark, so that the daemon's figures can be read as ratios against it.

It runs in its own process (as the daemon does), listens on 127.0.0.1 with the daemon's
WebSocket settings (64 KiB receive buffer, 8-message queue), prints its port on stdout, and
exits when its stdin closes. Every message is text; its first character is the operation:

    E<anything>   echo the whole message back (one round trip)
    R<anything>   `trio.run_process(["/bin/bash", "-c", "true"])`, then echo the whole message
                  back: a spawn plus one WebSocket echo (exec_true's floor)
    W<path>       edit one byte of <path> in memory and write it atomically (temporary file,
                  write, fsync, close, rename, fsync of the directory), then answer "W"
    P<json>       {"db": path, "after": seq}: read `seq, frame_json` of the events table in
                  seq order with one SELECT and send every frame_json as its own message
    S<command>    `trio.run_process(["/bin/bash", "-c", command])` with its stdout captured, then
                  answer with that output: a process spawned and its first output read
    T<line>       write <line> to `cat` on a terminal (started on first use) and answer with
                  what the terminal gives back once it holds two line ends (the terminal's
                  echo of the line, and cat's copy of it)

It deliberately imports nothing from the project: it is the baseline, not the subject.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import trio
import trio_websocket

RECEIVE_BUFFER_BYTES = 64 * 1024  # as the daemon (supervisor/server.py)
MESSAGE_QUEUE = 8  # as the daemon
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
FETCH_ROWS = 512
BASH = "/bin/bash"  # by absolute path, as the daemon's shell runs: no PATH search in the floor
BASH_TRUE = [BASH, "-c", "true"]


class Floor:
    def __init__(self) -> None:
        self.files: dict[str, bytearray] = {}
        self.databases: dict[str, sqlite3.Connection] = {}
        self.terminal: int | None = None  # the master side of cat's terminal

    async def terminal_echo(self, line: bytes) -> str:
        if self.terminal is None:
            master, slave = os.openpty()
            subprocess.Popen(["cat"], stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
            os.close(slave)
            os.set_blocking(master, False)
            self.terminal = master
        os.write(self.terminal, line)
        got = b""
        while got.count(b"\n") < 2:
            await trio.lowlevel.wait_readable(self.terminal)
            got += os.read(self.terminal, 65536)
        return got.decode(errors="replace")

    async def handle(self, request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        while True:
            try:
                message = await ws.get_message()
            except trio_websocket.ConnectionClosed:
                return
            op = message[0]
            if op == "E":
                await ws.send_message(message)
            elif op == "R":
                await trio.run_process(BASH_TRUE)
                await ws.send_message(message)
            elif op == "W":
                self.atomic_edit(message[1:])
                await ws.send_message("W")
            elif op == "P":
                spec = json.loads(message[1:])
                await self.replay(ws, spec["db"], spec["after"])
            elif op == "S":
                done = await trio.run_process([BASH, "-c", message[1:]], capture_stdout=True)
                await ws.send_message(done.stdout.decode(errors="replace"))
            elif op == "T":
                await ws.send_message(await self.terminal_echo(message[1:].encode()))
            else:
                await ws.send_message("?")

    def atomic_edit(self, path: str) -> None:
        content = self.files.get(path)
        if content is None:
            with open(path, "rb") as handle:
                content = self.files[path] = bytearray(handle.read())
        middle = len(content) // 2
        content[middle] = ord("b") if content[middle] == ord("a") else ord("a")
        directory = os.path.dirname(path)
        temp = os.path.join(directory, f".{os.path.basename(path)}.floor-tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    async def replay(self, ws: trio_websocket.WebSocketConnection, db: str, after: int) -> None:
        conn = self.databases.get(db)
        if conn is None:
            conn = self.databases[db] = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        cursor = conn.execute(
            "SELECT seq, frame_json FROM events WHERE seq > ? ORDER BY seq", (after,)
        )
        while rows := cursor.fetchmany(FETCH_ROWS):
            for _seq, frame in rows:
                await ws.send_message(frame)


async def watch_stdin(cancel_scope: trio.CancelScope) -> None:
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    while await stream.receive_some(1024):
        pass
    cancel_scope.cancel()


async def main() -> None:
    floor = Floor()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: trio_websocket.serve_websocket(
                floor.handle,
                "127.0.0.1",
                0,
                None,
                message_queue_size=MESSAGE_QUEUE,
                max_message_size=MAX_MESSAGE_BYTES,
                receive_buffer_size=RECEIVE_BUFFER_BYTES,
                task_status=task_status,
            )
        )
        print(server.port, flush=True)
        nursery.start_soon(watch_stdin, nursery.cancel_scope)


if __name__ == "__main__":
    trio.run(main)
