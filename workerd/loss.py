"""loss.py: the execution-level GSPO objective of DESIGN.md ("Loss"), per micro-step.

Returns the *sum* over this micro-step's target tokens of
    -(1/L_i) * w_t * min(s_it * A_i, clip(s_it) * A_i)
so that micro-steps add up exactly; the trainer divides the accumulated gradient by the
number of executions in the batch (the outer `mean_i`). Backend-neutral torch code: the
CPU and megatron trainers both call it. Not a packer: rows arrive ready.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IS_CAP = 5.0  # token importance weight cap
SEQ_CLIP = (0.995, 1.005)  # GSPO clip of the execution-level ratio


@dataclass(frozen=True, slots=True)
class LossOutput:
    loss_sum: torch.Tensor  # differentiable
    tokens: int
    executions: int
    mismatch: float  # mean(b - sg(l)) over targets


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], input_ids [B, T] -> log p(input_ids[t] | <t) at [B, T]; t=0 is 0.
    The whole [B, T, V] float32 log-softmax is built: for small checks; trainers use
    `chunked_logprobs`, which never holds it."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


CHUNK_TOKENS = 1024  # positions whose [chunk, V] logits exist at once


def _chunk_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = torch.nn.functional.linear(h, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _picked(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
            chunk: int) -> torch.Tensor:
    """log p(targets[k] | h[k]) for predicting states h [K, H], `chunk` rows of logits at a time,
    recomputed in the backward pass under autograd."""
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    pieces = []
    for s in range(0, h.shape[0], chunk):
        args = (h[s:s + chunk], weight, targets[s:s + chunk], temperature)
        if grad:
            from torch.utils.checkpoint import checkpoint

            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    # No position wanted: an empty slice, still in the graph (a backward of zero loss works).
    return torch.cat(pieces) if pieces else h.reshape(-1)[:0].float()


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                     positions: torch.Tensor | None = None, *, temperature: float = 1.0,
                     chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """Log-probs at the sampling temperature from final hidden states [B, T, H] and the output
    matrix [V, H], at [B, T] (t = 0 is 0; so is every position outside `positions`, a [B, T]
    bool mask of the tokens wanted, default all). Logits exist `chunk` positions at a time
    and, under autograd, are recomputed in the backward pass (activation checkpointing), so
    peak memory is O(chunk x V), not O(B x T x V): the full-vocabulary float32 log-softmax
    of a long micro-step is never built."""
    b, t = input_ids.shape
    want = torch.ones(b, t, dtype=torch.bool) if positions is None else positions.bool().clone()
    want[:, 0] = False
    rows, cols = want.nonzero(as_tuple=True)
    # The state before token t predicts it.
    picked = _picked(hidden[rows, cols - 1], weight, input_ids[rows, cols], temperature, chunk)
    return torch.zeros(b, t, dtype=torch.float32, device=hidden.device).index_put((rows, cols), picked)


def tree_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, prev_index: torch.Tensor,
                  positions: torch.Tensor | None = None, *, temperature: float = 1.0,
                  chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """`chunked_logprobs` over a tree's unique tokens: hidden [N, H], input_ids and prev_index
    [N] (the token before each on its own path, -1 for a root's first) -> log-probs [N], where
    token k is predicted by `hidden[prev_index[k]]`; 0 at roots' first tokens and outside
    `positions` ([N] bool, default all)."""
    want = prev_index >= 0
    if positions is not None:
        want &= positions.bool()
    (idx,) = want.nonzero(as_tuple=True)
    picked = _picked(hidden[prev_index[idx]], weight, input_ids[idx], temperature, chunk)
    return torch.zeros(input_ids.shape[0], dtype=torch.float32, device=hidden.device).index_put((idx,), picked)


def gspo_loss(
    logp: torch.Tensor,  # [B, T] current log-probs (differentiable)
    behaviour_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T]
    loss_weights: torch.Tensor,  # [B, T] = 1 / L_i on targets
    target_mask: torch.Tensor,  # [B, T] bool
    exec_ids: torch.Tensor,  # [B, T] int64, execution index per token
) -> LossOutput:
    mask = target_mask.bool()
    l = logp[mask]
    b = behaviour_logp[mask].float()
    a = advantages[mask].float()
    wts = loss_weights[mask].float()
    ex = exec_ids[mask].long()
    if l.numel() == 0:
        return LossOutput(logp.sum() * 0.0, 0, 0, 0.0)
    # Token importance weight, no gradient: corrects staleness and engine/trainer mismatch.
    w = torch.clamp(torch.exp(l.detach() - b), max=IS_CAP)
    # Execution-level ratio s_i = exp(mean_{t in T_i}(l_t - l_old_t)). With one optimizer
    # update per batch l_old = sg(l), so s_i == 1 whatever subset of T_i this micro-step
    # holds: that is what lets a micro-step split an execution. Asserted, not assumed.
    uniq, inv = torch.unique(ex, return_inverse=True)
    diff = (l.detach() - l.detach()).double()
    seg_mean = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, diff)
    seg_mean /= torch.bincount(inv, minlength=len(uniq)).double()
    s_i = torch.exp(seg_mean).float()
    assert torch.all(s_i == 1.0), "execution ratio != 1: a second update on the same batch?"
    s_it = s_i[inv] * torch.exp(l - l.detach())
    clipped = torch.clamp(s_it, *SEQ_CLIP)
    surrogate = torch.minimum(s_it * a, clipped * a)
    loss_sum = -(wts * w * surrogate).sum()
    return LossOutput(loss_sum, int(l.numel()), len(uniq), float((b - l.detach()).mean()))
