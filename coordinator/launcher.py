"""launcher.py: runs one execution: workspace, key, harness process, deadline, evaluation.

The harness is a subprocess (its preset's command, see harnesses.py) started in its own
session with the proxy's base URL and a fresh per-execution key in both OpenAI and
Anthropic variable names, plus the preset's own variables. At the deadline it
is stopped (SIGTERM to its process group, SIGKILL after a grace period) and its
workspace kept, so a timed-out execution is still scored on its preserved work. Ends in
exactly one status:

    harness               calls recorded   evaluation     status
    exit 0                any              ok / failed    completed / evaluator_error
    exit != 0             >= 1             ok / failed    harness_error / evaluator_error
    exit != 0, no call    0                -              placeholder (valid zero)
    could not start       0                -              aborted_infra (invalid)
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
from gyre.coordinator.harnesses import HarnessPreset
from gyre.coordinator.tasks import make_workspace
from gyre.proxy.server import ProxyServer

log = logging.getLogger("gyre.coordinator")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    preset: HarnessPreset
    timeout_s: float  # unless the task or the preset sets its own
    eval_attempts: int
    eval_budget_s: float


class Launcher:
    def __init__(self, proxy: ProxyServer, run_dir: Path, spec: LaunchSpec, default_evaluator: dict | None = None):
        self.proxy = proxy
        self.run_dir = run_dir
        self.spec = spec
        self.default_evaluator = default_evaluator or {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    async def run(self, run: Run) -> None:
        """Run `run` to its end; sets status, reward, valid, ref, times and the recorder."""
        code, timed_out, workspace = await self.execute(run)
        called = bool(run.recorder.calls)
        if code is None:  # the harness could not even start: infrastructure, not a zero
            run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, "harness could not start"
        elif code != 0 and not called and not timed_out:
            run.status, run.reward, run.valid, run.ref = "placeholder", 0.0, True, f"harness exit {code}"
        else:
            task = run.task
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

    async def execute(self, run: Run) -> tuple[int | None, bool, Path]:
        """The harness part alone: key, workspace, process, deadline; the key is revoked at
        the end. Returns (exit code or None if it could not start, timed_out, workspace)."""
        folder = self.run_dir / "executions" / run.id
        run.t_start = time.time()
        recorder = self.proxy.register(run.id, role_rule=self.spec.preset.role_rule)
        run.recorder = recorder
        try:
            workspace = await asyncio.to_thread(make_workspace, run.task, folder / "workspace")
            code, timed_out = await self._harness(run, recorder.key, workspace, folder)
        finally:
            self.proxy.revoke(run.id)  # the key stops working; the records stay
        return code, timed_out, workspace

    async def _harness(self, run: Run, key: str, workspace: Path, folder: Path) -> tuple[int | None, bool]:
        """Returns (exit code or None if it could not start, timed_out)."""
        base, preset = self.proxy.base_url, self.spec.preset
        state = folder / "harness-state"
        state.mkdir(parents=True, exist_ok=True)
        timeout = run.task.timeout_s or preset.timeout_s or self.spec.timeout_s
        argv, extra, files = preset.expand(task=run.task.prompt, workspace=str(workspace), execution=run.id,
                                           state=str(state), base_url=base, openai_base_url=f"{base}/v1", api_key=key,
                                           timeout_ms=str(int(timeout * 1000)))
        for path, text in files.items():  # the harness's own config (Codex's config.toml)
            target = state / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        # Its own XDG homes: a CLI's config, caches and sessions never mix with the user's or
        # another execution's (a preset's env may still point them elsewhere).
        xdg = {f"XDG_{kind.upper()}_HOME": str(state / "xdg" / kind) for kind in ("config", "data", "cache", "state")}
        env = dict(os.environ, OPENAI_BASE_URL=f"{base}/v1", OPENAI_API_KEY=key, ANTHROPIC_BASE_URL=base,
                   ANTHROPIC_API_KEY=key, GYRE_TASK=run.task.prompt, GYRE_WORKSPACE=str(workspace),
                   GYRE_EXECUTION=run.id, PYTHONUNBUFFERED="1", **xdg, **extra)
        env.pop("ANTHROPIC_AUTH_TOKEN", None)  # would override the per-execution key
        with open(folder / "harness.log", "ab") as logf:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, cwd=workspace, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=logf, stderr=logf, start_new_session=True)
            except OSError as e:
                hint = f" (install: {preset.install})" if preset.install and preset.executable() is None else ""
                logf.write(f"gyre: harness {preset.name!r} could not start: {e}{hint}\n".encode())
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
        for sig, wait in ((signal.SIGTERM, self.spec.preset.grace_s), (signal.SIGKILL, 10.0)):
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
