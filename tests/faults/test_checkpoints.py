"""Checkpoints on a full disk, and torn ones (issue 36, finding 7).

One real run serves the module: `gyre up` of 3 steps whose `checkpoints/` is a 45 MiB
tmpfs mounted in a private mount namespace (`unshare -m`, as root): room for two of the
tiny model's 18 MB checkpoints, not the third. Before, the failed save said `unexpected
pos` (torch's writer drops the errno), left `trainer.pt.tmp`, and the run, its summary
written, counted as finished: `--resume` had nothing to do though step 3 was never saved.
Its checkpoints are copied out before the namespace (and its tmpfs) goes. Copies of that
run are then torn the ways a crash or an interrupted copy tears them (trainer.pt cut
short, state.json cut short or not JSON): the resume reader falls back to the newest
intact checkpoint with a warning naming what it skipped, and one real `gyre up --resume`
does. Without root (no mount namespace) the run is an ordinary one and the disk tests skip.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.cli.upconfig import resumable as _resumable
from gyre.coordinator.resume import CHECKPOINTS, ResumeError, latest, step_dir
from gyre.coordinator.rundir import RunState, state
from tests.coordinator.scripted import HARNESS, write_tasks


def _namespaces() -> str | None:
    """Why a private mount namespace with a tmpfs cannot be had here, or None."""
    if os.geteuid() != 0:
        return "not root: no tmpfs can be mounted"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare -m / mount refused: {probe.stderr.decode().strip()}"


NO_DISK = _namespaces()


class Run:
    def __init__(self, path: Path, rc: int, output: str, full_disk: bool):
        self.path, self.rc, self.output, self.full_disk = path, rc, output, full_disk


@pytest.fixture(scope="module")
def disk_full_run(tmp_path_factory, tiny_dir) -> Run:
    root = tmp_path_factory.mktemp("ckpt")
    tasks = write_tasks(root / "tasks.jsonl", 4)
    cfg = root / "run.toml"
    cfg.write_text(f"steps = 3\ncells = 1\ngroups_per_step = 1\ngroup_size = 2\nmin_valid = 2\ncheckpoint_every = 1\n"
                   f'harness = {json.dumps(list(HARNESS))}\ntasks_path = "{tasks}"\nmodel_dir = "{tiny_dir}"\n'
                   'default_max_tokens = 8\nworkers = "inproc"\n')
    run, saved = root / "run", root / "saved"
    up = [sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run), "--no-live"]
    if NO_DISK:
        done = subprocess.run(up, capture_output=True, text=True, timeout=300)
        return Run(run, done.returncode, done.stdout + done.stderr, full_disk=False)
    (run / CHECKPOINTS).mkdir(parents=True)
    saved.mkdir()
    checkpoint = 3 * (tiny_dir / "model.safetensors").stat().st_size  # the weights and AdamW's two moments
    script = (f"mount -t tmpfs -o size={int(2.5 * checkpoint) >> 20}m tmpfs {run / CHECKPOINTS} || exit 99; "
              f'"$@"; rc=$?; cp -a {run / CHECKPOINTS}/. {saved}/; exit $rc')
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *up], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 99, done.stderr
    (run / CHECKPOINTS).rmdir()  # the bare mount point, the tmpfs gone with the namespace
    shutil.copytree(saved, run / CHECKPOINTS)
    return Run(run, done.returncode, done.stdout + done.stderr, full_disk=True)


def _copy(run: Run, dst: Path) -> Path:
    shutil.copytree(run.path, dst)
    return dst


def _newest(run: Path) -> int:
    return int((run / CHECKPOINTS / "latest").read_text().strip()[5:])


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


# --- a full disk ---------------------------------------------------------------------------


@pytest.mark.skipif(NO_DISK is not None, reason=f"{NO_DISK}")
def test_a_full_disk_fails_the_checkpoint_naming_enospc_and_leaves_nothing_torn(disk_full_run):
    run = disk_full_run
    assert run.rc == 1, run.output
    (error,) = [line for line in run.output.splitlines() if line.startswith("[error] ")]
    path = step_dir(run.path, 3) / "trainer.pt"
    assert "the checkpoint of step 3 failed, nothing of it kept (the last is step 2)" in error
    assert f"cannot write the checkpoint {path}: no space left on device (ENOSPC)" in error
    assert "unexpected pos" not in run.output
    assert sorted(p.name for p in (run.path / CHECKPOINTS).iterdir()) == ["latest", "step-000001", "step-000002"]
    assert not [p for p in (run.path / CHECKPOINTS).rglob("*") if p.name.endswith(".tmp")]
    assert _newest(run.path) == 2


@pytest.mark.skipif(NO_DISK is not None, reason=f"{NO_DISK}")
def test_a_run_whose_last_save_failed_is_not_finished(disk_full_run):
    run = disk_full_run.path
    (summary,) = [e for e in _events(run) if e["event"] == "summary"]
    assert summary["steps"] == 3  # trained, and counted by the summary, but never saved
    assert state(run) == RunState("stopped", 2, 3, unsaved=1)
    assert _resumable(run, target=3, extended=False)


# --- torn checkpoints ----------------------------------------------------------------------


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


TEARS = {
    "trainer.pt cut short": ("trainer.pt", _truncate, "trainer.pt is torn"),
    "state.json cut short": ("state.json", _truncate, "state.json does not read (JSONDecodeError"),
    "state.json not JSON": ("state.json", lambda p: p.write_bytes(b"\x00" * 64), "state.json does not read"),
    "state.json a list": ("state.json", lambda p: p.write_text("[1, 2]"), "state.json lacks the fields"),
}


@pytest.mark.parametrize("tear", list(TEARS))
def test_a_torn_latest_checkpoint_falls_back_to_the_previous_one_with_a_warning(disk_full_run, tmp_path, caplog,
                                                                                tear):
    run = _copy(disk_full_run, tmp_path / "run")
    top = _newest(run)
    name, damage, says = TEARS[tear]
    damage(step_dir(run, top) / name)
    with caplog.at_level(logging.WARNING, logger="gyre.coordinator"):
        folder, st = latest(run)
    assert folder == step_dir(run, top - 1) and st["step"] == top - 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(step_dir(run, top)) in m and says in m and m.endswith("skipped") for m in warned), warned
    assert any(f"from the newest intact checkpoint, step-{top - 1:06d}" in m for m in warned), warned
    assert state(run) == RunState("stopped", top - 1, 3, unsaved=3 - (top - 1))  # never "finished"


def test_with_no_intact_checkpoint_the_resume_is_one_line_naming_each(disk_full_run, tmp_path):
    run = _copy(disk_full_run, tmp_path / "run")
    for step in range(1, _newest(run) + 1):
        _truncate(step_dir(run, step) / "trainer.pt")
    with pytest.raises(ResumeError) as e:
        latest(run)
    message = str(e.value)
    assert "\n" not in message and f"rm {run / CHECKPOINTS / 'latest'}" in message
    assert all(f"{step_dir(run, s)}: trainer.pt is torn" in message for s in range(1, _newest(run) + 1))


def test_a_resume_trains_on_from_the_newest_intact_checkpoint(disk_full_run, tmp_path):
    """The real thing, once: `gyre up --resume` past a torn trainer.pt, to the target."""
    run = _copy(disk_full_run, tmp_path / "run")
    top = _newest(run)
    _truncate(step_dir(run, top) / "trainer.pt")
    done = subprocess.run([sys.executable, "-m", "gyre.cli", "up", "--resume", str(run), "--no-live"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"checkpoint {step_dir(run, top)}: trainer.pt is torn" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    events = _events(run)
    (resumed,) = [e for e in events if e["event"] == "resume"]
    assert resumed["step"] == top - 1 and resumed["checkpoint"] == str(step_dir(run, top - 1))
    cut = events.index(resumed)
    assert [e["step"] for e in events[cut:] if e["event"] == "step"] == list(range(top, 4))
    assert state(run) == RunState("finished", 3, 3)
    assert latest(run)[1]["step"] == 3


# --- durability ----------------------------------------------------------------------------


def test_trainer_pt_is_fsynced_and_its_folder_too_before_it_counts(tiny_dir, tmp_path, monkeypatch):
    """The file's bytes on disk before the rename makes it trainer.pt, the rename on disk
    (the folder fsynced) before the save returns: after a power cut a checkpoint the
    coordinator declared complete is whole, not the empty file a rename without fsync leaves."""
    from gyre.workerd.model import load_model
    from gyre.workerd.trainers.cpu import CpuTrainer

    trainer = CpuTrainer(load_model(tiny_dir))
    seen: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(src, dst) -> None:
        seen.append(("replace", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    target = tmp_path / "step-000001" / "trainer.pt"
    trainer.save_checkpoint(str(target))
    assert seen == [("fsync", f"{target}.tmp"), ("replace", str(target)), ("fsync", str(target.parent))]
    assert not list(target.parent.glob("*.tmp"))
