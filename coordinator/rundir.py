"""rundir.py: a run directory's ownership: one live `gyre up` per directory, and what it holds.

`claim()` takes an exclusive `flock` on `RUN_DIR/.lock` (released by the kernel when the
process exits, however it exits) and writes the holder's pid into it, so a second `gyre up`
on a live run directory is refused naming that pid. A new run is refused in a directory
that already holds one (finished, stopped or crashed: `config.json` is there), with a
message naming `--resume` or a new directory; `--resume` needs one. Paths are made
absolute here, before anything is written. Not the checkpoints: resume.py reads those (state()
asks it whether the last step's is intact).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson

from gyre.workerd.wire import GyreError

LOCK = ".lock"
TAIL_BYTES = 1 << 20  # state() reads only the end of metrics.jsonl: a long run's journal is large


class RunDirError(GyreError):
    """A run directory that this command cannot use; the message says why and what to do."""


def absolute(path: Path | str) -> Path:
    """`path` against the working directory, normalised, symlinks kept (as os.path.abspath)."""
    return Path(os.path.abspath(os.path.expanduser(str(path))))


RUN_ID = ".run-id"


def run_id(run_dir: Path) -> str:
    """The run's identity, made at its first start (`RUN_DIR/.run-id`): a workerd keeps its
    backends across a coordinator's restart only for the same run (wire.Welcome.run), never
    for a new run made in the same place."""
    path = run_dir / RUN_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        import secrets

        made = secrets.token_hex(8)
        path.write_text(made + "\n")
        return made


@dataclass
class RunLock:
    run_dir: Path
    file: IO[str] | None

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the descriptor drops the flock
            self.file = None


@dataclass(frozen=True, slots=True)
class RunState:
    """What a run directory holds: `kind` is "none" (no run started there), "finished",
    "stopped" (a graceful stop before its target) or "crashed" (no closing summary)."""

    kind: str
    steps_done: int = 0
    steps_target: int | None = None
    unsaved: int = 0  # steps trained after the newest intact checkpoint: a resume trains them again


def state(run_dir: Path) -> RunState:
    """What `run_dir` holds, from config.json's target and metrics.jsonl's last events. A
    run is finished only where the checkpoint of its last step is there and intact: one
    whose last save failed (a full disk) or is torn "stopped" at the step it can resume
    from, `unsaved` the steps after it."""
    from gyre.coordinator.metrics import read_events  # here, not at the top: it loads numpy (proxy/records.py)

    config = run_dir / "config.json"
    if not config.exists():
        return RunState("none")
    try:
        target = orjson.loads(config.read_bytes()).get("steps")
    except (orjson.JSONDecodeError, AttributeError):
        target = None
    if not isinstance(target, int) or isinstance(target, bool):
        target = None  # a damaged config: its target is unknown (build_config names the field)
    done, summary = 0, None
    for ev in read_events(run_dir / "metrics.jsonl", tail=TAIL_BYTES).events:
        if ev.get("event") == "step":
            done, summary = max(done, int(ev.get("step", 0))), None
        elif ev.get("event") == "summary":
            done, summary = int(ev.get("steps", done)), ev
        elif ev.get("event") == "resume":
            done, summary = int(ev.get("step", done)), None
    if summary is None:
        return RunState("crashed", done, target)
    saved = _saved_step(run_dir, done)
    if saved < done:
        return RunState("stopped", saved, target, unsaved=done - saved)
    if target is not None and done >= target:
        return RunState("finished", done, target)
    return RunState("stopped", done, target)


def unsaved(s: RunState) -> str:
    """'step 3' or 'steps 3-5': the steps a run trained after its newest intact checkpoint."""
    first, last = s.steps_done + 1, s.steps_done + s.unsaved
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _saved_step(run_dir: Path, done: int) -> int:
    """`done` where its checkpoint is intact (or no step was trained), else the step of the
    newest intact checkpoint a resume would load (0: none)."""
    from gyre.coordinator.resume import intact, newest_intact, step_dir

    if done <= 0 or intact(step_dir(run_dir, done))[0] is not None:
        return done
    folder, st, _ = newest_intact(run_dir)
    return int(st["step"]) if folder is not None and isinstance(st.get("step"), int) else 0


def claim(run_dir: Path, *, resume: bool = False, command: str = "up") -> RunLock:
    """Lock `run_dir` for this process (created if missing, unless resuming); refuse a
    directory another process holds, and a new run where one already started (`command`:
    "up", or "serve", whose directories are never resumed)."""
    run_dir = absolute(run_dir)
    if resume and not (run_dir / "config.json").exists():
        raise RunDirError(f"{run_dir / 'config.json'} does not exist: not a gyre run directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(run_dir / LOCK, "a+")
    except OSError as e:
        raise RunDirError(f"run directory {run_dir}: {e.strerror or e}") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirError(f"run directory {run_dir} is in use by another gyre process (pid {holder}); "
                          "stop it, wait for it to finish, or choose another --run-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    lock = RunLock(run_dir, f)
    if not resume:
        s = state(run_dir)
        if s.kind != "none":
            lock.release()
            if command == "serve":
                raise RunDirError(f"run directory {run_dir} was used by an earlier gyre run; choose a new --run-dir")
            raise RunDirError(_refusal(run_dir, s))
    return lock


def fresh(path: Path) -> Path:
    """Create `path`, or `path-2`, `path-3`, ... where it exists: a new, empty directory no
    other process chose (mkdir is atomic), for default run directory names."""
    path = absolute(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for k in range(1, 1000):
            candidate = path if k == 1 else path.with_name(f"{path.name}-{k}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                continue
    except OSError as e:
        raise RunDirError(f"run directory {path}: {e.strerror or e}") from None
    raise RunDirError(f"run directory {path}: 999 directories of that name exist; choose a --run-dir")


def live_coordinator(run_dir: Path) -> bool:
    """Whether the coordinator named by RUN_DIR/coordinator.json is still running (its pid)."""
    try:
        pid = int(orjson.loads((run_dir / "coordinator.json").read_bytes())["pid"])
        os.kill(pid, 0)
    except PermissionError:
        return True  # alive, another user's
    except (OSError, KeyError, ValueError, TypeError, orjson.JSONDecodeError):
        return False
    return True


def _refusal(run_dir: Path, s: RunState) -> str:
    of = f"{s.steps_done}/{s.steps_target}" if s.steps_target is not None else f"{s.steps_done}"
    if s.kind == "finished":
        return (f"run directory {run_dir} holds a finished run ({of} steps): extend it with "
                f"`gyre up --resume {run_dir} --steps N`, or choose a new --run-dir")
    how = "stopped" if s.kind == "stopped" else "crashed (no closing summary)"
    if s.unsaved:
        of += f" ({unsaved(s)} trained but never saved)"
    return (f"run directory {run_dir} holds a run that {how} at step {of}: continue it with "
            f"`gyre up --resume {run_dir}`, or choose a new --run-dir")


def holder(run_dir: Path) -> int | None:
    """The pid of the process holding RUN_DIR's lock (it writes its pid there once it holds
    it); None when nobody holds it, or the file does not say."""
    if not held(run_dir):
        return None
    try:
        return int((run_dir / LOCK).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def held(run_dir: Path) -> bool:
    """Whether some process holds RUN_DIR's lock (a live `gyre up` or `gyre serve` there).
    Asked about another process's directory: from the holder's own process the answer is
    also True (flock locks belong to open files, not processes)."""
    try:
        f = open(run_dir / LOCK)
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False
