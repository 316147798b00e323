"""report.py: what a run says of itself: a step's `StepReport` (steps.py makes one per
step, with its `step` event) and the closing `summary` event, read from the coordinator's
owners; nothing here decides or changes anything. Not the live view (status.py, cli/live.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # Whether an optimizer update was applied: a step whose groups added no token (all scored
    # alike, or made no model call) applies none and publishes no weights.
    trained: bool = True
    # diagnosis.diagnose of its groups (zero-advantage groups and why, the calls and statuses
    # behind them), and diagnosis.why in one line ('' when there is nothing to say).
    diagnosis: dict = field(default_factory=dict)
    note: str = ""


def summary(metrics, *, steps, cells, executions, buffer, wl, table, peak_rss: list[int | None]) -> None:
    """The closing `summary` event, in `metrics`' journal: statuses, pending and dropped
    groups, per-cell busy time and memory, read from the run's owners."""
    wall = metrics.now()
    rows = []
    for i, node in enumerate(cells.nodes):
        route = table.routes.get(node)
        rollout_busy = route.busy_s if route else 0.0
        train_busy = steps.train_busy_s.get(i, 0.0)
        rss = peak_rss[i] if i < len(peak_rss) else None
        rows.append({"cell": i, "rollout_busy_s": round(rollout_busy, 3), "train_busy_s": round(train_busy, 3),
                     "rollout_tokens": route.tokens if route else 0,
                     "peak_rss_mb": None if rss is None else round(rss / 2**20, 1),
                     "idle_frac": round(max(0.0, 1 - (rollout_busy + train_busy) / wall), 4) if wall else None})
    metrics.emit("summary", steps=steps.steps_done, wall_s=wall, statuses=dict(executions.status_counts),
                 pending_groups=sorted([*(g.id for g in buffer.groups.values() if g.state != "consumed"),
                                       *(ev["group"] for ev in executions.held if not ev.get("ahead"))]),
                 dropped_groups=sorted(g.id for g in buffer.groups.values() if g.state == "dropped"),
                 dead_cells=sorted(cells.dead), rejoined_cells=sorted(cells.no_reducer),
                 counters={"d": wl.c.d, "p": wl.c.p, "f": wl.c.f},
                 rollout_tokens=sum(c["rollout_tokens"] for c in rows), tokens_trained=steps.tokens_trained,
                 cells=rows)


def equal_rewards(group: Group) -> bool:
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
