"""Orphans: a killed coordinator's containers are removed by the next start; a live run's and
a deliberately kept one stay."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from gyre.coordinator.launcher import open_sandboxes
from gyre.coordinator.rundir import claim
from gyre.coordinator.sandbox import SandboxSpec, images, reaper
from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER, LABEL_PROCESS, LABEL_RUN_DIR, process_label
from gyre.coordinator.sandbox.reaper import mark_kept
from tests.sandbox.conftest import REPO, containers

# A coordinator-to-be that opens podman, starts a sandbox and then waits to be killed.
KILLED = textwrap.dedent('''\
    import asyncio, sys
    from pathlib import Path
    from gyre.coordinator.sandbox import SandboxSpec, images, make_backend
    from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER, LABEL_PROCESS, LABEL_RUN_DIR, process_label

    async def main():
        run_dir = Path(sys.argv[1])
        backend = make_backend("podman")  # opened without a start-up reap: the orphans stay
        await backend.open()
        labels = {LABEL_OWNER: "killed-" + sys.argv[2], LABEL_RUN_DIR: str(run_dir), LABEL_EXECUTION: sys.argv[2],
                  LABEL_PROCESS: process_label()}
        await backend.create(SandboxSpec(execution=sys.argv[2], labels=labels, image=images.BASE_IMAGE))
        print("ready", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
''')


def _killed_run(run_dir, execution: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(run_dir), execution], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


async def test_orphans_of_a_killed_run_are_reaped_at_the_next_start(podman, tmp_path):
    dead, kept, live = tmp_path / "dead", tmp_path / "kept", tmp_path / "live"
    _killed_run(dead, "orphan")
    _killed_run(kept, "debug-me")
    (kept / "executions" / "debug-me").mkdir(parents=True)
    mark_kept(kept, "debug-me", {"backend": "podman"})  # keep_sandbox's marker
    lock = claim(live)  # another run, alive: it holds its directory
    try:
        await podman.create(SandboxSpec(execution="live-one", image=images.BASE_IMAGE, labels={
            LABEL_OWNER: "someone-alive", LABEL_RUN_DIR: str(live), LABEL_EXECUTION: "live-one"}))
        # A live process's sandbox whose run directory nobody locks (a bench, a test): not an orphan.
        unlocked = tmp_path / "unlocked"
        await podman.create(SandboxSpec(execution="mine", image=images.BASE_IMAGE, labels={
            LABEL_OWNER: "this-process", LABEL_RUN_DIR: str(unlocked), LABEL_EXECUTION: "mine",
            LABEL_PROCESS: process_label()}))
        assert len(containers(podman, **{LABEL_RUN_DIR: str(dead)})) == 1  # the orphan outlived its run
        again = await open_sandboxes(sandbox="podman", run_dir=tmp_path / "next")  # the next start
        try:
            b = again.backend
            assert containers(b, **{LABEL_RUN_DIR: str(dead)}) == []
            assert len(containers(b, **{LABEL_RUN_DIR: str(kept)})) == 1
            assert len(containers(b, **{LABEL_RUN_DIR: str(live)})) == 1
            assert len(containers(b, **{LABEL_RUN_DIR: str(unlocked)})) == 1
            lock.release()  # the live run ends: its sandbox is an orphan now; the kept one is let go
            (kept / "executions" / "debug-me" / "sandbox-kept.json").unlink()
            assert await b.reap(reaper.at_startup(again.owner, tmp_path / "next")) == 2  # mine still stays
            assert await b.reap(lambda labels: labels.get(LABEL_OWNER) != "this-process") == 1
            assert containers(b, **{LABEL_RUN_DIR: str(live)}) == containers(b, **{LABEL_RUN_DIR: str(kept)}) == []
        finally:
            await again.close()
    finally:
        lock.release()


async def test_a_verifier_image_a_crash_left_is_reaped(podman, tmp_path):
    """The agent environment commits the agent's container to a temporary gyre-verify-* image
    (removed after scoring); one a crash left carries the container's labels, and the reaper
    removes it with the orphans of its run, never another's."""
    import secrets

    from gyre.coordinator.sandbox.docker_api import VERIFY_IMAGE_PREFIX

    owner = f"verify-orphan-{secrets.token_hex(3)}"
    made = []
    for name in ("dead", "live"):
        sandbox = await podman.create(SandboxSpec(execution=name, image=images.BASE_IMAGE, labels={
            LABEL_OWNER: f"{owner}-{name}", LABEL_RUN_DIR: str(tmp_path), LABEL_EXECUTION: name}))
        made.append(await podman.commit(sandbox, f"{VERIFY_IMAGE_PREFIX[len('localhost/'):]}{owner}-{name}"))
        await sandbox.stop()
    try:
        removed = await podman.reap(lambda labels: labels.get(LABEL_OWNER) != f"{owner}-dead")
        assert removed == 1
        assert not podman.image_exists(made[0]) and podman.image_exists(made[1])
    finally:
        for image in made:
            if podman.image_exists(image):
                podman.client.api.remove_image(image, force=True)
