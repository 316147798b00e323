"""gyre's own refusals are never an agent's score (issue 36, finding 7).

With the disk full, the proxy answers every model call 503 before any byte (its disk guard);
a harness that then fails, or that carries on and writes nothing, scored a valid 0.0 (16
executions did in a disk-full run): the fake zeros that corrupt RL. Here the disk guard is
real (a threshold above the disk's free space), the harness is a real `openai` SDK client
that retries as it does by default, and the execution runs through the launcher's whole
lifecycle on the process backend. The agent's own context overflow stays the agent's.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.tasks import Task
from tests.sandbox.conftest import run_task, shell_preset

# The harness: one chat call through the OpenAI SDK; on an error it either dies (as most CLIs
# do) or catches it and finishes with an empty answer (as an agent loop that gives up does).
HARNESS = textwrap.dedent('''\
    import os, sys
    from openai import OpenAI
    prompt = os.environ["GYRE_TASK"]
    try:
        with OpenAI(max_retries=int(os.environ.get("RETRIES", "0"))) as client:
            r = client.chat.completions.create(model="m", max_tokens=8,
                                               messages=[{"role": "user", "content": prompt}])
        answer = r.choices[0].message.content or ""
    except Exception as e:
        print(f"harness: {type(e).__name__}: {e}", file=sys.stderr)
        if "die" in prompt:
            sys.exit(1)
        answer = ""
    open("answer.txt", "w").write(answer)
''')


@pytest.fixture
async def proxy(request, chat_tokenizer, tmp_path):
    """A live proxy on the scripted engine; `request.param`: its ProxyConfig fields."""
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    engine = ScriptedEngine(chat_tokenizer, tokens_per_step=16)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(chat_tokenizer, backend, ProxyConfig(**request.param), run_dir=tmp_path / "run")
    await server.start()
    yield server
    await server.stop()
    backend.close()


DISK_FULL = {"max_context": 1 << 16, "min_free_disk_bytes": 1 << 62}  # no disk has that much free


async def _run(proxy, tmp_path, prompt: str, **env):
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    prefix = " ".join(f"{k}={v}" for k, v in env.items())
    preset = shell_preset(f"{prefix} {sys.executable} {script}")
    task = Task(id="t", prompt=prompt, target="Done.")
    return await run_task(proxy, ProcessBackend(), task, tmp_path / "run", preset)


@pytest.mark.parametrize("proxy", [DISK_FULL], indirect=True)
async def test_a_harness_that_dies_on_gyres_503_is_aborted_infra_not_a_zero(proxy, tmp_path):
    # The SDK retries once (after the 503's retry-after), then raises; the harness exits 1
    # having recorded no call: before, a "placeholder" valid 0.0.
    run = await _run(proxy, tmp_path, "die on error", RETRIES=1)
    assert (run.status, run.reward, run.valid) == ("aborted_infra", None, False), (run.status, run.ref)
    assert run.ref.startswith("gyre refused the harness's last model call (2 refused; the last: 503 "), run.ref
    assert "min_free_disk_bytes" in run.ref, run.ref  # it says why: the disk guard
    assert run.recorder.refusals == 2 and run.recorder.refused_last


@pytest.mark.parametrize("proxy", [DISK_FULL], indirect=True)
async def test_a_harness_that_gives_up_after_gyres_503_and_exits_0_is_not_scored(proxy, tmp_path):
    # Exit 0 with an empty answer: before, "completed" and a valid 0.0 from the evaluator.
    run = await _run(proxy, tmp_path, "carry on")
    assert (run.status, run.reward, run.valid) == ("aborted_infra", None, False), (run.status, run.ref)
    assert run.recorder.refusals == 1 and run.recorder.refused_last


@pytest.mark.parametrize("proxy", [{"max_context": 64}], indirect=True)
async def test_the_agents_own_context_overflow_stays_its_score(proxy, tmp_path):
    # A prompt longer than the model's context is the agent's doing: scored, not excused.
    run = await _run(proxy, tmp_path, "carry on " + "word " * 400)
    assert run.status == "completed" and run.valid and run.reward is not None, (run.status, run.ref)
    assert run.recorder.refusals == 0 and not run.recorder.refused_last


@pytest.mark.parametrize("proxy", [{"max_context": 1 << 16}], indirect=True)
async def test_a_harness_gyre_answered_is_scored(proxy, tmp_path):
    run = await _run(proxy, tmp_path, "carry on")
    assert run.status == "completed" and run.valid and run.reward == pytest.approx(1.0), (run.status, run.ref)
