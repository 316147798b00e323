"""`gyre inspect` of a `gyre up` run directory: the run's summary first, then one row per
execution with its status and reward; `--execution` for one tree; `--json` with the run and
every per-execution key it always had; a torn line in metrics.jsonl skipped; `gyre serve`
directories. The records are written by the real Recorder, the events by the real Metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.inspect import summary
from gyre.cli.main import app
from gyre.coordinator.metrics import Metrics
from gyre.proxy.recorder import Recorder
from gyre.proxy.records import load_execution
from gyre.proxy.roles import GenericRule
from gyre.proxy.types import ChatRequest, Message

runner = CliRunner()

# The per-execution keys `--json` gave before the run summary: tools and tests read them.
OLD_KEYS = {"execution", "calls", "nodes", "roots", "leaves", "unique_tokens", "tree_expanded_tokens",
            "policy_tokens", "external_tokens", "leaf_roles", "status", "cached_tokens", "prefill_tokens",
            "cache_hit_rate", "forward_tokens_tree", "unique_admitted_tokens", "expanded_tokens", "admission_j5",
            "admission_all"}

# group -> its executions as (id, turns, outcome): outcome the `execution` event's (status,
# reward, valid), None for one still in flight when the run stopped writing.
GROUPS = {
    0: [("g00000-00", 2, ("completed", 0.5, True)), ("g00000-01", 1, ("completed", 0.25, True)),
        ("g00000-02", 3, ("timed_out", 0.0, True)), ("g00000-03", 1, ("harness_error", None, False))],
    1: [("g00001-00", 2, ("completed", 0.125, True)), ("g00001-01", 2, None)],
}


def record(run: Path, tok, ex_id: str, turns: int) -> None:
    """A main agent's `turns` calls, each resending the history (a chain in the tree)."""
    ex = Recorder(ex_id, "k", tok, GenericRule(), dir=run / "executions" / ex_id)
    messages = [Message("system", "You are the main agent."), Message("user", f"Do task {ex_id}.")]
    for i in range(turns):
        req = ChatRequest(api="openai", model="m", messages=list(messages))
        prep = ex.prepare(req, {})
        reply = f"turn {i} of {ex_id}"
        new = prep.new_tokens  # what the engine computed; the rest it held from the previous turn
        ex.record_reply(req, tok.encode(reply) + tok.encode("<|im_end|>"), prep=prep,
                        cached_tokens=len(prep.prompt_ids) - new, prefill_tokens=new)
        messages += [Message("assistant", reply), Message("user", "Continue.")]
    ex.close()


def up_run(tmp_path: Path, tok, *, live: bool = False) -> Path:
    """A `gyre up` run that stopped writing mid-way (a crash, or still running with `live`):
    step 1 trained group 0; group 1 has one outcome, one execution in flight; the last
    line of metrics.jsonl is torn."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_dir": str(run), "steps": 3, "policy": "elastic"}))
    if live:  # the coordinator's own file, naming a pid that is alive (ours)
        (run / "coordinator.json").write_text(json.dumps({"pid": os.getpid(), "status_url": "http://x/gyre/status"}))
    metrics = Metrics(run / "metrics.jsonl")
    for gid, members in GROUPS.items():
        metrics.emit("dispatch", group=gid, task=f"task-{gid}", version=0, runs=[m[0] for m in members])
    for gid, members in GROUPS.items():
        for ex_id, turns, out in members:
            record(run, tok, ex_id, turns)
            if out is not None:
                status, reward, valid = out
                metrics.emit("execution", id=ex_id, group=gid, status=status, reward=reward, valid=valid)
        if gid == 0:
            metrics.emit("step", step=1, version=1, reward_mean=0.25, tokens_trained=90, group_ids=[0])
    metrics.close()
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"event": "execution", "id": "g00001-01", "status": "compl')  # the crash, mid-line
    with open(run / "executions" / "g00001-01" / "nodes.jsonl", "ab") as f:
        f.write(b'{"id": 99, "par')  # and mid-way through a node of the execution in flight
    return run


def rows_of(output: str) -> dict[str, list[str]]:
    """Each execution's row, split into its cells (one space between columns, none inside);
    not a tree's title line ("g00000-02 (3 calls)")."""
    return {line.split()[0]: line.split() for line in output.splitlines()
            if line.startswith("g0000") and len(line.split()) >= 10}


@pytest.mark.parametrize("live, in_flight", [(False, "interrupted"), (True, "running")])
def test_the_summary_comes_first_then_one_row_per_execution_with_its_status_and_reward(
        tmp_path, chat_tokenizer, live, in_flight):
    run = up_run(tmp_path, chat_tokenizer, live=live)
    r = runner.invoke(app, ["inspect", str(run)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    state = "running" if live else "crashed"
    assert lines[0] == f"{run}: {state}, step 1/3"
    assert lines[1] == f"6 executions: completed 3, harness_error 1, {in_flight} 1, timed_out 1"
    # The valid executions with a reward, as a step's reward_mean counts them: (.5 + .25 + 0 + .125) / 4.
    assert lines[2] == "reward mean 0.219 (4 scored); step 1: 0.250; 90 tokens trained"
    assert lines[3].startswith("11 calls: prompt tokens reused ")
    assert lines[4] == "1 torn line(s) in metrics.jsonl skipped"
    header = next(i for i, line in enumerate(lines) if line.startswith("execution"))
    rows = rows_of(r.output)
    assert min(i for i, line in enumerate(lines) if line.startswith("g0000")) > header > 4
    # execution, group, status, reward, valid, calls, policy, external, cache hits, leaf roles
    assert rows["g00000-00"][:6] == ["g00000-00", "0", "completed", "0.500", "yes", "2"]
    assert rows["g00000-01"][:6] == ["g00000-01", "0", "completed", "0.250", "yes", "1"]
    assert rows["g00000-02"][:6] == ["g00000-02", "0", "timed_out", "0.000", "yes", "3"]
    assert rows["g00000-03"][:6] == ["g00000-03", "0", "harness_error", "n/a", "no", "1"]
    assert rows["g00001-00"][:6] == ["g00001-00", "1", "completed", "0.125", "yes", "2"]
    # No `execution` event: no reward is made up; its group comes from the dispatch.
    assert rows["g00001-01"][:6] == ["g00001-01", "1", in_flight, "n/a", "n/a", "2"]
    assert all(cells[-2:] == ["main", "1"] for cells in rows.values())
    # A first call finds nothing cached; the second resends the first's prompt and output.
    assert rows["g00000-01"][-3] == "0.0%" and float(rows["g00000-00"][-3].rstrip("%")) > 0
    # Only the rows: no trees, and the hint that says where they are.
    assert "leaf:" not in r.output and "--execution ID" in lines[-1]
    assert len(lines) == header + 2 + len(GROUPS[0]) + len(GROUPS[1]) + 1


def test_execution_shows_its_row_tree_and_admission(tmp_path, chat_tokenizer):
    run = up_run(tmp_path, chat_tokenizer)
    r = runner.invoke(app, ["inspect", str(run), "--execution", "g00000-02"])
    assert r.exit_code == 0, r.output
    assert list(rows_of(r.output)) == ["g00000-02"]
    assert rows_of(r.output)["g00000-02"][2:4] == ["timed_out", "0.000"]
    assert "g00000-02 (3 calls)" in r.output and "main leaf: 3 outputs" in r.output
    assert "admitted" in r.output and "@J=5" in r.output
    missing = runner.invoke(app, ["inspect", str(run), "--execution", "g9"])
    assert missing.exit_code == 1 and "[error] no execution 'g9'" in missing.output


def test_json_has_the_run_summary_and_every_key_it_had(tmp_path, chat_tokenizer):
    run = up_run(tmp_path, chat_tokenizer)
    r = runner.invoke(app, ["inspect", str(run), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["run"] == {
        "run_dir": str(run), "command": "up", "state": "crashed", "steps_done": 1, "steps_target": 3,
        "steps_unsaved": 0,
        "executions": 6, "execution_status": {"completed": 3, "timed_out": 1, "harness_error": 1, "interrupted": 1},
        "rewarded": 4, "reward_mean": (0.5 + 0.25 + 0.0 + 0.125) / 4,
        "last_step": {"step": 1, "reward_mean": 0.25, "tokens_trained": 90}, "tokens_trained": 90,
        "calls": 11, "cached_tokens": out["run"]["cached_tokens"], "prefill_tokens": out["run"]["prefill_tokens"],
        "cache_hit_rate": out["run"]["cache_hit_rate"], "unrecorded": [], "skipped_lines": 1, "restarts": []}
    assert 0 < out["run"]["cached_tokens"] and 0 < out["run"]["prefill_tokens"]
    by_id = {e["execution"]: e for e in out["executions"]}
    assert list(by_id) == [m[0] for members in GROUPS.values() for m in members]
    for ex_id, ex in by_id.items():
        # The old keys, with the values they always had; `status` still counts the calls' statuses.
        old = summary(load_execution(run / "executions" / ex_id), 5)
        assert OLD_KEYS <= set(ex) and {k: ex[k] for k in OLD_KEYS} == old
        assert ex["status"] == {"ok": ex["calls"]}
    assert [(by_id[i]["execution_status"], by_id[i]["reward"], by_id[i]["valid"], by_id[i]["group"])
            for i in ("g00000-02", "g00000-03", "g00001-01")] == [
        ("timed_out", 0.0, True, 0), ("harness_error", None, False, 0), ("interrupted", None, None, 1)]
    one = json.loads(runner.invoke(app, ["inspect", str(run), "--json", "--execution", "g00001-00"]).output)
    assert one["run"] == out["run"] and one["executions"] == [by_id["g00001-00"]]


def test_a_resumed_finished_run_skips_a_torn_line_mid_file(tmp_path, chat_tokenizer):
    """A torn line mid-file (what gyre before the whole-line journal left after a crash and a
    resume: today's Metrics cuts a torn tail off when it reopens) is skipped and counted; the
    execution in flight then was dispatched again as `-r1`."""
    run = up_run(tmp_path, chat_tokenizer)
    record(run, chat_tokenizer, "g00001-01-r1", 1)
    metrics = Metrics(run / "metrics.jsonl")
    metrics.emit("resume", step=1)
    metrics.emit("execution", id="g00001-01-r1", group=1, status="completed", reward=0.75, valid=True)
    metrics.emit("step", step=2, version=2, reward_mean=0.4375, tokens_trained=60, group_ids=[1])
    metrics.emit("summary", steps=2, statuses={"completed": 2}, tokens_trained=150)
    metrics.close()
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    cut = next(i for i, x in enumerate(lines) if '"event":"resume"' in x)
    (run / "metrics.jsonl").write_text("".join([*lines[:cut], '{"event":"execution","t":9.1,"id":"g0\n', *lines[cut:]]))
    r = runner.invoke(app, ["inspect", str(run)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    # No checkpoint in this run directory: both steps were trained, neither was saved.
    assert lines[0] == f"{run}: stopped, step 2/3 (2 not saved: no intact checkpoint holds them; a resume " \
                       "starts from step 0)"
    assert lines[1] == "7 executions: completed 4, harness_error 1, redone 1, timed_out 1"
    assert lines[2].endswith("; step 2: 0.438; 150 tokens trained")  # the summary's count
    assert lines[4].startswith("resumed at step 1: down unknown, 0 running execution(s) adopted")  # a resume event
    assert lines[5] == "1 torn line(s) in metrics.jsonl skipped"
    rows = rows_of(r.output)
    assert rows["g00001-01"][2:4] == ["redone", "n/a"] and rows["g00001-01-r1"][2:4] == ["completed", "0.750"]


def serve_run(tmp_path: Path, tok, summary_json: dict | None) -> Path:
    """As `gyre serve` leaves it: config.json saying so, one execution, no metrics.jsonl."""
    run = tmp_path / "serve-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"command": "serve", "harness": None, "task": None}))
    record(run, tok, "serve", 2)
    if summary_json is not None:
        (run / "executions" / "serve" / "summary.json").write_text(json.dumps(summary_json))
    return run


@pytest.mark.parametrize("summary_json, status, reward", [
    (None, "unknown", "n/a"),  # plain `gyre serve`: a client made the calls, nobody scored them
    ({"execution": "serve", "harness": "demo", "status": "completed", "calls": 2}, "completed", "n/a"),
    ({"execution": "serve", "status": "completed", "score": 0.5, "valid": True}, "completed", "0.500"),
])
def test_a_serve_run_directory_has_its_row_and_tree(tmp_path, chat_tokenizer, summary_json, status, reward):
    run = serve_run(tmp_path, chat_tokenizer, summary_json)
    r = runner.invoke(app, ["inspect", str(run)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == f"{run}: gyre serve run" and lines[1] == f"1 execution: {status} 1"
    assert lines[2].startswith("reward mean 0.500 (1 scored)" if reward != "n/a" else "2 calls: ")
    row = next(line.split() for line in lines if line.startswith("serve "))
    assert row[2:4] == [status, reward]
    assert "main leaf: 2 outputs" in r.output  # a run of one execution shows its tree too
    out = json.loads(runner.invoke(app, ["inspect", str(run), "--json"]).output)
    assert (out["run"]["command"], out["run"]["state"], out["run"]["steps_done"]) == ("serve", None, None)
    assert out["run"]["tokens_trained"] is None and out["run"]["skipped_lines"] == 0
    (ex,) = out["executions"]
    assert ex["execution_status"] == status and ex["reward"] == (None if reward == "n/a" else 0.5)
