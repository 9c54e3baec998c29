// The client against the real daemon (started by tests/test_typescript_client.py as users
// start it: `sandbox-supervisor serve`). The tests share one session, so they run in order.

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import {
  CallNotStarted,
  DEFAULT_MAX_MESSAGE_BYTES,
  FrameRefused,
  FrameTooLarge,
  MemoryStore,
  StdinGap,
  type EventFrame,
  type ExecOutputEvent,
  type SupervisorSession,
} from "../src/index.js";
import { daemon, FrameChecker, newSession, until, type Daemon } from "./support.js";

const d = daemon();
const skip = d === undefined ? "no daemon: run through tests/test_typescript_client.py" : false;
const checker = new FrameChecker();
const store = new MemoryStore();
const seen = new Map<number, number>(); // seq -> times onEvent delivered it
let session: SupervisorSession;

function track(event: EventFrame): void {
  seen.set(event.seq, (seen.get(event.seq) ?? 0) + 1);
}

function outputText(callId: string): string {
  return [...store.events.values()]
    .filter((e): e is ExecOutputEvent => e.kind === "exec.output" && e.body.call_id === callId)
    .sort((a, b) => a.seq - b.seq)
    .map((e) => e.body.text)
    .join("");
}


async function dropAndReconnect(s: SupervisorSession): Promise<number> {
  const before = s.connection!;
  before.terminate(); // no close frame: a lost network (1006)
  await until("a new socket", () => s.connection !== before && s.connection?.state !== undefined);
  return s.connection!.generation;
}

before(async () => {
  if (!d) return;
  session = await newSession(d, d.tcp, store, { onEvent: track, onFrame: checker.check });
});

after(async () => {
  if (session) await session.close();
});

test("connects over TCP and bootstraps", { skip }, async () => {
  const state = await session.start();
  assert.equal(state.protocolVersion, 1);
  assert.equal(state.sessionId, "sess-ts-1");
  assert.equal(state.generation, store.generation); // clock-derived (MemoryStore)
  assert.deepEqual([...state.scopes].sort(), ["files:read", "files:write", "session:control", "shell:exec"]);
});

test("a call resolves with its tool.result, typed per tool", { skip }, async () => {
  writeFileSync(join((d as Daemon).workspace, "hello.txt"), "hello\n");
  const result = await session.call("read_file", { path: "hello.txt" });
  assert.equal(result.ok, true);
  if (result.ok) assert.equal(result.result.content, "hello\n"); // result: ReadFileResult
  const missing = await session.call("read_file", { path: "absent.txt" });
  assert.equal(missing.ok, false);
  if (!missing.ok) assert.equal(missing.error.code, "not_found");
});

test("pending and replayed resolve into the one promise of their key", { skip }, async () => {
  const ran = join((d as Daemon).workspace, "ran.log");
  writeFileSync(ran, "");
  // Long enough for the reconnect to come while it runs, on a loaded machine too.
  const command = "echo once >> ran.log; sleep 2; echo done";
  const first = session.call("execute_shell_command", { command }, { idempotencyKey: "ts-once" });
  assert.equal(session.call("execute_shell_command", { command }, { idempotencyKey: "ts-once" }), first, "one promise per key");
  await until("the command to start", () => readFileSync(ran, "utf8").includes("once"));
  // The socket drops while the command runs: the call goes again on the next socket with a
  // new call_id and the same key, is answered tool.pending, and the first attempt's result
  // settles the promise.
  const pendings: string[] = [];
  const previous = session.options.onFrame;
  session.options.onFrame = (frame, binary) => {
    previous?.(frame, binary);
    if ((frame as { kind?: string }).kind === "tool.pending") pendings.push("pending");
  };
  await dropAndReconnect(session);
  const result = await first;
  session.options.onFrame = previous;
  assert.equal(result.ok, true);
  if (result.ok) assert.equal(result.result.stdout.head, "done\n");
  assert.deepEqual(pendings, ["pending"]);
  // Completed: a new call with the key is answered tool.replayed, with the original result.
  const replayed = await session.call("execute_shell_command", { command }, { idempotencyKey: "ts-once" });
  assert.deepEqual(replayed, result);
  assert.ok(checker.kinds.has("tool.replayed"));
  assert.equal(readFileSync(ran, "utf8"), "once\n", "the command ran once");
});

test("a command with an earlier command's call_id: CallNotStarted, and the key runs with a fresh call_id", { skip }, async () => {
  const earlier = await session.call("execute_shell_command", { command: "true" }, { idempotencyKey: "ts-callid-1" });
  const reused = { command: "echo fresh" };
  await assert.rejects(
    session.call("execute_shell_command", reused, { idempotencyKey: "ts-callid-2", callId: earlier.call_id }),
    (error: unknown) => error instanceof CallNotStarted && error.code === "invalid_parameters" && error.idempotencyKey === "ts-callid-2",
  );
  const fresh = await session.call("execute_shell_command", reused, { idempotencyKey: "ts-callid-2" });
  assert.equal(fresh.ok && fresh.result.stdout.head, "fresh\n", "the key was free: the call ran");
});

test("a reconnect resumes from the ack floor: every event once, none lost", { skip }, async () => {
  const result = await session.call("execute_shell_command", { command: "echo one; echo two" }, { idempotencyKey: "ts-ack" });
  assert.equal(result.ok, true);
  const held = await store.ackFloor();
  assert.equal(held, Math.max(...store.events.keys()), "every event is held, so the floor is the last seq");
  const generation = await dropAndReconnect(session);
  assert.ok(generation > 1);
  // runtime.state: the supervisor's floor is the client's (the acks arrived, or the header).
  assert.equal(session.state?.ackFloor, held);
  const later = await session.call("read_file", { path: "hello.txt" });
  assert.equal(later.ok, true);
  const duplicated = [...seen].filter(([, times]) => times > 1);
  assert.deepEqual(duplicated, [], "no event delivered twice");
  const seqs = [...store.events.keys()].sort((a, b) => a - b);
  assert.deepEqual(seqs, Array.from({ length: seqs.length }, (_, i) => i + 1), "no seq missing");
});

test("output pages: JSON and binary, several pages, the same bytes", { skip }, async () => {
  const lines = 30_000;
  const expected = Array.from({ length: lines }, (_, i) => `${i + 1}\n`).join("");
  const result = await session.call("execute_shell_command", { command: `seq 1 ${lines}` }, { idempotencyKey: "ts-seq" });
  assert.equal(result.ok, true);
  const callId = result.call_id;
  const pages: number[] = [];
  const parts: Buffer[] = [];
  for await (const page of session.readOutput(callId, "stdout", { length: 50_000 })) {
    pages.push(page.data.length);
    parts.push(Buffer.from(page.data));
  }
  assert.equal(Buffer.concat(parts).toString("utf8"), expected);
  assert.ok(pages.length >= 4, `JSON pages: ${pages}`);
  const binaryBefore = checker.binaryPages;
  const binary = await session.readAll(callId, "stdout", { format: "binary", length: 60_000 });
  assert.equal(Buffer.from(binary).toString("utf8"), expected);
  assert.ok(checker.binaryPages - binaryBefore >= 3);
  const stderr = await session.readAll(callId, "stderr", { format: "binary" });
  assert.equal(stderr.length, 0);
  await assert.rejects(session.readAll(randomUUID(), "stdout"), (error: unknown) => error instanceof FrameRefused && error.code === "unknown_call");
});

test("reads of stdout, stderr and an unknown call in flight at once: each answer by its request_id", { skip }, async () => {
  const result = await session.call("execute_shell_command", { command: "echo out; echo err >&2" }, { idempotencyKey: "ts-rid" });
  assert.equal(result.ok, true);
  const connection = session.connection!;
  // What went out and what came back, by request id: the answer to each request echoes its id.
  const sent = new Map<string, string>(); // request_id -> "stream call_id"
  const send = connection.send.bind(connection);
  connection.send = ((kind: string, body: Record<string, unknown>) => {
    if (kind === "exec.read_output") sent.set(String(body.request_id), `${String(body.stream)} ${String(body.call_id)}`);
    send(kind as never, body as never);
  }) as typeof connection.send;
  const answered = new Map<string, string>(); // request_id -> what answered it
  const previous = session.options.onFrame;
  session.options.onFrame = (frame, binary) => {
    previous?.(frame, binary);
    const { kind, body } = frame as { kind: string; body: { request_id?: string; stream?: string; code?: string; call_id?: string } };
    if (body.request_id !== undefined) answered.set(body.request_id, kind === "error" ? `${body.code} ${body.call_id}` : `${body.stream} ${body.call_id}`);
  };
  const unknown = randomUUID();
  try {
    const [stdout, stderr, missing] = await Promise.allSettled([
      connection.readOutput(result.call_id, "stdout", 0, 1024, false),
      connection.readOutput(result.call_id, "stderr", 0, 1024, true),
      connection.readOutput(unknown, "stderr", 0, 1024, false),
    ]);
    assert.equal(stdout.status === "fulfilled" && Buffer.from(stdout.value.data).toString(), "out\n");
    assert.equal(stderr.status === "fulfilled" && Buffer.from(stderr.value.data).toString(), "err\n");
    assert.ok(missing.status === "rejected" && missing.reason instanceof FrameRefused && missing.reason.code === "unknown_call");
    // Three distinct ids went out, and each came back on the answer to its own request.
    assert.equal(sent.size, 3);
    for (const [id, request] of sent) {
      const [stream, callId] = request.split(" ");
      assert.equal(answered.get(id), callId === unknown ? `unknown_call ${unknown}` : `${stream} ${callId}`, id);
    }
  } finally {
    connection.send = send;
    session.options.onFrame = previous;
  }
});

test("a process on a PTY: stdin by offsets, never twice, resize, list, signal", { skip }, async () => {
  const { callId, result } = await session.startProcess(
    { command: "stty -echo; echo READY; cat", pty: { rows: 24, cols: 80 } },
    { idempotencyKey: "ts-pty" },
  );
  assert.equal(result.ok, true);
  if (result.ok) assert.equal(result.result.pty, true);
  await until("READY", () => outputText(callId).includes("READY"));
  assert.equal(await session.writeStdin(callId, Buffer.from("hello\n"), 0), 6);
  // The same bytes again (a lost answer, a reconnect): acknowledged, not written twice.
  assert.equal(await session.writeStdin(callId, Buffer.from("hello\n"), 0), 6);
  // Overlapping and going further: only what is new is written.
  assert.equal(await session.writeStdin(callId, Buffer.from("hello\nworld\n"), 0), 12);
  // A gap: nothing written, the ack says where stdin stands.
  const { request_id: echoed, ...gap } = await session.connection!.writeStdin(callId, 100, Buffer.from("zzz"));
  assert.deepEqual(gap, { call_id: callId, offset: 100, next_offset: 12, closed: false });
  assert.match(String(echoed), /^r\d+$/, "the ack echoes the write's request_id");
  await assert.rejects(session.writeStdin(callId, Buffer.from("zzz"), 100), (error: unknown) => error instanceof StdinGap && error.nextOffset === 12);
  await until("world", () => outputText(callId).includes("world"));
  const text = outputText(callId);
  assert.equal(text.split("hello").length - 1, 1, text);
  assert.equal(text.split("world").length - 1, 1, text);
  await session.resize(callId, 40, 100);
  const listed = (await session.listProcesses()).find((p) => p.call_id === callId);
  assert.ok(listed && listed.running && listed.pty);
  const completed = session.waitForEvent((e) => e.kind === "exec.completed" && e.body.call_id === callId);
  await session.signal(callId, "SIGKILL");
  const end = await completed;
  assert.equal(end.kind === "exec.completed" && end.body.signal, "SIGKILL");
  await assert.rejects(session.writeStdin(callId, Buffer.from("late"), 12), (error: unknown) => error instanceof FrameRefused && error.code === "not_running");
  const plain = await session.startProcess({ command: "cat" }, { idempotencyKey: "ts-plain" });
  await assert.rejects(session.resize(plain.callId, 10, 10), (error: unknown) => error instanceof FrameRefused && error.code === "not_a_terminal");
  const plainEnd = session.waitForEvent((e) => e.kind === "exec.completed" && e.body.call_id === plain.callId);
  assert.equal((await session.closeStdin(plain.callId, 0)).closed, true);
  const ended = await plainEnd; // cat read the end of its stdin and exited
  assert.equal(ended.kind === "exec.completed" && ended.body.exit_code, 0);
});

test("a call over the message limit is refused locally; the socket and the session go on", { skip }, async () => {
  const before = session.connection!;
  // One byte over the daemon's limit once framed: sent, it would close the socket 1009.
  const command = `echo ${"x".repeat(DEFAULT_MAX_MESSAGE_BYTES)}`;
  await assert.rejects(
    session.call("execute_shell_command", { command }, { idempotencyKey: "ts-too-large" }),
    (error: unknown) => error instanceof FrameTooLarge && error.kind === "tool.call" && error.bytes > DEFAULT_MAX_MESSAGE_BYTES,
  );
  // Nothing was sent: the same socket serves the next call, and the key was never claimed.
  const result = await session.call("execute_shell_command", { command: "echo fits" }, { idempotencyKey: "ts-too-large" });
  assert.equal(result.ok && result.result.exit_code, 0);
  assert.equal(session.connection, before);
  assert.equal(session.stopped, undefined);
});

test("over the unix socket: a new generation takes the session, the old socket stops", { skip }, async () => {
  const stops: string[] = [];
  session.options.onStopped = (why) => stops.push(why);
  // A round trip after the last events: the TCP socket's acks have been handled.
  await session.listProcesses();
  const held = await store.ackFloor();
  // A store that holds nothing (a new replica, say) but shares the generation counter: the
  // supervisor's floor in runtime.state is the one the TCP session's events.ack raised.
  const unixStore = new MemoryStore();
  unixStore.generation = store.generation;
  const viaUnix = await newSession(d as Daemon, (d as Daemon).unix, unixStore, { onFrame: checker.check });
  try {
    const state = await viaUnix.start();
    assert.ok(state.generation > session.connection!.generation);
    assert.equal(state.ackFloor, held, "the acks reached the supervisor");
    // The floor in runtime.state raised the store's: nothing at or below it was replayed.
    assert.ok((await unixStore.ackFloor()) >= held);
    assert.deepEqual([...unixStore.events.keys()].filter((seq) => seq <= held), []);
    const result = await viaUnix.call("read_file", { path: "hello.txt" });
    assert.equal(result.ok, true);
    await until("the TCP session to stop", () => stops.length > 0);
    assert.match(stops[0]!, /superseded/);
  } finally {
    await viaUnix.close();
  }
});

test("a control plane restarted with a new MemoryStore takes the session again", { skip }, async () => {
  // Its last generation is lost with the old store; the new store's generation comes from the
  // clock (docs/client-contract.md, "Generations") and is above the supervisor's fence.
  const restarted = await newSession(d as Daemon, (d as Daemon).tcp, new MemoryStore(), { onFrame: checker.check });
  try {
    const state = await restarted.start();
    assert.ok(state.generation > store.generation, `${state.generation} > ${store.generation}`);
    const result = await restarted.call("read_file", { path: "hello.txt" });
    assert.equal(result.ok, true);
  } finally {
    await restarted.close();
  }
});

test("every frame received is valid against the JSON Schemas (Ajv strict)", { skip }, () => {
  assert.deepEqual(checker.problems, []);
  for (const kind of ["runtime.state", "tool.result", "tool.pending", "tool.replayed", "exec.started", "exec.output", "exec.completed", "exec.output_page", "exec.stdin_ack", "exec.processes", "error"]) {
    assert.ok(checker.kinds.has(kind), `no ${kind} frame was checked`);
  }
  assert.ok(checker.binaryPages > 0);
});
