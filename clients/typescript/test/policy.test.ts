// The reconnect policy as a pure function: every close code and reason of docs/codes.md and
// every HTTP refusal get a decision, and the ones that cannot pass stop.

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  backoff,
  CLOSE_ABNORMAL,
  CloseCode,
  CloseReason,
  decideClose,
  decideConnectFailure,
  decideRefusal,
  HTTP_REFUSAL_STATUS,
  MAX_AUTHORITY_RETRIES,
  type HttpRefusalCode,
} from "../src/index.js";

const FIXED = { initialMs: 100, maxMs: 1000, jitter: 1 };

test("backoff doubles from its initial delay up to its cap", () => {
  assert.deepEqual([0, 1, 2, 3, 4, 5].map((n) => backoff(n, FIXED)), [100, 200, 400, 800, 1000, 1000]);
  assert.equal(backoff(2, { ...FIXED, jitter: 0.5 }), 200);
});

test("each close the supervisor sends has its decision", () => {
  const expected: [number, string, string][] = [
    [CloseCode.NORMAL, "", "reconnect"],
    [CloseCode.GOING_AWAY, CloseReason.STOPPING, "reconnect"],
    [CloseCode.PROTOCOL_ERROR, CloseReason.EXPECTED_BOOTSTRAP, "stop"],
    [CloseCode.UNSUPPORTED_DATA, CloseReason.BINARY, "stop"],
    [CloseCode.POLICY_VIOLATION, CloseReason.BOOTSTRAP_MISMATCH, "stop"],
    [CloseCode.POLICY_VIOLATION, CloseReason.BIND_FORBIDDEN, "stop"],
    [CloseCode.POLICY_VIOLATION, CloseReason.SUPERSEDED, "stop"],
    [CloseCode.MESSAGE_TOO_BIG, CloseReason.LIBRARY_TOO_BIG, "stop"],
    [CloseCode.MESSAGE_TOO_BIG, CloseReason.TOO_BIG, "stop"],
    [CloseCode.INTERNAL_ERROR, CloseReason.IDLE, "reconnect"],
    [CloseCode.INTERNAL_ERROR, CloseReason.RECEIPT_NOT_OBSERVED, "stop"],
    [CloseCode.INTERNAL_ERROR, CloseReason.SEND_FAILED, "reconnect"],
    [CloseCode.INTERNAL_ERROR, CloseReason.WRITE_TIMEOUT, "reconnect"],
    [CloseCode.INTERNAL_ERROR, CloseReason.INTERNAL, "reconnect"],
    [CloseCode.REJECTION_RECEIPT, CloseReason.REJECTION_RECEIPT, "stop"],
    [CLOSE_ABNORMAL, "", "reconnect"],
  ];
  for (const [code, reason, action] of expected) {
    assert.equal(decideClose(code, reason, 0, FIXED).action, action, `${code} ${reason}`);
  }
  // Every reason the supervisor uses is in the table above.
  const covered = new Set(expected.map(([, reason]) => reason));
  for (const reason of Object.values(CloseReason)) assert.ok(covered.has(reason), reason);
});

test("a reconnect after a close backs off with the attempt count", () => {
  const first = decideClose(CloseCode.INTERNAL_ERROR, CloseReason.IDLE, 0, FIXED);
  const third = decideClose(CloseCode.INTERNAL_ERROR, CloseReason.IDLE, 2, FIXED);
  assert.deepEqual([first.action === "reconnect" && first.delayMs, third.action === "reconnect" && third.delayMs], [100, 400]);
});

test("each HTTP refusal has its decision", () => {
  const expected: Record<HttpRefusalCode, string> = {
    bad_request: "stop",
    not_found: "stop",
    upgrade_required: "stop",
    request_head_too_large: "stop",
    too_many_handshakes: "reconnect",
    draining: "reconnect",
    terminated: "stop",
    invalid_routing_headers: "stop",
    sandbox_identity_unavailable: "reconnect",
    sandbox_mismatch: "stop",
    invalid_authority: "reconnect",
    session_mismatch: "stop",
    ack_floor_ahead: "reset_journal",
    stale_generation: "stop",
    state_unavailable: "reconnect",
    storage_full: "reconnect",
  };
  for (const [code, status] of Object.entries(HTTP_REFUSAL_STATUS) as [HttpRefusalCode, number][]) {
    assert.equal(decideRefusal(status, code, undefined, 0, FIXED).action, expected[code], code);
  }
});

test("storage_full waits for its Retry-After", () => {
  const decision = decideRefusal(503, "storage_full", 5, 0, FIXED);
  assert.deepEqual(decision.action === "reconnect" && decision.delayMs, 5000);
});

test("invalid_authority is tried a few times with fresh assertions, then stops", () => {
  assert.equal(decideRefusal(401, "invalid_authority", undefined, MAX_AUTHORITY_RETRIES - 1, FIXED, MAX_AUTHORITY_RETRIES - 1).action, "reconnect");
  assert.equal(decideRefusal(401, "invalid_authority", undefined, MAX_AUTHORITY_RETRIES, FIXED, MAX_AUTHORITY_RETRIES).action, "stop");
});

test("only invalid_authority refusals use up the assertion's tries, not failures of other kinds", () => {
  // After several draining refusals in a row (a restart), the first invalid_authority is
  // tried again: the backoff grows with every failure, the tries count only this refusal.
  const decision = decideRefusal(401, "invalid_authority", undefined, MAX_AUTHORITY_RETRIES + 3, FIXED, 0);
  assert.deepEqual(decision, { action: "reconnect", delayMs: backoff(MAX_AUTHORITY_RETRIES + 3, FIXED), why: "the assertion was refused; trying a fresh one" });
});

test("an answer that is no refusal of the supervisor: 5xx retried, 4xx not", () => {
  assert.equal(decideRefusal(502, undefined, undefined, 0, FIXED).action, "reconnect");
  assert.equal(decideRefusal(403, undefined, undefined, 0, FIXED).action, "stop");
  assert.equal(decideConnectFailure(0, FIXED).action, "reconnect");
});
