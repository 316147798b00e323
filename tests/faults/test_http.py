"""What one client can do to the proxy's connections (issue 26, findings 6 and 8): half-open
connections and slow headers or bodies (slowloris) from raw sockets, a flood past the
connection limit, next to real SDK calls that must keep working; and request bodies with a
wrong, unsupported or lying Content-Encoding, answered 4xx in each API's error shape.
Waits are on a socket closing (with a deadline), never on a sleep.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
import zlib
from contextlib import asynccontextmanager

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from gyre.proxy.records import load_execution
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.scripted import ScriptedEngine
from tests.support import ThreadEngineBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def live_proxy(tok, tmp_path, **config):
    engine = ScriptedEngine(tok)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(tok, backend, ProxyConfig(ping_interval_s=0.2, max_body_bytes=256 * 1024, **config),
                         run_dir=tmp_path / "run")
    await server.start()
    try:
        yield server, engine
    finally:
        await server.stop()
        backend.close()


async def connect(server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def closed_within(reader: asyncio.StreamReader, deadline_s: float) -> bytes:
    """Everything the server sends until it closes the connection (which must happen in time)."""
    return await asyncio.wait_for(reader.read(), deadline_s)


async def sdk_calls(server, ex) -> None:
    """One call through each SDK (fresh connections), both answered."""
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ex.key, max_retries=0) as oa:
        r = await oa.chat.completions.create(**CHAT)
        assert r.choices[0].message.content == "Done."
    async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=ex.key, max_retries=0) as an:
        m = await an.messages.create(**MESSAGES)
        assert m.content[0].text == "Done."


# --- slowloris ---------------------------------------------------------------------------------


async def test_a_connection_that_never_finishes_its_headers_is_closed_after_the_header_timeout(
        chat_tokenizer, tmp_path, caplog):
    """Half a request line and headers, then silence: closed at header_timeout_s (not at
    aiohttp's hour-long keep-alive), logged once for the lot, not per connection."""
    async with live_proxy(chat_tokenizer, tmp_path, header_timeout_s=0.5) as (server, engine):
        socks = [await connect(server) for _ in range(5)]
        t0 = time.monotonic()
        for _, w in socks:
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic")
        with caplog.at_level(logging.WARNING):
            for r, _ in socks:
                assert await closed_within(r, 10) == b""
        assert 0.4 < time.monotonic() - t0 < 10
        assert sum("header_timeout_s" in rec.getMessage() for rec in caplog.records) == 1
        for _, w in socks:
            w.close()


async def test_many_half_open_connections_leave_real_sdk_calls_working_and_are_all_closed(chat_tokenizer, tmp_path):
    """300 connections that never send a whole request (some nothing at all) while the SDKs
    call: every call succeeds; then every half-open connection is closed by the timeout."""
    async with live_proxy(chat_tokenizer, tmp_path, header_timeout_s=2.0, max_connections=1000) as (server, engine):
        ex = server.register("e1")
        socks = [await connect(server) for _ in range(300)]
        for i, (_, w) in enumerate(socks):
            if i % 2:
                w.write(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await sdk_calls(server, ex)
        await sdk_calls(server, ex)
        assert len(ex.calls) == 4
        results = await asyncio.gather(*(closed_within(r, 20) for r, _ in socks))
        assert results == [b""] * 300
        for _, w in socks:
            w.close()
        await sdk_calls(server, ex)


async def test_past_the_connection_limit_new_connections_get_a_503_and_existing_calls_go_on(
        chat_tokenizer, tmp_path, caplog):
    """At max_connections a new connection is answered 503 at once and closed, logged once
    per interval; a stream already running keeps streaming and ends normally; once the idle
    connections go, the SDKs connect again."""
    async with live_proxy(chat_tokenizer, tmp_path, max_connections=20) as (server, engine):
        ex = server.register("e1")
        engine.script = ["a streamed answer " * 5]
        engine.hold = True  # the stream waits for us
        async with aiohttp.ClientSession() as s:
            stream = await s.post(server.base_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                  headers={"Authorization": f"Bearer {ex.key}"})
            assert stream.status == 200
            idle = [await connect(server) for _ in range(19)]  # with the stream's: 20 open
            with caplog.at_level(logging.WARNING):
                refused = []
                for _ in range(5):
                    r, w = await connect(server)
                    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    refused.append(await closed_within(r, 5))
                    w.close()
            assert all(x.startswith(b"HTTP/1.1 503 ") and b"max_connections" in x for x in refused)
            assert sum("max_connections" in rec.getMessage() for rec in caplog.records) == 1
            engine.hold = False
            body = await stream.read()
            assert body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"stop"' in body
            stream.release()
        for _, w in idle:
            w.close()
        for r, _ in idle:
            assert await closed_within(r, 5) == b""
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ex.key, max_retries=5) as oa:
            assert (await oa.chat.completions.create(**CHAT)).choices[0].message.content == "Done."


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_an_answer_cut_while_it_is_sent_is_not_trained_and_the_sdks_retry_continues(
        chat_tokenizer, tmp_path, monkeypatch, sdk):
    """The connection drops as the proxy sends an answer it has recorded ok (a harness's
    socket gone, or the proxy stopping at a restart): the SDK saw no answer and retries. The
    cut call is kept as `undelivered`, its output not trainable, in memory and on file; the
    retry continues from the same prompt, and only its output is trained."""
    sent = web.StreamResponse.write_eof
    cut = []

    async def write_eof(self, data=b""):
        if not cut and self.status == 200 and self._req is not None and self._req.path.startswith("/v1/"):
            cut.append(self._req.path)
            self._req.transport.abort()  # the connection is gone as the answer goes out
        return await sent(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    async with live_proxy(chat_tokenizer, tmp_path) as (server, engine):
        ex = server.register("e1")
        if sdk == "openai":
            async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ex.key, max_retries=2) as oa:
                assert (await oa.chat.completions.create(**CHAT)).choices[0].message.content == "Done."
        else:
            async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=ex.key, max_retries=2) as an:
                assert (await an.messages.create(**MESSAGES)).content[0].text == "Done."
        assert len(cut) == 1 and len(engine.prompts) == 2  # cut once, generated again for the retry
        load = load_execution(tmp_path / "run" / "executions" / "e1")
        for calls, tree in ((ex.calls, ex.tree), (load.calls, load.tree)):  # in memory, and on file
            assert [c["status"] for c in calls] == ["undelivered", "ok"], calls
            assert calls[0]["prompt_node"] == calls[1]["prompt_node"] and len(tree.roots) == 1
            assert [tree.nodes[c["output_node"]].policy for c in calls] == [False, True]
        trajectories, _ = load.admit()
        assert [t.targets for t in trajectories] == [frozenset({load.calls[1]["output_node"]})]


async def test_a_slow_body_is_a_408_in_the_api_shape_and_its_connection_is_closed(chat_tokenizer, tmp_path):
    """Whole headers, then a tenth of the body and silence: 408 in the API's shape within
    body_timeout_s, and the connection ends."""
    async with live_proxy(chat_tokenizer, tmp_path, body_timeout_s=0.5, header_timeout_s=30) as (server, engine):
        ex = server.register("e1")
        for path, key_header in (("/v1/messages", "x-api-key"), ("/v1/chat/completions", "Authorization")):
            r, w = await connect(server)
            key = ex.key if key_header == "x-api-key" else f"Bearer {ex.key}"
            w.write(f"POST {path} HTTP/1.1\r\nHost: x\r\n{key_header}: {key}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: 1000\r\n\r\n".encode() + b'{"model": "m", "messages": [')
            t0 = time.monotonic()
            reply = await closed_within(r, 30)  # 408, then the lingering read ends the connection
            assert 0.4 < time.monotonic() - t0 < 30
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ")
            err = json.loads(body)
            if path == "/v1/messages":
                assert err["type"] == "error" and err["error"]["type"] == "timeout_error"
            else:
                assert err["error"]["type"] == "invalid_request_error"
            assert "body_timeout_s" in (err["error"]["message"])
            w.close()
        assert ex.calls == [] and engine.prompts == []


async def test_a_stream_longer_than_every_timeout_is_not_cut_while_a_silent_connection_is(chat_tokenizer, tmp_path):
    """A harness call that streams past every connection timeout (the engine silent longer
    than each: keep-alives flow) ends normally, through both SDKs, while a connection opened
    beside it that sends nothing is closed at the header timeout."""
    async with live_proxy(chat_tokenizer, tmp_path, header_timeout_s=0.3, body_timeout_s=0.3,
                          keepalive_timeout_s=0.3) as (server, engine):
        ex = server.register("e1")
        engine.script = ["the long answer", "the long answer"]
        engine.stalls = {3: 1.5}  # the engine goes silent 1.5 s after 3 tokens: 5x each timeout

        async def anthropic_stream() -> str:
            async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key=ex.key, max_retries=0) as an:
                async with an.messages.stream(**MESSAGES) as s:
                    return "".join([t async for t in s.text_stream])

        call = asyncio.ensure_future(anthropic_stream())
        r, w = await connect(server)
        assert await closed_within(r, 10) == b""
        w.close()
        assert not call.done()  # still streaming (the engine is silent)
        assert await call == "the long answer"
        engine.stalls = {3: 1.5}
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ex.key, max_retries=0) as oa:
            parts = [c async for c in await oa.chat.completions.create(**CHAT, stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == "the long answer"
        assert [c["status"] for c in ex.calls] == ["ok", "ok"]


# --- Content-Encoding --------------------------------------------------------------------------

BODY = json.dumps(CHAT).encode()
BAD_ENCODINGS = [  # (Content-Encoding, body, status, words in the message)
    ("gzip", BODY, 400, "not valid gzip"),
    ("deflate", b"\x00\x01garbage", 400, "not valid deflate"),
    ("gzip", gzip.compress(BODY)[:-12], 400, "cut short"),
    ("br", BODY, 415, "unsupported Content-Encoding 'br'"),
    ("zstd", BODY, 415, "unsupported Content-Encoding"),
    ("foo", BODY, 415, "unsupported Content-Encoding 'foo'"),
    ("gzip, compress", gzip.compress(BODY), 415, "unsupported Content-Encoding"),
    ("gzip", gzip.compress(b'{"x": "' + b"a" * 2_000_000 + b'"}'), 413, "once decoded"),  # 2 KB -> 2 MB
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("encoding, body, status, words", BAD_ENCODINGS,
                         ids=[f"{e}-{s}-{i}" for i, (e, _, s, _) in enumerate(BAD_ENCODINGS)])
async def test_a_body_the_proxy_cannot_decode_is_a_4xx_in_the_api_shape(
        chat_tokenizer, tmp_path, caplog, path, encoding, body, status, words):
    """Never a 500 nor a plain-text answer: the status names the problem (400 undecodable,
    415 unsupported, 413 past the limit once inflated) in the API's error shape, nothing is
    logged as an error, and a well-encoded body is served right after."""
    async with live_proxy(chat_tokenizer, tmp_path) as (server, engine):
        ex = server.register("e1")
        headers = {"Authorization": f"Bearer {ex.key}", "x-api-key": ex.key, "Content-Type": "application/json"}
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            with caplog.at_level(logging.WARNING):
                async with s.post(server.base_url + path, data=body,
                                  headers={**headers, "Content-Encoding": encoding}) as r:
                    assert r.status == status and r.content_type == "application/json"
                    err = await r.json()
            assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
            if path.startswith("/v1/messages"):
                assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error",
                                                                           "request_too_large")
            else:
                assert err["error"]["type"] == "invalid_request_error"
            assert words in err["error"]["message"]
            good = json.dumps(MESSAGES if path.startswith("/v1/messages") else
                              {"model": "m", "input": "hi"} if path == "/v1/responses" else CHAT).encode()
            for enc, data in (("gzip", gzip.compress(good)), ("deflate", zlib.compress(good)),
                              ("identity", good)):
                async with s.post(server.base_url + path, data=data, headers={**headers, "Content-Encoding": enc}) as r:
                    assert r.status == 200, await r.text()
        assert ex.calls == [] or all(c["status"] == "ok" for c in ex.calls)
