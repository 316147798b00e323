"""A stopped or killed run, resumed, dispatches as the uninterrupted run of the same seed did:
the same groups (ids and tasks) at the same published versions, the same staleness at every
step. Before, a resume counted every group the journal held as in flight at once, so a phi=0,
mu=1 run kept more groups in its pipeline than it asked for and trained them stale for the
rest of the run (staleness 2 from 0), leaving groups ready and never trained."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from tests.coordinator.scripted import write_tasks

HERE = Path(__file__).parent
STEPS = 6

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def write_config(folder: Path, tiny_dir: Path, *, checkpoint_every: int, workers: str = "inproc") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(folder / "tasks.jsonl", 5)
    harness = json.dumps([sys.executable, str(HERE / "_harness.py")])
    cfg = folder / "run.toml"
    # The run: elastic, phi = 0, mu = 1 (staleness 0 at every step, uninterrupted).
    cfg.write_text(f'steps = {STEPS}\nphi = 0.0\nmu = 1\ngroups_per_step = 2\ngroup_size = 2\nmin_valid = 2\n'
                   f'checkpoint_every = {checkpoint_every}\nharness = {harness}\ntasks_path = "{tasks}"\n'
                   f'model_dir = "{tiny_dir}"\ndefault_max_tokens = 8\nseed = 7\nworkers = "{workers}"\n')
    return cfg


def events(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a kill -9 may tear the last line
            continue
    return out


def schedule(run: Path) -> tuple[list[list[int]], dict[int, tuple[str, int]]]:
    """(staleness of each counted step, in step order; group id -> (task, version) of its last dispatch)."""
    evs = events(run)
    steps: dict[int, list[int]] = {}
    for e in evs:
        if e["event"] == "step":
            steps[e["step"]] = e["staleness"]  # a step redone after a resume replaces the lost one
    groups = {e["group"]: (e["task"], e["version"]) for e in evs if e["event"] == "dispatch"}
    return [steps[k] for k in sorted(steps)], groups


def start(cfg: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run), "--no-live"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def stop_at(proc: subprocess.Popen, line_start: str, sig: int) -> str:
    """Send `sig` when the run prints a line starting `line_start`; its whole output."""
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(line_start):
                os.kill(proc.pid, sig)
                break
        else:
            pytest.fail(f"the run ended before {line_start!r} (exit {proc.wait()}): {''.join(seen)}")
        seen += proc.stdout.readlines()
    finally:
        proc.wait(120)
        proc.stdout.close()
    return "".join(seen)


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    run = folder / "run"
    r = CliRunner().invoke(app, ["up", str(write_config(folder, tiny_dir, checkpoint_every=5)), "--run-dir", str(run),
                                 "--no-live"])
    assert r.exit_code == 0, r.output
    # A step count that is no multiple of checkpoint_every still ends with its last step kept.
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:06d}"
    assert f"trained weights (step {STEPS}): {run / 'checkpoints' / f'step-{STEPS:06d}' / 'trainer.pt'}" in r.output
    staleness, groups = schedule(run)
    assert len(staleness) == STEPS and all(s == [0, 0] for s in staleness)
    return run, (staleness, groups)


def test_resuming_a_finished_run_says_so_and_starts_nothing(uninterrupted):
    run, _ = uninterrupted
    before = (run / "metrics.jsonl").read_bytes()
    r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
    assert r.exit_code == 0, r.output  # not a failure: the systemd unit starts it again at every boot
    assert f"holds a finished run ({STEPS}/{STEPS} steps): nothing to resume" in r.output
    assert "--steps N" in r.output and "gyre up:" not in r.output
    assert (run / "metrics.jsonl").read_bytes() == before  # no worker, no event


def test_ctrl_c_keeps_a_checkpoint_and_the_resume_dispatches_as_the_uninterrupted_run(uninterrupted, tiny_dir,
                                                                                        tmp_path):
    """Ctrl-C after step 2 of 6 (checkpoint_every 5: no periodic checkpoint yet): the stop saves
    step 2, exits 130 naming the resume command, and the resumed run matches the uninterrupted one."""
    run = tmp_path / "run"
    out = stop_at(start(write_config(tmp_path, tiny_dir, checkpoint_every=5), run), "step 2/", signal.SIGINT)
    assert f"continue with: gyre up --resume {run}" in out
    before = events(run)
    (ckpt,) = [e for e in before if e["event"] == "checkpoint"]
    assert ckpt["step"] == 2 and (Path(ckpt["path"]) / "trainer.pt").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"

    r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
    assert r.exit_code == 0, r.output
    (res,) = [e for e in events(run) if e["event"] == "resume"]
    assert res["step"] == 2 and res["version"] == 2
    assert schedule(run) == uninterrupted[1]
    _nothing_lost(run)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_run_exits_128_plus_the_signal_with_its_checkpoint(tiny_dir, tmp_path, sig, code):
    """The shell (and a script, and systemd) can tell a stopped run from a finished one; either
    way the last step is kept."""
    run = tmp_path / "run"
    proc = start(write_config(tmp_path, tiny_dir, checkpoint_every=5, workers="local"), run)  # the zmq twin
    out = stop_at(proc, "step 1/", sig)
    assert proc.returncode == code, out
    assert (run / "checkpoints" / "latest").read_text().strip() in ("step-000001", "step-000002")


def test_kill9_between_checkpoints_resumes_with_the_lost_groups_held_for_their_publications(uninterrupted,
                                                                                            tiny_dir, tmp_path):
    """kill -9 at step 5 of 6 with the last checkpoint at step 3: the journal holds groups that
    publication 4 dispatched (a publication the checkpoint's model never made). They are held
    and dispatched again at publication 4 of the resumed run, with version 4."""
    run = tmp_path / "run"
    stop_at(start(write_config(tmp_path, tiny_dir, checkpoint_every=3), run), "step 5/", signal.SIGKILL)
    before = events(run)
    assert max(e["step"] for e in before if e["event"] == "checkpoint") == 3
    assert not any(e["event"] == "summary" for e in before)
    r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
    assert r.exit_code == 0, r.output
    assert schedule(run) == uninterrupted[1]
    (res,) = [e for e in events(run) if e["event"] == "resume"]
    assert res["step"] == 3 and res["groups_held"] >= 2  # publication 4's groups, at least
    _nothing_lost(run)


def _nothing_lost(run: Path) -> None:
    """Every execution that closed is, exactly once, in a step that counts or still pending."""
    evs = events(run)
    cut = max(i for i, e in enumerate(evs) if e["event"] == "resume")
    res = evs[cut]
    counted = {e["step"]: e for e in evs[:cut] if e["event"] == "step" and e["step"] <= res["step"]}
    counted.update({e["step"]: e for e in evs[cut:] if e["event"] == "step"})
    trained = [g for e in counted.values() for g in e["group_ids"]]
    assert len(trained) == len(set(trained))
    summary = [e for e in evs if e["event"] == "summary"][-1]  # a stopped run wrote one too
    assert not set(summary["pending_groups"]) & set(trained)
    closed = {e["group"] for e in evs if e["event"] == "execution" and e["status"] != "cancelled"}
    assert closed <= set(trained) | set(summary["pending_groups"])
