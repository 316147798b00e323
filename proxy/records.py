"""records.py: reads an execution's recorded files back (nodes.jsonl, calls.jsonl).

The tree is rebuilt node by node in recording order, so `gyre inspect`, admission and the
coordinator's resume see exactly what the proxy recorded. Not a writer: recorder.py
appends the files as calls happen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from gyre.proxy.admission import J_MAX, Rows, Trajectory, admit, materialise
from gyre.proxy.tree import LOGPROB_DTYPE, VERSION_DTYPE, Node, Tree, text_key


@dataclass
class Recorded:
    id: str
    tree: Tree
    calls: list[dict]
    leaf_roles: dict[int, str]

    def admit(self, j_max: int | None = J_MAX, seed: int = 0) -> tuple[list[Trajectory], Rows]:
        """As Recorder.admit: a resumed coordinator trains recorded executions through this."""
        trajectories = admit(self.tree, self.leaf_roles, j_max=j_max, rng=random.Random(seed))
        return trajectories, materialise(self.tree, trajectories)


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            break  # a torn last line from a crash: everything before it is whole
    return out


def load_execution(folder: Path) -> Recorded:
    tree = Tree()
    for n in _lines(folder / "nodes.jsonl"):
        if n["id"] != len(tree.nodes):
            raise ValueError(f"{folder}/nodes.jsonl: node {n['id']} out of order")
        parent = tree.nodes[n["parent"]] if n["parent"] >= 0 else None
        key = text_key(n["key"]) if n["kind"] == "text" else n["key"]  # as Tree.add_text keys it
        lps = None if n["logprobs"] is None else np.asarray(n["logprobs"], LOGPROB_DTYPE)
        vers = None if n["versions"] is None else np.asarray(n["versions"], VERSION_DTYPE)
        node = Node(id=n["id"], parent=n["parent"], kind=n["kind"], key=key,
                    tokens=np.asarray(n["tokens"], tree.ids), policy=n["policy"], call_id=n["call_id"],
                    logprobs=lps, versions=vers,
                    end=(parent.end if parent else 0) + len(n["tokens"]),
                    root=parent.root if parent else len(tree.roots))
        tree.nodes.append(node)
        (parent.children if parent else tree.roots)[(node.kind, key)] = node.id
    calls = _lines(folder / "calls.jsonl")
    roles: dict[int, str] = {}
    for c in calls:
        leaf = c["output_node"] if c["output_node"] is not None else c["prompt_path"][-1]
        roles[leaf] = c["role"]
    roles = {k: v for k, v in roles.items() if not tree.nodes[k].children}
    return Recorded(folder.name, tree, calls, roles)


def load_run(run_dir: Path) -> list[Recorded]:
    root = run_dir / "executions"
    if not root.is_dir():
        raise FileNotFoundError(f"{run_dir} has no executions/ folder (is it a gyre run directory?)")
    return [load_execution(d) for d in sorted(root.iterdir()) if d.is_dir()]
