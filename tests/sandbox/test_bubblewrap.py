"""The bubblewrap backend: a read-only system, the execution's folder the one writable place,
and a network that reaches the proxy and nothing else."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

from gyre.coordinator.sandbox.bubblewrap import BubblewrapBackend
from gyre.coordinator.tasks import Task
from tests.sandbox.conftest import run_task, shell_preset
from tests.sandbox.test_podman import PROBE, _host_address

NAME = "gyre-bwrap-probe"
# The system is read-only; home and /tmp are the sandbox's own (tmpfs), never the host's.
WRITES = (f'for p in /usr/{NAME} /etc/{NAME}; do touch "$p" 2>/dev/null && echo "$p" >> wrote-system; done; '
          f'touch "$HOME/{NAME}" /tmp/{NAME} 2>/dev/null; echo inside > notes.txt\n')


async def test_bubblewrap_reaches_the_proxy_only_and_writes_only_its_folder(bwrap_ready, scripted_proxy, tmp_path):
    other = await asyncio.start_server(lambda r, w: w.close(), "0.0.0.0", 0)
    port = other.sockets[0].getsockname()[1]
    backend = BubblewrapBackend()
    await backend.open()
    task = Task(id="bw", prompt="probe", workspace={"probe.py": PROBE}, target="x")
    try:
        run = await run_task(scripted_proxy, backend, task, tmp_path / "run",
                             shell_preset(WRITES + f"python3 probe.py {port} {_host_address()}"))
    finally:
        other.close()
        await backend.close()
    assert run.status == "completed", (run.status, run.ref)
    work = tmp_path / "run" / "executions" / "e1" / "workspace"
    seen = json.loads((work / "probe.json").read_text())
    assert seen["proxy"] == 200 and seen["host_port"] == "ConnectionRefusedError", seen
    assert seen["host_address"] != "connected" and seen["other_address"] != "connected", seen
    assert seen["dns"] == "gaierror", seen
    assert (work / "notes.txt").read_text() == "inside\n" and not (work / "wrote-system").exists()
    assert not (Path.home() / NAME).exists() and not Path("/tmp", NAME).exists()  # nothing reached the host


def _labels(owner: str, run_dir: Path, process: str) -> dict:
    from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER, LABEL_PROCESS, LABEL_RUN_DIR

    return {LABEL_OWNER: owner, LABEL_RUN_DIR: str(run_dir), LABEL_EXECUTION: "e1", LABEL_PROCESS: process}


async def test_a_stopped_sandbox_leaves_nothing_for_the_reaper(bwrap_ready, tmp_path, caplog):
    """stop returns once the holder's namespace is gone: a reap right after (shutdown's) finds
    nothing, where it used to find bwrap's child and `sleep` still dying, 'orphans'."""
    import logging

    from gyre.coordinator.sandbox import SandboxSpec, reaper
    from gyre.coordinator.sandbox.base import process_label

    backend = BubblewrapBackend()
    await backend.open()
    caplog.set_level(logging.INFO, logger="gyre.coordinator")
    found = []
    for i in range(20):  # the race it had was lost about every other time here
        owner = f"clean-{i}-{secrets.token_hex(3)}"
        box = await backend.create(SandboxSpec(execution="e1", workdir=str(tmp_path / str(i) / "workspace"),
                                               labels=_labels(owner, tmp_path, process_label())))
        assert (await box.exec(["true"], timeout_s=30)).code == 0
        await box.stop()
        found.append(await reaper.reap(backend, reaper.at_shutdown(owner), "at shutdown (local)"))
    await backend.close()
    assert found == [0] * 20
    assert not [r for r in caplog.records if "orphan" in r.getMessage()]


async def test_a_dead_makers_sandbox_is_reaped_and_counted_as_one(bwrap_ready, tmp_path, caplog):
    """A sandbox whose maker is gone (a start time no process has) is killed by the next
    start's reaper, holder and harness alike, and reported as one sandbox, not per process."""
    import logging

    from gyre.coordinator.sandbox import SandboxSpec, reaper
    from gyre.coordinator.sandbox.base import LABEL_OWNER, process_label

    backend = BubblewrapBackend()
    await backend.open()
    dead = f"dead-{secrets.token_hex(4)}"
    gone = f"{process_label().rsplit(':', 1)[0]}:999999999"
    box = await backend.create(SandboxSpec(execution="e1", workdir=str(tmp_path / "dead" / "workspace"),
                                           labels=_labels(dead, tmp_path / "dead", gone)))
    job = asyncio.create_task(box.exec(["sh", "-c", "touch started; exec sleep 300"], timeout_s=600))
    started = tmp_path / "dead" / "workspace" / "started"
    for _ in range(400):
        if started.exists():
            break
        await asyncio.sleep(0.05)
    caplog.set_level(logging.INFO, logger="gyre.coordinator")
    mine = reaper.at_startup("the-next-run", tmp_path / "next")
    try:
        # Only this test's sandbox is judged (other processes on the machine are not its own).
        n = await reaper.reap(backend, lambda labels: labels.get(LABEL_OWNER) != dead or mine(labels),
                              "at start-up (local)")
        assert n == 1
        assert (await asyncio.wait_for(job, 30)).code in (-9, 137)
        assert any("removed 1 orphan sandbox(es) at start-up" in r.getMessage() for r in caplog.records)
    finally:
        await box.stop()  # the holder is gone already: stop still returns
        await backend.close()
    assert box.holder.poll() is not None


def test_two_clean_serve_runs_warn_of_no_orphan(bwrap_ready, tmp_path):
    import subprocess
    import sys

    from tests.sandbox.conftest import REPO

    for name in ("x1", "x2"):
        r = subprocess.run([sys.executable, "-m", "gyre.cli", "serve", "--sandbox", "bubblewrap", "--harness", "demo",
                            "--task", "say hello", "--run-dir", str(tmp_path / name)], cwd=REPO, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout.splitlines()[-1])["status"] == "completed"
        assert "orphan" not in r.stderr, r.stderr[-2000:]
        assert "sandbox bubblewrap isolates each harness: an unprivileged uid" in r.stderr  # the start line
