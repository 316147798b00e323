"""routing.py: the proxy's Backend over the coordinator's ZeroMQ link to workerds.

Routing is execution-affine (the default, `routing = "affine"`): an execution's first call
places it on the accepting engine with the fewest executions homed there, and its later
calls go back to that home, whose prefix cache holds the KV of the history the agent
resends. A load bound keeps homes even: an engine with more than
max(min + `balance_abs`, min x `balance_rel`) executions (min: the least-loaded accepting
engine's) sheds its newest ones at their next call, to the least-loaded engine. When an
engine stops accepting (its cell leaves rollout, or dies), its executions are re-homed at
once in the paper's destination order (standalone engines first, then rollout cells from
the last one down), each filling the first destination under the bound, and they stay at
the new home. `routing = "least-inflight"` is the old baseline: every call to the engine
with the fewest requests in flight.

If the serving node dies or hands a request back (abort during a role change or shutdown),
the request continues on another node (its execution's new home) from the prompt plus the
tokens already produced, with the KV it brought where the engine can hand KV over, so the
harness sees one slower response, not an error. Not a placement policy: which cells roll
out is decided elsewhere; this module only routes among them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from gyre.coordinator.link import WorkerDeadError, WorkerError, WorkerLink
from gyre.proxy.backend import BackendUnavailable, Chunk, EngineRefused, GenParams
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")

ROUTINGS = ("affine", "least-inflight")


@dataclass
class Route:
    node: str
    order: int = 0  # the cell's index: re-homing fills higher ones first
    standalone: bool = False  # a never-training engine: the first destination when a cell leaves
    inflight: int = 0
    accepting: bool = True
    busy_s: float = 0.0  # time with at least one request in flight
    busy_since: float | None = None
    tokens: int = 0  # rollout tokens produced
    homes: dict[str, None] = field(default_factory=dict)  # executions homed here, oldest first
    calls: int = 0
    prompt_tokens: int = 0  # of the calls whose engine said how many it reused
    cached_tokens: int = 0
    # For the live view, which would otherwise read "0 tokens/s" through a long prefill:
    # calls in flight that have no token yet (queued in the engine or in prefill), and the
    # prompt tokens the engine computed rather than reused, counted at each attempt's first
    # token (when its prefill is done) where the engine said how many it reused.
    awaiting: int = 0
    prefilled: int = 0
    prefill_reports: int = 0  # first tokens whose prefill count is in `prefilled`

    def started(self, now: float) -> None:
        if self.inflight == 0:
            self.busy_since = now
        self.inflight += 1
        self.awaiting += 1

    def first_token(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """An attempt's first token arrived: its prefill is over."""
        self.awaiting -= 1
        if cached_tokens is not None:
            self.prefilled += max(0, prompt_tokens - cached_tokens)
            self.prefill_reports += 1

    def finished(self, now: float, awaiting: bool = False) -> None:
        """An attempt ended; `awaiting`: before its first token (aborted, refused, handed back)."""
        self.inflight -= 1
        if awaiting:
            self.awaiting -= 1
        if self.inflight == 0 and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    @property
    def hit_rate(self) -> float | None:
        """Prompt tokens served from KV already there (prefix cache, handed-over KV); None
        until a call with a known count."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass
class RoutingTable:
    routes: dict[str, Route] = field(default_factory=dict)
    policy: str = "affine"
    balance_abs: int = 2
    balance_rel: float = 1.5
    homes: dict[str, str] = field(default_factory=dict)  # execution -> node
    decisions: Counter = field(default_factory=Counter)  # home | placed | shed | rehomed | moved | least_inflight

    def __post_init__(self) -> None:
        if self.policy not in ROUTINGS:
            raise ValueError(f"unknown routing {self.policy!r} (known: {', '.join(ROUTINGS)})")
        if self.balance_abs < 1 or self.balance_rel < 1:
            raise ValueError(f"balance_abs must be >= 1 and balance_rel >= 1, got {self.balance_abs}, "
                             f"{self.balance_rel}")

    # --- the engines -------------------------------------------------------------------

    def set_nodes(self, nodes: list[str], standalone: frozenset[str] = frozenset()) -> None:
        """Routes for `nodes` (their order: cell index); a node no longer listed is closed."""
        for i, n in enumerate(nodes):
            route = self.routes.setdefault(n, Route(n))
            route.order, route.standalone = i, n in standalone
        for n in list(self.routes):
            if n not in nodes:
                self.close(n)

    def open(self, node: str) -> None:
        """The node takes requests again; executions re-homed elsewhere stay there."""
        self.routes[node].accepting = True

    def close(self, node: str) -> list[str]:
        """The node takes no new requests (leaving rollout, dead): its executions are
        re-homed now, in destination order; returns them."""
        route = self.routes[node]
        route.accepting = False
        moved = list(route.homes)
        route.homes.clear()
        for ex in moved:
            del self.homes[ex]
            dest = self._destination()
            if dest is not None:
                self._home(ex, dest)
                self.decisions["rehomed"] += 1
        if moved:
            log.info("%d executions re-homed from %s", len(moved), node)
        return moved

    def forget(self, execution: str) -> None:
        """The execution ended: it no longer counts toward its home's load."""
        node = self.homes.pop(execution, None)
        if node is not None:
            self.routes[node].homes.pop(execution, None)

    # --- a call's engine ---------------------------------------------------------------

    def bound(self) -> int | None:
        """Executions an accepting engine may have before it sheds; None: none accepts."""
        loads = [len(r.homes) for r in self.routes.values() if r.accepting]
        if not loads:
            return None
        low = min(loads)
        return max(low + self.balance_abs, int(low * self.balance_rel))

    def pick(self, execution: str | None = None, exclude: set[str] = frozenset()) -> Route | None:
        """The engine for one call of `execution` (None: no affinity), never a node in
        `exclude` (it handed this request back) nor one not accepting."""
        candidates = [r for r in self.routes.values() if r.accepting and r.node not in exclude]
        if not candidates:
            return None
        if self.policy == "least-inflight" or execution is None:
            self.decisions["least_inflight"] += 1
            return min(candidates, key=lambda r: (r.inflight, r.order))
        node = self.homes.get(execution)
        if node is None:
            dest = self._least_loaded(candidates)
            self._home(execution, dest)
            self.decisions["placed"] += 1
            return dest
        home = self.routes[node]
        if home.accepting and home.node not in exclude:
            bound = self.bound()
            if len(home.homes) <= bound or _rank(home.homes, execution) < bound:
                self.decisions["home"] += 1
                return home
            reason = "shed"  # the home is over the bound and this is one of its newest
        else:
            reason = "moved"  # the home handed this request back (it leaves rollout, or failed)
        dest = self._least_loaded(candidates)
        self.forget(execution)
        self._home(execution, dest)
        self.decisions[reason] += 1
        return dest

    def served(self, node: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """One attempt of a call ended on `node`; counts toward its hit rate when known."""
        route = self.routes[node]
        route.calls += 1
        if cached_tokens is not None:
            route.prompt_tokens += prompt_tokens
            route.cached_tokens += cached_tokens

    def _home(self, execution: str, route: Route) -> None:
        self.homes[execution] = route.node
        route.homes[execution] = None

    def _least_loaded(self, candidates: list[Route]) -> Route:
        return min(candidates, key=lambda r: (len(r.homes), r.inflight, r.order))

    def _destination(self) -> Route | None:
        """Where a re-homed execution goes: the first accepting engine in destination order
        (standalone, then cells from the last down) under the bound, else the least loaded."""
        accepting = [r for r in self.routes.values() if r.accepting]
        if not accepting:
            return None
        bound = self.bound()
        for r in sorted(accepting, key=lambda r: (not r.standalone, -r.order)):
            if len(r.homes) < bound:
                return r
        return self._least_loaded(accepting)

    def status(self) -> dict:
        """Plain data for /gyre/status: decisions, the bound, and each execution's home."""
        return {"policy": self.policy, "balance_abs": self.balance_abs, "balance_rel": self.balance_rel,
                "bound": self.bound(), "decisions": dict(self.decisions), "homes": dict(self.homes)}


def _rank(homes: dict[str, None], execution: str) -> int:
    """The execution's place among its home's executions, oldest first."""
    for i, ex in enumerate(homes):
        if ex == execution:
            return i
    raise KeyError(execution)


def prompt_frame(prompt_ids, produced: list[int]) -> wire.TensorFrame:
    """The prompt (and what a handed-back request already produced) as one raw frame: the
    ids' bytes, never a list of Python ints (a 100k-token prompt is milliseconds of the loop
    as a list, microseconds as an array)."""
    ids = np.asarray(prompt_ids)
    if ids.dtype not in (np.uint16, np.int32):
        ids = ids.astype(np.int32)
    if produced:
        ids = np.concatenate([ids, np.asarray(produced, dtype=ids.dtype)])
    return wire.TensorFrame(wire.PROMPT_FRAME, ids.dtype.name, ids.shape, ids)


class LinkBackend:
    def __init__(self, link: WorkerLink, table: RoutingTable, *, wait_s: float = 30.0):
        self.link = link
        self.table = table
        self.wait_s = wait_s  # how long a request may wait for any rollout node
        self._where: dict[str, str] = {}  # rid -> node serving it
        self._aborted: dict[str, bool] = {}  # rids we aborted ourselves (not handed back)
        self.reroutes = 0
        self.kv_handovers = 0  # reroutes that carried the prefix KV instead of recomputing it

    def forget(self, execution: str) -> None:
        self.table.forget(execution)

    async def generate(self, rid: str, prompt_ids: list[int], params: GenParams,
                       execution: str | None = None) -> AsyncIterator[Chunk]:
        produced: list[int] = []
        tried: set[str] = set()
        handover: dict = {}  # the KV a handed-back request brought along (CPU engine)
        usage = _Usage()
        while True:
            route = await self._route(execution, tried)
            loop = asyncio.get_running_loop()
            route.started(loop.time())
            self._where[rid] = route.node
            frames = handover.pop("frames", None)
            prompt = prompt_frame(prompt_ids, produced)
            msg = wire.Generate(rid=rid, prompt_ids=[], prompt_in_frame=True,
                                max_new_tokens=params.max_new_tokens - len(produced), temperature=params.temperature,
                                top_p=params.top_p, stop_token_ids=list(params.stop_token_ids), seed=params.seed,
                                kv_tokens=handover.pop("tokens", 0) if frames else 0)
            if frames:
                self.kv_handovers += 1
            frames = [prompt, *(frames or ())]
            handed_back = False
            attempt = usage.attempt(prompt.shape[0])

            def keep_kv(chunk, tensors) -> None:
                if chunk.kv_tokens:
                    handover.update(frames=tensors, tokens=chunk.kv_tokens)

            try:
                async for c in self.link.generate(route.node, msg, frames, on_frames=keep_kv):
                    attempt.saw(c.cached_tokens)
                    if c.token_ids and not attempt.got_token:
                        attempt.got_token = True
                        route.first_token(attempt.prompt_tokens, attempt.cached)
                    if c.finished and c.finish_reason == "abort" and not self._aborted.pop(rid, False):
                        handed_back = True  # the node gave it back (role change, shutdown)
                        if c.token_ids:
                            produced += c.token_ids
                            route.tokens += len(c.token_ids)
                            yield _chunk(c, route.node, usage, finished=False)
                        break
                    produced += c.token_ids
                    route.tokens += len(c.token_ids)
                    yield _chunk(c, route.node, usage)
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
                route.finished(loop.time(), awaiting=not attempt.got_token)
                self.table.served(route.node, attempt.prompt_tokens, attempt.cached)
                self._where.pop(rid, None)
            if not handed_back or len(produced) >= params.max_new_tokens:
                return
            tried.add(route.node)
            self.reroutes += 1

    async def _route(self, execution: str | None, tried: set[str]) -> Route:
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while True:
            route = self.table.pick(execution, exclude=tried) or self.table.pick(execution)
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
            await self.link.call(node, wire.Abort(rid=rid), timeout=10)
        except Exception as e:  # noqa: BLE001 - the node may be gone already
            log.debug("abort of %s on %s: %s", rid, node, e)


@dataclass
class _Attempt:
    prompt_tokens: int
    cached: int | None = None  # as the engine reported it; None until (unless) it does
    got_token: bool = False  # its first token arrived (Route.awaiting counts it until then)

    def saw(self, cached_tokens: int | None) -> None:
        if cached_tokens is not None:
            self.cached = cached_tokens


@dataclass
class _Usage:
    """A call's prefill over its attempts (a rerouted call prefills again, from its KV if
    it brought any): tokens reused and computed; None once any attempt's count is unknown."""

    attempts: list[_Attempt] = field(default_factory=list)

    def attempt(self, prompt_tokens: int) -> _Attempt:
        self.attempts.append(_Attempt(prompt_tokens))
        return self.attempts[-1]

    @property
    def cached(self) -> int | None:
        if any(a.cached is None for a in self.attempts):
            return None
        return sum(a.cached for a in self.attempts)

    @property
    def prefill(self) -> int | None:
        cached = self.cached
        return None if cached is None else sum(a.prompt_tokens for a in self.attempts) - cached


def _chunk(c: wire.GenerateChunk, node: str, usage: _Usage, finished: bool | None = None) -> Chunk:
    return Chunk(token_ids=c.token_ids, logprobs=c.logprobs, version=c.version,
                 finished=c.finished if finished is None else finished, finish_reason=c.finish_reason, engine=node,
                 cached_tokens=usage.cached, prefill_tokens=usage.prefill)
