"""resume.py: checkpoints of a run, and `gyre up --resume RUN_DIR` after a crash.

What survives a `kill -9` of the coordinator:

- the journal, `metrics.jsonl`, written a whole line at a time, fsynced at checkpoints: a
  `dispatch` event per group (task, version, execution ids) and an `execution` event per
  closed execution (status, reward, validity);
- each execution's records (`executions/<id>/nodes.jsonl`, `calls.jsonl`), written as calls
  complete;
- checkpoints, every `checkpoint_every` steps at a publication (no batch in flight) and at
  every end of a run (save_final; a run killed before its first resumes from step 0,
  its closed executions restored):
  `checkpoints/step-NNNNNN/trainer.pt` (the core's model, optimizer and version) and
  `state.json` (step, versions, publications, consumed groups, the task order), with
  `checkpoints/latest` naming the newest complete one (written last, atomically). Every
  file is fsynced (and its folder) before the next is written; a save that fails (a full
  disk: its errno named) removes the step's folder, so no torn checkpoint is left to read.

Resuming takes the newest intact checkpoint at or below `latest`: one whose state.json
does not parse or whose trainer files are cut short (a copy interrupted, a crash of an
older gyre) is skipped with a warning naming it (`intact`), never a traceback.

Resuming loads the latest checkpoint into the core, publishes it to every engine, and
rebuilds the buffer from the journal: groups consumed by a checkpointed step stay consumed
(later steps were lost with the model, so their groups are trained again); every closed
execution of any other group comes back with its recorded tree, exactly once; executions
that were queued or running (or cancelled by a shutdown) are dispatched again under new
ids (`<id>-r1`), except those whose harness outlived the coordinator in its container: they
are adopted under their own ids (launcher.adopt, issue 34), the same sandbox carrying on. A
group of a lost stretch (held, below) waits for the publication that first dispatched it,
unless one of its harnesses still runs: then it is out at the resume, adopted, and that
publication dispatches nothing in its place (Executions.restore).
Metrics continue in the same file. `read` gives what a run directory
holds (`Restored`); `Checkpoints` saves and restores a run through its owners (steps,
executions, cells, buffer, tasks). Not the loop (main.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.coordinator import failpoints
from gyre.coordinator.buffer import TrajectoryBuffer
from gyre.coordinator.heldout import HeldOut
from gyre.coordinator.metrics import read_events
from gyre.coordinator.tasks import TaskError, TaskSource
from gyre.proxy.records import JournalError
from gyre.workerd import wire
from gyre.workerd.checkpointio import named
from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")

CHECKPOINTS = "checkpoints"


class ResumeError(GyreError):
    """A run directory that cannot be resumed; the message says what is missing."""


class CheckpointError(GyreError):
    """A checkpoint that could not be saved; the message names the step and the cause (its errno)."""


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def write_state(run_dir: Path, step: int, state: dict) -> Path:
    """state.json for the checkpoint of `step`, then the `latest` pointer (both atomic)."""
    folder = step_dir(run_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic(folder / "state.json", json.dumps(state, indent=1))
    _atomic(run_dir / CHECKPOINTS / "latest", folder.name + "\n")
    return folder


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the run's complete checkpoints (trainer.pt and state.json both there)."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(int(f.name[5:]) for f in root.glob("step-*")
                  if f.name[5:].isdigit() and (f / "trainer.pt").exists() and (f / "state.json").exists())


def prune_checkpoints(run_dir: Path, step: int, keep: int) -> list[int]:
    """Delete the complete checkpoints older than the newest `keep` at or below `step`, the
    one just written; 0 keeps all. A folder cut short (no state.json) or past `step` (a
    stretch lost to a kill -9, written again as the run reaches it) is not counted and not
    touched. A deletion that fails is a warning, never the run's end. Returns the steps
    deleted."""
    if keep <= 0:
        return []
    steps = [s for s in checkpoint_steps(run_dir) if s <= step]
    deleted = []
    for old in steps[:-keep]:
        try:
            shutil.rmtree(step_dir(run_dir, old))
        except OSError as e:
            log.warning("keep_checkpoints: could not delete the checkpoint of step %d (%s)", old, e)
            continue
        deleted.append(old)
    return deleted


def _atomic(path: Path, text: str) -> None:
    """`text` into `path` through a fsynced `.tmp`, renamed, the folder fsynced; a failure
    (a full disk) removes the `.tmp`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


START = {"step": 0, "version": 0, "publications": 0, "groups_dispatched": 0, "consumed": [], "tasks": None,
         "tokens_trained": 0}
STATE_KEYS = ("step", "version", "publications", "groups_dispatched", "consumed", "tasks")


def latest(run_dir: Path) -> tuple[Path | None, dict]:
    """(checkpoint folder, state) of the newest intact checkpoint (`newest_intact`), each
    one skipped on the way a warning; (None, the start's state) for a run that stopped
    before its first: it resumes from the model directory's weights, with every execution
    it closed restored from the journal."""
    if not (run_dir / "config.json").exists():
        raise ResumeError(f"{run_dir} has no config.json: not a gyre run directory")
    folder, st, skipped = newest_intact(run_dir)
    for why in skipped:
        log.warning("resume: %s; skipped", why)
    if folder is None and skipped:
        pointer = run_dir / CHECKPOINTS / "latest"
        raise ResumeError(f"no intact checkpoint in {run_dir / CHECKPOINTS} ({'; '.join(skipped)}); to start "
                          f"again from step 0 (the model directory's weights): rm {pointer}")
    if skipped:
        log.warning("resume: from the newest intact checkpoint, %s (step %d)", folder.name, st["step"])
    return folder, st if folder is not None else dict(START)


def newest_intact(run_dir: Path) -> tuple[Path | None, dict | None, list[str]]:
    """(folder, state, what was skipped and why) of the newest intact checkpoint at or
    below the one `latest` names (past it: a save cut short before the pointer moved);
    (None, None, []) where no checkpoint was ever declared complete."""
    root = run_dir / CHECKPOINTS
    pointer = root / "latest"
    if not pointer.exists():
        return None, None, []
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    skipped: list[str] = []
    top = int(name[5:]) if re.fullmatch(r"step-\d+", name) else None
    if top is None:
        skipped.append(f"{pointer} names {name!r}, not a checkpoint")
    elif not (root / name).is_dir():
        skipped.append(f"checkpoint {root / name} is missing")
    candidates = sorted((int(f.name[5:]) for f in root.glob("step-*") if f.name[5:].isdigit()), reverse=True)
    for step in candidates:
        if top is not None and step > top:
            continue
        folder = step_dir(run_dir, step)
        st, why = intact(folder)
        if st is not None:
            return folder, st, skipped
        skipped.append(why)
    return None, None, skipped


def intact(folder: Path, needs: tuple[str, ...] = STATE_KEYS) -> tuple[dict | None, str]:
    """(state, "") for a checkpoint whose state.json parses (with the fields `needs`) and
    whose trainer.pt is whole; (None, what is wrong) otherwise. Whole: a zip archive
    (torch.save's format) whose central directory, at its very end, reads and whose every
    member lies within the file: a truncation fails this. Cheap: the tensors' bytes are
    not read. (A Megatron cell's other rank files are checked by the cell as it loads.)"""
    try:
        st = json.loads((folder / "state.json").read_text())
    except FileNotFoundError:
        return None, f"checkpoint {folder} is incomplete: state.json missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"checkpoint {folder}: state.json does not read ({type(e).__name__}: {e})"
    if not isinstance(st, dict) or any(k not in st for k in needs):
        return None, f"checkpoint {folder}: state.json lacks the fields read from it ({', '.join(needs)})"
    if not (folder / "trainer.pt").exists():
        return None, f"checkpoint {folder} is incomplete: trainer.pt missing"
    why = _torn(folder / "trainer.pt")
    return (None, f"checkpoint {folder}: trainer.pt is torn ({why})") if why else (st, "")


def _torn(path: Path) -> str:
    """What is wrong with a torch.save file, or "" where its archive is whole."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as z:
            past = [i.filename for i in z.infolist() if i.header_offset + i.compress_size > size]
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        return str(e)
    return f"{past[0]} runs past its end, {size} bytes" if past else ""


@dataclass(frozen=True)
class Restored:
    """What a resume starts from, read before anything starts: the newest intact checkpoint
    (None: the run stopped before its first) and its state, and the journal's dispatches,
    outcomes and last time stamp. Each owner restores itself from it (restore below)."""

    checkpoint: Path | None
    state: dict
    dispatches: dict[int, dict]  # the dispatch event of each group, by id
    outcomes: dict[str, dict]  # the last execution event of each execution, by id
    last_t: float  # the journal's last time: the resumed run's clock continues from it
    # When (time.time()) the earlier coordinator last showed it was alive: coordinator.json's
    # mtime, touched every second while it runs (main.py); None for a gyre that did not.
    last_alive: float | None = None


def read(run_dir: Path) -> Restored:
    """`latest` and `read_journal` of `run_dir`; ResumeError where it cannot be resumed."""
    folder, state = latest(run_dir)
    dispatches, outcomes, last_t = read_journal(run_dir)
    try:
        last_alive = (run_dir / "coordinator.json").stat().st_mtime
    except OSError:
        last_alive = None
    return Restored(folder, state, dispatches, outcomes, last_t, last_alive)


def read_journal(run_dir: Path) -> tuple[dict[int, dict], dict[str, dict], float]:
    """(dispatch events by group, last execution event by id, last time stamp) from
    metrics.jsonl; a torn last line (the crash) is skipped."""
    dispatches: dict[int, dict] = {}
    outcomes: dict[str, dict] = {}
    last_t = 0.0
    for ev in read_events(run_dir / "metrics.jsonl").events:  # a torn line skipped
        last_t = max(last_t, float(ev.get("t", 0.0)))
        if ev.get("event") == "dispatch":
            dispatches[ev["group"]] = ev
        elif ev.get("event") == "execution":
            outcomes[ev["id"]] = ev
    return dispatches, outcomes, last_t


def redo_id(run_dir: Path, run_id: str) -> str:
    """A fresh execution id for an execution dispatched again (its old folder is kept)."""
    k = 1
    while (run_dir / "executions" / f"{run_id}-r{k}").exists():
        k += 1
    return f"{run_id}-r{k}"


def _discard(folder: Path) -> None:
    """A checkpoint folder that is not (or no longer) a whole checkpoint, removed: state.json
    first, so a reader never takes what is left for complete. A failure is a warning."""
    try:
        (folder / "state.json").unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    except OSError as e:
        log.warning("could not remove the incomplete checkpoint %s (%s)", folder, e)


# --- the run's side -----------------------------------------------------------------------


class Checkpoints:
    """The run's checkpoints: saved (the core's trainer through the link, then the state its
    owners give), released (executions whose records a checkpoint holds, out of memory) and
    restored on a resume, each owner from the run directory's `Restored`."""

    def __init__(self, config, *, steps, executions, cells, buffer: TrajectoryBuffer, tasks: TaskSource,
                 heldout: HeldOut | None):
        self.c = config
        self.steps, self.executions, self.cells, self.buffer = steps, executions, cells, buffer
        self.tasks, self.heldout = tasks, heldout
        # Set at start-up (main.py): the workers, the weights' mover, the journal and the proxy.
        self.link: Any = None
        self.weights: Any = None
        self.metrics: Any = None
        self.proxy: Any = None

    async def save(self) -> None:
        """The core's trainer, then the state: at a publication (no batch in flight), or at the
        end of a run (a batch in flight was cancelled and its groups given back, main.py)."""
        t0 = time.monotonic()
        folder = step_dir(self.c.run_dir, self.steps.steps_done)
        if folder.exists():  # of a stretch lost to a crash (or torn), written again now: never half old, half new
            _discard(folder)
        link = self.link
        try:
            folder.mkdir(parents=True, exist_ok=True)
            await link.request(self.cells.nodes[0], wire.SaveCheckpoint(path=str(folder / "trainer.pt")),
                               timeout=self.c.checkpoint_timeout_s)
        except Exception as e:  # the worker's error names the errno (workerd/checkpointio.py)
            _discard(folder)
            cause = named(Path(e.filename or folder), e) if isinstance(e, OSError) else e
            raise CheckpointError(f"the checkpoint of step {self.steps.steps_done} failed, nothing of it kept "
                                  f"({self._last_saved()}): {cause}") from None
        try:  # the journal and the records the state will name, on disk (fsync) before the state says so
            self.metrics.sync()
            self.proxy.sync()
        except JournalError as e:
            _discard(folder)
            log.warning("checkpoint of step %d not completed: the journal cannot be synced (%s); the next one retries",
                        self.steps.steps_done, e)
            return
        await failpoints.hold("checkpoint", self.c.run_dir)
        try:
            self._write_state(folder)
        except OSError as e:
            _discard(folder)
            raise CheckpointError(f"the checkpoint of step {self.steps.steps_done} failed, nothing of it kept "
                                  f"({self._last_saved()}): {named(Path(e.filename or folder), e)}") from None
        self.steps.checkpointed_step = self.steps.steps_done
        pruned = prune_checkpoints(self.c.run_dir, self.steps.steps_done, self.c.keep_checkpoints)
        self.metrics.emit("checkpoint", step=self.steps.steps_done, version=self.steps.version, path=str(folder),
                           seconds=round(time.monotonic() - t0, 3), **({"deleted": pruned} if pruned else {}))
        self.release_done()
        await failpoints.hold("checkpointed", self.c.run_dir)


    def _last_saved(self) -> str:
        return f"the last is step {self.steps.checkpointed_step}" if self.steps.checkpointed_step else "none saved yet"




    def _write_state(self, folder: Path) -> None:
        write_state(self.c.run_dir, self.steps.steps_done, {
            "step": self.steps.steps_done, "version": self.steps.version, "publications": self.steps.publications,
            # The core's own version (ahead of the published one after a burst's last step): a
            # workerd whose trainer is at it holds this checkpoint's trainer (restore).
            "trainer_version": self.steps.trainer_version,
            "steps_in_burst": self.steps.steps_in_burst, "groups_dispatched": self.executions.groups_dispatched,
            "replacements": self.executions.replacements,
            "consumed": sorted(g.id for g in self.buffer.groups.values() if g.state == "consumed"),
            # Groups of a lost stretch not dispatched again yet (see restore): still held.
            "held": [ev["group"] for ev in self.executions.held],
            "ahead": [ev["group"] for ev in self.executions.held if ev.get("ahead")],
            "tasks": self.tasks.state(), "tokens_trained": self.steps.tokens_trained})


    def release_done(self) -> int:
        """Executions that will never be read again out of memory, once a checkpoint has their
        records on disk: those of trained (consumed) and dropped groups, and of complete held-out
        rounds. Their trees and call records stayed in the proxy otherwise, for the whole run
        (bench/soak.py: the coordinator grew with every execution). Returns how many went."""
        batch = self.steps.in_flight()
        packing = {g.id for g in batch.taken} if batch is not None else set()  # a step in flight still reads them
        runs = [r for g in self.buffer.groups.values()
                if g.state in ("consumed", "dropped") and g.id not in packing for r in g.runs]
        if self.heldout is not None:
            runs += [r for rd in self.heldout.rounds.values() if rd.closed == len(rd.runs) for r in rd.runs]
        n = 0
        for run in runs:
            if run.recorder is not None and run.closed and run.recorder.closed:
                self.proxy.release(run.id)
                run.recorder = None
                n += 1
        return n


    async def save_final(self) -> None:
        """Every end keeps what was trained: a checkpoint of the last step, unless one exists
        (main.py's shutdown, after the step in flight was settled)."""
        if not self.steps.steps_done or self.steps.checkpointed_step == self.steps.steps_done or 0 in self.cells.dead:
            return
        try:
            await self.save()
        except Exception as e:  # noqa: BLE001 - the run's own error (if any) matters more
            log.error("the final checkpoint (step %d) failed: %s", self.steps.steps_done, e)
            return
        log.info("checkpoint of step %d saved: %s", self.steps.steps_done,
                 step_dir(self.c.run_dir, self.steps.steps_done) / "trainer.pt")


    def counts(self, restored: Restored) -> None:
        """The run's counts at the checkpoint (steps done and checkpointed, publications, the
        burst, tokens trained, the version) before anything starts: a resumed run shows step
        3/5 while its workers load, never 0/5 (`restore` sets them again, the version from the
        weights loaded)."""
        st, steps = restored.state, self.steps
        steps.steps_done, steps.publications = st["step"], st["publications"]
        steps.checkpointed_step = st["step"] if restored.checkpoint is not None else None
        steps.trainer_version = steps.version = st.get("version", 0) if restored.checkpoint is not None else 0
        if restored.checkpoint is not None:
            steps.trainer_version = st.get("trainer_version", steps.version)
        steps.steps_in_burst = st.get("steps_in_burst", 0)
        if steps.steps_in_burst >= self.c.mu:
            # Stopped after a burst's last step, before its publication: loading the trainer's
            # weights into every engine (restore) is that publication (its dispatch follows).
            steps.publications += 1
            steps.steps_in_burst = 0
        steps.tokens_trained = st.get("tokens_trained", 0)

    async def restore(self, restored: Restored, kept: dict[int, tuple[int, int | None]] | None = None) -> None:
        """The latest checkpoint into the core and every engine; the buffer from the journal.

        `kept`: the cells whose workerd outlived the earlier coordinator and kept its backends,
        its trainer at the version resumed (LocalCluster.kept_cells: cell -> (engine version,
        trainer version)). A core that kept them holds the checkpoint's weights and optimizer
        state already (a step it had not applied was dropped with its gradients): nothing is
        loaded, and only the cells not already at that version are sent the weights.

        Dispatch continues as an uninterrupted run's would have from the checkpoint: groups
        dispatched after it (at publications lost with the model: a kill -9 between
        checkpoints) are held and dispatched again, under their own ids and tasks, at the
        publications that first dispatched them, with the version published then. Counting
        them in the pipeline at once would keep (phi + mu) * B more groups in flight than the
        run asked for, and every later step would train groups that many versions stale."""
        st, folder, restored_from = restored.state, restored.checkpoint, restored
        dispatches, outcomes = restored.dispatches, restored.outcomes
        core, link = self.cells.nodes[0], self.link
        self.counts(restored)  # without a checkpoint: the model directory's weights, which every cell loaded
        version = self.steps.trainer_version  # what the engines serve once restored: the trainer's
        kept = {cell: v for cell, v in (kept or {}).items() if v[1] == version}
        loaded_checkpoint = folder is not None and 0 not in kept
        if loaded_checkpoint:
            path = str(folder / "trainer.pt")
            loaded = await link.request(core, wire.LoadCheckpoint(path=path),
                                        timeout=self.c.checkpoint_timeout_s)
            version = loaded.version
            kept = {}  # the weights loaded now go to every engine
        self.steps.trainer_version = self.steps.version = version
        self.weights.forget(version)
        # Each engine's version: a kept one's own, a new one's the model directory's (0).
        behind = [i for i in range(len(self.cells.nodes)) if kept.get(i, (0,))[0] != version]
        if 0 in behind:
            await link.request(core, wire.LoadWeights(version=version))
        if others := [i for i in behind if i]:
            await self.weights.push(others, engine=True, version=version)
        if st["tasks"] is not None:  # else the task source is at its start, as the run was
            try:
                self.tasks.restore(st["tasks"])
            except TaskError as e:
                raise ResumeError(str(e)) from None
        ex = self.executions
        restored, redone = ex.restore(st, dispatches, outcomes)
        consumed, held = set(st["consumed"]), set(st.get("held", ()))
        # Up to what the run had dispatched by this publication, held groups first: a run with
        # no checkpoint yet (its initial fill), one stopped before its burst's publication, or
        # one checkpointed at its last step and extended with `--steps` dispatches its next
        # groups now, or it would wait for groups forever.
        scheduled = st["groups_dispatched"] - len(held) - ex.replacements  # boundary dispatches so far
        steps = self.steps
        short = self.c.dispatch_target(steps.publications) - scheduled if steps.steps_done < self.c.steps else 0
        while short > 0 and ex.held:
            ev = ex.held.popleft()
            if ev.get("ahead"):  # out already (restore): this dispatch is its place
                short -= 1
                continue
            group, k, r = ex.release(ev, adopt=True)
            restored, redone = restored + k, redone + r
            if group.state == "dropped":  # as when it first ran: its replacement follows
                ex.replacements += 1
            else:
                short -= 1
        # The restart's cost as the harnesses saw it: from the earlier coordinator's last sign of
        # life to now, the proxy serving again (the run's own clock leaves that gap out).
        down_s = round(time.time() - restored_from.last_alive, 1) if restored_from.last_alive else None
        held_later = sum(not ev.get("ahead") for ev in ex.held)
        self.metrics.emit("resume", step=self.steps.steps_done, version=self.steps.version, down_s=down_s,
                           checkpoint=str(folder) if folder is not None else None,
                           checkpoint_loaded=loaded_checkpoint, workers_kept=len(kept),
                           executions_restored=restored, executions_adopted=len(ex.adopting),
                           executions_redispatched=redone - len(ex.adopting),
                           groups=len(dispatches) - len(consumed & set(dispatches)), groups_held=held_later)
        log.info("resumed at step %d (version %d, %s, %s%s): %d closed executions restored, %d still running "
                 "adopted, %d dispatched again%s", self.steps.steps_done, self.steps.version,
                 f"down {down_s:.1f} s" if down_s is not None else "downtime unknown",
                 folder.name if folder is not None else "no checkpoint yet: from the start",
                 f"; {len(kept)} of {len(self.cells.nodes)} workers kept their weights" + (
                     ", nothing loaded" if 0 in kept else "") if kept else "",
                 restored, len(ex.adopting), redone - len(ex.adopting),
                 f", {held_later} groups held for later publications" if held_later else "")
        if short > 0:
            ex.dispatch(short)
