"""Child process for test_megatron: a TP=2 cell (TensorParallelTrainer: rank 0 here, rank 1 a
spawned child) trained on one tree micro-step; results to a file."""

import sys

import torch

from gyre.workerd.modeldir import load_config
from gyre.workerd.trainers.tp import TensorParallelTrainer
from gyre.workerd.trainers.treebatch import TreeBatch

model_dir, batch_path, out = sys.argv[1:4]
if __name__ == "__main__":
    trainer = TensorParallelTrainer(model_dir, load_config(model_dir), tp=2, lr=1e-3)
    batch = TreeBatch.from_tensors(torch.load(batch_path, weights_only=True))
    stats = trainer.train_micro_step(batch)
    norm = trainer.optimizer_step(1)
    weights = trainer.export_weights()
    trainer.close()
    torch.save({"loss": stats.loss, "tokens": stats.tokens, "norm": norm, "weights": weights}, out)
