"""TITO on a real model through the real SDKs: multi-turn conversations with SmolLM2 on the
CPU engine, driven by the `openai` and `anthropic` clients. Call k+1's prompt is call k's
prompt plus its output, verbatim; a conversation sent whole (no recorded outputs) is
tokenised exactly as transformers' apply_chat_template tokenises it; and a Hermes tool call,
several tokens in this vocabulary, comes back as a tool call."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.scripted import ScriptedEngine, tool_call
from tests.support import ThreadEngineBackend

TURNS = ["Name a colour.", "Name a fruit of that colour.", "Say it in French.", "Thanks. One word: which season?",
         "Why that one?", "Write it in capitals.", "Now count to three.", "Goodbye."]
SYSTEM = "You are brief."


@pytest.fixture
async def proxy(smol_tok, smol_model, tmp_path):
    from gyre.workerd.engines.base import SamplingParams
    from gyre.workerd.engines.cpu import CpuEngine

    backend = ThreadEngineBackend(CpuEngine(smol_model, seed=1), sampling_cls=SamplingParams)
    server = ProxyServer(smol_tok, backend, ProxyConfig(max_context=8192, default_max_tokens=20), run_dir=tmp_path)
    await server.start()
    yield server
    await server.stop()
    backend.close()


def assert_extends(ex) -> int:
    """Each call's prompt starts with the previous call's prompt + output, verbatim."""
    tree = ex.tree
    for a, b in zip(ex.calls, ex.calls[1:]):
        before = tree.tokens(ex.prompt_path(a)) + tree.nodes[a["output_node"]].tokens.tolist()
        assert tree.tokens(ex.prompt_path(b))[:len(before)] == before
    return len(ex.calls) - 1


def hf_prompt(smollm2_dir, messages: list[dict]) -> list[int]:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def plain_text(texts: list[str]) -> bool:
    return not any("<|" in t or "<tool" in t for t in texts)


async def test_openai_multi_turn_tito(proxy, smollm2_dir, capsys):
    ex = proxy.register("openai")
    messages = [{"role": "system", "content": SYSTEM}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=ex.key, max_retries=0) as client:
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            r = await client.chat.completions.create(model="smollm2", messages=messages)
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        checked = assert_extends(ex)
        # The same conversation sent whole by a new client: no recorded outputs to splice, so
        # every token is the template's and the text's, as transformers makes them.
        whole = proxy.register("openai-whole")
        async with openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=whole.key, max_retries=0) as c2:
            await c2.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    (call,) = whole.calls
    if plain_text([m["content"] for m in messages]):
        assert whole.tree.tokens(whole.prompt_path(call)) == hf_prompt(smollm2_dir, messages)
    with capsys.disabled():
        print(f"\nSmolLM2 TITO (openai): {checked} of {checked} prompt extensions exact over {len(ex.calls)} calls")


async def test_anthropic_multi_turn_tito_streaming(proxy, smollm2_dir, capsys):
    ex = proxy.register("anthropic")
    messages: list[dict] = []
    async with anthropic.AsyncAnthropic(base_url=proxy.base_url, api_key=ex.key, max_retries=0) as client:
        for turn in TURNS:
            messages.append({"role": "user", "content": [{"type": "text", "text": turn}]})
            async with client.messages.stream(model="smollm2", system=SYSTEM, max_tokens=20,
                                              messages=messages) as stream:
                final = await stream.get_final_message()
            text = "".join(b.text for b in final.content if b.type == "text")
            messages.append({"role": "assistant", "content": text or "..."})
    checked = assert_extends(ex)
    flat = [{"role": "system", "content": SYSTEM}] + [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
        for m in messages]
    whole = proxy.register("anthropic-whole")
    async with anthropic.AsyncAnthropic(base_url=proxy.base_url, api_key=whole.key, max_retries=0) as c2:
        await c2.messages.create(model="smollm2", system=SYSTEM, max_tokens=1,
                                 messages=messages + [{"role": "user", "content": "bye"}])
    (call,) = whole.calls
    if plain_text([m["content"] for m in flat]):
        assert whole.tree.tokens(whole.prompt_path(call)) == hf_prompt(smollm2_dir, flat + [{"role": "user",
                                                                                           "content": "bye"}])
    with capsys.disabled():
        print(f"\nSmolLM2 TITO (anthropic, streamed): {checked} of {checked} prompt extensions exact over "
              f"{len(ex.calls)} calls")


async def test_a_hermes_tool_call_in_text_tokens_is_a_tool_call(smol_tok, tmp_path):
    """`<tool_call>` is five tokens in SmolLM2's vocabulary: the parser finds it in the text."""
    script = [tool_call("write_file", path="a.txt", content="héllo\n"), "done"]
    engine = ScriptedEngine(smol_tok, script=script)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(smol_tok, backend, ProxyConfig(max_context=8192), run_dir=tmp_path)
    await server.start()
    try:
        ex = server.register("tools")
        tools = [{"type": "function", "function": {"name": "write_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=ex.key, max_retries=0) as client:
            msgs = [{"role": "user", "content": "write it"}]
            r = await client.chat.completions.create(model="m", messages=msgs, tools=tools)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "write_file"
            assert json.loads(call.function.arguments) == {"path": "a.txt", "content": "héllo\n"}
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "written"}]
            await client.chat.completions.create(model="m", messages=msgs, tools=tools)
        assert assert_extends(ex) == 1 and ex.calls[0]["invalid_tool_calls"] == 0
        assert len(smol_tok.encode("<tool_call>")) > 1
    finally:
        await server.stop()
        backend.close()
