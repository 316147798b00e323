"""A bubblewrap sandbox holds as root (issue 36, finding 1).

The coordinator runs as root. Inside a bubblewrap sandbox the agent used to keep every
capability: it remounted the host's /usr and the gyre checkout read-write and wrote there, read
/etc/shadow, the coordinator's whole environment, the checkout's tests/ and examples/ and a
sibling execution's workspace. A probe harness tries each of these through the launcher's
whole lifecycle, with a run directory where users keep theirs (runs/ in the checkout), and
reports what it saw; the host is then checked for what it wrote.
"""

from __future__ import annotations

import json
import secrets
import shutil
import textwrap
from pathlib import Path

import pytest

import gyre.coordinator
from gyre.coordinator.sandbox.bubblewrap import BubblewrapBackend
from gyre.coordinator.tasks import Task
from tests.sandbox.conftest import REPO, bwrap_ready, run_task, scripted_proxy, shell_preset

__all__ = ["bwrap_ready", "scripted_proxy"]  # fixtures, used by name

# Each attempt, and what came of it, into probe.json in the workspace (stdlib only).
PROBE = textwrap.dedent('''\
    import json, os, subprocess, sys
    mark, package, targets = sys.argv[1], sys.argv[2], sys.argv[3:]
    seen = {"uid": os.getuid()}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb", "NoNewPrivs"):
            seen[key] = value.strip()
    def attempt(fn):
        try:
            return fn()
        except Exception as e:
            return type(e).__name__
    def write(path):
        with open(path, "w") as f:
            f.write("written from a sandbox")
        return "written"
    seen["shadow"] = attempt(lambda: open("/etc/shadow").read() and "read")
    for folder in ("/usr", package):  # the system, and gyre's package (bound for the demo harness)
        seen["remount " + folder] = subprocess.run(["mount", "-o", "remount,rw,bind", folder],
                                                   capture_output=True).returncode
        seen["write " + folder] = attempt(lambda: write(os.path.join(folder, mark)))
    seen["visible"] = {t: os.path.exists(t) for t in targets}
    environs = [dict(os.environ)]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            environs.append(attempt(lambda: open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")))
    seen["environs"] = environs
    json.dump(seen, open("probe.json", "w"))
''')


@pytest.fixture
def runs_dir():
    """A run directory where a user keeps theirs: runs/ in the gyre checkout (ignored by git)."""
    path = REPO / "runs" / f"isolation-{secrets.token_hex(4)}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.sandbox
async def test_a_bubblewrap_sandbox_started_by_root_holds(bwrap_ready, scripted_proxy, runs_dir, monkeypatch):
    secret, mark = secrets.token_hex(16), f"gyre-isolation-{secrets.token_hex(4)}"
    monkeypatch.setenv("PLANTED_SECRET", secret)  # the coordinator's own environment
    monkeypatch.setenv("GYRE_PLANTED_SECRET", secret)  # GYRE_* of the coordinator's is not the launcher's
    sibling = runs_dir / "executions" / "e0" / "workspace" / "answer.txt"
    sibling.parent.mkdir(parents=True)
    sibling.write_text("a sibling's work")
    package = str(Path(gyre.coordinator.__file__).resolve().parent)
    targets = [str(sibling), str(sibling.parent), str(REPO / "tests"), str(REPO / "examples"), str(REPO / ".git"),
               str(REPO / "README.md"), str(REPO / "pyproject.toml")]
    backend = BubblewrapBackend()
    await backend.open()
    task = Task(id="iso", prompt="probe", workspace={"probe.py": PROBE}, target="x")
    try:
        run = await run_task(scripted_proxy, backend, task, runs_dir,
                             shell_preset(f"python3 probe.py {mark} {package} {' '.join(targets)}"))
    finally:
        await backend.close()
    assert run.status == "completed", (run.status, run.ref)
    seen = json.loads((runs_dir / "executions" / "e1" / "workspace" / "probe.json").read_text())
    # No capability in any set, none to gain, and not root.
    assert [seen[k] for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb")] == ["0000000000000000"] * 5, seen
    assert seen["NoNewPrivs"] == "1" and seen["uid"] != 0, seen
    # The system and gyre's package stay read-only, and root's files unreadable.
    for folder in ("/usr", package):
        assert seen[f"remount {folder}"] != 0 and seen[f"write {folder}"] in ("OSError", "PermissionError"), seen
        assert not Path(folder, mark).exists()  # on the host
    assert seen["shadow"] == "PermissionError", seen
    # Nothing of the checkout around the package, and no sibling.
    assert [t for t, v in seen["visible"].items() if v] == [], seen["visible"]
    # The coordinator's environment reached no process it could read.
    assert secret not in json.dumps(seen["environs"]), [e for e in seen["environs"] if secret in json.dumps(e)]
    assert seen["environs"][0]["OPENAI_API_KEY"]  # the launcher's own variables did come


def test_doctor_and_the_start_line_say_what_each_backend_isolates(caplog):
    """The process backend says it isolates nothing but keys; bubblewrap what it now does."""
    import logging

    from gyre.cli.doctor import _isolation
    from gyre.coordinator.sandbox import make_backend

    lines = {c.check: c.detail for c in _isolation()}
    assert set(lines) == {"sandbox process", "sandbox podman", "sandbox docker", "sandbox bubblewrap"}
    process = lines["sandbox process"]
    assert process.startswith("isolates nothing") and "a key works only from its own" in process
    assert "unprivileged uid" in lines["sandbox bubblewrap"] and "no capabilities" in lines["sandbox bubblewrap"]
    assert "container" in lines["sandbox podman"]
    caplog.set_level(logging.INFO, logger="gyre.coordinator")
    make_backend("process")  # what a run's start does, once per sandbox host
    assert [r.getMessage() for r in caplog.records] == [f"sandbox process {lines['sandbox process']}"]
