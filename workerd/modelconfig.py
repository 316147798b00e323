"""modelconfig.py: what a run reads from a Hugging Face model directory before anything starts.

config.json as `ModelConfig` (its checks: a supported architecture, plain RoPE; its
max_position_embeddings bounds a run's context) and gyre.json's run defaults. The
coordinator resolves a run against these and workerd builds its model from the same
`ModelConfig`: so it lives here, one of the light workerd modules the coordinator may import
(standard library only, no torch; tests/test_layering.py). Not the weights or the tokenizer
(modeldir.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gyre.workerd.wire import GyreError

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}


class ModelDirError(GyreError):
    """The model directory is missing a file or describes an unsupported model."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """config.json's fields that gyre uses (the trainers and the CPU engine build from it)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE

    @classmethod
    def from_hf(cls, raw: dict) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ModelDirError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelDirError(
                f"config.json architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        try:
            heads = int(raw["num_attention_heads"])
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
                rope_theta=rope_theta(raw),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama-family configs say so explicitly.
                attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
            )
        except KeyError as e:
            raise ModelDirError(f"config.json has no {e.args[0]!r}, which a {arch} config needs") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelDirError(f"config.json has a malformed field: {e}") from None


SUPPORTED_ROPE_TYPES = ("default",)


def rope_theta(raw: dict) -> float:
    """The RoPE base, from transformers 5's `rope_parameters` or the older top-level
    `rope_theta` / `rope_scaling`. Only plain RoPE is implemented: any scaling type
    (llama3, yarn, linear, dynamic, longrope, ...) is refused by name, never ignored."""
    params = raw.get("rope_parameters")
    legacy = raw.get("rope_scaling")
    for where, p in (("rope_parameters", params), ("rope_scaling", legacy)):
        if p is None:
            continue
        if not isinstance(p, dict):
            raise ModelDirError(f"config.json {where} must be an object, got {p!r}")
        if p and all(isinstance(v, dict) for v in p.values()):
            raise ModelDirError(f"config.json {where} is set per layer type ({', '.join(p)}), which gyre "
                                "does not implement")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ModelDirError(f"config.json {where}.rope_type {kind!r} is not supported (supported: "
                                f"{', '.join(SUPPORTED_ROPE_TYPES)}): gyre would compute wrong positions")
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ModelDirError(f"config.json {where}.partial_rotary_factor {p['partial_rotary_factor']} is not "
                                "supported (only full rotary embeddings)")
    theta = (params or {}).get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        theta = 10000.0  # transformers' default for Llama and Qwen2 configs that name none
    return float(theta)


def require(path: Path, what: str) -> Path:
    if not path.exists():
        raise ModelDirError(f"model directory {path.parent} has no {path.name} ({what})")
    return path


def load_config(model_dir: str | Path) -> ModelConfig:
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelDirError(f"model directory {root} does not exist")
    return ModelConfig.from_hf(read_json(require(root / "config.json", "the model config")))


def read_json(path: Path):
    """A JSON file of the model directory; unreadable or malformed is a `ModelDirError`."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path} is not readable JSON: {e}") from None


# gyre.json: run defaults a model directory may carry (the tiny model's; real models rarely
# have one, and then gyre's defaults for real models apply).
DEFAULT_KEYS = {"lr": float, "default_max_tokens": int, "max_tokens_cap": int}


def gyre_defaults(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "gyre.json"
    if not path.exists():
        return {}
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path} must hold a JSON object")
    unknown = sorted(set(raw) - set(DEFAULT_KEYS))
    if unknown:
        raise ModelDirError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(DEFAULT_KEYS)})")
    out = {}
    for key, value in raw.items():
        kind = DEFAULT_KEYS[key]
        wrong = isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value))
        if wrong or value <= 0:
            raise ModelDirError(f"{path}: {key} must be a positive {kind.__name__}, got {value!r}")
        out[key] = kind(value)
    return out
