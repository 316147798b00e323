"""training.py: one optimizer step's batch, trained by a membership that can grow.

Groups are packed into micro-steps as they become ready (streaming); every participating
cell claims micro-steps while it has capacity, so faster cells take more. A satellite may
join while the joining window is open (the batch still has groups to pack or micro-steps
to claim): it first pulls the core's weights, which stay fixed during accumulation, so
its gradients are taken at the same point as everyone else's. Then gradients are reduced
over the prefix group of the participants and the core alone applies the update; the
satellites receive the core's parameters before the next step. Not the policy: who joins
is decided by policies.py; this module only carries it out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre.coordinator.buffer import Group, TrajectoryBuffer
from gyre.coordinator.packing import MicroStep, Stats, pack_group
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")


@dataclass
class BatchResult:
    groups: list[Group]
    executions: int
    results: list[wire.TrainResult]
    participants: list[int]
    version: int | None  # the trainers' version after the update; None: no update was applied
    grad_norm: float | None
    claimed: dict[int, int] = field(default_factory=dict)  # cell -> micro-steps it trained
    tokens: Stats = field(default_factory=Stats)
    first_claim: float | None = None  # time.monotonic() of the step's first micro-step claim


class Batch:
    """One step's batch. `trains(cell)`: the cell holds the training role now (not paused,
    not switching); `changed` is set whenever an execution closes; claimed micro-steps'
    seconds add up in `train_busy_s` (the coordinator's per-cell tally)."""

    def __init__(self, participants: list[int], *, link, nodes: list[str], buffer: TrajectoryBuffer,
                 config, changed: asyncio.Event, trains: Callable[[int], bool], step: int,
                 train_busy_s: dict[int, float]):
        self.link, self.nodes, self.buffer, self.config, self.changed = link, nodes, buffer, config, changed
        self.trains, self.step, self.train_busy_s = trains, step, train_busy_s
        self.participants: list[int] = list(participants)
        self.pending: deque[MicroStep] = deque()
        self.packing_done = False
        self.cond = asyncio.Condition()
        self.workers: dict[int, asyncio.Task] = {}
        self.results: list[wire.TrainResult] = []
        self.claimed: dict[int, int] = {}
        self.first_claim: float | None = None  # when the first micro-step was claimed (training began)
        self.groups: list[Group] = []
        self.executions = 0
        self.busy: set[int] = set()  # cells with a micro-step in flight (the scheduler holds their role)
        self.tokens = Stats()  # forward, unique admitted, path-expanded and target tokens of the step
        self.taken: list[Group] = []  # taken from the buffer, packed or being packed
        self.applying = False  # the optimizer update was sent: the step happens on the workers whatever we do

    @property
    def window_open(self) -> bool:
        return not (self.packing_done and not self.pending)

    @property
    def unclaimed(self) -> int:
        return len(self.pending) + (0 if self.packing_done else 1)

    def join(self, cell: int) -> bool:
        """A training cell joins if the window is still open and it is next in prefix order
        (a cell before it that died while pulling weights leaves it out)."""
        if not self.window_open or cell in self.workers or cell != len(self.participants):
            return False
        self.participants.append(cell)
        self.workers[cell] = asyncio.create_task(self._worker(cell), name=f"gyre-claim-{cell}")
        return True

    async def run(self) -> BatchResult:
        c, nodes, link = self.config, self.nodes, self.link
        for cell in self.participants:
            self.workers[cell] = asyncio.create_task(self._worker(cell), name=f"gyre-claim-{cell}")
        exec_index = 0
        while len(self.groups) < c.groups_per_step:  # streaming: pack groups as they become ready
            group = self.buffer.take()
            if group is None:
                self.changed.clear()
                await self.changed.wait()
                continue
            self.taken.append(group)
            # Admission, materialisation and encoding on a worker thread: the event loop keeps
            # serving harness calls while a group is packed (the group's trees are closed).
            # At least a micro-step per training cell over the step's groups: a cell holding the
            # training role with none to claim would idle by construction.
            share = -(-len(self.participants) // c.groups_per_step)
            steps, exec_index, counted = await asyncio.to_thread(
                pack_group, group, j_max=c.j_max, seed=c.seed + group.id, next_exec=exec_index,
                budget_tokens=c.micro_step_tokens, form=c.packing, min_steps=share)
            self.executions += counted
            self.groups.append(group)
            for ms in steps:
                self.tokens.add(ms.stats)
            async with self.cond:
                self.pending.extend(steps)
                self.cond.notify_all()
        async with self.cond:
            self.packing_done = True
            self.cond.notify_all()
        while True:  # joins may add workers until the window closed
            running = [t for t in self.workers.values() if not t.done()]
            if not running:
                break
            await asyncio.gather(*running)
        for t in self.workers.values():
            t.result()  # a failed micro-step fails the step
        if not self.results:  # no group added a token (all scored alike, or no model call):
            # no update, which would only move the weights by weight decay and the optimizer's
            # momentum; the trainers keep their version, and the publication sends nothing.
            return BatchResult(self.groups, self.executions, [], list(self.participants), None, None,
                               {}, self.tokens, self.first_claim)
        async with self.cond:  # paused participants (schedule.py's pause/resume) resume first
            await self.cond.wait_for(lambda: all(self.trains(i) for i in self.participants))
        # Reduce over the participants' prefix group; only the core applies the update.
        self.applying = True
        k = len(self.participants)
        await asyncio.gather(*(link.request(nodes[i], wire.SetParticipants(participants=k))
                               for i in self.participants))
        replies = await asyncio.gather(*(link.request(nodes[i], wire.OptimizerStep(
            num_executions=max(1, self.executions), apply=i == 0))
            for i in self.participants))
        core = replies[0]
        for cell, r in zip(self.participants, replies):
            self.train_busy_s[cell] = self.train_busy_s.get(cell, 0.0) + r.seconds
        return BatchResult(self.groups, self.executions, self.results, list(self.participants), core.version,
                           core.grad_norm, dict(self.claimed), self.tokens, self.first_claim)

    async def _worker(self, cell: int) -> None:
        node, link = self.nodes[cell], self.link
        while True:
            async with self.cond:  # a paused cell (rollout for now) claims nothing
                await self.cond.wait_for(lambda: not self.pending and self.packing_done or (
                    self.pending and self.trains(cell)))
                if not self.pending:
                    return
                ms = self.pending.popleft()
                self.busy.add(cell)
                if self.first_claim is None:
                    self.first_claim = time.monotonic()
            try:
                res = await link.request(node, wire.TrainMicroStep(step=self.step),
                                         ms.frames())
            finally:
                self.busy.discard(cell)
            self.results.append(res)
            self.claimed[cell] = self.claimed.get(cell, 0) + 1
            self.train_busy_s[cell] = self.train_busy_s.get(cell, 0.0) + res.seconds
