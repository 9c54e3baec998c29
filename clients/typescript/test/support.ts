// Shared by the tests: the daemon tests/test_typescript_client.py started, and Ajv.

import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";

import { Ajv2020 } from "ajv/dist/2020.js";
import type { ValidateFunction } from "ajv";
import type { JWK } from "jose";

import { jwkSigner, MemoryStore, SupervisorSession, type BootstrapBody, type Endpoint, type SessionOptions } from "../src/index.js";

export const SCHEMA_DIR = process.env.SUPERVISOR_SCHEMAS ?? join(import.meta.dirname, "..", "..", "..", "..", "protocol", "schemas");

/** The probe's first truthy value, polled every 10 ms; fails after `timeoutMs` naming `what`. */
export async function until<T>(what: string, probe: () => T | undefined | false, timeoutMs = 15_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = probe();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

/** Ajv in strict mode with its default options; a strict-mode warning fails like an error. */
export function strictAjv(): Ajv2020 {
  const fail = (message: unknown): never => {
    throw new Error(String(message));
  };
  return new Ajv2020({ logger: { log: () => undefined, warn: fail, error: fail } });
}

export function schemaFiles(): string[] {
  return readdirSync(SCHEMA_DIR).filter((name) => name.endsWith(".json")).sort();
}

export function loadSchema(name: string): Record<string, unknown> {
  return JSON.parse(readFileSync(join(SCHEMA_DIR, name), "utf8")) as Record<string, unknown>;
}

/** Checks every frame a session receives against ServerFrame.json (a binary page's header
 * against ExecOutputPageHeader.json); `problems` lists what failed. */
export class FrameChecker {
  readonly problems: string[] = [];
  readonly kinds = new Set<string>();
  binaryPages = 0;
  private readonly server: ValidateFunction;
  private readonly header: ValidateFunction;

  constructor() {
    this.server = strictAjv().compile(loadSchema("ServerFrame.json"));
    this.header = strictAjv().compile(loadSchema("ExecOutputPageHeader.json"));
  }

  check = (frame: unknown, binary: boolean): void => {
    const validate = binary ? this.header : this.server;
    if (binary) this.binaryPages += 1;
    else this.kinds.add(String((frame as { kind?: unknown }).kind));
    if (!validate(frame)) this.problems.push(`${JSON.stringify(frame).slice(0, 300)}: ${JSON.stringify(validate.errors)}`);
  };
}

export interface Daemon {
  tcp: Endpoint;
  unix: Endpoint;
  sandboxId: string;
  workspace: string;
  jwk: JWK;
  issuer: string;
  audience: string;
}

/** The daemon of this run, or undefined when the tests run without one. */
export function daemon(): Daemon | undefined {
  const tcp = process.env.SUPERVISOR_TCP;
  if (!tcp) return undefined;
  const [host, port] = [tcp.slice(0, tcp.lastIndexOf(":")), Number(tcp.slice(tcp.lastIndexOf(":") + 1))];
  return {
    tcp: { tcp: { host, port } },
    unix: { unix: process.env.SUPERVISOR_UNIX! },
    sandboxId: process.env.SUPERVISOR_SANDBOX_ID!,
    workspace: process.env.SUPERVISOR_WORKSPACE!,
    jwk: JSON.parse(readFileSync(process.env.SUPERVISOR_JWK!, "utf8")) as JWK,
    issuer: process.env.SUPERVISOR_ISSUER!,
    audience: process.env.SUPERVISOR_AUDIENCE!,
  };
}

export const SESSION_ID = "sess-ts-1";

export function bootstrapBody(workspace: string): BootstrapBody {
  return { sessionId: SESSION_ID, agent: { cwd: workspace, profile: "default" }, repositories: [] };
}

export async function newSession(
  d: Daemon,
  endpoint: Endpoint,
  store: MemoryStore,
  extra: Partial<SessionOptions> = {},
): Promise<SupervisorSession> {
  return new SupervisorSession({
    endpoint,
    sandboxId: d.sandboxId,
    sessionId: SESSION_ID,
    sessionSandboxId: "ssb-ts-1",
    bootstrap: bootstrapBody(d.workspace),
    assertion: await jwkSigner(d.jwk, { issuer: d.issuer, audience: d.audience }),
    store,
    // Fast, fixed retries: the tests wait with deadlines, not on a random backoff.
    backoff: { initialMs: 20, maxMs: 200, jitter: 1 },
    ...extra,
  });
}
