"""`gyre eval`: pass@k over a task source. The shipped examples' own solutions in podman
(pass@2 1.0), the demo harness on the tiny model in process sandboxes (its numbers are
heldout.score's over the recorded outcomes), a real `gyre up` run's checkpoint served (its
weights, not the base model's), and the one-line refusals, each before anything is made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gyre.cli.eval import eval_cmd
from gyre.coordinator.heldout import score
from tests.inproc import SET
from tests.sandbox.conftest import REPO, podman_ready  # noqa: F401 - the fixture, with its skip reasons

runner = CliRunner()
app = typer.Typer()
app.command("eval")(eval_cmd)  # what cli/main.py registers

EXAMPLES = ("find-the-error", "fix-off-by-one", "make-test-pass", "sort-csv")


@app.callback()
def _root() -> None:
    """A group, so that `eval` is a subcommand as in `gyre`."""


def invoke(*args):
    return runner.invoke(app, ["eval", *map(str, args)])


def report_of(r) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def jsonl(tmp_path) -> Path:
    """Two tasks the similarity evaluator scores, one whose evaluator always fails."""
    path = tmp_path / "tasks.jsonl"
    rows = [{"id": "hello", "prompt": "Write hello to answer.txt.", "target": "hello"},
            {"id": "sum", "prompt": "What is 2+2? Write it to answer.txt.", "target": "4"},
            {"id": "broken", "prompt": "Anything.", "evaluator": {"type": "command", "argv": ["false"]}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.sandbox
def test_the_examples_own_solutions_pass_at_2(podman_ready, tmp_path):
    run = tmp_path / "solved"
    r = invoke("--tasks", REPO / "examples" / "tasks", "--solution", "--sandbox", "podman", "-k", 2, "--json",
               "--run-dir", run)
    assert r.exit_code == 0, r.output[-3000:]
    got = report_of(r)
    assert got["pass_at_k"] == 1.0 and got["pass_at_1"] == 1.0 and got["reward_mean"] == 1.0 and got["k"] == 2
    assert got["model"] is None and got["solution"] and got["unscored"] == []
    assert [t["task"] for t in got["tasks"]] == list(EXAMPLES)
    assert all(t["samples"] == 2 and t["passed"] == 2 and t["statuses"] == {"completed": 2} for t in got["tasks"]), \
        [(t["task"], t["statuses"]) for t in got["tasks"]]
    assert len(list((run / "executions").iterdir())) == 8


def test_the_demo_on_the_tiny_model_is_heldout_score_of_its_outcomes(jsonl, tmp_path):
    run = tmp_path / "demo"
    r = invoke("--tasks", jsonl, "--sandbox", "process", "-k", 3, "--threshold", 0.1, "--concurrency", 4,
               "--json", "--run-dir", run)
    assert r.exit_code == 1, r.output[-3000:]  # a task with no valid sample: the measure is incomplete
    got = report_of(r)
    rows = {t["task"]: t for t in got["tasks"]}
    assert got["k"] == 3 and got["threshold"] == 0.1 and got["executions"] == 9 and got["step"] is None
    assert got["model"] == str(run / "model")
    assert rows["hello"]["samples"] == rows["sum"]["samples"] == 3
    assert rows["broken"] == {"task": "broken", "samples": 0, "passed": 0, "rewards": [],
                              "statuses": {"evaluator_error": 3}}
    assert got["unscored"] == ["broken"] and got["scored_tasks"] == 2  # unscored: never a fail
    # The recorded outcomes, through the training loop's estimator.
    recorded = json.loads((run / "tasks.json").read_text())["tasks"]
    outcomes: dict[str, list] = {}
    for x in recorded:
        assert (run / "executions" / x["execution"] / "calls.jsonl").exists()
        outcomes.setdefault(x["task"], []).append((x["valid"], x["score"]))
    want = score(outcomes, 3, 0.1)
    for key in ("pass_at_k", "pass_at_1", "reward_mean", "unscored"):
        assert got[key] == want[key], key
    assert {t: {k: v for k, v in row.items() if k != "statuses"} for t, row in rows.items()} == {
        t: {"task": t, **v} for t, v in want["per_task"].items()}
    assert json.loads((run / "eval.json").read_text()) == got
    assert sorted(p.name for p in (run / "executions").iterdir()) == [
        f"t{i:03d}-{t}-s{s:02d}" for i, t in enumerate(("hello", "sum", "broken")) for s in range(3)]


def test_the_table_names_unscored_tasks_and_prints_pass_at_k(jsonl, tmp_path):
    r = invoke("--tasks", jsonl, "--sandbox", "process", "-k", 2, "--run-dir", tmp_path / "table")
    assert r.exit_code == 1, r.output[-3000:]
    out = r.stdout
    assert "records in" in out and "samples" in out and "statuses" in out
    assert "│ broken │ 0       │ unscored │" in out and "evaluator_error 2" in out
    assert "pass@2 " in out and "pass@1 " in out and "reward mean " in out
    assert "unscored (no valid sample; not counted a fail): broken" in out


# --- a real run's checkpoint ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A `gyre up` run of one step on the tiny model: checkpoints/step-000001, version 1."""
    run = tmp_path_factory.mktemp("up") / "run"
    exe = shutil.which("gyre", path=str(Path(sys.executable).parent)) or "gyre"
    r = subprocess.run([exe, "up", "--steps", "1", "--no-live", "--run-dir", str(run), *SET], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "checkpoints" / "step-000001" / "trainer.pt").exists()
    return run


@pytest.fixture
def hello(tmp_path) -> Path:
    path = tmp_path / "hello.jsonl"
    path.write_text(json.dumps({"id": "hello", "prompt": "Write hello to answer.txt.", "target": "hello"}) + "\n")
    return path


def greedy(model: Path, tasks: Path, run: Path, *extra) -> tuple[dict, list]:
    """The report, and every policy output's (tokens, logprobs) of a greedy eval of `model`."""
    r = invoke("--tasks", tasks, "--model", model, "--set", "rollout_temperature=0", "--json", "--run-dir", run,
               *extra)
    assert r.exit_code == 0, r.output[-3000:]
    outputs = []
    for folder in sorted((run / "executions").iterdir()):
        nodes = [json.loads(x) for x in (folder / "nodes.jsonl").read_text().splitlines()]
        outputs += [(n["tokens"], n["logprobs"]) for n in nodes if n["kind"] == "output"]
    assert outputs
    return report_of(r), outputs


def test_a_run_directory_evaluates_its_checkpoints_weights(trained_run, hello, tmp_path):
    got, trained = greedy(trained_run, hello, tmp_path / "trained")
    assert (got["model"], got["step"], got["version"]) == (str(trained_run), 1, 1)
    assert got["checkpoint"] == str(trained_run / "checkpoints" / "step-000001")
    readme = (tmp_path / "trained" / "model.md").read_text()
    assert f"from the run directory `{trained_run}`, checkpoint `checkpoints/step-000001`" in readme
    assert not (tmp_path / "trained" / "model").exists()  # the exported copy is removed once served
    # The base model's greedy outputs are not the checkpoint's ...
    _, base = greedy(trained_run / "model", hello, tmp_path / "base")
    assert [lp for _, lp in base] != [lp for _, lp in trained]
    # ... and `gyre export`'s directory of that checkpoint serves the same ones. (`--step 1` is
    # the latest here, the one evaluated above: a run of it again would prove nothing more.)
    from gyre.cli.export import export_run

    export_run(run_dir=trained_run, out=tmp_path / "exported")
    again, outputs = greedy(tmp_path / "exported", hello, tmp_path / "run-exported")
    assert [t for t, _ in outputs] == [t for t, _ in trained]
    assert all(a == pytest.approx(b, abs=1e-5) for (_, a), (_, b) in zip(outputs, trained, strict=True))
    assert again["pass_at_k"] == got["pass_at_k"] and again["reward_mean"] == got["reward_mean"]


# --- refusals ---------------------------------------------------------------------------------


def test_refusals_are_one_line_and_make_no_run_directory(trained_run, tiny_dir, jsonl, tmp_path, monkeypatch):
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    (untrained / "config.json").write_text(json.dumps({"model_dir": str(tiny_dir), "steps": 2}))
    cases = [
        (("--model", untrained), f"[error] run {untrained} has no checkpoint yet: a run saves one every "
                                 "checkpoint_every steps"),
        (("--model", trained_run, "--step", 7), f"[error] run {trained_run} has no checkpoint of step 7 "
                                                "(available: 1)"),
        (("--model", tiny_dir, "--step", 1), "[error] --step names a checkpoint of a gyre run directory"),
        (("--model", tmp_path / "nowhere"), f"[error] --model {tmp_path / 'nowhere'}: no such directory"),
        (("--tasks", tmp_path / "missing.jsonl"), f"[error] --tasks {tmp_path / 'missing.jsonl'}: no such file"),
        (("--harness", "nope"), "[error] unknown harness 'nope'"),
        (("-k", 0), "[error] -k must be >= 1, got 0"),
        (("--solution", "--model", tiny_dir), "[error] --solution runs each task's own solution/solve.sh"),
    ]
    for i, (args, want) in enumerate(cases):
        run = tmp_path / f"run{i}"
        flags = args if "--tasks" in args else ("--tasks", jsonl, *args)
        r = invoke(*flags, "--run-dir", run)
        assert r.exit_code == 1 and r.output.startswith(want) and len(r.output.splitlines()) == 1, (args, r.output)
        assert not run.exists(), args
    bare = tmp_path / "bin"  # a PATH without podman (python stays reachable by its full path)
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    r = invoke("--tasks", jsonl, "--sandbox", "podman", "--run-dir", tmp_path / "nopodman")
    assert r.exit_code == 1 and len(r.output.splitlines()) == 1, r.output
    assert r.output.startswith("[error] sandbox podman: the `podman` command is not on PATH"), r.output
    assert not (tmp_path / "nopodman").exists()
