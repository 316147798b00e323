"""The CPU engine + trainer learn: after a few GSPO updates on "favour one byte", the engine
loaded with the published weights samples that byte measurably more often."""

from __future__ import annotations

import pytest
import torch

from gyre.workerd.engines.base import SamplingParams
from gyre.workerd.engines.cpu import CpuEngine
from gyre.workerd.model import load_model
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer
from tests.workerd.helpers import build_micro_step, byte_reward, prompt_ids

TARGET = ord("a")


def sample(engine, prompt, n, seed, max_new=24):
    for k in range(n):
        engine.add_request(f"{seed}-{k}", prompt, SamplingParams(max_new_tokens=max_new, seed=seed * 1000 + k))
    out = {}
    while engine.running:
        for o in engine.step():
            ids, lps = out.get(o.rid, ([], []))
            out[o.rid] = (ids + o.token_ids, lps + o.logprobs)
    return [out[f"{seed}-{k}"] for k in range(n)]


def frequency(engine, prompt) -> float:
    held_out = sample(engine, prompt, 32, seed=777)
    return sum(byte_reward(ids, TARGET) for ids, _ in held_out) / len(held_out)


@pytest.mark.slow
def test_favoured_byte_becomes_more_frequent(tiny_dir):
    engine = CpuEngine(load_model(tiny_dir))
    trainer = CpuTrainer(load_model(tiny_dir), lr=3e-3)
    prompt = prompt_ids()
    before = frequency(engine, prompt)
    for step in range(8):
        samples = sample(engine, prompt, 16, seed=step)
        r = torch.tensor([byte_reward(ids, TARGET) for ids, _ in samples])
        adv = ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).tolist()
        trainer.train_micro_step(MicroBatch.from_tensors(build_micro_step(prompt, samples, adv)))
        trainer.optimizer_step(num_executions=len(samples))
        engine.load_weights(trainer.export_weights().items(), trainer.version)  # publication
    after = frequency(engine, prompt)
    # Measured with model seeds 0..2: before 0.000-0.003, after 0.146-0.169 (32 x 24 held-out bytes).
    assert after > 3 * before and after - before > 0.03, (before, after)
