"""Tree-form micro-steps built for tests: one execution's `TreeBatch` from its segments
(`from_segments`) or from a proxy `Tree` and its admitted `Trajectory`s (`tree_batch`), and
several batches side by side as one micro-step (`concat_tree_batches`). The worker builds its
batches from the coordinator's frames (workerd/trainers/treebatch.py `from_wire`); these are
here, not in workerd, because they read the proxy's types (workerd imports nothing of it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import numpy as np
import torch

from gyre.proxy.admission import Trajectory
from gyre.proxy.tree import Tree
from gyre.workerd.trainers.treebatch import TreeBatch, layout


def from_segments(*, parents: list[int], tokens: list[list[int]], target_mask: list[list[bool]],
                  behaviour_logprobs: list[list[float]], advantage: float, loss_weight: float,
                  exec_index: int) -> TreeBatch:
    """One execution's batch from its segments in order (parents first, -1 a root), each
    with its tokens, target mask and behaviour log-probs (read on targets only)."""
    lens = [len(t) for t in tokens]
    for s, (k, m, b) in enumerate(zip(lens, target_mask, behaviour_logprobs)):
        if len(m) != k or len(b) != k:
            raise ValueError(f"segment {s}: {k} tokens, {len(m)} mask entries, {len(b)} log-probs")
    seg_len = torch.tensor(lens, dtype=torch.int64)
    seg_start = seg_len.cumsum(0) - seg_len
    seg_parent = torch.tensor(parents, dtype=torch.int64)
    position_ids, prev_index = layout(seg_start, seg_len, seg_parent)
    mask = torch.tensor([x for m in target_mask for x in m], dtype=torch.bool)
    on = mask.float()
    return TreeBatch(
        input_ids=torch.tensor([x for t in tokens for x in t], dtype=torch.int64),
        position_ids=position_ids,
        prev_index=prev_index,
        target_mask=mask,
        behaviour_logprobs=torch.tensor([x for b in behaviour_logprobs for x in b], dtype=torch.float32) * on,
        advantages=on * advantage,
        loss_weights=on * loss_weight,
        exec_ids=torch.full((len(mask),), exec_index, dtype=torch.int64),
        seg_start=seg_start,
        seg_len=seg_len,
        seg_parent=seg_parent,
    )


def tree_batch(tree: Tree, trajectories: Sequence[Trajectory], advantage: float, exec_index: int, *,
               loss_weight: float | None = None) -> TreeBatch:
    """One execution's admitted trajectories as a tree: the nodes on their paths, each once,
    depth-first (children in the order the trajectories first reach them; a node without
    tokens is skipped, its children hang from its parent), targets the trajectories' target
    nodes. `loss_weight` defaults to 1 / L_i over these trajectories; give the whole
    execution's when its trajectories are split over micro-steps."""
    children: dict[int, list[int]] = {}
    seen: set[int] = set()
    targets: set[int] = set()
    for traj in trajectories:
        if targets & traj.targets:
            raise ValueError(f"target nodes {sorted(targets & traj.targets)} in two trajectories: each trains once")
        targets |= traj.targets
        for n in traj.path:
            if n not in seen:
                seen.add(n)
                children.setdefault(tree.nodes[n].parent, []).append(n)
    parents: list[int] = []
    tokens: list[list[int]] = []
    mask: list[list[bool]] = []
    lps: list[list[float]] = []
    stack = [(n, -1) for n in reversed(children.get(-1, []))]
    while stack:
        n, above = stack.pop()
        node = tree.nodes[n]
        if len(node.tokens):
            trained = n in targets
            if trained and (node.logprobs is None or len(node.logprobs) != len(node.tokens)):
                raise ValueError(f"target node {n} has {len(node.tokens)} tokens and "
                                 f"{0 if node.logprobs is None else len(node.logprobs)} behaviour log-probs")
            parents.append(above)
            tokens.append(np.asarray(node.tokens).tolist())
            mask.append([trained] * len(node.tokens))
            lps.append(np.asarray(node.logprobs).tolist() if trained else [0.0] * len(node.tokens))
            above = len(parents) - 1
        stack.extend((c, above) for c in reversed(children.get(n, [])))
    total = sum(len(t) for t, m in zip(tokens, mask) if m and m[0])
    if loss_weight is None:
        loss_weight = 1.0 / total if total else 0.0
    return from_segments(parents=parents, tokens=tokens, target_mask=mask, behaviour_logprobs=lps,
                         advantage=advantage, loss_weight=loss_weight, exec_index=exec_index)


def concat_tree_batches(batches: Sequence[TreeBatch]) -> TreeBatch:
    """Several batches (executions, or parts of one) as one micro-step: their forests side by
    side, indices shifted; exec_ids are kept (they are batch-wide already)."""
    if not batches:
        raise ValueError("no tree batches to concatenate")
    tok_at = seg_at = 0
    parts: dict[str, list[torch.Tensor]] = {f.name: [] for f in fields(TreeBatch)}
    for b in batches:
        for name in parts:
            parts[name].append(getattr(b, name))
        parts["prev_index"][-1] = torch.where(b.prev_index >= 0, b.prev_index + tok_at, -1)
        parts["seg_start"][-1] = b.seg_start + tok_at
        parts["seg_parent"][-1] = torch.where(b.seg_parent >= 0, b.seg_parent + seg_at, -1)
        tok_at += b.num_tokens
        seg_at += int(b.seg_start.shape[0])
    return TreeBatch(**{name: torch.cat(ts) for name, ts in parts.items()})
