"""The demo harness as a real subprocess against a real HTTP server speaking Chat Completions.

The server (FakeProxy) answers from per-role scripts (main agent, sub-agent, summary) and records
every request body, so the tests read exactly what the harness sent through the openai SDK.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gyre.coordinator import demo_harness as dh

TASK = "Write hello.txt containing hi."


def text(content):
    return {"role": "assistant", "content": content}


def calls(*triples, content=None):
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in triples]}


class FakeProxy:
    """POST /v1/chat/completions, non-streaming; the reply is picked by who is asking."""

    def __init__(self, main=(), sub=(), summary=(), status=200):
        self.scripts = {"main": list(main), "sub": list(sub), "summary": list(summary)}
        self.status = status
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = proxy.answer(self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("retry-after-ms", "1")  # keeps the SDK's retries fast
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def answer(self, path, body):
        with self.lock:
            self.requests.append(body)
            if self.status != 200:
                return self.status, {"error": {"message": "engine exploded", "type": "server_error"}}
            if path != "/v1/chat/completions":
                return 404, {"error": {"message": f"no route {path}"}}
            script = self.scripts[role_of(body)]
            message = script.pop(0) if script else text("done")
        return 200, {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                     "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

    def of(self, role):
        return [r for r in self.requests if role_of(r) == role]


def role_of(body):
    messages = body["messages"]
    if messages[0]["content"] == dh.SUB_SYSTEM:
        return "sub"
    last = messages[-1]
    if last["role"] == "user" and last["content"].startswith("Summarize the conversation so far"):
        return "summary"
    return "main"


@pytest.fixture
def proxies():
    started = []

    def start(**kwargs):
        started.append(FakeProxy(**kwargs))
        return started[-1]

    yield start
    for p in started:
        p.close()


@pytest.fixture
def ws(tmp_path):
    path = tmp_path / "ws"
    path.mkdir()
    return path


def harness(url, ws, *args, task=TASK, timeout=60):
    env = {k: v for k, v in os.environ.items()
           if "proxy" not in k.lower() and k not in ("GYRE_TASK", "OPENAI_BASE_URL", "OPENAI_API_KEY")}
    env.update(OPENAI_BASE_URL=url, OPENAI_API_KEY="k")
    cmd = [sys.executable, "-m", "gyre.coordinator.demo_harness", "--workspace", str(ws), *args]
    if task is not None:
        cmd += ["--task", task]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def stats(proc):
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def assert_well_formed(body):
    """Every assistant tool call is answered, in order, by a tool message with its id."""
    messages = body["messages"]
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            ids = [tc["id"] for tc in m["tool_calls"]]
            results = messages[i + 1:i + 1 + len(ids)]
            assert [(r["role"], r["tool_call_id"]) for r in results] == [("tool", x) for x in ids]


def tool_results(body):
    return {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}


# --- the main loop ---------------------------------------------------------------------------


def test_tool_calls_round_trip_verbatim(proxies, ws):
    args_w = '{"path": "notes/hello.txt",   "content": "hi"}'  # odd spacing must survive
    args_r = '{"path":"notes/hello.txt"}'
    p = proxies(main=[calls(("call_W1", "write_file", args_w), ("call_R1", "read_file", args_r), content="ok"),
                      text("all done")])
    s = stats(harness(p.url, ws))
    assert s == {"turns": 2, "tool_calls": 2, "compactions": 0, "subagents": 0, "answer_chars": 8}
    assert (ws / "notes/hello.txt").read_text() == "hi"
    assert (ws / "answer.txt").read_text() == "all done"
    first, second = p.requests
    assert first["messages"] == [{"role": "system", "content": dh.MAIN_SYSTEM}, {"role": "user", "content": TASK}]
    assert {t["function"]["name"] for t in first["tools"]} == {"write_file", "read_file", "list_files", "delegate"}
    assert "max_tokens" not in first and first["temperature"] == 1.0  # the proxy's limit applies
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == calls(("call_W1", "write_file", args_w), ("call_R1", "read_file", args_r),
                                          content="ok")
    assert second["messages"][3]["content"].startswith("wrote 2 bytes")
    assert second["messages"][4] == {"role": "tool", "tool_call_id": "call_R1", "content": "hi"}
    assert_well_formed(second)


def test_garbage_and_escapes_become_error_results(proxies, ws, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws / "link").symlink_to(outside)
    bad = [("c1", "write_file", "{not json"),
           ("c2", "write_file", '{"path": "../x", "content": "pwn"}'),
           ("c3", "read_file", '{"path": "/etc/passwd"}'),
           ("c4", "write_file", '{"path": "link/f.txt", "content": "pwn"}'),
           ("c5", "read_file", "{}"),
           ("c6", "rm_rf", "{}"),
           ("c7", "list_files", "[1, 2]"),
           ("c8", "write_file", '{"path": "big.txt", "content": "%s"}' % ("a" * (dh.MAX_FILE_BYTES + 1)))]
    p = proxies(main=[calls(*bad), text("\x00<|im_end|>\ufffd garbage )]}")])
    s = stats(harness(p.url, ws))
    assert s["turns"] == 2 and s["tool_calls"] == len(bad)
    results = tool_results(p.requests[1])
    assert list(results) == [c[0] for c in bad]
    assert all(r.startswith("error: ") for r in results.values()), results
    assert "not valid JSON" in results["c1"] and "escapes" in results["c2"] and "relative" in results["c3"]
    assert "escapes" in results["c4"] and "missing argument(s): path" in results["c5"]
    assert "unknown tool" in results["c6"] and "JSON object" in results["c7"] and "limit" in results["c8"]
    assert not (tmp_path / "x").exists() and not (outside / "f.txt").exists() and not (ws / "big.txt").exists()
    assert (ws / "answer.txt").read_text() == "\x00<|im_end|>\ufffd garbage )]}"


def test_empty_answer_still_writes_answer_file(proxies, ws):
    p = proxies(main=[text(None)])
    s = stats(harness(p.url, ws))
    assert s == {"turns": 1, "tool_calls": 0, "compactions": 0, "subagents": 0, "answer_chars": 0}
    assert (ws / "answer.txt").read_text() == ""


def test_model_blocking_answer_file_is_survived(proxies, ws):
    p = proxies(main=[calls(("c1", "write_file", '{"path": "answer.txt/x", "content": "y"}')), text("done")])
    proc = harness(p.url, ws)
    assert stats(proc)["turns"] == 2 and "cannot write answer.txt" in proc.stderr


def test_turns_are_bounded(proxies, ws):
    p = proxies(main=[calls((f"call_{i}", "list_files", "")) for i in range(10)])
    s = stats(harness(p.url, ws, "--max-turns", "3", "--max-tokens", "7"))
    assert s["turns"] == 3 and s["tool_calls"] == 3
    assert len(p.requests) == 3 and all(r["max_tokens"] == 7 for r in p.requests)
    assert tool_results(p.requests[2]) == {"call_0": "(empty)", "call_1": "(empty)"}


# --- compaction ------------------------------------------------------------------------------


def test_forced_compaction_starts_a_new_history(proxies, ws):
    p = proxies(main=[calls(("call_1", "write_file", '{"path": "a.txt", "content": "x"}')), text("done")],
                summary=[text("SUMMARY TEXT")])
    s = stats(harness(p.url, ws, "--force-compaction"))
    assert s["compactions"] == 1 and s["turns"] == 2
    first, summary, after = p.requests
    assert role_of(summary) == "summary" and summary["tools"] == first["tools"]
    assert summary["messages"][:-1] == first["messages"] + [
        calls(("call_1", "write_file", '{"path": "a.txt", "content": "x"}')),
        {"role": "tool", "tool_call_id": "call_1", "content": "wrote 1 bytes to a.txt"}]
    assert after["messages"][0] == first["messages"][0]
    assert len(after["messages"]) == 2 and after["messages"][1]["role"] == "user"
    continued = after["messages"][1]["content"]
    assert continued.startswith("This session is being continued")
    assert "Summary: SUMMARY TEXT" in continued and continued.endswith(f"Task: {TASK}")


def test_compaction_by_size_and_forced_after_a_plain_answer(proxies, ws):
    # A long history compacts without --force-compaction ...
    p = proxies(main=[calls(("call_1", "list_files", "{}")), text("done")])
    s = stats(harness(p.url, ws, "--compact-at", "50", "--max-turns", "2"))
    assert s["compactions"] == 1 and [role_of(r) for r in p.requests] == ["main", "summary", "main"]
    # ... and the forced one happens even when the first turn already answered.
    p = proxies(main=[text("early answer"), text("final")])
    s = stats(harness(p.url, ws / "w2", "--force-compaction"))
    assert s["compactions"] == 1 and s["turns"] == 2
    assert (ws / "w2/answer.txt").read_text() == "final"


# --- sub-agents ------------------------------------------------------------------------------


def test_delegate_runs_a_sub_agent(proxies, ws):
    p = proxies(main=[calls(("call_D", "delegate", '{"task": "count the files"}')), text("ok")],
                sub=[calls(("sub_1", "write_file", '{"path": "s.txt", "content": "sub"}')), text("one file")])
    s = stats(harness(p.url, ws))
    assert s == {"turns": 2, "tool_calls": 2, "compactions": 0, "subagents": 1, "answer_chars": 2}
    assert (ws / "s.txt").read_text() == "sub"
    sub_first, sub_second = p.of("sub")
    assert dh.SUB_SYSTEM != dh.MAIN_SYSTEM and dh.SUB_SYSTEM.startswith("You are a sub-agent")
    assert sub_first["messages"][1] == {"role": "user", "content": "count the files"}
    assert {t["function"]["name"] for t in sub_first["tools"]} == {"write_file", "read_file", "list_files"}
    assert_well_formed(sub_second)
    assert tool_results(p.requests[-1]) == {"call_D": "one file"}


def test_forced_sub_agent_and_its_turn_bound(proxies, ws):
    p = proxies(main=[text("hello"), text("done")],
                sub=[calls((f"s{i}", "list_files", "")) for i in range(5)])
    s = stats(harness(p.url, ws, "--force-subagent"))
    assert s["subagents"] == 1 and s["turns"] == 2 and s["tool_calls"] == dh.SUBAGENT_TURNS
    subs = p.of("sub")
    assert len(subs) == dh.SUBAGENT_TURNS
    assert subs[0]["messages"][1]["content"] == dh.FORCED_SUBTASK
    last_main = p.requests[-1]["messages"]
    assert last_main[-1] == {"role": "user", "content": "Sub-agent report: (no answer)"}
    assert last_main[-2] == text("hello")


# --- task sources and failures ---------------------------------------------------------------


def test_task_from_env_or_file(proxies, ws):
    p = proxies()
    env_task = dict(os.environ, GYRE_TASK="from env")
    proc = subprocess.run([sys.executable, "-m", "gyre.coordinator.demo_harness", "--workspace", str(ws),
                           "--base-url", p.url, "--api-key", "k"],
                          env={k: v for k, v in env_task.items() if "proxy" not in k.lower()},
                          capture_output=True, text=True, timeout=60)
    stats(proc)
    (ws / "task.txt").write_text("from file")
    stats(harness(p.url, ws, task=None))
    assert [r["messages"][1]["content"] for r in p.requests] == ["from env", "from file"]
    proc = harness(p.url, ws / "empty", task=None)
    assert proc.returncode == 2 and "no task" in proc.stderr


def test_http_500_fails_after_retries(proxies, ws):
    p = proxies(status=500)
    proc = harness(p.url, ws, "--max-retries", "1")
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(p.requests) == 2  # the first try and one retry
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "InternalServerError" in proc.stderr and "engine exploded" in proc.stderr
    assert (ws / "answer.txt").exists()


def test_unreachable_proxy_fails(ws):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the harness connects
    proc = harness(f"http://127.0.0.1:{port}/v1", ws, "--max-retries", "0")
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "APIConnectionError" in proc.stderr


# --- the workspace, in process ---------------------------------------------------------------


def test_workspace_confinement(tmp_path):
    w = dh.Workspace(tmp_path)
    assert w.write_file("d/e.txt", "é") == "wrote 2 bytes to d/e.txt"
    assert w.read_file("d/../d/e.txt") == "é" and w.list_files() == "d/e.txt"
    for path in ["../x", "/etc/passwd", "", ".", "d/../..", "a\x00b", 3]:
        with pytest.raises(dh.ToolError):
            w.resolve(path)
    assert dh.parse_arguments("", []) == {}
    with pytest.raises(dh.ToolError, match="missing"):
        dh.parse_arguments('{"path": "a"}', ["path", "content"])
    assert Path(tmp_path / "d/e.txt").read_bytes() == "é".encode()
