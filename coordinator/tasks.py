"""tasks.py: what an execution works on: tasks, their JSONL files, workspaces, the task source.

A task is a prompt plus the files of a fresh workspace and an evaluator spec; `load_tasks`
reads them from JSONL with errors that name the line and field, `default_tasks` is the
embedded set the tiny demo policy can learn, and `TaskSource` hands them out in a seeded
order. A task file is not trusted: `check_links` refuses a link out of a task's folder and
timeouts are held to MAX_TIMEOUT_S. Not the launcher (it starts no harness) and not the evaluator (it scores nothing).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gyre.workerd.wire import GyreError

TASK_FILE = "task.txt"  # the prompt, where the demo harness looks when given no --task
FIELDS = ("id", "prompt", "workspace", "template_dir", "evaluator", "target", "timeout_s", "meta")
# A task file's numbers are bounded at load: past these they are typos or attacks (1e308 s
# overflowed a deadline; 1e9 CPUs reached the engine and every execution failed as infra).
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week, for every timeout a task sets


class TaskError(GyreError):
    """A task file or task that cannot be used: the message names the line and field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Environment:
    """What a task's sandbox starts from (Harbor's [environment], a SWE row's image): a ready
    image or a folder to build, and the limits it asks for. None: no limit asked."""

    image: str | None = None  # an image name (present, pulled when missing)
    build_dir: str | None = None  # absolute: a folder with a Dockerfile, the build context
    dockerfile: str | None = None  # the Dockerfile's name in build_dir; None: "Dockerfile"
    build_timeout_s: float = 600.0
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    allow_internet: bool = False  # refused unless the run config allows sandboxes the internet
    workdir: str | None = None  # where the agent starts; None: the image's WORKDIR


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One task: the prompt, a fresh workspace's contents and how to score it."""

    id: str
    prompt: str
    workspace: dict[str, str] = field(default_factory=dict)  # relative path -> file content
    template_dir: str | None = None  # copied into the workspace before `workspace` is written
    evaluator: dict = field(default_factory=dict)  # evaluator spec; {} -> the source's default
    target: str | None = None  # the expected answer, for the similarity evaluator
    timeout_s: float | None = None  # the execution's budget; None -> the run's default
    meta: dict = field(default_factory=dict)  # anything else the task file carried
    # Sandboxed tasks (Harbor folders, SWE-style rows): see taskformats.py and verifier.py.
    environment: Environment | None = None  # None: no image; any backend runs it
    tests_dir: str | None = None  # absolute: copied to /tests only after the agent stops
    solution_dir: str | None = None  # absolute: copied to /solution for `--solution` (solve.sh)
    # run inside the sandbox (harbor | swe); {}: `evaluator`. Harbor's "environment": "agent" (absent: fresh).
    verifier: dict = field(default_factory=dict)


def check_relpath(path: Any) -> PurePosixPath:
    """A workspace path as given, or TaskError: relative, no `..`, no NUL, not empty."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise TaskError(f"bad workspace path {path!r}: must be a non-empty string")
    p = PurePosixPath(path.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts or p.parts in ((), (".",)):
        raise TaskError(f"workspace path {path!r} escapes the workspace")
    return p


# ---------------------------------------------------------------------------------------------
# JSONL


def _field_error(where: str, name: str, why: str) -> TaskError:
    return TaskError(f"{where}: field {name!r}: {why}")


def _optional_str(obj: dict, name: str, where: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise _field_error(where, name, f"must be a string or null, got {type(value).__name__}")
    return value


def _dict_field(obj: dict, name: str, where: str) -> dict:
    value = obj.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _field_error(where, name, f"must be an object, got {type(value).__name__}")
    return value


def _workspace_field(obj: dict, where: str) -> dict[str, str]:
    files = _dict_field(obj, "workspace", where)
    for path, content in files.items():
        try:
            check_relpath(path)
        except TaskError as e:
            raise _field_error(where, "workspace", str(e)) from None
        if not isinstance(content, str):
            raise _field_error(where, "workspace", f"content of {path!r} must be a string")
    return files


def _timeout_field(obj: dict, where: str) -> float | None:
    value = obj.get("timeout_s")
    if value is None:
        return None
    # bool is an int subclass: `true` is not a timeout.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _field_error(where, "timeout_s", f"must be a positive number or null, got {value!r}")
    if value > MAX_TIMEOUT_S:
        raise _field_error(where, "timeout_s", f"must be at most {MAX_TIMEOUT_S:g} s (a week), got {value!r}")
    return float(value)


def _template_field(obj: dict, where: str, base: Path) -> str | None:
    value = _optional_str(obj, "template_dir", where)
    if value is None:
        return None
    # Relative to the task file, so a task set and its templates move together; never out of
    # its folder (a template of "/root/.ssh" would copy the host's keys to the agent).
    path = (base / value).resolve()
    try:
        inside(base.resolve(), path, "the task file's folder")
        if not path.is_dir():
            raise TaskError(f"{path} is not a directory")
        check_links(path, ["."], "the template folder")  # make_workspace follows the template's links
    except TaskError as e:
        raise _field_error(where, "template_dir", str(e)) from None
    return str(path)


# ---------------------------------------------------------------------------------------------
# Task files stay inside their folder: a link or path out of it would hand a host file to the
# agent (as its prompt, its workspace) or to the verifier (as /tests).


def inside(root: Path, path: Path, what: str) -> None:
    """TaskError unless the resolved `path` lies in the resolved `root` (`what` names root)."""
    if not path.is_relative_to(root):
        raise TaskError(f"{path} is outside {what} {root}")


def check_links(root: Path, rels: Iterable[str], what: str = "the task folder") -> None:
    """TaskError naming the first link at or under `root/rel` (each rel) whose target lies
    outside `root` (resolved); links that stay inside are fine. `what` names root."""
    root = root.resolve()
    for rel in rels:
        for path in _entries(root / rel):
            if not path.is_symlink():
                continue
            try:
                target: Path | None = path.resolve(strict=False)
            except (OSError, RuntimeError):  # a loop: it leads nowhere of its own
                target = None
            if target is None or not target.is_relative_to(root):
                raise TaskError(f"{root}: {path.relative_to(root).as_posix()} is a link to "
                                f"{target or 'a link loop'}, outside {what}: a task's files must be its own "
                                "(copy them in)")


def _entries(top: Path) -> Iterable[Path]:
    """`top` and, when it is a folder, everything under it, links not followed; a link at
    `top` that stays inside is walked where it leads (it is checked first)."""
    yield top
    if not top.is_dir():
        return
    start = top.resolve() if top.is_symlink() else top
    for dirpath, dirnames, filenames in os.walk(start):  # followlinks=False: a link to a folder is an entry
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            yield Path(dirpath, name)


def parse_task(obj: Any, where: str, base: Path) -> Task:
    """One task from a decoded JSON line; `where` prefixes errors, `base` anchors template_dir."""
    if not isinstance(obj, dict):
        raise TaskError(f"{where}: a task must be a JSON object, got {type(obj).__name__}")
    for name in ("id", "prompt"):
        if name not in obj:
            raise _field_error(where, name, "missing")
        if not isinstance(obj[name], str) or not obj[name].strip():
            raise _field_error(where, name, "must be a non-empty string")
    meta = _dict_field(obj, "meta", where)
    unknown = {k: v for k, v in obj.items() if k not in FIELDS}
    if clash := sorted(meta.keys() & unknown.keys()):
        raise _field_error(where, clash[0], "given both at top level and in meta")
    return Task(id=obj["id"], prompt=obj["prompt"], workspace=_workspace_field(obj, where),
                template_dir=_template_field(obj, where, base),
                evaluator=_dict_field(obj, "evaluator", where),
                target=_optional_str(obj, "target", where), timeout_s=_timeout_field(obj, where),
                meta={**meta, **unknown})


def load_tasks(path: str | Path) -> list[Task]:
    """Every task of a JSONL file (one object per line, blank lines ignored), ids unique.

    Blocking file IO: read at startup, before the event loop runs, or via asyncio.to_thread.
    """
    return load_jsonl(path, parse_task, id_field="id")


def load_jsonl(path: str | Path, parse: Callable[[Any, str, Path], Task], *, id_field: str) -> list[Task]:
    """Every row of a JSONL task file through `parse(row, where, folder)` (blank lines
    ignored); the tasks' ids unique, a duplicate named by `id_field` and both lines."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read task file {path}: {e}") from None
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise TaskError(f"{where}: not valid JSON: {e}") from None
        task = parse(obj, where, path.parent)
        if task.id in first_line:
            raise _field_error(where, id_field, f"duplicate id {task.id!r} (first on line {first_line[task.id]})")
        first_line[task.id] = lineno
        tasks.append(task)
    if not tasks:
        raise TaskError(f"{path}: no tasks")
    return tasks


# ---------------------------------------------------------------------------------------------
# The embedded default set


# Short lowercase words, each a handful of bytes for the byte-level tiny policy (1 token per
# byte): a random policy already lands some of their letters, so the similarity score has
# variance within a group from the first step, and the target also appears in the prompt, so
# copying from the context is a shortcut the policy can find. Two phrasings keep it from
# keying on a single template.
DEFAULT_TARGET = "hello"
DEFAULT_PROMPTS = ("Say {w}.", "Reply with: {w}", "Answer with exactly the word {w}.", "Greet me: {w}",
                   "Write {w} and stop.", "One word, {w}.", "Please answer {w}", "Respond: {w}")


def default_tasks() -> list[Task]:
    """The embedded default task set, scored by similarity of answer.txt to the target.

    Eight phrasings of one target word: a 1.5 M-parameter random model cannot read a
    prompt yet, so one target gives it a consistent direction to learn in minutes (the
    byte-level similarity gives partial credit for each right letter in order)."""
    return [Task(id=f"say-{DEFAULT_TARGET}-{i}", prompt=p.format(w=DEFAULT_TARGET), target=DEFAULT_TARGET,
                 evaluator={"type": "similarity"}, meta={"source": "default"})
            for i, p in enumerate(DEFAULT_PROMPTS)]


# ---------------------------------------------------------------------------------------------
# Workspaces and the source


def make_workspace(task: Task, root: Path) -> Path:
    """Create `root` (absent or empty) with the template, the task's files and task.txt.

    Called by the launcher before it starts the harness; blocking file IO, so the
    coordinator calls it through asyncio.to_thread.
    """
    root = Path(root)
    # 1) Validate every path before touching the disk, so a bad task leaves nothing behind.
    files = [(check_relpath(p), content) for p, content in task.workspace.items()]
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise TaskError(f"workspace {root} already exists and is not an empty directory")
    # 2) The template first: the task's own files override it.
    #    Links are followed when copying, so no path below can be led out of root by one.
    if task.template_dir is not None:
        try:
            shutil.copytree(task.template_dir, root, dirs_exist_ok=True)
        except (OSError, shutil.Error) as e:
            raise TaskError(f"task {task.id!r}: cannot copy template_dir {task.template_dir}: {e}") from None
    root.mkdir(parents=True, exist_ok=True)
    base = root.resolve()
    for rel, content in files:
        target = base / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
    # 3) The prompt last, so it is the one the harness reads.
    (base / TASK_FILE).write_text(task.prompt, encoding="utf-8")
    return root


class TaskSource:
    """Hands out tasks forever: each pass over the set in a fresh seeded shuffle.

    The same tasks and seed give the same sequence, so a run's task order is reproducible.
    `default_evaluator` is the spec for tasks whose own spec is empty.
    """

    def __init__(self, tasks: list[Task], *, seed: int = 0, default_evaluator: dict | None = None):
        if not tasks:
            raise TaskError("a task source needs at least one task")
        self.tasks = list(tasks)
        self.default_evaluator = dict(default_evaluator or {})
        self._rng = random.Random(seed)
        self._order: list[Task] = []

    def __len__(self) -> int:
        return len(self.tasks)

    def next_task(self) -> Task:
        if not self._order:
            self._order = self.tasks[:]
            self._rng.shuffle(self._order)  # pop() takes them from the end: still a shuffle
        return self._order.pop()

    def evaluator_spec(self, task: Task) -> dict:
        """The spec to build `task`'s evaluator from: its own, else the source's default."""
        return task.evaluator or self.default_evaluator

    def state(self) -> dict[str, Any]:
        """Where the source is (a checkpoint's `tasks`): its RNG state and the rest of the pass."""
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": [t.id for t in self._order]}

    def restore(self, state: dict[str, Any]) -> None:
        """Back to `state()`'s position; TaskError names the tasks it holds that the set lacks."""
        by_id = {t.id: t for t in self.tasks}
        missing = [i for i in state["order"] if i not in by_id]
        if missing:
            raise TaskError(f"the task set changed since the checkpoint: task(s) {missing[:5]} are gone")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._order = [by_id[i] for i in state["order"]]
