"""metrics.py: `metrics.jsonl`, one JSON object per event, times in seconds since start.

Append-only, one whole line per write (proxy/records.Journal): a crash loses at most the
line being written, and the torn tail it leaves is cut off when a resumed run opens the
file again, so no torn line ever sits mid-file. An event the disk refuses (full, over
quota) is held in memory and written before the next one; `sync()` (at checkpoints)
fsyncs. `read_events` is the one reader, skipping any line that is not a whole event.
Never holds a secret: callers pass plain fields.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import orjson

from gyre.proxy.records import Journal, JournalError, read_lines

log = logging.getLogger("gyre.coordinator")

_WARN_EVERY_S = 30.0  # a disk that stays full: one warning per this many seconds


class Metrics:
    def __init__(self, path: Path, t0: float | None = None, trackers=None):
        self.path = path
        self.trackers = trackers  # coordinator/trackers.Trackers or None: every event also goes there
        self.t0 = time.monotonic() if t0 is None else t0
        self.t0_wall = time.time() - (time.monotonic() - self.t0)
        self._journal = Journal(path)  # a run continuing this file (resume): a torn last line is cut off
        self._held: list[bytes] = []  # events the disk refused, oldest first
        self._warned_at = -_WARN_EVERY_S
        self.last: dict[str, dict] = {}

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def since_start(self, wall: float | None) -> float | None:
        """A time.time() stamp as seconds since the run started."""
        return None if wall is None else round(wall - self.t0_wall, 4)

    def emit(self, event: str, **fields) -> dict:
        """Journal one event. A disk that refuses it does not stop the run: the event is held,
        in order, and written with the next one the disk takes."""
        rec = {"event": event, "t": self.now(), **fields}
        self._held.append(orjson.dumps(rec) + b"\n")
        self._write_held()
        self.last[event] = rec
        if self.trackers is not None:
            self.trackers.log(rec)  # queued: its thread writes TensorBoard / W&B
        return rec

    @property
    def held(self) -> int:
        """Events not on disk yet (the disk refused them)."""
        return len(self._held)

    def _write_held(self) -> JournalError | None:
        try:
            self._journal.append(b"".join(self._held))
        except JournalError as e:
            if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = time.monotonic()
                log.warning("%s: %d event(s) held in memory, the disk refused them: %s", self.path, len(self._held), e)
            return e
        if len(self._held) > 1:
            log.info("%s: %d held event(s) written", self.path, len(self._held))
        self._held.clear()
        return None

    def sync(self) -> None:
        """Every event emitted so far on disk, fsynced; the coordinator calls it at checkpoints.
        Raises JournalError when held events still cannot be written (a checkpoint must not
        claim a journal the disk does not have)."""
        if self._held and (e := self._write_held()) is not None:
            raise e
        self._journal.sync()

    def close(self) -> None:
        if self._held and self._write_held() is not None:
            log.error("%s: %d event(s) lost, the disk refused them until the end", self.path, len(self._held))
        self._journal.close()
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def read_events(path: str | Path) -> list[dict]:
    """The events of a metrics.jsonl: every line that is a whole JSON object, in order; a
    torn line (the last, from a crash; or one mid-file, which older writers could leave) is skipped
    with a warning."""
    out = []
    for line, ev in read_lines(Path(path)):
        if isinstance(ev, dict):
            out.append(ev)
        else:
            log.warning("%s: skipped line %d, not an event object", path, line)
    return out
