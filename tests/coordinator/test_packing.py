"""The coordinator's two micro-step forms (coordinator/packing.py) through the wire into the
CPU trainer: a group packed as trees (each unique token once) trains to the same loss and
gradients as the same group packed as path rows, whatever the split into micro-steps, and
sends fewer bytes when paths share a prefix."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.coordinator.buffer import Execution, Group
from gyre.coordinator.packing import pack_group
from gyre.coordinator.waterlevel import ExecState, Tracked
from gyre.proxy.records import Recorded
from gyre.proxy.roles import PRIORITY
from gyre.proxy.tree import Tree
from gyre.workerd import wire
from gyre.workerd.model import load_model
from gyre.workerd.tensors import from_frames
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer
from gyre.workerd.trainers.treebatch import from_wire
from tests.workerd.test_tree_training import GRAD_ATOL, GRAD_RTOL, LOSS_ATOL


@pytest.fixture(scope="module")
def trainer(tiny_dir):
    return CpuTrainer(load_model(tiny_dir))


def random_tree(rng: random.Random, calls: int) -> tuple[Tree, dict[int, str]]:
    """An agent-like tree: a long shared system prompt, turns of text and outputs, retries
    and compactions branching off earlier nodes, a sub-agent root; roles on every leaf."""
    tree = Tree(vocab_size=272)
    tree.add_text(-1, "system", [rng.randrange(256) for _ in range(rng.randint(20, 60))], "c0")
    if rng.random() < 0.5:
        tree.add_text(-1, "sub-agent", [rng.randrange(256) for _ in range(rng.randint(5, 20))], "s0")
    for i in range(calls):
        parent = rng.choice(range(len(tree.nodes))) if rng.random() < 0.3 else len(tree.nodes) - 1
        if rng.random() < 0.5:
            n = rng.randint(1, 12)
            tree.add_output(parent, f"o{i}", [rng.randrange(256) for _ in range(n)],
                            [-rng.random() * 3 for _ in range(n)], [0] * n)
        else:
            tree.add_text(parent, f"t{i}", [rng.randrange(256) for _ in range(rng.randint(1, 15))], f"c{i}")
    roles = {leaf.id: rng.choice([*PRIORITY, "side"]) for leaf in tree.leaves()}
    return tree, roles


def group_of(trees, rewards) -> Group:
    group = Group(id=0, task=None, version=0, size=len(trees))
    for i, ((tree, roles), reward) in enumerate(zip(trees, rewards)):
        run = Execution(id=f"x{i}", group=0, index=i, task=None, tracked=Tracked(ExecState.CLOSED),
                        version_dispatched=0, valid=True, reward=reward,
                        recorder=Recorded(f"x{i}", tree, [], roles))
        group.runs.append(run)
    return group


def train(trainer: CpuTrainer, steps) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    for ms in steps:
        named = from_frames(ms.frames())
        batch = from_wire(named) if wire.TREE_INPUT_IDS in named else MicroBatch.from_tensors(named)
        loss += trainer.train_micro_step(batch).loss
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss, grads


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), executions=st.integers(1, 4), calls=st.integers(1, 12),
       j_max=st.one_of(st.none(), st.integers(1, 5)), budget=st.sampled_from([40, 120, 8192]),
       min_steps=st.integers(1, 4))
def test_tree_and_path_micro_steps_train_alike(trainer, seed, executions, calls, j_max, budget, min_steps):
    """However a group is cut into micro-steps (by the budget, or spread over the training
    cells: min_steps), the step trains the same loss and gradients."""
    rng = random.Random(seed)
    trees = [random_tree(rng, calls) for _ in range(executions)]
    group = group_of(trees, [rng.randint(0, 4) / 4 for _ in trees])
    tree_steps, n_tree, counted_tree = pack_group(group, j_max=j_max, seed=1, next_exec=0, budget_tokens=budget,
                                                  min_steps=min_steps)
    if budget == 8192:  # each execution whole, one micro-step for all: spread over the cells, where it can
        assert len(tree_steps) == min(min_steps, n_tree)
    path_steps, n_path, counted_path = pack_group(group, j_max=j_max, seed=1, next_exec=0, budget_tokens=budget,
                                                  form="paths")
    assert (n_tree, counted_tree) == (n_path, counted_path)
    if not path_steps:
        assert not tree_steps
        return
    unique = sum(ms.stats.unique for ms in tree_steps)
    assert unique == sum(ms.stats.unique for ms in path_steps)  # the same admitted tokens
    assert sum(ms.stats.targets for ms in tree_steps) == sum(ms.stats.targets for ms in path_steps)
    if budget == 8192:  # each execution whole: forward tokens are the union of its admitted paths
        assert sum(ms.stats.forward for ms in tree_steps) == unique
        assert sum(ms.nbytes for ms in tree_steps) < sum(ms.nbytes for ms in path_steps)
    packed_steps, _, _ = pack_group(group, j_max=j_max, seed=1, next_exec=0, budget_tokens=budget, form="packed")
    # Unpadded rows: each path's tokens once per path, no padding slot computed.
    assert sum(ms.stats.forward for ms in packed_steps) == sum(ms.stats.expanded for ms in path_steps)
    loss_tree, grads_tree = train(trainer, tree_steps)
    loss_path, grads_path = train(trainer, path_steps)
    loss_packed, grads_packed = train(trainer, packed_steps)
    assert loss_tree == pytest.approx(loss_path, abs=LOSS_ATOL, rel=1e-5)
    assert loss_packed == pytest.approx(loss_path, abs=LOSS_ATOL, rel=1e-5)
    for name in grads_tree:
        assert torch.allclose(grads_tree[name], grads_path[name], rtol=GRAD_RTOL, atol=GRAD_ATOL), name
        assert torch.allclose(grads_packed[name], grads_path[name], rtol=GRAD_RTOL, atol=GRAD_ATOL), name


def test_the_wire_form_is_compact_and_rebuilds_positions(trainer):
    """One execution with a 200-token prefix shared by 3 branches: the tree form sends each
    unique token's id once (2 bytes: the tiny vocabulary fits uint16) and the targets'
    log-probs, and the rebuilt batch has each token at its depth in its own path."""
    tree = Tree(vocab_size=272)
    rng = random.Random(0)
    root = tree.add_text(-1, "system", [rng.randrange(256) for _ in range(200)], "c")
    roles = {}
    for b in range(3):
        out = tree.add_output(root.id, f"o{b}", [rng.randrange(256) for _ in range(10)], [-1.0] * 10, [0] * 10)
        roles[out.id] = "main"
    other = Tree(vocab_size=272)  # a group mate without a model call: a reward, nothing to train
    other.add_text(-1, "system", [1, 2, 3], "c")
    group = group_of([(tree, roles), (other, {0: "main"})], [1.0, 0.0])
    (ms,), _, counted = pack_group(group, j_max=None, seed=0, next_exec=0, budget_tokens=8192)
    assert counted == 1
    assert ms.stats.unique == ms.stats.forward == 230 and ms.stats.expanded == 630 and ms.stats.targets == 30
    named = {f.name: f for f in ms.frames()}
    assert named[wire.TREE_INPUT_IDS].data.dtype == np.uint16
    assert ms.nbytes < 230 * 4 * 1.25  # within the bound: <= 1.25 x unique tokens x 4 bytes
    batch = from_wire(from_frames(ms.frames()))
    assert batch.position_ids.tolist() == list(range(200)) + list(range(200, 210)) * 3
    assert batch.prev_index[200:].tolist()[::10] == [199, 199, 199]  # each branch continues the prefix


def test_an_unknown_packing_is_refused(tmp_path):
    from gyre.coordinator.config import CoordinatorConfig

    with pytest.raises(ValueError, match="packing must be one of tree, paths, packed"):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, packing="rows")


def test_a_claude_code_compaction_tree_is_sent_and_forwarded_once_per_token():
    """The tree Claude Code recorded across a task, /compact and one more turn
    (tests/fixtures/claude_code_compaction): the tree form forwards the union of the admitted
    paths, a third less than the path rows, and sends under 1.25 x 4 bytes per unique token."""
    from pathlib import Path

    from gyre.proxy.records import load_execution

    rec = load_execution(Path(__file__).resolve().parent.parent / "fixtures" / "claude_code_compaction")
    assert rec.tree.stats()["unique_tokens"] == 162_534 and sorted(rec.leaf_roles.values()) == [
        "main", "main", "main-summary"]
    other = Tree(vocab_size=272)
    other.add_text(-1, "system", [1], "c")
    group = group_of([(rec.tree, rec.leaf_roles), (other, {0: "main"})], [1.0, 0.0])
    trees, _, _ = pack_group(group, j_max=5, seed=0, next_exec=0, budget_tokens=1 << 20)
    paths, _, _ = pack_group(group, j_max=5, seed=0, next_exec=0, budget_tokens=1 << 20, form="paths")
    (tree_step,) = trees
    union = {n for t in rec.admit(j_max=5, seed=0)[0] for n in t.path}
    unique = sum(len(rec.tree.nodes[n].tokens) for n in union)
    assert tree_step.stats.forward == tree_step.stats.unique == unique == 162_534
    assert sum(ms.stats.expanded for ms in paths) == 240_079
    assert tree_step.nbytes < 1.25 * 4 * unique < sum(ms.nbytes for ms in paths)
    batch = from_wire(from_frames(tree_step.frames()))  # rebuilds, validated (positions, ancestry)
    assert batch.num_tokens == unique and int(batch.position_ids.max()) + 1 == max(
        rec.tree.nodes[leaf].end for leaf in rec.leaf_roles)
