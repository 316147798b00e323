"""`gyre doctor [RUN_DIR]`: one line per check with its fix, exit 1 on a fail. The installation
checks on this machine (only what every gyre install has is asserted) and on a PATH without
the sandbox tools; the run-directory checks on a real run (`gyre up --steps 1`, once per
module) and on copies of it damaged the way crashes, edits and moves damage them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gyre.cli.doctor import doctor
from gyre.cli.runchecks import run_directory
from tests.inproc import SET
from tests.sandbox.conftest import podman_ready

__all__ = ["podman_ready"]  # a fixture, used by name: builds the base image where the tier runs

app = typer.Typer()
app.command("doctor")(doctor)


@app.command("version")
def _version() -> None:  # a second command, so `doctor` stays a subcommand as in `gyre`
    pass


runner = CliRunner()
# What any working install has, whatever the machine's extras, tools and disks: asserted ok.
CORE = ("python", "gyre", "torch", "core packages", "loopback", "harness demo")
RUN = re.compile(r"^(run |metrics\.jsonl|checkpoint|execution)")


def checks(*args: str) -> tuple[int, list[dict]]:
    r = runner.invoke(app, ["doctor", *args, "--json"])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.output)


def run_checks(*args: str) -> tuple[int, list[dict]]:
    code, got = checks(*args)
    return code, [c for c in got if RUN.match(c["check"])]


def one(found: list[dict], name: str) -> dict:
    (c,) = [c for c in found if c["check"] == name]
    return c


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A real finished run: `gyre up --steps 1` on the embedded default (about 30 s)."""
    root = tmp_path_factory.mktemp("doctor")
    run = root / "run"
    r = subprocess.run([sys.executable, "-m", "gyre.cli", "up", "--steps", "1", "--no-live", "--run-dir", str(run),
                        *SET], cwd=root, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return run


def copy_run(src: Path, dst: Path) -> Path:
    """A copy that is a run of its own: config.json's paths name the copy, as after a move done
    right, so only the damage a test makes shows."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(run_dir=str(dst), model_dir=str(dst / "model"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def edit_config(run: Path, **fields) -> None:
    cfg = json.loads((run / "config.json").read_text())
    cfg.update(fields)
    (run / "config.json").write_text(json.dumps(cfg))


def test_a_working_install_has_no_failing_core_check_and_every_problem_has_a_fix():
    code, got = checks()
    for name in CORE:
        assert one(got, name)["status"] == "ok", one(got, name)
    for c in got:  # machine-dependent lines (extras, sandboxes, harness binaries, disks): not asserted
        assert c["status"] in ("ok", "warn", "fail") and c["detail"]
        assert c["fix"] or c["status"] == "ok", c
    assert code == (1 if any(c["status"] == "fail" for c in got) else 0)
    assert not [c for c in got if RUN.match(c["check"])]  # no RUN_DIR: no run lines


def test_text_output_is_one_line_per_check_with_the_fix_after_a_dash():
    r = runner.invoke(app, ["doctor"])
    lines = r.output.strip().splitlines()
    assert len(lines) == len(checks()[1])
    for line in lines:
        assert re.match(r"^(ok {4}|warn {2}|fail {2})\S[^:]*: \S", line), line
    torch = next(line for line in lines if line.startswith("ok    torch: "))
    assert re.match(r"ok    torch: \d+\.\d+\.\d+\S* \((cpu|cuda).*\)$", torch)
    assert all(" — " in line for line in lines if not line.startswith("ok"))


def test_a_path_without_podman_or_bwrap_says_how_to_install_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no podman, bwrap, nsenter, npm, claude
    _, got = checks()
    podman, bwrap = one(got, "podman"), one(got, "bubblewrap")
    assert podman["status"] == "warn" and "`podman` command is not on PATH" in podman["detail"]
    assert "apt-get install -y podman runc" in podman["fix"] and "root" in podman["fix"]
    assert bwrap["status"] == "warn" and "`bwrap` command is not on PATH" in bwrap["detail"]
    assert "apt-get install -y bubblewrap" in bwrap["fix"]
    assert one(got, "npm")["fix"] == "apt-get install -y npm"
    claude = one(got, "harness claude-code")
    assert claude["status"] == "warn" and claude["fix"].startswith("npm install -g @anthropic-ai/claude-code")
    assert one(got, "harness demo")["status"] == "ok"  # the demo harness is this Python


def test_a_finished_run_is_all_ok_with_the_command_to_extend_it(finished):
    code, got = run_checks(str(finished))
    assert [c for c in got if c["status"] != "ok"] == []
    assert [c["check"] for c in got] == ["run config", "run model", "run needs", "run state", "run lock",
                                         "metrics.jsonl", "checkpoint", "executions", "run disk", "run sandboxes"]
    state = one(got, "run state")
    assert state["detail"] == "finished (1/1 steps)"
    assert state["fix"] == f"extend it: gyre up --resume {finished} --steps N (N > 1)"
    assert one(got, "checkpoint")["detail"].startswith("latest is step-000001 (step 1, version 1)")
    assert "16 folder(s)" in one(got, "executions")["detail"]


def test_a_directory_that_is_not_a_run_directory_is_one_fail_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    for target, says in ((tmp_path, "has no config.json: not a gyre run directory"),
                         (tmp_path / "gone", "does not exist")):
        code, got = run_checks(str(target))
        assert code == 1
        assert [(c["check"], c["status"]) for c in got] == [("run directory", "fail")]
        assert says in got[0]["detail"] and "`gyre up`" in got[0]["fix"]
    assert len(run_directory(tmp_path)) == 1


def test_a_serve_directory_gets_its_records_checked(finished, tmp_path):
    run = tmp_path / "serve"
    shutil.copytree(sorted((finished / "executions").iterdir())[0], run / "executions" / "serve")
    (run / "config.json").write_text(json.dumps({"command": "serve", "model": str(finished / "model"),
                                                 "harness": "demo"}))  # as coordinator/serve.py writes it
    code, got = run_checks(str(run))
    assert [(c["check"], c["status"]) for c in got] == [("run directory", "ok"), ("run lock", "ok"),
                                                        ("executions", "ok"), ("run disk", "ok")]
    assert got[0]["detail"].startswith("a `gyre serve` directory (harness demo")


def test_a_torn_last_metrics_line_is_a_warning_resume_handles(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"event": "step", "t": 3')  # a crash mid-write
    code, got = run_checks(str(run))
    metrics = one(got, "metrics.jsonl")
    assert metrics["status"] == "warn" and "a crash tore the last line; resume skips it" in metrics["detail"]
    assert "mid-file" not in metrics["detail"] and f"gyre up --resume {run}" in metrics["fix"]
    assert not [c for c in got if c["status"] == "fail"] and code in (0, 1)  # 1 only for this machine's own fails


def test_a_torn_line_mid_metrics_is_a_warning_naming_the_line(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    lines[4] = lines[4][:15] + b"\n"
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    metrics = one(run_checks(str(run))[1], "metrics.jsonl")
    assert metrics["status"] == "warn" and "1 torn line(s) mid-file (line 5)" in metrics["detail"]
    assert "last line" not in metrics["detail"] and metrics["fix"]


@pytest.mark.parametrize("earlier", [False, True])
def test_a_latest_checkpoint_without_trainer_pt_fails_naming_what_to_resume_from(finished, tmp_path, earlier):
    run = copy_run(finished, tmp_path / "run")
    ckpts = run / "checkpoints"
    if earlier:  # an older complete checkpoint beside it
        shutil.copytree(ckpts / "step-000001", ckpts / "step-000000")
    (ckpts / "step-000001" / "trainer.pt").unlink()
    code, got = run_checks(str(run))
    ckpt = one(got, "checkpoint")
    assert code == 1 and ckpt["status"] == "fail"
    assert "step-000001 is incomplete: trainer.pt missing" in ckpt["detail"]
    latest = ckpts / "latest"
    assert ckpt["fix"] == (f"point latest at the newest complete one: echo step-000000 > {latest}" if earlier else
                           f"rm {latest}: a resume then starts from step 0 (the model directory's weights)")
    if earlier:  # the fix, applied, is enough
        latest.write_text("step-000000\n")
        assert one(run_checks(str(run))[1], "checkpoint")["status"] == "ok"


def test_megatron_checkpoints_need_every_rank_file(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    edit_config(run, trainer_backend="megatron", trainer_options={"tp": 2, "pp": 2})
    ckpt = one(run_checks(str(run))[1], "checkpoint")
    assert ckpt["status"] == "fail"
    assert "trainer.pt.pp0.tp1, trainer.pt.pp1.tp0, trainer.pt.pp1.tp1 missing (TP=2, PP=2" in ckpt["detail"]
    for name in ("trainer.pt.pp0.tp1", "trainer.pt.pp1.tp0", "trainer.pt.pp1.tp1"):
        (run / "checkpoints" / "step-000001" / name).write_bytes(b"")
    ckpt = one(run_checks(str(run))[1], "checkpoint")
    assert ckpt["status"] == "ok" and ckpt["detail"].endswith("trainer.pt and the rank files")


@pytest.mark.parametrize("fields, says", [
    ({"steps": "many"}, "field steps: expected int, got 'many'"),
    ({"stepz": 3}, "unknown field 'stepz': did you mean 'steps'?"),
    ({"policy": "greedy"}, "policy"),
])
def test_a_config_with_a_bad_field_fails_naming_it(finished, tmp_path, fields, says):
    run = copy_run(finished, tmp_path / "run")
    edit_config(run, **fields)
    code, got = run_checks(str(run))
    config = one(got, "run config")
    assert code == 1 and config["status"] == "fail" and says in config["detail"]
    assert config["fix"].startswith(f"correct it in {run / 'config.json'}")
    assert one(got, "run lock")["status"] == "ok"  # the other checks still run
    assert "the check itself failed" not in json.dumps(got)


def test_a_model_dir_that_is_gone_fails_with_how_to_get_it_back(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    shutil.rmtree(run / "model")
    code, got = run_checks(str(run))
    model = one(got, "run model")
    assert code == 1 and model["status"] == "fail" and str(run / "model") in model["detail"]
    assert model["fix"] == f"write it again: gyre init-model tiny {run / 'model'} --seed 0"
    r = subprocess.run([sys.executable, "-m", "gyre.cli", "init-model", "tiny", str(run / "model"), "--seed", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert one(run_checks(str(run))[1], "run model")["status"] == "ok"
    edit_config(run, model_dir=str(tmp_path / "elsewhere"))  # a model of its own, not the embedded one
    model = one(run_checks(str(run))[1], "run model")
    assert model["status"] == "fail" and model["fix"].startswith(f"restore {tmp_path / 'elsewhere'}")


def test_a_moved_run_directory_says_its_model_dir_still_names_the_old_path(finished, tmp_path):
    run = tmp_path / "moved"
    shutil.copytree(finished, run)  # config.json still names the original
    got = run_checks(str(run))[1]
    moved = [c for c in got if c["check"] == "run config" and c["status"] == "warn"]
    assert len(moved) == 1 and f"names run_dir {finished}: this directory was moved or copied" in moved[0]["detail"]
    assert moved[0]["fix"].startswith(f"set model_dir to {run / 'model'} in {run / 'config.json'}")


def test_a_torn_nodes_file_is_found_and_moving_the_execution_aside_clears_it(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    folder = sorted((run / "executions").iterdir())[0]
    nodes = (folder / "nodes.jsonl").read_bytes().splitlines(keepends=True)
    (folder / "nodes.jsonl").write_bytes(b"".join(nodes[:-1]) + nodes[-1][:40])  # the last node torn
    code, got = run_checks(str(run))
    assert one(got, "executions")["status"] == "warn"
    bad = one(got, f"execution {folder.name}")
    assert code == 1 and bad["status"] == "fail"
    assert "its records do not load" in bad["detail"] and "nodes.jsonl: a crash tore the last line" in bad["detail"]
    assert "calls.jsonl line 1" in bad["detail"]  # the reader names the call whose node is gone
    assert bad["fix"].startswith(f"move it aside (mkdir -p {run / 'broken'} && mv {folder} {run / 'broken'}/)")
    subprocess.run(["sh", "-c", bad["fix"].split("(", 1)[1].split(")")[0]], check=True)
    assert one(run_checks(str(run))[1], "executions")["status"] == "ok"


def test_a_torn_last_calls_line_alone_is_a_warning(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    folder = sorted((run / "executions").iterdir())[0]
    with open(folder / "calls.jsonl", "ab") as f:
        f.write(b'{"call_id": "x", "exec')
    got = run_checks(str(run))[1]
    line = one(got, f"execution {folder.name}")
    assert line["status"] == "warn" and line["detail"] == "calls.jsonl: a crash tore the last line; readers skip it"
    assert line["fix"].startswith("nothing to repair")


def test_a_crashed_run_says_how_to_continue_and_a_live_one_is_running_mid_write(finished, tmp_path):
    from gyre.coordinator.rundir import claim

    run = copy_run(finished, tmp_path / "run")
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines[:-1]))  # no closing summary: a crash
    state = one(run_checks(str(run))[1], "run state")
    assert state["status"] == "warn" and state["detail"].startswith("crashed at step 1/1")
    assert state["fix"] == f"continue it: gyre up --resume {run}"
    folder = sorted((run / "executions").iterdir())[0]
    nodes = (folder / "nodes.jsonl").read_bytes()
    (folder / "nodes.jsonl").write_bytes(nodes[:-30])  # as a reader may find a live run's records mid-write
    lock = claim(run, resume=True)
    try:
        got = run_checks(str(run))[1]
        assert one(got, "run state")["detail"] == f"running (pid {os.getpid()} holds the lock)"
        assert one(got, "run lock")["detail"] == f"held by pid {os.getpid()} (alive)"
        live = one(got, f"execution {folder.name}")
        assert live["status"] == "warn" and "the run is live, a record may be mid-write" in live["detail"]
    finally:
        lock.release()
    got = run_checks(str(run))[1]
    assert "stale and harmless" in one(got, "run lock")["detail"]
    assert one(got, f"execution {folder.name}")["status"] == "fail"  # not live any more: damage


def test_a_run_that_needs_podman_fails_where_there_is_none(finished, tmp_path, monkeypatch):
    run = copy_run(finished, tmp_path / "run")
    edit_config(run, sandbox="podman")
    monkeypatch.setenv("PATH", str(tmp_path))
    code, got = run_checks(str(run))
    needs = one(got, "run needs")
    assert code == 1 and needs["status"] == "fail" and "`podman` command is not on PATH" in needs["detail"]
    assert "apt-get install -y podman runc" in needs["fix"]


@pytest.mark.sandbox
def test_a_leftover_container_of_the_run_is_listed_with_the_command_to_remove_it(finished, podman_ready, tmp_path):
    from gyre.coordinator.sandbox.images import BASE_IMAGE

    run = copy_run(finished, tmp_path / "run")
    made = subprocess.run(["podman", "create", "--label", f"gyre.run_dir={run}", "--label", "gyre.execution=x",
                           BASE_IMAGE, "true"], capture_output=True, text=True, timeout=60, check=True)
    cid = made.stdout.strip()
    try:
        box = one(run_checks(str(run))[1], "run sandboxes")
        assert box["status"] == "warn" and box["detail"] == "1 leftover container(s) of this run"
        assert box["fix"].startswith(f"podman rm -f {cid[:12]}")
        subprocess.run(box["fix"].split(" (")[0].split(), capture_output=True, timeout=60, check=True)
        assert one(run_checks(str(run))[1], "run sandboxes")["status"] == "ok"
    finally:
        subprocess.run(["podman", "rm", "-f", cid], capture_output=True, timeout=60)
