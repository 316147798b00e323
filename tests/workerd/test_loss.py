"""The trainer's GSPO loss and gradients against a straightforward reference of DESIGN.md's
objective, with one execution's trajectories spread over two micro-steps."""

from __future__ import annotations

import copy

import pytest
import torch

from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer


def make_rows(seed: int):
    """Five trajectories of three executions: exec 0 has rows 0, 1, 4 (split across steps)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 5, 24
    exec_of_row = [0, 0, 1, 2, 0]
    adv = {0: 1.3, 1: -0.7, 2: 0.4}
    ids = torch.randint(0, 256, (rows, width), generator=g)
    mask = torch.rand(rows, width, generator=g) < 0.6
    mask[:, 0] = False
    mask[:, -3:] = False  # padding-like tail
    behaviour = -torch.rand(rows, width, generator=g) * 6  # stale/mismatched behaviour log-probs
    return ids, mask, behaviour, exec_of_row, adv


def reference_loss(model, ids, mask, behaviour, exec_of_row, adv) -> torch.Tensor:
    """mean_i [ -(1/L_i) sum_{t in T_i} w_t min(s_it A_i, clip(s_it) A_i) ], written plainly."""
    logits = model(ids)
    per_exec: dict[int, list[tuple[torch.Tensor, float]]] = {}
    for r in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if mask[r, t]:
                lp = torch.log_softmax(logits[r, t - 1], dim=-1)[ids[r, t]]
                per_exec.setdefault(exec_of_row[r], []).append((lp, float(behaviour[r, t])))
    losses = []
    for i, toks in per_exec.items():
        l = torch.stack([lp for lp, _ in toks])
        b = torch.tensor([b for _, b in toks])
        s_i = torch.exp((l - l.detach()).mean())  # l_old = sg(l): one update per batch
        total = 0.0
        for k in range(len(toks)):
            w = min(float(torch.exp(l[k].detach() - b[k])), 5.0)
            s_it = s_i.detach() * torch.exp(l[k] - l[k].detach())
            a = adv[i]
            total = total + w * torch.minimum(s_it * a, torch.clamp(s_it, 0.995, 1.005) * a)
        losses.append(-total / len(toks))
    return torch.stack(losses).mean()


def micro_batch(rows, ids, mask, behaviour, exec_of_row, adv, counts):
    sel = torch.tensor(rows)
    ex = torch.tensor([exec_of_row[r] for r in rows]).unsqueeze(1).expand(-1, ids.shape[1])
    a = torch.tensor([adv[exec_of_row[r]] for r in rows]).unsqueeze(1).expand(-1, ids.shape[1])
    lw = torch.tensor([1.0 / counts[exec_of_row[r]] for r in rows]).unsqueeze(1).expand(-1, ids.shape[1])
    m = mask[sel]
    return MicroBatch(input_ids=ids[sel], target_mask=m, behaviour_logprobs=behaviour[sel],
                      advantages=a * m, loss_weights=lw * m, exec_ids=ex.contiguous())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_micro_steps_equal_reference(tiny_model, seed):
    ids, mask, behaviour, exec_of_row, adv = make_rows(seed)
    counts = {i: int(sum(mask[r].sum() for r in range(5) if exec_of_row[r] == i)) for i in adv}
    ref_model = copy.deepcopy(tiny_model)
    trainer = CpuTrainer(tiny_model, lr=1e-3)

    ref = reference_loss(ref_model, ids, mask, behaviour, exec_of_row, adv)
    ref.backward()

    s1 = trainer.train_micro_step(micro_batch([0, 2], ids, mask, behaviour, exec_of_row, adv, counts))
    s2 = trainer.train_micro_step(micro_batch([1, 3, 4], ids, mask, behaviour, exec_of_row, adv, counts))
    assert (s1.loss + s2.loss) / 3 == pytest.approx(ref.item(), abs=1e-5)
    assert s1.tokens + s2.tokens == int(mask.sum())
    for (name, p), q in zip(tiny_model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p.grad / 3, q.grad, atol=1e-6, rtol=1e-4), name

    # One optimizer update: normalise by executions, clip to 1.0, AdamW(0.9, 0.95, 1e-15, wd 0.01).
    # The reference starts from the trainer's own normalised gradients: with eps=1e-15 Adam's
    # first step is ~lr*sign(g), which would amplify float noise in near-zero gradients.
    for p, q in zip(tiny_model.parameters(), ref_model.parameters()):
        q.grad = p.grad / 3
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), 1.0)
    ref_opt.step()
    norm = trainer.optimizer_step(num_executions=3)
    assert norm == pytest.approx(float(ref_norm), rel=1e-4)
    assert trainer.version == 1
    for (name, p), q in zip(tiny_model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name


def test_importance_weight_is_capped(tiny_model):
    """Behaviour log-probs far below the current ones: w_t = 5, not exp(gap)."""
    ids, mask, behaviour, exec_of_row, adv = make_rows(3)
    counts = {i: int(sum(mask[r].sum() for r in range(5) if exec_of_row[r] == i)) for i in adv}
    very_stale = torch.full_like(behaviour, -50.0)
    ref_model = copy.deepcopy(tiny_model)
    ref = reference_loss(ref_model, ids, mask, very_stale, exec_of_row, adv)
    base = reference_loss(copy.deepcopy(tiny_model), ids, mask, behaviour * 0 - 1e9, exec_of_row, adv)
    trainer = CpuTrainer(tiny_model)
    s = trainer.train_micro_step(micro_batch(list(range(5)), ids, mask, very_stale, exec_of_row, adv, counts))
    assert s.loss / 3 == pytest.approx(ref.item(), abs=1e-5)
    assert ref.item() == pytest.approx(base.item(), rel=1e-6)  # both capped at 5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_full_log_softmax_with_their_gradients(tiny_model, temperature):
    """loss.py's chunked log-probs (a few positions' logits at a time, recomputed in the
    backward) equal the whole-vocabulary log-softmax's, values and every gradient."""
    from gyre.workerd.loss import chunked_logprobs, token_logprobs

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (3, 40))
    mask = torch.rand(3, 40) < 0.5
    mask[:, 0] = False
    ref = token_logprobs(tiny_model(ids), ids, temperature)
    (ref * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad(set_to_none=True)
    got = chunked_logprobs(tiny_model.hidden(ids), tiny_model.output_weight, ids, mask, temperature=temperature,
                           chunk=7)
    assert torch.allclose(got[mask], ref[mask], atol=1e-5) and not got[~mask].any()
    got.sum().backward()
    for n, p in tiny_model.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-5), n


def test_recomputed_layers_give_the_same_gradients(tiny_dir):
    """checkpoint_layers (activations recomputed in the backward pass) changes memory, not maths."""
    from gyre.workerd.model import load_model

    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[:, 0] = False
    z = torch.zeros(2, 24)
    batch = MicroBatch(input_ids=ids, target_mask=mask, behaviour_logprobs=z - 5.0, advantages=z + 1.0,
                       loss_weights=z + 1 / 46, exec_ids=z.long())
    grads = []
    for recompute in (False, True):
        trainer = CpuTrainer(load_model(tiny_dir), checkpoint_layers=recompute)
        stats = trainer.train_micro_step(batch)
        grads.append((stats.loss, {n: p.grad for n, p in trainer.model.named_parameters()}))
    (loss_a, a), (loss_b, b) = grads
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)


def test_no_targets_means_zero_loss_and_no_grad(tiny_model):
    ids = torch.randint(0, 256, (2, 8))
    z = torch.zeros(2, 8)
    trainer = CpuTrainer(tiny_model)
    s = trainer.train_micro_step(MicroBatch(input_ids=ids, target_mask=z.bool(), behaviour_logprobs=z,
                                            advantages=z, loss_weights=z, exec_ids=z.long()))
    assert s.loss == 0 and s.tokens == 0
    assert all(p.grad is None or not p.grad.any() for p in tiny_model.parameters())


def test_micro_batch_validates_shapes():
    z = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="advantages has shape"):
        MicroBatch(input_ids=z.long(), target_mask=z.bool(), behaviour_logprobs=z,
                   advantages=torch.zeros(2, 7), loss_weights=z, exec_ids=z.long())
    m = z.bool().clone()
    m[0, 0] = True
    with pytest.raises(ValueError, match="first token"):
        MicroBatch(input_ids=z.long(), target_mask=m, behaviour_logprobs=z, advantages=z, loss_weights=z,
                   exec_ids=z.long())


def assert_non_finite_gradients_are_dropped(trainer) -> None:
    """A NaN advantage makes non-finite gradients: the step refuses, nothing is updated, and
    the next step is not polluted by them (they were dropped, not added)."""
    ids, mask, behaviour, exec_of_row, adv = make_rows(4)
    counts = {i: 1 for i in adv}
    before = trainer.export_weights()
    trainer.train_micro_step(micro_batch([0, 1], ids, mask, behaviour, exec_of_row, {**adv, 0: float("nan")}, counts))
    with pytest.raises(RuntimeError, match="non-finite gradient norm"):
        trainer.optimizer_step(2)
    assert trainer.version == 0 and all(torch.equal(trainer.export_weights()[k], v) for k, v in before.items())
    trainer.train_micro_step(micro_batch([0, 1], ids, mask, behaviour, exec_of_row, adv, counts))
    assert trainer.optimizer_step(2) > 0 and trainer.version == 1


def test_non_finite_gradients_update_nothing_on_the_cpu_trainer(tiny_model):
    """The guard lives in the shared optimizer step (trainers/base.py): every trainer has it."""
    assert_non_finite_gradients_are_dropped(CpuTrainer(copy.deepcopy(tiny_model), lr=1e-3))


def test_activation_recomputation_is_on_where_activations_would_not_fit(tiny_dir):
    import dataclasses

    from gyre.workerd.backends import checkpoint_layers
    from gyre.workerd.modeldir import load_config
    from gyre.workerd.wire import TrainerSpec

    tiny = load_config(tiny_dir)
    smollm2 = dataclasses.replace(tiny, hidden_size=576, num_hidden_layers=30)  # its shape
    assert not checkpoint_layers(tiny, TrainerSpec()) and checkpoint_layers(smollm2, TrainerSpec())
    assert not checkpoint_layers(smollm2, TrainerSpec(micro_step_tokens=1024))
    assert checkpoint_layers(tiny, TrainerSpec(checkpoint_layers=True))
    assert not checkpoint_layers(smollm2, TrainerSpec(checkpoint_layers=False))
