"""keys generate / keys mint, the CLI's dispatch of serve and onboard-template, and --version."""

from __future__ import annotations

import base64
import json
import time
import os
import stat
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from joserfc import jwt
from joserfc.jwk import KeySet

from sandbox_supervisor.daemon.exits import EXIT_TERMINATED
from sandbox_supervisor.daemon.ops import cli
from sandbox_supervisor.daemon.ops.keys import (
    JWKS_FILENAME,
    SIGNING_KEY_FILENAME,
    KeyFileError,
    load_signing_jwk,
    mint_assertion,
    thumbprint,
)


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def verify_with_cryptography(token: str, public_jwk: dict) -> dict:
    """Independent ES256 check: raw 64-byte r||s over header.payload with the JWKS key."""
    header_b64, payload_b64, sig_b64 = token.split(".")
    raw = b64url_decode(sig_b64)
    assert len(raw) == 64
    numbers = ec.EllipticCurvePublicNumbers(
        int.from_bytes(b64url_decode(public_jwk["x"]), "big"),
        int.from_bytes(b64url_decode(public_jwk["y"]), "big"),
        ec.SECP256R1(),
    )
    der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
    numbers.public_key().verify(
        der, f"{header_b64}.{payload_b64}".encode(), ec.ECDSA(hashes.SHA256())
    )
    return json.loads(b64url_decode(payload_b64))


def generate(tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    out = tmp_path / "keys"
    assert cli.main(["keys", "generate", "--out-dir", str(out), *extra]) == 0
    return out / SIGNING_KEY_FILENAME, out / JWKS_FILENAME


def mint(capsys: pytest.CaptureFixture[str], key: Path, claims: dict, *extra: str) -> str:
    capsys.readouterr()  # drop earlier output (keys generate prints what it wrote)
    code = cli.main(["keys", "mint", "--key", str(key), "--claims", json.dumps(claims), *extra])
    assert code == 0, capsys.readouterr().err
    return capsys.readouterr().out.strip()


def test_generate_writes_private_key_0600_and_public_jwks(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # the private key's mode must not depend on the umask
    try:
        key_path, jwks_path = generate(tmp_path, "--kid", "dev-1")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    private = json.loads(key_path.read_text())
    assert set(private) == {"kty", "crv", "x", "y", "d", "kid", "alg", "use"}
    assert (private["kty"], private["crv"], private["kid"]) == ("EC", "P-256", "dev-1")
    assert (private["alg"], private["use"]) == ("ES256", "sig")
    jwks = json.loads(jwks_path.read_text())
    assert jwks == {"keys": [{k: v for k, v in private.items() if k != "d"}]}


def test_generate_defaults_kid_to_thumbprint(tmp_path: Path) -> None:
    key_path, _ = generate(tmp_path)
    private = json.loads(key_path.read_text())
    assert private["kid"] == thumbprint(private)


def test_generate_refuses_to_overwrite_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path, jwks_path = generate(tmp_path)
    before = key_path.read_bytes(), jwks_path.read_bytes()
    code = cli.main(["keys", "generate", "--out-dir", str(key_path.parent)])
    assert code == 2
    assert "--force" in capsys.readouterr().err
    assert (key_path.read_bytes(), jwks_path.read_bytes()) == before


def test_generate_refuses_when_only_jwks_exists(tmp_path: Path) -> None:
    out = tmp_path / "keys"
    out.mkdir()
    (out / JWKS_FILENAME).write_text("{}")
    assert cli.main(["keys", "generate", "--out-dir", str(out)]) == 2
    assert not (out / SIGNING_KEY_FILENAME).exists()  # nothing half written


def test_generate_force_replaces_both_files(tmp_path: Path) -> None:
    key_path, jwks_path = generate(tmp_path)
    old = json.loads(key_path.read_text())
    generate(tmp_path, "--force")
    new = json.loads(key_path.read_text())
    assert new["d"] != old["d"]
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert json.loads(jwks_path.read_text())["keys"][0]["x"] == new["x"]
    # No temporary file is left behind by the replace.
    names = sorted(p.name for p in key_path.parent.iterdir())
    assert names == [JWKS_FILENAME, SIGNING_KEY_FILENAME]


def test_generate_rejects_a_bad_kid(tmp_path: Path) -> None:
    assert cli.main(["keys", "generate", "--out-dir", str(tmp_path), "--kid", "bad kid"]) == 2
    assert not (tmp_path / SIGNING_KEY_FILENAME).exists()


def test_minted_token_verifies_with_the_generated_jwks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path, jwks_path = generate(tmp_path, "--kid", "dev-1")
    claims = {"iss": "https://cp.test", "aud": "sandbox-supervisor", "connection_generation": 3}
    token = mint(capsys, key_path, claims)
    jwks = json.loads(jwks_path.read_text())

    header = json.loads(b64url_decode(token.split(".")[0]))
    assert header == {"alg": "ES256", "typ": "JWT", "kid": "dev-1"}
    payload = verify_with_cryptography(token, jwks["keys"][0])
    assert payload["connection_generation"] == 3
    # And with the JOSE library the daemon's verifier builds on.
    decoded = jwt.decode(token, KeySet.import_key_set(jwks), algorithms=["ES256"])
    assert decoded.claims["iss"] == "https://cp.test"


def test_minted_token_is_accepted_by_the_daemons_verifier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sandbox_supervisor.protocol import authority  # the daemon's verifier
    from sandbox_supervisor.protocol.headers import RoutingHeaders

    key_path, jwks_path = generate(tmp_path)
    keys = authority.load_jwks(jwks_path.read_bytes())
    headers = RoutingHeaders("sb-1", "session-1", "sb-1", "attempt-1", 1, 0, None)
    claims = {
        "iss": "x",
        "aud": authority.DEFAULT_AUDIENCE,
        "sandbox_id": "sb-1",
        "session_id": "session-1",
        "session_sandbox_id": "sb-1",
        "connection_generation": 1,
        "connection_attempt_id": "attempt-1",
        "event_ack_floor": 0,
        "scope": "session:control",
    }
    token = mint(capsys, key_path, claims)
    settings = authority.VerifierSettings(issuer="x")
    assert authority.verify_assertion(token, keys, settings, headers, time.time()).iss == "x"


def test_mint_fills_iat_exp_jti_and_keeps_given_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path, jwks_path = generate(tmp_path)
    public = json.loads(jwks_path.read_text())["keys"][0]
    token = mint(capsys, key_path, {"iss": "x"}, "--lifetime", "60")
    filled = verify_with_cryptography(token, public)
    assert filled["exp"] - filled["iat"] == 60
    assert isinstance(filled["jti"], str) and filled["jti"]
    again = verify_with_cryptography(mint(capsys, key_path, {"iss": "x"}), public)
    assert again["jti"] != filled["jti"]  # every token is fresh for the replay cache
    assert again["exp"] - again["iat"] == 120
    given = {"iss": "x", "iat": 1000, "exp": 1100, "jti": "fixed"}
    assert verify_with_cryptography(mint(capsys, key_path, given), public) == given


def test_signature_does_not_verify_with_another_key(tmp_path: Path) -> None:
    key_path, _ = generate(tmp_path)
    _, other_jwks = generate(tmp_path / "other")
    token = mint_assertion(load_signing_jwk(key_path), {"iss": "x"})
    with pytest.raises(InvalidSignature):
        verify_with_cryptography(token, json.loads(other_jwks.read_text())["keys"][0])


def test_mint_refuses_bad_claims_and_bad_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path, jwks_path = generate(tmp_path)
    base = ["keys", "mint", "--key", str(key_path)]
    assert cli.main([*base, "--claims", "not json"]) == 2
    assert cli.main([*base, "--claims", "[1]"]) == 2
    assert cli.main([*base, "--claims", "{}", "--lifetime", "0"]) == 2
    # The public JWKS is not a signing key.
    assert cli.main(["keys", "mint", "--key", str(jwks_path), "--claims", "{}"]) == 2
    assert cli.main(["keys", "mint", "--key", str(tmp_path / "none"), "--claims", "{}"]) == 2
    capsys.readouterr()


def test_load_signing_jwk_refuses_public_and_mismatched_keys(tmp_path: Path) -> None:
    key_path, _ = generate(tmp_path)
    jwk = json.loads(key_path.read_text())
    public_only = tmp_path / "public.jwk"
    public_only.write_text(json.dumps({k: v for k, v in jwk.items() if k != "d"}))
    with pytest.raises(KeyFileError):
        load_signing_jwk(public_only)
    _, other_jwks = generate(tmp_path / "other")
    mixed = tmp_path / "mixed.jwk"
    other = json.loads(other_jwks.read_text())["keys"][0]
    mixed.write_text(json.dumps({**jwk, "x": other["x"], "y": other["y"]}))
    with pytest.raises(KeyFileError, match="do not belong"):
        load_signing_jwk(mixed)
    for member in ("x", "y"):  # a key file without a public coordinate
        partial = tmp_path / f"no-{member}.jwk"
        partial.write_text(json.dumps({k: v for k, v in jwk.items() if k != member}))
        with pytest.raises(KeyFileError, match="do not belong"):
            load_signing_jwk(partial)
        assert cli.main(["keys", "mint", "--key", str(partial), "--claims", "{}"]) == 2


def test_keys_commands_work_as_a_module(tmp_path: Path) -> None:
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "sandbox_supervisor.daemon", *a], capture_output=True, text=True, timeout=60
    )
    out = tmp_path / "k"
    assert run("keys", "generate", "--out-dir", str(out)).returncode == 0
    minted = run("keys", "mint", "--key", str(out / SIGNING_KEY_FILENAME), "--claims", '{"a":1}')
    assert minted.returncode == 0
    jwks = json.loads((out / JWKS_FILENAME).read_text())
    assert verify_with_cryptography(minted.stdout.strip(), jwks["keys"][0])["a"] == 1


def write_config(tmp_path: Path) -> Path:
    _, jwks = generate(tmp_path)
    path = tmp_path / "supervisor.toml"
    path.write_text(f'[authority]\nissuer = "https://cp.test"\njwks_file = "{jwks}"\n')
    return path


def test_serve_passes_the_overridden_config_to_serve_main(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    fake_app = types.ModuleType("sandbox_supervisor.daemon.app")
    fake_app.serve_main = lambda config: seen.append(config) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sandbox_supervisor.daemon.app", fake_app)
    path = write_config(tmp_path)
    code = cli.main(["serve", "--config", str(path), "--listen-tcp", "127.0.0.1:0",
                     "--state-dir", str(tmp_path / "state")])
    assert code == 0
    (config,) = seen
    assert config.listen.tcp == ["127.0.0.1:0"]
    assert config.paths.state_dir == tmp_path / "state"
    assert config.authority.issuer == "https://cp.test"


def test_serve_returns_serve_main_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_app = types.ModuleType("sandbox_supervisor.daemon.app")
    fake_app.serve_main = lambda config: EXIT_TERMINATED  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sandbox_supervisor.daemon.app", fake_app)
    assert cli.main(["serve", "--config", str(write_config(tmp_path))]) == 78


def test_serve_with_bad_config_prints_problems_and_exits_2_without_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_app = types.ModuleType("sandbox_supervisor.daemon.app")
    fake_app.serve_main = lambda config: pytest.fail("serve_main ran")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sandbox_supervisor.daemon.app", fake_app)
    for name in list(os.environ):
        if name.startswith("SANDBOX_SUPERVISOR_"):
            monkeypatch.delenv(name)
    path = tmp_path / "bad.toml"
    path.write_text("[listen]\ntcp = [\"nope\"]\n")
    assert cli.main(["serve", "--config", str(path), "--log-format", "console"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("listen.tcp: ") for line in err)
    assert "authority.issuer: required" in err


def test_serve_rejects_a_bad_log_format_as_an_argument_error() -> None:
    assert cli.main(["serve", "--log-format", "xml"]) == 2


def test_onboard_template_without_its_flags_exits_2_and_stores_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = tmp_path / "store.json"
    assert cli.main(["onboard-template", "--store", str(store)]) == 2
    err = capsys.readouterr().err
    for flag in ("--service", "--profile-version", "--template-id"):
        assert f"{flag}: required" in err
    assert not store.exists()


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "check-config" in capsys.readouterr().out


def test_version_prints_the_installed_distributions_version(capsys: pytest.CaptureFixture[str]) -> None:
    installed = metadata.version("sandbox-supervisor")  # the metadata, not a copy in code
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"sandbox-supervisor {installed}\n"
    # The console script a platform engineer types, in its own process.
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "sandbox-supervisor"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (completed.returncode, completed.stdout, completed.stderr) == (0, f"sandbox-supervisor {installed}\n", "")


def test_mint_warns_of_claims_the_daemon_requires_and_does_not_know(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sandbox_supervisor.protocol.authority import AssertionClaims

    key_path, _ = generate(tmp_path)
    capsys.readouterr()
    assert cli.main(["keys", "mint", "--key", str(key_path), "--claims", '{"iss": "x", "colour": 1}']) == 0
    captured = capsys.readouterr()
    assert captured.out.count(".") == 2  # the token alone on stdout, still minted
    required = [n for n, f in AssertionClaims.model_fields.items() if f.is_required()]
    # iat, exp and jti are filled by mint; every other required claim but iss is named.
    expected = [n for n in required if n not in {"iss", "iat", "exp", "jti"}]
    assert "aud" in expected and "scope" in expected  # derived from the model, not a copy
    assert captured.err.splitlines() == [
        f"sandbox-supervisor: warning: claims the daemon requires are missing: {', '.join(expected)}",
        "sandbox-supervisor: warning: claims the daemon does not know (it refuses the token): colour",
    ]
    # Complete claims: no warning at all.
    complete = {name: "x" for name in expected + ["iss"]}
    assert cli.main(["keys", "mint", "--key", str(key_path), "--claims", json.dumps(complete)]) == 0
    assert capsys.readouterr().err == ""


def test_mint_refuses_nan_claims(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_path, _ = generate(tmp_path)
    assert cli.main(["keys", "mint", "--key", str(key_path), "--claims", '{"a": NaN}']) == 2
    assert "NaN" in capsys.readouterr().err


async def test_a_minted_token_opens_a_session_on_a_daemon_that_never_loads_joserfc(tmp_path: Path) -> None:
    """`keys mint` signs with joserfc; the serving daemon verifies with cryptography alone and
    must not import joserfc (about 2 MiB of idle memory). PYTHONPROFILEIMPORTTIME makes the
    daemon list every module it imports, at start and while it admits the token, in its log."""
    from sandbox_supervisor.testing.daemon import make_layout, running_daemon

    layout = make_layout(tmp_path / "d")
    key_path = tmp_path / SIGNING_KEY_FILENAME
    key_path.write_text(json.dumps(layout.authority.signing_jwk()))
    async with running_daemon(layout, env={"PYTHONPROFILEIMPORTTIME": "1"}) as process:
        client = process.running.client()
        claims = client.authority.claims_for(
            sandbox_id=client.sandbox_id,
            session_id=client.session_id,
            session_sandbox_id=client.session_sandbox_id,
            generation=1,
            attempt_id="attempt-minted",
            ack_floor=0,
        )
        for filled in ("iat", "exp", "jti"):
            del claims[filled]
        minted = subprocess.run(
            [str(Path(sys.executable).parent / "sandbox-supervisor"), "keys", "mint",
             "--key", str(key_path), "--claims", json.dumps(claims)],
            capture_output=True, text=True, timeout=60,
        )
        assert (minted.returncode, minted.stderr) == (0, "")
        async with client.connect(generation=1, attempt_id="attempt-minted", assertion=minted.stdout.strip()) as session:
            state = await session.bootstrap(cwd=str(layout.workspace))
            assert state["body"]["status"] == "ready"
    imported = [line.split("|")[-1].strip() for line in process.log_text().splitlines() if line.startswith("import time:")]
    assert "sandbox_supervisor.protocol.authority" in imported  # the probe saw the daemon's imports
    assert not [name for name in imported if name.split(".")[0] == "joserfc"]
