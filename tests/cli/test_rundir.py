"""The run directory as a user meets it: paths stored absolute, one live `gyre up` per
directory (a flock naming the holder's pid), a directory that holds a run refused with
what to do, a refused run leaving nothing behind, `gyre top` finding only live runs, and
the systemd unit resuming any run that started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import _latest_run, app
from gyre.cli.upconfig import resolve_config as _resolve_config
from gyre.coordinator.resume import STATE_KEYS, step_dir, write_state
from gyre.coordinator.rundir import RunDirError, claim, state
from tests.cli.errors import one_line_error

runner = CliRunner()


def test_paths_are_resolved_absolute_and_nothing_is_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _, _ = _resolve_config(None, ["tasks_path=tasks.jsonl"], run_dir=Path("runs/x"))
    assert cfg.run_dir == tmp_path / "runs" / "x" and cfg.model_dir == tmp_path / "runs" / "x" / "model"
    assert cfg.tasks_path == tmp_path / "tasks.jsonl"
    assert json.loads(json.dumps(cfg.to_json()))["run_dir"] == str(tmp_path / "runs" / "x")
    assert not (tmp_path / "runs").exists()


def test_a_live_run_directory_is_refused_naming_its_holder(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gyre.coordinator.rundir import claim; lock = claim(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()", str(run)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_line_error(runner.invoke(app, ["up", "--run-dir", str(run), "--steps", "1", "--no-live"]))
        assert f"in use by another gyre process (pid {holder.pid})" in line
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            claim(run)
    finally:
        holder.stdin.close()
        holder.wait(30)
        holder.stdout.close()
    claim(run).release()  # the kernel dropped the lock with the holder


def _run_dir(tmp_path: Path, events: list[dict]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"steps": 3}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn')
    done = [e["steps"] for e in events if e["event"] == "summary"]
    if done:  # its last step saved, as a run that ended does (rundir.state: finished means saved)
        write_state(run, done[-1], dict.fromkeys(STATE_KEYS, 0) | {"step": done[-1]})
        with zipfile.ZipFile(step_dir(run, done[-1]) / "trainer.pt", "w") as z:  # torch.save's format
            z.writestr("archive/data.pkl", b"")
    return run


@pytest.mark.parametrize("events, kind, says", [
    ([{"event": "step", "step": 1}, {"event": "step", "step": 3}, {"event": "summary", "steps": 3}], "finished",
     "holds a finished run (3/3 steps): extend it with `gyre up --resume"),
    ([{"event": "step", "step": 1}, {"event": "summary", "steps": 1}], "stopped",
     "holds a run that stopped at step 1/3: continue it with `gyre up --resume"),
    ([{"event": "step", "step": 2}], "crashed", "holds a run that crashed (no closing summary) at step 2/3"),
    ([{"event": "step", "step": 2}, {"event": "summary", "steps": 2}, {"event": "resume", "step": 1}], "crashed",
     "crashed (no closing summary) at step 1/3"),
    ([], "crashed", "at step 0/3"),
])
def test_a_directory_holding_a_run_is_refused_with_what_to_do(tmp_path, events, kind, says):
    run = _run_dir(tmp_path, events)
    assert state(run).kind == kind
    line = one_line_error(runner.invoke(app, ["up", "--run-dir", str(run), "--steps", "1", "--no-live"]))
    assert says in line and "or choose a new --run-dir" in line
    claim(run, resume=True).release()  # --resume may take it


@pytest.mark.parametrize("args, says", [
    (["--set", "stpes=3"], "unknown field 'stpes': did you mean 'steps'?"),
    (["--set", "cells=0"], "cells must be >= 1, got 0"),
    (["--set", "cells=-1"], "cells must be >= 1, got -1"),
    (["--steps", "0"], "steps must be >= 1, got 0"),
    (["--set", "exec_slots_per_cell=0"], "exec_slots_per_cell must be >= 1"),
    (["--set", "rollout_temperature=0"], "rollout_temperature must be > 0"),
    (["--set", "rollout_top_p=0.9"], "set allow_rollout_top_p = true"),
    (["--set", "harness=nope"], "unknown harness 'nope'"),
    (["--set", 'harness=["/nonexistent/agent"]'], "is not on PATH"),
    (["--model", "missing-model"], "model directory missing-model does not exist"),
])
def test_a_refused_run_is_one_line_and_leaves_no_run_directory(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    assert says in one_line_error(runner.invoke(app, ["up", "--no-live", *args]))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, says", [
    (["--config", "run.toml"], "unknown field 'stpes': did you mean 'steps'?"),  # --config is CONFIG
    (["other.toml", "--config", "run.toml"], "two configs: CONFIG other.toml and --config run.toml; give one"),
    (["--harness", "nope"], "unknown harness 'nope'"),
    (["--config", "good.toml", "--harness", "nope"], "unknown harness 'nope'"),  # the flag over the file's
    (["--harness", "demo", "--set", "harness=demo"], "--harness and --set harness=...: give the harness once"),
    (["--resume", "runs/x", "--harness", "demo"], "--resume takes the run's own config.json"),
])
def test_up_takes_config_and_harness_as_serve_and_eval_do(tmp_path, monkeypatch, args, says):
    """`gyre up --config FILE --harness NAME`, the spelling of serve, eval and tasks run; the
    positional CONFIG still works. A clash is one line and leaves nothing behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text("stpes = 3\n")
    (tmp_path / "good.toml").write_text('harness = "claude-code"\n')
    assert says in one_line_error(runner.invoke(app, ["up", "--no-live", *args]))
    assert not (tmp_path / "runs").exists()
    assert "unknown field 'stpes'" in one_line_error(runner.invoke(app, ["up", "--no-live", "run.toml"]))


def test_up_harness_flag_wins_over_the_file_and_help_shows_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text('harness = "claude-code"\nsteps = 2\n')
    cfg, _, overrides = _resolve_config(tmp_path / "run.toml", [], harness="demo")
    assert cfg.harness == "demo" and cfg.steps == 2 and overrides["harness"] == "demo"
    assert _resolve_config(tmp_path / "run.toml", [])[0].harness == "claude-code"
    text = runner.invoke(app, ["up", "--help"], terminal_width=200).output
    assert "--config" in text and "--harness" in text and "Run config file (TOML, YAML or JSON)" in text


@pytest.mark.parametrize("args, says", [
    (["--set", "lr=1"], "gyre serve takes no field 'lr': it takes only"),
    (["--set", "max_contxt=9"], "unknown field 'max_contxt': did you mean 'max_context'?"),
    (["--set", "default_max_tokens=0"], "default_max_tokens must be an int >= 1, got 0"),
    (["--set", "rollout_top_p=2"], "rollout_top_p must be in (0, 1], got 2"),
])
def test_a_refused_serve_leaves_no_run_directory(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    assert says in one_line_error(runner.invoke(app, ["serve", *args]))
    assert not (tmp_path / "runs").exists()


def test_model_directory_problems_are_one_line_errors(tmp_path, tiny_dir, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad-json"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_dir, no_tok)
    (no_tok / "tokenizer.json").unlink()
    rope = tmp_path / "rope"
    shutil.copytree(tiny_dir, rope)
    cfg = json.loads((rope / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (rope / "config.json").write_text(json.dumps(cfg))
    for model, says in ((bad, "config.json is not readable JSON"), (no_tok, "has no tokenizer.json"),
                        (rope, "rope_parameters.rope_type 'llama3' is not supported")):
        for command in (["up", "--no-live", "--run-dir", str(tmp_path / "r")], ["serve"]):
            assert says in one_line_error(runner.invoke(app, [*command, "--model", str(model)]))
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


def test_top_finds_only_a_live_coordinator(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for name, pid in (("a-live", os.getpid()), ("b-dead", int(gone.stdout))):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "coordinator.json").write_text(json.dumps({"status_url": "x", "pid": pid}))
    os.utime(tmp_path / "runs" / "a-live" / "coordinator.json", (1, 1))  # the older of the two
    assert _latest_run() == str(Path("runs") / "a-live")
    (tmp_path / "runs" / "a-live" / "coordinator.json").unlink()
    with pytest.raises(FileNotFoundError, match="no running coordinator under ./runs"):
        _latest_run()


def test_the_coordinator_unit_resumes_any_run_that_started(tmp_path):
    unit = Path(__file__).parents[2] / "systemd" / "gyre-coordinator.service"
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    script = line.removeprefix("ExecStart=/bin/sh -c ").strip("'")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gyre").write_text('#!/bin/sh\necho "$@"\n')
    (bin_dir / "gyre").chmod(0o755)
    run = tmp_path / "run"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", GYRE_CONFIG="/etc/gyre/run.toml",
               GYRE_RUN_DIR=str(run))

    def start() -> str:
        return subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True).stdout.strip()

    assert start() == f"up /etc/gyre/run.toml --run-dir {run} --no-live"  # a first start
    run.mkdir()
    assert start() == f"up /etc/gyre/run.toml --run-dir {run} --no-live"  # made, but no run started in it
    (run / "config.json").write_text("{}")  # crashed before its first checkpoint, or after: resumed
    assert start() == f"up --resume {run} --no-live"


def test_an_explicit_timeout_beats_the_presets_own(tmp_path, tiny_dir):
    """`gyre tasks run --timeout` is over a preset's timeout_s (a preset's 240 beat an explicit
    --timeout 300) and the preset's is over the default: a harness that naps 3 s under a preset
    of 1 s times out, and completes with --timeout 30."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "nap", "prompt": "Nap.", "target": "x"}) + "\n")
    cfg = tmp_path / "run.toml"
    cfg.write_text('[harnesses.nap]\ncommand = ["sh", "-c", "sleep 3"]\ntimeout_s = 1\n')

    def status(name: str, *flags: str) -> str:
        r = runner.invoke(app, ["tasks", "run", str(tasks), "--harness", "nap", "--config", str(cfg), "--sandbox",
                                "process", "--model", str(tiny_dir), "--run-dir", str(tmp_path / name), "--json",
                                *flags])
        assert r.exit_code == 0, r.output[-2000:]
        return json.loads(r.stdout)["tasks"][0]["status"]

    assert status("preset") == "timed_out"
    assert status("flag", "--timeout", "30") == "completed"
    # Under the preset, the run config's execution_timeout_s and keep_sandbox (flags still win).
    cfg.write_text('execution_timeout_s = 1\nkeep_sandbox = "on_failure"\n[harnesses.nap]\ncommand = ["sh", "-c", '
                   '"sleep 3"]\n')
    assert status("config") == "timed_out"
    recorded = json.loads((tmp_path / "config" / "config.json").read_text())
    assert (recorded["execution_timeout_s"], recorded["keep_sandbox"], recorded["timeout_s"]) == (1, "on_failure", None)
    assert status("config-flag", "--timeout", "30", "--keep-sandbox", "never") == "completed"
    assert json.loads((tmp_path / "config-flag" / "config.json").read_text())["keep_sandbox"] == "never"


@pytest.mark.parametrize("command, field, value, message", [
    (["tasks", "run"], "keep_sandbox", '"sometimes"', "keep_sandbox must be one of never, on_failure, always, got "
                                                      "'sometimes'"),
    (["tasks", "run"], "execution_timeout_s", "-5", "execution_timeout_s must be a positive number of seconds"),
    (["eval", "--tasks"], "eval_k", '"two"', "eval_k must be an integer, got 'two'"),
    (["eval", "--tasks"], "eval_pass_threshold", "true", "eval_pass_threshold must be a number, got True"),
])
def test_a_bad_config_field_that_tasks_run_and_eval_take_is_one_line_naming_the_file(tmp_path, command, field,
                                                                                        value, message):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "prompt": "Hi.", "target": "x"}) + "\n")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"{field} = {value}\n")
    r = runner.invoke(app, [*command, str(tasks), "--config", str(cfg), "--sandbox", "process",
                            "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    line = one_line_error(r)
    assert line.startswith(f"[error] {cfg}: ") and message in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was made
