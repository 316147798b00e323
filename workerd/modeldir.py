"""modeldir.py: a Hugging Face model directory as gyre's model spec.

Checks a directory whole (`check_model_dir`; its weights are weightfiles.py's) and writes
the embedded default (`gyre init-model tiny DIR`): a seeded random Qwen2 model,
a byte-level `tokenizers` tokenizer and a ChatML chat template with Hermes tool calls.
Nothing here downloads; a missing file is a `ModelDirError` naming it. Not the tokenizer
*runtime*: the proxy loads tokenizer.json itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

# config.json and gyre.json are read by modelconfig.py (the coordinator resolves a run with it too);
# workerd's modules and tests take ModelConfig, ModelDirError and load_config from here too, but
# model.py, which init_tiny below builds on, takes them from there.
from gyre.workerd.modelconfig import ModelConfig, ModelDirError, gyre_defaults, load_config, read_json, require
from gyre.workerd.weightfiles import weight_files


def check_model_dir(model_dir: str | Path) -> ModelConfig:
    """Everything gyre reads from a model directory, checked before a run starts: the config,
    the tokenizer (tokenizer.json loads), a chat template, the weight files, gyre.json."""
    root = Path(model_dir)
    config = load_config(root)
    tok = require(root / "tokenizer.json", "the tokenizer; gyre reads the fast-tokenizer file only")
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(tok))
    except Exception as e:  # noqa: BLE001 - the tokenizers library's own error, reported with the file
        raise ModelDirError(f"{tok} does not load: {e}") from None
    cfg = root / "tokenizer_config.json"
    template = read_json(cfg).get("chat_template") if cfg.exists() else None
    if template is None and not (root / "chat_template.jinja").exists():
        raise ModelDirError(f"model directory {root} has no chat template "
                            "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
    weight_files(root)
    gyre_defaults(root)
    return config


# --- the embedded default ---------------------------------------------------------------

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>",
]

TINY_CONFIG = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    vocab_size=272,  # 256 bytes + 9 added tokens, padded to a multiple of 16
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    max_position_embeddings=32768,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    torch_dtype="float32",
    use_sliding_window=False,
    bos_token_id=256,
    eos_token_id=258,
)

TINY_DEFAULTS = {"lr": 3e-3, "default_max_tokens": 16, "max_tokens_cap": 64}

# ChatML with Hermes tool calls: the structure of Qwen2.5's template, so a real Qwen
# checkpoint and the tiny model render the same way.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def _byte_vocab() -> dict[str, int]:
    """GPT-2's byte -> printable-char map; token id == byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {chars[b]: b for b in range(256)}


def build_tokenizer():
    """A byte-level BPE (no merges: one token per byte) plus ChatML/Hermes added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=t.startswith("<|"), normalized=False) for t in SPECIAL_TOKENS]
    )
    return tok


def init_tiny(out_dir: str | Path, *, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write the embedded default model directory; returns it. `overrides` changes config
    fields (benchmarks size the model up with hidden_size, intermediate_size, layers)."""
    import torch
    from safetensors.torch import save_file

    from gyre.workerd.model import CausalLM

    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == 256 + i, t
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    ), indent=2))
    hf_config = {**TINY_CONFIG, **(overrides or {})}
    (root / "config.json").write_text(json.dumps(hf_config, indent=2))
    (root / "generation_config.json").write_text(json.dumps(
        dict(eos_token_id=[258, 256], pad_token_id=256, temperature=1.0, top_p=1.0), indent=2
    ))
    # The random tiny model learns at a high rate and says little; a real model's defaults differ.
    (root / "gyre.json").write_text(json.dumps(TINY_DEFAULTS, indent=2))
    config = ModelConfig.from_hf(hf_config)
    torch.manual_seed(seed)
    model = CausalLM(config)
    model.init_weights(seed)
    save_file({k: v.contiguous() for k, v in model.hf_state_dict().items()},
              str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def describe(config: ModelConfig) -> dict:
    return asdict(config)
