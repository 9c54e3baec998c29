"""The upgrade gate over real TCP and unix sockets (docs/protocol.md §2, §3, §5.1)."""

from __future__ import annotations

import base64
import json
import time

from typing import Any

import pytest
import trio

from sandbox_supervisor.protocol import headers as H
from sandbox_supervisor.daemon.auth.gate import BEARER_PREFIX_DETAIL, Lifecycle
from sandbox_supervisor.testing import authority as forge
from sandbox_supervisor.testing.authority import OMIT, LoopbackAuthority, combine_jwks
from sandbox_supervisor.testing.client import BootstrapRejected, ControlClient, Endpoint, UpgradeRejected
from sandbox_supervisor.testing.daemon import in_process_daemon, make_layout, running_daemon


def endpoint_of(daemon, transport):
    return daemon.tcp if transport == "tcp" else daemon.unix


async def rejected(client, **connect_kwargs) -> UpgradeRejected:
    with pytest.raises(UpgradeRejected) as info:
        async with client.connect(**connect_kwargs):
            pass
    return info.value


def fence(daemon):
    snapshot = daemon.supervisor.store.snapshot()
    return snapshot.fence_generation, snapshot.fence_attempt_id


# --- each row of the table, over both transports ------------------------------------------


async def test_row1_terminated_after_a_rejected_bootstrap(tmp_path, authority):
    """A refused bootstrap terminates the session for good: from then on an upgrade is
    refused 503 terminated. The window is held open by a command that ignores SIGTERM (the
    stop waits its kill grace). (Row 1's `draining` is exercised by a real SIGTERM in
    test_front.test_a_real_sigterm_drains_health_upgrades_and_new_commands.)"""
    layout = make_layout(tmp_path / "d", authority=authority, exec={"kill_grace_ms": 4000})
    (layout.workspace / "sub").mkdir()
    async with running_daemon(layout) as process:
        running = process.running
        client = running.client()
        async with client.connect(generation=1) as bound:
            await bound.bootstrap(cwd=str(layout.workspace))
            stubborn = await bound.call(
                "execute_shell_command", {"command": "trap '' TERM; echo up; sleep 30"}, idempotency_key="s"
            )
            await bound.receive_until(lambda f: f["kind"] == "exec.output" and f["body"]["call_id"] == stubborn)
        async with client.connect(generation=2) as other:
            with pytest.raises(BootstrapRejected):  # another body: session_binding_mismatch
                await other.bootstrap(cwd=str(layout.workspace / "sub"))
        for endpoint in (running.tcp, running.unix):
            error = await rejected(running.client(endpoint), generation=3)
            assert (error.status, error.error) == (503, "terminated")
            assert error.body["message"]
        assert await process.wait(timeout=15) == 78


@pytest.mark.parametrize(
    "header, value",
    [
        (H.GENERATION_HEADER, "0"),
        (H.GENERATION_HEADER, "+1"),
        (H.GENERATION_HEADER, "0x1"),
        (H.GENERATION_HEADER, "1 1"),
        (H.GENERATION_HEADER, str(2**53)),
        (H.GENERATION_HEADER, None),
        (H.EVENT_ACK_HEADER, "-1"),
        (H.EVENT_ACK_HEADER, "1.0"),
        (H.SESSION_ID_HEADER, "x" * 129),
        (H.SESSION_ID_HEADER, "bad/id"),
        (H.ATTEMPT_ID_HEADER, "has space"),
        (H.SESSION_SANDBOX_ID_HEADER, None),
        (H.SANDBOX_ID_HEADER, None),
    ],
)
async def test_row2_malformed_routing_headers(daemon, transport, header, value):
    client = daemon.client(endpoint_of(daemon, transport))
    error = await rejected(client, header_overrides={header: value})
    assert (error.status, error.error) == (400, "invalid_routing_headers")
    assert fence(daemon) == (0, None)


async def test_leading_zeros_compare_as_integers(daemon):
    client = daemon.client()
    token = client.mint(generation=1, attempt_id="a-1", ack_floor=0)
    async with client.connect(
        generation=1,
        attempt_id="a-1",
        assertion=token,
        header_overrides={H.GENERATION_HEADER: "001", H.EVENT_ACK_HEADER: "00"},
    ):
        pass
    assert fence(daemon) == (1, "a-1")


async def test_row3_sandbox_identity_unavailable_then_retried(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    daemon.layout.sandbox_id_file.write_text("  \n")  # empty after trimming
    error = await rejected(client)
    assert (error.status, error.error) == (503, "sandbox_identity_unavailable")
    daemon.layout.sandbox_id_file.write_text(daemon.layout.sandbox_id + "\n")
    async with client.connect():
        pass


async def test_sandbox_id_env_fallback_only_when_file_is_absent(tmp_path, authority):
    # File absent: the environment names the sandbox.
    layout = make_layout(tmp_path / "d", authority=authority)
    layout.sandbox_id_file.unlink()
    async with running_daemon(layout, env={"E2B_SANDBOX_ID": layout.sandbox_id}) as process:
        async with process.running.client().connect():
            pass
    assert process.returncode == 0
    # File present: it wins over a different id in the environment.
    layout = make_layout(tmp_path / "e", authority=authority)
    async with running_daemon(layout, env={"E2B_SANDBOX_ID": "sbx-from-the-environment"}) as process:
        async with process.running.client().connect():
            pass
        error = await rejected(process.running.client(sandbox_id="sbx-from-the-environment"), generation=2)
        assert (error.status, error.error) == (409, "sandbox_mismatch")
    assert process.returncode == 0


async def test_sandbox_id_is_cached_once_read(daemon):
    client = daemon.client()
    async with client.connect():
        pass
    daemon.layout.sandbox_id_file.write_text("sbx-changed\n")
    async with client.connect():
        pass


async def test_row4_sandbox_mismatch(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport), sandbox_id="sbx-someone-else")
    error = await rejected(client)
    assert (error.status, error.error) == (409, "sandbox_mismatch")


async def test_row5_missing_assertion_is_401_with_challenge(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    error = await rejected(client, assertion=None)
    assert (error.status, error.error) == (401, "invalid_authority")
    assert error.header("www-authenticate") == 'Bearer error="invalid_token"'


async def test_row5_an_assertion_with_a_bearer_prefix_is_refused_and_logged_as_such(daemon, log_lines):
    """The header takes the compact JWS alone (docs/client-contract.md): `Bearer <jws>`, as an
    Authorization header would carry it, is a 401 like any malformed assertion, and the log
    names the prefix so an operator sees the mistake."""
    client = daemon.client()
    token = client.mint(generation=1, attempt_id="attempt-bearer", ack_floor=0)
    error = await rejected(client, generation=1, attempt_id="attempt-bearer", assertion=f"Bearer {token}")
    assert (error.status, error.error) == (401, "invalid_authority")
    assert error.header("www-authenticate") == 'Bearer error="invalid_token"'
    refusals = [line for line in log_lines() if line.get("event") == "upgrade.rejected"]
    assert [line["detail"] for line in refusals] == [BEARER_PREFIX_DETAIL]
    async with client.connect(generation=1, attempt_id="attempt-bearer", assertion=token):
        pass  # the same token alone is taken: nothing of it was used by the refusal


async def test_row6_bound_to_another_session(daemon, transport):
    first = daemon.client(endpoint_of(daemon, transport), session_id="session-a")
    async with first.connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
    second = daemon.client(endpoint_of(daemon, transport), session_id="session-b")
    error = await rejected(second, generation=5)
    assert (error.status, error.error) == (409, "session_mismatch")


async def test_row7_ack_floor_ahead(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    error = await rejected(client, ack_floor=1)
    assert (error.status, error.error) == (409, "ack_floor_ahead")


async def test_row8_stale_generation(daemon, transport):
    client = daemon.client(endpoint_of(daemon, transport))
    async with client.connect(generation=7):
        pass
    error = await rejected(client, generation=6)
    assert (error.status, error.error) == (409, "stale_generation")


# --- order: a request failing two checks gets the earlier one -----------------------------


async def test_order_draining_before_headers(daemon):
    daemon.supervisor.status.lifecycle = Lifecycle.DRAINING
    error = await rejected(daemon.client(), header_overrides={H.GENERATION_HEADER: "0"})
    daemon.supervisor.status.lifecycle = Lifecycle.SERVING
    assert error.error == "draining"


async def test_order_headers_before_identity(daemon):
    daemon.layout.sandbox_id_file.write_text("")
    error = await rejected(daemon.client(), header_overrides={H.EVENT_ACK_HEADER: "-1"})
    assert error.error == "invalid_routing_headers"


async def test_order_identity_before_mismatch(daemon):
    daemon.layout.sandbox_id_file.write_text("")
    error = await rejected(daemon.client(sandbox_id="sbx-other"))
    assert error.error == "sandbox_identity_unavailable"


async def test_order_sandbox_mismatch_before_authority(daemon):
    error = await rejected(daemon.client(sandbox_id="sbx-other"), assertion=None)
    assert error.error == "sandbox_mismatch"


async def test_order_authority_before_session_mismatch(daemon):
    async with daemon.client(session_id="session-a").connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
    error = await rejected(daemon.client(session_id="session-b"), generation=9, assertion=None)
    assert error.error == "invalid_authority"


async def test_order_session_mismatch_before_ack_floor(daemon):
    async with daemon.client(session_id="session-a").connect() as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
    error = await rejected(daemon.client(session_id="session-b"), generation=9, ack_floor=50)
    assert error.error == "session_mismatch"


async def test_order_ack_floor_before_stale_generation(daemon):
    client = daemon.client()
    async with client.connect(generation=4):
        pass
    error = await rejected(client, generation=2, ack_floor=3)
    assert error.error == "ack_floor_ahead"


async def test_rejected_upgrade_records_nothing(daemon):
    client = daemon.client()
    async with client.connect(generation=2, attempt_id="kept"):
        pass
    token = client.mint(generation=3, attempt_id="a-3", ack_floor=9)
    await rejected(client, generation=3, attempt_id="a-3", ack_floor=9, assertion=token)
    assert fence(daemon) == (2, "kept")
    # The jti of the refused attempt was not burnt: the same token's jti is not in the cache.
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert not daemon.supervisor.store.upgrade_state(claims["jti"], time.time()).jti_seen


# --- the assertion matrix, over the wire --------------------------------------------------


def _claims(client, generation=1, attempt="a-1", **overrides):
    claims = client.authority.claims_for(
        sandbox_id=client.sandbox_id,
        session_id=client.session_id,
        session_sandbox_id=client.session_sandbox_id,
        generation=generation,
        attempt_id=attempt,
        ack_floor=0,
    )
    for name, value in overrides.items():
        if value is OMIT:
            claims.pop(name, None)
        else:
            claims[name] = value
    return claims


def _now():
    return int(time.time())


BAD_TOKENS = {
    "alg-none": lambda c: forge.forge_alg_none(_claims(c)),
    "hs256-with-public-key": lambda c: forge.forge_hs256_with_public_key(c.authority, _claims(c)),
    "es384": lambda c: forge.forge_es384(_claims(c), c.authority.kid),
    "rs256": lambda c: forge.forge_rs256(_claims(c), c.authority.kid),
    "missing-kid": lambda c: forge.strip_kid(c.authority, _claims(c)),
    "unknown-kid": lambda c: LoopbackAuthority(kid="unknown-kid").mint(_claims(c)),
    "tampered-payload": lambda c: forge.tamper_payload(c.authority.mint(_claims(c)), scope="shell:exec"),
    "der-signature": lambda c: forge.forge_der_signature(c.authority, _claims(c)),
    "expired-beyond-leeway": lambda c: c.authority.mint(_claims(c, iat=_now() - 200, exp=_now() - 31)),
    "nbf-in-future": lambda c: c.authority.mint(_claims(c, nbf=_now() + 60)),
    "iat-in-future": lambda c: c.authority.mint(_claims(c, iat=_now() + 60, exp=_now() + 120)),
    "lifetime-over-max": lambda c: c.authority.mint(_claims(c, iat=_now(), exp=_now() + 301)),
    "wrong-iss": lambda c: c.authority.mint(_claims(c, iss="https://evil.example")),
    "wrong-aud": lambda c: c.authority.mint(_claims(c, aud="someone-else")),
    "aud-list-without-ours": lambda c: c.authority.mint(_claims(c, aud=["a", "b"])),
    "sandbox-id-differs": lambda c: c.authority.mint(_claims(c, sandbox_id="sbx-other")),
    "session-id-differs": lambda c: c.authority.mint(_claims(c, session_id="session-other")),
    "session-sandbox-id-differs": lambda c: c.authority.mint(_claims(c, session_sandbox_id="other")),
    "generation-differs": lambda c: c.authority.mint(_claims(c, connection_generation=2)),
    "attempt-differs": lambda c: c.authority.mint(_claims(c, connection_attempt_id="a-other")),
    "ack-floor-differs": lambda c: c.authority.mint(_claims(c, event_ack_floor=1)),
    "missing-scope": lambda c: c.authority.mint(_claims(c, scope=OMIT)),
    "not-a-jws": lambda c: "definitely.not.a-token",
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
async def test_invalid_assertions_are_401(daemon, transport, case):
    client = daemon.client(endpoint_of(daemon, transport))
    token = BAD_TOKENS[case](client)
    error = await rejected(client, generation=1, attempt_id="a-1", assertion=token)
    assert (error.status, error.error) == (401, "invalid_authority")
    assert fence(daemon) == (0, None)


GOOD_TOKENS = {
    "expired-within-leeway": lambda c: c.authority.mint(_claims(c, iat=_now() - 100, exp=_now() - 10)),
    "lifetime-exactly-max": lambda c: c.authority.mint(_claims(c, iat=_now(), exp=_now() + 300)),
    "aud-list-with-ours": lambda c: c.authority.mint(_claims(c, aud=["other", "sandbox-supervisor"])),
    "nbf-within-leeway": lambda c: c.authority.mint(_claims(c, nbf=_now() + 10)),
}


@pytest.mark.parametrize("case", sorted(GOOD_TOKENS))
async def test_valid_edge_assertions_are_admitted(daemon, case):
    client = daemon.client()
    async with client.connect(generation=1, attempt_id="a-1", assertion=GOOD_TOKENS[case](client)):
        pass
    assert fence(daemon) == (1, "a-1")


async def test_replayed_jti_is_refused_before_and_after_restart(layout):
    async with in_process_daemon(layout) as daemon:
        client = daemon.client()
        token = client.mint(generation=1, attempt_id="a-1", ack_floor=0)
        async with client.connect(generation=1, attempt_id="a-1", assertion=token):
            pass
        # Same generation and attempt would pass the fence: only the jti cache refuses it.
        error = await rejected(client, generation=1, attempt_id="a-1", assertion=token)
        assert error.error == "invalid_authority"
    async with in_process_daemon(layout) as daemon:
        error = await rejected(daemon.client(), generation=1, attempt_id="a-1", assertion=token)
        assert (error.status, error.error) == (401, "invalid_authority")


async def test_jwks_rotation_by_rewriting_the_file(daemon):
    old = daemon.layout.authority
    new = LoopbackAuthority(kid="rotated-key", issuer=old.issuer)
    client_old = daemon.client()
    client_new = daemon.client()
    client_new.authority = new
    # During the rotation both keys are listed: both are accepted.
    daemon.layout.jwks_file.write_text(json.dumps(combine_jwks(old, new)))
    async with client_new.connect(generation=1):
        pass
    async with client_old.connect(generation=2):
        pass
    # The old key is removed: its tokens are refused, the new key's accepted.
    daemon.layout.jwks_file.write_text(json.dumps(new.jwks()))
    error = await rejected(client_old, generation=3)
    assert error.error == "invalid_authority"
    async with client_new.connect(generation=3):
        pass


async def test_bad_jwks_on_reload_keeps_previous_keys(daemon):
    """A rewritten key file that is refused (it holds a private key) leaves the previous key
    set in force: the old key still verifies, and the refused file's key does not."""
    old = daemon.layout.authority
    other = LoopbackAuthority(kid="refused-key", issuer=old.issuer)
    daemon.layout.jwks_file.write_text(json.dumps({"keys": [other.signing_jwk()]}))
    async with daemon.client().connect(generation=1):
        pass  # still verified with the previous key set
    client_other = daemon.client()
    client_other.authority = other
    error = await rejected(client_other, generation=2)
    assert (error.status, error.error) == (401, "invalid_authority")


async def test_jwks_with_private_key_refused_at_start(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    layout.jwks_file.write_text(json.dumps({"keys": [authority.signing_jwk()]}))
    async with running_daemon(layout, wait_ready=False) as process:
        assert await process.wait(timeout=15) == 2
    assert "jwks" in process.log_text().lower()


async def test_sighup_reloads_keys(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        new = LoopbackAuthority(kid="after-hup", issuer=authority.issuer)
        # Same size, same mtime second: a change only SIGHUP is sure to notice.
        layout.jwks_file.write_text(json.dumps(new.jwks()))
        import signal as _signal

        process.send_signal(_signal.SIGHUP)
        with trio.fail_after(10):
            while not any(
                e.get("event") == "jwks.reloaded" and e.get("reason") == "sighup"
                for e in process.log_events()
            ):
                await trio.sleep(0.02)
        client = process.running.client()
        client.authority = new
        async with client.connect():
            pass
    assert process.returncode == 0


async def test_upgrade_decisions_are_logged_without_the_assertion(tmp_path, authority):
    layout = make_layout(tmp_path / "d", authority=authority)
    async with running_daemon(layout) as process:
        client = process.running.client()
        token = client.mint(generation=1, attempt_id="a-1", ack_floor=0)
        async with client.connect(generation=1, attempt_id="a-1", assertion=token):
            pass
        await rejected(client, generation=1, attempt_id="a-1", assertion=token)
    assert process.returncode == 0
    events = process.log_events()
    accepted = [e for e in events if e.get("event") == "upgrade.accepted"]
    refused = [e for e in events if e.get("event") == "upgrade.rejected"]
    assert accepted and accepted[0]["session_id"] == "session-1" and accepted[0]["generation"] == 1
    assert refused and refused[0]["error"] == "invalid_authority"
    assert token not in process.log_text()
    assert token.split(".")[2] not in process.log_text()


async def test_an_upgrade_the_store_cannot_record_is_500_and_moves_nothing(daemon):
    """The database refuses the admitted attempt's record (a real sqlite error: the daemon's
    own connection made read-only): 500 state_unavailable, and neither the fence nor the jti
    cache moved, so the client can try again once the database takes writes."""
    store = daemon.supervisor.store
    before = fence(daemon)
    client = daemon.client()
    store._conn.execute("PRAGMA query_only = ON")
    try:
        refusal = await rejected(client, generation=1, attempt_id="attempt-1")
    finally:
        store._conn.execute("PRAGMA query_only = OFF")
    assert (refusal.status, refusal.error) == (500, "state_unavailable")
    assert fence(daemon) == before and daemon.supervisor.status.admissions == 0
    async with client.connect(generation=1, attempt_id="attempt-1") as session:
        await session.bootstrap(cwd=str(daemon.layout.workspace))
    assert fence(daemon) == (1, "attempt-1")


def _upgrade_head(client: ControlClient, generation: int, attempt_id: str):
    from sandbox_supervisor.daemon.edge.http_front import HeadReader

    token = client.mint(generation=generation, attempt_id=attempt_id, ack_floor=0)
    headers = client.routing_headers(generation=generation, attempt_id=attempt_id, ack_floor=0, assertion=token)
    lines = [
        b"GET /v1/control HTTP/1.1", b"Host: localhost", b"Upgrade: websocket", b"Connection: Upgrade",
        b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        *(name.encode() + b": " + value.encode() for name, value in headers),
    ]
    head = HeadReader().feed(b"\r\n".join(lines) + b"\r\n\r\n")
    assert head is not None
    return head


@pytest.mark.parametrize(
    "second_writer, status, code",
    [("same_jti", 401, "invalid_authority"), ("newer_fence", 409, "stale_generation")],
)
def test_a_store_refusal_of_the_record_answers_as_the_gate_would(tmp_path, authority, second_writer, status, code):
    """The store re-checks the jti and the fence inside the transaction that records them.
    Its refusals are the peer's doing (StoreRefusal, not StoreError): 401 or 409 as the gate
    would answer, never a 500. Reached with the real store by letting a second writer record
    between the gate's decision and its record."""
    from sandbox_supervisor.protocol.authority import VerifierSettings
    from sandbox_supervisor.daemon.auth.admission import UpgradeAdmission
    from sandbox_supervisor.daemon.auth.identity import SandboxIdentity
    from sandbox_supervisor.daemon.auth.keyring import KeyRing
    from sandbox_supervisor.daemon.state.store import StateStore
    from sandbox_supervisor.daemon.status import DaemonStatus

    layout = make_layout(tmp_path / "d", authority=authority)
    client = ControlClient(Endpoint(unix=str(tmp_path / "unused.sock")), authority, sandbox_id=layout.sandbox_id)
    head = _upgrade_head(client, 3, "attempt-3")
    with StateStore.open(layout.state_dir) as store:
        daemon_status = DaemonStatus(version="test", session=None, fence_generation=0)
        admission = UpgradeAdmission(
            store=store,
            keyring=KeyRing(layout.jwks_file),
            identity=SandboxIdentity(layout.sandbox_id_file, {}),
            status=daemon_status,
            verifier=VerifierSettings(issuer=authority.issuer, audience=authority.audience),
        )
        real_record = store.record_upgrade

        def second_writer_first(**record: Any) -> None:
            if second_writer == "same_jti":
                real_record(**record)  # the same assertion, recorded by someone else first
            else:
                real_record(**{**record, "generation": record["generation"] + 1, "jti": "another"})
            real_record(**record)

        store.record_upgrade = second_writer_first  # type: ignore[method-assign]
        decision = admission.admit(head)
        fenced = store.snapshot().fence_generation
    assert (decision.status, decision.code) == (status, code)
    assert daemon_status.admissions == 0 and daemon_status.fence_generation == 0  # nothing admitted here
    assert fenced == (3 if second_writer == "same_jti" else 4)  # only the second writer's record


async def test_an_admitted_upgrade_is_logged_once_its_101_is_written(daemon, log_lines, monkeypatch):
    """The admission's line is written after the 101 (the client's next step waits for the
    101, not for the log): a 101 the socket refuses leaves no `upgrade.accepted`, and the
    failure's line names the attempt, whose fence the record already moved."""
    from sandbox_supervisor.daemon.edge import server

    real_send_all = server.StreamIO.send_all
    refused = []

    async def send_all(self, data, before_wait=None):
        if data.startswith(b"HTTP/1.1 101") and not refused:
            refused.append(data)
            raise trio.BrokenResourceError("the 101 could not be written")
        await real_send_all(self, data, before_wait)

    monkeypatch.setattr(server.StreamIO, "send_all", send_all)
    client = daemon.client()
    token = client.mint(generation=1, attempt_id="attempt-lost-101", ack_floor=0)
    routing = client.routing_headers(generation=1, attempt_id="attempt-lost-101", ack_floor=0, assertion=token)
    head = (
        f"GET {client.path} HTTP/1.1\r\nHost: {client.endpoint.host_header}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in routing)
        + "\r\n"
    )
    stream = await client.endpoint.open_stream()
    with trio.fail_after(10):
        await stream.send_all(head.encode("latin-1"))
        assert await stream.receive_some() == b""  # closed with no answer
    await stream.aclose()
    assert refused
    assert fence(daemon) == (1, "attempt-lost-101")  # admitted and recorded before the 101
    lines = log_lines()
    assert not [line for line in lines if line.get("event") == "upgrade.accepted"]
    [failed] = [line for line in lines if line.get("event") == "websocket.handshake_failed"]
    assert (failed["session_id"], failed["generation"], failed["attempt_id"]) == ("session-1", 1, "attempt-lost-101")
    async with client.connect(generation=2, attempt_id="attempt-next"):
        pass
    accepted = [line for line in log_lines() if line.get("event") == "upgrade.accepted"]
    assert [(line["generation"], line["attempt_id"]) for line in accepted] == [(2, "attempt-next")]
