"""Child process for test_megatron: a TP=2 cell as workerd builds it (TensorParallelTrainer:
rank 0 here, rank 1 a spawned child), trained on one micro-batch; results to a file."""

import sys
from pathlib import Path

import torch

from gyre.workerd.modeldir import load_config
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.tp import RankError, TensorParallelTrainer

model_dir, batch_path, out = sys.argv[1:4]
if __name__ == "__main__":
    trainer = TensorParallelTrainer(model_dir, load_config(model_dir), tp=2, lr=1e-3, offload=True)
    batch = MicroBatch.from_tensors(torch.load(batch_path, weights_only=True))
    logprobs = trainer.current_logprobs(batch.input_ids)
    stats = trainer.train_micro_step(batch)
    norm = trainer.optimizer_step(3)
    freed = trainer.offload()
    trainer.onload()
    weights = trainer.export_weights()
    try:  # a bad publication: refused on every rank, and the cell goes on
        trainer.load_weights([("model.norm.weight", torch.zeros(3))], version=9)
        error = ""
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    after = trainer.current_logprobs(batch.input_ids)  # every rank still answers
    # A call that fails on rank 1 only (its checkpoint file's place is taken by a folder):
    # the error names the rank, and the next call gets its own replies, not that one's.
    ckpt = Path(out).with_name("ckpt.pt")
    Path(f"{ckpt}.tp1").mkdir()
    try:
        trainer.save_checkpoint(str(ckpt))
        rank_error = ""
    except RankError as e:
        rank_error = str(e)
    stats2 = trainer.train_micro_step(batch)
    trainer.close()
    # close() leaves the process as before the cell: another cell can be built in it.
    again = TensorParallelTrainer(model_dir, load_config(model_dir), tp=2, lr=1e-3)
    again_lp = again.current_logprobs(batch.input_ids)
    again.close()
    torch.save({"logprobs": logprobs, "loss": stats.loss, "norm": norm, "version": trainer.version,
                "freed": freed, "weights": weights, "error": error, "after": after, "rank_error": rank_error,
                "stats2_tokens": stats2.tokens, "again": again_lp}, out)
