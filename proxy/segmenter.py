"""segmenter.py: a conversation's segments, re-rendering only what changed since a recent call.

A harness resends its whole history on every call; `Segmenter` reuses the rendered chunks
of a recent request that shares a prefix, when the chat template is local enough for that
(`probe_locality`, run once per template), so rendering costs O(new messages), not
O(context). The result always equals `ChatTokenizer.segments`. Not the tokenizer or the
renderer: chat.py owns both.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.proxy.chat import ChatTokenizer, Ref, Text
from gyre.proxy.types import Message, RequestError, ToolCall, ToolSpec


def _marked(m: Message, i: int, refs: dict[int, str]) -> bool:
    """Whether message i ends a chunk: a content mark (recorded outputs are delimited by
    their REF brackets inside a chunk; empty contents carry nothing)."""
    return bool(m.content) and i not in refs


def _marks(messages: list[Message], refs: dict[int, str]) -> list[int]:
    """Per message, the index of the chunk its mark ends (-1: no mark)."""
    marks, q = [], 0
    for i, m in enumerate(messages):
        if _marked(m, i, refs):
            marks.append(q)
            q += 1
        else:
            marks.append(-1)
    return marks


def _reduced(messages: list[Message], refs: dict[int, str], p: int) -> tuple[list[Message], dict[int, str]]:
    """[messages[0]] + messages[p:], with the refs renumbered to match."""
    index = [0, *range(p, len(messages))]
    return [messages[i] for i in index], {j: refs[i] for j, i in enumerate(index) if i in refs}


def _key(m: Message, ref: str | None) -> tuple:
    """What a message renders from, as plain data (tuple equality runs in C)."""
    return (m.role, m.content, m.tool_call_id, m.name, ref, *((c.id, c.name, c.arguments) for c in m.tool_calls))


@dataclass
class _Rendered:
    keys: list[tuple]
    tools: list[dict]
    chunks: list[str]
    marks: list[int]  # index of the chunk each message's mark ends (-1: no mark)


class Segmenter:
    """Segments of a conversation that re-renders only what changed since a recent call.

    A harness resends its whole history every call, so rendering it all costs O(context)
    per call. When the chat template is *local* (probed: each message's text depends only
    on the first message, its predecessor and its successor, and earlier text never on
    later messages) and a recent request shares a prefix of c messages, the chunks up to
    the last marked message p <= c-2 are that request's, and the rest comes from rendering
    [messages[0]] + messages[p:] alone. Anything else (another tool list, a short common
    prefix, a template that fails the probe or raises on the reduced conversation) is a
    full render, so the result always equals `ChatTokenizer.segments`.
    """

    KEEP = 4  # recent requests remembered (main agent, sub-agents, side calls interleave)

    def __init__(self, tokenizer: ChatTokenizer):
        self.tok = tokenizer
        self.recent: list[_Rendered] = []
        self.reused_chunks = 0  # statistics: chunks taken from a recent render
        self.incremental = self.full = 0

    def segments(self, messages: list[Message], tools: list[ToolSpec], refs: dict[int, str],
                 restore_args: dict[str, str]) -> list[Text | Ref]:
        tools_t = [t.as_template_tool() for t in tools]
        # The recent renders are kept once: an equal tool list or message key is the recent one's.
        tools_t = next((r.tools for r in self.recent if r.tools == tools_t), tools_t)
        keys = [_key(m, refs.get(i)) for i, m in enumerate(messages)]
        marks = _marks(messages, refs)
        chunks = self._incremental(messages, keys, marks, tools_t, refs, restore_args) if self.tok.local else None
        if chunks is None:
            chunks = self.tok.chunks(messages, tools_t, refs, restore_args)
            self.full += 1
        else:
            self.incremental += 1
        self.recent.insert(0, _Rendered(keys, tools_t, chunks, marks))
        del self.recent[self.KEEP:]
        return self.tok.to_segments(chunks)

    def _incremental(self, messages, keys, marks, tools_t, refs, restore_args) -> list[str] | None:
        best, common = None, 0
        for prev in self.recent:
            if prev.tools != tools_t or not prev.keys or prev.keys[0] != keys[0]:
                continue
            c, n = 1, min(len(prev.keys), len(keys))
            while c < n and prev.keys[c] == keys[c]:
                c += 1
            if c > common:
                best, common = prev, c
        if best is not None:
            keys[:common] = best.keys[:common]
        p = next((i for i in range(common - 2, 0, -1) if marks[i] >= 0), None)
        if best is None or p is None:
            return None
        reduced, reduced_refs = _reduced(messages, refs, p)
        try:
            tail = self.tok.chunks(reduced, tools_t, reduced_refs, restore_args, start=1)
        except RequestError:
            return None  # e.g. a template that checks role alternation: the full render decides
        first = 1 if marks[0] >= 0 else 0
        head = best.chunks[:marks[p] + 1]
        self.reused_chunks += len(head)
        return head + tail[first + 1:]


def probe_locality(tok: ChatTokenizer, seed: int = 0) -> bool:
    """Render synthetic conversations (tool runs, tool calls with and without text, empty
    and thinking-tagged contents, mid-list system messages, recorded-output placeholders,
    with and without tools) and check the two properties Segmenter relies on."""
    import random

    rng = random.Random(seed)
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]

    def text() -> str:
        return rng.choice(["", "a", "hello there", "<think>t</think>answer", "line\nline", "{\"k\": 1}"])

    def conversation() -> tuple[list[Message], dict[int, str]]:
        msgs = [Message(role="system", content=rng.choice(["sys", "you are x"]))] if rng.random() < 0.8 else []
        refs: dict[int, str] = {}
        for _ in range(rng.randint(2, 7)):
            msgs.append(Message(role="user", content=text() or "u"))
            for _ in range(rng.randint(0, 2)):
                calls = [ToolCall(id=f"c{len(msgs)}{k}", name="f", arguments='{"x": "1"}')
                         for k in range(rng.randint(1, 2))]
                msgs.append(Message(role="assistant", content=text(), tool_calls=calls))
                for c in calls:
                    msgs.append(Message(role="tool", content=text() or "r", tool_call_id=c.id))
                if rng.random() < 0.2:
                    msgs.append(Message(role="system", content="reminder"))
            msgs.append(Message(role="assistant", content=text() or "done"))
            if rng.random() < 0.3:
                refs[len(msgs) - 1] = f"r{len(msgs)}"
        return msgs, refs

    try:
        for trial in range(24):
            msgs, refs = conversation()
            tools_t = tools if trial % 2 else []
            full = tok.chunks(msgs, tools_t, refs, {})
            marks = _marks(msgs, refs)
            for k in range(2, len(msgs)):
                prefix = tok.chunks(msgs[:k], tools_t, {i: r for i, r in refs.items() if i < k}, {})
                for p in range(1, k - 1):  # earlier text never depends on later messages
                    if marks[p] >= 0 and prefix[:marks[p] + 1] != full[:marks[p] + 1]:
                        return False
            for p in range(1, len(msgs)):  # later text depends only on messages[0] and the neighbours
                if marks[p] < 0:
                    continue
                reduced, rrefs = _reduced(msgs, refs, p)
                tail = tok.chunks(reduced, tools_t, rrefs, {})
                first = 1 if marks[0] >= 0 else 0
                if tail[first + 1:] != full[marks[p] + 1:]:
                    return False
    except RequestError:
        return False
    return True
