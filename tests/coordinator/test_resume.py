"""kill -9 of the coordinator mid-run, then `gyre up --resume RUN_DIR`: the step count
continues, metrics continue in the same file, and every closed execution is, exactly once,
either in a step that counts or still pending."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from tests.coordinator.scripted import write_tasks

HERE = Path(__file__).parent


def write_config(tmp_path: Path, tiny_dir: Path, *, steps: int = 4, checkpoint_every: int = 1,
                 workers: str | None = "inproc") -> Path:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 5)
    harness = json.dumps([sys.executable, str(HERE / "_harness.py")])
    cfg = tmp_path / "run.toml"
    # async with a dispatch lead: executions are running when the coordinator is killed.
    cfg.write_text(f'steps = {steps}\npolicy = "async"\nphi = 1.0\ngroups_per_step = 2\ngroup_size = 3\nmin_valid = 2\n'
                   f'checkpoint_every = {checkpoint_every}\nharness = {harness}\ntasks_path = "{tasks}"\n'
                   f'model_dir = "{tiny_dir}"\ndefault_max_tokens = 16\n'
                   + (f'workers = "{workers}"\n' if workers else ""))  # a kill -9 takes inproc workers with it
    return cfg


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.timeout(400)
def test_kill9_then_resume_loses_nothing(tiny_dir, tmp_path):
    run = tmp_path / "run"
    kill_at(write_config(tmp_path, tiny_dir), run, "step 2/4")  # as step 2 is reported: step 1's checkpoint exists
    before = events(run)
    ckpt = max(e["step"] for e in before if e["event"] == "checkpoint")
    assert ckpt >= 1 and not any(e["event"] == "summary" for e in before)

    r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
    assert r.exit_code == 0, r.output
    assert "resuming" in r.output
    after = events(run)
    (res,) = [e for e in after if e["event"] == "resume"]
    assert res["step"] == ckpt
    cut = after.index(res)
    times = [e["t"] for e in after]
    assert times == sorted(times)  # metrics continue in the same file, on one clock

    # The step count continues from the checkpoint to the target.
    resumed_steps = [e for e in after[cut:] if e["event"] == "step"]
    assert [s["step"] for s in resumed_steps] == list(range(ckpt + 1, 5))
    counted = [e for e in after[:cut] if e["event"] == "step" and e["step"] <= ckpt] + resumed_steps
    trained = [g for s in counted for g in s["group_ids"]]
    assert len(trained) == len(set(trained))  # no group trained twice in the steps that count
    (summary,) = [e for e in after if e["event"] == "summary"]
    pending = set(summary["pending_groups"])
    assert not pending & set(trained)

    # Every execution closed before the kill: exactly once trained or pending, never re-run.
    ex_events = [e for e in after if e["event"] == "execution"]
    ids = [e["id"] for e in ex_events]
    assert len(ids) == len(set(ids))
    closed_before = [e for e in after[:cut] if e["event"] == "execution" and e["status"] != "cancelled"]
    assert closed_before
    for e in closed_before:
        assert e["group"] in set(trained) | pending, e
    consumed_at_ckpt = {g for s in after[:cut] if s["event"] == "step" and s["step"] <= ckpt for g in s["group_ids"]}
    assert res["executions_restored"] == sum(e["group"] not in consumed_at_ckpt for e in closed_before)
    # Every outcome is valid: a restored group never settles early (dropped) on its first runs;
    # groups still in flight when the run ends may drop (their runs are cancelled at shutdown).
    restored_groups = {e["group"] for e in closed_before if e["group"] not in consumed_at_ckpt}
    assert restored_groups and not restored_groups & set(summary["dropped_groups"])
    # Executions that were queued or running at the kill ran again under new ids.
    assert res["executions_redispatched"] > 0
    redone = [e for e in after[cut:] if e["event"] == "execution" and e["id"].endswith("-r1")]
    assert redone and all(e["id"][:-3] not in {x["id"] for x in closed_before} for e in redone)


def kill_at(cfg: Path, run: Path, line_start: str) -> None:
    """Start `gyre up cfg`, kill -9 it when it prints a line starting `line_start`."""
    first = subprocess.Popen([sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run), "--no-live"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in first.stdout:
            if line.startswith(line_start):
                break
        else:
            pytest.fail(f"the first run ended before {line_start!r} (exit {first.wait()})")
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.wait(60)
        first.stdout.close()


@pytest.mark.timeout(400)
def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(tiny_dir, tmp_path):
    """No checkpoint yet (the systemd unit resumes any started run): the model directory's
    weights, step 0, and every execution closed before the kill restored, none re-run."""
    run = tmp_path / "run"
    kill_at(write_config(tmp_path, tiny_dir, steps=2, checkpoint_every=0), run, "step 1/2")
    before = events(run)
    assert not any(e["event"] in ("checkpoint", "summary") for e in before)
    r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
    assert r.exit_code == 0, r.output
    after = events(run)
    (res,) = [e for e in after if e["event"] == "resume"]
    assert (res["step"], res["version"], res["checkpoint"]) == (0, 0, None)
    cut = after.index(res)
    assert [e["step"] for e in after[cut:] if e["event"] == "step"] == [1, 2]
    closed_before = [e for e in before if e["event"] == "execution" and e["status"] != "cancelled"]
    assert closed_before and res["executions_restored"] == len(closed_before)
    ids = [e["id"] for e in after if e["event"] == "execution"]
    assert len(ids) == len(set(ids))  # restored, never run again
    (summary,) = [e for e in after if e["event"] == "summary"]
    trained = {g for e in after[cut:] if e["event"] == "step" for g in e["group_ids"]}
    assert {e["group"] for e in closed_before} <= trained | set(summary["pending_groups"])


def test_resume_of_a_directory_without_a_run_is_a_clear_error(tmp_path):
    r = CliRunner().invoke(app, ["up", "--resume", str(tmp_path / "nothing")])
    assert r.exit_code == 1 and "not a gyre run directory" in r.output
    assert not (tmp_path / "nothing").exists()


def _hand_started(tmp_path: Path, tiny_dir: Path, *, steps: int) -> tuple[Path, list[subprocess.Popen]]:
    """A run config for workers = "external" at a free loopback port, and two `gyre workerd`
    started by hand there (as systemd runs them), their output in tmp_path/workerd-I.log."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    cfg = write_config(tmp_path, tiny_dir, steps=steps, workers=None)
    cfg.write_text(cfg.read_text() + f'workers = "external"\naddress = "{address}"\ntopology_timeout_s = 120.0\n')
    workers = []
    for i in range(2):
        with open(tmp_path / f"workerd-{i}.log", "wb") as log:
            workers.append(subprocess.Popen([sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", address,
                                             "--node-id", f"hand-{i}", "--heartbeat", "0.5"], stdout=log, stderr=log))
    return cfg, workers


@pytest.mark.timeout(400)
def test_workers_started_by_hand_survive_a_coordinator_kill_and_rejoin_the_resume(tiny_dir, tmp_path):
    """The operator's path: workerds started by hand stay up when the coordinator is killed;
    the resumed coordinator asks them to register again and finishes the run with them."""

    run = tmp_path / "run"
    cfg, workers = _hand_started(tmp_path, tiny_dir, steps=4)
    try:
        first = subprocess.Popen([sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run),
                                  "--no-live"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in first.stdout:
            if line.startswith("step 2/4"):
                break
        else:
            pytest.fail(f"the first run ended before step 2 (exit {first.wait()})")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(60)
        first.stdout.close()
        assert all(w.poll() is None for w in workers)  # the daemons outlive the coordinator
        r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
        assert r.exit_code == 0, r.output
        assert [w.wait(60) for w in workers] == [0, 0]  # told to shut down at the end of the run
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    after = events(run)
    (res,) = [e for e in after if e["event"] == "resume"]
    steps = [e["step"] for e in after[after.index(res):] if e["event"] == "step"]
    assert steps == list(range(res["step"] + 1, 5))


@pytest.mark.timeout(400)
def test_workers_that_outlive_the_coordinator_keep_their_weights_when_the_resume_starts_at_them(tiny_dir, tmp_path):
    """Workerds started by hand (as systemd runs them) outlive a SIGKILLed coordinator. Killed
    just after step 1's checkpoint (a failpoint holds it there, coordinator/failpoints.py),
    their trainers hold exactly the checkpoint's weights and optimizer state: the resume keeps
    both workers' backends, loads no checkpoint and sends no weights, and the run goes on
    with them. (Killed in a publication instead, the core's trainer is a step ahead and is
    built again: the fault matrix's coordinator-kill-publication, with spawned workerds.)"""
    point, kept = "checkpointed", 2
    run = tmp_path / "run"
    cfg, workers = _hand_started(tmp_path, tiny_dir, steps=3)
    try:
        first = subprocess.Popen([sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run),
                                  "--no-live"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env={**os.environ, "GYRE_FAILPOINT": point})
        try:
            held = run / f"failpoint-{point}"
            for _ in range(2400):  # 240 s
                if held.exists() or first.poll() is not None:
                    break
                time.sleep(0.1)
            assert held.exists(), f"the run never reached {point} (exit {first.poll()})"
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait(60)
        assert all(w.poll() is None for w in workers)  # the daemons outlive the coordinator
        r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
        assert r.exit_code == 0, r.output
        assert [w.wait(60) for w in workers] == [0, 0]  # told to shut down at the end of the run
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    after = events(run)
    (res,) = [e for e in after if e["event"] == "resume"]
    assert (res["workers_kept"], res["checkpoint_loaded"]) == (kept, False), res
    assert res["step"] == 1
    steps = [e for e in after[after.index(res):] if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(res["step"] + 1, 4)) and all(e["tokens_trained"] for e in steps)
    pushes = [e for e in after[after.index(res):] if e["event"] == "publish"]
    assert pushes and pushes[0]["version"] == res["version"] + 1  # the next step's, on from the kept weights
    said = json.loads(subprocess.run([sys.executable, "-m", "gyre.cli", "inspect", str(run), "--json"],
                                     capture_output=True, text=True, timeout=120).stdout)
    (restart,) = said["run"]["restarts"]
    assert restart["workers_kept"] == kept  # what `gyre inspect` tells of the restart


def _workerds(run: Path) -> list[int]:
    return list(json.loads((run / "workers.json").read_text())["pids"].values())


@pytest.mark.timeout(300)
def test_the_workerds_of_a_crashed_run_nobody_resumes_end_after_worker_linger_s(tiny_dir, tmp_path):
    from gyre.coordinator.local import alive

    run = tmp_path / "run"
    cfg = write_config(tmp_path, tiny_dir, steps=3, workers="local")
    cfg.write_text(cfg.read_text() + "worker_linger_s = 2\n")
    first = subprocess.Popen([sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run), "--no-live"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # killed once its workerds are up (coordinator.json is written then)
        deadline = time.monotonic() + 120
        while not (run / "coordinator.json").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (run / "coordinator.json").exists(), f"the run never started (exit {first.poll()})"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(60)
    pids = _workerds(run)
    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
    for cell in (0, 1):
        said = (run / "logs" / f"workerd-{cell}.log").read_text()
        assert "keeping the model and trainer 2s for the run's resume" in said, said[-2000:]
        assert "no coordinator resumed the run within 2s; shutting down" in said, said[-2000:]


@pytest.mark.timeout(400)
def test_gyre_restart_leaves_the_workerds_running_and_the_resume_keeps_their_weights(tiny_dir, tmp_path):
    """`gyre restart` (SIGUSR1): the stop saves the last step's checkpoint and, a stop for a
    restart, leaves the workerds running; the resume takes the same processes back, their
    trainers at that checkpoint: nothing loaded, no weights sent."""
    from gyre.coordinator.local import alive

    run = tmp_path / "run"
    cfg = write_config(tmp_path, tiny_dir, steps=4, checkpoint_every=0, workers="local")
    first = subprocess.Popen([sys.executable, "-m", "gyre.cli", "up", str(cfg), "--run-dir", str(run), "--no-live"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in first.stdout:
            if line.startswith("step 1/4"):
                break
        else:
            pytest.fail(f"the first run ended before step 1 (exit {first.wait()})")
        before = _workerds(run)
        again = subprocess.run([sys.executable, "-m", "gyre.cli", "restart", str(run), "--no-live"],
                               capture_output=True, text=True, timeout=300)
        assert first.wait(60) == 138
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
        first.stdout.close()
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert _workerds(run) == before and not any(alive(p) for p in before)  # the same ones, stopped at the end
    evs = events(run)
    (res,) = [e for e in evs if e["event"] == "resume"]
    assert (res["workers_kept"], res["checkpoint_loaded"]) == (2, False), res  # the stop's checkpoint, kept
    assert res["checkpoint"] is not None
    assert [e["step"] for e in evs[evs.index(res):] if e["event"] == "step"] == list(range(res["step"] + 1, 5))
