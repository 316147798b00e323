"""loopprobe.py: how late the coordinator's event loop runs, measured from inside it.

One task sleeps `interval_s` at a time and records how much later than asked it woke: that
lateness is what every harness call waiting on the loop (the proxy serves from it) waited
too. `LoopProbe.lag_ms(since)` gives p50 / p99 / max over the samples since a time, so a
step, a benchmark phase or the live view reads its own window. Not a profiler: it says that
the loop stalled, not what stalled it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopProbe:
    def __init__(self, interval_s: float = 0.01, keep: int = 100_000):
        self.interval_s = interval_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=keep)  # (loop time it slept from, lateness s)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gyre-loop-probe")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @staticmethod
    def now() -> float:
        """The probe's clock (perf_counter: uvloop's loop.time() counts whole milliseconds)."""
        return time.perf_counter()

    async def _run(self) -> None:
        while True:
            began = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.samples.append((began, max(0.0, time.perf_counter() - began - self.interval_s)))

    def lag_ms(self, since: float = float("-inf"), until: float = float("inf")) -> dict[str, float] | None:
        """p50 / p99 / max lateness (ms) of the probe's sleeps that overlap [since, until]
        (the probe's clock, `now()`): a stall that began just before the window but ran into it counts. None
        when there are none (not zero: nothing was measured)."""
        span = self.interval_s
        lags = sorted(lag for t, lag in self.samples if t <= until and t + span + lag >= since)
        if not lags:
            return None

        def q(p: float) -> float:
            return round(lags[min(len(lags) - 1, int(p * len(lags)))] * 1e3, 3)

        return {"p50": q(0.5), "p99": q(0.99), "max": round(lags[-1] * 1e3, 3), "samples": len(lags)}
