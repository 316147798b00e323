"""metrics.py: `metrics.jsonl`, one JSON object per event, times in seconds since start.

Append-only and flushed per line, so a crash loses at most the line being written and
`gyre top` / a resumed run can tail it. Never holds a secret: callers pass plain fields.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson


class Metrics:
    def __init__(self, path: Path, t0: float | None = None):
        self.path = path
        self.t0 = time.monotonic() if t0 is None else t0
        self.t0_wall = time.time() - (time.monotonic() - self.t0)
        self._f = open(path, "ab")
        if self._f.tell() > 0:  # a run continuing this file (resume): never append to a torn last line
            with open(path, "rb") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    self._f.write(b"\n")
        self.last: dict[str, dict] = {}

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def since_start(self, wall: float | None) -> float | None:
        """A time.time() stamp as seconds since the run started."""
        return None if wall is None else round(wall - self.t0_wall, 4)

    def emit(self, event: str, **fields) -> dict:
        rec = {"event": event, "t": self.now(), **fields}
        self._f.write(orjson.dumps(rec) + b"\n")
        self._f.flush()
        self.last[event] = rec
        return rec

    def close(self) -> None:
        self._f.close()
