"""A Recorder rebuilt from an execution's folder (Recorder.resumed, issue 34): after a
coordinator restart the harness's next call extends the same tree as it would have without
the restart. Two interleaved conversations with tool calls, text replies, a retried call and
a sub-agent delegation are recorded by one live Recorder; its folder is copied after every
call, and from each copy a resumed Recorder prepares the next call: the same path (node for
node), the same prompt tokens, the same role, no new root. The resumed one then records
that call, and its folder loads as one tree with every call once."""

from __future__ import annotations

import json
import shutil

from gyre.proxy.recorder import Recorder
from gyre.proxy.records import load_execution
from gyre.proxy.roles import ClaudeCodeRule
from gyre.proxy.types import ChatRequest, Message, ToolSpec
from tests.scripted import tool_call

AGENT = ToolSpec(name="Task", description="Delegate", parameters={"type": "object"})
READ = ToolSpec(name="read_file", description="Read", parameters={"type": "object"})


def conversation(tok):
    """(request, reply tokens) in order, each request built from the answers before it."""
    main = [Message("system", "You are the main agent."), Message("user", "Fix the bug.")]
    sub: list[Message] = []
    steps = [("main", tool_call("read_file", path="a.py")), ("main", tool_call("Task", prompt="Find the bug in a.py",
                                                                               description="find")),
             ("sub", tool_call("read_file", path="a.py")), ("sub", "The bug is on line 3."),
             ("main", "Fixed it."), ("main", "Fixed it.")]  # the last: a retry of the same request
    answers = {}
    for i, (who, reply) in enumerate(steps):
        if who == "sub" and not sub:
            sub[:] = [Message("system", "You are a sub-agent."), Message("user", "Find the bug in a.py")]
        msgs = main if who == "main" else sub
        tools = [READ, AGENT] if who == "main" else [READ]
        req = ChatRequest(api="openai", model="m", messages=list(msgs), tools=tools)
        result = yield req, tok.encode(reply) + tok.encode("<|im_end|>")
        answers[i] = result
        if i == len(steps) - 2:
            continue  # the harness did not get this answer (the crash): it sends the same request again
        msgs.append(Message("assistant", result.content, list(result.tool_calls)))
        if result.tool_calls:
            call = result.tool_calls[0]
            out = "line 3: x = 1/0" if call.name == "read_file" else (answers.get(3).content if 3 in answers else "")
            if call.name == "Task":
                out = "pending"
            msgs.append(Message("tool", out, tool_call_id=call.id))
        else:
            msgs.append(Message("user", "Go on."))


def test_a_resumed_recorder_prepares_every_next_call_as_the_live_one_did(tmp_path, chat_tokenizer):
    tok = chat_tokenizer
    live = Recorder("x", "k", tok, ClaudeCodeRule(), dir=tmp_path / "live")
    gen = conversation(tok)
    req, reply = next(gen)
    copies, preps = [], []
    while True:
        prep = live.prepare(req, {})
        preps.append((req, prep))
        result, _ = live.record_reply(req, reply, prep=prep)
        copies.append(tmp_path / f"at-{len(copies) + 1}")
        shutil.copytree(tmp_path / "live", copies[-1])  # the folder as a crash after this call leaves it
        try:
            req, reply = gen.send(result)
        except StopIteration:
            break
    assert len(preps) == 6 and len(live.tree.roots) == 2  # main and sub-agent: two contexts
    assert preps[2][1].delegated_by == preps[1][1].call_id  # the sub-agent, delegated by the Task call
    assert preps[5][1].path == preps[4][1].path  # the retry: the same prompt
    for k, folder in enumerate(copies[:-1], start=1):
        resumed = Recorder.resumed("x", "k", tok, ClaudeCodeRule(), folder)
        assert len(resumed.calls) == k
        req, want = preps[k]
        got = resumed.prepare(req, {})
        assert got.path == want.path, (k, got.path, want.path)  # node for node: no new root, no copy
        assert got.prompt_ids.tolist() == want.prompt_ids.tolist()
        assert (got.role, got.delegated_by) == (want.role, want.delegated_by), k
        resumed.record_reply(req, tok.encode("ok<|im_end|>"), prep=got)
        resumed.close()
        loaded = load_execution(folder)
        assert len(loaded.calls) == k + 1 and len(loaded.tree.roots) == len({p.path[0] for _, p in preps[:k + 1]})
        assert len({c["call_id"] for c in loaded.calls}) == k + 1  # every call once


def test_the_first_calls_model_and_tools_classify_after_a_resume_as_before(tmp_path, chat_tokenizer):
    """A call record says whether its request had tools: the generic rule's first-root test."""
    tok = chat_tokenizer
    live = Recorder("x", "k", tok, ClaudeCodeRule(), dir=tmp_path / "x")
    req = ChatRequest(api="openai", model="big", messages=[Message("user", "hi")], tools=[READ])
    live.record_reply(req, tok.encode("hello<|im_end|>"))
    (line,) = [json.loads(x) for x in (tmp_path / "x" / "calls.jsonl").read_text().splitlines()]
    assert line["has_tools"] is True
    resumed = Recorder.resumed("x", "k", tok, ClaudeCodeRule(), tmp_path / "x")
    assert (resumed._first_model, resumed._first_root_tools) == (live._first_model, live._first_root_tools)


async def test_the_proxy_takes_a_resumed_execution_under_its_old_key(tmp_path, chat_tokenizer):
    """After a restart the harness still holds its key: the new proxy answers it, and the
    call lands in the same tree."""
    import aiohttp

    from gyre.proxy.server import ProxyConfig, ProxyServer
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    key = None
    for life in range(2):
        engine = ScriptedEngine(chat_tokenizer, script=["Done."] * 4)
        backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
        server = ProxyServer(chat_tokenizer, backend, ProxyConfig(max_context=4096), run_dir=tmp_path / "run")
        url = await server.start()
        try:
            ex = server.register("e1", resume_key=key)  # the first life: a new execution
            key = ex.key
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/chat/completions", json=body,
                                        headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200, await r.text()
            assert len(ex.calls) == life + 1
        finally:
            await server.stop()  # its records stay on file, as a crash leaves them
            backend.close()
    loaded = load_execution(tmp_path / "run" / "executions" / "e1")
    assert len(loaded.calls) == 2 and len(loaded.tree.roots) == 1  # one context, both calls
