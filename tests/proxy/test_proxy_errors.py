"""Bad input and bad luck: malformed JSON, wrong keys, oversize bodies, invalid tool JSON
from the model, a client that leaves mid-stream, concurrent calls of one execution."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def post(live, path, *, key, body=None, raw=None, headers=None):
    h = {"Authorization": f"Bearer {key}", **(headers or {})}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{live.url}{path}", json=body if raw is None else None, data=raw, headers=h) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                                         ("/v1/responses", "openai")])
async def test_unknown_key_is_401_in_the_provider_shape_and_records_nothing(live, path, shape):
    ex = live.execution()
    status, body = await post(live, path, key="gyre-not-a-key", body=CHAT)
    assert status == 401
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["type"] == "authentication_error"
    assert ex.calls == [] and ex.tree.nodes == [] and live.engine.prompts == []


async def test_a_stale_key_is_401_and_records_nothing(live):
    """An execution's key stops working when it ends (revoked), and a key of one execution
    never records into another."""
    old, other = live.execution("old"), live.execution("other")
    status, _ = await post(live, "/v1/chat/completions", key=old.key, body=CHAT)
    assert status == 200 and len(old.calls) == 1
    live.server.revoke("old")
    n_nodes, n_prompts = len(old.tree.nodes), len(live.engine.prompts)
    status, body = await post(live, "/v1/chat/completions", key=old.key, body=CHAT)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert len(old.calls) == 1 and len(old.tree.nodes) == n_nodes and len(live.engine.prompts) == n_prompts
    assert other.calls == [] and other.tree.nodes == []


@pytest.mark.parametrize("kwargs, status, needle", [
    (dict(raw=b"{not json"), 400, "malformed JSON"),
    (dict(body={"model": "m"}), 400, "messages"),
    (dict(body={"model": "m", "messages": "hi"}), 400, "messages"),
    (dict(body={"model": "m", "messages": [{"role": "user", "content": 5}]}), 400, "messages[0].content"),
    (dict(body={"model": "m", "messages": [{"role": "wizard", "content": "x"}]}), 400, "messages[0].role"),
    (dict(body={**CHAT, "max_tokens": "many"}), 400, "max_tokens"),
    (dict(body={**CHAT, "n": 2}), 400, "n"),
    (dict(raw=b"{" + b'"x": "' + b"a" * 300_000 + b'"}'), 413, "limit"),
])
async def test_bad_requests_are_4xx_naming_the_problem_and_touch_no_record(live, kwargs, status, needle):
    ex = live.execution()
    got, body = await post(live, "/v1/chat/completions", key=ex.key, **kwargs)
    assert got == status and needle in body["error"]["message"]
    assert ex.calls == [] and ex.tree.nodes == [] and live.engine.prompts == []


async def test_invalid_tool_json_from_the_model_is_recorded_as_invalid(live, clients):
    """A call whose name is known streams as a call (its start may have gone out already), so
    malformed arguments stay the model's text inside the call; a body that never names a
    function is text. Both count as invalid in the record."""
    ex = live.execution()
    live.engine.script = ['<tool_call>\n{"name": "write_file", "arguments": {broken\n</tool_call>',
                          '<tool_call>\nnot a call at all\n</tool_call>']
    client = clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=ex.key, max_retries=0)
    r = await client.chat.completions.create(**CHAT)
    (tc,) = r.choices[0].message.tool_calls
    assert (tc.function.name, tc.function.arguments.strip()) == ("write_file", "{broken")
    assert r.choices[0].finish_reason == "tool_calls"
    r = await client.chat.completions.create(**CHAT)
    m = r.choices[0].message
    assert m.tool_calls is None and "<tool_call>" in m.content and "not a call" in m.content
    assert r.choices[0].finish_reason == "stop"
    assert [(c["status"], c["invalid_tool_calls"]) for c in ex.calls] == [("ok", 1), ("ok", 1)]
    assert all(ex.tree.nodes[c["output_node"]].policy for c in ex.calls)  # still trainable


async def test_client_disconnect_mid_stream_keeps_the_record_marked(live):
    ex = live.execution()
    recorded = asyncio.Event()
    live.server.on_record = lambda ex, record: recorded.set()
    live.engine.hold = True  # the output never completes: the client has to leave
    live.engine.script = ["a long answer that never ends " * 3]
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{live.url}/v1/chat/completions", json={**CHAT, "stream": True},
                            headers={"Authorization": f"Bearer {ex.key}"})
        assert resp.status == 200
        # The opening event goes out before any token: read on until text has arrived.
        while b'"content":"a' not in await resp.content.readuntil(b"\n\n"):
            pass
        resp.close()  # the client leaves, a token or more into the answer
    await asyncio.wait_for(recorded.wait(), 30)
    (call,) = ex.calls
    assert call["status"] == "disconnected" and call["output_tokens"] > 0
    assert not ex.tree.nodes[call["output_node"]].policy  # kept, marked, never trained
    assert await asyncio.to_thread(live.engine.abort_seen.wait, 30)  # generation aborted upstream
    assert live.engine.aborted == [call["call_id"]] and live.engine.running == 0


async def test_concurrent_calls_of_one_execution(live, clients):
    ex = live.execution()
    live.engine.script = lambda prompt: "answer for " + prompt[-30:-23]
    client = clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=ex.key, max_retries=0)
    prompts = [f"question {i}" for i in range(8)]
    results = await asyncio.gather(*(client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": p}]) for p in prompts))
    assert len(ex.calls) == 8 and all(c["status"] == "ok" for c in ex.calls)
    assert all(r.choices[0].message.content.startswith("answer for ") for r in results)
    # One shared system node, eight branches, eight policy leaves.
    assert len(ex.tree.roots) == 1
    assert sum(1 for n in ex.tree.nodes if n.kind == "output") == 8
    assert sorted(ex.leaf_roles.values()) == ["main"] * 8


async def test_injected_overload_is_retried_by_the_sdk(live, clients):
    ex = live.execution()
    live.server.inject_errors.append((529, {"retry-after": "0"}))
    import anthropic

    client = clients(anthropic.AsyncAnthropic, base_url=live.url, api_key=ex.key, max_retries=2)
    r = await client.messages.create(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert r.content[0].text == "Done." and len(ex.calls) == 1


async def test_prompt_over_the_context_is_400_and_adds_no_node(live):
    ex = live.execution()
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 40_000}]}  # 40k byte tokens > 32768
    status, body = await post(live, "/v1/chat/completions", key=ex.key, body=big)
    assert status == 400 and "context" in body["error"]["message"]
    assert ex.calls == [] and ex.tree.nodes == [] and live.engine.prompts == []
