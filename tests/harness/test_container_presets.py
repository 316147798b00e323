"""Presets that run in a container: sandbox_command, mounts and sandbox_pip checked as fields,
a container-only preset (no host command) refused where nothing runs images and never
refused for a host command it does not need, advice naming the user's preset, and the
shipped examples/harnesses files resolving."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from gyre.cli.common import check_installed
from gyre.coordinator.harnesses import HarnessError, resolve
from gyre.coordinator.runconfig import ConfigError, build_config, load_config_file
from gyre.coordinator.sandbox.agentdir import AGENT_INSIDE

REPO = Path(__file__).resolve().parents[2]
MINI = {"sandbox_pip": ["mini-swe-agent==2.4.6"], "sandbox_command": [f"{AGENT_INSIDE}/bin/mini", "-t", "{task}"]}


def test_a_preset_with_only_a_sandbox_command_runs_only_in_a_container():
    p = resolve("mini", {"mini": MINI})
    assert p.container_only and p.command == () and p.sandbox_pip == ("mini-swe-agent==2.4.6",)
    assert p.missing(contained=True) is None
    assert "runs only in a container" in p.missing(contained=False) and "'mini'" in p.missing(contained=False)
    inside, mounts = p.in_sandbox("/cache/agents/mini-abc")
    assert inside.command == (f"{AGENT_INSIDE}/bin/mini", "-t", "{task}") and mounts == {
        "/cache/agents/mini-abc": AGENT_INSIDE}
    with pytest.raises(HarnessError, match="not installed"):
        p.in_sandbox()


def test_a_host_command_is_not_needed_where_the_sandbox_command_runs():
    p = resolve("cc", {"cc": {"extends": "claude-code", "command": ["gyre-no-such-claude", "-p", "{task}"],
                              "sandbox_command": ["claude", "-p", "{task}"]}})
    assert p.missing(contained=True) is None  # checked in the image at launch, not here
    why = p.missing(contained=False)
    assert why.startswith("harness preset 'cc': 'gyre-no-such-claude' is not on PATH")
    assert "[harnesses.cc]" in why and "[harnesses.claude-code]" not in why  # the user's preset, not its parent
    check_installed(p, "podman")  # no refusal
    with pytest.raises(typer.Exit):
        check_installed(p, "process")


@pytest.mark.parametrize("table, message", [
    ({"sandbox_pip": ["a==1"], "command": ["a"]}, "sandbox_pip needs sandbox_command"),
    ({**MINI, "sandbox_pip": ["--index-url=http://x", "a"]}, "requirement specifiers.*not pip options"),
    ({**MINI, "sandbox_pip": "mini-swe-agent"}, "sandbox_pip must be a list of strings"),
    ({**MINI, "sandbox_python": "3"}, "sandbox_python is the image's Python as MAJOR.MINOR"),
    ({**MINI, "sandbox_python": 3.11}, "sandbox_python must be a string"),
    ({**MINI, "mounts": {"/host/x": AGENT_INSIDE + "/lib"}}, "a mount inside /opt/gyre/agent"),
    ({"command": ["a"], "mounts": {"rel/x": "/opt/x"}}, "absolute host path to an absolute path inside"),
    ({"command": ["a"], "mounts": {"/x": "opt/x"}}, "absolute host path to an absolute path inside"),
    ({"sandbox_command": ["a", "{taks}"]}, r"unknown placeholder \{taks\}"),
    ({"env": {"A": "1"}}, "command` is empty.*or sandbox_command"),
])
def test_bad_container_fields_name_the_preset_and_field(table, message):
    with pytest.raises(HarnessError, match=message) as e:
        resolve("bad", {"bad": table})
    assert "'bad'" in str(e.value)


def test_the_run_config_refuses_a_container_only_preset_outside_a_container(tmp_path):
    base = {"run_dir": tmp_path, "model_dir": tmp_path}
    with pytest.raises(ConfigError, match="'mini' runs only in a container"):
        build_config({"harness": "mini", "harnesses": {"mini": MINI}}, base)
    cfg = build_config({"harness": "mini", "sandbox": "podman", "harnesses": {"mini": MINI}}, base)
    assert cfg.preset().container_only


def test_the_mini_swe_agent_example_resolves_as_documented():
    path = REPO / "examples" / "harnesses" / "mini-swe-agent.toml"
    values = load_config_file(path)
    assert (values["harness"], values["sandbox"]) == ("mini-swe-agent", "podman")
    p = resolve("mini-swe-agent", values["harnesses"])
    assert p.container_only and p.sandbox_pip == ("mini-swe-agent==2.4.6",) and p.api == "openai"
    argv, env, _ = p.in_sandbox("/agent")[0].expand(
        task="sort it", workspace="/app", execution="e", state="/s", base_url="http://r", openai_base_url="http://r/v1",
        api_key="k", timeout_ms="1000")
    assert argv[0] == f"{AGENT_INSIDE}/bin/mini" and argv[argv.index("--task") + 1] == "sort it"
    assert "model.model_kwargs.api_base=http://r/v1" in argv and argv[argv.index("--model") + 1] == "openai/gyre-policy"
    assert argv[argv.index("--output") + 1] == "/s/mini/trajectory.traj.json"
    assert env["MSWEA_CONFIGURED"] == "1" and env["MSWEA_GLOBAL_CONFIG_DIR"] == "/s/mini"
