"""apply_file_patch and read_file through a real daemon: results, errors and the jail as a
control plane sees them (docs/protocol.md §7.2, §7.3, §7.5)."""

from __future__ import annotations

import base64
import difflib
import os

import pytest
from sandbox_supervisor.daemon.runtime.patch import git_blob_sha  # checked against `git hash-object` in test_patch

ZERO = "0" * 40


def unified(path: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


def patch_params(path: str, old: str | None, new: str | None) -> dict:
    if old is None:
        diff = unified(path, "", new).replace(f"--- a/{path}", "--- /dev/null", 1)
    elif new is None:
        diff = unified(path, old, "").replace(f"+++ b/{path}", "+++ /dev/null", 1)
    else:
        diff = unified(path, old, new)
    base = ZERO if old is None else git_blob_sha(old.encode())
    return {"path": path, "diff": diff, "base_sha": base}


async def test_create_modify_delete(daemon, session):
    ws = daemon.layout.workspace
    created = await session.call_and_wait(
        "apply_file_patch", patch_params("src/app.py", None, "a\nb\n"), idempotency_key="c1"
    )
    assert created["ok"] is True
    assert created["result"] == {
        "path": "src/app.py",
        "old_sha": ZERO,
        "new_sha": git_blob_sha(b"a\nb\n"),
        "hunks": 1,
        "bytes": 4,
    }
    os.chmod(ws / "src/app.py", 0o755)
    modified = await session.call_and_wait(
        "apply_file_patch", patch_params("src/app.py", "a\nb\n", "a\nB\nc\n"), idempotency_key="c2"
    )
    assert modified["result"]["new_sha"] == git_blob_sha(b"a\nB\nc\n")
    assert (ws / "src/app.py").read_bytes() == b"a\nB\nc\n"
    assert os.stat(ws / "src/app.py").st_mode & 0o777 == 0o755
    deleted = await session.call_and_wait(
        "apply_file_patch", patch_params("src/app.py", "a\nB\nc\n", None), idempotency_key="c3"
    )
    assert deleted["result"]["new_sha"] == ZERO and deleted["result"]["bytes"] == 0
    assert not (ws / "src/app.py").exists()


async def test_base_sha_mismatch_leaves_file_untouched(daemon, session):
    target = daemon.layout.workspace / "m.txt"
    target.write_text("actual\n")
    result = await session.call_and_wait(
        "apply_file_patch", patch_params("m.txt", "expected\n", "new\n"), idempotency_key="m1"
    )
    assert result["ok"] is False
    assert result["error"]["code"] == "base_sha_mismatch"
    assert result["error"]["current_sha"] == git_blob_sha(b"actual\n")
    assert target.read_text() == "actual\n"
    missing = await session.call_and_wait(
        "apply_file_patch", patch_params("nope.txt", "x\n", "y\n"), idempotency_key="m2"
    )
    assert missing["error"]["code"] == "base_sha_mismatch"
    assert missing["error"]["current_sha"] == ZERO


async def test_patch_that_does_not_apply_names_the_hunk(daemon, session):
    target = daemon.layout.workspace / "h.txt"
    target.write_text("one\ntwo\nthree\n")
    params = patch_params("h.txt", "one\ntwo\nthree\n", "one\n2\nthree\n")
    params["diff"] = params["diff"].replace("-two", "-TWO").replace(" one", " ONE")
    result = await session.call_and_wait("apply_file_patch", params, idempotency_key="h1")
    assert result["ok"] is False and result["error"]["code"] == "patch_does_not_apply"
    assert result["error"]["hunk"]["index"] == 0
    assert target.read_text() == "one\ntwo\nthree\n"


@pytest.mark.parametrize(
    "path",
    ["../outside.txt", "/etc/passwd", "link-out/x.txt", "sub/../../outside.txt"],
)
async def test_jail_escapes_over_the_wire(daemon, session, tmp_path, path):
    (daemon.layout.workspace / "link-out").symlink_to(tmp_path)
    result = await session.call_and_wait(
        "apply_file_patch", patch_params(path, None, "x\n"), idempotency_key=f"j-{path}"
    )
    assert result["ok"] is False and result["error"]["code"] == "path_outside_workspace"
    read = await session.call_and_wait("read_file", {"path": path})
    assert read["error"]["code"] == "path_outside_workspace"
    assert not (tmp_path / "x.txt").exists()


async def test_a_name_longer_than_the_file_system_allows_is_a_typed_error(daemon, session):
    # NAME_MAX is 255 bytes: the kernel refuses the name (ENAMETOOLONG). That is the caller's
    # parameter, not a crash of the supervisor.
    path = "n" * 300 + ".txt"
    patched = await session.call_and_wait(
        "apply_file_patch", patch_params(path, None, "x\n"), idempotency_key="long-name"
    )
    read = await session.call_and_wait("read_file", {"path": path})
    for result in (patched, read):
        assert result["ok"] is False
        assert result["error"]["code"] == "invalid_parameters"
        assert "File name too long" in result["error"]["message"]
    assert os.listdir(daemon.layout.workspace) == []


async def test_allowed_paths_from_the_assertion(daemon):
    ws = daemon.layout.workspace
    (ws / "src").mkdir()
    (ws / "srcx").mkdir()
    client = daemon.client()
    async with client.connect(claim_overrides={"allowed_paths": ["src"]}) as session:
        await session.bootstrap(cwd=str(ws))
        inside = await session.call_and_wait(
            "apply_file_patch", patch_params("src/ok.txt", None, "ok\n"), idempotency_key="a1"
        )
        outside = await session.call_and_wait(
            "apply_file_patch", patch_params("srcx/no.txt", None, "no\n"), idempotency_key="a2"
        )
    assert inside["ok"] is True
    assert outside["error"]["code"] == "path_outside_workspace"
    assert not (ws / "srcx/no.txt").exists()


async def test_read_file_text_binary_and_paging(daemon, session):
    ws = daemon.layout.workspace
    (ws / "t.txt").write_text("héllo wörld\n")
    text = await session.call_and_wait("read_file", {"path": "t.txt"})
    data = "héllo wörld\n".encode()
    assert text["result"] == {
        "path": "t.txt",
        "sha": git_blob_sha(data),
        "size": len(data),
        "offset": 0,
        "length": len(data),
        "encoding": "utf-8",
        "content": "héllo wörld\n",
        "eof": True,
    }
    blob = bytes(range(256)) * 10
    (ws / "b.bin").write_bytes(blob)
    page = await session.call_and_wait("read_file", {"path": "b.bin", "offset": 100, "length": 1000})
    assert page["result"]["encoding"] == "base64"
    assert base64.b64decode(page["result"]["content"]) == blob[100:1100]
    assert page["result"]["eof"] is False and page["result"]["sha"] == git_blob_sha(blob)
    missing = await session.call_and_wait("read_file", {"path": "absent.txt"})
    assert missing["error"]["code"] == "not_found"


async def test_crlf_and_no_final_newline_preserved(daemon, session):
    target = daemon.layout.workspace / "w.txt"
    old = b"line1\r\nline2\r\nlast"
    target.write_bytes(old)
    diff = (
        "--- a/w.txt\n+++ b/w.txt\n@@ -1,3 +1,3 @@\n line1\r\n-line2\r\n+LINE2\r\n last\n"
        "\\ No newline at end of file\n"
    )
    result = await session.call_and_wait(
        "apply_file_patch", {"path": "w.txt", "diff": diff, "base_sha": git_blob_sha(old)}, idempotency_key="w1"
    )
    assert result["ok"] is True, result
    assert target.read_bytes() == b"line1\r\nLINE2\r\nlast"
