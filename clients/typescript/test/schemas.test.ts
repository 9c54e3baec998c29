// Every exported schema compiles in Ajv's strict mode with default options, and the docs'
// example frames are valid against the unions (protocol/schemas/, docs/protocol.md §6).

import assert from "node:assert/strict";
import { test } from "node:test";

import { loadSchema, schemaFiles, strictAjv } from "./support.js";

test("every schema compiles in Ajv strict mode, alone and all together", () => {
  const names = schemaFiles();
  assert.ok(names.length > 30, `only ${names.length} schemas found`);
  for (const name of names) strictAjv().compile(loadSchema(name));
  const all = strictAjv();
  for (const name of names) all.addSchema(loadSchema(name));
  for (const name of names) assert.ok(all.getSchema(String(loadSchema(name).$id)), name);
});

test("valid frames pass and invalid ones fail", () => {
  const client = strictAjv().compile(loadSchema("ClientFrame.json"));
  const server = strictAjv().compile(loadSchema("ServerFrame.json"));
  const callId = "a96fb13d-92b2-4583-8807-c8d6fbbab508";
  assert.ok(client({ kind: "events.ack", connectionGeneration: 3, body: { seq: 9 } }));
  assert.ok(client({ kind: "exec.read_output", connectionGeneration: 3, body: { call_id: callId, stream: "stdout", offset: 0, length: 10, format: "binary" } }));
  assert.ok(!client({ kind: "events.ack", connectionGeneration: 0, body: { seq: 9 } }), "generation 0");
  assert.ok(!client({ kind: "events.ack", connectionGeneration: 3, body: { seq: 9, extra: 1 } }), "a closed body");
  assert.ok(!client({ kind: "runtime.state", connectionGeneration: 3, body: {} }), "a server kind");
  assert.ok(server({ kind: "error", body: { code: "not_running", message: "The command has finished.", call_id: callId } }));
  assert.ok(server({ kind: "event.withheld", seq: 14, body: {} }));
  assert.ok(!server({ kind: "event.withheld", seq: 0, body: {} }), "seq 0");
  assert.ok(!server({ kind: "error", body: { code: "x" } }), "no message");
});
