"""trainers/base.py: the trainer interface every backend implements (CPU torch, megatron-core).

A micro-step is a set of right-padded token rows with per-token arrays aligned to the
input positions: `target_mask[r, t]` says token `input_ids[r, t]` is a trained target
(predicted from position t-1). A trainer may also take the tree form of trainers/treebatch.py
(`TreeBatch`: each shared token once, flat [N] arrays). Not a packer: the coordinator
builds micro-steps.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from gyre.workerd import wire

if TYPE_CHECKING:
    from gyre.workerd.trainers.treebatch import TreeBatch


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    input_ids: torch.Tensor  # [R, T] int64
    target_mask: torch.Tensor  # [R, T] bool
    behaviour_logprobs: torch.Tensor  # [R, T] float32
    advantages: torch.Tensor  # [R, T] float32 (the execution's advantage on its tokens)
    loss_weights: torch.Tensor  # [R, T] float32 (1 / L_i on targets)
    exec_ids: torch.Tensor  # [R, T] int64 (execution index, batch-wide)

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [rows, T], got {tuple(shape)}")
        for f in fields(self):
            t = getattr(self, f.name)
            if t.shape != shape:
                raise ValueError(f"{f.name} has shape {tuple(t.shape)}, input_ids {tuple(shape)}")
        if bool(self.target_mask[:, 0].any()):
            raise ValueError("target_mask[:, 0] set: the first token of a row has no context")

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> MicroBatch:
        """A TrainMicroStep's tensors (named as wire.MICRO_STEP_TENSORS, which are these fields)."""
        missing = [n for n in wire.MICRO_STEP_TENSORS if n not in tensors]
        if missing:
            raise ValueError(f"micro-step lacks tensors: {', '.join(missing)}")
        return cls(
            input_ids=tensors[wire.INPUT_IDS].long(),
            target_mask=tensors[wire.TARGET_MASK].bool(),
            behaviour_logprobs=tensors[wire.BEHAVIOUR_LOGPROBS].float(),
            advantages=tensors[wire.ADVANTAGES].float(),
            loss_weights=tensors[wire.LOSS_WEIGHTS].float(),
            exec_ids=tensors[wire.EXEC_IDS].long(),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class MicroStepStats:
    loss: float
    tokens: int
    executions: int
    mismatch: float
    seconds: float


def backward_micro_step(logp: torch.Tensor, batch: MicroBatch | TreeBatch, started: float) -> MicroStepStats:
    """The GSPO loss of one micro-step from the trainer's current log-probs `logp` ([R, T]
    rows, or [N] for a tree batch), back-propagated (gradients accumulate); every trainer's
    `train_micro_step` ends here."""
    import time

    from gyre.workerd.loss import gspo_loss

    out = gspo_loss(logp, batch.behaviour_logprobs, batch.advantages, batch.loss_weights,
                    batch.target_mask, batch.exec_ids)
    out.loss_sum.backward()
    return MicroStepStats(out.loss_sum.item(), out.tokens, out.executions, out.mismatch,
                          time.perf_counter() - started)


def sum_and_normalise(params: list[torch.nn.Parameter], num_executions: int, reducer=None) -> None:
    """Gradients summed over the participating cells (a parameter no micro-step reached counts
    as zero), then divided by the batch's executions: DESIGN.md's outer mean_i."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if reducer is not None:
        reducer.all_reduce([p.grad for p in params])
    for p in params:
        p.grad.div_(num_executions)


def step_or_drop(trainer, norm: float, apply: bool) -> float:
    """After clipping to the (pre-clip) `norm`: update (the core) or not (a satellite), then
    drop the gradients. Non-finite gradients update nothing and are dropped too, on every
    cell alike (`norm` is taken after the cross-cell reduction)."""
    trainer.micro_steps = 0
    if not math.isfinite(norm):
        trainer.optimizer.zero_grad(set_to_none=True)
        raise RuntimeError(f"non-finite gradient norm {norm}: step skipped, gradients dropped")
    if apply:
        trainer.optimizer.step()
        trainer.version += 1
    trainer.optimizer.zero_grad(set_to_none=True)
    return norm


class Trainer(abc.ABC):
    """What the worker drives; every backend subclasses it. The abstract methods are the
    contract; the others are capabilities a backend may lack, with the lacking behaviour
    as their default, so the worker calls them on any trainer."""

    version: int

    @abc.abstractmethod
    def train_micro_step(self, batch: MicroBatch) -> MicroStepStats:
        """One micro-step's loss, back-propagated (gradients accumulate until `optimizer_step`).
        The CPU trainer also takes a `TreeBatch`."""

    @abc.abstractmethod
    def current_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Log-probs of `input_ids` under the current parameters (no gradients)."""

    @abc.abstractmethod
    def optimizer_step(self, num_executions: int, reducer=None, apply: bool = True) -> float:
        """Reduce, normalise, clip, update (unless `apply` is False: a satellite); returns
        the pre-clip gradient norm."""

    @abc.abstractmethod
    def export_weights(self) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int: ...

    @abc.abstractmethod
    def offload(self) -> int:
        """Move parameters, gradients and optimizer state off the accelerator for a role
        change to rollout (after which only `onload` may be called); returns bytes freed."""

    @abc.abstractmethod
    def onload(self) -> None:
        """Undo `offload`, for a role change to training (after the engine released memory)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None: ...

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None: ...

    def init_reducer(self, *, rank: int, world_size: int, init_method: str):
        """Join the cross-cell gradient reduction as cell `rank` of `world_size` (Worker's
        InitReducer handler calls it); returns the reducer `optimizer_step` is handed. The
        default: this process joins alone, one `GradReducer`."""
        from gyre.workerd.reducer import GradReducer

        return GradReducer(rank=rank, world_size=world_size, init_method=init_method)

    def set_participants(self, participants: int) -> None:  # noqa: B027 - a no-op by default, not abstract
        """The reduction now spans the first `participants` cells; the worker has set the
        reducer `init_reducer` returned. The default: no other reducer to tell."""

    def drop_gradients(self) -> bool:
        """Forget the gradients accumulated since the last update (a step its coordinator's
        restart abandoned), so the trainer can be kept for the next session; returns whether
        it can. The default: it cannot, and is built again at the next Welcome."""
        return False

    def close(self) -> None:  # noqa: B027 - a no-op by default, not abstract
        """Stop what the trainer runs outside this process (Worker.reset calls it before
        dropping the trainer). The default: a trainer that holds nothing there."""
