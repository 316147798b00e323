"""Copy-out under hostile workspaces, and sandboxes that must go whatever fails (issue 26, finding 3).

An absolute link in the container's workdir used to make the copy-out raise after the
execution was scored: the execution ended aborted_infra, its container was left running,
and `gyre serve --task-dir` crashed. Now links are never followed (kept where they stay
inside the copy, else left out and named), the copy has a cap, whatever goes wrong there is
recorded as the execution's copy_out_error without touching its status, and the container
is removed, also when something fails right after it was made. Real podman.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from gyre.coordinator import scoring as scoring_module
from gyre.coordinator.sandbox import images
from gyre.coordinator.sandbox.base import LABEL_OWNER, LABEL_RUN_DIR
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.tasks import Environment, Task
from tests.sandbox.conftest import containers, harbor_task, podman, podman_ready, run_task, scripted_proxy, shell_preset

__all__ = ["podman", "podman_ready", "scripted_proxy"]  # fixtures, used by name
pytestmark = pytest.mark.sandbox

LINKS = textwrap.dedent('''\
    echo 42 > answer.txt
    ln -s /etc/passwd abs
    ln -s ../../etc escapes
    ln -s answer.txt rel
    mkdir d && ln -s / d/root
''')


def _record(run_dir, execution: str = "e1") -> dict:
    return json.loads((run_dir / "executions" / execution / "sandbox.json").read_text())


async def test_links_out_of_the_workdir_are_left_out_and_the_score_stands(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "links")
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset(LINKS),
                         owner="links1")
    assert (run.status, run.reward, run.valid) == ("completed", 1.0, True), (run.status, run.ref)
    work = tmp_path / "run" / "executions" / "e1" / "workspace"
    assert (work / "answer.txt").read_text() == "42\n"
    assert (work / "rel").is_symlink() and (work / "rel").read_text() == "42\n"  # inside: kept as a link
    for gone in ("abs", "escapes", "d/root"):  # out of the copy: left out, never followed
        assert not (work / gone).exists() and not (work / gone).is_symlink(), gone
    error = _record(tmp_path / "run")["copy_out_error"]
    assert "3 entries left out" in error and "abs" in error, error
    assert run.copy_out_error == error
    harness = _record(tmp_path / "run")["harness"]  # what finds the harness again after a restart (issue 34)
    assert set(harness) == {"exec", "token", "started", "timeout_s"} and len(harness["exec"]) >= 12, harness
    assert containers(podman, **{LABEL_OWNER: "links1"}) == []


async def test_serve_on_a_task_whose_workdir_holds_an_absolute_link(podman, scripted_proxy, tmp_path):
    from gyre.coordinator.serve import run_harness_once

    task = load_harbor_task(harbor_task(tmp_path, "serve-links"))
    summary = await run_harness_once(scripted_proxy, shell_preset(LINKS), task.prompt, run_dir=tmp_path / "run",
                                     task=task, sandbox="podman")
    assert (summary["status"], summary["score"], summary["valid"]) == ("completed", 1.0, True), summary
    assert containers(podman, **{LABEL_RUN_DIR: str(tmp_path / "run")}) == []


async def test_a_copy_out_over_its_cap_stops_there_and_the_score_stands(podman, scripted_proxy, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(scoring_module, "COPY_LIMIT_BYTES", 1 << 20)  # where the copy-out reads it
    big = "echo 42 > answer.txt\nhead -c 4194304 /dev/zero > zeros\nhead -c 4194304 /dev/zero > zeros2\n"
    folder = harbor_task(tmp_path, "big")
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset(big),
                         owner="big1")
    assert (run.status, run.reward, run.valid) == ("completed", 1.0, True), (run.status, run.ref)
    work = tmp_path / "run" / "executions" / "e1" / "workspace"
    copied = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
    assert copied <= 1 << 20, copied
    assert "stopped at its cap" in _record(tmp_path / "run")["copy_out_error"]
    assert containers(podman, **{LABEL_OWNER: "big1"}) == []


async def test_a_failure_right_after_the_container_is_made_removes_it(podman, scripted_proxy, tmp_path):
    # A task whose files cannot be written (a path out of the workspace): found once the
    # container exists, when its files are made to be copied in.
    task = Task(id="bad-files", prompt="p", workspace={"../outside.txt": "x"}, target="x",
                environment=Environment(image=images.BASE_IMAGE))
    try:
        run = await run_task(scripted_proxy, podman, task, tmp_path / "run", shell_preset("true"), owner="bad1")
        assert (run.status, run.reward, run.valid) == ("aborted_infra", None, False)
        assert "outside.txt" in run.ref, run.ref
        assert containers(podman, **{LABEL_OWNER: "bad1"}) == []
    finally:
        for c in containers(podman, **{LABEL_OWNER: "bad1"}):  # what the original code left
            c.remove(force=True)
