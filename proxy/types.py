"""types.py: the one internal request/response shape all three provider APIs translate onto.

OpenAI Chat Completions, Anthropic Messages and OpenAI Responses each parse into a
`ChatRequest` and render a `ChatResult` (or a stream of `Delta`s) back; nothing else in
the proxy knows a provider's field names. Not the token layer: rendering to token IDs is
chat.py's job, and recording is tree.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RequestError(ValueError):
    """A request the proxy refuses with 400; `field` names the offending JSON path."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.status = status


class ContextOverflow(RequestError):
    """The prompt leaves no room for output in the context: answered 400 in each provider's
    own wording, the one its harnesses act on (Claude Code compacts on Anthropic's)."""

    def __init__(self, prompt_tokens: int, max_context: int):
        self.prompt_tokens, self.max_context = prompt_tokens, max_context
        self.limit = max_context - 1  # the longest prompt that leaves one token for output
        super().__init__("messages", f"prompt is too long: {prompt_tokens} tokens > {self.limit} maximum")


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as emitted by the model or sent back


@dataclass(slots=True)
class Message:
    """One normalised chat message. `content` is plain text (blocks joined, cache_control
    and similar annotations dropped); assistant tool calls ride in `tool_calls`."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # role == "tool": the call this result answers
    name: str | None = None


@dataclass(slots=True)
class ToolSpec:
    name: str  # as the policy sees and calls it ("ns.tool" for a Responses namespace's tool)
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    # Responses tool kinds beyond functions (Codex): "custom" (freeform input, e.g. apply_patch:
    # the policy calls it with {"input": text}), "tool_search", "namespace" (a namespace's tool).
    kind: str = "function"
    namespace: str | None = None

    def as_template_tool(self) -> dict[str, Any]:
        """The OpenAI-style tool dict that HF chat templates (Qwen/Hermes) render."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


@dataclass(slots=True)
class ChatRequest:
    api: str  # "openai" | "anthropic" | "responses"
    model: str
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: Any = None  # accepted; the policy decides
    max_tokens: int | None = None  # None: the server's default
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    stream_usage: bool = False  # OpenAI stream_options.include_usage
    metadata: dict[str, Any] = field(default_factory=dict)  # API-specific extras kept for records


@dataclass(slots=True)
class Usage:
    input_tokens: int
    output_tokens: int


@dataclass(slots=True)
class ChatResult:
    """The parsed model output of one call."""

    id: str  # response id (chatcmpl-..., msg_..., resp_...)
    model: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    usage: Usage


# --- streaming deltas, in the order the output parser emits them -------------------------


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    """A complete tool call at once (arguments whole): a call that could not be streamed
    (its arguments a JSON string, or keys in another order), or a test's."""

    index: int
    call: ToolCall


@dataclass(slots=True)
class ToolCallStart:
    """A tool call begins: its id and name are known, its arguments follow as ToolArgsDelta."""

    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolArgsDelta:
    """More of a started call's arguments, the model's exact JSON text."""

    index: int
    text: str


@dataclass(slots=True)
class ToolCallEnd:
    """A started call is complete: `call.arguments` is every ToolArgsDelta joined; `valid`
    says whether they form a JSON object (a malformed call stays a call once started)."""

    index: int
    call: ToolCall
    valid: bool


Delta = TextDelta | ToolCallDelta | ToolCallStart | ToolArgsDelta | ToolCallEnd


class ParseMemo:
    """One execution's recent raw message lists and their parses. A harness resends its
    whole history every call; a raw message equal to the one at the same index of a
    recent request (dict equality, which runs in C) reuses that parse instead of being
    validated and built again. Parsed messages are never mutated after parsing. A repeated
    raw message is replaced in the request's list by the recent one it equals, so the
    remembered lists hold each message once, not once per request."""

    KEEP = 4

    def __init__(self) -> None:
        self.recent: list[tuple[list, list[list[Message]]]] = []

    def parse(self, raw: list, parse_one) -> list[Message]:
        """`parse_one(raw_message, index) -> list[Message]` for what is new."""
        prev_raw, prev_out = next(((r, o) for r, o in self.recent if r and raw and r[0] == raw[0]), ((), ()))
        per: list[list[Message]] = []
        same = True
        for i, m in enumerate(raw):
            if same and i < len(prev_raw) and prev_raw[i] == m:
                raw[i] = prev_raw[i]  # kept once: the recent lists share what they repeat
                per.append(prev_out[i])
            else:
                same = False
                per.append(parse_one(m, i))
        self.recent.insert(0, (raw, per))
        del self.recent[self.KEEP:]
        return [msg for msgs in per for msg in msgs]
