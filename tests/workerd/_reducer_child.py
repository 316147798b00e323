"""Child process for test_reducer: one rank of a gloo group training on its share."""

import json
import sys

import torch

from gyre.workerd.model import load_model
from gyre.workerd.reducer import GradReducer
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer

rank, world, init, model_dir, batch_path, participants, out = sys.argv[1:8]
rank, world, participants = int(rank), int(world), int(participants)
reducer = GradReducer(rank=rank, world_size=world, init_method=init, timeout_s=60)
reducer.participants = participants
if rank < participants:
    trainer = CpuTrainer(load_model(model_dir), lr=1e-3)
    rows = torch.load(batch_path)
    mine = {k: v[rank::participants] for k, v in rows.items()}  # this cell's micro-step
    grads = {}  # what the update is made of: reduced, normalised, clipped
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    trainer.train_micro_step(MicroBatch.from_tensors(mine))
    # The core applies the update; satellites only take part in the reduction.
    trainer.optimizer_step(num_executions=int(rows["exec_ids"].max()) + 1, reducer=reducer, apply=rank == 0)
    torch.save({"weights": trainer.export_weights(), "version": trainer.version, "grads": grads}, out)
else:
    # A cell outside the prefix group takes no part; the group of the others must not need it.
    json.dump({"idle": True}, open(out, "w"))
reducer.close()
