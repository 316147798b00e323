"""SmolLM2 on the shipped example tasks in podman containers: `gyre up` trains (the verifiers'
partial credit differs within a group, so a step has tokens to train)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sandbox.conftest import REPO, podman_ready  # noqa: F401  (the fixture)

pytestmark = pytest.mark.sandbox
GYRE = [sys.executable, "-m", "gyre.cli"]


@pytest.mark.timeout(900)
def test_gyre_up_on_the_examples_in_containers_trains_smollm2(smollm2_dir, podman_ready, tmp_path, capsys):
    run = tmp_path / "up"
    sets = ["tasks_path=examples/tasks", "sandbox=podman", "cells=2", "groups_per_step=4", "group_size=2",
            "min_valid=1", "default_max_tokens=48", "execution_timeout_s=300", "micro_step_tokens=4096",
            "policy=colocate"]
    r = subprocess.run([*GYRE, "up", "--model", str(smollm2_dir), "--run-dir", str(run), "--steps", "1",
                        "--no-live", *(x for s in sets for x in ("--set", s))], cwd=REPO, capture_output=True,
                       text=True, timeout=860)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (step,) = [e for e in events if e["event"] == "step"]
    done = [e for e in events if e["event"] == "execution"]
    assert all(e["status"] == "completed" and e["ref"].startswith("reward.txt ") for e in done), done
    assert step["tokens_trained"] > 0, (step, [(e["id"], e["reward"]) for e in done])
    with capsys.disabled():
        rewards = ", ".join(f"{e['id']} {e['reward']:g}" for e in done)
        print(f"\nSmolLM2 gyre up on examples/tasks in podman: step {step['seconds']:.1f} s, "
              f"{step['tokens_trained']} tokens trained; rewards {rewards}")
