// Generated from protocol/schemas/ (the pydantic models of protocol/) by
// `python -m sandbox_supervisor.protocol.typescript_export`. Do not edit by hand:
// `--check` reports drift, and tests/test_typescript_client.py runs it.
/* eslint-disable */

/**
 * The tools of docs/protocol.md §7.
 */
export type ToolName =
  | "apply_file_patch"
  | "execute_shell_command"
  | "read_file"
  | "start_process"
;

/**
 * Assertion scopes (docs/protocol.md §3.5).
 */
export type Scope =
  | "files:read"
  | "files:write"
  | "session:control"
  | "shell:exec"
;

/**
 * The `code` of an `error` frame (docs/protocol.md §6.5).
 */
export type FrameErrorCode =
  | "ack_ahead"
  | "forbidden"
  | "generation_mismatch"
  | "internal"
  | "invalid_frame"
  | "journal_full"
  | "not_a_terminal"
  | "not_running"
  | "unknown_call"
  | "unknown_kind"
;

/**
 * The `code` of a failed `tool.result` (docs/protocol.md §7.6).
 */
export type ToolErrorCode =
  | "base_sha_mismatch"
  | "file_too_large"
  | "forbidden"
  | "idempotency_key_reused"
  | "internal"
  | "interrupted"
  | "invalid_parameters"
  | "not_found"
  | "patch_does_not_apply"
  | "path_outside_workspace"
  | "resource_exhausted"
  | "supervisor_stopping"
  | "too_many_processes"
;

/**
 * The `code` of `session.bootstrap.rejected` (docs/protocol.md §5.4).
 */
export type BootstrapRejectionCode =
  | "cwd_not_in_workspace"
  | "profile_not_allowed"
  | "repository_root_missing"
  | "session_binding_mismatch"
;

/**
 * The `error` of an HTTP refusal (docs/protocol.md §1, §2.2).
 */
export type HttpRefusalCode =
  | "ack_floor_ahead"
  | "bad_request"
  | "draining"
  | "invalid_authority"
  | "invalid_routing_headers"
  | "not_found"
  | "request_head_too_large"
  | "sandbox_identity_unavailable"
  | "sandbox_mismatch"
  | "session_mismatch"
  | "stale_generation"
  | "state_unavailable"
  | "storage_full"
  | "terminated"
  | "too_many_handshakes"
  | "upgrade_required"
;

export interface AckBody {
  seq: number;
}

export interface AgentSpec {
  cwd: string;
  profile: string;
  env?: Record<string, string> | null;
}

export interface ApplyFilePatchCall {
  tool_name: "apply_file_patch";
  call_id: string;
  idempotency_key: string;
  parameters: ApplyFilePatchParams;
}

export interface ApplyFilePatchParams {
  path: string;
  diff: string;
  base_sha: string;
}

/**
 * Every repositories[i].root equals agent.cwd or lies under agent.cwd + "/".
 */
export interface BootstrapBody {
  sessionId: string;
  agent: AgentSpec;
  repositories: Repository[];
}

export interface BootstrapRejectedBody {
  code: BootstrapRejectionCode;
  message: string;
}

export interface BootstrapRejectedFrame {
  kind: "session.bootstrap.rejected";
  body: BootstrapRejectedBody;
}

export interface ErrorBody {
  code: FrameErrorCode;
  message: string;
  call_id?: string | null;
  request_id?: string | null;
}

export interface ErrorFrame {
  kind: "error";
  body: ErrorBody;
}

/**
 * Empty on purpose: nothing of the withheld event is told, not even its kind.
 */
export interface EventWithheldBody {
}

export interface EventWithheldEvent {
  kind: "event.withheld";
  seq: number;
  body: EventWithheldBody;
}

export interface EventsAckFrame {
  kind: "events.ack";
  connectionGeneration: number;
  body: AckBody;
}

export interface ExecCloseStdinBody {
  call_id: string;
  offset: number;
  request_id?: string | null;
}

export interface ExecCloseStdinFrame {
  kind: "exec.close_stdin";
  connectionGeneration: number;
  body: ExecCloseStdinBody;
}

export interface ExecCompletedBody {
  exit_code: number | null;
  signal: string | null;
  timed_out: boolean;
  duration_ms: number;
  stdout: StreamSummary;
  stderr: StreamSummary;
  call_id: string;
  interrupted?: boolean;
  oom_killed?: true | null;
}

export interface ExecCompletedEvent {
  kind: "exec.completed";
  seq: number;
  body: ExecCompletedBody;
}

/**
 * Captured when the process starts and kept with it (docs/protocol.md §6.6).
 */
export interface ExecContext {
  session_id: string;
  generation: number;
  idempotency_key: string | null;
}

export interface ExecListBody {
  request_id?: string | null;
}

export interface ExecListFrame {
  kind: "exec.list";
  connectionGeneration: number;
  body: ExecListBody;
}

export interface ExecOutputBody {
  call_id: string;
  stream: "stdout" | "stderr";
  text: string;
  offset: number;
  bytes: number;
  truncated: boolean;
  dropped_bytes: number;
  after_exit: boolean;
}

export interface ExecOutputEvent {
  kind: "exec.output";
  seq: number;
  body: ExecOutputBody;
}

export interface ExecOutputPageBody {
  call_id: string;
  stream: "stdout" | "stderr";
  offset: number;
  data: string;
  eof: boolean;
  truncated: boolean;
  request_id?: string | null;
}

export interface ExecOutputPageFrame {
  kind: "exec.output_page";
  body: ExecOutputPageBody;
}

export interface ExecOutputPageHeader {
  kind: "exec.output_page";
  body: ExecOutputPageHeaderBody;
}

/**
 * A binary page's header body (§6.5.1): the JSON page's fields, with the number of
 * bytes that follow the header in place of `data`.
 */
export interface ExecOutputPageHeaderBody {
  call_id: string;
  stream: "stdout" | "stderr";
  offset: number;
  bytes: number;
  eof: boolean;
  truncated: boolean;
  request_id?: string | null;
}

export interface ExecProcessesBody {
  processes: ProcessInfo[];
  request_id?: string | null;
}

export interface ExecProcessesFrame {
  kind: "exec.processes";
  body: ExecProcessesBody;
}

export interface ExecReadOutputBody {
  call_id: string;
  stream: "stdout" | "stderr";
  offset: number;
  length: number;
  format?: ("json" | "binary") | null;
  request_id?: string | null;
}

export interface ExecReadOutputFrame {
  kind: "exec.read_output";
  connectionGeneration: number;
  body: ExecReadOutputBody;
}

export interface ExecResizeBody {
  call_id: string;
  rows: number;
  cols: number;
  request_id?: string | null;
}

export interface ExecResizeFrame {
  kind: "exec.resize";
  connectionGeneration: number;
  body: ExecResizeBody;
}

export interface ExecSignalBody {
  call_id: string;
  signal: "SIGINT" | "SIGTERM" | "SIGKILL" | "SIGHUP";
  request_id?: string | null;
}

export interface ExecSignalFrame {
  kind: "exec.signal";
  connectionGeneration: number;
  body: ExecSignalBody;
}

export interface ExecStartedBody {
  call_id: string;
  pid: number;
  pgid: number;
  command: string;
  cwd: string;
  started_at: number;
  context: ExecContext;
}

export interface ExecStartedEvent {
  kind: "exec.started";
  seq: number;
  body: ExecStartedBody;
}

/**
 * The answer to exec.write_stdin and exec.close_stdin (§7.7.2).
 */
export interface ExecStdinAckBody {
  call_id: string;
  offset: number;
  next_offset: number;
  closed: boolean;
  request_id?: string | null;
}

export interface ExecStdinAckFrame {
  kind: "exec.stdin_ack";
  body: ExecStdinAckBody;
}

export interface ExecWriteStdinBody {
  call_id: string;
  offset: number;
  data: string;
  request_id?: string | null;
}

export interface ExecWriteStdinFrame {
  kind: "exec.write_stdin";
  connectionGeneration: number;
  body: ExecWriteStdinBody;
}

export interface ExecuteShellCommandCall {
  tool_name: "execute_shell_command";
  call_id: string;
  idempotency_key: string;
  parameters: ExecuteShellCommandParams;
}

export interface ExecuteShellCommandParams {
  command: string;
  timeout_ms?: number;
  cwd?: string | null;
  env?: Record<string, string> | null;
}

/**
 * `apply_file_patch` result (docs/protocol.md §7.5).
 */
export interface PatchResult {
  path: string;
  old_sha: string;
  new_sha: string;
  hunks: number;
  bytes: number;
}

export interface ProcessExit {
  exit_code: number | null;
  signal: string | null;
  timed_out: boolean;
}

/**
 * One process of the session in exec.processes (§7.7.4).
 */
export interface ProcessInfo {
  call_id: string;
  tool_name: string;
  command: string;
  pid: number;
  pgid: number;
  pty: boolean;
  started_at: number;
  running: boolean;
  exit: ProcessExit | null;
}

/**
 * `start_process` result (docs/protocol.md §7.7.1): the process runs; its `call_id` is
 * its handle for every `exec.*` frame.
 */
export interface ProcessStarted {
  pid: number;
  pgid: number;
  started_at: number;
  pty: boolean;
}

/**
 * A terminal for the process (docs/protocol.md §7.7.3): its size and `TERM`.
 */
export interface PtyRequest {
  rows: number;
  cols: number;
  term?: string | null;
}

export interface ReadFileCall {
  tool_name: "read_file";
  call_id: string;
  idempotency_key?: string | null;
  parameters: ReadFileParams;
}

export interface ReadFileParams {
  path: string;
  offset?: number;
  length?: number | null;
}

/**
 * `read_file` result (docs/protocol.md §7.3).
 */
export interface ReadFileResult {
  path: string;
  sha: string;
  size: number;
  offset: number;
  length: number;
  encoding: "utf-8" | "base64";
  content: string;
  eof: boolean;
}

export interface Repository {
  name: string;
  root: string;
}

export interface RuntimeStateBody {
  status: "ready";
  sessionId: string;
  generation: number;
  ackFloor: number;
  localEventMax: number;
  oldestRetainedSeq: number;
  supervisorVersion: string;
  protocolVersion: 1;
  scopes: ("files:read" | "files:write" | "shell:exec" | "session:control")[];
}

export interface RuntimeStateFrame {
  kind: "runtime.state";
  body: RuntimeStateBody;
}

export interface SessionBootstrapFrame {
  kind: "session.bootstrap";
  connectionGeneration: number;
  body: BootstrapBody;
}

/**
 * `execute_shell_command` result (docs/protocol.md §7.4.3); `exec.completed` adds `call_id`.
 */
export interface ShellResult {
  exit_code: number | null;
  signal: string | null;
  timed_out: boolean;
  duration_ms: number;
  stdout: StreamSummary;
  stderr: StreamSummary;
}

export interface StartProcessCall {
  tool_name: "start_process";
  call_id: string;
  idempotency_key: string;
  parameters: StartProcessParams;
}

export interface StartProcessParams {
  command: string;
  timeout_ms?: number | null;
  cwd?: string | null;
  env?: Record<string, string> | null;
  pty?: PtyRequest | null;
}

export interface StreamSummary {
  bytes: number;
  head: string;
  tail: string;
  truncated: boolean;
}

export interface ToolCallFrame {
  kind: "tool.call";
  connectionGeneration: number;
  body: ToolCallBody;
}

export interface ToolError {
  code: ToolErrorCode;
  message: string;
  [extra: string]: unknown;
}

export interface ToolPendingBody {
  call_id: string;
  idempotency_key: string;
}

export interface ToolPendingFrame {
  kind: "tool.pending";
  body: ToolPendingBody;
}

export interface ToolReplayedBody {
  call_id: string;
  idempotency_key: string;
  original: ToolResultEvent;
}

export interface ToolReplayedFrame {
  kind: "tool.replayed";
  body: ToolReplayedBody;
}

export interface ToolResultEvent {
  kind: "tool.result";
  seq: number;
  body: ToolResultBody;
}

interface ToolResultBodyBase {
  call_id: string;
  /** As the caller sent it; null when the call had none (or it was not a 1-128 char string). */
  idempotency_key: string | null;
}

/** An ok `tool.result` of tool N: `result` is that tool's result model. */
export type ToolResultOk<N extends ToolName = ToolName> = {
  [T in N]: ToolResultBodyBase & { tool_name: T; ok: true; result: ToolResultsByName[T]; error?: never };
}[N];

/** A failed `tool.result`; `tool_name` is null when the name sent was not a readable string,
 * and may be a name that is no tool (`invalid_parameters` `Unknown tool_name.`). */
export type ToolResultFailure = ToolResultBodyBase & {
  tool_name: string | null;
  ok: false;
  error: ToolError;
  result?: never;
};

/** The body of a `tool.result` event (docs/protocol.md §6.6). */
export type ToolResultBody = ToolResultOk | ToolResultFailure;

/** Each tool's parameters (the `parameters` of its tool.call). */
export interface ToolParametersByName {
  "apply_file_patch": ApplyFilePatchParams;
  "execute_shell_command": ExecuteShellCommandParams;
  "read_file": ReadFileParams;
  "start_process": StartProcessParams;
}

/** Each tool's `result` in an ok `tool.result`. */
export interface ToolResultsByName {
  "apply_file_patch": PatchResult;
  "execute_shell_command": ShellResult;
  "read_file": ReadFileResult;
  "start_process": ProcessStarted;
}

/** The scope a connection needs for each tool (docs/protocol.md §3.5). */
export const TOOL_SCOPES = {
  "apply_file_patch": "files:write",
  "execute_shell_command": "shell:exec",
  "read_file": "files:read",
  "start_process": "shell:exec",
} as const satisfies Record<ToolName, Scope>;

/** Every frame a client sends (docs/protocol.md §6.3), discriminated by `kind`. */
export type ClientFrame = SessionBootstrapFrame | ToolCallFrame | EventsAckFrame | ExecSignalFrame | ExecReadOutputFrame | ExecWriteStdinFrame | ExecCloseStdinFrame | ExecResizeFrame | ExecListFrame;

/** Every text frame the supervisor sends (docs/protocol.md §6.5, §6.6), discriminated by `kind`. */
export type ServerFrame = RuntimeStateFrame | BootstrapRejectedFrame | ToolPendingFrame | ToolReplayedFrame | ExecOutputPageFrame | ExecStdinAckFrame | ExecProcessesFrame | ErrorFrame | ExecStartedEvent | ExecOutputEvent | ExecCompletedEvent | ToolResultEvent | EventWithheldEvent;

/** The body of a `tool.call` (docs/protocol.md §7.1), discriminated by `tool_name`. */
export type ToolCallBody = ApplyFilePatchCall | ExecuteShellCommandCall | ReadFileCall | StartProcessCall;

export interface ClientFrameByKind {
  "session.bootstrap": SessionBootstrapFrame;
  "tool.call": ToolCallFrame;
  "events.ack": EventsAckFrame;
  "exec.signal": ExecSignalFrame;
  "exec.read_output": ExecReadOutputFrame;
  "exec.write_stdin": ExecWriteStdinFrame;
  "exec.close_stdin": ExecCloseStdinFrame;
  "exec.resize": ExecResizeFrame;
  "exec.list": ExecListFrame;
}

export interface ServerFrameByKind {
  "runtime.state": RuntimeStateFrame;
  "session.bootstrap.rejected": BootstrapRejectedFrame;
  "tool.pending": ToolPendingFrame;
  "tool.replayed": ToolReplayedFrame;
  "exec.output_page": ExecOutputPageFrame;
  "exec.stdin_ack": ExecStdinAckFrame;
  "exec.processes": ExecProcessesFrame;
  "error": ErrorFrame;
  "exec.started": ExecStartedEvent;
  "exec.output": ExecOutputEvent;
  "exec.completed": ExecCompletedEvent;
  "tool.result": ToolResultEvent;
  "event.withheld": EventWithheldEvent;
}

export type ClientKind = keyof ClientFrameByKind;
export type ServerKind = keyof ServerFrameByKind;
/** The journaled kinds: frames with a `seq` (docs/protocol.md §6.6, §9.1). */
export type EventFrame = Extract<ServerFrame, { seq: number }>;

// --- constants (protocol/closes.py, protocol/headers.py, protocol/frames.py) ---

/** WebSocket close codes of the control channel (docs/protocol.md §4.4, docs/codes.md). */
export const CloseCode = {
  GOING_AWAY: 1001,
  INTERNAL_ERROR: 1011,
  MESSAGE_TOO_BIG: 1009,
  NORMAL: 1000,
  POLICY_VIOLATION: 1008,
  PROTOCOL_ERROR: 1002,
  REJECTION_RECEIPT: 4400,
  UNSUPPORTED_DATA: 1003,
} as const;

/** The reasons the supervisor closes with (docs/protocol.md §4.4). */
export const CloseReason = {
  BINARY: "Binary frames are not supported.",
  BIND_FORBIDDEN: "Binding the session needs the session:control scope.",
  BOOTSTRAP_MISMATCH: "Bootstrap does not match upgrade headers.",
  EXPECTED_BOOTSTRAP: "Expected session bootstrap as first frame.",
  IDLE: "Connection idle timeout.",
  INTERNAL: "Supervisor internal error.",
  LIBRARY_TOO_BIG: "Exceeded maximum message size: 131072 bytes",
  RECEIPT_NOT_OBSERVED: "Supervisor rejection receipt was not observed.",
  REJECTION_RECEIPT: "bootstrap rejection received",
  SEND_FAILED: "Supervisor could not send a frame.",
  STOPPING: "Supervisor listener stopping.",
  SUPERSEDED: "Connection attempt was superseded.",
  TOO_BIG: "Message is larger than the limit.",
  WRITE_TIMEOUT: "Peer stopped reading.",
} as const;

/** Routing headers of the upgrade (docs/protocol.md §2.1). */
export const Header = {
  ATTEMPT_ID: "x-coding-agent-runtime-connection-attempt-id",
  AUTHORITY: "x-coding-agent-control-authority",
  EVENT_ACK: "x-coding-agent-event-ack",
  GENERATION: "x-coding-agent-connection-generation",
  SANDBOX_ID: "e2b-sandbox-id",
  SESSION_ID: "x-coding-agent-session-id",
  SESSION_SANDBOX_ID: "x-coding-agent-session-sandbox-id",
} as const;

/** Each HTTP refusal's status (docs/protocol.md §1, §2.2). */
export const HTTP_REFUSAL_STATUS = {
  bad_request: 400,
  not_found: 404,
  upgrade_required: 426,
  request_head_too_large: 431,
  too_many_handshakes: 503,
  draining: 503,
  terminated: 503,
  invalid_routing_headers: 400,
  sandbox_identity_unavailable: 503,
  sandbox_mismatch: 409,
  invalid_authority: 401,
  session_mismatch: 409,
  ack_floor_ahead: 409,
  stale_generation: 409,
  state_unavailable: 500,
  storage_full: 503,
} as const satisfies Record<HttpRefusalCode, number>;

export const PROTOCOL_VERSION = 1;
export const MAX_SAFE_INTEGER = 9007199254740991;
export const MAX_OUTPUT_PAGE_LENGTH = 65536;
export const MAX_BINARY_OUTPUT_PAGE_LENGTH = 1048576;
export const BINARY_PAGE_HEADER_LENGTH_BYTES = 4;
export const MAX_STDIN_WRITE_BYTES = 65536;
export const STORAGE_FULL_RETRY_AFTER_S = 5;
export const DEFAULT_MAX_MESSAGE_BYTES = 131072;
