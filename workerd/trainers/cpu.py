"""trainers/cpu.py: the embedded trainer, plain torch on CPU over the shared `CausalLM`.

Accumulates the GSPO loss's gradients over micro-steps (padded rows, or a tree of shared
segments: trainers/treebatch.py), reduces them over a gloo prefix group when cells train
together, and applies one AdamW update per step with DESIGN.md's settings. Not the packer
and not the reducer's owner: both are handed in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from gyre.workerd import checkpointio
from gyre.workerd.loss import chunked_logprobs, tree_logprobs
from gyre.workerd.model import CausalLM
from gyre.workerd.trainers.base import (
    MicroBatch,
    MicroStepStats,
    Trainer,
    backward_micro_step,
    step_or_drop,
    sum_and_normalise,
)
from gyre.workerd.trainers.treebatch import TreeBatch
from gyre.workerd.wire import TrainerSpec

_DEFAULT = TrainerSpec()  # the options' defaults, written once (wire/messages.py)


class CpuTrainer(Trainer):
    def __init__(self, model: CausalLM, *, lr: float = _DEFAULT.lr, weight_decay: float = _DEFAULT.weight_decay,
                 grad_clip: float = _DEFAULT.grad_clip, version: int = 0, temperature: float = _DEFAULT.temperature,
                 checkpoint_layers: bool = False):
        self.model = model.train()
        model.checkpoint_layers = checkpoint_layers  # recompute activations: long micro-steps fit
        self.version = version
        self.temperature = temperature  # the engines' sampling temperature: log-probs of the same distribution
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-15, weight_decay=weight_decay
        )
        self.micro_steps = 0  # accumulated since the last update

    def drop_gradients(self) -> bool:
        self.optimizer.zero_grad(set_to_none=True)
        self.micro_steps = 0
        return True

    def train_micro_step(self, batch: MicroBatch | TreeBatch) -> MicroStepStats:
        t0 = time.perf_counter()
        # Log-probs only where the loss reads them (the targets), a chunk of positions at a time.
        if isinstance(batch, TreeBatch):
            h = self.model.tree_hidden(batch.input_ids, batch.position_ids, batch.seg_start, batch.seg_len,
                                       batch.seg_parent)
            logp = tree_logprobs(h, self.model.output_weight, batch.input_ids, batch.prev_index,
                                 batch.target_mask, temperature=self.temperature)
        else:
            logp = chunked_logprobs(self.model.hidden(batch.input_ids), self.model.output_weight, batch.input_ids,
                                    batch.target_mask, temperature=self.temperature)
        stats = backward_micro_step(logp, batch, t0)
        self.micro_steps += 1
        return stats

    def current_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return chunked_logprobs(self.model.hidden(input_ids), self.model.output_weight, input_ids,
                                    temperature=self.temperature)

    def optimizer_step(self, num_executions: int, reducer=None, apply: bool = True) -> float:
        """Reduce, normalise, clip; then update (the core) or only drop the gradients (a
        satellite, whose parameters the core sends after its update)."""
        if num_executions < 1:
            raise ValueError(f"num_executions must be >= 1, got {num_executions}")
        params = list(self.model.parameters())
        sum_and_normalise(params, num_executions, reducer)
        return step_or_drop(self, float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip)), apply)

    def export_weights(self) -> dict[str, torch.Tensor]:
        # A snapshot, not views: the frames go out zero-copy after this returns, and the next
        # optimizer step must not change bytes still waiting in a socket.
        return {k: v.clone() for k, v in self.model.hf_state_dict().items()}

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        nbytes = self.model.load_hf_weights(named)
        self.version = version
        return nbytes

    def offload(self) -> int:
        """Nothing moves on CPU: engine and trainer share host memory."""
        return 0

    def onload(self) -> None:
        pass

    def save_checkpoint(self, path: str) -> None:
        """Atomic and fsynced (checkpointio.save): a crash mid-save leaves the previous
        checkpoint, a full disk is named (ENOSPC) and leaves no `.tmp`."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        checkpointio.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                           "version": self.version}, path)

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
