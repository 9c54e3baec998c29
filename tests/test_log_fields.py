"""Log fields: one naming style (snake_case with the unit: `duration_ms`, `session_id`), the
seed's `sandbox.startup-stage` facts excepted, and enum values logged as values."""

from __future__ import annotations

import ast
import io
import json
import logging
import re
from enum import Enum
from pathlib import Path

import structlog
from wsproto.frame_protocol import CloseReason

from sandbox_supervisor.daemon.ops.logs import configure_logging

ROOT = Path(__file__).resolve().parent.parent
DAEMON = ROOT / "supervisor"
LEVELS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "msg", "bind", "new"}
SNAKE_CASE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# The fields of the startup-stage facts are the seed's names, read by a platform's boot
# timeline as they are (docs/protocol.md §5.2): kept, and allowed only on that event.
SEED_EVENT = "sandbox.startup-stage"
SEED_FIELDS = {"stage", "outcome", "duration", "sessionId"}
# A field about time says its unit; a duration is always in milliseconds (`duration_ms`).
TIME_WORDS = re.compile(r"(^|_)(duration|elapsed|timeout|interval|delay|wait|age|latency|retry|uptime|budget)(_|$)")
UNIT = re.compile(r"_(ms|s|us|ns)$")


def _log_calls(tree: ast.AST):
    """(call, enclosing function) for every structlog call and safe_log call."""
    def walk(node: ast.AST, function: ast.AST | None):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                func = child.func
                if (isinstance(func, ast.Attribute) and func.attr in LEVELS and child.keywords) or (
                    isinstance(func, ast.Name) and func.id == "safe_log"
                ):
                    yield child, function
            yield from walk(child, inner)
    yield from walk(tree, None)


def _event(call: ast.Call) -> str | None:
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def _dict_keys(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """String keys of dict literals and of `d["key"] = …` stores under node."""
    keys = []
    for item in ast.walk(node):
        if isinstance(item, ast.Dict):
            keys += [(key.value, key) for key in item.keys if isinstance(key, ast.Constant)]
        elif isinstance(item, ast.Subscript) and isinstance(item.ctx, ast.Store):
            if isinstance(item.slice, ast.Constant) and isinstance(item.slice.value, str):
                keys.append((item.slice.value, item))
    return keys


def _fields(trees: dict[Path, ast.AST]):
    """(where, event, field name) of every field a log call can write. A `**expansion` is
    followed: a dict bound in the same function, a `**kwargs` parameter (its callers' keyword
    names), or a method's or function's returned dict (its literal keys); any other is
    reported as such."""
    functions = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.setdefault(node.name, []).append(node)
    calls_by_name: dict[str, list[ast.Call]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name:
                    calls_by_name.setdefault(name, []).append(node)
    for path, tree in trees.items():
        for call, function in _log_calls(tree):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            event = _event(call)
            for keyword in call.keywords:
                if keyword.arg is not None:
                    yield where, event, keyword.arg
                    continue
                value = keyword.value
                if isinstance(value, ast.Name) and function is not None:
                    kwarg = function.args.kwarg
                    if kwarg is not None and kwarg.arg == value.id:
                        for caller in calls_by_name.get(function.name, []):
                            for passed in caller.keywords:
                                if passed.arg is not None:
                                    # The caller may name the event (safe_log's do).
                                    yield where, _event(caller) or event, passed.arg
                        continue
                    bound = [
                        node.value for node in ast.walk(function)
                        if isinstance(node, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == value.id for t in node.targets)
                    ]
                    if bound and all(_dict_keys(node) for node in bound):
                        for node in bound:
                            for key, _ in _dict_keys(node):
                                yield where, event, key
                        continue
                if isinstance(value, ast.Call) and isinstance(value.func, (ast.Attribute, ast.Name)):
                    name = value.func.attr if isinstance(value.func, ast.Attribute) else value.func.id
                    providers = functions.get(name, [])
                    keys = [key for provider in providers for key, _ in _dict_keys(provider)]
                    if keys:
                        for key in keys:
                            yield where, event, key
                        continue
                yield where, event, f"**{ast.unparse(value)} (cannot be followed)"


def _trees() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text()) for path in sorted(DAEMON.rglob("*.py"))}


def test_every_log_field_is_snake_case_with_its_unit() -> None:
    fields = list(_fields(_trees()))
    assert len(fields) > 100  # the scan sees the daemon's log calls
    bad = []
    for where, event, name in fields:
        if event == SEED_EVENT and name in SEED_FIELDS:
            continue
        if not SNAKE_CASE.match(name):
            bad.append((where, event, name, "not snake_case"))
        elif TIME_WORDS.search(name) and not UNIT.search(name):
            bad.append((where, event, name, "a time without its unit"))
        elif name.startswith("duration") and name != "duration_ms":
            bad.append((where, event, name, "a duration is duration_ms"))
    assert bad == []


def test_the_seed_startup_stage_fields_keep_the_seeds_names() -> None:
    seed_fields = {name for _, event, name in _fields(_trees()) if event == SEED_EVENT}
    assert seed_fields == SEED_FIELDS


def test_the_scan_follows_expansions_and_catches_a_bad_name(tmp_path: Path) -> None:
    source = (
        "def f(log, x, **detail):\n"
        "    ids = {'sessionId': x}\n"
        "    log.info('a.b', waitTime=1, **ids, **detail)\n"
        "    log.info('a.c', timeout=2, elapsed_ms=3)\n"
        "def g(log):\n"
        "    f(log, 1, retryIn=2)\n"
    )
    path = ROOT / "supervisor" / "example.py"
    names = {name for _, _, name in _fields({path: ast.parse(source)})}
    assert names == {"waitTime", "sessionId", "retryIn", "timeout", "elapsed_ms"}
    # A dict the scan cannot see into is reported, not passed.
    opaque = "def h(log, c):\n    counts = c.drain()\n    log.info('a.d', **counts)\n"
    (_, _, name), = _fields({path: ast.parse(opaque)})
    assert name == "**counts (cannot be followed)"


class Colour(Enum):
    RED = "red"


def _render(fmt: str, **fields: object) -> str:
    buffer = io.StringIO()
    configure_logging("info", fmt, stream=buffer)
    try:
        structlog.get_logger("test").info("socket.closed", **fields)
    finally:
        configure_logging("error", "json")  # the suite's quiet default (conftest.py)
    return buffer.getvalue()


def test_the_console_format_prints_enum_values() -> None:
    line = _render("console", code=CloseReason.NORMAL_CLOSURE, colour=Colour.RED)
    assert "code=1000" in line and "colour=red" in line
    assert "CloseReason" not in line and "Colour" not in line


def test_the_json_format_writes_enum_values() -> None:
    event = json.loads(_render("json", code=CloseReason.NORMAL_CLOSURE, colour=Colour.RED))
    assert (event["code"], event["colour"]) == (1000, "red")


def test_a_cached_logger_follows_a_later_configuration() -> None:
    """Loggers are cached on first use; the level, the stream and the format set by a later
    `configure_logging` still reach them (the suite and an operator's tooling reconfigure)."""
    logger = structlog.get_logger("test.cached")
    quiet = io.StringIO()
    configure_logging("error", "json", stream=quiet)
    try:
        logger.info("first.use")  # the first use caches the logger, below the level
        assert quiet.getvalue() == ""
        loud = io.StringIO()
        configure_logging("info", "json", stream=loud)
        logger.info("after.reconfigure", n=1)
        logger.bind(k="v").warning("bound.after")
        lines = [json.loads(line) for line in loud.getvalue().splitlines()]
        assert [(line["event"], line["level"]) for line in lines] == [("after.reconfigure", "info"), ("bound.after", "warning")]
        console = io.StringIO()
        configure_logging("warning", "console", stream=console)
        logger.info("not.shown")
        logger.error("shown", code=CloseReason.NORMAL_CLOSURE)
        assert "not.shown" not in console.getvalue() and "shown" in console.getvalue() and "code=1000" in console.getvalue()
        assert quiet.getvalue() == ""
    finally:
        configure_logging("error", "json")  # the suite's quiet default (conftest.py)


def test_the_json_line_has_level_timestamp_traceback_and_a_repr_for_the_rest() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    buffer = io.StringIO()
    configure_logging("info", "json", stream=buffer)
    try:
        logger = structlog.get_logger("test.json")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("it.failed", thing=Opaque(), path=Path("/a"))
        logger.warn("alias.warn")
    finally:
        configure_logging("error", "json")
    failed, warned = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert failed["event"] == "it.failed" and failed["level"] == "error"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", failed["timestamp"])
    assert "Traceback" in failed["exception"] and "ValueError: boom" in failed["exception"]
    assert "exc_info" not in failed
    assert (failed["thing"], failed["path"]) == ("<opaque>", "PosixPath('/a')")
    assert warned["level"] == "warning"


def _is_logger_name(name: str) -> bool:
    return name == "log" or name.endswith("_log")


def test_every_logging_method_the_daemon_calls_exists_on_its_logger() -> None:
    from sandbox_supervisor.daemon.ops.logs import LiveLevelLogger

    called = set()
    for path in DAEMON.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, (ast.Name, ast.Attribute))
                and _is_logger_name(getattr(node.func.value, "id", None) or getattr(node.func.value, "attr", ""))
            ):
                called.add(node.func.attr)
    assert called and "info" in called
    assert all(callable(getattr(LiveLevelLogger, name, None)) for name in called), sorted(called)


def test_the_logger_keeps_the_rest_of_structlogs_synchronous_interface() -> None:
    """%-arguments, `log(level, …)` and the level queries, as structlog's filtering logger
    has them, all following the live level."""
    buffer = io.StringIO()
    configure_logging("warning", "json", stream=buffer)
    try:
        logger = structlog.get_logger("test.interface")
        logger.warning("took %d ms", 5)
        logger.log(logging.INFO, "below.the.level")
        logger.log(logging.ERROR, "at %s", "error")
        assert logger.is_enabled_for(logging.WARNING) and not logger.is_enabled_for(logging.INFO)
        assert logger.get_effective_level() == logging.WARNING
        configure_logging("info", "json", stream=buffer)
        assert logger.is_enabled_for(logging.INFO) and logger.get_effective_level() == logging.INFO
    finally:
        configure_logging("error", "json")
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [(line["event"], line["level"]) for line in lines] == [("took 5 ms", "warning"), ("at error", "error")]
