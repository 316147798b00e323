"""api_openai.py: OpenAI Chat Completions <-> the internal ChatRequest/ChatResult.

Every provider module has the same surface: `parse_request`, `render_result`, `Stream`
(an SSE encoder fed with deltas), `error_body`, `new_response_id`, `new_tool_call_id`.
Lenient on what it does not use (unknown fields are ignored), strict on what it does
(a wrong type is a RequestError naming the field). Not HTTP: server.py owns the wire.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

import orjson

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

NAME = "openai"


def new_response_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def overloaded_body(message: str) -> dict:
    """A 503 to retry later (the proxy cannot take the call now: a full disk)."""
    return error_body(503, message)


def rate_limit_body(message: str, kind: str) -> dict:
    """A 429 as OpenAI words one (both OpenAI shapes): `type` names the limit ("requests" or
    "tokens"), `code` is rate_limit_exceeded; the SDKs and Codex retry it after `retry-after`."""
    body = error_body(429, message, code="rate_limit_exceeded")
    body["error"]["type"] = kind
    return body


def overflow_body(prompt_tokens: int, max_context: int) -> dict:
    """OpenAI's own wording and code for a prompt past the context (both OpenAI shapes)."""
    body = error_body(400, f"This model's maximum context length is {max_context} tokens. However, your messages "
                           f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                      code="context_length_exceeded")
    body["error"]["param"] = "messages"
    return body


# --- parsing ------------------------------------------------------------------------------


def expect(value: Any, types, field: str, what: str):
    if not isinstance(value, types) or isinstance(value, bool) and bool not in _tuple(types):
        raise RequestError(field, f"must be {what}, got {type(value).__name__}")
    return value


def _tuple(t):
    return t if isinstance(t, tuple) else (t,)


def text_of(content: Any, field: str) -> str:
    """A string, or a list of text parts (`{"type": "text", "text": ...}`), as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    expect(content, list, field, "a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        expect(part, dict, f"{field}[{i}]", "an object")
        kind = part.get("type", "text")
        if kind in ("text", "input_text", "output_text"):
            parts.append(expect(part.get("text"), str, f"{field}[{i}].text", "a string"))
        else:
            raise RequestError(f"{field}[{i}].type", f"content part {kind!r} is not supported (text only)")
    return "".join(parts)


def optional_number(body: dict, key: str) -> float | None:
    v = body.get(key)
    return None if v is None else float(expect(v, (int, float), key, "a number"))


def optional_int(body: dict, *keys: str) -> int | None:
    for key in keys:
        v = body.get(key)
        if v is not None:
            expect(v, int, key, "an integer")
            if v < 1:
                raise RequestError(key, "must be >= 1")
            return v
    return None


def stop_list(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    expect(value, list, field, "a string or a list of strings")
    return [expect(s, str, f"{field}[{i}]", "a string") for i, s in enumerate(value)]


def arguments_text(value: Any, field: str) -> str:
    """Tool-call arguments as JSON text: strings are kept byte-exact, objects serialised."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return orjson.dumps(value).decode()
    raise RequestError(field, f"must be a JSON string or object, got {type(value).__name__}")


def parse_tools(raw: Any, field: str = "tools") -> list[ToolSpec]:
    if raw is None:
        return []
    expect(raw, list, field, "a list")
    tools = []
    for i, t in enumerate(raw):
        expect(t, dict, f"{field}[{i}]", "an object")
        fn = t.get("function", t)  # {"type":"function","function":{...}} or flat
        expect(fn, dict, f"{field}[{i}].function", "an object")
        name = expect(fn.get("name"), str, f"{field}[{i}].function.name", "a string")
        params = fn.get("parameters") or {}
        expect(params, dict, f"{field}[{i}].function.parameters", "an object")
        tools.append(ToolSpec(name=name, description=fn.get("description") or "", parameters=params))
    return tools


def parse_message(m: Any, field: str) -> Message:
    expect(m, dict, field, "an object")
    role = expect(m.get("role"), str, f"{field}.role", "a string")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"{field}.role", f"unknown role {role!r}")
    msg = Message(role=role, content=text_of(m.get("content"), f"{field}.content"), name=m.get("name"))
    if role == "assistant":
        for j, tc in enumerate(expect(m.get("tool_calls") or [], list, f"{field}.tool_calls", "a list")):
            f = f"{field}.tool_calls[{j}]"
            expect(tc, dict, f, "an object")
            fn = expect(tc.get("function"), dict, f"{f}.function", "an object")
            msg.tool_calls.append(ToolCall(
                id=expect(tc.get("id"), str, f"{f}.id", "a string"),
                name=expect(fn.get("name"), str, f"{f}.function.name", "a string"),
                arguments=arguments_text(fn.get("arguments", "{}"), f"{f}.function.arguments")))
    if role == "tool":
        msg.tool_call_id = expect(m.get("tool_call_id"), str, f"{field}.tool_call_id", "a string")
    return msg


def parse_request(body: Any, headers: Mapping[str, str], memo: ParseMemo | None = None) -> ChatRequest:
    expect(body, dict, "", "a JSON object")
    raw = body.get("messages")
    if raw is None:
        raise RequestError("messages", "is required")
    expect(raw, list, "messages", "a list")
    if not raw:
        raise RequestError("messages", "must not be empty")
    n = body.get("n")
    if n not in (None, 1):
        raise RequestError("n", "only n=1 is supported")
    stream_options = body.get("stream_options") or {}
    expect(stream_options, dict, "stream_options", "an object")
    return ChatRequest(
        api=NAME,
        model=str(body.get("model") or "default"),
        messages=(memo or ParseMemo()).parse(raw, lambda m, i: [parse_message(m, f"messages[{i}]")]),
        tools=parse_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"),
        max_tokens=optional_int(body, "max_completion_tokens", "max_tokens"),
        temperature=optional_number(body, "temperature"),
        top_p=optional_number(body, "top_p"),
        stop=stop_list(body.get("stop"), "stop"),
        stream=bool(expect(body.get("stream", False), bool, "stream", "a boolean")),
        stream_usage=bool(stream_options.get("include_usage", False)),
    )


# --- rendering ----------------------------------------------------------------------------


def _tool_calls_json(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _usage(result: ChatResult) -> dict:
    u = result.usage
    return {"prompt_tokens": u.input_tokens, "completion_tokens": u.output_tokens,
            "total_tokens": u.input_tokens + u.output_tokens}


def render_result(result: ChatResult, req: ChatRequest) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": result.content or None}
    if result.tool_calls:
        message["tool_calls"] = _tool_calls_json(result.tool_calls)
    return {
        "id": result.id, "object": "chat.completion", "created": int(time.time()), "model": result.model,
        "choices": [{"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}],
        "usage": _usage(result),
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Stream:
    """SSE chunks of one streamed chat completion."""

    def __init__(self, req: ChatRequest, response_id: str):
        self.req = req
        self.id = response_id
        self.created = int(time.time())

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
        if self.req.stream_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[bytes]:
        return [_sse(self._chunk({"role": "assistant", "content": ""}))]

    def delta(self, d: Delta) -> list[bytes]:
        """Text as it comes; a tool call as OpenAI streams one: id and name first, then the
        arguments' text in pieces (the model's exact text: malformed arguments stay as written)."""
        if isinstance(d, TextDelta):
            return [_sse(self._chunk({"content": d.text}))]
        if isinstance(d, ToolCallStart):
            return [_sse(self._chunk({"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                                      "function": {"name": d.name, "arguments": ""}}]}))]
        if isinstance(d, ToolArgsDelta):
            return [_sse(self._chunk({"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}))]
        if isinstance(d, ToolCallEnd):
            return []
        assert isinstance(d, ToolCallDelta)
        c = d.call
        return [_sse(self._chunk({"tool_calls": [{"index": d.index, "id": c.id, "type": "function",
                                                  "function": {"name": c.name, "arguments": c.arguments}}]}))]

    def finish(self, result: ChatResult) -> list[bytes]:
        out = [_sse(self._chunk({}, result.finish_reason))]
        if self.req.stream_usage:
            out.append(_sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.req.model, "choices": [], "usage": _usage(result)}))
        out.append(b"data: [DONE]\n\n")
        return out

    def ping(self) -> bytes:
        return b": keep-alive\n\n"

    def error(self, status: int, message: str) -> list[bytes]:
        """An error after the stream started: a chunk carrying `error` (the openai SDK raises
        it as an APIError), then the end of the stream."""
        return [_sse(error_body(status, message)), b"data: [DONE]\n\n"]
