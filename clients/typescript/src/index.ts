// The TypeScript client of the sandbox-supervisor control protocol (docs/protocol.md).
export * from "./protocol.js";
export * from "./assertion.js";
export * from "./endpoint.js";
export * from "./policy.js";
export * from "./store.js";
export * from "./connection.js";
export * from "./session.js";
