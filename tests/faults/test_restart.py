"""The coordinator SIGKILLed mid-rollout, `gyre up --resume` at once (issue 34): the
executions it left running carry on in their own containers and the step trains them.

`gyre up` on the tiny model with podman executions (tests/faults/restart.py: an agent making
its calls through the real `openai` SDK, whose retries cover the restart). Once every
execution has made two calls the coordinator alone is killed (a crash: its proxy, relays and
podman service die, the containers run on). While it is down one harness ends on its own and
one container is removed (its host lost it). The resumed coordinator adopts the other three
and scores the one that ended; the removed one is aborted_infra, never run again. Then:
each execution has one status, none ran twice (its workspace's `starts`), its calls are each
recorded once in one tree (one root: the retried call extended the conversation), the step
trains on them, the resume says its downtime, and no container of the run is left. The same
run restarted without a crash (`gyre restart`: SIGUSR1, a stop that hands its container
executions off) has every execution adopted, none cancelled; killed in training instead (step 1
waiting for its slow group), the fast group's executions are restored and the slow one's adopted.
"""

from __future__ import annotations

import subprocess

import pytest

from gyre.proxy.records import load_execution
from tests.faults import restart as r
from tests.sandbox.conftest import podman_ready

__all__ = ["podman_ready"]  # a fixture, used by name
pytestmark = pytest.mark.sandbox
CALLS = 10  # ~2 s apart: each harness works for ~20 s, killed after its second call


@pytest.mark.timeout(420)
def test_a_killed_coordinators_executions_carry_on_in_their_sandboxes(podman_ready, tmp_path):
    config = r.scenario(tmp_path, calls=CALLS, gap_s=2.0, short="g00000-01")
    run = tmp_path / "run"
    first = r.up(config, run, steps=1, log=tmp_path / "up.log")
    try:
        def two_calls_each():
            """every execution made two calls"""
            made = r.calls_made(run)
            return len(made) == 4 and all(n >= 2 for n in made.values())

        r.wait_for(two_calls_each, 240, proc=first)
    finally:
        r.kill(first)
    r.wait_for(lambda: r.harness_ended(run, "g00000-01"), 60)  # it ends while nobody serves
    gone = r.sandbox_of(run, "g00001-00")
    r.podman("rm", "-f", "-t", "0", gone)  # its host lost it
    meanwhile = r.inspect(run)  # what `gyre inspect` says of the crashed run: nothing is made up
    assert meanwhile["run"]["state"] == "crashed"
    assert {e["execution"]: e["execution_status"] for e in meanwhile["executions"]} == dict.fromkeys(
        ["g00000-00", "g00000-01", "g00001-00", "g00001-01"], "left running")
    done = r.resume(run, tmp_path / "up.log", timeout_s=300)
    log = (tmp_path / "up.log").read_text()
    assert done.returncode == 0, log[-3000:]

    events = r.events(run)
    (resumed,) = [e for e in events if e["event"] == "resume"]
    assert (resumed["executions_adopted"], resumed["executions_redispatched"]) == (4, 0), resumed
    assert isinstance(resumed["down_s"], float) and 0 < resumed["down_s"] < 120, resumed
    ends = {e["id"]: e for e in events if e["event"] == "execution"}
    assert sorted(ends) == ["g00000-00", "g00000-01", "g00001-00", "g00001-01"]  # one status each, no rerun
    assert all(e["adopted"] for e in ends.values())
    lost = ends.pop("g00001-00")
    assert (lost["status"], lost["reward"], lost["valid"]) == ("aborted_infra", None, False)
    assert "not adopted after the coordinator's restart" in lost["ref"] and gone[:12] in lost["ref"]
    assert {k: (e["status"], e["reward"]) for k, e in ends.items()} == {
        "g00000-00": ("completed", 1.0), "g00000-01": ("completed", 0.0), "g00001-01": ("completed", 0.0)}
    for ex, calls in (("g00000-00", CALLS), ("g00000-01", 2), ("g00001-01", CALLS)):
        folder = run / "executions" / ex
        assert (folder / "workspace" / "starts").read_text() == "started\n", ex  # never started again
        recorded = load_execution(folder)
        assert r.answered(recorded) == calls, ex  # each call once, none lost, one root
        assert "was adopted" in (folder / "harness.log").read_text()
    (step,) = [e for e in events if e["event"] == "step"]
    assert step["tokens_trained"] > 0, step  # group 0's rewards 1 and 0: an advantage trained
    summary = [e for e in events if e["event"] == "summary"][-1]
    assert summary["statuses"] == {"completed": 3, "aborted_infra": 1}, summary
    assert summary["counters"] == {"d": 4, "p": 4, "f": 4}  # as an uninterrupted run's: none counted twice
    left = r.podman("ps", "-aq", "--filter", f"label=gyre.run_dir={run}").stdout.strip()
    assert left == "", left  # every sandbox removed, the lost one's never made again
    after = r.inspect(run)
    (restart,) = after["run"]["restarts"]
    assert (restart["adopted"], restart["redispatched"]) == (4, 0) and restart["down_s"] == resumed["down_s"]
    assert all(e["adopted"] for e in after["executions"])


@pytest.mark.timeout(420)
def test_gyre_restart_hands_the_running_executions_to_the_resume(podman_ready, tmp_path):
    """`gyre restart RUN_DIR`, twice: the live coordinator stops on SIGUSR1 leaving its container
    executions running (nothing journaled of their end), and the resume in the restart's own
    process adopts every one; restarted again, that one hands off what it had adopted."""
    config = r.scenario(tmp_path, calls=CALLS, gap_s=2.0)
    run = tmp_path / "run"
    first = r.up(config, run, steps=1, log=tmp_path / "first.log")
    again = None
    try:
        def two_calls_each():
            """every execution made two calls"""
            made = r.calls_made(run)
            return len(made) == 4 and all(n >= 2 for n in made.values())

        r.wait_for(two_calls_each, 240, proc=first)
        with open(tmp_path / "again.log", "wb") as out:
            again = subprocess.Popen([*r.GYRE, "restart", str(run), "--no-live"], cwd=r.REPO, stdout=out,
                                     stderr=subprocess.STDOUT)

        def adopted_and_on():
            """the first restart adopted them, and each made calls since"""
            resumed = any(e["event"] == "resume" for e in r.events(run))
            return resumed and all(n >= 5 for n in r.calls_made(run).values())

        r.wait_for(adopted_and_on, 240, proc=again)
        last = subprocess.run([*r.GYRE, "restart", str(run), "--no-live"], cwd=r.REPO, capture_output=True,
                              text=True, timeout=300)
    finally:
        for proc in (first, again):
            if proc is not None and proc.poll() is None:
                r.kill(proc)
    said = (tmp_path / "first.log").read_text()
    assert first.returncode == 138, said[-3000:]  # 128 + SIGUSR1: stopped for the restart
    assert "4 executions left running in their containers, for the resume to adopt" in said, said[-2000:]
    said = (tmp_path / "again.log").read_text()
    assert "is stopping; executions in containers keep running" in said
    assert again.returncode == 138 and "4 executions left running" in said, said[-3000:]  # adopted, handed on
    assert last.returncode == 0, (last.stdout + last.stderr)[-3000:]
    events = r.events(run)
    ends = {e["id"]: e for e in events if e["event"] == "execution"}
    assert sorted(ends) == ["g00000-00", "g00000-01", "g00001-00", "g00001-01"]  # none cancelled, none rerun
    assert all(e["adopted"] and e["status"] == "completed" for e in ends.values()), ends
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["executions_adopted"], e["executions_redispatched"]) for e in resumes] == [(4, 0), (4, 0)], resumes
    for ex in ends:
        folder = run / "executions" / ex
        assert (folder / "workspace" / "starts").read_text() == "started\n", ex
        assert r.answered(load_execution(folder)) == CALLS, ex
    assert [e["step"] for e in events if e["event"] == "step"] == [1]
    left = r.podman("ps", "-aq", "--filter", f"label=gyre.run_dir={run}").stdout.strip()
    assert left == "", left


def test_gyre_restart_on_a_run_nobody_runs_says_how_to_continue(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    r_ = subprocess.run([*r.GYRE, "restart", str(run)], cwd=r.REPO, capture_output=True, text=True, timeout=60)
    assert r_.returncode == 1
    assert f"no gyre process holds {run}: nothing to restart; continue a stopped or crashed run with `gyre up " \
           f"--resume {run}`" in r_.stderr, r_.stderr


@pytest.mark.timeout(420)
def test_a_coordinator_killed_in_training_keeps_the_slow_groups_executions(podman_ready, tmp_path):
    """Killed while step 1 is in flight (the core training the fast group, the step waiting for
    the slow one): the resume restores the fast group's closed executions, adopts the slow
    group's still running, and trains step 1 again on both; none is run twice."""
    fast = "g00000-00,g00000-01"
    config = r.scenario(tmp_path, calls=CALLS, gap_s=2.0, short=fast)
    run = tmp_path / "run"
    first = r.up(config, run, steps=1, log=tmp_path / "up.log")
    try:
        def training():
            """step 1 in flight, the core training, the slow group still running"""
            s = r.status(run)
            return s is not None and s["steps"]["done"] == 0 and s["step_in_flight"] \
                and s["cells"][0]["role"] == "training" and s["waterlevel"]["running"] == 2

        r.wait_for(training, 240, proc=first)
    finally:
        r.kill(first)
    done = r.resume(run, tmp_path / "up.log", timeout_s=300)
    assert done.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
    events = r.events(run)
    (resumed,) = [e for e in events if e["event"] == "resume"]
    assert (resumed["executions_restored"], resumed["executions_adopted"], resumed["executions_redispatched"]) == (
        2, 2, 0), resumed
    ends = [e for e in events if e["event"] == "execution"]
    assert sorted(e["id"] for e in ends) == ["g00000-00", "g00000-01", "g00001-00", "g00001-01"]  # once each
    assert {e["id"] for e in ends if e.get("adopted")} == {"g00001-00", "g00001-01"}
    assert all(e["status"] == "completed" for e in ends)
    (step,) = [e for e in events if e["event"] == "step"]  # the lost step 1, trained once after the resume
    assert sorted(step["group_ids"]) == [0, 1] and step["tokens_trained"] > 0, step
    for ex in ("g00001-00", "g00001-01"):
        folder = run / "executions" / ex
        assert (folder / "workspace" / "starts").read_text() == "started\n", ex
        assert r.answered(load_execution(folder)) == CALLS, ex
    left = r.podman("ps", "-aq", "--filter", f"label=gyre.run_dir={run}").stdout.strip()
    assert left == "", left


@pytest.mark.timeout(420)
@pytest.mark.parametrize("point", ["publication", "checkpoint"])
def test_a_coordinator_killed_in_publication_or_a_checkpoint_keeps_the_running_groups(podman_ready, tmp_path,
                                                                                      point):
    """Killed while step 1's weights go out (the core took them, cell 1 not yet), or while its
    checkpoint is written (trainer.pt on disk, the state not yet): held there by a failpoint
    (coordinator/failpoints.py) while the executions run on, then SIGKILLed. No checkpoint
    counts (the torn one is passed over), so step 1 is trained again from the journal. Group
    1, running since the start, is adopted and trained by step 2; in the checkpoint case group
    2, dispatched by step 1's publication before the kill, is adopted too, at the resume,
    though it belongs to a stretch the crash lost (before, such a group was held for its
    publication and run again from the start), and that publication dispatches nothing new."""
    config = r.scenario(tmp_path, calls=CALLS, gap_s=2.0, short="g00000-00,g00000-01", groups=2, steps=2,
                        extra="phi = 1\ncheckpoint_every = 1\n")
    run = tmp_path / "run"
    first = r.up(config, run, steps=2, log=tmp_path / "up.log", failpoint=point)
    try:
        r.wait_for(lambda: (run / f"failpoint-{point}").exists(), 240, proc=first)
        if point == "checkpoint":
            def group_2_calling():
                """step 1's publication dispatched group 2, and its harnesses made a call"""
                made = r.calls_made(run)
                return all(made.get(f"g00002-0{i}", 0) >= 1 for i in (0, 1))

            r.wait_for(group_2_calling, 120, proc=first)
            assert (run / "checkpoints" / "step-000001" / "trainer.pt").exists()  # torn: no state
    finally:
        r.kill(first)
    running = {ex for ex, n in r.calls_made(run).items() if ex >= "g00001"}
    done = r.resume(run, tmp_path / "up.log", timeout_s=300)
    log = (tmp_path / "up.log").read_text()
    assert done.returncode == 0, log[-3000:]
    events = r.events(run)
    (resumed,) = [e for e in events if e["event"] == "resume"]
    adopted = {"g00001-00", "g00001-01"} | ({"g00002-00", "g00002-01"} if point == "checkpoint" else set())
    assert running == adopted
    assert resumed["checkpoint"] is None, resumed  # the torn step 1 is not a checkpoint
    assert (resumed["executions_restored"], resumed["executions_adopted"], resumed["executions_redispatched"]) == (
        2, len(adopted), 0), resumed
    assert sorted({e["group"] for e in events if e["event"] == "dispatch"}) == [0, 1, 2]  # no group 3
    ends = {}
    for e in events:
        if e["event"] == "execution":
            assert e["id"] not in ends, e  # one status each
            ends[e["id"]] = e
    assert {k for k, e in ends.items() if e.get("adopted")} == adopted
    assert {k: ends[k]["status"] for k in ("g00000-00", "g00000-01", "g00001-00", "g00001-01")} == dict.fromkeys(
        ("g00000-00", "g00000-01", "g00001-00", "g00001-01"), "completed")
    assert not any(e["valid"] and e["status"] != "completed" for e in ends.values())
    steps = [e for e in events if e["event"] == "step"]
    # Step 1 before the kill, trained again after it (lost with the model), then step 2.
    assert [(e["step"], sorted(e["group_ids"])) for e in steps] == [(1, [0]), (1, [0]), (2, [1])], steps
    assert all(e["tokens_trained"] > 0 for e in steps)
    for ex in ("g00001-00", "g00001-01"):
        folder = run / "executions" / ex
        assert (folder / "workspace" / "starts").read_text() == "started\n", ex  # never started again
        recorded = load_execution(folder)
        assert r.answered(recorded) == CALLS, ex
    summary = [e for e in events if e["event"] == "summary"][-1]
    assert summary["counters"] == {"d": 6, "p": 6, "f": 6}, summary  # three groups, as uninterrupted
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [1, 2]  # step 1's, written whole again
    left = r.podman("ps", "-aq", "--filter", f"label=gyre.run_dir={run}").stdout.strip()
    assert left == "", left
