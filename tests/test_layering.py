"""The dependency direction (docs/DESIGN.md "Dependency direction") as a test: an AST walk of
every module of coordinator/, workerd/, proxy/ and cli/, each import seen wherever it is (module
level, inside a function, under `if TYPE_CHECKING:`), against the arrows

    cli -> coordinator -> proxy
                       -> the light workerd modules (wire and the few shared with the daemon)
    workerd -> nothing of coordinator, proxy or cli
    proxy   -> nothing of coordinator, workerd or cli

with no exceptions. The light workerd modules are those the coordinator and the daemon share;
none imports torch (checked in a fresh interpreter), so the coordinator never loads it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "workerd", "proxy", "cli")

# The workerd modules the coordinator may import, each light (no torch at import) and shared with
# the daemon: the wire (messages, framing, micro-step tensor names, the Welcome's option specs),
# the model directory's config (a run resolves against it; workerd builds its model from it),
# the link's CURVE keys, the sandbox proxy relay (made here, or by a node's workerd), and the
# checkpoint file's errno names (resume reads a worker's checkpoint error with them).
COORDINATOR_MAY_IMPORT = (
    "gyre.workerd.wire",
    "gyre.workerd.modelconfig",
    "gyre.workerd.keys",
    "gyre.workerd.netns",
    "gyre.workerd.checkpointio",
)

# package -> (what it may not import, what of that it may all the same)
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "workerd": (("gyre.coordinator", "gyre.proxy", "gyre.cli"), ()),
    "proxy": (("gyre.coordinator", "gyre.workerd", "gyre.cli"), ()),
    "coordinator": (("gyre.cli", "gyre.workerd"), COORDINATOR_MAY_IMPORT),
    "cli": ((), ()),  # the top: it may import any of them
}

# "path:line -> module" offences let through. Empty: a new one is a design change, made in
# DESIGN.md and here together, never an entry in this list.
EXCEPTIONS: frozenset[str] = frozenset()


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("gyre", *(p for p in parts if p != "__init__")))


def _is_module(name: str, root: Path) -> bool:
    rel = Path(*name.split(".")[1:])
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, gyre module) of every import in the file: `from A import b` names A.b where that
    is a module (`from gyre.workerd import wire`), else A; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_of(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if _is_module(sub, root) else base))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value))
    return sorted({(line, m) for line, m in found if _within(m, "gyre")})


def offences(root: Path = ROOT) -> list[str]:
    """Each import against the arrows, as "path:line -> module"."""
    out = []
    for package in PACKAGES:
        forbidden, allowed = RULES[package]
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imports(path, root):
                if any(_within(module, f) for f in forbidden) and not any(_within(module, a) for a in allowed):
                    out.append(f"{path.relative_to(root)}:{line} -> {module}")
    return out


def test_imports_follow_the_dependency_direction():
    bad = [o for o in offences() if o not in EXCEPTIONS]
    assert not bad, "imports against docs/DESIGN.md's dependency direction:\n" + "\n".join(bad)


def test_there_are_no_exceptions():
    assert EXCEPTIONS == frozenset()


def test_the_coordinator_imports_exactly_the_light_workerd_modules_allowed():
    """The allowed list is what the coordinator needs, no more: a module it stops importing
    leaves the list too."""
    used = {a for path in (ROOT / "coordinator").rglob("*.py") for _, module in imports(path)
            for a in COORDINATOR_MAY_IMPORT if _within(module, a)}
    assert sorted(used) == sorted(COORDINATOR_MAY_IMPORT)


def test_the_light_workerd_modules_do_not_import_torch():
    """The coordinator loads them; none may pull torch (or another heavy library) in."""
    code = (f"import sys, {', '.join(COORDINATOR_MAY_IMPORT)}; "
            "heavy = [m for m in ('torch', 'numpy', 'sglang', 'megatron', 'safetensors') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_walk_finds_every_kind_of_import(tmp_path):
    """Module level, in a function, under TYPE_CHECKING, relative, `from gyre.x import module`
    and importlib's: each offence named with its file and line."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "workerd" / "wire.py").write_text("")
    (tmp_path / "workerd" / "heavy.py").write_text("")
    (tmp_path / "cli" / "main.py").write_text("")
    (tmp_path / "workerd" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import gyre.coordinator.main\n"
        "if TYPE_CHECKING:\n"
        "    from gyre.proxy.tree import Tree\n"
        "def f():\n"
        "    from gyre.cli import main\n"
        "    from ..coordinator import x\n"
        "    importlib.import_module('gyre.proxy.server')\n"
        "from gyre.workerd import wire\n")
    (tmp_path / "coordinator" / "ok.py").write_text(
        "from gyre.workerd import wire\nfrom gyre.workerd.wire import GyreError\nfrom gyre.proxy import chat\n")
    (tmp_path / "coordinator" / "bad.py").write_text(
        "from gyre.workerd import heavy\nfrom gyre.workerd.wirex import y\nfrom gyre.workerd import wire, heavy as h\n")
    (tmp_path / "proxy" / "bad.py").write_text("def f():\n    from gyre.workerd.wire import GyreError\n")
    (tmp_path / "cli" / "ok.py").write_text("import gyre.workerd.heavy\nimport gyre.coordinator.ok\n")
    assert offences(tmp_path) == [
        "coordinator/bad.py:1 -> gyre.workerd.heavy",
        "coordinator/bad.py:2 -> gyre.workerd.wirex",
        "coordinator/bad.py:3 -> gyre.workerd.heavy",
        "workerd/bad.py:2 -> gyre.coordinator.main",
        "workerd/bad.py:4 -> gyre.proxy.tree",
        "workerd/bad.py:6 -> gyre.cli.main",
        "workerd/bad.py:7 -> gyre.coordinator",
        "workerd/bad.py:8 -> gyre.proxy.server",
        "proxy/bad.py:2 -> gyre.workerd.wire",
    ]


# --- no import cycle within cli/ ------------------------------------------------------------


def cli_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """cli/'s import graph, every import counted wherever it is: module -> {gyre.cli module it
    imports: "path:line" of the first import of it}."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted((root / "cli").rglob("*.py")):
        edges = graph.setdefault(_module_of(path, root), {})
        for line, module in imports(path, root):
            if _within(module, "gyre.cli"):
                edges.setdefault(module, f"{path.relative_to(root)}:{line}")
    return graph


def a_cycle(graph: dict[str, dict[str, str]]) -> list[str]:
    """One cycle of `graph` as [a, b, ..., a] (depth first, in name order), [] where none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if found := visit(nxt):
                return found
        path.pop()
        done.add(node)
        return []

    return next((c for c in map(visit, sorted(graph)) if c), [])


def _cycle_text(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_cli_has_no_import_cycle():
    """cli/'s modules import one another one way only, function-local imports included: what
    several commands share lives in leaves (common.py, checks.py) that import no command module."""
    graph = cli_graph()
    cycle = a_cycle(graph)
    assert not cycle, "an import cycle in cli/: " + _cycle_text(graph, cycle)


def test_the_cycle_walk_sees_function_local_imports(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("")
    (tmp_path / "cli" / "a.py").write_text("from gyre.cli.b import x\n")
    (tmp_path / "cli" / "b.py").write_text("import gyre.cli.c\n")
    (tmp_path / "cli" / "c.py").write_text("def f():\n    from gyre.cli import a\n")
    graph = cli_graph(tmp_path)
    cycle = a_cycle(graph)
    assert _cycle_text(graph, cycle) == ("gyre.cli.a (cli/a.py:1) -> gyre.cli.b (cli/b.py:1) -> "
                                         "gyre.cli.c (cli/c.py:2) -> gyre.cli.a")
    (tmp_path / "cli" / "c.py").write_text("def f():\n    from gyre.cli import b\n")
    assert a_cycle(cli_graph(tmp_path)) == ["gyre.cli.b", "gyre.cli.c", "gyre.cli.b"]
    (tmp_path / "cli" / "c.py").write_text("")
    assert a_cycle(cli_graph(tmp_path)) == []
