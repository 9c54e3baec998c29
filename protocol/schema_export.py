"""Export the protocol's JSON Schemas to protocol/schemas/ (or check that they are current).

    python -m sandbox_supervisor.protocol.schema_export            # (re)write protocol/schemas/*.json
    python -m sandbox_supervisor.protocol.schema_export --check    # exit 1 and list drifted files

The models are the source of truth; the files are for control planes in other languages.
`render_schemas` is pure; only `main` touches the file system (this module is a tool that
lives next to the models it exports, not part of the wire logic).

Every file is plain draft 2020-12 that strict validators take without options (Ajv 8's
strict mode, Python's jsonschema): pydantic's output is post-processed by `portable` to drop
what only OpenAPI tools read (`discriminator`) and formats a validator would have to be told
about (`date-time`: the model's own pattern says it). tests/test_schemas_validators.py checks
both validators, and the TypeScript client's tests run Ajv itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter

from sandbox_supervisor.protocol import authority, bootstrap, frames, onboarding, tools

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
# Each file's `$id`: a name, not a location (nothing is served there), so that a validator
# holding every file at once (Ajv's addSchema) tells them apart. `$ref`s stay in-file
# (`#/$defs/…`), so no validator ever needs to fetch anything.
SCHEMA_ID_PREFIX = "urn:sandbox-supervisor:protocol:v1:"
# OpenAPI's `discriminator` is no JSON Schema keyword: Ajv's strict mode refuses it (and its
# `mapping` even with `discriminator: true`). The `oneOf` it sits beside already tells the
# kinds apart by their `const` kind (or tool_name), so dropping it loses nothing.
OPENAPI_ONLY_KEYWORDS = frozenset({"discriminator"})
# Formats a strict validator refuses unless the caller registers them; the fields carrying one
# also carry the pattern the model checks (a test holds this), so the format adds nothing.
UNDECLARED_FORMATS = frozenset({"date-time"})
# Keywords whose value maps names to sub-schemas; the names are data, never keywords (a
# property called `format` or `discriminator` is kept).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
# Keywords whose value is data (an instance, a list of names): copied as they are.
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples", "required"})
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "schemas"

# name -> model or union; the name is the file name (without .json). Any: the values are type
# forms (classes, and Annotated unions that are no class) as TypeAdapter takes them.
EXPORTED: dict[str, Any] = {
    # client frames, one by one and as the union a server accepts
    "SessionBootstrapFrame": frames.SessionBootstrapFrame,
    "ToolCallFrame": frames.ToolCallFrame,
    "EventsAckFrame": frames.EventsAckFrame,
    "ExecSignalFrame": frames.ExecSignalFrame,
    "ExecReadOutputFrame": frames.ExecReadOutputFrame,
    "ExecWriteStdinFrame": frames.ExecWriteStdinFrame,
    "ExecCloseStdinFrame": frames.ExecCloseStdinFrame,
    "ExecResizeFrame": frames.ExecResizeFrame,
    "ExecListFrame": frames.ExecListFrame,
    "ClientFrame": frames.ClientFrame,
    # server frames and journaled events
    "RuntimeStateFrame": frames.RuntimeStateFrame,
    "BootstrapRejectedFrame": frames.BootstrapRejectedFrame,
    "ToolPendingFrame": frames.ToolPendingFrame,
    "ToolReplayedFrame": frames.ToolReplayedFrame,
    "ExecOutputPageFrame": frames.ExecOutputPageFrame,
    "ExecOutputPageHeader": frames.ExecOutputPageHeader,
    "ExecStdinAckFrame": frames.ExecStdinAckFrame,
    "ExecProcessesFrame": frames.ExecProcessesFrame,
    "ErrorFrame": frames.ErrorFrame,
    "ExecStartedEvent": frames.ExecStartedEvent,
    "ExecOutputEvent": frames.ExecOutputEvent,
    "ExecCompletedEvent": frames.ExecCompletedEvent,
    "ToolResultEvent": frames.ToolResultEvent,
    "EventWithheldEvent": frames.EventWithheldEvent,
    "ServerFrame": frames.ServerFrame,
    # tool calls (the body of a tool.call frame) and their parameters and results
    "ToolCallBody": tools.ToolCallBody,
    **{spec.parameters.__name__: spec.parameters for spec in tools.TOOL_SPECS},
    **{spec.result.__name__: spec.result for spec in tools.TOOL_SPECS},
    # session.bootstrap body, assertion claims
    "BootstrapBody": bootstrap.BootstrapBody,
    "AssertionClaims": authority.AssertionClaims,
    # template onboarding record (kept by the service that owns the template)
    "TemplateOnboarding": onboarding.TemplateOnboarding,
}


def portable(schema: Any) -> Any:
    """`schema` without the keywords and formats of OPENAPI_ONLY_KEYWORDS and
    UNDECLARED_FORMATS, walked by keyword (so a property named like a keyword stays)."""
    if isinstance(schema, list):  # a sub-schema list (anyOf …) or a keyword's plain value
        return [portable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result: dict[str, Any] = {}
    for keyword, value in schema.items():
        if keyword in OPENAPI_ONLY_KEYWORDS:
            continue
        if keyword == "format" and value in UNDECLARED_FORMATS:
            if "pattern" not in schema:
                raise ValueError(f"format {value!r} without a pattern would lose its check")
            continue
        if keyword in _DATA_KEYWORDS:
            result[keyword] = value
        elif keyword in _SCHEMA_MAPS and isinstance(value, dict):
            result[keyword] = {name: portable(sub) for name, sub in value.items()}
        elif keyword in _SCHEMA_LISTS or isinstance(value, dict):
            result[keyword] = portable(value)  # sub-schemas: items, not, if, additionalProperties …
        else:
            result[keyword] = value
    return result


def schema_of(name: str, target: Any) -> dict[str, Any]:
    if isinstance(target, type) and issubclass(target, BaseModel):
        schema = target.model_json_schema()
    else:
        schema = TypeAdapter(target).json_schema()
        schema.setdefault("title", name)
    return {"$schema": SCHEMA_DIALECT, "$id": f"{SCHEMA_ID_PREFIX}{name}.json", **portable(schema)}


def render_schemas() -> dict[str, str]:
    """File name -> exact file text (sorted keys, indent 2, trailing newline)."""
    return {
        f"{name}.json": json.dumps(schema_of(name, target), indent=2, sort_keys=True) + "\n"
        for name, target in EXPORTED.items()
    }


def drifted_files(out_dir: Path) -> list[str]:
    """Names of files that differ from the models: changed, missing, or no longer exported."""
    expected = render_schemas()
    present = {path.name for path in out_dir.glob("*.json")} if out_dir.is_dir() else set()
    drifted = [
        name
        for name, text in expected.items()
        if name not in present or (out_dir / name).read_text(encoding="utf-8") != text
    ]
    drifted += sorted(present - expected.keys())
    return sorted(drifted)


def write_schemas(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    expected = render_schemas()
    for stale in {path.name for path in out_dir.glob("*.json")} - expected.keys():
        (out_dir / stale).unlink()
    for name, text in expected.items():
        (out_dir / name).write_text(text, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox_supervisor.protocol.schema_export", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    if args.check:
        drifted = drifted_files(args.out_dir)
        for name in drifted:
            print(f"drifted: {args.out_dir / name}", file=sys.stderr)
        if drifted:
            print("run: python -m sandbox_supervisor.protocol.schema_export", file=sys.stderr)
        return 1 if drifted else 0
    write_schemas(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
