"""api_anthropic: Claude-Code-shaped parsing, refusals naming the field, and responses and
SSE streams checked against the real `anthropic` SDK (its types, and its client over a mock
transport)."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx2
import orjson
import pytest
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from gyre.proxy import api_anthropic as api
from gyre.proxy.types import (
    ChatRequest,
    ChatResult,
    Message,
    RequestError,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)

SCHEMA = "http://json-schema.org/draft-07/schema#"
BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
               "required": ["command"], "additionalProperties": False, "$schema": SCHEMA}
READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"],
               "additionalProperties": False, "$schema": SCHEMA}
EPHEMERAL = {"type": "ephemeral"}


def claude_code_body() -> dict:
    """What Claude Code 2.1 sends on a later turn (HARNESS-NOTES.md), shortened."""
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": EPHEMERAL},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                         {"type": "text", "text": "List the files.", "cache_control": EPHEMERAL}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Let me look.", "signature": "sig=="},
                {"type": "text", "text": "I'll look."},
                {"type": "tool_use", "id": "toolu_01", "name": "Bash",
                 "input": {"command": "ls", "timeout": 60000}},
                {"type": "tool_use", "id": "toolu_02", "name": "Read", "input": {"file_path": "/a.txt"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.txt\nb.txt"},
                {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
                 "content": [{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}],
                 "cache_control": EPHEMERAL},
                {"type": "text", "text": "Now summarise."},
            ]},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "assistant", "content": [{"type": "text", "text": "Two files."}]},
            {"role": "user", "content": "Thanks."},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a shell command.", "input_schema": BASH_SCHEMA},
            {"name": "Read", "description": "Read a file.", "input_schema": READ_SCHEMA,
             "cache_control": EPHEMERAL},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "metadata": {"user_id": '{"device_id":"d1","session_id":"s1"}'},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "some_future_field": {"anything": True},
    }


HEADERS = {"X-Claude-Code-Session-Id": "sess-1", "x-claude-code-agent-id": "agent-7", "x-api-key": "k"}


def sdk_client(handler) -> anthropic.Anthropic:
    transport = httpx2.MockTransport(handler)
    return anthropic.Anthropic(api_key="k", base_url="http://proxy.test", max_retries=0,
                               http_client=httpx2.Client(transport=transport))


def recording_client(seen: list[dict], reply: dict) -> anthropic.Anthropic:
    """A client whose every call answers `reply` as JSON and appends its request body to `seen`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(orjson.loads(request.content))
        return httpx2.Response(200, json=reply)

    return sdk_client(handler)


# --- parsing ------------------------------------------------------------------------------


def test_parse_claude_code_body():
    req = api.parse_request(claude_code_body(), HEADERS)
    assert req.api == "anthropic" and req.model == "claude-sonnet-4-5"
    assert req.max_tokens == 32000 and req.stream is True
    assert req.temperature is None and req.top_p is None and req.stop == [] and req.tool_choice is None
    assert req.messages == [
        Message("system", "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;\n"
                          "You are Claude Code."),
        Message("user", "<system-reminder>ctx</system-reminder>\nList the files."),
        Message("assistant", "I'll look.", tool_calls=[
            ToolCall("toolu_01", "Bash", '{"command":"ls","timeout":60000}'),
            ToolCall("toolu_02", "Read", '{"file_path":"/a.txt"}')]),
        Message("tool", "a.txt\nb.txt", tool_call_id="toolu_01"),
        Message("tool", "line 1\nline 2", tool_call_id="toolu_02"),
        Message("user", "Now summarise."),
        Message("system", "Reminder: be brief."),
        Message("assistant", "Two files."),
        Message("user", "Thanks."),
    ]
    # The server tool is skipped; "$schema" keys ride along untouched.
    assert req.tools == [ToolSpec("Bash", "Run a shell command.", BASH_SCHEMA),
                         ToolSpec("Read", "Read a file.", READ_SCHEMA)]
    assert req.metadata == {"user_id": '{"device_id":"d1","session_id":"s1"}', "session_id": "sess-1",
                            "agent_id": "agent-7"}


def test_string_and_one_text_block_are_the_same_message():
    as_string = {"messages": [{"role": "user", "content": "hello"}], "system": "be nice"}
    as_blocks = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello",
                                                            "cache_control": EPHEMERAL}]}],
                 "system": [{"type": "text", "text": "be nice", "cache_control": EPHEMERAL}]}
    assert api.parse_request(as_string, {}).messages == api.parse_request(as_blocks, {}).messages
    assistant = [{"role": "assistant", "content": "ok"}]
    assistant_blocks = [{"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    assert api.parse_request({"messages": assistant}, {}).messages == \
        api.parse_request({"messages": assistant_blocks}, {}).messages


def test_reparsed_tool_use_input_keeps_the_call_id():
    first = {"type": "tool_use", "id": "toolu_X", "name": "Bash", "input": {"timeout": 60000.0, "command": "ls\t"}}
    later = {"type": "tool_use", "id": "toolu_X", "name": "Bash", "input": {"command": "ls\t", "timeout": 60000}}
    calls = [api.parse_request({"messages": [{"role": "assistant", "content": [b]}]}, {}).messages[0].tool_calls[0]
             for b in (first, later)]
    assert calls[0].id == calls[1].id == "toolu_X" and calls[0].name == calls[1].name
    assert orjson.loads(calls[0].arguments) == orjson.loads(calls[1].arguments)


def test_tool_use_input_with_a_huge_integer():
    block = {"type": "tool_use", "id": "toolu_H", "name": "Get", "input": {"id": 2**70, "q": "\u00e9"}}
    call = api.parse_request({"messages": [{"role": "assistant", "content": [block]}]}, {}).messages[0].tool_calls[0]
    assert call.arguments == '{"id":1180591620717411303424,"q":"\u00e9"}'


def test_user_message_text_before_tool_results_and_empty_content():
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "before"}, {"type": "tool_result", "tool_use_id": "t1"},
        {"type": "tool_result", "tool_use_id": "t2", "content": []}]},
        {"role": "user", "content": []}, {"role": "assistant", "content": []}]}
    assert api.parse_request(body, {}).messages == [
        Message("user", "before"), Message("tool", "", tool_call_id="t1"), Message("tool", "", tool_call_id="t2"),
        Message("user", ""), Message("assistant", "")]


def test_sampling_fields_and_lenient_max_tokens():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_p": 1,
            "stop_sequences": ["END", "\n\nHuman:"], "tool_choice": {"type": "auto"}}
    req = api.parse_request(body, {})
    assert (req.max_tokens, req.temperature, req.top_p, req.stop) == (None, 0.5, 1.0, ["END", "\n\nHuman:"])
    assert req.tool_choice == {"type": "auto"} and req.stream is False and req.metadata == {}
    assert api.parse_request({**body, "model": None}, {}).model == "default"


def test_tools_custom_type_and_missing_schema():
    tools = [{"type": "custom", "name": "a", "input_schema": {"type": "object"}}, {"name": "b"},
             {"type": "bash_20250124", "name": "bash"}]
    req = api.parse_request({"messages": [{"role": "user", "content": "x"}], "tools": tools}, {})
    assert req.tools == [ToolSpec("a", "", {"type": "object"}), ToolSpec("b", "", {})]
    assert req.tools[1].as_template_tool()["function"]["parameters"] == {"type": "object", "properties": {}}


def test_parse_count_tokens_needs_no_max_tokens_and_never_streams():
    body = claude_code_body()
    del body["max_tokens"]
    req = api.parse_count_tokens(body, HEADERS)
    assert req.max_tokens is None and req.stream is False
    assert req.messages == api.parse_request(claude_code_body(), HEADERS).messages
    # The body the real SDK sends for count_tokens parses too.
    seen: list[dict] = []
    client = recording_client(seen, {"input_tokens": 7})
    assert client.messages.count_tokens(model="m", system="s", messages=[{"role": "user", "content": "hi"}],
                                        tools=[{"name": "t", "input_schema": {"type": "object"}}]).input_tokens == 7
    req = api.parse_count_tokens(seen[0], {})
    assert req.messages == [Message("system", "s"), Message("user", "hi")] and req.tools[0].name == "t"


def _bad(path: str, value) -> dict:
    """claude_code_body() with the value at a dotted path (list indexes as ints) replaced."""
    body = claude_code_body()
    *keys, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    target = body
    for k in keys:
        target = target[k]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return body


_DELETE = object()
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


@pytest.mark.parametrize("path, value, field", [
    ("messages", _DELETE, "messages"),
    ("messages", [], "messages"),
    ("messages", {"role": "user"}, "messages"),
    ("messages.0", "hi", "messages[0]"),
    ("messages.0.role", "tool", "messages[0].role"),
    ("messages.0.role", None, "messages[0].role"),
    ("messages.0.content", 5, "messages[0].content"),
    ("messages.0.content.1", IMAGE, "messages[0].content[1].type"),
    ("messages.0.content.1", "plain", "messages[0].content[1]"),
    ("messages.0.content.1.text", None, "messages[0].content[1].text"),
    ("messages.0.content.1.type", 3, "messages[0].content[1].type"),
    ("messages.1.content.2.input", "ls", "messages[1].content[2].input"),
    ("messages.1.content.2.id", 1, "messages[1].content[2].id"),
    ("messages.1.content.2.name", None, "messages[1].content[2].name"),
    ("messages.1.content.0", {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
     "messages[1].content[0].type"),
    ("messages.2.content.0.tool_use_id", None, "messages[2].content[0].tool_use_id"),
    ("messages.2.content.0.content", {"text": "x"}, "messages[2].content[0].content"),
    ("messages.2.content.1.content", [IMAGE], "messages[2].content[1].content[0].type"),
    ("messages.2.content.1.is_error", "yes", "messages[2].content[1].is_error"),
    ("messages.2.content.2", {"type": "tool_use", "id": "t", "name": "n", "input": {}}, "messages[2].content[2].type"),
    ("messages.3.content", [{"type": "tool_result", "tool_use_id": "t"}], "messages[3].content[0].type"),
    ("system", {"text": "x"}, "system"),
    ("system.1.text", 1, "system[1].text"),
    ("tools", {"name": "Bash"}, "tools"),
    ("tools.0", "Bash", "tools[0]"),
    ("tools.0.name", None, "tools[0].name"),
    ("tools.0.input_schema", "object", "tools[0].input_schema"),
    ("tools.1.description", 1, "tools[1].description"),
    ("max_tokens", "32000", "max_tokens"),
    ("max_tokens", 0, "max_tokens"),
    ("temperature", "hot", "temperature"),
    ("top_p", True, "top_p"),
    ("stop_sequences", [1], "stop_sequences[0]"),
    ("stream", "yes", "stream"),
    ("metadata", "user", "metadata"),
])
def test_bad_input_names_the_field(path, value, field):
    with pytest.raises(RequestError) as err:
        api.parse_request(_bad(path, value), {})
    assert err.value.field == field and err.value.status == 400


def test_body_must_be_an_object():
    with pytest.raises(RequestError) as err:
        api.parse_request([], {})
    assert err.value.field == ""


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "api_error"), (504, "timeout_error"), (529, "overloaded_error"),
])
def test_error_body(status, kind):
    body = api.error_body(status, "nope")
    assert body == {"type": "error", "error": {"type": kind, "message": "nope"}}
    if kind != "request_too_large":  # documented by Anthropic for 413, absent from the SDK's union
        assert ErrorResponse.model_validate(body).error.type == kind


def test_ids():
    assert api.NAME == "anthropic"
    assert api.new_response_id().startswith("msg_") and api.new_tool_call_id().startswith("toolu_")
    assert api.new_response_id() != api.new_response_id()


# --- rendering ----------------------------------------------------------------------------

REQ = ChatRequest(api="anthropic", model="policy", messages=[Message("user", "hi")])
BASH = ToolCall("toolu_a", "Bash", '{"command": "ls -la", "timeout": 60000.0}')
READ = ToolCall("toolu_b", "Read", '{"file_path":"/tmp/x \\u00e9.txt"}')


def result(content: str = "", calls: tuple[ToolCall, ...] = (), finish: str = "stop") -> ChatResult:
    return ChatResult(id="msg_1", model="policy", content=content, tool_calls=list(calls), finish_reason=finish,
                      usage=Usage(input_tokens=11, output_tokens=5))


def sdk_dump(message: SdkMessage) -> dict:
    return message.model_dump(mode="json", exclude_none=True)


def without_nulls(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("res, blocks, stop", [
    (result("Hello."), [{"type": "text", "text": "Hello."}], "end_turn"),
    (result("Hel", finish="length"), [{"type": "text", "text": "Hel"}], "max_tokens"),
    (result("Looking.", (BASH, READ), "tool_calls"), [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {"command": "ls -la", "timeout": 60000.0}},
        {"type": "tool_use", "id": "toolu_b", "name": "Read", "input": {"file_path": "/tmp/x \u00e9.txt"}}],
     "tool_use"),
    (result("", (BASH,), "stop"), [{"type": "tool_use", "id": "toolu_a", "name": "Bash",
                                    "input": {"command": "ls -la", "timeout": 60000.0}}], "tool_use"),
    (result(""), [], "end_turn"),
])
def test_render_result(res, blocks, stop):
    body = api.render_result(res, REQ)
    assert body == {"id": "msg_1", "type": "message", "role": "assistant", "model": "policy", "content": blocks,
                    "stop_reason": stop, "stop_sequence": None, "usage": {"input_tokens": 11, "output_tokens": 5}}
    assert sdk_dump(SdkMessage.model_validate(body)) == without_nulls(body)


@pytest.mark.parametrize("arguments, sent", [
    ("", {}), ("not json", {}), ("[1, 2]", {}), ('"text"', {}),
    # Malformed arguments of an object: cut at the last safe point and closed, as when streamed.
    ('{"a": 1', {"a": 1}), ('{"a": "hal', {"a": "hal"}), ('{"a": 1, "b": tru', {"a": 1}),
])
def test_arguments_that_are_not_an_object_are_sent_as_one(arguments, sent):
    body = api.render_result(result("", (ToolCall("toolu_z", "Bash", arguments),), "tool_calls"), REQ)
    assert body["content"][0]["input"] == sent
    events = parse_sse(stream_bytes([ToolCallDelta(0, ToolCall("toolu_z", "Bash", arguments))], "tool_calls"))
    partial = "".join(d["delta"]["partial_json"] for _, d in events if d["type"] == "content_block_delta")
    assert json.loads(partial) == sent


def test_rendered_message_comes_back_as_the_same_turn():
    # The SDK reads our response and sends it back as the next request's assistant turn.
    rendered = api.render_result(result("Looking.", (BASH, READ), "tool_calls"), REQ)
    seen: list[dict] = []
    client = recording_client(seen, rendered)
    history = [{"role": "user", "content": "hi"}]
    first = client.messages.create(model="policy", max_tokens=100, messages=history)
    client.messages.create(model="policy", max_tokens=100, messages=[*history, first.to_param()])
    turn = api.parse_request(seen[1], {}).messages[1]
    assert turn.role == "assistant" and turn.content == "Looking."
    assert [(c.id, c.name, orjson.loads(c.arguments)) for c in turn.tool_calls] == \
        [(c.id, c.name, orjson.loads(c.arguments)) for c in (BASH, READ)]


# --- streaming ----------------------------------------------------------------------------


def parse_sse(chunks: list[bytes]) -> list[tuple[str, dict]]:
    """Our SSE bytes back into (event name, data object), checking the framing exactly."""
    events = []
    for frame in b"".join(chunks).split(b"\n\n")[:-1]:
        name_line, data_line = frame.split(b"\n")
        assert name_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        name, data = name_line[7:].decode(), orjson.loads(data_line[6:])
        assert data["type"] == name
        events.append((name, data))
    assert b"".join(chunks).endswith(b"\n\n")
    return events


def stream_bytes(deltas, finish: str, content: str | None = None, input_tokens: int = 11) -> list[bytes]:
    calls = [d.call for d in deltas if isinstance(d, ToolCallDelta)]
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta)) if content is None else content
    s = api.Stream(REQ, "msg_s", input_tokens=input_tokens)
    out = s.start()
    for d in deltas:
        out += s.delta(d)
    return out + s.finish(result(text, tuple(calls), finish))


def check_stream(events: list[tuple[str, dict]]) -> tuple[str, list[dict]]:
    """Every event validates as the SDK's RawMessageStreamEvent; indexes run 0, 1, ... with
    start/delta*/stop per block. Returns the text and the tool_use blocks, inputs rebuilt."""
    adapter = TypeAdapter(RawMessageStreamEvent)
    for _, data in events:
        assert adapter.validate_python(data).type == data["type"]
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text, tools, index, open_block = "", [], -1, None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == index + 1
            index, open_block = data["index"], dict(data["content_block"])
            open_block["json"] = ""
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == index
            delta = data["delta"]
            if delta["type"] == "text_delta":
                assert open_block["type"] == "text"
                text += delta["text"]
            else:
                assert open_block["type"] == "tool_use" and delta["type"] == "input_json_delta"
                open_block["json"] += delta["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == index and open_block is not None
            if open_block["type"] == "tool_use":
                assert open_block.pop("input") == {}
                arguments = open_block.pop("json")
                tools.append({**open_block, "input": orjson.loads(arguments)})
            open_block = None
    assert open_block is None
    return text, tools


def test_stream_text_only():
    chunks = stream_bytes([TextDelta("Hel"), TextDelta(""), TextDelta("lo.")], "stop")
    events = parse_sse(chunks)
    assert [(n, d.get("index")) for n, d in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0), ("message_delta", None), ("message_stop", None)]
    assert events[0][1]["message"] == {"id": "msg_s", "type": "message", "role": "assistant", "model": "policy",
                                       "content": [], "stop_reason": None, "stop_sequence": None,
                                       "usage": {"input_tokens": 11, "output_tokens": 0}}
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {"input_tokens": 11, "output_tokens": 5}}
    assert check_stream(events) == ("Hello.", [])


def test_stream_text_then_two_tool_calls():
    deltas = [TextDelta("Let me "), TextDelta("look."), ToolCallDelta(0, BASH), ToolCallDelta(1, READ)]
    events = parse_sse(stream_bytes(deltas, "tool_calls"))
    assert [(n, d.get("index")) for n, d in events] == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {}}
    # The arguments text goes out byte-exact.
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": BASH.arguments}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    text, tools = check_stream(events)
    assert text == "Let me look."
    assert tools == [{"type": "tool_use", "id": c.id, "name": c.name, "input": orjson.loads(c.arguments)}
                     for c in (BASH, READ)]


def test_stream_tool_call_only():
    events = parse_sse(stream_bytes([ToolCallDelta(0, READ)], "tool_calls", input_tokens=0))
    assert [(n, d.get("index")) for n, d in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("message_delta", None), ("message_stop", None)]
    # start() did not know the prompt size: message_delta carries the true, cumulative count.
    assert events[0][1]["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0}
    assert events[-2][1]["usage"] == {"input_tokens": 11, "output_tokens": 5}
    assert check_stream(events) == ("", [{"type": "tool_use", "id": "toolu_b", "name": "Read",
                                          "input": {"file_path": "/tmp/x \u00e9.txt"}}])


def test_stream_text_after_a_tool_call_opens_a_new_block():
    events = parse_sse(stream_bytes([TextDelta("a"), ToolCallDelta(0, BASH), TextDelta("b")], "length"))
    starts = [(d["index"], d["content_block"]["type"]) for n, d in events if n == "content_block_start"]
    assert starts == [(0, "text"), (1, "tool_use"), (2, "text")]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert check_stream(events)[0] == "ab"


def test_stream_finish_sends_tool_calls_never_streamed_once():
    s = api.Stream(REQ, "msg_s")
    out = s.start() + s.delta(ToolCallDelta(0, BASH)) + s.finish(result("", (BASH, READ), "tool_calls"))
    _, tools = check_stream(parse_sse(out))
    assert [t["id"] for t in tools] == ["toolu_a", "toolu_b"]


def test_stream_empty_output():
    events = parse_sse(stream_bytes([], "stop"))
    assert [n for n, _ in events] == ["message_start", "message_delta", "message_stop"]
    check_stream(events)


def test_ping():
    s = api.Stream(REQ, "msg_s")
    assert s.ping() == b'event: ping\ndata: {"type": "ping"}\n\n'
    assert parse_sse([s.ping()]) == [("ping", {"type": "ping"})]


# --- the real SDK client over a mock transport --------------------------------------------


def test_sdk_streams_our_events_into_the_rendered_message():
    deltas = [TextDelta("Let me "), TextDelta("look."), ToolCallDelta(0, BASH), ToolCallDelta(1, READ)]
    s = api.Stream(REQ, "msg_1", input_tokens=11)
    chunks = s.start() + s.delta(deltas[0]) + [s.ping()]
    for d in deltas[1:]:
        chunks += s.delta(d)
    final = result("Let me look.", (BASH, READ), "tool_calls")
    chunks += s.finish(final)
    seen: list[dict] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(orjson.loads(request.content))
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(chunks))

    with sdk_client(handler).messages.stream(model="policy", max_tokens=100, system="sys",
                                             messages=[{"role": "user", "content": "hi"}]) as stream:
        streamed_text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert streamed_text == "Let me look."
    assert sdk_dump(message) == without_nulls(api.render_result(final, REQ))
    # The SDK's own request body parses.
    req = api.parse_request(seen[0], {})
    assert req.stream is True and req.max_tokens == 100
    assert req.messages == [Message("system", "sys"), Message("user", "hi")]


def test_sdk_reads_our_error_body():
    client = sdk_client(lambda r: httpx2.Response(529, json=api.error_body(529, "busy")))
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 529 and err.value.body == api.error_body(529, "busy")


def test_parse_does_not_mutate_the_body():
    body = claude_code_body()
    before = copy.deepcopy(body)
    api.parse_request(body, HEADERS)
    assert body == before
