"""bench/tree_train.py: trainer seconds per micro-step, tree form against path rows.

One execution on the tiny model: a shared 2,000-token prefix (external text) and 4 sampled
branches of 300 tokens, all admitted. The tree form forwards 3,200 unique tokens; the path
rows forward 4 x 2,300 = 9,200. Each form runs `CpuTrainer.train_micro_step` (forward,
GSPO loss, backward) after a warm-up, the two forms alternating so that a busy machine
slows both alike; the medians are printed with their ratio. Not a test: it asserts only
that both forms give the same loss. Run:
    python bench/tree_train.py
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

import numpy as np
import torch

from gyre.proxy.admission import admit, materialise
from gyre.proxy.tree import Tree
from gyre.workerd.model import load_model
from gyre.workerd.modeldir import init_tiny
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer
from gyre.workerd.trainers.tree import tree_batch

PREFIX, BRANCHES, BRANCH = 2000, 4, 300
RUNS = 5  # timed micro-steps per form


def execution() -> tuple[Tree, list]:
    rng = random.Random(0)
    tree = Tree()
    root = tree.add_text(-1, "prefix", [rng.randrange(256) for _ in range(PREFIX)], "c0")
    leaves = {}
    for b in range(BRANCHES):
        out = tree.add_output(root.id, f"c{b}", [rng.randrange(256) for _ in range(BRANCH)],
                              [-rng.random() * 4 for _ in range(BRANCH)], [0] * BRANCH)
        leaves[out.id] = "main"
    return tree, admit(tree, leaves, j_max=None)


def rows(tree: Tree, trajectories: list, advantage: float) -> MicroBatch:
    mat = materialise(tree, trajectories)  # equal-length rows here (every branch is BRANCH long)
    mask = torch.from_numpy(np.stack(mat.target_mask))
    return MicroBatch(input_ids=torch.from_numpy(np.stack(mat.input_ids).astype(np.int64)), target_mask=mask,
                      behaviour_logprobs=torch.from_numpy(np.stack(mat.behaviour_logprobs)),
                      advantages=mask * advantage,
                      loss_weights=mask * mat.loss_weight, exec_ids=torch.zeros_like(mask, dtype=torch.long))


def step(trainer: CpuTrainer, batch) -> tuple[float, float]:
    """Seconds of one micro-step, and its loss."""
    t0 = time.perf_counter()
    loss = trainer.train_micro_step(batch).loss
    elapsed = time.perf_counter() - t0
    trainer.optimizer.zero_grad(set_to_none=True)
    return elapsed, loss


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        trainer = CpuTrainer(load_model(init_tiny(d, seed=0)))
    tree, trajectories = execution()
    tb, mb = tree_batch(tree, trajectories, 1.0, 0), rows(tree, trajectories, 1.0)
    times: dict[str, list[float]] = {"tree": [], "paths": []}
    for i in range(RUNS + 1):  # the first round warms up
        losses = {}
        for name, batch in (("tree", tb), ("paths", mb)):
            elapsed, losses[name] = step(trainer, batch)
            times[name] += [elapsed] if i else []
        assert abs(losses["tree"] - losses["paths"]) < 1e-4, losses
    tree_s, paths_s = statistics.median(times["tree"]), statistics.median(times["paths"])
    print(f"tiny model, prefix {PREFIX} + {BRANCHES} x {BRANCH} tokens, {torch.get_num_threads()} threads")
    print(f"tree : {tb.num_tokens:5d} tokens forwarded, {tree_s:.3f} s per micro-step")
    print(f"paths: {int(mb.input_ids.numel()):5d} tokens forwarded, {paths_s:.3f} s per micro-step")
    print(f"paths / tree: {paths_s / tree_s:.2f}x  (runs: tree {_fmt(times['tree'])}; paths {_fmt(times['paths'])})")


def _fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in xs)


if __name__ == "__main__":
    main()
