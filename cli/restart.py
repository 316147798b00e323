"""restart.py: `gyre restart RUN_DIR`: a run's coordinator stopped and started again, its
executions in containers running on through it (issue 34).

The live coordinator (the process holding the run directory's lock) gets SIGUSR1: it stops as
a SIGTERM stops it (a step in flight given up, a checkpoint of the last one saved, workers shut
down), except that every execution whose harness runs in a container is handed off, left
running with nothing journaled of its end. Once the lock is free, the caller resumes the run
(`gyre up --resume`), which adopts them. Not the coordinator's stop (main.py) nor the resume.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import typer

from gyre.coordinator.rundir import RunDirError, held, holder

POLL_S = 0.2


def hand_off(run_dir: Path, wait_s: float) -> int:
    """SIGUSR1 to RUN_DIR's coordinator, then wait for it to let the run directory go (saying
    so every 10 s); its pid. RunDirError when no coordinator runs there, or it is still
    there after `wait_s`."""
    if not (run_dir / "config.json").exists():
        raise RunDirError(f"{run_dir / 'config.json'} does not exist: not a gyre run directory")
    pid = holder(run_dir)
    if pid is None:
        raise RunDirError(f"no gyre process holds {run_dir}: nothing to restart; continue a stopped or crashed run "
                          f"with `gyre up --resume {run_dir}`")
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        pid = None  # it ended meanwhile
    except PermissionError:
        raise RunDirError(f"the coordinator of {run_dir} (pid {pid}) is another user's: restart it as that "
                          f"user") from None
    typer.echo(f"gyre restart: the coordinator of {run_dir} (pid {pid}) is stopping; executions in containers keep "
               f"running for the resume to adopt", err=True)
    start = time.monotonic()
    said = start
    while held(run_dir):
        now = time.monotonic()
        if now - start > wait_s:
            raise RunDirError(f"the coordinator of {run_dir} (pid {pid}) still holds it after {wait_s:.0f}s; "
                              f"wait for it (a checkpoint may be saving), then `gyre up --resume {run_dir}`")
        if now - said >= 10:
            said = now
            typer.echo(f"gyre restart: waiting for pid {pid} to let {run_dir} go ({now - start:.0f}s)", err=True)
        time.sleep(POLL_S)
    return pid
