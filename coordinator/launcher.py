"""launcher.py: runs one execution in a sandbox: key, harness, deadline, evaluation, removal.

The sandbox comes from the run's backend (sandbox/): a host folder for `process`, a container
from the task's image for `podman` / `docker`. The harness runs inside with the proxy's base
URL and a fresh per-execution key in both OpenAI and Anthropic variable names, plus the
preset's own variables; in an isolated sandbox the base URL is a listener inside the
sandbox's own network namespace (sandbox/netns.py), the only thing it can reach. At the
deadline the harness is stopped inside (SIGTERM to its group, SIGKILL after the grace) and
the sandbox kept, so a timed-out execution is still scored on its preserved work: by the
task's verifier inside the sandbox (tests copied in only now), else by an evaluator on the
workspace copied out to RUN_DIR/executions/ID/workspace. Ends in exactly one status:

    harness               calls recorded   evaluation     status
    exit 0                any              ok / failed    completed / evaluator_error
    exit != 0             >= 1             ok / failed    harness_error / evaluator_error
    exit != 0, no call    0                -              placeholder (valid zero)
    could not start       0                -              aborted_infra (invalid)
    deadline              any              ok / failed    timed_out / evaluator_error
    sandbox failed        any              -              aborted_infra, or placeholder
                                                          under infra_failure = "placeholder"

Not the scheduler: the coordinator decides when to launch (and builds images first, `prepare`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from gyre.coordinator.buffer import Run
from gyre.coordinator.evaluator import Outcome, build_evaluator, evaluate_with_retries
from gyre.coordinator.harnesses import HarnessError, HarnessPreset
from gyre.coordinator.sandbox import Limits, Sandbox, SandboxBackend, SandboxError, SandboxSpec, make_backend
from gyre.coordinator.sandbox import reaper
from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER, LABEL_RUN_DIR, LABEL_TASK
from gyre.coordinator.sandbox.netns import ProxyRelay
from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.tasks import Task, make_workspace
from gyre.coordinator.verifier import SOLUTION_DIR, TESTS_DIR, build_verifier
from gyre.proxy.server import ProxyServer

log = logging.getLogger("gyre.coordinator")
STATE_INSIDE = "/tmp/gyre-state"  # the harness's own state folder inside a container sandbox
INFRA_FAILURE = ("aborted_infra", "placeholder")
KEEP = ("never", "on_failure", "always")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    preset: HarnessPreset
    timeout_s: float  # unless the task or the preset sets its own
    eval_attempts: int
    eval_budget_s: float
    infra_failure: str = "aborted_infra"  # or "placeholder": the paper's valid zero
    keep_sandbox: str = "never"  # never | on_failure | always
    allow_internet: bool = False  # may a task with allow_internet = true have it
    limits: Limits = field(default_factory=Limits)  # defaults under the task's own
    swe_score: str = "all"  # all | fraction
    solution: bool = False  # run the task's solution/solve.sh instead of the harness


def launch_spec(c, *, solution: bool = False) -> LaunchSpec:
    """The LaunchSpec of a CoordinatorConfig."""
    return LaunchSpec(preset=c.preset(), timeout_s=c.execution_timeout_s, eval_attempts=c.eval_attempts,
                      eval_budget_s=c.eval_budget_s, infra_failure=c.infra_failure, keep_sandbox=c.keep_sandbox,
                      allow_internet=c.sandbox_internet, swe_score=c.swe_score, solution=solution,
                      limits=Limits(cpus=c.sandbox_cpus, memory_mb=c.sandbox_memory_mb, pids=c.sandbox_pids))


@dataclass
class Sandboxes:
    """An opened backend and this process's owner label; `close` reaps what it left."""

    backend: SandboxBackend
    owner: str

    async def close(self) -> None:
        try:
            await reaper.reap(self.backend, reaper.at_shutdown(self.owner), "at shutdown")
        except SandboxError as e:
            log.warning("%s: orphans not reaped at shutdown: %s", self.backend.name, e)
        await self.backend.close()


async def open_sandboxes(c=None, *, sandbox: str | None = None, url: str | None = None,
                         run_dir: Path | None = None) -> Sandboxes:
    """Open the run's sandbox backend (config `c`, or the names given) and reap the orphans
    of dead runs (and of an earlier process on this run directory). SandboxError if it cannot."""
    name = sandbox or (c.sandbox if c is not None else "process")
    backend = make_backend(name, url if url is not None else (c.sandbox_url if c is not None else None))
    await backend.open()
    owner = secrets.token_hex(8)
    try:
        await reaper.reap(backend, reaper.at_startup(owner, run_dir or c.run_dir), "at start-up")
    except BaseException:
        await backend.close()
        raise
    return Sandboxes(backend, owner)


class Launcher:
    def __init__(self, proxy: ProxyServer, run_dir: Path, spec: LaunchSpec, default_evaluator: dict | None = None,
                 backend: SandboxBackend | None = None, owner: str | None = None):
        self.proxy = proxy
        self.run_dir = run_dir
        self.spec = spec
        self.default_evaluator = default_evaluator or {}
        self.backend = backend or ProcessBackend()
        self.owner = owner or secrets.token_hex(8)  # labels this process's sandboxes (the reaper's test)
        self._live: dict[str, Sandbox] = {}
        self._presets: dict[str, HarnessPreset] = {}
        self._images: dict[str, asyncio.Future] = {}  # task id -> its image (or the build's error)

    # --- images, before the slot --------------------------------------------------------

    def image_state(self, task: Task) -> str:
        """"ready", "building" or "failed"; the first ask starts the build."""
        fut = self._images.get(task.id)
        if fut is None:
            fut = self._images[task.id] = asyncio.ensure_future(self._prepare(task))
        if not fut.done():
            return "building"
        return "failed" if fut.exception() is not None else "ready"

    async def prepare(self, task: Task) -> str | None:
        """The task's image, built (or pulled) once per task; SandboxError if it cannot be."""
        self.image_state(task)
        return await asyncio.shield(self._images[task.id])

    async def _prepare(self, task: Task) -> str | None:
        env = task.environment
        self.check_task(task)
        if env is None or not self.backend.needs_image:
            return None
        return await self.backend.prepare(env.build_dir, image=env.image, dockerfile=env.dockerfile,
                                          timeout_s=env.build_timeout_s, name=task.id)

    def check_task(self, task: Task) -> None:
        env = task.environment
        if env is not None and env.allow_internet and not self.spec.allow_internet:
            raise SandboxError(f"task {task.id!r} asks allow_internet = true; set sandbox_internet = true in the "
                               "run config to give sandboxes the internet")
        if env is not None and (env.image or env.build_dir) and not self.backend.needs_image:
            raise SandboxError(f"task {task.id!r} runs in its own image; sandbox {self.backend.name!r} runs no "
                               "images (use sandbox = \"podman\" or \"docker\")")
        if task.verifier and not self.backend.needs_image:
            raise SandboxError(f"task {task.id!r} is verified inside its sandbox; sandbox {self.backend.name!r} "
                               "has none")

    # --- one execution ------------------------------------------------------------------

    async def run(self, run: Run) -> None:
        """Run `run` to its end; sets status, reward, valid, ref, times and the recorder."""
        run.t_start = time.time()
        folder = self.run_dir / "executions" / run.id
        sandbox = None
        failed = True
        try:
            try:
                image = await self.prepare(run.task)
                sandbox = await self._open(run, folder, image)
                code, timed_out = await self._harness(run, sandbox, folder)
            except SandboxError as e:
                self._infra(run, str(e))
                return
            called = bool(run.recorder.calls)
            if code is None:  # the harness could not even start: infrastructure, not a zero
                run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, "harness could not start"
            elif code != 0 and not called and not timed_out and not self.spec.solution:
                run.status, run.reward, run.valid, run.ref = "placeholder", 0.0, True, f"harness exit {code}"
            else:
                try:
                    outcome = await self._evaluate(run, sandbox, folder)
                except SandboxError as e:
                    self._infra(run, str(e))
                    return
                run.reward, run.valid, run.ref = outcome.score, outcome.valid, outcome.ref or (outcome.error or "")
                run.eval_attempts = outcome.attempts
                if outcome.error is not None:
                    run.status = "evaluator_error"
                else:
                    run.status = "timed_out" if timed_out else "completed" if code == 0 else "harness_error"
                    failed = False
        finally:
            run.t_end = time.time()
            if sandbox is not None:
                await asyncio.shield(self._close(run, sandbox, folder, failed))

    def _infra(self, run: Run, why: str) -> None:
        log.warning("execution %s: sandbox failure: %s", run.id, why)
        if run.recorder is None:
            run.recorder = self.proxy.register(run.id, role_rule=self.spec.preset.role_rule)
            self.proxy.revoke(run.id)
        if self.spec.infra_failure == "placeholder":
            run.status, run.reward, run.valid, run.ref = "placeholder", 0.0, True, why
        else:
            run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, why

    async def execute(self, run: Run) -> tuple[int | None, bool, Path]:
        """The harness part alone (`gyre serve`): sandbox, key, harness, deadline, then the
        workspace copied out and the sandbox removed. Returns (exit code or None if it could
        not start, timed_out, the workspace on the host)."""
        folder = self.run_dir / "executions" / run.id
        run.t_start = time.time()
        image = await self.prepare(run.task)
        sandbox = await self._open(run, folder, image)
        try:
            code, timed_out = await self._harness(run, sandbox, folder)
        finally:
            await asyncio.shield(self._close(run, sandbox, folder, False))
        return code, timed_out, folder / "workspace"

    async def _open(self, run: Run, folder: Path, image: str | None) -> Sandbox:
        task, env = run.task, run.task.environment
        folder.mkdir(parents=True, exist_ok=True)
        labels = {LABEL_OWNER: self.owner, LABEL_RUN_DIR: str(self.run_dir), LABEL_EXECUTION: run.id,
                  LABEL_TASK: task.id[:200]}
        base = self.spec.limits
        limits = Limits(cpus=env.cpus if env and env.cpus else base.cpus,
                        memory_mb=env.memory_mb if env and env.memory_mb else base.memory_mb,
                        pids=base.pids, storage_mb=env.storage_mb if env and env.storage_mb else base.storage_mb)
        preset, mounts = self.spec.preset, {}
        if self.backend.needs_image and not self.spec.solution:
            try:
                preset, mounts = preset.in_sandbox()
            except HarnessError as e:
                raise SandboxError(str(e)) from None
        if self.backend.needs_image:
            spec = SandboxSpec(execution=run.id, labels=labels, image=image, workdir=env.workdir if env else None,
                               limits=limits, mounts=mounts, internet=bool(env and env.allow_internet))
        else:
            workspace = await asyncio.to_thread(make_workspace, task, folder / "workspace")
            spec = SandboxSpec(execution=run.id, labels=labels, workdir=str(workspace), limits=limits, mounts=mounts)
        sandbox = await self.backend.create(spec)
        self._live[run.id] = sandbox
        self._presets[run.id] = preset  # the preset as it runs there
        if self.backend.needs_image and task.workspace:  # a JSONL task's files, into the image's workdir
            await asyncio.to_thread(make_workspace, Task(id=task.id, prompt=task.prompt, workspace=task.workspace),
                                    folder / "task-files")
            await sandbox.upload(folder / "task-files", sandbox.workdir)
        return sandbox

    async def _harness(self, run: Run, sandbox: Sandbox, folder: Path) -> tuple[int | None, bool]:
        """The harness (or the task's solve.sh) to its end or deadline; the key is revoked at
        the end. Returns (exit code or None if it could not start, timed_out)."""
        recorder = self.proxy.register(run.id, role_rule=self.spec.preset.role_rule)
        run.recorder = recorder
        relay = None
        try:
            base = self.proxy.base_url
            if self.backend.isolated_network:
                relay, base = await self._relay(sandbox)
            return await self._run_harness(run, sandbox, folder, recorder.key, base)
        finally:
            self.proxy.revoke(run.id)  # the key stops working; the records stay
            if relay is not None:
                await relay.close()

    async def _relay(self, sandbox: Sandbox) -> tuple[ProxyRelay, str]:
        pid = sandbox.netns_pid()
        if pid is None:
            raise SandboxError(f"{self.backend.name}: no local network namespace to reach the proxy from")
        url = urlsplit(self.proxy.base_url)
        host = "127.0.0.1" if url.hostname in (None, "", "0.0.0.0", "::") else url.hostname
        relay = ProxyRelay(host, url.port)
        port = await relay.start(pid)
        return relay, f"http://127.0.0.1:{port}"

    async def _run_harness(self, run: Run, sandbox: Sandbox, folder: Path, key: str, base: str):
        preset = self._presets.pop(run.id, self.spec.preset)
        contained = self.backend.needs_image
        timeout = run.task.timeout_s or self.spec.preset.timeout_s or self.spec.timeout_s
        host_state = folder / "harness-state"
        host_state.mkdir(parents=True, exist_ok=True)
        state = STATE_INSIDE if contained else str(host_state)
        argv, extra, files = preset.expand(task=run.task.prompt, workspace=sandbox.workdir, execution=run.id,
                                           state=state, base_url=base, openai_base_url=f"{base}/v1", api_key=key,
                                           timeout_ms=str(int(timeout * 1000)))
        for path, text in files.items():  # the harness's own config (Codex's config.toml)
            target = host_state / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        if contained:
            await sandbox.upload(host_state, STATE_INSIDE)
        # Its own XDG homes: a CLI's config, caches and sessions never mix with the user's or
        # another execution's (a preset's env may still point them elsewhere).
        xdg = {f"XDG_{kind.upper()}_HOME": f"{state}/xdg/{kind}" for kind in ("config", "data", "cache", "state")}
        env = dict(OPENAI_BASE_URL=f"{base}/v1", OPENAI_API_KEY=key, ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY=key,
                   GYRE_TASK=run.task.prompt, GYRE_WORKSPACE=sandbox.workdir, GYRE_EXECUTION=run.id,
                   PYTHONUNBUFFERED="1", **xdg, **extra)
        if self.spec.solution:
            if run.task.solution_dir is None:
                raise SandboxError(f"task {run.task.id!r} has no solution/solve.sh")
            await sandbox.upload(Path(run.task.solution_dir), SOLUTION_DIR)
            argv = ["bash", f"{SOLUTION_DIR}/solve.sh"]
        with open(folder / "harness.log", "ab") as logf:
            try:
                result = await sandbox.exec(argv, env=env, timeout_s=timeout, grace_s=self.spec.preset.grace_s,
                                            log=logf)
            except SandboxError as e:
                if not contained:  # the process backend: the command itself could not start
                    hint = f" (install: {preset.install})" if preset.install and preset.executable() is None else ""
                    logf.write(f"gyre: harness {preset.name!r} could not start: {e}{hint}\n".encode())
                    return None, False
                raise
            if result.timed_out:
                logf.write(f"gyre: deadline of {timeout:.0f}s reached; the harness was stopped\n".encode())
            elif contained and result.code in (126, 127):  # the shell's "cannot execute" / "not found"
                logf.write(f"gyre: harness {argv[0]!r} could not start in the sandbox (exit {result.code})\n".encode())
                return None, False
        if contained:
            try:
                await sandbox.download(STATE_INSIDE, host_state)
            except (FileNotFoundError, SandboxError) as e:
                log.debug("execution %s: harness state not copied out: %s", run.id, e)
        return result.code, result.timed_out

    async def _evaluate(self, run: Run, sandbox: Sandbox, folder: Path) -> Outcome:
        task = run.task
        await sandbox.cancel()  # nothing of the agent's still runs while it is scored
        deadline = time.monotonic() + self.spec.eval_budget_s
        if task.verifier:
            if task.tests_dir is not None:  # only now: the agent never saw the tests
                await sandbox.upload(Path(task.tests_dir), TESTS_DIR)
            evaluator = build_verifier(task, sandbox, swe_mode=self.spec.swe_score, log_path=folder / "verifier.log")
            workspace = folder / "workspace"
        else:
            workspace = await self._copy_out(sandbox, folder)
            evaluator = build_evaluator(task.evaluator or self.default_evaluator)
        return await evaluate_with_retries(evaluator, task, workspace, deadline=deadline,
                                           max_attempts=self.spec.eval_attempts)

    async def _copy_out(self, sandbox: Sandbox, folder: Path) -> Path:
        workspace = folder / "workspace"
        if self.backend.needs_image and not workspace.exists():
            try:
                await sandbox.download(sandbox.workdir, workspace)
            except FileNotFoundError:
                workspace.mkdir(parents=True, exist_ok=True)  # the agent removed its workdir
        return workspace

    async def _close(self, run: Run, sandbox: Sandbox, folder: Path, failed: bool) -> None:
        self._live.pop(run.id, None)
        try:
            await sandbox.cancel()
            await self._copy_out(sandbox, folder)  # the preserved work, for the run directory
        except (SandboxError, OSError) as e:
            log.warning("execution %s: workspace not copied out: %s", run.id, e)
        keep = self.spec.keep_sandbox == "always" or (self.spec.keep_sandbox == "on_failure" and failed)
        if keep:
            info = {"backend": self.backend.name, "id": getattr(sandbox, "id", None), "status": run.status}
            reaper.mark_kept(self.run_dir, run.id, info)  # the reaper leaves it alone
            log.warning("execution %s: sandbox %s kept (keep_sandbox = %s)", run.id, info["id"],
                        self.spec.keep_sandbox)
            return
        try:
            await sandbox.stop()
        except SandboxError as e:
            log.warning("execution %s: sandbox not removed: %s", run.id, e)

    async def stop(self, run_id: str) -> None:
        sandbox = self._live.get(run_id)
        if sandbox is not None:
            await sandbox.cancel()

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(r) for r in list(self._live)))
