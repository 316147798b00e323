"""inspect.py: `gyre inspect RUN_DIR`: each execution's trajectory tree and admission stats.

Linear chains are folded: the view shows roots, branch points and leaves, with the role
of each leaf and policy/external token counts along the way. Pure rendering from the
recorded files; it changes nothing.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree as RichTree

from gyre.proxy.admission import admit
from gyre.proxy.records import Recorded, load_run
from gyre.proxy.tree import Tree


def admission_stats(rec: Recorded, j_max: int | None) -> dict:
    """Admitted trajectories and their tokens: targets, the path-expanded forward pass
    (`forward_tokens`, as `packing = "paths"` computes it), and the tree form's (each node on
    an admitted path once: `forward_tokens_tree`, equal to the unique admitted tokens)."""
    trajectories = admit(rec.tree, rec.leaf_roles, j_max=j_max)
    unique = sum(len(rec.tree.nodes[n].tokens) for n in {n for t in trajectories for n in t.path})
    expanded = sum(rec.tree.nodes[t.path[-1]].end for t in trajectories)
    return {"trajectories": len(trajectories),
            "admitted_tokens": sum(t.target_tokens(rec.tree) for t in trajectories),
            "forward_tokens": expanded, "forward_tokens_tree": unique,
            "unique_admitted_tokens": unique, "expanded_tokens": expanded}


def summary(rec: Recorded, j_max: int) -> dict:
    s = rec.tree.stats()
    s["tree_expanded_tokens"] = s.pop("expanded_tokens")  # every leaf's path; `expanded_tokens` is training's
    admitted = admission_stats(rec, j_max)
    # What training at this J_max forwards, tree form against path rows (the run's default J_max).
    training = {k: admitted[k] for k in ("forward_tokens_tree", "unique_admitted_tokens", "expanded_tokens")}
    roles: dict[str, int] = {}
    for r in rec.leaf_roles.values():
        roles[r] = roles.get(r, 0) + 1
    return {"execution": rec.id, "calls": len(rec.calls), **s, "leaf_roles": roles,
            "status": _count(c["status"] for c in rec.calls), **prefill_stats(rec.calls), **training,
            f"admission_j{j_max}": admitted, "admission_all": admission_stats(rec, None)}


def prefill_stats(calls: list[dict]) -> dict:
    """The engines' prefill over these calls: prompt tokens reused (prefix cache, handed-over
    KV) and computed, and the hit rate; None where no call's engine said (records from before
    the cache have no such fields)."""
    known = [c for c in calls if c.get("cached_tokens") is not None]
    cached = sum(c["cached_tokens"] for c in known) if known else None
    prefill = sum(c["prefill_tokens"] for c in known) if known else None
    total = (cached or 0) + (prefill or 0)
    return {"cached_tokens": cached, "prefill_tokens": prefill,
            "cache_hit_rate": round(cached / total, 4) if known and total else None}


def _count(items) -> dict:
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def render_tree(rec: Recorded) -> RichTree:
    tree = rec.tree
    view = RichTree(f"[bold]{rec.id}[/] ({len(rec.calls)} calls)")
    for rid in tree.roots.values():
        _fold(tree, rid, view, rec.leaf_roles)
    return view


def _fold(tree: Tree, start: int, parent_view: RichTree, roles: dict[int, str]) -> None:
    """Follow the single-child chain from `start`; add one line for it, recurse at a branch."""
    policy = external = calls = 0
    n = start
    while True:
        node = tree.nodes[n]
        if node.policy:
            policy += len(node.tokens)
        else:
            external += len(node.tokens)
        calls += node.kind == "output"
        if len(node.children) != 1:
            break
        n = next(iter(node.children.values()))
    node = tree.nodes[n]
    label = f"{calls} outputs, [green]{policy} policy[/] / [dim]{external} external[/] tokens"
    if not node.children:
        label = f"[bold]{roles.get(n, '?')}[/] leaf: " + label + f" (path {node.end} tokens)"
    else:
        label = f"branch after {node.end} tokens: " + label
    branch = parent_view.add(label)
    for child in node.children.values():
        _fold(tree, child, branch, roles)


def inspect_run(run_dir: Path, *, execution: str | None, as_json: bool, j_max: int, console: Console) -> list[dict]:
    records = [r for r in load_run(run_dir) if execution is None or r.id == execution]
    if execution is not None and not records:
        raise FileNotFoundError(f"no execution {execution!r} in {run_dir}")
    out = [summary(r, j_max) for r in records]
    if as_json:
        return out
    for rec, s in zip(records, out):
        console.print(render_tree(rec))
        t = Table(show_header=True, header_style="bold")
        for col in ("nodes", "roots", "leaves", "unique tokens", "expanded tokens",
                    f"admitted @J={j_max}", "admitted @all", "cache hits"):
            t.add_column(col, justify="right")
        hit = s["cache_hit_rate"]
        t.add_row(str(s["nodes"]), str(s["roots"]), str(s["leaves"]), str(s["unique_tokens"]),
                  str(s["tree_expanded_tokens"]), str(s[f"admission_j{j_max}"]["admitted_tokens"]),
                  str(s["admission_all"]["admitted_tokens"]), "n/a" if hit is None else f"{hit:.1%}")
        console.print(t)
    if len(records) > 1:
        total = prefill_stats([c for r in records for c in r.calls])
        hit = total["cache_hit_rate"]
        console.print(f"{len(records)} executions, {sum(len(r.calls) for r in records)} calls: prompt tokens "
                      f"reused {_num(total['cached_tokens'])}, computed {_num(total['prefill_tokens'])}, "
                      f"cache hits {'n/a' if hit is None else f'{hit:.1%}'}")
    return out


def _num(v: int | None) -> str:
    return "n/a" if v is None else str(v)
