"""The jail's descriptor walk (supervisor/runtime/paths.py, docs/protocol.md §7.2): symlinks
followed by hand from agent.cwd's opened directory, and the file tools' writes made through
the walk's descriptors, so a swap between the check and the use changes nothing outside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox_supervisor.protocol.errors import INTERNAL, INVALID_PARAMETERS, NOT_FOUND, PATH_OUTSIDE_WORKSPACE
from sandbox_supervisor.protocol.tools import ApplyFilePatchParams, ReadFileParams
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.files import read_file_result
from sandbox_supervisor.daemon.runtime.patch import ZERO_SHA, commit_patch, git_blob_sha, plan_patch
from sandbox_supervisor.daemon.runtime.paths import (
    MAX_SYMLINK_HOPS,
    READ_FLAGS,
    PathOutsideWorkspace,
    WorkspaceRoot,
    WorkspaceRoots,
    open_in_jail,
)

SECRET = b"outside secret\n"


@pytest.fixture
def tree(tmp_path) -> tuple[Path, Path]:
    """(agent.cwd, an outside directory holding `secret`)."""
    cwd = tmp_path / "ws" / "repo"
    (cwd / "src").mkdir(parents=True)
    (cwd / "src" / "a.py").write_bytes(b"a\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    return cwd, outside


@pytest.fixture
def root(tree):
    opened = WorkspaceRoot.open(str(tree[0]))
    yield opened
    opened.close()


def walk(root: WorkspaceRoot, relative: str, allowed=None) -> tuple[str, list[str]]:
    with open_in_jail(root, relative, allowed, READ_FLAGS) as jailed:
        return jailed.state, jailed.components


def refused(root: WorkspaceRoot, relative: str, allowed=None) -> None:
    with pytest.raises(PathOutsideWorkspace):
        walk(root, relative, allowed)


def test_a_plain_path_is_opened_with_its_real_components(root):
    with open_in_jail(root, "src/a.py", None, READ_FLAGS) as jailed:
        assert jailed.state == "open" and jailed.components == ["src", "a.py"]
        assert jailed.fd is not None and os.read(jailed.fd, 10) == b"a\n"


def test_relative_and_absolute_symlinks_inside_are_followed(root, tree):
    cwd, _ = tree
    (cwd / "rel").symlink_to("src/a.py")
    (cwd / "abs").symlink_to(cwd / "src" / "a.py")
    (cwd / "dirlink").symlink_to("src")
    assert walk(root, "rel") == ("open", ["src", "a.py"])
    assert walk(root, "abs") == ("open", ["src", "a.py"])
    assert walk(root, "dirlink/a.py") == ("open", ["src", "a.py"])
    assert walk(root, "dirlink/../src/a.py") == ("open", ["src", "a.py"])  # `..` of the target


def test_an_absolute_link_through_the_bound_alias_of_agent_cwd_is_inside(tree, tmp_path):
    cwd, _ = tree
    alias = tmp_path / "alias"
    alias.symlink_to(cwd)
    root = WorkspaceRoot.open(str(alias))
    try:
        (cwd / "via").symlink_to(alias / "src" / "a.py")
        assert walk(root, "via") == ("open", ["src", "a.py"])
        assert walk(root, str(alias / "src" / "a.py")) == ("open", ["src", "a.py"])
    finally:
        root.close()


def test_symlinks_and_dot_dot_that_lead_out_are_refused(root, tree):
    cwd, outside = tree
    (cwd / "out").symlink_to(outside / "secret")
    (cwd / "outdir").symlink_to(outside)
    (cwd / "up").symlink_to("../../outside/secret")
    (cwd / "slash").symlink_to("/")
    for relative in ("out", "outdir/secret", "up", "slash/etc/passwd", "..", "../x", str(outside / "secret")):
        refused(root, relative)
    # A dangling link out would create its target outside: refused as well.
    (cwd / "dangling").symlink_to(outside / "new")
    refused(root, "dangling")


def test_dot_dot_may_leave_and_reenter_agent_cwd_by_name(root, tree):
    cwd, _ = tree
    assert walk(root, f"../{cwd.name}/src/a.py") == ("open", ["src", "a.py"])
    refused(root, "../other/src/a.py")


def test_symlink_chains_are_bounded(root, tree):
    cwd, _ = tree
    (cwd / "l0").symlink_to("src/a.py")
    for index in range(1, MAX_SYMLINK_HOPS + 1):
        (cwd / f"l{index}").symlink_to(f"l{index - 1}")
    assert walk(root, f"l{MAX_SYMLINK_HOPS - 1}") == ("open", ["src", "a.py"])  # 40 hops
    with pytest.raises(ToolFailure) as caught:
        walk(root, f"l{MAX_SYMLINK_HOPS}")  # 41
    assert caught.value.code == INVALID_PARAMETERS
    (cwd / "loop").symlink_to("loop")
    with pytest.raises(ToolFailure) as caught:
        walk(root, "loop/x")
    assert caught.value.code == INVALID_PARAMETERS


def test_missing_components_are_a_tail_without_dot_dot(root, tree):
    cwd, _ = tree
    assert walk(root, "src/new/deep/f.py") == ("missing", ["src", "new", "deep", "f.py"])
    (cwd / "gen").symlink_to("src/generated/x.py")  # dangling: created where it points
    assert walk(root, "gen") == ("missing", ["src", "generated", "x.py"])
    refused(root, "src/new/../a.py")
    (cwd / "file").write_bytes(b"")
    assert walk(root, "file/x")[0] == "blocked"


def test_allowed_paths_compare_real_components(root, tree):
    cwd, _ = tree
    (cwd / "srcx").mkdir()
    (cwd / "alias").symlink_to("src")
    assert walk(root, "src/a.py", ["src"])[0] == "open"
    assert walk(root, "alias/a.py", ["src"])[0] == "open"  # a link into src is judged by src
    assert walk(root, "src/a.py", ["alias"])[0] == "open"  # an entry through a link too
    refused(root, "srcx/b", ["src"])
    refused(root, "src/a.py", [])


def test_agent_cwd_replaced_after_it_was_opened_is_never_followed(root, tree, tmp_path):
    """The root swap: agent.cwd renamed away and a symlink to / (or anywhere) put in its
    place. The jail keeps resolving in the directory it opened."""
    cwd, outside = tree
    moved = cwd.with_name("moved")
    cwd.rename(moved)
    cwd.symlink_to(outside)
    assert walk(root, "secret")[0] == "missing"  # not the outside file of that name
    assert walk(root, "src/a.py") == ("open", ["src", "a.py"])  # the opened directory's
    assert walk(root, str(cwd / "src" / "a.py")) == ("open", ["src", "a.py"])
    cwd.unlink()
    cwd.symlink_to("/")
    assert walk(root, "etc/passwd")[0] == "missing"


def test_a_root_reopened_outside_the_workspace_root_is_refused(tree, tmp_path):
    """At a restart the daemon has only the path: one swapped for a symlink out of the
    workspace root is refused rather than opened."""
    cwd, outside = tree
    roots = WorkspaceRoots(workspace_root=str(cwd.parent))
    assert roots.get(str(cwd)).real == str(cwd)
    roots.close()
    cwd.rename(cwd.with_name("moved"))
    cwd.symlink_to(outside)
    with pytest.raises(PathOutsideWorkspace):
        WorkspaceRoots(workspace_root=str(cwd.parent)).get(str(cwd))
    with pytest.raises(ToolFailure) as caught:
        WorkspaceRoots().get(str(tmp_path / "gone"))
    assert caught.value.code == NOT_FOUND


def test_read_file_through_the_walk_never_follows_a_final_symlink_out(root, tree):
    cwd, outside = tree
    (cwd / "src" / "f").symlink_to(outside / "secret")
    params = ReadFileParams(path="src/f")
    with pytest.raises(ToolFailure) as caught:
        read_file_result(lambda: open_in_jail(root, "src/f", None, READ_FLAGS), "src/f", params)
    assert caught.value.code == PATH_OUTSIDE_WORKSPACE


def create_params(path: str, text: bytes) -> ApplyFilePatchParams:
    diff = f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+{text.decode().rstrip()}\n"
    return ApplyFilePatchParams(path=path, diff=diff, base_sha=ZERO_SHA)


def test_a_directory_swapped_for_a_symlink_after_the_plan_is_not_written_through(root, tree):
    """Deterministic form of the patch race: the plan saw `d` missing, then the agent put a
    symlink to outside there before the commit. mkdir -p meets the link: refused."""
    cwd, outside = tree
    with open_in_jail(root, "d/f", None, READ_FLAGS) as jailed:
        plan = plan_patch(jailed, "d/f", create_params("d/f", b"x\n"))
        (cwd / "d").symlink_to(outside)
        with pytest.raises(ToolFailure) as caught:
            commit_patch(plan)
    assert caught.value.code == INVALID_PARAMETERS
    assert sorted(os.listdir(outside)) == ["secret"]


def test_a_parent_swapped_after_the_walk_keeps_the_write_in_the_judged_directory(root, tree):
    """The walk holds `src` open: renaming it away and linking `src` to outside between the
    plan and the commit leaves the write in the directory that was judged."""
    cwd, outside = tree
    old = b"a\n"
    diff = "--- a/src/a.py\n+++ b/src/a.py\n@@ -1 +1 @@\n-a\n+b\n"
    params = ApplyFilePatchParams(path="src/a.py", diff=diff, base_sha=git_blob_sha(old))
    (outside / "a.py").write_bytes(old)  # same content: the sha check cannot tell them apart
    with open_in_jail(root, "src/a.py", None, READ_FLAGS) as jailed:
        plan = plan_patch(jailed, "src/a.py", params)
        (cwd / "src").rename(cwd / "src-moved")
        (cwd / "src").symlink_to(outside)
        commit_patch(plan)
    assert (outside / "a.py").read_bytes() == old
    assert (cwd / "src-moved" / "a.py").read_bytes() == b"b\n"
    assert sorted(os.listdir(outside)) == ["a.py", "secret"]


def test_a_file_swapped_for_a_symlink_after_the_plan_is_refused(root, tree):
    cwd, outside = tree
    old = b"a\n"
    diff = "--- a/src/a.py\n+++ b/src/a.py\n@@ -1 +1 @@\n-a\n+b\n"
    params = ApplyFilePatchParams(path="src/a.py", diff=diff, base_sha=git_blob_sha(old))
    (outside / "a.py").write_bytes(old)
    with open_in_jail(root, "src/a.py", None, READ_FLAGS) as jailed:
        plan = plan_patch(jailed, "src/a.py", params)
        (cwd / "src" / "a.py").unlink()
        (cwd / "src" / "a.py").symlink_to(outside / "a.py")
        with pytest.raises(ToolFailure) as caught:
            commit_patch(plan)
    assert caught.value.code == INTERNAL
    assert (outside / "a.py").read_bytes() == old
    assert os.readlink(cwd / "src" / "a.py") == str(outside / "a.py")
