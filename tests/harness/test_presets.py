"""Harness presets as data: built-ins, user presets from a config file, clear errors, and
`gyre serve --harness` running one execution that `gyre inspect` shows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.harnesses import BUILTIN, HarnessError, presets, resolve
from gyre.coordinator.up import ConfigError, build_config


def test_builtins_name_command_env_api_rule():
    cc = resolve("claude-code")
    assert cc.api == "anthropic" and cc.role_rule == "claude-code" and cc.command[0] == "claude"
    assert cc.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and "npm install" in cc.install
    argv, env = cc.expand(task="do it", workspace="/w", execution="e", state="/s", base_url="http://h",
                          openai_base_url="http://h/v1", api_key="k")
    assert argv[:3] == ["claude", "-p", "do it"]
    assert env["ANTHROPIC_MODEL"] == "gyre-policy" and env["CLAUDE_CONFIG_DIR"] == "/s/claude"
    assert resolve("demo").role_rule == "generic" and set(BUILTIN) == {"demo", "claude-code", "openai-compatible"}
    with pytest.raises(HarnessError, match="command.*empty"):
        resolve("openai-compatible")  # needs the user's command


def test_user_presets_extend_and_override():
    user = {
        "openai-compatible": {"command": ["my-agent", "--url", "{openai_base_url}", "{task}"], "timeout_s": 30},
        "cc-fast": {"extends": "claude-code", "env": {"MAX_THINKING_TOKENS": "0"}, "timeout_s": 60},
        "mine": {"command": ["./run.sh"], "api": "responses"},
    }
    oc = resolve("openai-compatible", user)
    assert oc.command[0] == "my-agent" and oc.timeout_s == 30 and oc.env["OPENAI_API_BASE"] == "{openai_base_url}"
    fast = resolve("cc-fast", user)
    assert fast.role_rule == "claude-code" and fast.env["MAX_THINKING_TOKENS"] == "0"
    assert fast.env["IS_SANDBOX"] == "1"  # env tables merge over the base's
    assert resolve("mine", user).api == "responses" and resolve("mine", user).role_rule == "generic"
    assert resolve(("python", "agent.py")).command == ("python", "agent.py")
    assert set(presets(user)) == {"demo", "claude-code", "openai-compatible", "cc-fast", "mine"}


@pytest.mark.parametrize("table, message", [
    ({"command": "claude -p"}, "command must be a list of strings"),
    ({"command": ["x"], "api": "grpc"}, "api must be one of"),
    ({"command": ["x"], "role_rule": "nope"}, "role_rule must be one of"),
    ({"command": ["x", "{taks}"]}, r"unknown placeholder \{taks\}"),
    ({"command": ["x"], "timeout": 3}, "unknown field.*timeout"),
    ({"extends": "ghost"}, "extends unknown preset 'ghost'"),
    ({"command": ["x"], "timeout_s": 0}, "timeout_s must be > 0"),
])
def test_bad_presets_name_the_field(table, message):
    with pytest.raises(HarnessError, match=message):
        resolve("bad", {"bad": table})


def test_run_config_selects_and_validates_the_harness(tmp_path):
    base = {"run_dir": tmp_path, "model_dir": tmp_path}
    cfg = build_config({"harness": "mine", "harnesses": {"mine": {"command": ["./a"]}}}, base)
    assert cfg.preset().command == ("./a",) and cfg.to_json()["harness"] == "mine"
    assert build_config({"harness": ["python", "x.py"]}, base).preset().name == "command"
    with pytest.raises(ConfigError, match="unknown harness 'nope'"):
        build_config({"harness": "nope"}, base)


def test_harnesses_command_lists_presets(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[harnesses.mine]\ncommand = ["./agent", "{task}"]\n')
    r = CliRunner().invoke(app, ["harnesses", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "claude-code: api anthropic, role rule claude-code" in r.output and "mine: api any" in r.output
    assert "openai-compatible: unusable" in r.output


def test_serve_harness_needs_a_task_and_an_installed_command(tmp_path):
    r = CliRunner().invoke(app, ["serve", "--harness", "demo", "--run-dir", str(tmp_path)])
    assert r.exit_code == 1 and "--harness needs --task" in r.output
    cfg = tmp_path / "run.toml"
    cfg.write_text('[harnesses.ghost]\ncommand = ["gyre-no-such-agent"]\n')
    r = CliRunner().invoke(app, ["serve", "--harness", "ghost", "--task", "x", "--config", str(cfg),
                                 "--run-dir", str(tmp_path)])
    assert r.exit_code == 1 and "'gyre-no-such-agent' is not on PATH" in r.output


@pytest.mark.timeout(180)
def test_serve_runs_the_demo_harness_once(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "gyre.cli", "serve", "--run-dir", str(run), "--harness", "demo",
                        "--task", "Write hello to a.txt"], capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["harness"] == "demo" and summary["calls"] >= 1
    assert summary["roles"] == {"main": summary["calls"]}
    assert json.loads((run / "executions" / "serve" / "summary.json").read_text()) == summary
    r = CliRunner().invoke(app, ["inspect", str(run), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)[0]["calls"] == summary["calls"]
