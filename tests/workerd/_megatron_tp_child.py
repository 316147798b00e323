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
torch.save({"logprobs": logprobs, "loss": stats.loss, "tokens": stats.tokens, "grads": grads, "copy_grad": copy,
            "norm": norm, "weights": trainer.export_weights(), "params": trainer.num_params}, out)
dist.destroy_process_group()
