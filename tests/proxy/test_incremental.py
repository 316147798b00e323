"""Incremental rendering and parsing give exactly what a full render and parse give.

Segmenter (chat.py) re-renders only the changed tail of a conversation when the template
passes its locality probe; ParseMemo (types.py) reuses the parse of resent messages. Both
are checked against the full computation on random call sequences of the kinds harnesses
make: appended turns, compactions (a shorter history), sub-agents interleaving, edits of an
earlier message, recorded outputs spliced back, a changed tool list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy import api_anthropic, api_openai
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.segmenter import Segmenter, probe_locality
from gyre.proxy.types import Message, ParseMemo, ToolCall, ToolSpec

TOOLS = [ToolSpec(name="f", description="d", parameters={"type": "object", "properties": {"x": {"type": "string"}}})]
texts = st.sampled_from(["", "a", "hello", "<think>t</think>x", "two\nlines", '{"k": 1}', "ü ✓"])


@st.composite
def messages(draw) -> list[Message]:
    out = [Message(role="system", content=draw(st.sampled_from(["sys", "other system"])))] \
        if draw(st.booleans()) else []
    for turn in range(draw(st.integers(1, 5))):
        out.append(Message(role="user", content=draw(texts) or "u"))
        for k in range(draw(st.integers(0, 2))):
            ids = [f"c{turn}{k}{j}" for j in range(draw(st.integers(1, 2)))]
            out.append(Message(role="assistant", content=draw(texts),
                               tool_calls=[ToolCall(id=i, name="f", arguments='{"x": "1"}') for i in ids]))
            out += [Message(role="tool", content=draw(texts) or "r", tool_call_id=i) for i in ids]
            if draw(st.booleans()):
                out.append(Message(role="system", content="reminder"))
        out.append(Message(role="assistant", content=draw(texts) or "done"))
    return out


@st.composite
def call_sequences(draw):
    """Requests as a harness sends them: each a (messages, refs, tools) built from the last."""
    base = draw(messages())
    seq = []
    convo = base[:max(2, len(base) // 2)]
    for _ in range(draw(st.integers(2, 8))):
        action = draw(st.sampled_from(["extend", "extend", "extend", "compact", "subagent", "edit", "tools"]))
        if action == "extend":
            convo = convo + draw(messages())[:draw(st.integers(1, 4))]
        elif action == "compact":
            convo = convo[:max(1, len(convo) // 3)] + [Message(role="user", content="summary")]
        elif action == "subagent":
            seq.append((draw(messages()), {}, TOOLS))
            continue
        elif action == "edit" and len(convo) > 2:
            i = draw(st.integers(1, len(convo) - 1))
            m = convo[i]
            convo = convo[:i] + [Message(role=m.role, content=m.content + " edited", tool_calls=m.tool_calls,
                                         tool_call_id=m.tool_call_id)] + convo[i + 1:]
        refs = {i: f"r{i}" for i, m in enumerate(convo)
                if m.role == "assistant" and m.content and not m.tool_calls and draw(st.booleans())}
        seq.append((convo, refs, [] if action == "tools" else TOOLS))
    return seq


@pytest.fixture(scope="module")
def tok(tiny_dir) -> ChatTokenizer:
    return ChatTokenizer(tiny_dir)


def test_the_tiny_template_is_local(tok):
    assert tok.local  # else nothing below would exercise the incremental path


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=call_sequences())
def test_incremental_segments_equal_full_renders(tok, seq):
    seg = Segmenter(tok)
    for msgs, refs, tools in seq:
        assert seg.segments(msgs, tools, refs, {}) == tok.segments(msgs, tools, refs)


def test_the_incremental_path_is_taken_and_reuses_chunks(tok):
    seg = Segmenter(tok)
    convo = [Message(role="system", content="s"), Message(role="user", content="u")]
    for i in range(20):
        convo += [Message(role="assistant", content=f"a{i}"), Message(role="user", content=f"u{i}")]
        assert seg.segments(convo, TOOLS, {}, {}) == tok.segments(convo, TOOLS, {})
    assert seg.full == 1 and seg.incremental == 19 and seg.reused_chunks > 19 * 3


def _template_dir(tiny_dir: Path, tmp_path: Path, template: str) -> Path:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("template", [
    # Earlier text depends on the whole conversation (a count of messages up front).
    "{{ messages|length }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
    # Qwen3-style: thinking stripped from assistant turns before the last user message.
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<{{ m.role }}>"
    "{% if m.role == 'assistant' and loop.index0 < ns.last %}"
    "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    # Later text depends on a message two back.
    "{% for m in messages %}{% if loop.index0 > 1 %}[{{ messages[loop.index0 - 2].role }}]{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% endfor %}",
])
def test_non_local_templates_fail_the_probe_and_render_in_full(tiny_dir, tmp_path, template):
    tok = ChatTokenizer(_template_dir(tiny_dir, tmp_path, template))
    assert not probe_locality(tok) and not tok.local
    seg = Segmenter(tok)
    convo = [Message(role="system", content="s"), Message(role="user", content="u")]
    for i in range(6):
        convo += [Message(role="assistant", content=f"<think>t</think>a{i}"), Message(role="user", content=f"u{i}")]
        assert seg.segments(convo, [], {}, {}) == tok.segments(convo, [], {})
    assert seg.incremental == 0


raw_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system"]),
    "content": st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                          min_size=1, max_size=2))}), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(bodies=st.lists(raw_messages, min_size=1, max_size=6), grow=st.booleans())
def test_parse_memo_equals_a_fresh_parse(bodies, grow):
    memo_o, memo_a = ParseMemo(), ParseMemo()
    history: list = []
    for raw in bodies:
        history = (history + raw) if grow else raw
        body = {"model": "m", "messages": history}
        assert api_openai.parse_request(body, {}, memo=memo_o).messages == api_openai.parse_request(body, {}).messages
        try:
            fresh = api_anthropic.parse_request(body, {}).messages
        except Exception as e:  # noqa: BLE001 - the memo must fail the same way
            with pytest.raises(type(e)):
                api_anthropic.parse_request(body, {}, memo=memo_a)
            continue
        assert api_anthropic.parse_request(body, {}, memo=memo_a).messages == fresh


def test_the_parse_memo_keeps_a_resent_message_once():
    """A harness resends its history as new objects every call; the memo's recent lists
    share one copy of each message they repeat, not one per request."""
    memo = ParseMemo()
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "a tool result " * 100}]
    api_openai.parse_request({"messages": history}, {}, memo=memo)
    for k in range(3):
        history = json.loads(json.dumps(history)) + [{"role": "user", "content": f"next {k}"}]  # as off the wire
        api_openai.parse_request({"messages": history}, {}, memo=memo)
    lists = [raw for raw, _ in memo.recent]
    assert len(lists) == 4 and all(lst[1] is lists[-1][1] for lst in lists)
