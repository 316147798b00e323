"""A restarted coordinator carries on with an execution whose harness outlived the old one
(issue 34: Launcher.adopt).

A coordinator-to-be (a real proxy on the scripted engine, the launcher, gyre's podman service)
runs a Harbor task whose harness makes its model calls one after another through the
sandbox's relay, retrying a call that fails as harnesses do. After its second call is
recorded the coordinator is SIGKILLed; its proxy, relay and podman service die with it. A new
proxy and launcher on the same run directory adopt the execution: the same container, the
harness never started again, its remaining calls answered by the new proxy through a relay
made again at the same port, the call the kill cut retried into the same tree (one root per
prompt), the execution scored by its tests as any other and its sandbox removed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

from gyre.coordinator.buffer import Execution
from gyre.coordinator.launcher import Launcher, LaunchSpec
from gyre.coordinator.sandbox import Limits, SandboxSpec
from gyre.coordinator.sandbox.execs import PID_DIR
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.waterlevel import Tracked
from gyre.proxy.records import load_execution
from tests.sandbox.conftest import containers, harbor_task, kill_after_its_word, scripted_proxy, shell_preset

__all__ = ["scripted_proxy"]  # a fixture, used by name

CALLS = 8
# The harness: CALLS calls, each retried for up to 90 s while the proxy is away, 0.3 s apart.
HARNESS = textwrap.dedent(f'''\
    echo started >> /app/starts
    python3 - <<'PY'
    import json, os, time, urllib.request
    for i in range({CALLS}):
        body = json.dumps({{"model": "m", "max_tokens": 8, "messages": [{{"role": "user", "content": f"step {{i}}"}}]}})
        give_up = time.time() + 90
        while True:
            try:
                req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body.encode(),
                    headers={{"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                             "Content-Type": "application/json"}})
                urllib.request.urlopen(req, timeout=30).read()
                break
            except OSError as e:
                if time.time() > give_up:
                    raise
                print("retrying step", i, type(e).__name__, flush=True)
                time.sleep(0.3)
        print("answered step", i, flush=True)
        time.sleep(0.3)
    open("/app/answer.txt", "w").write("42\\n")
    PY
''')
SCORE = 'if [ "$(cat /app/answer.txt)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'

COORDINATOR = textwrap.dedent('''\
    import asyncio, json, sys
    from pathlib import Path
    from gyre.coordinator.buffer import Execution
    from gyre.coordinator.launcher import Launcher, LaunchSpec
    from gyre.coordinator.sandbox import Limits, make_backend
    from gyre.coordinator.taskformats import load_harbor_task
    from gyre.coordinator.waterlevel import Tracked
    from gyre.proxy.chat import ChatTokenizer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from tests.sandbox.conftest import shell_preset
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    async def main():
        tiny, task_dir, run_dir, harness = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
        tok = ChatTokenizer(tiny)
        backend = ThreadEngineBackend(ScriptedEngine(tok, tokens_per_step=16), sampling_cls=lambda **kw: kw)
        proxy = ProxyServer(tok, backend, ProxyConfig(max_context=1 << 16), run_dir=run_dir)
        await proxy.start()
        podman = make_backend("podman")
        await podman.open()
        spec = LaunchSpec(preset=shell_preset(harness), timeout_s=300, eval_attempts=1, eval_budget_s=60.0,
                          limits=Limits(pids=512))
        launcher = Launcher(proxy, run_dir, spec, backend=podman, owner="first")
        run = Execution(id="e1", group=0, index=0, task=load_harbor_task(task_dir), tracked=Tracked(),
                        version_dispatched=0)
        asyncio.ensure_future(launcher.run(run))
        while run.recorder is None or len(run.recorder.calls) < 2:
            await asyncio.sleep(0.05)
        print(json.dumps({"calls": len(run.recorder.calls)}), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
''')


async def test_a_restarted_coordinator_adopts_a_running_harness_and_scores_it(podman, scripted_proxy, tiny_dir,
                                                                              tmp_path):
    folder = harbor_task(tmp_path, "adopted", test_sh=SCORE)
    run_dir = scripted_proxy.run_dir
    before = kill_after_its_word([sys.executable, "-c", COORDINATOR, str(tiny_dir), str(folder), str(run_dir),
                                  HARNESS])["calls"]
    record = json.loads((run_dir / "executions" / "e1" / "sandbox.json").read_text())
    # The harness runs on without a proxy: wait until a call of it has failed (a real outage),
    # reading its output inside as it grows.
    box = await podman.adopt(record["id"], SandboxSpec(execution="e1", labels={}, image=None))
    out = f"{PID_DIR}/{record['harness']['token']}.out"
    for _ in range(600):
        if b"retrying step" in (await box.execs.read(out, 1 << 20) or b""):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the harness never saw the proxy gone")

    spec = LaunchSpec(preset=shell_preset(HARNESS), timeout_s=300, eval_attempts=1, eval_budget_s=60.0,
                      limits=Limits(pids=512))
    launcher = Launcher(scripted_proxy, run_dir, spec, backend=podman, owner="second")
    run = Execution(id="e1", group=0, index=0, task=load_harbor_task(folder), tracked=Tracked(), version_dispatched=0)
    assert launcher.adopting("e1") and launcher.adopted == {"e1"}
    await launcher.adopt(run)
    assert (run.status, run.reward, run.valid) == ("completed", 1.0, True), (run.status, run.ref)

    log = (run_dir / "executions" / "e1" / "harness.log").read_text()
    assert "was adopted" in log and f"answered step {CALLS - 1}" in log, log
    assert log.count("answered step") == CALLS  # every step once, the output from before the kill too
    assert "retrying step" in log  # the proxy was away meanwhile: a call failed, and was made again
    work = run_dir / "executions" / "e1" / "workspace"
    assert (work / "starts").read_text() == "started\n"  # the harness ran once: never started again
    recorded = load_execution(run_dir / "executions" / "e1")
    prompts = [c["prompt_node"] for c in recorded.calls]
    assert len(recorded.tree.roots) == CALLS  # one root per step's prompt: a retried call joined its own
    assert len(recorded.calls) >= CALLS and before >= 2 and len(run.recorder.calls) == len(recorded.calls)
    assert len(set(prompts)) == CALLS
    assert containers(podman, **{"gyre.execution": "e1", "gyre.run_dir": str(run_dir)}) == []  # removed at its end
    assert record["id"] and record["harness"]["exec"]
