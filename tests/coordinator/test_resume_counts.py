"""A resumed run counts the run's steps, not this session's (issue 33, item 5): its status
reads the checkpoint's step while the workers load (it read `step 0/2` until the first step
of the session), and the steps of a lost stretch, trained again after the resume, count once
in the role timeline and in `gyre doctor` (a 2-step run read `3 steps in 12.1 min`)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from gyre.cli.live import plain_line
from gyre.cli.timeline import result_from_metrics, role_timeline_text
from gyre.coordinator import resume
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator


def checkpointed(run: Path, *, step: int, steps_in_burst: int = 0) -> None:
    """A run directory whose newest checkpoint is that of `step` (its trainer.pt a whole zip)."""
    (run / "config.json").write_text("{}")
    folder = resume.write_state(run, step, {
        "step": step, "version": step, "publications": step, "groups_dispatched": 2 * step + 2,
        "consumed": list(range(2 * step)), "tasks": None, "tokens_trained": 208 * step,
        "steps_in_burst": steps_in_burst})
    with zipfile.ZipFile(folder / "trainer.pt", "w") as z:
        z.writestr("trainer/data.pkl", b"weights")


def test_a_resumed_run_shows_its_checkpoints_step_before_the_sessions_first(tiny_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    checkpointed(run, step=1)
    coord = Coordinator(CoordinatorConfig(model_dir=tiny_dir, run_dir=run, steps=2, mu=1), resume=True)
    assert coord.status()["steps"] == {"done": 0, "target": 2}  # nothing read yet
    coord.checkpoints.counts(resume.read(run))  # what Coordinator.run does first on a resume
    status = coord.status()
    assert status["steps"] == {"done": 1, "target": 2} and status["version"] == 1
    assert plain_line(status).startswith("t=0s step 1/2 version 1 ")
    steps = coord.steps
    assert (steps.checkpointed_step, steps.publications, steps.tokens_trained) == (1, 1, 208)


def test_a_checkpoint_at_a_bursts_end_counts_its_publication(tiny_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    checkpointed(run, step=2, steps_in_burst=2)  # stopped after the burst's last step, before publishing
    coord = Coordinator(CoordinatorConfig(model_dir=tiny_dir, run_dir=run, steps=4, mu=2), resume=True)
    coord.checkpoints.counts(resume.read(run))
    assert (coord.steps.steps_done, coord.steps.publications, coord.steps.steps_in_burst) == (2, 3, 0)
    assert coord.status()["burst"]["steps"] == 0


def test_a_run_killed_before_its_first_checkpoint_counts_from_the_start(tiny_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    coord = Coordinator(CoordinatorConfig(model_dir=tiny_dir, run_dir=run, steps=2), resume=True)
    coord.checkpoints.counts(resume.read(run))
    assert (coord.steps.steps_done, coord.steps.checkpointed_step, coord.steps.version) == (0, None, 0)


def lost_and_retrained(run: Path) -> Path:
    """A 2-step run: step 1 checkpointed, step 2 trained, then kill -9 before its checkpoint;
    the resume (from step 1) trains step 2 again."""
    step = {"event": "step", "seconds": 60.0, "groups": 2, "cells_training": 1, "staleness_mean": 0.0,
            "tokens_trained": 100}
    lines = [{"event": "step", "t": 200.0, "step": 1, **step}, {"event": "checkpoint", "t": 201.0, "step": 1},
             {"event": "step", "t": 400.0, "step": 2, **step},
             {"event": "resume", "t": 420.0, "step": 1, "version": 1},
             {"event": "step", "t": 726.0, "step": 2, **step, "staleness_mean": 1.0},
             {"event": "summary", "t": 727.0, "steps": 2}]
    (run / "config.json").write_text(json.dumps({"cells": 1, "policy": "elastic", "phi": 0.0, "mu": 1,
                                                 "steps": 2}))
    path = run / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_the_timeline_counts_a_resumed_runs_steps_once(tmp_path):
    r = result_from_metrics(lost_and_retrained(tmp_path))
    assert r.steps == 2 and r.step_hours == [200 / 3600, 726 / 3600]
    assert r.staleness_mean == 0.5  # of the steps that count: the lost step 2 is not one of them
    assert role_timeline_text(r).splitlines()[0].startswith("elastic phi=0.0 mu=1: 2 steps in 12.1")


def test_doctor_counts_a_resumed_runs_steps_once(tmp_path):
    from gyre.cli.runchecks import _run_training

    lost_and_retrained(tmp_path)
    (check,) = _run_training(tmp_path)
    assert check.detail == "2 steps, 200 tokens trained", check
