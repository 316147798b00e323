"""Child process for test_megatron: a PP=2 cell as workerd builds it (rank 0, the first
stage, here; rank 1, the last, a spawned child), through a rollout cell's life: train,
offload, a publication while offloaded, a refused one, onload, checkpoint; results to a file."""

import sys
from pathlib import Path

import torch

from gyre.workerd.modeldir import ModelDirError, load_config
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.tp import TensorParallelTrainer

model_dir, batch_path, out = sys.argv[1:4]
if __name__ == "__main__":
    trainer = TensorParallelTrainer(model_dir, load_config(model_dir), tp=1, pp=2, lr=1e-3, offload=True,
                                    microbatches=3)
    batch = MicroBatch.from_tensors(torch.load(batch_path, weights_only=True))
    logprobs = trainer.current_logprobs(batch.input_ids)
    stats = trainer.train_micro_step(batch)
    norm = trainer.optimizer_step(3)
    trained = trainer.export_weights()
    freed = trainer.offload()
    published = {k: v * 0.5 for k, v in trained.items()}
    trainer.load_weights(published.items(), version=4)  # kept on the host, each stage its part
    while_offloaded = trainer.export_weights()
    # A set the last stage refuses (its layer is missing): refused on every rank, with the
    # last stage's reason, and the first stage keeps what it had.
    partial = {k: v for k, v in trained.items() if not k.startswith("model.layers.1.mlp")}
    try:
        trainer.load_weights(partial.items(), version=9)
        error = ""
    except ModelDirError as e:
        error = str(e)
    # A malformed tensor of the last stage's (k_proj with a wrong row count): named, on every rank.
    bad_k = dict(trained)
    bad_k["model.layers.1.self_attn.k_proj.weight"] = bad_k["model.layers.1.self_attn.k_proj.weight"][:-1]
    try:
        trainer.load_weights(bad_k.items(), version=9)
        malformed = ""
    except ModelDirError as e:
        malformed = str(e)
    trainer.onload()
    onloaded = trainer.export_weights()
    ckpt = f"{out}.ckpt"
    trainer.save_checkpoint(ckpt)
    files = sorted(p.name for p in Path(ckpt).parent.iterdir() if p.name.startswith(Path(ckpt).name))
    trainer.load_weights(trained.items(), version=5)
    trainer.load_checkpoint(ckpt)
    restored = trainer.export_weights()
    # A checkpoint whose last-stage file is from another version: refused before any rank loads.
    other = f"{out}.other"
    trainer.load_weights(trained.items(), version=6)
    trainer.save_checkpoint(other)
    Path(f"{other}.pp1.tp0").replace(f"{ckpt}.pp1.tp0")
    try:
        trainer.load_checkpoint(ckpt)
        mixed = ""
    except Exception as e:  # noqa: BLE001
        mixed = str(e)
    untouched = trainer.export_weights()
    trainer.load_weights(published.items(), version=4)
    stats2 = trainer.train_micro_step(batch)
    norm2 = trainer.optimizer_step(3)
    version = trainer.version
    params = trainer.num_params
    trainer.close()
    torch.save({"logprobs": logprobs, "loss": stats.loss, "norm": norm, "trained": trained, "freed": freed,
                "published": published, "while_offloaded": while_offloaded, "error": error,
                "onloaded": onloaded, "restored": restored, "loss2": stats2.loss, "norm2": norm2,
                "version": version, "params": params, "files": files, "malformed": malformed, "mixed": mixed,
                "untouched": untouched}, out)
