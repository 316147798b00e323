"""The real Claude Code CLI through gyre's proxy, driven by the scripted responder.

Only the engine is scripted: Claude Code, the HTTP proxy, rendering, TITO records, the
tree and the claude-code role rule are the real ones. Each test runs the `claude-code`
preset (its command pointed at the installed binary) through the launcher's path.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.harnesses import resolve
from gyre.coordinator.serve import run_harness_once
from tests.scripted import tool_call
from tests.support import CUT_STREAM

pytestmark = pytest.mark.timeout(300)

TASK = "Write 1 into counter.txt with Bash, then change it to 2."


def preset(claude_bin: Path, command: list[str] | None = None):
    """The built-in claude-code preset, overridden the way a user would in their config."""
    cmd = command or [str(claude_bin), "-p", "{task}", "--dangerously-skip-permissions", "--output-format", "json"]
    return resolve("claude-code", {"claude-code": {"command": cmd, "timeout_s": 240}})


def tool_results(prompt: str) -> int:
    return prompt.count("<tool_response>")


def requests(run_dir: Path, execution: str) -> list[dict]:
    path = run_dir / "executions" / execution / "requests.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def assert_round_trips(ex, calls: list[dict]) -> None:
    """Each call's prompt is the previous call's prompt + its recorded output node + new
    tokens: no re-tokenisation mismatch anywhere along the conversation."""
    for prev, nxt in zip(calls, calls[1:]):
        head = ex.prompt_path(prev) + [prev["output_node"]]
        assert ex.prompt_path(nxt)[:len(head)] == head, (prev["call_id"], nxt["call_id"])


async def test_bash_and_edit_task_completes_with_exact_round_trips(cc_proxy, claude_bin, tmp_path):
    server, engine = cc_proxy
    ws = server.run_dir / "executions" / "cc" / "workspace"
    # Keys out of order and a float: Claude Code re-serialises tool_use input (sorted keys,
    # 600000.0 -> 600000); the proxy must put back the tokens the policy actually produced.
    # In the foreground, with Claude Code's longest timeout: its Bash tool backgrounds a
    # command still running at the timeout ("Command running in background with ID: ...",
    # whatever run_in_background says), and the command runs in a login shell whose profile
    # may be slow (pyenv's rehash waits 60 s on a stale lock), so the Read and Edit that
    # follow would find no counter.txt.
    bash = ('<tool_call>\n{"name": "Bash", "arguments": {"description": "write counter", '
            '"command": "echo 1 > counter.txt", "timeout": 600000.0, "run_in_background": false}}\n</tool_call>')

    def script(prompt: str) -> str:
        return [bash,
                tool_call("Read", file_path=str(ws / "counter.txt")),
                tool_call("Edit", file_path=str(ws / "counter.txt"), old_string="1", new_string="2"),
                "Done: counter.txt now holds 2."][min(tool_results(prompt), 3)]

    engine.script = script
    summary = await run_harness_once(server, preset(claude_bin), TASK, run_dir=server.run_dir, execution="cc")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed", log[-3000:]
    bash_result = json.dumps(requests(server.run_dir, "cc")[1]["body"]["messages"][-1])
    assert "running in background" not in bash_result, bash_result  # the Bash call ran to its end
    assert (ws / "counter.txt").read_text() == "2\n"
    assert json.loads(log.strip().splitlines()[-1])["result"] == "Done: counter.txt now holds 2."

    ex = server.executions["cc"]
    assert [c["role"] for c in ex.calls] == ["main"] * 4 and {c["status"] for c in ex.calls} == {"ok"}
    assert [c["stream"] for c in ex.calls] == [True] * 4
    assert_round_trips(ex, ex.calls)
    stats = ex.tree.stats()
    assert stats["roots"] == 1 and stats["leaves"] == 1
    assert stats["unique_tokens"] == stats["expanded_tokens"]  # one conversation, stored once
    # What Claude Code sent back for the Bash call differs from what the policy produced...
    sent = requests(server.run_dir, "cc")[1]["body"]["messages"]
    (tool_use,) = [b for m in sent if m["role"] == "assistant" for b in m["content"] if b["type"] == "tool_use"]
    assert tool_use["name"] == "Bash" and tool_use["input"]["timeout"] == 600000
    assert '"timeout": 600000.0' not in json.dumps(tool_use["input"])
    # ... but the next prompt carries the policy's exact tokens for it.
    second = server.tokenizer.decode(engine.prompts[1])
    assert bash in second
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0]
    # The key never lands in the recorded requests.
    key_free = (server.run_dir / "executions" / "cc" / "requests.jsonl").read_text()
    assert ex.key not in key_free and "x-api-key" not in key_free.lower()


async def test_overloaded_529_is_retried_and_not_recorded(cc_proxy, claude_bin):
    server, engine = cc_proxy
    engine.script = lambda prompt: "Hello from gyre."
    server.inject_errors.append((529, {"retry-after": "0"}))
    summary = await run_harness_once(server, preset(claude_bin), "Say hello.", run_dir=server.run_dir,
                                     execution="cc")
    assert summary["status"] == "completed", Path(summary["harness_log"]).read_text()[-3000:]
    assert not server.inject_errors  # the 529 was answered...
    ex = server.executions["cc"]
    assert len(ex.calls) == 1 and ex.calls[0]["status"] == "ok"  # ... touched no record, and was retried
    assert len(requests(server.run_dir, "cc")) == 1


async def test_stream_cut_before_content_falls_back_to_non_streaming(cc_proxy, claude_bin):
    server, engine = cc_proxy
    engine.script = lambda prompt: "Hello without streaming."
    server.inject_errors.append((CUT_STREAM, {}))
    summary = await run_harness_once(server, preset(claude_bin), "Say hello.", run_dir=server.run_dir,
                                     execution="cc")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed", log[-3000:]
    assert json.loads(log.strip().splitlines()[-1])["result"] == "Hello without streaming."
    ex = server.executions["cc"]
    assert [(c["stream"], c["status"]) for c in ex.calls] == [(False, "ok")]


async def test_subagent_is_its_own_root_with_delegation(cc_proxy, claude_bin):
    server, engine = cc_proxy
    sub_prompt = "List the files here and report the count."

    def script(prompt: str) -> str:
        if "Delegate counting" in prompt:  # the main agent's conversation
            if tool_results(prompt) == 0:
                return tool_call("Agent", description="count files", prompt=sub_prompt,
                                 subagent_type="general-purpose")
            return "The sub-agent counted the files."
        return tool_call("Bash", command="ls | wc -l", description="count") if tool_results(prompt) == 0 \
            else "There are 0 files."

    engine.script = script
    summary = await run_harness_once(server, preset(claude_bin), "Delegate counting the files to a sub-agent.",
                                     run_dir=server.run_dir, execution="cc")
    assert summary["status"] == "completed", Path(summary["harness_log"]).read_text()[-3000:]
    ex = server.executions["cc"]
    roles = [c["role"] for c in ex.calls]
    assert roles == ["main", "sub-agent", "sub-agent", "main"]
    main_first = ex.calls[0]["call_id"]
    assert [c.get("delegated_by") for c in ex.calls] == [None, main_first, main_first, None]
    assert_round_trips(ex, [ex.calls[0], ex.calls[3]])
    assert_round_trips(ex, ex.calls[1:3])
    assert ex.tree.stats()["roots"] == 2
    assert sorted(ex.leaf_roles.values()) == ["main", "sub-agent"]


async def test_compaction_branches_off_main_and_continues_as_main(cc_proxy, claude_bin):
    """Three Claude Code processes in one execution, as a user script would chain them:
    a task with a tool call, `/compact` on that session, then one more turn."""
    server, engine = cc_proxy

    def script(prompt: str) -> str:
        if "Your task is to create a detailed summary of the conversation" in prompt:
            return "<analysis>short</analysis>\n<summary>The user asked for a greeting; I ran echo.</summary>"
        if tool_results(prompt) == 0 and "Say hello again." not in prompt:
            return tool_call("Bash", command="echo hello", description="say hello")
        return "Hello."

    engine.script = script
    claude = shlex.quote(str(claude_bin))
    flags = "--dangerously-skip-permissions --output-format json"
    chain = (f'{claude} -p "$GYRE_TASK" {flags} && {claude} --continue -p /compact {flags} && '
             f'{claude} --continue -p "Say hello again." {flags}')
    summary = await run_harness_once(server, preset(claude_bin, ["sh", "-c", chain]), "Say hello.",
                                     run_dir=server.run_dir, execution="cc")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed", log[-3000:]
    ex = server.executions["cc"]
    assert [c["role"] for c in ex.calls] == ["main", "main", "main-summary", "main"]
    first, second, compact, after = ex.calls
    assert_round_trips(ex, [first, second])
    # The compaction request is the history without the last assistant turn plus the
    # instruction: it branches off the main conversation, sharing its prefix.
    first_path, compact_path = ex.prompt_path(first), ex.prompt_path(compact)
    assert compact_path[:len(first_path) + 1] == first_path + [first["output_node"]]
    assert second["output_node"] not in compact_path
    # Afterwards a new history starts from the summary: a new root, still the main agent.
    assert ex.prompt_path(after)[0] not in first_path
    assert "This session is being continued" in server.tokenizer.decode(engine.prompts[3])
    assert sorted(ex.leaf_roles.values()) == ["main", "main", "main-summary"]

    server.revoke("cc")
    out = CliRunner().invoke(app, ["inspect", str(server.run_dir)])
    assert out.exit_code == 0, out.output
    assert re.search(r"main-summary leaf", out.output) and out.output.count("main leaf") == 2


async def test_an_overflow_in_anthropics_words_is_recognised_as_one(cc_proxy, claude_bin):
    """Claude Code acts on context overflow only in Anthropic's wording ("prompt is too long:
    N tokens > M maximum"). In `-p` mode it cannot compact, so it ends with its own overflow
    message; a 400 in other words it reports as a plain API error instead."""
    import dataclasses

    server, engine = cc_proxy

    def script(prompt: str) -> str:
        if tool_results(prompt) == 0:  # the first call fits; the context ends right after it
            server.config = dataclasses.replace(server.config, max_context=len(engine.prompts[-1]) + 20)
            return tool_call("Bash", command="echo hi", description="say hi")
        return "Done."

    engine.script = script
    summary = await run_harness_once(server, preset(claude_bin), "Say hi.", run_dir=server.run_dir, execution="cc")
    result = json.loads(Path(summary["harness_log"]).read_text().strip().splitlines()[-1])
    assert result["is_error"] and result["api_error_status"] == 400 and result["result"] == "Prompt is too long", (
        result, [(c["status"], c["prompt_tokens"]) for c in server.executions["cc"].calls], server.config.max_context)
    ex = server.executions["cc"]
    assert [c["status"] for c in ex.calls] == ["ok"]  # the refused prompt touched no record
    server.config = dataclasses.replace(server.config, max_context=1 << 21)
    engine.script = lambda prompt: "Done."
    server.inject_errors.append((400, {}))  # a 400 in other words
    other = await run_harness_once(server, preset(claude_bin), "Say hi.", run_dir=server.run_dir, execution="other")
    result = json.loads(Path(other["harness_log"]).read_text().strip().splitlines()[-1])
    assert result["is_error"] and result["result"] != "Prompt is too long"


@pytest.mark.harness_stall
@pytest.mark.timeout(600)
async def test_a_pause_past_the_300s_watchdog_inside_a_streamed_answer(cc_proxy, claude_bin):
    """Claude Code drops a stream after max(CLAUDE_STREAM_IDLE_TIMEOUT_MS, 300 s) without
    content, pings or not, and re-sends; the preset sets the variable to the execution's
    deadline, so a 310 s pause of the engine mid-answer passes: one call, no re-send."""
    server, engine = cc_proxy
    engine.script = lambda prompt: "Hello after a long think."
    engine.tokens_per_step = 2
    engine.stalls = {4: 310.0}
    p = resolve("claude-code", {"claude-code": {"command": preset(claude_bin).command, "timeout_s": 500}})
    summary = await run_harness_once(server, p, "Say hello.", run_dir=server.run_dir, execution="cc")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed", log[-3000:]
    assert json.loads(log.strip().splitlines()[-1])["result"] == "Hello after a long think."
    ex = server.executions["cc"]
    assert [(c["stream"], c["status"]) for c in ex.calls] == [(True, "ok")]
    assert len(requests(server.run_dir, "cc")) == 1
