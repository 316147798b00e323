"""The real Codex CLI (0.171.0) through gyre's proxy, driven by the scripted responder.

Only the engine is scripted: Codex, the `codex` preset (its CODEX_HOME and config.toml), the
HTTP proxy with its Responses stream, rendering, TITO records and the tree are the real
ones. Codex edits files with `apply_patch`, a custom (freeform) tool: the policy's call must
come back to Codex as a custom_tool_call it runs, and the next prompt must carry the
policy's exact tokens for it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gyre.coordinator.harnesses import resolve
from gyre.coordinator.serve import run_harness_once
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.scripted import ScriptedEngine, tool_call
from tests.support import ThreadEngineBackend

pytestmark = pytest.mark.timeout(300)

TASK = "Create hello.txt containing the line: hello from gyre"
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from gyre\n*** End Patch\n"


def preset(codex_bin: Path, **fields):
    """The built-in codex preset, its command pointed at the installed binary (as a user would)."""
    cmd = [str(codex_bin), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
           "-C", "{workspace}", "{task}"]
    return resolve("codex", {"codex": {"command": cmd, "timeout_s": 240, **fields}})


@pytest.fixture
async def proxy(chat_tokenizer, tmp_path):
    engine = ScriptedEngine(chat_tokenizer, tokens_per_step=64)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    # Codex's ~35k-token prompt is ~140k byte tokens in the tiny vocabulary.
    server = ProxyServer(chat_tokenizer, backend, ProxyConfig(max_context=1 << 21, record_requests=True,
                                                              ping_interval_s=0.5), run_dir=tmp_path / "run")
    await server.start()
    yield server, engine
    await server.stop()
    backend.close()


def patch_then_done(engine: ScriptedEngine) -> list[str]:
    call = tool_call("apply_patch", input=PATCH)
    engine.script = lambda prompt: "Done: hello.txt written." if "Success. Updated" in prompt else call
    return [call]


def assert_extends(ex) -> None:
    for prev, nxt in zip(ex.calls, ex.calls[1:]):
        head = ex.prompt_path(prev) + [prev["output_node"]]
        assert ex.prompt_path(nxt)[:len(head)] == head, (prev["call_id"], nxt["call_id"])


async def test_codex_edits_a_file_with_apply_patch_and_the_next_prompt_has_the_policys_bytes(proxy, codex_bin):
    server, engine = proxy
    (call,) = patch_then_done(engine)
    summary = await run_harness_once(server, preset(codex_bin), TASK, run_dir=server.run_dir, execution="cx")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed", log[-3000:]
    ws = Path(summary["workspace"])
    assert (ws / "hello.txt").read_text() == "hello from gyre\n"
    ex = server.executions["cx"]
    assert len(ex.calls) == 2 and {c["status"] for c in ex.calls} == {"ok"} and ex.calls[0]["stream"]
    assert ex.calls[0]["finish_reason"] == "tool_calls" and ex.calls[0]["invalid_tool_calls"] == 0
    assert_extends(ex)
    second = server.tokenizer.decode(engine.prompts[1])
    assert call in second  # the policy's own text, not a re-serialisation of Codex's item
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0]
    # Codex got the call as the custom tool it is, and sent its output back by call id.
    bodies = [r["body"] for r in _requests(server, "cx")]
    first_tools = {t.get("name"): t["type"] for t in bodies[0]["tools"]}
    assert first_tools["apply_patch"] == "custom" and "web_search" not in first_tools.values()
    items = bodies[1]["input"]
    (sent,) = [i for i in items if i.get("type") == "custom_tool_call"]
    (out,) = [i for i in items if i.get("type") == "custom_tool_call_output"]
    assert sent["input"] == PATCH and out["call_id"] == sent["call_id"] == ex.calls[0]["tool_calls"][0]
    # Its own CODEX_HOME, as the preset wrote it.
    config = (server.run_dir / "executions" / "cx" / "harness-state" / "codex" / "config.toml").read_text()
    assert f'base_url = "{server.base_url}/v1"' in config and 'wire_api = "responses"' in config


@pytest.mark.parametrize("keepalive", [True, False])
async def test_a_slow_engine_does_not_make_codex_abort_or_resend(proxy, codex_bin, keepalive):
    """Codex's stream idle timeout (3 s here) resets only on events with data: with the
    proxy's response.in_progress keep-alives every 0.5 s, a 5 s wait for the first token and
    a 5 s pause inside the tool call's tokens pass unnoticed. Without them (keep-alives
    every 60 s), Codex gives up on the stream and re-sends."""
    server, engine = proxy
    patch_then_done(engine)
    if not keepalive:
        server.config = dataclasses.replace(server.config, ping_interval_s=60.0)
    engine.tokens_per_step = 4
    engine.stalls = {0: 5.0, 24: 5.0}  # before the first token, and inside the tool call
    summary = await run_harness_once(server, preset(codex_bin, idle_timeout_s=3), TASK, run_dir=server.run_dir,
                                     execution="slow")
    ex = server.executions["slow"]
    if keepalive:
        assert summary["status"] == "completed", Path(summary["harness_log"]).read_text()[-3000:]
        assert len(ex.calls) == 2 and {c["status"] for c in ex.calls} == {"ok"}
    else:
        assert len(ex.calls) > 2 or summary["status"] != "completed"
        assert "disconnected" in {c["status"] for c in ex.calls}


def _requests(server, execution: str) -> list[dict]:
    import orjson

    path = server.run_dir / "executions" / execution / "requests.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]
