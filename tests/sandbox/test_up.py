"""`gyre up` on the shipped example tasks in podman containers (the tiny model): the RL loop's
executions run in their task images, are scored by the tasks' own verifiers, and leave no
container behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sandbox.conftest import REPO

GYRE = [sys.executable, "-m", "gyre.cli"]


@pytest.mark.timeout(400)
def test_gyre_up_trains_on_the_examples_in_containers(podman_ready, tmp_path):
    run = tmp_path / "up"
    sets = ["tasks_path=examples/tasks", "sandbox=podman", "cells=2", "groups_per_step=2", "group_size=2",
            "min_valid=1", "workers=inproc"]
    r = subprocess.run([*GYRE, "up", "--run-dir", str(run), "--steps", "2", "--no-live",
                        *(x for s in sets for x in ("--set", s))], cwd=REPO, capture_output=True, text=True,
                       timeout=380)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
    done = [e for e in events if e["event"] == "execution"]
    assert len(done) >= 8 and all(e["status"] == "completed" and e["valid"] for e in done), done
    assert all(e["ref"].startswith("reward.txt ") for e in done)  # the tasks' verifiers scored them
    config = json.loads((run / "config.json").read_text())
    assert config["sandbox"] == "podman" and config["tasks_path"] == str(REPO / "examples" / "tasks")
    left = subprocess.run(["podman", "ps", "-aq", "--filter", f"label=gyre.run_dir={run}"], capture_output=True,
                          text=True, timeout=60)
    assert left.returncode == 0 and left.stdout.strip() == ""  # every sandbox removed


@pytest.mark.timeout(300)
def test_a_run_whose_every_execution_fails_its_sandbox_stops_saying_why(podman_ready, tmp_path):
    from tests.sandbox.conftest import harbor_task

    folder = harbor_task(tmp_path / "tasks", "broken", dockerfile="FROM localhost/gyre-base:bookworm\nRUN exit 3\n")
    sets = [f"tasks_path={folder}", "sandbox=podman", "cells=2", "groups_per_step=1", "group_size=2",
            "min_valid=1", "infra_failures_in_row=4", "workers=inproc"]
    r = subprocess.run([*GYRE, "up", "--run-dir", str(tmp_path / "up"), "--steps", "2", "--no-live",
                        *(x for s in sets for x in ("--set", s))], capture_output=True, text=True, timeout=280)
    assert r.returncode != 0
    assert "4 executions in a row ended aborted_infra (infra_failures_in_row = 4)" in r.stderr, r.stderr[-2000:]
    assert "RUN exit 3" in r.stderr or "exit status 3" in r.stderr  # the build's own error, named
    events = [json.loads(x) for x in (tmp_path / "up" / "metrics.jsonl").read_text().splitlines()]
    done = [e for e in events if e["event"] == "execution"]
    assert len(done) >= 4 and all(e["status"] == "aborted_infra" and e["reward"] is None for e in done)
    assert not [e for e in events if e["event"] == "step"]  # nothing trained on them
