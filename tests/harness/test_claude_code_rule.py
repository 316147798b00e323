"""The claude-code role rule on recorded Claude Code 2.1.197 request shapes (no CLI needed).

fixtures/claude_code_requests.json holds what Claude Code sent to gyre's proxy in a
sub-agent run and in a compaction run (texts trimmed). The requests are replayed through
a fresh execution in order, as the proxy would see them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from gyre.proxy import api_anthropic
from gyre.proxy.recorder import Recorder
from gyre.proxy.roles import CallInfo, ClaudeCodeRule, GenericRule
from gyre.proxy.types import ToolCall
from tests.scripted import tool_call

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "claude_code_requests.json").read_text())


def replay(tokenizer, recorded: list[dict], *, rule=None, outputs: dict[int, ToolCall] | None = None):
    """Prepare each request in turn and complete it: the model's text for the tool call
    `outputs[i]` (answered with its id) when given, else "ok"."""
    ex = Recorder("x", "k", tokenizer, rule or ClaudeCodeRule())
    roles = []
    for i, r in enumerate(recorded):
        req = api_anthropic.parse_request(r["body"], r["headers"])
        prep = ex.prepare(req, r["headers"])
        roles.append(prep.role)
        call = (outputs or {}).get(i)
        text = tool_call(call.name, **json.loads(call.arguments)) if call else "ok"
        ex.record_reply(req, tokenizer.encode(text), prep=prep, new_call_id=lambda call=call: call.id)
    return ex, roles


def agent_call(recorded: list[dict]) -> ToolCall:
    """The Agent tool_use the main agent made (as the next main request sends it back)."""
    for r in recorded:
        for m in r["body"]["messages"]:
            if m["role"] == "assistant" and isinstance(m["content"], list):
                for b in m["content"]:
                    if b.get("type") == "tool_use" and b["name"] == "Agent":
                        return ToolCall(id=b["id"], name="Agent", arguments=json.dumps(b["input"]))
    raise AssertionError("no Agent call in the fixture")


def test_subagent_by_header(chat_tokenizer):
    _, roles = replay(chat_tokenizer, FIXTURES["sub-agent"])
    assert roles == ["main", "sub-agent", "sub-agent", "main"]


def test_subagent_by_delegation_alone(chat_tokenizer):
    """Strip every sub-agent signal but the prompt: the delegation match still finds it."""
    recorded = copy.deepcopy(FIXTURES["sub-agent"])
    for r in recorded:
        r["headers"].pop("x-claude-code-agent-id", None)
        for block in r["body"]["system"]:
            block["text"] = block["text"].replace(" cc_is_subagent=true;", "")
    ex, roles = replay(chat_tokenizer, recorded, outputs={0: agent_call(recorded)})
    assert roles == ["main", "sub-agent", "sub-agent", "main"]
    assert [c.get("delegated_by") for c in ex.calls] == [None, "x-c00001", "x-c00001", None]
    # Without the Agent call on record there is nothing to match: main (a new root).
    _, roles = replay(chat_tokenizer, recorded)
    assert roles == ["main"] * 4


def test_compaction_and_continuation(chat_tokenizer):
    _, roles = replay(chat_tokenizer, FIXTURES["compaction"])
    assert roles == ["main", "main", "main-summary", "main"]
    # The generic rule would call the post-compaction root a sub-agent: why the preset
    # names its own rule.
    _, generic = replay(chat_tokenizer, FIXTURES["compaction"], rule=GenericRule())
    assert generic[3] == "sub-agent"


def test_subagent_compaction_and_side_calls():
    rule = ClaudeCodeRule()
    base = dict(root=1, model="gyre-policy", has_tools=True, last_user="hi", first_model="gyre-policy",
                first_root_has_tools=True, headers={"x-claude-code-agent-id": "a1"})
    compact = "...\nYour task is to create a detailed summary of the conversation so far, paying close attention"
    assert rule.classify(CallInfo(**base)) == "sub-agent"
    assert rule.classify(CallInfo(**{**base, "last_user": compact})) == "sub-agent-summary"
    assert rule.classify(CallInfo(**{**base, "headers": {}, "last_user": compact})) == "main-summary"
    # A title request: no tools, not a summary.
    assert rule.classify(CallInfo(**{**base, "headers": {}, "has_tools": False,
                                     "last_user": "Generate a concise title for this session"})) == "side"


@pytest.mark.parametrize("scenario", ["sub-agent", "compaction"])
def test_fixture_shapes_are_what_the_notes_say(scenario):
    """Guard the fixture itself: streaming, billing header first, Agent/Task tool present."""
    for r in FIXTURES[scenario]:
        body = r["body"]
        assert body["stream"] is True and body["system"][0]["text"].startswith("x-anthropic-billing-header")
        assert any(t["name"] == "Agent" for t in body["tools"]) or "x-claude-code-agent-id" in r["headers"]
