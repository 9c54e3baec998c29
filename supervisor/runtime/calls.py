"""Tool-call dispatch: validation, scopes, idempotency, execution, and the one tool.result.

Calls belong to the session, not to the socket that sent them: they run in the daemon-wide
`calls` nursery, so a call started on a socket that is later superseded still finishes and
its result reaches the next socket through the journal.
"""

from __future__ import annotations

import enum
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from sandbox_supervisor.protocol import errors
from sandbox_supervisor.protocol.frames import (
    STALE_FRAME_MESSAGE,
    ErrorBody,
    ErrorFrame,
    ToolPendingBody,
    ToolPendingFrame,
    encode_frame,
    encode_replayed,
)
from sandbox_supervisor.protocol.tools import ToolCall, ToolCallError, call_digest, is_call_id, parse_tool_call
from sandbox_supervisor.daemon.runtime.failures import ToolFailure
from sandbox_supervisor.daemon.runtime.tool import (
    CallContext,
    RunningCall,
    SendReply,
    Tool,
    result_body,
)
from sandbox_supervisor.daemon.state.journal import Journal
from sandbox_supervisor.daemon.state.keys import OWNER_SPACE, CallKey
from sandbox_supervisor.daemon.state.store import CallRecord, JournalRow, StateStore, StoreError
from sandbox_supervisor.daemon.runtime.audience import audience_for
from sandbox_supervisor.daemon.runtime.paths import WorkspaceRoots
from sandbox_supervisor.daemon.state.visibility import (
    PUBLIC,
    EventView,
    call_result_view,
    commands_origin,
    is_path_bound,
    result_view,
    visible,
)
from sandbox_supervisor.daemon.telemetry import Telemetry

__all__ = ["CallContext", "CallRunner", "Outcome", "RunningCall", "SendReply", "error_frame", "idempotency_outcome"]

log = structlog.get_logger("supervisor.calls")

# Refusals that happen before any side effect and for a reason that passes: the key is
# freed with the result, so the same call can be retried with the same key later.
TRANSIENT_REFUSALS = frozenset({errors.TOO_MANY_PROCESSES, errors.RESOURCE_EXHAUSTED, errors.SUPERVISOR_STOPPING})

# Calls accepted and not yet finished. Results are journaled, not replied, so nothing else
# slows a client that pipelines calls; past this many the socket's reader waits for a slot,
# and the client's own sends back up.
MAX_CALLS_IN_FLIGHT = 64
# Results the state database refused to journal, kept (by idempotency key) until the key
# comes back; past this many the oldest is left to the next start's recovery.
MAX_UNJOURNALED = 1024
# …and at most this many characters of them (their bodies and final events, as JSON).
MAX_UNJOURNALED_CHARS = 8 * 1024 * 1024
# How long a best-effort error frame may wait for room in the socket's reply queue.
UNJOURNALED_REPORT_TIMEOUT_S = 1.0
UNJOURNALED_KEYLESS_MESSAGE = "The supervisor could not record the call's result; the call may have taken effect."
UNJOURNALED_KEYED_MESSAGE = (
    "The supervisor could not record the call's result yet; retry with the same idempotency key."
)
NOT_RECORDED_MESSAGE = "The supervisor could not record the call; nothing was run."
JOURNAL_FULL_MESSAGE = "Too many unacknowledged events; ack them, then send the call again. Nothing was run."
KEY_REUSED_MESSAGE = "The idempotency key was used for a different call."
# A retry whose first result lies outside the retrying socket's allowed_paths: refused as the
# jail refuses the same call run fresh, so a key never reads what the path rules hide.
REPLAY_OUTSIDE_MESSAGE = "The call's recorded result is not under any of allowed_paths."
REPLAY_OTHER_COMMANDS_MESSAGE = "The call's recorded result ran under other allowed_commands."
TOOL_CRASHED_MESSAGE = "The supervisor failed to run the tool."


class Outcome(enum.Enum):
    RUN = "run"  # a new key (or no key): execute now
    REPLAY = "replay"  # completed with the same digest: send the original result again
    PENDING = "pending"  # the first execution is still running: the one result will come
    JOURNAL_KEPT = "journal_kept"  # it finished, but its result was not journaled: do it now
    KEY_REUSED = "key_reused"  # same key, different call: refuse, run nothing


def idempotency_outcome(existing: CallRecord | None, digest: str, *, kept: bool = False) -> Outcome:
    """docs/protocol.md §8 as a pure decision over the record `begin_call` found (None: it
    wrote a new pending record) and whether this daemon keeps an unjournaled result for the
    key (a pending record whose execution has in fact finished)."""
    if existing is None:
        return Outcome.RUN
    if existing.digest != digest:
        return Outcome.KEY_REUSED
    if existing.state == "completed":
        return Outcome.REPLAY
    return Outcome.JOURNAL_KEPT if kept else Outcome.PENDING


def error_frame(code: str, message: str, call_id: str | None = None) -> str:
    return encode_frame(ErrorFrame(body=ErrorBody(code=code, message=message, call_id=call_id)))


def pending_frame(call_id: str, key: str) -> str:
    return encode_frame(ToolPendingFrame(body=ToolPendingBody(call_id=call_id, idempotency_key=key)))


def frees_key(running: RunningCall, body: dict[str, Any]) -> bool:
    """A refusal that started nothing, for a reason that passes: its result frees the key."""
    return (
        not body["ok"]
        and (running.frees_key or body["error"]["code"] in TRANSIENT_REFUSALS)
        and not running.final_events  # nothing was started
    )


@dataclass(slots=True)
class _Unjournaled:
    """A finished call whose result the database refused, kept until its key comes back."""

    running: RunningCall
    body: dict[str, Any]
    started: float
    ran_s: float  # its run time, up to the journal write that failed (not to the retry)
    chars: int = 0

    def __post_init__(self) -> None:
        # default=str: a size estimate must not raise where the journal's encoder did.
        self.chars = len(json.dumps(self.body, default=str)) + sum(
            len(json.dumps(b, default=str)) for _, b in self.running.final_events
        )


def failure_body(call: ToolCall, exc: ToolFailure) -> dict[str, Any]:
    return result_body(call.call_id, call.idempotency_key, call.tool_name, error=exc.to_error())


def crashed_body(call: ToolCall) -> dict[str, Any]:
    """The result of a call whose tool raised something other than its typed failure: logged
    with the traceback (called inside the `except`), `internal` on the wire."""
    log.exception("tool.crashed", call_id=call.call_id, tool=call.tool_name)
    error = {"code": errors.INTERNAL, "message": TOOL_CRASHED_MESSAGE}
    return result_body(call.call_id, call.idempotency_key, call.tool_name, error=error)


class CallRunner:
    """Accepts tool calls from attached sockets and runs them in the session's nursery."""

    def __init__(
        self,
        store: StateStore,
        journal: Journal,
        nursery: trio.Nursery,
        tools: Mapping[str, Tool],
        telemetry: Telemetry | None = None,
        roots: WorkspaceRoots | None = None,
        max_unacked_bytes: int | None = None,
    ) -> None:
        self.store = store
        # The journal's bound ([journal] max_unacked_bytes); None: unbounded.
        self.max_unacked_bytes = max_unacked_bytes
        # The opened agent.cwd, to judge a retry's view with the jail's walk as it is now.
        self.roots = roots if roots is not None else WorkspaceRoots()
        self.telemetry = telemetry
        self.journal = journal
        self.nursery = nursery
        self.tools = dict(tools)
        self.in_flight = trio.Semaphore(MAX_CALLS_IN_FLIGHT)
        # Finished calls whose result the database refused, by key, oldest first: retried
        # when the key comes back, so the client is not told tool.pending for a call that
        # is no longer running.
        self.unjournaled: OrderedDict[CallKey, _Unjournaled] = OrderedDict()
        self._unjournaled_chars = 0

    def _count(self, body: dict[str, Any], duration_s: float | None = None) -> None:
        if self.telemetry is not None:
            # Unknown tool names are folded into one label: the series count stays bounded.
            tool = body["tool_name"] if body["tool_name"] in self.tools else "unknown"
            self.telemetry.tool_call(tool, "success" if body["ok"] else body["error"]["code"], duration_s)

    def _journal_refusal(self, body: dict[str, Any], view: EventView = PUBLIC) -> None:
        """A refusal that claimed no key (invalid, forbidden, key reused): journaled only.
        Public by default: it tells only what its caller sent (docs/protocol.md §9.1)."""
        self.journal.complete_call(None, body, view=view)
        self._count(body)

    async def submit(
        self, body: dict[str, Any], context: CallContext, reply: SendReply, may_act: Callable[[], bool] | None = None
    ) -> None:
        """Validate and dispatch one `tool.call` body. Everything up to the pending record is
        synchronous, so duplicates arriving together are ordered by the store, not by luck."""
        bound = self.max_unacked_bytes
        if bound is not None and self.journal.unacked_bytes > bound:
            # Refused before anything is recorded, and not journaled: a peer that calls but
            # never acks must not grow the journal further, not even by refusals. The key
            # is not claimed, so the same call goes through once the client has acked.
            call_id = body.get("call_id")
            await reply(error_frame(errors.JOURNAL_FULL, JOURNAL_FULL_MESSAGE, call_id if is_call_id(call_id) else None))
            return
        try:
            await self._submit(body, context, reply, may_act)
        except StoreError:
            # The state database refused (a full disk, say): the call was not recorded, so
            # nothing ran; the client gets a typed answer and may retry with the same key.
            log.exception("tool.record_failed")
            call_id = body.get("call_id")
            await reply(error_frame(errors.INTERNAL, NOT_RECORDED_MESSAGE, call_id if is_call_id(call_id) else None))

    async def _submit(
        self, body: dict[str, Any], context: CallContext, reply: SendReply, may_act: Callable[[], bool] | None
    ) -> None:
        try:
            call = parse_tool_call(body)
        except ToolCallError as exc:
            if exc.call_id is None:
                await reply(error_frame(errors.INVALID_FRAME, exc.message))
                return
            error = {"code": errors.INVALID_PARAMETERS, "message": exc.message}
            self._journal_refusal(result_body(exc.call_id, exc.idempotency_key, exc.tool_name, error=error))
            return
        tool = self.tools[call.tool_name]
        if tool.scope not in context.scopes:
            error = {"code": errors.FORBIDDEN, "message": f"The connection lacks the {tool.scope} scope."}
            self._journal_refusal(result_body(call.call_id, call.idempotency_key, call.tool_name, error=error))
            return
        try:
            # A free slot is taken without a checkpoint: `acquire` would yield to the
            # scheduler even then, one more pass of the event loop on every call.
            self.in_flight.acquire_nowait()
        except trio.WouldBlock:
            await self.in_flight.acquire()
        if may_act is not None and not may_act():
            # Waiting for a slot is a checkpoint: a newer upgrade may have passed the gate
            # meanwhile (without superseding this socket yet). A fenced-out frame never acts.
            self.in_flight.release()
            await reply(error_frame(errors.GENERATION_MISMATCH, STALE_FRAME_MESSAGE))
            return
        run = False
        try:
            run = await self._claim(call, context, reply)
        finally:
            if not run:
                self.in_flight.release()
        if run:
            running = RunningCall(call, context, reply=reply)
            try:
                outcome = self._run_now(running, tool)
            except BaseException:
                self.in_flight.release()
                raise
            if outcome is None:
                self.nursery.start_soon(self._run, running, tool)
                return
            self.in_flight.release()
            if outcome is False:
                await self._report_unjournaled(running)

    async def _claim(self, call: ToolCall, context: CallContext, reply: SendReply) -> bool:
        """Claim the idempotency key (the store decides, synchronously, before any await) and
        answer a duplicate from the record. True when the call must run now."""
        key = call.idempotency_key
        if key is None:
            return True
        # Claimed in the sending socket's key space (state/keys.py); answered with the key
        # as sent.
        stored = CallKey(context.key_space, key)
        digest = call_digest(call.tool_name, call.parameters)
        existing = self.store.begin_call(
            key=stored,
            tool_name=call.tool_name,
            digest=digest,
            call_id=call.call_id,
            intent_json=json.dumps(
                {
                    "parameters": call.parameters.model_dump(mode="json"),
                    "cwd": context.cwd,
                    "allowed_paths": context.allowed_paths,
                    # Who may see a recovered command's events (docs/protocol.md §9.1).
                    "allowed_commands": context.allowed_commands,
                    "session_id": context.session_id,
                    "generation": context.generation,
                }
            ),
        )
        outcome = idempotency_outcome(existing, digest, kept=stored in self.unjournaled)
        if outcome is Outcome.RUN:
            return True
        if outcome is Outcome.KEY_REUSED:
            error = {"code": errors.IDEMPOTENCY_KEY_REUSED, "message": KEY_REUSED_MESSAGE}
            self._journal_refusal(result_body(call.call_id, key, call.tool_name, error=error))
            return False
        if outcome is Outcome.PENDING:
            await reply(pending_frame(call.call_id, key))
            return False
        if outcome is Outcome.REPLAY:
            assert existing is not None and existing.result_frame is not None
            if not self._may_see(existing.result_view, context):
                self._refuse_replay(call, context)
                return False
            await reply(encode_replayed(call.call_id, key, existing.result_frame))
            return False
        # JOURNAL_KEPT: the first execution finished but its result was not journaled.
        kept = self._take_unjournaled(stored)
        assert kept is not None
        frame = self._finish(kept.running, kept.body, kept.started, ran_s=kept.ran_s)
        if frame is None:
            await reply(error_frame(errors.INTERNAL, UNJOURNALED_KEYED_MESSAGE, call.call_id))
            return False
        if frees_key(kept.running, kept.body):
            # A refusal that ran nothing was journaled and freed the key with it: this call
            # is then a new execution, as it would have been at once.
            return await self._claim(call, context, reply)
        if not self._may_see(_view(kept.running, kept.body), context):
            self._refuse_replay(call, context)
            return False
        await reply(encode_replayed(call.call_id, key, frame))
        return False

    def _may_see(self, view: EventView | None, context: CallContext) -> bool:
        """Whether the retrying socket may see a recorded result. Its allowed_paths are
        resolved again for this (not taken from when it attached): a replay answers as the
        same call run fresh would, and the jail judges a fresh call by the paths as they are."""
        if context.audience is None or context.audience.sees_everything:
            return True
        if view is None:
            return False
        fresh = audience_for(self.roots, context.scopes, context.allowed_paths, context.allowed_commands, context.cwd)
        return visible(view, fresh)

    def _refuse_replay(self, call: ToolCall, context: CallContext) -> None:
        """A retry may only replay what its socket could see (docs/protocol.md §8, §9.1); the
        scope check has passed, so what hides the result is a file tool's path (answered as
        the jail answers the same call run fresh) or the allowed_commands a command ran under.
        The record is left as it is."""
        if is_path_bound(call.tool_name):
            code, message = errors.PATH_OUTSIDE_WORKSPACE, REPLAY_OUTSIDE_MESSAGE
        else:
            code, message = errors.FORBIDDEN, REPLAY_OTHER_COMMANDS_MESSAGE
        body = result_body(call.call_id, call.idempotency_key, call.tool_name, error={"code": code, "message": message})
        # Seen by the socket that sent the retry: its own answer.
        self._journal_refusal(body, result_view(call.tool_name, code, None, commands_origin(context.allowed_commands)))

    async def _run(self, running: RunningCall, tool: Tool) -> None:
        try:
            await self._execute(running, tool)
        finally:
            self.in_flight.release()

    def _run_now(self, running: RunningCall, tool: Tool) -> bool | None:
        """Finish a call on the spot when its tool has a fast path that answers now (a small
        read_file): no task to spawn and no scheduler pass before its result is journaled.
        Nothing here awaits, so the reader task it runs in cannot be cancelled half way.
        None when the call needs its own task; else whether its result was journaled."""
        if tool.run_now is None:
            return None
        call = running.call
        started = time.monotonic()
        try:
            result = tool.run_now(running)
            if result is None:
                return None
            body = result_body(call.call_id, call.idempotency_key, call.tool_name, result=result)
        except ToolFailure as exc:
            running.frees_key = exc.frees_key
            body = failure_body(call, exc)
        except Exception:  # see _execute: a tool's bug still owes its call one result
            body = crashed_body(call)
        return self._finish(running, body, started) is not None

    async def _execute(self, running: RunningCall, tool: Tool) -> None:
        call = running.call
        started = time.monotonic()
        try:
            result = await tool.run(running)
            body = result_body(call.call_id, call.idempotency_key, call.tool_name, result=result)
        except ToolFailure as exc:
            running.frees_key = exc.frees_key
            body = failure_body(call, exc)
        except Exception:
            # A bug in one tool must still give its call the one result it is owed (or its
            # key would stay pending until a restart): `internal`, with the traceback in the
            # log and never on the wire. Cancellation is not caught: the call stays pending
            # and the next start reports it interrupted.
            body = crashed_body(call)
        if self._finish(running, body, started) is None:
            await self._report_unjournaled(running)

    async def _report_unjournaled(self, running: RunningCall) -> None:
        """Tell the socket that sent the call that its result could not be journaled (best
        effort: that socket may be gone, and its reply queue is given a bounded wait)."""
        if running.reply is None:
            return
        call = running.call
        message = UNJOURNALED_KEYLESS_MESSAGE if call.idempotency_key is None else UNJOURNALED_KEYED_MESSAGE
        reply, running.reply = running.reply, None  # a kept result must not keep a socket alive
        with trio.move_on_after(UNJOURNALED_REPORT_TIMEOUT_S):
            try:
                await reply(error_frame(errors.INTERNAL, message, call.call_id))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    def _keep_unjournaled(self, key: CallKey, kept: _Unjournaled) -> None:
        self._take_unjournaled(key)
        self.unjournaled[key] = kept
        self._unjournaled_chars += kept.chars
        # Past the bounds the oldest are dropped, delegated key spaces' first (as the store's
        # retention does, state/keys.py): their records stay pending, and the next start
        # resolves them (§10.2), as it would have without this memory.
        while self.unjournaled and (
            len(self.unjournaled) > MAX_UNJOURNALED or self._unjournaled_chars > MAX_UNJOURNALED_CHARS
        ):
            victim = next((k for k in self.unjournaled if k.space != OWNER_SPACE), None)
            if victim is None:
                victim = next(iter(self.unjournaled))
            dropped = self.unjournaled.pop(victim)
            self._unjournaled_chars -= dropped.chars

    def _take_unjournaled(self, key: CallKey) -> _Unjournaled | None:
        kept = self.unjournaled.pop(key, None)
        if kept is not None:
            self._unjournaled_chars -= kept.chars
        return kept

    def _finish(
        self, running: RunningCall, body: dict[str, Any], started: float, *, ran_s: float | None = None
    ) -> str | None:
        """Journal the one tool.result (completing or freeing the key) and log the call; the
        journaled frame, or None when the database refused it. `ran_s`: the run time of a
        kept result, measured when its first journal write failed (else: from `started`)."""
        call = running.call
        key = running.key
        try:
            try:
                rows = self._journal(running, body)
            except ValueError:
                # The protocol's models refused what the tool produced (a bug in the tool):
                # the call still gets its one result, `internal`, and the session goes on.
                body = crashed_body(call)
                running.final_events.clear()
                rows = self._journal(running, body)
        except StoreError:
            # One call's failure to journal must not take the session's other calls down.
            # With a key the record stays pending: the result is kept here and journaled
            # when the key comes back (or the next start resolves the record, §7.1).
            log.exception("tool.journal_failed", call_id=call.call_id, tool=call.tool_name)
            if key is not None:
                ran = time.monotonic() - started if ran_s is None else ran_s
                self._keep_unjournaled(key, _Unjournaled(running, body, started, ran))
            return None
        duration_s = time.monotonic() - started if ran_s is None else ran_s
        # A refusal that started nothing (its key freed) ran nothing to time: counted only.
        self._count(body, None if frees_key(running, body) else duration_s)
        log.info(
            "tool.finished",
            call_id=call.call_id,
            tool=call.tool_name,
            ok=body["ok"],
            error=None if body["ok"] else body["error"]["code"],
            exit_code=(body.get("result") or {}).get("exit_code"),
            duration_ms=round(duration_s * 1000, 3),
            session_id=running.context.session_id,
            generation=running.context.generation,
        )
        return rows[-1][1]

    def _journal(self, running: RunningCall, body: dict[str, Any]) -> list[JournalRow]:
        key = running.key
        view = _view(running, body)
        if key is not None and frees_key(running, body):
            return self.journal.release_call(key, body, view)
        origin = commands_origin(running.context.allowed_commands)
        return self.journal.complete_call(key, body, running.final_events, view, origin)


def _view(running: RunningCall, body: dict[str, Any]) -> EventView:
    """Who may see this call's tool.result: its tool's scope, the path it touched, and (a
    command's) the allowed_commands it ran under."""
    return call_result_view(body, running.view_path, commands_origin(running.context.allowed_commands))
