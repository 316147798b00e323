"""bench/coordinator.py: real `gyre up` runs of one workload under several placement policies.

    python bench/coordinator.py [--config FILE] [--tasks PATH] [--model DIR] [--set KEY=VALUE ...]
        [--policies elastic,colocate,async,async-streaming] [--repeat N] [--ed E] [--training-cells T]
        [--steps N] [--keep DIR] [--json PATH] [--plot PATH]

Each run is the real thing a user starts: `gyre up --no-live` in its own process (workerds,
the proxy, the harness's processes), on the config given (default: the embedded default).
Policies run interleaved, ABBA (E C A S, then S A C E, ...), so a drift of the host's load
falls on every policy alike; `--ed E` sets each policy's (phi, mu) to the paper's matched
setting at mean staleness E (gyre.coordinator.sim.matched_settings), else every run keeps the
config's. Per run it reads metrics.jsonl:

    s/step     from the first dispatch to the last step, over the steps (worker start-up, which
               the `ready` event times, is not a step's)
    slots      the executions' slots occupied, on average over that window (an execution waiting
               on its tool holds a slot: it is not idle capacity); per cell, in --json, the
               executions homed at its engine over its slots (the `slots` events)
    idle       per cell, time neither serving a call nor training (the summary's idle_frac)
    load       the host's 1-minute load average, sampled while the run ran

and prints, per policy, s/step with its spread over the repeats (min-max) and elastic's
speedup over it (its s/step / elastic's, measured in this invocation). `--keep DIR` keeps
every run directory (`gyre sim compare --from DIR/*` replays them); `--plot` writes one SVG of
every run's role timeline on one time axis, and the s/step bars.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gyre.cli.timeline import compare_runs_svg, result_from_metrics
from gyre.coordinator.metrics import counted_steps, read_events
from gyre.coordinator.replay import s_per_step
from gyre.coordinator.sim import matched_settings

POLICIES = ("elastic", "colocate", "async", "async-streaming")


class LoadSampler:
    """The host's 1-minute load average every `every_s` seconds, on a thread, until stopped."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return


def order(policies: list[str], repeat: int) -> list[tuple[int, str]]:
    """(repeat, policy) in ABBA order: forward on even repeats, backward on odd ones."""
    return [(r, p) for r in range(repeat) for p in (policies if r % 2 == 0 else policies[::-1])]


def up_command(policy: str, run_dir: Path, args) -> list[str]:
    cmd = [sys.executable, "-m", "gyre.cli", "up", "--no-live", "--run-dir", str(run_dir), "--policy", policy]
    for flag, value in (("--config", args.config), ("--tasks", args.tasks), ("--model", args.model),
                        ("--steps", args.steps), ("--seed", args.seed)):
        if value is not None:
            cmd += [flag, str(value)]
    for item in args.set:
        cmd += ["--set", item]
    if args.ed is not None:
        phi, mu = matched_settings(args.ed)[policy]
        cmd += ["--set", f"phi={phi:g}", "--set", f"mu={mu}"]
    if args.training_cells is not None and policy.startswith("async"):
        cmd += ["--set", f"async_training_cells={args.training_cells}"]
    return cmd


def measure(run_dir: Path, load: list[float], wall_s: float) -> dict:
    """One run's figures from its metrics.jsonl and config.json (module docstring)."""
    events = read_events(run_dir / "metrics.jsonl", warn=True).events
    cfg = json.loads((run_dir / "config.json").read_text())
    steps = counted_steps(events)
    if not steps:
        raise SystemExit(f"{run_dir}: no step finished (see {run_dir.name}.log beside it)")
    per_step, _ = s_per_step(events)
    first = min(e["t"] for e in events if e["event"] == "dispatch")
    end = steps[-1]["t"]
    execs = [e for e in events if e["event"] == "execution" and e.get("group") is not None
             and e.get("t_start") is not None and e.get("t_end") is not None]
    held = sum(max(0.0, min(e["t_end"], end) - max(e["t_start"], first)) for e in execs)
    slots = cfg["exec_slots_per_cell"] * cfg["cells"]
    summary = next((e for e in reversed(events) if e["event"] == "summary"), {})
    ready = next((e for e in events if e["event"] == "ready"), None)
    claimed = [sum(s.get("micro_steps_by_cell", [0] * cfg["cells"])[c] for s in steps) for c in range(cfg["cells"])]
    slots_ev = [e for e in events if e["event"] == "slots" and first <= e["t"] <= end + e["seconds"]]
    span = sum(e["seconds"] for e in slots_ev)
    homed = [round(sum(e["homed"][c] * e["seconds"] for e in slots_ev) / span / cfg["exec_slots_per_cell"], 3)
             for c in range(cfg["cells"])] if span else None
    return {
        "policy": cfg["policy"], "phi": cfg["phi"], "mu": cfg["mu"], "cells": cfg["cells"],
        "training_cells": cfg.get("async_training_cells") if cfg["policy"].startswith("async") else None,
        "run_dir": str(run_dir), "steps": len(steps), "wall_s": round(wall_s, 2),
        "startup_s": ready["startup_s"] if ready else None,
        "s_per_step": round(per_step, 3),
        "staleness_mean": round(statistics.fmean(s["staleness_mean"] for s in steps), 3),
        "slots_occupied": round(held / ((end - first) * slots), 3) if end > first else None,
        "idle_frac": [c["idle_frac"] for c in summary.get("cells", [])],
        "micro_steps_by_cell": claimed,
        "homed_frac_by_cell": homed,  # executions homed at each cell's engine / its slots (`slots` events)
        "trainer_seconds": round(sum(s.get("trainer_seconds") or 0.0 for s in steps), 2),
        "statuses": summary.get("statuses"),
        "reward_by_step": [s["reward_mean"] for s in steps],
        "cache_hit_rate": hit_rate(steps),
        "load_mean": round(statistics.fmean(load), 2) if load else None,
        "load_max": round(max(load), 2) if load else None,
    }


def hit_rate(steps: list[dict]) -> float | None:
    """Prompt tokens the engines reused over those they were given, over the steps' calls
    (None: no engine said)."""
    known = [e for e in steps if e.get("cached_tokens") is not None]
    total = sum(e["cached_tokens"] + e["prefill_tokens"] for e in known)
    return round(sum(e["cached_tokens"] for e in known) / total, 4) if total else None


def table(runs: list[dict], policies: list[str]) -> tuple[list[str], dict]:
    """The printed table and, per policy, s/step (mean, min, max) and elastic's speedup."""
    by = {p: [r for r in runs if r["policy"] == p] for p in policies}
    stats = {p: {"s_per_step": statistics.fmean(r["s_per_step"] for r in rs),
                 "min": min(r["s_per_step"] for r in rs), "max": max(r["s_per_step"] for r in rs),
                 "runs": len(rs)} for p, rs in by.items()}
    base = stats.get("elastic", stats[policies[0]])["s_per_step"]
    ref = "elastic" if "elastic" in stats else policies[0]
    lines = [f"{'policy':<16}{'phi':>5}{'mu':>4}{'t':>3}{'s/step':>9}{'spread':>16}{'speedup of ' + ref:>21}"
             f"{'staleness':>11}{'slots':>7}{'start s':>9}{'load':>6}  idle per cell  micro-steps per cell"]
    for p in policies:
        rs, st = by[p], stats[p]
        st["speedup_of_" + ref] = round(st["s_per_step"] / base, 3)
        first = rs[0]
        t = first["training_cells"] if first["training_cells"] is not None else "-"
        idle = " ".join(f"{statistics.fmean(r['idle_frac'][c] for r in rs):.2f}" for c in range(first["cells"])
                        if all(len(r["idle_frac"]) > c for r in rs))
        micro = " ".join(str(sum(r["micro_steps_by_cell"][c] for r in rs)) for c in range(first["cells"]))
        known = [r[k] for r in rs for k in ("slots_occupied",) if r[k] is not None]
        loads = [r["load_mean"] for r in rs if r["load_mean"] is not None]
        starts = [r["startup_s"] for r in rs if r["startup_s"] is not None]
        lines.append(f"{p:<16}{first['phi']:>5g}{first['mu']:>4}{t:>3}{st['s_per_step']:>9.2f}"
                     f"{st['min']:>8.2f}-{st['max']:<7.2f}{st['s_per_step'] / base:>20.2f}x"
                     f"{statistics.fmean(r['staleness_mean'] for r in rs):>11.2f}"
                     f"{statistics.fmean(known) if known else float('nan'):>7.2f}"
                     f"{statistics.fmean(starts) if starts else float('nan'):>9.1f}"
                     f"{statistics.fmean(loads) if loads else float('nan'):>6.1f}  {idle:<14} {micro}")
    return lines, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, help="the run config (default: the embedded default)")
    ap.add_argument("--tasks", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config field, for every run")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each policy, interleaved ABBA")
    ap.add_argument("--ed", type=float, help="matched mean staleness E[d]: each policy's (phi, mu) from it")
    ap.add_argument("--training-cells", type=int, help="async policies: cells that only train")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--keep", type=Path, help="keep the run directories here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="write every run's figures and the table's here")
    ap.add_argument("--plot", type=Path, help="the SVG (default: KEEP/compare.svg with --keep, else none)")
    args = ap.parse_args()
    policies = args.policies.split(",")
    if unknown := [p for p in policies if p not in POLICIES]:
        ap.error(f"unknown policy {unknown[0]!r}: {', '.join(POLICIES)}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs = []
        plan = order(policies, args.repeat)
        for i, (rep, policy) in enumerate(plan, 1):
            run_dir = root / f"{i:02d}-{policy}"
            print(f"[{i}/{len(plan)}] {policy} (repeat {rep + 1}) -> {run_dir}", flush=True)
            with open(root / f"{run_dir.name}.log", "wb") as log, LoadSampler() as load:
                t0 = time.monotonic()
                rc = subprocess.run(up_command(policy, run_dir, args), stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise SystemExit(f"gyre up exited {rc} for {policy}: see {root / run_dir.name}.log")
            runs.append(measure(run_dir, load.samples, time.monotonic() - t0))
            print(f"    {runs[-1]['s_per_step']:.2f} s/step, start-up {runs[-1]['startup_s']} s, "
                  f"load {runs[-1]['load_mean']}", flush=True)
        lines, stats = table(runs, policies)
        plot = args.plot or (root / "compare.svg" if args.keep else None)
        if plot is not None:
            plot.write_text(compare_runs_svg([(f"{Path(r['run_dir']).name}", result_from_metrics(
                Path(r["run_dir"]) / "metrics.jsonl"), r["s_per_step"]) for r in runs]))
    workload = args.config or "the embedded default"
    print(f"{workload}: {len(policies)} policies x {args.repeat} (ABBA), {os.cpu_count()} cores")
    print("\n".join(lines))
    if plot is not None:
        print(f"plot: {plot}")
    out = {"workload": str(workload), "runs": runs, "policies": stats, "cores": os.cpu_count()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
