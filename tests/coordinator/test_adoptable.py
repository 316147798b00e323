"""Which sandboxes a reaper leaves for a restarted coordinator to adopt (issue 34,
coordinator/sandbox/reaper.py): a container whose harness runs on by itself stays until its
deadline (plus ADOPT_SLACK_S) has passed, whoever starts meanwhile; once the restarted
coordinator has adopted what it could, what it did not adopt of its run is an orphan."""

from __future__ import annotations

import json
import time

from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER, LABEL_PROCESS, LABEL_RUN_DIR
from gyre.coordinator.sandbox.reaper import ADOPT_SLACK_S, KEY_FILE, adoptable_until, at_resume, at_shutdown, at_startup

DEAD = "1:1"  # a process label no live process has (pid 1 with another start time)


def _execution(run_dir, name, *, started=None, timeout_s=60.0, key=True, harness=True):
    folder = run_dir / "executions" / name
    folder.mkdir(parents=True)
    record = {"host": "local", "backend": "podman", "id": "c" * 64, "image": "i"}
    if harness:
        record["harness"] = {"exec": "x" * 64, "token": "t1", "started": started or time.time(),
                             "timeout_s": timeout_s}
    (folder / "sandbox.json").write_text(json.dumps(record))
    if key:
        (folder / KEY_FILE).write_text("gyre-key")
    return {LABEL_OWNER: "dead-owner", LABEL_PROCESS: DEAD, LABEL_RUN_DIR: str(run_dir), LABEL_EXECUTION: name}


def test_a_running_harness_is_adoptable_until_its_deadline(tmp_path):
    run = tmp_path / "crashed"
    live = _execution(run, "e1")
    late = _execution(run, "e2", started=time.time() - 60 - ADOPT_SLACK_S - 1)
    keyless = _execution(run, "e3", key=False)
    never = _execution(run, "e4", harness=False)  # killed before its harness started
    other = at_startup("another-run", tmp_path / "another")
    assert other(live)  # another run's start leaves it for the crashed run's resume
    assert not other(late) and not other(keyless) and not other(never)
    until = adoptable_until(run / "executions" / "e1")
    assert until is not None and until > time.time() + 59
    assert adoptable_until(run / "executions" / "e4") is None


def test_the_resume_sweeps_what_it_did_not_adopt_and_its_shutdown_what_it_did(tmp_path):
    run = tmp_path / "run"
    mine, theirs = _execution(run, "e1"), _execution(run, "e2")
    elsewhere = _execution(tmp_path / "other", "e1")
    swept = at_resume("new-owner", run, adopted={"e1"})
    assert swept(mine) and not swept(theirs) and swept(elsewhere)
    at_end = at_shutdown("new-owner", run, adopted={"e1"})
    assert not at_end(mine)  # adopted: this process's to remove now
    assert at_end(theirs) and at_end(elsewhere)  # not this process's
    assert at_end({**theirs, LABEL_OWNER: "x"}) and not at_end({**theirs, LABEL_OWNER: "new-owner"})


def test_a_run_directory_nobody_resumes_leaves_nothing_to_adopt(tmp_path):
    """`gyre tasks run`, `eval` and `serve` are never resumed: their containers are orphans as
    soon as their process is gone, not kept running to their deadline."""
    for command in ("tasks run", "eval", "serve", "up", None):
        run = tmp_path / str(command)
        labels = _execution(run, "e1")
        if command is not None:
            (run / "config.json").write_text(json.dumps({"command": command} if command != "up" else {"steps": 2}))
        resumable = command in ("up", None)
        assert (adoptable_until(run / "executions" / "e1") is not None) == resumable, command
        assert at_startup("another-run", tmp_path / "another")(labels) == resumable, command
