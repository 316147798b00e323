"""launcher.py: runs one execution in a sandbox: key, harness, deadline, then its scoring and removal.

The sandbox comes from the run's backend (sandbox/): a host folder for `process`, a container
from the task's image for `podman` / `docker`. The harness runs inside with the proxy's base
URL and a fresh per-execution key in both OpenAI and Anthropic variable names, plus the
preset's own variables; in an isolated sandbox the base URL is a listener inside the
sandbox's own network namespace (workerd/netns.py), the only thing it can reach. At the
deadline the harness is stopped inside (SIGTERM to its group, SIGKILL after the grace) and
the sandbox kept, so a timed-out execution is still scored on its preserved work (scoring.py:
its workspace copied out, its verifier, its one status). A container execution makes one exec
(the harness, detached: it outlives this process, and a restarted coordinator adopts it); files
move by archive calls, which leave no monitor. The harness's storage is held to the task's
storage_mb (measured as it runs) and harness.log is capped. The sandbox is always removed
(unless kept). As it goes it sets the execution's phase (buffer.py PHASES: image, sandbox,
harness, verifier, cleanup, done), which the live view shows.

Not the scheduler: the coordinator decides when to launch (and builds images, and the folder a
preset's sandbox_pip is installed into, first: taskimages.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from gyre.coordinator.buffer import Execution
from gyre.coordinator.evaluator import (
    REWARD_RANGE,
)
from gyre.coordinator.harnesses import HarnessError, HarnessPreset
from gyre.coordinator.sandbox import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    reaper,
    storage,
)
from gyre.coordinator.sandbox.base import (
    LABEL_EXECUTION,
    LABEL_OWNER,
    LABEL_PROCESS,
    LABEL_RUN_DIR,
    LABEL_TASK,
    CappedLog,
    process_label,
)
from gyre.coordinator.sandbox.hosts import HostPool, SandboxHost
from gyre.coordinator.sandbox.pool import Sandboxes, open_sandboxes  # noqa: F401 - the launcher's callers open them
from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.sandbox.reaper import ADOPT_SLACK_S, KEY_FILE
from gyre.coordinator.scoring import Scoring, remove_sandbox
from gyre.coordinator.taskimages import TaskImages
from gyre.coordinator.tasks import Task, make_workspace
from gyre.coordinator.verifier import SOLUTION_DIR
from gyre.proxy.server import ProxyServer
from gyre.workerd.netns import ProxyRelay, RelayError

log = logging.getLogger("gyre.coordinator")
STATE_INSIDE = "/tmp/gyre-state"  # the harness's own state folder inside a container sandbox
INFRA_FAILURE = ("aborted_infra", "placeholder")
CANCEL_CLEANUP_S = 30.0  # a stopped execution's sandbox cleanup may take this long before the stop moves on
KEEP = ("never", "on_failure", "always")
HARNESS_LOG_BYTES = 64 << 20  # harness.log keeps this much of the harness's output, then says so


def _keep_key(path: Path, key: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
STORAGE_EXIT = 137  # the exit a harness stopped at its storage limit counts as (a memory hog's, killed)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    preset: HarnessPreset
    timeout_s: float  # unless the task or the preset sets its own
    # An explicit --timeout (tasks run, eval): over the preset's timeout_s, under the task's own.
    timeout_flag_s: float | None = None
    eval_attempts: int
    eval_budget_s: float
    infra_failure: str = "aborted_infra"  # or "placeholder": the paper's valid zero
    keep_sandbox: str = "never"  # never | on_failure | always
    allow_internet: bool = False  # may a task with allow_internet = true have it
    limits: Limits = field(default_factory=Limits)  # defaults under the task's own
    swe_score: str = "all"  # all | fraction
    solution: bool = False  # run the task's solution/solve.sh instead of the harness
    reward_range: tuple[float, float] = REWARD_RANGE  # a valid reward is finite and within it


def launch_spec(c, *, solution: bool = False) -> LaunchSpec:
    """The LaunchSpec of a CoordinatorConfig."""
    return LaunchSpec(preset=c.preset(), timeout_s=c.execution_timeout_s, eval_attempts=c.eval_attempts,
                      eval_budget_s=c.eval_budget_s, infra_failure=c.infra_failure, keep_sandbox=c.keep_sandbox,
                      allow_internet=c.sandbox_internet, swe_score=c.swe_score, solution=solution,
                      limits=Limits(cpus=c.sandbox_cpus, memory_mb=c.sandbox_memory_mb, pids=c.sandbox_pids),
                      reward_range=tuple(c.reward_range))


class _Closer:
    """A remote relay's `close` as the local relay's interface."""

    def __init__(self, close):
        self._close = close

    async def close(self) -> None:
        try:
            await self._close()
        except Exception as e:  # noqa: BLE001 - the node may be gone with its relay
            log.warning("sandbox relay not closed: %s", e)


class Launcher:
    def __init__(self, proxy: ProxyServer, run_dir: Path, spec: LaunchSpec, default_evaluator: dict | None = None,
                 backend: SandboxBackend | None = None, owner: str | None = None, pool: HostPool | None = None,
                 remote_relay=None, adopted: set[str] | None = None, handed_off: set[str] | None = None):
        self.proxy = proxy
        self.run_dir = run_dir
        self.spec = spec
        self.default_evaluator = default_evaluator or {}
        self.pool = pool or HostPool([SandboxHost("local", backend or ProcessBackend())], ping_interval_s=0.0)
        self.backend = self.pool.hosts[0].backend  # the run's one kind (needs_image, isolated_network, name)
        self.owner = owner or secrets.token_hex(8)  # labels this process's sandboxes (the reaper's test)
        self.process = process_label()
        # async (node, pid, proxy_port) -> (port, close): a listener made by that node's workerd.
        self.remote_relay = remote_relay
        self._live: dict[str, Sandbox] = {}
        # Executions an earlier coordinator of this run left running, taken over (`adopting`):
        # the pool's (Sandboxes.adopted), whose sweep and shutdown reap read it.
        self.adopted: set[str] = adopted if adopted is not None else set()
        self.handed_off: set[str] = handed_off if handed_off is not None else set()  # left running (`hand_off`)
        self._presets: dict[str, HarnessPreset] = {}
        # Each task's image on each host, and the preset's sandbox_pip folder: made before the slot.
        self.images = TaskImages(self.pool, spec)
        # What each execution's end makes it: its workspace copied out, its verifier, its status.
        self.scoring = Scoring(spec, self.backend, self.default_evaluator)

    # --- one execution ------------------------------------------------------------------

    async def run(self, run: Execution) -> None:
        """Run `run` to its end; sets status, reward, valid, ref, times and the recorder."""
        run.t_start = time.time()
        host = self.pool.choose(prefer=self.images.ready_hosts(run.task))
        if host is None:
            why = ("no sandbox host is up: " + "; ".join(f"{h.name}: {h.why}" for h in self.pool.hosts)
                   if not self.pool.up else "every sandbox host is at its max_concurrent")
            self._infra(run, why)
            run.t_end = time.time()
            run.enter("done")
            return
        host.running += 1
        job = asyncio.ensure_future(self._run_on(run, host))
        down = asyncio.ensure_future(host.down.wait())
        try:
            await asyncio.wait({job, down}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done():  # the host stopped answering: nothing there can be waited for
                job.cancel()  # left to finish on its own: calls to a dead engine return late
                if run.recorder is not None:
                    self.proxy.revoke(run.id)
                self._live.pop(run.id, None)
                self._infra(run, f"sandbox host {host.name} stopped answering ({host.why})")
            else:
                job.result()
        except asyncio.CancelledError:  # the run is being stopped: let its cleanup finish, boundedly
            job.cancel()
            await asyncio.wait({job}, timeout=CANCEL_CLEANUP_S)
            raise
        finally:
            down.cancel()
            if not job.done():
                job.cancel()
            host.running -= 1
            if run.status == "aborted_infra":
                host.failed += 1
            run.t_end = run.t_end or time.time()
            run.enter("done")

    async def _run_on(self, run: Execution, host: SandboxHost) -> None:
        folder = self.run_dir / "executions" / run.id
        sandbox = None
        failed = True
        try:
            run.enter("image")
            image = await self.images.prepare(run.task, host)
            run.enter("sandbox")
            sandbox = await self._open(run, folder, image, host)
            code, timed_out = await self._harness(run, sandbox, folder, host)
            failed = not await self.scoring.score(run, sandbox, folder, code, timed_out)
        except Exception as e:  # noqa: BLE001 - still one status, and the run goes on
            self._failed(run, e)
        finally:
            run.t_end = time.time()
            if sandbox is not None and run.id not in self.handed_off:
                run.enter("cleanup")
                await asyncio.shield(self._close(run, sandbox, folder, failed))

    def _failed(self, run: Execution, e: Exception) -> None:
        """What an exception out of an execution's lifecycle makes it (called in its handler):
        the sandbox layer's failure is infrastructure; anything unforeseen is logged with its
        traceback and ends aborted_infra too."""
        if isinstance(e, SandboxError):
            self._infra(run, str(e))
            return
        log.exception("execution %s failed", run.id)
        run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, f"{type(e).__name__}: {e}"

    def _infra(self, run: Execution, why: str) -> None:
        log.warning("execution %s: sandbox failure: %s", run.id, why)
        if run.recorder is None:
            run.recorder = self.proxy.register(run.id, role_rule=self.spec.preset.role_rule)
            self.proxy.revoke(run.id)
        if self.spec.infra_failure == "placeholder":
            run.status, run.reward, run.valid, run.ref = "placeholder", 0.0, True, why
        else:
            run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, why

    async def execute(self, run: Execution) -> tuple[int | None, bool, Path]:
        """The harness part alone (`gyre serve`): sandbox, key, harness, deadline, then the
        workspace copied out and the sandbox removed. Returns (exit code or None if it could
        not start, timed_out, the workspace on the host)."""
        folder = self.run_dir / "executions" / run.id
        run.t_start = time.time()
        host = self.pool.choose()
        if host is None:
            raise SandboxError("no sandbox host is up, or every one is at its max_concurrent")
        run.enter("image")
        image = await self.images.prepare(run.task, host)
        run.enter("sandbox")
        sandbox = await self._open(run, folder, image, host)
        try:
            code, timed_out = await self._harness(run, sandbox, folder, host)
        finally:
            run.enter("cleanup")
            await asyncio.shield(self._close(run, sandbox, folder, False))  # never raises
            run.enter("done")
        return code, timed_out, folder / "workspace"

    async def _open(self, run: Execution, folder: Path, image: str | None, host: SandboxHost) -> Sandbox:
        task, env = run.task, run.task.environment
        folder.mkdir(parents=True, exist_ok=True)
        labels = {LABEL_OWNER: self.owner, LABEL_RUN_DIR: str(self.run_dir), LABEL_EXECUTION: run.id,
                  LABEL_TASK: task.id[:200], LABEL_PROCESS: self.process}
        base = self.spec.limits
        limits = Limits(cpus=env.cpus if env and env.cpus else base.cpus,
                        memory_mb=env.memory_mb if env and env.memory_mb else base.memory_mb,
                        pids=base.pids, storage_mb=env.storage_mb if env and env.storage_mb else base.storage_mb)
        preset, mounts = self.spec.preset, {}
        if self.backend.needs_image and not self.spec.solution:
            try:
                preset, mounts = preset.in_sandbox(await self.images.agent_dir())
            except HarnessError as e:
                raise SandboxError(str(e)) from None
        elif preset.container_only and not self.spec.solution:  # no host command to run
            raise SandboxError(preset.missing(contained=False))
        if self.backend.needs_image:
            spec = SandboxSpec(execution=run.id, labels=labels, image=image, workdir=env.workdir if env else None,
                               limits=limits, mounts=mounts, internet=bool(env and env.allow_internet))
        else:
            workspace = await asyncio.to_thread(make_workspace, task, folder / "workspace")
            spec = SandboxSpec(execution=run.id, labels=labels, workdir=str(workspace), limits=limits, mounts=mounts)
        sandbox = await host.backend.create(spec)
        try:  # from here the sandbox exists: whatever fails before the caller holds it removes it
            (folder / "sandbox.json").write_text(json.dumps({  # where it ran, for the user and the reaper's logs
                "host": host.name, "backend": self.backend.name, "id": getattr(sandbox, "id", None), "image": image}))
            if self.backend.needs_image and task.workspace:  # a JSONL task's files, into the image's workdir
                await asyncio.to_thread(make_workspace, Task(id=task.id, prompt=task.prompt,
                                                             workspace=task.workspace), folder / "task-files")
                await sandbox.upload(folder / "task-files", sandbox.workdir)
        except BaseException:
            await asyncio.shield(remove_sandbox(run, sandbox))
            raise
        self._live[run.id] = sandbox
        self._presets[run.id] = preset  # the preset as it runs there
        return sandbox

    async def _harness(self, run: Execution, sandbox: Sandbox, folder: Path,
                       host: SandboxHost) -> tuple[int | None, bool]:
        """The harness (or the task's solve.sh) to its end or deadline; the key is revoked at
        the end. Returns (exit code or None if it could not start, timed_out)."""
        recorder = self.proxy.register(run.id, role_rule=self.spec.preset.role_rule)
        run.recorder = recorder
        run.enter("harness")
        relay = None
        try:
            if self.backend.needs_image:  # what a restarted coordinator takes the harness back under (`adopt`)
                await asyncio.to_thread(_keep_key, folder / KEY_FILE, recorder.key)
            base = self.proxy.base_url
            if self.backend.isolated_network:
                relay, base = await self._relay(sandbox, host)
            bind = self.backend.binds_keys and host.node is None  # siblings can read the key: bind it
            if bind:
                self.proxy.bindings.bind(run.id)
            return await self._run_harness(run, sandbox, folder, recorder.key, base, bind)
        finally:
            self.proxy.revoke(run.id)  # the key stops working; the records stay
            if relay is not None:
                await relay.close()

    def adopting(self, run_id: str) -> bool:
        """Whether an earlier coordinator of this run left `run_id`'s harness running where it
        can be taken back (reaper.adoptable_until: a container's detached exec, its key kept);
        then the execution is this launcher's to `adopt`, and its sandbox is spared by the
        sweep of what was not adopted (pool.Sandboxes.sweep)."""
        if reaper.adoptable_until(self.run_dir / "executions" / run_id) is None:
            return False
        self.adopted.add(run_id)
        return True

    def hand_off(self, run: Execution) -> bool:
        """A stop for a restart (SIGUSR1): leave `run`'s harness running in its container for the
        next coordinator of the run to adopt, where it can: its exec detached and recorded
        (reaper.adoptable_until), the execution in its harness phase. Its sandbox is then
        neither killed, copied out nor removed by this process, nor reaped at its shutdown
        (`handed_off`, the pool's). False: the caller cancels it as any other."""
        sandbox = self._live.get(run.id)
        detach = getattr(sandbox, "detach", None)
        if run.phase != "harness" or detach is None or \
                reaper.adoptable_until(self.run_dir / "executions" / run.id) is None:
            return False
        detach()
        self._live.pop(run.id)
        self.handed_off.add(run.id)
        log.info("execution %s: handed off, its harness still running in sandbox %s", run.id, sandbox.id[:12])
        return True

    async def adopt(self, run: Execution) -> None:
        """Carry on with an execution an earlier coordinator of this run left running (issue
        34; `adopting` said so): its sandbox found again by sandbox.json (the same container,
        still running), its key (harness.key) and records taken back (Recorder.resumed: its
        later calls extend its tree), its relay made again in the sandbox's network namespace
        at the same port, its harness's exec waited for to its end (the deadline is enforced
        inside by its own `timeout`, which ran on meanwhile; a harness that ended while the
        coordinator was away is scored at once, from its exit file), then scored and closed as
        any execution. A call the restart cut fails at the harness, which retries it. A sandbox
        that is gone or stopped (its host rebooted, somebody removed it) took the harness's work
        with it: aborted_infra, never run again silently."""
        run.t_start = run.t_start or time.time()
        folder = self.run_dir / "executions" / run.id
        try:
            record = json.loads((folder / "sandbox.json").read_text())
            harness = record["harness"]
            exec_id, token = harness["exec"], harness["token"]
            started, timeout = float(harness["started"]), float(harness["timeout_s"])
            key = (folder / KEY_FILE).read_text().strip()
            host = next(h for h in self.pool.hosts if h.name == record.get("host"))
            run.t_start = started
            sandbox = await host.backend.adopt(record["id"], SandboxSpec(
                execution=run.id, image=record.get("image"),
                labels={LABEL_OWNER: self.owner, LABEL_RUN_DIR: str(self.run_dir), LABEL_EXECUTION: run.id,
                        LABEL_TASK: run.task.id[:200], LABEL_PROCESS: self.process}))
            if sandbox is None:
                raise SandboxError(f"its sandbox {str(record['id'])[:12]} is gone or stopped: the harness's work "
                                   f"went with it")
        except (OSError, ValueError, KeyError, TypeError, StopIteration, AttributeError, SandboxError) as e:
            why = str(e) if isinstance(e, SandboxError) else \
                f"its sandbox record is unreadable ({type(e).__name__}: {e})"
            self._infra(run, f"not adopted after the coordinator's restart: {why}")
            run.t_end = time.time()
            run.enter("done")
            return
        log.info("execution %s: adopted sandbox %s, its harness still running", run.id, sandbox.id[:12])
        run.t_start = started
        host.running += 1
        self._live[run.id] = sandbox
        failed, relay = True, None
        try:
            run.recorder = self.proxy.register(run.id, role_rule=self.spec.preset.role_rule, resume_key=key)
            run.enter("harness")
            if self.backend.isolated_network:
                relay, _ = await self._relay(sandbox, host)
            limit = started + timeout + self.spec.preset.grace_s + ADOPT_SLACK_S - time.time()
            with open(folder / "harness.log", "ab") as logf:
                logf.write(b"gyre: the coordinator restarted; the harness, still running, was adopted\n")
                try:
                    code = await asyncio.wait_for(sandbox.wait_detached(
                        exec_id, token, log=CappedLog(logf, HARNESS_LOG_BYTES, "harness.log")), max(limit, 1.0))
                except TimeoutError:  # the engine never ended it: as an exec past its host-side wait
                    code = None
                    logf.write(b"gyre: the engine did not end the adopted harness after its deadline\n")
            timed_out = code in (124, 137) and time.time() >= started + timeout * 0.99
            self.proxy.revoke(run.id)
            if relay is not None:
                await relay.close()
                relay = None
            if code is None:  # neither the engine nor its exit file says how it ended: never a score
                raise SandboxError("the adopted harness's end is unknown (its sandbox was stopped or removed "
                                   "while the coordinator was away)")
            failed = not await self.scoring.score(run, sandbox, folder, code, timed_out)
        except Exception as e:  # noqa: BLE001 - still one status, and the run goes on
            self._failed(run, e)
        finally:
            if run.recorder is not None and run.id in self.proxy.executions and not run.recorder.closed:
                self.proxy.revoke(run.id)
            if relay is not None:
                await relay.close()
            host.running -= 1
            run.t_end = time.time()
            if run.id not in self.handed_off:  # handed off again (a second restart): the next one's
                run.enter("cleanup")
                await asyncio.shield(self._close(run, sandbox, folder, failed))
            run.enter("done")

    def _started(self, run: Execution, folder: Path, bind: bool, timeout_s: float, info: dict) -> None:
        """The harness's exec started: its session bound to the key (process backends), and
        what finds it again recorded in sandbox.json under "harness" (with its deadline)."""
        if bind and "session" in info:
            self.proxy.bindings.add(run.id, info["session"])
        try:
            record = json.loads((folder / "sandbox.json").read_text())
            record["harness"] = {**info, "started": time.time(), "timeout_s": timeout_s}
            (folder / "sandbox.json").write_text(json.dumps(record))
        except (OSError, ValueError) as e:
            log.warning("execution %s: harness start not recorded in sandbox.json: %s", run.id, e)

    async def _relay(self, sandbox: Sandbox, host: SandboxHost):
        """The proxy's listener inside the sandbox's network namespace: made here when the
        sandbox runs on this host, else by the host's workerd. Returns (a closer, base URL)."""
        url = urlsplit(self.proxy.base_url)
        if host.node is not None:
            pid = sandbox.engine_pid()
            if pid is None or self.remote_relay is None:
                raise SandboxError(f"sandbox host {host.name}: no way to reach the proxy from its sandboxes "
                                   f"(node {host.node}'s relay is not available here)")
            port, close = await self.remote_relay(host.node, pid, url.port)
            return _Closer(close), f"http://127.0.0.1:{port}"
        pid = sandbox.netns_pid()
        if pid is None:
            raise SandboxError(f"{self.backend.name}: no local network namespace to reach the proxy from")
        target = "127.0.0.1" if url.hostname in (None, "", "0.0.0.0", "::") else url.hostname
        relay = ProxyRelay(target, url.port)
        try:
            port = await relay.start(pid)
        except RelayError as e:  # the sandbox layer's failure: the execution ends aborted_infra
            raise SandboxError(str(e)) from None
        return relay, f"http://127.0.0.1:{port}"

    async def _run_harness(self, run: Execution, sandbox: Sandbox, folder: Path, key: str, base: str, bind: bool):
        preset = self._presets.pop(run.id, self.spec.preset)
        contained = self.backend.needs_image
        spec = self.spec  # the task's own deadline, then an explicit flag, then the preset's, then the run's
        timeout = run.task.timeout_s or spec.timeout_flag_s or spec.preset.timeout_s or spec.timeout_s
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
        sandbox.on_start = partial(self._started, run, folder, bind, timeout)
        with open(folder / "harness.log", "ab") as logf:  # gyre's own lines go to logf, past the cap
            try:
                result = await self._exec_held(sandbox, argv, env, timeout, logf)
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
                report = await sandbox.download(STATE_INSIDE, host_state)
                if report.problem():
                    log.warning("execution %s: harness state copied out in part: %s", run.id, report.problem())
            except (OSError, SandboxError) as e:  # FileNotFoundError among them: the harness kept none
                log.debug("execution %s: harness state not copied out: %s", run.id, e)
        return result.code, result.timed_out

    async def _exec_held(self, sandbox: Sandbox, argv: list[str], env: dict, timeout: float, logf) -> ExecResult:
        """The harness's exec, its output capped in harness.log and, where the task sets
        storage_mb, its storage held to it (sandbox/storage.py): over the limit the harness
        is stopped and its exit counts as STORAGE_EXIT."""
        kw = dict(env=env, timeout_s=timeout, grace_s=self.spec.preset.grace_s,
                  log=CappedLog(logf, HARNESS_LOG_BYTES, "harness.log"))
        limit_mb = sandbox.spec.limits.storage_mb
        if not limit_mb:
            return await sandbox.exec(argv, **kw)
        result, used = await storage.exec_within(sandbox, limit_mb << 20, argv, **kw)
        if used <= limit_mb << 20:
            return result
        logf.write(f"gyre: storage limit of {limit_mb} MiB exceeded ({used >> 20} MiB written); the harness "
                   f"{'was stopped' if result is None else 'had ended'}\n".encode())
        return ExecResult(STORAGE_EXIT, False, b"")

    async def _close(self, run: Execution, sandbox: Sandbox, folder: Path, failed: bool) -> None:
        """After the execution has its status: its processes killed, its workspace copied out
        (if not yet), then the sandbox removed (or kept). Never raises: nothing here may change
        the status or stop the run."""
        self._live.pop(run.id, None)
        try:
            if not self.scoring.copied(run.id):
                await sandbox.cancel()
                await self.scoring.copy_out(run, sandbox, folder, needed=False)
        except Exception as e:  # noqa: BLE001 - logged; the sandbox is still removed below
            log.warning("execution %s: workspace not copied out: %s", run.id, e)
        finally:
            self.scoring.forget(run.id)
        keep = self.spec.keep_sandbox == "always" or (self.spec.keep_sandbox == "on_failure" and failed)
        if keep:
            info = {"backend": self.backend.name, "id": getattr(sandbox, "id", None), "status": run.status}
            try:
                reaper.mark_kept(self.run_dir, run.id, info)  # the reaper leaves it alone
                log.warning("execution %s: sandbox %s kept (keep_sandbox = %s)", run.id, info["id"],
                            self.spec.keep_sandbox)
                return
            except OSError as e:
                log.warning("execution %s: sandbox not kept (%s): removed", run.id, e)
        await remove_sandbox(run, sandbox)

    async def stop(self, run_id: str) -> None:
        sandbox = self._live.get(run_id)
        if sandbox is not None:
            try:
                await sandbox.cancel()
            except SandboxError as e:
                log.warning("execution %s: not stopped: %s", run_id, e)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(r) for r in list(self._live)))
