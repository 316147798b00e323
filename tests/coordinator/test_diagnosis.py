"""What a step trained on, and why it trained nothing (coordinator/diagnosis.py): groups that
scored alike or made no model call, and the calls behind them (cut at max_tokens, no tool call
parsed, a malformed one) read from the real Recorder's call records; then a real 2-step run
whose every group scores alike: no update applied, no weights sent, its lines, `gyre doctor`
and `gyre export` say so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.coordinator.buffer import Execution, Group
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.diagnosis import diagnose, merge, why
from gyre.coordinator.waterlevel import Waterlevel
from gyre.proxy.recorder import Recorder
from gyre.proxy.roles import GenericRule
from gyre.proxy.types import ChatRequest, Message

HERE = Path(__file__).parent


def _group(tok, gid: int, outcomes, replies) -> Group:
    """A closed group: one execution per (status, reward, valid), each having answered one call
    with its reply (text, finish) recorded as the server records it (None: no model call)."""
    wl = Waterlevel()
    g = Group(gid, None, 0, len(outcomes))
    for i, ((status, reward, valid), reply, tracked) in enumerate(zip(outcomes, replies, wl.dispatch(len(outcomes)))):
        wl.launch(tracked)
        wl.terminate(tracked)
        rec = None
        if reply is not None:
            text, finish = reply
            rec = Recorder(f"g{gid}-{i}", "k", tok, GenericRule())
            req = ChatRequest(api="openai", model="m", messages=[Message("user", "fix the bug")])
            ids = tok.encode(text) + ([] if finish == "length" else tok.encode("<|im_end|>"))
            rec.record_reply(req, ids, finish=finish)
        g.runs.append(Execution(f"g{gid}-{i}", gid, i, None, tracked, 0, status=status, reward=reward, valid=valid,
                                recorder=rec))
    return g


def test_a_steps_groups_say_why_they_trained_nothing(chat_tokenizer):
    tok = chat_tokenizer
    ok = ("completed", 0.0, True)
    cut = ("I will start by reading", "length")  # every reply cut at max_tokens, no tool call
    alike = _group(tok, 0, [ok, ok, ok], [cut, cut, cut])
    malformed = ('<tool_call>{"name": "bash", "arguments": ', "stop")  # a tool call that never closes
    silent = _group(tok, 1, [ok, ok, ("harness_error", 0.0, True)], [None, None, None])  # no model call
    spread = _group(tok, 2, [("completed", 1.0, True), ok, ("evaluator_error", None, False)],
                    [('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>', "stop"),
                     malformed, cut])
    d = diagnose([alike, silent, spread])
    assert d["zero_advantage_groups"] == {"scored_alike": 1, "no_model_calls": 1}
    assert d["alike_rewards"] == [0.0]
    assert d["calls"] == 6 and d["calls_at_max_tokens"] == 4
    assert d["calls_without_tool_call"] == 5 and d["invalid_tool_calls"] >= 1  # the malformed one parsed none
    assert d["execution_statuses"] == {"completed": 7, "harness_error": 1, "evaluator_error": 1}
    line = why(d, 3)
    assert line.startswith("1 of 3 groups scored alike (zero advantage, every reward 0.000); "
                           "1 of 3 groups made no model call; of 6 model calls 4 ended at max_tokens, "
                           "5 parsed no tool call"), line
    assert line.endswith("executions: 1 harness error, 1 verifier error"), line
    assert why(d, 3, calls=False) == ("1 of 3 groups scored alike (zero advantage, every reward 0.000); "
                                      "1 of 3 groups made no model call")
    # Steps add up (the end of a run; `gyre doctor` over the step events, which carry the same keys).
    both = merge([d, json.loads(json.dumps(diagnose([alike])))])
    assert both["zero_advantage_groups"] == {"scored_alike": 2, "no_model_calls": 1} and both["calls"] == 9
    # A group with spread says nothing; nor does a step with no groups.
    assert why(diagnose([spread]), 1) .startswith("of 3 model calls") and why(diagnose([]), 0) == ""


@pytest.mark.timeout(300)
def test_a_run_whose_groups_all_score_alike_trains_and_publishes_nothing_and_says_so(tiny_dir, tmp_path, capsys):
    from gyre.cli.main import app
    from gyre.cli.up import run_up
    from gyre.coordinator.metrics import read_events

    # Every execution scores 0.25 whatever the model says; the harness asks for 8 tokens.
    constant = [sys.executable, "-c", "print('{\"score\": 0.25}')"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": "mode:normal say hi",
                                           "evaluator": {"type": "command", "argv": constant}}) for i in range(2)))
    run = tmp_path / "run"
    cfg = CoordinatorConfig(run_dir=run, model_dir=tiny_dir, steps=2, policy="colocate", cells=2, groups_per_step=2,
                            group_size=2, harness=(sys.executable, str(HERE / "_harness.py")), tasks_path=tasks,
                            workers="inproc", seed=0)
    assert run_up(cfg) == 0
    out = capsys.readouterr().out
    events = read_events(run / "metrics.jsonl").events
    steps = [e for e in events if e["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["trained"] is False and s["tokens_trained"] == 0 and s["version"] == 0
        assert s["zero_advantage_groups"] == {"scored_alike": 2} and s["alike_rewards"] == [0.25]
        assert s["calls"] >= 4 and s["note"].startswith("nothing trained: 2 of 2 groups scored alike")
        assert s["note"].endswith("; no weights published")
    pubs = [e for e in events if e["event"] == "publish"]
    assert pubs and all(p["unchanged"] and p["bytes"] == 0 and p["version"] == 0 for p in pubs)
    assert "step 1/2" in out and "(nothing trained: 2 of 2 groups scored alike (zero advantage, every reward " \
                                 "0.250)" in out
    assert "trained weights" not in out
    assert "trained nothing: 2 steps trained 0 tokens, so the weights equal the base model's" in out, out
    # gyre doctor warns, with the same reasons; gyre export says the weights are the base model's.
    runner = CliRunner()
    r = runner.invoke(app, ["doctor", str(run), "--json"])
    (check,) = [c for c in json.loads(r.stdout) if c["check"] == "training"]
    assert check["status"] == "warn" and "2 step(s) trained 0 tokens: the weights equal the base model's" \
        in check["detail"] and "scored alike" in check["detail"] and "--transcript" in check["fix"]
    r = runner.invoke(app, ["export", str(run), str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "note: the weights equal the base model's" in r.stderr
    assert "They equal the base model's" in (tmp_path / "out" / "README.md").read_text()
