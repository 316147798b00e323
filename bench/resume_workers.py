"""bench/resume_workers.py: what a coordinator crash costs the workers, kept or started again.

Issue 34's second measure. `gyre up` on MODEL (local workerds, 2 cells, the embedded
default's tasks and harness) is held just after step 1's checkpoint (GYRE_FAILPOINT=
checkpointed, coordinator/failpoints.py) and SIGKILLed there; `gyre up --resume` starts at
once, and is stopped (SIGTERM) once it serves. Both ways, interleaved REPEAT times:

    kept     worker_linger_s = 120: the workerds wait and the resume takes them back, their
             model and trainer as they were (no model loaded, no checkpoint loaded)
    new      worker_linger_s = 0: they end with the coordinator; the resume starts new ones,
             each loads the model, and the core loads the checkpoint

Reported per run: the wall seconds from the resume's start to its `resume` event (the run
restored and serving), the event's `down_s` (the earlier coordinator's last heartbeat to
then), and what it kept (`workers_kept`, `checkpoint_loaded`); then the medians, and new's
over kept's. Run:
    python bench/resume_workers.py [--model DIR] [--repeat 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GYRE = [sys.executable, "-m", "gyre.cli"]


def events(run: Path) -> list[dict]:
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def wait(what, timeout_s: float, proc: subprocess.Popen, poll_s: float = 0.05):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        if proc.poll() is not None:
            raise SystemExit(f"gyre exited ({proc.returncode}) before {what.__doc__}")
        time.sleep(poll_s)
    raise SystemExit(f"not within {timeout_s:.0f}s: {what.__doc__}")


def one(root: Path, model: str | None, linger: float) -> dict:
    run = root / "run"
    config = root / "run.toml"
    config.write_text(f"steps = 3\ncells = 2\ncheckpoint_every = 1\nworkers = \"local\"\nworker_linger_s = {linger}\n"
                      + (f"model_dir = \"{model}\"\n" if model else ""))
    log = open(root / "up.log", "ab")
    first = subprocess.Popen([*GYRE, "up", str(config), "--run-dir", str(run), "--no-live"], stdout=log,
                             stderr=subprocess.STDOUT, env={**os.environ, "GYRE_FAILPOINT": "checkpointed"})
    try:
        def held():
            """step 1's checkpoint"""
            return (run / "failpoint-checkpointed").exists()

        wait(held, 900, first)
    finally:
        first.kill()
        first.wait()
    t0 = time.monotonic()
    resumed = subprocess.Popen([*GYRE, "up", "--resume", str(run), "--no-live"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def serving():
            """the resume's event"""
            return next((e for e in events(run) if e["event"] == "resume"), None)

        ev = wait(serving, 900, resumed)
        took = time.monotonic() - t0
    finally:
        resumed.send_signal(signal.SIGTERM)
        resumed.wait()
        log.close()
    return {"resume_s": round(took, 2), "down_s": ev["down_s"], "workers_kept": ev["workers_kept"],
            "checkpoint_loaded": ev["checkpoint_loaded"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a model directory (default: the tiny model)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each way, interleaved")
    p.add_argument("--json", type=Path, help="write the results here too")
    a = p.parse_args()
    rows: dict[str, list[dict]] = {"kept": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="gyre-resume-workers-") as tmp:
        for i in range(a.repeat):
            for way, linger in (("kept", 120.0), ("new", 0.0)) if i % 2 == 0 else (("new", 0.0), ("kept", 120.0)):
                root = Path(tmp) / f"{way}-{i}"
                root.mkdir()
                got = one(root, a.model, linger)
                rows[way].append(got)
                print(f"{way:4} #{i + 1}: resume serving after {got['resume_s']:.2f} s (down_s {got['down_s']}), "
                      f"workers kept {got['workers_kept']}, checkpoint loaded {got['checkpoint_loaded']}", flush=True)
    med = {w: statistics.median(r["resume_s"] for r in rows[w]) for w in rows}
    print(f"median resume: kept {med['kept']:.2f} s, new {med['new']:.2f} s: new/kept {med['new'] / med['kept']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"runs": rows, "median_resume_s": med, "args": vars(a)}, default=str, indent=1))


if __name__ == "__main__":
    main()
