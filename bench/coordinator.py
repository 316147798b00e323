"""bench/coordinator.py: the embedded default under several placement policies, in one invocation.

    python bench/coordinator.py [--steps 6] [--cells 2] [--ed 0] [--policies colocate,async] [--json PATH]

Runs the real coordinator (local workerd processes, the proxy, demo-harness subprocesses,
the tiny model) for the same number of steps under each policy at matched mean staleness
E[d] = phi + (mu-1)/2 (the (phi, mu) per policy come from `gyre.coordinator.sim.
matched_settings`, so runs and simulations compare alike; --ed 0 is phi=0, mu=1 for all),
and prints per policy: wall time per step, rollout tokens/s, trained tokens/s and each
cell's idle fraction (time neither serving a request nor training). Ratios are against the
first policy listed, measured in the same run.
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
from gyre.coordinator.metrics import read_events
from gyre.coordinator.sim import matched_settings
from gyre.workerd.modeldir import init_tiny


def run_policy(policy: str, phi: float, mu: int, args, model_dir: Path, root: Path) -> dict:
    cfg = CoordinatorConfig(run_dir=root / policy, model_dir=model_dir, steps=args.steps, policy=policy, phi=phi,
                            mu=mu, cells=args.cells, seed=args.seed)
    t0 = time.monotonic()
    uvloop.run(Coordinator(cfg).run())
    wall = time.monotonic() - t0
    events = read_events(cfg.run_dir / "metrics.jsonl", warn=True).events
    summary = next(e for e in events if e["event"] == "summary")
    steps = [e for e in events if e["event"] == "step"]
    loop_s = summary["wall_s"]
    return {
        "policy": policy, "phi": phi, "mu": mu, "steps": summary["steps"], "wall_s": round(wall, 2),
        "loop_s": loop_s, "s_per_step": round(loop_s / summary["steps"], 2),
        "rollout_tok_s": round(summary["rollout_tokens"] / loop_s, 1),
        "trained_tok_s": round(summary["tokens_trained"] / loop_s, 1),
        "idle_frac": [c["idle_frac"] for c in summary["cells"]],
        "staleness_mean": round(sum(e["staleness_mean"] for e in steps) / len(steps), 3),
        "statuses": summary["statuses"], "reward_by_step": [e["reward_mean"] for e in steps],
        "cache_hit_rate": hit_rate(steps),
    }


def hit_rate(steps: list[dict]) -> float | None:
    """Prompt tokens the engines reused over those they were given, over the steps' calls
    (None: no engine said)."""
    known = [e for e in steps if e.get("cached_tokens") is not None]
    total = sum(e["cached_tokens"] + e["prefill_tokens"] for e in known)
    return round(sum(e["cached_tokens"] for e in known) / total, 4) if total else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cells", type=int, default=2)
    ap.add_argument("--ed", type=float, default=0.0, help="matched mean staleness E[d]")
    ap.add_argument("--policies", default="colocate,async")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    settings = matched_settings(args.ed)
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = init_tiny(root / "model", seed=args.seed)
        results = [run_policy(p, *settings[p], args, model_dir, root) for p in policies]
    base = results[0]["s_per_step"]
    print(f"embedded default: {args.steps} steps per policy, {args.cells} cells, B=2 N=8, E[d]={args.ed}")
    print(f"{'policy':<10}{'phi':>5}{'mu':>4}{'s/step':>8}{'vs ' + policies[0]:>14}{'staleness':>11}"
          f"{'rollout tok/s':>15}{'trained tok/s':>15}{'cache hits':>12}  idle per cell")
    for r in results:
        idle = " ".join(f"{x:.2f}" for x in r["idle_frac"])
        print(f"{r['policy']:<10}{r['phi']:>5}{r['mu']:>4}{r['s_per_step']:>8.2f}{base / r['s_per_step']:>13.2f}x"
              f"{r['staleness_mean']:>11.2f}{r['rollout_tok_s']:>15.1f}{r['trained_tok_s']:>15.1f}"
              f"{'n/a' if r['cache_hit_rate'] is None else format(r['cache_hit_rate'], '.1%'):>12}  {idle}")
    out = {"results": results, "speedup_vs_first": {r["policy"]: round(base / r["s_per_step"], 3) for r in results}}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
