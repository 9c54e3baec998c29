"""Development keys: an ES256 signing JWK, its public JWKS, and signed assertions.

Keys are made with cryptography; assertions are signed by joserfc, a JOSE library, so a
minted token does not depend on the daemon's own JWS reader (`protocol/authority.py`) to be
correct. joserfc is imported inside `mint_assertion` only: the daemon never loads it (it would
cost an idle daemon about 2 MiB; README, "Dependencies, and why each").
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from sandbox_supervisor.protocol.authority import AssertionClaims

SIGNING_KEY_FILENAME = "signing-key.jwk"
JWKS_FILENAME = "jwks.json"
PRIVATE_KEY_MODE = 0o600
PUBLIC_FILE_MODE = 0o644
ALGORITHM = "ES256"
CURVE_NAME = "P-256"
COORDINATE_BYTES = 32  # P-256 coordinates, scalars and r, s are 32 bytes each
# Well inside the verifier's default max lifetime (300 s), so a fresh token is always valid.
DEFAULT_LIFETIME_S = 120
KID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_COMPACT = (",", ":")


class KeyFileError(ValueError):
    """A signing key file is missing, unreadable, or not an EC P-256 private JWK."""


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _int_b64(value: int) -> str:
    return _b64url(value.to_bytes(COORDINATE_BYTES, "big"))


def thumbprint(public_jwk: dict[str, Any]) -> str:
    """RFC 7638 thumbprint (SHA-256) of an EC public JWK: a stable default kid."""
    members = {name: public_jwk[name] for name in ("crv", "kty", "x", "y")}
    canonical = json.dumps(members, sort_keys=True, separators=_COMPACT).encode()
    return _b64url(hashlib.sha256(canonical).digest())


def new_signing_jwk(kid: str | None = None) -> dict[str, Any]:
    """A fresh P-256 private JWK; kid defaults to the key's RFC 7638 thumbprint."""
    key = ec.generate_private_key(ec.SECP256R1())
    numbers = key.private_numbers()
    jwk: dict[str, Any] = {
        "kty": "EC",
        "crv": CURVE_NAME,
        "x": _int_b64(numbers.public_numbers.x),
        "y": _int_b64(numbers.public_numbers.y),
        "d": _int_b64(numbers.private_value),
    }
    if kid is None:
        kid = thumbprint(jwk)
    if not KID_PATTERN.match(kid):
        raise ValueError(f"kid must match {KID_PATTERN.pattern}")
    jwk.update({"kid": kid, "alg": ALGORITHM, "use": "sig"})
    return jwk


def public_jwk(private_jwk: dict[str, Any]) -> dict[str, Any]:
    """The same JWK without its private part."""
    return {name: value for name, value in private_jwk.items() if name != "d"}


def write_key_pair(
    out_dir: Path, kid: str | None = None, *, force: bool = False
) -> tuple[Path, Path]:
    """Write `signing-key.jwk` (0600) and `jwks.json` into `out_dir`; returns both paths.

    Refuses (FileExistsError) when either exists, unless `force`: overwriting a signing key by
    accident would lock out every control plane that holds the old one.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key_path, jwks_path = out_dir / SIGNING_KEY_FILENAME, out_dir / JWKS_FILENAME
    if not force:
        for path in (key_path, jwks_path):
            if path.exists() or path.is_symlink():
                raise FileExistsError(f"{path} exists (use --force to replace it)")
    jwk = new_signing_jwk(kid)
    _write_new_file(key_path, _json_bytes(jwk), PRIVATE_KEY_MODE, replace=force)
    jwks = _json_bytes({"keys": [public_jwk(jwk)]})
    _write_new_file(jwks_path, jwks, PUBLIC_FILE_MODE, replace=force)
    return key_path, jwks_path


def _json_bytes(data: object) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def _write_new_file(path: Path, data: bytes, mode: int, *, replace: bool) -> None:
    """Create the file with `mode` from its first byte (O_EXCL: never through an existing file
    or symlink). With `replace`, write a temporary file and rename it over the old one."""
    target = path.with_name(f".{path.name}.{os.getpid()}.tmp") if replace else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        # The mode given to os.open is filtered by the umask; the file mode is exact.
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(target)
        raise
    os.close(fd)
    if replace:
        os.replace(target, path)


def load_signing_jwk(path: Path) -> dict[str, Any]:
    """Read and check a private signing JWK (EC P-256 with d, x, y consistent, and a kid)."""
    try:
        jwk = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KeyFileError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise KeyFileError(f"{path} is not JSON") from None
    if not isinstance(jwk, dict):
        raise KeyFileError(f"{path} is not a JWK object")
    if jwk.get("kty") != "EC" or jwk.get("crv") != CURVE_NAME:
        raise KeyFileError(f"{path} is not an EC {CURVE_NAME} key")
    if not isinstance(jwk.get("kid"), str) or not KID_PATTERN.match(jwk["kid"]):
        raise KeyFileError(f"{path} has no valid kid")
    if jwk.get("alg", ALGORITHM) != ALGORITHM:
        raise KeyFileError(f"{path} is not an {ALGORITHM} key")
    try:
        key = _private_key(jwk)
    except (KeyError, TypeError, ValueError):
        raise KeyFileError(f"{path} is not a valid {CURVE_NAME} private key") from None
    public = key.public_key().public_numbers()
    if _int_b64(public.x) != jwk.get("x") or _int_b64(public.y) != jwk.get("y"):
        raise KeyFileError(f"{path}: x and y do not belong to d")
    return jwk


def _private_key(jwk: dict[str, Any]) -> ec.EllipticCurvePrivateKey:
    d = _b64url_decode(jwk["d"])
    if len(d) != COORDINATE_BYTES:
        raise ValueError("d must be 32 bytes")
    return ec.derive_private_key(int.from_bytes(d, "big"), ec.SECP256R1())


def mint_assertion(
    jwk: dict[str, Any],
    claims: dict[str, Any],
    *,
    lifetime_s: int = DEFAULT_LIFETIME_S,
    now: float | None = None,
) -> str:
    """Sign `claims`, filling `iat`, `exp` (iat + lifetime) and `jti` when absent."""
    if lifetime_s <= 0:
        raise ValueError("lifetime must be positive")
    payload = dict(claims)
    iat = payload.setdefault("iat", int(time.time() if now is None else now))
    if "exp" not in payload:
        if not isinstance(iat, int) or isinstance(iat, bool):
            raise ValueError("iat must be an integer to derive exp from it")
        payload["exp"] = iat + lifetime_s
    payload.setdefault("jti", str(uuid.uuid4()))
    try:
        # NaN and Infinity are not JSON: joserfc would write them, and every verifier refuse.
        json.dumps(payload, allow_nan=False)
    except ValueError:
        raise ValueError("claims must not contain NaN or Infinity") from None
    # Imported here, not at the top: `keys mint` is the only user (module docstring).
    from joserfc import jwt
    from joserfc.jwk import ECKey

    header = {"alg": ALGORITHM, "typ": "JWT", "kid": jwk["kid"]}
    return jwt.encode(header, payload, ECKey.import_key(jwk), algorithms=[ALGORITHM])


# The claims the daemon's verifier requires, and every claim it knows: read from its own model,
# so a claim added to (or made optional in) AssertionClaims changes the warnings with it.
REQUIRED_CLAIMS = tuple(name for name, field in AssertionClaims.model_fields.items() if field.is_required())
KNOWN_CLAIMS = frozenset(AssertionClaims.model_fields)


# Filled by mint_assertion when absent.
FILLED_CLAIMS = frozenset({"iat", "exp", "jti"})


def claim_warnings(claims: dict[str, Any]) -> list[str]:
    """What would make the daemon refuse a token minted from these claims whatever their
    values: a required claim missing (beyond those mint_assertion fills), or a claim it does not
    know (the claim set is closed, docs/protocol.md §3.2). Warnings, not errors: a test may
    mint an incomplete token on purpose."""
    warnings = []
    missing = [name for name in REQUIRED_CLAIMS if name not in claims and name not in FILLED_CLAIMS]
    if missing:
        warnings.append(f"claims the daemon requires are missing: {', '.join(missing)}")
    unknown = sorted(set(claims) - KNOWN_CLAIMS)
    if unknown:
        warnings.append(f"claims the daemon does not know (it refuses the token): {', '.join(unknown)}")
    return warnings
