"""api_responses.py: OpenAI Responses (`POST /v1/responses`, Codex CLI) <-> ChatRequest/ChatResult.

Same surface as api_openai.py: `parse_request`, `render_result`, `Stream`, `error_body`,
`new_response_id`, `new_tool_call_id`. Stateless: the whole history must arrive in `input`
(`previous_response_id` is refused). Items the model produced in one turn (a message, then
function calls; reasoning items are dropped) merge back into one assistant Message.
Not HTTP (server.py owns the wire), and not the token layer.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any

import orjson

# error_body, overloaded_body, rate_limit_body: the Responses API answers errors in the same shape as Chat Completions.
from gyre.proxy.api_openai import (
    arguments_text,
    error_body,
    expect,
    optional_int,
    optional_number,
    overflow_body,
    overloaded_body,
    rate_limit_body,
    text_of,
)
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

__all__ = ["NAME", "Stream", "error_body", "new_response_id", "new_tool_call_id", "overflow_body", "overloaded_body",
           "parse_request", "rate_limit_body", "render_result"]

NAME = "responses"

# Item types that carry no text the policy should see again: the model's own reasoning comes
# back opaque (`content: null`, maybe `encrypted_content`), so it is accepted and dropped.
_DROPPED_ITEMS = frozenset({"reasoning"})
_CALL_ITEMS = frozenset({"function_call", "custom_tool_call", "tool_search_call"})
_OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output", "tool_search_output"})
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
    """A call item as the policy wrote it: a custom tool's raw input as {"input": text}, a
    namespace's tool by its qualified name, tool_search by its name."""
    call_id = _required_str(item, "call_id", field)
    if kind == "custom_tool_call":
        raw = expect(item.get("input", ""), str, f"{field}.input", "a string")
        return ToolCall(id=call_id, name=_required_str(item, "name", field),
                        arguments=json.dumps({"input": raw}, ensure_ascii=False))
    if kind == "tool_search_call":
        return ToolCall(id=call_id, name=str(item.get("name") or "tool_search"),
                        arguments=arguments_text(item.get("arguments", {}), f"{field}.arguments"))
    name = _required_str(item, "name", field)
    namespace = item.get("namespace")
    if namespace is not None:
        name = f"{expect(namespace, str, f'{field}.namespace', 'a string')}.{name}"
    return ToolCall(id=call_id, name=name, arguments=arguments_text(item.get("arguments", "{}"), f"{field}.arguments"))


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
    elif kind == "tool_search_output":  # the tools found, as the policy will read them
        tools = item.get("tools") or []
        messages.append(Message(role="tool", tool_call_id=_required_str(item, "call_id", field),
                                content=orjson.dumps(tools).decode()))
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
    """The tools the policy is shown: functions; Codex's custom (freeform) tools such as
    apply_patch, as a function of one string `input` whose description carries the tool's
    format (its Lark grammar); `tool_search`; and each tool of a `namespace` by its qualified
    name `ns.tool`. Tools the provider executes (web_search, ...) are skipped: nothing here
    runs them (the codex preset turns web search off)."""
    if raw is None:
        return []
    expect(raw, list, field, "a list")
    tools: list[ToolSpec] = []
    for i, t in enumerate(raw):
        f = f"{field}[{i}]"
        expect(t, dict, f, "an object")
        kind = expect(t.get("type", "function"), str, f"{f}.type", "a string")
        if kind == "function":
            tools.append(_function_tool(t, f))
        elif kind == "custom":
            tools.append(_custom_tool(t, f))
        elif kind == "tool_search":
            params = expect(t.get("parameters") or {}, dict, f"{f}.parameters", "an object")
            tools.append(ToolSpec(name=str(t.get("name") or "tool_search"), parameters=params, kind="tool_search",
                                  description=expect(t.get("description") or "", str, f"{f}.description", "a string")))
        elif kind == "namespace":
            namespace = _required_str(t, "name", f)
            for j, inner in enumerate(expect(t.get("tools") or [], list, f"{f}.tools", "a list")):
                spec = _function_tool(expect(inner, dict, f"{f}.tools[{j}]", "an object"), f"{f}.tools[{j}]")
                tools.append(ToolSpec(name=f"{namespace}.{spec.name}", description=spec.description,
                                      parameters=spec.parameters, kind="namespace", namespace=namespace))
    return tools


def _function_tool(t: dict, f: str) -> ToolSpec:
    params = t.get("parameters") or {}
    expect(params, dict, f"{f}.parameters", "an object")
    description = expect(t.get("description") or "", str, f"{f}.description", "a string")
    return ToolSpec(name=_required_str(t, "name", f), description=description, parameters=params)


def _custom_tool(t: dict, f: str) -> ToolSpec:
    description = expect(t.get("description") or "", str, f"{f}.description", "a string")
    fmt = t.get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = fmt.get("syntax") or "lark"
        description += f"\n\nThe input is raw text (not JSON) following this {syntax} grammar:\n{fmt['definition']}"
    params = {"type": "object", "properties": {"input": {"type": "string", "description": "the tool's raw input"}},
              "required": ["input"]}
    return ToolSpec(name=_required_str(t, "name", f), description=description, parameters=params, kind="custom")


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


def _spec(req: ChatRequest, name: str) -> ToolSpec | None:
    return next((t for t in req.tools if t.name == name), None)


def _call_item(item_id: str, call: ToolCall, status: str = "completed", spec: ToolSpec | None = None) -> dict:
    """The output item of a call, by the kind of tool it calls (Codex runs each kind from
    its own item type): function_call, custom_tool_call (raw input), tool_search_call, or a
    namespace's function_call (bare name plus `namespace`)."""
    done = status == "completed"
    base = {"id": item_id, "status": status, "call_id": call.id}
    kind = spec.kind if spec is not None else "function"
    if kind == "custom":
        return {**base, "type": "custom_tool_call", "name": call.name, "input": custom_input(call) if done else ""}
    if kind == "tool_search":
        args = _object(call.arguments) if done else {}
        return {**base, "type": "tool_search_call", "execution": "client", "arguments": args}
    item = {**base, "type": "function_call", "name": call.name, "arguments": call.arguments if done else ""}
    if kind == "namespace" and spec.namespace and call.name.startswith(spec.namespace + "."):
        item.update(name=call.name[len(spec.namespace) + 1:], namespace=spec.namespace)
    return item


def custom_input(call: ToolCall) -> str:
    """A custom tool's raw input from the policy's {"input": text} (else its text as is)."""
    value = _object(call.arguments)
    return value["input"] if isinstance(value.get("input"), str) else call.arguments


def _object(text: str) -> dict:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


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
        "tools": [_tool_echo(t) for t in req.tools],
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_tokens,
        "previous_response_id": None, "metadata": {},
        "usage": _usage(result) if result is not None else None,
    }


def _tool_echo(t: ToolSpec) -> dict:
    if t.kind == "custom":
        return {"type": "custom", "name": t.name, "description": t.description}
    return {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}


def render_result(result: ChatResult, req: ChatRequest) -> dict:
    output = [_message_item(_item_id("msg"), result.content)] if result.content else []
    output += [_call_item(_item_id("fc"), c, spec=_spec(req, c.name)) for c in result.tool_calls]
    return _response(req, result.id, int(time.time()), output, result)


class _InputText:
    """A custom tool's raw input as it streams: the policy writes {"input": "<JSON string>"};
    `feed` takes more of that JSON and returns the input text decoded so far (escapes
    resolved; a \\u escape or a surrogate pair waits for its end). Only the common shape,
    `input` first, streams; anything else comes out whole at the end (input.done)."""

    _HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')
    _ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

    def __init__(self) -> None:
        self.raw = ""
        self.at: int | None = None  # next raw char to decode, once the head was read
        self.done = False
        self._high: str | None = None  # a high surrogate waiting for its pair

    def feed(self, piece: str) -> str:
        self.raw += piece
        if self.at is None:
            m = self._HEAD.match(self.raw)
            if m is None:
                return ""
            self.at = m.end()
        out = []
        raw, i = self.raw, self.at
        while i < len(raw) and not self.done:
            ch = raw[i]
            if ch == '"':
                self.done = True
                break
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            if i + 1 >= len(raw):
                break  # the escape's second character has not arrived
            esc = raw[i + 1]
            if esc == "u":
                if i + 6 > len(raw):
                    break
                code = int(raw[i + 2:i + 6], 16)
                i += 6
                if 0xD800 <= code < 0xDC00:
                    self._high = chr(code)
                    continue
                if self._high is not None:
                    out.append((self._high + chr(code)).encode("utf-16", "surrogatepass").decode("utf-16"))
                    self._high = None
                    continue
                out.append(chr(code))
                continue
            out.append(self._ESCAPES.get(esc, esc))
            i += 2
        self.at = i
        return "".join(out)


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
        self._open_calls: dict[int, tuple[int, str, ToolSpec | None, _InputText]] = {}  # while streaming

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
            item_id, index, spec = _item_id("fc"), len(self._items), _spec(self.req, d.name)
            self._sent_calls.add(d.id)
            self._open_calls[d.index] = (index, item_id, spec, _InputText())
            item = _call_item(item_id, ToolCall(d.id, d.name, ""), "in_progress", spec)
            self._items.append(item)
            return out + [self._event("response.output_item.added", output_index=index, item=item)]
        if isinstance(d, ToolArgsDelta):
            index, item_id, spec, text = self._open_calls[d.index]
            return self._argument_events(index, item_id, spec, text, d.text)
        if isinstance(d, ToolCallEnd):  # the model's exact arguments, malformed ones included
            index, item_id, spec, _ = self._open_calls.pop(d.index)
            return self._end_call(index, item_id, spec, d.call)
        assert isinstance(d, ToolCallDelta)
        return self._close_text() + self._tool_call(d.call)

    def _argument_events(self, index: int, item_id: str, spec: ToolSpec | None, text: _InputText,
                         piece: str) -> list[bytes]:
        where = {"item_id": item_id, "output_index": index}
        kind = spec.kind if spec is not None else "function"
        if kind == "custom":  # the raw input, decoded from the policy's {"input": "..."} as it comes
            new = text.feed(piece)
            return [self._event("response.custom_tool_call_input.delta", **where, delta=new)] if new else []
        if kind == "tool_search":
            return []  # its arguments are an object in the item: sent whole at the end
        return [self._event("response.function_call_arguments.delta", **where, delta=piece)]

    def _end_call(self, index: int, item_id: str, spec: ToolSpec | None, call: ToolCall) -> list[bytes]:
        self._items[index] = item = _call_item(item_id, call, spec=spec)
        where = {"item_id": item_id, "output_index": index}
        kind = spec.kind if spec is not None else "function"
        if kind == "custom":
            out = [self._event("response.custom_tool_call_input.done", **where, input=item["input"])]
        elif kind == "tool_search":
            out = []
        else:
            out = [self._event("response.function_call_arguments.done", **where, arguments=call.arguments)]
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

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
        """A call handed over whole: added, its arguments in one piece, done."""
        item_id, index, spec = _item_id("fc"), len(self._items), _spec(self.req, call.name)
        self._sent_calls.add(call.id)
        self._items.append(_call_item(item_id, call, "in_progress", spec))
        added = self._event("response.output_item.added", output_index=index, item=self._items[index])
        args = self._argument_events(index, item_id, spec, _InputText(), call.arguments)
        return [added, *args, *self._end_call(index, item_id, spec, call)]

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
