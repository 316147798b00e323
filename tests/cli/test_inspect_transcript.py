"""`gyre inspect RUN_DIR --execution ID --transcript` (and `--json`): an execution recorded
by the real proxy server (HTTP calls as a harness makes them, the scripted engine behind it)
shows each call's new messages, tool calls and results, output and finish reason, then the
verifier's log and the outcome; a record from before the transcript keys shows them as
unknown; a bad id, a folder that is no run and an execution with no call are one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.cli.transcript import TEXT_LIMIT
from gyre.coordinator.metrics import Metrics
from gyre.proxy.records import TRANSCRIPT_KEYS
from gyre.proxy.server import ProxyServer
from tests.scripted import ScriptedEngine, tool_call
from tests.support import ThreadEngineBackend

runner = CliRunner()
EX = "g00000-00"
SYSTEM = "You are a coding agent."
LONG = "x" * 3000 + "END"  # a tool result past TEXT_LIMIT
VERIFIER_LOG = "collected 2 items\ntest_a.py::test_file PASSED\ntest_a.py::test_text FAILED\n"


async def served_run(tmp_path: Path, tok) -> Path:
    """A run directory as `gyre up` leaves it, its execution served call by call over HTTP: a
    tool call; the tool's result sent back, answered by an output cut at max_tokens; that
    output dropped by the harness (mini-swe-agent's way with a malformed reply) and a format
    error sent instead, answered with a stop. A second execution never called the model."""
    run = tmp_path / "run"
    engine = ScriptedEngine(tok, script=[tool_call("write_file", path="a.txt", content="hi"),
                                         "I wrote it, and now", "Done."])
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(tok, backend, run_dir=run)
    url = await server.start()
    try:
        ex = server.register(EX)
        server.register("g00000-01")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a.txt."}]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ex.key}"}) as s:
            async def call(max_tokens: int | None = None) -> dict:
                body = {"model": "policy", "messages": messages, **({"max_tokens": max_tokens} if max_tokens else {})}
                async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["choices"][0]["message"]

            first = await call()
            messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": LONG}]
            engine.final_reason = "length"  # as an engine cut at max_tokens (between calls: none in flight)
            await call(max_tokens=6)
            engine.final_reason = "stop"
            messages.append({"role": "user", "content": "Format error: reply with one tool call."})
            await call()
    finally:
        await server.stop()
        backend.close()
    (run / "config.json").write_text(json.dumps({"run_dir": str(run), "steps": 1}))
    metrics = Metrics(run / "metrics.jsonl")
    metrics.emit("dispatch", group=0, task="t", version=0, runs=[EX, "g00000-01"])
    metrics.emit("execution", id=EX, group=0, status="completed", reward=0.5, valid=True,
                 ref="reward.txt 0.5 (test.sh exit 1)", eval_attempts=1)
    metrics.close()
    (run / "executions" / EX / "verifier.log").write_text(VERIFIER_LOG)  # as verifier.py's CappedLog leaves it
    return run


def transcript(run: Path, *flags: str) -> str:
    r = runner.invoke(app, ["inspect", str(run), "--execution", EX, "--transcript", *flags])
    assert r.exit_code == 0, r.output
    return r.output


async def test_the_transcript_shows_each_calls_new_messages_output_and_finish_then_the_verifier(
        tmp_path, chat_tokenizer):
    run = await served_run(tmp_path, chat_tokenizer)
    out = transcript(run)
    lines = out.splitlines()
    assert lines[0] == f"{EX}: 3 calls, completed, reward 0.500, valid, 1 evaluation attempt(s)"
    call1, call2, call3 = (out.index(f"call {i}/3 {EX}-c0000{i}: openai chat, role main, status ok") for i in (1, 2, 3))
    assert call1 < call2 < call3
    first, second, third = out[call1:call2], out[call2:call3], out[call3:]
    # 1) The whole conversation once, the tool call the model made, its finish reason.
    assert "messages 1-2 of 2:" in first and f"    system: {SYSTEM}" in first and "    user: Write a.txt." in first
    assert '    -> write_file {"path": "a.txt", "content": "hi"}' in first
    assert "output: finish tool_calls;" in first
    # 2) Only what is new: the output sent back (not repeated) and the tool's result, cut in the middle.
    assert "messages 3-4 of 4 (2 before as sent in call 1, not repeated):" in second
    assert "    assistant: call 1's output, sent back" in second
    assert "    tool (result of call_" in second and ", write_file in call 1): xxx" in second and "END" in second
    note = re.search(r"\[\.\.\. (\d+) of (\d+) characters cut; --full shows all \.\.\.]", second)
    cut, total = map(int, note.groups())
    assert total - cut == TEXT_LIMIT and total > len(LONG) and "x" * TEXT_LIMIT not in second
    assert "output: finish length (cut at max_tokens 6);" in second and "    I wrote it, and now" in second
    # 3) The harness dropped that reply: call 2's messages again, and a format error instead of it.
    assert "message 5 of 5 (4 before as sent in call 2, not repeated):" in third
    assert "assistant" not in third.split("output:")[0]
    assert "    user: Format error: reply with one tool call." in third
    assert "call 2's output is not among them as the model wrote it (the harness dropped or rewrote it)" in third
    assert "is not among them" not in first + second
    assert "output: finish stop;" in third and "    Done." in third
    # Then what the verifier printed, and the outcome.
    assert "harness.log: none" in third
    assert f"verifier.log: {run / 'executions' / EX / 'verifier.log'} ({len(VERIFIER_LOG)} bytes; all of it)" in third
    assert "    test_a.py::test_text FAILED" in third
    assert lines[-2:] == ["outcome: completed, reward 0.500, valid, 1 evaluation attempt(s)",
                          "  ref: reward.txt 0.5 (test.sh exit 1)"]
    # --full: every text whole.
    assert "x" * 3000 + "END" in transcript(run, "--full")


async def test_json_holds_the_same_transcript_with_stable_keys(tmp_path, chat_tokenizer):
    run = await served_run(tmp_path, chat_tokenizer)
    t = json.loads(transcript(run, "--json"))
    assert set(t) == {"execution", "run_dir", "calls", "harness_log", "verifier_log", "outcome"}
    assert t["outcome"] == {"status": "completed", "reward": 0.5, "valid": True,
                            "ref": "reward.txt 0.5 (test.sh exit 1)", "eval_attempts": 1}
    assert t["verifier_log"]["tail"] == VERIFIER_LOG and t["harness_log"] is None
    c1, c2, c3 = t["calls"]
    assert set(c1) == {"index", "call_id", "api", "role", "status", "finish_reason", "max_tokens", "prompt_tokens",
                       "new_prompt_tokens", "cached_tokens", "output_tokens", "invalid_tool_calls", "delegated_by",
                       "messages_total", "messages_from", "messages_seen_in", "messages", "new_prompt_text",
                       "output_text", "output_tool_calls"}
    assert [c["finish_reason"] for c in t["calls"]] == ["tool_calls", "length", "stop"]
    assert (c2["max_tokens"], c2["output_text"]) == (6, "I wrote it, and now")
    assert c1["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a.txt."}]
    (made,) = c1["output_tool_calls"]
    assert (made["name"], json.loads(made["arguments"])) == ("write_file", {"path": "a.txt", "content": "hi"})
    assert (c2["messages_from"], c2["messages_seen_in"], c2["messages_total"]) == (2, 1, 4)
    assert c2["messages"][0]["tool_calls"] == [made] and c2["messages"][1] == {
        "role": "tool", "content": LONG, "tool_call_id": made["id"]}  # texts whole in JSON
    assert (c3["messages_from"], c3["messages_seen_in"], c3["messages"]) == (
        4, 2, [{"role": "user", "content": "Format error: reply with one tool call."}])
    assert "Write a.txt." in c1["new_prompt_text"] and "Format error" in c3["new_prompt_text"]
    assert all(c["output_tokens"] > 0 and c["prompt_tokens"] > 0 for c in t["calls"])


async def test_an_old_record_without_the_transcript_keys_shows_them_as_unknown(tmp_path, chat_tokenizer):
    run = await served_run(tmp_path, chat_tokenizer)
    calls = run / "executions" / EX / "calls.jsonl"
    old = []
    for line in calls.read_text().splitlines():  # as a gyre before the transcript wrote it
        c = {k: v for k, v in json.loads(line).items() if k not in TRANSCRIPT_KEYS}
        c["sampling"] = {k: v for k, v in c["sampling"].items() if k not in ("max_tokens", "client_max_tokens")}
        old.append(json.dumps(c))
    calls.write_text("\n".join(old) + "\n")
    out = transcript(run)
    assert out.count("messages: unknown (recorded before gyre kept them)") == 3
    assert out.count("unknown (recorded before gyre kept it): ") == 3
    assert "output: finish length (cut at max_tokens);" in out  # the reason was recorded, the cap was not
    assert "Format error: reply with one tool call." in out  # the prompt text new in that call, rendered
    t = json.loads(transcript(run, "--json"))
    for c in t["calls"]:
        assert all(c[k] is None for k in ("messages", "messages_from", "messages_total", "messages_seen_in",
                                          "output_text", "output_tool_calls", "max_tokens"))
    assert t["calls"][1]["finish_reason"] == "length" and t["outcome"]["reward"] == 0.5


async def test_errors_are_one_line(tmp_path, chat_tokenizer):
    run = await served_run(tmp_path, chat_tokenizer)

    def error(*args: str) -> str:
        r = runner.invoke(app, ["inspect", *args])
        assert r.exit_code == 1 and len(r.output.splitlines()) == 1, r.output
        return r.output.strip()

    assert error(str(run), "--execution", "g9", "--transcript") == (
        f"[error] no execution 'g9' in {run} (2 recorded: {EX}, g00000-01; gyre inspect {run} lists them)")
    assert error(str(run), "--execution", "..", "--transcript").startswith("[error] no execution '..'")
    assert error(str(tmp_path), "--execution", EX, "--transcript") == (
        f"[error] {tmp_path} has no executions/ folder (is it a gyre run directory?)")
    assert error(str(run), "--execution", "g00000-01", "--transcript") == (
        "[error] execution 'g00000-01' recorded no model calls (its harness never reached the model): "
        f"see {run / 'executions' / 'g00000-01' / 'harness.log'}")
    assert error(str(run), "--transcript") == (
        f"[error] --transcript needs --execution ID (gyre inspect {run} lists the executions)")


async def test_a_tasks_run_directory_takes_its_outcome_from_tasks_json(tmp_path, chat_tokenizer):
    """`gyre tasks run` and `gyre eval` keep no metrics.jsonl: their results are in tasks.json."""
    run = await served_run(tmp_path, chat_tokenizer)
    (run / "metrics.jsonl").unlink()
    (run / "config.json").write_text(json.dumps({"command": "tasks run", "harness": "mini-swe-agent"}))
    (run / "tasks.json").write_text(json.dumps({"tasks": [
        {"task": "t", "sample": 0, "status": "completed", "score": 0.25, "valid": True,
         "ref": "reward.txt 0.25 (test.sh exit 0)", "execution": EX, "calls": 3}]}))
    assert transcript(run).splitlines()[-2:] == ["outcome: completed, reward 0.250, valid",
                                                 "  ref: reward.txt 0.25 (test.sh exit 0)"]
    r = runner.invoke(app, ["inspect", str(run), "--json"])
    assert r.exit_code == 0, r.output
    row = next(e for e in json.loads(r.output)["executions"] if e["execution"] == EX)
    assert (row["execution_status"], row["reward"], row["valid"]) == ("completed", 0.25, True)
    # Its head says what it is: a tasks run that ended (tasks.json), not "crashed, step 0/?" (before).
    r = runner.invoke(app, ["inspect", str(run)])
    assert r.output.splitlines()[0] == f"{run}: gyre tasks run, finished", r.output
    (run / "tasks.json").unlink()
    assert runner.invoke(app, ["inspect", str(run)]).output.splitlines()[0] == f"{run}: gyre tasks run, interrupted"
