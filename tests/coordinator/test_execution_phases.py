"""An execution's phase as the launcher runs it (issue 33, item 5): image, sandbox, harness,
verifier, cleanup, done; and what the live view makes of the harness's phase: "harness"
before its first model call, "model call" while one is in flight at the proxy, "tool"
between calls. A real launcher on the process backend, a real proxy on the scripted engine;
the harness waits on FIFOs (the test looks while it is held there), the proxy looks at each
model call, and the evaluator looks while it scores: no sleeps, no timing."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field

import pytest

from gyre.coordinator.buffer import Execution
from gyre.coordinator.launcher import Launcher, LaunchSpec
from gyre.coordinator.sandbox import Limits
from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.status import execution_rows
from gyre.coordinator.tasks import Task
from gyre.coordinator.waterlevel import Tracked
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.sandbox.conftest import shell_preset

# What the view showed of the watched execution, in order: (phase, calls, calls in flight).
SEEN: list[tuple[str, int, int | None]] = []
WATCHED: dict[str, tuple[Execution, ProxyServer]] = {}  # task id -> (its execution, the proxy)

# Waits on the first FIFO, makes one model call, waits on the second, answers.
HARNESS = textwrap.dedent('''\
    import json, os, sys, urllib.request
    open(sys.argv[1]).read()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()
    open(sys.argv[2]).read()
    open("answer.txt", "w").write("Done.")
''')


def look(run: Execution, proxy: ProxyServer) -> None:
    (row,), _ = execution_rows([run], budgets=proxy.budgets, last_reward={}, queued=0, wall=time.time())
    SEEN.append((row["phase"], row["calls"], row["calls_in_flight"]))


@dataclass(eq=False)
class Traced(Execution):
    """An execution that keeps each phase the launcher moves it to."""

    trace: list[str] = field(default_factory=list)

    def enter(self, phase: str) -> None:
        super().enter(phase)
        self.trace.append(phase)


class WatchingProxy(ProxyServer):
    """The proxy, looking at the watched execution as each model call is served."""

    async def _intercept(self, request, api, req):
        for run, proxy in WATCHED.values():
            if proxy is self:
                look(run, self)
        return None


async def score(task: Task, workspace) -> dict:
    """The task's evaluator: looks while the execution is scored, then passes it."""
    look(*WATCHED[task.id])
    return {"score": 1.0}


@pytest.fixture
async def proxy(chat_tokenizer, tmp_path):
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    engine = ScriptedEngine(chat_tokenizer, tokens_per_step=16)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = WatchingProxy(chat_tokenizer, backend, ProxyConfig(max_context=1 << 16), run_dir=tmp_path / "run")
    await server.start()
    yield server
    await server.stop()
    backend.close()
    SEEN.clear()
    WATCHED.clear()


async def held(fifo, job: asyncio.Future):
    """The FIFO opened for writing: returns once the harness is waiting on it (it stays held
    there until the writer is closed); fails if the execution ends first."""
    opening = asyncio.ensure_future(asyncio.to_thread(open, fifo, "w"))
    await asyncio.wait({opening, job}, return_when=asyncio.FIRST_COMPLETED)
    if not opening.done():
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # lets the open return
        (await opening).close()
        pytest.fail(f"the execution ended before its harness reached {fifo.name}")
    return opening.result()


@pytest.mark.timeout(120)
async def test_the_launcher_moves_an_execution_through_its_phases(proxy, tmp_path):
    fifos = [tmp_path / "started", tmp_path / "between"]
    for fifo in fifos:
        os.mkfifo(fifo)
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    preset = shell_preset(f"{sys.executable} {script} {fifos[0]} {fifos[1]}")
    spec = LaunchSpec(preset=preset, timeout_s=60.0, eval_attempts=1, eval_budget_s=60.0, limits=Limits(pids=512))
    launcher = Launcher(proxy, tmp_path / "run", spec, backend=ProcessBackend())
    task = Task(id="watched", prompt="say Done.", evaluator={
        "type": "python", "callable": f"{__name__}:score"})
    run = Traced(id="g00000-00", group=0, index=0, task=task, tracked=Tracked(), version_dispatched=0)
    assert (run.phase, run.phase_t) == ("queued", None)
    WATCHED[task.id] = (run, proxy)
    job = asyncio.ensure_future(launcher.run(run))
    for fifo in fifos:
        writer = await held(fifo, job)  # the harness waits there: the view looks now
        look(run, proxy)
        writer.close()
    await job
    assert (run.status, run.reward) == ("completed", 1.0), run.ref
    assert SEEN == [
        ("harness", 0, 0),  # started, no model call yet
        ("model call", 0, 1),  # its call at the proxy
        ("tool", 1, 0),  # between calls: its own code
        ("verifier", 1, 0),  # being scored
    ]
    assert run.trace == ["image", "sandbox", "harness", "verifier", "cleanup", "done"]
    assert run.phase == "done" and run.phase_t >= run.t_end - 1.0
