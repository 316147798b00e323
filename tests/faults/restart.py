"""A run whose coordinator is SIGKILLed mid-rollout and resumed (issue 34): its task, its
harness and the kill, for tests/faults/test_restart.py and bench/restart.py.

The task's image holds an agent (AGENT) that works for a while as a harness does: CALLS model
calls over one growing conversation through the real `openai` SDK, GAP seconds apart, whose
retries (max_retries) cover the coordinator's absence. It notes each start in the workspace
(`starts`: started twice would be a rerun) and ends writing its execution's id to answer.txt;
the task's tests score 1 for an even index, 0 for an odd one, so every group of two has an
advantage to train. Executions may be told to stop after two calls (`short`, ids comma-
separated): one ends while the coordinator is away, or a group is ready long before another.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

GYRE = [sys.executable, "-m", "gyre.cli"]
REPO = Path(__file__).resolve().parents[2]

AGENT = textwrap.dedent('''\
    import os, sys, time
    import openai
    calls, gap, retries, short = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    if os.environ["GYRE_EXECUTION"] in short:
        calls = 2
    client = openai.OpenAI(max_retries=retries, timeout=60)
    with open("starts", "a") as f:
        f.write("started\\n")
    messages = [{"role": "user", "content": os.environ["GYRE_TASK"]}]
    for i in range(calls):
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"Go on ({i + 1})."}]
        print("answered", i, flush=True)
        time.sleep(gap)
    open("answer.txt", "w").write(os.environ["GYRE_EXECUTION"] + "\\n")
''')
TEST_SH = textwrap.dedent('''\
    mkdir -p /logs/verifier
    id=$(cat /app/answer.txt) || id=none
    case "$id" in *[02468]) echo 1;; *) echo 0;; esac > /logs/verifier/reward.txt
''')


def scenario(root: Path, *, calls: int, gap_s: float, retries: int = 12, short: str = "-",
             groups: int = 2, steps: int = 1, extra: str = "") -> Path:
    """The task folder and run config under `root`; returns the config's path. `groups`
    groups of 2 are trained in `steps` steps (every execution dispatched at the start is in
    one of them, none left running at the end, unless `extra`'s lines say otherwise)."""
    task = root / "tasks" / "slow"
    (task / "environment").mkdir(parents=True, exist_ok=True)
    (task / "tests").mkdir(exist_ok=True)
    (task / "environment" / "agent.py").write_text(AGENT)
    (task / "environment" / "Dockerfile").write_text(
        "FROM localhost/gyre-base:bookworm\nCOPY agent.py /opt/agent.py\nWORKDIR /app\n")
    (task / "instruction.md").write_text("Say something.\n")
    (task / "task.toml").write_text('version = "1.0"\n')
    (task / "tests" / "test.sh").write_text(TEST_SH)
    config = root / "run.toml"
    config.write_text(extra + textwrap.dedent(f'''\
        tasks_path = "{root / 'tasks'}"
        sandbox = "podman"
        harness = "slow"
        cells = 2
        groups_per_step = {groups // steps}
        group_size = 2
        min_valid = 1
        workers = "inproc"
        [harnesses.slow]
        sandbox_command = ["python3", "/opt/agent.py", "{calls}", "{gap_s}", "{retries}", "{short}"]
    '''))
    return config


def up(config: Path, run_dir: Path, steps: int, log: Path, failpoint: str | None = None) -> subprocess.Popen:
    """`gyre up` in the background; with `failpoint`, held there (coordinator/failpoints.py)."""
    out = open(log, "ab")
    env = {**os.environ, "GYRE_FAILPOINT": failpoint} if failpoint else None
    try:
        return subprocess.Popen([*GYRE, "up", "--config", str(config), "--run-dir", str(run_dir), "--steps",
                                 str(steps), "--no-live"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        out.close()


def resume(run_dir: Path, log: Path, timeout_s: float) -> subprocess.CompletedProcess:
    with open(log, "ab") as out:
        return subprocess.run([*GYRE, "up", "--resume", str(run_dir), "--no-live"], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout_s)


def calls_made(run_dir: Path) -> dict[str, int]:
    """Each execution's recorded calls so far (lines of its calls.jsonl)."""
    out = {}
    for f in (run_dir / "executions").glob("*/calls.jsonl"):
        out[f.parent.name] = f.read_bytes().count(b"\n")
    return out


def answered(recorded) -> int:
    """The calls the harness was answered, after checking the rest and the tree: one root (the
    conversation continued across every restart), and a call the coordinator's stop cut
    (in generation: `disconnected`; while its answer was sent: `undelivered`) kept once with
    its output untrained, the harness's retry of it answered from the same prompt node."""
    assert len(recorded.tree.roots) == 1, recorded.id
    ok = [c for c in recorded.calls if c["status"] == "ok"]
    for c in recorded.calls:
        if c["status"] == "ok":
            continue
        assert c["status"] in ("disconnected", "undelivered"), c
        assert c["output_node"] is None or not recorded.tree.nodes[c["output_node"]].policy, c
        assert any(o["prompt_node"] == c["prompt_node"] for o in ok), c  # retried, and answered
    return len(ok)


def wait_for(what, timeout_s: float, proc: subprocess.Popen | None = None, poll_s: float = 0.2):
    """`what()` once truthy (polling the run's files: the coordinator is another process), else
    AssertionError; also when `proc` ended meanwhile."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the coordinator exited ({proc.returncode}) before {what.__doc__ or what}")
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what.__doc__ or what}")


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the coordinator alone: a crash, an OOM kill (its sandboxes' harnesses run on)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def podman(*args: str, timeout_s: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """The podman CLI seeing what gyre's service sees (its containers.conf)."""
    from gyre.coordinator.sandbox.podman import podman_env

    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s, env=podman_env())
    assert r.returncode == 0 or not check, r.stderr
    return r


def harness_ended(run_dir: Path, execution: str) -> bool:
    """Whether the execution's harness has ended inside its container (its wrapper's exit file)."""
    from gyre.coordinator.sandbox.execs import PID_DIR

    record = json.loads((run_dir / "executions" / execution / "sandbox.json").read_text())
    r = podman("exec", record["id"], "cat", f"{PID_DIR}/{record['harness']['token']}.exit", check=False)
    return r.returncode == 0 and r.stdout.strip().isdigit()


def sandbox_of(run_dir: Path, execution: str) -> str:
    return json.loads((run_dir / "executions" / execution / "sandbox.json").read_text())["id"]


def events(run_dir: Path) -> list[dict]:
    """metrics.jsonl's events; a last line being written (no newline yet) is left for later."""
    text = (run_dir / "metrics.jsonl").read_text()
    whole = text[:text.rfind("\n") + 1]
    return [json.loads(x) for x in whole.splitlines() if x.strip()]


def inspect(run_dir: Path) -> dict:
    """`gyre inspect RUN_DIR --json`, as a user reads the run."""
    r = subprocess.run([*GYRE, "inspect", str(run_dir), "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status(run_dir: Path) -> dict | None:
    """The live coordinator's /gyre/status (None while it has none)."""
    from gyre.cli.live import fetch, status_url

    try:
        return fetch(status_url(str(run_dir)), timeout=2.0)
    except (OSError, ConnectionError, FileNotFoundError, ValueError):
        return None
