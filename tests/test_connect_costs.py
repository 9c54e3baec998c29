"""What the first upgrade and an idle daemon must not pay (bench/README.md, issue 12 on
connections and memory): work moved to the start, and modules an idle daemon never loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sandbox_supervisor.daemon.state.store import DB_FILENAME, StateStore


def test_the_store_starts_its_wal_when_it_opens(tmp_path: Path) -> None:
    # The first commit into a new WAL writes and fsyncs its header. Opening the store makes
    # that commit, so the first upgrade's fence-and-jti commit (before its 101) does not.
    store = StateStore.open(tmp_path / "state")
    try:
        wal = tmp_path / "state" / f"{DB_FILENAME}-wal"
        assert wal.stat().st_size > 0
        assert store.snapshot().fence_generation == 0  # the start left no row behind
    finally:
        store.close()


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_verifier_loads_the_ecdsa_backend_at_import_and_no_jose_library() -> None:
    # The backend is what `ECDSA()` imports lazily (~2 ms): at import, not in the first upgrade.
    # A JOSE library (and the X.509 code it pulls in) would cost an idle daemon ~2 MiB.
    loaded = _modules_after("import sandbox_supervisor.protocol.authority")
    assert "cryptography.hazmat.backends.openssl.backend" in loaded
    assert not {name for name in loaded if name.split(".")[0] == "joserfc"}
    assert "cryptography.x509" not in loaded
