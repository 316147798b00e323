"""Child process for test_megatron: one rank of a TP=2 megatron-core cell over gloo."""

import sys

import torch
import torch.distributed as dist

from gyre.workerd.modeldir import load_config
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.hf_megatron import to_hf
from gyre.workerd.trainers.megatron import MegatronTrainer

rank, world, init, model_dir, batch_path, out = sys.argv[1:7]
rank, world = int(rank), int(world)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
trainer = MegatronTrainer(model_dir, load_config(model_dir), lr=1e-3, tp=world)
batch = MicroBatch.from_tensors(torch.load(batch_path, weights_only=True))
logprobs = trainer.current_logprobs(batch.input_ids)
stats = trainer.train_micro_step(batch)
shards = [{} for _ in range(world)]
for name, g in trainer.grads().items():
    parts = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(parts, g.contiguous())
    for r, part in enumerate(parts):
        shards[r][name] = part
grads = to_hf(shards, trainer.config)
norm = trainer.optimizer_step(3)
torch.save({"logprobs": logprobs, "loss": stats.loss, "grads": grads, "norm": norm,
            "weights": trainer.export_weights()}, out)
dist.destroy_process_group()
