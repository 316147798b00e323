"""Helpers shared by workerd tests: byte-level prompts, one-row micro-steps, a byte reward."""

from __future__ import annotations

import torch

PROMPT = "<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n"


def prompt_ids(text: str = PROMPT) -> list[int]:
    """Byte-level ids of the tiny model (specials 257/258 for ChatML markers)."""
    parts = text.replace("<|im_start|>", "\x00S").replace("<|im_end|>", "\x00E").split("\x00")
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i > 0:
            ids.append({"S": 257, "E": 258}[part[0]])
            part = part[1:]
        ids.extend(part.encode())
    return ids


def build_micro_step(prompt: list[int], samples: list[tuple[list[int], list[float]]],
                     advantages: list[float]) -> dict[str, torch.Tensor]:
    """One row per sample: prompt + output; targets are the output tokens."""
    rows = len(samples)
    width = len(prompt) + max(len(s[0]) for s in samples)
    t = {
        "input_ids": torch.zeros(rows, width, dtype=torch.long),
        "target_mask": torch.zeros(rows, width, dtype=torch.bool),
        "behaviour_logprobs": torch.zeros(rows, width),
        "advantages": torch.zeros(rows, width),
        "loss_weights": torch.zeros(rows, width),
        "exec_ids": torch.zeros(rows, width, dtype=torch.long),
    }
    p = len(prompt)
    for i, ((ids, lps), adv) in enumerate(zip(samples, advantages)):
        n = len(ids)
        t["input_ids"][i, :p] = torch.tensor(prompt)
        t["input_ids"][i, p : p + n] = torch.tensor(ids)
        t["target_mask"][i, p : p + n] = True
        t["behaviour_logprobs"][i, p : p + n] = torch.tensor(lps)
        t["advantages"][i, p : p + n] = adv
        t["loss_weights"][i, p : p + n] = 1.0 / n
        t["exec_ids"][i] = i
    return t


def byte_reward(ids: list[int], target: int) -> float:
    return sum(1 for t in ids if t == target) / max(1, len(ids))


