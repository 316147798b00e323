"""metrics.py: `metrics.jsonl`, one JSON object per event, times in seconds since start.

Append-only, one whole line per write (proxy/records.Journal): a crash loses at most the
line being written, and the torn tail it leaves is cut off when a resumed run opens the
file again, so no torn line ever sits mid-file. An event the disk refuses (full, over
quota) is held in memory and written before the next one; `sync()` (at checkpoints)
fsyncs. `read_events` is the one reader: the events in order, and which lines were no
whole event (a torn last one, or bad ones mid-file), of the file or only of its tail.
Never holds a secret: callers pass plain fields.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from gyre.proxy.records import Journal, JournalError, parse_lines

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


@dataclass(frozen=True, slots=True)
class Events:
    """What `read_events` found in a metrics.jsonl."""

    events: list[dict]  # every line that is a whole JSON object, in order
    bad: tuple[int, ...] = ()  # numbers (from 1) of the other non-blank lines: torn, or not an object
    lines: int = 0  # lines read, blank ones included
    torn_last: bool = False  # the last non-blank line is one of `bad` (what a crash mid-write leaves)

    @property
    def mid(self) -> tuple[int, ...]:
        """The bad lines before the last one: what a resume of an older gyre left mid-file."""
        return self.bad[:-1] if self.torn_last else self.bad


def read_events(path: str | Path, *, tail: int | None = None, warn: bool = False) -> Events:
    """The events of a metrics.jsonl (none where the file is missing) and the lines that are
    no whole event; blank lines are skipped. `tail`: only its last `tail` bytes, a line they
    start inside dropped (lines then count from the first whole one read). `warn`: log each
    skipped line."""
    path = Path(path)
    if not path.exists():
        return Events([])
    with open(path, "rb") as f:
        start = max(0, f.seek(0, os.SEEK_END) - tail) if tail is not None else 0
        f.seek(max(0, start - 1))
        data = f.read()
    if start > 0:  # read from the byte before: a line starting right at `start` stays whole
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else b""
    lines = data.splitlines()
    parsed, bad = parse_lines(lines, path, warn=warn)
    events = []
    for n, ev in parsed:
        if isinstance(ev, dict):
            events.append(ev)
            continue
        bad.append(n)
        if warn:
            log.warning("%s: skipped a line that is not an event object: line %d, %d bytes", path, n, len(lines[n - 1]))
    bad.sort()
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    return Events(events, tuple(bad), len(lines), bool(bad) and bad[-1] == last + 1)


def counted_steps(events: list[dict]) -> list[dict]:
    """The run's `step` events that count, in order: a `resume` (its `step`: the checkpoint's)
    drops those past the checkpoint before it, lost with the coordinator and trained again
    since, so a 2-step run resumed after its step 2 was lost counts 2 steps, not 3."""
    out: list[dict] = []
    for ev in events:
        if ev.get("event") == "resume" and isinstance(ev.get("step"), int):
            out = [s for s in out if not isinstance(s.get("step"), int) or s["step"] <= ev["step"]]
        elif ev.get("event") == "step":
            out.append(ev)
    return out
