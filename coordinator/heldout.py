"""heldout.py: held-out evaluation: pass@k over a task source, during training and alone.

During a run (`eval_every` steps, `eval_tasks_path`, `eval_k`), `HeldOut` dispatches a
round at the start and at every eval_every-th step's publication: each held-out task k
times, at the version just published. Its executions run through the same launcher and
proxy as training's but are never trained: they are outside the trajectory buffer and the
waterlevel the policies read, and take only serving slots training leaves free
(schedule.py). When a round's last execution closes, an `eval` event gives its pass@k.
`pass_at_k` is the estimator `gyre eval` prints too. Not the scheduler, not the launcher.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from gyre.coordinator.buffer import Execution
from gyre.coordinator.waterlevel import Waterlevel


def rounds_in(run_dir) -> int:
    """The number after the highest evaluation round whose executions a run directory holds."""
    numbers = [int(p.name.removeprefix("eval").split("-")[0]) for p in (run_dir / "executions").glob("eval*-*-*")
               if p.name.removeprefix("eval").split("-")[0].isdigit()]
    return max(numbers, default=-1) + 1


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of n valid samples with c passes (Chen et al. 2021): the chance
    that k of them drawn without replacement hold a pass. With n < k: pass@n."""
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def score(results: dict[str, list[tuple[bool, float | None]]], k: int, threshold: float) -> dict:
    """pass@k and pass@1 over tasks from {task: [(valid, reward), ...]}: a valid reward >=
    `threshold` passes; invalid outcomes (evaluator_error, aborted_infra) are not samples, and
    a task with none valid is `unscored`, never a fail."""
    per_task, at_k, at_1, rewards = {}, [], [], []
    for task, outcomes in results.items():
        scored = [r for valid, r in outcomes if valid and r is not None]
        passed = sum(r >= threshold for r in scored)
        per_task[task] = {"samples": len(scored), "passed": passed, "rewards": [round(r, 6) for r in scored]}
        if scored:
            at_k.append(pass_at_k(len(scored), passed, k))
            at_1.append(passed / len(scored))
            rewards += scored
    return {"k": k, "threshold": threshold, "tasks": len(results), "scored_tasks": len(at_k),
            "unscored": sorted(t for t, v in per_task.items() if not v["samples"]),
            "pass_at_k": sum(at_k) / len(at_k) if at_k else None,
            "pass_at_1": sum(at_1) / len(at_1) if at_1 else None,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None, "per_task": per_task}


@dataclass
class Round:
    number: int
    step: int
    version: int
    runs: list[Execution] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    closed: int = 0


class HeldOut:
    """The run's evaluation rounds: `dispatch` queues one, the coordinator launches from
    `queue` as decisions allow and calls `close` for each ended execution; `close` returns
    the round's `eval` event once the round is complete."""

    def __init__(self, tasks: list, *, k: int, threshold: float, first_round: int = 0):
        self.tasks, self.k, self.threshold = tasks, k, threshold
        self.queue: deque[Execution] = deque()
        self.running: set[str] = set()
        self.rounds: dict[int, Round] = {}
        self.next_round = first_round  # a resumed run continues the numbers: execution folders stay unique
        self.wl = Waterlevel()  # their own counters: each launched one still closes exactly once

    def dispatch(self, *, step: int, version: int) -> Round:
        r = Round(self.next_round, step, version)
        self.rounds[r.number] = r
        self.next_round += 1
        for t, task in enumerate(self.tasks):
            for i, tracked in enumerate(self.wl.dispatch(self.k)):
                run = Execution(f"eval{r.number:03d}-{t:03d}-{i:02d}", -1, i, task, tracked, version)
                r.runs.append(run)
                self.queue.append(run)
        return r

    def round_of(self, run: Execution) -> Round:
        return self.rounds[int(run.id.removeprefix("eval").split("-")[0])]

    def launched(self, run: Execution) -> None:
        self.wl.launch(run.tracked)
        self.running.add(run.id)

    def close(self, run: Execution) -> dict | None:
        """Record an ended execution (launched or not); the round's event when it completes."""
        self.running.discard(run.id)
        if run.tracked.state.value == "queued":
            self.wl.launch(run.tracked)
        self.wl.terminate(run.tracked)
        r = self.round_of(run)
        r.closed += 1
        r.statuses[run.status] = r.statuses.get(run.status, 0) + 1
        if r.closed < len(r.runs):
            return None
        results: dict[str, list] = {}
        for x in r.runs:
            results.setdefault(x.task.id, []).append((x.valid, x.reward))
        # The round's wall time: its first start to its last end (None when nothing of it ran).
        starts, ends = [x.t_start for x in r.runs if x.t_start], [x.t_end for x in r.runs if x.t_end]
        seconds = round(max(ends) - min(starts), 3) if starts and ends else None
        return {"round": r.number, "step": r.step, "version": r.version, "executions": len(r.runs),
                "statuses": dict(r.statuses), "complete": not r.statuses.get("cancelled"), "seconds": seconds,
                **score(results, self.k, self.threshold)}

    def cancel_queued(self) -> list[Execution]:
        """At shutdown: the executions never launched, each closed as cancelled."""
        out = list(self.queue)
        self.queue.clear()
        return out
