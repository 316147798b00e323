"""Hostile task authors (issue 36, finding 8). A task folder whose instruction.md, tests/,
solution/ or environment/ (or a file in them) is a link to a host path, a SWE row or gyre JSONL
task that names a folder outside its own, and numbers past sane bounds (timeout_sec = 1e308,
cpus = 1e9) are each refused with one line naming the task's file and the field or link, both
at load and by `gyre tasks check` (before: loaded silently, or an OverflowError traceback). A
build past its build_timeout_sec is stopped with nothing of it left on the host (before: its
RUN step ran on, orphaned, after the error), and an image larger than the task's storage_mb is
refused naming both sizes. The last two need real podman (marker sandbox).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.sandbox import images
from gyre.coordinator.sandbox.base import ImageBuildError
from gyre.coordinator.sandbox.podman import podman_env
from gyre.coordinator.taskformats import load_task_source
from gyre.coordinator.tasks import TaskError
from tests.sandbox.conftest import podman, podman_ready

__all__ = ["podman", "podman_ready"]  # fixtures, used by name

SECRET = "HOST-SECRET-never-a-prompt"
runner = CliRunner()


def harbor(folder: Path, toml: str = "") -> Path:
    """A valid Harbor task folder; `toml` is added to its task.toml."""
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text("FROM localhost/gyre-base:bookworm\n")
    (folder / "instruction.md").write_text("Fix the bug.\n")
    (folder / "task.toml").write_text('version = "1.0"\n' + textwrap.dedent(toml))
    (folder / "tests").mkdir()
    (folder / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (folder / "solution").mkdir()
    (folder / "solution" / "solve.sh").write_text("true\n")
    return folder


@pytest.fixture
def host(tmp_path) -> Path:
    """Host files a hostile task links to: a secret, a folder of tests, a build folder."""
    out = tmp_path / "host"
    (out / "tests").mkdir(parents=True)
    (out / "secret.md").write_text(SECRET)
    (out / "task.toml").write_text('version = "1.0"\n')
    (out / "tests" / "test.sh").write_text(f"echo {SECRET}\n")
    (out / "env").mkdir()
    (out / "env" / "Dockerfile").write_text("FROM localhost/gyre-base:bookworm\n")
    return out


def _replace(path: Path, target: Path | str) -> None:
    """`path` (a file or folder) replaced by a link to `target`."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


# Each: (the link inside the task folder, where it leads: a name under `host` or an absolute path)
LINKS = [
    ("instruction.md", "secret.md"),  # a host file became the prompt
    ("task.toml", "task.toml"),
    ("tests", "tests"),  # a host folder became /tests
    ("solution", "tests"),
    ("environment", "env"),  # a host folder became the build context
    ("tests/data.txt", "secret.md"),
    ("tests/passwd", "/etc/passwd"),
    ("environment/app/conf", "secret.md"),  # deeper in a folder
    ("solution/solve.sh", "secret.md"),
    ("tests/loop", "loop"),  # a link to itself: a loop, refused as leading nowhere of its own
]


def _hostile_link(tmp_path: Path, host: Path, rel: str, target: str) -> Path:
    folder = harbor(tmp_path / "evil")
    lead = folder / rel if target == "loop" else host / target if not target.startswith("/") else Path(target)
    _replace(folder / rel, lead)
    return folder


def assert_one_line_refusal(path: Path, *words: str) -> str:
    """Load and `gyre tasks check` both refuse `path` with one line holding every word."""
    with pytest.raises(TaskError) as e:
        load_task_source(path)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert SECRET not in message
    r = runner.invoke(app, ["tasks", "check", str(path)])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exit_code, r.output, r.exception)
    assert len(lines) == 1 and lines[0].startswith("[error] ") and all(w in lines[0] for w in words), r.output
    return message


@pytest.mark.parametrize(("rel", "target"), LINKS, ids=[rel for rel, _ in LINKS])
def test_a_link_out_of_the_task_folder_is_refused_and_named(tmp_path, host, rel, target):
    folder = _hostile_link(tmp_path, host, rel, target)
    assert_one_line_refusal(folder, str(folder), rel, "outside the task folder")


def test_a_link_out_of_a_task_in_a_folder_of_tasks_is_refused(tmp_path, host):
    harbor(tmp_path / "set" / "good")
    evil = harbor(tmp_path / "set" / "evil")
    _replace(evil / "tests", host / "tests")
    assert_one_line_refusal(tmp_path / "set", str(evil), "tests is a link to", "outside the task folder")


def test_the_real_cli_refuses_a_linked_instruction(tmp_path, host):
    folder = _hostile_link(tmp_path, host, "instruction.md", "secret.md")
    exe = shutil.which("gyre", path=str(Path(sys.executable).parent)) or "gyre"
    r = subprocess.run([exe, "tasks", "check", str(folder)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("[error] ") and "instruction.md" in r.stderr, r.stderr
    assert SECRET not in r.stderr + r.stdout


def test_links_that_stay_inside_the_task_folder_load(tmp_path):
    folder = harbor(tmp_path / "fine")
    (folder / "tests" / "solve.sh").symlink_to("../solution/solve.sh")
    (folder / "environment" / "data").mkdir()
    (folder / "environment" / "latest").symlink_to("data")
    [task] = load_task_source(folder)
    assert task.tests_dir == str(folder / "tests")
    r = runner.invoke(app, ["tasks", "check", str(folder), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["tasks"][0]["task"] == "fine", r.output


# ---------------------------------------------------------------------------------------------
# Numbers


NUMBERS = [
    ("[agent]\ntimeout_sec = 1e308\n", "[agent].timeout_sec"),  # was an OverflowError traceback at run time
    ("[verifier]\ntimeout_sec = 1e308\n", "[verifier].timeout_sec"),
    ("[environment]\nbuild_timeout_sec = 1e308\n", "[environment].build_timeout_sec"),
    ("[agent]\ntimeout_sec = 604801\n", "[agent].timeout_sec"),  # a week and a second
    ("[environment]\ncpus = 1e9\n", "[environment].cpus"),  # was aborted_infra for every execution
    ("[environment]\ncpus = 0.001\n", "[environment].cpus"),  # under podman's 0.01
    ("[environment]\nmemory_mb = 1000000000000000\n", "[environment].memory_mb"),
    ("[environment]\nmemory_mb = 1\n", "[environment].memory_mb"),  # under podman's 6 MiB
    (f'[environment]\nmemory = "{"9" * 400}G"\n', "[environment].memory"),  # was an OverflowError traceback
    ("[environment]\nstorage_mb = 1000000000000000\n", "[environment].storage_mb"),
    ('[environment]\nstorage = "99999999T"\n', "[environment].storage"),
    ("[environment]\ngpus = 100000\n", "[environment].gpus"),
]


@pytest.mark.parametrize(("toml", "field"), NUMBERS, ids=[f"{f}={t.split('= ')[1][:12].strip()}" for t, f in NUMBERS])
def test_numbers_past_sane_bounds_are_refused_naming_task_file_and_field(tmp_path, toml, field):
    folder = harbor(tmp_path / "greedy", toml)
    message = assert_one_line_refusal(folder, str(folder / "task.toml"), f"field {field}")
    assert "must be" in message


def test_numbers_at_the_bounds_load(tmp_path):
    folder = harbor(tmp_path / "big", "[agent]\ntimeout_sec = 604800\n[environment]\ncpus = 512\n"
                                      "build_timeout_sec = 604800\nmemory = \"4T\"\nstorage_mb = 1024\n")
    [task] = load_task_source(folder)
    assert (task.timeout_s, task.environment.cpus, task.environment.memory_mb) == (604800.0, 512.0, 4 << 20)


# ---------------------------------------------------------------------------------------------
# SWE-bench-style rows and gyre's own JSONL


def swe_row(**over) -> dict:
    return {"instance_id": "demo__demo-1", "problem_statement": "Fix it.", "image": "localhost/gyre-base:bookworm",
            "test_cmd": "pytest -rA", "FAIL_TO_PASS": ["t.py::test_a"], **over}


def write_jsonl(path: Path, *rows: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("over", "field"), [
    ({"timeout_s": 1e308}, "'timeout_s'"),
    ({"test_timeout_s": 1e308}, "'test_timeout_s'"),
    ({"cpus": 1e9}, "'cpus'"),
    ({"memory_mb": 10 ** 15}, "'memory_mb'"),
], ids=["timeout_s", "test_timeout_s", "cpus", "memory_mb"])
def test_swe_numbers_past_sane_bounds_are_refused(tmp_path, over, field):
    path = write_jsonl(tmp_path / "set" / "swe.jsonl", swe_row(), swe_row(instance_id="demo__demo-2", **over))
    assert_one_line_refusal(path, f"{path}:2", f"field {field}")


def test_swe_dockerfile_outside_its_folder_is_refused(tmp_path, host):
    row = swe_row(image=None, dockerfile=str(host / "env" / "Dockerfile"))  # the build context would be host/env
    path = write_jsonl(tmp_path / "set" / "swe.jsonl", {k: v for k, v in row.items() if v is not None})
    assert_one_line_refusal(path, f"{path}:1", "field 'dockerfile'", "outside the task file's folder")


def test_swe_build_context_with_a_link_out_is_refused(tmp_path, host):
    env = tmp_path / "set" / "env"
    env.mkdir(parents=True)
    (env / "Dockerfile").write_text("FROM localhost/gyre-base:bookworm\nCOPY key /key\n")
    (env / "key").symlink_to(host / "secret.md")
    row = {k: v for k, v in swe_row(image=None, dockerfile="env/Dockerfile").items() if v is not None}
    path = write_jsonl(tmp_path / "set" / "swe.jsonl", row)
    assert_one_line_refusal(path, f"{path}:1", "field 'dockerfile'", "key is a link to", "outside the build context")


def test_gyre_jsonl_timeout_past_a_week_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", {"id": "a", "prompt": "p", "timeout_s": 1e308})
    assert_one_line_refusal(path, f"{path}:1", "field 'timeout_s'")


def test_gyre_jsonl_template_outside_its_folder_is_refused(tmp_path, host):
    path = write_jsonl(tmp_path / "set" / "tasks.jsonl", {"id": "a", "prompt": "p", "template_dir": str(host)})
    assert_one_line_refusal(path, f"{path}:1", "field 'template_dir'", "outside the task file's folder")


def test_gyre_jsonl_template_with_a_link_out_is_refused(tmp_path, host):
    tpl = tmp_path / "set" / "tpl"
    tpl.mkdir(parents=True)
    (tpl / "notes.md").symlink_to(host / "secret.md")  # make_workspace follows it: the secret in the workspace
    path = write_jsonl(tmp_path / "set" / "tasks.jsonl", {"id": "a", "prompt": "p", "template_dir": "tpl"})
    assert_one_line_refusal(path, f"{path}:1", "field 'template_dir'", "notes.md is a link to")


# ---------------------------------------------------------------------------------------------
# The build past its timeout, and the image larger than storage_mb (real podman)


def _procs_with(token: str) -> dict[int, str]:
    """pid -> HOSTNAME (a buildah step's is its working container's id) of processes whose
    command line holds `token`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if token.encode() not in cmdline or b"pytest" in cmdline:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found[int(entry)] = next((v[9:].decode() for v in env if v.startswith(b"HOSTNAME=")), "")
    return found


def _external_containers() -> set[str]:
    """The ids of every container podman knows, a build's working containers included."""
    r = subprocess.run(["podman", "ps", "-a", "--external", "--no-trunc", "--format", "{{.ID}}"], env=podman_env(),
                       capture_output=True, text=True, timeout=60, check=True)
    return set(r.stdout.split())


@pytest.mark.sandbox
async def test_a_build_past_its_timeout_is_stopped_and_leaves_nothing(podman, tmp_path):
    token = f"gyre-h36-{secrets.token_hex(6)}"  # names this test's RUN step among the host's processes
    folder = tmp_path / "env"
    folder.mkdir()
    (folder / "Dockerfile").write_text(f"FROM {images.BASE_IMAGE}\nRUN sleep 600 && echo {token}\n")
    build = asyncio.ensure_future(images.build(podman, folder, images.task_tag(token, folder), dockerfile=None,
                                               timeout_s=8))
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while not build.done() and time.monotonic() < deadline:  # the RUN step, seen while it runs
            seen.update(_procs_with(token))
            await asyncio.wait({build}, timeout=0.2)
        with pytest.raises(ImageBuildError, match=r"not done after 8s \(build_timeout_sec\)") as e:
            await asyncio.wait_for(build, 120)  # bounded: the stop has its own deadlines
        assert "\n" not in str(e.value)
        assert seen, "the RUN step never ran: the test saw nothing to stop"
        assert _procs_with(token) == {}, "the RUN step outlived its build's timeout"
        working = {c for c in _external_containers() for short in seen.values() if short and c.startswith(short)}
        assert working == set(), f"the build's working container was left: {working}"
    finally:  # what a failing run left: this test's own, by pid and id
        for pid in _procs_with(token):
            os.kill(pid, 9)
        for short in set(seen.values()) - {""}:
            subprocess.run(["podman", "rm", "-f", short], env=podman_env(), capture_output=True, timeout=60)

