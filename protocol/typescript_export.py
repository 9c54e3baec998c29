"""Write the TypeScript types of every frame to clients/typescript/src/protocol.ts (or check
that the committed file is current).

    python -m sandbox_supervisor.protocol.typescript_export            # (re)write the file
    python -m sandbox_supervisor.protocol.typescript_export --check    # exit 1 if it drifted

The types are generated from the exported JSON Schemas (`schema_export.schema_of`, the files
in protocol/schemas/), so they say what the schemas say: one interface per model, named as
the model (`ToolResultEvent`, `ExecOutputBody` …), `kind` as a string literal, so that
`ServerFrame` and `ClientFrame` are discriminated unions. Where a schema is open on purpose
the generator narrows it from the protocol's own tables: the error codes of each family as
string-literal unions (protocol/errors.py), a `tool.result`'s `result` per tool
(tools.TOOL_SPECS), a `tool.call`'s body as `ToolCallBody`. The constants a client needs
(close codes, header names, page limits) come from the same modules. `render` is pure; only
`main` touches the file system.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox_supervisor.protocol import PROTOCOL_VERSION, closes, errors, frames, headers, tools
from sandbox_supervisor.protocol.schema_export import EXPORTED, schema_of

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_FILE = REPO_ROOT / "clients" / "typescript" / "src" / "protocol.ts"

# The schemas whose $defs hold every model of the wire; each file's root becomes a type too.
ROOTS = ("ClientFrame", "ServerFrame", "ToolCallBody", "ExecOutputPageHeader")
# Models outside those roots that a client reads: each tool's parameters and result.
EXTRA_MODELS = tuple(
    dict.fromkeys(name for spec in tools.TOOL_SPECS for name in (spec.parameters.__name__, spec.result.__name__))
)

# Fields whose schema is open, narrowed from the protocol's tables: (model, field) -> type.
FIELD_OVERRIDES: dict[tuple[str, str], str] = {
    ("ErrorBody", "code"): "FrameErrorCode",
    ("BootstrapRejectedBody", "code"): "BootstrapRejectionCode",
    ("ToolError", "code"): "ToolErrorCode",
    ("ToolCallFrame", "body"): "ToolCallBody",
}
# Models written by hand below the generated ones (they need a union the schema cannot say).
HAND_WRITTEN = frozenset({"ToolResultBody"})

HEADER = """\
// Generated from protocol/schemas/ (the pydantic models of protocol/) by
// `python -m sandbox_supervisor.protocol.typescript_export`. Do not edit by hand:
// `--check` reports drift, and tests/test_typescript_client.py runs it.
/* eslint-disable */
"""


def _literal(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _union(parts: Iterable[str]) -> str:
    unique = list(dict.fromkeys(parts))
    return " | ".join(unique) if unique else "never"


def _ref_name(ref: str) -> str:
    prefix = "#/$defs/"
    if not ref.startswith(prefix):
        raise ValueError(f"unexpected $ref {ref!r}")
    return ref[len(prefix):]


def ts_type(schema: Mapping[str, Any]) -> str:
    """The TypeScript type of one sub-schema (inline; named models are referenced by name)."""
    if "$ref" in schema:
        return _ref_name(schema["$ref"])
    if "const" in schema:
        return _literal(schema["const"])
    if "enum" in schema:
        return _union(_literal(value) for value in schema["enum"])
    for keyword in ("anyOf", "oneOf"):
        if keyword in schema:
            return _union(_wrap(ts_type(sub)) for sub in schema[keyword])
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union(ts_type({**schema, "type": one}) for one in kind)
    if kind == "string":
        return "string"
    if kind in ("integer", "number"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "null":
        return "null"
    if kind == "array":
        items = schema.get("items")
        return f"{_wrap(ts_type(items))}[]" if isinstance(items, dict) else "unknown[]"
    if kind == "object":
        if "properties" in schema:
            return "{ " + " ".join(_members(schema, owner=None)) + " }"
        values = schema.get("additionalProperties")
        pattern_values = list(schema.get("patternProperties", {}).values())
        if pattern_values:
            return f"Record<string, {_union(ts_type(sub) for sub in pattern_values)}>"
        if isinstance(values, dict):
            return f"Record<string, {ts_type(values)}>"
        if values is False:
            return "Record<string, never>"
        return "Record<string, unknown>"
    return "unknown"


def _wrap(text: str) -> str:
    return f"({text})" if " | " in text else text


def _members(schema: Mapping[str, Any], owner: str | None) -> list[str]:
    required = set(schema.get("required", []))
    members = []
    for name, sub in schema["properties"].items():
        override = FIELD_OVERRIDES.get((owner, name)) if owner else None
        text = override or ts_type(sub)
        if override and _is_nullable(sub):
            text = f"{override} | null"
        optional = "" if name in required else "?"
        members.append(f"{name}{optional}: {text};")
    if schema.get("additionalProperties") is True:
        members.append("[extra: string]: unknown;")
    return members


def _is_nullable(schema: Mapping[str, Any]) -> bool:
    return any(sub.get("type") == "null" for sub in schema.get("anyOf", []))


def _comment(text: str | None, indent: str = "") -> list[str]:
    if not text:
        return []
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return [f"{indent}/**", *(f"{indent} * {line}".rstrip() for line in lines), f"{indent} */"]


def _definitions() -> dict[str, dict[str, Any]]:
    """Every named model of the roots and extra models, one schema per name."""
    found: dict[str, dict[str, Any]] = {}

    def add(name: str, schema: dict[str, Any]) -> None:
        previous = found.get(name)
        if previous is not None and previous != schema:
            raise ValueError(f"two different schemas are both named {name}")
        found[name] = schema

    for name in (*ROOTS, *EXTRA_MODELS):
        schema = schema_of(name, EXPORTED[name])
        for def_name, sub in schema.get("$defs", {}).items():
            add(def_name, sub)
        root = {key: value for key, value in schema.items() if key not in ("$defs", "$schema", "$id")}
        if "properties" in root:
            add(name, root)
    return found


def _interface(name: str, schema: Mapping[str, Any]) -> list[str]:
    if "properties" not in schema:
        return [*_comment(schema.get("description")), f"export type {name} = {ts_type(schema)};"]
    lines = [*_comment(schema.get("description")), f"export interface {name} {{"]
    lines += [f"  {member}" for member in _members(schema, owner=name)]
    lines.append("}")
    return lines


def _string_union(name: str, values: Iterable[str], comment: str) -> list[str]:
    return [*_comment(comment), f"export type {name} =", *(f"  | {_literal(v)}" for v in sorted(values)), ";"]


def _kind_map(name: str, union_schema: Mapping[str, Any], definitions: Mapping[str, Any]) -> list[str]:
    lines = [f"export interface {name} {{"]
    for sub in union_schema["oneOf"]:
        model = _ref_name(sub["$ref"])
        kind = definitions[model]["properties"]["kind"]["const"]
        lines.append(f"  {_literal(kind)}: {model};")
    lines.append("}")
    return lines


def _tool_maps() -> list[str]:
    lines = ["/** Each tool's parameters (the `parameters` of its tool.call). */", "export interface ToolParametersByName {"]
    lines += [f"  {_literal(spec.name)}: {spec.parameters.__name__};" for spec in tools.TOOL_SPECS]
    lines += ["}", "", "/** Each tool's `result` in an ok `tool.result`. */", "export interface ToolResultsByName {"]
    lines += [f"  {_literal(spec.name)}: {spec.result.__name__};" for spec in tools.TOOL_SPECS]
    lines += ["}", "", "/** The scope a connection needs for each tool (docs/protocol.md §3.5). */"]
    lines.append("export const TOOL_SCOPES = {")
    lines += [f"  {_literal(spec.name)}: {_literal(spec.scope)}," for spec in tools.TOOL_SPECS]
    lines.append("} as const satisfies Record<ToolName, Scope>;")
    return lines


# `tool.result`'s body: ok:true carries the result of the tool it names; ok:false an error.
# The schema keeps `result` an open object (one envelope for every tool); here it is narrowed.
TOOL_RESULT_BODY = """\
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
"""


def _const_object(
    doc: str, name: str, namespace: dict[str, Any], *, prefix: str = "", suffix: str = ""
) -> list[str]:
    """`export const name = {…} as const;` of a module's constants named prefix…suffix, sorted,
    each under its name without the prefix and suffix."""
    lines = [f"/** {doc} */", f"export const {name} = {{"]
    for constant in sorted(namespace):
        if constant.startswith(prefix) and constant.endswith(suffix) and constant != prefix + suffix:
            lines.append(f"  {constant[len(prefix) : len(constant) - len(suffix)]}: {_literal(namespace[constant])},")
    return [*lines, "} as const;", ""]


def _constants() -> list[str]:
    lines = ["// --- constants (protocol/closes.py, protocol/headers.py, protocol/frames.py) ---", ""]
    lines += _const_object(
        "WebSocket close codes of the control channel (docs/protocol.md §4.4, docs/codes.md).",
        "CloseCode", vars(closes), prefix="CLOSE_",
    )
    lines += _const_object("The reasons the supervisor closes with (docs/protocol.md §4.4).", "CloseReason", vars(closes), suffix="_REASON")
    lines += _const_object("Routing headers of the upgrade (docs/protocol.md §2.1).", "Header", vars(headers), suffix="_HEADER")
    lines.append("/** Each HTTP refusal's status (docs/protocol.md §1, §2.2). */")
    lines.append("export const HTTP_REFUSAL_STATUS = {")
    lines += [f"  {code}: {status}," for code, (status, _message) in errors.HTTP_ERRORS.items()]
    lines += ["} as const satisfies Record<HttpRefusalCode, number>;", ""]
    numbers = {
        "PROTOCOL_VERSION": PROTOCOL_VERSION,
        "MAX_SAFE_INTEGER": headers.MAX_SAFE_INTEGER,
        "MAX_OUTPUT_PAGE_LENGTH": frames.MAX_OUTPUT_PAGE_LENGTH,
        "MAX_BINARY_OUTPUT_PAGE_LENGTH": frames.MAX_BINARY_OUTPUT_PAGE_LENGTH,
        "BINARY_PAGE_HEADER_LENGTH_BYTES": frames.BINARY_PAGE_HEADER_LENGTH_BYTES,
        "MAX_STDIN_WRITE_BYTES": frames.MAX_STDIN_WRITE_BYTES,
        "STORAGE_FULL_RETRY_AFTER_S": errors.STORAGE_FULL_RETRY_AFTER_S,
        "DEFAULT_MAX_MESSAGE_BYTES": frames.DEFAULT_MAX_MESSAGE_BYTES,
    }
    lines += [f"export const {name} = {value};" for name, value in numbers.items()]
    return lines


def render() -> str:
    definitions = _definitions()
    client_union = schema_of("ClientFrame", EXPORTED["ClientFrame"])
    server_union = schema_of("ServerFrame", EXPORTED["ServerFrame"])
    call_union = schema_of("ToolCallBody", EXPORTED["ToolCallBody"])
    lines = HEADER.splitlines()
    lines.append("")
    lines += _string_union("ToolName", tools.TOOL_NAMES, "The tools of docs/protocol.md §7.")
    lines.append("")
    lines += _string_union("Scope", ("files:read", "files:write", "shell:exec", "session:control"), "Assertion scopes (docs/protocol.md §3.5).")
    lines.append("")
    lines += _string_union("FrameErrorCode", errors.FRAME_ERROR_MEANINGS, "The `code` of an `error` frame (docs/protocol.md §6.5).")
    lines.append("")
    lines += _string_union("ToolErrorCode", errors.TOOL_ERROR_MEANINGS, "The `code` of a failed `tool.result` (docs/protocol.md §7.6).")
    lines.append("")
    lines += _string_union(
        "BootstrapRejectionCode", errors.BOOTSTRAP_REJECTION_MEANINGS, "The `code` of `session.bootstrap.rejected` (docs/protocol.md §5.4)."
    )
    lines.append("")
    lines += _string_union("HttpRefusalCode", errors.HTTP_ERRORS, "The `error` of an HTTP refusal (docs/protocol.md §1, §2.2).")
    lines.append("")
    for name in sorted(definitions):
        if name in HAND_WRITTEN:
            continue
        lines += _interface(name, definitions[name])
        lines.append("")
    lines += TOOL_RESULT_BODY.splitlines()
    lines.append("")
    lines += _tool_maps()
    lines.append("")
    lines.append("/** Every frame a client sends (docs/protocol.md §6.3), discriminated by `kind`. */")
    lines.append(f"export type ClientFrame = {ts_type(client_union)};")
    lines.append("")
    lines.append("/** Every text frame the supervisor sends (docs/protocol.md §6.5, §6.6), discriminated by `kind`. */")
    lines.append(f"export type ServerFrame = {ts_type(server_union)};")
    lines.append("")
    lines.append("/** The body of a `tool.call` (docs/protocol.md §7.1), discriminated by `tool_name`. */")
    lines.append(f"export type ToolCallBody = {ts_type(call_union)};")
    lines.append("")
    lines += _kind_map("ClientFrameByKind", client_union, definitions)
    lines.append("")
    lines += _kind_map("ServerFrameByKind", server_union, definitions)
    lines.append("")
    lines.append("export type ClientKind = keyof ClientFrameByKind;")
    lines.append("export type ServerKind = keyof ServerFrameByKind;")
    lines.append("/** The journaled kinds: frames with a `seq` (docs/protocol.md §6.6, §9.1). */")
    lines.append(f"export type EventFrame = Extract<ServerFrame, {{ seq: number }}>;")
    lines.append("")
    lines += _constants()
    return "\n".join(lines) + "\n"


def drifted(out_file: Path) -> bool:
    return not out_file.is_file() or out_file.read_text(encoding="utf-8") != render()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_supervisor.protocol.typescript_export", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_FILE)
    args = parser.parse_args(argv)
    if args.check:
        if drifted(args.out):
            print(f"drifted: {args.out}\nrun: python -m sandbox_supervisor.protocol.typescript_export", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
