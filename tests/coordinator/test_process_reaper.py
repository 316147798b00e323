"""The process backend's orphans: a harness whose coordinator is gone is killed by the next
start's reaper (found by the markers in its environment); one whose coordinator still runs is
not, whether or not its run directory is locked."""

from __future__ import annotations

import asyncio
import secrets

from gyre.coordinator.sandbox import SandboxSpec
from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER, LABEL_PROCESS, LABEL_RUN_DIR, process_label
from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.sandbox.reaper import at_startup


async def _sleeper(backend, tmp_path, owner: str, process: str):
    box = await backend.create(SandboxSpec(execution=owner, workdir=str(tmp_path / owner / "workspace"), labels={
        LABEL_OWNER: owner, LABEL_RUN_DIR: str(tmp_path / owner), LABEL_EXECUTION: owner, LABEL_PROCESS: process}))
    job = asyncio.create_task(box.exec(["sh", "-c", "touch started; exec sleep 300"], timeout_s=600))
    started = tmp_path / owner / "workspace" / "started"
    for _ in range(400):
        if started.exists():
            return job
        await asyncio.sleep(0.05)
    raise AssertionError("the harness never started")


async def test_a_dead_coordinators_harness_is_killed_and_a_live_ones_is_not(tmp_path):
    backend = ProcessBackend()
    dead, live = f"dead-{secrets.token_hex(4)}", f"live-{secrets.token_hex(4)}"
    gone = f"{process_label().rsplit(':', 1)[0]}:999999999"  # a start time no process has
    dead_job = await _sleeper(backend, tmp_path, dead, gone)
    live_job = await _sleeper(backend, tmp_path, live, process_label())
    mine = at_startup("the-new-coordinator", tmp_path / "new-run")
    try:
        # Only these two are judged (other processes on the machine are not this test's).
        ours = lambda labels: labels.get(LABEL_OWNER) not in (dead, live) or mine(labels)  # noqa: E731
        assert await backend.reap(ours) == 1
        result = await asyncio.wait_for(dead_job, 30)
        assert result.code == -9 or result.code == 137, result
        assert not live_job.done()
    finally:
        live_job.cancel()
        await asyncio.gather(live_job, return_exceptions=True)
