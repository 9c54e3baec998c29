// One control socket after its 101: the bootstrap, the frames both ways, and the matching of
// exec.* replies to their requests (docs/protocol.md §5, §6).
//
// Every exec.* frame carries a `request_id` this connection chooses ("r1", "r2", …), and
// whatever answers it echoes the id (docs/protocol.md §6.3, §6.5): a reply is matched to its
// request by that id, so two reads of one call_id in flight (stdout and stderr, say) each get
// their own page, and an `unknown_call` error goes to the read it answers. Replies also come
// in the order of the requests (the supervisor handles a socket's exec frames one after the
// other, docs/client-contract.md "Matching replies to requests"). exec.signal and
// exec.resize are answered only when they fail, so a request that gets no reply is confirmed
// by the reply to a later request; `barrier()` sends an exec.list for that. With request ids
// turned off (`sendRequestIds = false`, a supervisor older than the field) a reply is matched
// by what it echoes: (call_id, stream, offset) for a page, (call_id, offset) for a stdin ack,
// the oldest exec.list for exec.processes, the oldest request for its call_id for an error.

import type WebSocket from "ws";

import {
  BINARY_PAGE_HEADER_LENGTH_BYTES,
  CloseCode,
  CloseReason,
  DEFAULT_MAX_MESSAGE_BYTES,
  type BootstrapBody,
  type ClientFrameByKind,
  type ClientKind,
  type ErrorBody,
  type EventFrame,
  type ExecOutputPageHeaderBody,
  type ExecProcessesBody,
  type ExecStdinAckBody,
  type RuntimeStateBody,
  type ServerFrame,
  type ToolPendingBody,
  type ToolReplayedBody,
} from "./protocol.js";

/** One page of a stream, from a JSON or a binary exec.output_page. */
export interface OutputPage {
  call_id: string;
  stream: "stdout" | "stderr";
  offset: number;
  data: Uint8Array;
  eof: boolean;
  truncated: boolean;
}

/** The supervisor answered a request with an `error` frame (docs/protocol.md §6.5). */
export class FrameRefused extends Error {
  constructor(readonly body: ErrorBody) {
    super(`${body.code}: ${body.message}`);
    this.name = "FrameRefused";
  }
  get code(): string {
    return this.body.code;
  }
}

export class BootstrapRejected extends Error {
  constructor(readonly code: string, readonly detail: string) {
    super(`bootstrap rejected: ${code}: ${detail}`);
    this.name = "BootstrapRejected";
  }
}

/** The socket closed before the request was answered. */
export class ConnectionClosed extends Error {
  constructor(readonly code: number, readonly reason: string) {
    super(`connection closed: ${code} ${reason}`);
    this.name = "ConnectionClosed";
  }
}

/**
 * The frame is larger than the supervisor takes (`websocket.max_message_bytes`, UTF-8 bytes,
 * docs/protocol.md §1.4): it was not sent. Sent, it would close the socket 1009 and cost the
 * session (a reconnect would resend it); refused here, it costs only this request. Keep a
 * command or an `apply_file_patch`'s patch below the limit.
 */
export class FrameTooLarge extends Error {
  readonly code = "frame_too_large";
  constructor(readonly kind: string, readonly bytes: number, readonly limit: number) {
    super(`a ${kind} frame of ${bytes} bytes is over the supervisor's limit of ${limit} bytes: not sent`);
    this.name = "FrameTooLarge";
  }
}

/** Nothing came within the request's timeout. */
export class RequestTimeout extends Error {
  constructor(what: string) {
    super(`no answer to ${what}`);
    this.name = "RequestTimeout";
  }
}

type ExecKind = "exec.read_output" | "exec.write_stdin" | "exec.close_stdin" | "exec.list" | "exec.signal" | "exec.resize";

interface ExecRequest {
  kind: ExecKind;
  requestId: string | undefined;
  callId: string | undefined;
  stream?: string;
  offset?: number;
  resolve(value: unknown): void;
  reject(error: Error): void;
}

export interface ConnectionHandlers {
  /** A journaled event (or event.withheld), in seq order. */
  onEvent(event: EventFrame): void;
  onPending(body: ToolPendingBody): void;
  onReplayed(body: ToolReplayedBody): void;
  /** An `error` frame no exec request claimed (tool calls, acks, generation_mismatch). */
  onError(body: ErrorBody): void;
  /** Whether `callId` is a tool call awaiting its answer (its errors go to onError). */
  ownsCall(callId: string): boolean;
  /** Every frame as received (a binary page: its header), before it is handled: for logs
   * and for validating against the JSON Schemas. */
  onFrame?(frame: unknown, binary: boolean): void;
  /** A frame that is not JSON of a known kind, or a binary message that is no page. */
  onProtocolViolation(detail: string): void;
  onClose(code: number, reason: string): void;
}

export const DEFAULT_REQUEST_TIMEOUT_MS = 30_000;

export class ControlConnection {
  state: RuntimeStateBody | undefined;
  closed: { code: number; reason: string } | undefined;
  private readonly exec: ExecRequest[] = [];
  private bootstrapWaiter: { resolve(state: RuntimeStateBody): void; reject(error: Error): void } | undefined;
  private nextRequest = 0;

  constructor(
    private readonly ws: WebSocket,
    readonly generation: number,
    private readonly handlers: ConnectionHandlers,
    /** Send a client-chosen request_id on exec.* frames (protocol.md §6.3); off only for a
     * supervisor older than the field, which refuses it as an unknown member. */
    private readonly sendRequestIds = true,
    /** The supervisor's websocket.max_message_bytes: larger frames are refused here. */
    readonly maxMessageBytes: number = DEFAULT_MAX_MESSAGE_BYTES,
  ) {
    ws.on("message", (data: Buffer, isBinary: boolean) => this.receive(data, isBinary));
    ws.on("close", (code: number, reason: Buffer) => this.onClosed(code, reason.toString("utf8")));
    ws.on("error", () => undefined); // reported through "close"
  }

  /** Throws ConnectionClosed, or FrameTooLarge (nothing sent, the socket stays). */
  send<K extends ClientKind>(kind: K, body: ClientFrameByKind[K]["body"]): void {
    if (this.closed) throw new ConnectionClosed(this.closed.code, this.closed.reason);
    const text = JSON.stringify({ kind, connectionGeneration: this.generation, body });
    // The supervisor counts UTF-8 bytes (never fewer than the characters it also checks).
    const bytes = Buffer.byteLength(text, "utf8");
    if (bytes > this.maxMessageBytes) throw new FrameTooLarge(kind, bytes, this.maxMessageBytes);
    this.ws.send(text);
  }

  /** Send session.bootstrap; resolve with runtime.state, or close 4400 and throw
   * BootstrapRejected after session.bootstrap.rejected (docs/protocol.md §5.4). */
  bootstrap(body: BootstrapBody, timeoutMs = DEFAULT_REQUEST_TIMEOUT_MS): Promise<RuntimeStateBody> {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new RequestTimeout("session.bootstrap")), timeoutMs);
      this.bootstrapWaiter = {
        resolve: (state) => (clearTimeout(timer), resolve(state)),
        reject: (error) => (clearTimeout(timer), reject(error)),
      };
      try {
        this.send("session.bootstrap", body);
      } catch (error) {
        this.bootstrapWaiter.reject(error as Error);
        this.bootstrapWaiter = undefined;
      }
    });
  }

  close(code: number = CloseCode.NORMAL, reason = ""): void {
    if (!this.closed) this.ws.close(code, reason);
  }

  /** Drop the socket at once (no close handshake), as a lost network would. */
  terminate(): void {
    this.ws.terminate();
  }

  readOutput(callId: string, stream: "stdout" | "stderr", offset: number, length: number, binary: boolean, timeoutMs?: number): Promise<OutputPage> {
    const body = { call_id: callId, stream, offset, length, ...(binary ? { format: "binary" as const } : {}) };
    return this.request<OutputPage>("exec.read_output", body, { callId, stream, offset }, timeoutMs);
  }

  writeStdin(callId: string, offset: number, data: Uint8Array, timeoutMs?: number): Promise<ExecStdinAckBody> {
    const body = { call_id: callId, offset, data: Buffer.from(data).toString("base64") };
    return this.request<ExecStdinAckBody>("exec.write_stdin", body, { callId, offset }, timeoutMs);
  }

  closeStdin(callId: string, offset: number, timeoutMs?: number): Promise<ExecStdinAckBody> {
    return this.request<ExecStdinAckBody>("exec.close_stdin", { call_id: callId, offset }, { callId, offset }, timeoutMs);
  }

  list(timeoutMs?: number): Promise<ExecProcessesBody> {
    return this.request<ExecProcessesBody>("exec.list", {}, {}, timeoutMs);
  }

  /** exec.signal: resolves once a later reply shows it was not refused (see barrier). */
  signal(callId: string, signal: "SIGINT" | "SIGTERM" | "SIGKILL" | "SIGHUP", timeoutMs?: number): Promise<void> {
    const done = this.request<void>("exec.signal", { call_id: callId, signal }, { callId }, timeoutMs);
    void this.barrier(timeoutMs).catch(() => undefined);
    return done;
  }

  resize(callId: string, rows: number, cols: number, timeoutMs?: number): Promise<void> {
    const done = this.request<void>("exec.resize", { call_id: callId, rows, cols }, { callId }, timeoutMs);
    void this.barrier(timeoutMs).catch(() => undefined);
    return done;
  }

  /** An exec.list whose reply confirms every earlier exec.signal / exec.resize. */
  barrier(timeoutMs?: number): Promise<ExecProcessesBody> {
    return this.list(timeoutMs);
  }

  private request<T>(kind: ExecKind, body: Record<string, unknown>, match: { callId?: string; stream?: string; offset?: number }, timeoutMs = DEFAULT_REQUEST_TIMEOUT_MS): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const requestId = this.sendRequestIds ? `r${++this.nextRequest}` : undefined;
      const timer = setTimeout(() => {
        this.remove(entry);
        reject(new RequestTimeout(kind));
      }, timeoutMs);
      const entry: ExecRequest = {
        kind,
        requestId,
        callId: match.callId,
        ...(match.stream !== undefined ? { stream: match.stream } : {}),
        ...(match.offset !== undefined ? { offset: match.offset } : {}),
        resolve: (value) => (clearTimeout(timer), resolve(value as T)),
        reject: (error) => (clearTimeout(timer), reject(error)),
      };
      this.exec.push(entry);
      try {
        const sent = requestId === undefined ? body : { ...body, request_id: requestId };
        this.send(kind, sent as never);
      } catch (error) {
        this.remove(entry);
        entry.reject(error as Error);
      }
    });
  }

  private remove(entry: ExecRequest): void {
    const index = this.exec.indexOf(entry);
    if (index >= 0) this.exec.splice(index, 1);
  }

  /** Take the request a reply answers: every signal/resize before it is confirmed. */
  private take(predicate: (entry: ExecRequest) => boolean, requestId: unknown): ExecRequest | undefined {
    const index =
      typeof requestId === "string" ? this.exec.findIndex((entry) => entry.requestId === requestId) : this.exec.findIndex(predicate);
    if (index < 0) return undefined;
    const [entry] = this.exec.splice(index, 1);
    for (const earlier of this.exec.slice(0, index)) {
      if (earlier.kind === "exec.signal" || earlier.kind === "exec.resize") {
        this.remove(earlier);
        earlier.resolve(undefined);
      }
    }
    return entry;
  }

  private receive(data: Buffer, isBinary: boolean): void {
    if (isBinary) {
      this.receiveBinaryPage(data);
      return;
    }
    let frame: ServerFrame;
    try {
      frame = JSON.parse(data.toString("utf8")) as ServerFrame;
    } catch {
      this.handlers.onProtocolViolation("a text message that is not JSON");
      return;
    }
    this.handlers.onFrame?.(frame, false);
    this.dispatch(frame);
  }

  private receiveBinaryPage(data: Buffer): void {
    // docs/protocol.md §6.5.1: a 4-byte big-endian header length, the JSON header, the bytes.
    if (data.length < BINARY_PAGE_HEADER_LENGTH_BYTES) return this.handlers.onProtocolViolation("a binary message without a header");
    const size = data.readUInt32BE(0);
    const end = BINARY_PAGE_HEADER_LENGTH_BYTES + size;
    let header: { kind?: unknown; body?: ExecOutputPageHeaderBody & { request_id?: string } };
    try {
      header = JSON.parse(data.subarray(BINARY_PAGE_HEADER_LENGTH_BYTES, end).toString("utf8"));
    } catch {
      return this.handlers.onProtocolViolation("a binary page header that is not JSON");
    }
    this.handlers.onFrame?.(header, true);
    const body = header.body;
    const bytes = data.subarray(end);
    if (header.kind !== "exec.output_page" || body === undefined || body.bytes !== bytes.length) {
      return this.handlers.onProtocolViolation("a binary message that is not an exec.output_page of its length");
    }
    this.page({ call_id: body.call_id, stream: body.stream, offset: body.offset, data: new Uint8Array(bytes), eof: body.eof, truncated: body.truncated }, body.request_id);
  }

  private page(page: OutputPage, requestId: unknown): void {
    const entry = this.take(
      (e) => e.kind === "exec.read_output" && e.callId === page.call_id && e.stream === page.stream && e.offset === page.offset,
      requestId,
    );
    if (entry) entry.resolve(page);
  }

  private dispatch(frame: ServerFrame): void {
    switch (frame.kind) {
      case "runtime.state":
        this.state = frame.body;
        this.bootstrapWaiter?.resolve(frame.body);
        this.bootstrapWaiter = undefined;
        return;
      case "session.bootstrap.rejected":
        // The receipt the supervisor waits for before it terminates (§5.4).
        this.ws.close(CloseCode.REJECTION_RECEIPT, CloseReason.REJECTION_RECEIPT);
        this.bootstrapWaiter?.reject(new BootstrapRejected(frame.body.code, frame.body.message));
        this.bootstrapWaiter = undefined;
        return;
      case "tool.pending":
        return this.handlers.onPending(frame.body);
      case "tool.replayed":
        return this.handlers.onReplayed(frame.body);
      case "exec.output_page": {
        const body = frame.body as typeof frame.body & { request_id?: string };
        return this.page({ ...body, data: new Uint8Array(Buffer.from(body.data, "base64")) }, body.request_id);
      }
      case "exec.stdin_ack": {
        const body = frame.body as ExecStdinAckBody & { request_id?: string };
        const entry = this.take(
          (e) => (e.kind === "exec.write_stdin" || e.kind === "exec.close_stdin") && e.callId === body.call_id && e.offset === body.offset,
          body.request_id,
        );
        entry?.resolve(body);
        return;
      }
      case "exec.processes": {
        const body = frame.body as ExecProcessesBody & { request_id?: string };
        this.take((e) => e.kind === "exec.list", body.request_id)?.resolve(body);
        return;
      }
      case "error": {
        const body = frame.body as ErrorBody & { request_id?: string };
        // An error for an exec request: by request_id, else the oldest request for its call_id
        // (exec.list has none: forbidden without a call_id answers the oldest list).
        if (body.request_id === undefined && body.call_id && this.handlers.ownsCall(body.call_id)) {
          return this.handlers.onError(body);
        }
        const entry =
          body.request_id !== undefined || body.call_id
            ? this.take((e) => e.callId === body.call_id, body.request_id)
            : body.code === "forbidden"
              ? this.take((e) => e.kind === "exec.list", undefined)
              : undefined;
        if (entry) entry.reject(new FrameRefused(body));
        else this.handlers.onError(body);
        return;
      }
      default:
        if ("seq" in frame && typeof frame.seq === "number") {
          this.handlers.onEvent(frame);
          return;
        }
        this.handlers.onProtocolViolation(`an unknown frame kind ${JSON.stringify((frame as { kind?: unknown }).kind)}`);
    }
  }

  private onClosed(code: number, reason: string): void {
    this.closed = { code, reason };
    const error = new ConnectionClosed(code, reason);
    this.bootstrapWaiter?.reject(error);
    this.bootstrapWaiter = undefined;
    for (const entry of this.exec.splice(0)) entry.reject(error);
    this.handlers.onClose(code, reason);
  }
}
