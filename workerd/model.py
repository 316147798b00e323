"""model.py: the Qwen2/Qwen3/Llama decoder in plain torch, with Hugging Face parameter names.

One definition serves the CPU engine (`extend`, `decode` over per-sequence KV caches) and
the CPU trainer (`forward` over padded rows, `tree_hidden` over a prefix-sharing tree's
unique tokens), so behaviour and training log-probs come from the same math. State-dict
keys are the HF names (`model.layers.0.self_attn.q_proj.weight`), so HF safetensors load
without a mapping. Not a serving engine: batching policy and sampling live in engines/cpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# From their home, not workerd/modeldir.py: that module's init_tiny builds a CausalLM.
from gyre.workerd.modelconfig import ModelConfig, ModelDirError, load_config
from gyre.workerd.weightfiles import iter_weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] -> cos, sin [..., T, head_dim] (float32)."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


@dataclass
class SeqCache:
    """KV cache of one sequence: per layer [kv_heads, capacity, head_dim], grown by doubling."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [kv_heads, T, head_dim] at positions length..length+T (layer-major order)."""
        n, t = self.length, k.shape[1]
        if layer == len(self.k):
            cap = max(64, 2 * t)
            self.k.append(k.new_empty(k.shape[0], cap, k.shape[2]))
            self.v.append(v.new_empty(v.shape[0], cap, v.shape[2]))
        if n + t > self.k[layer].shape[1]:
            cap = max(2 * self.k[layer].shape[1], n + t)
            for buf in (self.k, self.v):
                old = buf[layer]
                grown = old.new_empty(old.shape[0], cap, old.shape[2])
                grown[:, :n] = old[:, :n]
                buf[layer] = grown
        self.k[layer][:, n : n + t] = k
        self.v[layer][:, n : n + t] = v

    def view(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :upto], self.v[layer][:, :upto]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.qk_norm = c.qk_norm

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> q [B, heads, T, d], k, v [B, kv_heads, T, d] with rope applied."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, heads, T, d] -> [B, T, H]."""
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM with identical parameter names."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.rope = Rope(config.head_dim, config.rope_theta)
        # Training only: recompute each layer's activations in the backward pass instead of
        # holding them (a long micro-step's activations, not its weights, fill the memory).
        self.checkpoint_layers = False
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # --- weights ------------------------------------------------------------------------

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.state_dict().items()}

    def load_hf_weights(self, named, *, strict: bool = True) -> int:
        """Copy (hf_name, tensor) pairs into the parameters; returns bytes loaded."""
        own = self.state_dict()
        seen, nbytes = set(), 0
        with torch.no_grad():
            for name, tensor in named:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue  # tied checkpoints sometimes carry a copy of the embedding
                if name not in own:
                    if strict:
                        raise ModelDirError(f"weight {name!r} does not belong to {self.config.architecture}")
                    continue
                if tuple(own[name].shape) != tuple(tensor.shape):
                    raise ModelDirError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                        f"expected {tuple(own[name].shape)}")
                own[name].copy_(tensor)
                seen.add(name)
                nbytes += tensor.numel() * tensor.element_size()
        missing = set(own) - seen
        if strict and missing:
            raise ModelDirError(f"weights missing: {', '.join(sorted(missing)[:5])}")
        return nbytes

    @property
    def output_weight(self) -> torch.Tensor:
        """The [V, H] matrix mapping final hidden states to logits (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.model.norm(h), self.output_weight)

    # --- training: padded rows, causal ---------------------------------------------------

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (right-padded) -> final-normed hidden states [B, T, H]: logits are
        `hidden @ output_weight.T`, left to the caller so that they need not exist for every
        position at once (loss.py computes log-probs in chunks)."""
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t).expand(b, t)
        cos, sin = self.rope(position_ids)
        h = self.model.embed_tokens(input_ids)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                from torch.utils.checkpoint import checkpoint

                h = checkpoint(_layer_forward, layer, h, cos, sin, use_reentrant=False)
            else:
                h = _layer_forward(layer, h, cos, sin)
        return self.model.norm(h)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (right-padded) -> logits [B, T, V]."""
        return F.linear(self.hidden(input_ids, position_ids), self.output_weight)

    # --- training: a tree of segments, each token attending to its own path --------------

    def tree_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, seg_start: torch.Tensor,
                    seg_len: torch.Tensor, seg_parent: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] of a tree's N unique tokens (input_ids and
        position_ids [N]; segments [S] tiling the tokens in order, parents first, -1 a root):
        each token attends to the tokens of its ancestor segments and causally to its own
        segment's, so it equals the same token's state in its path's padded row."""
        blocks = tree_blocks(seg_start.tolist(), seg_len.tolist(), seg_parent.tolist())
        cos, sin = self.rope(position_ids.unsqueeze(0))
        h = self.model.embed_tokens(input_ids.unsqueeze(0))
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                from torch.utils.checkpoint import checkpoint

                h = checkpoint(_tree_layer_forward, layer, h, cos, sin, blocks, use_reentrant=False)
            else:
                h = _tree_layer_forward(layer, h, cos, sin, blocks)
        return self.model.norm(h)[0]

    # --- inference: one sequence extended, many sequences decoded ------------------------

    @torch.no_grad()
    def extend(self, ids: torch.Tensor, cache: SeqCache) -> torch.Tensor:
        """Append ids [T] to one sequence's cache (prefill or continuation) -> logits [T, V]."""
        n, t = cache.length, ids.shape[0]
        positions = torch.arange(n, n + t).unsqueeze(0)
        cos, sin = self.rope(positions)
        h = self.model.embed_tokens(ids.unsqueeze(0))
        # Query i sits at position n+i and sees keys 0..n+i; with n == 0 that is plain causal.
        mask = None if n == 0 else torch.ones(t, n + t, dtype=torch.bool).tril(diagonal=n)
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(h), cos, sin)
            cache.append(i, k[0], v[0])
            kk, vv = cache.view(i, n + t)
            o = F.scaled_dot_product_attention(
                q, kk.unsqueeze(0), vv.unsqueeze(0), attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
            h = h + a.out(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        cache.length = n + t
        return self.logits(h)[0]

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, caches: list[SeqCache]) -> torch.Tensor:
        """One token for each of B sequences: ids [B] -> logits [B, V].

        Projections and MLPs run batched; attention runs per sequence over its own cache,
        which avoids padding and copying KV when sequence lengths differ.
        """
        positions = torch.tensor([c.length for c in caches]).unsqueeze(1)  # [B, 1]
        cos, sin = self.rope(positions)
        h = self.model.embed_tokens(ids.unsqueeze(1))  # [B, 1, H]
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(h), cos, sin)  # q [B, heads, 1, d]
            outs = []
            for j, c in enumerate(caches):
                c.append(i, k[j], v[j])
                kk, vv = c.view(i, c.length + 1)
                outs.append(F.scaled_dot_product_attention(
                    q[j : j + 1], kk.unsqueeze(0), vv.unsqueeze(0), enable_gqa=True))
            h = h + a.out(torch.cat(outs, dim=0))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for c in caches:
            c.length += 1
        return self.logits(h)[:, 0]


def _layer_forward(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One decoder layer over padded rows, causal (the training path)."""
    a = layer.self_attn
    q, k, v = a.qkv(layer.input_layernorm(h), cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = h + a.out(o)
    return h + layer.mlp(layer.post_attention_layernorm(h))


QUERY_CHUNK = 2048  # queries of one tree block per attention call: bounds its [queries, keys] mask


@dataclass(frozen=True, slots=True)
class TreeBlock:
    """Tokens [start, end) of a chain of segments, each the parent of the next and stored
    right after it, so one causal block serves them all; `context` is their ancestors'
    tokens outside the block: a range (lo, start) when contiguous with it, else an index."""

    start: int
    end: int
    context: tuple[int, int] | torch.Tensor


def tree_blocks(seg_start: list[int], seg_len: list[int], seg_parent: list[int]) -> list[TreeBlock]:
    """The attention blocks of a tree batch's segments (see TreeBlock), in token order. A
    depth-first layout makes a block of each root-to-leaf path's new tokens, and the first
    child's context a plain range."""
    paths: list[list[tuple[int, int]]] = []  # per segment: its root-to-self token ranges, merged
    blocks: list[TreeBlock] = []
    for i, (start, n, p) in enumerate(zip(seg_start, seg_len, seg_parent)):
        above = paths[p] if p >= 0 else []
        paths.append(_extend_ranges(above, (start, start + n)))
        if blocks and p == i - 1 and blocks[-1].end == start:
            blocks[-1] = TreeBlock(blocks[-1].start, start + n, blocks[-1].context)
            continue
        if not above:
            context: tuple[int, int] | torch.Tensor = (start, start)
        elif len(above) == 1 and above[0][1] == start:
            context = (above[0][0], start)
        else:
            context = torch.cat([torch.arange(a, b) for a, b in above])
        blocks.append(TreeBlock(start, start + n, context))
    return blocks


def _extend_ranges(ranges: list[tuple[int, int]], r: tuple[int, int]) -> list[tuple[int, int]]:
    if ranges and ranges[-1][1] == r[0]:
        return [*ranges[:-1], (ranges[-1][0], r[1])]
    return [*ranges, r]


def _context_kv(x: torch.Tensor, block: TreeBlock) -> torch.Tensor | None:
    """x [1, kv_heads, N, d] -> the keys (or values) of a block's context, when it is not a
    range next to the block (that one is sliced with the block's own, no copy)."""
    if isinstance(block.context, tuple):
        return None
    return x.index_select(2, block.context.to(x.device))


def _tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[TreeBlock]) -> torch.Tensor:
    """q [1, heads, N, d], k, v [1, kv_heads, N, d] -> o [1, heads, N, d], block by block:
    queries see all their context and causally their own block. A block without context (a
    root's chain) is one causal call, as a row is; the others go `QUERY_CHUNK` queries at a
    time, so no mask is larger than [QUERY_CHUNK, keys]."""
    outs = []
    for b in blocks:
        ck, cv = _context_kv(k, b), _context_kv(v, b)
        lo = b.context[0] if ck is None else b.start
        ctx = b.start - lo if ck is None else ck.shape[2]
        if ctx == 0:  # a root's chain: plain causal attention, in one call (no mask is built)
            outs.append(F.scaled_dot_product_attention(q[:, :, b.start:b.end], k[:, :, b.start:b.end],
                                                       v[:, :, b.start:b.end], is_causal=True, enable_gqa=True))
            continue
        for s in range(b.start, b.end, QUERY_CHUNK):
            e = min(s + QUERY_CHUNK, b.end)
            kk, vv = k[:, :, lo:e], v[:, :, lo:e]
            if ck is not None:
                kk, vv = torch.cat([ck, kk], dim=2), torch.cat([cv, vv], dim=2)
            seen = ctx + s - b.start  # keys before query s: the context and the block's earlier tokens
            mask = None
            if seen:  # query j sees keys 0..seen+j
                mask = torch.ones(e - s, kk.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=seen)
            outs.append(F.scaled_dot_product_attention(q[:, :, s:e], kk, vv, attn_mask=mask,
                                                       is_causal=mask is None, enable_gqa=True))
    return torch.cat(outs, dim=2) if outs else q


def _tree_layer_forward(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        blocks: list[TreeBlock]) -> torch.Tensor:
    """One decoder layer over a tree's tokens [1, N, H]: projections and MLP over all N at
    once, attention per block."""
    a = layer.self_attn
    q, k, v = a.qkv(layer.input_layernorm(h), cos, sin)
    h = h + a.out(_tree_attention(q, k, v, blocks))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def load_model(model_dir, config: ModelConfig | None = None) -> CausalLM:
    config = config or load_config(model_dir)
    model = CausalLM(config)
    model.load_hf_weights(iter_weights(model_dir))
    return model
