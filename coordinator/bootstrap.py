"""bootstrap.py: the byte-preference RL loop that `gyre up` runs until the harness-driven
coordinator lands. Real parts end to end: two workerd processes over ZeroMQ, the CPU
engine samples with behaviour log-probs, the CPU trainer takes GSPO steps, weights are
published back to the rollout cell. The reward is the fraction of sampled bytes equal to
a target byte, so learning is visible in a few steps. Not the product loop: no proxy,
no harness, no tree (see the "Coordinator RL loop" issue).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import torch

from gyre.coordinator.local import LocalCluster
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")

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


async def sample_group(link, node: str, prompt: list[int], n: int, max_new: int, seed: int):
    async def one(k: int):
        msg = wire.Generate(req_id=link.new_req_id(), rid=f"s{seed}-{k}", prompt_ids=prompt,
                            max_new_tokens=max_new, seed=seed * 1000 + k, stop_token_ids=[258])
        ids, lps = [], []
        async for chunk in link.generate(node, msg):
            ids += chunk.token_ids
            lps += chunk.logprobs
        return ids, lps

    return await asyncio.gather(*(one(k) for k in range(n)))


def byte_reward(ids: list[int], target: int) -> float:
    return sum(1 for t in ids if t == target) / max(1, len(ids))


async def bootstrap(*, steps: int, run_dir: Path, model_dir: Path, seed: int, group: int = 16,
                    max_new: int = 24, target: int = ord("a"), lr: float = 3e-3) -> list[float]:
    from gyre.workerd.tensors import to_frames

    metrics = (run_dir / "metrics.jsonl").open("a")
    t_start = time.monotonic()
    rewards: list[float] = []
    async with LocalCluster(model_dir, cells=2, trainer={"lr": lr}, engine={"threads": 1},
                            log_dir=run_dir / "logs") as cluster:
        link, rollout, train = cluster.link, cluster.node_of_cell(0), cluster.node_of_cell(1)
        prompt = prompt_ids()
        for step in range(steps):
            samples = await sample_group(link, rollout, prompt, group, max_new, seed + step)
            r = [byte_reward(ids, target) for ids, _ in samples]
            mean = sum(r) / len(r)
            std = (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5
            adv = [(x - mean) / (std + 1e-6) for x in r]
            frames = to_frames(build_micro_step(prompt, samples, adv))
            res, _ = await link.call(train, wire.TrainMicroStep(req_id=link.new_req_id(), step=step), frames)
            upd, _ = await link.call(train, wire.OptimizerStep(req_id=link.new_req_id(), num_executions=group))
            t0 = time.monotonic()
            w, wframes = await link.call(train, wire.ExportWeights(req_id=link.new_req_id()))
            await link.call(rollout, wire.LoadWeights(req_id=link.new_req_id(), version=w.version), wframes)
            publish_s = time.monotonic() - t0
            rewards.append(mean)
            t = time.monotonic() - t_start
            for rec in ({"event": "step", "step": step + 1, "version": upd.version, "t": t, "reward_mean": mean,
                         "loss": res.loss, "tokens_trained": res.tokens, "grad_norm": upd.grad_norm,
                         "mismatch": res.mismatch_kl},
                        {"event": "publish", "version": w.version, "t": t, "seconds": publish_s, "bytes": w.nbytes}):
                metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            log.info("step %d/%d  reward %.3f  loss %.4f  grad_norm %.3f  version %d",
                     step + 1, steps, mean, res.loss, upd.grad_norm, upd.version)
    metrics.close()
    return rewards


def run_bootstrap(*, steps: int, run_dir: Path, model_dir: Path, seed: int) -> list[float]:
    import uvloop

    print(f"gyre up (bootstrap loop: byte-preference RL on two local workerd processes; "
          f"the harness-driven loop is not built yet) -> {run_dir}", flush=True)
    rewards = uvloop.run(bootstrap(steps=steps, run_dir=run_dir, model_dir=model_dir, seed=seed))
    print(f"reward by step: {' '.join(f'{r:.3f}' for r in rewards)}", flush=True)
    return rewards
