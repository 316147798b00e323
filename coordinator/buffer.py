"""buffer.py: executions by group, group readiness and group-relative advantages.

A group is *ready* when every execution in it is closed and at least `min_valid`
outcomes are valid; one that closes with fewer is *dropped* (its executions never
train). With oversampling, once N outcomes are valid the still-running surplus is
returned for cancellation. Rewards that are missing stay missing: an invalid execution
has `reward=None` and no advantage. Not the packer and not the launcher.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from gyre.coordinator.waterlevel import ExecState, Tracked

# An execution's phases, in order, as the launcher sets them (launcher.py): waiting for a slot,
# its task's image, its sandbox made, its harness running, scored, its sandbox removed, closed.
# While the harness runs the live view tells apart a model call in flight at the proxy and the
# time between calls (status.py `shown_phase`).
PHASES = ("queued", "image", "sandbox", "harness", "verifier", "cleanup", "done")


@dataclass(eq=False)
class Execution:
    """One execution as the coordinator tracks it."""

    id: str
    group: int
    index: int
    task: Any
    tracked: Tracked
    version_dispatched: int
    status: str | None = None
    reward: float | None = None
    valid: bool = False
    ref: str = ""
    eval_attempts: int = 0
    t_start: float | None = None
    t_end: float | None = None
    recorder: Any = None  # the proxy's Recorder (tree, calls)
    copy_out_error: str | None = None  # what the workspace copy left out or stopped at (scoring.py)
    phase: str = "queued"  # where the launcher has it now: one of PHASES
    phase_t: float | None = None  # when that phase began (time.time()); None while queued
    adopted: bool = False  # its harness outlived an earlier coordinator of the run, and was taken back

    def enter(self, phase: str) -> None:
        """The launcher moved it on (the live view shows the phase and its time)."""
        self.phase, self.phase_t = phase, time.time()

    @property
    def closed(self) -> bool:
        return self.tracked.state is ExecState.CLOSED


@dataclass(eq=False)
class Group:
    id: int
    task: Any
    version: int  # published policy version at dispatch
    size: int  # N valid outcomes wanted
    runs: list[Execution] = field(default_factory=list)
    state: str = "open"  # open | ready | dropped | consumed

    @property
    def valid_runs(self) -> list[Execution]:
        return [r for r in self.runs if r.closed and r.valid]


class TrajectoryBuffer:
    def __init__(self, min_valid: int):
        self.min_valid = min_valid
        self.groups: dict[int, Group] = {}
        self._ready: dict[int, Group] = {}  # kept apart: a long run holds thousands of groups

    def _settle(self, g: Group, state: str) -> None:
        g.state = state
        if state == "ready":
            self._ready[g.id] = g

    def add(self, group: Group) -> None:
        self.groups[group.id] = group

    def on_closed(self, run: Execution) -> list[Execution]:
        """Update the run's group; returns surplus runs to cancel (oversampling)."""
        g = self.groups[run.group]
        if g.state != "open":
            return []
        valid = g.valid_runs
        if len(valid) >= g.size:
            surplus = [r for r in g.runs if not r.closed]
            if not surplus:
                self._settle(g, "ready")
            return surplus
        if all(r.closed for r in g.runs):
            self._settle(g, "ready" if len(valid) >= self.min_valid else "dropped")
        return []

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def ready(self) -> list[Group]:
        """Ready groups, oldest policy version first (then dispatch order)."""
        return sorted(self._ready.values(), key=lambda g: (g.version, g.id))

    def take(self) -> Group | None:
        if not self._ready:
            return None
        g = min(self._ready.values(), key=lambda g: (g.version, g.id))
        del self._ready[g.id]
        g.state = "consumed"
        return g

    def untake(self, groups: list[Group]) -> None:
        """Groups a batch took but never trained (a step cancelled at shutdown): ready again,
        so the final checkpoint does not count them consumed."""
        for g in groups:
            if g.state == "consumed":
                self._settle(g, "ready")


def advantages(group: Group) -> dict[str, float]:
    """Group-relative: (r - mean) / (std + eps) over the group's valid rewards only
    (the first N valid, when oversampling produced more).

    Computed on the rewards divided by their largest magnitude, s: the advantage is the same,
    (x - m) / (sd + eps / s) with x = r / s, but no sum or square can overflow, so any finite
    rewards (1e308 among them) give finite advantages, never inf or NaN."""
    runs = group.valid_runs[: group.size]
    if not runs:
        return {}
    scale = max(abs(r.reward) for r in runs)
    if scale == 0.0:
        return {r.id: 0.0 for r in runs}
    xs = [r.reward / scale for r in runs]  # each in [-1, 1]
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
    eps = 1e-6 / scale  # inf for the tiniest scales: advantages 0, as the unscaled formula gives
    return {r.id: (x - mean) / (std + eps) for r, x in zip(runs, xs)}
