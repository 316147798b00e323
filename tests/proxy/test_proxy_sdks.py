"""The proxy against the real `openai` and `anthropic` SDKs: streaming and not, tool calls,
and the request rewrites real harnesses make (HARNESS-NOTES.md) matched onto the recorded
tree without re-tokenising."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.scripted import tool_call

TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "Write a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                         "required": ["path", "content"]}}}]


def assert_extends(ex, earlier: dict, later: dict) -> None:
    """`later`'s prompt path runs through `earlier`'s recorded output node, and the prompt
    the engine got equals the tree's tokens for that path."""
    path, before = ex.prompt_path(later), ex.prompt_path(earlier)
    assert earlier["output_node"] in path, (earlier, later)
    tree = ex.tree
    i = path.index(earlier["output_node"])
    assert path[: i] == before[: i] or path[:len(before)] == before
    assert tree.nodes[earlier["output_node"]].policy


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_chat_tool_round_trip(live, clients, stream):
    ex = live.execution()
    live.engine.script = [tool_call("write_file", path="a.txt", content="hi"), "All done."]
    client = clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=ex.key, max_retries=0)
    messages = [{"role": "system", "content": "You write files."}, {"role": "user", "content": "write a.txt"}]
    if stream:
        parts = [c async for c in await client.chat.completions.create(
            model="anything", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True})]
        calls = [tc for c in parts if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert len(parts) > 3 and parts[-1].usage.completion_tokens > 0
        # Streamed as OpenAI streams a call: id and name first, then the arguments in pieces.
        assert calls[0].id and calls[0].function.name == "write_file" and calls[0].function.arguments == ""
        assert len(calls) > 2 and {tc.index for tc in calls} == {0} and not any(tc.id for tc in calls[1:])
        call_id, name, args = calls[0].id, calls[0].function.name, "".join(tc.function.arguments for tc in calls)
        finish = [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason]
        assert finish == ["tool_calls"]
    else:
        r = await client.chat.completions.create(model="anything", messages=messages, tools=TOOLS)
        tc = r.choices[0].message.tool_calls[0]
        call_id, name, args = tc.id, tc.function.name, tc.function.arguments
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.usage.prompt_tokens == len(live.engine.prompts[0])
    assert name == "write_file" and json.loads(args) == {"path": "a.txt", "content": "hi"}
    # The harness re-serialises the arguments (key order, spacing) and sends the history back.
    reserialised = json.dumps(json.loads(args), sort_keys=True, indent=1)
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": reserialised}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "wrote 2 bytes"}]
    r2 = await client.chat.completions.create(model="anything", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "All done."
    first, second = ex.calls
    assert_extends(ex, first, second)
    # Exactly the tokens the engine produced sit in the second prompt, not a re-tokenisation.
    out = ex.tree.nodes[first["output_node"]].tokens.tolist()
    p1, p2 = live.engine.prompts
    assert p2[: len(p1) + len(out)] == p1 + out
    assert second["new_prompt_tokens"] < 40  # only the tool result and glue were encoded
    # In memory a call keeps its prompt's last node; calls.jsonl keeps the whole path.
    on_disk = [json.loads(x) for x in (ex.dir / "calls.jsonl").read_text().splitlines()]
    assert [c["prompt_path"] for c in on_disk] == [ex.prompt_path(c) for c in ex.calls]
    assert all("prompt_path" not in c for c in ex.calls)


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages_with_claude_code_rewrites(live, clients, stream):
    ex = live.execution()
    live.engine.script = [tool_call("write_file", path="b.txt", content="x", mode=60000.0), "Finished."]
    client = clients(anthropic.AsyncAnthropic, base_url=live.url, api_key=ex.key, max_retries=0)
    tools = [{"name": "write_file", "description": "Write", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {}}}]
    system = [{"type": "text", "text": "x-billing-header: abc"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    user = {"role": "user",
            "content": [{"type": "text", "text": "write b.txt", "cache_control": {"type": "ephemeral"}}]}
    if stream:
        async with client.messages.stream(model="claude-x", max_tokens=32000, system=system, messages=[user],
                                          tools=tools) as s:
            final = await s.get_final_message()
    else:
        final = await client.messages.create(model="claude-x", max_tokens=4000, system=system, messages=[user],
                                             tools=tools)
    assert final.stop_reason == "tool_use"
    tu = next(b for b in final.content if b.type == "tool_use")
    assert tu.input == {"path": "b.txt", "content": "x", "mode": 60000.0}
    # Claude Code sends it back re-parsed (sorted keys, 60000.0 -> 60000), moves cache_control,
    # turns the one-block user message into a string and adds a mid-list system message.
    history = [{"role": "user", "content": "write b.txt"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": tu.id, "name": tu.name,
                                                  "input": {"content": "x", "mode": 60000, "path": "b.txt"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "ok",
                                             "cache_control": {"type": "ephemeral"}}]}]
    system2 = [{"type": "text", "text": "x-billing-header: abc"}, {"type": "text", "text": "You are Claude Code."}]
    r2 = await client.messages.create(model="claude-x", max_tokens=4000, system=system2, messages=history,
                                      tools=tools)
    assert r2.content[0].text == "Finished." and r2.stop_reason == "end_turn"
    first, second = ex.calls
    assert_extends(ex, first, second)
    p1, p2 = live.engine.prompts
    out = ex.tree.nodes[first["output_node"]].tokens.tolist()
    assert p2[: len(p1) + len(out)] == p1 + out
    assert r2.usage.input_tokens == len(p2)


async def test_responses_api_round_trip(live, clients):
    ex = live.execution()
    live.engine.script = ["Let me write it." + tool_call("write_file", path="c.txt", content="y"), "ok"]
    client = clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=ex.key, max_retries=0)
    tools = [{"type": "function", "name": "write_file", "parameters": {"type": "object", "properties": {}}},
             {"type": "web_search"}]
    items = [{"type": "message", "role": "developer", "id": "d1", "content": [{"type": "input_text", "text": "Dev."}]},
             {"type": "message", "role": "user", "id": "u1", "content": [{"type": "input_text", "text": "go"}]}]
    events = [e async for e in await client.responses.create(model="codex", input=items, tools=tools, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = events[-1].response
    fc = next(o for o in done.output if o.type == "function_call")
    msg = next(o for o in done.output if o.type == "message")
    assert done.usage.input_tokens == len(live.engine.prompts[0])
    # Codex sends items back byte-identical, with reasoning-like extras and client ids.
    items += [{"type": "message", "role": "assistant", "id": msg.id,
               "content": [{"type": "output_text", "text": msg.content[0].text}]},
              {"type": "function_call", "id": fc.id, "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
              {"type": "function_call_output", "call_id": fc.call_id, "output": "written"}]
    r2 = await client.responses.create(model="codex", input=items, tools=tools)
    assert r2.output_text == "ok"
    first, second = ex.calls
    assert_extends(ex, first, second)


async def test_models_health_and_count_tokens(live, clients):
    ex = live.execution()
    client = clients(anthropic.AsyncAnthropic, base_url=live.url, api_key=ex.key, max_retries=0)
    n = await client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hello"}])
    assert n.input_tokens > 5
    models = await clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=ex.key).models.list()
    assert [m.id for m in models.data] == ["gyre-policy"]
    for key in ("gyre-not-a-key", ""):  # a wrong or missing key: 401 from the SDK, never a 500
        bad = clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=key or "x", max_retries=0,
                      default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            await bad.models.list()
