"""Failpoints: named places where a fault test holds the coordinator, to kill it there.

Some phases last milliseconds on the embedded default (a checkpoint's state written after the
trainer's file; a publication's push to the other cells), too short to SIGKILL a process in
from outside. `GYRE_FAILPOINT=<name>` in the coordinator's environment (a test's, never a
config field) makes it, the first time it reaches that point, write `RUN_DIR/failpoint-<name>`
(its pid) and wait there for ever: the rest of the event loop runs on (the proxy serves, the
executions call the model and close), so the phase is held open as a long one would be on a
cluster until the test kills the process. As etcd's gofail does, without the variable a
failpoint costs one lookup.

    publication   Steps.publish: the core took the new weights, the other cells not yet
    checkpoint    Checkpoints.save: trainer.pt written, the state (and so the checkpoint) not
    checkpointed  Checkpoints.save: the checkpoint complete, the run not yet on (the trainer at its version)
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

log = logging.getLogger("gyre.coordinator")

ENV = "GYRE_FAILPOINT"
POINTS = ("publication", "checkpoint", "checkpointed")
_passed: set[str] = set()


async def hold(name: str, run_dir: Path) -> None:
    """Wait here for ever when the environment names this point (once per process)."""
    if os.environ.get(ENV) != name or name in _passed:
        return
    assert name in POINTS, name
    _passed.add(name)
    log.warning("failpoint %s reached: holding here until killed (%s is set)", name, ENV)
    (run_dir / f"failpoint-{name}").write_text(f"{os.getpid()}\n")
    await asyncio.Event().wait()
