"""A pip-installed agent CLI as a folder for containers (sandbox/agentdir.py): the cache key
follows everything that shapes the folder, a finished folder is reused without pip, pip's
failure is one line naming the preset and the package, and the console scripts are rewritten
for the image's python3 (their own sys.path, exit 127 on another Python version). pip itself
is faked at the edge: the real install is the sandbox tier's (tests/sandbox/test_agent_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.coordinator.sandbox import agentdir
from gyre.coordinator.sandbox.agentdir import AGENT_INSIDE, AgentInstallError, agent_dir, agent_key
from gyre.coordinator.sandbox.images import BASE_PYTHON


def test_the_key_follows_the_spec_and_names_the_package():
    key = agent_key(["mini-swe-agent==2.4.6"], "3.11", "x86_64")
    assert key.startswith("mini-swe-agent-") and key == agent_key(["mini-swe-agent==2.4.6"], "3.11", "x86_64")
    others = {agent_key(["mini-swe-agent==2.4.5"], "3.11", "x86_64"), agent_key(["mini-swe-agent==2.4.6"], "3.12",
              "x86_64"), agent_key(["mini-swe-agent==2.4.6"], "3.11", "aarch64"),
              agent_key(["mini-swe-agent==2.4.6", "rich"], "3.11", "x86_64")}
    assert key not in others and len(others) == 4
    assert agent_key(["Aider-Chat[extra]>=0.1"], "3.11").startswith("aider-chat-")


def test_every_manylinux_up_to_the_images_glibc_is_named_to_pip():
    """pip given --platform takes exactly the tags named: tiktoken 0.12.0's one Linux wheel is
    manylinux_2_28, which naming only manylinux_2_36 and manylinux2014 refused (aider-chat)."""
    tags = agentdir.platforms("x86_64")
    for tag in ("manylinux_2_36_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux_2_5_x86_64",
                "manylinux2014_x86_64", "manylinux1_x86_64"):
        assert tag in tags
    assert not any(t.startswith("manylinux_2_37") or "aarch64" in t for t in tags)


def test_the_default_python_is_the_base_images():
    from gyre.coordinator.harnesses import HarnessPreset

    assert HarnessPreset(name="x", command=("x",)).sandbox_python == BASE_PYTHON


def test_a_finished_folder_is_reused_without_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_IMAGE_CACHE", str(tmp_path))
    done = tmp_path / "agents" / agent_key(["a==1"], "3.11")
    done.mkdir(parents=True)
    (done / "gyre-agent.json").write_text("{}")
    monkeypatch.setattr(agentdir, "_install", lambda *a: pytest.fail("installed again"))
    assert agent_dir("p", ["a==1"], "3.11") == done


def test_an_unfinished_folder_is_installed_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_IMAGE_CACHE", str(tmp_path))
    half = tmp_path / "agents" / agent_key(["a==1"], "3.11")
    (half / "lib").mkdir(parents=True)  # an install that died before gyre-agent.json
    calls = []

    def install(preset, packages, python, out):
        assert not out.exists()  # the half-made folder went first
        calls.append((preset, packages, python))
        out.mkdir()
        (out / "gyre-agent.json").write_text("{}")

    monkeypatch.setattr(agentdir, "_install", install)
    assert agent_dir("p", ["a==1"], "3.11") == half and calls == [("p", ["a==1"], "3.11")]


def fake_pip(tmp_path, script: str) -> list[str]:
    path = tmp_path / "pip.py"
    path.write_text(script)
    return [sys.executable, str(path)]


def test_a_pip_failure_is_one_line_naming_the_preset_and_package(tmp_path):
    argv = fake_pip(tmp_path, "print('Collecting nope==9')\n"
                              "print('ERROR: No matching distribution found for nope==9')\nraise SystemExit(1)\n")
    with pytest.raises(AgentInstallError) as e:
        agentdir._pip(argv, "harness preset 'mine'", ["nope==9"], "3.11", 0.0)
    assert str(e.value) == ("harness preset 'mine': pip could not install nope==9 for Python 3.11 (sandbox_pip): "
                            "No matching distribution found for nope==9")


def test_an_install_writes_the_folder_and_its_record(tmp_path, monkeypatch):
    """The whole _install with pip's argv checked and its work faked: lib/, bin/ wrappers,
    gyre-agent.json, a folder others may read, nothing left beside it."""
    seen = []

    def pip(argv, where, packages, python, start):
        seen.append(argv)
        lib = argv[argv.index("--target") + 1]
        (Path(lib) / "bin").mkdir(parents=True)
        (Path(lib) / "bin" / "mini").write_text("#!/host/python\nimport sys\nprint('hi')\n")
        (Path(lib) / "mini_swe_agent-2.4.6.dist-info").mkdir()

    monkeypatch.setattr(agentdir, "_pip", pip)
    out = tmp_path / "agents" / "mini-x"
    out.parent.mkdir()
    agentdir._install("mine", ["mini-swe-agent==2.4.6"], "3.11", out)
    argv = seen[0]
    assert argv[1:4] == ["-m", "pip", "install"] and "--only-binary=:all:" in argv and argv[-2:] == [
        "--", "mini-swe-agent==2.4.6"]
    assert argv[argv.index("--python-version") + 1] == "3.11" and argv[argv.index("--abi") + 1] == "cp311"
    record = json.loads((out / "gyre-agent.json").read_text())
    assert record["installed"] == {"mini_swe_agent": "2.4.6"} and record["scripts"] == ["mini"]
    assert (out / "bin" / "mini").read_text().startswith("#!/usr/bin/env python3\n")
    assert out.stat().st_mode & 0o755 == 0o755 and [p.name for p in out.parent.iterdir()] == ["mini-x"]


def test_scripts_run_on_the_images_python_with_their_own_path(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "bin"
    src.mkdir()
    (src / "tool").write_text("#!/host/venv/bin/python\nimport sys\nprint(sys.path[0])\n")
    long = "#!/bin/sh\n'''exec' /a/very/long/python \"$0\" \"$@\"\n' '''\nimport sys\nprint(sys.path[0])\n"
    (src / "long").write_text(long)
    (src / "shell").write_text("#!/bin/sh\necho hi\n")
    (src / "__pycache__").mkdir()  # pip compiled a package's .py script (mini-swe-agent's install has one)
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert agentdir._wrap_scripts(src, dest, mine) == ["long", "tool"]
    for name in ("long", "tool"):
        r = subprocess.run([sys.executable, str(dest / name)], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == f"{AGENT_INSIDE}/lib", r.stderr
    other = tmp_path / "other"
    agentdir._wrap_scripts(src, other, "3.99")
    r = subprocess.run([sys.executable, str(other / "tool")], capture_output=True, text=True)
    assert r.returncode == 127  # cannot start: an infrastructure failure, never the agent's zero
    assert f"installed for Python 3.99; this image's python3 is {mine}" in r.stderr


async def test_the_launcher_installs_once_before_the_slot_and_fails_every_task_with_pips_error(monkeypatch, tmp_path):
    from gyre.coordinator.harnesses import resolve
    from gyre.coordinator.launcher import Launcher, LaunchSpec
    from gyre.coordinator.sandbox import make_backend
    from gyre.coordinator.tasks import Task

    mini = resolve("mini", {"mini": {"sandbox_pip": ["a==1"], "sandbox_command": [f"{AGENT_INSIDE}/bin/a"]}})
    calls = []

    def install(preset, packages, python):
        calls.append((preset, tuple(packages), python))
        return tmp_path / "agent"

    monkeypatch.setattr(agentdir, "agent_dir", install)

    def launcher(**kw):
        spec = LaunchSpec(preset=mini, timeout_s=1, eval_attempts=1, eval_budget_s=1, **kw)
        return Launcher(None, tmp_path, spec, backend=make_backend("podman"))  # not opened: nothing runs

    one = launcher()
    await one.images.prepare(Task(id="t1", prompt="p"))
    await one.images.prepare(Task(id="t2", prompt="p"))
    assert calls == [("mini", ("a==1",), "3.11")]  # once per launcher (and per spec on disk)
    await launcher(solution=True).images.prepare(Task(id="t1", prompt="p"))
    assert len(calls) == 1  # a --solution run runs no harness

    def broken(preset, packages, python):
        raise AgentInstallError(f"harness preset {preset!r}: pip could not install a==1 for Python 3.11 "
                                "(sandbox_pip): no such version")

    monkeypatch.setattr(agentdir, "agent_dir", broken)
    two = launcher()
    with pytest.raises(AgentInstallError, match="'mini': pip could not install a==1"):
        await two.images.prepare(Task(id="t1", prompt="p"))
    assert two.images.state(Task(id="t1", prompt="p")) == "failed"  # the execution ends aborted_infra, named
