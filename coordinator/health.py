"""health.py: the coordinator's watch over its workers: dead cells out, returning ones in.

A worker silent for `worker_timeout_s` is declared dead: its pending requests fail over
(the routing backend reroutes them), its cell stops taking requests and leaves placement
and training. The core dying, or a cell dying inside a training batch, stops the run
(resume recovers). A worker that registers for a dead cell is brought in as a side task:
current weights, then rollout (it is outside the reducer's world). Functions of the
Coordinator (main.py), like training.py's; not the link's liveness itself (link.py).
"""

from __future__ import annotations

import asyncio
import logging

from gyre.coordinator.link import WorkerDeadError
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")


def watch(coord) -> None:
    """Silent workers are declared dead (their requests fail over and are rerouted);
    a dead cell stops taking requests and leaves placement and training."""
    for node in coord.link.silent_nodes(coord.c.worker_timeout_s):
        coord.link.mark_dead(node, f"no heartbeat for {coord.c.worker_timeout_s:g}s")
    for cell, node in enumerate(coord.nodes):
        link = coord.link.nodes.get(node)
        if cell in coord.dead or link is None or link.alive:
            continue
        coord.dead.add(cell)
        coord.weights.lost_member(cell)
        coord.table.close(node)  # its executions re-homed; its requests fail over
        coord.record_role(cell, coord.roles[cell], "dead")
        log.error("cell %d (%s) is dead: excluded from rollout and training until a worker re-registers",
                  cell, node)
        coord.metrics.emit("worker_dead", cell=cell, node=node, role=coord.roles[cell])
        if cell == 0:
            raise WorkerDeadError(f"the core (cell 0, {node}) died: its trainer holds the optimizer state; "
                                  "the run stops (resume from the last checkpoint)")
        if coord.batch is not None and cell in coord.batch.participants and not coord._idle(coord.step_task):
            raise WorkerDeadError(f"cell {cell} ({node}) died while training a batch: the step cannot complete")


def on_rejoin(coord, cell: int, node: str) -> None:
    """A worker re-registered for a dead cell and is ready; tick() brings it in as a side
    task (never beside a step or a publication, whose weight transfers it would race)."""
    if cell in coord.dead:
        coord._rejoins[cell] = node


def start_rejoin(coord) -> None:
    if coord._rejoins and coord._idle(coord.side_task) and coord._idle(coord.step_task):
        cell, node = coord._rejoins.popitem()
        coord.side_task = asyncio.create_task(rejoin(coord, cell, node), name=f"gyre-rejoin-{cell}")


async def rejoin(coord, cell: int, node: str) -> None:
    """Current weights (the core's trainer, labelled with its version), then rollout: the
    cell is outside the reducer's world, so it does not train in this run."""
    coord.nodes[cell] = node
    coord.table.set_nodes(coord.nodes)
    coord.table.close(node)  # no calls before its weights and role are in place
    try:
        await coord.weights.push([cell], engine=True, version=coord.trainer_version)
        await coord.link.request(node, wire.SetRole(role="rollout"))
    except WorkerDeadError as e:
        log.warning("rejoin of cell %d failed: %s (it stays excluded)", cell, e)
        return
    coord.dead.discard(cell)
    coord.no_reducer.add(cell)
    coord.roles[cell] = "rollout"
    coord.table.open(node)
    coord.record_role(cell, "dead", "rollout")
    coord.metrics.emit("worker_rejoined", cell=cell, node=node, version=coord.trainer_version)
    log.warning("cell %d rejoined as %s (rollout only)", cell, node)
