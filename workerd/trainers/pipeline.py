"""trainers/pipeline.py: the GPipe schedule of one pipeline stage, over torch.distributed.

A micro-step's rows are cut into `chunks` (at most one per row). Forward: each chunk's
activations [T, rows, hidden] come from the previous stage, go through this stage (`run`),
and go on to the next as soon as they are computed, so stage s works on chunk c while stage
s+1 works on chunk c-1. Backward: each chunk's gradient comes from the loss (the last stage)
or the next stage, goes back through this stage, and on to the previous one. Sends and
receives are point to point on Megatron's pipeline group, in chunk order on every stage.

A stage whose computation fails (recorded in the caller's `failed` list) still sends and
receives every chunk, zeros in place of what it could not compute, so no other stage is left
waiting; the caller then agrees on the failure over the cell. Not the loss and not the
agreement (trainers/megatron.py): this module moves activations and gradients only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gyre.workerd.trainers.hf_megatron import Stage
from gyre.workerd.trainers.megatron_model import pp_group

# (chunk input: None on the first stage, chunk output: None where it failed, activation shape)
Chunk = tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, int, int]]


class GPipe:
    def __init__(self, stage: Stage, *, hidden: int, dtype: torch.dtype, device: torch.device, chunks: int,
                 run: Callable[[torch.Tensor], torch.Tensor], set_input: Callable[[torch.Tensor | None], None]):
        if chunks < 1:
            raise ValueError(f"microbatches must be >= 1, got {chunks}")
        self.stage, self.hidden, self.dtype, self.device = stage, hidden, dtype, device
        self.chunks = chunks
        self.run = run  # this stage's forward of rows (log-probs on the last stage)
        self.set_input = set_input  # where a later stage's forward reads its input from

    def split(self, rows: int) -> list[slice]:
        n = min(self.chunks, rows)
        bounds = [rows * i // n for i in range(n + 1)]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def forward(self, input_ids: torch.Tensor, grad: bool, failed: list[BaseException]) -> list[Chunk]:
        """The forward half: every chunk through this stage, each output sent on as soon as
        it is computed."""
        from megatron.core import parallel_state as ps

        ids = input_ids.to(self.device)
        t = ids.shape[1]
        group = pp_group()
        out: list[Chunk] = []
        try:
            for rows in self.split(ids.shape[0]):
                shape = (t, rows.stop - rows.start, self.hidden)
                x = y = None
                if not self.stage.first:
                    x = torch.empty(shape, dtype=self.dtype, device=self.device)
                    dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
                    x.requires_grad_(grad)
                if not failed:
                    try:
                        if x is not None:
                            self.set_input(x)
                        y = self.run(ids[rows])
                    except Exception as e:  # noqa: BLE001 - agreed over the cell, then raised
                        failed.append(e)
                if not self.stage.last:
                    sent = y.detach().contiguous() if y is not None else torch.zeros(shape, dtype=self.dtype,
                                                                                       device=self.device)
                    dist.send(sent, dst=ps.get_pipeline_model_parallel_next_rank(), group=group)
                out.append((x, y, shape))
        finally:
            if not self.stage.first:
                self.set_input(None)  # the last chunk's input is not kept past the step
        return out

    def backward(self, chunks: list[Chunk], grads, failed: list[BaseException]) -> None:
        """The backward half: each chunk's gradient (`grads` from the loss on the last stage,
        from the next stage on the others) back through this stage, then on to the previous."""
        from megatron.core import parallel_state as ps

        group = pp_group()
        for i, (x, y, shape) in enumerate(chunks):
            if self.stage.last:
                g = grads[i] if grads is not None else None
            else:
                g = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.recv(g, src=ps.get_pipeline_model_parallel_next_rank(), group=group)
            if not failed and y is not None and g is not None:
                try:
                    torch.autograd.backward(y, g)
                except Exception as e:  # noqa: BLE001
                    failed.append(e)
            if not self.stage.first:
                if not failed and x.grad is None:  # a wiring fault, never a silent zero gradient
                    failed.append(RuntimeError(f"no gradient reached pipeline stage input (chunk {i})"))
                back = x.grad if not failed else torch.zeros_like(x)
                dist.send(back.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank(), group=group)
