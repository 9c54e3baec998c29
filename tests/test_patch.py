"""apply_file_patch (docs/protocol.md §7.5): strict unified-diff apply, base sha, atomic write, §10.2
crash rule. Real files in tmp_path; the diff parser also under hypothesis."""

from __future__ import annotations

import difflib
import os
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_supervisor.protocol.errors import (
    BASE_SHA_MISMATCH,
    INVALID_PARAMETERS,
    PATCH_DOES_NOT_APPLY,
)
from sandbox_supervisor.protocol.frames import ToolError
from sandbox_supervisor.protocol.tools import PatchResult
from sandbox_supervisor.protocol.tools import ApplyFilePatchParams
from sandbox_supervisor.daemon.runtime import patch as patch_module
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.patch import (
    NEW_FILE_MODE,
    ZERO_SHA,
    DiffOutcome,
    PatchError,
    apply_unified_diff,
    commit_patch,
    current_sha,
    git_blob_sha,
    plan_patch,
    recover_patch,
)
from sandbox_supervisor.testing.fuzzing import fuzz_settings
from sandbox_supervisor.daemon.state.keys import owner_key

NO_NEWLINE = b"\\ No newline at end of file\n"


def make_diff(old: bytes | None, new: bytes | None, path: str = "f.txt") -> str:
    """A correct unified diff from `old` to `new` (None: no file), as git would write it.

    difflib is run over lines that keep their endings (split on b"\\n" only), so CRLF and a
    missing final newline survive; a line without "\\n" gets the no-newline marker after it.
    """
    old_lines = [] if old is None else _lines(old)
    new_lines = [] if new is None else _lines(new)
    from_name = b"/dev/null" if old is None else b"a/" + path.encode()
    to_name = b"/dev/null" if new is None else b"b/" + path.encode()
    out = [b"--- " + from_name + b"\n", b"+++ " + to_name + b"\n"]
    emitted = list(
        difflib.diff_bytes(difflib.unified_diff, old_lines, new_lines, from_name, to_name)
    )
    for line in emitted[2:]:  # difflib's own ---/+++ lines are the two above
        if line.startswith(b"@@"):
            out.append(line)
        elif line.endswith(b"\n"):
            out.append(line)
        else:
            out.append(line + b"\n" + NO_NEWLINE)
    return b"".join(out).decode("utf-8")


def _lines(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def params(path: str, diff: str, base_sha: str) -> ApplyFilePatchParams:
    return ApplyFilePatchParams(path=path, diff=diff, base_sha=base_sha)


def patch_file(target: Path, diff: str, base_sha: str | None = None):
    """plan + commit, as the dispatcher does; the plan."""
    if base_sha is None:
        base_sha = git_blob_sha(target.read_bytes()) if target.exists() else ZERO_SHA
    plan = plan_patch(target, target.name, params(target.name, diff, base_sha))
    commit_patch(plan)
    return plan


def a_to_b() -> ApplyFilePatchParams:
    """f.txt from "a\\n" to "b\\n"."""
    return params("f.txt", make_diff(b"a\n", b"b\n"), git_blob_sha(b"a\n"))


def file_with(tmp_path: Path, data: bytes, name: str = "f.txt") -> Path:
    target = tmp_path / name
    target.write_bytes(data)
    return target


def expect_failure(code: str, fn, *args) -> ToolFailure:
    with pytest.raises(ToolFailure) as caught:
        fn(*args)
    assert caught.value.code == code, caught.value
    return caught.value


# --- git blob sha ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"hello\n",
        b"no newline",
        b"crlf\r\nlines\r\n",
        b"\x00\xff\xfe binary",
        bytes(range(256)) * 9,
    ],
)
def test_git_blob_sha_equals_git_hash_object(tmp_path, data):
    target = file_with(tmp_path, data)
    printed = subprocess.run(
        ["git", "hash-object", "--no-filters", str(target)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert git_blob_sha(data) == printed
    assert current_sha(target) == printed


def test_current_sha_of_a_missing_file_is_forty_zeros(tmp_path):
    assert current_sha(tmp_path / "missing") == ZERO_SHA == "0" * 40


# --- create / modify / delete ----------------------------------------------------------------


def test_create_writes_the_file_with_the_default_mode(tmp_path):
    target = tmp_path / "new.txt"
    plan = patch_file(target, make_diff(None, b"one\ntwo\n", "new.txt"), ZERO_SHA)
    assert target.read_bytes() == b"one\ntwo\n"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == NEW_FILE_MODE & ~umask
    assert plan.result() == {
        "path": "new.txt",
        "old_sha": ZERO_SHA,
        "new_sha": git_blob_sha(b"one\ntwo\n"),
        "hunks": 1,
        "bytes": 8,
    }
    PatchResult.model_validate(plan.result())


def test_create_makes_missing_parent_directories(tmp_path):
    target = tmp_path / "a" / "b" / "new.txt"
    patch_file(target, make_diff(None, b"x\n"), ZERO_SHA)
    assert target.read_bytes() == b"x\n"


def test_create_of_an_empty_file_needs_no_hunk(tmp_path):
    target = tmp_path / "empty"
    plan = patch_file(target, "--- /dev/null\n+++ b/empty\n", ZERO_SHA)
    assert target.read_bytes() == b""
    assert plan.result()["hunks"] == 0 and plan.new_sha == git_blob_sha(b"")


def test_modify_replaces_the_content_and_reports_both_shas(tmp_path):
    old, new = b"a\nb\nc\n", b"a\nB\nc\n"
    target = file_with(tmp_path, old)
    plan = patch_file(target, make_diff(old, new))
    assert target.read_bytes() == new
    assert plan.result() == {
        "path": "f.txt",
        "old_sha": git_blob_sha(old),
        "new_sha": git_blob_sha(new),
        "hunks": 1,
        "bytes": len(new),
    }


def test_delete_removes_the_file_and_reports_zero_new_sha(tmp_path):
    old = b"a\nb\n"
    target = file_with(tmp_path, old)
    plan = patch_file(target, make_diff(old, None))
    assert not target.exists()
    assert plan.result() == {
        "path": "f.txt",
        "old_sha": git_blob_sha(old),
        "new_sha": ZERO_SHA,
        "hunks": 1,
        "bytes": 0,
    }
    assert os.listdir(tmp_path) == []


def test_removing_every_line_without_dev_null_leaves_an_empty_file(tmp_path):
    target = file_with(tmp_path, b"a\n")
    plan = patch_file(target, "--- a/f.txt\n+++ b/f.txt\n@@ -1 +0,0 @@\n-a\n")
    assert target.read_bytes() == b"" and plan.new_sha == git_blob_sha(b"")


def test_multi_hunk_patch_applies_every_hunk(tmp_path):
    old_lines = [b"line %d\n" % n for n in range(1, 41)]
    new_lines = list(old_lines)
    new_lines[2] = b"changed 3\n"
    new_lines[30:32] = [b"inserted\n", b"changed 31\n"]
    old, new = b"".join(old_lines), b"".join(new_lines)
    diff = make_diff(old, new)
    assert diff.count("\n@@ ") == 2
    target = file_with(tmp_path, old)
    plan = patch_file(target, diff)
    assert target.read_bytes() == new and plan.hunks == 2


def test_header_names_are_not_compared_with_the_call_path(tmp_path):
    target = file_with(tmp_path, b"a\n")
    patch_file(target, "--- some/other/name\t2024-01-01\n+++ whatever\n@@ -1 +1 @@\n-a\n+b\n")
    assert target.read_bytes() == b"b\n"


def test_git_preamble_lines_are_accepted(tmp_path):
    target = file_with(tmp_path, b"a\n")
    diff = (
        "diff --git a/f.txt b/f.txt\nindex 7898192..6178079 100644\n"
        "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-a\n+b\n"
    )
    patch_file(target, diff)
    assert target.read_bytes() == b"b\n"


def test_an_empty_line_inside_a_hunk_is_an_empty_context_line(tmp_path):
    target = file_with(tmp_path, b"a\n\nb\n")
    patch_file(target, "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n\n-b\n+c\n")
    assert target.read_bytes() == b"a\n\nc\n"


# --- base sha -----------------------------------------------------------------------------


def test_base_sha_mismatch_leaves_the_file_untouched_and_reports_current_sha(tmp_path):
    old = b"a\nb\n"
    target = file_with(tmp_path, old)
    failure = expect_failure(
        BASE_SHA_MISMATCH,
        plan_patch,
        target,
        "f.txt",
        params("f.txt", make_diff(old, b"a\nc\n"), git_blob_sha(b"something else")),
    )
    assert failure.details == {"current_sha": git_blob_sha(old)}
    assert target.read_bytes() == old
    ToolError.model_validate(failure.to_error())
    assert failure.to_error()["current_sha"] == git_blob_sha(old)


def test_base_sha_mismatch_for_a_missing_file_reports_forty_zeros(tmp_path):
    target = tmp_path / "missing.txt"
    failure = expect_failure(
        BASE_SHA_MISMATCH,
        plan_patch,
        target,
        "missing.txt",
        params("missing.txt", make_diff(b"a\n", b"b\n"), git_blob_sha(b"a\n")),
    )
    assert failure.details == {"current_sha": ZERO_SHA}
    assert not target.exists()


def test_zero_base_sha_for_an_existing_file_is_a_mismatch(tmp_path):
    target = file_with(tmp_path, b"here\n")
    failure = expect_failure(
        BASE_SHA_MISMATCH,
        plan_patch,
        target,
        "f.txt",
        params("f.txt", make_diff(None, b"x\n"), ZERO_SHA),
    )
    assert failure.details == {"current_sha": git_blob_sha(b"here\n")}
    assert target.read_bytes() == b"here\n"


def test_commit_refuses_a_file_changed_since_the_plan(tmp_path):
    target = file_with(tmp_path, b"a\n")
    plan = plan_patch(target, "f.txt", a_to_b())
    target.write_bytes(b"someone else\n")
    failure = expect_failure(BASE_SHA_MISMATCH, commit_patch, plan)
    assert failure.details == {"current_sha": git_blob_sha(b"someone else\n")}
    assert target.read_bytes() == b"someone else\n"


# --- diffs that do not apply -----------------------------------------------------------------

TEN = b"".join(b"l%d\n" % n for n in range(1, 11))


def refused_hunk(tmp_path, diff: str, data: bytes = TEN) -> dict:
    """The diff must not apply to `data`; the file stays as it was; the hunk details."""
    target = file_with(tmp_path, data)
    failure = expect_failure(
        PATCH_DOES_NOT_APPLY, plan_patch, target, "f.txt", params("f.txt", diff, git_blob_sha(data))
    )
    assert target.read_bytes() == data
    assert os.listdir(tmp_path) == ["f.txt"]
    ToolError.model_validate(failure.to_error())
    return failure.details["hunk"]


def test_wrong_context_does_not_apply(tmp_path):
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -2,3 +2,3 @@\n l2\n-l3\n+x\n WRONG\n")
    assert hunk["index"] == 0 and hunk["header"] == "@@ -2,3 +2,3 @@"
    assert "line 4" in hunk["reason"]


def test_right_context_at_the_wrong_line_does_not_apply(tmp_path):
    # The lines exist (at 2-4), but the header says 3: no offset search.
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -3,3 +3,3 @@\n l2\n-l3\n+x\n l4\n")
    assert hunk["index"] == 0 and "differs" in hunk["reason"]


def test_second_hunk_failure_names_index_one(tmp_path):
    diff = (
        "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n-l1\n+one\n l2\n"
        "@@ -8,2 +8,2 @@\n l8\n-nope\n+x\n"
    )
    hunk = refused_hunk(tmp_path, diff)
    assert hunk["index"] == 1 and hunk["header"] == "@@ -8,2 +8,2 @@"


def test_a_hunk_with_fewer_lines_than_its_header_does_not_apply(tmp_path):
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n l1\n-l2\n+x\n")
    assert "fewer lines" in hunk["reason"]


def test_a_hunk_with_more_lines_than_its_header_does_not_apply(tmp_path):
    # The case a lenient parser drops silently: the extra "+d" would be lost.
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n l1\n-l2\n+c\n+d\n")
    assert hunk["index"] == 0 and "more lines than its header" in hunk["reason"]


def test_a_hunk_past_the_end_of_the_file_does_not_apply(tmp_path):
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -10,2 +10,2 @@\n l10\n-l11\n+x\n")
    assert "end of the file" in hunk["reason"]


def test_overlapping_hunks_do_not_apply(tmp_path):
    diff = "--- a/f\n+++ b/f\n@@ -2,2 +2,2 @@\n l2\n-l3\n+x\n@@ -3 +3 @@\n-l3\n+y\n"
    hunk = refused_hunk(tmp_path, diff)
    assert hunk["index"] == 1 and "overlaps" in hunk["reason"]


def test_a_wrong_new_side_start_does_not_apply(tmp_path):
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -2 +5 @@\n-l2\n+x\n")
    assert "new side" in hunk["reason"]


def test_a_malformed_hunk_header_does_not_apply(tmp_path):
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -2,x +2 @@\n-l2\n+x\n")
    assert "malformed" in hunk["reason"]


def test_a_huge_line_number_is_a_malformed_header_not_a_crash(tmp_path):
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -" + "9" * 5000 + " +1 @@\n-l1\n+x\n")
    assert "malformed" in hunk["reason"] and len(hunk["header"]) <= 200


def test_a_marker_that_follows_no_line_does_not_apply(tmp_path):
    diff = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n\\ No newline at end of file\n-l1\n+x\n"
    hunk = refused_hunk(tmp_path, diff)
    assert "marker" in hunk["reason"]


def test_trailing_empty_lines_and_a_missing_final_newline_in_the_diff_are_fine(tmp_path):
    assert apply_unified_diff(b"a\n", "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n\n\n").new == b"b\n"
    assert apply_unified_diff(b"a\n", "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b").new == b"b\n"


def test_creating_below_a_regular_file_is_invalid_parameters(tmp_path):
    file_with(tmp_path, b"x\n", "plain")
    target = tmp_path / "plain" / "child.txt"
    expect_failure(
        INVALID_PARAMETERS,
        plan_patch,
        target,
        "plain/child.txt",
        params("plain/child.txt", make_diff(None, b"y\n"), ZERO_SHA),
    )
    assert (tmp_path / "plain").read_bytes() == b"x\n"


def test_crlf_context_against_an_lf_file_names_the_line_ending(tmp_path):
    hunk = refused_hunk(tmp_path, "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-l1\r\n+x\r\n")
    assert "line ending" in hunk["reason"]


@pytest.mark.parametrize(
    ("original", "diff", "reason"),
    [
        (b"a\n", "--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+a\n", "exists"),
        (None, "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n", "does not exist"),
        (b"a\nb\n", "--- a/f\n+++ /dev/null\n@@ -1 +0,0 @@\n-a\n", "leaves 1 line"),
    ],
)
def test_a_diff_that_does_not_fit_the_file_as_a_whole(original, diff, reason):
    with pytest.raises(PatchError) as caught:
        apply_unified_diff(original, diff)
    assert caught.value.code == PATCH_DOES_NOT_APPLY
    assert reason in caught.value.details["reason"]


@pytest.mark.parametrize(
    "diff",
    [
        "",
        "\n\n",
        "just some prose\n",
        "--- a/f\n+++ b/f\n",
        "@@ -1 +1 @@\n-a\n+b\n",
        "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n--- a/g\n+++ b/g\n@@ -1 +1 @@\n-a\n+b\n",
        "diff --git a/f b/f\ndiff --git a/g b/g\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n",
        "diff --git a/f b/g\nrename from f\nrename to g\n--- a/f\n+++ b/g\n@@ -1 +1 @@\n-a\n+b\n",
        "diff --git a/f b/f\nBinary files a/f and b/f differ\n",
        "--- /dev/null\n+++ /dev/null\n",
    ],
)
def test_a_diff_that_is_not_a_one_file_unified_diff_is_invalid_parameters(tmp_path, diff):
    target = file_with(tmp_path, b"a\n")
    failure = expect_failure(
        INVALID_PARAMETERS, plan_patch, target, "f.txt", params("f.txt", diff, git_blob_sha(b"a\n"))
    )
    assert failure.message.startswith("diff: ")
    assert target.read_bytes() == b"a\n"


def test_a_directory_is_not_patched(tmp_path):
    (tmp_path / "d").mkdir()
    expect_failure(
        INVALID_PARAMETERS,
        plan_patch,
        tmp_path / "d",
        "d",
        params("d", make_diff(None, b"x\n"), ZERO_SHA),
    )
    assert (tmp_path / "d").is_dir()


# --- bytes are kept --------------------------------------------------------------------------


def test_crlf_content_is_preserved_byte_for_byte(tmp_path):
    old = b"one\r\ntwo\r\nthree\r\n"
    new = b"one\r\nTWO\r\nthree\r\n"
    diff = make_diff(old, new)
    assert "-two\r\n+TWO\r\n" in diff
    target = file_with(tmp_path, old)
    patch_file(target, diff)
    assert target.read_bytes() == new


def test_line_separators_other_than_newline_are_content(tmp_path):
    # str.splitlines would split these; a unified diff does not.
    old = "a\x0bb\x1cc\u2028d\x85e\rf\n".encode() + b"second\n"
    new = "a\x0bb\x1cc\u2028d\x85e\rf\n".encode() + b"SECOND\n"
    target = file_with(tmp_path, old)
    plan = patch_file(target, make_diff(old, new))
    assert target.read_bytes() == new and plan.hunks == 1


def test_nul_and_invalid_utf8_outside_the_hunk_are_preserved(tmp_path):
    head = b"\x00\xff\xfe\x80 not utf-8\n" + b"".join(b"pad %d\n" % n for n in range(10))
    old = head + b"target\n" + b"pad\n" * 5 + b"\xc3\x28 tail\x00"
    new = head + b"changed\n" + b"pad\n" * 5 + b"\xc3\x28 tail\x00"
    diff = "--- a/f\n+++ b/f\n@@ -11,3 +11,3 @@\n pad 9\n-target\n+changed\n pad\n"
    target = file_with(tmp_path, old)
    patch_file(target, diff)
    assert target.read_bytes() == new


def test_adding_the_final_newline(tmp_path):
    old, new = b"a\nb", b"a\nb\n"
    diff = make_diff(old, new)
    assert diff.endswith("-b\n\\ No newline at end of file\n+b\n")
    target = file_with(tmp_path, old)
    patch_file(target, diff)
    assert target.read_bytes() == new


def test_removing_the_final_newline(tmp_path):
    old, new = b"a\nb\n", b"a\nb"
    diff = make_diff(old, new)
    assert diff.endswith("-b\n+b\n\\ No newline at end of file\n")
    target = file_with(tmp_path, old)
    patch_file(target, diff)
    assert target.read_bytes() == new


def test_context_line_without_final_newline_stays_without(tmp_path):
    old, new = b"a\nb\nc", b"A\nb\nc"
    target = file_with(tmp_path, old)
    patch_file(target, make_diff(old, new))
    assert target.read_bytes() == new


def test_a_no_newline_marker_on_a_middle_line_does_not_apply():
    diff = "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n-a\n+x\n\\ No newline at end of file\n b\n"
    with pytest.raises(PatchError) as caught:
        apply_unified_diff(b"a\nb\n", diff)
    assert caught.value.code == PATCH_DOES_NOT_APPLY
    assert "not the last" in caught.value.details["hunk"]["reason"]


# --- atomic write, mode -----------------------------------------------------------------------


def test_mode_is_kept(tmp_path):
    target = file_with(tmp_path, b"#!/bin/sh\necho a\n")
    target.chmod(0o755)
    patch_file(target, make_diff(b"#!/bin/sh\necho a\n", b"#!/bin/sh\necho b\n"))
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert target.read_bytes() == b"#!/bin/sh\necho b\n"


def test_mode_bits_the_umask_would_strip_are_kept(tmp_path):
    target = file_with(tmp_path, b"a\n")
    target.chmod(0o666)
    old_umask = os.umask(0o022)
    try:
        patch_file(target, make_diff(b"a\n", b"b\n"))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666


def test_commit_leaves_no_temp_files_behind(tmp_path):
    target = file_with(tmp_path, b"a\n")
    patch_file(target, make_diff(b"a\n", b"b\n"))
    patch_file(tmp_path / "g.txt", make_diff(None, b"new\n"), ZERO_SHA)
    assert sorted(os.listdir(tmp_path)) == ["f.txt", "g.txt"]


def test_commit_is_a_rename_readers_never_see_a_partial_file(tmp_path):
    target = file_with(tmp_path, b"a\n")
    inode_before = target.stat().st_ino
    patch_file(target, make_diff(b"a\n", b"b\n"))
    # A new inode: the content was written elsewhere and renamed over, not rewritten in place.
    assert target.stat().st_ino != inode_before


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp_file(tmp_path, monkeypatch):
    target = file_with(tmp_path, b"a\n")
    plan = plan_patch(target, "f.txt", a_to_b())

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(patch_module.os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        commit_patch(plan)
    assert target.read_bytes() == b"a\n"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_plan_writes_nothing(tmp_path):
    target = file_with(tmp_path, b"a\n")
    delete = params("f.txt", make_diff(b"a\n", None), git_blob_sha(b"a\n"))
    plan = plan_patch(target, "f.txt", delete)
    plan_patch(tmp_path / "n" / "new", "n/new", params("n/new", make_diff(None, b"x\n"), ZERO_SHA))
    assert plan.new_bytes is None and plan.new_sha == ZERO_SHA
    assert os.listdir(tmp_path) == ["f.txt"] and target.read_bytes() == b"a\n"


# --- crash rule (§10.2) -------------------------------------------------------------------------

OLD, NEW, OTHER = "1" * 40, "2" * 40, "3" * 40


@pytest.mark.parametrize(
    ("current", "old_sha", "new_sha", "outcome"),
    [
        (NEW, OLD, NEW, "applied"),
        (OLD, OLD, NEW, "apply_now"),
        (OTHER, OLD, NEW, "interrupted"),
        (ZERO_SHA, OLD, ZERO_SHA, "applied"),  # a delete that happened
        (ZERO_SHA, ZERO_SHA, NEW, "apply_now"),  # a create that did not
        (ZERO_SHA, OLD, NEW, "interrupted"),  # the file was removed meanwhile
        (OLD, OLD, OLD, "applied"),  # a patch that changes nothing
    ],
)
def test_recover_patch_follows_the_crash_rule(current, old_sha, new_sha, outcome):
    assert recover_patch(current, old_sha, new_sha) == outcome


def test_recovery_after_a_crash_before_the_rename_applies_the_plan(tmp_path):
    old, new = b"a\n", b"b\n"
    target = file_with(tmp_path, old)
    plan = plan_patch(target, "f.txt", params("f.txt", make_diff(old, new), git_blob_sha(old)))
    assert recover_patch(current_sha(target), plan.old_sha, plan.new_sha) == "apply_now"
    commit_patch(plan)
    assert recover_patch(current_sha(target), plan.old_sha, plan.new_sha) == "applied"


# --- property: make_diff output applies to exactly the edited file ----------------------------

LINE_ALPHABET = st.characters(
    blacklist_categories=("Cs",), blacklist_characters="\n\r"
) | st.sampled_from(["\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", " ", "-", "+", "\\", "@"])
LINE = st.one_of(
    st.sampled_from(["", "a", "b", "x y", "-a", "+b", " c", "\\ d", "@@ -1 +1 @@", "--- a/f"]),
    st.text(LINE_ALPHABET, max_size=8),
)


@st.composite
def files(draw, lines=st.lists(LINE, max_size=25)) -> bytes:
    texts = draw(lines)
    style = draw(st.sampled_from(["\n", "\r\n", "mixed"]))
    endings = [
        draw(st.sampled_from(["\n", "\r\n"])) if style == "mixed" else style for _ in texts
    ]
    data = "".join(text + ending for text, ending in zip(texts, endings))
    if texts and draw(st.booleans()):
        data = data[: -len(endings[-1])]  # no newline at end of file
    return data.encode("utf-8")


@st.composite
def edits(draw, old: bytes) -> bytes:
    lines = _lines(old)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        where = draw(st.integers(0, len(lines)))
        text = (draw(LINE) + draw(st.sampled_from(["\n", "\r\n"]))).encode("utf-8")
        if op == "insert":
            lines.insert(where, text)
        elif lines and where < len(lines):
            if op == "delete":
                del lines[where]
            else:
                lines[where] = text
    new = b"".join(lines)
    # Flip the final newline sometimes, in either direction.
    if new and draw(st.booleans()):
        new = new[:-1] if new.endswith(b"\n") else new + b"\n"
    return new


@st.composite
def file_pairs(draw) -> tuple[bytes | None, bytes | None]:
    kind = draw(st.sampled_from(["modify"] * 8 + ["create", "delete"]))
    if kind == "create":
        return None, draw(files())
    old = draw(files())
    if kind == "delete":
        return old, None
    return old, draw(edits(old))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file_pairs())
def test_a_generated_diff_applies_to_exactly_the_edited_file(pair):
    old, new = pair
    diff = make_diff(old, new)
    if old == new:
        # difflib emits no hunk for an unchanged file: a diff without hunks is invalid.
        with pytest.raises(PatchError) as caught:
            apply_unified_diff(old, diff)
        assert caught.value.code == INVALID_PARAMETERS
        return
    outcome = apply_unified_diff(old, diff)
    assert outcome == DiffOutcome(new=new, hunks=diff.count("\n@@ "))


def test_make_diff_agrees_with_git_apply(tmp_path):
    # The helper the property test relies on writes diffs git accepts and applies the same way.
    old = b"keep\r\none\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nlast"
    new = b"keep\r\nONE\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nlast\n"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    target = file_with(tmp_path, old)
    (tmp_path / "change.diff").write_text(make_diff(old, new), newline="")
    subprocess.run(
        ["git", "-C", str(tmp_path), "apply", "--whitespace=nowarn", "change.diff"], check=True
    )
    assert target.read_bytes() == new
    assert apply_unified_diff(old, make_diff(old, new)).new == new


# --- the diff parser under arbitrary text -----------------------------------------------------

_DIFF_PIECES = st.sampled_from(
    ["--- a/f.txt\n", "+++ b/f.txt\n", "--- /dev/null\n", "+++ /dev/null\n", "@@ -1,2 +1,2 @@\n",
     "@@ -0,0 +1 @@\n", "@@ -1 +0,0 @@\n", "@@ -3,1 +3,1 @@ ctx\n", "@@ -99999999999999999999,1 +1 @@\n",
     " keep\n", "-old\n", "+new\n", "\\ No newline at end of file\n", "diff --git a/f.txt b/f.txt\n",
     "index 0000000..1111111 100644\n", "rename from x\n", "Binary files differ\n", "GIT binary patch\n",
     "\r\n", "\n", " ", "-", "+", "@@", "\x00", "é"]
)


@pytest.mark.fuzz
@fuzz_settings(300)
@given(
    diff=st.one_of(
        st.lists(_DIFF_PIECES, max_size=25).map("".join),
        st.builds(lambda pair, cut, noise: make_diff(*pair)[:cut] + noise, file_pairs(), st.integers(0, 400), st.text(max_size=8)),
        st.text(max_size=300),
    ),
    original=st.none() | st.sampled_from([b"", b"keep\nold\n", b"old\r\nkeep", b"\xff\xfe\n"]) | st.binary(max_size=60),
)
def test_arbitrary_diffs_apply_or_raise_a_typed_patch_error(diff: str, original: bytes | None) -> None:
    """Any text against any file: a result, or PatchError with a code of the protocol and an
    error object that validates — never another exception."""
    try:
        outcome = apply_unified_diff(original, diff)
    except PatchError as failure:
        assert failure.code in {INVALID_PARAMETERS, PATCH_DOES_NOT_APPLY}
        ToolError.model_validate(failure.to_error())
    else:
        # Without hunks a diff may only create or delete an empty file (docs/protocol.md §7.5).
        assert outcome.hunks >= 1 or outcome.new == b"" or (outcome.new is None and not original)
        assert outcome.new is None or isinstance(outcome.new, bytes)


def test_a_crash_while_recovery_applies_an_unplanned_patch_is_recovered_as_applied(tmp_path):
    """A kill -9 before the plan was recorded leaves a pending patch with no plan; the next
    start applies it. If that start is killed too, after the write and before the result,
    the start after it must recognise the patch as applied (not plan it again against the
    new content and answer base_sha_mismatch)."""
    import json

    from sandbox_supervisor.daemon.runtime.tool import RecoveryEnv
    from sandbox_supervisor.daemon.runtime.tools.apply_file_patch import recover
    from sandbox_supervisor.daemon.state.store import StateStore

    workspace = tmp_path / "ws"
    workspace.mkdir()
    old, new = b"one\ntwo\n", b"one\nTWO\n"
    (workspace / "f.txt").write_bytes(old)
    parameters = {"path": "f.txt", "diff": make_diff(old, new), "base_sha": git_blob_sha(old)}
    intent = {"parameters": parameters, "cwd": str(workspace), "allowed_paths": None}
    with StateStore.open(tmp_path / "state") as store:
        store.begin_call(
            key=owner_key("k"), tool_name="apply_file_patch", digest="d", call_id="c-1", intent_json=json.dumps(intent)
        )
        env = RecoveryEnv(store, tmp_path / "state")
        first = recover(store.call_record(owner_key("k")), env).body  # ...killed before complete_call
        assert (workspace / "f.txt").read_bytes() == new
        second = recover(store.call_record(owner_key("k")), env).body
    assert first["ok"] is True and second == first
    assert (workspace / "f.txt").read_bytes() == new


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (CI runs as root)")
def test_a_recovered_patch_gives_what_it_creates_to_the_command_user(tmp_path):
    """With [exec] user set, a file a patch creates belongs to the command user; a patch that
    crash recovery carries out must do the same, or the agent could not edit it."""
    import json

    from sandbox_supervisor.daemon.runtime.tool import RecoveryEnv
    from sandbox_supervisor.daemon.runtime.tools.apply_file_patch import recover
    from sandbox_supervisor.daemon.state.store import StateStore

    nobody = (65534, 65534)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    new = b"hello\n"
    parameters = {"path": "made/new.txt", "diff": make_diff(None, new, "made/new.txt"), "base_sha": "0" * 40}
    intent = {"parameters": parameters, "cwd": str(workspace), "allowed_paths": None}
    with StateStore.open(tmp_path / "state") as store:
        store.begin_call(key=owner_key("k"), tool_name="apply_file_patch", digest="d", call_id="c-1", intent_json=json.dumps(intent))
        body = recover(store.call_record(owner_key("k")), RecoveryEnv(store, tmp_path / "state", file_owner=nobody)).body
    assert body["ok"] is True, body
    created = workspace / "made" / "new.txt"
    assert created.read_bytes() == new
    assert (created.stat().st_uid, created.stat().st_gid) == nobody
    assert (created.parent.stat().st_uid, created.parent.stat().st_gid) == nobody


def test_hunks_far_into_a_large_file_apply_exactly_and_name_the_right_line():
    # Lines of many lengths (some longer than the block _Lines skips at a time), edits far
    # apart and close together, and the last line without a newline: the lines between the
    # hunks are located without being split, and must land byte for byte.
    lines = [b"%d %s\n" % (i, b"x" * (i * 37 % 5000 if i % 97 == 0 else i % 90)) for i in range(6000)]
    lines[-1] = lines[-1].rstrip(b"\n")
    old = b"".join(lines)
    edited = list(lines)
    for where in (0, 1, 40, 41, 2000, 2035, 4500, 5999):
        edited[where] = b"changed %d\n" % where if where != 5999 else b"changed last"
    new = b"".join(edited)
    diff = make_diff(old, new)
    assert apply_unified_diff(old, diff) == DiffOutcome(new=new, hunks=diff.count("\n@@ "))
    # A context line that differs deep in the file is reported at its own line number.
    broken = old.replace(b"\n4502 ", b"\n4502 BROKEN ")
    with pytest.raises(PatchError) as caught:
        apply_unified_diff(broken, diff)
    assert caught.value.code == PATCH_DOES_NOT_APPLY
    assert caught.value.details["hunk"]["reason"] == "line 4503 differs from the hunk"


def test_the_plan_joins_the_pending_calls_intent_in_one_transaction(tmp_path):
    """apply_file_patch records its plan with StateStore.add_call_intent: the members it names
    are set (a result recorded before is replaced, not merged), the call's own are kept, and
    only a pending call takes it."""
    import json

    from sandbox_supervisor.daemon.runtime.tool import result_body
    from sandbox_supervisor.daemon.state.store import StateStore, StoreError

    intent = {"parameters": {"path": "f.txt"}, "cwd": "/w", "allowed_paths": None, "result": {"stale": 1}}
    planned = {"path": "f.txt", "old_sha": "a" * 40, "new_sha": "b" * 40, "hunks": 1, "bytes": 3}
    with StateStore.open(tmp_path / "state") as store:
        key = owner_key("k")
        store.begin_call(key=key, tool_name="apply_file_patch", digest="d", call_id="c-1", intent_json=json.dumps(intent))
        store.add_call_intent(key, {"target": "/w/f.txt", "result": planned})
        recorded = json.loads(store.call_record(key).intent_json)
        assert recorded == {**intent, "target": "/w/f.txt", "result": planned}
        with pytest.raises(ValueError):
            store.add_call_intent(key, {"not a name": 1})
        call_id = "7bc11259-f6ff-47e1-b5bc-02ddbe8c902a"
        store.complete_call(key, result_body(call_id, "k", "apply_file_patch", result=planned))
        with pytest.raises(StoreError):
            store.add_call_intent(key, {"target": "/w/f.txt"})
        with pytest.raises(StoreError):
            store.add_call_intent(owner_key("never-claimed"), {"target": "/w/f.txt"})
