"""bench/pipeline.py: a pipeline-parallel megatron-core cell's micro-step, by GPipe chunks.

    python bench/pipeline.py [--layers 8] [--hidden 256] [--rows 16] [--tokens 128]
                             [--chunks 1,2,4,8] [--repeat 5]

A PP=2 cell as workerd builds it (trainers/tp.py: rank 0 here, rank 1 a child process; one
CPU thread each, on CPU behind the shim) trains the same micro-step (forward, GSPO loss,
backward) with its rows cut into 1, 2, 4, 8 chunks. With one chunk the stages take turns;
with more, stage 1 works on chunk c while stage 0 works on chunk c+1, and the bubble is
(PP - 1) / (chunks + PP - 1) of the step. Baseline, in the same run: the whole model in one
one-thread process (PP=1). Prints seconds per micro-step and the ratios, one JSON object last.
Needs two free cores to show the overlap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gyre.workerd.modeldir import init_tiny, load_config
from gyre.workerd.trainers.base import MicroBatch


def micro_step(rows: int, tokens: int, vocab: int) -> MicroBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    mask[:, 0] = False
    execs = (torch.arange(rows) // 2).unsqueeze(1).expand(rows, tokens).contiguous()  # two rows per execution
    adv = torch.where(execs % 2 == 0, 1.0, -1.0) * mask
    weights = mask / (2 * (tokens - 1))
    return MicroBatch(input_ids=ids, target_mask=mask, behaviour_logprobs=-torch.rand(rows, tokens, generator=g) * 5,
                      advantages=adv, loss_weights=weights.float(), exec_ids=execs)


def timed(trainer, batch: MicroBatch, repeat: int) -> float:
    trainer.train_micro_step(batch)  # warm-up
    trainer.optimizer_step(1)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        trainer.train_micro_step(batch)
        times.append(time.perf_counter() - t0)
        trainer.optimizer_step(1)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core per rank (the children are given as many as this process)
    model_dir = init_tiny(Path(tempfile.mkdtemp(prefix="gyre-bench-pp-")) / "model", seed=0,
                          overrides={"num_hidden_layers": args.layers, "hidden_size": args.hidden,
                                     "intermediate_size": 4 * args.hidden, "num_attention_heads": 8,
                                     "num_key_value_heads": 4})
    config = load_config(model_dir)
    batch = micro_step(args.rows, args.tokens, config.vocab_size)
    print(f"model: {args.layers} layers, hidden {args.hidden}; micro-step {args.rows} rows x {args.tokens} tokens")

    from gyre.workerd.trainers.megatron import MegatronTrainer
    from gyre.workerd.trainers.megatron_model import teardown_parallel
    from gyre.workerd.trainers.tp import TensorParallelTrainer

    # The baseline first, in a cell of its own world (closed before the PP cells are built).
    one = MegatronTrainer(str(model_dir), config, lr=1e-6, offload=False)
    baseline = timed(one, batch, args.repeat)
    print(f"{'PP=1 (one process)':<22}{baseline:.3f} s per micro-step")
    teardown_parallel()  # the baseline's private world, gone before a cell takes the process
    rows = []
    for chunks in [int(c) for c in args.chunks.split(",")]:
        cell = TensorParallelTrainer(str(model_dir), config, tp=1, pp=2, lr=1e-6, offload=False, microbatches=chunks)
        try:
            secs = timed(cell, batch, args.repeat)
        finally:
            cell.close()
        bubble = 1 / (min(chunks, args.rows) + 1)
        rows.append({"chunks": chunks, "seconds": round(secs, 4), "speedup_vs_pp1": round(baseline / secs, 2),
                     "ideal_bubble": round(bubble, 3)})
        print(f"{f'PP=2, {chunks} chunk(s)':<22}{secs:.3f} s per micro-step  "
              f"{baseline / secs:.2f}x PP=1  (ideal bubble {bubble:.0%})")
    first = rows[0]["seconds"]
    print("ratios (same run): PP=2 with k chunks / PP=2 with 1 chunk: "
          + ", ".join(f"{r['chunks']}: {r['seconds'] / first:.2f}x" for r in rows))
    print(json.dumps({"baseline_pp1_seconds": round(baseline, 4), "rows": rows}))


if __name__ == "__main__":
    main()
