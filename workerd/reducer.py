"""reducer.py: gradient reduction across cells over prebuilt prefix process groups.

Cells 0..n-1 each contribute one rank (their data-parallel leader). Groups {0..k-1} for
every k are created once at start-up, so a step with k participating cells reduces over
`prefix(k)` without building a group mid-run. gloo on CPU, NCCL on GPU.

The groups are built straight on a rendezvous store, never as torch.distributed's default
group: that one belongs to the trainer (megatron-core's parallel state lives on it), so
the reducer and a Megatron cell coexist in one process. Not a scheduler: the coordinator
says how many cells participate.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def _group(backend: str, store, rank: int, size: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"unknown reducer backend {backend!r} (gloo or nccl)")


class ReducerError(RuntimeError):
    """The cross-cell all-reduce failed (a peer cell died or timed out)."""


class GradReducer:
    def __init__(self, *, rank: int, world_size: int, init_method: str,
                 backend: str = "gloo", timeout_s: float = 120.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.rank, self.world_size = rank, world_size
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
        # Ascending k on every rank: a group's members all reach it after the smaller ones.
        self._prefix = {k: _group(backend, dist.PrefixStore(f"gyre/prefix/{k}", store), rank, k, timeout)
                        for k in range(2, world_size + 1) if rank < k}
        self._store = store
        self.participants = world_size

    def group_for(self, participants: int):
        """The prefix group of the first `participants` cells (None for a lone cell)."""
        if not 1 <= participants <= self.world_size:
            raise ValueError(f"participants must be in [1, {self.world_size}], got {participants}")
        if self.rank >= participants:
            raise ValueError(f"rank {self.rank} is not among the first {participants} cells")
        return self._prefix.get(participants)

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` in place over the current prefix group, as one flat buffer."""
        if self.participants == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        try:
            self.group_for(self.participants).allreduce([flat]).wait()
        except RuntimeError as e:  # another cell's failure, not this cell's own group
            raise ReducerError(f"cross-cell gradient reduction over {self.participants} cells failed: {e}") from e
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def close(self) -> None:
        self._prefix.clear()  # the groups shut down as they are collected
        self._store = None
