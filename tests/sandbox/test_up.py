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
            "min_valid=1"]
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
