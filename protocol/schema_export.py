"""Export the protocol's JSON Schemas to protocol/schemas/ (or check that they are current).

    python -m sandbox_supervisor.protocol.schema_export            # (re)write protocol/schemas/*.json
    python -m sandbox_supervisor.protocol.schema_export --check    # exit 1 and list drifted files

The models are the source of truth; the files are for control planes in other languages.
`render_schemas` is pure; only `main` touches the file system (this module is a tool that
lives next to the models it exports, not part of the wire logic).
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


def schema_of(name: str, target: Any) -> dict[str, Any]:
    if isinstance(target, type) and issubclass(target, BaseModel):
        schema = target.model_json_schema()
    else:
        schema = TypeAdapter(target).json_schema()
        schema.setdefault("title", name)
    return {"$schema": SCHEMA_DIALECT, **schema}


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
