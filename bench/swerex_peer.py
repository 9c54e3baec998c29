"""SWE-ReX, the peer measured in the same run: its server (`swerex-remote`, a FastAPI app under
uvicorn, as `pip install swe-rex` ships it) in its own process on 127.0.0.1, and a lean
HTTP/1.1 client for it in the benchmark's trio loop.

Not a benchmark itself (no NAME). The rows that compare against SWE-ReX use `swerex_server()`;
when swe-rex is not installed (the `bench` extra), it raises `Skipped` with the install hint, so
that a run with only the `test` extra (CI's smoke run) still exits 0.

The client keeps one HTTP connection open for every request (keep-alive), like the one
WebSocket the daemon's client keeps. SWE-ReX's own client (`RemoteRuntime`) opens a new
connection per request, which costs more: the comparison here is the peer's server at its
cheapest. Each request carries the auth token header the server requires.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import h11
import trio

from bench.common import CpuMeter, Driver, Result, Skipped, alternate, daemon, latency, now, workspace

MISSING = "swe-rex not installed (pip install -e '.[bench]')"
START_TIMEOUT_S = 30.0  # uvicorn and FastAPI import in ~1 s quiet; far more on a busy machine
STOP_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 120.0
RECEIVE_BYTES = 256 * 1024
# Lets a run pretend swe-rex is absent (the smoke test checks the SKIP path with it installed).
DISABLE_ENV = "SUPERVISOR_BENCH_WITHOUT_SWEREX"
SERVER_MAIN = "import sys; from swerex.server import main; sys.exit(main())"


def available() -> bool:
    if os.environ.get(DISABLE_ENV):
        return False
    return importlib.util.find_spec("swerex") is not None and importlib.util.find_spec("uvicorn") is not None


def require() -> None:
    if not available():
        raise Skipped(MISSING)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class HttpError(Exception):
    pass


class SweRexClient:
    """One keep-alive HTTP/1.1 connection to the server (h11, the parser the daemon uses)."""

    def __init__(self, stream: trio.SocketStream, host: str, token: str) -> None:
        self.stream = stream
        self.host = host
        self.token = token
        self.conn = h11.Connection(h11.CLIENT)

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        data = b"" if body is None else json.dumps(body).encode()
        headers = [("Host", self.host), ("X-API-Key", self.token), ("Content-Length", str(len(data)))]
        if body is not None:
            headers.append(("Content-Type", "application/json"))
        out = self.conn.send(h11.Request(method=method, target=path, headers=headers))
        out += self.conn.send(h11.Data(data=data)) if data else b""
        out += self.conn.send(h11.EndOfMessage())
        status = 0
        chunks: list[bytes] = []
        with trio.fail_after(REQUEST_TIMEOUT_S):
            await self.stream.send_all(out)
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    self.conn.receive_data(await self.stream.receive_some(RECEIVE_BYTES))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise HttpError(f"{method} {path}: the server closed the connection")
        self.conn.start_next_cycle()
        payload = b"".join(chunks)
        if status != 200:
            raise HttpError(f"{method} {path}: HTTP {status}: {payload[:500]!r}")
        return json.loads(payload)

    async def execute(self, argv: list[str]) -> dict[str, Any]:
        """POST /execute: SWE-ReX runs the command (subprocess.run, output captured) and answers
        with its stdout, stderr and exit code in one JSON body."""
        answer: dict[str, Any] = await self.request("POST", "/execute", {"command": argv, "shell": False})
        return answer


class SweRexServer:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, token: str) -> None:
        self.proc = proc
        self.port = port
        self.token = token

    @asynccontextmanager
    async def client(self) -> AsyncIterator[SweRexClient]:
        stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            yield SweRexClient(stream, f"127.0.0.1:{self.port}", self.token)
        finally:
            await stream.aclose()


async def wait_alive(server: SweRexServer) -> None:
    with trio.fail_after(START_TIMEOUT_S):
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"the SWE-ReX server exited with {server.proc.returncode} before it answered")
            try:
                async with server.client() as client:
                    await client.request("GET", "/is_alive")
                    return
            except (OSError, HttpError):
                await trio.sleep(0.05)  # polled under the deadline above: it is starting


@asynccontextmanager
async def swerex_server(log_path: Path) -> AsyncIterator[SweRexServer]:
    """`swerex-remote --host 127.0.0.1 --port P --auth-token T` in its own process (its log,
    uvicorn's access lines included, goes to `log_path`); stopped with SIGTERM on leaving."""
    require()
    token = secrets.token_hex(16)
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_MAIN, "--host", "127.0.0.1", "--port", str(port), "--auth-token", token],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = SweRexServer(proc, port, token)
    try:
        try:
            await wait_alive(server)
        except BaseException:
            sys.stderr.write(f"--- SWE-ReX server log ({log_path}) ---\n{log_path.read_text(errors='replace')[-4000:]}\n")
            raise
        yield server
    finally:
        proc.terminate()
        try:
            await trio.to_thread.run_sync(proc.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def compared(name: str, target: float, measured: list[float], peer: list[float], note: str) -> Result:
    """A row measured against SWE-ReX: its median time over the daemon's (higher is better),
    at least `target`."""
    ratio = statistics.median(peer) / statistics.median(measured)
    return Result(
        name,
        latency(measured),
        latency(peer),
        ratio,
        f">= {target:g}x (SWE-ReX / daemon)",
        ratio >= target,
        note,
        floor_label="SWE-ReX",
    )


T = TypeVar("T")
U = TypeVar("U")


async def alternated(
    workdir: Path,
    samples: int,
    warmup: int,
    on_peer: Callable[[SweRexClient], Awaitable[T]],
    on_daemon: Callable[[Driver], Awaitable[U]],
    check_peer: Callable[[T], None],
    check_daemon: Callable[[U], None],
    after_daemon: Callable[[Path, U], None] | None = None,
) -> tuple[list[float], list[float], CpuMeter, int]:
    """One SWE-ReX server and one daemon with a bootstrapped socket; samples alternate in
    blocks (peer, daemon, …: `common.alternate`), each timed around its callable, the warm-up
    ones discarded. What each returns is checked, and the daemon's events acked, after its
    timer stops; then `after_daemon`, if given, is called with the daemon's state directory
    and what its callable returned (output_10mb removes the sample's spool there). The
    daemon's times, the peer's, both servers' CPU after the warm-up, and how many operations
    each side did meanwhile (the count to divide that CPU by)."""
    async with swerex_server(workdir / "swerex.log") as rex, daemon(workdir / "daemon") as (process, running):
        client = running.client()
        async with rex.client() as http, client.connect() as session:
            await session.bootstrap(cwd=workspace(running.layout))
            driver = Driver(session)
            meters: list[CpuMeter] = []

            async def peer_once() -> float:
                started = now()
                answer = await on_peer(http)
                elapsed = now() - started
                check_peer(answer)
                return elapsed

            async def daemon_once() -> float:
                started = now()
                result = await on_daemon(driver)
                elapsed = now() - started
                check_daemon(result)
                await driver.maybe_ack()
                if after_daemon is not None:
                    after_daemon(running.layout.state_dir, result)
                return elapsed

            peer, measured, done = await alternate(
                samples,
                warmup,
                peer_once,
                daemon_once,
                lambda: meters.append(CpuMeter(process.proc.pid, rex.proc.pid, "SWE-ReX")),
            )
            meters[0].stop()
    return measured, peer, meters[0], done
