// The session's faults that the real daemon never shows, against a small fake supervisor on
// loopback (`ws` and node:http): an upgrade refused on purpose, a 101 that never gets its
// runtime.state, events whose handlers throw or whose store fails. The daemon's own behaviour
// is tested in client.test.ts; this fake speaks only as much of the protocol as each test
// needs.

import assert from "node:assert/strict";
import { createServer, type IncomingMessage } from "node:http";
import type { AddressInfo } from "node:net";
import type { Duplex } from "node:stream";
import { after, afterEach, test } from "node:test";

import { WebSocketServer, type WebSocket } from "ws";

import { until } from "./support.js";

import {
  EventHandlerFailed,
  IdempotencyKeyReused,
  MAX_AUTHORITY_RETRIES,
  MemoryStore,
  SessionStopped,
  StoreFailed,
  SupervisorSession,
  type Decision,
  type Endpoint,
  type EventFrame,
  type SessionOptions,
} from "../src/index.js";

const SESSION = "sess-fake";


// An unhandled rejection would end a Node process without a test runner (the reviewer's
// finding 1): every test here asserts that none happened.
const unhandled: unknown[] = [];
process.on("unhandledRejection", (reason) => unhandled.push(reason));
afterEach(() => assert.deepEqual(unhandled.splice(0), [], "no unhandled rejection"));

interface Refusal {
  status: number;
  error: string;
}

/** A supervisor on 127.0.0.1 that refuses, serves, or keeps silent as a test sets it. */
class FakeSupervisor {
  upgrades = 0;
  /** The refusal of upgrade n (0-based), or undefined to accept it. */
  refuse: (n: number) => Refusal | undefined = () => undefined;
  /** Answer session.bootstrap with runtime.state (false: keep silent). */
  answerBootstrap = true;
  /** Events sent right after runtime.state. */
  events: EventFrame[] = [];
  readonly sockets: WebSocket[] = [];
  readonly received: { kind: string; body: Record<string, unknown> }[] = [];
  private readonly http = createServer();
  private readonly wss = new WebSocketServer({ noServer: true });

  constructor() {
    this.http.on("upgrade", (request: IncomingMessage, socket: Duplex, head: Buffer) => {
      const refusal = this.refuse(this.upgrades++);
      if (refusal) {
        const body = JSON.stringify({ error: refusal.error, message: "Refused by the fake." });
        socket.end(
          `HTTP/1.1 ${refusal.status} Refused\r\nContent-Type: application/json\r\n` +
            `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
        );
        return;
      }
      this.wss.handleUpgrade(request, socket, head, (ws) => this.serve(ws));
    });
  }

  async listen(): Promise<Endpoint> {
    await new Promise<void>((resolve) => this.http.listen(0, "127.0.0.1", resolve));
    return { tcp: { host: "127.0.0.1", port: (this.http.address() as AddressInfo).port } };
  }

  acks(): number[] {
    return this.received.filter((f) => f.kind === "events.ack").map((f) => f.body.seq as number);
  }

  async close(): Promise<void> {
    for (const ws of this.wss.clients) ws.terminate();
    this.http.closeAllConnections();
    await new Promise((resolve) => this.http.close(resolve));
  }

  private serve(ws: WebSocket): void {
    this.sockets.push(ws);
    ws.on("message", (data: Buffer) => {
      const frame = JSON.parse(data.toString("utf8")) as { kind: string; connectionGeneration: number; body: Record<string, unknown> };
      this.received.push(frame);
      if (frame.kind !== "session.bootstrap" || !this.answerBootstrap) return;
      const state = {
        status: "ready",
        sessionId: SESSION,
        generation: frame.connectionGeneration,
        ackFloor: 0,
        localEventMax: 0,
        oldestRetainedSeq: 1,
        supervisorVersion: "fake",
        protocolVersion: 1,
        scopes: ["files:read", "files:write", "shell:exec", "session:control"],
      };
      ws.send(JSON.stringify({ kind: "runtime.state", body: state }));
      for (const event of this.events) ws.send(JSON.stringify(event));
    });
  }
}

const fakes: FakeSupervisor[] = [];
const sessions: SupervisorSession[] = [];
after(async () => {
  for (const session of sessions) await session.close();
  for (const fake of fakes) await fake.close();
});

async function setUp(extra: Partial<SessionOptions> = {}): Promise<{ fake: FakeSupervisor; session: SupervisorSession; endpoint: Endpoint }> {
  const fake = new FakeSupervisor();
  fakes.push(fake);
  const endpoint = await fake.listen();
  const session = new SupervisorSession({
    endpoint,
    sandboxId: "sbx-fake",
    sessionId: SESSION,
    sessionSandboxId: "ssb-fake",
    bootstrap: { sessionId: SESSION, agent: { cwd: "/", profile: "default" }, repositories: [] },
    assertion: async () => "header.payload.signature", // the fake checks none
    store: new MemoryStore(),
    backoff: { initialMs: 2, maxMs: 20, jitter: 1 },
    ...extra,
  });
  sessions.push(session);
  return { fake, session, endpoint };
}

const withheld = (seq: number): EventFrame => ({ kind: "event.withheld", seq, body: {} });

test("a throwing event handler is reported; later events are still stored, delivered and acked", async () => {
  const failures: unknown[] = [];
  const delivered: number[] = [];
  const { fake, session } = await setUp({
    onEvent: (event) => {
      delivered.push(event.seq);
      if (event.seq === 1) throw new Error("the application's bug");
    },
    onFailure: (failure) => failures.push(failure),
  });
  fake.events = [withheld(1), withheld(2), withheld(3)];
  // A listener that throws too (a waitForEvent predicate): the others still get the event.
  const third = session.waitForEvent((event) => {
    if (event.seq === 2) throw new Error("a predicate's bug");
    return event.seq === 3;
  });
  await session.start();
  assert.equal((await third).seq, 3);
  await until("the ack of seq 3", () => fake.acks().includes(3));
  assert.deepEqual(delivered, [1, 2, 3]);
  assert.deepEqual(
    failures.map((f) => f instanceof EventHandlerFailed && [f.event.seq, (f.cause as Error).message]),
    [[1, "the application's bug"], [2, "a predicate's bug"]],
  );
  assert.equal(session.stopped, undefined);
});

test("a store that fails stops the session with StoreFailed, reported, and acks nothing past it", async () => {
  const store = new MemoryStore();
  const put = store.putEvent.bind(store);
  store.putEvent = async (event) => {
    if (event.seq === 2) throw new Error("disk full");
    return put(event);
  };
  const failures: unknown[] = [];
  const stops: string[] = [];
  const { fake, session } = await setUp({ store, onFailure: (f) => failures.push(f), onStopped: (why) => stops.push(why) });
  fake.events = [withheld(1), withheld(2), withheld(3)];
  await session.start();
  await until("the session to stop", () => stops.length > 0);
  assert.equal(failures.length, 1);
  const failure = failures[0];
  assert.ok(failure instanceof StoreFailed && failure.operation === "putEvent" && failure.seq === 2, String(failure));
  assert.match(stops[0]!, /putEvent failed at event 2: disk full/);
  // Its socket is closed, and the floor stayed below the event that was not stored: the
  // supervisor keeps 2 and 3 for the next session on the repaired store.
  await until("the fake to see the close", () => fake.sockets[0]!.readyState === fake.sockets[0]!.CLOSED);
  assert.deepEqual(fake.acks(), [1]);
  assert.deepEqual([...store.events.keys()], [1]);
  await assert.rejects(session.connected(), (error: unknown) => error instanceof SessionStopped && error.cause === failure);
});

test("a bootstrap never answered drops the socket and retries, then connects", async () => {
  const decisions: Decision[] = [];
  const { fake, session } = await setUp({ bootstrapTimeoutMs: 50, onDecision: (d) => decisions.push(d) });
  fake.answerBootstrap = false;
  const started = session.start();
  await until("two attempts without an answer", () => fake.sockets.length >= 2);
  // The first socket was dropped by the client, not left open.
  await until("the first socket to close", () => fake.sockets[0]!.readyState === fake.sockets[0]!.CLOSED);
  assert.ok(decisions.length >= 1 && decisions.every((d) => d.action === "reconnect"), JSON.stringify(decisions));
  // A supervisor that answers again: the waiting start() resolves, not rejects.
  fake.answerBootstrap = true;
  const state = await started;
  assert.equal(state.generation, session.connection!.generation);
  assert.equal(session.stopped, undefined);
});

test("call() with a key in flight: the same call gets its promise, another call IdempotencyKeyReused", async () => {
  const { fake, session } = await setUp();
  await session.start();
  const first = session.call("execute_shell_command", { command: "sleep 1", timeout_ms: 5000 }, { idempotencyKey: "k" });
  first.catch(() => undefined); // rejected SessionStopped when the session closes
  // The same tool and parameters (another key order): the same promise.
  assert.equal(session.call("execute_shell_command", { timeout_ms: 5000, command: "sleep 1" }, { idempotencyKey: "k" }), first);
  const other = session.call("execute_shell_command", { command: "rm -rf build" }, { idempotencyKey: "k" });
  assert.notEqual(other, first, "not the call in flight's promise");
  await assert.rejects(
    other,
    (error: unknown) => error instanceof IdempotencyKeyReused && error.code === "idempotency_key_reused" && error.idempotencyKey === "k",
  );
  await assert.rejects(
    session.call("read_file", { path: "a" }, { idempotencyKey: "k" }),
    (error: unknown) => error instanceof IdempotencyKeyReused && error.inFlightTool === "execute_shell_command",
  );
  // A later call on the same socket: once the fake has it, every frame before it arrived too.
  session.call("read_file", { path: "b" }, { idempotencyKey: "k2" }).catch(() => undefined);
  await until("the call with k2", () => fake.received.some((f) => f.body.idempotency_key === "k2"));
  const calls = fake.received.filter((f) => f.kind === "tool.call").map((f) => [f.body.idempotency_key, f.body.parameters]);
  assert.deepEqual(calls, [["k", { command: "sleep 1", timeout_ms: 5000 }], ["k2", { path: "b" }]]);
});

test("draining refusals do not use up the invalid_authority tries", async () => {
  const DRAINING = MAX_AUTHORITY_RETRIES + 2; // more failures in a row than the tries
  const refusals: string[] = [];
  const stops: string[] = [];
  const { fake, session } = await setUp({ onStopped: (why) => stops.push(why) });
  fake.refuse = (n) => {
    const refusal = n < DRAINING ? { status: 503, error: "draining" } : { status: 401, error: "invalid_authority" };
    refusals.push(refusal.error);
    return refusal;
  };
  await assert.rejects(session.start(), SessionStopped);
  // Every invalid_authority try was made: the first came after DRAINING failures in a row.
  assert.equal(refusals.filter((r) => r === "invalid_authority").length, MAX_AUTHORITY_RETRIES + 1);
  assert.equal(refusals.length, DRAINING + MAX_AUTHORITY_RETRIES + 1);
  assert.match(stops[0]!, /assertion keeps being refused/);
});
