"""Limits that hold against a harness (issue 26, finding 9): storage_mb, the size of
harness.log, and nothing of a harness outliving its deadline. Real podman containers and
real host processes; the limits are made small so the tests stay quick.
"""

from __future__ import annotations

import os
import secrets
import sys
import textwrap

import pytest

from gyre.coordinator import launcher as launcher_module
from gyre.coordinator.sandbox.base import LABEL_OWNER
from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.tasks import Environment, Task
from tests.faults.test_sandbox_trust import marked
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

# One call (so the execution has work of the agent's), an answer, then more than the task's
# storage allows, then a wait the storage limit must end long before the deadline.
HOARD = CALL_PROXY + "echo 42 > answer.txt\nhead -c 33554432 /dev/zero > hoard\nsleep 600\n"


@pytest.fixture
def quick_storage_checks(monkeypatch):
    from gyre.coordinator.sandbox import storage

    monkeypatch.setattr(storage, "POLL_S", 0.2)


@pytest.mark.sandbox
async def test_a_container_over_its_storage_mb_is_stopped_and_scored(podman, scripted_proxy, tmp_path,
                                                                   quick_storage_checks):
    folder = harbor_task(tmp_path, "hoard", toml="[agent]\ntimeout_sec = 30\n[environment]\nstorage_mb = 8\n",
                         test_sh='[ -f /app/answer.txt ] && echo 0.5 > /logs/verifier/reward.txt\n')
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset(HOARD),
                         owner="hoard1")
    # Stopped like a memory hog (exit 137), scored on what it left.
    assert (run.status, run.reward, run.valid) == ("harness_error", 0.5, True), (run.status, run.ref)
    log = (tmp_path / "run" / "executions" / "e1" / "harness.log").read_text()
    assert "storage limit of 8 MiB exceeded" in log and "deadline" not in log
    assert containers(podman, **{LABEL_OWNER: "hoard1"}) == []


async def test_a_host_workspace_over_its_storage_mb_is_stopped(scripted_proxy, tmp_path, quick_storage_checks):
    owner = f"hoard-{secrets.token_hex(3)}"
    task = Task(id="hoard", prompt="p", target="42", timeout_s=30, environment=Environment(storage_mb=8))
    try:
        run = await run_task(scripted_proxy, ProcessBackend(), task, tmp_path / "run",
                             shell_preset(HOARD.replace("python3", sys.executable)), owner=owner)
        assert (run.status, run.valid) == ("harness_error", True), (run.status, run.ref)
        assert "storage limit of 8 MiB exceeded" in (tmp_path / "run" / "executions" / "e1" / "harness.log").read_text()
        assert marked(owner) == []
    finally:
        for pid in marked(owner):
            os.kill(pid, 9)


LOUD = "head -c 8388608 /dev/zero | tr '\\0' x; echo; echo 42 > answer.txt\n"


async def _loud(proxy, box, task, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(launcher_module, "HARNESS_LOG_BYTES", 1 << 20)
    run = await run_task(proxy, box, task, tmp_path / "run", shell_preset(LOUD))
    assert run.status == "completed" and run.reward == 1.0, (run.status, run.ref)
    log = (tmp_path / "run" / "executions" / "e1" / "harness.log").read_bytes()
    assert (1 << 20) <= len(log) < (1 << 20) + 4096, len(log)
    assert b"harness.log reached its cap of 1 MiB" in log


async def test_harness_log_is_capped_on_the_host(scripted_proxy, tmp_path, monkeypatch):
    await _loud(scripted_proxy, ProcessBackend(), Task(id="loud", prompt="p", target="42"), tmp_path, monkeypatch)


@pytest.mark.sandbox
async def test_harness_log_is_capped_in_a_container(podman, scripted_proxy, tmp_path, monkeypatch):
    await _loud(scripted_proxy, podman, load_harbor_task(harbor_task(tmp_path, "loud")), tmp_path, monkeypatch)


# The harness is ended at its deadline; a child of it that ignores SIGTERM must not survive.
STUBBORN = textwrap.dedent('''\
    sh -c 'trap "" TERM; while :; do sleep 0.1; done' term-immune-loop &
    echo 42 > answer.txt
    exec sleep 300
''')


async def test_nothing_of_a_harness_outlives_its_deadline(scripted_proxy, tmp_path):
    owner = f"stubborn-{secrets.token_hex(3)}"
    task = Task(id="stubborn", prompt="p", target="42", timeout_s=1)
    try:
        run = await run_task(scripted_proxy, ProcessBackend(), task, tmp_path / "run", shell_preset(STUBBORN),
                             owner=owner)
        assert (run.status, run.reward) == ("timed_out", 1.0), (run.status, run.ref)
        assert marked(owner) == []
    finally:
        for pid in marked(owner):
            os.kill(pid, 9)
