"""Real Claude Code and Codex in podman outlive their coordinator (issue 34): each works a task
in its container as examples/harnesses/NAME.toml runs it (npm's install on PATH), a coordinator-
to-be (a real proxy on the scripted engine, the launcher, gyre's podman service) in its own
process. Two model calls in, that process is SIGKILLed; the harness's next call is cut unanswered
and retried by the harness's own budget (the preset's CLAUDE_CODE_MAX_RETRIES, Codex's
request_max_retries / stream_max_retries with unbounded retries off). A new proxy and launcher on
the same run directory adopt the execution: the harness is never started again (its tool work is
done once: K steps, K files or lines), every call after the restart extends the one before it
(the conversation continued in one tree), and its tests score it."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import pytest

from gyre.coordinator.buffer import Execution
from gyre.coordinator.launcher import Launcher, LaunchSpec
from gyre.coordinator.sandbox import Limits, SandboxSpec
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.waterlevel import Tracked
from gyre.proxy.records import load_execution
from gyre.workerd.netns import bind_in_netns
from tests.harness.test_codex import proxy  # noqa: F401  (the fixture: the scripted engine, Codex's context)
from tests.harness.test_example_harnesses import example, on_path, verifier
from tests.sandbox.conftest import harbor_task, kill_after_its_word, podman, podman_ready  # noqa: F401  (fixtures)
from tests.scripted import tool_call

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(420)]
STEPS = 4  # tool calls before the policy says it is done


def policy(harness: str):
    """The scripted policy for `harness`: STEPS tool calls, then done. The same in both
    coordinators."""
    if harness == "claude-code":
        def script(prompt: str) -> str:
            done = prompt.count("<tool_response>")
            return "Done: log written." if done >= STEPS else tool_call(
                "Bash", command=f"sleep 1; echo {done} >> /app/log", description=f"step {done}")
    else:
        def script(prompt: str) -> str:
            done = prompt.count("Success. Updated")
            patch = f"*** Begin Patch\n*** Add File: f{done}.txt\n+{done}\n*** End Patch\n"
            return "Done: files written." if done >= STEPS else tool_call("apply_patch", input=patch)
    return script


def score(harness: str) -> str:
    if harness == "claude-code":
        return verifier("/app/log", "\n".join(str(i) for i in range(STEPS)))
    return verifier("/app/f3.txt", "3")


def spec(preset) -> LaunchSpec:
    return LaunchSpec(preset=preset, timeout_s=300, eval_attempts=1, eval_budget_s=60.0, limits=Limits(pids=1024))


COORDINATOR = textwrap.dedent('''\
    import asyncio, json, sys
    from pathlib import Path
    from gyre.coordinator.buffer import Execution
    from gyre.coordinator.launcher import Launcher
    from gyre.coordinator.sandbox import make_backend
    from gyre.coordinator.taskformats import load_harbor_task
    from gyre.coordinator.waterlevel import Tracked
    from gyre.proxy.chat import ChatTokenizer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from tests.harness.test_example_harnesses import example
    from tests.harness.test_restart_harnesses import policy, spec
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    async def main():
        harness, tiny, task_dir, run_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
        tok = ChatTokenizer(tiny)
        engine = ScriptedEngine(tok, tokens_per_step=64)
        engine.script = policy(harness)
        backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
        proxy = ProxyServer(tok, backend, ProxyConfig(max_context=1 << 21, ping_interval_s=0.5), run_dir=run_dir)
        await proxy.start()
        podman = make_backend("podman")
        await podman.open()
        launcher = Launcher(proxy, run_dir, spec(example(harness)), backend=podman, owner="first")
        run = Execution(id="e1", group=0, index=0, task=load_harbor_task(task_dir), tracked=Tracked(),
                        version_dispatched=0)
        asyncio.ensure_future(launcher.run(run))
        while run.recorder is None or len(run.recorder.calls) < 2:
            await asyncio.sleep(0.05)
        print(json.dumps({"calls": len(run.recorder.calls)}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
''')


@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_a_real_harness_in_podman_outlives_its_coordinator(harness, request, proxy, podman, tiny_dir,
                                                                 tmp_path, monkeypatch):
    binary = request.getfixturevalue("claude_bin" if harness == "claude-code" else "codex_bin")
    on_path(monkeypatch, tmp_path, binary, "claude" if harness == "claude-code" else "codex")
    preset = example(harness)
    assert dict(preset.env).get("CLAUDE_CODE_MAX_RETRIES") == "8" or harness == "codex"
    server, engine = proxy
    engine.script = policy(harness)
    folder = harbor_task(tmp_path, "steps", test_sh=score(harness))
    run_dir = server.run_dir
    before = kill_after_its_word([sys.executable, "-c", COORDINATOR, harness, str(tiny_dir), str(folder),
                                  str(run_dir)])["calls"]
    # The harness works on without a proxy. Its next call is taken in the sandbox's namespace,
    # at the proxy's port, and its connection closed unanswered (as a kill cuts a call in
    # flight): the harness has met the outage, and retries.
    record = json.loads((run_dir / "executions" / "e1" / "sandbox.json").read_text())
    box = await podman.adopt(record["id"], SandboxSpec(execution="e1", labels={}, image=None))
    listener = bind_in_netns(box.netns_pid())
    try:
        listener.setblocking(True)
        listener.settimeout(120)
        conn, _ = await asyncio.to_thread(listener.accept)
        conn.close()
    finally:
        listener.close()

    launcher = Launcher(server, run_dir, spec(preset), backend=podman, owner="second")
    run = Execution(id="e1", group=0, index=0, task=load_harbor_task(folder), tracked=Tracked(), version_dispatched=0)
    assert launcher.adopting("e1")
    await launcher.adopt(run)
    log = (run_dir / "executions" / "e1" / "harness.log").read_text()
    assert (run.status, run.reward) == ("completed", 1.0), (run.status, run.ref, log[-3000:])
    assert "was adopted" in log
    ex = run.recorder  # the calls from before the kill (taken back from calls.jsonl) and after
    assert len(load_execution(run_dir / "executions" / "e1").calls) == len(ex.calls)  # each on disk once
    main = [c for c in ex.calls if c["role"] == "main"]
    assert len(main) == STEPS + 1, [c["role"] for c in ex.calls]  # each step's call once, then done
    for prev, nxt in zip(main, main[1:]):  # one conversation across the restart: each extends the last
        head = ex.prompt_path(prev) + [prev["output_node"]]
        assert ex.prompt_path(nxt)[:len(head)] == head, (prev["call_id"], nxt["call_id"])
    assert before >= 2 and len(ex.calls) > before
