"""A newcomer's first day: what the environment lacks is one line before anything starts,
default run directories never collide, `gyre up` takes --sandbox and --tasks, and a step
that trains nothing says why."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.rundir import fresh
from tests.cli.errors import one_line_error

runner = CliRunner()


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [
    ["up", "--no-live", "--set", "proxy_port={p}"],
    ["up", "--no-live", "--set", "address=tcp://127.0.0.1:{p}"],
    ["serve", "--port", "{p}"],
])
def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path, monkeypatch, taken_port, command):
    """Before: a 111-140-line traceback after the workers started, and a run directory left."""
    monkeypatch.chdir(tmp_path)
    line = one_line_error(runner.invoke(app, [a.format(p=taken_port) for a in command]))
    assert f"port {taken_port} on 127.0.0.1 is in use" in line
    assert not (tmp_path / "runs").exists()


def test_default_run_directories_never_collide(tmp_path, monkeypatch):
    """Two `gyre up` in the same second: the second gets runs/up-<same timestamp>-2."""
    import time

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: fmt.replace("%Y%m%d-%H%M%S", "20261202-150000"))
    seen = []

    def fake_run_up(config, live=False, resume=False):
        seen.append(config)
        return 0

    monkeypatch.setattr("gyre.cli.up.run_up", fake_run_up)
    for _ in range(2):
        r = runner.invoke(app, ["up", "--no-live"])
        assert r.exit_code == 0, r.output
    first, second = (c.run_dir for c in seen)
    assert first == tmp_path / "runs" / "up-20261202-150000"
    assert second == tmp_path / "runs" / "up-20261202-150000-2"
    assert seen[1].model_dir == second / "model" and (second / "model" / "config.json").is_file()


def test_fresh_makes_a_new_directory_each_time(tmp_path):
    made = [fresh(tmp_path / "runs" / "up-x") for _ in range(3)]
    assert [p.name for p in made] == ["up-x", "up-x-2", "up-x-3"] and all(p.is_dir() for p in made)


def test_up_takes_sandbox_and_tasks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "prompt": "say hi"}) + "\n")
    seen = {}
    monkeypatch.setattr("gyre.cli.up.run_up", lambda config, live=False, resume=False: seen.setdefault("c", config)
                        and 0)
    r = runner.invoke(app, ["up", "--no-live", "--run-dir", "r", "--sandbox", "process", "--tasks", "tasks.jsonl"])
    assert r.exit_code == 0, r.output
    assert seen["c"].sandbox == "process" and seen["c"].tasks_path == tmp_path / "tasks.jsonl"
    line = one_line_error(runner.invoke(app, ["up", "--no-live", "--run-dir", "r2", "--sandbox", "nope"]))
    assert "sandbox must be one of" in line and not (tmp_path / "r2").exists()


def test_a_steps_line_carries_its_diagnosis():
    """The step line ends with the step's note (coordinator/diagnosis.py; its cases are in
    tests/coordinator/test_diagnosis.py), and with nothing when there is nothing to say."""
    from gyre.cli.up import _why_flat
    from gyre.coordinator.report import StepReport

    report = StepReport(step=1, version=0, reward_mean=0.25, reward_valid_frac=1.0, staleness_mean=0.0, groups=2,
                        executions=6, tokens_trained=0, cells_training=1, loss=0.0, seconds=1.0,
                        equal_reward_groups=2, trained=False,
                        note="nothing trained: 2 of 2 groups scored alike (zero advantage, every reward 0.250)")
    assert _why_flat(report) == "  (nothing trained: 2 of 2 groups scored alike (zero advantage, every reward 0.250))"
    assert _why_flat(StepReport(**{**report.__dict__, "note": ""})) == ""


def test_the_resume_hint_names_the_run_as_typed(tmp_path, monkeypatch):
    from gyre.cli.up import shown

    monkeypatch.chdir(tmp_path)
    assert shown(tmp_path / "runs" / "a") == str(Path("runs") / "a")
    assert shown(Path("/elsewhere/run")) == "/elsewhere/run"


@pytest.mark.parametrize("args, says", [
    (["--sandbox", "bubblewrap"], "sandbox bubblewrap: the `bwrap` command is not on PATH"),
    (["--sandbox", "podman"], "sandbox podman: the `podman` command is not on PATH"),
    (["--sandbox", "process", "--tasks", "EXAMPLES"], "sandbox 'process' runs no images"),
    # No --sandbox: the default rule wants a container for tasks with an image, and none is here.
    (["--tasks", "EXAMPLES"], "needs a container image (4 of 4 task(s) run in one) and neither podman nor a docker "
                              "engine is here"),
])
def test_a_missing_sandbox_backend_is_one_line_before_anything_starts(tmp_path, monkeypatch, args, says):
    """Before: found after the workers started (25-46 s), leaving a run directory that a retry
    then refused as 'a run that crashed'."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # python and gyre, no podman or bwrap
    examples = Path(__file__).parents[2] / "examples" / "tasks"
    args = [str(examples) if a == "EXAMPLES" else a for a in args]
    assert says in one_line_error(runner.invoke(app, ["up", "--no-live", *args]))
    assert not (tmp_path / "runs").exists()


def test_a_moved_run_directory_resumes_with_its_own_model(tmp_path):
    """config.json names the embedded model by its absolute path inside the old run directory."""
    from gyre.cli.upconfig import moved_model as _moved_model

    run = tmp_path / "new"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_dir": "/old/run", "model_dir": "/old/run/model"}))
    assert _moved_model(run) == run / "model"
    (run / "config.json").write_text(json.dumps({"run_dir": "/old/run", "model_dir": "/models/smollm2"}))
    assert _moved_model(run) is None  # a model of its own stays where it is


def test_a_config_with_a_damaged_steps_field_has_an_unknown_target(tmp_path):
    from gyre.coordinator.rundir import state

    (tmp_path / "config.json").write_text(json.dumps({"steps": "five"}))
    assert state(tmp_path).steps_target is None  # before: a TypeError traceback from `gyre up`
