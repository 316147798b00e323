"""reducer.py: gradient reduction across cells over prebuilt prefix process groups.

Cells 0..n-1 each contribute one rank (their data-parallel leader). Groups {0..k-1} for
every k are created once at start-up, in the same order on every rank (torch.distributed
requires it), so a step with k participating cells reduces over `prefix(k)` without
building a group mid-run. gloo on CPU, NCCL on GPU. Not a scheduler: the coordinator
says how many cells participate.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class GradReducer:
    def __init__(self, *, rank: int, world_size: int, init_method: str,
                 backend: str = "gloo", timeout_s: float = 120.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.rank, self.world_size = rank, world_size
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self._prefix = {world_size: dist.group.WORLD}
        for k in range(1, world_size):
            self._prefix[k] = dist.new_group(ranks=list(range(k)), backend=backend)
        self.participants = world_size

    def group_for(self, participants: int):
        if not 1 <= participants <= self.world_size:
            raise ValueError(f"participants must be in [1, {self.world_size}], got {participants}")
        if self.rank >= participants:
            raise ValueError(f"rank {self.rank} is not among the first {participants} cells")
        return self._prefix[participants]

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` in place over the current prefix group, as one flat buffer."""
        if self.participants == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group_for(self.participants))
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
