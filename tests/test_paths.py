"""The workspace jail (docs/protocol.md §7.2): real paths inside agent.cwd and allowed_paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_supervisor.protocol.errors import INVALID_PARAMETERS, PATH_OUTSIDE_WORKSPACE
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.paths import (
    PathOutsideWorkspace,
    resolve_in_jail,
)
from sandbox_supervisor.testing.fuzzing import fuzz_settings


@pytest.fixture
def workspace(tmp_path) -> Path:
    """tmp/root/{repo (= agent.cwd), other, outside.txt}, with repo/src/a.py and repo/srcx/b.py."""
    root = tmp_path / "root"
    cwd = root / "repo"
    (cwd / "src").mkdir(parents=True)
    (cwd / "srcx").mkdir()
    (cwd / "src" / "a.py").write_text("a\n")
    (cwd / "srcx" / "b.py").write_text("b\n")
    (cwd / "README").write_text("r\n")
    (root / "other").mkdir()
    (root / "other" / "secret.txt").write_text("s\n")
    (tmp_path / "outside.txt").write_text("o\n")
    return cwd


def real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def refused(cwd: Path, relative: str, allowed=None) -> PathOutsideWorkspace:
    with pytest.raises(PathOutsideWorkspace) as caught:
        resolve_in_jail(str(cwd), relative, allowed)
    assert caught.value.code == PATH_OUTSIDE_WORKSPACE
    assert isinstance(caught.value, ToolFailure)
    return caught.value


def test_a_relative_path_resolves_inside_cwd(workspace):
    assert resolve_in_jail(str(workspace), "src/a.py", None) == real(workspace / "src" / "a.py")


def test_a_new_file_resolves_to_where_it_will_be_created(workspace):
    assert resolve_in_jail(str(workspace), "src/new/deep/f.py", None) == real(
        workspace / "src" / "new" / "deep" / "f.py"
    )


def test_dot_dot_that_stays_inside_is_fine(workspace):
    assert resolve_in_jail(str(workspace), "src/../README", None) == real(workspace / "README")


@pytest.mark.parametrize(
    "relative", ["..", "../other/secret.txt", "src/../../other/x", "../../outside.txt"]
)
def test_dot_dot_out_of_cwd_is_refused(workspace, relative):
    # "../other/…" stays in the workspace root but leaves agent.cwd: still refused.
    refused(workspace, relative)


def test_dot_dot_after_a_missing_directory_is_refused(workspace):
    # The kernel cannot walk ".." out of a directory that does not exist; neither do we.
    refused(workspace, "missing/../README")


def test_an_absolute_path_outside_is_refused(workspace, tmp_path):
    refused(workspace, str(tmp_path / "outside.txt"))
    refused(workspace, "/etc/passwd")


def test_an_absolute_path_inside_cwd_is_accepted(workspace):
    inside = str(workspace / "src" / "a.py")
    assert resolve_in_jail(str(workspace), inside, None) == real(workspace / "src" / "a.py")


def test_a_symlink_pointing_out_is_refused(workspace, tmp_path):
    (workspace / "link.txt").symlink_to(tmp_path / "outside.txt")
    refused(workspace, "link.txt")


def test_a_dangling_symlink_pointing_out_is_refused(workspace, tmp_path):
    (workspace / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    refused(workspace, "dangling")


def test_a_symlink_pointing_inside_resolves_to_its_target(workspace):
    (workspace / "alias.py").symlink_to(workspace / "src" / "a.py")
    assert resolve_in_jail(str(workspace), "alias.py", None) == real(workspace / "src" / "a.py")


def test_a_symlinked_parent_pointing_out_is_refused(workspace):
    (workspace / "linkdir").symlink_to(workspace.parent / "other")
    refused(workspace, "linkdir/secret.txt")


def test_a_new_file_whose_parent_is_a_symlink_out_is_refused(workspace):
    (workspace / "linkdir").symlink_to(workspace.parent / "other")
    refused(workspace, "linkdir/new.txt")
    refused(workspace, "linkdir/newdir/new.txt")
    assert not (workspace.parent / "other" / "new.txt").exists()


def test_a_symlinked_cwd_is_judged_by_its_real_path(workspace, tmp_path):
    alias = tmp_path / "cwd-alias"
    alias.symlink_to(workspace)
    assert resolve_in_jail(str(alias), "src/a.py", None) == real(workspace / "src" / "a.py")
    refused(alias, "../other/secret.txt")


def test_cwd_itself_is_inside_the_jail(workspace):
    # Returned (the shell tool runs there); the file tools refuse it as a directory.
    assert resolve_in_jail(str(workspace), ".", None) == real(workspace)
    assert resolve_in_jail(str(workspace), "src/..", None) == real(workspace)


def test_allowed_paths_admit_whole_components_only(workspace):
    allowed = ["src"]
    assert resolve_in_jail(str(workspace), "src/a.py", allowed) == real(workspace / "src" / "a.py")
    assert resolve_in_jail(str(workspace), "src", allowed) == real(workspace / "src")
    refused(workspace, "srcx/b.py", allowed)
    refused(workspace, "srcx", allowed)
    refused(workspace, "README", allowed)
    refused(workspace, ".", allowed)


def test_a_new_file_under_an_allowed_directory_is_fine(workspace):
    expected = real(workspace / "src") / "pkg" / "new.py"
    assert resolve_in_jail(str(workspace), "src/pkg/new.py", ["docs", "src"]) == expected


def test_allowed_paths_may_name_a_file_or_a_nested_directory(workspace):
    assert resolve_in_jail(str(workspace), "README", ["README"]) == real(workspace / "README")
    assert resolve_in_jail(str(workspace), "src/a.py", ["src/a.py"]) == real(workspace / "src/a.py")
    refused(workspace, "src/a.pyc", ["src/a.py"])


def test_none_admits_all_of_cwd_and_an_empty_list_admits_nothing(workspace):
    assert resolve_in_jail(str(workspace), "srcx/b.py", None) == real(workspace / "srcx" / "b.py")
    refused(workspace, "src/a.py", [])


def test_an_allowed_path_cannot_widen_the_jail(workspace):
    refused(workspace, "../other/secret.txt", ["../other"])


def test_a_symlink_from_an_allowed_directory_to_another_is_refused(workspace):
    (workspace / "src" / "to-srcx").symlink_to(workspace / "srcx" / "b.py")
    refused(workspace, "src/to-srcx", ["src"])


@pytest.mark.parametrize("relative", ["", "src/\x00a.py"])
def test_an_empty_path_or_a_nul_byte_is_invalid(workspace, relative):
    with pytest.raises(ToolFailure) as caught:
        resolve_in_jail(str(workspace), relative, None)
    assert caught.value.code == INVALID_PARAMETERS


def test_a_symlink_loop_is_invalid(workspace):
    (workspace / "loop1").symlink_to(workspace / "loop2")
    (workspace / "loop2").symlink_to(workspace / "loop1")
    with pytest.raises(ToolFailure) as caught:
        resolve_in_jail(str(workspace), "loop1/x", None)
    assert caught.value.code == INVALID_PARAMETERS and "loop" in caught.value.message


def test_the_error_object_validates_as_a_tool_error(workspace):
    from sandbox_supervisor.protocol.frames import ToolError

    failure = refused(workspace, "../x")
    error = ToolError.model_validate(failure.to_error())
    assert error.code == PATH_OUTSIDE_WORKSPACE and error.message == failure.message


# --- the kernel's resolution agrees with the portable walk ----------------------------------

NAMES = ["a", "b", "c", "..", "."]


def _random_tree(root: Path, draw) -> None:
    """Directories, files and symlinks (relative, absolute, dangling, looping) under root."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "c").mkdir()
    (root / "a" / "f").write_text("f")
    for index in range(draw(st.integers(0, 6))):
        where = root / draw(st.sampled_from(["", "a", "a/b", "c"]))
        target = draw(
            st.one_of(
                st.lists(st.sampled_from(NAMES + ["f", "l0", "l1", "missing"]), min_size=1, max_size=4).map(
                    lambda parts: os.path.join(*parts)
                ),
                st.sampled_from([str(root / "a"), str(root / "a" / "f"), "/", str(root / "nowhere")]),
            )
        )
        link = where / f"l{index}"
        if not os.path.lexists(link):
            link.symlink_to(target)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_descriptor_walk_matches_realpath_wherever_both_answer(tmp_path_factory, data):
    """The walk follows symlinks by hand; wherever the path exists and realpath keeps it
    inside agent.cwd, both name the same file, and the walk never names another one."""
    root = tmp_path_factory.mktemp("tree")
    _random_tree(root, data.draw)
    parts = data.draw(st.lists(st.sampled_from(NAMES + ["f", "l0", "l1", "l2", "l3", "missing"]), min_size=1, max_size=5))
    relative = os.path.join(*parts)
    path = os.path.join(str(root), relative)
    try:
        expected = os.path.realpath(path, strict=True)
    except OSError:
        expected = None  # missing, dangling, a loop, a file used as a directory
    real_root = os.path.realpath(root)
    try:
        walked = str(resolve_in_jail(str(root), relative, None))
    except ToolFailure:
        walked = None
    if expected is not None and os.path.exists(path) and (expected == real_root or expected.startswith(real_root + os.sep)):
        # realpath is lexical on `file/..`, which the kernel (and the walk) refuse.
        if walked is not None and os.path.isdir(os.path.dirname(expected) or "/"):
            assert walked == expected
    if walked is not None and os.path.exists(walked) and expected is not None:
        assert walked == expected


@pytest.mark.fuzz
@fuzz_settings(300)
@given(
    relative=st.lists(st.sampled_from(NAMES + ["f", "l0", "l1", "missing", "", "/", "//", "\x00", "é", "n" * 300]), max_size=6).map("/".join)
    | st.text(max_size=60),
    allowed=st.none() | st.lists(st.sampled_from(["a", "a/b", "c", "..", "", "l0"]), max_size=3),
)
def test_arbitrary_paths_resolve_inside_or_raise_a_typed_failure(tmp_path_factory, relative, allowed):
    """Any text an agent sends as a path: a real path inside agent.cwd (and an allowed path),
    or a ToolFailure with a code of the protocol — never another exception."""
    root = tmp_path_factory.mktemp("jail")
    (root / "a" / "b").mkdir(parents=True)
    (root / "c").mkdir()
    (root / "a" / "f").write_text("f")
    (root / "l0").symlink_to("a")
    (root / "l1").symlink_to("/")
    try:
        resolved = resolve_in_jail(str(root), relative, allowed)
    except ToolFailure as failure:
        assert failure.code in {INVALID_PARAMETERS, PATH_OUTSIDE_WORKSPACE, "not_found"}
    else:
        real_root = os.path.realpath(root)
        assert str(resolved) == real_root or str(resolved).startswith(real_root + os.sep)


@pytest.mark.parametrize(
    "relative", ["src/a.py", "src", ".", "src/../README", "link/a.py", "missing/deeper/x", "README/under", "/", "/src/a.py"]
)
def test_real_text_is_the_real_path_as_pathlib_writes_it(workspace, relative):
    """read_file's view path is joined without pathlib; it must be the string Path makes of
    the same walk, open, missing or blocked, below agent.cwd and at "/"."""
    from sandbox_supervisor.daemon.runtime.paths import READ_FLAGS, WorkspaceRoot, open_in_jail

    (workspace / "link").symlink_to("src")
    # A leading "/" here: agent.cwd is "/" itself, and the rest is walked from there.
    at_root = relative.startswith("/")
    root = WorkspaceRoot.open("/" if at_root else str(workspace))
    if at_root:
        relative = os.path.realpath(workspace).lstrip("/") + relative if relative != "/" else "."
    try:
        with open_in_jail(root, relative, None, READ_FLAGS) as jailed:
            assert jailed.real_text == str(Path(root.real, *jailed.components))
            assert jailed.real_path == Path(root.real, *jailed.components)
    finally:
        root.close()
