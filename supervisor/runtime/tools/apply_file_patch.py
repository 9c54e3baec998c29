"""apply_file_patch (docs/protocol.md §7.5), and its crash recovery (§10.2).

The decisions live in `paths` and `patch`; this module sequences them with the idempotency
record: the planned result is recorded *before* the write, so after a crash the daemon can
tell "written" from "not written" by the file's sha alone.

The patch runs in a worker thread holding a token of `ToolServices.patch_limiter`, its own,
so reads filling theirs cannot delay it. It is *not* abandoned when the call is cancelled
(unlike a read): the thread records the planned result and then replaces the file, and an
abandoned thread would go on doing so after the call was reported cut short and after
`file_write_lock` was released, so a second patch of the same file could plan against the
old base while the first still writes, and the journal would say "interrupted" of a patch
that was applied. Waiting is bounded instead: the file is at most `[files] max_file_bytes`.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
import trio

from sandbox_supervisor.protocol.tools import ApplyFilePatchParams, tool_spec
from sandbox_supervisor.daemon.runtime.failures import ToolFailure, os_failure
from sandbox_supervisor.daemon.runtime.patch import commit_patch, current_sha, plan_patch, recover_patch, remove_leftover_temps
from sandbox_supervisor.daemon.runtime.paths import READ_FLAGS, open_in_jail
from sandbox_supervisor.daemon.runtime.tool import (
    Recovered,
    RecoveryEnv,
    RunningCall,
    Tool,
    ToolServices,
    interrupted,
    result_body,
)
from sandbox_supervisor.daemon.state.store import CallRecord

log = structlog.get_logger("supervisor.recovery")

NAME = "apply_file_patch"
FILE_CHANGED_MESSAGE = "The supervisor stopped while applying the patch, and the file has changed since."


def bind(services: ToolServices) -> Tool:
    async def run(running: RunningCall) -> dict[str, Any]:
        return await apply(running, services)

    return Tool(tool_spec(NAME), run=run)


async def apply(running: RunningCall, services: ToolServices) -> dict[str, Any]:
    params = running.call.parameters
    assert isinstance(params, ApplyFilePatchParams)
    ctx = running.context
    root = services.roots.get(ctx.cwd)
    # Walked once here too, so a refusal comes before the lock and the thread, and the view
    # (who may see the result, docs/protocol.md §9.1) is known even if the call is cut short
    # while it waits; the walk in the thread is the one the write uses.
    try:
        with open_in_jail(root, params.path, ctx.allowed_paths, READ_FLAGS) as early:
            running.view_path = str(early.real_path)
    except OSError as exc:
        raise os_failure(exc, "written") from None
    key = running.key
    store = services.store

    def plan_record_commit() -> dict[str, Any]:
        # One worker-thread hop for the whole patch (walk, reads, hashes, fsyncs): the planned
        # result is recorded with the pending call before the write, as recovery needs. The
        # jail's descriptors stay open from the walk to the rename (paths.py).
        with open_in_jail(root, params.path, ctx.allowed_paths, READ_FLAGS) as target:
            running.view_path = str(target.real_path)
            plan = plan_patch(target, params.path, params, max_file_bytes=services.max_file_bytes)
            result = plan.result()
            if key is not None:
                # One transaction: the plan joins the intent begin_call recorded.
                store.add_call_intent(key, {"target": str(plan.path), "result": result})
            commit_patch(plan, max_file_bytes=services.max_file_bytes, new_owner=services.file_owner)
            return result

    async with services.file_write_lock:
        try:
            # abandon_on_cancel stays False: see the module's docstring.
            return await trio.to_thread.run_sync(
                plan_record_commit, limiter=services.patch_limiter, abandon_on_cancel=False
            )
        except OSError as exc:
            # Refused by the file system while reading or writing (the atomic write leaves
            # the old file in place): a typed answer, not a crash.
            raise os_failure(exc, "written") from None


def recover(record: CallRecord, env: RecoveryEnv) -> Recovered:
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

    view_path: str | None = None  # once the walk found the file: who may see the result

    def body(**outcome: Any) -> Recovered:
        return Recovered(result_body(record.call_id, record.key, record.tool_name, **outcome), view_path=view_path)

    try:
        # The file is found again through the jail (agent.cwd's descriptor, the path walked
        # anew), never by the recorded real path ("target", kept for people reading the
        # journal): the agent may have swapped a component for a symlink since.
        root = env.roots.get(intent["cwd"])
        with open_in_jail(root, params.path, tuple(allowed) if allowed is not None else None, READ_FLAGS) as target:
            view_path = str(target.real_path)
            # A kill between the temp file's creation and its rename left it beside the
            # target (visible in the agent's `git status`): this call's, so ours to remove.
            if removed := remove_leftover_temps(target, older_than=env.started_at):
                log.info("recovery.leftovers_removed", where="workspace", files=removed, call_id=record.call_id)
            planned = intent.get("result")
            if planned is not None:
                now = current_sha(target, max_file_bytes=env.max_file_bytes)
                decision = recover_patch(now, planned["old_sha"], planned["new_sha"])
                if decision == "applied":
                    return body(result=planned)
                if decision == "interrupted":
                    return body(error=interrupted(FILE_CHANGED_MESSAGE, current_sha=now))
            plan = plan_patch(target, params.path, params, max_file_bytes=env.max_file_bytes)
            env.store.set_call_intent(record.call_key, json.dumps({**intent, "target": str(plan.path), "result": plan.result()}))
            commit_patch(plan, max_file_bytes=env.max_file_bytes, new_owner=env.file_owner)
            return body(result=plan.result())
    except ToolFailure as failure:
        return body(error=failure.to_error())
