"""Streams as slow engines and long contexts make them: headers and the opening events at
once, keep-alives each harness honours while the model is silent, errors after the start
in each API's own shape, overflow in each provider's own words, and records whose finish
reason is what ended the call."""

from __future__ import annotations

import json
import threading

import aiohttp
import anthropic
import openai
import pytest

from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.proxy.types import Message

BODIES = {
    "/v1/chat/completions": {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {"model": "m", "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "stream": True, "input": "hi"},
}
FIRST = {"/v1/chat/completions": "chat.completion.chunk", "/v1/messages": "message_start",
         "/v1/responses": "response.created"}


async def read_events(resp, n: int) -> list[tuple[str | None, dict | None]]:
    """The next `n` SSE blocks: (event name, data) or (None, None) for a comment."""
    out, buf = [], b""
    while len(out) < n:
        buf += await resp.content.readany()
        while b"\n\n" in buf and len(out) < n:
            block, buf = buf.split(b"\n\n", 1)
            lines = block.decode().splitlines()
            name = next((x[7:] for x in lines if x.startswith("event: ")), None)
            data = next((x[6:] for x in lines if x.startswith("data: ")), None)
            out.append((name, json.loads(data) if data and data != "[DONE]" else None))
    return out


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_a_silent_engine_gets_headers_at_once_then_keep_alives(live, path):
    live.engine.gate = threading.Event()  # no token until released
    ex = live.execution()
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{live.url}{path}", json=BODIES[path], headers={"Authorization": f"Bearer {ex.key}",
                                                                          "x-api-key": ex.key}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            (name, data), *rest = await read_events(r, 4)  # before any token: the start and keep-alives
            assert (data or {}).get("object", name) == FIRST[path] or name == FIRST[path]
            if path == "/v1/responses":  # Codex: real events with data, never comments
                assert [d["type"] for _, d in rest][-2:] == ["response.in_progress"] * 2
            elif path == "/v1/messages":
                assert [n for n, _ in rest][-2:] == ["ping", "ping"]
            live.engine.gate.set()
            await r.read()
    assert ex.calls and ex.calls[0]["status"] == "ok" and ex.calls[0]["output_tokens"] > 0


@pytest.mark.parametrize("api", ["anthropic", "openai", "responses"])
async def test_an_overflow_is_answered_in_the_providers_own_words(chat_tokenizer, tmp_path, api):
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    backend = ThreadEngineBackend(ScriptedEngine(chat_tokenizer), sampling_cls=lambda **kw: kw)
    server = ProxyServer(chat_tokenizer, backend, ProxyConfig(max_context=300), run_dir=tmp_path)
    await server.start()
    ex = server.register("e")
    long = "word " * 200  # ~1000 byte tokens
    try:
        if api == "anthropic":
            async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=ex.key, max_retries=0) as client:
                with pytest.raises(anthropic.BadRequestError) as e:
                    await client.messages.create(model="m", max_tokens=10,
                                                 messages=[{"role": "user", "content": long}])
            err = e.value.body["error"]
            assert err["type"] == "invalid_request_error"
            n = len(chat_tokenizer.prompt_ids([Message("user", long)], []))
            assert err["message"] == f"prompt is too long: {n} tokens > 299 maximum"
        else:
            async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=ex.key, max_retries=0) as client:
                with pytest.raises(openai.BadRequestError) as e:
                    if api == "openai":
                        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": long}])
                    else:
                        await client.responses.create(model="m", input=long)
            assert e.value.code == "context_length_exceeded" and "maximum context length is 300 tokens" in str(e.value)
        assert ex.calls == [] and ex.tree.nodes == []  # refused before anything was recorded
    finally:
        await server.stop()
        backend.close()


async def test_an_engine_refusal_after_the_stream_started_is_an_error_event_not_a_500(live, clients):
    live.engine.refuse = "forbidden"
    ex = live.execution()
    oa = clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=ex.key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="the engine refused the request"):
        await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "forbidden"}])
    stream = await oa.chat.completions.create(model="m", stream=True,
                                              messages=[{"role": "user", "content": "forbidden"}])
    with pytest.raises(openai.APIError, match="the engine refused the request"):
        async for _ in stream:
            pass
    events = [e async for e in await oa.responses.create(model="m", stream=True, input="forbidden")]
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "invalid_prompt"
    an = clients(anthropic.AsyncAnthropic, base_url=live.url, api_key=ex.key, max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="the engine refused the request"):
        async with an.messages.stream(model="m", max_tokens=20,
                                      messages=[{"role": "user", "content": "forbidden"}]) as s:
            await s.get_final_message()
    assert [c["status"] for c in ex.calls] == ["error"] * 4
    assert {c["finish_reason"] for c in ex.calls} == {"error"}


async def test_finish_reasons_in_records_are_what_ended_the_call(live, clients):
    from tests.scripted import tool_call

    live.engine.script = [tool_call("write_file", path="a"), "plain answer"]
    ex = live.execution()
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
    oa = clients(openai.AsyncOpenAI, base_url=f"{live.url}/v1", api_key=ex.key, max_retries=0)
    r1 = await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], tools=tools)
    r2 = await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}], tools=tools)
    assert (r1.choices[0].finish_reason, r2.choices[0].finish_reason) == ("tool_calls", "stop")
    assert [c["finish_reason"] for c in ex.calls] == ["tool_calls", "stop"]
