"""scoring.py: `Scoring`, what an execution's end makes it: its workspace copied out, its reward, its status.

Before anything is scored every process of the sandbox is killed (a daemon the agent left could
rewrite what is scored), and the workspace is copied out to RUN_DIR/executions/ID/workspace
(links never followed, under a cap; what went wrong is recorded, never the status). A task's
verifier then runs in a fresh sandbox from the task's image holding that copy and the tests
(verifier.py): nothing the agent changed outside its workdir (its tools, hooks, preload list,
`sleep`) takes part, and its own container is removed first (kept under keep_sandbox, it is
never started again); a task whose `[verifier] environment = "agent"` is scored in a copy of its
stopped container instead, its diff in agent-diff.json (verifier.py says what that mode can and
cannot guarantee); else an evaluator scores the copy. A reward outside reward_range is no reward
(evaluator_error). Ends in exactly one status:

    harness               calls recorded   evaluation     status
    exit 0                any              ok / failed    completed / evaluator_error
    exit != 0             >= 1             ok / failed    harness_error / evaluator_error
    exit != 0, no call    0                -              placeholder (valid zero)
    could not start       0                -              aborted_infra (invalid)
    refused by gyre, then any              -              aborted_infra, or placeholder
      failed (below)                                      under infra_failure = "placeholder"
    deadline              any              ok / failed    timed_out / evaluator_error
    over storage_mb       (as exit 137: killed, like a memory hog)
    sandbox failed        any              -              aborted_infra, or placeholder
                                                          under infra_failure = "placeholder"

gyre's own refusals are never the agent's score: a harness whose last model call gyre refused
(503: the disk guard, no engine; 429: its execution's budget), or that exited non-zero after
any such refusal, ended because of gyre, and the zero it would score is one gyre made (the
fake zeros that corrupt RL). A context overflow or a bad request is the agent's, and scored.

Owned by the launcher (launcher.py), which runs the harness and removes the sandbox; not the
evaluators themselves (evaluator.py, verifier.py).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from gyre.coordinator.buffer import Execution
from gyre.coordinator.evaluator import EvaluatorError, EvaluatorFailed, Outcome, build_evaluator, evaluate_with_retries
from gyre.coordinator.sandbox import Sandbox, SandboxBackend, SandboxError
from gyre.coordinator.sandbox.base import COPY_LIMIT_BYTES
from gyre.coordinator.verifier import build_verifier

log = logging.getLogger("gyre.coordinator")


class Scoring:
    def __init__(self, spec, backend: SandboxBackend, default_evaluator: dict):
        self.spec = spec  # the launcher's LaunchSpec
        self.backend = backend  # the run's one kind: a container's workspace is copied out, a folder's is there
        self.default_evaluator = default_evaluator
        self._copied: set[str] = set()  # executions whose workspace has been copied out (once, before any test)
        self._owners: dict[str, dict] = {}  # execution -> its copy's owners (CopyReport.owners), for the verifier

    def copied(self, run_id: str) -> bool:
        """Whether `run_id`'s workspace was copied out already (scored, or being scored)."""
        return run_id in self._copied

    def forget(self, run_id: str) -> None:
        """The execution is closed: what was kept for scoring it goes."""
        self._copied.discard(run_id)
        self._owners.pop(run_id, None)

    async def score(self, run: Execution, sandbox: Sandbox, folder: Path, code: int | None, timed_out: bool) -> bool:
        """The status the harness's end and its evaluation make (the table above); True when
        the execution was scored (completed, timed_out, harness_error)."""
        called = bool(run.recorder.calls)
        if code is None:  # the harness could not even start: infrastructure, not a zero
            run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, "harness could not start"
            return False
        refused = self._refused(run, code, timed_out)
        if refused is not None:
            log.warning("execution %s: %s", run.id, refused)
            placeholder = self.spec.infra_failure == "placeholder"
            run.status, run.reward, run.valid, run.ref = ("placeholder", 0.0, True, refused) if placeholder \
                else ("aborted_infra", None, False, refused)
            return False
        if code != 0 and not called and not timed_out and not self.spec.solution:
            run.status, run.reward, run.valid, run.ref = "placeholder", 0.0, True, f"harness exit {code}"
            return False
        run.enter("verifier")
        outcome = await self._evaluate(run, sandbox, folder)
        run.reward, run.valid, run.ref = outcome.score, outcome.valid, outcome.ref or (outcome.error or "")
        run.eval_attempts = outcome.attempts
        if outcome.error is not None:
            run.status = "evaluator_error"
            return False
        run.status = "timed_out" if timed_out else "completed" if code == 0 else "harness_error"
        return True

    def _refused(self, run: Execution, code: int, timed_out: bool) -> str | None:
        """Why the harness's end was gyre's doing (the module's table), or None: its last model
        call was refused by gyre, or it exited non-zero after a refusal."""
        rec = run.recorder
        if not rec.refusals or self.spec.solution:
            return None
        if rec.refused_last:
            return f"gyre refused the harness's last model call ({rec.refusals} refused; the last: {rec.last_refusal})"
        if code != 0 and not timed_out:
            return (f"the harness exited {code} after gyre refused {rec.refusals} of its model calls "
                    f"(the last: {rec.last_refusal})")
        return None

    async def _evaluate(self, run: Execution, sandbox: Sandbox, folder: Path) -> Outcome:
        task = run.task
        # 1) Nothing of the agent's runs from here on: a daemon it left could rewrite the reward,
        #    read the tests or copy them into its workspace (SandboxError if that cannot be made sure).
        await sandbox.cancel()
        deadline = time.monotonic() + self.spec.eval_budget_s
        # 2) Its workspace out before any test goes in: the saved copy is the agent's work alone,
        #    and all of it a verifier sees.
        workspace = await self.copy_out(run, sandbox, folder, needed=True)
        try:
            if task.verifier:
                # 3) Scored in fresh sandboxes from the image: the agent's container goes now (a
                #    kept one stays stopped), nothing of it beyond the copy takes part. A task in
                #    the "agent" environment is scored in a copy of it (stopped, removed at close).
                if self.spec.keep_sandbox == "never" and task.verifier.get("environment") != "agent":
                    await remove_sandbox(run, sandbox)
                evaluator = build_verifier(task, sandbox, swe_mode=self.spec.swe_score,
                                           log_path=folder / "verifier.log", owners=self._owners.pop(run.id, None),
                                           diff_path=folder / "agent-diff.json")
            else:
                evaluator = build_evaluator(task.evaluator or self.default_evaluator)
        except (EvaluatorError, EvaluatorFailed) as e:
            return Outcome(score=None, valid=False, ref="", error=f"{type(e).__name__}: {e}")
        return await evaluate_with_retries(evaluator, task, workspace, deadline=deadline,
                                           max_attempts=self.spec.eval_attempts, reward_range=self.spec.reward_range)

    async def copy_out(self, run: Execution, sandbox: Sandbox, folder: Path, *, needed: bool) -> Path:
        """The container's workdir to RUN_DIR/executions/ID/workspace, once per execution (links
        kept only where they stay inside, never followed; at most the larger of 512 MiB and
        storage_mb). What went wrong is recorded as its copy_out_error; it raises (SandboxError)
        only when the copy is `needed` (it is what is scored) and none could be made."""
        workspace = folder / "workspace"
        if not self.backend.needs_image or run.id in self._copied:
            return workspace  # a host folder already (process, bubblewrap), or copied
        self._copied.add(run.id)
        limit = max(COPY_LIMIT_BYTES, (sandbox.spec.limits.storage_mb or 0) << 20)
        try:
            report = await sandbox.download(sandbox.workdir, workspace, limit_bytes=limit)
            problem, self._owners[run.id] = report.problem(), report.owners
        except FileNotFoundError:
            workspace.mkdir(parents=True, exist_ok=True)  # the agent removed its workdir
            problem = None
        except (SandboxError, OSError) as e:
            problem = f"{type(e).__name__}: {e}"
            if needed:
                raise SandboxError(f"workspace not copied out: {e}") from None
        if problem is not None:
            self._note_copy_out(run, folder, problem)
        return workspace

    def _note_copy_out(self, run: Execution, folder: Path, problem: str) -> None:
        log.warning("execution %s: workspace copy-out: %s", run.id, problem)
        run.copy_out_error = problem[:500]  # in the execution's record (Execution.copy_out_error)
        try:
            info = json.loads((folder / "sandbox.json").read_text())
            info["copy_out_error"] = run.copy_out_error
            (folder / "sandbox.json").write_text(json.dumps(info))
        except (OSError, ValueError) as e:
            log.warning("execution %s: copy-out error not recorded in sandbox.json: %s", run.id, e)


async def remove_sandbox(run: Execution, sandbox: Sandbox) -> None:
    """The sandbox stopped and removed; a failure logged (what is left is the reaper's)."""
    try:
        await sandbox.stop()
    except Exception as e:  # noqa: BLE001 - a sandbox left is the reaper's at shutdown
        log.warning("execution %s: sandbox not removed: %s", run.id, e)
