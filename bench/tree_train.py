"""bench/tree_train.py: a training step's tokens and trainer seconds, tree form against path rows.

For each execution, its admitted trajectories (J_max = 5) are packed the two ways the
coordinator packs them (coordinator/packing.py `pack_group`, micro-steps of at most
`--micro-step-tokens`), sent through the wire encoding and trained by the CPU trainer on the
tiny model (forward, GSPO loss, backward), the two forms alternating so that a busy machine
slows both alike. Printed per execution: unique admitted tokens (the union of the admitted
paths), tokens the forward pass computes in each form (padded slots for paths), bytes sent,
and trainer seconds per step (median of `--runs`), with the ratio. Checked: the tree form's
unique tokens are exactly the union (and all it forwards when the execution fits one
micro-step), and both forms give the same loss. Executions:
- `prefix`: a 2,000-token prefix shared by 4 sampled branches of 300 tokens;
- `synthetic`: bench/proxy.py's 600-call agent (tool turns, two compactions, five sub-agents);
- `claude-code`: the tree the real Claude Code recorded in tests/harness's compaction test
  (tests/fixtures/claude_code_compaction/: a task, /compact, one more turn).
Not a test. Run:
    python bench/tree_train.py [--trees prefix,synthetic,claude-code] [--runs 1] [--synthetic-calls 600]
                               [--train-max-path 16384] [--json PATH]
Trainer seconds are measured where the longest admitted path fits the CPU trainer's attention
(`--train-max-path`); a smaller synthetic (`--synthetic-calls 120`) fits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gyre.coordinator.buffer import Execution, Group
from gyre.coordinator.packing import pack_group
from gyre.coordinator.waterlevel import ExecState, Tracked
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.records import Recorded, load_execution
from gyre.proxy.tree import Tree
from gyre.workerd import wire
from gyre.workerd.model import load_model
from gyre.workerd.modeldir import init_tiny
from gyre.workerd.tensors import from_frames
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer
from gyre.workerd.trainers.treebatch import from_wire

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "claude_code_compaction"
PREFIX, BRANCHES, BRANCH = 2000, 4, 300


def prefix_execution() -> Recorded:
    rng = random.Random(0)
    tree = Tree(vocab_size=272)
    root = tree.add_text(-1, "prefix", [rng.randrange(256) for _ in range(PREFIX)], "c0")
    roles = {}
    for b in range(BRANCHES):
        out = tree.add_output(root.id, f"c{b}", [rng.randrange(256) for _ in range(BRANCH)],
                              [-rng.random() * 4 for _ in range(BRANCH)], [0] * BRANCH)
        roles[out.id] = "main"
    return Recorded("prefix", tree, [], roles)


def synthetic_execution(model_dir: Path, calls: int) -> Recorded:
    sys.path.insert(0, str(ROOT / "bench"))
    from proxy import synthetic_execution as build  # bench/proxy.py's 600-call agent

    ex, _ = build(ChatTokenizer(model_dir), calls)
    return Recorded("synthetic", ex.tree, ex.calls, ex.leaf_roles)


def group_of(rec: Recorded) -> Group:
    """The execution with a group mate of another reward, so its advantage is not zero."""
    group = Group(id=0, task=None, version=0, size=2)
    empty = Tree()
    empty.add_text(-1, "system", [1], "c")
    for i, (r, reward) in enumerate(((rec, 1.0), (Recorded("mate", empty, [], {0: "main"}), 0.0))):
        group.runs.append(Execution(id=f"x{i}", group=0, index=i, task=None, tracked=Tracked(ExecState.CLOSED),
                                    version_dispatched=0, valid=True, reward=reward, recorder=r))
    return group


def train(trainer: CpuTrainer, steps) -> tuple[float, float]:
    """Seconds and loss of one step of these micro-steps (gradients dropped after)."""
    t0 = time.perf_counter()
    loss = 0.0
    for ms in steps:
        named = from_frames(ms.frames())
        batch = from_wire(named) if wire.TREE_INPUT_IDS in named else MicroBatch.from_tensors(named)
        loss += trainer.train_micro_step(batch).loss
    elapsed = time.perf_counter() - t0
    trainer.optimizer.zero_grad(set_to_none=True)
    return elapsed, loss


def measure(name: str, rec: Recorded, trainer: CpuTrainer, args) -> dict:
    group = group_of(rec)
    packed = {form: pack_group(group, j_max=5, seed=0, next_exec=0, budget_tokens=args.micro_step_tokens,
                               form=form)[0] for form in ("tree", "paths")}
    unique = sum(ms.stats.unique for ms in packed["tree"])
    union = {n for t in rec.admit(j_max=5, seed=0)[0] for n in t.path}
    assert unique == sum(len(rec.tree.nodes[n].tokens) for n in union)  # each admitted node once
    longest = max(ms.width for ms in packed["paths"])
    times: dict[str, list[float]] = {"tree": [], "paths": []}
    trainable = longest <= args.train_max_path  # attention over a path is quadratic in memory on CPU
    for _ in range(args.runs if trainable else 0):
        losses = {}
        for form, steps in packed.items():
            elapsed, losses[form] = train(trainer, steps)
            times[form].append(elapsed)
        assert abs(losses["tree"] - losses["paths"]) < 1e-4 * max(1.0, abs(losses["paths"])), losses
    out = {"execution": name, "unique_admitted_tokens": unique, "longest_path": longest,
           "expanded_tokens": sum(ms.stats.expanded for ms in packed["paths"])}
    for form, steps in packed.items():
        out[form] = {"micro_steps": len(steps), "forward_tokens": sum(ms.stats.forward for ms in steps),
                     "wire_bytes": sum(ms.nbytes for ms in steps),
                     "seconds": statistics.median(times[form]) if times[form] else None,
                     "runs": [round(x, 3) for x in times[form]]}
    if out["tree"]["micro_steps"] == 1:  # the execution whole: the union, computed once
        assert out["tree"]["forward_tokens"] == unique
    out["seconds_paths_over_tree"] = out["paths"]["seconds"] / out["tree"]["seconds"] if trainable else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="prefix,synthetic,claude-code")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--micro-step-tokens", type=int, default=8192, help="as the run config's")
    ap.add_argument("--train-max-path", type=int, default=16384,
                    help="train (and time) only executions whose longest admitted path is at most this: the CPU "
                         "trainer's attention over one path holds path x path scores")
    ap.add_argument("--synthetic-calls", type=int, default=600)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model_dir = init_tiny(Path(d) / "model", seed=0)
        # Activations recomputed in the backward pass: a trajectory of ~100k tokens is one
        # micro-step in either form (it is never cut), and must fit in memory.
        trainer = CpuTrainer(load_model(model_dir), checkpoint_layers=True)
        train(trainer, pack_group(group_of(prefix_execution()), j_max=5, seed=0, next_exec=0,
                                  budget_tokens=args.micro_step_tokens)[0])  # warm-up
        builders = {"prefix": prefix_execution,
                    "synthetic": lambda: synthetic_execution(model_dir, args.synthetic_calls),
                    "claude-code": lambda: load_execution(FIXTURE)}
        results = [measure(name, builders[name](), trainer, args) for name in args.trees.split(",")]
    print(f"tiny model, J_max 5, {torch.get_num_threads()} threads; trainer seconds per step (median of {args.runs})")
    print(f"{'execution':<12}{'unique adm.':>12}{'expanded':>10}{'tree fwd':>10}{'paths fwd':>11}"
          f"{'tree MB':>9}{'paths MB':>10}{'tree s':>8}{'paths s':>9}{'paths/tree':>12}")
    for r in results:
        t, p = r["tree"], r["paths"]
        timed = r["seconds_paths_over_tree"] is not None
        secs = (f"{t['seconds']:>8.2f}{p['seconds']:>9.2f}{r['seconds_paths_over_tree']:>11.2f}x" if timed
                else f"{'n/a':>8}{'n/a':>9}{'':>12}  (a path of {r['longest_path']:,} tokens: not trained here)")
        print(f"{r['execution']:<12}{r['unique_admitted_tokens']:>12,}{r['expanded_tokens']:>10,}"
              f"{t['forward_tokens']:>10,}{p['forward_tokens']:>11,}{t['wire_bytes'] / 1e6:>9.2f}"
              f"{p['wire_bytes'] / 1e6:>10.2f}" + secs)
    out = {"results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
