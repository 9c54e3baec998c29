// Opening the control socket over TCP or a unix socket (docs/protocol.md §1, §2).

import WebSocket from "ws";

import type { HttpRefusalCode } from "./protocol.js";

export type Endpoint = { tcp: { host: string; port: number } } | { unix: string };

export const DEFAULT_CONTROL_PATH = "/v1/control";
// The supervisor refuses inbound messages above websocket.max_message_bytes (131,072 bytes);
// its own frames can be larger (a binary page is up to 1 MiB plus its header, a replay
// batch frame is one event): accept what it sends.
export const MAX_INBOUND_MESSAGE_BYTES = 64 * 1024 * 1024;
export const DEFAULT_HANDSHAKE_TIMEOUT_MS = 10_000;

/** The URL `ws` opens. `ws` ignores a `socketPath` option; its `ws+unix:` form works. */
export function controlUrl(endpoint: Endpoint, path: string = DEFAULT_CONTROL_PATH): string {
  if ("unix" in endpoint) return `ws+unix:${endpoint.unix}:${path}`;
  const { host, port } = endpoint.tcp;
  const bracketed = host.includes(":") ? `[${host}]` : host;
  return `ws://${bracketed}:${port}${path}`;
}

/** The upgrade was answered with an HTTP status instead of 101 (docs/protocol.md §2.2). */
export class UpgradeRefused extends Error {
  constructor(
    readonly status: number,
    /** The body's `error`: a HttpRefusalCode, or undefined when the body was not one. */
    readonly code: HttpRefusalCode | undefined,
    readonly detail: string,
    /** Retry-After in seconds (storage_full), when sent. */
    readonly retryAfterS: number | undefined,
  ) {
    super(`upgrade refused: ${status} ${code ?? "(no code)"}: ${detail}`);
    this.name = "UpgradeRefused";
  }
}

/** No HTTP answer at all: refused, reset, timed out, or a unix peer check (§1.1). */
export class ConnectFailed extends Error {
  constructor(override readonly cause: unknown) {
    super(`connect failed: ${cause instanceof Error ? cause.message : String(cause)}`);
    this.name = "ConnectFailed";
  }
}

export interface OpenOptions {
  path?: string;
  handshakeTimeoutMs?: number;
}

/** Open one WebSocket with the routing headers; resolves once the 101 arrived. */
export function openSocket(endpoint: Endpoint, headers: Record<string, string>, options: OpenOptions = {}): Promise<WebSocket> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(controlUrl(endpoint, options.path), {
      headers,
      // No extensions: the supervisor negotiates none (docs/protocol.md §1.4).
      perMessageDeflate: false,
      handshakeTimeout: options.handshakeTimeoutMs ?? DEFAULT_HANDSHAKE_TIMEOUT_MS,
      maxPayload: MAX_INBOUND_MESSAGE_BYTES,
    });
    let settled = false;
    const settle = (action: () => void): void => {
      if (!settled) {
        settled = true;
        action();
      }
    };
    ws.once("open", () => settle(() => resolve(ws)));
    ws.on("unexpected-response", (request, response) => {
      const chunks: Buffer[] = [];
      response.on("data", (chunk: Buffer) => chunks.push(chunk));
      response.on("end", () => {
        const text = Buffer.concat(chunks).toString("utf8");
        let code: HttpRefusalCode | undefined;
        let detail = text;
        try {
          const body = JSON.parse(text) as { error?: unknown; message?: unknown };
          if (typeof body.error === "string") code = body.error as HttpRefusalCode;
          if (typeof body.message === "string") detail = body.message;
        } catch {
          // not JSON: keep the text as the detail
        }
        const retryAfter = Number(response.headers["retry-after"]);
        settle(() =>
          reject(new UpgradeRefused(response.statusCode ?? 0, code, detail, Number.isFinite(retryAfter) ? retryAfter : undefined)),
        );
        request.destroy();
      });
    });
    ws.on("error", (error) => settle(() => reject(new ConnectFailed(error))));
    ws.once("close", () => settle(() => reject(new ConnectFailed(new Error("closed before the upgrade completed")))));
  });
}
