"""bench/coordinator.py: the embedded default under `colocate` and `async`, in one invocation.

    python bench/coordinator.py [--steps 4] [--json PATH]

Runs the real coordinator (two local workerd processes, the proxy, demo-harness
subprocesses, the tiny model) for the same number of steps under each policy, at matched
staleness settings (phi=0, mu=1 for both), and prints per policy: wall time per step,
rollout tokens/s, trained tokens/s and each cell's idle fraction (time neither serving a
request nor training). Ratios are against colocate measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator
from gyre.workerd.modeldir import init_tiny


def run_policy(policy: str, steps: int, model_dir: Path, root: Path, seed: int) -> dict:
    cfg = CoordinatorConfig(run_dir=root / policy, model_dir=model_dir, steps=steps, policy=policy, seed=seed)
    t0 = time.monotonic()
    uvloop.run(Coordinator(cfg).run())
    wall = time.monotonic() - t0
    events = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(e for e in events if e["event"] == "summary")
    loop_s = summary["wall_s"]
    return {
        "policy": policy, "steps": summary["steps"], "wall_s": round(wall, 2), "loop_s": loop_s,
        "s_per_step": round(loop_s / summary["steps"], 2),
        "rollout_tok_s": round(summary["rollout_tokens"] / loop_s, 1),
        "trained_tok_s": round(summary["tokens_trained"] / loop_s, 1),
        "idle_frac": [c["idle_frac"] for c in summary["cells"]],
        "statuses": summary["statuses"],
        "reward_by_step": [e["reward_mean"] for e in events if e["event"] == "step"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = init_tiny(root / "model", seed=args.seed)
        results = [run_policy(p, args.steps, model_dir, root, args.seed) for p in ("colocate", "async")]
    base = results[0]["s_per_step"]
    print(f"embedded default, {args.steps} steps per policy, B=2 N=8, phi=0 mu=1, 2 cells")
    print(f"{'policy':<10}{'s/step':>8}{'vs colocate':>13}{'rollout tok/s':>15}{'trained tok/s':>15}  idle per cell")
    for r in results:
        idle = " ".join(f"{x:.2f}" for x in r["idle_frac"])
        print(f"{r['policy']:<10}{r['s_per_step']:>8.2f}{base / r['s_per_step']:>12.2f}x"
              f"{r['rollout_tok_s']:>15.1f}{r['trained_tok_s']:>15.1f}  {idle}")
    out = {"results": results, "speedup_async_vs_colocate": round(base / results[1]["s_per_step"], 3)}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
