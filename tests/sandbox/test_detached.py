"""A harness in a container outlives the coordinator that started it (issue 34, first slice).

A coordinator-to-be opens gyre's podman service, starts a sandbox and a harness in it, says
where they are (the container, the exec's id and token, as the launcher records them in
sandbox.json), and is SIGKILLed while the harness runs; its podman service dies with it
(PDEATHSIG). A new backend (a new service) finds the same container still running and waits
for the same exec: the harness ran to its own end after the kill, its exit code and its whole
output come back, and nothing was started twice. The exec's identity is what
ContainerSandbox.on_start tells, and an exec that the engine has let go is still found by its
exit file.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from gyre.coordinator.sandbox import SandboxSpec, images
from gyre.coordinator.sandbox.base import LABEL_EXECUTION
from tests.sandbox.conftest import REPO

# Counts to 40 over about 4 s (a file of its own marks each start), then exits 7.
HARNESS = ("echo started >> /tmp/starts; i=0; while [ $i -lt 40 ]; do echo tick $i; i=$((i+1)); sleep 0.1; done; "
           "exit 7")

COORDINATOR = textwrap.dedent('''\
    import asyncio, json, sys
    from gyre.coordinator.sandbox import SandboxSpec, images, make_backend
    from gyre.coordinator.sandbox.base import LABEL_EXECUTION

    async def main():
        backend = make_backend("podman")
        await backend.open()
        box = await backend.create(SandboxSpec(execution="detached", labels={LABEL_EXECUTION: "detached"},
                                               image=images.BASE_IMAGE))
        told = asyncio.get_running_loop().create_future()
        box.on_start = lambda info: told.done() or told.set_result(info)
        asyncio.ensure_future(box.exec(["sh", "-c", sys.argv[1]], timeout_s=120))
        info = await told
        print(json.dumps({"container": box.id, **info}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
''')


@pytest.fixture
def killed_coordinator(podman_ready):
    """Starts the coordinator-to-be, reads where its harness runs, SIGKILLs it: that record."""
    proc = subprocess.Popen([sys.executable, "-c", COORDINATOR, HARNESS], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the coordinator-to-be said nothing"
        yield json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


async def test_a_harness_outlives_its_coordinator_and_a_new_one_waits_for_its_end(podman, killed_coordinator):
    record = killed_coordinator
    spec = SandboxSpec(execution="detached", labels={LABEL_EXECUTION: "detached"}, image=images.BASE_IMAGE)
    box = await podman.adopt(record["container"], spec)
    assert box is not None and box.id == record["container"]  # the same container, still running
    try:
        out = bytearray()

        class Log:
            def write(self, data: bytes) -> int:
                out.extend(data)
                return len(data)

            def flush(self) -> None:
                pass

        code = await box.wait_detached(record["exec"], record["token"], log=Log(), poll_s=0.2)
        assert code == 7
        text = out.decode()
        assert "tick 0" in text and "tick 39" in text, text  # the whole output, written after the kill too
        assert (await box.execs.read("/tmp/starts", 1024)) == b"started\n"  # it ran once, never again
    finally:
        await box.stop()


async def test_an_exec_the_engine_let_go_is_found_by_its_exit_file(podman):
    box = await podman.create(SandboxSpec(execution="gone", labels={LABEL_EXECUTION: "gone"}, image=images.BASE_IMAGE))
    try:
        told = []
        box.on_start = told.append
        result = await box.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=30)
        assert result.code == 3 and b"out" in result.output and b"err" in result.output
        [info] = told
        assert await box.wait_detached(info["exec"], info["token"]) == 3  # the engine still keeps it
        assert await box.wait_detached("no-such-exec", info["token"]) == 3  # from TOKEN.exit inside
        assert await box.wait_detached("no-such-exec", "0000") is None  # neither says: unknown, not 0
    finally:
        await box.stop()


async def test_adopting_a_sandbox_that_is_gone_says_none(podman):
    spec = SandboxSpec(execution="x", labels={LABEL_EXECUTION: "x"}, image=images.BASE_IMAGE)
    box = await podman.create(spec)
    await box.stop()
    assert await podman.adopt(box.id, spec) is None
