"""packing.py: ready groups -> admitted trajectories -> micro-steps of token rows.

Per execution: the proxy's admission (J_max, role priority, each target once) and
materialisation (loss weight 1/L_i). Rows are packed first-fit by length into
micro-steps under a per-rank token budget (rows x padded width); a row longer than the
budget gets a micro-step of its own, never truncated. Arrays are numpy (no torch in the
coordinator). Not the trainer: micro-steps are sent as-is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.coordinator.buffer import Group, advantages
from gyre.workerd import wire


@dataclass
class Row:
    ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    versions: list[int]
    advantage: float
    loss_weight: float
    exec_index: int


@dataclass
class MicroStep:
    rows: list[Row]

    @property
    def width(self) -> int:
        return max(len(r.ids) for r in self.rows)

    @property
    def targets(self) -> int:
        return sum(sum(r.mask) for r in self.rows)

    def frames(self) -> list[wire.TensorFrame]:
        n, w = len(self.rows), self.width
        arrays = {name: np.zeros((n, w), dtype) for name, dtype in wire.MICRO_STEP_TENSORS.items()}
        for i, r in enumerate(self.rows):
            k = len(r.ids)
            mask = np.asarray(r.mask, np.bool_)
            arrays[wire.INPUT_IDS][i, :k] = r.ids
            arrays[wire.TARGET_MASK][i, :k] = mask
            arrays[wire.BEHAVIOUR_LOGPROBS][i, :k] = r.logprobs
            arrays[wire.ADVANTAGES][i, :k] = np.where(mask, r.advantage, 0.0)
            arrays[wire.LOSS_WEIGHTS][i, :k] = np.where(mask, r.loss_weight, 0.0)
            arrays[wire.EXEC_IDS][i, :] = r.exec_index
        return [wire.TensorFrame(k, wire.MICRO_STEP_TENSORS[k], a.shape, a) for k, a in arrays.items()]


def group_rows(group: Group, *, j_max: int | None, seed: int, next_exec: int) -> tuple[list[Row], int, int]:
    """Rows of a group's valid executions; returns (rows, next exec index, executions
    counted in the batch mean: valid ones with policy tokens, zero advantage included)."""
    adv = advantages(group)
    rows: list[Row] = []
    counted = 0
    for run in group.valid_runs[: group.size]:
        if run.recorder is None or not any(n.policy for n in run.recorder.tree.nodes):
            continue  # no model call (e.g. a placeholder): nothing to train, nothing to count
        counted += 1
        if adv.get(run.id, 0.0) == 0.0:
            continue  # contributes zero loss: no rows needed
        _, mat = run.recorder.admit(j_max=j_max, seed=seed)
        if not mat.targets:
            continue
        for ids, mask, lps, vers in zip(mat.input_ids, mat.target_mask, mat.behaviour_logprobs, mat.versions):
            rows.append(Row(ids, mask, lps, vers, adv[run.id], mat.loss_weight, next_exec))
        next_exec += 1
    return rows, next_exec, counted


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
