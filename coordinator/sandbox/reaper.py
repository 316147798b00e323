"""reaper.py: which sandboxes are orphans, and opening a backend with its orphans removed.

A sandbox is an orphan when the coordinator process that made it (LABEL_OWNER, LABEL_PROCESS)
is gone and nobody kept it on purpose: at start-up (a new run, or `--resume` of a killed one) every
sandbox of a dead run, and of an earlier process on this run directory, is removed; at
shutdown, this process's own leftovers (the ones it adopted among them). A live run's
sandboxes (its run directory's lock held) and sandboxes kept by `keep_sandbox`
(RUN_DIR/executions/ID/sandbox-kept.json) stay.

So does an *adoptable* one (issue 34): a container whose harness runs on by itself (its exec
recorded in sandbox.json, its key in harness.key) until its deadline, plus ADOPT_SLACK_S, has
passed. A coordinator restarted on that run directory takes it back (launcher.adopt), and
sweeps the rest (`at_resume`); until then another run's start-up leaves it alone.
"""

from __future__ import annotations

import json
import logging
import time
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
KEY_FILE = "harness.key"  # in the execution's folder (0600): the key its harness holds, for `adopt`
ADOPT_SLACK_S = 60.0  # an adopted harness is waited for this long past its deadline and grace

Alive = Callable[[Mapping[str, str]], bool]


def kept_marker(run_dir: Path, execution: str) -> Path:
    return run_dir / "executions" / execution / KEPT_FILE


def mark_kept(run_dir: Path, execution: str, info: dict) -> None:
    kept_marker(run_dir, execution).write_text(json.dumps(info))


def _kept(labels: Mapping[str, str]) -> bool:
    rd, ex = labels.get(LABEL_RUN_DIR), labels.get(LABEL_EXECUTION)
    return bool(rd and ex and kept_marker(Path(rd), ex).exists())


NEVER_RESUMED = ("serve", "tasks run", "eval")  # config.json's `command` of runs nobody resumes


def adoptable_until(folder: Path) -> float | None:
    """Until when (time.time()) the execution in `folder` may be adopted: its harness's start
    plus its deadline and ADOPT_SLACK_S, where sandbox.json records a detached harness and its
    key was kept; None where nothing of it can be adopted (it never started, or ran where a
    harness dies with the coordinator: the process and bubblewrap backends), or nobody would
    (a `gyre serve`, `tasks run` or `eval` run directory is never resumed)."""
    try:
        command = json.loads((folder.parent.parent / "config.json").read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        command = None  # no run config (a launcher of its own): its caller may adopt
    if command in NEVER_RESUMED:
        return None
    try:
        harness = json.loads((folder / "sandbox.json").read_text())["harness"]
        if not (harness["exec"] and harness["token"] and (folder / KEY_FILE).is_file()):
            return None
        return float(harness["started"]) + float(harness["timeout_s"]) + ADOPT_SLACK_S
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _adoptable(labels: Mapping[str, str]) -> bool:
    rd, ex = labels.get(LABEL_RUN_DIR), labels.get(LABEL_EXECUTION)
    if not (rd and ex):
        return False
    until = adoptable_until(Path(rd) / "executions" / ex)
    return until is not None and time.time() < until


def at_startup(owner: str, run_dir: Path) -> Alive:
    def alive(labels: Mapping[str, str]) -> bool:
        if labels.get(LABEL_OWNER) == owner or _kept(labels) or _adoptable(labels):
            return True
        if process_alive(labels.get(LABEL_PROCESS)):
            return True  # the process that made it still runs (here): not an orphan, whatever its run directory
        rd = labels.get(LABEL_RUN_DIR) or ""
        if not rd or Path(rd) == run_dir:
            return False  # an earlier process on this run directory (the one we hold)
        return held(Path(rd)) or live_coordinator(Path(rd))  # another live run's

    return alive


def at_resume(owner: str, run_dir: Path, adopted: set[str]) -> Alive:
    """Once a restarted coordinator has adopted what it could: an earlier process's sandbox of
    this run directory that it did not adopt is an orphan now (its execution runs again, or
    ended without it)."""

    def alive(labels: Mapping[str, str]) -> bool:
        if labels.get(LABEL_OWNER) == owner or _kept(labels) or labels.get(LABEL_EXECUTION) in adopted:
            return True
        return Path(labels.get(LABEL_RUN_DIR) or "/") != run_dir

    return alive


def at_shutdown(owner: str, run_dir: Path | None = None, adopted: set[str] = frozenset(),
                handed_off: set[str] = frozenset()) -> Alive:
    """This process's own sandboxes are orphans now, and the ones of `run_dir` it adopted,
    except those it `handed_off` to the next coordinator of the run (a stop for a restart)."""

    def alive(labels: Mapping[str, str]) -> bool:
        ours = Path(labels.get(LABEL_RUN_DIR) or "/") == run_dir
        if _kept(labels) or (ours and labels.get(LABEL_EXECUTION) in handed_off):
            return True
        if labels.get(LABEL_OWNER) == owner:
            return False
        return not (ours and labels.get(LABEL_EXECUTION) in adopted)

    return alive


async def reap(backend: SandboxBackend, alive: Alive, when: str) -> int:
    n = await backend.reap(alive)
    if n:
        log.warning("%s: removed %d orphan sandbox(es) %s", backend.name, n, when)
    return n
