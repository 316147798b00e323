"""evaluator.py: scores a preserved workspace, and retries failed evaluations within a budget.

Three evaluators share one async interface: similarity of answer.txt to the task's target
(the embedded default), an external command that prints JSON, and a Python callable.
`evaluate_with_retries` turns exceptions into failed attempts and a run of failures into an
invalid outcome with no score: a missing reward is never filled in as 0; a score that is not
finite or lies outside the run's reward_range (`valid_reward`) is no reward either. Not the
launcher, and not where rewards become advantages.

A host-side command evaluator runs where the agent's files are: whatever its tools pick up
from the workspace (pytest's conftest.py, a module `python -m` finds in the working folder, a
.pth there) runs with it. So it never runs on the workspace itself nor with the coordinator's
privileges: it runs on a fresh copy (links copied as links, never followed), one per
workspace, shared by its retries. As root with bubblewrap it runs jailed as bubblewrap.py
jails a harness: an unprivileged uid of the evaluators' own range with no capability, the
system, this Python, gyre's coordinator package and its own command's folders read-only, the
folder of the run directory it would show covered, the copy writable and mounted where the
workspace was (cwd and GYRE_WORKSPACE unchanged), no network, a private PID namespace that ends
with it, and only PATH, TERM, the locale, HOME=/tmp and its GYRE_* variables for environment.
As root without bubblewrap it runs on the copy as that uid through setpriv (no capability; it
sees the host as any unprivileged user does, and its own files must be readable by one); as a
user other than root, on the copy as that user.
What that guarantees: agent-written code run by the evaluator cannot act as root, write the
host (the saved workspace included), read another execution or the coordinator's environment,
or outlive the attempt. What it cannot: an evaluator that imports or runs the agent's code puts
its own result in that code's hands, which may print any score; only an evaluator that keeps
the agent's files out of its own process (pytest with --rootdir/--confcutdir at its own tests
and `-p no:cacheprovider`, `python -I`, reading files as data) or a verifier in a fresh
container (verifier.py) scores honestly against a hostile agent. Its network is gone too: an
evaluator that calls a service (an LLM judge) belongs in a python evaluator, which runs in the
coordinator's own process and so must read the workspace as data, never import or run it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gyre.coordinator.sandbox import bubblewrap as jail
from gyre.coordinator.sandbox.base import COPY_LIMIT_BYTES
from gyre.coordinator.sandbox.files import copy_capped
from gyre.coordinator.sandbox.process import end_pipes, exit_of
from gyre.coordinator.tasks import Task
from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")

ANSWER_FILE = "answer.txt"  # where the demo harness writes its final answer
MAX_ANSWER_BYTES = 64 * 1024
MAX_COMPARED_CHARS = 1024  # the LCS is O(len(answer) * len(target)); see similarity()
REAP_TIMEOUT_S = 5.0  # waiting for a SIGKILLed evaluator to be reaped
OUTPUT_GRACE_S = 2.0  # output still coming once the command has exited (a child holding its pipes)
STDOUT_TAIL, STDERR_TAIL = 1 << 20, 64 << 10  # what is kept of an evaluator's output (the result is the last line)
REWARD_RANGE = (-1e6, 1e6)  # the run config's default reward_range


class EvaluatorError(GyreError):
    """An evaluator spec or configuration that cannot work: no attempt will ever succeed."""


class EvaluatorFailed(GyreError):
    """One evaluation attempt failed (crash, timeout, unreadable output): worth a retry."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """An evaluation's result. valid=False with score None: no reward (never read it as 0)."""

    score: float | None
    valid: bool
    ref: str  # short: what was compared, or the command's own reference
    error: str | None = None
    attempts: int = 1


class Evaluator(Protocol):
    async def evaluate(self, task: Task, workspace: Path) -> Outcome: ...


def valid_reward(value: Any, reward_range: tuple[float, float] = REWARD_RANGE) -> str | None:
    """None when `value` can be trained on: a number (not a bool), finite, within
    `reward_range` (low and high included); else why not, in a few words. Pure: the launcher
    asks at the evaluator's boundary, resume of the rewards it journaled."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"reward {value!r} is not a number"
    if not math.isfinite(value):
        return f"reward {value} is not finite"
    low, high = reward_range
    if not low <= value <= high:
        return f"reward {value:g} is outside reward_range [{low:g}, {high:g}]"
    return None


def outcome_from_dict(result: Any, default_ref: str) -> Outcome:
    """`{"score": number, "valid": bool = true, "ref": str = default_ref}` as an Outcome."""
    if not isinstance(result, dict):
        raise EvaluatorFailed(f"result must be a JSON object, got {type(result).__name__}")
    valid, ref, score = result.get("valid", True), result.get("ref", default_ref), result.get("score")
    if not isinstance(valid, bool):
        raise EvaluatorFailed(f"'valid' must be a boolean, got {valid!r}")
    if not isinstance(ref, str):
        raise EvaluatorFailed(f"'ref' must be a string, got {type(ref).__name__}")
    # An invalid outcome may omit its score; a valid one must carry a finite number.
    if score is None and not valid:
        return Outcome(score=None, valid=False, ref=ref)
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise EvaluatorFailed(f"'score' must be a finite number, got {score!r}")
    return Outcome(score=float(score), valid=valid, ref=ref)


# ---------------------------------------------------------------------------------------------
# Similarity (the embedded default)


def _normalize(text: str) -> str:
    return " ".join(text.split()).lower()


def _lcs_length(a: str, b: str) -> int:
    # One row of the classic DP, over the shorter string.
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for ca in a:
        prev_diag = 0
        for j, cb in enumerate(b, start=1):
            prev_diag, row[j] = row[j], prev_diag + 1 if ca == cb else max(row[j], row[j - 1])
    return row[-1]


def similarity(answer: str, target: str) -> float:
    """2·LCS / (len(answer) + len(target)) after trimming, collapsing whitespace and lowercasing.

    Why this measure: it is the F1 of an in-order character match (precision: how much of
    the answer is the target; recall: how much of the target the answer holds), equal to
    1 - indel distance / total length. It is 1.0 only for the exact target, a prefix earns
    its share ("hel" of "hello": 0.75), the target's letters out of order still earn some
    ("olleh": 0.4), and garbage around a right answer costs in proportion to its length, so
    the policy gains both by landing the letters and by stopping. Normalized Levenshtein
    ranks answers much the same way; this one was chosen because, as an F1 with no
    substitution step, each point of score maps to characters matched (it is what difflib's
    ratio() approximates), and it is symmetric in which string is longer.
    """
    a, t = _normalize(answer), _normalize(target)
    if not a and not t:
        return 1.0
    # Matches past the first MAX_COMPARED_CHARS are dropped: with an answer that long the
    # score is at most 2·len(t)/len(a) anyway, and the DP stays cheap.
    lcs = _lcs_length(a[:MAX_COMPARED_CHARS], t)
    return 2.0 * lcs / (len(a) + len(t))


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class SimilarityEvaluator:
    """Scores answer.txt against task.target with `similarity`; partial credit in [0, 1]."""

    async def evaluate(self, task: Task, workspace: Path) -> Outcome:
        if task.target is None:
            raise EvaluatorError(f"task {task.id!r}: the similarity evaluator needs a target")
        return await asyncio.to_thread(self._score, task.target, Path(workspace))

    @staticmethod
    def _score(target: str, workspace: Path) -> Outcome:
        path = workspace / ANSWER_FILE
        # The harness left nothing (or something that is not a file): the evaluation itself
        # worked and the answer is worth nothing, so this is a valid 0, not a failure.
        if not path.exists():
            return Outcome(score=0.0, valid=True, ref=f"no {ANSWER_FILE}")
        if not path.is_file():
            return Outcome(score=0.0, valid=True, ref=f"{ANSWER_FILE} is not a file")
        with path.open("rb") as f:
            answer = f.read(MAX_ANSWER_BYTES).decode("utf-8", errors="replace")
        return Outcome(score=similarity(answer, target), valid=True,
                       ref=f"{_short(answer.strip())} vs {_short(target)}")


# ---------------------------------------------------------------------------------------------
# Command and callable


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # start_new_session=True made the command a group leader: its children die with it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone (the group with it)


def _tail(data: bytes, limit: int = 300) -> str:
    return " ".join(data.decode("utf-8", errors="replace").split())[-limit:]


async def _read_into(stream: asyncio.StreamReader, buf: bytearray, keep: int) -> None:
    """The stream's last `keep` bytes into `buf`, as they come (a cancelled read leaves what it had)."""
    while chunk := await stream.read(65536):
        buf += chunk
        del buf[:-keep]


def _evaluator_uid(workspace: str) -> int:
    """The uid a jailed evaluator runs as: in a range of its own, above every sandbox's, so
    it never shares one with the agent whose work it scores."""
    return jail.UID_BASE + jail.UID_SPAN + zlib.crc32(workspace.encode()) % jail.UID_SPAN


def _remove_copies(copies: dict[str, str]) -> None:
    for folder in copies.values():
        shutil.rmtree(folder, ignore_errors=True)
    copies.clear()


def _command_roots(argv: list[str], workspace: str) -> list[str]:
    """What a jail shows read-only of the command's own files (its program as found on PATH,
    and every absolute path among its arguments), each as named and resolved: a file's folder
    where any user may read it (a script's helper modules come along), else the file alone (a
    0700 folder would bar the jail's uid; the folders bwrap makes above a mount are 0755). The
    system's are there anyway; one inside the workspace comes from the copy."""
    found = [shutil.which(argv[0]) or argv[0], *(a for a in argv[1:] if os.path.isabs(a))]
    roots = set()
    for path in found:
        for p in (os.path.abspath(path), os.path.realpath(path)):
            if os.path.isdir(p):
                roots.add(p)
            elif os.path.exists(p):
                folder = os.path.dirname(p)
                roots.add(folder if os.stat(folder).st_mode & 0o005 == 0o005 else p)
    return sorted(r for r in roots if r != "/" and not jail.within(r, jail.SYSTEM_RO)
                  and not jail.within(r, [workspace]))


class CommandEvaluator:
    """Runs `argv` on a fresh copy of the workspace; its last non-empty stdout line is the
    JSON result. Jailed as the module docstring says: the agent's files never run with the
    coordinator's privileges, and the workspace itself is never written.

    Environment: GYRE_WORKSPACE, GYRE_TASK_ID, GYRE_TASK_PROMPT and, when the task has one,
    GYRE_TARGET (plus PATH, TERM, the locale and HOME). A non-zero exit, a timeout or
    unreadable output is a failed attempt. The attempt ends when the command exits: output its
    children still send is read for OUTPUT_GRACE_S, then its process group is killed (nothing
    of it outlives the attempt), and only the tails of its output are kept. `release` (or the
    evaluator's end) removes a workspace's copy.
    """

    def __init__(self, argv: list[str], timeout_s: float):
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self._copies: dict[str, str] = {}  # workspace -> the temporary folder holding its copy
        self._finalizer = weakref.finalize(self, _remove_copies, self._copies)

    def release(self, workspace: Path) -> None:
        """Remove the copy made for `workspace` (evaluate_with_retries calls it once done)."""
        folder = self._copies.pop(str(Path(workspace).absolute()), None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _copy_of(self, workspace: Path, uid: int | None) -> str:
        """The workspace's copy (made on the first attempt, shared by the retries), handed to
        `uid` when the evaluator drops to one."""
        key = str(workspace.absolute())
        if key in self._copies:
            return os.path.join(self._copies[key], "workspace")
        folder = tempfile.mkdtemp(prefix="gyre-eval-")
        self._copies[key] = folder
        copy = os.path.join(folder, "workspace")
        if workspace.is_dir():
            report = copy_capped(workspace, Path(copy), COPY_LIMIT_BYTES)
            if report.truncated:  # a score of part of the work would be a wrong score
                raise EvaluatorError(f"workspace larger than the evaluator's copy cap: {report.problem()}")
        else:
            os.mkdir(copy)
        if uid is not None:
            os.chmod(folder, 0o711)  # the uid passes through to its copy, and lists nothing else
            jail.hand_over(copy, uid)
        return copy

    def _command(self, workspace: Path, env: dict[str, str]) -> tuple[list[str], str, dict[str, str]]:
        """(command line, host cwd, environment) for one attempt, by what this host allows."""
        program = self.argv[0]
        if "/" in program and not os.path.isabs(program):  # relative to the folder it runs in, as exec finds it
            program = os.path.join(os.path.abspath(workspace), program)
        if shutil.which(program) is None:
            raise EvaluatorFailed(f"cannot start {self.argv[0]!r}: not found or not executable")
        tools = {t: shutil.which(t) for t in ("bwrap", "setpriv")}
        if os.geteuid() != 0:  # already unprivileged: the copy keeps the workspace as it was
            copy = self._copy_of(workspace, None)
            return self.argv, copy, jail.allowed_env({**env, "GYRE_WORKSPACE": copy})
        if tools["setpriv"] is None:
            raise EvaluatorError("a host evaluator will not run agent-written files as root without setpriv; "
                                 "install it (apt-get install -y util-linux bubblewrap)")
        inside = os.path.realpath(workspace)
        uid = _evaluator_uid(inside)
        copy = self._copy_of(workspace, uid)
        if tools["bwrap"] is None:  # the host as an unprivileged user sees it, the copy its only own place
            return [*jail.jail(tools["setpriv"], uid), *self.argv], copy, jail.allowed_env(
                {**env, "GYRE_WORKSPACE": copy})
        readable = jail.harness_roots() + _command_roots(self.argv, inside)
        # A folder shown that holds the workspace would show its run: the part toward it is covered.
        hidden = sorted({os.path.join(r, os.path.relpath(inside, r).split("/")[0]) for r in readable
                         if jail.within(inside, [r]) and inside != r})
        argv = jail.confined_argv(self.argv, bwrap=tools["bwrap"], setpriv=tools["setpriv"], uid=uid, cwd=inside,
                                  readable={r: r for r in readable}, hidden=hidden, writable={copy: inside})
        return argv, copy, jail.allowed_env(env)

    async def evaluate(self, task: Task, workspace: Path) -> Outcome:
        env = {"GYRE_WORKSPACE": str(workspace), "GYRE_TASK_ID": task.id, "GYRE_TASK_PROMPT": task.prompt}
        if task.target is not None:
            env["GYRE_TARGET"] = task.target
        argv, cwd, env = await asyncio.to_thread(self._command, Path(workspace), env)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise EvaluatorFailed(f"cannot start {self.argv[0]!r}: {e}") from None
        stdout, stderr = bytearray(), bytearray()
        readers = [asyncio.ensure_future(_read_into(proc.stdout, stdout, STDOUT_TAIL)),
                   asyncio.ensure_future(_read_into(proc.stderr, stderr, STDERR_TAIL))]
        exited = exit_of(proc.pid)  # not proc.wait(): that also waits for every holder of its pipes
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.shield(exited)
            # 1) Exited: what its children still write is read for a grace (a child holding the
            #    pipes must not turn a result into a timeout), 2) then its group is killed.
            await asyncio.wait(readers, timeout=OUTPUT_GRACE_S)
        except TimeoutError:
            raise EvaluatorFailed(f"timed out after {self.timeout_s:g}s") from None
        finally:
            # Always (a result, a timeout, a cancellation): nothing of the command outlives
            # the attempt (jailed: bwrap's PID namespace goes with it); its pipes are closed
            # and it is reaped, boundedly.
            _kill_group(proc)
            await asyncio.shield(end_pipes(proc, REAP_TIMEOUT_S, *readers))
            exited.cancel()
        if proc.returncode != 0:
            raise EvaluatorFailed(f"exit {proc.returncode}: {_tail(bytes(stderr)) or '(no stderr)'}")
        return self._parse(bytes(stdout))

    def _parse(self, stdout: bytes) -> Outcome:
        lines = [ln for ln in stdout.decode("utf-8", errors="replace").splitlines() if ln.strip()]
        if not lines:
            raise EvaluatorFailed("no output: the last stdout line must be a JSON result")
        try:
            result = json.loads(lines[-1])
        except ValueError:
            raise EvaluatorFailed(f"last stdout line is not JSON: {_short(lines[-1], 120)}") from None
        return outcome_from_dict(result, default_ref=Path(self.argv[0]).name)


class CallableEvaluator:
    """Wraps `fn(task, workspace) -> dict | Outcome`: awaited if async, else run in a thread."""

    def __init__(self, fn: Callable[[Task, Path], Any]):
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or repr(fn)

    async def evaluate(self, task: Task, workspace: Path) -> Outcome:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(task, workspace)
        else:
            # A sync scorer may do blocking work: never on the event loop.
            result = await asyncio.to_thread(self.fn, task, workspace)
            if inspect.isawaitable(result):
                result = await result
        if isinstance(result, Outcome):
            return result
        return outcome_from_dict(result, default_ref=self.name)


# ---------------------------------------------------------------------------------------------
# Specs


def _spec_keys(spec: dict, allowed: set[str]) -> None:
    if extra := sorted(set(spec) - allowed - {"type"}):
        raise EvaluatorError(f"evaluator spec: unknown field {extra[0]!r} for type {spec.get('type')!r}")


def _import_callable(ref: Any) -> Callable:
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise EvaluatorError(f"evaluator spec: field 'callable' must be 'module:function', got {ref!r}")
    module_name, attr = ref.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise EvaluatorError(f"evaluator spec: field 'callable': cannot import {ref!r}: {e}") from None
    if not callable(obj):
        raise EvaluatorError(f"evaluator spec: field 'callable': {ref!r} is not callable")
    return obj


def build_evaluator(spec: dict) -> Evaluator:
    """The evaluator a spec describes; {} is the similarity evaluator. Bad spec: EvaluatorError."""
    if not isinstance(spec, dict):
        raise EvaluatorError(f"evaluator spec must be an object, got {type(spec).__name__}")
    kind = spec.get("type", "similarity")
    if kind == "similarity":
        _spec_keys(spec, set())
        return SimilarityEvaluator()
    if kind == "command":
        _spec_keys(spec, {"argv", "timeout_s"})
        argv = spec.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
            raise EvaluatorError(f"evaluator spec: field 'argv' must be a non-empty list of strings, got {argv!r}")
        timeout_s = spec.get("timeout_s", 60)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise EvaluatorError(f"evaluator spec: field 'timeout_s' must be a positive number, got {timeout_s!r}")
        return CommandEvaluator(argv, float(timeout_s))
    if kind == "python":
        _spec_keys(spec, {"callable"})
        return CallableEvaluator(_import_callable(spec.get("callable")))
    raise EvaluatorError(f"evaluator spec: field 'type' must be similarity, command or python, got {kind!r}")


# ---------------------------------------------------------------------------------------------
# Retries


def _checked(outcome: Any) -> Outcome:
    # An evaluator that claims a valid outcome without a usable score is broken, not "0".
    if not isinstance(outcome, Outcome):
        raise EvaluatorFailed(f"evaluator returned {type(outcome).__name__}, not an Outcome")
    if outcome.valid and (outcome.score is None or not math.isfinite(outcome.score)):
        raise EvaluatorFailed(f"valid outcome with score {outcome.score!r}")
    return outcome


async def evaluate_with_retries(evaluator: Evaluator, task: Task, workspace: Path, *, deadline: float,
                                max_attempts: int = 3, backoff_s: float = 0.5,
                                clock: Callable[[], float] = time.monotonic,
                                reward_range: tuple[float, float] = REWARD_RANGE) -> Outcome:
    """Evaluate `workspace`, retrying failed attempts against the same state until `deadline`.

    Called by the launcher once the harness has ended (also after a timeout). The first attempt
    always runs; another starts only while attempts < max_attempts and the backoff ends before
    `deadline` (a `clock` time). Each attempt is bounded by its evaluator (CommandEvaluator's
    timeout_s). All failed: Outcome(score=None, valid=False, error=last error), never a 0.
    An outcome with valid=False is a successful evaluation and is returned as is. A valid
    score outside `reward_range` ends it at once (the same state would score the same) as
    invalid, the error naming the score and the range: it is never trained on.
    """
    try:
        return await _attempts(evaluator, task, workspace, deadline, max_attempts, backoff_s, clock, reward_range)
    finally:
        release = getattr(evaluator, "release", None)  # CommandEvaluator's copy of the workspace
        if release is not None:
            await asyncio.to_thread(release, workspace)


async def _attempts(evaluator: Evaluator, task: Task, workspace: Path, deadline: float, max_attempts: int,
                    backoff_s: float, clock: Callable[[], float], reward_range: tuple[float, float]) -> Outcome:
    attempts, error = 0, "no attempt"
    while True:
        attempts += 1
        try:
            outcome = _checked(await evaluator.evaluate(task, workspace))
            why = valid_reward(outcome.score, reward_range) if outcome.valid else None
            if why is not None:
                log.warning("task %s: evaluation returned an unusable reward: %s", task.id, why)
                return Outcome(score=None, valid=False, ref="", error=f"invalid reward: {why}", attempts=attempts)
            return dataclasses.replace(outcome, attempts=attempts)
        except EvaluatorError as e:
            # A configuration error fails every attempt the same way: stop now.
            error = f"{type(e).__name__}: {e}"
            break
        except Exception as e:  # crash, timeout, bad output: a failed attempt (CancelledError passes)
            error = f"{type(e).__name__}: {e}"
            log.warning("task %s: evaluation attempt %d failed: %s", task.id, attempts, error)
        if attempts >= max_attempts or clock() + backoff_s >= deadline:
            break
        await asyncio.sleep(backoff_s)
    return Outcome(score=None, valid=False, ref="", error=error, attempts=attempts)
