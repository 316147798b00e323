"""wire/steps.py: the tensor frames a TrainMicroStep carries, in its two forms: padded path
rows (`MICRO_STEP_TENSORS`) or a tree of unique segments (`TREE_STEP_TENSORS`; the packed
form uses it too). The coordinator's packing.py writes them, the trainers read them.
Names and dtypes only.
"""

from __future__ import annotations

# TrainMicroStep's tensor frames by name, with their dtypes: the coordinator's packing.py
# writes them, the trainers' MicroBatch reads them.
INPUT_IDS = "input_ids"
TARGET_MASK = "target_mask"  # the token at [r, t] is a trained target
BEHAVIOUR_LOGPROBS = "behaviour_logprobs"  # the engine's log-prob of each target
ADVANTAGES = "advantages"  # the execution's advantage on its targets
LOSS_WEIGHTS = "loss_weights"  # 1 / L_i on targets
EXEC_IDS = "exec_ids"  # execution index per token, batch-wide
MICRO_STEP_TENSORS: dict[str, str] = {
    INPUT_IDS: "int64", TARGET_MASK: "bool", BEHAVIOUR_LOGPROBS: "float32",
    ADVANTAGES: "float32", LOSS_WEIGHTS: "float32", EXEC_IDS: "int64",
}
# A micro-step in tree form (packing = "tree"): each unique token once, with the structure
# the worker rebuilds positions, ancestry and per-token fields from (trainers/treebatch.py).
TREE_INPUT_IDS = "tree.ids"  # [N] the unique tokens, segment after segment (uint16 where the vocabulary fits)
TREE_SEG_LEN = "tree.seg_len"  # [S] tokens of each segment (a tree node)
TREE_SEG_PARENT = "tree.seg_parent"  # [S] its parent segment, before it (-1: a root)
TREE_SEG_EXEC = "tree.seg_exec"  # [S] its execution, an index into the exec arrays
TREE_SEG_TARGET = "tree.seg_target"  # [S] its tokens are trained targets
TREE_TARGET_LOGPROBS = "tree.target_logprobs"  # [targets] behaviour log-probs, in token order
TREE_EXEC_ADVANTAGE = "tree.exec_advantage"  # [E]
TREE_EXEC_LOSS_WEIGHT = "tree.exec_loss_weight"  # [E] 1 / L_i of the whole execution
TREE_EXEC_INDEX = "tree.exec_index"  # [E] execution index, batch-wide
TREE_STEP_TENSORS: dict[str, str] = {
    TREE_INPUT_IDS: "int32", TREE_SEG_LEN: "int32", TREE_SEG_PARENT: "int32", TREE_SEG_EXEC: "int32",
    TREE_SEG_TARGET: "bool", TREE_TARGET_LOGPROBS: "float32", TREE_EXEC_ADVANTAGE: "float32",
    TREE_EXEC_LOSS_WEIGHT: "float32", TREE_EXEC_INDEX: "int32",
}
