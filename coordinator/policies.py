"""policies.py: placement policies, pure functions from a state snapshot to cell roles.

A policy sees the cells and their roles, the counters, the ready groups and where the
current burst stands, and returns the role every cell should hold now. It owns no state
and does no I/O, so the same code drives real runs and simulations. `elastic` comes with
its own issue and slots in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    roles: tuple[str, ...]  # per cell: "rollout" | "training"
    queued: int  # executions dispatched, not launched
    running: int  # executions launched, not closed
    ready_groups: int
    groups_per_step: int  # B
    mu: int
    steps_in_burst: int  # optimizer steps done in the current burst
    step_in_flight: bool
    async_training_cells: int = 1

    @property
    def cells(self) -> int:
        return len(self.roles)


Policy = Callable[[Snapshot], tuple[str, ...]]


def async_policy(s: Snapshot) -> tuple[str, ...]:
    """A fixed split: cells [0, t) train, the others roll out, for the whole run."""
    return tuple("training" if c < s.async_training_cells else "rollout" for c in range(s.cells))


def colocate_policy(s: Snapshot) -> tuple[str, ...]:
    """The whole pool switches together: to training once every dispatched execution has
    finished and a step's groups are ready; back to rollout once the burst is published
    and nothing more is ready, or when a burst runs out of groups while executions remain
    (dropped groups were replaced: they must roll out first)."""
    if all(r == "training" for r in s.roles):
        if s.step_in_flight:
            return s.roles
        published = s.steps_in_burst == 0 and s.ready_groups < s.groups_per_step
        starved = s.ready_groups < s.groups_per_step and s.queued + s.running > 0
        return ("rollout",) * s.cells if published or starved else s.roles
    if s.queued == 0 and s.running == 0 and s.ready_groups >= s.groups_per_step:
        return ("training",) * s.cells
    return ("rollout",) * s.cells


POLICIES: dict[str, Policy] = {"async": async_policy, "colocate": colocate_policy}
