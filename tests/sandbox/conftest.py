"""The sandbox tier: real containers (rootful podman with runc, through gyre's own podman
service and containers.conf) and bubblewrap. Every test here carries the `sandbox` marker:
`python -m pytest -m sandbox` runs the tier alone. Where the machine cannot run containers
(no podman, not root, the engine refuses) the tests skip with a one-line reason; gyre's base
image is built once per machine (debootstrap, about a minute) and its root's tar cached."""

from __future__ import annotations

import asyncio
import os
import shutil
import textwrap
from pathlib import Path

import pytest

from gyre.coordinator.sandbox.base import SandboxError

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.sandbox)


def _why_not_podman() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install -y podman runc)"
    if os.geteuid() != 0:
        return "the container tests use rootful podman: run them as root"
    return None


@pytest.fixture(scope="session")
def podman_ready() -> None:
    """Skips unless podman runs containers here; builds gyre's base image once."""
    why = _why_not_podman()
    if why:
        pytest.skip(why)
    from gyre.coordinator.sandbox import images
    from gyre.coordinator.sandbox.podman import PodmanBackend

    async def ensure() -> None:
        backend = PodmanBackend()
        await backend.open()
        try:
            await images.ensure_base(backend)
        finally:
            await backend.close()

    try:
        asyncio.run(ensure())
    except SandboxError as e:
        pytest.skip(f"podman cannot run containers here: {e}")


@pytest.fixture
async def podman(podman_ready):
    from gyre.coordinator.sandbox.podman import PodmanBackend

    backend = PodmanBackend()
    await backend.open()
    yield backend
    await backend.close()


@pytest.fixture(scope="session")
def bwrap_ready() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if os.geteuid() != 0 or shutil.which("nsenter") is None:
        pytest.skip("the bubblewrap backend's proxy-only network needs root and nsenter")


@pytest.fixture
async def scripted_proxy(chat_tokenizer, tmp_path):
    """A live proxy whose engine is the scripted responder (every answer "Done.")."""
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from tests.scripted import ScriptedEngine
    from tests.support import ThreadEngineBackend

    engine = ScriptedEngine(chat_tokenizer, tokens_per_step=16)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(chat_tokenizer, backend, ProxyConfig(max_context=1 << 16), run_dir=tmp_path / "run")
    await server.start()
    yield server
    await server.stop()
    backend.close()


# A harness step that calls the proxy once through the OpenAI variables, with the stdlib only.
CALL_PROXY = textwrap.dedent('''\
    python3 - <<'PY'
    import json, os, urllib.request
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    print(json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"])
    PY
''')


def harbor_task(root: Path, name: str, *, harness_files: dict[str, str] | None = None, dockerfile: str | None = None,
                test_sh: str = "echo 1 > /logs/verifier/reward.txt", toml: str = "", solve: str | None = None) -> Path:
    """A Harbor task folder under root; returns it. Files in harness_files land in /app."""
    folder = root / name
    env = folder / "environment"
    env.mkdir(parents=True)
    copies = "".join(f"COPY {n} /app/{n}\n" for n in (harness_files or {}))
    (env / "Dockerfile").write_text(dockerfile or f"FROM localhost/gyre-base:bookworm\nWORKDIR /app\n{copies}")
    for n, text in (harness_files or {}).items():
        (env / n).write_text(text)
    (folder / "instruction.md").write_text(f"Task {name}.\n")
    (folder / "task.toml").write_text('version = "1.0"\n' + textwrap.dedent(toml))
    (folder / "tests").mkdir()
    (folder / "tests" / "test.sh").write_text("mkdir -p /logs/verifier\n" + textwrap.dedent(test_sh))
    if solve is not None:
        (folder / "solution").mkdir()
        (folder / "solution" / "solve.sh").write_text(solve)
    return folder


def shell_preset(script: str, **kw):
    """A harness that is a shell script, run by the sandbox's own sh (host's sh elsewhere)."""
    from gyre.coordinator.harnesses import HarnessPreset

    script = script.replace("{", "{{").replace("}", "}}")  # a preset's command is a format string
    return HarnessPreset(name="script", command=("sh", "-c", script), sandbox_command=("sh", "-c", script), **kw)


async def run_task(proxy, backend, task, run_dir: Path, preset, *, timeout_s: float = 60.0, owner: str | None = None,
                   run_id: str = "e1", **spec_kw):
    """One execution of `task` through the launcher's whole lifecycle; returns the Run."""
    from gyre.coordinator.buffer import Execution
    from gyre.coordinator.launcher import Launcher, LaunchSpec
    from gyre.coordinator.sandbox import Limits
    from gyre.coordinator.waterlevel import Tracked

    spec_kw.setdefault("limits", Limits(pids=512))
    spec = LaunchSpec(preset=preset, timeout_s=timeout_s, eval_attempts=1, eval_budget_s=60.0, **spec_kw)
    launcher = Launcher(proxy, run_dir, spec, default_evaluator={"type": "similarity"}, backend=backend, owner=owner)
    run = Execution(id=run_id, group=0, index=0, task=task, tracked=Tracked(), version_dispatched=0)
    await launcher.run(run)
    return run


def containers(backend, **labels) -> list:
    """The containers (running or not) carrying these labels."""
    return backend.client.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in labels.items()]})


def kill_after_its_word(argv: list[str]) -> dict:
    """A coordinator-to-be run as `argv` (from the repository) until it prints its first JSON
    line, then SIGKILLed alone, as a crash ends it (its sandboxes' harnesses run on): that line."""
    import json
    import signal
    import subprocess

    first = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line, "the first coordinator said nothing"
        return json.loads(line)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        first.stdout.close()
