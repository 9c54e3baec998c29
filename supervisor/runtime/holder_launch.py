"""Starting a holder (holder.py) for a process: the daemon's side of the launch.

`launch_holder(directory, spec)` writes spec.json, starts the holder detached — its own
session, stdio on /dev/null, no pipe to the daemon, all descriptors closed — and waits, with
a deadline, for holder.json. It blocks (a few tens of milliseconds: an interpreter start);
the daemon calls it from a worker thread.

The process the launcher starts forks the holder and exits once holder.json is written, so
the launcher waits for an exit status, not for a file to appear, and the holder itself is
never the daemon's child (no zombie for the daemon to reap when it ends). Stdlib only, like
the holder.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from sandbox_supervisor.daemon.runtime.holder_protocol import (
    HOLDER_FAILED,
    SPEC_FILE,
    HolderInfo,
    HolderProtocolError,
    HolderSpawnFailed,
    HolderSpec,
    read_holder,
)

__all__ = ["HOLDER_MODULE", "LAUNCH_TIMEOUT_S", "HolderLaunchError", "launch_holder", "launched", "write_spec"]

HOLDER_MODULE = "sandbox_supervisor.daemon.runtime.holder"
# From launch to holder.json: an interpreter start and a fork/exec, ~40 ms when idle; the
# margin is for a machine under load. Past it the launch is abandoned (and the holder killed).
LAUNCH_TIMEOUT_S = 10.0
_DIRECTORY_MODE = 0o700  # the spool's: output may hold secrets
_FILE_MODE = 0o600


class HolderLaunchError(Exception):
    """The holder could not be started or did not report in time. `code`: `holder_exists`
    (the directory already has a spec: a call never runs twice), `holder_failed`,
    `holder_timeout`, or a holder.json error code (`spawn_failed`, `bad_spec` …; then
    nothing ran)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def write_spec(directory: Path, spec: HolderSpec) -> None:
    directory.mkdir(mode=_DIRECTORY_MODE, parents=True, exist_ok=True)
    try:
        fd = os.open(directory / SPEC_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    except FileExistsError:
        raise HolderLaunchError("holder_exists", f"{directory} already has a {SPEC_FILE}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(spec.to_json(), handle, sort_keys=True)


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Popen.wait with a timeout polls with sleeps that double up to 50 ms, which would add
    tens of milliseconds to every launch; a pidfd wakes this thread as the process exits."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (OSError, AttributeError):  # before Linux 5.3: the polling wait
        return process.wait(timeout=timeout_s)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    if not ready:
        raise subprocess.TimeoutExpired(process.args, timeout_s)
    return process.wait()


def launch_holder(
    directory: str | os.PathLike[str], spec: HolderSpec, *, timeout_s: float = LAUNCH_TIMEOUT_S
) -> HolderInfo:
    """Start the holder of `spec` in `directory`; its holder.json once the process runs.

    HolderLaunchError when nothing runs (with holder.json's code when the holder said why),
    or when the deadline passed (the holder is then killed; see docs/internals.md for the
    narrow case where the process had already started).
    """
    directory = Path(directory).resolve()
    try:
        write_spec(directory, spec)
        starter = subprocess.Popen(
            [sys.executable, "-I", "-m", HOLDER_MODULE, str(directory)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # not in the daemon's session or group: a stop's signals miss it
            cwd="/",
        )
    except OSError as exc:  # the directory cannot be written, no fork (EAGAIN, ENOMEM) …
        raise HolderLaunchError(HOLDER_FAILED, f"cannot start a holder in {directory}: {exc}") from None
    try:
        status = _wait(starter, timeout_s)
    except subprocess.TimeoutExpired:
        # The starter leads the group the holder is in: kill both, so no late holder starts
        # a process the daemon has given up on.
        try:
            os.killpg(starter.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        starter.wait()
        raise HolderLaunchError("holder_timeout", f"no {directory / 'holder.json'} within {timeout_s} s") from None
    return launched(directory, status)


def launched(directory: Path, status: int) -> HolderInfo:
    """What the holder of `directory` reported once its starter ended with `status`: its
    holder.json, or the HolderLaunchError that says why there is none."""
    try:
        info = read_holder(directory)
    except HolderSpawnFailed as exc:
        raise HolderLaunchError(exc.code, exc.message) from None
    except HolderProtocolError as exc:
        raise HolderLaunchError(HOLDER_FAILED, str(exc)) from None
    if info is None:
        raise HolderLaunchError(HOLDER_FAILED, f"the holder ended (status {status}) without writing holder.json")
    return info
