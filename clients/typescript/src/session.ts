// A control session that outlives its sockets: generations and the ack floor through a
// pluggable store, reconnects by the policy of policy.ts, exactly-once tool calls by
// idempotency key, output paging and held processes (docs/protocol.md §4, §7, §8, §9).

import { randomUUID } from "node:crypto";

import type { AssertionSource } from "./assertion.js";
import {
  BootstrapRejected,
  ConnectionClosed,
  ControlConnection,
  FrameRefused,
  FrameTooLarge,
  RequestTimeout,
  type OutputPage,
} from "./connection.js";
import { ConnectFailed, DEFAULT_CONTROL_PATH, openSocket, UpgradeRefused, type Endpoint } from "./endpoint.js";
import { DEFAULT_BACKOFF, decideClose, decideConnectFailure, decideRefusal, type BackoffOptions, type Decision } from "./policy.js";
import {
  Header,
  MAX_BINARY_OUTPUT_PAGE_LENGTH,
  MAX_OUTPUT_PAGE_LENGTH,
  MAX_STDIN_WRITE_BYTES,
  type BootstrapBody,
  type ErrorBody,
  type EventFrame,
  type ExecStdinAckBody,
  type ProcessInfo,
  type RuntimeStateBody,
  type StartProcessParams,
  type ToolName,
  type ToolParametersByName,
  type ToolResultBody,
  type ToolResultOk,
  type ToolResultFailure,
} from "./protocol.js";
import type { SessionStore } from "./store.js";

export interface SessionOptions {
  endpoint: Endpoint;
  /** The provider's sandbox id (e2b-sandbox-id). */
  sandboxId: string;
  sessionId: string;
  /** The control plane's id of this session's sandbox record. */
  sessionSandboxId: string;
  bootstrap: BootstrapBody;
  assertion: AssertionSource;
  store: SessionStore;
  path?: string;
  backoff?: BackoffOptions;
  /** Send a request_id on every exec.* frame and match its answer by it (default true;
   * false only for a supervisor older than the field, which refuses it, docs/protocol.md §6.3). */
  requestIds?: boolean;
  /** The supervisor's websocket.max_message_bytes, when it is not the default: a frame
   * larger than this is refused locally with FrameTooLarge instead of costing the socket. */
  maxMessageBytes?: number;
  /** How long to wait for runtime.state after the 101; then the socket is dropped and the
   * attempt counts as a failed connect (backoff, retry). */
  bootstrapTimeoutMs?: number;
  /** Every journaled event (and event.withheld), once, in seq order, after it is stored.
   * A throw here is reported to onFailure (EventHandlerFailed); the session goes on. */
  onEvent?: (event: EventFrame) => void;
  /** A throwing event handler (EventHandlerFailed: the event is stored and acked all the
   * same) or a failing store (StoreFailed: the session stops). Without this callback they
   * are emitted as process warnings. */
  onFailure?: (failure: EventHandlerFailed | StoreFailed) => void;
  /** An `error` frame that answers nothing the session sent and waits for. */
  onError?: (body: ErrorBody) => void;
  /** The session will not reconnect (the decision's reason). */
  onStopped?: (why: string) => void;
  /** Every frame received, before it is handled (a binary page: its header). */
  onFrame?: (frame: unknown, binary: boolean) => void;
  /** A decision after a close or a refusal (for logs). */
  onDecision?: (decision: Decision) => void;
}

export type CallResult<N extends ToolName> = ToolResultOk<N> | ToolResultFailure;

export interface CallOptions {
  /** Required for every tool but read_file (docs/protocol.md §7.1). */
  idempotencyKey?: string;
  /** Default: a fresh uuid (each retry on a new socket gets a new one, same key). */
  callId?: string;
}

interface PendingCall {
  tool: ToolName;
  parameters: unknown;
  key: string | undefined;
  /** The parameters as canonical JSON: a second call() with the key must match them. */
  fingerprint: string;
  callIds: Set<string>;
  pending: boolean;
  resolve(body: ToolResultBody): void;
  reject(error: Error): void;
  promise: Promise<ToolResultBody>;
}

// The answers after which nothing ran and the call's idempotency key is FREE: the same call
// sent again with the same key runs as a new call (docs/client-contract.md, "Tool results:
// may the key be sent again"; docs/protocol.md §8). Every other tool.result completes its key
// (`interrupted` too: the call was cut and is never run again) or is a refusal that a retry
// would only repeat, and resolves the call's promise.
export const KEY_FREEING_TOOL_ERRORS: ReadonlySet<string> = new Set(["supervisor_stopping", "too_many_processes", "resource_exhausted"]);
// A command whose call_id an earlier command used: refused before it ran, and the key is
// freed (the call_id belongs to the attempt, not to the call: docs/protocol.md §7.4.1 step 3,
// §8). Told apart from the invalid_parameters that complete a key only by this sentence.
export const CALL_ID_REUSED_MESSAGE = "This call_id was already used for a command.";
// The error frame after which nothing was recorded for a tool.call (ack, then send again).
export const KEY_FREEING_FRAME_ERRORS: ReadonlySet<string> = new Set(["journal_full"]);

/**
 * The call was not run and its idempotency key is free: call again with the same key.
 * `supervisor_stopping`: the supervisor's stop had begun; the session does not send anything
 * more on that socket, so the call made again goes to the next supervisor (after its restart).
 * `too_many_processes`, `resource_exhausted`: a shortage; try again later. `journal_full`:
 * too many unacknowledged events (the session acks what it stores); try again shortly.
 * `invalid_parameters` CALL_ID_REUSED_MESSAGE: the `callId` option named an earlier
 * command's call_id; call again without it (a fresh one).
 */
export class CallNotStarted extends Error {
  constructor(
    readonly code: string,
    readonly idempotencyKey: string | undefined,
    /** The tool.result body (a tool error) or the error frame's body (journal_full). */
    readonly body: ToolResultFailure | ErrorBody,
  ) {
    super(`the call was not started (${code}); its key is free: send it again with the same key`);
    this.name = "CallNotStarted";
  }
}

/**
 * The supervisor's state was reset (`409 ack_floor_ahead`, docs/client-contract.md,
 * "Recovering from ack_floor_ahead"): it forgot this call's key, so sending the call again
 * would run it again, and whether the first attempt took effect is unknown. Check (read the
 * file, list the processes), then call again with a new key if it must run.
 */
export class CallOutcomeUnknown extends Error {
  constructor(readonly idempotencyKey: string | undefined) {
    super("the supervisor's state was reset while the call was unanswered: its outcome is unknown");
    this.name = "CallOutcomeUnknown";
  }
}

/** The session stopped: reconnecting cannot help (the policy's reason). `cause`: the
 * failure that stopped it, when it was no decision of the policy (a StoreFailed). */
export class SessionStopped extends Error {
  constructor(readonly why: string, cause?: unknown) {
    super(`session stopped: ${why}`, cause === undefined ? undefined : { cause });
    this.name = "SessionStopped";
  }
}

/**
 * call() with an idempotency key already in flight for another call (another tool or other
 * parameters). Nothing was sent: the supervisor would answer `idempotency_key_reused`, and
 * the key stays the first call's. One key, one call: use a new key for this one.
 */
export class IdempotencyKeyReused extends Error {
  readonly code = "idempotency_key_reused";
  constructor(readonly idempotencyKey: string, readonly tool: ToolName, readonly inFlightTool: ToolName) {
    super(`the idempotency key ${JSON.stringify(idempotencyKey)} is in flight for another ${inFlightTool} call: nothing was sent`);
    this.name = "IdempotencyKeyReused";
  }
}

/** An onEvent callback or an event listener threw (or onStopped, called when the store
 * failed during an event). The event was stored and is acked: the
 * handler's failure is the application's, and the session goes on with the next event. */
export class EventHandlerFailed extends Error {
  constructor(readonly event: EventFrame, cause: unknown) {
    super(`a handler of event ${event.seq} (${event.kind}) threw: ${cause instanceof Error ? cause.message : String(cause)}`, { cause });
    this.name = "EventHandlerFailed";
  }
}

/**
 * The store failed while storing an event or reading the ack floor after it. The session
 * stops (SessionStopped, its cause this error) and closes its socket: nothing after the
 * failed event can be acked, and storing later events around a hole would only hide it.
 * Nothing is lost: the supervisor keeps every event above the store's ack floor, so a new
 * SupervisorSession on the repaired store gets them again (docs/client-contract.md, "The
 * ack floor").
 */
export class StoreFailed extends Error {
  constructor(readonly operation: "putEvent" | "ackFloor", readonly seq: number, cause: unknown) {
    super(`the store's ${operation} failed at event ${seq}: ${cause instanceof Error ? cause.message : String(cause)}`, { cause });
    this.name = "StoreFailed";
  }
}

/** JSON with every object's keys sorted: equal for parameters that differ only in order. */
export function canonicalJson(value: unknown): string {
  return JSON.stringify(value, (_key, inner: unknown) =>
    inner !== null && typeof inner === "object" && !Array.isArray(inner)
      ? Object.fromEntries(Object.entries(inner).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)))
      : inner,
  );
}

export interface ReadOutputOptions {
  offset?: number;
  /** Bytes per page; default the largest page of the format. */
  length?: number;
  /** "binary" pages (docs/protocol.md §6.5.1) or base64 JSON pages. */
  format?: "json" | "binary";
  /** Wait this long before asking again after an empty page that is not the end. */
  pollMs?: number;
  timeoutMs?: number;
}

/** A stdin write above the process's stdin offset: nothing was written (§7.7.2). */
export class StdinGap extends Error {
  constructor(readonly callId: string, readonly offset: number, readonly nextOffset: number) {
    super(`stdin of ${callId} stands at ${nextOffset}, below this write's offset ${offset}: write the bytes before it first`);
    this.name = "StdinGap";
  }
}

/** The process's stdin is closed: nothing more can be written. */
export class StdinClosed extends Error {
  constructor(readonly callId: string, readonly nextOffset: number) {
    super(`stdin of ${callId} is closed at ${nextOffset}`);
    this.name = "StdinClosed";
  }
}

export const DEFAULT_POLL_MS = 50;
// Between retries of a stdin write whose bytes the holder's buffer could not take yet.
export const STDIN_RETRY_MS = 20;

export class SupervisorSession {
  connection: ControlConnection | undefined;
  state: RuntimeStateBody | undefined;
  stopped: string | undefined;
  private stopCause: unknown;
  private readonly calls = new Map<string, PendingCall>(); // by key, or by call_id without one
  private readonly byCallId = new Map<string, PendingCall>();
  private acked = 0;
  private failures = 0;
  // invalid_authority refusals since the last attached socket: only these use up the
  // assertion's tries (MAX_AUTHORITY_RETRIES), not the draining refusals of a restart.
  private authorityRefusals = 0;
  // The store failed: the session stopped, and the events still queued are not stored.
  private storeFailed = false;
  private connecting: Promise<ControlConnection> | undefined;
  private readonly listeners = new Set<(event: EventFrame) => void>();
  private storing: Promise<void> = Promise.resolve();
  private closing = false;
  // The socket whose supervisor answered supervisor_stopping: its stop has begun, so nothing
  // more is sent on it; the next call waits for a socket to the next supervisor.
  private stopping: ControlConnection | undefined;

  constructor(readonly options: SessionOptions) {}

  /** Connect (reconnecting by the policy) and bootstrap; the state of the first socket. */
  async start(): Promise<RuntimeStateBody> {
    await this.connected();
    return this.state!;
  }

  /** The open, bootstrapped socket; connects when there is none. */
  connected(): Promise<ControlConnection> {
    if (this.stopped !== undefined) return Promise.reject(new SessionStopped(this.stopped, this.stopCause));
    const current = this.connection;
    if (current && !current.closed && current.state && current !== this.stopping) return Promise.resolve(current);
    this.connecting ??= this.connectLoop().finally(() => (this.connecting = undefined));
    return this.connecting;
  }

  /** Close the socket and stop reconnecting. */
  async close(): Promise<void> {
    this.closing = true;
    this.stop("closed by the client");
    const connection = this.connection;
    if (connection && !connection.closed) {
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, 2000);
        connection.close();
        const poll = setInterval(() => {
          if (connection.closed) {
            clearInterval(poll);
            clearTimeout(timer);
            resolve();
          }
        }, 5);
      });
    }
  }

  /**
   * Run a tool call; resolves with its tool.result body, however the supervisor answers:
   * the tool.result itself, tool.replayed (its original's body), or tool.pending (then the
   * tool.result of the first attempt: it carries the first attempt's call_id, which is
   * another replica's when another replica made it, so after a tool.pending the result is
   * matched by its idempotency key). One promise per idempotency key: calling again with a
   * key in flight and the same tool and parameters returns the same one; with another tool
   * or other parameters it rejects IdempotencyKeyReused (nothing is sent). A frame over the
   * supervisor's message limit rejects FrameTooLarge (nothing is sent). A lost socket re-sends the call on the next one with
   * a new call_id and the same key, which the supervisor answers without running it twice
   * (§8). Rejects with CallNotStarted when nothing ran and the key is free
   * (`supervisor_stopping`, `too_many_processes`, `resource_exhausted`, `journal_full`, an
   * earlier command's `callId`).
   */
  call<N extends ToolName>(tool: N, parameters: ToolParametersByName[N], options: CallOptions = {}): Promise<CallResult<N>> {
    const key = options.idempotencyKey;
    const existing = key === undefined ? undefined : this.calls.get(key);
    const fingerprint = canonicalJson({ tool, parameters });
    if (existing) {
      if (existing.fingerprint === fingerprint) return existing.promise as Promise<CallResult<N>>;
      return Promise.reject(new IdempotencyKeyReused(key!, tool, existing.tool));
    }
    let resolve!: (body: ToolResultBody) => void;
    let reject!: (error: Error) => void;
    const promise = new Promise<ToolResultBody>((res, rej) => ((resolve = res), (reject = rej)));
    const call: PendingCall = { tool, parameters, key, fingerprint, callIds: new Set(), pending: false, resolve, reject, promise };
    const slot = key ?? options.callId ?? randomUUID(); // a call without a key: its own slot
    const settle = (): void => {
      this.calls.delete(slot);
      for (const id of call.callIds) this.byCallId.delete(id);
    };
    call.resolve = (body) => (settle(), resolve(body));
    call.reject = (error) => (settle(), reject(error));
    this.calls.set(slot, call);
    void this.connected()
      .then((connection) => this.sendCall(connection, call, options.callId))
      .catch((error: Error) => call.reject(error));
    return promise as Promise<CallResult<N>>;
  }

  private sendCall(connection: ControlConnection, call: PendingCall, callId?: string): void {
    const id = callId && !call.callIds.has(callId) ? callId : randomUUID();
    call.callIds.add(id);
    this.byCallId.set(id, call);
    try {
      connection.send("tool.call", {
        tool_name: call.tool,
        call_id: id,
        ...(call.key !== undefined ? { idempotency_key: call.key } : {}),
        parameters: call.parameters,
      } as never);
    } catch (error) {
      // Too large to send: this call fails alone (it was never sent, so no socket resends
      // it); the socket and the other calls go on.
      if (!(error instanceof FrameTooLarge)) throw error;
      call.reject(error);
    }
  }

  /** Start a held process (docs/protocol.md §7.7.1); its call_id is its handle. */
  async startProcess(parameters: StartProcessParams, options: { idempotencyKey: string; callId?: string }): Promise<{ callId: string; result: CallResult<"start_process"> }> {
    const callId = options.callId ?? randomUUID();
    const result = await this.call("start_process", parameters, { ...options, callId });
    return { callId: result.call_id, result };
  }

  /**
   * Every byte of one stream from `offset`, page by page, until its end: JSON or binary
   * pages (§6.5.1). An empty page that is not the end means "nothing more yet": the iterator
   * waits for the call's next exec.output event or `pollMs`, then asks again. A lost socket
   * asks again on the next one at the same offset.
   */
  async *readOutput(callId: string, stream: "stdout" | "stderr", options: ReadOutputOptions = {}): AsyncGenerator<OutputPage> {
    const binary = options.format === "binary";
    const length = options.length ?? (binary ? MAX_BINARY_OUTPUT_PAGE_LENGTH : MAX_OUTPUT_PAGE_LENGTH);
    let offset = options.offset ?? 0;
    for (;;) {
      const connection = await this.connected();
      let page: OutputPage;
      try {
        page = await connection.readOutput(callId, stream, offset, length, binary, options.timeoutMs);
      } catch (error) {
        if (error instanceof ConnectionClosed) continue;
        throw error;
      }
      if (page.data.length > 0 || page.eof) yield page;
      if (page.eof) return;
      offset += page.data.length;
      if (page.data.length === 0) await this.waitForOutput(callId, options.pollMs ?? DEFAULT_POLL_MS);
    }
  }

  /** All of a stream, concatenated (readOutput until its end). */
  async readAll(callId: string, stream: "stdout" | "stderr", options: ReadOutputOptions = {}): Promise<Uint8Array> {
    const parts: Uint8Array[] = [];
    for await (const page of this.readOutput(callId, stream, options)) parts.push(page.data);
    return new Uint8Array(Buffer.concat(parts));
  }

  /**
   * Write `data` at stdin offset `offset` (docs/protocol.md §7.7.2) until every byte is
   * taken; returns the offset after them. Bytes below the process's offset are not written
   * twice, so the same write may be sent again after a lost answer or a reconnect: it is,
   * here, on ConnectionClosed.
   */
  async writeStdin(callId: string, data: Uint8Array, offset: number): Promise<number> {
    const end = offset + data.length;
    let next = offset;
    while (next < end || data.length === 0) {
      const chunk = data.subarray(next - offset, Math.min(end, next + MAX_STDIN_WRITE_BYTES) - offset);
      let ack: ExecStdinAckBody;
      try {
        ack = await (await this.connected()).writeStdin(callId, next, chunk);
      } catch (error) {
        if (error instanceof ConnectionClosed) continue;
        throw error;
      }
      if (ack.closed) throw new StdinClosed(callId, ack.next_offset);
      if (ack.next_offset < offset) throw new StdinGap(callId, offset, ack.next_offset);
      if (data.length === 0) return ack.next_offset;
      if (ack.next_offset === next) await new Promise((resolve) => setTimeout(resolve, STDIN_RETRY_MS)); // buffer full
      next = Math.max(next, ack.next_offset);
    }
    return end;
  }

  /** Close stdin after the byte below `offset` (§7.7.2). */
  async closeStdin(callId: string, offset: number): Promise<ExecStdinAckBody> {
    for (;;) {
      try {
        return await (await this.connected()).closeStdin(callId, offset);
      } catch (error) {
        if (!(error instanceof ConnectionClosed)) throw error;
      }
    }
  }

  async resize(callId: string, rows: number, cols: number): Promise<void> {
    return (await this.connected()).resize(callId, rows, cols);
  }

  async signal(callId: string, signal: "SIGINT" | "SIGTERM" | "SIGKILL" | "SIGHUP"): Promise<void> {
    return (await this.connected()).signal(callId, signal);
  }

  async listProcesses(): Promise<ProcessInfo[]> {
    return (await (await this.connected()).list()).processes;
  }

  /** The next event matching `predicate` (events stored from now on). */
  waitForEvent(predicate: (event: EventFrame) => boolean, timeoutMs = 30_000): Promise<EventFrame> {
    return new Promise((resolve, reject) => {
      const listener = (event: EventFrame): void => {
        if (!predicate(event)) return;
        clearTimeout(timer);
        this.listeners.delete(listener);
        resolve(event);
      };
      const timer = setTimeout(() => {
        this.listeners.delete(listener);
        reject(new RequestTimeout("an awaited event"));
      }, timeoutMs);
      this.listeners.add(listener);
    });
  }

  // --- connecting -------------------------------------------------------------------------

  private async connectLoop(): Promise<ControlConnection> {
    for (;;) {
      if (this.stopped !== undefined) throw new SessionStopped(this.stopped);
      let decision: Decision;
      try {
        const connection = await this.connectOnce();
        this.failures = 0;
        this.authorityRefusals = 0;
        this.resend(connection);
        return connection;
      } catch (error) {
        if (error instanceof UpgradeRefused) {
          decision = decideRefusal(error.status, error.code, error.retryAfterS, this.failures, this.backoff(), this.authorityRefusals);
          if (error.code === "invalid_authority") this.authorityRefusals += 1;
        } else if (error instanceof ConnectFailed) {
          decision = decideConnectFailure(this.failures, this.backoff());
        } else if (error instanceof ConnectionClosed) {
          decision = decideClose(error.code, error.reason, this.failures, this.backoff());
        } else if (error instanceof BootstrapRejected || error instanceof FrameTooLarge) {
          // FrameTooLarge: the bootstrap body itself is over the limit, every time.
          decision = { action: "stop", why: error.message };
        } else {
          throw error;
        }
      }
      this.failures += 1;
      await this.apply(decision);
    }
  }

  private backoff(): BackoffOptions {
    return this.options.backoff ?? { ...DEFAULT_BACKOFF, jitter: 0.5 + Math.random() / 2 };
  }

  private async apply(decision: Decision): Promise<void> {
    this.options.onDecision?.(decision);
    if (decision.action === "stop") {
      this.stop(decision.why);
      throw new SessionStopped(decision.why);
    }
    if (decision.action === "reset_journal") {
      await this.options.store.resetJournal();
      this.acked = 0;
      // The reset state remembers no key: a call already sent would run again if resent.
      for (const call of new Set(this.calls.values())) {
        if (call.callIds.size > 0) call.reject(new CallOutcomeUnknown(call.key));
      }
    }
    await new Promise((resolve) => setTimeout(resolve, decision.delayMs));
  }

  private async connectOnce(): Promise<ControlConnection> {
    const { store } = this.options;
    const generation = await store.nextGeneration();
    const ackFloor = await store.ackFloor();
    const attemptId = randomUUID();
    const assertion = await this.options.assertion({
      sandboxId: this.options.sandboxId,
      sessionId: this.options.sessionId,
      sessionSandboxId: this.options.sessionSandboxId,
      generation,
      attemptId,
      ackFloor,
    });
    const ws = await openSocket(
      this.options.endpoint,
      {
        [Header.SANDBOX_ID]: this.options.sandboxId,
        [Header.SESSION_ID]: this.options.sessionId,
        [Header.SESSION_SANDBOX_ID]: this.options.sessionSandboxId,
        [Header.ATTEMPT_ID]: attemptId,
        [Header.GENERATION]: String(generation),
        [Header.EVENT_ACK]: String(ackFloor),
        // The raw compact JWS: "Bearer <jwt>" is refused (docs/protocol.md §3.1).
        [Header.AUTHORITY]: assertion,
      },
      { path: this.options.path ?? DEFAULT_CONTROL_PATH },
    );
    const connection = new ControlConnection(
      ws,
      generation,
      {
        onEvent: (event) => this.onEvent(event, connection),
        onPending: (body) => {
          const call = this.byCallId.get(body.call_id);
          if (call) call.pending = true;
        },
        onReplayed: (body) => {
          const call = this.byCallId.get(body.call_id);
          if (call) this.settle(call, body.original.body, undefined); // a stored result: not live
        },
        onError: (body) => this.onErrorFrame(connection, body),
        ownsCall: (callId) => this.byCallId.has(callId),
        onFrame: (frame, binary) => this.options.onFrame?.(frame, binary),
        onProtocolViolation: (detail) => this.options.onError?.({ code: "invalid_frame", message: detail }),
        onClose: (code, reason) => this.onClose(connection, code, reason),
      },
      this.options.requestIds ?? true,
      this.options.maxMessageBytes,
    );
    this.connection = connection;
    this.acked = Math.max(this.acked, ackFloor);
    let state: RuntimeStateBody;
    try {
      state = await connection.bootstrap(this.options.bootstrap, this.options.bootstrapTimeoutMs);
    } catch (error) {
      if (error instanceof RequestTimeout) {
        // A 101 and then no runtime.state: a supervisor stuck, or a proxy that upgraded and
        // lost its far end. Drop the socket (a close handshake would wait on the same
        // silence) and count it as a failed connect: back off and try again.
        connection.terminate();
        throw new ConnectFailed(error);
      }
      if (error instanceof FrameTooLarge) connection.close();
      throw error;
    }
    // Events up to the supervisor's floor were acked (by this client or a replica sharing
    // the store) and are pruned: the store's floor is at least that (§6.5, runtime.state).
    await store.raiseFloor(state.ackFloor);
    this.acked = Math.max(this.acked, state.ackFloor);
    this.state = state;
    return connection;
  }

  /** Calls still unanswered go again on a new socket: new call_id, same key (§8). */
  private resend(connection: ControlConnection): void {
    for (const call of new Set(this.calls.values())) {
      if (call.callIds.size > 0) this.sendCall(connection, call);
    }
  }

  private onClose(connection: ControlConnection, code: number, reason: string): void {
    if (connection !== this.connection || this.closing || this.stopped !== undefined || !connection.state) return;
    // A socket that was open: reconnect in the background if the policy says so.
    const decision = decideClose(code, reason, 0, this.backoff());
    if (decision.action === "stop") {
      this.options.onDecision?.(decision);
      this.stop(decision.why);
      return;
    }
    void (async () => {
      try {
        await this.apply(decision);
        await this.connected();
      } catch {
        // stop() has told everyone
      }
    })();
  }

  private stop(why: string, cause?: unknown): void {
    if (this.stopped !== undefined) return;
    this.stopped = why;
    this.stopCause = cause;
    const error = new SessionStopped(why, cause);
    for (const call of new Set(this.calls.values())) call.reject(error);
    this.options.onStopped?.(why);
  }

  // --- events, results and acks ------------------------------------------------------------

  private onEvent(event: EventFrame, connection: ControlConnection): void {
    // Stored in order, one after the other; the ack follows what the store made durable.
    // handleEvent never rejects: a rejected chain would be an unhandled rejection (Node
    // exits on it) and would store and ack nothing after it.
    // The last catch is for the one user callback handleEvent does not guard itself
    // (onStopped, called when the store fails).
    this.storing = this.storing
      .then(() => this.handleEvent(event, connection))
      .catch((error: unknown) => this.report(new EventHandlerFailed(event, error)));
  }

  private async handleEvent(event: EventFrame, connection: ControlConnection): Promise<void> {
    if (this.storeFailed) return; // stopped: the next session gets these events again
    try {
      await this.options.store.putEvent(event);
    } catch (error) {
      return this.failStore(new StoreFailed("putEvent", event.seq, error), connection);
    }
    if (event.kind === "tool.result") {
      const call = this.byCallId.get(event.body.call_id) ?? this.pendingByKey(event.body);
      // Journaled after this socket attached (above runtime.state's localEventMax): sent
      // live by the supervisor at the other end, not replayed from an earlier one.
      const live = connection.state !== undefined && event.seq > connection.state.localEventMax;
      if (call) this.settle(call, event.body, live ? connection : undefined);
    }
    // Each handler on its own: one that throws neither stops the others nor the ack.
    for (const handler of [this.options.onEvent, ...this.listeners]) {
      try {
        handler?.(event);
      } catch (error) {
        this.report(new EventHandlerFailed(event, error));
      }
    }
    try {
      await this.ack();
    } catch (error) {
      this.failStore(new StoreFailed("ackFloor", event.seq, error), connection);
    }
  }

  private failStore(failure: StoreFailed, connection: ControlConnection): void {
    this.storeFailed = true;
    this.report(failure);
    this.stop(failure.message, failure);
    connection.close();
    if (this.connection !== connection) this.connection?.close();
  }

  private report(failure: EventHandlerFailed | StoreFailed): void {
    const { onFailure } = this.options;
    if (!onFailure) {
      process.emitWarning(failure);
      return;
    }
    try {
      onFailure(failure);
    } catch {
      // A reporter that throws has nobody left to report to; the session goes on.
    }
  }

  /**
   * The call a tool.result answers when it carries none of this session's call_ids: after a
   * tool.pending, the one result of the key is the first attempt's, and the first attempt may
   * have been another replica's (it shares the session's keys, docs/client-contract.md,
   * "Generations"). Not an `idempotency_key_reused` refusal: that answers a call that used
   * the key with other parameters, and leaves the key to the call it already belongs to.
   * The key alone cannot tell this session's key space from a delegated socket's, whose
   * results this socket sees too (docs/protocol.md §8): with delegated sockets, keep their
   * keys apart from the control plane's (docs/client-contract.md, "Matching replies").
   */
  private pendingByKey(body: ToolResultBody): PendingCall | undefined {
    if (body.idempotency_key === null) return undefined;
    const call = this.calls.get(body.idempotency_key);
    if (!call || !call.pending || call.key !== body.idempotency_key) return undefined;
    if (!body.ok && body.error.code === "idempotency_key_reused") return undefined;
    return call;
  }

  /** Resolve a call with its result, or reject it CallNotStarted when its key is free.
   * `live`: the socket that sent the result live (undefined for a replayed one). */
  private settle(call: PendingCall, body: ToolResultBody, live: ControlConnection | undefined): void {
    const freed =
      !body.ok &&
      (KEY_FREEING_TOOL_ERRORS.has(body.error.code) || (body.error.code === "invalid_parameters" && body.error.message === CALL_ID_REUSED_MESSAGE));
    if (!freed) {
      call.resolve(body);
      return;
    }
    // supervisor_stopping sent live: this socket's supervisor is going away; whatever is sent
    // next goes to the next one (this socket is closed 1001, and the session reconnects as
    // for any 1001). A replayed one was the stop of an earlier supervisor: this one serves.
    if (!body.ok && body.error.code === "supervisor_stopping" && live !== undefined) this.stopping = live;
    call.reject(new CallNotStarted(body.error.code, call.key, body as ToolResultFailure));
  }

  private async ack(): Promise<void> {
    const floor = await this.options.store.ackFloor();
    const connection = this.connection;
    // Acks need session:control (§3.5); a delegated socket's events are acked by the owner.
    if (floor <= this.acked || !connection || connection.closed || !connection.state?.scopes.includes("session:control")) return;
    connection.send("events.ack", { seq: floor });
    this.acked = floor;
  }

  private onErrorFrame(connection: ControlConnection, body: ErrorBody): void {
    if (body.code === "generation_mismatch") {
      // This socket no longer acts: a newer attempt passed the gate (another replica, as
      // with 1008 superseded); nothing sent on it ran. Fighting back would supersede it.
      this.stop("a newer connection attempt passed the gate (generation_mismatch)");
      connection.close();
      return;
    }
    const call = body.call_id ? this.byCallId.get(body.call_id) : undefined;
    if (call) {
      // journal_full: nothing was recorded, the key is free (ack, then send again; the session
      // acks what it stores). internal: the message says whether a retry with the same key is
      // safe; the caller decides.
      call.reject(KEY_FREEING_FRAME_ERRORS.has(body.code) ? new CallNotStarted(body.code, call.key, body) : new FrameRefused(body));
      return;
    }
    this.options.onError?.(body);
  }

  /** Until the next event of the call (output, its end) or `ms`, whichever comes first. */
  private waitForOutput(callId: string, ms: number): Promise<void> {
    return new Promise((resolve) => {
      const done = (): void => {
        clearTimeout(timer);
        this.listeners.delete(listener);
        resolve();
      };
      const listener = (event: EventFrame): void => {
        if (event.kind !== "event.withheld" && event.body.call_id === callId) done();
      };
      const timer = setTimeout(done, ms);
      this.listeners.add(listener);
    });
  }
}
