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
from collections import deque
from dataclasses import dataclass, field

from gyre.coordinator.buffer import Group
from gyre.coordinator.link import WorkerDeadError
from gyre.coordinator.packing import MicroStep, group_rows, pack
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")


@dataclass
class BatchResult:
    groups: list[Group]
    executions: int
    results: list[wire.TrainResult]
    participants: list[int]
    version: int
    grad_norm: float
    claimed: dict[int, int] = field(default_factory=dict)  # cell -> micro-steps it trained


class Batch:
    def __init__(self, coord, participants: list[int]):
        self.c = coord  # the Coordinator: link, nodes, buffer, config, changed event
        self.participants: list[int] = list(participants)
        self.pending: deque[MicroStep] = deque()
        self.packing_done = False
        self.cond = asyncio.Condition()
        self.workers: dict[int, asyncio.Task] = {}
        self.results: list[wire.TrainResult] = []
        self.claimed: dict[int, int] = {}
        self.groups: list[Group] = []
        self.executions = 0

    @property
    def window_open(self) -> bool:
        return not (self.packing_done and not self.pending)

    @property
    def unclaimed(self) -> int:
        return len(self.pending) + (0 if self.packing_done else 1)

    async def join(self, cell: int) -> bool:
        """A satellite that switched to training joins if the window is still open."""
        if not self.window_open or cell in self.workers:
            return False
        if cell != len(self.participants):
            raise RuntimeError(f"cell {cell} would break the prefix {self.participants}")
        self.participants.append(cell)
        self.workers[cell] = asyncio.create_task(self._worker(cell), name=f"gyre-claim-{cell}")
        return True

    async def run(self) -> BatchResult:
        c = self.c
        nodes = c.nodes
        # Cached before the core gets busy: joins read it from here.
        await (core_offer(c) if c.c.weight_transfer == "mooncake" else core_weights(c))
        for cell in self.participants:
            self.workers[cell] = asyncio.create_task(self._worker(cell), name=f"gyre-claim-{cell}")
        exec_index = 0
        while len(self.groups) < c.c.groups_per_step:  # streaming: pack groups as they become ready
            group = c.buffer.take()
            if group is None:
                c.changed.clear()
                await c.changed.wait()
                continue
            rows, exec_index, counted = group_rows(group, j_max=c.c.j_max, seed=c.c.seed + group.id,
                                                   next_exec=exec_index)
            self.executions += counted
            self.groups.append(group)
            async with self.cond:
                self.pending.extend(pack(rows, c.c.micro_step_tokens))
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
        async with self.cond:  # paused participants (main.py _pause_or_resume) resume first
            await self.cond.wait_for(lambda: all(c.roles[i] == "training" for i in self.participants))
        # Reduce over the participants' prefix group; only the core applies the update.
        k, link = len(self.participants), c.link
        await asyncio.gather(*(link.request(nodes[i], wire.SetParticipants(req_id=link.new_req_id(), participants=k))
                               for i in self.participants))
        replies = await asyncio.gather(*(link.request(nodes[i], wire.OptimizerStep(
            req_id=link.new_req_id(), num_executions=max(1, self.executions), apply=i == 0))
            for i in self.participants))
        core = replies[0]
        for cell, r in zip(self.participants, replies):
            c.train_busy_s[cell] = c.train_busy_s.get(cell, 0.0) + r.seconds
        return BatchResult(self.groups, self.executions, self.results, list(self.participants), core.version,
                           core.grad_norm, dict(self.claimed))

    async def _worker(self, cell: int) -> None:
        c = self.c
        node = c.nodes[cell]
        while True:
            async with self.cond:  # a paused cell (rollout for now) claims nothing
                await self.cond.wait_for(lambda: not self.pending and self.packing_done or (
                    self.pending and c.roles[cell] == "training"))
                if not self.pending:
                    return
                ms = self.pending.popleft()
            res = await c.link.request(node, wire.TrainMicroStep(req_id=c.link.new_req_id(), step=c.steps_done),
                                       ms.frames())
            self.results.append(res)
            self.claimed[cell] = self.claimed.get(cell, 0) + 1
            c.train_busy_s[cell] = c.train_busy_s.get(cell, 0.0) + res.seconds


async def core_offer(coord) -> wire.WeightOffer:
    """Mooncake: the core's offer for the current trainer version (cached; the core packs
    and registers its parameters once per version, before it gets busy)."""
    cached = coord._core_offer
    if cached is not None and cached.version == coord.trainer_version:
        return cached
    link = coord.link
    coord._core_offer = await link.request(coord.nodes[0], wire.OfferWeights(req_id=link.new_req_id(),
                                                                             version=coord.trainer_version))
    return coord._core_offer


async def core_weights(coord) -> tuple[int, list[wire.TensorFrame]]:
    """The core's parameters at the current trainer version, exported once per version and
    cached, so a joining satellite never waits for the core (busy training) to answer."""
    cached = coord._core_cache
    if cached is not None and cached[0] == coord.trainer_version:
        return cached[1], cached[2]
    link = coord.link
    w, frames = await link.call(coord.nodes[0], wire.ExportWeights(req_id=link.new_req_id()))
    coord._core_cache = (coord.trainer_version, w.nbytes, frames)
    return w.nbytes, frames


MEMCPY_SAMPLE = 16 << 20


def memcpy_seconds(nbytes: int) -> float:
    """A local copy of as many bytes, the baseline every weight transfer is reported against:
    timed on at most 16 MiB and scaled (the coordinator never holds a big model's weights)."""
    import time

    import numpy as np

    sample = max(1, min(nbytes, MEMCPY_SAMPLE))
    src = np.ones(sample, dtype=np.uint8)
    t0 = time.perf_counter()
    src.copy()
    return (time.perf_counter() - t0) * nbytes / sample


async def init_broadcast(coord) -> None:
    """broadcast: every cell joins one torch.distributed group, the core as rank 0 (its TCP
    store on the core's host), and the core's weight specs are read once."""
    c, nodes, link = coord.c, coord.nodes, coord.link
    host = coord.cluster.transfer_host(nodes[0], c.transfer_host)
    port = _free_port() if coord.cluster.spawn and not c.transfer_host else c.transfer_port
    await asyncio.gather(*(link.request(n, wire.InitBroadcast(req_id=link.new_req_id(), master_address=host,
                                                              master_port=port, rank=i, world_size=len(nodes)))
                           for i, n in enumerate(nodes)))
    specs = await link.request(nodes[0], wire.WeightSpecs(req_id=link.new_req_id()))
    coord._broadcast = {"specs": specs}  # a wire.TensorSpecs


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # the store binds every interface: so does this probe
        s.bind(("", 0))
        return s.getsockname()[1]


def _broadcast_covers(coord, cells: list[int]) -> bool:
    """A broadcast reaches every member at once: usable while the group is whole (a member
    marked dead disables it for good, health.py) and `cells` are all the cells but the core."""
    return coord._broadcast is not None and sorted(cells) == list(range(1, len(coord.nodes)))


async def push_core_weights(coord, cells: list[int], *, engine: bool, version: int) -> int:
    """The core's current parameters to `cells` (their trainers; their engines if asked).
    Returns bytes sent per cell. Goes through the configured weight-transfer path; a
    broadcast that cannot reach exactly these cells (a subset, a group that lost a member)
    goes through ZeroMQ frames instead. `coord.last_transfer` says which path was taken."""
    if not cells:
        return 0
    link, nodes = coord.link, coord.nodes
    if coord.c.weight_transfer == "broadcast" and _broadcast_covers(coord, cells):
        specs: wire.TensorSpecs = coord._broadcast["specs"]
        # The core exports first: receivers enter the collective only once the sender is ready.
        await link.request(nodes[0], wire.PrepareBroadcast(req_id=link.new_req_id(), version=version))
        if not _broadcast_covers(coord, cells):  # a member died meanwhile (health.py gave the group up)
            return await push_core_weights(coord, [i for i in cells if i not in coord.dead], engine=engine,
                                           version=version)
        results = await asyncio.gather(
            link.request(nodes[0], wire.BroadcastWeights(req_id=link.new_req_id(), version=version)),
            *(link.request(nodes[i], wire.ReceiveWeights(
                req_id=link.new_req_id(), version=version, names=specs.names, dtypes=specs.dtypes,
                shapes=specs.shapes, engine=engine, trainer=True)) for i in cells), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if not failed:
            coord.last_transfer = "broadcast"
            return results[0].nbytes
        # A failed collective leaves the group unusable: ZeroMQ from now on.
        log.warning("weight broadcast of version %d failed (%s): ZeroMQ from now on", version, failed[0])
        coord._broadcast = None
        if not any(isinstance(r, WorkerDeadError) for r in failed):
            raise failed[0]
        return await push_core_weights(coord, [i for i in cells if i not in coord.dead], engine=engine,
                                       version=version)
    if coord.c.weight_transfer == "mooncake":  # each cell pulls from the core's registered buffer
        offer = await core_offer(coord)
        _tolerate_dead(await asyncio.gather(
            *(link.request(nodes[i], wire.PullWeights(req_id=link.new_req_id(), handle=offer.handle, engine=engine,
                                                      trainer=True)) for i in cells),
            return_exceptions=True))
        coord.last_transfer = "mooncake"
        return offer.nbytes
    coord.last_transfer = "zmq"
    nbytes, frames = await core_weights(coord)
    _tolerate_dead(await asyncio.gather(
        *(link.request(nodes[i], wire.LoadWeights(req_id=link.new_req_id(), version=version, trainer=True,
                                                  engine=engine), frames) for i in cells),
        return_exceptions=True))
    return nbytes


def _tolerate_dead(results: list) -> None:
    """A destination that died mid-transfer is the health watch's business (it excludes the
    cell); any other failure fails the caller."""
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, WorkerDeadError):
            raise r
