"""One big prompt must not freeze everyone (issue 36, finding 4): a body that cannot fit the
context is refused before anything tokenizes it, in the provider's overflow shape; a long
prompt is rendered and tokenized off the event loop, so other executions' calls are served
meanwhile. A real ProxyServer on 127.0.0.1 with the scripted engine behind it; the
tokenizer is the tiny model's, counted (and, for the second test, held) where it works."""

from __future__ import annotations

import asyncio
import io
import json
import random
import threading

import aiohttp
import pytest

from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.scripted import ScriptedEngine
from tests.support import ThreadEngineBackend

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
COUNT = "/v1/messages/count_tokens"


class CountingTokenizer(ChatTokenizer):
    """The tiny model's tokenizer, counting the texts it renders and tokenizes; `hold`, when
    set, is called before tokenizing a text of `hold_chars` or more (on whatever thread does it)."""

    encoded = rendered = 0  # (class defaults: the constructor renders and tokenizes probes)
    hold = None
    hold_chars = 3000

    def encode_plain(self, text: str, *, at_start: bool = False) -> list[int]:
        self.encoded += 1
        if self.hold is not None and len(text) >= self.hold_chars:
            self.hold()
        return super().encode_plain(text, at_start=at_start)

    def render(self, *args, **kwargs) -> str:
        self.rendered += 1
        return super().render(*args, **kwargs)


def body_for(path: str, text: str) -> dict:
    if path in (MESSAGES, COUNT):
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        return body if path == COUNT else {**body, "max_tokens": 8}
    if path == RESPONSES:
        return {"model": "m", "input": text, "max_output_tokens": 8}
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}


async def post(url: str, path: str, key: str, body: dict) -> tuple[int, dict]:
    headers = {"x-api-key": key} if path in (MESSAGES, COUNT) else {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s:  # (a large body as a file: aiohttp warns of bytes)
        async with s.post(url + path, data=io.BytesIO(json.dumps(body).encode()),
                          headers={**headers, "Content-Type": "application/json"}) as r:
            return r.status, await r.json()


@pytest.fixture
async def proxy(tiny_dir, tmp_path):
    """(server, url, tokenizer): max_context 4096, the default 32 MiB body limit."""
    tok = CountingTokenizer(tiny_dir)
    engine = ScriptedEngine(tok)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(tok, backend, ProxyConfig(max_context=4096), run_dir=tmp_path / "run")
    url = await server.start()
    yield server, url, tok
    await server.stop()
    backend.close()


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES, COUNT])
async def test_a_body_that_cannot_fit_the_context_is_refused_before_anything_tokenizes_it(proxy, path):
    """2 MiB of text cannot be 4,096 tokens, whatever the tokenizer: refused with the
    provider's context-overflow answer (harnesses compact on it), no text rendered or
    tokenized (the tokenizer's counters did not move), nothing recorded, and it is the
    agent's overflow, not a refusal of gyre's. A body that fits is still served."""
    server, url, tok = proxy
    ex = server.register("big")
    encoded, rendered = tok.encoded, tok.rendered
    status, body = await post(url, path, ex.key, body_for(path, "All work and no play. " * ((2 << 20) // 22)))
    assert status == 400
    assert (tok.encoded, tok.rendered) == (encoded, rendered)
    if path in (MESSAGES, COUNT):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("prompt is too long: ")
    else:
        assert body["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 4096 tokens" in body["error"]["message"]
    assert ex.calls == [] and ex.tree.nodes == []
    assert ex.refusals == 0 and not ex.refused_last
    assert server.fit_bytes < 2 << 20 < server.config.max_body_bytes  # refused by the fit bound, not the limit
    status, _ = await post(url, path, ex.key, body_for(path, "hello " * 100))
    assert status == 200 and tok.encoded > encoded


async def test_a_small_call_is_served_while_a_long_prompt_is_being_tokenized(proxy):
    """The long prompt's tokenizing is held (on whatever thread does it) until a small call
    of another execution has been answered: on the event loop that would be a deadlock
    broken only by the hold's own timeout, so the order of the two answers says where the
    work ran."""
    server, url, tok = proxy
    big, small = server.register("long"), server.register("small")
    order: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        if not release.wait(30):
            order.append("hold timed out: the tokenizer ran on the event loop")

    tok.hold = hold

    async def long_call() -> int:
        status, _ = await post(url, CHAT, big.key, body_for(CHAT, "word " * 700))
        order.append("long")
        return status

    task = asyncio.create_task(long_call())
    assert await asyncio.to_thread(entered.wait, 30)  # the long prompt is being tokenized now
    status, _ = await post(url, MESSAGES, small.key, body_for(MESSAGES, "hi"))
    order.append("small")
    release.set()
    assert await task == 200 and status == 200
    assert order == ["small", "long"]
    assert len(big.calls) == 1 and len(small.calls) == 1


def test_the_fit_bounds_hold_for_any_text(chat_tokenizer):
    """The bounds that refuse a body unread never refuse one that fits: for texts of every
    kind (control characters, quotes, accents, astral emoji, decomposed Hangul, special-token
    text), the text's tokens x max_json_bytes_per_token covers its JSON, escaped as badly as
    JSON allows, and its tokens x max_chars_per_token covers its characters."""
    tok, rng = chat_tokenizer, random.Random(0)
    alphabet = ["\x01", "\n", '"', "\\", "/", "a", " ", "é", "\u1100\u1161\u11a8", "😀", "\u202e", "<|im_start|>",
                "<tool_call>", "ﬀ", "\x7f"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) * rng.randrange(1, 5) for _ in range(rng.randrange(1, 60)))
        n = len(tok.encode_plain(text))
        assert len(json.dumps(text, ensure_ascii=True)) - 2 <= n * tok.max_json_bytes_per_token
        assert len(json.dumps(text, ensure_ascii=False).encode()) - 2 <= n * tok.max_json_bytes_per_token
        assert len(text) <= n * tok.max_chars_per_token


async def test_a_long_text_is_tokenized_with_the_gil_released(chat_tokenizer):
    """Off the loop is not enough: `tokenizers`' plain `encode` holds the GIL throughout, so
    the loop would stall on a prompt thread just the same. While a long text is tokenized
    on a thread, the event loop keeps turning (hundreds of turns seen mid-encode; with the
    GIL held, none or one)."""
    text = "All work and no play makes Jack a dull boy. " * 7000  # 308,000 characters
    state = {"running": False}

    def encode() -> int:
        state["running"] = True
        try:
            return len(chat_tokenizer.encode_plain(text))
        finally:
            state["running"] = False

    job = asyncio.get_running_loop().run_in_executor(None, encode)
    turns = 0
    while not job.done():
        await asyncio.sleep(0)
        turns += state["running"]
    assert await job == 308_000  # (byte tokens)
    assert turns > 100, turns
