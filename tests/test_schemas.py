"""The exported JSON Schemas stay in sync with the pydantic models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox_supervisor.protocol import schema_export
from sandbox_supervisor.protocol.schema_export import DEFAULT_OUT_DIR, EXPORTED, drifted_files, main, render_schemas

REPO = Path(__file__).resolve().parents[1]


def test_checked_in_schemas_match_the_models() -> None:
    assert drifted_files(DEFAULT_OUT_DIR) == [], "run: python -m sandbox_supervisor.protocol.schema_export"


def test_one_file_per_exported_model() -> None:
    assert sorted(path.name for path in DEFAULT_OUT_DIR.glob("*.json")) == sorted(
        f"{name}.json" for name in EXPORTED
    )


def test_files_are_sorted_indented_and_end_with_a_newline() -> None:
    for name, text in render_schemas().items():
        assert text.endswith("}\n"), name
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n", name


def _objects(schema: Any) -> list[dict[str, Any]]:
    """Every sub-schema that declares properties."""
    found: list[dict[str, Any]] = []
    if isinstance(schema, dict):
        if "properties" in schema:
            found.append(schema)
        for value in schema.values():
            found += _objects(value)
    elif isinstance(schema, list):
        for value in schema:
            found += _objects(value)
    return found


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_schemas_are_closed_except_tool_error(name: str) -> None:
    schema = json.loads(render_schemas()[f"{name}.json"])
    for sub in _objects(schema):
        if sub.get("title") == "ToolError":
            assert sub.get("additionalProperties") is True  # the one open model, on purpose
        else:
            assert sub.get("additionalProperties") is False, (name, sub.get("title"))


def test_server_frames_require_their_kind() -> None:
    schema = json.loads(render_schemas()["ErrorFrame.json"])
    assert schema["required"] == ["kind", "body"]
    assert schema["properties"]["kind"]["const"] == "error"


def test_check_reports_a_drifted_file_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--out-dir", str(tmp_path)]) == 0
    assert main(["--check", "--out-dir", str(tmp_path)]) == 0
    (tmp_path / "ErrorFrame.json").write_text("{}\n")
    (tmp_path / "Stale.json").write_text("{}\n")
    (tmp_path / "ReadFileParams.json").unlink()
    capsys.readouterr()
    assert main(["--check", "--out-dir", str(tmp_path)]) == 1
    reported = capsys.readouterr().err
    for name in ("ErrorFrame.json", "Stale.json", "ReadFileParams.json"):
        assert name in reported
    assert "ToolCallBody.json" not in reported


def test_writing_removes_files_no_longer_exported(tmp_path: Path) -> None:
    (tmp_path / "Stale.json").write_text("{}\n")
    schema_export.write_schemas(tmp_path)
    assert not (tmp_path / "Stale.json").exists()
    assert drifted_files(tmp_path) == []


def test_module_entry_point_checks_the_repository() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "sandbox_supervisor.protocol.schema_export", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
