"""read_file (docs/protocol.md §7.3): a byte range as UTF-8 text or base64, the whole file's sha."""

from __future__ import annotations

import base64
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_supervisor.protocol.errors import INVALID_PARAMETERS, NOT_FOUND
from sandbox_supervisor.protocol.tools import ReadFileResult
from sandbox_supervisor.protocol.tools import MAX_READ_LENGTH, ReadFileParams
from sandbox_supervisor.daemon.runtime import files as files_module
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.files import read_file_result
from sandbox_supervisor.daemon.runtime.patch import git_blob_sha


def read(target, offset: int = 0, length: int | None = None) -> dict:
    params = ReadFileParams(path=target.name, offset=offset, length=length)
    result = read_file_result(target, target.name, params)
    ReadFileResult.model_validate(result)
    return result


def content_bytes(result: dict) -> bytes:
    if result["encoding"] == "base64":
        return base64.b64decode(result["content"])
    return result["content"].encode("utf-8")


def test_a_text_file_is_returned_as_utf8(tmp_path):
    data = "héllo wörld\r\nline 2\n".encode()
    target = tmp_path / "t.txt"
    target.write_bytes(data)
    assert read(target) == {
        "path": "t.txt",
        "sha": git_blob_sha(data),
        "size": len(data),
        "offset": 0,
        "length": len(data),
        "encoding": "utf-8",
        "content": "héllo wörld\r\nline 2\n",
        "eof": True,
    }


def test_a_binary_file_is_returned_as_base64(tmp_path):
    data = b"\x00\xff\xfe\x80binary"
    target = tmp_path / "b.bin"
    target.write_bytes(data)
    result = read(target)
    assert result["encoding"] == "base64"
    assert base64.b64decode(result["content"]) == data
    assert result["length"] == len(data) and result["eof"] is True


def test_an_empty_file(tmp_path):
    target = tmp_path / "empty"
    target.write_bytes(b"")
    result = read(target)
    assert result["size"] == 0 and result["length"] == 0 and result["content"] == ""
    assert result["encoding"] == "utf-8" and result["eof"] is True
    assert result["sha"] == git_blob_sha(b"")


def test_paging_returns_every_byte_once_and_eof_only_at_the_end(tmp_path):
    data = bytes(range(256)) * 40 + b"tail"
    target = tmp_path / "p"
    target.write_bytes(data)
    pages, offset = [], 0
    while True:
        result = read(target, offset, 1000)
        assert result["offset"] == offset
        assert result["sha"] == git_blob_sha(data)  # always the whole file's
        assert result["size"] == len(data)
        pages.append(content_bytes(result))
        offset += result["length"]
        assert result["eof"] is (offset == len(data))
        if result["eof"]:
            break
    assert b"".join(pages) == data
    assert [len(page) for page in pages[:-1]] == [1000] * (len(pages) - 1)


def test_the_default_length_is_the_maximum(tmp_path):
    data = b"x" * (MAX_READ_LENGTH + 10)
    target = tmp_path / "big"
    target.write_bytes(data)
    result = read(target)
    assert result["length"] == MAX_READ_LENGTH and result["eof"] is False
    rest = read(target, MAX_READ_LENGTH)
    assert rest["length"] == 10 and rest["eof"] is True


def test_a_range_of_a_text_file_is_text(tmp_path):
    target = tmp_path / "t"
    target.write_bytes(b"abcdef")
    result = read(target, 2, 3)
    assert (result["content"], result["encoding"], result["length"]) == ("cde", "utf-8", 3)
    assert result["eof"] is False and result["sha"] == git_blob_sha(b"abcdef")


def test_a_range_that_splits_a_multibyte_character_is_base64(tmp_path):
    data = "é".encode() * 3  # c3 a9 c3 a9 c3 a9
    target = tmp_path / "t"
    target.write_bytes(data)
    result = read(target, 1, 2)
    assert result["encoding"] == "base64"
    assert base64.b64decode(result["content"]) == data[1:3]


@pytest.mark.parametrize("offset", [6, 7, 10_000])
def test_an_offset_at_or_past_the_end_returns_nothing_and_eof(tmp_path, offset):
    target = tmp_path / "t"
    target.write_bytes(b"abcdef")
    result = read(target, offset)
    assert result["length"] == 0 and result["content"] == "" and result["eof"] is True
    assert result["offset"] == offset and result["size"] == 6


def test_a_missing_file_is_not_found(tmp_path):
    with pytest.raises(ToolFailure) as caught:
        read(tmp_path / "missing")
    assert caught.value.code == NOT_FOUND


def test_a_directory_is_invalid_parameters(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ToolFailure) as caught:
        read(tmp_path / "d")
    assert caught.value.code == INVALID_PARAMETERS and "directory" in caught.value.message


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=64), offset=st.integers(0, 70), length=st.integers(1, 70))
def test_ranges_across_read_chunks_are_exact(tmp_path_factory, data, offset, length):
    # A tiny chunk size makes every range cross chunk boundaries.
    target = tmp_path_factory.mktemp("r") / "f"
    target.write_bytes(data)
    with mock.patch.object(files_module, "READ_CHUNK_BYTES", 7):
        result = read(target, offset, length)
    assert content_bytes(result) == data[offset : offset + length]
    assert result["sha"] == git_blob_sha(data)
    assert result["eof"] is (offset + result["length"] >= len(data))


def test_os_errors_become_typed_failures_with_the_systems_words():
    import errno as errno_module

    from sandbox_supervisor.protocol.errors import INTERNAL, RESOURCE_EXHAUSTED
    from sandbox_supervisor.daemon.runtime.failures import os_failure

    denied = os_failure(PermissionError(errno_module.EACCES, "Permission denied"), "read")
    assert (denied.code, denied.message) == (INTERNAL, "The file could not be read: Permission denied.")
    full = os_failure(OSError(errno_module.ENOSPC, "No space left on device"), "written")
    # A shortage, not the call's fault: its own code, which frees the key.
    assert (full.code, full.message) == (
        RESOURCE_EXHAUSTED,
        "The file could not be written: No space left on device; retry later.",
    )
    assert full.frees_key
    long_name = os_failure(OSError(errno_module.ENAMETOOLONG, "File name too long"), "read")
    assert long_name.code == INVALID_PARAMETERS
