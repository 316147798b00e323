"""Child process for test_megatron: one rank of a TP x PP megatron-core cell over gloo."""

import sys

import torch
import torch.distributed as dist

from gyre.workerd.modeldir import load_config
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.hf_megatron import to_hf
from gyre.workerd.trainers.megatron import MegatronTrainer

rank, tp, pp, init, model_dir, batch_path, out = sys.argv[1:8]
rank, tp, pp = int(rank), int(tp), int(pp)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp * pp)
trainer = MegatronTrainer(model_dir, load_config(model_dir), lr=1e-3, tp=tp, pp=pp)
from megatron.core import parallel_state as ps  # noqa: E402 - after the trainer set it up

batch = MicroBatch.from_tensors(torch.load(batch_path, weights_only=True))
failures = []
if pp > 1:  # one stage fails alone: every stage raises, none is left waiting, nothing is kept
    import gyre.workerd.loss as loss_module

    real_loss, real_forward = loss_module.gspo_loss, trainer.pipe.run

    def broken(*args, **kwargs):
        raise ArithmeticError("injected loss failure")

    if trainer.stage.last:
        loss_module.gspo_loss = broken
    try:
        trainer.train_micro_step(batch)
    except Exception as e:  # noqa: BLE001
        failures.append(f"{type(e).__name__}: {e}")
    loss_module.gspo_loss = real_loss
    if trainer.stage.first:
        trainer.pipe.run = broken
    try:
        trainer.current_logprobs(batch.input_ids)
    except Exception as e:  # noqa: BLE001
        failures.append(f"{type(e).__name__}: {e}")
    trainer.pipe.run = real_forward
logprobs = trainer.current_logprobs(batch.input_ids)
stats = trainer.train_micro_step(batch)
shards = [{} for _ in range(tp)]
for name, g in trainer.grads().items():
    parts = [torch.empty_like(g) for _ in range(tp)]
    dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
    for r, part in enumerate(parts):
        shards[r][name] = part
grads = to_hf(shards, trainer.config, trainer.stage)  # this stage's, numbered in the whole model
copy = torch.cat([s["output_layer.weight"] for s in shards]) if trainer._is_copy("output_layer.weight") else None
norm = trainer.optimizer_step(3)
copy_after = None  # the tied embedding's copy after the step: the same update as the embedding
if trainer._is_copy("output_layer.weight"):
    w = trainer.gpt.output_layer.weight.detach()
    parts = [torch.empty_like(w) for _ in range(tp)]
    dist.all_gather(parts, w.contiguous(), group=ps.get_tensor_model_parallel_group())
    copy_after = torch.cat(parts)
torch.save({"logprobs": logprobs, "loss": stats.loss, "tokens": stats.tokens, "grads": grads, "copy_grad": copy,
            "norm": norm, "weights": trainer.export_weights(), "params": trainer.num_params, "failures": failures,
            "copy_after": copy_after}, out)
dist.destroy_process_group()
