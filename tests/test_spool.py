"""The output spool (docs/protocol.md §7.4.6): every byte kept up to a cap, paged back exactly."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_supervisor.daemon.runtime import spool as spool_module
from sandbox_supervisor.daemon.runtime.spool import (
    SpoolNotFound,
    SpoolPage,
    SpoolWriter,
    StreamState,
    read_range,
    read_state,
    remove_spool,
    seal_stream,
    spool_dir,
    stream_path,
)

CALL_ID = "0b7f5d4e-8a43-4c6e-9a55-2f1f3d0c9b11"
PAGE = 64 * 1024
REPO_ROOT = Path(__file__).resolve().parents[1]  # so `python -c` imports this checkout
CAP = 64 * 1024 * 1024


@pytest.fixture
def stdout(tmp_path: Path) -> Path:
    return stream_path(tmp_path, CALL_ID, "stdout")


def read_all(path: Path, page: int = PAGE) -> tuple[bytes, list[SpoolPage]]:
    pages, offset = [], 0
    while True:
        got = read_range(path, offset, page)
        pages.append(got)
        offset += len(got.data)
        if got.eof or not got.data:
            return b"".join(p.data for p in pages), pages


def test_the_layout_is_a_directory_per_call(tmp_path: Path) -> None:
    assert spool_dir(tmp_path, CALL_ID) == tmp_path / "spool" / CALL_ID
    assert stream_path(tmp_path, CALL_ID, "stderr") == tmp_path / "spool" / CALL_ID / "stderr"


@pytest.mark.parametrize("call_id", ["../etc", "", "x" * 36, CALL_ID + "\n", "a/b"])
def test_a_call_id_that_is_not_a_uuid_never_becomes_a_path(tmp_path: Path, call_id: str) -> None:
    with pytest.raises(ValueError):
        spool_dir(tmp_path, call_id)


def test_an_unknown_stream_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        stream_path(tmp_path, CALL_ID, "stdin")


def test_five_megabytes_in_random_writes_read_back_exactly(stdout: Path) -> None:
    rng = random.Random(7)
    data = rng.randbytes(5 * 1024 * 1024)
    writer = SpoolWriter(stdout, CAP)
    position = 0
    while position < len(data):
        size = rng.choice([1, 7, 512, 4096, 65536, 200_000])
        piece = data[position : position + size]
        assert writer.write(piece) == len(piece)
        position += size
    writer.close()
    assert (writer.size, writer.total, writer.truncated) == (len(data), len(data), False)
    back, pages = read_all(stdout)
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    assert all(len(p.data) == PAGE for p in pages[:-1])
    assert [p.eof for p in pages] == [False] * (len(pages) - 1) + [True]
    assert not any(p.truncated for p in pages)


def test_bytes_past_the_cap_are_counted_not_kept(stdout: Path) -> None:
    writer = SpoolWriter(stdout, cap_bytes=10)
    assert writer.write(b"0123456") == 7
    assert not writer.truncated
    assert writer.write(b"789abc") == 3
    assert writer.write(b"more") == 0
    assert (writer.size, writer.total, writer.truncated) == (10, 17, True)
    assert stdout.read_bytes() == b"0123456789"
    writer.close()
    page = read_range(stdout, 0, 100)
    assert page == SpoolPage(data=b"0123456789", eof=True, truncated=True)
    assert read_state(stdout) == StreamState(ended=True, total=17, kept=10, truncated=True)


def test_a_reader_sees_truncated_while_the_stream_still_runs(stdout: Path) -> None:
    writer = SpoolWriter(stdout, cap_bytes=4)
    writer.write(b"abcdef")
    page = read_range(stdout, 0, 10)
    assert page == SpoolPage(data=b"abcd", eof=False, truncated=True)


def test_exactly_the_cap_is_not_truncated(stdout: Path) -> None:
    writer = SpoolWriter(stdout, cap_bytes=4)
    writer.write(b"abcd")
    writer.close()
    assert read_range(stdout, 0, 10) == SpoolPage(b"abcd", eof=True, truncated=False)


def test_eof_only_once_the_stream_has_ended(stdout: Path) -> None:
    writer = SpoolWriter(stdout, CAP)
    writer.write(b"hello")
    assert read_range(stdout, 0, 100) == SpoolPage(b"hello", eof=False, truncated=False)
    assert read_range(stdout, 5, 100) == SpoolPage(b"", eof=False, truncated=False)
    writer.close()
    assert read_range(stdout, 0, 100) == SpoolPage(b"hello", eof=True, truncated=False)
    assert read_range(stdout, 5, 100) == SpoolPage(b"", eof=True, truncated=False)


def test_eof_only_when_the_page_reaches_the_end(stdout: Path) -> None:
    writer = SpoolWriter(stdout, CAP)
    writer.write(b"0123456789")
    writer.close()
    assert read_range(stdout, 0, 4) == SpoolPage(b"0123", eof=False, truncated=False)
    assert read_range(stdout, 4, 6) == SpoolPage(b"456789", eof=True, truncated=False)
    assert read_range(stdout, 8, 100) == SpoolPage(b"89", eof=True, truncated=False)
    assert read_range(stdout, 50, 100) == SpoolPage(b"", eof=True, truncated=False)


def test_an_empty_stream_that_ended_is_at_eof_at_once(stdout: Path) -> None:
    SpoolWriter(stdout, CAP).close()
    assert read_range(stdout, 0, PAGE) == SpoolPage(b"", eof=True, truncated=False)


def test_reading_while_it_is_written_sees_every_byte_so_far(stdout: Path) -> None:
    writer = SpoolWriter(stdout, CAP)
    written = b""
    offset = 0
    seen = b""
    for round_ in range(50):
        piece = bytes([round_]) * (round_ * 37 % 1000 + 1)
        writer.write(piece)
        written += piece
        page = read_range(stdout, offset, 333)
        assert not page.eof
        seen += page.data
        offset += len(page.data)
        assert written.startswith(seen)
    writer.close()
    rest, _ = read_all_from(stdout, offset)
    assert seen + rest == written


def read_all_from(path: Path, offset: int) -> tuple[bytes, bool]:
    out = b""
    while True:
        page = read_range(path, offset, 333)
        out += page.data
        offset += len(page.data)
        if page.eof:
            return out, True


def test_a_missing_stream_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(SpoolNotFound) as missing:
        read_range(stream_path(tmp_path, CALL_ID, "stderr"), 0, 10)
    assert missing.value.path.name == "stderr"


def test_a_stream_is_written_once(stdout: Path) -> None:
    writer = SpoolWriter(stdout, CAP)
    writer.write(b"x")
    writer.close()
    with pytest.raises(FileExistsError):
        SpoolWriter(stdout, CAP)


def test_an_empty_stream_creates_no_file_and_reads_as_empty(stdout: Path) -> None:
    """Files are created with their first byte (most commands leave a stream empty, and each
    file is a metadata write on the command's path); the call directory still exists."""
    writer = SpoolWriter(stdout, CAP)
    assert not stdout.exists() and stdout.parent.is_dir()
    running = read_range(stdout, 0, 10, writer_alive=True)
    assert (running.data, running.eof) == (b"", False)
    writer.close()
    assert not stdout.exists()
    ended = read_range(stdout, 0, 10)
    assert (ended.data, ended.eof, ended.truncated) == (b"", True, False)


def test_close_is_idempotent_and_writing_after_it_is_a_bug(stdout: Path) -> None:
    writer = SpoolWriter(stdout, CAP)
    writer.write(b"x")
    writer.close()
    writer.close()
    assert writer.closed
    with pytest.raises(ValueError):
        writer.write(b"y")


def test_the_end_survives_the_writer_process(tmp_path: Path) -> None:
    """A writer in another process that closes and is gone: the state is on disk."""
    path = stream_path(tmp_path, CALL_ID, "stdout")
    script = (
        "import sys\n"
        "from sandbox_supervisor.daemon.runtime.spool import SpoolWriter\n"
        "w = SpoolWriter(sys.argv[1], 1 << 20)\n"
        "w.write(b'from another process\\n' * 1000)\n"
        "w.close()\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, cwd=REPO_ROOT)
    data, pages = read_all(path)
    assert data == b"from another process\n" * 1000
    assert pages[-1].eof
    assert read_state(path) == StreamState(ended=True, total=21_000, kept=21_000, truncated=False)


def test_bytes_survive_a_writer_killed_without_closing(tmp_path: Path) -> None:
    """kill -9 of the daemon: the bytes written are readable; seal_stream then ends them."""
    path = stream_path(tmp_path, CALL_ID, "stdout")
    script = (
        "import os, sys\n"
        "from sandbox_supervisor.daemon.runtime.spool import SpoolWriter\n"
        "w = SpoolWriter(sys.argv[1], 1 << 20)\n"
        "w.write(b'partial output')\n"
        "os._exit(137)\n"  # no close, no flush of anything in userspace
    )
    finished = subprocess.run([sys.executable, "-c", script, str(path)], cwd=REPO_ROOT)
    assert finished.returncode == 137
    assert read_range(path, 0, PAGE) == SpoolPage(b"partial output", eof=False, truncated=False)
    state = seal_stream(path)
    assert state == StreamState(ended=True, total=14, kept=14, truncated=False)
    assert read_range(path, 0, PAGE) == SpoolPage(b"partial output", eof=True, truncated=False)
    assert seal_stream(path) == state  # idempotent


def test_sealing_keeps_a_truncation_and_its_total(stdout: Path) -> None:
    writer = SpoolWriter(stdout, cap_bytes=3)
    writer.write(b"abcdef")  # the writer then dies without close
    state = seal_stream(stdout)
    assert state == StreamState(ended=True, total=6, kept=3, truncated=True)
    assert read_range(stdout, 0, 10) == SpoolPage(b"abc", eof=True, truncated=True)


def test_sealing_a_stream_that_never_started_makes_it_empty_and_ended(stdout: Path) -> None:
    assert seal_stream(stdout) == StreamState(ended=True, total=0, kept=0, truncated=False)
    assert read_range(stdout, 0, 10) == SpoolPage(b"", eof=True, truncated=False)


def test_the_state_file_is_small_json_replaced_atomically(stdout: Path) -> None:
    writer = SpoolWriter(stdout, CAP)
    writer.write(b"abc")
    writer.close()
    state_file = stdout.with_name("stdout.state")
    assert json.loads(state_file.read_text()) == {
        "ended": True,
        "total": 3,
        "kept": 3,
        "truncated": False,
    }
    leftovers = [p.name for p in stdout.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_a_disk_error_truncates_the_stream_without_raising(
    stdout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SpoolWriter(stdout, CAP)
    writer.write(b"kept")
    real_write = os.write

    def full_disk(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(spool_module.os, "write", full_disk)
    assert writer.write(b"lost") == 0
    monkeypatch.setattr(spool_module.os, "write", real_write)
    assert writer.write(b"also lost") == 0  # no more bytes once the disk refused one
    writer.close()
    assert writer.write_error == os.strerror(errno.ENOSPC)
    assert (writer.size, writer.total, writer.truncated) == (4, 17, True)
    assert read_range(stdout, 0, 100) == SpoolPage(b"kept", eof=True, truncated=True)


def test_a_partial_write_keeps_what_reached_the_file(
    stdout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SpoolWriter(stdout, CAP)
    real_write = os.write
    calls = []

    def short_then_full(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:3]))
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(spool_module.os, "write", short_then_full)
    assert writer.write(b"abcdef") == 3
    monkeypatch.setattr(spool_module.os, "write", real_write)
    writer.close()
    assert stdout.read_bytes() == b"abc" and writer.truncated
    assert calls == [6, 3]  # the rest was retried once, then given up


def test_remove_spool_deletes_the_call_and_is_idempotent(tmp_path: Path) -> None:
    for stream in ("stdout", "stderr"):
        writer = SpoolWriter(stream_path(tmp_path, CALL_ID, stream), CAP)
        writer.write(b"x")
        writer.close()
    other = "1b7f5d4e-8a43-4c6e-9a55-2f1f3d0c9b11"
    SpoolWriter(stream_path(tmp_path, other, "stdout"), CAP).close()
    remove_spool(tmp_path, CALL_ID)
    assert not spool_dir(tmp_path, CALL_ID).exists()
    assert spool_dir(tmp_path, other).exists()
    remove_spool(tmp_path, CALL_ID)
    with pytest.raises(SpoolNotFound):
        read_range(stream_path(tmp_path, CALL_ID, "stdout"), 0, 1)


def test_the_spool_is_private_to_the_daemon(stdout: Path) -> None:
    writer = SpoolWriter(stdout, CAP)
    writer.write(b"secret output")
    writer.close()
    assert stdout.stat().st_mode & 0o777 == 0o600
    assert stdout.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize(("offset", "length"), [(-1, 10), (0, -1)])
def test_negative_ranges_are_a_bug(stdout: Path, offset: int, length: int) -> None:
    SpoolWriter(stdout, CAP).close()
    with pytest.raises(ValueError):
        read_range(stdout, offset, length)
