// Tool results whose key another attempt decides, against a real daemon (its own, as the
// last test stops it). After tool.pending, the result of another replica's first attempt
// settles the call by its key; after ack_floor_ahead a call already sent is not sent again.
// And supervisor_stopping: a command refused because the supervisor's stop
// had begun is a CallNotStarted with its key free, and the same call with the same key runs
// on the next supervisor. tests/test_typescript_client.py starts the daemon with a long
// exec.kill_grace_ms (the stop's frames are still handled while it waits out the grace,
// docs/protocol.md §10.1), passes its pid, and starts it again on the same state once this
// test's SIGTERM has ended it.

import assert from "node:assert/strict";
import { test } from "node:test";

import { CallNotStarted, CallOutcomeUnknown, MemoryStore, type ExecOutputEvent, type SupervisorSession } from "../src/index.js";
import { daemon, FrameChecker, newSession, until, type Daemon } from "./support.js";

const d = daemon();
const pid = Number(process.env.SUPERVISOR_PID);
const skip = d === undefined || !pid ? "no daemon to stop: run through tests/test_typescript_client.py" : false;


// The session's generation counter, shared by every session of this file as replicas share
// it in their store (docs/client-contract.md, "Generations").
let generation = 0;
function sharedStore(): MemoryStore {
  const store = new MemoryStore();
  store.nextGeneration = async () => (generation += 1);
  return store;
}

test("after tool.pending, the result of another replica's attempt settles the call, by its key", { skip }, async () => {
  const first = await newSession(d as Daemon, (d as Daemon).tcp, sharedStore());
  const second = await newSession(d as Daemon, (d as Daemon).unix, sharedStore());
  try {
    await first.start();
    const callIds = new Set<string>();
    // Long enough for the second replica to connect and send its call while it runs, on a
    // loaded machine too.
    const command = { command: "sleep 3; echo by-the-first" };
    const running = first.call("execute_shell_command", command, { idempotencyKey: "ts-replica" });
    running.catch(() => undefined); // the first replica is superseded: its promise rejects
    await until("the first attempt to start", () => started(first));
    // The second replica takes the session and sends the same call with the same key: the
    // supervisor answers tool.pending, and the one tool.result carries the FIRST replica's
    // call_id, none of the second's.
    second.options.onFrame = (frame) => {
      const { kind, body } = frame as { kind: string; body: { call_id?: string } };
      if (kind === "tool.pending" && body.call_id) callIds.add(body.call_id);
    };
    await second.start();
    const result = await second.call("execute_shell_command", command, { idempotencyKey: "ts-replica" });
    assert.equal(callIds.size, 1, "the second replica's call was answered tool.pending");
    assert.ok(!callIds.has(result.call_id), "the result is the first attempt's");
    assert.equal(result.ok && result.result.stdout.head, "by-the-first\n");
  } finally {
    await second.close();
    await first.close();
  }
});

/** Whether the session's command has started (its exec.started is stored). */
function started(session: SupervisorSession): boolean {
  return [...(session.options.store as MemoryStore).events.values()].some((e) => e.kind === "exec.started");
}

test("ack_floor_ahead (a reset state): a call already sent is not sent again but rejected CallOutcomeUnknown", { skip }, async () => {
  const store = sharedStore();
  const decisions: string[] = [];
  const session = await newSession(d as Daemon, (d as Daemon).tcp, store, { onDecision: (decision) => decisions.push(decision.action) });
  try {
    await session.start();
    // Still running when the socket drops (the stop of the last test ends it).
    const running = session.call("execute_shell_command", { command: "sleep 30" }, { idempotencyKey: "ts-reset" });
    await until("the command to start", () => started(session));
    // A floor above everything the supervisor journaled, as after a reset of its state: the
    // next upgrade is refused ack_floor_ahead.
    await store.raiseFloor(1_000_000_000);
    session.connection!.terminate();
    await assert.rejects(running, (error: unknown) => error instanceof CallOutcomeUnknown && error.idempotencyKey === "ts-reset");
    assert.ok(decisions.includes("reset_journal"), decisions.join());
    await until("a new socket", () => session.connection?.state !== undefined && !session.connection.closed);
    assert.equal(await store.ackFloor() < 1_000_000_000, true, "the journal was reset");
  } finally {
    await session.close();
  }
});

test("supervisor_stopping frees the key: the call made again runs on the next supervisor", { skip }, async () => {
  const store = sharedStore();
  const checker = new FrameChecker();
  const session = await newSession(d as Daemon, (d as Daemon).unix, store, { onFrame: checker.check });
  const output = (key: string): string =>
    [...store.events.values()]
      .filter((e): e is ExecOutputEvent => e.kind === "exec.output")
      .filter((e) => e.body.call_id === callIds.get(key))
      .map((e) => e.body.text)
      .join("");
  const callIds = new Map<string, string>();
  session.options.onFrame = (frame, binary) => {
    checker.check(frame, binary);
    const { kind, body } = frame as { kind: string; body: { call_id: string; tool_name?: string } };
    if (kind === "exec.started") callIds.set("held", body.call_id);
  };
  try {
    await session.start();
    // A command that outlives the stop's SIGTERM (it traps it) keeps the stop in its grace,
    // where the socket is still served; its "TERM" line says the stop has begun.
    const held = session.call(
      "execute_shell_command",
      { command: "trap 'echo TERM' TERM; echo READY; while :; do sleep 0.05; done" },
      { idempotencyKey: "ts-held" },
    );
    held.catch(() => undefined); // awaited below; a failure before that is the one to report
    await until("the held command to start", () => output("held").includes("READY"));
    process.kill(pid, "SIGTERM");
    await until("the stop to signal the held command", () => output("held").includes("TERM"));
    const again = { command: "echo again" };
    await assert.rejects(
      session.call("execute_shell_command", again, { idempotencyKey: "ts-stopping" }),
      (error: unknown) => error instanceof CallNotStarted && error.code === "supervisor_stopping" && error.idempotencyKey === "ts-stopping",
    );
    // The key is free, and nothing more goes to the stopping supervisor: the same call waits
    // for the next socket, to the supervisor started again on the same state, and runs there.
    const retried = await session.call("execute_shell_command", again, { idempotencyKey: "ts-stopping" });
    assert.equal(retried.ok, true, JSON.stringify(retried));
    if (retried.ok) assert.equal(retried.result.stdout.head, "again\n");
    assert.ok(session.connection!.generation > 1, "the retry went on a new socket");
    // The held call ended with the stop (its result reaches the client live or by replay).
    const ended = await held;
    assert.equal(ended.idempotency_key, "ts-held");
    assert.deepEqual(checker.problems, []);
  } finally {
    await session.close();
  }
});
