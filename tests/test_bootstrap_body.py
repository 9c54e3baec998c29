"""The session.bootstrap body and its path rules (docs/protocol.md §5.3, §6.3)."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sandbox_supervisor.protocol.bootstrap import (
    MAX_ENV_ENTRIES,
    MAX_REPOSITORIES,
    NORMALISED_ABSOLUTE_PATTERN,
    BootstrapBody,
    bootstrap_digest,
    is_normalised_absolute,
    is_within,
)


def body(
    cwd: str = "/work",
    roots: list[str] | None = None,
    env: dict[str, str] | None = None,
    profile: str = "default",
    **extra: Any,
) -> dict[str, Any]:
    agent: dict[str, Any] = {"cwd": cwd, "profile": profile}
    if env is not None:
        agent["env"] = env
    repositories = [{"name": f"r{i}", "root": root} for i, root in enumerate(roots or [])]
    return {"sessionId": "s-1", "agent": agent, "repositories": repositories, **extra}


def valid(document: dict[str, Any]) -> BootstrapBody:
    return BootstrapBody.model_validate(document)


def invalid(document: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        BootstrapBody.model_validate(document)


def test_minimal_body_fills_defaults() -> None:
    parsed = valid({"sessionId": "s-1", "agent": {"cwd": "/", "profile": "p"}, "repositories": []})
    assert parsed.repositories == []
    assert parsed.agent.env is None


def test_repositories_is_required_as_in_the_seed_schema() -> None:
    # The seed's closed schema requires the field; `[]` is how a client says "none".
    invalid({"sessionId": "s-1", "agent": {"cwd": "/", "profile": "p"}})
    assert "repositories" in BootstrapBody.model_json_schema()["required"]


@pytest.mark.parametrize(
    "cwd",
    [
        "work",
        "./work",
        "",
        "/work/",
        "/work/../etc",
        "/work/./x",
        "//work",
        "/work//x",
        "/a\x00b",
        "/..",
    ],
)
def test_cwd_must_be_absolute_and_normalised(cwd: str) -> None:
    invalid(body(cwd=cwd))


@pytest.mark.parametrize("cwd", ["/", "/work", "/work/a b/ünïcode", "/...", "/.hidden"])
def test_normalised_absolute_cwds_are_accepted(cwd: str) -> None:
    assert valid(body(cwd=cwd)).agent.cwd == cwd


def test_cwd_longer_than_path_max_is_refused() -> None:
    invalid(body(cwd="/" + "a" * 4096))


@pytest.mark.parametrize(
    ("cwd", "root"),
    [
        ("/work", "/work"),
        ("/work", "/work/app"),
        ("/work", "/work/a/b/c"),
        ("/", "/anything/at/all"),
    ],
)
def test_roots_equal_to_or_under_cwd_are_accepted(cwd: str, root: str) -> None:
    assert valid(body(cwd=cwd, roots=[root])).repositories[0].root == root


@pytest.mark.parametrize(
    ("cwd", "root"),
    [
        ("/a/b", "/a/bc"),  # a prefix by text, not by component
        ("/a/b", "/a"),
        ("/work", "/etc"),
        ("/work", "/work/../etc"),
        ("/work", "work/app"),
        ("/work", "/work/app/"),
    ],
)
def test_roots_outside_cwd_or_unnormalised_are_refused(cwd: str, root: str) -> None:
    invalid(body(cwd=cwd, roots=[root]))


def test_one_bad_root_among_good_ones_refuses_the_body() -> None:
    invalid(body(roots=["/work/a", "/work/b", "/elsewhere"]))


@pytest.mark.parametrize("profile", ["", "Default", "1abc", "-a", "a_b", "a" * 65, "a b"])
def test_bad_profiles_are_refused(profile: str) -> None:
    invalid(body(profile=profile))


@pytest.mark.parametrize("profile", ["a", "default", "a.b-c9", "a" * 64])
def test_good_profiles_are_accepted(profile: str) -> None:
    assert valid(body(profile=profile)).agent.profile == profile


@pytest.mark.parametrize("name", ["path", "1ABC", "A-B", "A B", "", "É"])
def test_env_names_must_be_upper_snake(name: str) -> None:
    invalid(body(env={name: "x"}))


@pytest.mark.parametrize("name", ["PATH", "_X", "A1_B2", "_"])
def test_good_env_names_are_accepted(name: str) -> None:
    assert valid(body(env={name: "v"})).agent.env == {name: "v"}


def test_env_values_may_not_contain_nul() -> None:
    invalid(body(env={"X": "a\x00b"}))


def test_env_entry_count_is_capped() -> None:
    entries = {f"V{i}": "x" for i in range(MAX_ENV_ENTRIES)}
    assert len(valid(body(env=entries)).agent.env or {}) == MAX_ENV_ENTRIES
    invalid(body(env=entries | {"ONE_MORE": "x"}))


def test_repository_count_is_capped() -> None:
    roots = [f"/work/r{i}" for i in range(MAX_REPOSITORIES)]
    assert len(valid(body(roots=roots)).repositories) == MAX_REPOSITORIES
    invalid(body(roots=[*roots, "/work/extra"]))


@pytest.mark.parametrize("name", ["", "a/b", "a b", "x" * 129, "ü"])
def test_bad_repository_names_are_refused(name: str) -> None:
    document = body(roots=["/work/a"])
    document["repositories"][0]["name"] = name
    invalid(document)


@pytest.mark.parametrize("where", ["body", "agent", "repository"])
def test_unknown_fields_are_refused(where: str) -> None:
    document = body(roots=["/work/a"])
    target = {
        "body": document,
        "agent": document["agent"],
        "repository": document["repositories"][0],
    }[where]
    target["unknown"] = 1
    invalid(document)


def test_session_id_follows_the_id_rules() -> None:
    invalid(body() | {"sessionId": "has space"})
    invalid(body() | {"sessionId": "x" * 129})


# ------------------------------- digest -------------------------------


def test_digest_is_sha256_of_the_documented_canonical_form() -> None:
    parsed = valid({"agent": {"profile": "default", "cwd": "/wörk"}, "sessionId": "s-1", "repositories": []})
    canonical = '{"agent":{"cwd":"/wörk","profile":"default"},"repositories":[],"sessionId":"s-1"}'
    assert bootstrap_digest(parsed) == hashlib.sha256(canonical.encode()).hexdigest()


def test_digest_of_a_full_body_is_stable_across_releases() -> None:
    # Digests are persisted with the binding: if this value changes, a supervisor upgraded
    # in place would reject its own client's reconnect as a different bootstrap.
    parsed = valid(body(env={"CI": "1", "LANG": "C.UTF-8"}, roots=["/work/app", "/work/lib"]))
    assert bootstrap_digest(parsed) == (
        "4c9d42f1a6004f6b254f6e387ead840088e87b0b208d056d8076ec6b1cdb84b4"
    )


def test_digest_ignores_key_order_and_whitespace() -> None:
    one = valid(
        json.loads('{"sessionId":"s-1","agent":{"cwd":"/w","profile":"p","env":{"A":"1","B":"2"}},"repositories":[]}')
    )
    two = valid(
        json.loads(
            '{ "agent": {"env": {"B": "2", "A": "1"}, "profile": "p", "cwd": "/w"},'
            ' "repositories": [], "sessionId": "s-1" }'
        )
    )
    assert bootstrap_digest(one) == bootstrap_digest(two)


def test_absent_and_null_env_digest_alike() -> None:
    bare = valid({"sessionId": "s-1", "agent": {"cwd": "/w", "profile": "p"}, "repositories": []})
    explicit = valid(
        {
            "sessionId": "s-1",
            "agent": {"cwd": "/w", "profile": "p", "env": None},
            "repositories": [],
        }
    )
    assert bootstrap_digest(bare) == bootstrap_digest(explicit)


@pytest.mark.parametrize(
    "change",
    [
        {"profile": "other"},
        {"env": {"CI": "0"}},
        {"env": None},
        {"roots": ["/work/lib", "/work/app"]},  # repository order is part of the request
        {"roots": ["/work/app"]},
        {"cwd": "/work/app", "roots": ["/work/app", "/work/app/lib"]},
    ],
)
def test_digest_changes_with_the_content(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {"env": {"CI": "1"}, "roots": ["/work/app", "/work/lib"]}
    assert bootstrap_digest(valid(body(**base))) != bootstrap_digest(valid(body(**base | change)))


# ------------------------------- path helpers -------------------------------


def test_is_within_uses_whole_components() -> None:
    assert is_within("/a/b", "/a/b")
    assert is_within("/a/b/c", "/a/b")
    assert not is_within("/a/bc", "/a/b")
    assert is_within("/x", "/")
    assert not is_within("/a", "/a/b")


_segments = st.sampled_from(["a", "b", ".", "..", "", "...", ".x", "é", "a\x00"])


@settings(max_examples=600, deadline=None)
@given(st.lists(_segments, max_size=5), st.booleans(), st.booleans())
def test_pattern_and_function_agree_on_normalised_absolute_paths(
    segments: list[str], leading: bool, trailing: bool
) -> None:
    path = ("/" if leading else "") + "/".join(segments) + ("/" if trailing else "")
    expected = is_normalised_absolute(path)
    # The exported pattern is ECMA-262, where "$" is only the end of input; Python's "$" also
    # matches before a trailing newline, so translate it for this comparison.
    pattern = re.compile(NORMALISED_ABSOLUTE_PATTERN.replace("$", r"\Z"))
    assert (pattern.fullmatch(path) is not None) == expected
    if expected:
        assert posixpath.normpath(path) == path and path.startswith("/")
