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
from gyre.coordinator.runconfig import ConfigError, build_config


def test_builtins_name_command_env_api_rule():
    cc = resolve("claude-code")
    assert cc.api == "anthropic" and cc.role_rule == "claude-code" and cc.command[0] == "claude"
    assert cc.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and "npm install" in cc.install
    argv, env, files = cc.expand(task="do it", workspace="/w", execution="e", state="/s", base_url="http://h",
                                 openai_base_url="http://h/v1", api_key="k", timeout_ms="1800000")
    assert argv[:3] == ["claude", "-p", "do it"] and files == {}
    assert env["ANTHROPIC_MODEL"] == "gyre-policy" and env["CLAUDE_CONFIG_DIR"] == "/s/claude"
    assert env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] == "1800000"  # its watchdog waits the whole deadline
    assert resolve("demo").role_rule == "generic"
    assert set(BUILTIN) == {"demo", "claude-code", "codex", "openai-compatible"}
    with pytest.raises(HarnessError, match="command.*empty"):
        resolve("openai-compatible")  # needs the user's command


def test_the_codex_preset_writes_its_own_codex_home():
    import tomllib

    cx = resolve("codex")
    assert (cx.api, cx.model, cx.command[:2], cx.role_rule) == ("responses", "gpt-5.5", ("codex", "exec"), "codex")
    argv, env, files = cx.expand(task="fix it", workspace="/w", execution="e", state="/s", base_url="http://h",
                                 openai_base_url="http://h/v1", api_key="k", timeout_ms="60000")
    assert argv == ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "-C", "/w",
                    "fix it"]
    assert env == {"CODEX_HOME": "/s/codex"}
    config = tomllib.loads(files["codex/config.toml"])
    assert (config["model"], config["model_provider"], config["web_search"]) == ("gpt-5.5", "gyre", "disabled")
    assert config["model_providers"]["gyre"] == {
        "name": "gyre", "base_url": "http://h/v1", "wire_api": "responses", "env_key": "OPENAI_API_KEY",
        "request_max_retries": 6, "stream_max_retries": 6, "stream_idle_timeout_ms": 300000}
    assert config["analytics"] == {"enabled": False}
    # Retries that outlast a coordinator's restart, and end (docs/harnesses.md).
    assert config["features"] == {"plugins": False, "unbounded_connection_retries": False}
    quick = resolve("cx", {"cx": {"extends": "codex", "idle_timeout_s": 3}})
    assert "stream_idle_timeout_ms = 3000" in quick.expand(
        task="t", workspace="/w", execution="e", state="/s", base_url="b", openai_base_url="o", api_key="k",
        timeout_ms="1")[2]["codex/config.toml"]


def test_extends_works_for_any_preset_the_child_completing_the_parent():
    user = {"mine": {"extends": "openai-compatible", "command": ["my-agent", "{task}"]},
            "mine2": {"extends": "mine", "env": {"X": "1"}, "files": {"conf/a.toml": "k = 1"}}}
    mine = resolve("mine", user)  # its parent alone has no command: only the finished preset is checked
    assert mine.command == ("my-agent", "{task}") and mine.env["OPENAI_API_BASE"] == "{openai_base_url}"
    mine2 = resolve("mine2", user)
    assert mine2.command == mine.command and mine2.env["X"] == "1" and mine2.files == {"conf/a.toml": "k = 1"}
    with pytest.raises(HarnessError, match="inside the state folder"):
        resolve("bad", {"bad": {"command": ["x"], "files": {"../escape": "x"}}})


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
    assert set(presets(user)) == {"demo", "claude-code", "codex", "openai-compatible", "cc-fast", "mine"}


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
    assert r.exit_code == 0 and json.loads(r.output)["executions"][0]["calls"] == summary["calls"]


# (Braces doubled: a preset's argv is a format string, {state} and the like are placeholders.)
PROBE = """import json, os, sys
state = sys.argv[1]
out = {{k: os.environ[k] for k in os.environ if k.startswith("XDG_") or k == "PROBE_HOME"}}
out["file"] = open(os.path.join(state, "probe", "conf.txt")).read()
open("probe.json", "w").write(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_a_preset_gets_its_files_and_its_own_state_folders(tmp_path):
    """Files written under {state} with placeholders filled, and XDG homes per execution."""
    cfg = tmp_path / "run.toml"
    cfg.write_text("[harnesses.probe]\n" + f"command = {json.dumps([sys.executable, '-c', PROBE, '{state}'])}\n"
                   'env = { PROBE_HOME = "{state}/home" }\n'
                   'files = { "probe/conf.txt" = "url={openai_base_url} deadline={timeout_ms}" }\n')
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "gyre.cli", "serve", "--run-dir", str(run), "--harness", "probe",
                        "--task", "t", "--config", str(cfg), "--timeout", "120"], capture_output=True, text=True,
                       timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    folder = run / "executions" / "serve"
    probe = json.loads((folder / "workspace" / "probe.json").read_text())
    state = folder / "harness-state"
    assert probe["PROBE_HOME"] == str(state / "home")
    assert {probe[f"XDG_{k}_HOME"] for k in ("CONFIG", "DATA", "CACHE", "STATE")} == {
        str(state / "xdg" / k) for k in ("config", "data", "cache", "state")}
    url, deadline = probe["file"].split()
    assert url.startswith("url=http://127.0.0.1:") and url.endswith("/v1") and deadline == "deadline=120000"


def test_the_codex_rule_knows_its_compactions():
    from gyre.proxy.roles import CallInfo, rule

    codex = rule("codex")

    def role(headers, last_user="go on", root=0):
        return codex.classify(CallInfo(root=root, model="gpt-5.5", has_tools=True, last_user=last_user,
                                       first_model="gpt-5.5", first_root_has_tools=True, headers=headers))

    meta = {"X-Codex-Turn-Metadata": json.dumps({"request_kind": "compaction", "turn_id": "t1"})}
    assert role(meta) == "main-summary" and role(meta, root=1) == "sub-agent-summary"
    assert role({}, "You are performing a CONTEXT CHECKPOINT COMPACTION. Summarize.") == "main-summary"
    assert role({"x-codex-turn-metadata": json.dumps({"request_kind": "turn"})}) == "main"
    assert role({"x-codex-turn-metadata": "not json"}) == "main"
