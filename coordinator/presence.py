"""presence.py: the live coordinator as others see it: its run directory's coordinator.json, and
the stop a signal asked of it.

`Presence` writes RUN_DIR/coordinator.json once the coordinator serves (its status URL for
`gyre top`, its pid, its start) and touches it each second while it runs, so that a later
`gyre up --resume` knows when it was last alive (resume.Restored.last_alive: the restart's
downtime, as the harnesses saw it). `StopRequest` holds what SIGINT, SIGTERM and SIGUSR1 asked:
a stop at the next tick (a second SIGINT exits at once, saving nothing), and for SIGUSR1
(`gyre restart`, `systemctl reload`) a hand-off: the executions whose
harnesses run in containers are left running for the next coordinator to adopt. Not the stop
itself (main.py's shutdown).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("gyre.coordinator")
BEAT_S = 1.0  # coordinator.json is touched this often: a resume's downtime is known to this much


class Presence:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "coordinator.json"
        self._beat_at = 0.0  # monotonic

    def write(self, status_url: str) -> None:
        self.path.write_text(json.dumps({"status_url": status_url, "pid": os.getpid(), "started": time.time()}))
        self._beat_at = time.monotonic()

    def beat(self) -> None:
        """Touched at most each BEAT_S (the tick calls it)."""
        now = time.monotonic()
        if now - self._beat_at >= BEAT_S:
            self._beat_at = now
            try:
                os.utime(self.path)
            except OSError:
                pass  # a later resume reads a longer downtime; nothing else depends on it


class StopRequest:
    def __init__(self):
        self.requested = False  # stop at the next tick, gracefully
        self.signal: int | None = None  # the first signal that asked (the exit status is 128 + it)
        self.handoff = False  # SIGUSR1: leave the container executions running for the resume

    def install(self) -> None:
        """The handlers, on the running loop (not in a thread other than the main one: tests)."""
        loop = asyncio.get_running_loop()
        # Not SIGHUP: a closed terminal, or `nohup`'s ignoring it, keeps its usual meaning.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            try:
                loop.add_signal_handler(sig, self.ask, sig)
            except (NotImplementedError, RuntimeError):
                return

    def ask(self, sig: int) -> None:
        if self.requested and sig == signal.SIGINT:
            if os.isatty(1):  # os._exit skips the live view's cleanup: show the cursor again
                os.write(1, b"\n\x1b[?25h")
            os._exit(130)
        if not self.requested:
            if sig == signal.SIGUSR1:
                self.handoff = True
                log.warning("signal %d: stopping for a restart: harnesses in containers keep running for the next "
                            "`gyre up --resume` to adopt; a step in flight is given up, a checkpoint of the last "
                            "one saved", sig)
            else:
                log.warning("signal %d: stopping: a step in flight is given up, a checkpoint of the last one saved "
                            "(Ctrl-C again: exit at once, saving nothing)", sig)
        self.requested = True
        self.signal = self.signal or sig
