"""api_responses.py: OpenAI Responses (`POST /v1/responses`, Codex CLI) <-> ChatRequest/ChatResult.

Same surface as api_openai.py: `parse_request`, `render_result`, `Stream`, `error_body`,
`new_response_id`, `new_tool_call_id`. Stateless: the whole history must arrive in `input`
(`previous_response_id` is refused). Items the model produced in one turn (a message, then
function calls; reasoning items are dropped) merge back into one assistant Message.
Not HTTP (server.py owns the wire), and not the token layer.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Mapping

import orjson

# error_body: the Responses API answers errors in the same shape as Chat Completions.
from gyre.proxy.api_openai import (arguments_text, error_body, expect, optional_int, optional_number, overflow_body,
                                   text_of)
from gyre.proxy.types import (ChatRequest, ChatResult, Delta, Message, ParseMemo, RequestError, TextDelta, ToolArgsDelta,
                              ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart, ToolSpec)

__all__ = ["NAME", "Stream", "error_body", "new_response_id", "new_tool_call_id", "overflow_body", "parse_request",
           "render_result"]

NAME = "responses"

# Item types that carry no text the policy should see again: the model's own reasoning comes
# back opaque (`content: null`, maybe `encrypted_content`), so it is accepted and dropped.
_DROPPED_ITEMS = frozenset({"reasoning"})
_CALL_ITEMS = {"function_call": "arguments", "custom_tool_call": "input"}  # type -> arguments key
_OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})
_ROLES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(12)}"


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# --- parsing ------------------------------------------------------------------------------


def _required_str(item: dict, key: str, field: str) -> str:
    return expect(item.get(key), str, f"{field}.{key}", "a string")


def _call(item: dict, kind: str, field: str) -> ToolCall:
    key = _CALL_ITEMS[kind]
    return ToolCall(id=_required_str(item, "call_id", field), name=_required_str(item, "name", field),
                    arguments=arguments_text(item.get(key, "{}"), f"{field}.{key}"))


def _append_item(messages: list[Message], item: Any, field: str) -> None:
    """Translate one `input` item onto `messages`, merging assistant output of one turn."""
    expect(item, dict, field, "an object")
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"  # EasyInputMessage: {"role", "content"} without a type
    expect(kind, str, f"{field}.type", "a string")
    if kind == "message":
        role = expect(item.get("role"), str, f"{field}.role", "a string")
        if role not in _ROLES:
            raise RequestError(f"{field}.role", f"unknown role {role!r}")
        # A new message item always starts a new Message, even after an assistant one: the
        # rendered output puts its one message item before the function calls.
        messages.append(Message(role=_ROLES[role], content=text_of(item.get("content"), f"{field}.content")))
    elif kind in _CALL_ITEMS:
        call = _call(item, kind, field)
        # Calls right after assistant output (a message or other calls) came from the same
        # model output: they join that Message rather than starting a turn of their own.
        if messages and messages[-1].role == "assistant":
            messages[-1].tool_calls.append(call)
        else:
            messages.append(Message(role="assistant", tool_calls=[call]))
    elif kind in _OUTPUT_ITEMS:
        messages.append(Message(role="tool", tool_call_id=_required_str(item, "call_id", field),
                                content=text_of(item.get("output"), f"{field}.output")))
    elif kind not in _DROPPED_ITEMS:
        # We only ever emit message and function_call items, so anything else (web_search_call,
        # item_reference, compaction, ...) comes from another server's history: refuse it
        # rather than silently train on a prompt that lost part of its content.
        raise RequestError(f"{field}.type", f"input item type {kind!r} is not supported")


def parse_input(raw: Any, field: str = "input") -> list[Message]:
    if isinstance(raw, str):
        return [Message(role="user", content=raw)]
    expect(raw, list, field, "a string or a list of items")
    messages: list[Message] = []
    for i, item in enumerate(raw):
        _append_item(messages, item, f"{field}[{i}]")
    return messages


def parse_tools(raw: Any, field: str = "tools") -> list[ToolSpec]:
    """Flat function tools (`{"type":"function","name",...}`); other tool types (custom,
    web_search, tool_search, namespace, local_shell, ...) are accepted and skipped: the
    policy can only call functions."""
    if raw is None:
        return []
    expect(raw, list, field, "a list")
    tools = []
    for i, t in enumerate(raw):
        f = f"{field}[{i}]"
        expect(t, dict, f, "an object")
        if expect(t.get("type", "function"), str, f"{f}.type", "a string") != "function":
            continue
        params = t.get("parameters") or {}
        expect(params, dict, f"{f}.parameters", "an object")
        description = expect(t.get("description") or "", str, f"{f}.description", "a string")
        tools.append(ToolSpec(name=_required_str(t, "name", f), description=description, parameters=params))
    return tools


def _metadata(body: dict) -> dict[str, Any]:
    """Extras kept for records and for echoing back; all optional and loosely typed."""
    keep = {}
    for key in ("prompt_cache_key", "metadata", "parallel_tool_calls", "reasoning", "store"):
        if body.get(key) is not None:
            keep[key] = body[key]
    return keep


def parse_request(body: Any, headers: Mapping[str, str], memo: ParseMemo | None = None) -> ChatRequest:
    """`memo` is accepted for the common signature; input items can merge into the
    previous message, so they are parsed whole each time."""
    expect(body, dict, "", "a JSON object")
    if body.get("previous_response_id") is not None:
        raise RequestError("previous_response_id", "is not supported: this proxy is stateless and keeps no "
                           "responses; send the whole conversation in `input` (store: false)")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None and expect(instructions, str, "instructions", "a string"):
        messages.append(Message(role="system", content=instructions))
    if body.get("input") is None:
        raise RequestError("input", "is required")
    messages += parse_input(body["input"])
    if not messages:
        raise RequestError("input", "must not be empty")
    stream = body.get("stream")
    return ChatRequest(
        api=NAME,
        model=str(body.get("model") or "default"),
        messages=messages,
        tools=parse_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"),
        max_tokens=optional_int(body, "max_output_tokens"),  # Codex sends none: server default
        temperature=optional_number(body, "temperature"),
        top_p=optional_number(body, "top_p"),
        stream=False if stream is None else expect(stream, bool, "stream", "a boolean"),
        metadata=_metadata(body),
    )


# --- rendering ----------------------------------------------------------------------------


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else ""}


def _usage(result: ChatResult) -> dict:
    # Codex compacts on the reported input_tokens: these must be the true counts.
    u = result.usage
    return {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
            "total_tokens": u.input_tokens + u.output_tokens,
            # cache_write_tokens: required by the current openai SDK's ResponseUsage.
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _tool_choice(req: ChatRequest) -> Any:
    tc = req.tool_choice
    return tc if isinstance(tc, dict) or tc in ("none", "auto", "required") else "auto"


def _response(req: ChatRequest, response_id: str, created_at: int, output: list[dict],
              result: ChatResult | None = None) -> dict:
    """The Response object; `result` None means still in progress (no usage yet)."""
    status, incomplete = "in_progress", None
    if result is not None:
        status = "incomplete" if result.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "error": None, "incomplete_details": incomplete, "instructions": None,
        "model": result.model if result is not None else req.model, "output": output,
        "parallel_tool_calls": bool(req.metadata.get("parallel_tool_calls", True)),
        "tool_choice": _tool_choice(req),
        "tools": [{"type": "function", **_tool_echo(t)} for t in req.tools],
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_tokens,
        "previous_response_id": None, "metadata": {},
        "usage": _usage(result) if result is not None else None,
    }


def _tool_echo(t: ToolSpec) -> dict:
    return {"name": t.name, "description": t.description, "parameters": t.parameters}


def render_result(result: ChatResult, req: ChatRequest) -> dict:
    output = [_message_item(_item_id("msg"), result.content)] if result.content else []
    output += [_call_item(_item_id("fc"), c) for c in result.tool_calls]
    return _response(req, result.id, int(time.time()), output, result)


class Stream:
    """SSE events of one streamed response. server.py calls start() once, delta() per parsed
    delta, ping() while waiting, and finish() once; each returns the bytes to send.

    Every event carries the next `sequence_number`; `output_index` is the item's position in
    `output`. The open message item (if any) is closed before a function call is announced,
    so items never interleave.
    """

    def __init__(self, req: ChatRequest, response_id: str):
        self.req = req
        self.id = response_id
        self.created_at = int(time.time())
        self._seq = 0
        self._items: list[dict] = []  # output items so far, in their final (done) form once closed
        self._text: list[str] | None = None  # pieces of the open message item; None when none is open
        self._sent_calls: set[str] = set()
        self._sent_text = False
        self._open_calls: dict[int, tuple[int, str]] = {}  # call index -> (output index, item id) while streaming

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> list[bytes]:
        response = _response(self.req, self.id, self.created_at, [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def delta(self, d: Delta) -> list[bytes]:
        if isinstance(d, TextDelta):
            return self._text_delta(d.text)
        if isinstance(d, ToolCallStart):  # announced once named; its arguments follow as deltas
            out = self._close_text()
            item_id, index = _item_id("fc"), len(self._items)
            self._sent_calls.add(d.id)
            self._open_calls[d.index] = (index, item_id)
            item = _call_item(item_id, ToolCall(d.id, d.name, ""), "in_progress")
            self._items.append(item)
            return out + [self._event("response.output_item.added", output_index=index, item=item)]
        if isinstance(d, ToolArgsDelta):
            index, item_id = self._open_calls[d.index]
            return [self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                delta=d.text)]
        if isinstance(d, ToolCallEnd):  # the model's exact arguments, malformed ones included
            index, item_id = self._open_calls.pop(d.index)
            self._items[index] = _call_item(item_id, d.call)
            where = {"item_id": item_id, "output_index": index}
            return [self._event("response.function_call_arguments.done", **where, arguments=d.call.arguments),
                    self._event("response.output_item.done", output_index=index, item=self._items[index])]
        assert isinstance(d, ToolCallDelta)
        return self._close_text() + self._tool_call(d.call)

    def _text_delta(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = []
        if self._text is None:
            item = _message_item(_item_id("msg"), None, "in_progress")
            self._items.append(item)
            self._text = []
            out.append(self._event("response.output_item.added", output_index=len(self._items) - 1, item=item))
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self._items) - 1, content_index=0, part=_text_part("")))
        self._text.append(text)
        self._sent_text = True
        out.append(self._event("response.output_text.delta", item_id=self._items[-1]["id"],
                               output_index=len(self._items) - 1, content_index=0, delta=text, logprobs=[]))
        return out

    def _close_text(self) -> list[bytes]:
        if self._text is None:
            return []
        text, self._text = "".join(self._text), None
        index = len(self._items) - 1
        item = self._items[index] = _message_item(self._items[index]["id"], text)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=_text_part(text)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _tool_call(self, call: ToolCall) -> list[bytes]:
        # The output parser hands over whole calls, so the arguments go out as one delta.
        item_id, index = _item_id("fc"), len(self._items)
        self._sent_calls.add(call.id)
        self._items.append(_call_item(item_id, call))
        where = {"item_id": item_id, "output_index": index}
        return [self._event("response.output_item.added", output_index=index,
                            item=_call_item(item_id, call, "in_progress")),
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self._event("response.function_call_arguments.done", **where, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=self._items[index])]

    def finish(self, result: ChatResult) -> list[bytes]:
        out = self._close_text()
        # 1) Output the parser never streamed (it should not happen) still reaches the client
        #    as items: Codex builds its history from output_item.done, not from the final object.
        if result.content and not self._sent_text:
            out += self._text_delta(result.content) + self._close_text()
        for call in result.tool_calls:
            if call.id not in self._sent_calls:
                out += self._tool_call(call)
        # 2) The final object repeats the streamed items (same ids) with the true usage.
        response = _response(self.req, self.id, self.created_at, list(self._items), result)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=response)]

    def ping(self) -> bytes:
        """A real event while the model is silent: Codex resets its stream idle timer on events
        that carry data, never on SSE comments."""
        return self._event("response.in_progress", response=_response(self.req, self.id, self.created_at,
                                                                       list(self._items)))

    def error(self, status: int, message: str) -> list[bytes]:
        """An error after the stream started: `response.failed`, the response carrying it."""
        response = _response(self.req, self.id, self.created_at, list(self._items))
        code = {400: "invalid_prompt", 429: "rate_limit_exceeded"}.get(status, "server_error")
        response.update(status="failed", error={"code": code, "message": message})
        return [self._event("response.failed", response=response)]
