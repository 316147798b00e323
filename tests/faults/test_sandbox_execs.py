"""An execution makes one exec (issue 36, finding 10).

podman keeps a `conmon` monitor alive for each exec through its Docker-compatible API long
after the exec ended (300 s by default), and an execution used to make six (a mkdir per
upload, two to clear /tests, two to verify) and restart its container for the verifier.
Now the harness is the only exec: files move by archive calls and the verifier runs as the
own command of a fresh container. The agent's container, kept here (keep_sandbox =
"always") to be looked at, lists its exec sessions; it must hold the harness's alone and
never have run again after the harness. Real podman.
"""

from __future__ import annotations

import pytest

from gyre.coordinator.sandbox.base import LABEL_OWNER
from gyre.coordinator.taskformats import load_harbor_task
from tests.sandbox.conftest import (
    CALL_PROXY,
    containers,
    harbor_task,
    podman,
    podman_ready,
    run_task,
    scripted_proxy,
    shell_preset,
)

__all__ = ["podman", "podman_ready", "scripted_proxy"]  # fixtures, used by name
pytestmark = pytest.mark.sandbox

SCORE = 'if [ "$(cat /app/answer.txt)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > ' \
        '/logs/verifier/reward.txt; fi\n'
AGENT = CALL_PROXY + "echo 42 > answer.txt\n"


async def test_an_execution_makes_one_exec_and_its_container_never_runs_again(podman, scripted_proxy, tmp_path):
    task = load_harbor_task(harbor_task(tmp_path, "execs", test_sh=SCORE))
    run = await run_task(scripted_proxy, podman, task, tmp_path / "run", shell_preset(AGENT), owner="execs-1",
                         keep_sandbox="always")
    kept = containers(podman, **{LABEL_OWNER: "execs-1"})
    try:
        assert (run.status, run.reward) == ("completed", 1.0), run.ref
        assert len(kept) == 1  # the agent's; the verifier's went with its score
        (box,) = kept
        box.reload()
        assert len(box.attrs.get("ExecIDs") or []) == 1  # the harness; the sessions stay listed for 30 s
        assert box.status == "exited"  # killed before scoring, and never started again
    finally:
        for c in kept:
            c.remove(force=True)
