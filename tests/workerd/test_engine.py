"""The CPU rollout engine: batching changes nothing but speed, abort, stop, role memory,
and the rollout/training consistency check (behaviour vs trainer log-probs, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from gyre.workerd.engines.base import SamplingParams
from gyre.workerd.engines.cpu import CpuEngine, EngineReleased
from gyre.workerd.loss import token_logprobs
from gyre.workerd.model import load_model


def run(engine: CpuEngine) -> dict[str, tuple[list[int], list[float], str]]:
    out: dict[str, tuple[list[int], list[float], str]] = {}
    while engine.running:
        for o in engine.step():
            ids, lps, _ = out.get(o.rid, ([], [], None))
            out[o.rid] = (ids + o.token_ids, lps + o.logprobs, o.finish_reason)
    return out


PROMPTS = [list(b"hello there"), list(b"a"), list(b"a much longer prompt than the others, to vary lengths")]


def test_batched_equals_sequential(tiny_model):
    batched = CpuEngine(tiny_model)
    for i, p in enumerate(PROMPTS):
        batched.add_request(f"r{i}", p, SamplingParams(max_new_tokens=12, seed=i))
    together = run(batched)
    for i, p in enumerate(PROMPTS):
        alone = CpuEngine(tiny_model)
        alone.add_request("x", p, SamplingParams(max_new_tokens=12, seed=i))
        ids, lps, reason = run(alone)["x"]
        assert together[f"r{i}"][0] == ids and reason == "length"
        assert torch.allclose(torch.tensor(together[f"r{i}"][1]), torch.tensor(lps), atol=1e-5)


def test_behaviour_logprobs_match_trainer(tiny_dir):
    """The mismatch check: same weights, same tokens -> engine and trainer log-probs agree."""
    engine_model, trainer_model = load_model(tiny_dir), load_model(tiny_dir)
    engine = CpuEngine(engine_model)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=40, seed=10 + i))
    results = run(engine)
    for i, p in enumerate(PROMPTS):
        ids, lps, _ = results[f"r{i}"]
        row = torch.tensor([p + ids])
        with torch.no_grad():
            ref = token_logprobs(trainer_model(row), row)[0, len(p):]
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (torch.tensor(lps) - ref).abs().max()


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_behaviour_logprobs_at_a_temperature_match_the_trainer_at_it(tiny_dir, temperature):
    """Behaviour log-probs are of the distribution sampled from (logits / T), and the trainer
    computes them at the same T: equal within 1e-4, and not the temperature-1 ones."""
    from gyre.workerd.trainers.cpu import CpuTrainer

    engine = CpuEngine(load_model(tiny_dir))
    trainer = CpuTrainer(load_model(tiny_dir), temperature=temperature)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=30, temperature=temperature, seed=i))
    results = run(engine)
    for i, p in enumerate(PROMPTS):
        ids, lps, _ = results[f"r{i}"]
        row = torch.tensor([p + ids])
        ref = trainer.current_logprobs(row)[0, len(p):]
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (torch.tensor(lps) - ref).abs().max()
        with torch.no_grad():
            at_one = token_logprobs(trainer.model(row), row)[0, len(p):]
        assert (torch.tensor(lps) - at_one).abs().max() > 1e-3


def test_top_p_behaviour_logprobs_are_renormalised_over_the_kept_set(tiny_model):
    engine = CpuEngine(tiny_model)
    engine.add_request("p", PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.5, seed=3))
    ids, lps, _ = run(engine)["p"]
    row = torch.tensor([PROMPTS[0] + ids])
    with torch.no_grad():
        full = token_logprobs(tiny_model(row), row)[0, len(PROMPTS[0]):]
    # Truncation to half the mass raises every drawn token's probability (by at least log 2 - slack).
    assert all(lp <= 1e-6 for lp in lps) and all(b > f + 0.5 for b, f in zip(lps, full.tolist()))


def test_stop_token_ends_request_and_is_kept(tiny_model):
    engine = CpuEngine(tiny_model)
    engine.add_request("g", PROMPTS[0], SamplingParams(max_new_tokens=5, temperature=0))
    greedy = run(engine)["g"][0]
    engine.add_request("s", PROMPTS[0], SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(greedy[2],)))
    ids, _, reason = run(engine)["s"]
    first = greedy.index(greedy[2])
    assert ids == greedy[: first + 1] and reason == "stop"


def test_abort_ends_one_request_only(tiny_model):
    engine = CpuEngine(tiny_model)
    for rid in ("a", "b"):
        engine.add_request(rid, PROMPTS[0], SamplingParams(max_new_tokens=50, seed=1))
    engine.step()
    final = engine.abort("a")
    assert final.finished and final.finish_reason == "abort"
    assert engine.abort("a") is None
    out = run(engine)
    assert set(out) == {"b"} and len(out["b"][0]) == 49


def test_release_refuses_requests_until_resumed(tiny_model):
    engine = CpuEngine(tiny_model)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_new_tokens=3))
    with pytest.raises(RuntimeError, match="abort them first"):
        engine.release_memory()
    engine.abort("a")
    engine.release_memory()
    with pytest.raises(EngineReleased):
        engine.add_request("b", PROMPTS[0], SamplingParams(max_new_tokens=3))
    engine.resume_memory()
    engine.add_request("b", PROMPTS[0], SamplingParams(max_new_tokens=3))
    assert len(run(engine)["b"][0]) == 3


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(max_new_tokens=1), "empty"),
    ([999], SamplingParams(max_new_tokens=1), "vocabulary"),
])
def test_bad_requests_are_value_errors(tiny_model, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        CpuEngine(tiny_model).add_request("x", prompt, params)


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=1, top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_top_p_restricts_to_nucleus(tiny_model):
    """With a tiny top_p only the argmax token can be drawn."""
    engine = CpuEngine(tiny_model)
    engine.add_request("g", PROMPTS[1], SamplingParams(max_new_tokens=8, temperature=0))
    engine.add_request("p", PROMPTS[1], SamplingParams(max_new_tokens=8, top_p=1e-6, seed=3))
    out = run(engine)
    assert out["g"][0] == out["p"][0]


def test_kv_handover_continues_exactly(tiny_model, tiny_dir):
    """A request exported mid-generation continues on another engine from its KV prefix and
    produces what an undisturbed greedy run produces."""
    from gyre.workerd.model import load_model

    whole = CpuEngine(tiny_model)
    whole.add_request("r", PROMPTS[2], SamplingParams(max_new_tokens=30, temperature=0))
    reference = run(whole)["r"][0]

    src, dst = CpuEngine(load_model(tiny_dir)), CpuEngine(load_model(tiny_dir))
    src.add_request("r", PROMPTS[2], SamplingParams(max_new_tokens=30, temperature=0))
    produced: list[int] = []
    while len(produced) < 12:
        for o in src.step():
            produced += o.token_ids
    kv = src.export_kv("r")
    assert kv.length == len(PROMPTS[2]) + len(produced) - 1  # the last token is not fed yet
    assert src.abort("r").finish_reason == "abort"
    dst.add_request("r", PROMPTS[2] + produced, SamplingParams(max_new_tokens=30 - len(produced), temperature=0),
                    kv=kv)
    rest = run(dst)["r"][0]
    assert produced + rest == reference
    with pytest.raises(ValueError, match="handed-over KV"):
        dst.add_request("x", PROMPTS[2][:3], SamplingParams(max_new_tokens=1), kv=kv)
