"""The control-authority assertion (docs/protocol.md §3): claims, JWKS loading, verification.

Pure: the caller reads the JWKS file, passes the clock (`now`) and keeps the jti replay cache
(the daemon's store does, durably). The verifier pins everything an attacker could choose:
we read the protected header ourselves, so the algorithm, the key id and the absence of
key-carrying header parameters are decided here, not guessed. With all of that decided, what
is left of JWS (RFC 7515) for a compact ES256 token is one ECDSA P-256/SHA-256 check of the
raw r||s signature over `header.payload`, which `cryptography` does directly: no JOSE library
is loaded (one cost 2 MiB of the daemon's resident memory and ~40 µs per upgrade for work the
checks here already do).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from pydantic import Field, StringConstraints, ValidationError, field_validator

from sandbox_supervisor.protocol.fields import MAX_PATH_CHARS, Scope, StrictModel
from sandbox_supervisor.protocol.headers import RoutingHeaders

__all__ = [
    "DEFAULT_AUDIENCE",
    "SCOPES",
    "AssertionClaims",
    "AuthorityError",
    "JwksError",
    "KeySet",
    "VerifierSettings",
    "VerifyingKey",
    "load_jwks",
    "verify_assertion",
]

SCOPES: tuple[Scope, ...] = get_args(Scope)
ALGORITHM = "ES256"
CURVE = "P-256"
TOKEN_TYPE = "JWT"
DEFAULT_AUDIENCE = "sandbox-supervisor"
DEFAULT_LEEWAY_S = 30
DEFAULT_MAX_LIFETIME_S = 300

# A compact ES256 JWS with our claims is well under 2 KiB; the cap only bounds work done on
# junk before the signature is checked.
MAX_ASSERTION_CHARS = 8192
MAX_JTI_CHARS = 128
MAX_ALLOWED_ENTRIES = 256
MAX_COMMAND_NAME_CHARS = 256
# Header parameters that name a key or change how the token is processed. The key comes from
# our JWKS by kid only, so a token that tries to bring or point at its own key (jwk, jku,
# x5u, x5c) or to add processing rules (crit, b64 of RFC 7797) is refused outright.
FORBIDDEN_HEADER_PARAMS = frozenset({"crit", "jku", "jwk", "x5u", "x5c", "b64"})

MAX_JWKS_CHARS = 256 * 1024
MAX_JWKS_KEYS = 64
MAX_KID_CHARS = 128
P256_COORDINATE_BYTES = 32
# Members of a private JWK (EC "d", RSA "p", "q", …, symmetric "k"): any of them refuses the file.
PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
ALLOWED_JWK_MEMBERS = frozenset({"kty", "crv", "x", "y", "kid", "alg", "use", "key_ops", "ext"})

# The signature algorithm of ES256, built once. Building it is also what loads cryptography's
# OpenSSL backend (a lazy import inside `ECDSA()`, ~2 ms): done here, at the daemon's start,
# instead of inside the first upgrade, which would otherwise pay it.
_ES256 = ec.ECDSA(hashes.SHA256())

# Three base64url segments; the signature may be empty so that "alg":"none" tokens reach the
# header check and are refused for their algorithm, which is what the log should say.
_COMPACT_RE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
_BASE64URL_RE = re.compile(r"[A-Za-z0-9_-]*")


class AuthorityError(Exception):
    """The assertion is not accepted. `.reason` is short text for logs; never the token."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class JwksError(ValueError):
    """The JWKS is refused whole; `.problems` lists every reason found."""

    def __init__(self, problems: str | list[str]) -> None:
        # A single str is accepted too, for callers that refuse a file before parsing it.
        listed = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(listed))
        self.problems = listed


@dataclass(frozen=True, slots=True)
class VerifyingKey:
    """One trusted P-256 public key and its kid. The parsed key object is kept (parsing is the
    costly part); every assertion's signature is still checked against it."""

    kid: str
    public_key: ec.EllipticCurvePublicKey


class KeySet:
    """The trusted keys of a JWKS, in file order, looked up by kid (unique: `load_jwks`)."""

    __slots__ = ("_by_kid", "_keys")

    def __init__(self, keys: Iterable[VerifyingKey]) -> None:
        self._keys = tuple(keys)
        self._by_kid = {key.kid: key for key in self._keys}

    def __iter__(self) -> Iterator[VerifyingKey]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, kid: str) -> VerifyingKey | None:
        return self._by_kid.get(kid)


@dataclass(frozen=True, slots=True)
class VerifierSettings:
    issuer: str
    audience: str = DEFAULT_AUDIENCE
    leeway_s: int = DEFAULT_LEEWAY_S
    max_lifetime_s: int = DEFAULT_MAX_LIFETIME_S


# Paths relative to agent.cwd: not absolute, no NUL.
AllowedPath = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS, pattern=r"^[^/\x00][^\x00]*$")
]
# Command names are basenames: no "/" and no NUL.
CommandName = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_COMMAND_NAME_CHARS, pattern=r"^[^/\x00]+$")
]


class AssertionClaims(StrictModel):
    """The assertion's claims. Closed: an unknown claim makes the assertion invalid.

    Strict: integers must be JSON integers (`true`, `1.0` and `"1"` are refused).
    """

    iss: str
    aud: str | list[str]
    iat: int
    exp: int
    nbf: int | None = None
    jti: Annotated[str, StringConstraints(min_length=1, max_length=MAX_JTI_CHARS)]
    sandbox_id: str
    session_id: str
    session_sandbox_id: str
    connection_generation: int
    connection_attempt_id: str
    event_ack_floor: int
    scope: str  # space-separated names from SCOPES
    allowed_paths: Annotated[list[AllowedPath], Field(max_length=MAX_ALLOWED_ENTRIES)] | None = None
    allowed_commands: Annotated[list[CommandName], Field(max_length=MAX_ALLOWED_ENTRIES)] | None = (
        None
    )

    @field_validator("scope")
    @classmethod
    def _known_scopes(cls, value: str) -> str:
        # Refused rather than ignored: an issuer granting a scope we do not know expects
        # behaviour we do not have; failing the upgrade shows the mismatch at once instead of
        # running with a grant that differs silently from what was meant.
        unknown = set(_split_scope(value)) - set(SCOPES)
        if unknown:
            raise ValueError("unknown scope name")
        return value

    @property
    def scopes(self) -> frozenset[str]:
        return frozenset(_split_scope(self.scope))


def _split_scope(scope: str) -> list[str]:
    # Space-delimited (as OAuth's scope); repeated spaces are tolerated, other whitespace is
    # part of a name and so makes it unknown.
    return [name for name in scope.split(" ") if name]


# ------------------------------- strict JSON -------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two values for one member could be read differently by two parsers; refuse both.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError("duplicate member")
        result[key] = value
    return result


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str | bytes) -> object:
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def _b64url_decode(segment: str) -> bytes:
    if _BASE64URL_RE.fullmatch(segment) is None or len(segment) % 4 == 1:
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


# ------------------------------- JWKS -------------------------------


def _import_jwk(index: int, entry: object, problems: list[str]) -> VerifyingKey | None:
    where = f"keys[{index}]"
    if not isinstance(entry, dict):
        problems.append(f"{where}: not a JSON object")
        return None
    private = sorted(PRIVATE_JWK_MEMBERS & entry.keys())
    if private:
        problems.append(f"{where}: carries private key material ({', '.join(private)})")
        return None
    # Another key type or curve makes its other members meaningless: report just that.
    if entry.get("kty") != "EC":
        problems.append(f"{where}: kty must be EC")
        return None
    if entry.get("crv") != CURVE:
        problems.append(f"{where}: crv must be {CURVE}")
        return None
    found = len(problems)
    unknown = sorted(set(entry) - ALLOWED_JWK_MEMBERS)
    if unknown:
        problems.append(f"{where}: unknown members {', '.join(unknown)}")
    kid = entry.get("kid")
    if not isinstance(kid, str) or not 0 < len(kid) <= MAX_KID_CHARS:
        problems.append(f"{where}: kid must be a string of 1-{MAX_KID_CHARS} characters")
    if "alg" in entry and entry["alg"] != ALGORITHM:
        problems.append(f"{where}: alg must be {ALGORITHM}")
    if "use" in entry and entry["use"] != "sig":
        problems.append(f"{where}: use must be sig")
    key_ops = entry.get("key_ops", ["verify"])
    if not isinstance(key_ops, list) or not key_ops or set(key_ops) - {"verify"}:
        problems.append(f"{where}: key_ops must only allow verify")
    if "ext" in entry and not isinstance(entry["ext"], bool):
        problems.append(f"{where}: ext must be a boolean")
    # A kid that is not a string is among the problems already; the test also tells mypy.
    if len(problems) > found or not isinstance(kid, str):
        return None
    try:
        coordinates = [_b64url_decode(entry[name]) for name in ("x", "y")]
        if any(len(value) != P256_COORDINATE_BYTES for value in coordinates):
            raise ValueError("wrong length")
        x, y = (int.from_bytes(value, "big") for value in coordinates)
        # cryptography refuses a point that is not on the curve here.
        public_key = ec.EllipticCurvePublicNumbers(x, y, ec.SECP256R1()).public_key()
    except (KeyError, TypeError, ValueError):
        problems.append(f"{where}: x and y must be a point on {CURVE}")
        return None
    return VerifyingKey(kid, public_key)


def load_jwks(data: str | bytes) -> KeySet:
    """Parse a JWKS of P-256 public keys; raise JwksError listing every problem, refusing the
    whole file when any key is wrong (a half-loaded key set would hide an operator's mistake).
    """
    if not isinstance(data, (str, bytes)):
        raise JwksError(["not text"])
    if len(data) > MAX_JWKS_CHARS:
        raise JwksError([f"larger than {MAX_JWKS_CHARS} bytes"])
    try:
        document = _strict_json(data)
    except (ValueError, TypeError, RecursionError):
        raise JwksError(["not valid JSON"]) from None
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise JwksError(['not a JSON object with a "keys" list'])
    entries = document["keys"]
    if not entries:
        raise JwksError(["no keys"])
    if len(entries) > MAX_JWKS_KEYS:
        raise JwksError([f"more than {MAX_JWKS_KEYS} keys"])
    problems: list[str] = []
    keys = [_import_jwk(index, entry, problems) for index, entry in enumerate(entries)]
    kids = [entry.get("kid") for entry in entries if isinstance(entry, dict)]
    duplicated = sorted({kid for kid in kids if isinstance(kid, str) and kids.count(kid) > 1})
    if duplicated:
        problems.append(f"duplicate kid {', '.join(duplicated)}")
    if problems:
        raise JwksError(problems)
    loaded = KeySet([key for key in keys if key is not None])
    for key in loaded:
        _exercise(key)
    return loaded


def _exercise(key: VerifyingKey) -> None:
    """Check one signature that cannot be valid (r = s = 1). The first verification with a key
    sets up OpenSSL's state for it (~0.7 ms here, ~0.1 ms each later one); done at load, the
    first upgrade does not pay it. Every assertion is still verified in full."""
    try:
        key.public_key.verify(encode_dss_signature(1, 1), b"", _ES256)
    except InvalidSignature:
        return
    raise JwksError(["a key accepted a signature no P-256 key can accept"])


# ------------------------------- verification -------------------------------


def _read_protected_header(token: str) -> dict[str, Any]:
    try:
        header = _strict_json(_b64url_decode(token.split(".", 1)[0]))
    except (ValueError, RecursionError):
        raise AuthorityError("malformed_header") from None
    if not isinstance(header, dict):
        raise AuthorityError("malformed_header")
    return header


def _check_header(header: dict[str, Any], keys: KeySet) -> VerifyingKey:
    """The header's checks; the key it names."""
    forbidden = sorted(FORBIDDEN_HEADER_PARAMS & header.keys())
    if forbidden:
        raise AuthorityError(f"forbidden_header:{forbidden[0]}")
    if header.get("alg") != ALGORITHM:
        raise AuthorityError("alg_not_allowed")
    if "typ" in header and header["typ"] != TOKEN_TYPE:
        raise AuthorityError("bad_typ")
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid:
        # joserfc would pick the only key of a one-key set for a token without kid.
        raise AuthorityError("missing_kid")
    key = keys.get(kid)
    if key is None:
        raise AuthorityError("unknown_kid")
    return key


def _verified_payload(token: str, key: VerifyingKey) -> bytes:
    """The payload of a compact JWS whose ES256 signature `key` verifies (RFC 7515 §5.2, with
    the algorithm already pinned by the header check): the signature is the raw 64-byte
    r||s of RFC 7518 §3.4, over the ASCII bytes of `header.payload` as sent."""
    signing_input, _, encoded_signature = token.rpartition(".")
    try:
        signature = _b64url_decode(encoded_signature)
    except ValueError:
        raise AuthorityError("bad_signature") from None
    if len(signature) != 2 * P256_COORDINATE_BYTES:
        # A DER signature, or one for another curve: never converted, refused.
        raise AuthorityError("bad_signature")
    r = int.from_bytes(signature[:P256_COORDINATE_BYTES], "big")
    s = int.from_bytes(signature[P256_COORDINATE_BYTES:], "big")
    try:
        key.public_key.verify(encode_dss_signature(r, s), signing_input.encode("ascii"), _ES256)
    except InvalidSignature:
        raise AuthorityError("bad_signature") from None
    try:
        return _b64url_decode(signing_input.split(".", 1)[1])
    except ValueError:
        raise AuthorityError("jws_invalid") from None


def _parse_claims(payload: bytes) -> AssertionClaims:
    try:
        document = _strict_json(payload)
    except (ValueError, RecursionError):
        raise AuthorityError("malformed_payload") from None
    if not isinstance(document, dict):
        raise AuthorityError("malformed_payload")
    try:
        return AssertionClaims.model_validate(document)
    except ValidationError as error:
        loc = error.errors(include_url=False, include_input=False)[0]["loc"]
        claim = str(loc[0])[:64] if loc else "<root>"
        raise AuthorityError(f"invalid_claims:{claim}") from None


def _check_times(claims: AssertionClaims, settings: VerifierSettings, now: float) -> None:
    leeway = settings.leeway_s
    if claims.iat > now + leeway:
        raise AuthorityError("iat_in_future")
    if claims.exp <= now - leeway:
        raise AuthorityError("expired")
    if claims.nbf is not None and claims.nbf > now + leeway:
        raise AuthorityError("nbf_in_future")
    if claims.exp <= claims.iat:
        raise AuthorityError("exp_not_after_iat")
    if claims.exp - claims.iat > settings.max_lifetime_s:
        raise AuthorityError("lifetime_too_long")


def _check_audience(claims: AssertionClaims, settings: VerifierSettings) -> None:
    if claims.iss != settings.issuer:
        raise AuthorityError("wrong_issuer")
    audience = claims.aud if isinstance(claims.aud, list) else [claims.aud]
    if settings.audience not in audience:
        raise AuthorityError("wrong_audience")


def _check_binding(claims: AssertionClaims, headers: RoutingHeaders) -> None:
    # Each claim binds the assertion to one routing header: an assertion minted for another
    # sandbox, session, attempt, generation or ack floor is useless here.
    pairs = (
        ("sandbox_id", claims.sandbox_id, headers.sandbox_id),
        ("session_id", claims.session_id, headers.session_id),
        ("session_sandbox_id", claims.session_sandbox_id, headers.session_sandbox_id),
        ("connection_generation", claims.connection_generation, headers.generation),
        ("connection_attempt_id", claims.connection_attempt_id, headers.attempt_id),
        ("event_ack_floor", claims.event_ack_floor, headers.event_ack),
    )
    for name, claimed, sent in pairs:
        if claimed != sent:
            raise AuthorityError(f"claim_mismatch:{name}")


def _verify(
    token: str, keys: KeySet, settings: VerifierSettings, headers: RoutingHeaders, now: float
) -> AssertionClaims:
    if not isinstance(token, str) or not token:
        raise AuthorityError("missing_token")
    if len(token) > MAX_ASSERTION_CHARS or _COMPACT_RE.fullmatch(token) is None:
        raise AuthorityError("malformed_token")
    key = _check_header(_read_protected_header(token), keys)
    claims = _parse_claims(_verified_payload(token, key))
    _check_audience(claims, settings)
    _check_times(claims, settings, now)
    _check_binding(claims, headers)
    return claims


def verify_assertion(
    token: str, keys: KeySet, settings: VerifierSettings, headers: RoutingHeaders, now: float
) -> AssertionClaims:
    """Verify a compact JWS assertion against the key set, settings and routing headers.

    Raises only AuthorityError. The jti is NOT checked against a replay cache here: the
    caller does that with `claims.jti` (and keeps it until `claims.exp` + leeway).
    """
    try:
        return _verify(token, keys, settings, headers, now)
    except AuthorityError:
        raise
    except Exception:  # the promise is "only AuthorityError"; the reason says it was ours
        raise AuthorityError("verify_failed") from None
