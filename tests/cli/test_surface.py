"""One surface over the commands that run tasks (gyre up, tasks run, eval, serve --harness):
one default sandbox rule (podman, else docker, for tasks that run in an image; else process),
explicit flags over the config and the preset, the same --help. Real commands, run in
process; the rule is driven by what is on PATH (a PATH without podman) and by an engine URL
that answers nothing (a socket that is not there), so no container starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.common import sandbox_for
from gyre.cli.main import app
from gyre.cli.upconfig import resolve_config as _resolve_config
from gyre.coordinator.sandbox.base import SandboxError
from gyre.coordinator.sandbox.preflight import default_sandbox
from gyre.coordinator.taskformats import load_task_source
from tests.cli.errors import one_line_error

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "tasks"
runner = CliRunner()


@pytest.fixture
def no_engine(tmp_path, monkeypatch) -> str:
    """A PATH without podman, and the URL of an engine that is not there."""
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    return f"unix://{tmp_path / 'no-docker.sock'}"


@pytest.fixture
def jsonl(tmp_path) -> Path:
    """A gyre task that needs no image."""
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "hello", "prompt": "Write hello to answer.txt.", "target": "hello"}) + "\n")
    return path


@pytest.fixture
def quick(tmp_path) -> Path:
    """A run config with a harness that exits at once."""
    path = tmp_path / "run.toml"
    path.write_text('[harnesses.quick]\ncommand = ["true"]\n')
    return path


# --- the default sandbox rule --------------------------------------------------------------------


def test_the_rule_picks_by_the_tasks_and_what_is_installed(jsonl, no_engine, monkeypatch):
    harbor = load_task_source(EXAMPLES)  # every example runs in its image
    assert default_sandbox(load_task_source(jsonl), source="t") == "process"
    assert default_sandbox([], source="t") == "process"
    with pytest.raises(SandboxError) as e:
        default_sandbox(harbor, source="examples/tasks", url=no_engine)
    assert str(e.value) == (
        "examples/tasks needs a container image (4 of 4 task(s) run in one) and neither podman nor a docker engine "
        "is here: install podman (apt-get install -y podman runc), start docker, or pass --sandbox docker with "
        "--sandbox-url URL")
    monkeypatch.undo()  # the real PATH
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed here")
    assert default_sandbox(harbor, source="examples/tasks") == "podman"


def test_every_command_stops_on_the_same_line_and_makes_nothing(tmp_path, no_engine, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = f"[error] {EXAMPLES} needs a container image (4 of 4 task(s) run in one) and neither podman nor a docker"
    url = ["--sandbox-url", no_engine]
    cases = {"tasks run": ["tasks", "run", str(EXAMPLES), *url],
             "eval": ["eval", "--tasks", str(EXAMPLES), *url],
             "up": ["up", "--tasks", str(EXAMPLES), "--set", f"sandbox_url={no_engine}", "--no-live"]}
    for name, args in cases.items():
        line = one_line_error(runner.invoke(app, args))
        assert line.startswith(want), (name, line)
    assert one_line_error(runner.invoke(app, cases["up"])).endswith("--sandbox docker with --set sandbox_url=URL")
    line = one_line_error(runner.invoke(app, ["serve", "--harness", "demo", "--task-dir", str(EXAMPLES / "sort-csv"),
                                              *url]))
    assert line.startswith(f"[error] --task-dir {EXAMPLES / 'sort-csv'} needs a container image (1 of 1 task(s)"), line
    assert not (tmp_path / "runs").exists()


def test_a_named_sandbox_wins_flag_over_config_over_the_rule(tmp_path, no_engine):
    harbor = load_task_source(EXAMPLES)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'sandbox = "docker"\nsandbox_url = "{no_engine}"\n')
    # The rule would refuse here (no podman, no engine): a named sandbox is not the rule's.
    assert sandbox_for(flag=None, url=None, config=cfg, tasks=harbor, source="x") == ("docker", no_engine)
    assert sandbox_for(flag="podman", url="unix:///x", config=cfg, tasks=harbor, source="x") == ("podman", "unix:///x")
    assert sandbox_for(flag="process", url=None, config=None, tasks=harbor, source="x") == ("process", None)
    bad = tmp_path / "bad.toml"
    bad.write_text('sandbox = "vm"\n')
    line = one_line_error(runner.invoke(app, ["tasks", "run", str(EXAMPLES), "--config", str(bad)]))
    assert line == f"[error] {bad}: sandbox must be one of process, podman, docker, bubblewrap, got 'vm'"
    line = one_line_error(runner.invoke(app, ["eval", "--tasks", str(EXAMPLES), "--sandbox", "vm"]))
    assert line == "[error] --sandbox must be one of process, podman, docker, bubblewrap, got 'vm'"


def test_gyre_up_records_the_sandbox_the_rule_picked(tmp_path, monkeypatch, jsonl):
    monkeypatch.chdir(tmp_path)
    cfg, _, overrides = _resolve_config(None, [], tasks_path=jsonl)
    assert cfg.sandbox == "process" and "sandbox" not in overrides  # picked, not given
    (tmp_path / "run.toml").write_text(f'tasks_path = "{EXAMPLES}"\nsandbox = "bubblewrap"\n')
    assert _resolve_config(tmp_path / "run.toml", [])[0].sandbox == "bubblewrap"
    assert _resolve_config(tmp_path / "run.toml", [], sandbox="docker")[0].sandbox == "docker"
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed here")
    cfg, file_values, overrides = _resolve_config(None, [], tasks_path=EXAMPLES)
    assert cfg.sandbox == "podman" and cfg.to_json()["sandbox"] == "podman"  # config.json says what runs


def test_tasks_without_an_image_run_in_process_sandboxes_by_default(tmp_path, tiny_dir, jsonl, quick):
    """tasks run (once podman's default), eval and serve --harness: no --sandbox, no image: process."""
    common = ["--harness", "quick", "--config", str(quick), "--model", str(tiny_dir)]
    r = runner.invoke(app, ["tasks", "run", str(jsonl), *common, "--run-dir", str(tmp_path / "t"), "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    r = runner.invoke(app, ["eval", "--tasks", str(jsonl), *common, "--run-dir", str(tmp_path / "e"), "--json"])
    assert r.exit_code in (0, 1), r.output[-2000:]  # scored or not: where it ran is the point
    r = runner.invoke(app, ["serve", "--task", "t", *common, "--run-dir", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output[-2000:]
    for name in ("t", "e", "s"):
        assert json.loads((tmp_path / name / "config.json").read_text())["sandbox"] == "process", name


# --- explicit flags over the config and the preset ----------------------------------------------


def test_serve_timeout_beats_the_presets_own(tmp_path, tiny_dir):
    """`gyre serve --harness --timeout` is over a preset's timeout_s (its default of 600 could
    not be told from a flag: the preset's always won) and the preset's over the default: a
    harness that naps 2 s under a preset of 0.5 s times out, and completes with --timeout 30."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('[harnesses.nap]\ncommand = ["sh", "-c", "sleep 2"]\ntimeout_s = 0.5\n')

    def serve(name: str, *flags: str) -> tuple[str, float]:
        run = tmp_path / name
        r = runner.invoke(app, ["serve", "--harness", "nap", "--task", "nap", "--config", str(cfg), "--model",
                                str(tiny_dir), "--run-dir", str(run), *flags])
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert r.exit_code == (0 if summary["status"] == "completed" else 1), r.output[-2000:]
        return summary["status"], json.loads((run / "config.json").read_text())["timeout_s"]

    assert serve("preset") == ("timed_out", 0.5)
    assert serve("flag", "--timeout", "30") == ("completed", 30.0)


def test_timeout_refusals_are_the_same_everywhere(tmp_path, jsonl):
    want = "[error] --timeout must be a positive number of seconds, at most 604800 (a week), got 0"
    for args in (["tasks", "run", str(jsonl)], ["eval", "--tasks", str(jsonl)], ["serve", "--harness", "demo",
                                                                                  "--task", "t"]):
        assert one_line_error(runner.invoke(app, [*args, "--timeout", "0"])) == want, args
    line = one_line_error(runner.invoke(app, ["serve", "--timeout", "5"]))
    assert line == "[error] --timeout is for --harness (without it, serve waits for your own client)"
    assert not (tmp_path / "runs").exists()


def test_the_configs_harness_applies_and_harness_wins(tmp_path, tiny_dir, jsonl):
    """tasks run and eval take --config's harness where no --harness is given (it read "demo"
    before, whatever the config said); --harness wins over it."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('harness = "quick"\n[harnesses.quick]\ncommand = ["true"]\n[harnesses.other]\ncommand = ["true"]\n')

    def harness(*args: str) -> str:
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        r = runner.invoke(app, [*args, "--config", str(cfg), "--model", str(tiny_dir), "--run-dir", str(run),
                                "--json"])
        assert r.exit_code in (0, 1) and (run / "config.json").exists(), r.output[-2000:]
        return json.loads((run / "config.json").read_text())["harness"]

    assert harness("tasks", "run", str(jsonl)) == "quick"
    assert harness("tasks", "run", str(jsonl), "--harness", "other") == "other"
    assert harness("eval", "--tasks", str(jsonl)) == "quick"
    assert harness("eval", "--tasks", str(jsonl), "--harness", "other") == "other"


# --- the same --help ------------------------------------------------------------------------------


def _params(*path: str) -> dict:
    """The click parameters of `gyre PATH...`, by their long flag."""
    import typer

    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {opt: p for p in command.params for opt in p.opts if opt.startswith("--")}


COMMANDS = {("up",): "up", ("serve",): "serve", ("tasks", "run"): "tasks", ("eval",): "eval"}


def test_every_harness_help_lists_the_registrys_presets_and_its_real_run_dir(tmp_path, monkeypatch):
    from gyre.cli.common import default_run_dir
    from gyre.coordinator.harnesses import BUILTIN

    presets = f"({', '.join(BUILTIN)}, or one from the config's [harnesses.NAME])"
    for path, prefix in COMMANDS.items():
        params = _params(*path)
        assert presets in params["--harness"].help, path
        assert f"default: runs/{prefix}-<timestamp>, -2, -3, ... when taken" in params["--run-dir"].help, path
        assert "auto: podman, else docker, when a task runs in a container image" in params["--sandbox"].help, path
        assert default_run_dir(prefix).name.startswith(f"{prefix}-")  # what the command names it
        text = runner.invoke(app, [*path, "--help"], terminal_width=1000).output
        assert presets in text and f"runs/{prefix}-<timestamp>" in text, path
    timeouts = {_params(*path)["--timeout"].help for path in (("serve",), ("tasks", "run"), ("eval",))}
    assert len(timeouts) == 1 and "over the preset's timeout_s" in timeouts.pop()
    # The names the commands really give a default run directory.
    monkeypatch.chdir(tmp_path)
    assert _resolve_config(None, [])[0].run_dir.name.startswith("up-")


def test_tasks_run_names_its_run_directory_as_its_help_says(tmp_path, monkeypatch, tiny_dir, jsonl, quick):
    """runs/tasks-<timestamp> (-2 when taken): each run its own directory."""
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        r = runner.invoke(app, ["tasks", "run", str(jsonl), "--harness", "quick", "--config", str(quick),
                                "--model", str(tiny_dir), "--json"])
        assert r.exit_code == 0, r.output[-2000:]
    made = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(made) == 2 and all(name.startswith("tasks-") for name in made), made


def test_up_ed_sets_the_policys_matched_phi_and_mu(tmp_path, monkeypatch):
    """`gyre up --ed E` is bench/coordinator.py --ed's setting; with --set phi or mu, or a
    negative E, one line and no run directory."""
    from gyre.cli.upconfig import matched as _matched

    monkeypatch.chdir(tmp_path)
    got = {}
    for policy in ("elastic", "colocate", "async", "async-streaming"):
        cfg = _matched(_resolve_config(None, [], policy=policy)[0], 1.5, [])
        got[policy] = (cfg.phi, cfg.mu)
    assert got == {"elastic": (0.5, 3), "colocate": (0.0, 4), "async": (1.5, 1), "async-streaming": (1.5, 1)}
    runner = CliRunner()
    for args, want in ((["--ed", "1", "--set", "mu=2"], "[error] --ed sets phi and mu; --set mu=... too: give one"),
                       (["--ed", "-1"], "[error] --ed: ed must be >= 0, got -1.0")):
        run = tmp_path / "run"
        assert one_line_error(runner.invoke(app, ["up", "--run-dir", str(run), *args])) == want
        assert not run.exists()
