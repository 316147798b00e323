"""tests/gpu/check.py: one real `gyre workerd` with the SGLang engine and the megatron-core
trainer on one GPU, driven over ZeroMQ by the coordinator's link, as `gyre up` drives it.

    model    a tiny random-weight Qwen2 directory written here (config, tokenizer, safetensors)
    1        start-up: the workerd builds SGLang and Megatron from the directory
    2        generate: concurrent requests from token ids, per-token log-probs (rollout tokens/s),
             compared with the trainer's log-probs of the same tokens
    3        role change to training (SGLang releases, Megatron onloads)
    4        one training step (a GSPO micro-step on the generated samples, one optimizer step)
    5        role change to rollout (Megatron offloads, SGLang resumes weights then KV)
    6        one publication (the engine loads its own trainer's weights) and generation at the
             new version, its log-probs again against the trainer's

Prints one line per phase and a JSON summary last; exits 1 if any check fails. Nothing is
downloaded: HF_HUB_OFFLINE is set and the model is generated locally. `--engine cpu` or
`--trainer cpu` run the same script on CPU backends (how it is checked without a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from gyre.coordinator.local import LocalCluster  # noqa: E402
from gyre.workerd import wire  # noqa: E402
from gyre.workerd.modeldir import init_tiny  # noqa: E402
from gyre.workerd.tensors import to_frames  # noqa: E402
from tests.workerd.helpers import build_micro_step, prompt_ids  # noqa: E402

# Big enough for GPU kernels' usual head sizes, small enough to start in seconds.
GPU_MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


class Checks:
    def __init__(self):
        self.failed: list[str] = []
        self.figures: dict = {}

    def expect(self, ok: bool, what: str) -> None:
        print(f"  {'ok ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failed.append(what)


async def generate(link, node, n: int, tokens: int, tag: str):
    prompts = [prompt_ids(f"<|im_start|>user\nRequest {tag}-{i}: write.<|im_end|>\n<|im_start|>assistant\n")
               for i in range(n)]

    async def one(i):
        msg = wire.Generate(rid=f"{tag}-{i}", prompt_ids=prompts[i],
                            max_new_tokens=tokens, temperature=1.0, seed=i)
        chunks = [c async for c in link.generate(node, msg)]
        return (prompts[i], [t for c in chunks for t in c.token_ids], [x for c in chunks for x in c.logprobs],
                {c.version for c in chunks}, chunks[-1].finish_reason)

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(i) for i in range(n)))
    return out, time.perf_counter() - t0


async def trainer_logprobs(link, node, prompt, ids):
    reply, _ = await link.call(node, wire.Call(method="logprobs",
                                               args={"input_ids": [prompt + ids]}))
    if reply.error:
        raise RuntimeError(reply.error)
    return reply.result[0][len(prompt):]


async def generation_round(c: Checks, link, node, args, *, version: int, tag: str, tps_key: str):
    """Concurrent requests at `version`: tokens/s, and the first sample's log-probs against
    the trainer's for the same tokens (figure logprob_max_diff_v<version>)."""
    samples, secs = await generate(link, node, args.requests, args.tokens, tag)
    total = sum(len(s[1]) for s in samples)
    c.figures[tps_key] = round(total / secs, 1)
    print(f"  generate: {args.requests} requests, {total} tokens in {secs:.2f} s = {total / secs:.0f} tokens/s")
    c.expect(all(len(s[1]) == len(s[2]) > 0 for s in samples), "every request returned tokens with log-probs")
    c.expect({r for s in samples for r in s[3]} == {version}, f"chunks carry version {version}")
    prompt, ids, lps = samples[0][:3]
    ref = await trainer_logprobs(link, node, prompt, ids)
    diff = max(abs(a - b) for a, b in zip(lps, ref))
    c.figures[f"logprob_max_diff_v{version}"] = round(diff, 6)
    c.expect(diff < args.tolerance, f"engine vs trainer log-probs at version {version}: max |diff| {diff:.2e} "
                                    f"< {args.tolerance}")
    return samples


async def main(args) -> int:
    c = Checks()
    work = Path(args.work or tempfile.mkdtemp(prefix="gyre-gpu-check-"))
    model_dir = init_tiny(work / "model", seed=0, overrides=GPU_MODEL if args.engine == "sglang" else None)
    print(f"model: {model_dir} ({json.loads((model_dir / 'config.json').read_text())['hidden_size']} hidden)")
    server = json.loads(args.server) if args.server else {}
    t0 = time.perf_counter()
    async with LocalCluster(model_dir, cells=1, roles=("rollout",), backends=(args.engine, args.trainer),
                            engine={"max_running": args.requests, "server": server},
                            trainer={"lr": 1e-5, "tp": args.tp, "pp": args.pp,
                                     **({"offload": True} if args.offload else {})},
                            start_timeout_s=args.start_timeout, log_dir=work / "logs") as cluster:
        link, node = cluster.link, cluster.node_of_cell(0)
        ready = next(e for e in cluster.events if isinstance(e, wire.Ready))
        c.figures["start_seconds"] = round(time.perf_counter() - t0, 2)
        c.figures["load_seconds"] = round(ready.load_seconds, 2)
        print(f"1 start-up: {c.figures['start_seconds']} s (backends built in {ready.load_seconds:.2f} s), "
              f"{ready.params:,} parameters")

        print("2 generate at version 0")
        samples = await generation_round(c, link, node, args, version=0, tag="a", tps_key="rollout_tokens_per_s")

        t = time.perf_counter()
        changed, _ = await link.call(node, wire.SetRole(role="training"))
        c.figures["to_training_seconds"] = round(time.perf_counter() - t, 3)
        print(f"3 role -> training: {c.figures['to_training_seconds']} s (worker {changed.seconds:.3f} s, "
              f"freed {changed.freed_bytes:,} bytes)")

        # One micro-step per sample (its prompt, its output as targets), alternating advantages.
        frames = [to_frames(build_micro_step(s[0], [(s[1], s[2])], [1.0 if i % 2 else -1.0]))
                  for i, s in enumerate(samples[:8])]
        t = time.perf_counter()
        results = []
        for f in frames:
            res, _ = await link.call(node, wire.TrainMicroStep(step=0), f)
            results.append(res)
        step, _ = await link.call(node, wire.OptimizerStep(num_executions=len(frames)))
        c.figures["train_step_seconds"] = round(time.perf_counter() - t, 3)
        c.figures["mismatch_kl"] = round(max(abs(r.mismatch_kl) for r in results), 6)
        print(f"4 train: {len(frames)} micro-steps + optimizer step in {c.figures['train_step_seconds']} s, "
              f"grad norm {step.grad_norm:.4f}, |mismatch| <= {c.figures['mismatch_kl']}")
        c.expect(step.version == 1 and step.grad_norm > 0, "optimizer step: version 1, non-zero gradient")

        t = time.perf_counter()
        changed, _ = await link.call(node, wire.SetRole(role="rollout"))
        c.figures["to_rollout_seconds"] = round(time.perf_counter() - t, 3)
        print(f"5 role -> rollout: {c.figures['to_rollout_seconds']} s (worker {changed.seconds:.3f} s, "
              f"offloaded {changed.freed_bytes:,} bytes)")

        t = time.perf_counter()
        loaded, _ = await link.call(node, wire.LoadWeights(version=1))
        c.figures["publish_seconds"] = round(time.perf_counter() - t, 3)
        c.figures["publish_bytes"] = loaded.nbytes
        print(f"6 publish: {loaded.nbytes:,} bytes in {c.figures['publish_seconds']} s "
              f"(worker {loaded.seconds:.3f} s)")
        await generation_round(c, link, node, args, version=1, tag="b", tps_key="rollout_tokens_per_s_after")
    summary = {"engine": args.engine, "trainer": args.trainer, "ok": not c.failed, "failed": c.failed,
               **c.figures}
    print(json.dumps(summary))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0 if not c.failed else 1


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="sglang", choices=["sglang", "cpu"])
    p.add_argument("--trainer", default="megatron", choices=["megatron", "cpu"])
    p.add_argument("--server", default="",
                   help="SGLang ServerArgs fields as JSON, e.g. '{\"mem_fraction_static\": 0.3}'")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="max |engine - trainer| log-prob (bf16 kernels differ; fp32 on CPU is ~1e-5)")
    p.add_argument("--offload", action="store_true", help="offload the trainer for rollout (default on GPU)")
    p.add_argument("--tp", type=int, default=1, help="the trainer cell's tensor-parallel size (one GPU per rank)")
    p.add_argument("--pp", type=int, default=1, help="the trainer cell's pipeline-parallel size (one GPU per rank)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--work", default="", help="folder for the model and logs (default: a temporary one)")
    p.add_argument("--json-out", default="")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
