"""The bubblewrap backend: a read-only system, the execution's folder the one writable place,
and a network that reaches the proxy and nothing else."""

from __future__ import annotations

import asyncio
import json
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
