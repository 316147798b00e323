"""trainers/megatron_weights.py: a Megatron trainer's weights in and out by Hugging Face names.

In: a whole HF weight set is cut to this rank's shards (its stage, its TP shard), checked
against the model's names and shapes and agreed over the cell before anything is copied.
Out: every TP rank's shards are gathered, then every pipeline stage's HF tensors reach the
first stage on the host, point to point through one device buffer. Plain functions of the
trainer (megatron.py), which keeps `export_weights` / `load_weights` and the offload state
they consult; not the name mapping itself (hf_megatron.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gyre.workerd.modeldir import ModelConfig, ModelDirError
from gyre.workerd.trainers.hf_megatron import to_megatron
from gyre.workerd.trainers.megatron_model import pp_group

if TYPE_CHECKING:
    from gyre.workerd.trainers.megatron import MegatronTrainer


def hf_bytes(hf: dict[str, torch.Tensor], config: ModelConfig) -> int:
    """Bytes of a whole HF weight set (a tied lm_head, the embedding again, not counted)."""
    return sum(t.numel() * t.element_size() for k, t in hf.items()
               if not (k == "lm_head.weight" and config.tie_word_embeddings))


def fit(trainer: MegatronTrainer, hf: dict[str, torch.Tensor], own: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """This rank's shards of a whole HF weight set, checked against its own names and
    shapes. Each rank holds only its part (its stage, its TP shard), so the verdict is
    agreed over the cell: a set one rank refuses is refused on all, with that rank's
    reason (a ModelDirError: malformed input), and nothing is half-loaded."""
    failed: list[BaseException] = []
    shards = {}
    try:
        shards = to_megatron(hf, trainer.config, rank=trainer.tp_rank, tp=trainer.tp, stage=trainer.stage)
        match(shards, own)
    except Exception as e:  # noqa: BLE001 - agreed over the cell, then raised
        failed.append(e)
    trainer._agree(failed, what="weight load", passthrough=(ModelDirError,))
    return shards


def check(trainer: MegatronTrainer, hf: dict[str, torch.Tensor]) -> int:
    """Names and shapes of a whole HF weight set, against this model's (shapes from the
    mapping, so it works while offloaded); returns its bytes."""
    fit(trainer, hf, {k: tuple(v) for k, v in trainer._shapes.items()})
    return hf_bytes(hf, trainer.config)


def match(shards: dict[str, torch.Tensor], own: dict[str, tuple]) -> None:
    missing = sorted(set(own) - set(shards))
    if missing:
        raise ModelDirError(f"weights missing for megatron parameters: {', '.join(missing[:5])}")
    for name, t in shards.items():
        if name not in own:
            raise ModelDirError(f"weight for {name!r}: not a parameter of this model")
        if own[name] != tuple(t.shape):
            raise ModelDirError(f"weight {name!r} has shape {tuple(t.shape)}, expected {own[name]}")


def load_into(trainer: MegatronTrainer, model, hf: dict[str, torch.Tensor]) -> int:
    """Copy a whole HF weight set's shards for this rank into `model` (the trainer's
    GPTModel, or the one it is building), after the cell agreed they fit; returns its bytes."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    shards = fit(trainer, hf, {k: tuple(v.shape) for k, v in own.items()})  # before any copy
    with torch.no_grad():
        for name, t in shards.items():
            own[name].copy_(t)
    return hf_bytes(hf, trainer.config)


def shards(trainer: MegatronTrainer) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's Megatron-named tensors of this stage, by TP rank (a collective under TP)."""
    mine = {k: v.detach() for k, v in trainer.gpt.state_dict().items() if not k.endswith("_extra_state")}
    if trainer.tp == 1:
        return [mine]
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(trainer.tp)]
    for name, t in mine.items():
        parts = [torch.empty_like(t) for _ in range(trainer.tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        for r, part in enumerate(parts):
            out[r][name] = part
    return out


def gather_stages(trainer: MegatronTrainer, mine) -> dict[str, torch.Tensor]:
    """Every stage's HF tensors (`mine`: a function giving this stage's) at the first
    stage, on the host, which returns the whole model; the others return {}. Names and
    shapes go first, then each rank allocates the one device buffer it sends or receives
    through (sized for the largest tensor: never the whole model on one device), and
    only when every rank has its buffer do the tensors go, point to point. A failure at
    either point is raised on every rank."""
    if trainer.pp == 1:
        return {k: v.to("cpu", copy=True).contiguous() for k, v in mine().items()}
    from megatron.core import parallel_state as ps

    first, device = trainer.stage.first, trainer.device
    failed: list[BaseException] = []
    tensors: dict[str, torch.Tensor] = {}
    try:
        tensors = mine()
    except Exception as e:  # noqa: BLE001 - agreed over the cell, then raised
        failed.append(e)
    meta = trainer._agree(failed, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], what="export")
    moving = [m for stage in meta[1:] for m in stage] if first else \
        [(k, tuple(v.shape), v.dtype) for k, v in tensors.items() if v.device != device]
    out: dict[str, torch.Tensor] = {}
    try:
        buf = torch.empty(max((math.prod(shape) * dtype.itemsize for _, shape, dtype in moving), default=0),
                          dtype=torch.uint8, device=device)
        if first:
            out = {k: v.to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    except Exception as e:  # noqa: BLE001
        failed.append(e)
    trainer._agree(failed, what="export")

    def staged(shape, dtype) -> torch.Tensor:
        return buf[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    group = pp_group()
    if not first:
        for name, shape, dtype in meta[ps.get_pipeline_model_parallel_rank()]:
            t = tensors[name]
            if t.device != device:  # weights kept on the host (offloaded): through the buffer
                t = staged(shape, dtype).copy_(t)
            dist.send(t.contiguous(), dst=ps.get_pipeline_model_parallel_first_rank(), group=group)
        return {}
    ranks = dist.get_process_group_ranks(group)
    for stage in range(1, trainer.pp):
        for name, shape, dtype in meta[stage]:
            t = staged(shape, dtype)
            dist.recv(t, src=ranks[stage], group=group)
            out.setdefault(name, t.to("cpu", copy=True))  # a copy: the buffer takes the next one
    return out
