"""workloads.py: the clusters and task mixes `gyre sim` runs on.

A `Workload` is one cluster shape (cells, slots, switch and publication times) and one
distribution of execution durations: the calibrated presets (NL2Repo as in the paper,
SWE-style repair, terminal tasks) or one rebuilt from a real run's metrics.jsonl. Not the
simulator (sim.py) and not the scheduler (schedule.py).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from gyre.coordinator.metrics import read_events
from gyre.workerd.wire import GyreError


class SimError(GyreError):
    """A simulation cannot go on (it stalled, or the scheduler did not settle), or a
    workload cannot be built (a metrics.jsonl without the events it needs)."""


@dataclass(frozen=True)
class Workload:
    """One cluster and task mix. Durations: per query a scale lognormal(0, query_sigma),
    times `hard_mult` for a `hard_frac` of queries (tasks the agent rarely finishes: the
    timeouts bunch there); per execution exec_median_h * scale * lognormal(0, exec_sigma).
    `empirical_groups_h` (from a real run) replaces the model: a recorded group is drawn
    and its durations resampled (inf = timed out), or, with `ordered_groups`, the groups are
    taken in the order they were dispatched."""

    name: str
    cells: int
    cell_nodes: int
    group_size: int  # N
    groups_per_step: int  # B
    exec_slots_per_cell: int
    timeout_h: float
    train_h_all: float  # hours of one step when every cell trains
    switch_to_train_s: float = 8.52
    switch_to_rollout_s: float = 3.46
    publish_s: float = 30.0
    micro_steps_per_group: int = 4
    load_alpha: float = 0.3
    exec_median_h: float = 1.0
    query_sigma: float = 0.0
    exec_sigma: float = 0.5
    hard_frac: float = 0.0
    hard_mult: float = 1.0
    empirical_groups_h: tuple[tuple[float, ...], ...] = ()
    # The recorded groups in dispatch order, each its members' in id order: the i-th group
    # dispatched takes the i-th (cycling) instead of a random one. A recorded run's tasks come
    # in the same order under every policy, and their durations are the tasks' own.
    ordered_groups: bool = False
    train_h_by_cells: tuple[tuple[int, float], ...] = ()  # measured (cells, step hours), reference only
    assumed: tuple[str, ...] = ()  # terms a recorded run did not measure, and what stands in for each
    # A host whose cells share its cores (coordinator/replay.py fits it from recorded runs; 0:
    # off, independent cells as on GPUs): each execution started together with k-1 others
    # takes k * host_start_s seconds more (k harnesses starting up on the same cores).
    host_start_s: float = 0.0


PRESETS: dict[str, Workload] = {
    # Paper's NL2Repo run: 32 nodes, 4 h harness deadline. Calibrated by a numeric search
    # to mean 1.93 h/execution, 2.96 h/query (group max), 9.51% queries at the cap, 6.25%
    # executions timed out (see test_sim.py for the sampled figures).
    "nl2repo": Workload(name="nl2repo", cells=8, cell_nodes=4, group_size=16, groups_per_step=32,
                        exec_slots_per_cell=144, timeout_h=4.0, train_h_all=0.4, micro_steps_per_group=4,
                        exec_median_h=1.70, query_sigma=0.10, exec_sigma=0.29, hard_frac=0.06, hard_mult=4.45),
    # SWE-style repair (DeepSWE-like): ~0.5 h mean, 2 h deadline, N=16 (768 executions a
    # step); a step of long multi-turn contexts is 0.25 h on all 24 nodes (1.5 cell-hours,
    # close to the 2 cell-hours its rollouts take: training-heavy like NL2Repo).
    "deepswe": Workload(name="deepswe", cells=6, cell_nodes=4, group_size=16, groups_per_step=48,
                        exec_slots_per_cell=192, timeout_h=2.0, train_h_all=0.25, micro_steps_per_group=4,
                        exec_median_h=0.40, query_sigma=0.35, exec_sigma=0.45, hard_frac=0.04, hard_mult=3.0),
    # Terminal tasks: ~0.35 h mean, 1 h deadline, N=8 (384 executions a step); shorter
    # contexts: 0.12 h a step on all 24 nodes.
    "terminalbench": Workload(name="terminalbench", cells=6, cell_nodes=4, group_size=8, groups_per_step=48,
                              exec_slots_per_cell=192, timeout_h=1.0, train_h_all=0.12, micro_steps_per_group=2,
                              exec_median_h=0.28, query_sigma=0.4, exec_sigma=0.4, hard_frac=0.05, hard_mult=3.0),
}


def sample_query(w: Workload, rng: random.Random, index: int | None = None) -> list[float]:
    """Work hours (at load 1) of one query's N executions; >= timeout_h means a timeout.
    `index`: the query's place in dispatch order (used with `ordered_groups`)."""
    if w.empirical_groups_h and w.ordered_groups and index is not None:
        g = w.empirical_groups_h[index % len(w.empirical_groups_h)]
        return [*g, *(rng.choice(g) for _ in range(w.group_size - len(g)))][:w.group_size]
    if w.empirical_groups_h:
        g = rng.choice(w.empirical_groups_h)
        return [rng.choice(g) for _ in range(w.group_size)]
    scale = w.exec_median_h * math.exp(rng.gauss(0.0, w.query_sigma))
    if rng.random() < w.hard_frac:
        scale *= w.hard_mult
    return [scale * math.exp(rng.gauss(0.0, w.exec_sigma)) for _ in range(w.group_size)]


def duration_stats(w: Workload, *, queries: int, seed: int) -> dict[str, float]:
    """The four statistics the presets are calibrated to, at load 1."""
    rng = random.Random(seed)
    execs = [sample_query(w, rng) for _ in range(queries)]
    capped = [[min(x, w.timeout_h) for x in q] for q in execs]
    n = queries * w.group_size
    return {"mean_exec_h": sum(map(sum, capped)) / n,
            "mean_query_h": sum(map(max, capped)) / queries,
            "query_cap_frac": sum(max(q) >= w.timeout_h for q in execs) / queries,
            "exec_timeout_frac": sum(x >= w.timeout_h for q in execs for x in q) / n}


# --- a workload from a real run ---------------------------------------------------------------


def workload_from_metrics(path: str | Path, events: list[dict] | None = None) -> Workload:
    """A Workload from a run's metrics.jsonl (and its config.json next to it, if present).
    Recorded groups' execution durations are replayed in the order the groups were dispatched
    (`ordered_groups`; timed_out ones end at the deadline; cancelled ones, which never
    finished, are left out, their places drawn from the group's others). A step's cell-hours are its trainers'
    own seconds (`trainer_seconds`; a streaming step's wall time includes its wait for ready
    groups), over the steps that trained; `train_h_by_cells` keeps the steps' wall hours per
    cell count, for reference. Switch and publication times and micro-steps per group are the
    run's own. A term the run did not measure (no `role` event: the run never switched; a
    journal from before `trainer_seconds` or `micro_steps`) keeps a stand-in, named in
    `assumed`. Cluster shape comes from config.json, else from the events."""
    path = Path(path)
    if events is None:  # (a caller that read the journal already passes its events)
        events = read_events(path, warn=True).events  # a torn line skipped
    cfg_path = path.parent / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    assumed: list[str] = []
    groups: dict[int, dict[str, float]] = {}
    for e in events:
        if e.get("event") == "execution" and e.get("t_start") is not None and e.get("t_end") is not None \
                and e.get("status") != "cancelled" and e.get("group") is not None:
            hours = math.inf if e.get("status") == "timed_out" else (e["t_end"] - e["t_start"]) / 3600
            groups.setdefault(e["group"], {})[e.get("id", str(len(groups.get(e["group"], {}))))] = hours
    steps = [e for e in events if e.get("event") == "step"]
    roles = [e for e in events if e.get("event") == "role"]
    if not groups or not steps:
        raise SimError(f"{path}: needs execution and step events")
    cells = int(cfg.get("cells") or max([e["cells_training"] for e in steps] + [e["cell"] + 1 for e in roles]))
    trained = [e for e in steps if e.get("trained", True) and e.get("tokens_trained", 1)] or steps
    if all(e.get("trainer_seconds") is not None for e in trained):
        cell_h = sum(e["trainer_seconds"] for e in trained) / len(trained) / 3600
    else:
        cell_h = sum(e["seconds"] * e["cells_training"] for e in trained) / len(trained) / 3600
        assumed.append("training: step seconds x cells training (no trainer_seconds in the journal)")
    by_cells: dict[int, list[float]] = {}
    for e in steps:
        by_cells.setdefault(e["cells_training"], []).append(e["seconds"] / 3600)
    finite = [x for g in groups.values() for x in g.values() if math.isfinite(x)]
    timeout_h = cfg["execution_timeout_s"] / 3600 if "execution_timeout_s" in cfg else max(finite, default=1.0)
    # What a timeout costs: the deadline, then stopping the harness and scoring its workspace.
    ended = [(e["t_end"] - e["t_start"]) / 3600 for e in events if e.get("event") == "execution"
             and e.get("status") == "timed_out" and e.get("t_start") is not None and e.get("t_end") is not None]
    if ended:
        timeout_h = max(timeout_h, sum(ended) / len(ended))

    def mean_seconds(kind: str, default: float, what: str, to: str | None = None) -> float:
        xs = [e["seconds"] for e in events if e.get("event") == kind and (to is None or e.get("to") == to)]
        if xs:
            return sum(xs) / len(xs)
        assumed.append(f"{what}: {default:g} s (the paper's GPU figure; the run measured none)")
        return default

    counted = [e for e in trained if e.get("micro_steps") and e.get("groups")]
    if counted:
        per_group = max(1, round(sum(e["micro_steps"] for e in counted) / sum(e["groups"] for e in counted)))
    else:
        per_group = Workload.micro_steps_per_group
        assumed.append(f"micro-steps per group: {per_group} (no micro_steps in the journal)")
    base = Workload(name=path.parent.name or "metrics", cells=cells, cell_nodes=1,
                    group_size=int(cfg.get("group_size") or max(len(g) for g in groups.values())),
                    groups_per_step=int(cfg.get("groups_per_step") or max(e["groups"] for e in steps)),
                    exec_slots_per_cell=int(cfg.get("exec_slots_per_cell") or _peak_running(events, cells)),
                    timeout_h=timeout_h, train_h_all=cell_h / cells)
    return replace(base, switch_to_train_s=mean_seconds("role", 8.52, "switch to training", "training"),
                   switch_to_rollout_s=mean_seconds("role", 3.46, "switch to rollout", "rollout"),
                   publish_s=mean_seconds("publish", 30.0, "publication"), micro_steps_per_group=per_group,
                   empirical_groups_h=tuple(tuple(h for _, h in sorted(g.items())) for _, g in sorted(groups.items())),
                   ordered_groups=True,
                   train_h_by_cells=tuple((k, sum(v) / len(v)) for k, v in sorted(by_cells.items())),
                   assumed=tuple(assumed))


def _peak_running(events: list[dict], cells: int) -> int:
    """Slots per cell when config.json is missing: peak concurrent executions / cells."""
    marks = sorted([(e["t_start"], 1) for e in events if e.get("event") == "execution"]
                   + [(e["t_end"], -1) for e in events if e.get("event") == "execution"])
    peak = level = 0
    for _, d in marks:
        level += d
        peak = max(peak, level)
    return max(1, math.ceil(peak / max(1, cells)))
