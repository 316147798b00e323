"""api_responses: Codex-shaped requests parse onto ChatRequest; results and streams render
into shapes the real `openai` SDK types accept."""

from __future__ import annotations

import copy
import json

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gyre.proxy import api_responses as api
from gyre.proxy.types import ChatResult, Message, RequestError, TextDelta, ToolCall, ToolCallDelta, ToolSpec, Usage

EVENT = TypeAdapter(ResponseStreamEvent)

# Byte-exact arguments: odd spacing, a float with a trailing zero, an escaped unicode char.
ARGS_1 = '{"command": ["bash", "-lc", "ls -la"],  "timeout_ms":60000.0}'
ARGS_2 = '{"cmd":"echo \\u00e9", "workdir" : "/repo"}'

CODEX_BODY = {
    "model": "gpt-5-codex",
    "instructions": None,
    "input": [
        {"type": "message", "role": "developer", "id": "msg_dev_1",
         "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "id": "msg_user_1", "status": "completed",
         "content": [{"type": "input_text", "text": "<env>cwd=/repo</env>"},
                     {"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "id": "rs_1", "content": None, "encrypted_content": "gAAAA...",
         "summary": [{"type": "summary_text", "text": "Thinking about ls"}]},
        {"type": "message", "role": "assistant", "id": "msg_a1", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_A", "name": "shell", "arguments": ARGS_1},
        {"type": "function_call", "id": "fc_2", "call_id": "call_B", "name": "shell", "arguments": ARGS_2},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_A", "output": "a.py\nb.py"},
        {"type": "function_call_output", "call_id": "call_B",
         "output": [{"type": "input_text", "text": "é"}]},
        {"type": "message", "role": "user", "id": "msg_user_2",
         "content": [{"type": "input_text", "text": "Now run the tests."}]},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array"}}, "required": ["command"]}},
        {"type": "custom", "name": "apply_patch", "description": "Patch files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "web_search"},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199-session",
    "text": {"verbosity": "medium"},
}


def parse(body):
    return api.parse_request(body, {"authorization": "Bearer x"})


def user_body(**extra):
    return {"model": "m", "input": "hi", **extra}


# --- parsing ------------------------------------------------------------------------------


def test_codex_body_parses_with_one_turn_merged():
    req = parse(copy.deepcopy(CODEX_BODY))
    assert req.api == "responses" and req.model == "gpt-5-codex" and req.stream is True
    assert req.messages == [
        Message(role="system", content="You are Codex."),
        Message(role="user", content="<env>cwd=/repo</env>List the files."),
        Message(role="assistant", content="Looking.",
                tool_calls=[ToolCall("call_A", "shell", ARGS_1), ToolCall("call_B", "shell", ARGS_2)]),
        Message(role="tool", content="a.py\nb.py", tool_call_id="call_A"),
        Message(role="tool", content="é", tool_call_id="call_B"),
        Message(role="user", content="Now run the tests."),
    ]
    assert req.messages[2].tool_calls[0].arguments == ARGS_1  # byte-exact, not re-serialised
    shell, patch = req.tools  # web_search (run by a provider, not here) is not the policy's
    assert shell == ToolSpec(name="shell", description="Run a command", parameters=CODEX_BODY["tools"][0]["parameters"])
    assert (patch.name, patch.kind, patch.parameters["required"]) == ("apply_patch", "custom", ["input"])
    assert patch.description.startswith("Patch files") and "lark grammar:\nstart: /.+/" in patch.description
    assert req.tool_choice == "auto"
    assert req.max_tokens is None and req.temperature is None and req.top_p is None
    assert req.metadata["prompt_cache_key"] == "0199-session"
    assert req.metadata["parallel_tool_calls"] is False


def test_string_input_and_instructions():
    req = parse({"model": "m", "instructions": "Be brief.", "input": "hello", "max_output_tokens": 256,
                 "temperature": 0.7, "top_p": 1})
    assert req.messages == [Message(role="system", content="Be brief."), Message(role="user", content="hello")]
    assert (req.max_tokens, req.temperature, req.top_p, req.stream) == (256, 0.7, 1.0, False)
    assert parse({"input": "x"}).model == "default"


def test_function_calls_without_message_merge_and_new_turns_split():
    req = parse({"input": [
        {"role": "user", "content": "go"},  # no type: an easy input message
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "content": None, "summary": []},  # dropped; does not split the turn
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]})
    assert [(m.role, [c.id for c in m.tool_calls]) for m in req.messages] == [
        ("user", []), ("assistant", ["c1", "c2"]), ("tool", []), ("tool", []), ("assistant", ["c3"])]
    assert req.messages[1].content == ""


def test_codex_tool_items_come_back_as_the_policy_wrote_them():
    """A custom tool's raw input is the policy's {"input": text}; a namespace's tool is
    `ns.tool`; tool_search's object arguments are text; its output is the tools found."""
    req = parse({"input": [
        {"type": "message", "role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "c9", "name": "apply_patch", "input": "*** Begin Patch\n"},
        {"type": "custom_tool_call_output", "call_id": "c9", "output": "Done"},
        {"type": "tool_search_call", "call_id": "s1", "execution": "client", "arguments": {"query": "agents"}},
        {"type": "tool_search_output", "call_id": "s1", "status": "completed", "execution": "client",
         "tools": [{"type": "namespace", "name": "multi_agent_v1", "tools": []}]},
        {"type": "function_call", "call_id": "n1", "name": "close_agent", "namespace": "multi_agent_v1",
         "arguments": "{}"},
    ]})
    assert req.messages[1] == Message(role="assistant", tool_calls=[
        ToolCall("c9", "apply_patch", json.dumps({"input": "*** Begin Patch\n"}))])
    assert req.messages[2] == Message(role="tool", content="Done", tool_call_id="c9")
    assert req.messages[3].tool_calls == [ToolCall("s1", "tool_search", '{"query":"agents"}')]
    assert json.loads(req.messages[4].content) == [{"type": "namespace", "name": "multi_agent_v1", "tools": []}]
    assert req.messages[5].tool_calls == [ToolCall("n1", "multi_agent_v1.close_agent", "{}")]


CODEX_TOOLS = [
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}},
    {"type": "tool_search", "execution": "client", "description": "Find tools.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
     "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]},
]


def test_codex_tools_reach_the_policy_and_its_calls_come_back_as_codex_runs_them():
    req = parse(user_body(tools=CODEX_TOOLS))
    assert [(t.name, t.kind) for t in req.tools] == [("apply_patch", "custom"), ("tool_search", "tool_search"),
                                                     ("multi_agent_v1.close_agent", "namespace")]
    patch = ToolCall("call_p", "apply_patch", json.dumps({"input": "*** Begin Patch\n*** End Patch\n"}))
    search = ToolCall("call_s", "tool_search", '{"query": "agents", "limit": 3}')
    close = ToolCall("call_c", "multi_agent_v1.close_agent", '{"id": "a1"}')
    body = api.render_result(result("", [patch, search, close], "tool_calls"), req)
    items = body["output"]
    assert items[0] | {"id": None} == {"id": None, "type": "custom_tool_call", "status": "completed",
                                       "call_id": "call_p", "name": "apply_patch",
                                       "input": "*** Begin Patch\n*** End Patch\n"}
    assert (items[1]["type"], items[1]["arguments"], items[1]["execution"]) == (
        "tool_search_call", {"query": "agents", "limit": 3}, "client")
    assert (items[2]["type"], items[2]["name"], items[2]["namespace"], items[2]["arguments"]) == (
        "function_call", "close_agent", "multi_agent_v1", '{"id": "a1"}')
    Response.model_validate(body)


def test_a_custom_tool_streams_its_raw_input():
    from gyre.proxy.types import ToolArgsDelta, ToolCallEnd, ToolCallStart

    req = parse(user_body(tools=CODEX_TOOLS))
    text = "*** Begin Patch\n*** Add File: a.txt\n+h\u00e9llo \"q\"\n*** End Patch\n"
    raw = json.dumps({"input": text})
    stream = api.Stream(req, "resp_abc")
    chunks = stream.start() + stream.delta(ToolCallStart(0, "call_p", "apply_patch"))
    for i in range(0, len(raw), 5):
        chunks += stream.delta(ToolArgsDelta(0, raw[i:i + 5]))
    call = ToolCall("call_p", "apply_patch", raw)
    chunks += stream.delta(ToolCallEnd(0, call, True)) + stream.finish(result("", [call], "tool_calls"))
    events = sse_events(chunks)
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert len(deltas) > 5 and "".join(deltas) == text
    (done,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert done["input"] == text and events[-1]["response"]["output"][0]["input"] == text
    assert events[-1]["response"]["output"][0]["type"] == "custom_tool_call"


def test_unused_fields_and_tool_types_are_accepted():
    tools = [{"type": "web_search"}, {"type": "namespace", "name": "mcp", "tools": []}, {"type": "local_shell"},
             {"type": "function", "name": "f"}]
    req = parse(user_body(tools=tools, include=["reasoning.encrypted_content"], store=False,
                          reasoning={"effort": "high"}, text={"format": {"type": "text"}}, prompt_cache_key="k",
                          parallel_tool_calls=True, metadata={"a": "b"}, brand_new_field={"x": 1},
                          tool_choice={"type": "function", "name": "f"}, previous_response_id=None))
    assert req.tools == [ToolSpec(name="f")]
    assert req.tool_choice == {"type": "function", "name": "f"}


BAD = [
    ([1], ""),
    ({"model": "m"}, "input"),
    (user_body(input=5), "input"),
    (user_body(input=[]), "input"),
    (user_body(input=["hi"]), "input[0]"),
    (user_body(input=[{"content": "no type, no role"}]), "input[0].type"),
    (user_body(input=[{"type": "web_search_call", "id": "ws_1"}]), "input[0].type"),
    (user_body(input=[{"type": "message", "role": "robot", "content": "x"}]), "input[0].role"),
    (user_body(input=[{"type": "message", "role": "user", "content": 3}]), "input[0].content"),
    (user_body(input=[{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
     "input[0].content[0].type"),
    (user_body(input=[{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}]),
     "input[1].call_id"),
    (user_body(input=[{"role": "user", "content": "x"}, {"type": "message", "role": "user", "content": "y"},
                      {"type": "message", "role": "assistant", "content": "z"},
                      {"type": "function_call", "call_id": "c", "name": "f", "arguments": 7}]),
     "input[3].arguments"),
    (user_body(input=[{"type": "function_call", "call_id": "c", "name": 1, "arguments": "{}"}]), "input[0].name"),
    (user_body(input=[{"type": "function_call_output", "call_id": "c", "output": 5}]), "input[0].output"),
    (user_body(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
    (user_body(instructions=["x"]), "instructions"),
    (user_body(previous_response_id="resp_1"), "previous_response_id"),
    (user_body(max_output_tokens="100"), "max_output_tokens"),
    (user_body(max_output_tokens=0), "max_output_tokens"),
    (user_body(temperature="hot"), "temperature"),
    (user_body(top_p=True), "top_p"),
    (user_body(stream="yes"), "stream"),
    (user_body(tools={"type": "function"}), "tools"),
    (user_body(tools=[{"type": "function", "description": "no name"}]), "tools[0].name"),
    (user_body(tools=[{"type": "web_search"}, {"type": "function", "name": "f", "parameters": "{}"}]),
     "tools[1].parameters"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_input_names_the_field(body, field):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert e.value.field == field and e.value.status == 400


def test_previous_response_id_says_stateless():
    with pytest.raises(RequestError, match="stateless"):
        parse(user_body(previous_response_id="resp_1"))


def test_ids_and_error_body():
    assert api.NAME == "responses"
    assert api.new_response_id().startswith("resp_") and api.new_tool_call_id().startswith("call_")
    assert api.new_response_id() != api.new_response_id()
    assert api.error_body(400, "bad") == {"error": {"message": "bad", "type": "invalid_request_error",
                                                    "param": None, "code": None}}


# --- render_result ------------------------------------------------------------------------

CALLS = [ToolCall("call_1", "shell", ARGS_1), ToolCall("call_2", "shell", ARGS_2)]


def result(content="", calls=(), finish="stop", usage=(120, 7)):
    return ChatResult(id="resp_abc", model="policy", content=content, tool_calls=list(calls),
                      finish_reason=finish, usage=Usage(*usage))


def request():
    return parse(copy.deepcopy(CODEX_BODY))


def test_render_text():
    out = api.render_result(result("Hello."), request())
    Response.model_validate(out)
    assert (out["id"], out["object"], out["status"], out["model"]) == ("resp_abc", "response", "completed", "policy")
    assert out["incomplete_details"] is None
    [msg] = out["output"]
    assert msg["id"].startswith("msg_")
    assert {k: v for k, v in msg.items() if k != "id"} == {
        "type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]}
    assert out["usage"] == {"input_tokens": 120, "output_tokens": 7, "total_tokens": 127,
                            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
    assert out["parallel_tool_calls"] is False and out["tool_choice"] == "auto"
    assert [(t["type"], t["name"]) for t in out["tools"]] == [("function", "shell"), ("custom", "apply_patch")]


def test_render_tool_calls():
    out = api.render_result(result("Running.", CALLS, "tool_calls"), request())
    sdk = Response.model_validate(out)
    assert [i["type"] for i in out["output"]] == ["message", "function_call", "function_call"]
    for item, call in zip(out["output"][1:], CALLS):
        assert item["id"].startswith("fc_") and item["status"] == "completed"
        assert (item["call_id"], item["name"], item["arguments"]) == (call.id, call.name, call.arguments)
    assert sdk.output[1].arguments == ARGS_1
    only_calls = api.render_result(result("", CALLS[:1], "tool_calls"), request())
    assert [i["type"] for i in only_calls["output"]] == ["function_call"]


def test_render_length_is_incomplete():
    out = api.render_result(result("Truncat", finish="length"), request())
    sdk = Response.model_validate(out)
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert sdk.incomplete_details.reason == "max_output_tokens"


def test_rendered_output_comes_back_as_one_assistant_turn():
    """What Codex sends next turn: our output items (with their ids) then the call outputs."""
    out = api.render_result(result("Running.", CALLS, "tool_calls"), request())
    body = copy.deepcopy(CODEX_BODY)
    body["input"] += out["output"] + [{"type": "function_call_output", "call_id": "call_1", "output": "ok"}]
    messages = parse(body).messages
    assert messages[-2] == Message(role="assistant", content="Running.", tool_calls=CALLS)
    assert messages[-1] == Message(role="tool", content="ok", tool_call_id="call_1")


# --- streaming ----------------------------------------------------------------------------


def sse_events(chunks: list[bytes]) -> list[dict]:
    """Parse our own SSE bytes back; check each `event:` line against its data's type."""
    events = []
    for block in b"".join(chunks).split(b"\n\n"):
        if not block or block.startswith(b":"):
            continue
        event_line, data_line = block.split(b"\n")
        assert event_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        data = orjson.loads(data_line[len(b"data: "):])
        assert data["type"] == event_line[len(b"event: "):].decode()
        events.append(data)
    return events


def run_stream(deltas, res, ping: bool = False):
    stream = api.Stream(request(), "resp_abc")
    chunks = stream.start()
    for d in deltas:
        chunks += stream.delta(d)
    if ping:
        chunks.append(stream.ping())
    return sse_events(chunks + stream.finish(res))


HEAD = ["response.created", "response.in_progress"]
TEXT = ["response.output_item.added", "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL = ["response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]


def check_stream(events, status="completed"):
    """Invariants every stream keeps; returns the final response object."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT.validate_python(e)
    for e in events[:2]:
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == []
        assert e["response"]["id"] == "resp_abc"
    final = events[-1]["response"]
    Response.model_validate(final)
    assert final["status"] == status and final["usage"]["input_tokens"] == 120
    # Every item event's output_index points at that item in the final output, by id.
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == final["output"]
    for e in events:
        if "output_index" in e:
            item_id = e["item"]["id"] if "item" in e else e["item_id"]
            assert final["output"][e["output_index"]]["id"] == item_id
    return final


def test_stream_text_only():
    events = run_stream([TextDelta("Hel"), TextDelta(""), TextDelta("lo.")], result("Hello."))
    assert [e["type"] for e in events] == (HEAD + TEXT + ["response.output_text.delta"] * 2 + TEXT_END
                                           + ["response.completed"])
    final = check_stream(events)
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo."]
    assert events[-2]["item"]["content"] == [{"type": "output_text", "text": "Hello.", "annotations": []}]
    assert events[2]["item"]["status"] == "in_progress" and events[2]["item"]["content"] == []
    assert [i["type"] for i in final["output"]] == ["message"]


def test_stream_text_then_two_tool_calls():
    deltas = [TextDelta("Running."), ToolCallDelta(0, CALLS[0]), ToolCallDelta(1, CALLS[1])]
    events = run_stream(deltas, result("Running.", CALLS, "tool_calls"))
    assert [e["type"] for e in events] == (HEAD + TEXT + ["response.output_text.delta"] + TEXT_END + CALL + CALL
                                           + ["response.completed"])
    final = check_stream(events)
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"][1:]
    assert all(i["arguments"] == "" and i["status"] == "in_progress" for i in added)
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert args == [ARGS_1, ARGS_2]
    assert [(i["call_id"], i["arguments"]) for i in final["output"][1:]] == [("call_1", ARGS_1), ("call_2", ARGS_2)]


def test_stream_tool_call_only():
    events = run_stream([ToolCallDelta(0, CALLS[0])], result("", CALLS[:1], "tool_calls"))
    assert [e["type"] for e in events] == HEAD + CALL + ["response.completed"]
    final = check_stream(events)
    assert events[2]["output_index"] == 0 and final["output"][0]["call_id"] == "call_1"


def test_stream_length_ends_incomplete():
    events = run_stream([TextDelta("Trunc")], result("Trunc", finish="length"))
    assert events[-1]["type"] == "response.incomplete"
    final = check_stream(events, status="incomplete")
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_finish_emits_output_never_streamed():
    events = run_stream([], result("Late.", CALLS[:1], "tool_calls"))
    assert [e["type"] for e in events] == (HEAD + TEXT + ["response.output_text.delta"] + TEXT_END + CALL
                                           + ["response.completed"])
    check_stream(events)


def test_a_ping_is_a_real_event_codex_counts_as_activity():
    """Codex resets its stream idle timer only on events with data: a keep-alive is a
    repeated response.in_progress, with the items so far, in sequence."""
    events = run_stream([TextDelta("Hi")], result("Hi"), ping=True)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == HEAD and kinds.count("response.in_progress") == 2
    ping = events[kinds.index("response.in_progress", 2)]
    assert (ping["response"]["status"] == "in_progress"
            and [i["type"] for i in ping["response"]["output"]] == ["message"])
    check_stream(events)  # sequence numbers stay consecutive across the keep-alive
