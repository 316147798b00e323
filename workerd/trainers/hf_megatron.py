"""hf_megatron.py: Hugging Face <-> megatron-core parameter names, layouts, TP shards and PP stages.

One mapping serves loading a checkpoint into a Megatron cell and publishing its weights to
rollout engines (SGLang and the CPU engine take HF names). Pure torch on whole tensors:
`to_megatron` cuts one tensor-parallel rank's shard of one pipeline stage out of HF
tensors; `to_hf` joins every TP rank's shards of a stage back (a stage's layers are
numbered from 0 in Megatron, from its `Stage.offset` in HF). Covers the dense decoder
families gyre supports (Qwen2, Qwen3, Llama, Mistral) with megatron-core's local layer spec
(`get_gpt_layer_local_spec`):

    model.embed_tokens.weight               embedding.word_embeddings.weight   rows split
    model.layers.N.input_layernorm.weight   decoder.layers.N.input_layernorm.weight
    q_proj, k_proj, v_proj (+ .bias)        ...self_attention.linear_qkv.*     fused, grouped
    q_norm, k_norm (Qwen3)                  ...self_attention.q_layernorm / k_layernorm
    o_proj                                  ...self_attention.linear_proj      columns split
    post_attention_layernorm                ...pre_mlp_layernorm
    gate_proj, up_proj                      ...mlp.linear_fc1                  [gate; up] per rank
    down_proj                               ...mlp.linear_fc2                  columns split
    model.norm.weight                       decoder.final_layernorm.weight
    lm_head.weight                          output_layer.weight                rows split

Megatron's fused QKV is laid out per query group: for each of the `kv_heads` groups, its
`heads / kv_heads` query heads, then its key head, then its value head; a TP rank holds a
contiguous run of groups. Not a loader of files (modeldir.py) and not a model builder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gyre.workerd.modeldir import ModelConfig, ModelDirError

_LAYER = re.compile(r"^(model\.layers|decoder\.layers)\.(\d+)\.(.+)$")

# HF per-layer name -> (Megatron per-layer name, how it is split across TP ranks).
# "rows": dim 0 split; "cols": dim 1 split; None: replicated.
_SIMPLE = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", None),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", "cols"),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", None),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", "cols"),
}
_GLOBAL = {
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", "rows"),
    "model.norm.weight": ("decoder.final_layernorm.weight", None),
    "lm_head.weight": ("output_layer.weight", "rows"),
}


@dataclass(frozen=True, slots=True)
class Stage:
    """The part of the model one pipeline stage holds: decoder layers [offset, offset +
    layers) (None: all), the embedding on the first stage, the final norm and the output
    layer on the last. With tied embeddings and more than one stage, the last stage's
    output layer is a copy of the embedding (the trainer keeps the two in sync)."""

    first: bool = True
    last: bool = True
    offset: int = 0
    layers: int | None = None

    def holds_layer(self, i: int) -> bool:
        return i >= self.offset and (self.layers is None or i < self.offset + self.layers)


WHOLE = Stage()


def check_pp(config: ModelConfig, pp: int) -> None:
    if pp < 1:
        raise ModelDirError(f"pipeline-parallel size must be >= 1, got {pp}")
    if config.num_hidden_layers % pp:
        raise ModelDirError(f"num_hidden_layers={config.num_hidden_layers} is not divisible by "
                            f"pipeline-parallel size {pp}")


def check_tp(config: ModelConfig, tp: int) -> None:
    """The splits this mapping supports; anything else is an error naming the field."""
    if tp < 1:
        raise ModelDirError(f"tensor-parallel size must be >= 1, got {tp}")
    for field, value in (("num_key_value_heads", config.num_key_value_heads),
                         ("intermediate_size", config.intermediate_size),
                         ("vocab_size", config.vocab_size)):
        if value % tp:
            raise ModelDirError(f"{field}={value} is not divisible by tensor-parallel size {tp}")


def is_tp_split(megatron_name: str) -> bool:
    """Whether TP ranks hold different shards of this parameter (norms are replicated)."""
    return not megatron_name.endswith("layernorm.weight")


def _split(t: torch.Tensor, how: str | None, rank: int, tp: int) -> torch.Tensor:
    if how is None or tp == 1:
        return t
    return t.chunk(tp, dim=0 if how == "rows" else 1)[rank]


def _join(parts: list[torch.Tensor], how: str | None) -> torch.Tensor:
    if how is None or len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=0 if how == "rows" else 1)


def _qkv_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF q [heads*d, ...], k/v [kv*d, ...] -> Megatron fused [kv, (heads/kv + 2)*d, ...]."""
    g, d = config.num_key_value_heads, config.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, (config.num_attention_heads // g) * d, *rest)
    return torch.cat([q, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)


def _held(name: str, config: ModelConfig, stage: Stage) -> str | None:
    """The Megatron name a global HF tensor has on this stage, or None where it has none."""
    if name == "model.embed_tokens.weight":
        if stage.first:
            return "embedding.word_embeddings.weight"
        return "output_layer.weight" if stage.last and config.tie_word_embeddings else None
    if name == "lm_head.weight":  # tied: the output layer reads the embedding (or its copy)
        return "output_layer.weight" if stage.last and not config.tie_word_embeddings else None
    return _GLOBAL[name][0] if stage.last else None  # model.norm.weight


def holds(name: str, config: ModelConfig, stage: Stage) -> bool:
    """Whether pipeline stage `stage` needs HF tensor `name` (a tied embedding: the first
    stage and, for its copy, the last)."""
    if name in _GLOBAL:
        return _held(name, config, stage) is not None
    m = _LAYER.match(name)
    return m is not None and stage.holds_layer(int(m.group(2)))


def to_megatron(hf: dict[str, torch.Tensor], config: ModelConfig, *, rank: int = 0, tp: int = 1,
                stage: Stage = WHOLE) -> dict[str, torch.Tensor]:
    """HF-named tensors -> TP rank `rank`'s Megatron-named shards of pipeline stage `stage`
    (new tensors where fused, views otherwise); other stages' tensors are passed over.
    Unknown names are errors; missing ones are for the caller to find (its own names)."""
    check_tp(config, tp)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    fc1: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        if name in _GLOBAL:
            if (mname := _held(name, config, stage)) is not None:
                out[mname] = _split(t, _GLOBAL[name][1], rank, tp)  # the output layer's copy: rows, as the embedding
            continue
        m = _LAYER.match(name)
        if m is None or m.group(1) != "model.layers":
            raise ModelDirError(f"weight {name!r} has no megatron-core counterpart")
        i, rest = int(m.group(2)), m.group(3)
        if i >= config.num_hidden_layers:
            raise ModelDirError(f"weight {name!r}: the model has {config.num_hidden_layers} layers")
        if not stage.holds_layer(i):
            continue
        if rest in _SIMPLE:
            mname, how = _SIMPLE[rest]
            out[f"decoder.layers.{i - stage.offset}.{mname}"] = _split(t, how, rank, tp)
        elif (p := re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)) is not None:
            qkv.setdefault((i, p.group(2)), {})[p.group(1)] = t
        elif (p := re.fullmatch(r"mlp\.(gate|up)_proj\.weight", rest)) is not None:
            fc1.setdefault(i, {})[p.group(1)] = t
        else:
            raise ModelDirError(f"weight {name!r} has no megatron-core counterpart")
    d = config.head_dim
    for (i, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ModelDirError(f"layer {i} {kind}: q, k and v projections must come together, got {sorted(parts)}")
        rows = {"q": config.num_attention_heads * d, "k": config.num_key_value_heads * d,
                "v": config.num_key_value_heads * d}
        for proj, t in parts.items():  # before the reshape, so a bad one is named, not a reshape error
            if t.shape[0] != rows[proj] or t.shape[1:] != parts["q"].shape[1:]:
                raise ModelDirError(f"weight 'model.layers.{i}.self_attn.{proj}_proj.{kind}' has shape "
                                    f"{tuple(t.shape)}, expected ({rows[proj]}, ...) like its q projection")
        fused = _qkv_groups(parts["q"], parts["k"], parts["v"], config).chunk(tp, dim=0)[rank]
        out[f"decoder.layers.{i - stage.offset}.self_attention.linear_qkv.{kind}"] = fused.reshape(-1, *fused.shape[2:])
    for i, parts in fc1.items():
        if set(parts) != {"gate", "up"}:
            raise ModelDirError(f"layer {i}: gate and up projections must come together, got {sorted(parts)}")
        if parts["gate"].shape != parts["up"].shape:
            raise ModelDirError(f"layer {i}: gate_proj {tuple(parts['gate'].shape)} and up_proj "
                                f"{tuple(parts['up'].shape)} differ")
        out[f"decoder.layers.{i - stage.offset}.mlp.linear_fc1.weight"] = torch.cat(
            [parts["gate"].chunk(tp, dim=0)[rank], parts["up"].chunk(tp, dim=0)[rank]], dim=0)
    return out


def to_hf(shards: list[dict[str, torch.Tensor]], config: ModelConfig, stage: Stage = WHOLE
          ) -> dict[str, torch.Tensor]:
    """Every TP rank's Megatron-named shards of one pipeline stage (in rank order) -> whole
    HF-named tensors, layers numbered in the whole model. Megatron's `_extra_state` entries
    are skipped, and so is a last stage's copy of a tied embedding (the first stage's is
    the one); any other unknown name is an error."""
    tp = len(shards)
    check_tp(config, tp)
    g, d, heads = config.num_key_value_heads, config.head_dim, config.num_attention_heads
    out: dict[str, torch.Tensor] = {}
    reverse_global = {m: (h, how) for h, (m, how) in _GLOBAL.items()}
    reverse_layer = {m: (h, how) for h, (m, how) in _SIMPLE.items()}
    for name in shards[0]:
        if name.endswith("._extra_state"):
            continue
        parts = [s[name] for s in shards]
        if name == "output_layer.weight" and config.tie_word_embeddings:
            continue
        if name in reverse_global:
            hname, how = reverse_global[name]
            out[hname] = _join(parts, how)
            continue
        m = _LAYER.match(name)
        if m is None or m.group(1) != "decoder.layers":
            raise ModelDirError(f"megatron-core parameter {name!r} has no HF counterpart")
        i, rest = int(m.group(2)) + stage.offset, m.group(3)
        prefix = f"model.layers.{i}"
        if rest in reverse_layer:
            hname, how = reverse_layer[rest]
            out[f"{prefix}.{hname}"] = _join(parts, how)
        elif (p := re.fullmatch(r"self_attention\.linear_qkv\.(weight|bias)", rest)) is not None:
            fused = torch.cat(parts, dim=0)
            fused = fused.reshape(g, (heads // g + 2) * d, *fused.shape[1:])
            q, k, v = fused.split([(heads // g) * d, d, d], dim=1)
            for proj, t in (("q", q), ("k", k), ("v", v)):
                out[f"{prefix}.self_attn.{proj}_proj.{p.group(1)}"] = t.reshape(-1, *t.shape[2:])
        elif rest == "mlp.linear_fc1.weight":
            gates, ups = zip(*(t.chunk(2, dim=0) for t in parts))
            out[f"{prefix}.mlp.gate_proj.weight"] = torch.cat(gates, dim=0)
            out[f"{prefix}.mlp.up_proj.weight"] = torch.cat(ups, dim=0)
        else:
            raise ModelDirError(f"megatron-core parameter {name!r} has no HF counterpart")
    return out
