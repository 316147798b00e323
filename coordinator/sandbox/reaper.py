"""reaper.py: which sandboxes are orphans, and opening a backend with its orphans removed.

A sandbox is an orphan when the coordinator process that made it (LABEL_OWNER, LABEL_PROCESS)
is gone and nobody kept it on purpose: at start-up (a new run, or `--resume` of a killed one) every
sandbox of a dead run, and of an earlier process on this run directory, is removed; at
shutdown, this process's own leftovers. A live run's sandboxes (its run directory's lock
held) and sandboxes kept by `keep_sandbox` (RUN_DIR/executions/ID/sandbox-kept.json) stay.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from gyre.coordinator.rundir import held, live_coordinator
from gyre.coordinator.sandbox.base import (
    LABEL_EXECUTION,
    LABEL_OWNER,
    LABEL_PROCESS,
    LABEL_RUN_DIR,
    SandboxBackend,
    process_alive,
)

log = logging.getLogger("gyre.coordinator")
KEPT_FILE = "sandbox-kept.json"

Alive = Callable[[Mapping[str, str]], bool]


def kept_marker(run_dir: Path, execution: str) -> Path:
    return run_dir / "executions" / execution / KEPT_FILE


def mark_kept(run_dir: Path, execution: str, info: dict) -> None:
    kept_marker(run_dir, execution).write_text(json.dumps(info))


def _kept(labels: Mapping[str, str]) -> bool:
    rd, ex = labels.get(LABEL_RUN_DIR), labels.get(LABEL_EXECUTION)
    return bool(rd and ex and kept_marker(Path(rd), ex).exists())


def at_startup(owner: str, run_dir: Path) -> Alive:
    def alive(labels: Mapping[str, str]) -> bool:
        if labels.get(LABEL_OWNER) == owner or _kept(labels):
            return True
        if process_alive(labels.get(LABEL_PROCESS)):
            return True  # the process that made it still runs (here): not an orphan, whatever its run directory
        rd = labels.get(LABEL_RUN_DIR) or ""
        if not rd or Path(rd) == run_dir:
            return False  # an earlier process on this run directory (the one we hold)
        return held(Path(rd)) or live_coordinator(Path(rd))  # another live run's

    return alive


def at_shutdown(owner: str) -> Alive:
    return lambda labels: labels.get(LABEL_OWNER) != owner or _kept(labels)


async def reap(backend: SandboxBackend, alive: Alive, when: str) -> int:
    n = await backend.reap(alive)
    if n:
        log.warning("%s: removed %d orphan sandbox(es) %s", backend.name, n, when)
    return n
