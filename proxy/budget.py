"""budget.py: each execution's share of the proxy: calls in flight and tokens per minute.

One execution must not starve the rest (32 concurrent calls from one left a neighbour 4
calls in 100 s): each has at most `max_in_flight` model calls in flight and spends at most
`tokens_per_minute` (a bucket that refills continuously, one minute's worth deep; a call is
let in while the bucket is above zero and charged what it prefilled and generated). The
calls in flight are shared fairly: while n executions have calls in flight or waiting, each
holds at most max(1, max_in_flight // n) (an execution calling alone has all of
`max_in_flight`; beside a neighbour, its extra calls wait, since on a shared engine every
call in the batch slows the others), and a slot freed goes to whichever execution is under
its share. A call over its execution's share waits, first come first served among that
execution's calls, at most `wait_s`; then it is refused with `OverBudget`, which the server
answers 429 in the provider's shape with `retry-after` (every harness retries 429s). Not the
engine's scheduler, not HTTP.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field


class OverBudget(Exception):
    """A call its execution's budget cannot take within the wait: `kind` is "requests"
    (calls in flight) or "tokens" (tokens per minute); `retry_after_s` when to try again."""

    def __init__(self, kind: str, message: str, retry_after_s: int):
        super().__init__(message)
        self.kind, self.message, self.retry_after_s = kind, message, retry_after_s


@dataclass(slots=True)
class _Share:
    in_flight: int = 0
    waiters: deque = field(default_factory=deque)  # futures of calls waiting for a slot, oldest first
    level: float = 0.0  # tokens left in the bucket (may go below zero: a call is charged after it runs)
    stamp: float = 0.0  # when `level` was last refilled


REQUESTS_RETRY_AFTER_S = 2  # a call refused for calls in flight: one of them is likely done by then


class Budgets:
    def __init__(self, max_in_flight: int = 0, tokens_per_minute: int = 0, wait_s: float = 30.0,
                 clock=time.monotonic):
        self.max_in_flight, self.tokens_per_minute, self.wait_s = max_in_flight, tokens_per_minute, wait_s
        self.clock = clock
        self._shares: dict[str, _Share] = {}
        self._calling: set[str] = set()  # executions with calls in flight or waiting: who shares
        self.refused = {"requests": 0, "tokens": 0}  # calls answered 429, by budget (statistics)

    def _share(self, execution: str) -> _Share:
        share = self._shares.get(execution)
        if share is None:
            share = self._shares[execution] = _Share(level=float(self.tokens_per_minute), stamp=self.clock())
        return share

    def share_now(self) -> int:
        """The calls in flight each execution may hold now: all of `max_in_flight` for one
        calling alone, an equal part (at least one) while several call (0: unlimited)."""
        n = len(self._calling)
        return self.max_in_flight if n <= 1 or not self.max_in_flight else max(1, self.max_in_flight // n)

    def forget(self, execution: str) -> None:
        """The execution ended: its share goes (its calls still in flight release nothing)."""
        self._shares.pop(execution, None)
        if execution in self._calling:
            self._calling.discard(execution)
            self._hand_out()

    def in_flight(self, execution: str) -> int:
        share = self._shares.get(execution)
        return share.in_flight if share else 0

    async def admit(self, execution: str) -> None:
        """Wait for a slot and for tokens in the bucket, at most `wait_s` in all; OverBudget
        when they do not come. An admitted call must `release` exactly once."""
        share = self._share(execution)
        deadline = self.clock() + self.wait_s
        await self._slot(execution, share, deadline)
        try:
            await self._tokens(share, deadline)
        except BaseException:
            self.release(execution)
            raise

    async def _slot(self, execution: str, share: _Share, deadline: float) -> None:
        self._calling.add(execution)
        if not self.max_in_flight or (share.in_flight < self.share_now() and not share.waiters):
            share.in_flight += 1
            return
        fut = asyncio.get_running_loop().create_future()
        share.waiters.append(fut)
        try:
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, deadline - self.clock()))
        except asyncio.CancelledError:  # the client went away while waiting
            self._leave(execution, share, fut)
            raise
        if done:
            return  # a slot handed over by `_hand_out`
        self._leave(execution, share, fut)
        self.refused["requests"] += 1
        raise OverBudget("requests", f"this execution already has {share.in_flight} model calls in flight, its "
                                     f"share now ({self.share_now()} of max_calls_in_flight_per_execution = "
                                     f"{self.max_in_flight}, shared among the {len(self._calling)} executions "
                                     f"calling); none ended within {self.wait_s:g} s", REQUESTS_RETRY_AFTER_S)

    def _leave(self, execution: str, share: _Share, fut: asyncio.Future) -> None:
        """A waiter gives up: out of the queue, or, when a slot was handed to it already,
        that slot given back."""
        if fut.done() and not fut.cancelled():
            self.release(execution)
            return
        fut.cancel()
        try:
            share.waiters.remove(fut)
        except ValueError:
            pass
        self._settle(execution, share)

    def _settle(self, execution: str, share: _Share) -> None:
        """An execution with nothing in flight and nobody waiting no longer shares: the
        others' shares grow."""
        if not share.in_flight and not share.waiters and execution in self._calling:
            self._calling.discard(execution)
            self._hand_out()

    async def _tokens(self, share: _Share, deadline: float) -> None:
        if not self.tokens_per_minute:
            return
        self._refill(share)
        if share.level > 0:
            return
        wait = (1 - share.level) * 60.0 / self.tokens_per_minute  # until the bucket holds a token again
        if self.clock() + wait > deadline:
            self.refused["tokens"] += 1
            raise OverBudget("tokens", f"this execution spent its {self.tokens_per_minute} tokens per minute "
                                       f"(max_tokens_per_minute_per_execution)", max(1, math.ceil(wait)))
        await asyncio.sleep(wait)
        self._refill(share)

    def _refill(self, share: _Share) -> None:
        now = self.clock()
        share.level = min(float(self.tokens_per_minute),
                          share.level + (now - share.stamp) * self.tokens_per_minute / 60.0)
        share.stamp = now

    def charge(self, execution: str, tokens: int) -> None:
        """Tokens an admitted call cost (prefilled, generated): out of the bucket."""
        share = self._shares.get(execution)
        if share is not None and self.tokens_per_minute:
            self._refill(share)
            share.level -= tokens

    def release(self, execution: str) -> None:
        """An admitted call ended: its slot goes to a waiter under its execution's share,
        this execution's oldest first."""
        share = self._shares.get(execution)
        if share is None:
            return
        share.in_flight -= 1
        if self.max_in_flight and share.waiters and share.in_flight < self.share_now():
            self._hand(share)
        self._settle(execution, share)
        if self.max_in_flight:
            self._hand_out()

    def _hand(self, share: _Share) -> bool:
        """A slot to the execution's oldest waiter still waiting; False when none is."""
        while share.waiters:
            fut = share.waiters.popleft()
            if not fut.done():
                fut.set_result(True)
                share.in_flight += 1
                return True
        return False

    def _hand_out(self) -> None:
        """Every execution under its share gets slots for its waiters (shares grow when an
        execution stops calling; a freed slot may belong to another execution's share)."""
        if not self.max_in_flight:
            return
        changed = True
        while changed:
            changed, cap = False, self.share_now()
            for execution in list(self._calling):
                share = self._shares.get(execution)
                if share is None:
                    continue
                while share.waiters and share.in_flight < cap and self._hand(share):
                    pass
                if not share.in_flight and not share.waiters:  # its waiters had all left
                    self._calling.discard(execution)
                    changed = True
