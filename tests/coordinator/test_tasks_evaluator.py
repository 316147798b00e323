"""Tasks (JSONL, workspaces, the source, the default set) and evaluators (similarity, command,
callable, specs, retries), run for real: commands are small `sys.executable -c` children."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gyre.coordinator import evaluator as ev
from gyre.coordinator.evaluator import (
    CallableEvaluator,
    CommandEvaluator,
    EvaluatorError,
    EvaluatorFailed,
    Outcome,
    SimilarityEvaluator,
    build_evaluator,
    evaluate_with_retries,
    similarity,
)
from gyre.coordinator.tasks import Task, TaskError, TaskSource, default_tasks, load_tasks, make_workspace
from gyre.workerd.wire import GyreError

TASK = Task(id="t1", prompt="Reply with: hello", target="hello")


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def write_jsonl(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# load_tasks


def test_load_tasks_happy_path(tmp_path):
    (tmp_path / "tpl").mkdir()
    full = {"id": "b", "prompt": "Fix it.", "workspace": {"src/a.py": "x = 1\n"}, "template_dir": "tpl",
            "evaluator": {"type": "command", "argv": ["true"]}, "target": None, "timeout_s": 30,
            "meta": {"k": 1}, "difficulty": "easy"}
    path = write_jsonl(tmp_path / "t.jsonl", json.dumps({"id": "a", "prompt": "Say hi", "target": "hi"}),
                       "", "   ", json.dumps(full))
    a, b = load_tasks(path)
    assert a == Task(id="a", prompt="Say hi", target="hi")
    assert (a.workspace, a.evaluator, a.meta, a.template_dir, a.timeout_s) == ({}, {}, {}, None, None)
    assert b.workspace == {"src/a.py": "x = 1\n"}
    assert b.template_dir == str((tmp_path / "tpl").resolve())  # relative to the task file
    assert b.evaluator == {"type": "command", "argv": ["true"]}
    assert b.timeout_s == 30.0 and isinstance(b.timeout_s, float)
    assert b.meta == {"k": 1, "difficulty": "easy"}  # unknown fields land in meta


@pytest.mark.parametrize("lines, lineno, words", [
    (['{"id": "a", "prompt": "p"}', '{"id": "b", "prompt": }'], 2, ["not valid JSON"]),
    (['{"id": "a", "prompt": "p"}', "", '{"id": "b"}'], 3, ["'prompt'", "missing"]),
    (['{"prompt": "p"}'], 1, ["'id'", "missing"]),
    (['{"id": "a", "prompt": "p"}', '{"id": "a", "prompt": "q"}'], 2, ["'id'", "duplicate", "line 1"]),
    (['["a", "p"]'], 1, ["JSON object"]),
    (['{"id": "a", "prompt": 3}'], 1, ["'prompt'", "string"]),
    (['{"id": "a", "prompt": "p", "workspace": {"../x": "y"}}'], 1, ["'workspace'", "escapes"]),
    (['{"id": "a", "prompt": "p", "workspace": {"/etc/x": "y"}}'], 1, ["'workspace'", "escapes"]),
    (['{"id": "a", "prompt": "p", "workspace": {"x": 1}}'], 1, ["'workspace'", "string"]),
    (['{"id": "a", "prompt": "p", "timeout_s": true}'], 1, ["'timeout_s'"]),
    (['{"id": "a", "prompt": "p", "timeout_s": -1}'], 1, ["'timeout_s'"]),
    (['{"id": "a", "prompt": "p", "evaluator": "similarity"}'], 1, ["'evaluator'", "object"]),
    (['{"id": "a", "prompt": "p", "target": 5}'], 1, ["'target'"]),
    (['{"id": "a", "prompt": "p", "template_dir": "nope"}'], 1, ["'template_dir'", "not a directory"]),
    (['{"id": "a", "prompt": "p", "x": 1, "meta": {"x": 2}}'], 1, ["'x'", "meta"]),
])
def test_load_tasks_errors_name_line_and_field(tmp_path, lines, lineno, words):
    path = write_jsonl(tmp_path / "t.jsonl", *lines)
    with pytest.raises(TaskError) as info:
        load_tasks(path)
    assert f"t.jsonl:{lineno}:" in str(info.value)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, GyreError)


def test_load_tasks_missing_or_empty_file(tmp_path):
    with pytest.raises(TaskError, match="cannot read"):
        load_tasks(tmp_path / "absent.jsonl")
    with pytest.raises(TaskError, match="no tasks"):
        load_tasks(write_jsonl(tmp_path / "empty.jsonl", "", ""))


# ---------------------------------------------------------------------------------------------
# make_workspace and TaskSource


def test_make_workspace_writes_template_files_and_prompt(tmp_path):
    tpl = tmp_path / "tpl"
    (tpl / "pkg").mkdir(parents=True)
    (tpl / "pkg" / "a.py").write_text("old")
    (tpl / "README").write_text("template readme")
    task = Task(id="w", prompt="Do the thing.", template_dir=str(tpl),
                workspace={"pkg/a.py": "new", "deep/er/b.txt": "b", "task.txt": "not the prompt"})
    root = make_workspace(task, tmp_path / "ws")
    assert root == tmp_path / "ws"
    assert (root / "README").read_text() == "template readme"
    assert (root / "pkg" / "a.py").read_text() == "new"  # the task's files override the template
    assert (root / "deep" / "er" / "b.txt").read_text() == "b"
    assert (root / "task.txt").read_text() == "Do the thing."  # the prompt wins
    assert (tpl / "pkg" / "a.py").read_text() == "old"  # the template is untouched


def test_make_workspace_accepts_an_empty_root_and_no_files(tmp_path):
    (tmp_path / "ws").mkdir()
    root = make_workspace(Task(id="e", prompt="p"), tmp_path / "ws")
    assert sorted(p.name for p in root.iterdir()) == ["task.txt"]


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "a/..", "", ".", "a\x00b", "..\\x"])
def test_make_workspace_refuses_escapes(tmp_path, bad):
    task = Task(id="bad", prompt="p", workspace={"ok.txt": "fine", bad: "evil"})
    with pytest.raises(TaskError):
        make_workspace(task, tmp_path / "ws")
    assert not (tmp_path / "ws").exists()  # validated before anything is written
    assert not (tmp_path / "x").exists()


def test_make_workspace_does_not_write_through_template_links(tmp_path):
    (tmp_path / "outside").mkdir()
    tpl = tmp_path / "tpl"
    tpl.mkdir()
    (tpl / "link").symlink_to(tmp_path / "outside")
    root = make_workspace(Task(id="s", prompt="p", template_dir=str(tpl), workspace={"link/x": "e"}),
                          tmp_path / "ws")
    # The template is copied with its links followed: the workspace holds a real directory.
    assert not (root / "link").is_symlink() and (root / "link" / "x").read_text() == "e"
    assert list((tmp_path / "outside").iterdir()) == []


def test_make_workspace_refuses_a_non_empty_root(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "stale").write_text("x")
    with pytest.raises(TaskError, match="not an empty directory"):
        make_workspace(Task(id="n", prompt="p"), tmp_path / "ws")


def test_task_source_is_a_seeded_shuffle_per_pass():
    tasks = default_tasks()
    ids = [t.id for t in tasks]

    def sequence(seed, n):
        source = TaskSource(tasks, seed=seed)
        return [source.next_task().id for _ in range(n)]

    seq = sequence(7, 3 * len(tasks))
    assert seq == sequence(7, 3 * len(tasks))  # deterministic given the seed
    for k in range(3):  # every pass covers each task exactly once
        assert sorted(seq[k * len(tasks):(k + 1) * len(tasks)]) == sorted(ids)
    assert seq[:len(tasks)] != seq[len(tasks):2 * len(tasks)]  # reshuffled each pass
    assert sequence(0, len(tasks)) != sequence(1, len(tasks))
    with pytest.raises(TaskError):
        TaskSource([])


def test_task_source_default_evaluator():
    source = TaskSource([TASK], default_evaluator={"type": "command", "argv": ["x"]})
    assert source.evaluator_spec(TASK) == {"type": "command", "argv": ["x"]}
    own = Task(id="o", prompt="p", evaluator={"type": "similarity"})
    assert source.evaluator_spec(own) == {"type": "similarity"}
    assert len(source) == 1


# ---------------------------------------------------------------------------------------------
# The default set and the similarity evaluator


def test_default_tasks_are_valid():
    tasks = default_tasks()
    assert len(tasks) == 8
    assert len({t.id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.target == "hello"
        assert t.target in t.prompt and len(t.prompt) <= 40  # short: the harness adds its own prompt
        assert isinstance(build_evaluator(t.evaluator), SimilarityEvaluator)
        assert t.workspace == {} and t.template_dir is None and t.timeout_s is None


async def score(task: Task, workspace: Path, answer: bytes | str | None) -> Outcome:
    path = workspace / "answer.txt"
    path.unlink(missing_ok=True)
    if answer is not None:
        path.write_bytes(answer if isinstance(answer, bytes) else answer.encode())
    return await SimilarityEvaluator().evaluate(task, workspace)


@pytest.mark.parametrize("task", default_tasks(), ids=lambda t: t.id)
async def test_similarity_on_default_tasks(tmp_path, task):
    target, rng = task.target, random.Random(task.id)
    exact = await score(task, tmp_path, target)
    assert exact == Outcome(score=1.0, valid=True, ref=exact.ref)
    assert (await score(task, tmp_path, f"  {target.upper()}\n")).score == 1.0
    prefix = (await score(task, tmp_path, target[:-1])).score
    near = (await score(task, tmp_path, target[:-1] + "#")).score
    letters = (await score(task, tmp_path, target[::-1])).score
    noise = [(await score(task, tmp_path, rng.randbytes(64))).score for _ in range(5)]
    assert 0.5 <= prefix < 1.0 and 0.5 <= near < 1.0
    assert max(noise) < 0.2 < letters  # the target's letters beat random bytes
    missing = await score(task, tmp_path, None)
    assert missing == Outcome(score=0.0, valid=True, ref="no answer.txt")


def test_similarity_values():
    assert similarity("hello", "hello") == 1.0
    assert similarity("hel", "hello") == 0.75
    assert similarity("olleh", "hello") == 0.4
    assert similarity("xyz", "hello") == 0.0
    assert similarity("", "") == 1.0 and similarity("", "hi") == 0.0
    assert similarity("Hello   World", "hello world") == 1.0
    long = "q" * 100_000 + "hello"  # past the compared prefix: cheap, and near 0 anyway
    assert 0.0 <= similarity(long, "hello") < 0.001


async def test_similarity_answer_dir_and_missing_target(tmp_path):
    (tmp_path / "answer.txt").mkdir()
    assert await SimilarityEvaluator().evaluate(TASK, tmp_path) == Outcome(0.0, True, "answer.txt is not a file")
    with pytest.raises(EvaluatorError, match="target"):
        await SimilarityEvaluator().evaluate(Task(id="n", prompt="p"), tmp_path)


# ---------------------------------------------------------------------------------------------
# CommandEvaluator


async def test_command_success_sees_workspace_and_env(tmp_path):
    (tmp_path / "answer.txt").write_text("hello")
    code = ("import json, os; print('noise'); print(json.dumps({'score': 0.75, 'ref': '|'.join([\n"
            "os.getcwd(), os.environ['GYRE_WORKSPACE'], os.environ['GYRE_TASK_ID'],\n"
            "os.environ['GYRE_TASK_PROMPT'], os.environ['GYRE_TARGET'], open('answer.txt').read()])})); print()")
    out = await CommandEvaluator(py(code), timeout_s=30).evaluate(TASK, tmp_path)
    ws = str(tmp_path)
    assert out == Outcome(score=0.75, valid=True, ref=f"{Path(ws).resolve()}|{ws}|t1|Reply with: hello|hello|hello")


async def test_command_defaults_and_invalid_results(tmp_path):
    out = await CommandEvaluator(py("print('{\"score\": 1}')"), 30).evaluate(Task(id="n", prompt="p"), tmp_path)
    assert out == Outcome(score=1.0, valid=True, ref=Path(sys.executable).name)
    code = "import os; print('{\"score\": null, \"valid\": false, \"ref\": \"%s\"}' % ('GYRE_TARGET' in os.environ))"
    out = await CommandEvaluator(py(code), 30).evaluate(Task(id="n", prompt="p"), tmp_path)
    assert out == Outcome(score=None, valid=False, ref="False")  # no target, no GYRE_TARGET


@pytest.mark.parametrize("code, match", [
    ("import sys; sys.stderr.write('boom'); sys.exit(3)", "exit 3: boom"),
    ("print('{\"score\": 1}'); print('not json')", "not JSON"),
    ("pass", "no output"),
    ("print('[1, 2]')", "JSON object"),
    ("print('{\"score\": \"high\"}')", "'score'"),
    ("print('{\"valid\": true}')", "'score'"),
    ("print('{\"score\": 1, \"valid\": \"yes\"}')", "'valid'"),
    ("print('{\"score\": NaN}')", "'score'"),
])
async def test_command_failures(tmp_path, code, match):
    with pytest.raises(EvaluatorFailed, match=match):
        await CommandEvaluator(py(code), timeout_s=30).evaluate(TASK, tmp_path)


async def test_command_that_cannot_start(tmp_path):
    with pytest.raises(EvaluatorFailed, match="cannot start"):
        await CommandEvaluator([str(tmp_path / "no-such-binary")], 30).evaluate(TASK, tmp_path)


async def test_command_timeout_kills_the_child(tmp_path, monkeypatch):
    procs = []
    real_exec = asyncio.create_subprocess_exec

    async def recording_exec(*args, **kwargs):
        procs.append(await real_exec(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(ev.asyncio, "create_subprocess_exec", recording_exec)
    start = time.monotonic()
    with pytest.raises(EvaluatorFailed, match="timed out after 0.5s"):
        await CommandEvaluator(py("import time; time.sleep(30)"), timeout_s=0.5).evaluate(TASK, tmp_path)
    assert time.monotonic() - start < 10
    (proc,) = procs
    assert proc.returncode == -signal.SIGKILL  # killed and reaped, not left running


def _ends(pid: int, within_s: float = 5.0) -> bool:
    """Whether process `pid` has exited (or does within `within_s`): its pidfd turns readable."""
    import os
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within_s)[0])
    finally:
        os.close(fd)


def _gone(token: str) -> bool:
    """Whether every host process whose command line holds `token` has exited (or does soon).
    By token, not by the pid the evaluator saw: a jailed one sees its own PID namespace's."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            continue
    return all(_ends(pid) for pid in pids)


async def test_a_child_holding_stdout_does_not_hold_the_result(tmp_path):
    # The evaluator prints its result and exits; a child it started keeps its stdout open.
    token = f"child-{time.monotonic_ns()}"
    code = ("import json, subprocess, sys\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', {token!r}])\n"
            "print(json.dumps({'score': 0.5, 'ref': str(child.pid)}), flush=True)\n")
    start = time.monotonic()
    out = await CommandEvaluator(py(code), timeout_s=8).evaluate(TASK, tmp_path)
    assert out.score == 0.5 and out.valid and time.monotonic() - start < 8
    assert _gone(token)  # and the child went with the attempt


async def test_nothing_of_an_evaluator_outlives_its_attempt(tmp_path):
    token = f"child-{time.monotonic_ns()}"
    code = ("import json, subprocess, sys\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', {token!r}],\n"
            "                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print(json.dumps({'score': 1, 'ref': str(child.pid)}))\n")
    out = await CommandEvaluator(py(code), timeout_s=30).evaluate(TASK, tmp_path)
    assert out.score == 1.0
    assert _gone(token)


def test_an_evaluators_output_is_kept_to_its_tail(tmp_path):
    """200 MiB on stdout and 20 MiB on stderr before the result: the result is read, and the
    evaluating process (a fresh one, to measure its peak memory) holds only the tails."""
    noisy = ("import os; [os.write(1, b'x' * (1 << 20)) for _ in range(200)]; os.write(2, b'e' * (20 << 20)); "
             "print(); print('{\"score\": 0.5}')")
    script = ("import asyncio, re, sys\n"
              "from pathlib import Path\n"
              "from gyre.coordinator.evaluator import CommandEvaluator\n"
              "from gyre.coordinator.tasks import Task\n"
              f"out = asyncio.run(CommandEvaluator([sys.executable, '-c', {noisy!r}], 120).evaluate(\n"
              "    Task(id='n', prompt='p'), Path('.')))\n"
              # VmHWM, not ru_maxrss: that one keeps the peak of the pytest process it was forked from.
              "peak = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
              "print(out.score, int(peak) >> 10)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    score, peak_mib = done.stdout.split()
    assert float(score) == 0.5
    assert int(peak_mib) < 120, peak_mib  # not the 220 MiB it printed


# ---------------------------------------------------------------------------------------------
# CallableEvaluator and build_evaluator


def sync_score(task, workspace):
    return {"score": 0.5, "ref": f"{task.id}@{threading.current_thread() is threading.main_thread()}"}


async def async_score(task, workspace):
    return Outcome(score=0.25, valid=True, ref=str(Path(workspace).name))


async def test_callable_sync_runs_in_a_thread(tmp_path):
    out = await CallableEvaluator(sync_score).evaluate(TASK, tmp_path)
    assert out == Outcome(score=0.5, valid=True, ref="t1@False")


async def test_callable_async_is_awaited(tmp_path):
    out = await CallableEvaluator(async_score).evaluate(TASK, tmp_path)
    assert out == Outcome(score=0.25, valid=True, ref=tmp_path.name)


async def test_callable_bad_result(tmp_path):
    with pytest.raises(EvaluatorFailed, match="JSON object"):
        await CallableEvaluator(lambda task, ws: 0.5).evaluate(TASK, tmp_path)


def test_build_evaluator_kinds():
    assert isinstance(build_evaluator({}), SimilarityEvaluator)
    assert isinstance(build_evaluator({"type": "similarity"}), SimilarityEvaluator)
    cmd = build_evaluator({"type": "command", "argv": ["x", "y"]})
    assert isinstance(cmd, CommandEvaluator) and cmd.argv == ["x", "y"] and cmd.timeout_s == 60
    assert build_evaluator({"type": "command", "argv": ["x"], "timeout_s": 2}).timeout_s == 2.0
    fn = build_evaluator({"type": "python", "callable": f"{__name__}:sync_score"})
    assert isinstance(fn, CallableEvaluator) and fn.fn is sync_score
    assert build_evaluator({"type": "python", "callable": "os.path:join"}).fn is __import__("os").path.join


@pytest.mark.parametrize("spec, field", [
    ("similarity", "object"),
    ({"type": "magic"}, "'type'"),
    ({"type": "similarity", "argv": ["x"]}, "'argv'"),
    ({"type": "command"}, "'argv'"),
    ({"type": "command", "argv": []}, "'argv'"),
    ({"type": "command", "argv": "python x.py"}, "'argv'"),
    ({"type": "command", "argv": ["x", 1]}, "'argv'"),
    ({"type": "command", "argv": ["x"], "timeout_s": 0}, "'timeout_s'"),
    ({"type": "command", "argv": ["x"], "timeout_s": "60"}, "'timeout_s'"),
    ({"type": "command", "argv": ["x"], "timeout": 60}, "'timeout'"),
    ({"type": "python"}, "'callable'"),
    ({"type": "python", "callable": "no_colon"}, "'callable'"),
    ({"type": "python", "callable": "gyre_no_such_module:f"}, "'callable'"),
    ({"type": "python", "callable": "os:no_such_function"}, "'callable'"),
    ({"type": "python", "callable": "os:sep"}, "not callable"),
])
def test_build_evaluator_errors(spec, field):
    with pytest.raises(EvaluatorError) as info:
        build_evaluator(spec)
    assert field in str(info.value) and isinstance(info.value, GyreError)


# ---------------------------------------------------------------------------------------------
# evaluate_with_retries


class Scripted:
    """An evaluator that plays a list of results (an exception is raised), counting calls."""

    def __init__(self, *results):
        self.results, self.calls = list(results), 0

    async def evaluate(self, task, workspace):
        self.calls += 1
        result = self.results[min(self.calls, len(self.results)) - 1]
        if isinstance(result, BaseException):
            raise result
        return result


COUNTING = py("import pathlib, json, sys\n"
              "p = pathlib.Path('attempts'); n = int(p.read_text()) + 1 if p.exists() else 1\n"
              "p.write_text(str(n))\n"
              "if n < 3: sys.exit('attempt %d fails' % n)\n"
              "print(json.dumps({'score': 0.5, 'ref': 'attempt %d' % n}))")


async def test_retries_fail_twice_then_succeed(tmp_path):
    out = await evaluate_with_retries(CommandEvaluator(COUNTING, 30), TASK, tmp_path,
                                      deadline=time.monotonic() + 60, backoff_s=0.01)
    assert out == Outcome(score=0.5, valid=True, ref="attempt 3", attempts=3)
    # Every attempt on the same copy (attempt 3 counted the other two); the workspace itself is never written.
    assert not (tmp_path / "attempts").exists()


async def test_retries_exhausted_is_invalid_never_zero(tmp_path):
    out = await evaluate_with_retries(CommandEvaluator(py("import sys; sys.exit(1)"), 30), TASK, tmp_path,
                                      deadline=time.monotonic() + 60, backoff_s=0)
    assert (out.score, out.valid, out.ref, out.attempts) == (None, False, "", 3)
    assert "EvaluatorFailed: exit 1" in out.error


async def test_deadline_in_the_past_allows_one_attempt(tmp_path):
    scripted = Scripted(EvaluatorFailed("flaky"))
    out = await evaluate_with_retries(scripted, TASK, tmp_path, deadline=time.monotonic() - 1, backoff_s=0)
    assert scripted.calls == 1 and out == Outcome(None, False, "", error="EvaluatorFailed: flaky", attempts=1)
    # A deadline in the past does not skip the attempt: preserved work is still scored.
    ok = Outcome(1.0, True, "r")
    assert await evaluate_with_retries(Scripted(ok), TASK, tmp_path, deadline=0.0, clock=lambda: 1.0) == ok


async def test_backoff_never_waits_past_the_deadline(tmp_path):
    scripted = Scripted(RuntimeError("down"))
    start = time.monotonic()
    out = await evaluate_with_retries(scripted, TASK, tmp_path, deadline=start + 0.2, backoff_s=30)
    assert time.monotonic() - start < 5 and scripted.calls == 1
    assert out.error == "RuntimeError: down" and out.score is None


async def test_retries_stop_when_the_clock_reaches_the_deadline(tmp_path):
    ticks = iter(range(100))
    scripted = Scripted(RuntimeError("down"))
    out = await evaluate_with_retries(scripted, TASK, tmp_path, deadline=2.5, max_attempts=10, backoff_s=0,
                                      clock=lambda: next(ticks))
    assert scripted.calls == 4 and out.attempts == 4  # failures at clock 0, 1, 2 retry; at 3 it stops


async def test_invalid_outcome_and_config_errors_are_not_retried(tmp_path):
    invalid = Outcome(score=None, valid=False, ref="tests did not build")
    scripted = Scripted(invalid)
    out = await evaluate_with_retries(scripted, TASK, tmp_path, deadline=time.monotonic() + 60, backoff_s=0)
    assert out == invalid and scripted.calls == 1
    out = await evaluate_with_retries(SimilarityEvaluator(), Task(id="n", prompt="p"), tmp_path,
                                      deadline=time.monotonic() + 60, backoff_s=0)
    assert (out.valid, out.score, out.attempts) == (False, None, 1) and "target" in out.error


async def test_a_valid_outcome_without_a_score_is_a_failed_attempt(tmp_path):
    scripted = Scripted(Outcome(None, True, "broken"), {"score": 1}, Outcome(0.0, True, "zero"))
    out = await evaluate_with_retries(scripted, TASK, tmp_path, deadline=time.monotonic() + 60, backoff_s=0)
    assert out == Outcome(0.0, True, "zero", attempts=3)  # a real 0 from a working evaluator is kept


async def test_cancellation_propagates(tmp_path):
    class Hanging:
        async def evaluate(self, task, workspace):
            await asyncio.Event().wait()

    task = asyncio.create_task(evaluate_with_retries(Hanging(), TASK, tmp_path, deadline=time.monotonic() + 60))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_modules_do_not_import_torch():
    code = ("import sys; import gyre.coordinator.tasks, gyre.coordinator.evaluator; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
