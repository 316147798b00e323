"""gcpolicy.py: the coordinator's long-lived objects kept out of Python's cycle collector.

CPython's collector walks every tracked object of the oldest generation on a full
collection, and it runs one whenever that generation has grown by a quarter. The
coordinator's long-lived state (each execution's tree and recorder, the tokenizer's memos)
is millions of objects at the paper's scale, none of them in a reference cycle: refcounting
frees them when an execution closes. Measured with bench/scale.py at 1,152 executions of up
to 200k tokens, three full collections in a 120 s window stopped the event loop (and every
harness call waiting on it) for up to 2.3 s each.

`GcPolicy` calls `gc.freeze()` every `every_s`: whatever survived until then moves to the
permanent generation, which collections skip, so each full collection walks only what was
promoted since the last freeze. Young objects are collected as Python always does. The cost
is cycles that become garbage after being frozen (an object alive at a freeze, in a
reference cycle, later dropped): refcounting cannot free them and the collector no longer
looks. `collect_frozen()` unfreezes, collects everything and freezes again, and says how much
it found and how long it took (the benchmark reports it). `every_s = 0` leaves Python's
collector as it is.
"""

from __future__ import annotations

import asyncio
import gc
import time


class GcPolicy:
    def __init__(self, every_s: float = 30.0):
        if every_s < 0:
            raise ValueError(f"gc_freeze_every_s must be >= 0 (0: off), not {every_s}")
        self.every_s = every_s
        self.freezes = 0
        self.pauses_ms: dict[int, float] = {0: 0.0, 1: 0.0, 2: 0.0}  # longest collection per generation
        self.collections: dict[int, int] = {0: 0, 1: 0, 2: 0}
        self._started: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Freeze what start-up built, watch the collector, and freeze again every `every_s`."""
        if self._task is not None:
            return
        gc.collect()
        gc.freeze()
        self.freezes += 1
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        if self.every_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gyre-gc-freeze")

    async def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def freeze(self) -> None:
        gc.freeze()  # O(1): the generations' lists are spliced onto the permanent one
        self.freezes += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.freeze()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            g = info["generation"]
            self.collections[g] += 1
            self.pauses_ms[g] = max(self.pauses_ms[g], (time.perf_counter() - self._started) * 1e3)
            self._started = None

    @staticmethod
    def collect_frozen() -> dict:
        """Collect everything, the frozen objects included, then freeze again: what the
        freezes kept from the collector (unreachable objects found) and the pause it takes."""
        frozen = gc.get_freeze_count()
        t0 = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        ms = (time.perf_counter() - t0) * 1e3
        gc.freeze()
        return {"frozen_objects": frozen, "unreachable_found": found, "pause_ms": round(ms, 1)}

    def status(self) -> dict:
        return {"freeze_every_s": self.every_s, "freezes": self.freezes,
                "collections": {f"gen{g}": n for g, n in self.collections.items()},
                "longest_pause_ms": {f"gen{g}": round(ms, 3) for g, ms in self.pauses_ms.items()}}
