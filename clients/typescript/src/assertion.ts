// The control-authority assertion (docs/protocol.md §3): an ES256 compact JWS sent as the
// raw value of the x-coding-agent-control-authority header (no "Bearer " prefix).
//
// A control plane signs with its own key service; this helper is for tests, demos and
// control planes that hold a private JWK themselves.

import { randomUUID } from "node:crypto";
import { SignJWT, importJWK, type JWK } from "jose";

import type { Scope } from "./protocol.js";

/** What one upgrade asserts: the routing headers it goes with (docs/protocol.md §3.2). */
export interface UpgradeClaims {
  sandboxId: string;
  sessionId: string;
  sessionSandboxId: string;
  generation: number;
  attemptId: string;
  ackFloor: number;
}

export interface AssertionOptions {
  issuer: string;
  /** Default "sandbox-supervisor" (authority.audience). */
  audience?: string | string[];
  /** The key's kid, as listed in the supervisor's JWKS; default: the JWK's own `kid`. */
  kid?: string;
  /** Default: every scope (the control plane's own sessions, docs/protocol.md §3.5). */
  scopes?: readonly Scope[];
  allowedPaths?: string[] | null;
  allowedCommands?: string[] | null;
  /** exp - iat; the supervisor accepts at most authority.max_lifetime_s (default 300). */
  lifetimeS?: number;
  /** Unix seconds (for tests); default: now. */
  now?: number;
}

export const DEFAULT_AUDIENCE = "sandbox-supervisor";
export const ALL_SCOPES: readonly Scope[] = ["files:read", "files:write", "shell:exec", "session:control"];
// Well under the supervisor's default max lifetime (300 s): an assertion is used once (its
// jti is remembered), right after it is minted.
export const DEFAULT_LIFETIME_S = 60;

/** Produces the assertion of one upgrade; called once per attempt (a jti is single-use). */
export type AssertionSource = (claims: UpgradeClaims) => Promise<string>;

/** A signer for a private P-256 JWK (with "d"), minting a fresh assertion per upgrade. */
export async function jwkSigner(jwk: JWK, options: AssertionOptions): Promise<AssertionSource> {
  const kid = options.kid ?? jwk.kid;
  if (kid === undefined) throw new Error("the assertion needs a kid: give options.kid or a JWK with one");
  const key = await importJWK({ ...jwk, alg: "ES256" }, "ES256");
  return async (claims) => {
    const iat = Math.floor(options.now ?? Date.now() / 1000);
    const lifetime = options.lifetimeS ?? DEFAULT_LIFETIME_S;
    const payload: Record<string, unknown> = {
      iss: options.issuer,
      aud: options.audience ?? DEFAULT_AUDIENCE,
      iat,
      exp: iat + lifetime,
      jti: randomUUID(),
      sandbox_id: claims.sandboxId,
      session_id: claims.sessionId,
      session_sandbox_id: claims.sessionSandboxId,
      connection_generation: claims.generation,
      connection_attempt_id: claims.attemptId,
      event_ack_floor: claims.ackFloor,
      scope: (options.scopes ?? ALL_SCOPES).join(" "),
    };
    if (options.allowedPaths !== undefined) payload.allowed_paths = options.allowedPaths;
    if (options.allowedCommands !== undefined) payload.allowed_commands = options.allowedCommands;
    // The claims are set as a plain payload: SignJWT's setters would add nothing the
    // supervisor accepts (its claim set is closed).
    return new SignJWT(payload).setProtectedHeader({ alg: "ES256", typ: "JWT", kid }).sign(key);
  };
}
