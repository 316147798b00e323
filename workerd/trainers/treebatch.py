"""trainers/treebatch.py: a micro-step in tree form, each shared token once (DESIGN.md
"Performance targets": prefix-shared training compute).

A `TreeBatch` holds one or more executions' admitted trajectories as a forest of segments
(the trajectory tree's nodes on admitted paths), laid out depth-first in flat per-token
arrays; the model's `tree_hidden` attends each token to its own path only, so log-probs,
loss and gradients equal the path-expanded rows' (`to_micro_batch`). A worker builds one
from the coordinator's frames (`from_wire`); tests build them from proxy trees with
tests/workerd/treebuild.py (workerd imports nothing from the proxy). Not the proxy's
trajectory tree (proxy/tree.py), not the packer and not the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from gyre.workerd.trainers.base import MicroBatch

# A tree micro-step's tensors by name, with their dtypes: [N] per token, then [S] per segment.
TREE_STEP_TENSORS: dict[str, str] = {
    "tree.input_ids": "int64",
    "tree.position_ids": "int64",  # the token's index in its path's row
    "tree.prev_index": "int64",  # the token before it on its path (-1: a root's first token)
    "tree.target_mask": "bool",
    "tree.behaviour_logprobs": "float32",
    "tree.advantages": "float32",  # the execution's advantage on its targets
    "tree.loss_weights": "float32",  # 1 / L_i on targets
    "tree.exec_ids": "int64",  # execution index per token, batch-wide
    "tree.seg_start": "int64",
    "tree.seg_len": "int64",
    "tree.seg_parent": "int64",  # -1: a root
}
TOKEN_FIELDS = ("input_ids", "position_ids", "prev_index", "target_mask", "behaviour_logprobs", "advantages",
                "loss_weights", "exec_ids")
SEGMENT_FIELDS = ("seg_start", "seg_len", "seg_parent")
_DTYPES = {"int64": torch.int64, "bool": torch.bool, "float32": torch.float32}


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeBatch:
    """Segments tile the N tokens in order (segment s is tokens seg_start[s] ..+ seg_len[s])
    and come parents first. position_ids and prev_index follow from the segments; they are
    carried for the model and the log-probs, and checked against them."""

    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64
    prev_index: torch.Tensor  # [N] int64
    target_mask: torch.Tensor  # [N] bool
    behaviour_logprobs: torch.Tensor  # [N] float32
    advantages: torch.Tensor  # [N] float32
    loss_weights: torch.Tensor  # [N] float32
    exec_ids: torch.Tensor  # [N] int64
    seg_start: torch.Tensor  # [S] int64
    seg_len: torch.Tensor  # [S] int64
    seg_parent: torch.Tensor  # [S] int64

    def __post_init__(self) -> None:
        n = self.input_ids.shape
        for name in TOKEN_FIELDS:
            t = getattr(self, name)
            if t.dim() != 1 or t.shape != n:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, want [N] = {tuple(n)}")
        s = self.seg_start.shape
        for name in SEGMENT_FIELDS:
            t = getattr(self, name)
            if t.dim() != 1 or t.shape != s:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, want [S] = {tuple(s)}")
        _check_segments(self.seg_start.tolist(), self.seg_len.tolist(), self.seg_parent.tolist(), n[0])
        position_ids, prev_index = layout(self.seg_start, self.seg_len, self.seg_parent)
        for name, want in (("position_ids", position_ids), ("prev_index", prev_index)):
            bad = (getattr(self, name) != want).nonzero()
            if bad.numel():
                k = int(bad[0])
                raise ValueError(f"{name}[{k}] = {int(getattr(self, name)[k])}, the segments say {int(want[k])}")
        first = self.target_mask & (self.prev_index < 0)
        if bool(first.any()):
            raise ValueError(f"target on token {int(first.nonzero()[0])}, a root's first: it has no context")

    # --- sizes -----------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Tokens the tree form forwards: the union of the admitted paths."""
        return int(self.input_ids.shape[0])

    @property
    def expanded_tokens(self) -> int:
        """Tokens the path-expanded rows forward (unpadded): one row per leaf segment."""
        return sum(len(r) for r in self.path_rows())

    @property
    def targets(self) -> int:
        return int(self.target_mask.sum())

    # --- the wire's view ---------------------------------------------------------------

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {f"tree.{f.name}": getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> TreeBatch:
        """Named as TREE_STEP_TENSORS; each is cast to its dtype."""
        missing = [n for n in TREE_STEP_TENSORS if n not in tensors]
        if missing:
            raise ValueError(f"tree micro-step lacks tensors: {', '.join(missing)}")
        return cls(**{n.removeprefix("tree."): tensors[n].to(_DTYPES[d]) for n, d in TREE_STEP_TENSORS.items()})

    # --- the path-expanded equivalent --------------------------------------------------

    def path_rows(self) -> list[torch.Tensor]:
        """Token indices of each root-to-leaf path, one per leaf segment in order: row r's
        position t holds token path_rows()[r][t]."""
        starts, lens, parents = self.seg_start.tolist(), self.seg_len.tolist(), self.seg_parent.tolist()
        has_child = set(parents)
        rows = []
        for leaf in (s for s in range(len(parents)) if s not in has_child):
            chain, s = [], leaf
            while s >= 0:
                chain.append(s)
                s = parents[s]
            rows.append(torch.cat([torch.arange(starts[s], starts[s] + lens[s]) for s in reversed(chain)]))
        return rows

    def to_micro_batch(self) -> MicroBatch:
        """The same micro-step as right-padded rows, one per root-to-leaf path; a target
        shared by several paths is a target in the first row only (trained once), context
        in the others. Its loss and gradients equal this batch's."""
        rows = self.path_rows()
        width = max((len(r) for r in rows), default=0)
        out = {f.name: torch.zeros(len(rows), width, dtype=getattr(self, f.name).dtype) for f in fields(MicroBatch)}
        trained = torch.zeros(self.num_tokens, dtype=torch.bool)
        for i, idx in enumerate(rows):
            k = len(idx)
            mask = self.target_mask[idx] & ~trained[idx]
            trained[idx] |= mask
            out["input_ids"][i, :k] = self.input_ids[idx]
            out["target_mask"][i, :k] = mask
            for f in ("behaviour_logprobs", "advantages", "loss_weights"):
                out[f][i, :k] = torch.where(mask, getattr(self, f)[idx], 0.0)
            out["exec_ids"][i, :] = self.exec_ids[idx[-1]]
            out["exec_ids"][i, :k] = self.exec_ids[idx]
        return MicroBatch(**out)


def _check_segments(starts: list[int], lens: list[int], parents: list[int], n: int) -> None:
    at = 0
    for s, (start, k, p) in enumerate(zip(starts, lens, parents)):
        if start != at:
            raise ValueError(f"segment {s} starts at token {start}, want {at}: segments tile the tokens in order")
        if k < 1:
            raise ValueError(f"segment {s} has {k} tokens, want at least 1")
        if not -1 <= p < s:
            raise ValueError(f"segment {s} has parent {p}: parents come first (-1 for a root)")
        at += k
    if at != n:
        raise ValueError(f"segments cover {at} tokens, the batch has {n}")


def layout(seg_start: torch.Tensor, seg_len: torch.Tensor,
           seg_parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids and prev_index [N] of segments that tile the tokens, parents first: a
    segment continues its parent's path (position after the parent's last token, which
    predicts its first) or starts one at 0 with no predictor (-1)."""
    starts, lens, parents = seg_start.tolist(), seg_len.tolist(), seg_parent.tolist()
    depth: list[int] = []  # position of each segment's first token
    before: list[int] = []  # index of the token before its first
    for p in parents:
        depth.append(depth[p] + lens[p] if p >= 0 else 0)
        before.append(starts[p] + lens[p] - 1 if p >= 0 else -1)
    n = sum(lens)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    offset = torch.arange(n) - torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64), lens_t)
    position_ids = torch.repeat_interleave(torch.tensor(depth, dtype=torch.int64), lens_t) + offset
    prev_index = torch.arange(n) - 1
    if starts:
        prev_index[torch.tensor(starts, dtype=torch.int64)] = torch.tensor(before, dtype=torch.int64)
    return position_ids, prev_index


def from_wire(tensors: dict[str, torch.Tensor]) -> TreeBatch:
    """A tree micro-step as the coordinator sends it (wire.TREE_STEP_TENSORS: unique ids,
    per segment length / parent / execution / target, targets' log-probs, per execution
    advantage / loss weight / index): positions, ancestry and per-token fields rebuilt."""
    from gyre.workerd import wire

    missing = [n for n in wire.TREE_STEP_TENSORS if n not in tensors]
    if missing:
        raise ValueError(f"tree micro-step lacks tensors: {', '.join(missing)}")
    t = {n: tensors[n] for n in wire.TREE_STEP_TENSORS}
    ids = t[wire.TREE_INPUT_IDS].to(torch.int64)
    seg_len = t[wire.TREE_SEG_LEN].to(torch.int64)
    seg_parent = t[wire.TREE_SEG_PARENT].to(torch.int64)
    seg_exec = t[wire.TREE_SEG_EXEC].to(torch.int64)
    seg_target = t[wire.TREE_SEG_TARGET].to(torch.bool)
    n_exec = t[wire.TREE_EXEC_INDEX].shape[0]
    for name, x in ((wire.TREE_SEG_PARENT, seg_parent), (wire.TREE_SEG_EXEC, seg_exec),
                    (wire.TREE_SEG_TARGET, seg_target)):
        if x.shape != seg_len.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, {wire.TREE_SEG_LEN} {tuple(seg_len.shape)}")
    if int(seg_len.sum()) != ids.shape[0]:
        raise ValueError(f"segments cover {int(seg_len.sum())} tokens, {wire.TREE_INPUT_IDS} has {ids.shape[0]}")
    if seg_exec.numel() and not (0 <= int(seg_exec.min()) and int(seg_exec.max()) < n_exec):
        raise ValueError(f"{wire.TREE_SEG_EXEC} outside the {n_exec} executions")
    for name in (wire.TREE_EXEC_ADVANTAGE, wire.TREE_EXEC_LOSS_WEIGHT):
        if t[name].shape[0] != n_exec:
            raise ValueError(f"{name} has {t[name].shape[0]} entries for {n_exec} executions")
    seg_start = seg_len.cumsum(0) - seg_len
    position_ids, prev_index = layout(seg_start, seg_len, seg_parent)
    of_token = torch.repeat_interleave(torch.arange(seg_len.shape[0]), seg_len)
    mask = seg_target[of_token]
    lps = t[wire.TREE_TARGET_LOGPROBS].to(torch.float32)
    if lps.shape[0] != int(mask.sum()):
        raise ValueError(f"{wire.TREE_TARGET_LOGPROBS} has {lps.shape[0]} entries for {int(mask.sum())} targets")
    behaviour = torch.zeros(ids.shape[0], dtype=torch.float32)
    behaviour[mask] = lps
    e = seg_exec[of_token]
    on = mask.float()
    return TreeBatch(input_ids=ids, position_ids=position_ids, prev_index=prev_index, target_mask=mask,
                     behaviour_logprobs=behaviour,
                     advantages=on * t[wire.TREE_EXEC_ADVANTAGE].to(torch.float32)[e],
                     loss_weights=on * t[wire.TREE_EXEC_LOSS_WEIGHT].to(torch.float32)[e],
                     exec_ids=t[wire.TREE_EXEC_INDEX].to(torch.int64)[e],
                     seg_start=seg_start, seg_len=seg_len, seg_parent=seg_parent)
