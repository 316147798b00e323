"""routing.py: the proxy's Backend over the coordinator's ZeroMQ link to workerds.

Each request goes to the rollout node with the fewest requests in flight. If that node
dies or hands the request back (abort during a role change or shutdown), the request
continues on another rollout node from the prompt plus the tokens already produced, so
the harness sees one slower response, not an error. Not a placement policy: which cells
roll out is decided elsewhere; this module only routes among them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gyre.coordinator.link import WorkerDeadError, WorkerError, WorkerLink
from gyre.proxy.backend import BackendUnavailable, Chunk, EngineRefused, GenParams
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")


@dataclass
class Route:
    node: str
    inflight: int = 0
    accepting: bool = True
    busy_s: float = 0.0  # time with at least one request in flight
    busy_since: float | None = None
    tokens: int = 0  # rollout tokens produced

    def started(self, now: float) -> None:
        if self.inflight == 0:
            self.busy_since = now
        self.inflight += 1

    def finished(self, now: float) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None


@dataclass
class RoutingTable:
    routes: dict[str, Route] = field(default_factory=dict)

    def set_nodes(self, nodes: list[str]) -> None:
        for n in nodes:
            self.routes.setdefault(n, Route(n))
        for n in list(self.routes):
            if n not in nodes:
                self.routes[n].accepting = False

    def pick(self, exclude: set[str] = frozenset()) -> Route | None:
        candidates = [r for r in self.routes.values() if r.accepting and r.node not in exclude]
        return min(candidates, key=lambda r: r.inflight, default=None)


class LinkBackend:
    def __init__(self, link: WorkerLink, table: RoutingTable, *, wait_s: float = 30.0):
        self.link = link
        self.table = table
        self.wait_s = wait_s  # how long a request may wait for any rollout node
        self._where: dict[str, str] = {}  # rid -> node serving it
        self._aborted: dict[str, bool] = {}  # rids we aborted ourselves (not handed back)
        self.reroutes = 0
        self.kv_handovers = 0  # reroutes that carried the prefix KV instead of recomputing it

    async def generate(self, rid: str, prompt_ids: list[int], params: GenParams) -> AsyncIterator[Chunk]:
        produced: list[int] = []
        tried: set[str] = set()
        handover: dict = {}  # the KV a handed-back request brought along (CPU engine)
        while True:
            route = await self._route(tried)
            loop = asyncio.get_running_loop()
            route.started(loop.time())
            self._where[rid] = route.node
            frames = handover.pop("frames", None)
            msg = wire.Generate(req_id=self.link.new_req_id(), rid=rid, prompt_ids=prompt_ids + produced,
                                max_new_tokens=params.max_new_tokens - len(produced), temperature=params.temperature,
                                top_p=params.top_p, stop_token_ids=list(params.stop_token_ids), seed=params.seed,
                                kv_tokens=handover.pop("tokens", 0) if frames else 0)
            if frames:
                self.kv_handovers += 1
            handed_back = False

            def keep_kv(chunk, tensors) -> None:
                if chunk.kv_tokens:
                    handover.update(frames=tensors, tokens=chunk.kv_tokens)

            try:
                async for c in self.link.generate(route.node, msg, frames, on_frames=keep_kv):
                    if c.finished and c.finish_reason == "abort" and not self._aborted.pop(rid, False):
                        handed_back = True  # the node gave it back (role change, shutdown)
                        if c.token_ids:
                            produced += c.token_ids
                            yield _chunk(c, route.node, finished=False)
                        break
                    produced += c.token_ids
                    route.tokens += len(c.token_ids)
                    yield _chunk(c, route.node)
                    if c.finished:
                        return
            except WorkerDeadError as e:
                log.warning("request %s lost its node: %s; rerouting", rid, e)
                handed_back = True
            except WorkerError as e:
                if e.kind not in ("RoleError", "EngineReleased"):
                    if e.kind == "ValueError":  # the engine refused the request itself
                        raise EngineRefused(str(e).removeprefix("ValueError: ")) from None
                    raise
                log.info("request %s refused by %s while it left rollout: %s; rerouting", rid, route.node, e)
                handed_back = True  # the node stopped accepting between routing and arrival
            finally:
                route.finished(loop.time())
                self._where.pop(rid, None)
            if not handed_back or len(produced) >= params.max_new_tokens:
                return
            tried.add(route.node)
            self.reroutes += 1

    async def _route(self, tried: set[str]) -> Route:
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while True:
            route = self.table.pick(exclude=tried) or self.table.pick()
            if route is not None:
                return route
            if asyncio.get_running_loop().time() > deadline:
                raise BackendUnavailable(f"no rollout node accepted the request within {self.wait_s:.0f}s")
            await asyncio.sleep(0.05)  # waiting for a cell to come back to rollout

    async def abort(self, rid: str) -> None:
        node = self._where.get(rid)
        if node is None:
            return
        self._aborted[rid] = True  # our own abort: the stream really ends here
        try:
            await self.link.call(node, wire.Abort(req_id=self.link.new_req_id(), rid=rid), timeout=10)
        except Exception as e:  # noqa: BLE001 - the node may be gone already
            log.debug("abort of %s on %s: %s", rid, node, e)


def _chunk(c: wire.GenerateChunk, node: str, finished: bool | None = None) -> Chunk:
    return Chunk(token_ids=c.token_ids, logprobs=c.logprobs, version=c.version,
                 finished=c.finished if finished is None else finished, finish_reason=c.finish_reason, engine=node)
