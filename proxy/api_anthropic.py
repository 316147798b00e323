"""api_anthropic.py: Anthropic Messages <-> the internal ChatRequest/ChatResult.

The same surface as api_openai.py (`parse_request`, `render_result`, `Stream`, `error_body`,
`new_response_id`, `new_tool_call_id`) plus `parse_count_tokens` for
`POST /v1/messages/count_tokens`. Shaped by what Claude Code really sends (HARNESS-NOTES.md):
system blocks, mid-list system messages, tool_result blocks, thinking blocks, server tools.
Not HTTP: server.py owns the wire, the `?beta=true` query string and the token counting.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import orjson

from gyre.proxy.api_openai import expect, optional_int, optional_number, stop_list
from gyre.proxy.jsonprefix import JsonPrefix
from gyre.proxy.types import (
    ChatRequest,
    ChatResult,
    Delta,
    Message,
    ParseMemo,
    RequestError,
    TextDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)

NAME = "anthropic"

# Blocks are separate paragraphs to the model: joining with "" would glue Claude Code's
# billing-header line onto the system prompt and a <system-reminder> onto the user's text.
BLOCK_SEPARATOR = "\n"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                415: "invalid_request_error", 429: "rate_limit_error",
                504: "timeout_error", 529: "overloaded_error"}

# Headers Claude Code sends that tell sessions and sub-agents apart (kept for records).
_HEADER_METADATA = {"x-claude-code-session-id": "session_id", "x-claude-code-agent-id": "agent_id"}


def new_response_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def new_tool_call_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def overloaded_body(message: str) -> dict:
    """A 503 to retry later (the proxy cannot take the call now: a full disk), as Anthropic
    words an overload."""
    return {"type": "error", "error": {"type": "overloaded_error", "message": message}}


def rate_limit_body(message: str, kind: str) -> dict:
    """A 429 as Anthropic words one (rate_limit_error, whichever limit `kind` names); Claude
    Code and the SDK retry it after `retry-after`."""
    return error_body(429, message)


def overflow_body(prompt_tokens: int, max_context: int) -> dict:
    """Anthropic's wording, which Claude Code parses to decide to compact."""
    return error_body(400, f"prompt is too long: {prompt_tokens} tokens > {max_context - 1} maximum")


# --- parsing ------------------------------------------------------------------------------


def _block_type(block: Any, field: str) -> str:
    expect(block, dict, field, "an object")
    return expect(block.get("type", "text"), str, f"{field}.type", "a string")


def _text_blocks(content: Any, field: str) -> str:
    """A string, or a list of text blocks, as one string; cache_control and citations dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    expect(content, list, field, "a string or a list of content blocks")
    parts = []
    for i, block in enumerate(content):
        kind = _block_type(block, f"{field}[{i}]")
        if kind != "text":
            raise RequestError(f"{field}[{i}].type", f"content block {kind!r} is not supported here (text only)")
        parts.append(expect(block.get("text"), str, f"{field}[{i}].text", "a string"))
    return BLOCK_SEPARATOR.join(parts)


def _tool_result(block: dict, field: str) -> Message:
    call_id = expect(block.get("tool_use_id"), str, f"{field}.tool_use_id", "a string")
    # is_error has no place in Message: the error text itself tells the model.
    expect(block.get("is_error", False), (bool, type(None)), f"{field}.is_error", "a boolean")
    return Message(role="tool", content=_text_blocks(block.get("content"), f"{field}.content"),
                   tool_call_id=call_id)


def _user_messages(content: Any, field: str) -> list[Message]:
    """One user message can hold text and tool results: each tool_result becomes its own
    tool message, and each run of text blocks a user message, in their original order."""
    if not isinstance(content, list):
        return [Message(role="user", content=_text_blocks(content, field))]
    out: list[Message] = []
    texts: list[str] = []
    for i, block in enumerate(content):
        f = f"{field}[{i}]"
        kind = _block_type(block, f)
        if kind == "text":
            texts.append(expect(block.get("text"), str, f"{f}.text", "a string"))
        elif kind == "tool_result":
            if texts:
                out.append(Message(role="user", content=BLOCK_SEPARATOR.join(texts)))
                texts = []
            out.append(_tool_result(block, f))
        else:
            raise RequestError(f"{f}.type", f"content block {kind!r} is not supported (text and tool_result only)")
    if texts or not out:
        out.append(Message(role="user", content=BLOCK_SEPARATOR.join(texts)))
    return out


def _tool_use(block: dict, field: str) -> ToolCall:
    # Claude Code sends `input` back re-parsed (keys sorted, numbers normalised): only the
    # id is byte-exact, so the recorder keys on it and the arguments text is just a rendering.
    call_id = expect(block.get("id"), str, f"{field}.id", "a string")
    name = expect(block.get("name"), str, f"{field}.name", "a string")
    value = expect(block.get("input", {}), dict, f"{field}.input", "an object")
    try:
        arguments = orjson.dumps(value).decode()
    except orjson.JSONEncodeError:  # integers past 64 bits: same compact form, slower
        arguments = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return ToolCall(id=call_id, name=name, arguments=arguments)


def _assistant_message(content: Any, field: str) -> Message:
    if not isinstance(content, list):
        return Message(role="assistant", content=_text_blocks(content, field))
    msg = Message(role="assistant")
    texts = []
    for i, block in enumerate(content):
        f = f"{field}[{i}]"
        kind = _block_type(block, f)
        if kind == "text":
            texts.append(expect(block.get("text"), str, f"{f}.text", "a string"))
        elif kind == "tool_use":
            msg.tool_calls.append(_tool_use(block, f))
        elif kind not in ("thinking", "redacted_thinking"):  # never ours: we emit no thinking blocks
            raise RequestError(f"{f}.type", f"content block {kind!r} is not supported (text and tool_use only)")
    msg.content = BLOCK_SEPARATOR.join(texts)
    return msg


def parse_messages(raw: Any, field: str = "messages", memo: ParseMemo | None = None) -> list[Message]:
    if raw is None:
        raise RequestError(field, "is required")
    expect(raw, list, field, "a list")
    if not raw:
        raise RequestError(field, "must not be empty")

    def one(m: Any, i: int) -> list[Message]:
        f = f"{field}[{i}]"
        expect(m, dict, f, "an object")
        role = expect(m.get("role"), str, f"{f}.role", "a string")
        content = m.get("content")
        if role == "user":
            return _user_messages(content, f"{f}.content")
        if role == "assistant":
            return [_assistant_message(content, f"{f}.content")]
        if role == "system":  # Claude Code puts these mid-list, after tool results
            return [Message(role="system", content=_text_blocks(content, f"{f}.content"))]
        raise RequestError(f"{f}.role", f"unknown role {role!r}")

    return (memo or ParseMemo()).parse(raw, one)


def parse_tools(raw: Any, field: str = "tools") -> list[ToolSpec]:
    if raw is None:
        return []
    expect(raw, list, field, "a list")
    tools = []
    for i, t in enumerate(raw):
        f = f"{field}[{i}]"
        expect(t, dict, f, "an object")
        kind = t.get("type") or "custom"
        schema = t.get("input_schema")
        if kind != "custom" and schema is None:
            continue  # a server tool (web_search_20250305, ...): the policy cannot run it
        name = expect(t.get("name"), str, f"{f}.name", "a string")
        description = expect(t.get("description") or "", str, f"{f}.description", "a string")
        params = expect(schema or {}, dict, f"{f}.input_schema", "an object")
        tools.append(ToolSpec(name=name, description=description, parameters=params))
    return tools


def _metadata(body: dict, headers: Mapping[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    raw = body.get("metadata")
    if raw is not None:
        expect(raw, dict, "metadata", "an object")
        if raw.get("user_id") is not None:
            meta["user_id"] = raw["user_id"]  # a JSON string from Claude Code: kept as-is
    for key, value in headers.items():
        if key.lower() in _HEADER_METADATA:
            meta[_HEADER_METADATA[key.lower()]] = value
    return meta


def _parse(body: Any, headers: Mapping[str, str], memo: ParseMemo | None = None) -> ChatRequest:
    """Shared by both endpoints. `thinking`, `context_management`, `output_config` and other
    unknown fields are accepted and ignored."""
    expect(body, dict, "", "a JSON object")
    system = _text_blocks(body.get("system"), "system")
    messages = parse_messages(body.get("messages"), memo=memo)
    return ChatRequest(
        api=NAME,
        model=str(body.get("model") or "default"),
        messages=([Message(role="system", content=system)] if system else []) + messages,
        tools=parse_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"),
        temperature=optional_number(body, "temperature"),
        top_p=optional_number(body, "top_p"),
        stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
        metadata=_metadata(body, headers),
    )


def parse_request(body: Any, headers: Mapping[str, str], memo: ParseMemo | None = None) -> ChatRequest:
    req = _parse(body, headers, memo)
    req.max_tokens = optional_int(body, "max_tokens")  # required by Anthropic; None: server default
    req.stream = expect(body.get("stream", False), bool, "stream", "a boolean")
    return req


def parse_count_tokens(body: Any, headers: Mapping[str, str]) -> ChatRequest:
    """`POST /v1/messages/count_tokens`: the same prompt fields, no max_tokens, no stream."""
    return _parse(body, headers)


# --- rendering ----------------------------------------------------------------------------


def stop_reason(result: ChatResult) -> str:
    # "stop_sequence" would need the matched stop string, which ChatResult does not carry.
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "tool_calls" or result.tool_calls:
        return "tool_use"
    return "end_turn"


def input_json(call: ToolCall) -> str:
    """The tool call's arguments as the JSON text of an object. Anthropic clients require an
    object: arguments the model left malformed are cut at their last safe point and closed
    (jsonprefix.py), as they are when streamed; not an object at all: `{}`. The client's own
    validation then tells the model what is missing."""
    try:
        value = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        prefix = JsonPrefix()
        prefix.feed(call.arguments)
        return prefix.text[:prefix.safe] + prefix.closers() if prefix.safe else "{}"
    return call.arguments if isinstance(value, dict) else "{}"


def _tool_use_block(call: ToolCall, arguments: bool = True) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": orjson.loads(input_json(call)) if arguments else {}}


def render_result(result: ChatResult, req: ChatRequest) -> dict:
    content: list[dict] = [{"type": "text", "text": result.content}] if result.content else []
    content.extend(_tool_use_block(c) for c in result.tool_calls)
    return {
        "id": result.id, "type": "message", "role": "assistant", "model": result.model, "content": content,
        "stop_reason": stop_reason(result), "stop_sequence": None,
        "usage": {"input_tokens": result.usage.input_tokens, "output_tokens": result.usage.output_tokens},
    }


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class Stream:
    """SSE events of one streamed message. server.py calls start() once, delta() per parsed
    delta, finish() once, and ping() while it waits; block indexes count up from 0.

    Text opens a block lazily on its first non-empty delta; a tool call closes any open text
    block, opens a tool_use block as soon as its name is known, then sends its arguments as
    input_json_delta fragments up to their last safe point (clients parse the fragments as
    they come, so they never see malformed JSON): at the end the rest, or, for arguments the
    model left malformed, the closers that make the safe prefix valid."""

    def __init__(self, req: ChatRequest, response_id: str, input_tokens: int = 0):
        self.req = req
        self.id = response_id
        self.input_tokens = input_tokens
        self._next_index = 0
        self._text_open = False
        self._sent_calls: set[str] = set()
        self._args: dict[int, tuple[JsonPrefix, list[int]]] = {}  # call index -> (its arguments, [chars sent])

    def start(self) -> list[bytes]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [_event("message_start", {"type": "message_start", "message": message})]

    def _open(self, block: dict) -> bytes:
        self._next_index += 1
        return _event("content_block_start", {"type": "content_block_start", "index": self._next_index - 1,
                                              "content_block": block})

    def _close(self) -> bytes:
        self._text_open = False
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._next_index - 1})

    def _block_delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self._next_index - 1,
                                              "delta": delta})

    def _partial(self, text: str, sent: list[int], upto: int) -> list[bytes]:
        if not text:
            return []
        sent[0] = upto
        return [self._block_delta({"type": "input_json_delta", "partial_json": text})]

    def _tool_call(self, call: ToolCall) -> list[bytes]:
        self._sent_calls.add(call.id)
        out = [self._close()] if self._text_open else []
        out.append(self._open(_tool_use_block(call, arguments=False)))
        out.append(self._block_delta({"type": "input_json_delta", "partial_json": input_json(call)}))
        out.append(self._close())
        return out

    def delta(self, d: Delta) -> list[bytes]:
        if isinstance(d, ToolCallDelta):
            return self._tool_call(d.call)
        if isinstance(d, ToolCallStart):
            self._sent_calls.add(d.id)
            self._args[d.index] = (JsonPrefix(), [0])
            out = [self._close()] if self._text_open else []
            return out + [self._open({"type": "tool_use", "id": d.id, "name": d.name, "input": {}})]
        if isinstance(d, ToolArgsDelta):
            prefix, sent = self._args[d.index]
            prefix.feed(d.text)
            return self._partial(prefix.text[sent[0]:prefix.safe], sent, prefix.safe)
        if isinstance(d, ToolCallEnd):
            prefix, sent = self._args.pop(d.index)
            tail = prefix.text[sent[0]:] if prefix.complete else prefix.text[sent[0]:prefix.safe] + prefix.closers()
            return self._partial(tail, sent, len(prefix.text)) + [self._close()]
        assert isinstance(d, TextDelta)
        if not d.text:
            return []
        out = []
        if not self._text_open:
            out.append(self._open({"type": "text", "text": ""}))
            self._text_open = True
        out.append(self._block_delta({"type": "text_delta", "text": d.text}))
        return out

    def finish(self, result: ChatResult) -> list[bytes]:
        out = [self._close()] if self._text_open else []
        # 1) Tool calls the parser only settled at the end (never streamed as deltas).
        for call in result.tool_calls:
            if call.id not in self._sent_calls:
                out.extend(self._tool_call(call))
        # 2) message_delta usage is cumulative; input_tokens corrects a start() that sent 0.
        usage = {"input_tokens": result.usage.input_tokens, "output_tokens": result.usage.output_tokens}
        out.append(_event("message_delta", {"type": "message_delta", "usage": usage,
                                            "delta": {"stop_reason": stop_reason(result), "stop_sequence": None}}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out

    def ping(self) -> bytes:
        return b'event: ping\ndata: {"type": "ping"}\n\n'

    def error(self, status: int, message: str) -> list[bytes]:
        """An error after the stream started: Anthropic's `error` event (overloaded_error for
        a 503/529, as its API sends mid-stream)."""
        return [_event("error", error_body(529 if status in (503, 529) else status, message))]
