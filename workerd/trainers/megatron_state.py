"""trainers/megatron_state.py: where a Megatron trainer's state goes off the accelerator.

Host memory, at role changes: `offload` copies every storage of parameters, gradients and
optimizer state to host memory and shrinks it to zero bytes in place, so the views into them
(DDP's buffers) stay valid; `onload` copies them back, then applies the weights published
while offloaded. Files, for checkpoints: one per rank, read and checked on every rank and
agreed over the cell before any rank changes anything. Plain functions of the trainer
(megatron.py), which holds the state (`_host`, `_spare`, `_pending`); not the weights by HF
name (megatron_weights.py).
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from gyre.workerd.trainers.megatron import MegatronTrainer


# --- host memory (role changes) -------------------------------------------------------


def storages(trainer: MegatronTrainer) -> list[torch.UntypedStorage]:
    """Every non-empty storage of the trainer's parameters, gradients, DDP buffers and
    optimizer state (the fp32 main parameters on GPU), each once."""
    tensors = [p for p in trainer.gpt.parameters()]
    tensors += [p.grad for p in trainer.gpt.parameters() if p.grad is not None]
    if trainer.on_gpu:
        tensors += [b.grad_data for b in trainer.model.buffers]
        tensors += [b.param_data for b in trainer.model.buffers if b.param_data is not None]
    for state in optimizer_states(trainer.optimizer):
        tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    for inner in inner_optimizers(trainer.optimizer):  # on GPU: the fp32 main parameters
        tensors += [p for g in inner.param_groups for p in g["params"]]
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


def inner_optimizers(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield getattr(opt, "optimizer", opt)


def optimizer_states(optimizer):
    for inner in inner_optimizers(optimizer):
        yield from inner.state.values()


def offload(trainer: MegatronTrainer) -> int:
    """MegatronTrainer.offload: every storage to host memory, then freed; returns bytes freed."""
    if not trainer.offload_enabled or trainer._host is not None:
        return 0
    host, freed = [], 0
    for i, s in enumerate(storages(trainer)):
        n = s.nbytes()
        view = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
        # Pinned host buffers are slow to allocate: kept from the last offload when they fit.
        keep = trainer._spare[i] if i < len(trainer._spare) and trainer._spare[i].numel() == n else \
            torch.empty(n, dtype=torch.uint8, pin_memory=trainer.on_gpu)
        keep.copy_(view, non_blocking=trainer.on_gpu)
        host.append((s, keep))
        freed += n
    if trainer.on_gpu:
        torch.cuda.synchronize()  # every copy landed before a storage is freed
    for s, _ in host:
        s.resize_(0)
    trainer._host = host
    trainer._spare = []  # the ones not reused are let go
    if trainer.on_gpu:
        torch.cuda.empty_cache()
    return freed


def onload(trainer: MegatronTrainer) -> None:
    """MegatronTrainer.onload: same storages, same bytes; then the pending weights, if any."""
    if trainer._host is None:
        return
    for s, keep in trainer._host:
        s.resize_(keep.numel())
        torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(keep, non_blocking=trainer.on_gpu)
    if trainer.on_gpu:
        torch.cuda.synchronize()
    trainer._spare = [keep for _, keep in trainer._host]
    trainer._host = None
    if trainer._pending is not None:
        pending, trainer._pending = trainer._pending, None
        trainer.load_weights(pending.items(), trainer.version)


@contextlib.contextmanager
def onloaded(trainer: MegatronTrainer):
    """On the accelerator for the duration (a checkpoint or export on a rollout cell)."""
    was_offloaded = trainer._host is not None
    onload(trainer)
    try:
        yield
    finally:
        if was_offloaded:
            offload(trainer)


@contextlib.contextmanager
def params_onloaded(trainer: MegatronTrainer):
    """Only the parameters' storages back for the duration (an export or log-probs on a
    rollout cell, beside a serving engine): gradients and optimizer state stay on the
    host. Parameters are read, not changed, so nothing is copied back."""
    if trainer._host is None or trainer._pending is not None:  # pending weights: a full onload applies them
        with onloaded(trainer):
            yield
        return
    params = {p.untyped_storage()._cdata for p in trainer.gpt.parameters()}
    back = [(s, keep) for s, keep in trainer._host if s._cdata in params]
    try:
        for s, keep in back:
            s.resize_(keep.numel())
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(keep)
        yield
    finally:
        for s, _ in back:
            s.resize_(0)
        if trainer.on_gpu:
            torch.cuda.empty_cache()  # not held beside the serving engine


def need_onloaded(trainer: MegatronTrainer) -> None:
    if trainer._host is not None:
        raise RuntimeError("trainer state is offloaded (the cell is serving rollouts): onload first")


# --- files (checkpoints) --------------------------------------------------------------


def ckpt_path(trainer: MegatronTrainer, path: str) -> Path:
    """One file per rank: `path` itself for the cell's rank 0 (so a run's checkpoint
    names one file whatever the cell's shape), `path.tpR` for the other TP ranks,
    `path.ppS.tpR` for the other ranks under PP."""
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    if trainer.tp_rank == 0 and stage == 0:
        return Path(path)
    return Path(f"{path}.pp{stage}.tp{trainer.tp_rank}") if trainer.pp > 1 else Path(f"{path}.tp{trainer.tp_rank}")


def save_checkpoint(trainer: MegatronTrainer, path: str) -> None:
    with onloaded(trainer):
        _save(trainer, path)


def _save(trainer: MegatronTrainer, path: str) -> None:
    """Each file atomic and fsynced (checkpointio): a crash mid-save leaves the previous
    checkpoint, a full disk is named (ENOSPC) and leaves no `.tmp`."""
    from gyre.workerd import checkpointio

    target = ckpt_path(trainer, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    model = {k: v for k, v in trainer.gpt.state_dict().items() if not k.endswith("_extra_state")}
    stepped = any(True for _ in optimizer_states(trainer.optimizer))  # no Adam state before the first step
    if trainer.on_gpu and stepped:  # the distributed optimizer keeps its Adam moments apart from state_dict()
        optim = Path(str(target) + ".optim")
        tmp = optim.with_name(optim.name + ".tmp")
        try:
            trainer.optimizer.save_parameter_state(str(tmp))
        except Exception as e:
            tmp.unlink(missing_ok=True)
            if checkpointio.no_space(tmp.parent):  # Megatron's writer drops the errno
                raise checkpointio.CheckpointWriteError(checkpointio.named(optim, OSError(errno.ENOSPC, ""))) from e
            raise
        checkpointio.commit(tmp, optim)
    checkpointio.save({"model": model,
                       "optimizer": trainer.optimizer.state_dict() if stepped or not trainer.on_gpu else None,
                       "optimizer_state": stepped, "version": trainer.version, "tp": trainer.tp, "pp": trainer.pp},
                      target)


def load_checkpoint(trainer: MegatronTrainer, path: str) -> None:
    with onloaded(trainer):
        _restore(trainer, path)


def _restore(trainer: MegatronTrainer, path: str) -> None:
    """Each rank reads and checks its file (names, shapes, the optimizer's state file on
    GPU), then the cell agrees (every rank's file there, fitting, from the same version)
    before any rank changes anything."""
    failed: list[BaseException] = []
    state: dict = {}
    try:
        state = torch.load(ckpt_path(trainer, path), map_location="cpu", weights_only=True)
        if (state.get("tp", 1), state.get("pp", 1)) != (trainer.tp, trainer.pp):
            raise RuntimeError(f"checkpoint {path} was saved with TP={state.get('tp', 1)}, "
                               f"PP={state.get('pp', 1)}; this trainer has TP={trainer.tp}, PP={trainer.pp}")
        own = {k: tuple(v.shape) for k, v in trainer.gpt.state_dict().items() if not k.endswith("_extra_state")}
        saved = {k: tuple(v.shape) for k, v in state["model"].items()}
        if own != saved:
            wrong = sorted(k for k in set(own) & set(saved) if own[k] != saved[k])
            raise RuntimeError(f"checkpoint {ckpt_path(trainer, path)} does not fit this model: missing "
                               f"{sorted(set(own) - set(saved))[:3]}, unexpected {sorted(set(saved) - set(own))[:3]}, "
                               f"other shapes {wrong[:3]}")
        optim = Path(str(ckpt_path(trainer, path)) + ".optim")
        if trainer.on_gpu and state.get("optimizer_state", True) and not optim.exists():
            raise FileNotFoundError(f"checkpoint {path}: {optim} missing (the optimizer's state)")
    except Exception as e:  # noqa: BLE001 - agreed over the cell below
        failed.append(e)
    trainer._agree(failed, what=f"checkpoint {path}")
    versions = {state.get("version")}
    if trainer.tp * trainer.pp > 1:
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, state.get("version"), group=group)
        versions = set(every)
    if len(versions) > 1:
        raise RuntimeError(f"checkpoint {path}: the cell's files are from different versions {sorted(versions)}")
    trainer.gpt.load_state_dict(state["model"], strict=False)  # _extra_state entries aside, checked above
    if state["optimizer"] is not None:
        # Storages read from a file cannot be resized, so an offload would fail on them:
        # the optimizer keeps copies of its own.
        from torch.utils._pytree import tree_map

        trainer.optimizer.load_state_dict(tree_map(lambda v: v.clone() if torch.is_tensor(v) else v,
                                                   state["optimizer"]))
    if trainer.on_gpu and state.get("optimizer_state", True):
        # The fp32 main parameters come from here (reload_model_params would overwrite
        # them with the bf16 model's, losing what bf16 cannot hold).
        trainer.optimizer.load_parameter_state(str(ckpt_path(trainer, path)) + ".optim")
    elif trainer.on_gpu:  # no Adam state saved (before the first step): main params follow the model
        trainer.optimizer.reload_model_params()
    trainer.version = int(state["version"])
