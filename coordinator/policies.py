"""policies.py: the placement policies, and the one registry of them.

A policy sees the cells and their roles, the counters, the training supply and where the
current burst stands, and returns the role every cell should hold now. It owns no state
and does no I/O. `POLICIES` maps each policy's name to a `PolicySpec`: its role rule, the
roles it starts from and when a step may start (a full batch, or streaming from the first
ready group). Nothing else in gyre tests a policy's name: the scheduler (schedule.py) reads
the spec, for runs and `gyre sim` alike. Training cells always form a prefix 0..k-1 (cell 0
is the core), which is what the prebuilt prefix process groups need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    roles: tuple[str, ...]  # per cell: "rollout" | "training"
    queued: int  # executions dispatched, not launched
    running: int  # executions launched, not closed
    ready_groups: int  # ready groups not yet taken by a batch
    groups_per_step: int  # B
    mu: int
    steps_in_burst: int  # optimizer steps done since the last publication
    step_in_flight: bool
    async_training_cells: int = 1
    capacity: tuple[int, ...] = ()  # per cell: concurrent executions it serves in rollout
    standalone: int = 0  # executions a never-training rollout pool serves
    window_open: bool = False  # the batch in flight still takes new participants
    unclaimed: int = 0  # micro-steps of the batch in flight not yet claimed by a cell

    @property
    def cells(self) -> int:
        return len(self.roles)

    @property
    def waterlevel(self) -> int:
        return self.queued + self.running

    def rollout_capacity(self, roles: tuple[str, ...] | list[str]) -> int:
        caps = self.capacity or (0,) * self.cells
        return self.standalone + sum(c for c, r in zip(caps, roles) if r == "rollout")


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


def elastic_policy(s: Snapshot) -> tuple[str, ...]:
    """Cells move to training one by one as the waterlevel allows, in fixed order.

    - The core (cell 0) enters training when there is training supply and the remaining
      rollout capacity (other rollout cells + standalone pool) covers the waterlevel.
    - Satellites (1, 2, ...) join the batch in flight, in order, under the same two checks,
      while its joining window is open.
    - At burst end (mu steps done) the satellites return to rollout; the core stays to
      publish, then starts the next burst only if supply and capacity still allow.
    - Between steps of a burst the core (and its satellites) return to rollout when supply
      or the capacity check fails.
    """
    roles = list(s.roles)
    n = s.cells
    supply = s.ready_groups > 0 or s.unclaimed > 0

    def fits_without(cell: int) -> bool:
        trial = list(roles)
        trial[cell] = "training"
        return s.rollout_capacity(trial) >= s.waterlevel

    if roles[0] == "rollout":
        if s.ready_groups > 0 and fits_without(0):
            roles[0] = "training"  # the satellites may follow once its batch is in flight
        return tuple(roles)
    if not s.step_in_flight:
        if s.steps_in_burst >= s.mu:  # burst end: satellites back; the core publishes
            return ("training",) + ("rollout",) * (n - 1)
        if not (s.ready_groups > 0 and s.rollout_capacity(roles) >= s.waterlevel):
            return ("rollout",) * n  # between steps (or after publishing): no supply or no room
        return tuple(roles)
    # A batch is in flight: satellites join in order while the window is open.
    for cell in range(1, n):
        if roles[cell] == "training":
            continue
        if not (s.window_open and supply and fits_without(cell)):
            break
        roles[cell] = "training"
    return tuple(roles)


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    roles: Policy
    full_batch: bool  # a step starts only once B groups are ready; else from the first ready group
    fixed_split: bool = False  # cells [0, async_training_cells) train for the whole run
    about: str = ""

    def initial_roles(self, cells: int, training_cells: int) -> tuple[str, ...]:
        return tuple("training" if self.fixed_split and c < training_cells else "rollout" for c in range(cells))

    def groups_to_start(self, groups_per_step: int) -> int:
        return groups_per_step if self.full_batch else 1


POLICIES: dict[str, PolicySpec] = {p.name: p for p in (
    PolicySpec("elastic", elastic_policy, full_batch=False,
               about="cells move between rollout and training as the waterlevel falls; streaming steps"),
    PolicySpec("colocate", colocate_policy, full_batch=True,
               about="the whole pool rolls out, then the whole pool trains a full batch"),
    PolicySpec("async", async_policy, full_batch=True, fixed_split=True,
               about="a fixed split; a step starts once a full batch is ready (the paper's Async baseline)"),
    PolicySpec("async-streaming", async_policy, full_batch=False, fixed_split=True,
               about="a fixed split; a step starts from the first ready group (the paper's A3 ablation)"),
)}
