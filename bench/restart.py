"""bench/restart.py: what a coordinator crash costs a run whose executions are in containers.

Issue 34's measure. `gyre up` on the tiny model with podman executions whose harness (the
agent of tests/faults/restart.py, the real `openai` SDK) makes CALLS model calls GAP seconds
apart: about a minute of calls each with the defaults. First the run uninterrupted; then the
same run with its coordinator SIGKILLed once every execution is KILL_AFTER calls in (mid-
rollout), `gyre up --resume` started DOWN seconds later. Reported, for each downtime: both
runs' wall times (first start to the last exit), the time lost (their difference) against the
downtime (the kill to the resume's start) and the resume's own `down_s`, whether it is under
twice the downtime, and the executions adopted, run again and completed (every one adopted,
none run again, is the point). Needs rootful podman and gyre's base image (`gyre doctor`).
Run:
    python bench/restart.py [--calls 30] [--gap 2] [--kill-after 8] [--down 10,25] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the tests' scenario

from tests.faults import restart as r  # noqa: E402 - test scaffolding, not part of the package


def uninterrupted(root: Path, calls: int, gap: float) -> dict:
    config = r.scenario(root, calls=calls, gap_s=gap)
    t0 = time.monotonic()
    proc = r.up(config, root / "run", steps=1, log=root / "up.log")
    code = proc.wait()
    wall = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {code}): see {root / 'up.log'}")
    return {"wall_s": round(wall, 1), **_outcome(root / "run")}


def interrupted(root: Path, calls: int, gap: float, kill_after: int, down: float) -> dict:
    config = r.scenario(root, calls=calls, gap_s=gap)
    run = root / "run"
    t0 = time.monotonic()
    first = r.up(config, run, steps=1, log=root / "up.log")

    def mid_rollout():
        """every execution is kill_after calls in"""
        made = r.calls_made(run)
        return len(made) == 4 and all(n >= kill_after for n in made.values())

    try:
        r.wait_for(mid_rollout, 600, proc=first)
    finally:
        r.kill(first)
    killed = time.monotonic()
    time.sleep(max(0.0, down - (time.monotonic() - killed)))
    resumed_at = time.monotonic()
    done = r.resume(run, root / "up.log", timeout_s=900)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"the resumed run failed (exit {done.returncode}): see {root / 'up.log'}")
    ev = next(e for e in r.events(run) if e["event"] == "resume")
    return {"wall_s": round(wall, 1), "killed_at_s": round(killed - t0, 1), "downtime_s": round(resumed_at - killed, 1),
            "resume_down_s": ev["down_s"], "adopted": ev["executions_adopted"],
            "redispatched": ev["executions_redispatched"], **_outcome(run)}


def _outcome(run: Path) -> dict:
    events = r.events(run)
    ends = [e for e in events if e["event"] == "execution"]
    step = next(e for e in events if e["event"] == "step")
    return {"executions": len(ends), "completed": sum(e["status"] == "completed" for e in ends),
            "reruns": sum("-r" in e["id"] for e in ends), "tokens_trained": step["tokens_trained"],
            "execution_s": round(max(e["t_end"] - e["t_start"] for e in ends), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=30, help="model calls per execution")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between an execution's calls")
    p.add_argument("--kill-after", type=int, default=8, help="calls every execution has made at the kill")
    p.add_argument("--down", default="10,25", help="seconds from the kill to the resume, comma-separated")
    p.add_argument("--json", type=Path, help="write the results here too")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-restart-") as tmp:
        base = uninterrupted(Path(tmp) / "base", a.calls, a.gap)
        print(f"uninterrupted: {base['wall_s']:.1f} s wall, executions {base['execution_s']:.0f} s of calls, "
              f"{base['completed']}/{base['executions']} completed", flush=True)
        rows = []
        for down in (float(x) for x in a.down.split(",")):
            got = interrupted(Path(tmp) / f"down-{down:g}", a.calls, a.gap, a.kill_after, down)
            lost = got["wall_s"] - base["wall_s"]
            got.update(lost_s=round(lost, 1), under_twice_downtime=lost < 2 * got["downtime_s"])
            rows.append(got)
            print(f"killed at {got['killed_at_s']:.0f} s, down {got['downtime_s']:.1f} s (resume says "
                  f"{got['resume_down_s']} s): {got['wall_s']:.1f} s wall, lost {lost:.1f} s = "
                  f"{lost / got['downtime_s']:.2f}x the downtime; adopted {got['adopted']}, run again "
                  f"{got['redispatched']}, completed {got['completed']}/{got['executions']}, reruns {got['reruns']}, "
                  f"tokens trained {got['tokens_trained']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"uninterrupted": base, "interrupted": rows, "args": vars(a)}, default=str,
                                     indent=1))


if __name__ == "__main__":
    main()
