"""resume.py: checkpoints of a run, and `gyre up --resume RUN_DIR` after a crash.

What survives a `kill -9` of the coordinator:

- the journal, `metrics.jsonl`, flushed per line: a `dispatch` event per group (task, version,
  execution ids) and an `execution` event per closed execution (status, reward, validity);
- each execution's records (`executions/<id>/nodes.jsonl`, `calls.jsonl`), written as calls
  complete;
- checkpoints, every `checkpoint_every` steps at a publication (no batch in flight):
  `checkpoints/step-NNNNNN/trainer.pt` (the core's model, optimizer and version) and
  `state.json` (step, versions, publications, consumed groups, the task order), with
  `checkpoints/latest` naming the newest complete one (written last, atomically).

Resuming loads the latest checkpoint into the core, publishes it to every engine, and
rebuilds the buffer from the journal: groups consumed by a checkpointed step stay consumed
(later steps were lost with the model, so their groups are trained again); every closed
execution of any other group comes back with its recorded tree, exactly once; executions
that were queued or running (or cancelled by a shutdown) are dispatched again under new
ids (`<id>-r1`). Metrics continue in the same file. Not the loop: main.py calls these.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import orjson

from gyre.workerd.wire import GyreError

CHECKPOINTS = "checkpoints"


class ResumeError(GyreError):
    """A run directory that cannot be resumed; the message says what is missing."""


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def write_state(run_dir: Path, step: int, state: dict) -> Path:
    """state.json for the checkpoint of `step`, then the `latest` pointer (both atomic)."""
    folder = step_dir(run_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic(folder / "state.json", json.dumps(state, indent=1))
    _atomic(run_dir / CHECKPOINTS / "latest", folder.name + "\n")
    return folder


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def latest(run_dir: Path) -> tuple[Path, dict]:
    """(checkpoint folder, state) of the newest complete checkpoint."""
    pointer = run_dir / CHECKPOINTS / "latest"
    if not (run_dir / "config.json").exists():
        raise ResumeError(f"{run_dir} has no config.json: not a gyre run directory")
    if not pointer.exists():
        raise ResumeError(f"{run_dir} has no checkpoint yet ({pointer} missing): nothing to resume from; "
                          "start a new run (checkpoints are written every `checkpoint_every` steps)")
    folder = run_dir / CHECKPOINTS / pointer.read_text().strip()
    state_path, trainer = folder / "state.json", folder / "trainer.pt"
    for f in (state_path, trainer):
        if not f.exists():
            raise ResumeError(f"checkpoint {folder} is incomplete: {f.name} missing")
    return folder, json.loads(state_path.read_text())


def read_journal(run_dir: Path) -> tuple[dict[int, dict], dict[str, dict], float]:
    """(dispatch events by group, last execution event by id, last time stamp) from
    metrics.jsonl; a torn last line (the crash) is skipped."""
    dispatches: dict[int, dict] = {}
    outcomes: dict[str, dict] = {}
    last_t = 0.0
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            last_t = max(last_t, float(ev.get("t", 0.0)))
            if ev.get("event") == "dispatch":
                dispatches[ev["group"]] = ev
            elif ev.get("event") == "execution":
                outcomes[ev["id"]] = ev
    return dispatches, outcomes, last_t


def task_order_state(source) -> dict[str, Any]:
    """The task source's position: its RNG state and the rest of the current pass."""
    version, internal, gauss = source._rng.getstate()
    return {"rng": [version, list(internal), gauss], "order": [t.id for t in source._order]}


def restore_task_order(source, state: dict[str, Any]) -> None:
    version, internal, gauss = state["rng"]
    source._rng.setstate((version, tuple(internal), gauss))
    by_id = {t.id: t for t in source.tasks}
    missing = [i for i in state["order"] if i not in by_id]
    if missing:
        raise ResumeError(f"the task set changed since the checkpoint: task(s) {missing[:5]} are gone")
    source._order = [by_id[i] for i in state["order"]]


def redo_id(run_dir: Path, run_id: str) -> str:
    """A fresh execution id for an execution dispatched again (its old folder is kept)."""
    k = 1
    while (run_dir / "executions" / f"{run_id}-r{k}").exists():
        k += 1
    return f"{run_id}-r{k}"
