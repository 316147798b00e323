"""cells.py: `Cells`, the owner of the run's cells: each one's role, node, death and rejoin.

It holds each cell's role (while a switch runs: the role it is moving to) and node, the
cells whose worker died and those that rejoined (rollout only: outside the reducer's
world), every role change on a timeline, and the switch in flight per cell. It carries out
a switch (routes closed before, opened after), watches the workers (a silent one is
declared dead: its requests fail over, its cell leaves rollout, placement and training;
the core dying, or a cell dying inside a training batch, stops the run and a resume
recovers), and brings a replacement worker in for a dead cell: current weights, then
rollout. Not the scheduler (schedule.py decides each switch) and not the link's liveness
itself (link.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gyre.coordinator.link import WorkerDeadError
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")

SLOTS_EVERY_S = 10.0  # seconds between `slots` events


class Occupancy:
    """Executions homed per cell and running in all, time-weighted between two `slots` events
    (`every_s` apart): what each cell's slots held over time, from the tick's samples."""

    def __init__(self, every_s: float = SLOTS_EVERY_S):
        self.every_s = every_s
        self.since: float | None = None  # the current interval's start
        self.last = 0.0
        self.held: tuple[list[int], int] = ([], 0)  # the last sample: homed per cell, running
        self.sums: list[float] = []
        self.running_sum = 0.0

    def sample(self, t: float, homed: list[int], running: int) -> dict | None:
        """Take a sample at `t`; an interval's means once it is `every_s` long, else None."""
        if self.since is None or len(homed) != len(self.sums):
            self.since, self.last, self.held = t, t, (homed, running)
            self.sums, self.running_sum = [0.0] * len(homed), 0.0
            return None
        dt = t - self.last
        for i, h in enumerate(self.held[0]):
            self.sums[i] += h * dt
        self.running_sum += self.held[1] * dt
        self.last, self.held = t, (homed, running)
        span = t - self.since
        if span < self.every_s:
            return None
        out = {"seconds": round(span, 3), "homed": [round(x / span, 3) for x in self.sums],
               "running": round(self.running_sum / span, 3)}
        self.since, self.sums, self.running_sum = t, [0.0] * len(homed), 0.0
        return out


class Cells:
    def __init__(self, roles: list[str], now: Callable[[], float]):
        self.roles = roles
        self.now = now  # the run's clock (metrics.now): the timeline's times
        self.nodes: list[str] = []  # per cell: its node id (set at start-up; a rejoin replaces one in place)
        self.dead: set[int] = set()  # cells whose worker died; excluded until a worker re-registers
        self.no_reducer: set[int] = set()  # rejoined cells: they roll out, they cannot reduce gradients
        self.rejoins: dict[int, str] = {}  # dead cell -> the ready replacement node, not yet brought in
        self.history: list[list[tuple[float, str]]] = [[(0.0, r)] for r in roles]  # per cell: (t, role)
        self.switches: list[dict] = []  # every role change: t, cell, from, to
        self.switch_tasks: dict[int, asyncio.Task] = {}  # per cell: its role change (the last one)
        self.occupancy = Occupancy()  # what each cell's slots held over time (`slots` events)
        # Set at start-up (main.py): the workers, their routes, the weights and the journal.
        self.link: Any = None
        self.table: Any = None
        self.weights: Any = None
        self.metrics: Any = None

    def record(self, cell: int, old: str, new: str) -> None:
        """A role change (or death, or rejoin) for the live view's timeline and switch list."""
        t = self.now()
        self.history[cell].append((t, new))
        self.switches.append({"t": t, "cell": cell, "from": old, "to": new})

    def sample_slots(self, running: int) -> None:
        """The tick's sample of each cell's homed executions (its engine's) and of the
        executions running in all; every SLOTS_EVERY_S a `slots` event of their means."""
        routes = self.table.routes
        homed = [len(routes[n].homes) if n in routes else 0 for n in self.nodes]
        event = self.occupancy.sample(self.now(), homed, running)
        if event is not None:
            self.metrics.emit("slots", **event)

    def settled(self, cell: int) -> bool:
        """The cell holds its role: no switch of it is under way (a batch claims only then)."""
        task = self.switch_tasks.get(cell)
        return task is None or task.done()

    def switching(self) -> frozenset[int]:
        return frozenset(cell for cell in self.switch_tasks if not self.settled(cell))

    def start_switch(self, cell: int, new: str, batch: Callable[[], Any]) -> None:
        self.switch_tasks[cell] = asyncio.create_task(self._switch(cell, new, batch), name=f"gyre-switch-{cell}")

    async def _switch(self, cell: int, new: str, batch: Callable[[], Any]) -> None:
        """One cell's role change, every one its own task (cells switch in parallel); the role
        is its target from the start (the scheduler holds the cell until this ends), routes
        close before and open after. `batch`: the batch in flight now, if any."""
        old, node = self.roles[cell], self.nodes[cell]
        self.roles[cell] = new
        t0 = time.monotonic()
        if new == "training":
            self.table.close(node)  # no new requests, its executions re-homed; running ones are handed back
        try:
            reply = await self.link.request(node, wire.SetRole(role=new))
        except WorkerDeadError as e:  # the health watch excludes the cell
            log.warning("role change of cell %d to %s: %s", cell, new, e)
            return
        if new == "rollout":
            self.table.open(node)  # every node has a route since start-up
        in_flight = batch()
        if in_flight is not None:
            async with in_flight.cond:
                in_flight.cond.notify_all()  # a paused participant may claim again
        self.record(cell, old, new)
        self.metrics.emit("role", cell=cell, **{"from": old, "to": new}, seconds=round(time.monotonic() - t0, 4),
                          worker_seconds=round(reply.seconds, 4))

    # --- health -------------------------------------------------------------------------

    def watch(self, timeout_s: float, training: Callable[[int], bool]) -> None:
        """Silent workers are declared dead (their requests fail over and are rerouted);
        a dead cell stops taking requests and leaves placement and training. `training(cell)`:
        the cell is in a step's batch now (its death stops the run)."""
        for node in self.link.silent_nodes(timeout_s):
            self.link.mark_dead(node, f"no heartbeat for {timeout_s:g}s")
        for cell, node in enumerate(self.nodes):
            link = self.link.nodes.get(node)
            if cell in self.dead or link is None or link.alive:
                continue
            self.dead.add(cell)
            self.weights.lost_member(cell)
            self.table.close(node)  # its executions re-homed; its requests fail over
            self.record(cell, self.roles[cell], "dead")
            log.error("cell %d (%s) is dead: excluded from rollout and training until a worker re-registers",
                      cell, node)
            self.metrics.emit("worker_dead", cell=cell, node=node, role=self.roles[cell])
            if cell == 0:
                raise WorkerDeadError(f"the core (cell 0, {node}) died: its trainer holds the optimizer state; "
                                      "the run stops (resume from the last checkpoint)")
            if training(cell):
                raise WorkerDeadError(f"cell {cell} ({node}) died while training a batch: the step cannot complete")

    def on_rejoin(self, cell: int, node: str) -> None:
        """A worker re-registered for a dead cell and is ready; the tick brings it in as a side
        task (never beside a step or a publication, whose weight transfers it would race)."""
        if cell in self.dead:
            self.rejoins[cell] = node

    async def rejoin(self, cell: int, node: str, version: int) -> None:
        """Weights at `version` (the core's trainer's), then rollout: the cell is outside the
        reducer's world, so it does not train in this run."""
        self.nodes[cell] = node
        self.table.set_nodes(self.nodes)
        self.table.close(node)  # no calls before its weights and role are in place
        try:
            await self.weights.push([cell], engine=True, version=version)
            await self.link.request(node, wire.SetRole(role="rollout"))
        except WorkerDeadError as e:
            log.warning("rejoin of cell %d failed: %s (it stays excluded)", cell, e)
            return
        self.dead.discard(cell)
        self.no_reducer.add(cell)
        self.roles[cell] = "rollout"
        self.table.open(node)
        self.record(cell, "dead", "rollout")
        self.metrics.emit("worker_rejoined", cell=cell, node=node, version=version)
        log.warning("cell %d rejoined as %s (rollout only)", cell, node)
