"""admission.py: which trajectories of an execution train, and their token rows.

DESIGN.md "Admission": start from the provenance mask; repeatedly take the highest-priority
role that still has a leaf with unmasked trainable tokens on its path, draw one of its
leaves with probability proportional to that count, fix the trajectory's targets to the
tokens still unmasked, and mask its whole path; stop at `j_max` or when nothing trainable
is left. Every trainable target is therefore admitted at most once. `materialise` turns
admitted trajectories into rows with per-token loss weight 1/L_i. Not the packer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gyre.proxy.roles import PRIORITY
from gyre.proxy.tree import Tree

J_MAX = 5  # trajectories admitted per execution by default (`j_max`; None: all)


@dataclass(frozen=True, slots=True)
class Trajectory:
    leaf: int
    role: str
    path: list[int]
    targets: frozenset[int]  # policy nodes whose tokens are this trajectory's targets

    def target_tokens(self, tree: Tree) -> int:
        return sum(len(tree.nodes[n].tokens) for n in self.targets)


@dataclass(slots=True)
class Rows:
    """Materialised trajectories of one execution, one row each (plain lists, no torch)."""

    input_ids: list[list[int]]
    target_mask: list[list[bool]]
    behaviour_logprobs: list[list[float]]
    versions: list[list[int]]  # policy version of each target token (-1 elsewhere)
    loss_weight: float  # 1 / L_i
    targets: int  # L_i


def admit(tree: Tree, leaf_roles: dict[int, str], *, j_max: int | None = J_MAX,
          rng: random.Random | None = None) -> list[Trajectory]:
    rng = rng or random.Random(0)
    masked: set[int] = set()
    paths = {leaf: tree.path(leaf) for leaf, role in leaf_roles.items() if role in PRIORITY}
    out: list[Trajectory] = []
    while j_max is None or len(out) < j_max:
        picked = None
        for role in PRIORITY:
            weights = {leaf: _unmasked(tree, paths[leaf], masked)
                       for leaf, r in leaf_roles.items() if r == role and leaf in paths}
            weights = {k: v for k, v in weights.items() if v > 0}
            if weights:
                leaves = sorted(weights)
                picked = (rng.choices(leaves, weights=[weights[k] for k in leaves])[0], role)
                break
        if picked is None:
            break
        leaf, role = picked
        path = paths[leaf]
        targets = frozenset(n for n in path if tree.nodes[n].policy and n not in masked)
        out.append(Trajectory(leaf, role, path, targets))
        masked.update(path)
    return out


def _unmasked(tree: Tree, path: list[int], masked: set[int]) -> int:
    return sum(len(tree.nodes[n].tokens) for n in path if tree.nodes[n].policy and n not in masked)


def materialise(tree: Tree, trajectories: list[Trajectory]) -> Rows:
    rows = Rows([], [], [], [], 0.0, 0)
    for traj in trajectories:
        ids: list[int] = []
        mask: list[bool] = []
        lps: list[float] = []
        vers: list[int] = []
        for n in traj.path:
            node = tree.nodes[n]
            k = len(node.tokens)
            ids.extend(node.tokens)
            if n in traj.targets:
                mask.extend([True] * k)
                lps.extend(node.logprobs)
                vers.extend(node.versions)
            else:
                mask.extend([False] * k)
                lps.extend([0.0] * k)
                vers.extend([-1] * k)
        rows.input_ids.append(ids)
        rows.target_mask.append(mask)
        rows.behaviour_logprobs.append(lps)
        rows.versions.append(vers)
        rows.targets += sum(mask)
    rows.loss_weight = 1.0 / rows.targets if rows.targets else 0.0
    return rows
