"""agent.py: the long-tail workload's harness, a small real agent on the `openai` SDK.

Each execution makes `--calls` model calls through gyre's proxy, and between them waits out a
tool's time (as an agent waits for a build, a test run, a shell command). Its tool seconds are
drawn from a heavy-tailed law seeded by the execution's id, so the same execution takes the same
time under every placement policy, and a benchmark compares policies, not luck:

    per group (one task, N executions):  scale = median_s * lognormal(0, query_sigma),
                                         times hard_mult for a hard_frac of groups
    per execution:                       total = scale * lognormal(0, exec_sigma),
                                         split over its calls by exponential weights

(the same law `gyre sim`'s presets use, coordinator/workloads.py `sample_query`). A hard
group's executions run into the run's deadline and time out, as the paper's NL2Repo tails do.
The model's last answer goes to answer.txt, which the task's similarity evaluator scores
against its target: rewards vary within a group. The execution's id and task come from
gyre's environment (GYRE_EXECUTION, GYRE_TASK, OPENAI_BASE_URL, OPENAI_API_KEY).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from pathlib import Path

import openai


def tool_seconds(execution: str, args: argparse.Namespace) -> list[float]:
    """The tool time after each call of `execution` (an id `gGROUP-MEMBER`, or any string)."""
    group = execution.rpartition("-")[0] or execution
    per_group = random.Random(f"{args.seed}:{group}")
    scale = args.median_s * math.exp(per_group.gauss(0.0, args.query_sigma))
    if per_group.random() < args.hard_frac:
        scale *= args.hard_mult
    own = random.Random(f"{args.seed}:{execution}")
    total = scale * math.exp(own.gauss(0.0, args.exec_sigma))
    weights = [own.expovariate(1.0) for _ in range(args.calls)]
    return [total * w / sum(weights) for w in weights]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4, help="model calls per execution")
    ap.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each call")
    ap.add_argument("--median-s", type=float, default=10.0, help="median tool seconds of an execution")
    ap.add_argument("--query-sigma", type=float, default=0.1, help="spread of a group's scale (log)")
    ap.add_argument("--exec-sigma", type=float, default=0.3, help="spread of an execution around it (log)")
    ap.add_argument("--hard-frac", type=float, default=0.0, help="share of groups that are hard")
    ap.add_argument("--hard-mult", type=float, default=1.0, help="how much longer a hard group's tools run")
    ap.add_argument("--seed", type=int, default=0, help="the law's seed (the same for every policy compared)")
    ap.add_argument("--model", default="policy", help="the model name sent (gyre serves any)")
    args = ap.parse_args()
    execution = os.environ.get("GYRE_EXECUTION", "local-0")
    waits = tool_seconds(execution, args)
    client = openai.OpenAI(max_retries=8, timeout=300)  # retries that cover a coordinator's restart
    messages = [{"role": "system", "content": "You are a coding agent. Answer briefly."},
                {"role": "user", "content": os.environ.get("GYRE_TASK", "Say hello.")}]
    answer = ""
    for i, wait in enumerate(waits):
        r = client.chat.completions.create(model=args.model, messages=messages,
                                           max_tokens=args.max_tokens)
        answer = r.choices[0].message.content or ""
        print(f"call {i + 1}/{len(waits)}: {len(answer)} chars; tool {wait:.1f} s", flush=True)
        time.sleep(wait)  # the tool runs
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"The tool ran for {wait:.1f} s and printed nothing. Go on."}]
    Path(os.environ.get("GYRE_WORKSPACE", ".")).joinpath("answer.txt").write_text(answer.strip() + "\n")


if __name__ == "__main__":
    main()
