"""Tree-form micro-steps (trainers/treebatch.py, CausalLM.tree_hidden) against the path-expanded
rows of the same admitted trajectories, on the tiny model and real proxy trees: the same
per-token log-probs, loss and gradients, each shared token forwarded once."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gyre.proxy.admission import admit, materialise
from gyre.proxy.roles import PRIORITY
from gyre.proxy.tree import Tree
from gyre.workerd import model as model_module
from gyre.workerd.loss import chunked_logprobs, tree_logprobs
from gyre.workerd.model import load_model
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer
from gyre.workerd.trainers.treebatch import TREE_STEP_TENSORS, TreeBatch
from tests.workerd.treebuild import concat_tree_batches, from_segments, tree_batch

LOGP_ATOL = 1e-5
LOSS_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def trainer(tiny_dir):
    return CpuTrainer(load_model(tiny_dir))


# --- trees and their path rows -----------------------------------------------------------

def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _output(tree: Tree, rng: random.Random, parent: int, call: str, n: int):
    return tree.add_output(parent, call, _tokens(rng, n), [-rng.random() * 4 for _ in range(n)], [0] * n)


@st.composite
def executions(draw):
    """One execution's real proxy tree and admitted trajectories: text roots (sub-agents are
    further roots), outputs and text under any node (retries share a prefix, compaction
    branches off early), and outputs copied into another context (external there)."""
    rng = random.Random(draw(st.integers(0, 2**16)))
    tree = Tree()
    for r in range(draw(st.integers(1, 3))):
        tree.add_text(-1, f"system {r}", _tokens(rng, draw(st.integers(1, 8))), f"r{r}")
    for i in range(draw(st.integers(1, 14))):
        parent = draw(st.integers(0, len(tree.nodes) - 1))
        n = draw(st.integers(1, 8))
        kind = draw(st.sampled_from(["output", "output", "text", "copy"]))
        outputs = [node for node in tree.nodes if node.policy]
        if kind == "copy" and outputs:
            source = draw(st.sampled_from(outputs))
            if tree.child(parent, "output", source.key) is None:
                tree.add_output_copy(parent, source, f"k{i}")
        elif kind == "text":
            tree.add_text(parent, f"text {i}", _tokens(rng, n), f"t{i}")
        else:
            _output(tree, rng, parent, f"o{i}", n)
    roles = {leaf.id: draw(st.sampled_from([*PRIORITY, "side"])) for leaf in tree.leaves()}
    j_max = draw(st.one_of(st.none(), st.integers(1, 5)))
    trajectories = admit(tree, roles, j_max=j_max, rng=random.Random(draw(st.integers(0, 99))))
    # Quarters, not any float: a subnormal advantage makes the backward pass crawl on denormals.
    advantage = draw(st.integers(-8, 8)) / 4
    return tree, trajectories, advantage


def materialised(execs) -> MicroBatch:
    """The proxy's own rows (admission.materialise), packed as coordinator/packing.py does."""
    rows = []
    for i, (tree, trajs, adv) in enumerate(execs):
        mat = materialise(tree, trajs)
        rows += [(ids, mask, lps, adv, mat.loss_weight, i)
                 for ids, mask, lps in zip(mat.input_ids, mat.target_mask, mat.behaviour_logprobs)]
    width = max(len(r[0]) for r in rows)
    t = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
         "target_mask": torch.zeros(len(rows), width, dtype=torch.bool),
         "behaviour_logprobs": torch.zeros(len(rows), width), "advantages": torch.zeros(len(rows), width),
         "loss_weights": torch.zeros(len(rows), width), "exec_ids": torch.zeros(len(rows), width, dtype=torch.long)}
    for r, (ids, mask, lps, adv, lw, i) in enumerate(rows):
        k, m = len(ids), torch.tensor(mask)
        t["input_ids"][r, :k] = torch.tensor(ids)
        t["target_mask"][r, :k] = m
        t["behaviour_logprobs"][r, :k] = torch.tensor(lps)
        t["advantages"][r, :k] = m * adv
        t["loss_weights"][r, :k] = m * lw
        t["exec_ids"][r] = i
    return MicroBatch(**t)


def gradients(trainer: CpuTrainer, batch) -> tuple[float, int, dict[str, torch.Tensor]]:
    """Loss and gradients of one micro-step, left with no gradients behind."""
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = trainer.train_micro_step(batch)
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return stats.loss, stats.tokens, grads


def assert_same_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=GRAD_RTOL, atol=GRAD_ATOL), \
            f"{name}: max diff {float((a[name] - b[name]).abs().max()):.3g}"


def all_logprobs(trainer: CpuTrainer, batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of every token (not only targets), tree form [N] and path rows [R, T]."""
    m, w = trainer.model, trainer.model.output_weight
    rows = batch.to_micro_batch()
    with torch.no_grad():
        h = m.tree_hidden(batch.input_ids, batch.position_ids, batch.seg_start, batch.seg_len, batch.seg_parent)
        tree = tree_logprobs(h, w, batch.input_ids, batch.prev_index, temperature=trainer.temperature)
        paths = chunked_logprobs(m.hidden(rows.input_ids), w, rows.input_ids, temperature=trainer.temperature)
    return tree, paths


# --- the properties ----------------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(execs=st.lists(executions(), min_size=1, max_size=3), temperature=st.sampled_from([1.0, 0.7]))
def test_tree_form_equals_path_rows(trainer, execs, temperature):
    assume(any(trajs for _, trajs, _ in execs))
    batch = concat_tree_batches([tree_batch(tree, trajs, adv, i) for i, (tree, trajs, adv) in enumerate(execs)])
    paths = materialised(execs)
    trainer.temperature = temperature

    # Every token's log-prob (targets or not) equals the same token's in each path row holding it.
    tree_lp, path_lp = all_logprobs(trainer, batch)
    for r, idx in enumerate(batch.path_rows()):
        assert batch.position_ids[idx].tolist() == list(range(len(idx)))  # its depth on its own path
        assert torch.allclose(tree_lp[idx], path_lp[r, :len(idx)], atol=LOGP_ATOL, rtol=0)

    # The loss and every gradient equal the proxy's materialised rows' (and the converter's).
    loss, tokens, grads = gradients(trainer, batch)
    for rows in (paths, batch.to_micro_batch()):
        loss_p, tokens_p, grads_p = gradients(trainer, rows)
        assert tokens == tokens_p == int(paths.target_mask.sum())
        assert loss == pytest.approx(loss_p, abs=LOSS_ATOL, rel=1e-5)
        assert_same_gradients(grads, grads_p)

    # Forwarded tokens: the union of the admitted paths, once each; fewer when paths share a root.
    unique = sum(len(tree.nodes[n].tokens) for tree, trajs, _ in execs for n in {n for t in trajs for n in t.path})
    expanded = sum(len(ids) for tree, trajs, _ in execs for ids in materialise(tree, trajs).input_ids)
    shared = any(len({t.path[0] for t in trajs}) < len(trajs) for _, trajs, _ in execs)
    assert batch.num_tokens == unique and batch.expanded_tokens == expanded
    assert (batch.num_tokens < expanded) if shared else (batch.num_tokens == expanded)
    assert sorted(batch.to_micro_batch().input_ids.tolist()) == sorted(paths.input_ids.tolist())
    trainer.temperature = 1.0


def agent_tree() -> tuple[Tree, list]:
    """A main agent with two retries of its second call sharing the prefix, a compaction that
    branches after the system prompt and carries a copy of an earlier output, and a sub-agent
    root; all leaves main or sub-agent, every trajectory admitted."""
    rng = random.Random(7)
    tree = Tree()
    system = tree.add_text(-1, "system", _tokens(rng, 40), "c0")
    first = _output(tree, rng, system.id, "c0", 12)
    result = tree.add_text(first.id, "tool result", _tokens(rng, 30), "c1")
    retry_a = _output(tree, rng, result.id, "c1", 9)
    retry_b = _output(tree, rng, result.id, "c1b", 11)
    summary = tree.add_text(system.id, "summary request", _tokens(rng, 8), "c2")
    copied = tree.add_output_copy(summary.id, first, "c2")
    after = _output(tree, rng, copied.id, "c2", 7)
    sub_root = tree.add_text(-1, "sub-agent system", _tokens(rng, 20), "c3")
    sub = _output(tree, rng, sub_root.id, "c3", 10)
    roles = {retry_a.id: "main", retry_b.id: "main", after.id: "main-summary", sub.id: "sub-agent"}
    trajectories = admit(tree, roles, j_max=None)
    assert len(trajectories) == 4
    return tree, trajectories


def test_an_execution_split_over_two_micro_steps_sums_to_one(trainer):
    tree, trajs = agent_tree()
    whole = tree_batch(tree, trajs, 0.8, 0)
    weight = 1.0 / sum(t.target_tokens(tree) for t in trajs)
    first, second = (tree_batch(tree, part, 0.8, 0, loss_weight=weight) for part in (trajs[:2], trajs[2:]))
    loss, _, grads = gradients(trainer, whole)
    loss_a, _, grads_a = gradients(trainer, first)
    loss_b, _, grads_b = gradients(trainer, second)
    assert loss_a + loss_b == pytest.approx(loss, abs=LOSS_ATOL)
    assert_same_gradients({n: grads_a[n] + grads_b[n] for n in grads}, grads)


def test_shared_prefix_is_forwarded_once():
    tree, trajs = agent_tree()
    batch = tree_batch(tree, trajs, 1.0, 0)
    # The system prompt (40) and the first call and its result (12 + 30) are shared by three
    # paths; the sub-agent root shares nothing.
    assert batch.num_tokens == sum(len(n.tokens) for n in tree.nodes)
    assert batch.expanded_tokens == sum(len(r) for r in materialise(tree, trajs).input_ids)
    assert batch.num_tokens < batch.expanded_tokens
    assert batch.targets == materialise(tree, trajs).targets
    assert float(batch.loss_weights.max()) == pytest.approx(1.0 / batch.targets)
    # The copied output is context, not a target, where it was copied to.
    copied = next(n for n in tree.nodes if n.kind == "output" and not n.policy)
    assert copied.id not in set().union(*(t.targets for t in trajs))


def test_chunked_queries_and_recomputed_layers_change_nothing(trainer, monkeypatch):
    tree, trajs = agent_tree()
    batch = tree_batch(tree, trajs, -0.5, 0)
    loss, _, grads = gradients(trainer, batch.to_micro_batch())
    monkeypatch.setattr(model_module, "QUERY_CHUNK", 5)  # blocks of 40-90 tokens in several calls
    trainer.model.checkpoint_layers = True
    try:
        loss_t, _, grads_t = gradients(trainer, batch)
    finally:
        trainer.model.checkpoint_layers = False
    assert loss_t == pytest.approx(loss, abs=LOSS_ATOL)
    assert_same_gradients(grads_t, grads)


def test_a_node_without_tokens_is_skipped(trainer):
    rng = random.Random(3)
    tree = Tree()
    system = tree.add_text(-1, "system", _tokens(rng, 6), "c0")
    glue = tree.add_text(system.id, "", [], "c0")
    a = _output(tree, rng, glue.id, "c0", 5)
    b = _output(tree, rng, glue.id, "c1", 4)
    trajs = admit(tree, {a.id: "main", b.id: "main"}, j_max=None)
    batch = tree_batch(tree, trajs, 1.0, 0)
    assert sorted(batch.seg_len.tolist()) == [4, 5, 6] and batch.seg_parent.tolist() == [-1, 0, 0]
    loss, _, grads = gradients(trainer, batch)
    loss_p, _, grads_p = gradients(trainer, materialised([(tree, trajs, 1.0)]))
    assert loss == pytest.approx(loss_p, abs=LOSS_ATOL)
    assert_same_gradients(grads, grads_p)


# --- construction, validation, tensors -------------------------------------------------

def small_batch(**change) -> TreeBatch:
    """Root [3 tokens] with children [2] and [2]; the children's tokens are targets."""
    b = from_segments(parents=[-1, 0, 0], tokens=[[1, 2, 3], [4, 5], [6, 7]],
                      target_mask=[[False] * 3, [True] * 2, [True] * 2],
                      behaviour_logprobs=[[0.0] * 3, [-1.0] * 2, [-2.0] * 2], advantage=0.5, loss_weight=0.25,
                      exec_index=3)
    return TreeBatch(**{**{k.removeprefix("tree."): v for k, v in b.to_tensors().items()}, **change})


def test_segments_give_positions_and_predictors():
    b = small_batch()
    assert b.seg_start.tolist() == [0, 3, 5]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert b.prev_index.tolist() == [-1, 0, 1, 2, 3, 2, 5]
    assert b.exec_ids.tolist() == [3] * 7 and b.advantages.tolist() == [0, 0, 0, 0.5, 0.5, 0.5, 0.5]
    rows = b.to_micro_batch()
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7]]
    assert rows.target_mask.tolist() == [[False] * 3 + [True] * 2] * 2
    assert (b.num_tokens, b.expanded_tokens) == (7, 10)


def test_tensors_round_trip_under_their_names():
    b = small_batch()
    named = b.to_tensors()
    assert list(named) == list(TREE_STEP_TENSORS)
    assert [str(t.dtype).removeprefix("torch.") for t in named.values()] == list(TREE_STEP_TENSORS.values())
    back = TreeBatch.from_tensors({k: (v.int() if v.dtype == torch.int64 else v) for k, v in named.items()})
    assert all(torch.equal(getattr(back, k.removeprefix("tree.")), v) for k, v in named.items())
    with pytest.raises(ValueError, match="lacks tensors: tree.seg_parent"):
        TreeBatch.from_tensors({k: v for k, v in named.items() if k != "tree.seg_parent"})


@pytest.mark.parametrize(("change", "message"), [
    ({"advantages": torch.zeros(6)}, r"advantages has shape \(6,\), want \[N\]"),
    ({"seg_parent": torch.tensor([-1, 0])}, r"seg_parent has shape \(2,\), want \[S\]"),
    ({"input_ids": torch.zeros(1, 7, dtype=torch.long)}, r"input_ids has shape \(1, 7\)"),
    ({"seg_parent": torch.tensor([-1, 2, 0])}, "segment 1 has parent 2: parents come first"),
    ({"seg_start": torch.tensor([0, 3, 4])}, "segment 2 starts at token 4, want 5"),
    ({"seg_len": torch.tensor([3, 2, 1])}, "segments cover 6 tokens, the batch has 7"),
    ({"position_ids": torch.tensor([0, 1, 2, 3, 4, 5, 6])}, r"position_ids\[5\] = 5, the segments say 3"),
    ({"prev_index": torch.tensor([-1, 0, 1, 2, 3, 4, 5])}, r"prev_index\[5\] = 4, the segments say 2"),
    ({"target_mask": torch.tensor([True] + [False] * 6)}, "target on token 0, a root's first"),
])
def test_invalid_batches_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        small_batch(**change)


def test_overlapping_targets_are_refused():
    tree, trajs = agent_tree()
    with pytest.raises(ValueError, match="in two trajectories"):
        tree_batch(tree, [trajs[0], trajs[0]], 1.0, 0)
