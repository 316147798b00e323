"""replay.py: recorded runs through the simulator, measured against predicted.

`gyre sim compare --from RUN_DIR ...` (cli/sim.py) reads real runs of one workload under
several policies (bench/coordinator.py --keep writes them), pools what they recorded into one
`Workload` (every run's execution durations; training, switch and publication times averaged
over the runs that measured them), replays each run's own policy, (phi, mu) and split on it,
and sets the simulator's seconds per step beside the measured ones, and each policy's ratio to
elastic beside the measured ratio. Not the simulator (sim.py) nor a run's own reading
(workloads.workload_from_metrics).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from gyre.coordinator.metrics import counted_steps, read_events
from gyre.coordinator.sim import simulate
from gyre.coordinator.workloads import SimError, Workload, workload_from_metrics

SHAPE = ("cells", "group_size", "groups_per_step", "exec_slots_per_cell")


@dataclass(frozen=True)
class RecordedRun:
    """One real run: its settings, its measured seconds per step, its workload."""

    run_dir: Path
    policy: str
    phi: float
    mu: int
    training_cells: int | None  # a fixed split's training cells; None: the policy moves cells
    steps: int
    s_per_step: float
    workload: Workload
    # execution id -> (group, hours (inf: timed out), executions started together with it):
    # what the host model is fitted on, and the pool is merged from
    executions: dict[str, tuple[int, float, float]]


def s_per_step(events: list[dict]) -> tuple[float, int]:
    """(seconds per step, steps): from the first dispatch to the last step over the steps
    (a run's worker start-up is no step's; the simulator starts at the first dispatch too)."""
    steps = counted_steps(events)
    dispatches = [e["t"] for e in events if e.get("event") == "dispatch"]
    if not steps or not dispatches:
        raise SimError("needs dispatch and step events (a run that finished a step)")
    return (steps[-1]["t"] - min(dispatches)) / len(steps), len(steps)


def read_run(run_dir: Path) -> RecordedRun:
    metrics = run_dir / "metrics.jsonl"
    events = read_events(metrics, warn=True).events
    cfg = json.loads((run_dir / "config.json").read_text())
    seconds, steps = s_per_step(events)
    policy = cfg.get("policy", "elastic")
    split = int(cfg.get("async_training_cells", 1)) if policy.startswith("async") else None
    return RecordedRun(run_dir, policy, float(cfg.get("phi", 0.0)), int(cfg.get("mu", 1)), split, steps, seconds,
                       workload_from_metrics(metrics, events), _executions(events))


TOGETHER_S = 1.0  # executions started within this of one another started together


def _executions(events: list[dict]) -> dict[str, tuple[int, float, float]]:
    """Each finished training execution: (group, hours or inf, how many executions started
    together with it, itself included)."""
    done = [e for e in events if e.get("event") == "execution" and e.get("group") is not None
            and e.get("status") != "cancelled" and e.get("t_start") is not None and e.get("t_end") is not None]
    starts = [e["t_start"] for e in done]
    out = {}
    for e in done:
        together = sum(1 for x in starts if abs(x - e["t_start"]) <= TOGETHER_S)
        hours = math.inf if e.get("status") == "timed_out" else (e["t_end"] - e["t_start"]) / 3600
        out[e["id"]] = (e["group"], hours, float(together))
    return out


def fit_host(runs: list[RecordedRun]) -> float:
    """The host model's seconds per execution started together (Workload.host_start_s): the
    slope of one task's duration on how many started with it, across the runs (least squares
    within each execution finished in two runs or more, so the tasks' own lengths cancel).
    0 when no execution was seen twice, or more company never cost anything."""
    seen: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        for ident, (_, hours, together) in r.executions.items():
            if math.isfinite(hours):
                seen.setdefault(ident, []).append((hours * 3600, together))
    num = den = 0.0
    for xs in seen.values():
        if len(xs) < 2:
            continue
        d, k = statistics.fmean(x for x, _ in xs), statistics.fmean(y for _, y in xs)
        num += sum((x - d) * (y - k) for x, y in xs)
        den += sum((y - k) ** 2 for _, y in xs)
    return max(0.0, num / den) if den else 0.0


def pool(runs: list[RecordedRun], *, host: bool = False) -> Workload:
    """One workload from runs of the same shape: the recorded groups in dispatch order, each
    member's duration its median over the runs (`_merged`); each time the mean over the runs
    that measured it (`assumed` keeps only what none measured)."""
    first = runs[0].workload
    for r in runs[1:]:
        if differ := [k for k in SHAPE if getattr(r.workload, k) != getattr(first, k)]:
            raise SimError(f"{r.run_dir} is not a run of {runs[0].run_dir}'s workload: its {differ[0]} is "
                           f"{getattr(r.workload, differ[0])}, not {getattr(first, differ[0])}")

    def measured(field: str, term: str) -> float:
        xs = [getattr(r.workload, field) for r in runs if not any(a.startswith(term) for a in r.workload.assumed)]
        return statistics.fmean(xs) if xs else getattr(first, field)

    def unmeasured(term: str) -> bool:
        return all(any(a.startswith(term) for a in r.workload.assumed) for r in runs)

    assumed = tuple(a for a in first.assumed if unmeasured(a.split(":")[0]))
    start_s = fit_host(runs) if host else 0.0
    return replace(first, name=f"{len(runs)} runs", train_h_all=measured("train_h_all", "training"),
                   switch_to_train_s=measured("switch_to_train_s", "switch to training"),
                   switch_to_rollout_s=measured("switch_to_rollout_s", "switch to rollout"),
                   publish_s=measured("publish_s", "publication"),
                   micro_steps_per_group=max(1, round(measured("micro_steps_per_group", "micro-steps"))),
                   timeout_h=max(r.workload.timeout_h for r in runs),
                   empirical_groups_h=_merged(runs, start_s), ordered_groups=True, host_start_s=start_s,
                   train_h_by_cells=(), assumed=assumed)


def _merged(runs: list[RecordedRun], start_s: float) -> tuple[tuple[float, ...], ...]:
    """The runs' groups in dispatch order, members in id order, each execution's duration the
    median over the runs that finished it (the lower one of an even count; a timeout, inf,
    where most timed out): the same task under each policy. With the host model (start_s >
    0) each duration first loses what its company at start added (the sim adds it back)."""
    by: dict[int, dict[str, list[float]]] = {}
    for r in runs:
        for ident, (group, hours, together) in r.executions.items():
            own = max(hours - start_s * together / 3600, 0.0) if math.isfinite(hours) else hours
            by.setdefault(group, {}).setdefault(ident, []).append(own)
    out = []
    for _, members in sorted(by.items()):
        out.append(tuple(sorted(xs)[(len(xs) - 1) // 2] for _, xs in sorted(members.items())))
    return tuple(out)


def replay(run_dirs: list[Path], *, seeds: list[int], host: bool = False) -> dict:
    """Measured and predicted seconds per step, per run and per policy, and each policy's
    ratio to elastic (measured, predicted, and the prediction's error); `host`: with the host
    model fitted from the runs (fit_host), else independent cells."""
    runs = [read_run(d) for d in run_dirs]
    w = pool(runs, host=host)
    out_runs = []
    for r in runs:
        sims = [simulate(w, policy=r.policy, phi=r.phi, mu=r.mu, steps=r.steps, seed=s,
                         async_training_cells=r.training_cells) for s in seeds]
        predicted = statistics.fmean(x.hours * 3600 / x.steps for x in sims)
        out_runs.append({"run_dir": str(r.run_dir), "policy": r.policy, "phi": r.phi, "mu": r.mu,
                         "training_cells": r.training_cells, "steps": r.steps,
                         "measured_s_per_step": round(r.s_per_step, 3), "predicted_s_per_step": round(predicted, 3),
                         "error": round(predicted / r.s_per_step - 1, 4)})
    policies: dict[str, dict] = {}
    for name in dict.fromkeys(r["policy"] for r in out_runs):
        mine = [r for r in out_runs if r["policy"] == name]
        policies[name] = {k: round(statistics.fmean(r[k + "_s_per_step"] for r in mine), 3)
                          for k in ("measured", "predicted")} | {"runs": len(mine)}
    ref = policies.get("elastic")
    if ref is not None:
        for p in policies.values():
            p["measured_vs_elastic"] = round(p["measured"] / ref["measured"], 4)
            p["predicted_vs_elastic"] = round(p["predicted"] / ref["predicted"], 4)
            p["ratio_error"] = round(p["predicted_vs_elastic"] / p["measured_vs_elastic"] - 1, 4)
    return {"workload": {k: getattr(w, k) for k in (*SHAPE, "train_h_all", "switch_to_train_s", "switch_to_rollout_s",
                                                   "publish_s", "micro_steps_per_group", "timeout_h", "host_start_s")}
            | {"groups": len(w.empirical_groups_h), "assumed": list(w.assumed)},
            "seeds": seeds, "runs": out_runs, "policies": policies}
