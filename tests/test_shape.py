"""The coordinator's shape (issue 32), held by AST walks: the Coordinator keeps the loop and
hands its state to owners (executions.py, cells.py, steps.py), so it stays small; modules
that still take it read no underscored member of it; no caller hands out request ids."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_ATTRIBUTES = 25
MAX_LINES = 300


def coordinator_class() -> ast.ClassDef:
    tree = ast.parse((ROOT / "coordinator" / "main.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Coordinator")


def test_the_coordinator_stays_small():
    cls = coordinator_class()
    attrs = sorted({n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"})
    assert len(attrs) <= MAX_ATTRIBUTES, f"{len(attrs)} attributes (give new state an owner): {attrs}"
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= MAX_LINES, f"the Coordinator class is {lines} lines"


def test_no_module_reads_the_coordinators_private_members():
    offenders = []
    for path in sorted((ROOT / "coordinator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id == "coord"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: coord.{node.attr}")
    assert offenders == []


def test_the_link_alone_assigns_request_ids():
    files = [p for folder in ("coordinator", "proxy", "cli") for p in (ROOT / folder).rglob("*.py")]
    callers = [str(p.relative_to(ROOT)) for p in files if re.search(r"new_req_id\(|req_id=\w+\.link\.", p.read_text())]
    assert callers == []


# What a command's rollout and execution stacks are made of: built in coordinator/stack.py alone.
STACK_PARTS = ("LocalCluster", "RoutingTable", "ProxyServer", "Launcher", "open_sandboxes")


def test_the_rollout_stack_is_built_in_one_module():
    """Workers, routes, proxy, sandboxes and launcher are constructed by stack.py alone, for
    `gyre up`, `serve`, `serve --harness`, `tasks run` and `eval` (fails at 9e9320d:
    main.py, serve.py and taskrun.py each built their own)."""
    offenders = []
    for folder in ("coordinator", "proxy", "workerd", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "coordinator" / "stack.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if name in STACK_PARTS:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...)")
    assert offenders == []
