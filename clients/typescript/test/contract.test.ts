// The reconnect policy (src/policy.ts) and the client contract page (docs/client-contract.md)
// were written apart: this test reads the page's two tables, "After an HTTP refusal" and
// "After a close", and checks that the policy takes the action each row names first, for
// every refusal code and every close reason the supervisor sends.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import {
  CloseReason,
  decideClose,
  decideRefusal,
  HTTP_REFUSAL_STATUS,
  MAX_AUTHORITY_RETRIES,
  type HttpRefusalCode,
} from "../src/index.js";

const PAGE = process.env.SUPERVISOR_CONTRACT ?? join(import.meta.dirname, "..", "..", "..", "..", "docs", "client-contract.md");
const FIXED = { initialMs: 100, maxMs: 1000, jitter: 1 };

/** The rows of the table under the `## heading`: cells without their outer pipes. */
function table(heading: string): string[][] {
  const text = readFileSync(PAGE, "utf8");
  const start = text.indexOf(`\n## ${heading}\n`);
  assert.ok(start >= 0, `no section "${heading}" in ${PAGE}`);
  const section = text.slice(start + 1).split(/\n## /)[0]!;
  return section
    .split("\n")
    .filter((line) => line.startsWith("| ") && !line.startsWith("| ---"))
    .slice(1) // the header row
    .map((line) => line.slice(2, -2).split(" | "));
}

/** The policy's action for the page's action word (its first words). */
function action(cell: string): string {
  for (const [words, decided] of [
    ["reconnect", "reconnect"],
    ["back off", "reconnect"],
    ["fix", "stop"], // the client cannot correct its own request: it stops and reports
    ["stop", "stop"],
    ["reset the journal", "reset_journal"],
  ] as const) {
    if (cell.startsWith(words)) return decided;
  }
  throw new Error(`no action word at the start of: ${cell}`);
}

const unquote = (cell: string): string => (cell === "(empty)" ? "" : cell.replace(/^`|`$/g, ""));

test("every HTTP refusal: the policy takes the page's action", () => {
  const rows = table("After an HTTP refusal");
  const seen = new Set<string>();
  for (const [status, code, , client] of rows) {
    const name = unquote(code!);
    seen.add(name);
    assert.equal(HTTP_REFUSAL_STATUS[name as HttpRefusalCode], Number(status), `${name}: status`);
    assert.equal(decideRefusal(Number(status), name, undefined, 0, FIXED).action, action(client!), `${status} ${name}`);
  }
  assert.deepEqual([...seen].sort(), Object.keys(HTTP_REFUSAL_STATUS).sort(), "the page's rows are the supervisor's refusals");
  // invalid_authority: "a few times" is the policy's number.
  const authority = rows.find(([, code]) => code === "`invalid_authority`")![3]!;
  assert.ok(authority.includes(`(the TypeScript client: ${MAX_AUTHORITY_RETRIES})`), authority);
  assert.equal(decideRefusal(401, "invalid_authority", undefined, MAX_AUTHORITY_RETRIES, FIXED, MAX_AUTHORITY_RETRIES).action, "stop");
});

test("every close: the policy takes the page's action", () => {
  const rows = table("After a close");
  const seen = new Set<string>();
  for (const [code, reason, , client] of rows) {
    const text = unquote(reason!);
    seen.add(text);
    assert.equal(decideClose(Number(code), text, 0, FIXED).action, action(client!), `${code} ${text}`);
  }
  // Every reason the supervisor closes with (4400 is the client's own close).
  const expected = Object.values(CloseReason).filter((reason) => reason !== CloseReason.REJECTION_RECEIPT);
  assert.deepEqual([...seen].filter((r) => r !== "").sort(), [...expected].sort());
});
