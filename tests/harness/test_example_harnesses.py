"""examples/harnesses/codex.toml as a user runs it: Codex installed with npm (its node launcher on
PATH, as `npm install -g` leaves it), the example file's preset, a task's podman container with no
node in it and nothing built by hand, the task's own verifier. The engine is scripted; Codex, the
proxy and the container are the real ones. (claude-code.toml: tests/harness/test_claude_code_sandbox.py.)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gyre.coordinator.harnesses import HarnessError, npm_native, resolve
from gyre.coordinator.runconfig import load_config_file
from gyre.coordinator.serve import run_harness_once
from gyre.coordinator.taskformats import load_harbor_task
from tests.harness.test_codex import PATCH, proxy  # noqa: F401  (the fixture)
from tests.sandbox.conftest import harbor_task, podman_ready  # noqa: F401  (the fixture)
from tests.scripted import tool_call

REPO = Path(__file__).resolve().parents[2]


def example(name: str):
    """The preset of examples/harnesses/NAME.toml, resolved as gyre tasks run / up resolve it."""
    values = load_config_file(REPO / "examples" / "harnesses" / f"{name}.toml")
    assert values["sandbox"] == "podman"
    return resolve(values["harness"], values.get("harnesses", {}))


def on_path(monkeypatch, tmp_path: Path, binary: Path, name: str) -> Path:
    """PATH as `npm install -g` leaves it: node_modules/.bin (the launcher) first where the
    binary came from npm, else a folder holding a link to the binary given."""
    modules = next((p for p in binary.parents if p.name == "node_modules"), None)
    folder = modules / ".bin" if modules is not None and (modules / ".bin" / name).exists() else tmp_path / "bin"
    if folder == tmp_path / "bin":
        folder.mkdir()
        (folder / name).symlink_to(binary)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder / name


def verifier(path: str, text: str) -> str:
    reward = "/logs/verifier/reward.txt"
    return f'[ "$(cat {path})" = "{text}" ] && echo 1 > {reward} || echo 0 > {reward}\n'


@pytest.mark.sandbox
@pytest.mark.timeout(300)
async def test_the_codex_example_works_a_task_in_podman_from_its_npm_install(proxy, codex_bin, podman_ready,
                                                                           tmp_path, monkeypatch):
    server, engine = proxy
    on_path(monkeypatch, tmp_path, codex_bin, "codex")
    preset = example("codex")
    assert preset.missing(contained=True) is None
    (mounted,) = preset.in_sandbox()[1]  # npm's launcher is a node script: its native binary goes in
    assert Path(mounted).read_bytes()[:4] == b"\x7fELF"
    call = tool_call("apply_patch", input=PATCH)
    engine.script = lambda prompt: "Done: hello.txt written." if "Success. Updated" in prompt else call
    task = load_harbor_task(harbor_task(tmp_path, "hello", test_sh=verifier("/app/hello.txt", "hello from gyre")))
    summary = await run_harness_once(server, preset, "", run_dir=server.run_dir, execution="cx", task=task,
                                     sandbox="podman")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed" and summary["score"] == 1.0, (summary, log[-3000:])
    ex = server.executions["cx"]
    assert len(ex.calls) == 2 and {c["status"] for c in ex.calls} == {"ok"}
    assert (server.run_dir / "executions" / "cx" / "workspace" / "hello.txt").read_text() == "hello from gyre\n"


def _package(root: Path, launcher: str = "#!/usr/bin/env node\nimport './x.js';\n", native: bool = True) -> Path:
    """node_modules with @acme/agent's launcher (bin/agent.js, linked from .bin/agent) and,
    where `native`, its platform package's binary (an ELF: a copy of this host's `true`)."""
    modules = root / "node_modules"
    script = modules / "@acme" / "agent" / "bin" / "agent.js"
    script.parent.mkdir(parents=True)
    script.write_text(launcher)
    script.chmod(0o755)
    (modules / ".bin").mkdir()
    (modules / ".bin" / "agent").symlink_to(script)
    if native:
        arch = {"x86_64": "x64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
        binary = modules / "@acme" / f"agent-linux-{arch}" / "vendor" / "triple" / "bin" / "agent"
        binary.parent.mkdir(parents=True)
        shutil.copy(shutil.which("true"), binary)
        (binary.parent / "agent-helper").write_bytes(b"\x7fELF not this one")
    return modules / ".bin" / "agent"


def test_a_node_launcher_is_mounted_as_its_native_binary_and_refused_without_one(tmp_path):
    found = _package(tmp_path / "a")
    p = resolve("agent", {"agent": {"command": [str(found), "{task}"]}})
    inside, mounts = p.in_sandbox()
    native = next(iter(mounts))
    assert native.endswith("/vendor/triple/bin/agent") and mounts[native] == "/opt/gyre/bin/agent"
    assert inside.command == ("/opt/gyre/bin/agent", "{task}")
    assert p.missing(contained=True) is None
    # No platform package beside it: one line naming the preset, the script and the fix.
    bare = resolve("bare", {"bare": {"command": [str(_package(tmp_path / "b", native=False))]}})
    why = bare.missing(contained=True)
    assert why.startswith("harness preset 'bare': ") and "is a node script" in why and "sandbox_command" in why
    assert bare.missing(contained=False) is None  # on the host, node runs it
    with pytest.raises(HarnessError, match="native binary"):
        bare.in_sandbox()
    # A script for an interpreter the image has (python3), or a binary, is mounted as it is.
    script = tmp_path / "agent.py"
    script.write_text("#!/usr/bin/env python3\nprint('hi')\n")
    assert npm_native(str(script), "p") == str(script)
    binary = os.path.realpath(shutil.which("true"))
    assert npm_native(binary, "p") == binary
