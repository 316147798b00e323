"""A pip-installed agent CLI in a task's container, as docs/harnesses.md's recipe runs it:
mini-swe-agent 2.4.6 from examples/harnesses/mini-swe-agent.toml, installed by gyre (once
per spec, in gyre's cache: the first run of this tier downloads about 550 MB, a minute),
mounted read-only, run by `gyre tasks run` on an example task against the tiny model, its
calls recorded through gyre's proxy. The tiny model's replies are noise: mini-swe-agent ends
after three answers without a tool call (RepeatedFormatError), which is the point: it ran
in the container and every call it made went through gyre."""

from __future__ import annotations

import json
import textwrap

import pytest

from gyre.coordinator.harnesses import resolve
from gyre.coordinator.sandbox.agentdir import AGENT_INSIDE
from gyre.coordinator.taskformats import load_harbor_task
from tests.sandbox.conftest import CALL_PROXY, REPO, harbor_task, run_task
from tests.sandbox.test_tasks_cli import gyre

EXAMPLE = REPO / "examples" / "harnesses" / "mini-swe-agent.toml"


@pytest.mark.timeout(900)
def test_mini_swe_agent_runs_in_podman_through_the_proxy(podman_ready, tmp_path):
    run_dir = tmp_path / "run"
    r = gyre("tasks", "run", "examples/tasks/sort-csv", "--sandbox", "podman", "--harness", "mini-swe-agent",
             "--config", str(EXAMPLE), "--json", "--run-dir", str(run_dir), timeout=840)
    assert r.returncode == 0, r.stderr[-3000:]
    [row] = json.loads(r.stdout)["tasks"]
    assert row["status"] == "completed" and row["score"] is not None, row
    folder = run_dir / "executions" / row["execution"]
    calls = [json.loads(x) for x in (folder / "calls.jsonl").read_text().splitlines()]
    assert calls and all(c["status"] == "ok" and c["api"] == "openai" for c in calls), calls
    log = (folder / "harness.log").read_text()
    assert "This is mini-swe-agent version 2.4.6" in log, log[-2000:]
    # Its trajectory, written in its state folder in the container, came out with it.
    trajectory = json.loads((folder / "harness-state" / "mini" / "trajectory.traj.json").read_text())
    assert trajectory["info"]["mini_version"] == "2.4.6"
    assert trajectory["info"]["model_stats"]["api_calls"] == len(calls)


# What the agent's own commands see: the folder read-only, no PYTHONPATH of gyre's, its
# packages not on the image's python3; the preset's script still starts and reaches the proxy.
PROBE = textwrap.dedent(f'''\
    touch {AGENT_INSIDE}/x 2>/dev/null && echo agent-dir-writable || echo agent-dir-read-only
    echo "pythonpath=[$PYTHONPATH]"
    python3 -c "import litellm" 2>/dev/null && echo image-sees-litellm || echo image-lacks-litellm
    {AGENT_INSIDE}/bin/mini --help >/dev/null 2>&1 && echo mini-starts || echo mini-fails
''') + CALL_PROXY


async def test_the_agent_folder_is_read_only_and_stays_out_of_the_agents_way(podman, scripted_proxy, tmp_path):
    preset = resolve("probe", {"probe": {"sandbox_pip": ["mini-swe-agent==2.4.6"], "env": {"MSWEA_CONFIGURED": "1"},
                                         "sandbox_command": ["sh", "-c", PROBE.replace("{", "{{").replace("}", "}}")]}})
    task = load_harbor_task(harbor_task(tmp_path, "probe"))
    run = await run_task(scripted_proxy, podman, task, tmp_path / "run", preset, timeout_s=120)
    log = (tmp_path / "run" / "executions" / run.id / "harness.log").read_text()
    assert run.status == "completed" and len(run.recorder.calls) == 1, (run.status, run.ref, log[-2000:])
    for line in ("agent-dir-read-only", "pythonpath=[]", "image-lacks-litellm", "mini-starts"):
        assert line in log, log[-2000:]


AIDER = REPO / "examples" / "harnesses" / "aider.toml"


def _aider_or_skip():
    """examples/harnesses/aider.toml's preset; its 610 MB install (two minutes) is this tier's
    to make only where asked (GYRE_TEST_AGENTS=1) or already in gyre's cache."""
    import os

    from gyre.coordinator.runconfig import load_config_file
    from gyre.coordinator.sandbox.agentdir import agent_key
    from gyre.coordinator.sandbox.images import cache_dir

    values = load_config_file(AIDER)
    preset = resolve(values["harness"], values["harnesses"])
    cached = (cache_dir() / "agents" / agent_key(list(preset.sandbox_pip), preset.sandbox_python)).is_dir()
    if not cached and os.environ.get("GYRE_TEST_AGENTS") != "1":
        pytest.skip("aider-chat is not in gyre's cache: GYRE_TEST_AGENTS=1 installs it (about 610 MB, two minutes)")
    return preset


@pytest.mark.timeout(900)
async def test_aider_from_its_example_writes_a_file_in_podman_and_is_scored(podman, chat_tokenizer, tmp_path):
    """Aider, pip-installed by gyre from examples/harnesses/aider.toml, answers the task with a
    whole-file edit (the policy's reply, scripted), writes the file in the container's /app, and
    the task's verifier scores it 1.0; its one call went through the proxy, its history came out."""
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    preset = _aider_or_skip()
    engine = ScriptedEngine(chat_tokenizer, tokens_per_step=16)
    engine.script = lambda prompt: "hello.txt\n```\nhello from gyre\n```\n"
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    proxy = ProxyServer(chat_tokenizer, backend, ProxyConfig(max_context=1 << 17), run_dir=tmp_path / "run")
    await proxy.start()
    try:
        reward = "/logs/verifier/reward.txt"
        task = load_harbor_task(harbor_task(tmp_path, "hello", test_sh=(
            f'[ "$(cat /app/hello.txt)" = "hello from gyre" ] && echo 1 > {reward} || echo 0 > {reward}\n')))
        run = await run_task(proxy, podman, task, tmp_path / "run", preset, timeout_s=600)
    finally:
        await proxy.stop()
        backend.close()
    folder = tmp_path / "run" / "executions" / run.id
    log = (folder / "harness.log").read_text()
    assert run.status == "completed" and run.reward == 1.0, (run.status, run.reward, log[-3000:])
    assert "Aider v0.86.2" in log, log[-2000:]
    calls = [json.loads(x) for x in (folder / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1 and calls[0]["status"] == "ok" and calls[0]["api"] == "openai", calls
    assert (folder / "workspace" / "hello.txt").read_text() == "hello from gyre\n"
    assert "hello from gyre" in (folder / "harness-state" / "aider" / "chat.history.md").read_text()
