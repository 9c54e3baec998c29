"""`apply_file_patch` and `read_file` as tools of the CallRunner, and the crash recovery of
patches (docs/protocol.md §7.3, §7.5, §10.2).

The decisions live in `paths`, `patch` and `files`; this module sequences them with the
idempotency record: the planned result is recorded *before* the write, so after a crash
the daemon can tell "written" from "not written" by the file's sha alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.tools import ApplyFilePatchParams, ReadFileParams
from sandbox_supervisor.daemon.runtime.calls import CallRunner, RunningCall, failure_error, result_body
from sandbox_supervisor.daemon.runtime.failures import ToolFailure, os_failure
from sandbox_supervisor.daemon.runtime.files import read_file_result
from sandbox_supervisor.daemon.runtime.patch import commit_patch, current_sha, plan_patch, recover_patch
from sandbox_supervisor.daemon.runtime.paths import resolve_in_jail
from sandbox_supervisor.daemon.state.store import CallRecord, StateStore

# Hashing a file is the slow part of read_file; below this size it is cheaper to do it on
# the trio thread than to pay for a worker-thread hop (~50-100 µs).
INLINE_READ_MAX_BYTES = 1024 * 1024


async def apply_file_patch(running: RunningCall, runner: CallRunner) -> dict[str, Any]:
    params = running.call.parameters
    assert isinstance(params, ApplyFilePatchParams)
    ctx = running.context
    target = resolve_in_jail(ctx.cwd, params.path, ctx.allowed_paths)
    key = running.key

    def plan_record_commit() -> dict[str, Any]:
        # One worker-thread hop for the whole patch (reads, hashes, fsyncs): the planned
        # result is recorded with the pending call before the write, as recovery needs.
        plan = plan_patch(target, params.path, params)
        if key is not None:
            record = runner.store.call_record(key)
            intent = json.loads(record.intent_json or "{}") if record else {}
            intent.update({"target": str(plan.path), "result": plan.result()})
            runner.store.set_call_intent(key, json.dumps(intent))
        commit_patch(plan)
        return plan.result()

    async with runner.file_write_lock:
        try:
            return await trio.to_thread.run_sync(plan_record_commit)
        except OSError as exc:
            # Refused by the file system while reading or writing (the atomic write leaves
            # the old file in place): a typed answer, not a crash.
            raise os_failure(exc, "written") from None


def read_file_now(running: RunningCall, runner: CallRunner) -> dict[str, Any] | None:
    """read_file's fast path, run by the CallRunner in the socket's own task: the result of a
    small file at once (or its typed failure), None for a file worth a worker thread."""
    target, params = _read_target(running)
    return _read_if_small(target, params)


async def read_file(running: RunningCall, runner: CallRunner) -> dict[str, Any]:
    target, params = _read_target(running)
    result = _read_if_small(target, params)  # the file shrank since the fast path passed it on
    if result is not None:
        return result
    return await trio.to_thread.run_sync(read_file_result, target, params.path, params)


def _read_target(running: RunningCall) -> tuple[Path, ReadFileParams]:
    params = running.call.parameters
    assert isinstance(params, ReadFileParams)
    ctx = running.context
    return resolve_in_jail(ctx.cwd, params.path, ctx.allowed_paths), params


def _read_if_small(target: Path, params: ReadFileParams) -> dict[str, Any] | None:
    try:
        size = os.stat(target).st_size
    except OSError:
        size = 0  # read_file_result reports the precise error
    if size <= INLINE_READ_MAX_BYTES:
        return read_file_result(target, params.path, params)
    return None


def register(runner: CallRunner) -> None:
    runner.register("apply_file_patch", apply_file_patch)
    runner.register("read_file", read_file, inline=read_file_now)


# --- crash recovery -------------------------------------------------------------------------


def interrupted(message: str, **details: Any) -> dict[str, Any]:
    return {"code": errors.INTERRUPTED, "message": message, **details}


def recover_patch_call(record: CallRecord, store: StateStore) -> dict[str, Any]:
    """The tool.result body that completes a patch left pending by a crash.

    - the planned result was recorded: the file's sha says whether the write happened
      (new sha → applied; base sha → apply now; anything else → interrupted);
    - no plan was recorded: nothing was written yet, so the call is carried out now, with the
      same base_sha guard a fresh call has — and, as on the live path, the plan is recorded
      before the write, so a crash during this recovery is recovered by the first rule.
    """
    intent = json.loads(record.intent_json or "{}")
    params = ApplyFilePatchParams.model_validate(intent["parameters"])
    allowed = intent.get("allowed_paths")
    try:
        target = resolve_in_jail(intent["cwd"], params.path, tuple(allowed) if allowed is not None else None)
        planned = intent.get("result")
        if planned is not None:
            now = current_sha(Path(intent["target"]))
            decision = recover_patch(now, planned["old_sha"], planned["new_sha"])
            if decision == "applied":
                return result_body(record.call_id, record.key, record.tool_name, result=planned)
            if decision == "interrupted":
                return result_body(
                    record.call_id,
                    record.key,
                    record.tool_name,
                    error=interrupted(
                        "The supervisor stopped while applying the patch, and the file has changed since.",
                        current_sha=now,
                    ),
                )
        plan = plan_patch(target, params.path, params)
        store.set_call_intent(record.key, json.dumps({**intent, "target": str(plan.path), "result": plan.result()}))
        commit_patch(plan)
        return result_body(record.call_id, record.key, record.tool_name, result=plan.result())
    except ToolFailure as failure:
        return result_body(record.call_id, record.key, record.tool_name, error=failure_error(failure))
