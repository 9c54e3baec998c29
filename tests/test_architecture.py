"""The shape of the code, checked: no import cycle (TYPE_CHECKING and function-level imports
included), and every dependency points down the layers docs/internals.md draws.

The graph is read from the source with `ast`, under the installed names (the mapping comes
from pyproject.toml's package-dir), so it sees exactly what `import` would resolve.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DAEMON = "sandbox_supervisor.daemon"
PROTOCOL = "sandbox_supervisor.protocol"
TESTING = "sandbox_supervisor.testing"


def _modules() -> dict[str, Path]:
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, directory in mapping.items():
        root = REPO / directory
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module of ours that importing `name` runs: what it imports anywhere in its body,
    and the packages those live in (their __init__ runs first)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    edges: set[str] = set()
    for target in targets:
        while target:
            if target in MODULES and target != name:
                edges.add(target)
            target = target.rpartition(".")[0]
    return edges


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _in(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_graph_sees_the_packages():
    assert {DAEMON, PROTOCOL, TESTING} <= MODULES.keys()
    assert f"{DAEMON}.session.control" in GRAPH[f"{DAEMON}.session.socket"]


def test_there_is_no_import_cycle():
    # Tarjan's strongly connected components: any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert cycles == []


def _violations(source_prefixes: tuple[str, ...], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if _in(name, *source_prefixes) and name not in allowed
        for target in targets
        if _in(target, *forbidden)
    )


def test_protocol_imports_nothing_from_the_daemon_or_the_kit():
    assert _violations((PROTOCOL,), (DAEMON, TESTING)) == []


def test_the_daemon_imports_nothing_from_the_kit():
    assert _violations((DAEMON,), (TESTING,)) == []


@pytest.mark.parametrize(
    "layer, above",
    [
        # A frame goes down: edge -> session -> runtime -> state. Nothing below reaches back up.
        (f"{DAEMON}.state", (f"{DAEMON}.runtime", f"{DAEMON}.session", f"{DAEMON}.edge", f"{DAEMON}.auth", f"{DAEMON}.ops", f"{DAEMON}.app")),
        (f"{DAEMON}.runtime", (f"{DAEMON}.session", f"{DAEMON}.edge", f"{DAEMON}.auth", f"{DAEMON}.ops", f"{DAEMON}.app")),
        (f"{DAEMON}.session", (f"{DAEMON}.edge", f"{DAEMON}.app")),
        (f"{DAEMON}.auth", (f"{DAEMON}.session", f"{DAEMON}.runtime", f"{DAEMON}.app")),
        (f"{DAEMON}.edge", (f"{DAEMON}.session", f"{DAEMON}.runtime", f"{DAEMON}.auth.admission", f"{DAEMON}.app")),
    ],
)
def test_layers_only_import_downwards(layer, above):
    assert _violations((layer,), above) == []


def test_only_the_entry_points_import_the_assembly():
    importers = sorted(name for name, targets in GRAPH.items() if f"{DAEMON}.app" in targets)
    assert importers == [f"{DAEMON}.ops.cli", f"{TESTING}.daemon"]
