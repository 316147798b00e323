"""taskrun.py: `gyre tasks run` and `gyre eval`: each task of a source k times, through the launcher, scored.

The rollout stack on one local workerd serves the harness's calls (stack.py, as for `gyre serve`); each
execution runs in its own sandbox under the launcher's full lifecycle (image, harness or,
with `solution`, the task's own solution/solve.sh, deadline, tests, verifier, removal), a
few at a time. Results (task, sample, status, score, valid, ref, calls) are returned and
written to RUN_DIR/tasks.json; each execution's records and logs are under
RUN_DIR/executions/. Not training: nothing is learned from these runs; not the pass@k
(evalrun.py, heldout.py).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path

from gyre.coordinator.buffer import Execution
from gyre.coordinator.harnesses import HarnessPreset
from gyre.coordinator.launcher import LaunchSpec
from gyre.coordinator.sandbox import Limits
from gyre.coordinator.stack import execution_stack, rollout_stack, serving_worker
from gyre.coordinator.tasks import Task
from gyre.coordinator.waterlevel import Tracked
from gyre.proxy.serving import ProxyConfig


def execution_id(index: int, task: Task, sample: int | None = None) -> str:
    """t003-NAME for a task run once; t003-NAME-s01 for its sample 1 of several."""
    name = re.sub(r"[^a-zA-Z0-9_.-]+", "-", task.id).strip("-.")[:60] or "task"
    return f"t{index:03d}-{name}" + ("" if sample is None else f"-s{sample:02d}")


async def run_tasks(tasks: list[Task], *, preset: HarnessPreset, model_dir: Path, run_dir: Path,
                    sandbox: str = "podman", sandbox_url: str | None = None, solution: bool = False,
                    concurrency: int = 2, timeout_s: float | None = None, default_timeout_s: float = 600.0,
                    settings: ProxyConfig | None = None,
                    infra_failure: str = "aborted_infra", keep_sandbox: str = "never", allow_internet: bool = False,
                    swe_score: str = "all", eval_attempts: int = 1, k: int = 1, on_result=None) -> list[dict]:
    """Every task `k` times (at most `concurrency` executions at once); one result per
    execution, in task then sample order. `timeout_s`: the --timeout given (over the
    preset's own, under the task's), None: the preset's, else `default_timeout_s` (the run
    config's execution_timeout_s where one was given)."""
    spec = LaunchSpec(preset=preset, timeout_s=timeout_s or default_timeout_s, timeout_flag_s=timeout_s,
                      eval_attempts=eval_attempts, eval_budget_s=60.0,
                      infra_failure=infra_failure, keep_sandbox=keep_sandbox, allow_internet=allow_internet,
                      swe_score=swe_score, solution=solution, limits=Limits(pids=4096))
    serving = settings if settings is not None else ProxyConfig()
    async with (rollout_stack(serving_worker(model_dir, run_dir), replace(serving, host="127.0.0.1", port=0),
                              run_dir=run_dir) as rollout,
                execution_stack(rollout.proxy, spec, run_dir=run_dir, sandbox=sandbox,
                                sandbox_url=sandbox_url) as executor):
        launcher = executor.launcher
        for task in tasks:  # refused before anything runs, named
            launcher.images.check(task)
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(index: int, task: Task, sample: int) -> dict:
            async with gate:
                run = Execution(id=execution_id(index, task, sample if k > 1 else None), group=0, index=sample,
                                task=task, tracked=Tracked(), version_dispatched=0)
                await launcher.run(run)
                result = {"task": task.id, "sample": sample, "status": run.status, "score": run.reward,
                          "valid": run.valid, "ref": run.ref, "execution": run.id,
                          "calls": len(run.recorder.calls) if run.recorder else 0}
                if on_result is not None:
                    on_result(result)
                return result

        # Sample-major: with a bound below k x tasks, every task gets its first sample
        # early (one image build each, in parallel) rather than one task all of them.
        order = [(i, t, s) for s in range(max(1, k)) for i, t in enumerate(tasks)]
        done = await asyncio.gather(*(one(i, t, s) for i, t, s in order))
        results = [r for _, r in sorted(zip(order, done, strict=True), key=lambda x: (x[0][0], x[0][2]))]
    (run_dir / "tasks.json").write_text(json.dumps({"tasks": results}, indent=2))
    return results
