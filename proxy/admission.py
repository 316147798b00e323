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

import numpy as np

from gyre.proxy.roles import PRIORITY
from gyre.proxy.tree import LOGPROB_DTYPE, VERSION_DTYPE, Tree

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
    """Materialised trajectories of one execution, one row each (numpy arrays, no torch)."""

    input_ids: list[np.ndarray]  # the tree's id dtype
    target_mask: list[np.ndarray]  # bool
    behaviour_logprobs: list[np.ndarray]  # float32 (0 off the targets)
    versions: list[np.ndarray]  # int32 policy version of each target token (-1 elsewhere)
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
    """One row per trajectory: its path's tokens, the targets' mask, log-probs and versions
    (array concatenations: nothing per token in Python)."""
    rows = Rows([], [], [], [], 0.0, 0)
    for traj in trajectories:
        nodes = [tree.nodes[n] for n in traj.path]
        trained = [n in traj.targets for n in traj.path]
        rows.input_ids.append(np.concatenate([node.tokens for node in nodes]))
        rows.target_mask.append(np.concatenate([np.full(len(node.tokens), t) for node, t in zip(nodes, trained)]))
        rows.behaviour_logprobs.append(np.concatenate([
            node.logprobs if t else np.zeros(len(node.tokens), LOGPROB_DTYPE) for node, t in zip(nodes, trained)]))
        rows.versions.append(np.concatenate([
            node.versions if t else np.full(len(node.tokens), -1, VERSION_DTYPE) for node, t in zip(nodes, trained)]))
        rows.targets += int(rows.target_mask[-1].sum())
    rows.loss_weight = 1.0 / rows.targets if rows.targets else 0.0
    return rows
