"""packing.py: ready groups -> admitted trajectories -> micro-steps, encoded for the wire.

Per execution: the proxy's admission (J_max, role priority, each target once). Two forms:

- `tree` (the default, `packing = "tree"`): each execution's admitted trajectories as one
  tree of unique segments (each tree node on an admitted path once, depth-first), so a
  shared prefix is sent, and computed, once. On the wire: the ids of the unique tokens, per
  segment its length, parent, execution and whether it is a target, the behaviour log-probs
  of the targets only, and per execution its advantage and loss weight 1/L_i; the worker
  rebuilds positions, ancestry and per-token fields (trainers/treebatch.py `from_wire`).
  Executions are packed whole into micro-steps under the per-rank token budget (unique
  tokens); one larger than the budget is split by trajectories, each part keeping the
  execution's 1/L_i.
- `paths`: one right-padded row per admitted trajectory (the path-expanded form); rows are
  packed first-fit by length under the budget (rows x padded width); a row longer than the
  budget gets a micro-step of its own, never truncated.
- `packed`: the path-expanded form without padding, for where sharing is off: each
  trajectory's whole path as a chain of its own in the tree form's encoding, so rows lie end
  to end with positions restarting at each and attention within each (no token of one path
  sees another's), packed first-fit by tokens.

`pack_group` does a whole group, encoding included; the coordinator runs it on a worker
thread as each group becomes ready, so nothing heavy runs on the event loop. Arrays are
numpy (no torch in the coordinator). Not the trainer: micro-steps are sent as encoded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from gyre.coordinator.buffer import Group, advantages
from gyre.proxy.admission import admit
from gyre.workerd import wire

PACKINGS = ("tree", "paths", "packed")


@dataclass
class Row:
    ids: np.ndarray
    mask: np.ndarray  # bool
    logprobs: np.ndarray  # float32
    versions: np.ndarray
    advantage: float
    loss_weight: float
    exec_index: int


@dataclass
class Stats:
    """What a micro-step holds: tokens the forward pass computes (padded slots for paths),
    the unique admitted tokens (each tree node on an admitted path once), the path-expanded
    tokens (each admitted path whole), and the targets."""

    forward: int = 0
    unique: int = 0
    expanded: int = 0
    targets: int = 0

    def add(self, other: Stats) -> None:
        self.forward += other.forward
        self.unique += other.unique
        self.expanded += other.expanded
        self.targets += other.targets


@dataclass
class MicroStep:
    rows: list[Row] = field(default_factory=list)
    encoded: list[wire.TensorFrame] | None = None  # set once packed (pack_group): the frames sent
    stats: Stats = field(default_factory=Stats)

    @property
    def width(self) -> int:
        return max(len(r.ids) for r in self.rows)

    @property
    def targets(self) -> int:
        return sum(int(np.count_nonzero(r.mask)) for r in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(f.data.nbytes for f in self.frames())

    def frames(self) -> list[wire.TensorFrame]:
        if self.encoded is None:
            self.encoded = _row_frames(self.rows)
        return self.encoded


def _row_frames(rows: list[Row]) -> list[wire.TensorFrame]:
    n, w = len(rows), max(len(r.ids) for r in rows)
    arrays = {name: np.zeros((n, w), dtype) for name, dtype in wire.MICRO_STEP_TENSORS.items()}
    for i, r in enumerate(rows):
        k = len(r.ids)
        arrays[wire.INPUT_IDS][i, :k] = r.ids
        arrays[wire.TARGET_MASK][i, :k] = r.mask
        arrays[wire.BEHAVIOUR_LOGPROBS][i, :k] = r.logprobs
        arrays[wire.ADVANTAGES][i, :k] = np.where(r.mask, r.advantage, 0.0)
        arrays[wire.LOSS_WEIGHTS][i, :k] = np.where(r.mask, r.loss_weight, 0.0)
        arrays[wire.EXEC_IDS][i, :] = r.exec_index
    return [wire.TensorFrame(k, wire.MICRO_STEP_TENSORS[k], a.shape, a) for k, a in arrays.items()]


def trainable(group: Group):
    """(run, advantage) of the group's valid executions that count in the batch mean (they
    have policy tokens; zero advantage included), and how many they are."""
    adv = advantages(group)
    out = []
    for run in group.valid_runs[: group.size]:
        if run.recorder is None or not any(n.policy for n in run.recorder.tree.nodes):
            continue  # no model call (e.g. a placeholder): nothing to train, nothing to count
        out.append((run, adv.get(run.id, 0.0)))
    return out


def group_rows(group: Group, *, j_max: int | None, seed: int, next_exec: int):
    """Rows of a group's valid executions: (rows, next exec index, executions counted in the
    batch mean: valid ones with policy tokens, zero advantage included, and each execution's
    unique admitted tokens: exec index -> count)."""
    rows: list[Row] = []
    unique: dict[int, int] = {}
    runs = trainable(group)
    for run, adv in runs:
        if adv == 0.0:
            continue  # contributes zero loss: no rows needed
        trajectories, mat = run.recorder.admit(j_max=j_max, seed=seed)
        if not mat.targets:
            continue
        for ids, mask, lps, vers in zip(mat.input_ids, mat.target_mask, mat.behaviour_logprobs, mat.versions):
            rows.append(Row(ids, mask, lps, vers, adv, mat.loss_weight, next_exec))
        tree = run.recorder.tree
        unique[next_exec] = sum(len(tree.nodes[n].tokens) for n in {n for t in trajectories for n in t.path})
        next_exec += 1
    return rows, next_exec, len(runs), unique


def pack(rows: list[Row], budget_tokens: int) -> list[MicroStep]:
    """First-fit decreasing by length; a micro-step's cost is rows x its widest row."""
    steps: list[MicroStep] = []
    for row in sorted(rows, key=lambda r: len(r.ids), reverse=True):
        for step in steps:
            if (len(step.rows) + 1) * max(step.width, len(row.ids)) <= budget_tokens:
                step.rows.append(row)
                break
        else:
            steps.append(MicroStep([row]))
    return steps


# --- the tree form ---------------------------------------------------------------------------

@dataclass
class _Part:
    """One execution's admitted subtree (or a part of it): its nodes in depth-first order
    with their parent's place in that order."""

    exec_index: int
    advantage: float
    loss_weight: float
    nodes: list[int]  # tree node ids, parents first
    parents: list[int]  # index into `nodes` (-1: a root)
    targets: list[bool]
    tree: object  # the proxy Tree
    forward: int = 0  # its tokens (a shared prefix again in each part of a split execution)
    unique: int = 0  # of those, the ones no earlier part of the execution holds
    expanded: int = 0


def _subtree(tree, trajectories) -> tuple[list[int], list[int], list[bool]]:
    """The nodes on `trajectories`' paths, each once, depth-first (children in the order the
    trajectories first reach them); nodes without tokens are skipped (their children hang
    from their parent)."""
    children: dict[int, list[int]] = {}
    seen: set[int] = set()
    targets: set[int] = set()
    for t in trajectories:
        targets |= t.targets
        for n in t.path:
            if n not in seen:
                seen.add(n)
                children.setdefault(tree.nodes[n].parent, []).append(n)
    nodes: list[int] = []
    parents: list[int] = []
    stack = [(n, -1) for n in reversed(children.get(-1, []))]
    while stack:
        n, above = stack.pop()
        if len(tree.nodes[n].tokens):
            nodes.append(n)
            parents.append(above)
            above = len(nodes) - 1
        stack.extend((c, above) for c in reversed(children.get(n, [])))
    return nodes, parents, [n in targets for n in nodes]


def _parts(tree, trajectories, *, exec_index: int, advantage: float, loss_weight: float,
           budget: int, shared: bool = True) -> list[_Part]:
    """The execution's subtree, split by trajectories into parts of at most `budget` unique
    tokens where it is larger, or of at most twice their longest trajectory where that passes
    the budget and the trajectories share a prefix (a trajectory is never cut).
    `shared=False`: every trajectory a part of its own, its whole path (`packing = "packed"`)."""
    parts: list[tuple[list, set[int], list[int]]] = []  # (trajectories, nodes covered, [unique, longest])
    for t in trajectories:
        length = tree.nodes[t.path[-1]].end
        best = None
        for p in parts if shared else ():
            new = sum(len(tree.nodes[n].tokens) for n in t.path if n not in p[1])
            unique, longest = p[2]
            # Into a part if it fits the budget there, or if it shares a prefix there and the
            # part stays within twice its longest trajectory: a trajectory is never cut, so a
            # part of long paths passes the budget anyway, and on its own this one would cost
            # its whole path again. The part it shares the most with wins.
            fits = unique + new <= budget or (new < length and unique + new <= 2 * max(longest, length))
            if fits and (best is None or new < best[0]):
                best = (new, p)
        if best is None:
            parts.append(([], set(), [0, 0]))
            best = (length, parts[-1])
        new, (trajs, covered, size) = best
        trajs.append(t)
        covered.update(t.path)
        size[0] += new
        size[1] = max(size[1], length)
    groups = [trajs for trajs, _, _ in parts]
    out = []
    credited: set[int] = set()  # nodes counted as unique admitted tokens by an earlier part
    for trajs in groups:
        nodes, parents, targets = _subtree(tree, trajs)
        part = _Part(exec_index, advantage, loss_weight, nodes, parents, targets, tree)
        part.forward = sum(len(tree.nodes[n].tokens) for n in nodes)
        part.unique = sum(len(tree.nodes[n].tokens) for n in nodes if n not in credited)
        part.expanded = sum(tree.nodes[t.path[-1]].end for t in trajs)
        credited.update(nodes)
        out.append(part)
    return out


def _tree_frames(parts: list[_Part]) -> tuple[list[wire.TensorFrame], Stats]:
    """The wire form of several parts as one micro-step (wire.TREE_STEP_TENSORS)."""
    ids, seg_len, seg_parent, seg_exec, seg_target, lps = [], [], [], [], [], []
    exec_adv, exec_weight, exec_id = [], [], []
    at = 0  # segments so far
    stats = Stats()
    for e, p in enumerate(parts):
        nodes = [p.tree.nodes[n] for n in p.nodes]
        ids += [node.tokens for node in nodes]
        seg_len += [len(node.tokens) for node in nodes]
        seg_parent += [q + at if q >= 0 else -1 for q in p.parents]
        seg_exec += [e] * len(nodes)
        seg_target += p.targets
        lps += [node.logprobs for node, t in zip(nodes, p.targets) if t]
        exec_adv.append(p.advantage)
        exec_weight.append(p.loss_weight)
        exec_id.append(p.exec_index)
        at += len(nodes)
        stats.forward += p.forward
        stats.unique += p.unique
        stats.expanded += p.expanded
    narrow = all(p.tree.ids == np.uint16 for p in parts)  # ids as the trees hold them: 2 bytes where they fit
    arrays = {
        wire.TREE_INPUT_IDS: np.concatenate(ids).astype(np.uint16 if narrow else np.int32, copy=False),
        wire.TREE_SEG_LEN: np.asarray(seg_len, np.int32),
        wire.TREE_SEG_PARENT: np.asarray(seg_parent, np.int32),
        wire.TREE_SEG_EXEC: np.asarray(seg_exec, np.int32),
        wire.TREE_SEG_TARGET: np.asarray(seg_target, np.bool_),
        wire.TREE_TARGET_LOGPROBS: np.concatenate(lps).astype(np.float32, copy=False) if lps
        else np.zeros(0, np.float32),
        wire.TREE_EXEC_ADVANTAGE: np.asarray(exec_adv, np.float32),
        wire.TREE_EXEC_LOSS_WEIGHT: np.asarray(exec_weight, np.float32),
        wire.TREE_EXEC_INDEX: np.asarray(exec_id, np.int32),
    }
    stats.targets = int(np.asarray(seg_len)[np.asarray(seg_target, bool)].sum()) if seg_len else 0
    return [wire.TensorFrame(k, str(a.dtype), a.shape, a) for k, a in arrays.items()], stats


def pack_tree(parts: list[_Part], budget_tokens: int, min_steps: int = 1) -> list[list[_Part]]:
    """First-fit decreasing by tokens: a micro-step's cost is the tokens it forwards. Fewer
    micro-steps than `min_steps` (the training cells' share of the step: a cell with no
    micro-step to claim idles by construction) are spread over min(min_steps, parts)
    instead, largest first, each to the lightest, unless one would then pass the budget."""
    bins: list[tuple[int, list[_Part]]] = []
    for part in sorted(parts, key=lambda p: p.forward, reverse=True):
        for i, (used, members) in enumerate(bins):
            if used + part.forward <= budget_tokens:
                members.append(part)
                bins[i] = (used + part.forward, members)
                break
        else:
            bins.append((part.forward, [part]))
    k = min(min_steps, len(parts))
    if len(bins) < k:
        spread: list[tuple[int, list[_Part]]] = [(0, []) for _ in range(k)]
        for part in sorted(parts, key=lambda p: p.forward, reverse=True):
            i = min(range(k), key=lambda j: spread[j][0])
            spread[i] = (spread[i][0] + part.forward, [*spread[i][1], part])
        if all(used <= budget_tokens or len(members) == 1 for used, members in spread):
            bins = spread
    return [members for _, members in bins]


# --- a whole group ---------------------------------------------------------------------------

def pack_group(group: Group, *, j_max: int | None, seed: int, next_exec: int, budget_tokens: int,
               form: str = "tree", min_steps: int = 1) -> tuple[list[MicroStep], int, int]:
    """A ready group's micro-steps, encoded: (micro-steps, next exec index, executions
    counted in the batch mean); the tree form makes at least `min_steps` where it has the
    parts to (pack_tree). Pure computation over closed executions' trees (nothing else
    writes them), so it may run off the event loop."""
    if form not in PACKINGS:
        raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {form!r}")
    if form == "paths":
        rows, next_exec, counted, unique = group_rows(group, j_max=j_max, seed=seed, next_exec=next_exec)
        steps = pack(rows, budget_tokens)
        for ms in steps:
            ms.frames()
            ms.stats = Stats(forward=len(ms.rows) * ms.width, expanded=sum(len(r.ids) for r in ms.rows),
                             targets=ms.targets)
        credited: set[int] = set()
        for ms in steps:  # an execution's unique tokens, on the micro-step holding its first row
            for r in ms.rows:
                if r.exec_index not in credited:
                    credited.add(r.exec_index)
                    ms.stats.unique += unique[r.exec_index]
        return steps, next_exec, counted
    parts: list[_Part] = []
    runs = trainable(group)
    for run, adv in runs:
        if adv == 0.0:
            continue
        trajectories, targets = _admitted(run.recorder, j_max=j_max, seed=seed)
        if not targets:
            continue
        parts += _parts(run.recorder.tree, trajectories, exec_index=next_exec, advantage=adv,
                        loss_weight=1.0 / targets, budget=budget_tokens, shared=form == "tree")
        next_exec += 1
    steps = []
    for members in pack_tree(parts, budget_tokens, min_steps):
        frames, stats = _tree_frames(members)
        steps.append(MicroStep(encoded=frames, stats=stats))
    return steps, next_exec, len(runs)


def _admitted(recorder, *, j_max: int | None, seed: int):
    """An execution's admitted trajectories and L_i (its target tokens)."""
    trajectories = admit(recorder.tree, recorder.leaf_roles, j_max=j_max, rng=random.Random(seed))
    return trajectories, sum(t.target_tokens(recorder.tree) for t in trajectories)
