"""evalrun.py: `gyre eval`'s run: a task source k times on one model, and its pass@k.

`evaluate` runs every task k times through taskrun.run_tasks (the proxy, one local
workerd, the launcher and its sandboxes, at most `concurrency` executions at once) and
folds the outcomes through heldout.score, the estimator the training loop's `eval` events
use: a valid reward >= threshold passes, an invalid outcome (evaluator_error,
aborted_infra) is no sample, and a task with no valid one is unscored, never a fail. The
report is returned and written to RUN_DIR/eval.json beside tasks.json (every execution's
outcome). Not the model's preparation or the table (cli/eval.py), not the launcher.
"""

from __future__ import annotations

import json
from pathlib import Path

from gyre.coordinator.heldout import score
from gyre.coordinator.taskrun import run_tasks
from gyre.coordinator.tasks import Task
from gyre.workerd.wire import GyreError


class EvalError(GyreError):
    """An evaluation that cannot start: the message names the flag or file and why."""


def summarise(tasks: list[Task], results: list[dict], *, k: int, threshold: float) -> dict:
    """The report of run_tasks' `results`: heldout.score's pass@k, pass@1, reward mean and
    unscored tasks, and one row per task (samples, passed, rewards, statuses)."""
    outcomes: dict[str, list[tuple[bool, float | None]]] = {t.id: [] for t in tasks}
    statuses: dict[str, dict[str, int]] = {t.id: {} for t in tasks}
    for r in results:
        outcomes[r["task"]].append((r["valid"], r["score"]))
        statuses[r["task"]][r["status"]] = statuses[r["task"]].get(r["status"], 0) + 1
    s = score(outcomes, k, threshold)
    rows = [{"task": t, **s["per_task"][t], "statuses": statuses[t]} for t in outcomes]
    return {"k": k, "threshold": threshold, "pass_at_k": s["pass_at_k"], "pass_at_1": s["pass_at_1"],
            "reward_mean": s["reward_mean"], "unscored": s["unscored"], "scored_tasks": s["scored_tasks"],
            "executions": len(results), "tasks": rows}


async def evaluate(tasks: list[Task], *, k: int, threshold: float, run_dir: Path, about: dict | None = None,
                   **run) -> dict:
    """Every task k times (`run`: run_tasks' keywords), scored; `about` (the model, the
    step) heads the report."""
    results = await run_tasks(tasks, k=k, run_dir=run_dir, **run)
    report = {**(about or {}), **summarise(tasks, results, k=k, threshold=threshold)}
    (run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    return report
