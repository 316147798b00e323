"""The HF model directory: `gyre init-model tiny` output loads with transformers and matches
its Qwen2 implementation; the chat template round-trips tool calls."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gyre.workerd.model import SeqCache, load_model, num_params
from gyre.workerd.modeldir import ModelDirError, load_config

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write héllo <b>&</b> to a.txt"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "write_file", "arguments": {"path": "a.txt", "text": "héllo"}}}]},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "Done."},
]
TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "Write a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}}}]


def test_size_is_tiny(tiny_dir):
    n = num_params(load_model(tiny_dir))
    assert 1_000_000 <= n <= 5_000_000


def test_loads_with_transformers_auto_classes(tiny_dir):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(tiny_dir)
    assert config.model_type == "qwen2" and config.vocab_size == 272
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", "text": "héllo"}}\n</tool_call>' in text
    assert "<b>&</b>" in text  # not HTML-escaped
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: exact round trip
    assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == 3  # two in the tools header, one call
    assert tok.convert_tokens_to_ids("<|im_end|>") == 258
    # The rendered tool call parses back to the call that produced it.
    body = text.split("<tool_call>\n")[-1].split("\n</tool_call>")[0]
    assert json.loads(body) == {"name": "write_file", "arguments": {"path": "a.txt", "text": "héllo"}}


def test_logits_equal_transformers_qwen2(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ours = load_model(tiny_dir).eval()
    ids = torch.randint(0, 265, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-5)


def test_cached_extend_and_batched_decode_match_full_forward(tiny_model):
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = tiny_model(ids)
    a, b = SeqCache(), SeqCache()
    la = torch.cat([tiny_model.extend(ids[0, :10], a), tiny_model.extend(ids[0, 10:20], a)])
    tiny_model.extend(ids[1, :25], b)
    step = tiny_model.decode(torch.stack([ids[0, 20], ids[1, 25]]), [a, b])
    assert torch.allclose(la, full[0, :20], atol=1e-5)
    assert torch.allclose(step[0], full[0, 20], atol=1e-5)
    assert torch.allclose(step[1], full[1, 25], atol=1e-5)


def test_missing_files_are_named(tiny_dir, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="no model.safetensors"):
        load_model(broken)
    (broken / "config.json").unlink()
    with pytest.raises(ModelDirError, match="no config.json"):
        load_config(broken)
    with pytest.raises(ModelDirError, match="does not exist"):
        load_config(tmp_path / "nowhere")


def test_unsupported_architecture_is_refused(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match="GPT2LMHeadModel.*not supported"):
        load_config(d)


def test_foreign_weight_names_are_refused(tiny_model):
    with pytest.raises(ModelDirError, match="does not belong"):
        tiny_model.load_hf_weights([("transformer.h.0.attn.weight", torch.zeros(1))])
    with pytest.raises(ModelDirError, match="shape"):
        tiny_model.load_hf_weights([("model.norm.weight", torch.zeros(3))])


@pytest.mark.parametrize("arch,model_type", [("Qwen3ForCausalLM", "qwen3"), ("LlamaForCausalLM", "llama")])
def test_logits_equal_transformers_other_families(tmp_path, arch, model_type):
    """Qwen3 (per-head q/k RMSNorm, no QKV bias) and Llama load and match transformers."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from gyre.workerd.modeldir import init_tiny

    d = init_tiny(tmp_path / model_type, overrides=dict(
        architectures=[arch], model_type=model_type, num_hidden_layers=2, tie_word_embeddings=False))
    ours = load_model(d).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms away from 1, so a missing or misplaced norm shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    save_file({k: v.contiguous() for k, v in ours.hf_state_dict().items()}, str(d / "model.safetensors"))
    names = set(ours.hf_state_dict())
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (model_type == "qwen3")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) is False
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert set(hf.state_dict()) == names
    ids = torch.randint(0, 265, (2, 24), generator=g)
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-5)


def _with(tiny_dir, tmp_path, **changes) -> object:
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_rope_parameters_of_transformers_5_are_read(tiny_dir, tmp_path):
    """transformers 5 writes `rope_parameters` and no top-level rope_theta: gyre reads it (it
    silently used 10000 before), and the logits then match transformers'."""
    transformers = pytest.importorskip("transformers")
    d = _with(tiny_dir, tmp_path, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    assert load_config(d).rope_theta == 100000.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_theta"] == 100000.0
    ids = torch.randint(0, 265, (1, 300), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(load_model(d).eval()(ids), hf(ids).logits, atol=1e-4)


@pytest.mark.parametrize("field, value, says", [
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0},
     "rope_parameters.rope_type 'llama3' is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope_type 'yarn'"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type 'linear'"),
    ("rope_parameters", {"rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("rope_parameters", {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}},
     "per layer type"),
    ("rope_parameters", "fast", "must be an object"),
    ("hidden_size", None, "has no 'hidden_size'"),
    ("num_attention_heads", "many", "malformed field"),
])
def test_unsupported_rope_and_malformed_configs_are_refused_by_name(tiny_dir, tmp_path, field, value, says):
    with pytest.raises(ModelDirError, match=says):
        load_config(_with(tiny_dir, tmp_path, **{field: value}))


def test_plain_rope_scaling_entries_are_accepted(tiny_dir, tmp_path):
    d = _with(tiny_dir, tmp_path, rope_scaling={"rope_type": "default"}, rope_theta=5e5)
    assert load_config(d).rope_theta == 5e5


@pytest.mark.parametrize("defaults, says", [
    ({"default_max_tokens": 0.5}, "must be a positive int"), ({"lr": 0}, "must be a positive float"),
    ({"lr": True}, "must be a positive float"), ({"tempo": 1}, "unknown key"),
])
def test_bad_gyre_json_is_refused_by_name(tiny_dir, tmp_path, defaults, says):
    from gyre.workerd.modeldir import check_model_dir

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "gyre.json").write_text(json.dumps(defaults))
    with pytest.raises(ModelDirError, match=says):
        check_model_dir(d)
