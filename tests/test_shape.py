"""The coordinator's shape (issue 32), held by AST walks: the Coordinator keeps the loop and
hands its state to owners (executions.py, cells.py, steps.py, resume.Checkpoints), so it
stays small and no function elsewhere takes it whole; no class of gyre's reads another's
underscored members; no caller hands out request ids; one module builds the stacks."""

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


def test_no_function_outside_main_takes_the_coordinator():
    """Owners get what they use, named: no function in coordinator/ but main.py's takes the
    Coordinator (a `coord` or `coordinator` parameter, or one annotated Coordinator), and
    the Coordinator hands itself to no call (fails at 2a0c628: resume.checkpoint, restore,
    final_checkpoint, release_done, status.snapshot and report.summary took it)."""
    offenders = []
    for path in sorted((ROOT / "coordinator").rglob("*.py")):
        if path == ROOT / "coordinator" / "main.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if arg.arg in ("coord", "coordinator") or re.search(r"\bCoordinator\b", note):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}({arg.arg})")
    for node in ast.walk(coordinator_class()):
        if isinstance(node, ast.Call):
            for value in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(value, ast.Name) and value.id == "self":
                    offenders.append(f"coordinator/main.py:{node.lineno}: {ast.unparse(node.func)}(self)")
    assert offenders == []


def gyre_private_members() -> dict[str, set[str]]:
    """Underscored method and attribute names -> the classes of gyre's production code that define them."""
    owners: dict[str, set[str]] = {}
    for folder in ("coordinator", "proxy", "workerd", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not isinstance(cls, ast.ClassDef):
                    continue
                for n in ast.walk(cls):
                    name = None
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                        name = n.name
                    elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                          and isinstance(n.value, ast.Name) and n.value.id == "self"):
                        name = n.attr
                    if name and name.startswith("_") and not name.startswith("__"):
                        owners.setdefault(name, set()).add(cls.name)
    return owners


def test_no_class_reads_another_classs_private_members():
    """In coordinator/, an underscored member of one of gyre's classes is read only inside
    that class (a module-level function or another class reads none). Receivers that are
    modules (os._exit) are not members; docker-py's APIClient's request helpers (api._get,
    api._url, ...; sandbox/docker_api.py, execs.py, images.py) are the SDK's own, and of those only a
    name gyre also defines could be taken for gyre's: `api` names the SDK's client."""
    owners = gyre_private_members()
    offenders = []
    for path in sorted((ROOT / "coordinator").rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names}
        offenders += [f"{path.relative_to(ROOT)}:{line}" for line in private_reads(tree, None, owners, modules)]
    assert offenders == []


def private_reads(node: ast.AST, cls: str | None, owners: dict[str, set[str]], receivers: set[str]) -> list[str]:
    """`x._name` under `node` (inside class `cls`, None: outside any) where _name is another
    gyre class's member and x is not self, cls, `api` or a module in `receivers`."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            found += private_reads(child, child.name, owners, receivers)
            continue
        if (isinstance(child, ast.Attribute) and child.attr in owners and cls not in owners[child.attr]
                and not (isinstance(child.value, ast.Name) and child.value.id in {"self", "cls", "api", *receivers})):
            found.append(f"{child.lineno}: {ast.unparse(child)} (in {cls or 'a function'}; "
                         f"{'/'.join(sorted(owners[child.attr]))}'s)")
        found += private_reads(child, cls, owners, receivers)
    return found


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
