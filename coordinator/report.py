"""report.py: what a run says of itself: each step's report and `step` event, the closing
`summary` event. Read from the coordinator's objects (main.py calls these with itself);
nothing here decides or changes anything. Not the live view (status.py, cli/live.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.coordinator.buffer import Group


@dataclass
class StepReport:
    step: int
    version: int
    reward_mean: float | None
    reward_valid_frac: float | None
    staleness_mean: float
    groups: int
    executions: int
    tokens_trained: int
    cells_training: int
    loss: float
    seconds: float
    # Groups whose valid rewards were all equal: group-relative advantages are zero, so
    # they train nothing (a run of such steps learns nothing; the reward needs spread).
    equal_reward_groups: int = 0


def step(coord, groups, executions, results, version_before, n_cells, seconds, packed) -> None:
    """A trained step: its report (the `on_step` callback, the step line) and its `step` event."""
    runs = [r for g in groups for r in g.runs if r.status != "cancelled"]
    valid = [r.reward for r in runs if r.valid and r.reward is not None]
    staleness = [version_before - g.version for g in groups]
    rep = StepReport(step=coord.steps_done, version=coord.trainer_version,
                     reward_mean=sum(valid) / len(valid) if valid else None,
                     reward_valid_frac=len(valid) / len(runs) if runs else None,
                     staleness_mean=sum(staleness) / len(staleness), groups=len(groups),
                     executions=executions, tokens_trained=sum(r.tokens for r in results),
                     cells_training=n_cells, loss=sum(r.loss for r in results), seconds=round(seconds, 3),
                     equal_reward_groups=sum(_equal_rewards(g) for g in groups))
    coord.reports.append(rep)
    coord.tokens_trained += rep.tokens_trained
    # Engine/trainer gap over the step's targets (token-weighted mean of b - l): near zero
    # when the engines run the trainer's weights; a health signal for GPU backends.
    tokens = sum(r.tokens for r in results)
    mismatch = sum(r.mismatch_kl * r.tokens for r in results) / tokens if tokens else None
    prefill, cached = prefill_of(runs)
    coord.metrics.emit("step", **rep.__dict__, mismatch=mismatch, staleness=staleness,
                       group_ids=[g.id for g in groups], prefill_tokens=prefill, cached_tokens=cached,
                       # The forward pass: tokens computed, unique admitted (each tree node on
                       # an admitted path once), path-expanded, and the trainers' seconds.
                       packing=coord.c.packing, forward_tokens=packed.forward,
                       unique_admitted_tokens=packed.unique, expanded_tokens=packed.expanded,
                       trainer_seconds=round(sum(r.seconds for r in results), 4),
                       loop_lag_ms=coord.probe.lag_ms(since=coord.step_began),
                       cache_hit_rate=None if prefill is None or not prefill + cached
                       else round(cached / (prefill + cached), 4),
                       waterlevel=coord.wl.c.waterlevel,
                       counters={"d": coord.wl.c.d, "p": coord.wl.c.p, "f": coord.wl.c.f},
                       statuses=dict(coord.executions.status_counts))
    if coord.on_step is not None:
        coord.on_step(rep)


def summary(coord) -> None:
    """The closing `summary` event: statuses, pending and dropped groups, per-cell busy time and memory."""
    wall = coord.metrics.now()
    cells = []
    for i, node in enumerate(coord.cells.nodes):
        route = coord.table.routes.get(node)
        rollout_busy = route.busy_s if route else 0.0
        train_busy = coord.train_busy_s.get(i, 0.0)
        rss = coord.peak_rss[i] if i < len(coord.peak_rss) else None
        cells.append({"cell": i, "rollout_busy_s": round(rollout_busy, 3), "train_busy_s": round(train_busy, 3),
                      "rollout_tokens": route.tokens if route else 0,
                      "peak_rss_mb": None if rss is None else round(rss / 2**20, 1),
                      "idle_frac": round(max(0.0, 1 - (rollout_busy + train_busy) / wall), 4) if wall else None})
    coord.metrics.emit("summary", steps=coord.steps_done, wall_s=wall, statuses=dict(coord.executions.status_counts),
                       pending_groups=sorted([*(g.id for g in coord.buffer.groups.values() if g.state != "consumed"),
                                             *(ev["group"] for ev in coord.executions.held)]),
                       dropped_groups=sorted(g.id for g in coord.buffer.groups.values() if g.state == "dropped"),
                       dead_cells=sorted(coord.cells.dead), rejoined_cells=sorted(coord.cells.no_reducer),
                       counters={"d": coord.wl.c.d, "p": coord.wl.c.p, "f": coord.wl.c.f},
                       rollout_tokens=sum(c["rollout_tokens"] for c in cells),
                       tokens_trained=coord.tokens_trained, cells=cells)


def _equal_rewards(group: Group) -> bool:
    """Every counted valid reward of the group the same: no advantage to learn from."""
    rewards = [r.reward for r in group.valid_runs[: group.size] if r.reward is not None]
    return len(rewards) > 0 and max(rewards) == min(rewards)


def prefill_of(runs) -> tuple[int | None, int | None]:
    """(computed, reused) prompt tokens over the model calls of a step's executions; None
    where no call's engine said (an unknown is never counted as zero)."""
    known = [c for r in runs if r.recorder is not None for c in r.recorder.calls if c.get("cached_tokens") is not None]
    if not known:
        return None, None
    return sum(c["prefill_tokens"] for c in known), sum(c["cached_tokens"] for c in known)
