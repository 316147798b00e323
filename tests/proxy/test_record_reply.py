"""Recorder.record_reply, the benches' and tests' way to record an output without the server,
records what the server records: the same request served by a live proxy with the scripted
engine, and the same output ids handed to record_reply on a Recorder of its own, give equal
call records, equal trees (the output's tokens, log-probs, versions, the lookups a second call
follows) and the same answer, tool calls (malformed ones too) and a client's stop string
included."""

from __future__ import annotations

import aiohttp
import pytest

from gyre.proxy.recorder import APIS, Recorder
from tests.scripted import tool_call

TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
WRITE = tool_call("write_file", path="a.txt", content="hi")
MALFORMED = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", "content": "hi}\n</tool_call>'


def openai_body(messages: list[dict], **extra) -> dict:
    return {"model": "m", "messages": messages, "tools": TOOLS, **extra}


def openai_next(messages: list[dict], answer: dict) -> list[dict]:
    reply = answer["choices"][0]["message"]
    return [*messages, reply, *({"role": "tool", "tool_call_id": c["id"], "content": "written"}
                                for c in reply.get("tool_calls") or [])] + [{"role": "user", "content": "Go on."}]


def anthropic_body(messages: list[dict]) -> dict:
    return {"model": "m", "max_tokens": 200, "messages": messages,
            "tools": [{"name": "write_file", "input_schema": {"type": "object"}}]}


def anthropic_next(messages: list[dict], answer: dict) -> list[dict]:
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "written"}
               for b in answer["content"] if b["type"] == "tool_use"]
    return [*messages, {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": [*results, {"type": "text", "text": "Go on."}]}]


# (path, body for the messages, the next messages after an answer, the model's two outputs)
CASES = {
    "openai tool call": ("/v1/chat/completions", openai_body, openai_next, ["Writing it." + WRITE, "Done."]),
    "openai stop string": ("/v1/chat/completions", lambda m: openai_body(m, stop=["END"]), openai_next,
                           ["Done. END and then more", WRITE + "END"]),
    "openai malformed arguments": ("/v1/chat/completions", openai_body, openai_next, [MALFORMED, "Done."]),
    "anthropic tool call": ("/v1/messages", anthropic_body, anthropic_next, [WRITE, "Written."]),
}


def node_view(ex: Recorder) -> list[tuple]:
    return [(n.parent, n.kind, n.key, n.tokens.tolist(), n.policy, n.call_id,
             None if n.logprobs is None else n.logprobs.tolist(), None if n.versions is None else n.versions.tolist())
            for n in ex.tree.nodes]


def timeless(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("t_start", "t_end")}


def unnamed(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}  # fresh per response


@pytest.mark.parametrize("case", CASES)
async def test_record_reply_records_what_the_server_records(live, chat_tokenizer, case):
    path, body, follow, outputs = CASES[case]
    live.engine.script = list(outputs)
    served = live.execution()
    mine = Recorder(served.id, "k", chat_tokenizer, served.rule)
    api = APIS["anthropic" if path == "/v1/messages" else "openai"]
    messages = [{"role": "user", "content": "Write a.txt."}]
    async with aiohttp.ClientSession() as s:
        for i, text in enumerate(outputs):
            async with s.post(f"{live.url}{path}", json=body(messages),
                              headers={"Authorization": f"Bearer {served.key}", "x-api-key": served.key}) as r:
                assert r.status == 200
                answer = await r.json()
            record = served.calls[i]
            ids = chat_tokenizer.encode(text) + [live.engine.stop_id]
            req = api.parse_request(body(messages), {})
            # The engine's name and the run's sampling are the backend's and the config's to say.
            result, mine_record = mine.record_reply(req, ids, logprobs=[-0.25] * len(ids), engine=record["engine"],
                                                    sampling=record["sampling"],
                                                    new_call_id=iter(record["tool_calls"]).__next__)
            assert timeless(mine_record) == timeless(record)
            assert unnamed(api.render_result(result, req)) == unnamed(answer)
            messages = follow(messages, answer)
    assert node_view(mine) == node_view(served)
    assert any(c["tool_calls"] for c in mine.calls)  # the cases exercise what they name
    if "stop" in case:
        assert mine.calls[0]["output_tokens"] < len(chat_tokenizer.encode(outputs[0]))
