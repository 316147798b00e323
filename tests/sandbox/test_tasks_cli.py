"""`gyre tasks` on the shipped examples, as a user runs it from the repository: check, then run
with the tasks' own solutions (every one scores 1.0) and with the demo harness (less)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.sandbox.conftest import REPO

EXAMPLES = ("find-the-error", "fix-off-by-one", "make-test-pass", "sort-csv")


def gyre(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = shutil.which("gyre", path=str(Path(sys.executable).parent)) or "gyre"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_tasks_check_lists_the_examples():
    r = gyre("tasks", "check", "examples/tasks", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["tasks"]
    assert sorted(t["task"] for t in rows) == list(EXAMPLES)
    assert all(t["format"] == "harbor" and t["solution"] for t in rows)


def test_tasks_check_names_the_bad_field(tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(REPO / "examples" / "tasks" / "sort-csv", folder)
    (folder / "task.toml").write_text('version = "1.0"\n[environment]\ncpus = "lots"\n')
    r = gyre("tasks", "check", str(folder))
    assert r.returncode != 0 and "task.toml" in r.stderr and "cpus" in r.stderr, r.stderr


def test_the_examples_solve_to_one_and_the_demo_scores_less(podman_ready, tmp_path):
    r = gyre("tasks", "run", "examples/tasks", "--solution", "--json", "--run-dir", str(tmp_path / "solved"))
    assert r.returncode == 0, r.stderr[-2000:]
    solved = {t["task"]: t for t in json.loads(r.stdout)["tasks"]}
    assert sorted(solved) == list(EXAMPLES)
    assert all(t["status"] == "completed" and t["score"] == 1.0 for t in solved.values()), solved
    r = gyre("tasks", "run", "examples/tasks", "--harness", "demo", "--json", "--run-dir", str(tmp_path / "demo"),
             "--set", "default_max_tokens=8")
    assert r.returncode == 0, r.stderr[-2000:]
    demo = json.loads(r.stdout)["tasks"]
    assert all(t["status"] == "completed" and t["score"] is not None and t["score"] < 1.0 for t in demo), demo
    for t in demo:  # the demo harness called the policy through the proxy-only network
        calls = [json.loads(x) for x in (tmp_path / "demo" / "executions" / t["execution"] / "calls.jsonl")
                 .read_text().splitlines()]
        assert calls and all(c["status"] == "ok" and 0 < c["output_tokens"] <= 8 for c in calls), t
