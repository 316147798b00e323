"""publisher.py: the core's weights on their way to the other cells.

`WeightPublisher` owns everything a weight transfer keeps between calls: the core's
export (ZeroMQ frames) and Mooncake offer, cached per trainer version so a joining cell
never waits for the busy core; the weight-broadcast group while it is whole; the path
the last push took; and the trainer version each cell was last given, so a cell is sent
weights only when it is behind. Publications, joins, step ends, rejoins and resume all
push through it. Not the schedule (when to push) and not the workers' side of it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from gyre.coordinator.link import WorkerDeadError
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")
MEMCPY_SAMPLE = 16 << 20


class WeightPublisher:
    def __init__(self, config, link, nodes: list[str], cluster, dead: set[int]):
        self.c, self.link, self.cluster = config, link, cluster
        self.nodes = nodes  # the coordinator's list (a rejoin replaces a cell's node in place)
        self.dead = dead  # the coordinator's set of dead cells
        self.export: tuple[int, int, list[wire.TensorFrame]] | None = None  # (version, bytes, frames)
        self.offer: wire.WeightOffer | None = None  # Mooncake: the core's offer for one version
        self.specs: wire.TensorSpecs | None = None  # broadcast: the group's weight specs, while whole
        self.last_transfer: str | None = None  # the path of the last push: zmq | mooncake | broadcast
        self.trainer_at = dict.fromkeys(range(len(nodes)), 0)  # per cell: its trainer's version, as sent

    def forget(self, version: int) -> None:
        """Caches dropped (the core loaded a checkpoint); every cell now holds `version`."""
        self.export = self.offer = None
        self.trainer_at = dict.fromkeys(range(len(self.nodes)), version)

    def lost_member(self, cell: int) -> None:
        if self.specs is not None:  # the weight-broadcast group lost a member for good
            log.warning("weight broadcast disabled: cell %d left its group; publications go by ZeroMQ", cell)
            self.specs = None

    async def prepare(self, version: int) -> None:
        """Export (or offer) `version` now, while the core is idle."""
        await (self.core_offer(version) if self.c.weight_transfer == "mooncake" else self.core_weights(version))

    async def core_offer(self, version: int) -> wire.WeightOffer:
        """Mooncake: the core's offer for `version` (the core packs and registers its
        parameters once per version)."""
        if self.offer is None or self.offer.version != version:
            self.offer = await self.link.request(self.nodes[0], wire.OfferWeights(version=version))
        return self.offer

    async def core_weights(self, version: int) -> tuple[int, list[wire.TensorFrame]]:
        """The core's parameters at `version`, exported once per version."""
        if self.export is None or self.export[0] != version:
            w, frames = await self.link.call(self.nodes[0], wire.ExportWeights())
            self.export = (version, w.nbytes, frames)
        return self.export[1], self.export[2]

    async def init_broadcast(self) -> None:
        """broadcast: every cell joins one torch.distributed group, the core as rank 0 (its
        TCP store on the core's host), and the core's weight specs are read once."""
        c, nodes, link = self.c, self.nodes, self.link
        host = self.cluster.transfer_host(nodes[0], c.transfer_host)
        port = _free_port() if self.cluster.spawn and not c.transfer_host else c.transfer_port
        await asyncio.gather(*(link.request(n, wire.InitBroadcast(master_address=host,
                                                                  master_port=port, rank=i, world_size=len(nodes)))
                               for i, n in enumerate(nodes)))
        self.specs = await link.request(nodes[0], wire.WeightSpecs())

    async def level(self, cells: list[int], version: int) -> int:
        """`version` (the core's) to the trainers of those `cells` that are behind it."""
        return await self.push([c for c in cells if c != 0 and self.trainer_at.get(c) != version],
                               engine=False, version=version)

    async def unchanged(self, cells: list[int], version: int) -> int:
        """A publication of weights no update changed: each cell's engine is told `version`
        is unchanged (an engine that still holds it does nothing; one that dropped its
        weights on release copies its own trainer). A cell whose trainer is behind gets the
        core's weights (push). Returns the bytes sent: 0 unless some trainer was behind."""
        level = [c for c in cells if c == 0 or self.trainer_at.get(c) == version]
        behind = [c for c in cells if c not in level]
        _tolerate_dead(await asyncio.gather(*(self.link.request(
            self.nodes[c], wire.LoadWeights(version=version, unchanged=True)) for c in level), return_exceptions=True))
        return await self.push(behind, engine=True, version=version) if behind else 0

    async def push(self, cells: list[int], *, engine: bool, version: int) -> int:
        """The core's parameters at `version` to `cells` (their trainers; their engines if
        asked). Returns bytes sent per cell. Goes through the configured path; a broadcast
        that cannot reach exactly these cells (a subset, a group that lost a member) goes
        through ZeroMQ frames instead. `last_transfer` says which path was taken."""
        if not cells:
            return 0
        nbytes = await self._push(cells, engine=engine, version=version)
        self.trainer_at.update({c: version for c in cells})
        return nbytes

    def _covers(self, cells: list[int]) -> bool:
        """A broadcast reaches every member at once: usable while the group is whole and
        `cells` are all the cells but the core."""
        return self.specs is not None and sorted(cells) == list(range(1, len(self.nodes)))

    async def _push(self, cells: list[int], *, engine: bool, version: int) -> int:
        link, nodes = self.link, self.nodes
        if self.c.weight_transfer == "broadcast" and self._covers(cells):
            specs = self.specs
            # The core exports first: receivers enter the collective only once the sender is ready.
            await link.request(nodes[0], wire.PrepareBroadcast(version=version))
            if not self._covers(cells):  # a member died meanwhile (cells.py gave the group up)
                return await self._push(self._alive(cells), engine=engine, version=version)
            results = await asyncio.gather(
                link.request(nodes[0], wire.BroadcastWeights(version=version)),
                *(link.request(nodes[i], wire.ReceiveWeights(
                    version=version, names=specs.names, dtypes=specs.dtypes,
                    shapes=specs.shapes, engine=engine, trainer=True)) for i in cells), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if not failed:
                self.last_transfer = "broadcast"
                return results[0].nbytes
            # A failed collective leaves the group unusable: ZeroMQ from now on.
            log.warning("weight broadcast of version %d failed (%s): ZeroMQ from now on", version, failed[0])
            self.specs = None
            if not any(isinstance(r, WorkerDeadError) for r in failed):
                raise failed[0]
            return await self._push(self._alive(cells), engine=engine, version=version)
        if self.c.weight_transfer == "mooncake":  # each cell pulls from the core's registered buffer
            offer = await self.core_offer(version)
            _tolerate_dead(await asyncio.gather(
                *(link.request(nodes[i], wire.PullWeights(handle=offer.handle,
                                                          engine=engine, trainer=True)) for i in cells),
                return_exceptions=True))
            self.last_transfer = "mooncake"
            return offer.nbytes
        self.last_transfer = "zmq"
        nbytes, frames = await self.core_weights(version)
        _tolerate_dead(await asyncio.gather(
            *(link.request(nodes[i], wire.LoadWeights(version=version, trainer=True,
                                                      engine=engine), frames) for i in cells),
            return_exceptions=True))
        return nbytes

    def _alive(self, cells: list[int]) -> list[int]:
        return [i for i in cells if i not in self.dead]


def memcpy_seconds(nbytes: int) -> float:
    """A local copy of as many bytes, the baseline every weight transfer is reported against:
    timed on at most 16 MiB and scaled (the coordinator never holds a big model's weights)."""
    sample = max(1, min(nbytes, MEMCPY_SAMPLE))
    src = np.ones(sample, dtype=np.uint8)
    t0 = time.perf_counter()
    src.copy()
    return (time.perf_counter() - t0) * nbytes / sample


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # the store binds every interface: so does this probe
        s.bind(("", 0))
        return s.getsockname()[1]


def _tolerate_dead(results: list) -> None:
    """A destination that died mid-transfer is the health watch's business (it excludes the
    cell); any other failure fails the caller."""
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, WorkerDeadError):
            raise r
