"""The control-authority assertion matrix and JWKS loading (docs/protocol.md §3).

Tokens come from testing.authority, which signs with `cryptography` directly, so these tests
do not share code with the verifier's JOSE library.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_supervisor.protocol.authority import (
    KeySet,
    SCOPES,
    AssertionClaims,
    AuthorityError,
    JwksError,
    VerifierSettings,
    load_jwks,
    verify_assertion,
)
from sandbox_supervisor.protocol.headers import RoutingHeaders
from sandbox_supervisor.testing.authority import (
    OMIT,
    LoopbackAuthority,
    combine_jwks,
    forge_alg_none,
    forge_der_signature,
    forge_es384,
    forge_hs256_with_public_key,
    forge_rs256,
    forge_with_other_key,
    strip_kid,
    tamper_payload,
)
from sandbox_supervisor.testing.fuzzing import fuzz_settings

NOW = 1_700_000_000
LEEWAY = 30
MAX_LIFETIME = 300
HEADERS = RoutingHeaders(
    sandbox_id="sbx-1",
    session_id="session-1",
    session_sandbox_id="record-1",
    attempt_id="attempt-1",
    generation=4,
    event_ack=17,
    authority=None,
)


@pytest.fixture(scope="module")
def authority() -> LoopbackAuthority:
    return LoopbackAuthority()


@pytest.fixture(scope="module")
def keys(authority: LoopbackAuthority) -> KeySet:
    return load_jwks(json.dumps(authority.jwks()))


@pytest.fixture(scope="module")
def verifier_settings(authority: LoopbackAuthority) -> VerifierSettings:
    return VerifierSettings(issuer=authority.issuer, leeway_s=LEEWAY, max_lifetime_s=MAX_LIFETIME)


def claims(authority: LoopbackAuthority, **overrides: Any) -> dict[str, Any]:
    """Claims matching HEADERS at NOW; any claim (or claims_for argument) may be overridden."""
    arguments: dict[str, Any] = {
        "sandbox_id": HEADERS.sandbox_id,
        "session_id": HEADERS.session_id,
        "session_sandbox_id": HEADERS.session_sandbox_id,
        "generation": HEADERS.generation,
        "attempt_id": HEADERS.attempt_id,
        "ack_floor": HEADERS.event_ack,
        "now": NOW,
    }
    for name in [*arguments, "scope", "lifetime_s"]:
        if name in overrides:
            arguments[name] = overrides.pop(name)
    return authority.claims_for(**arguments, **overrides)


@pytest.fixture
def verify(keys: KeySet, verifier_settings: VerifierSettings) -> Any:
    def run(token: str, now: float = NOW) -> AssertionClaims:
        return verify_assertion(token, keys, verifier_settings, HEADERS, now)

    return run


@pytest.fixture
def rejects(verify: Any) -> Any:
    def run(token: str, reason: str, now: float = NOW) -> None:
        with pytest.raises(AuthorityError) as caught:
            verify(token, now)
        assert caught.value.reason == reason
        # Logs get the reason; the bearer token itself must never end up in them.
        if len(token) > 16:  # (a one-letter "token" is in any text)
            assert token not in str(caught.value) and token not in repr(caught.value.args)
        # Nor in a chained exception (pydantic errors carry the claims they refused).
        error = caught.value
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)

    return run


def test_a_valid_assertion_is_accepted_and_returned(
    authority: LoopbackAuthority, verify: Any
) -> None:
    minted = claims(authority, allowed_paths=["src"], allowed_commands=["pytest"])
    verified = verify(authority.mint(minted))
    assert verified.jti == minted["jti"]
    assert verified.exp == NOW + 120
    assert verified.scopes == frozenset(SCOPES)
    assert verified.allowed_paths == ["src"] and verified.allowed_commands == ["pytest"]


def test_typ_may_be_absent(authority: LoopbackAuthority, verify: Any) -> None:
    assert verify(authority.mint(claims(authority), header_overrides={"typ": OMIT})).iat == NOW


# ------------------------------- algorithm and key pinning -------------------------------


def test_alg_none_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(forge_alg_none(claims(authority), kid=authority.kid), "alg_not_allowed")


def test_hs256_keyed_with_the_public_key_is_refused(
    authority: LoopbackAuthority, rejects: Any
) -> None:
    rejects(forge_hs256_with_public_key(authority, claims(authority)), "alg_not_allowed")


def test_es384_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(forge_es384(claims(authority), kid=authority.kid), "alg_not_allowed")


def test_rs256_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(forge_rs256(claims(authority), kid=authority.kid), "alg_not_allowed")


@pytest.mark.parametrize("alg", ["es256", "ES256 ", None, 1, ["ES256"]])
def test_alg_must_be_exactly_es256(authority: LoopbackAuthority, rejects: Any, alg: Any) -> None:
    rejects(authority.mint(claims(authority), header_overrides={"alg": alg}), "alg_not_allowed")


def test_missing_kid_is_refused_even_with_a_single_key(
    authority: LoopbackAuthority, rejects: Any
) -> None:
    rejects(strip_kid(authority, claims(authority)), "missing_kid")


@pytest.mark.parametrize("kid", ["", 5, None])
def test_kid_must_be_a_non_empty_string(
    authority: LoopbackAuthority, rejects: Any, kid: Any
) -> None:
    rejects(authority.mint(claims(authority), header_overrides={"kid": kid}), "missing_kid")


def test_unknown_kid_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    stranger = LoopbackAuthority(kid="someone-else")
    rejects(stranger.mint(claims(authority)), "unknown_kid")


def test_a_key_nobody_trusts_under_a_trusted_kid_fails_the_signature(
    authority: LoopbackAuthority, rejects: Any
) -> None:
    rejects(forge_with_other_key(claims(authority), kid=authority.kid), "bad_signature")


def test_tampered_payload_fails_the_signature(authority: LoopbackAuthority, rejects: Any) -> None:
    token = authority.mint(claims(authority, scope="files:read"))
    rejects(tamper_payload(token, scope="files:read files:write shell:exec"), "bad_signature")


def test_der_encoded_signature_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(forge_der_signature(authority, claims(authority)), "bad_signature")


def test_truncated_signature_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    token = authority.mint(claims(authority))
    rejects(token[:-4], "bad_signature")


@pytest.mark.parametrize("typ", ["JOSE", "jwt", "at+jwt", None])
def test_typ_when_present_must_be_jwt(authority: LoopbackAuthority, rejects: Any, typ: Any) -> None:
    rejects(authority.mint(claims(authority), header_overrides={"typ": typ}), "bad_typ")


@pytest.mark.parametrize("param", ["jwk", "jku", "x5u", "x5c", "crit", "b64"])
def test_key_carrying_or_critical_header_params_are_refused(
    authority: LoopbackAuthority, rejects: Any, param: str
) -> None:
    value: Any = {"jwk": authority.public_jwk(), "crit": ["exp"], "b64": False}.get(param, "x")
    token = authority.mint(claims(authority), header_overrides={param: value})
    rejects(token, f"forbidden_header:{param}")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "header",
    [b"[]", b"not json", b'{"alg":"ES256","alg":"ES256","kid":"test-key-1"}', b"\xff", b"NaN"],
)
def test_malformed_protected_header_is_refused(
    authority: LoopbackAuthority, rejects: Any, header: bytes
) -> None:
    _, payload, signature = authority.mint(claims(authority)).split(".")
    rejects(f"{_b64(header)}.{payload}.{signature}", "malformed_header")


@pytest.mark.parametrize(
    "token",
    [
        *["a", "a.b", "a.b.c.d", "a..c", ".b.c", "a.b.c ", "Bearer a.b.c", "é.b.c"],
        "a.b." + "c" * 9000,  # over MAX_ASSERTION_CHARS
    ],
)
def test_malformed_tokens_are_refused(rejects: Any, token: str) -> None:
    rejects(token, "malformed_token")


def test_empty_token_is_refused(rejects: Any) -> None:
    rejects("", "missing_token")


# ------------------------------- claims -------------------------------


def test_expired_beyond_leeway_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    token = authority.mint(claims(authority))
    rejects(token, "expired", now=NOW + 120 + LEEWAY)


def test_expired_within_leeway_is_accepted(authority: LoopbackAuthority, verify: Any) -> None:
    token = authority.mint(claims(authority))
    assert verify(token, now=NOW + 120 + LEEWAY - 1).exp == NOW + 120


def test_iat_in_the_future_beyond_leeway_is_refused(
    authority: LoopbackAuthority, rejects: Any, verify: Any
) -> None:
    rejects(authority.mint(claims(authority)), "iat_in_future", now=NOW - LEEWAY - 1)
    assert verify(authority.mint(claims(authority)), now=NOW - LEEWAY).iat == NOW


def test_nbf_in_the_future_beyond_leeway_is_refused(
    authority: LoopbackAuthority, rejects: Any, verify: Any
) -> None:
    rejects(authority.mint(claims(authority, nbf=NOW + LEEWAY + 1)), "nbf_in_future")
    assert verify(authority.mint(claims(authority, nbf=NOW + LEEWAY))).nbf == NOW + LEEWAY


def test_lifetime_of_exactly_the_maximum_is_accepted(
    authority: LoopbackAuthority, verify: Any
) -> None:
    token = authority.mint(claims(authority, lifetime_s=MAX_LIFETIME))
    assert verify(token).exp - NOW == MAX_LIFETIME


def test_lifetime_over_the_maximum_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(authority.mint(claims(authority, lifetime_s=MAX_LIFETIME + 1)), "lifetime_too_long")


def test_exp_not_after_iat_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(authority.mint(claims(authority, exp=NOW)), "exp_not_after_iat")


def test_wrong_issuer_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(authority.mint(claims(authority, iss="https://evil.test")), "wrong_issuer")


def test_wrong_audience_is_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(authority.mint(claims(authority, aud="another-service")), "wrong_audience")


def test_audience_list_containing_ours_is_accepted(
    authority: LoopbackAuthority, verify: Any
) -> None:
    token = authority.mint(claims(authority, aud=["other", "sandbox-supervisor"]))
    assert verify(token).aud == ["other", "sandbox-supervisor"]


@pytest.mark.parametrize("aud", [["other"], []])
def test_audience_list_without_ours_is_refused(
    authority: LoopbackAuthority, rejects: Any, aud: list[str]
) -> None:
    rejects(authority.mint(claims(authority, aud=aud)), "wrong_audience")


BINDING_CLAIMS = {
    "sandbox_id": "sbx-2",
    "session_id": "session-2",
    "session_sandbox_id": "record-2",
    "connection_generation": 5,
    "connection_attempt_id": "attempt-2",
    "event_ack_floor": 16,
}


@pytest.mark.parametrize(("claim", "value"), sorted(BINDING_CLAIMS.items()))
def test_each_binding_claim_must_equal_its_header(
    authority: LoopbackAuthority, rejects: Any, claim: str, value: Any
) -> None:
    rejects(authority.mint(claims(authority, **{claim: value})), f"claim_mismatch:{claim}")


@pytest.mark.parametrize("claim", ["connection_generation", "event_ack_floor"])
@pytest.mark.parametrize("kind", ["string", "bool", "float"])
def test_binding_integers_must_be_json_integers(
    authority: LoopbackAuthority, rejects: Any, claim: str, kind: str
) -> None:
    right = getattr(HEADERS, "generation" if claim == "connection_generation" else "event_ack")
    value = {"string": str(right), "bool": True, "float": float(right)}[kind]
    rejects(authority.mint(claims(authority, **{claim: value})), f"invalid_claims:{claim}")


@pytest.mark.parametrize("claim", ["iat", "exp", "nbf"])
def test_times_must_be_json_integers(
    authority: LoopbackAuthority, rejects: Any, claim: str
) -> None:
    rejects(authority.mint(claims(authority, **{claim: NOW + 0.5})), f"invalid_claims:{claim}")


@pytest.mark.parametrize(
    "claim",
    ["iss", "aud", "iat", "exp", "jti", "scope", *sorted(BINDING_CLAIMS)],
)
def test_each_required_claim_is_required(
    authority: LoopbackAuthority, rejects: Any, claim: str
) -> None:
    rejects(authority.mint(claims(authority, **{claim: OMIT})), f"invalid_claims:{claim}")


@pytest.mark.parametrize("scope", ["files:read admin", "FILES:READ", "files:read\tshell:exec", 5])
def test_unknown_or_malformed_scope_is_refused(
    authority: LoopbackAuthority, rejects: Any, scope: Any
) -> None:
    rejects(authority.mint(claims(authority, scope=scope)), "invalid_claims:scope")


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        ("files:read", {"files:read"}),
        ("shell:exec  files:write", {"shell:exec", "files:write"}),
        ("", set()),
    ],
)
def test_scopes_are_split_on_spaces(
    authority: LoopbackAuthority, verify: Any, scope: str, expected: set[str]
) -> None:
    assert verify(authority.mint(claims(authority, scope=scope))).scopes == expected


def test_unknown_claims_are_refused(authority: LoopbackAuthority, rejects: Any) -> None:
    rejects(authority.mint(claims(authority, sub="someone")), "invalid_claims:sub")


@pytest.mark.parametrize("jti", ["", "j" * 129, 5])
def test_jti_is_1_to_128_characters(authority: LoopbackAuthority, rejects: Any, jti: Any) -> None:
    rejects(authority.mint(claims(authority, jti=jti)), "invalid_claims:jti")


@pytest.mark.parametrize(
    ("claim", "value"),
    [
        ("allowed_paths", ["/etc"]),
        ("allowed_paths", [""]),
        ("allowed_paths", "src"),
        ("allowed_commands", ["/bin/rm"]),
        ("allowed_commands", [""]),
    ],
)
def test_allowed_lists_are_checked(
    authority: LoopbackAuthority, rejects: Any, claim: str, value: Any
) -> None:
    rejects(authority.mint(claims(authority, **{claim: value})), f"invalid_claims:{claim}")


@pytest.mark.parametrize(
    "payload",
    [b"[]", b"not json", b'{"iss":"a","iss":"b"}', b"\xff\xfe", b'{"iat": NaN}'],
)
def test_malformed_payload_is_refused(
    authority: LoopbackAuthority, rejects: Any, payload: bytes
) -> None:
    rejects(authority.mint_payload(payload), "malformed_payload")


def test_key_rotation_accepts_both_keys(
    authority: LoopbackAuthority, verifier_settings: VerifierSettings
) -> None:
    successor = LoopbackAuthority(kid="test-key-2")
    rotating = load_jwks(json.dumps(combine_jwks(authority, successor)))
    for signer in (authority, successor):
        token = signer.mint(claims(authority))
        assert verify_assertion(token, rotating, verifier_settings, HEADERS, NOW).iss


@pytest.mark.fuzz
@fuzz_settings(300)
@given(
    st.text(max_size=300)
    | st.from_regex(
        r"[A-Za-z0-9_-]{0,40}\.[A-Za-z0-9_-]{0,40}\.[A-Za-z0-9_-]{0,90}", fullmatch=True
    )
)
def test_arbitrary_tokens_raise_only_authority_error(token: str) -> None:
    keys = load_jwks(json.dumps(LoopbackAuthority().jwks()))
    with pytest.raises(AuthorityError):
        verify_assertion(token, keys, VerifierSettings(issuer="x"), HEADERS, NOW)


@pytest.mark.fuzz
@fuzz_settings(300)
@given(
    header=st.dictionaries(
        st.sampled_from(["alg", "kid", "typ", "cty", "zip"]) | st.text(max_size=4),
        st.sampled_from(["ES256", "test-key-1", "JWT"])
        | st.integers()
        | st.none()
        | st.text(max_size=6),
        max_size=4,
    ),
    payload=st.binary(max_size=60),
)
def test_arbitrary_headers_and_payloads_raise_only_authority_error(
    authority: LoopbackAuthority,
    keys: KeySet,
    verifier_settings: VerifierSettings,
    header: dict[str, Any],
    payload: bytes,
) -> None:
    token = f"{_b64(json.dumps(header).encode())}.{_b64(payload) or 'e30'}.{_b64(b'x' * 64)}"
    with pytest.raises(AuthorityError):
        verify_assertion(token, keys, verifier_settings, HEADERS, NOW)


# ------------------------------- JWKS -------------------------------


def test_jwks_of_public_p256_keys_loads(authority: LoopbackAuthority) -> None:
    other = LoopbackAuthority(kid="k2")
    loaded = load_jwks(json.dumps(combine_jwks(authority, other)).encode())
    assert [key.kid for key in loaded] == [authority.kid, "k2"]
    assert all(isinstance(key.public_key, ec.EllipticCurvePublicKey) for key in loaded)


def test_jwks_written_to_a_file_loads(authority: LoopbackAuthority, tmp_path: Any) -> None:
    path = authority.write_jwks(tmp_path / "jwks.json")
    assert [key.kid for key in load_jwks(path.read_text())] == [authority.kid]


def test_optional_members_alg_and_use_may_be_absent(authority: LoopbackAuthority) -> None:
    jwk = {k: v for k, v in authority.public_jwk().items() if k not in {"alg", "use"}}
    assert [key.kid for key in load_jwks(json.dumps({"keys": [jwk]}))] == [authority.kid]


def refused_jwks(keys: list[Any]) -> JwksError:
    with pytest.raises(JwksError) as caught:
        load_jwks(json.dumps({"keys": keys}))
    return caught.value


def _rsa_jwk() -> dict[str, Any]:
    from cryptography.hazmat.primitives.asymmetric import rsa

    numbers = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key().public_numbers()
    )
    n = numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")
    return {"kty": "RSA", "n": _b64(n), "e": "AQAB", "kid": "rsa", "alg": "RS256", "use": "sig"}


def _p384_jwk() -> dict[str, Any]:
    from cryptography.hazmat.primitives.asymmetric import ec

    numbers = ec.generate_private_key(ec.SECP384R1()).public_key().public_numbers()
    return {
        "kty": "EC",
        "crv": "P-384",
        "x": _b64(numbers.x.to_bytes(48, "big")),
        "y": _b64(numbers.y.to_bytes(48, "big")),
        "kid": "p384",
    }


def test_a_private_key_refuses_the_whole_file(authority: LoopbackAuthority) -> None:
    good = LoopbackAuthority(kid="good").public_jwk()
    error = refused_jwks([good, authority.signing_jwk()])
    assert error.problems == ["keys[1]: carries private key material (d)"]


def test_an_rsa_key_refuses_the_whole_file(authority: LoopbackAuthority) -> None:
    error = refused_jwks([authority.public_jwk(), _rsa_jwk()])
    assert error.problems == ["keys[1]: kty must be EC"]


def test_a_p384_key_refuses_the_whole_file(authority: LoopbackAuthority) -> None:
    error = refused_jwks([authority.public_jwk(), _p384_jwk()])
    assert error.problems == ["keys[1]: crv must be P-256"]


def test_a_duplicate_kid_refuses_the_whole_file(authority: LoopbackAuthority) -> None:
    twin = LoopbackAuthority(kid=authority.kid)
    error = refused_jwks([authority.public_jwk(), twin.public_jwk()])
    assert error.problems == [f"duplicate kid {authority.kid}"]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"kid": OMIT}, "kid must be a string"),
        ({"kid": ""}, "kid must be a string"),
        ({"kid": 7}, "kid must be a string"),
        ({"alg": "ES384"}, "alg must be ES256"),
        ({"use": "enc"}, "use must be sig"),
        ({"key_ops": ["sign"]}, "key_ops must only allow verify"),
        ({"x5c": ["MII..."]}, "unknown members x5c"),
        ({"kty": "oct", "k": "c2VjcmV0"}, "private key material (k)"),
        ({"crv": "secp256k1"}, "crv must be P-256"),
        ({"x": "AAAA"}, "must be a point on P-256"),
        ({"y": OMIT}, "must be a point on P-256"),
    ],
)
def test_each_bad_key_member_is_reported(
    authority: LoopbackAuthority, change: dict[str, Any], problem: str
) -> None:
    jwk = authority.public_jwk()
    for name, value in change.items():
        if value is OMIT:
            jwk.pop(name)
        else:
            jwk[name] = value
    error = refused_jwks([jwk])
    assert any(problem in text for text in error.problems), error.problems


def test_a_point_off_the_curve_is_refused(authority: LoopbackAuthority) -> None:
    jwk = authority.public_jwk()
    y = int.from_bytes(base64.urlsafe_b64decode(jwk["y"] + "=="), "big")
    jwk["y"] = _b64(((y + 1) % 2**256).to_bytes(32, "big"))
    assert refused_jwks([jwk]).problems == ["keys[0]: x and y must be a point on P-256"]


def test_every_problem_is_listed(authority: LoopbackAuthority) -> None:
    error = refused_jwks([authority.signing_jwk(), _rsa_jwk(), authority.public_jwk()])
    assert error.problems == [
        "keys[0]: carries private key material (d)",
        "keys[1]: kty must be EC",
        f"duplicate kid {authority.kid}",
    ]


@pytest.mark.parametrize(
    "data",
    [
        "",
        "not json",
        "[]",
        '{"keys": {}}',
        '{"keys": []}',
        '{"nokeys": []}',
        b"\xff",
        '{"keys": [1]}',
    ],
)
def test_unusable_jwks_documents_are_refused(data: str | bytes) -> None:
    with pytest.raises(JwksError):
        load_jwks(data)
