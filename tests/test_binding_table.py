"""session.bootstrap's binding decision as a table, without a daemon (docs/protocol.md §5.2).

`decide_binding` is handed its two filesystem probes; here they read a fake tree (a set of
directories and a symlink map), so every rule, and the order of the rules, is one row. The
same refusals over a real socket and real directories are in tests/test_bootstrap.py.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

import pytest

from sandbox_supervisor.daemon.session.binding import BindAccepted, BindRejected, decide_binding
from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.bootstrap import BootstrapBody, bootstrap_digest

WORKSPACE = "/home/user"


@dataclass
class FakeTree:
    """Directories that exist, and symlinks (a path prefix resolving elsewhere)."""

    dirs: set[str] = field(default_factory=lambda: {WORKSPACE, WORKSPACE + "/app", WORKSPACE + "/app/lib"})
    links: dict[str, str] = field(default_factory=dict)
    probed: list[str] = field(default_factory=list)

    def realpath(self, path: str) -> str:
        self.probed.append(path)
        for link, target in self.links.items():
            if path == link or path.startswith(link + "/"):
                return posixpath.normpath(target + path[len(link):])
        return path

    def is_dir(self, path: str) -> bool:
        self.probed.append(path)
        return self.realpath(path) in self.dirs


def body(cwd: str = WORKSPACE + "/app", profile: str = "default", roots: tuple[str, ...] = ()) -> BootstrapBody:
    repositories = [{"name": f"r{i}", "root": root} for i, root in enumerate(roots)]
    data: dict[str, Any] = {"sessionId": "s-1", "agent": {"cwd": cwd, "profile": profile}, "repositories": repositories}
    return BootstrapBody.model_validate(data)


def decide(
    request: BootstrapBody,
    *,
    bound: str | None = None,
    tree: FakeTree | None = None,
    workspace: str = WORKSPACE,
    allowed: tuple[str, ...] = (),
) -> BindAccepted | BindRejected:
    tree = tree or FakeTree()
    return decide_binding(
        request,
        bootstrap_digest(request),
        bound,
        workspace_root=workspace,
        allowed_profiles=allowed,
        is_dir=tree.is_dir,
        realpath=tree.realpath,
    )


def code(decision: BindAccepted | BindRejected) -> str:
    return decision.code if isinstance(decision, BindRejected) else ("bound" if decision.newly_bound else "reattached")


# --- already bound: the digest alone decides ----------------------------------------------


def test_the_same_digest_reattaches_without_binding_again() -> None:
    request = body()
    decision = decide(request, bound=bootstrap_digest(request))
    assert decision == BindAccepted(bootstrap_digest(request), newly_bound=False)


def test_another_digest_is_a_binding_mismatch() -> None:
    decision = decide(body(profile="other"), bound=bootstrap_digest(body()))
    assert isinstance(decision, BindRejected) and decision.code == errors.BOOTSTRAP_MISMATCH


@pytest.mark.parametrize("same", [True, False], ids=["same-digest", "other-digest"])
def test_once_bound_the_filesystem_and_profiles_are_not_consulted(same: bool) -> None:
    """Re-attaching does not re-check a cwd that may since have gone; nor does a mismatch."""
    request = body(cwd="/elsewhere", profile="forbidden", roots=("/elsewhere/gone",))
    tree = FakeTree()
    decision = decide(request, bound=bootstrap_digest(request) if same else "0" * 64, tree=tree, allowed=("default",))
    assert code(decision) == ("reattached" if same else errors.BOOTSTRAP_MISMATCH)
    assert tree.probed == []


# --- not bound yet: cwd, then repository roots, then the profile --------------------------

UNBOUND_ROWS = [
    # cwd, roots, profile, allowed, tree changes, workspace, expected
    pytest.param(WORKSPACE + "/app", (), "default", (), {}, WORKSPACE, "bound", id="valid"),
    pytest.param(WORKSPACE, (), "default", (), {}, WORKSPACE, "bound", id="cwd-is-the-root"),
    pytest.param(WORKSPACE + "/app", (), "default", (), {}, WORKSPACE + "/", "bound", id="root-with-trailing-slash"),
    pytest.param(WORKSPACE + "/app", (), "default", (), {}, "/", "bound", id="root-is-slash"),
    pytest.param("/etc", (), "default", (), {"dirs": {"/etc"}}, WORKSPACE, errors.CWD_INVALID, id="cwd-outside"),
    pytest.param(WORKSPACE + "2", (), "default", (), {"dirs": {WORKSPACE + "2"}}, WORKSPACE, errors.CWD_INVALID, id="cwd-shares-a-prefix-only"),
    pytest.param(
        WORKSPACE + "/link", (), "default", (), {"dirs": {"/etc"}, "links": {WORKSPACE + "/link": "/etc"}},
        WORKSPACE, errors.CWD_INVALID, id="cwd-symlink-escapes",
    ),
    pytest.param(
        WORKSPACE + "/link", (), "default", (), {"links": {WORKSPACE + "/link": WORKSPACE + "/app"}},
        WORKSPACE, "bound", id="cwd-symlink-stays-inside",
    ),
    pytest.param(
        WORKSPACE + "/app", (), "default", (),
        {"dirs": {"/data/user/app"}, "links": {WORKSPACE: "/data/user"}},
        WORKSPACE, "bound", id="root-itself-a-symlink",
    ),
    pytest.param(WORKSPACE + "/missing", (), "default", (), {}, WORKSPACE, errors.CWD_INVALID, id="cwd-not-a-directory"),
    pytest.param(
        WORKSPACE + "/app", (WORKSPACE + "/app/lib", WORKSPACE + "/app/gone"), "default", (), {},
        WORKSPACE, errors.REPOSITORY_MISSING, id="repository-root-missing",
    ),
    pytest.param(
        WORKSPACE + "/app", (WORKSPACE + "/app", WORKSPACE + "/app/lib"), "default", (), {},
        WORKSPACE, "bound", id="repository-roots-exist",
    ),
    pytest.param(WORKSPACE + "/app", (), "forbidden", ("default", "ci"), {}, WORKSPACE, errors.PROFILE_NOT_ALLOWED, id="profile-not-allowed"),
    pytest.param(WORKSPACE + "/app", (), "ci", ("default", "ci"), {}, WORKSPACE, "bound", id="profile-allowed"),
    pytest.param(WORKSPACE + "/app", (), "anything", (), {}, WORKSPACE, "bound", id="empty-allowed-list-allows-any"),
    # Order: the cwd before the roots before the profile.
    pytest.param(
        "/etc", ("/etc/gone",), "forbidden", ("default",), {"dirs": {"/etc"}},
        WORKSPACE, errors.CWD_INVALID, id="cwd-before-roots-and-profile",
    ),
    pytest.param(
        WORKSPACE + "/app", (WORKSPACE + "/app/gone",), "forbidden", ("default",), {},
        WORKSPACE, errors.REPOSITORY_MISSING, id="roots-before-profile",
    ),
]


@pytest.mark.parametrize("cwd, roots, profile, allowed, changes, workspace, expected", UNBOUND_ROWS)
def test_unbound_decision(
    cwd: str, roots: tuple[str, ...], profile: str, allowed: tuple[str, ...], changes: dict[str, Any], workspace: str, expected: str
) -> None:
    tree = FakeTree()
    tree.dirs |= changes.get("dirs", set())
    tree.links.update(changes.get("links", {}))
    request = body(cwd=cwd, profile=profile, roots=roots)
    decision = decide(request, tree=tree, workspace=workspace, allowed=allowed)
    assert code(decision) == expected
    if isinstance(decision, BindAccepted):
        assert decision.digest == bootstrap_digest(request)


def test_a_missing_repository_is_named_in_the_message() -> None:
    decision = decide(body(roots=(WORKSPACE + "/app/lib", WORKSPACE + "/app/gone")))
    assert isinstance(decision, BindRejected) and "'r1'" in decision.message
