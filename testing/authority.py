"""A loopback control authority: ES256 test keys, a JWKS, assertion minting, and forgeries.

Tokens are built with `cryptography` directly (base64url JSON header and payload, ECDSA
SHA-256, DER converted to raw r||s), never with the verifier's library, so a bug shared by
signer and verifier cannot make the tests pass.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from sandbox_supervisor.protocol.authority import DEFAULT_AUDIENCE

__all__ = [
    "ALL_SCOPES",
    "DEFAULT_ISSUER",
    "OMIT",
    "LoopbackAuthority",
    "combine_jwks",
    "forge_alg_none",
    "forge_der_signature",
    "forge_es384",
    "forge_hs256_with_public_key",
    "forge_rs256",
    "forge_with_other_key",
    "strip_kid",
    "tamper_payload",
]

DEFAULT_KID = "test-key-1"
DEFAULT_ISSUER = "https://control-plane.test"
ALL_SCOPES = "files:read files:write shell:exec session:control"
DEFAULT_LIFETIME_S = 120
RSA_TEST_KEY_BITS = 2048
P256_COORDINATE_BYTES = 32


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


# Pass as a claim or header value to delete that member instead of setting it. Typed Any
# because it stands in for a value of any claim's type, typed arguments of claims_for included.
OMIT: Any = _Omit()


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_json(document: Mapping[str, Any]) -> str:
    return _b64url(json.dumps(document, separators=(",", ":")).encode("utf-8"))


def _b64url_decode(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def _apply(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, value in changes.items():
        if value is OMIT:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


def _raw_signature(private_key: ec.EllipticCurvePrivateKey, message: bytes, size: int) -> bytes:
    hash_algorithm: hashes.HashAlgorithm = hashes.SHA256() if size == 32 else hashes.SHA384()
    r, s = decode_dss_signature(private_key.sign(message, ec.ECDSA(hash_algorithm)))
    return r.to_bytes(size, "big") + s.to_bytes(size, "big")


def _compact(header: Mapping[str, Any], claims: Mapping[str, Any]) -> str:
    """The signing input `header.payload` (the caller appends `.signature`)."""
    return f"{_b64url_json(header)}.{_b64url_json(claims)}"


class LoopbackAuthority:
    """Plays the control plane's signing side: one P-256 key with a kid."""

    def __init__(
        self,
        kid: str = DEFAULT_KID,
        issuer: str = DEFAULT_ISSUER,
        audience: str = DEFAULT_AUDIENCE,
    ) -> None:
        self.private_key = ec.generate_private_key(ec.SECP256R1())
        self.kid = kid
        self.issuer = issuer
        self.audience = audience

    def public_jwk(self) -> dict[str, Any]:
        numbers = self.private_key.public_key().public_numbers()
        return {
            "kty": "EC",
            "crv": "P-256",
            "x": _b64url(numbers.x.to_bytes(P256_COORDINATE_BYTES, "big")),
            "y": _b64url(numbers.y.to_bytes(P256_COORDINATE_BYTES, "big")),
            "kid": self.kid,
            "alg": "ES256",
            "use": "sig",
        }

    def jwks(self) -> dict[str, Any]:
        """The public JWKS the supervisor should trust."""
        return {"keys": [self.public_jwk()]}

    def write_jwks(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.jwks(), indent=2) + "\n", encoding="utf-8")
        return path

    def signing_jwk(self) -> dict[str, Any]:
        """The private JWK (with "d"), as `keys generate` writes it."""
        private_value = self.private_key.private_numbers().private_value
        d = _b64url(private_value.to_bytes(P256_COORDINATE_BYTES, "big"))
        return {**self.public_jwk(), "d": d}

    def public_key_pem(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def claims_for(
        self,
        *,
        sandbox_id: str,
        session_id: str,
        session_sandbox_id: str,
        generation: int,
        attempt_id: str,
        ack_floor: int,
        scope: str = ALL_SCOPES,
        now: float | None = None,
        lifetime_s: int = DEFAULT_LIFETIME_S,
        **overrides: Any,
    ) -> dict[str, Any]:
        """Valid claims for one upgrade; `overrides` set any claim, or delete it with OMIT."""
        issued_at = int(time.time() if now is None else now)
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "aud": self.audience,
            "iat": issued_at,
            "exp": issued_at + lifetime_s,
            "jti": str(uuid.uuid4()),
            "sandbox_id": sandbox_id,
            "session_id": session_id,
            "session_sandbox_id": session_sandbox_id,
            "connection_generation": generation,
            "connection_attempt_id": attempt_id,
            "event_ack_floor": ack_floor,
            "scope": scope,
        }
        # Applied over everything, so OMIT also deletes a claim named by an argument.
        return _apply({}, {**claims, **overrides})

    def mint(
        self, claims: Mapping[str, Any], *, header_overrides: Mapping[str, Any] | None = None
    ) -> str:
        """An ES256 compact JWS of `claims` (raw 64-byte r||s signature)."""
        payload = json.dumps(claims, separators=(",", ":")).encode("utf-8")
        return self.mint_payload(payload, header_overrides=header_overrides)

    def mint_payload(
        self, payload: bytes, *, header_overrides: Mapping[str, Any] | None = None
    ) -> str:
        """A validly signed token over arbitrary payload bytes (for malformed-claims tests)."""
        header = _apply({"alg": "ES256", "typ": "JWT", "kid": self.kid}, header_overrides or {})
        signing_input = f"{_b64url_json(header)}.{_b64url(payload)}"
        signature = _raw_signature(self.private_key, signing_input.encode("ascii"), 32)
        return f"{signing_input}.{_b64url(signature)}"


def combine_jwks(*authorities: LoopbackAuthority) -> dict[str, Any]:
    """One JWKS listing every authority's public key (a key rotation in progress)."""
    return {"keys": [authority.public_jwk() for authority in authorities]}


# ------------------------------- forgeries -------------------------------


def forge_alg_none(claims: Mapping[str, Any], kid: str = DEFAULT_KID) -> str:
    """An unsigned token ("alg":"none", empty signature)."""
    return _compact({"alg": "none", "typ": "JWT", "kid": kid}, claims) + "."


def forge_hs256_with_public_key(authority: LoopbackAuthority, claims: Mapping[str, Any]) -> str:
    """The key-confusion attack: HMAC-SHA256 keyed with the authority's public key (PEM)."""
    signing_input = _compact({"alg": "HS256", "typ": "JWT", "kid": authority.kid}, claims)
    mac = hmac.new(authority.public_key_pem(), signing_input.encode("ascii"), hashlib.sha256)
    return f"{signing_input}.{_b64url(mac.digest())}"


def forge_es384(claims: Mapping[str, Any], kid: str = DEFAULT_KID) -> str:
    """A genuine ES384 signature with a fresh P-384 key, under the trusted kid."""
    key = ec.generate_private_key(ec.SECP384R1())
    signing_input = _compact({"alg": "ES384", "typ": "JWT", "kid": kid}, claims)
    return f"{signing_input}.{_b64url(_raw_signature(key, signing_input.encode('ascii'), 48))}"


def forge_rs256(claims: Mapping[str, Any], kid: str = DEFAULT_KID) -> str:
    """A genuine RS256 signature with a fresh RSA key, under the trusted kid."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_TEST_KEY_BITS)
    signing_input = _compact({"alg": "RS256", "typ": "JWT", "kid": kid}, claims)
    signature = key.sign(signing_input.encode("ascii"), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input}.{_b64url(signature)}"


def forge_with_other_key(claims: Mapping[str, Any], kid: str = DEFAULT_KID) -> str:
    """A well-formed ES256 token under the trusted kid, signed by a key nobody trusts."""
    return LoopbackAuthority(kid=kid).mint(claims)


def forge_der_signature(authority: LoopbackAuthority, claims: Mapping[str, Any]) -> str:
    """A correct ES256 signature in DER encoding instead of JWS's raw r||s."""
    signing_input = _compact({"alg": "ES256", "typ": "JWT", "kid": authority.kid}, claims)
    der = authority.private_key.sign(signing_input.encode("ascii"), ec.ECDSA(hashes.SHA256()))
    return f"{signing_input}.{_b64url(der)}"


def tamper_payload(token: str, **changes: Any) -> str:
    """The same header and signature over a modified payload (OMIT deletes a claim)."""
    header, payload, signature = token.split(".")
    claims = _apply(json.loads(_b64url_decode(payload)), changes)
    return f"{header}.{_b64url_json(claims)}.{signature}"


def strip_kid(authority: LoopbackAuthority, claims: Mapping[str, Any]) -> str:
    """A properly signed token whose header has no kid."""
    return authority.mint(claims, header_overrides={"kid": OMIT})
