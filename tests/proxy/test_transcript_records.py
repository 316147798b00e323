"""A call's transcript keys in calls.jsonl (records.TRANSCRIPT_KEYS): its messages from the
first one the closest recent call did not send (interleaved conversations each find their
own), the answer's text and tool calls, or for a call that ended unanswered the decoding of
what was generated; in the file only, never in the calls a Recorder or a loaded execution
keeps in memory (unless asked)."""

from __future__ import annotations

import json

from gyre.proxy.recorder import Recorder
from gyre.proxy.records import TRANSCRIPT_KEYS, load_execution
from gyre.proxy.roles import GenericRule
from gyre.proxy.types import ChatRequest, Message
from tests.scripted import tool_call


def lines(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]


def test_interleaved_conversations_each_write_only_their_new_messages(tmp_path, chat_tokenizer):
    tok = chat_tokenizer
    ex = Recorder("x", "k", tok, GenericRule(), dir=tmp_path / "x")
    talks = {name: [Message("system", f"You are the {name} agent."), Message("user", f"{name}: begin.")]
             for name in ("main", "sub")}
    for turn in range(2):
        for name, msgs in talks.items():
            req = ChatRequest(api="openai", model="m", messages=list(msgs))
            reply = tool_call("read_file", path="a.txt") if turn == 0 and name == "main" else f"{name} {turn}"
            result, _ = ex.record_reply(req, tok.encode(reply) + tok.encode("<|im_end|>"))
            msgs += [Message("assistant", result.content, list(result.tool_calls)),
                     Message("tool", "a", tool_call_id=result.tool_calls[0].id) if result.tool_calls
                     else Message("user", "Go on.")]
    main1, sub1, main2, sub2 = lines(tmp_path / "x")
    assert (main1["messages_from"], main1["messages_seen_in"]) == (0, None)
    assert main1["messages"] == [{"role": "system", "content": "You are the main agent."},
                                 {"role": "user", "content": "main: begin."}]
    assert (sub1["messages_from"], sub1["messages_seen_in"], len(sub1["messages"])) == (0, None, 2)
    (made,) = main1["output_tool_calls"]
    assert made["name"] == "read_file" and json.loads(made["arguments"]) == {"path": "a.txt"}
    assert main1["output_text"] == "" and main1["finish_reason"] == "tool_calls"
    # Each second call names its own conversation's first, not the call just before it.
    assert (main2["messages_from"], main2["messages_seen_in"]) == (2, main1["call_id"])
    assert main2["messages"] == [{"role": "assistant", "content": "", "tool_calls": [made]},
                                 {"role": "tool", "content": "a", "tool_call_id": made["id"]}]
    assert (sub2["messages_from"], sub2["messages_seen_in"]) == (2, sub1["call_id"])
    assert sub2["messages"] == [{"role": "assistant", "content": "sub 0"}, {"role": "user", "content": "Go on."}]
    assert (sub2["output_text"], sub2["output_tool_calls"]) == ("sub 1", [])
    # In memory, nothing of it: not in the Recorder's calls, nor in a loaded execution's unless asked.
    ex.close()
    assert not any(k in c for c in ex.calls for k in TRANSCRIPT_KEYS)
    assert not any(k in c for c in load_execution(tmp_path / "x").calls for k in TRANSCRIPT_KEYS)
    kept = load_execution(tmp_path / "x", transcript=True).calls
    assert [c["messages"] for c in kept] == [c["messages"] for c in (main1, sub1, main2, sub2)]


def test_a_call_that_ended_unanswered_keeps_what_was_generated(tmp_path, chat_tokenizer):
    tok = chat_tokenizer
    ex = Recorder("x", "k", tok, GenericRule(), dir=tmp_path / "x")
    req = ChatRequest(api="openai", model="m", messages=[Message("user", "Write a.txt.")])
    prep = ex.prepare(req, {})
    ids = tok.encode("I will wri")
    ex.complete(prep, output_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids),
                finish_reason="disconnected", status="disconnected", engine="e", result=None, request=req)
    (c,) = lines(tmp_path / "x")
    assert (c["status"], c["output_text"], c["output_tool_calls"]) == ("disconnected", "I will wri", [])
    assert c["messages"] == [{"role": "user", "content": "Write a.txt."}]
    # The same request again (a retry): nothing new is written, the earlier call is named.
    ex.record_reply(req, tok.encode("Done.<|im_end|>"))
    again = lines(tmp_path / "x")[1]
    assert (again["messages_from"], again["messages_seen_in"], again["messages"]) == (1, c["call_id"], [])
