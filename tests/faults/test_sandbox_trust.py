"""A hostile agent cannot set its own reward (issue 26, finding 1).

The harness is a small script that does what an agent bent on its reward would: it leaves a
daemon behind (`setsid`, out of its process group, and one in its group) that rewrites
/logs/verifier/reward.txt to 1.0 and copies /tests into its workspace the moment they
appear, and it plants a file at /tests before the real tests land. The verifier must still
give its own score, the saved workspace must hold no test, and nothing of the execution may
be left running: real podman containers, real host processes.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import textwrap
from pathlib import Path

import pytest

from gyre.coordinator.sandbox.base import LABEL_OWNER
from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.tasks import Task
from tests.sandbox.conftest import containers, harbor_task, podman, podman_ready, run_task, scripted_proxy, shell_preset

__all__ = ["podman", "podman_ready", "scripted_proxy"]  # fixtures, used by name

# The agent's real work (worth 0.25 to the verifier below), then the attack.
HOSTILE = textwrap.dedent('''\
    echo 42 > answer.txt
    mkdir -p /tests && echo planted > /tests/planted
    setsid sh -c 'while :; do
        [ -f /tests/test.sh ] && cp -r /tests "$0/stolen-tests" 2>/dev/null
        mkdir -p /logs/verifier 2>/dev/null && echo 1.0 > /logs/verifier/reward.txt
        sleep 0.05
    done' "$PWD" hostile-loop </dev/null >/dev/null 2>&1 &
    sh -c 'while :; do echo 1.0 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.05; done' in-group-loop &
    exit 0
''')
# The verifier: 0.25 for the agent's answer. It also says what it saw, so that a failure names
# the hole: 1 for a file the agent planted among the tests, 0.5 when a loop of the agent's
# still runs while it scores. Like many Harbor tests it copies a test file into the workdir.
VERIFY = textwrap.dedent('''\
    alive=no
    for p in /proc/[0-9]*; do
        case "$(tr '\\0' ' ' < "$p/cmdline" 2>/dev/null)" in *hostile-loop*|*in-group-loop*) alive=yes;; esac
    done
    cp /tests/test.sh /app/copied-by-the-verifier.sh
    if [ -e /tests/planted ]; then echo 1 > /logs/verifier/reward.txt
    elif [ $alive = yes ]; then echo 0.5 > /logs/verifier/reward.txt
    elif [ "$(cat /app/answer.txt)" = 42 ]; then echo 0.25 > /logs/verifier/reward.txt
    else echo 0 > /logs/verifier/reward.txt; fi
''')


def marked(owner: str) -> list[int]:
    """Live processes whose environment carries this sandbox owner's marker (the process
    backend's GYRE_SANDBOX_OWNER), zombies aside."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"GYRE_SANDBOX_OWNER={owner}".encode() in env and state != "Z":
            found.append(int(entry))
    return found


@pytest.mark.sandbox
async def test_a_daemon_the_agent_leaves_cannot_set_its_reward_in_a_container(podman, scripted_proxy, tmp_path):
    owner = f"hostile-{secrets.token_hex(3)}"
    folder = harbor_task(tmp_path, "hostile", test_sh=VERIFY)
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset(HOSTILE),
                         owner=owner)
    # The verifier's own score: no daemon alive while it ran, nothing planted among the tests.
    assert (run.status, run.reward, run.valid) == ("completed", 0.25, True), (run.status, run.reward, run.ref)
    work = tmp_path / "run" / "executions" / "e1" / "workspace"
    assert (work / "answer.txt").read_text() == "42\n"  # the agent's work was copied out
    # ... before any test went in: neither the daemon's copy nor the verifier's own is there.
    assert not (work / "stolen-tests").exists() and not (work / "copied-by-the-verifier.sh").exists()
    assert containers(podman, **{LABEL_OWNER: owner}) == []  # and nothing is left running


# For the process backend: the evaluator (a host command) reports the agent's loops alive while
# it scores, and scores answer.txt (the agent's: 0.25; the daemon's: 1.0).
SCORE_ON_HOST = textwrap.dedent('''\
    import json, os, pathlib, sys
    owner = sys.argv[1]
    pathlib.Path("scoring").write_text("now")
    alive = []
    for e in os.listdir("/proc"):
        try:
            env = pathlib.Path(f"/proc/{e}/environ").read_bytes().split(b"\\0")
            state = pathlib.Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()[0]
            argv = pathlib.Path(f"/proc/{e}/cmdline").read_bytes()
        except OSError:
            continue
        if f"GYRE_SANDBOX_OWNER={owner}".encode() in env and state != "Z" and b"-loop" in argv:
            alive.append(e)
    answer = pathlib.Path("answer.txt").read_text().strip()
    print(json.dumps({"score": 1.0 if answer == "forged" else 0.25, "ref": f"alive {len(alive)}"}))
''')
HOSTILE_ON_HOST = textwrap.dedent('''\
    echo mine > answer.txt
    setsid sh -c 'while :; do [ -e scoring ] && echo forged > answer.txt; sleep 0.05; done' hostile-loop \
        </dev/null >/dev/null 2>&1 &
    sh -c 'while :; do [ -e scoring ] && echo forged > answer.txt; sleep 0.05; done' in-group-loop &
    exit 0
''')


async def test_a_daemon_the_agent_leaves_is_gone_before_a_host_evaluator_scores(scripted_proxy, tmp_path):
    owner = f"hostile-{secrets.token_hex(3)}"
    score = tmp_path / "score.py"
    score.write_text(SCORE_ON_HOST)
    task = Task(id="hostile", prompt="p", evaluator={"type": "command", "argv": [sys.executable, str(score), owner]})
    try:
        run = await run_task(scripted_proxy, ProcessBackend(), task, tmp_path / "run", shell_preset(HOSTILE_ON_HOST),
                             owner=owner)
        assert (run.status, run.reward, run.ref) == ("completed", 0.25, "alive 0")
        assert marked(owner) == []  # nothing of the execution outlives it
    finally:
        for pid in marked(owner):  # the original code leaves them: do not leave them to the machine
            os.kill(pid, 9)
    assert json.loads((tmp_path / "run" / "executions" / "e1" / "sandbox.json").read_text())["backend"] == "process"
