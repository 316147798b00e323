"""waterlevel.py: the three cumulative counters and each execution's one-way life.

d (dispatched) >= p (launched) >= f (terminated) >= 0 always; every launched execution
adds exactly one to f whatever its end. Waterlevel = d - f (queued + running). Counters
only move through `ExecutionState` transitions, so "exactly once" is structural, and a
violation raises instead of being papered over. Not a scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CounterError(AssertionError):
    """A transition that would break 0 <= f <= p <= d, or count an execution twice."""


class ExecState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(slots=True)
class Counters:
    d: int = 0
    p: int = 0
    f: int = 0

    @property
    def queued(self) -> int:
        return self.d - self.p

    @property
    def running(self) -> int:
        return self.p - self.f

    @property
    def waterlevel(self) -> int:
        return self.d - self.f

    def check(self) -> None:
        if not 0 <= self.f <= self.p <= self.d:
            raise CounterError(f"counter invariant broken: d={self.d} p={self.p} f={self.f}")


@dataclass(slots=True)
class Tracked:
    """One execution's place in the counters."""

    state: ExecState = ExecState.QUEUED


class Waterlevel:
    def __init__(self) -> None:
        self.c = Counters()

    def dispatch(self, n: int = 1) -> list[Tracked]:
        self.c.d += n
        return [Tracked() for _ in range(n)]

    def launch(self, t: Tracked) -> None:
        if t.state is not ExecState.QUEUED:
            raise CounterError(f"launch of an execution in state {t.state.value}")
        t.state = ExecState.RUNNING
        self.c.p += 1
        self.c.check()

    def terminate(self, t: Tracked) -> None:
        """Launched executions only: a queued one is launched first (cancel = launch + end)."""
        if t.state is not ExecState.RUNNING:
            raise CounterError(f"terminate of an execution in state {t.state.value}")
        t.state = ExecState.CLOSED
        self.c.f += 1
        self.c.check()
