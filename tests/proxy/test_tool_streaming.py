"""Tool calls streamed as their tokens arrive, through the real SDKs: the name first, then
the arguments in pieces, in each API's own events; what each client sees when the model's
arguments end malformed; and the record, the model's exact tokens either way."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from gyre.proxy.jsonprefix import JsonPrefix
from tests.scripted import tool_call

TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": "write_file", "input_schema": TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", "name": "write_file", "parameters": TOOLS[0]["function"]["parameters"]}]
LONG = {"path": "notes/a.txt", "content": "line of text\n" * 40}
MALFORMED = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", "content": "hi}\n</tool_call>'


@pytest.fixture
def slow(live):
    live.engine.tokens_per_step = 3  # a long call takes many chunks
    return live


async def test_openai_chat_streams_the_arguments_in_pieces(slow, clients):
    slow.engine.script = [tool_call("write_file", **LONG)]
    ex = slow.execution()
    client = clients(openai.AsyncOpenAI, base_url=f"{slow.url}/v1", api_key=ex.key, max_retries=0)
    chunks = [c async for c in await client.chat.completions.create(
        model="m", stream=True, tools=TOOLS, messages=[{"role": "user", "content": "write"}])]
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "write_file" and deltas[0].id and len(deltas) > 20
    assert json.loads("".join(d.function.arguments for d in deltas)) == LONG
    assert ex.calls[0]["tool_calls"] == [deltas[0].id] and ex.calls[0]["invalid_tool_calls"] == 0


async def test_anthropic_streams_valid_partial_json(slow, clients):
    slow.engine.script = [tool_call("write_file", **LONG)]
    ex = slow.execution()
    client = clients(anthropic.AsyncAnthropic, base_url=slow.url, api_key=ex.key, max_retries=0)
    fragments = []
    async with client.messages.stream(model="m", max_tokens=4000, tools=ANTHROPIC_TOOLS,
                                      messages=[{"role": "user", "content": "write"}]) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        final = await stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "write_file" and use.input == LONG and final.stop_reason == "tool_use"
    assert len(fragments) > 20
    prefix = JsonPrefix()
    for f in fragments:  # every prefix the client parsed was one of a valid object
        prefix.feed(f)
        assert not prefix.failed
    assert prefix.complete


async def test_responses_streams_function_call_argument_deltas(slow, clients):
    slow.engine.script = [tool_call("write_file", **LONG)]
    ex = slow.execution()
    client = clients(openai.AsyncOpenAI, base_url=f"{slow.url}/v1", api_key=ex.key, max_retries=0)
    events = [e async for e in await client.responses.create(model="m", stream=True, tools=RESPONSES_TOOLS,
                                                             input="write")]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    assert len(deltas) > 20
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(deltas) and json.loads(done.arguments) == LONG
    (item,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert item.arguments == done.arguments and item.name == "write_file"


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
async def test_malformed_arguments_once_streamed_stay_a_call(slow, clients, api):
    """Chat Completions and Responses: the model's own text, malformed (as OpenAI's models can
    produce); Anthropic: the arguments cut at their last safe point and closed, so the client
    always parses valid JSON. The record counts the call invalid and keeps the exact tokens."""
    slow.engine.script = [MALFORMED]
    ex = slow.execution()
    if api == "anthropic":
        client = clients(anthropic.AsyncAnthropic, base_url=slow.url, api_key=ex.key, max_retries=0)
        async with client.messages.stream(model="m", max_tokens=400, tools=ANTHROPIC_TOOLS,
                                          messages=[{"role": "user", "content": "w"}]) as stream:
            final = await stream.get_final_message()
        (use,) = [b for b in final.content if b.type == "tool_use"]
        assert use.input == {"path": "a.txt", "content": "hi"}
    elif api == "openai":
        client = clients(openai.AsyncOpenAI, base_url=f"{slow.url}/v1", api_key=ex.key, max_retries=0)
        chunks = [c async for c in await client.chat.completions.create(
            model="m", stream=True, tools=TOOLS, messages=[{"role": "user", "content": "w"}])]
        args = "".join(tc.function.arguments
                       for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or []))
        assert args.strip() == '{"path": "a.txt", "content": "hi'
    else:
        client = clients(openai.AsyncOpenAI, base_url=f"{slow.url}/v1", api_key=ex.key, max_retries=0)
        events = [e async for e in await client.responses.create(model="m", stream=True, tools=RESPONSES_TOOLS,
                                                                 input="w")]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments.strip() == '{"path": "a.txt", "content": "hi'
    (call,) = ex.calls
    assert call["invalid_tool_calls"] == 1 and call["status"] == "ok"
    out = ex.tree.nodes[call["output_node"]].tokens.tolist()
    assert slow.server.tokenizer.decode(out).startswith(MALFORMED)  # the model's exact tokens
