"""launcher.py: runs one execution: workspace, key, harness process, deadline, evaluation.

The harness is a subprocess started in its own session with the proxy's base URL and a
fresh per-execution key in both OpenAI and Anthropic variable names. At the deadline it
is stopped (SIGTERM to its process group, SIGKILL after a grace period) and its
workspace kept, so a timed-out execution is still scored on its preserved work. Ends in
exactly one status:

    harness               calls recorded   evaluation     status
    exit 0                any              ok / failed    completed / evaluator_error
    exit != 0             >= 1             ok / failed    harness_error / evaluator_error
    exit != 0, no start   0                -              placeholder (valid zero)
    deadline              any              ok / failed    timed_out / evaluator_error

Not the scheduler: the coordinator decides when to launch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from gyre.coordinator.buffer import Run
from gyre.coordinator.evaluator import Outcome, build_evaluator, evaluate_with_retries
from gyre.coordinator.tasks import make_workspace
from gyre.proxy.server import ProxyServer

log = logging.getLogger("gyre.coordinator")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    harness: tuple[str, ...]
    timeout_s: float
    eval_attempts: int
    eval_budget_s: float
    grace_s: float = 5.0


class Launcher:
    def __init__(self, proxy: ProxyServer, run_dir: Path, spec: LaunchSpec, default_evaluator: dict | None = None):
        self.proxy = proxy
        self.run_dir = run_dir
        self.spec = spec
        self.default_evaluator = default_evaluator or {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    async def run(self, run: Run) -> None:
        """Run `run` to its end; sets status, reward, valid, ref, times and the recorder."""
        task = run.task
        folder = self.run_dir / "executions" / run.id
        run.t_start = time.time()
        recorder = self.proxy.register(run.id)
        run.recorder = recorder
        try:
            workspace = await asyncio.to_thread(make_workspace, task, folder / "workspace")
            code, timed_out = await self._harness(run, recorder.key, workspace, folder)
        finally:
            self.proxy.revoke(run.id)  # the key stops working; the records stay
        called = bool(recorder.calls)
        if code is None or (code != 0 and not called and not timed_out):
            run.status, run.reward, run.valid, run.ref = "placeholder", 0.0, True, f"harness exit {code}"
        else:
            deadline = time.monotonic() + self.spec.eval_budget_s
            evaluator = build_evaluator(task.evaluator or self.default_evaluator)
            outcome: Outcome = await evaluate_with_retries(evaluator, task, workspace, deadline=deadline,
                                                           max_attempts=self.spec.eval_attempts)
            run.reward, run.valid, run.ref = outcome.score, outcome.valid, outcome.ref or (outcome.error or "")
            run.eval_attempts = outcome.attempts
            if outcome.error is not None:
                run.status = "evaluator_error"
            else:
                run.status = "timed_out" if timed_out else "completed" if code == 0 else "harness_error"
        run.t_end = time.time()

    async def _harness(self, run: Run, key: str, workspace: Path, folder: Path) -> tuple[int | None, bool]:
        """Returns (exit code or None if it could not start, timed_out)."""
        base = self.proxy.base_url
        env = dict(os.environ, OPENAI_BASE_URL=f"{base}/v1", OPENAI_API_KEY=key, ANTHROPIC_BASE_URL=base,
                   ANTHROPIC_API_KEY=key, GYRE_TASK=run.task.prompt, GYRE_WORKSPACE=str(workspace),
                   GYRE_EXECUTION=run.id, PYTHONUNBUFFERED="1")
        timeout = run.task.timeout_s or self.spec.timeout_s
        with open(folder / "harness.log", "ab") as logf:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.spec.harness, cwd=workspace, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=logf, stderr=logf, start_new_session=True)
            except OSError as e:
                logf.write(f"gyre: harness could not start: {e}\n".encode())
                return None, False
            self._procs[run.id] = proc
            try:
                await asyncio.wait_for(proc.wait(), timeout)
                return proc.returncode, False
            except asyncio.TimeoutError:
                logf.write(f"gyre: deadline of {timeout:.0f}s reached; stopping the harness\n".encode())
                await self.stop(run.id)
                return proc.returncode, True
            except asyncio.CancelledError:
                # Cancelled (surplus, shutdown): the process must not outlive its execution.
                await asyncio.shield(self.stop(run.id))
                raise
            finally:
                self._procs.pop(run.id, None)

    async def stop(self, run_id: str) -> None:
        """SIGTERM the harness's process group, SIGKILL after the grace period."""
        proc = self._procs.get(run_id)
        if proc is None or proc.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.spec.grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                await asyncio.wait_for(proc.wait(), wait)
                return
            except asyncio.TimeoutError:
                continue

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(r) for r in list(self._procs)))
