"""Gradient reduction over prebuilt prefix groups (gloo): k participating cells on the same
batch give the same update as one cell on the whole batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.workerd.model import load_model
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer

CHILD = Path(__file__).with_name("_reducer_child.py")


def batch(n_exec: int = 4, width: int = 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (n_exec, width), generator=g)
    mask = torch.zeros(n_exec, width, dtype=torch.bool)
    mask[:, 8:] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1).expand(-1, width) * mask
    return {"input_ids": ids, "target_mask": mask, "behaviour_logprobs": -torch.rand(n_exec, width, generator=g) * 5,
            "advantages": adv.contiguous(), "loss_weights": mask / mask.sum(1, keepdim=True),
            "exec_ids": torch.arange(n_exec).unsqueeze(1).expand(-1, width).contiguous()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("participants", [1, 2, 3])
def test_prefix_group_update_equals_single_cell(tiny_dir, tmp_path, participants):
    rows = batch()
    torch.save(rows, tmp_path / "batch.pt")
    world = 3  # three cells; prefix groups {0}, {0,1}, {0,1,2} are prebuilt on every rank
    init = f"file://{tmp_path}/rendezvous"
    procs = [subprocess.Popen([sys.executable, str(CHILD), str(r), str(world), init, str(tiny_dir),
                               str(tmp_path / "batch.pt"), str(participants), str(tmp_path / f"out{r}")],
                              stderr=subprocess.PIPE) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=150)
        assert p.returncode == 0, err.decode()[-2000:]

    lr = 1e-3
    ref = CpuTrainer(load_model(tiny_dir), lr=lr)
    grads = {}
    ref.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.clone() for n, p in ref.model.named_parameters()}))
    ref.train_micro_step(MicroBatch.from_tensors(rows))
    ref.optimizer_step(num_executions=4)
    expected = ref.export_weights()
    core = torch.load(tmp_path / "out0")
    assert core["version"] == 1
    # The update is made of the same gradient: summed over the participants, divided by the
    # batch's executions, clipped (a missing share, a double count or no division shows here).
    assert grads.keys() == core["grads"].keys()
    for name, g in grads.items():
        scale = g.abs().max().item()
        assert torch.allclose(core["grads"][name], g, rtol=1e-4, atol=1e-6 * scale), name
    # AdamW's first step (eps 1e-15) moves each weight by lr x sign(gradient): where a gradient
    # is within float32 summation noise of zero its sign (so a 2 lr step) depends on the
    # reduction's order; everywhere else the weights agree to 1e-5.
    for name, t in expected.items():
        got = core["weights"][name]
        g = grads.get(name)
        if g is None:  # not a parameter of its own (a buffer, a tied weight's second name)
            assert torch.allclose(got, t, atol=1e-5), name
            continue
        noise = g.abs() <= 1e-4 * g.abs().max()
        assert torch.allclose(got[~noise], t[~noise], atol=1e-5), name
        assert ((got - t).abs()[noise] <= 2 * lr + 1e-5).all(), name
    initial = load_model(tiny_dir).hf_state_dict()
    for r in range(1, participants):  # satellites took part in the reduction but did not update
        sat = torch.load(tmp_path / f"out{r}")
        assert sat["version"] == 0
        assert all(torch.equal(sat["weights"][k], v) for k, v in initial.items())
