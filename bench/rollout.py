"""bench/rollout.py: rollout throughput for agents, least-inflight without a cache vs
execution-affine routing with the engines' prefix cache, in one run.

    python bench/rollout.py [--executions 12] [--turns 10] [--cells 2] [--grow 300]
                            [--model DIR] [--json PATH]

K concurrent multi-turn executions (demo-harness-shaped: one system prompt shared by all,
a task, then turns that each append the model's reply and a tool-result-sized message, so
every call resends the whole history) call the real proxy through the `openai` SDK, over
real workerds (one per cell) on the ZeroMQ link. The same executions run twice on fresh
cells: first routed to the engine with the fewest requests in flight, prefix cache off
(`prefix_cache_mb = 0`: every call prefills its whole prompt), then execution-affine with
the cache on (the defaults), then least-inflight with the cache on ("cache only": what the
cache gives when an execution's calls scatter). Between calls each execution waits a
random tool time (exponential, mean `--tool-s`), so executions fall out of step as real
ones do. Sampling is greedy, so both runs produce the same tokens (the
cache is exact) and the bench checks that they do.

Per configuration: prefill tokens computed per call (the engines' count), new prompt tokens
per call (what the call added to the execution's history: the proxy's count), cache hit
rate (prompt tokens reused / prompt tokens), mean call latency, and aggregate rollout
tokens/s (output tokens of all calls / wall time). `--json PATH` writes
{"baseline": {...}, "affine": {...}, "speedup": affine tokens_per_s / baseline's}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import uvloop

from gyre.coordinator.local import LocalCluster
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.workerd.modeldir import init_tiny

WORDS = ("def return self value list dict import from class data path file line error test assert "
         "print open read write json config module function result status index count total").split()
SYSTEM = ("You are a coding agent working in a workspace directory. Use the tools to finish the task: "
          "write_file(path, content), read_file(path), list_files(), delegate(task). " * 4).strip()


def tool_text(rng: random.Random, chars: int) -> str:
    """A tool result's worth of code-like text."""
    out, n = [], 0
    while n < chars:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
        out.append(line)
        n += len(line) + 1
    return "\n".join(out)[:chars]


async def execution(proxy: ProxyServer, name: str, args, seed: int) -> list[dict]:
    """One agent: `turns` calls, each resending the history plus a new tool result."""
    rng = random.Random(seed)
    ex = proxy.register(name)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {seed}: " + tool_text(rng, args.grow)}]
    latencies, texts = [], []
    async with openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=ex.key, max_retries=0,
                                  timeout=600) as client:
        for _ in range(args.turns):
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=args.max_tokens)
            latencies.append(time.perf_counter() - t0)
            text = reply.choices[0].message.content or ""
            texts.append(text)
            await asyncio.sleep(rng.expovariate(1 / args.tool_s))  # the harness runs the tool
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "Tool result:\n" + tool_text(rng, args.grow)}]
    proxy.revoke(name)
    return [dict(c, latency=lat, text=t) for c, lat, t in zip(ex.calls, latencies, texts)]


async def run_config(label: str, routing: str, cache_mb: int, args, model_dir: Path, root: Path) -> dict:
    roles = ("rollout",) * args.cells
    async with LocalCluster(model_dir, cells=args.cells, roles=roles, log_dir=root / label / "logs",
                            engine={"prefix_cache_mb": cache_mb, "max_running": 64}) as cluster:
        table = RoutingTable(policy=routing)
        table.set_nodes([cluster.node_of_cell(i) for i in range(args.cells)])
        proxy = ProxyServer(ChatTokenizer(model_dir), LinkBackend(cluster.link, table),
                            ProxyConfig(temperature=0.0), run_dir=root / label)
        await proxy.start()
        try:
            t0 = time.perf_counter()
            per_ex = await asyncio.gather(*(execution(proxy, f"x{i:03d}", args, seed=i)
                                            for i in range(args.executions)))
            wall = time.perf_counter() - t0
        finally:
            await proxy.stop()
    calls = [c for ex in per_ex for c in ex]
    bad = [c for c in calls if c["status"] != "ok"]
    if bad:
        raise SystemExit(f"{label}: {len(bad)} calls failed: {bad[0]['status']} {bad[0]['finish_reason']}")
    unknown = [c for c in calls if c["cached_tokens"] is None]
    if unknown:
        raise SystemExit(f"{label}: {len(unknown)} calls without the engine's prefill count")
    prompt = sum(c["prompt_tokens"] for c in calls)
    cached = sum(c["cached_tokens"] for c in calls)
    return {
        "routing": routing, "prefix_cache_mb": cache_mb, "calls": len(calls), "wall_s": round(wall, 2),
        "prompt_tokens_per_call": round(prompt / len(calls), 1),
        "prefill_tokens_per_call": round(sum(c["prefill_tokens"] for c in calls) / len(calls), 1),
        "new_tokens_per_call": round(sum(c["new_prompt_tokens"] for c in calls) / len(calls), 1),
        "hit_rate": round(cached / prompt, 4),
        "latency_mean_s": round(statistics.mean(c["latency"] for c in calls), 3),
        "tokens_per_s": round(sum(c["output_tokens"] for c in calls) / wall, 1),
        "max_prompt_tokens": max(c["prompt_tokens"] for c in calls),
        "engines_per_execution": round(statistics.mean(len({c["engine"] for c in ex}) for ex in per_ex), 2),
        "decisions": dict(table.decisions),
        "_texts": [[c["text"] for c in ex] for ex in per_ex],
    }


async def main_async(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = args.model or init_tiny(root / "model", seed=0)
        baseline = await run_config("baseline", "least-inflight", 0, args, model_dir, root)
        affine = await run_config("affine", "affine", args.cache_mb, args, model_dir, root)
        # The cache without affinity: what routing alone adds.
        scattered = await run_config("scattered", "least-inflight", args.cache_mb, args, model_dir, root)
    texts = baseline.pop("_texts")
    same = texts == affine.pop("_texts") == scattered.pop("_texts")
    speedup = round(affine["tokens_per_s"] / baseline["tokens_per_s"], 3)
    return {"baseline": baseline, "affine": affine, "speedup": speedup, "same_outputs": same,
            "least_inflight_cached": scattered,
            "setup": {"executions": args.executions, "turns": args.turns, "cells": args.cells, "grow": args.grow,
                      "max_tokens": args.max_tokens, "tool_s": args.tool_s,
                      "model": "tiny" if args.model is None else str(args.model)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--cells", type=int, default=2)
    ap.add_argument("--grow", type=int, default=300, help="characters of tool result appended per turn")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tool-s", type=float, default=0.2, help="mean seconds a tool runs between calls")
    ap.add_argument("--cache-mb", type=int, default=512, help="the affine run's prefix cache per cell")
    ap.add_argument("--model", type=Path, help="a model directory (default: the tiny random model)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = uvloop.run(main_async(args))
    b, a, c = out["baseline"], out["affine"], out["least_inflight_cached"]
    s = out["setup"]
    print(f"{s['executions']} executions x {s['turns']} turns over {s['cells']} cells, +{s['grow']} chars a turn, "
          f"model {s['model']}; prompts up to {a['max_prompt_tokens']} tokens")
    print(f"{'':<28}{'baseline':>14}{'affine':>14}{'ratio':>9}{'cache only':>14}")
    rows = [("routing", "routing", None), ("prefill tokens / call", "prefill_tokens_per_call", "{:.1f}"),
            ("new tokens / call", "new_tokens_per_call", "{:.1f}"), ("cache hit rate", "hit_rate", "{:.1%}"),
            ("mean call latency (s)", "latency_mean_s", "{:.3f}"), ("rollout tokens/s", "tokens_per_s", "{:.1f}"),
            ("engines per execution", "engines_per_execution", "{:.2f}"), ("wall (s)", "wall_s", "{:.1f}")]
    for label, key, fmt in rows:
        bv, av, cv = b[key], a[key], c[key]
        if fmt is None:
            print(f"{label:<28}{bv:>14}{av:>14}{'':>9}{cv + '+cache':>14}")
            continue
        ratio = f"{av / bv:.2f}x" if bv else ""
        print(f"{label:<28}{fmt.format(bv):>14}{fmt.format(av):>14}{ratio:>9}{fmt.format(cv):>14}")
    print(f"affine prefill / new tokens per call: {a['prefill_tokens_per_call'] / a['new_tokens_per_call']:.2f} "
          f"(target <= 1.5); throughput vs baseline: {out['speedup']:.2f}x; same greedy outputs: {out['same_outputs']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
