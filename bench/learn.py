"""bench/learn.py: does the agent get better at tasks it never trained on? SmolLM2 on the
`shout` task family (examples/learn/), in containers, through the demo harness (a
tool-calling agent), N steps of gyre's RL loop on this machine.

    python bench/learn.py [--model DIR] [--steps 10] [--groups 2] [--group-size 8]
                          [--eval-every 5] [--eval-k 4] [--threshold 0.5] [--lr 3e-5]
                          [--max-tokens 24] [--sandbox podman] [--run-dir DIR] [--out DIR]
                          [--harness NAME [--preset FILE]]

`--harness NAME` trains through another agent than the demo harness: a built-in preset, or
one of FILE's [harnesses.*] tables (a run config such as examples/harnesses/mini-swe-agent.toml).
The shout verifier reads /app/answer.txt, which the demo harness writes with the model's reply;
another agent scores only where the model makes it write that file. The step table gives the
diagnosis of each step's calls (how many, cut at max_tokens, with no tool call parsed) and the
step's note, so a run that trains nothing says why.

The run trains on examples/learn/train (24 words) and evaluates examples/learn/heldout (12
other words) with gyre's held-out evaluation (`eval_every`): the base model at step 0, then
every `--eval-every` steps and after the last, each task `--eval-k` times, pass@k at a
reward of at least `--threshold` (0.5: the word in capitals in the reply; 1.0: nothing
else). The baseline is the same run's step-0 evaluation. It prints per step the reward, the
spread of rewards within each group (an equal group trains nothing), tokens trained, the
engine/trainer mismatch (mean b - l over the targets, a KL proxy) and loss; per round the
held-out pass@k and pass@1; then whether held-out pass@k rose, and one JSON object last.
With matplotlib (`pip install matplotlib`) it writes OUT/learn.png: reward by step and the
held-out pass@k and pass@1 by step. Needs podman (root) unless `--sandbox bubblewrap` or
`process` with tasks that need no image (the shout tasks need one). Measured figures are in
docs/benchmarks.md (held-out pass@4 0.167 -> 1.000 over 10 steps); a run on 2 cores takes about
20-40 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "learn"


def model_dir(given: str | None) -> Path:
    if given:
        return Path(given).resolve()
    path = Path(os.environ.get("GYRE_CACHE", Path.home() / ".cache" / "gyre")) / "models" / "smollm2"
    if not (path / "config.json").exists():
        print(f"writing SmolLM2 into {path} (gyre init-model smollm2)", flush=True)
        subprocess.run([sys.executable, "-m", "gyre.cli", "init-model", "smollm2", str(path)], check=True)
    return path


def harness_tables(path: str | None) -> list[str]:
    """FILE's [harnesses.*] tables, written back as TOML (strings, numbers, lists and tables)."""
    if not path:
        return []
    import tomllib

    lines: list[str] = []

    def table(name: str, values: dict) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict))
        for k, v in values.items():
            if isinstance(v, dict):
                table(f"{name}.{json.dumps(k)}", v)

    for preset, values in tomllib.loads(Path(path).read_text()).get("harnesses", {}).items():
        table(f"harnesses.{json.dumps(preset)}", values)
    return lines


def config_text(a, model: Path) -> str:
    return "\n".join([
        f"steps = {a.steps}", f"groups_per_step = {a.groups}", f"group_size = {a.group_size}",
        f"min_valid = {min(2, a.group_size)}", f'model_dir = "{model}"', f'tasks_path = "{TASKS / "train"}"',
        f'sandbox = "{a.sandbox}"', f"harness = {json.dumps(a.harness)}", f"default_max_tokens = {a.max_tokens}",
        f"max_tokens_cap = {a.max_tokens}", f"lr = {a.lr}", f"eval_every = {a.eval_every}",
        f'eval_tasks_path = "{TASKS / "heldout"}"', f"eval_k = {a.eval_k}", f"eval_pass_threshold = {a.threshold}",
        f"checkpoint_every = {a.steps}", f"seed = {a.seed}", f"exec_slots_per_cell = {a.slots}",
        *harness_tables(a.preset), ""])


def events(run_dir: Path) -> list[dict]:
    """The run's events, as gyre reads them (a torn line skipped, with a warning); the step
    events those a resume kept (gyre.coordinator.metrics.counted_steps)."""
    from gyre.coordinator.metrics import counted_steps, read_events

    evs = read_events(run_dir / "metrics.jsonl", warn=True).events
    counted = {id(e) for e in counted_steps(evs)}
    return [e for e in evs if e.get("event") != "step" or id(e) in counted]


def steps_table(evs: list[dict]) -> list[dict]:
    """Per step: reward, the spread of rewards within its groups, tokens, mismatch, loss."""
    by_group: dict[int, list[float]] = {}
    for e in evs:
        if e["event"] == "execution" and e.get("eval") is None and e["valid"] and e["reward"] is not None:
            by_group.setdefault(e["group"], []).append(e["reward"])
    rows = []
    for e in evs:
        if e["event"] != "step":
            continue
        spreads = [statistics.pstdev(by_group[g]) for g in e["group_ids"] if len(by_group.get(g, [])) > 1]
        rows.append({"step": e["step"], "reward": e["reward_mean"], "group_reward_std":
                     round(statistics.mean(spreads), 4) if spreads else None,
                     "equal_reward_groups": e.get("equal_reward_groups"), "groups": e["groups"],
                     "tokens_trained": e["tokens_trained"], "mismatch": e.get("mismatch"), "loss": e["loss"],
                     "seconds": e["seconds"], "calls": e.get("calls"), "at_max_tokens": e.get("calls_at_max_tokens"),
                     "no_tool_call": e.get("calls_without_tool_call"), "note": e.get("note")})
    return rows


def plot(out: Path, rows: list[dict], rounds: list[dict], k: int, title: str = "demo harness") -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], "o-", label="training reward (mean)")
    steps = [r["step"] for r in rounds]
    ax.plot(steps, [r["pass_at_k"] for r in rounds], "s--", label=f"held-out pass@{k}")
    if k != 1:  # pass@1 is the line above
        ax.plot(steps, [r["pass_at_1"] for r in rounds], "^:", label="held-out pass@1")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"SmolLM2-135M on shout (examples/learn), {title}")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    path = out / "learn.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--slots", type=int, default=8, help="executions a rollout cell serves at once")
    ap.add_argument("--sandbox", default="podman")
    ap.add_argument("--harness", default="demo", help="the agent: a built-in preset or one of --preset's")
    ap.add_argument("--preset", help="a run config whose [harnesses.*] tables --harness may name "
                    "(e.g. examples/harnesses/mini-swe-agent.toml)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir")
    ap.add_argument("--out", help="where learn.png and learn.json go (default: the run directory)")
    a = ap.parse_args()
    model = model_dir(a.model)
    run_dir = Path(a.run_dir or ROOT / "runs" / time.strftime("learn-%Y%m%d-%H%M%S")).resolve()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(config_text(a, model))
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run_dir),
                           "--no-live"]).returncode
    wall = time.monotonic() - t0
    if code != 0:
        sys.exit(f"gyre up exited {code}; see {run_dir}")
    evs = events(run_dir)
    rows = steps_table(evs)
    rounds = [e for e in evs if e["event"] == "eval"]
    print(f"\n{'step':>4} {'reward':>7} {'grp std':>8} {'equal':>5} {'tokens':>7} {'mismatch':>9} {'loss':>10} "
          f"{'s':>6} {'calls':>5} {'at max':>6} {'no tool':>7}")
    for r in rows:
        print(f"{r['step']:>4} {_f(r['reward'])} {_f(r['group_reward_std'], 8)} {r['equal_reward_groups']!s:>5} "
              f"{r['tokens_trained']:>7} {_f(r['mismatch'], 9, '.2e')} {_f(r['loss'], 10, '.3e')} {r['seconds']:>6.1f} "
              f"{r['calls']!s:>5} {r['at_max_tokens']!s:>6} {r['no_tool_call']!s:>7}")
        if r["note"]:
            print(f"     {r['note']}")
    one = a.eval_k == 1  # pass@1 is pass@k: one column
    print(f"\n{'round':>5} {'step':>4} {'version':>7} pass@{a.eval_k:<3}" + ("" if one else f" {'pass@1':>7}")
          + f" {'reward':>7} tasks")
    for r in rounds:
        print(f"{r['round']:>5} {r['step']:>4} {r['version']:>7} {_f(r['pass_at_k'])}"
              + ("" if one else f" {_f(r['pass_at_1'])}") + f" {_f(r['reward_mean'])} {r['scored_tasks']}/{r['tasks']}")
    before, after = (rounds[0], rounds[-1]) if len(rounds) >= 2 else (None, None)
    rose = None
    if before and after and before["pass_at_k"] is not None and after["pass_at_k"] is not None:
        rose = after["pass_at_k"] > before["pass_at_k"]
        ratio = after["pass_at_k"] / before["pass_at_k"] if before["pass_at_k"] else None
        verdict = (f", {ratio:.2f}x" if ratio else "") + (": rose" if rose else ": did not rise")
        print(f"\nheld-out pass@{a.eval_k}: {before['pass_at_k']:.3f} before (step 0) -> {after['pass_at_k']:.3f} "
              f"after (step {after['step']}){verdict}")
    out = Path(a.out).resolve() if a.out else run_dir
    out.mkdir(parents=True, exist_ok=True)
    png = plot(out, rows, rounds, a.eval_k, f"{'demo harness' if a.harness == 'demo' else a.harness} in {a.sandbox}")
    result = {"run_dir": str(run_dir), "wall_s": round(wall, 1), "settings": vars(a), "model": str(model),
              "steps": rows, "evals": [{k: r[k] for k in ("round", "step", "version", "pass_at_k", "pass_at_1",
                                                          "reward_mean", "scored_tasks", "tasks")} for r in rounds],
              "pass_at_k_before": before and before["pass_at_k"], "pass_at_k_after": after and after["pass_at_k"],
              "rose": rose, "plot": str(png) if png else None}
    (out / "learn.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def _f(v, width: int = 7, fmt: str = ".3f") -> str:
    return f"{'n/a':>{width}}" if v is None else f"{v:>{width}{fmt}}"


if __name__ == "__main__":
    main()
