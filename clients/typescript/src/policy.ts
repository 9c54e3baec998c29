// What a client does after each close code and each HTTP refusal (docs/protocol.md §2.2,
// §4.4, docs/codes.md). Pure functions: no socket, no clock; tests call them directly.
// docs/client-contract.md's tables name the same action for every row (test/contract.test.ts
// reads them): its "reconnect" and "back off" are a reconnect here, its "fix" and "stop" a
// stop (this client cannot correct its own request), "reset the journal" reset_journal.
//
// Every reconnect is a new attempt: a new attempt id, a new assertion, and the next
// generation from the store (docs/protocol.md §4.1), with the ack header at the store's
// floor. "stop" means reconnecting cannot help: a programming error, another owner of the
// session, or a supervisor that will never serve again.

import { CloseCode, CloseReason, type HttpRefusalCode } from "./protocol.js";

export type Decision =
  /** Connect again (a new attempt and generation) after `delayMs`. */
  | { action: "reconnect"; delayMs: number; why: string }
  /** The supervisor's journal is behind the client's floor: its state was reset (a new
   * sandbox from a snapshot, a wiped state directory). The events the client holds above
   * the supervisor's journal are not this journal's: start a new journal epoch in the store
   * (floor 0), then connect again. */
  | { action: "reset_journal"; delayMs: number; why: string }
  | { action: "stop"; why: string };

export interface BackoffOptions {
  initialMs: number;
  maxMs: number;
  /** 0 … 1, from a random source; 1 gives the full delay (tests pass a fixed value). */
  jitter: number;
}

export const DEFAULT_BACKOFF: BackoffOptions = { initialMs: 100, maxMs: 10_000, jitter: 1 };
// The WebSocket code a client library reports when the connection ended without a close
// frame (RFC 6455, section 7.1.5): a dropped network, a killed daemon.
export const CLOSE_ABNORMAL = 1006;
// Invalid assertions may be a clock skew or a key rotation in progress (docs/protocol.md
// §3.4): worth a few tries with fresh assertions, not an endless loop.
export const MAX_AUTHORITY_RETRIES = 3;

/** Exponential backoff with jitter: attempt 0 waits `initialMs` (times the jitter). */
export function backoff(attempt: number, options: BackoffOptions = DEFAULT_BACKOFF): number {
  const delay = Math.min(options.maxMs, options.initialMs * 2 ** Math.min(attempt, 30));
  return Math.round(delay * options.jitter);
}

/** After the socket closed with `code` / `reason` (sent by the supervisor, or 1006). */
export function decideClose(code: number, reason: string, attempt: number, options: BackoffOptions = DEFAULT_BACKOFF): Decision {
  const retry = (why: string): Decision => ({ action: "reconnect", delayMs: backoff(attempt, options), why });
  switch (code) {
    case CloseCode.NORMAL:
      return retry("closed without a specific reason");
    case CloseCode.GOING_AWAY:
      // Drain: a restart follows (systemd), or the daemon stays down; upgrades meanwhile get
      // 503 draining, which backs off further.
      return retry("the supervisor is stopping");
    case CloseCode.PROTOCOL_ERROR:
      return { action: "stop", why: "the first frame was not a valid session.bootstrap (a client bug)" };
    case CloseCode.UNSUPPORTED_DATA:
      return { action: "stop", why: "a binary message was sent (a client bug)" };
    case CloseCode.POLICY_VIOLATION:
      if (reason === CloseReason.SUPERSEDED) {
        // Another attempt holds a higher generation: another replica of the control plane.
        // (A newer attempt of this session itself closes only a socket it has already
        // replaced, whose close the session ignores.) Fighting back would supersede it in
        // turn; a replica that still holds the session's lease connects again itself.
        return { action: "stop", why: "superseded by a newer connection attempt" };
      }
      if (reason === CloseReason.BIND_FORBIDDEN) {
        return { action: "stop", why: "binding the session needs the session:control scope" };
      }
      return { action: "stop", why: `the bootstrap does not match the upgrade (${reason})` };
    case CloseCode.MESSAGE_TOO_BIG:
      // A reconnect would resend the unanswered tool.calls, the oversized one among them.
      return { action: "stop", why: "a frame was larger than websocket.max_message_bytes (a client bug)" };
    case CloseCode.INTERNAL_ERROR:
      if (reason === CloseReason.RECEIPT_NOT_OBSERVED) {
        return { action: "stop", why: "the bootstrap was rejected: the supervisor has terminated" };
      }
      // Idle timeout, a write that timed out, a failed send, a state database failure:
      // passing; the journal keeps every event for the next socket.
      return retry(reason || "internal error");
    case CloseCode.REJECTION_RECEIPT:
      return { action: "stop", why: "the bootstrap was rejected" };
    default:
      return retry(code === CLOSE_ABNORMAL ? "the connection dropped" : `close ${code}`);
  }
}

/** After the upgrade was answered `status` with `error` `code` (undefined: not a refusal
 * body, a proxy's answer say), `retryAfterS` from its Retry-After header. `attempt` counts the
 * failures of any kind in a row (it sets the backoff); `authorityRefusals` counts only the
 * `invalid_authority` refusals before this one since the last attached socket: a few
 * `draining` refusals during a restart must not use up the assertion's tries. */
export function decideRefusal(
  status: number,
  code: HttpRefusalCode | string | undefined,
  retryAfterS: number | undefined,
  attempt: number,
  options: BackoffOptions = DEFAULT_BACKOFF,
  authorityRefusals = 0,
): Decision {
  const retry = (why: string): Decision => ({ action: "reconnect", delayMs: backoff(attempt, options), why });
  switch (code) {
    case "too_many_handshakes":
      return retry("the listener's handshake slots are taken; retry shortly");
    case "draining":
      return retry("the supervisor is stopping (a restart may follow)");
    case "sandbox_identity_unavailable":
      return retry("the sandbox id cannot be read yet; it is read again at the next upgrade");
    case "state_unavailable":
      return retry("the supervisor could not record the connection");
    case "storage_full":
      return {
        action: "reconnect",
        delayMs: Math.max((retryAfterS ?? 0) * 1000, backoff(attempt, options)),
        why: "the supervisor's state directory is full",
      };
    case "invalid_authority":
      // A fresh assertion (a new jti) each try; past a few, the key or the clock is wrong.
      if (authorityRefusals < MAX_AUTHORITY_RETRIES) return retry("the assertion was refused; trying a fresh one");
      return { action: "stop", why: "the assertion keeps being refused (key, issuer, audience or clock)" };
    case "ack_floor_ahead":
      return { action: "reset_journal", delayMs: 0, why: "the supervisor's journal is behind the client's floor (its state was reset)" };
    case "stale_generation":
      return { action: "stop", why: "another connection attempt holds a newer generation" };
    case "terminated":
      return { action: "stop", why: "the supervisor terminated after a bootstrap rejection; it never serves again" };
    case "session_mismatch":
      return { action: "stop", why: "the supervisor is bound to another session" };
    case "sandbox_mismatch":
      return { action: "stop", why: "the endpoint is another sandbox's supervisor" };
    case "invalid_routing_headers":
    case "bad_request":
    case "upgrade_required":
    case "request_head_too_large":
    case "not_found":
      return { action: "stop", why: `the request is malformed (${code}): a client bug` };
    default:
      // Not a refusal of the supervisor (a proxy, a load balancer): 5xx pass, 4xx do not.
      return status >= 500 ? retry(`HTTP ${status}`) : { action: "stop", why: `HTTP ${status}` };
  }
}

/** When the connection could not be made at all (refused, reset, no socket file). */
export function decideConnectFailure(attempt: number, options: BackoffOptions = DEFAULT_BACKOFF): Decision {
  return { action: "reconnect", delayMs: backoff(attempt, options), why: "no answer from the supervisor" };
}
