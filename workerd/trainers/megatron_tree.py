"""trainers/megatron_tree.py: a tree micro-step (trainers/treebatch.py `TreeBatch`) through a
megatron-core GPTModel, each shared token computed once.

GPTModel's forward cannot take a tree: with `position_embedding_type="rope"` its
`_preprocess` builds the rotary embedding from the sequence length (`self.rotary_pos_emb(
rotary_seq_len)`: positions 0..S-1), never from `position_ids`; only its `mrope` path reads
`position_ids` (`MultimodalRotaryEmbedding.forward(position_ids, mrope_section)`). So the
model's parts are driven here: `embedding(input_ids, position_ids)`, then `decoder(hidden_states,
attention_mask, rotary_pos_emb=...)` with the rotary table (`rotary_pos_emb(max_pos)`,
[P, 1, 1, dim]) indexed by each token's own position id, and an ancestor mask that
`FusedScaleMaskSoftmax.forward_torch_softmax` applies as given (True: hidden); then
`output_layer` (with `shared_embedding_or_output_weight()` when tied) on the hidden states that
predict the targets (gathered by `prev_index`: a branch point's last token predicts each
child's first) and `compute_language_model_loss` (vocab-parallel under TP) for their log-probs.

The mask is dense [N, N]: megatron-core's local attention takes an arbitrary mask on CPU.
A GPU path would not: there it would be one packed sequence per path (`PackedSeqParams(
qkv_format="thd", cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)`, prefix computed
per path) or segment attention over ancestor KV (Megatron-LM #7386/#7387, open). One stage
only: a pipeline-parallel cell expands the tree into path rows.
"""

from __future__ import annotations

import torch

from gyre.workerd.trainers.treebatch import TreeBatch


def ancestor_mask(batch: TreeBatch) -> torch.Tensor:
    """[N, N] bool, True where token i may attend to token j: j lies in an ancestor segment
    of i's, or in i's own segment at or before i."""
    parents = batch.seg_parent.tolist()
    s = len(parents)
    above = torch.eye(s, dtype=torch.bool)  # above[a, b]: segment b is a or an ancestor of a
    for a, p in enumerate(parents):  # parents come first: their rows are complete
        if p >= 0:
            above[a] |= above[p]
    seg = torch.repeat_interleave(torch.arange(s), batch.seg_len)
    n = seg.shape[0]
    idx = torch.arange(n)
    same = seg[:, None] == seg[None, :]
    return above[seg][:, seg] & (~same | (idx[None, :] <= idx[:, None]))


def tree_logprobs(model, batch: TreeBatch, device: torch.device) -> torch.Tensor:
    """[N] log-probs of the batch's tokens at the model's temperature (the output layer's
    hook scales its logits), set where the loss reads them (targets with a predecessor),
    0 elsewhere; differentiable."""
    ids = batch.input_ids.to(device)
    pos = batch.position_ids.to(device)
    hidden = model.embedding(input_ids=ids[None], position_ids=pos[None])  # [N, 1, H]
    rotary = model.rotary_pos_emb(int(pos.max()) + 1)[pos]  # [N, 1, 1, dim]: each token at its own depth
    hidden = model.decoder(hidden_states=hidden, attention_mask=~ancestor_mask(batch).to(device)[None, None],
                           rotary_pos_emb=rotary)  # final-normed: the decoder ends with it
    want = (batch.target_mask & (batch.prev_index >= 0)).nonzero(as_tuple=True)[0]
    out = torch.zeros(ids.shape[0], dtype=torch.float32, device=device)
    if want.numel() == 0:
        return out + hidden.sum() * 0.0  # still in the graph: a backward of zero loss works
    h = hidden[batch.prev_index[want].to(device)]  # [K, 1, H]: the state before each target
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(h, weight=weight)  # [K, 1, V / tp]
    nll = model.compute_language_model_loss(ids[want][None], logits)  # [1, K]
    return out.index_put((want.to(device),), -nll[0].float())
