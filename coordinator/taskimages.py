"""taskimages.py: `TaskImages`, what an execution's sandbox needs before its slot is taken.

Each task's image on each sandbox host, built (or pulled) once per task and host, and the folder
the preset's sandbox_pip is installed into (sandbox/agentdir.py), once per run. The scheduler
asks `state` before it launches an execution (a build runs while no slot is taken; a recipe
that fails fails every execution of its task, aborted_infra), the launcher awaits `prepare` on
the host it chose, and `check` refuses a task this run cannot run anywhere (its start fails,
naming it). Owned by the launcher (launcher.py); not the engine's build (sandbox/images.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from gyre.coordinator.sandbox import ImageBuildError, SandboxError
from gyre.coordinator.sandbox.hosts import HostPool, SandboxHost
from gyre.coordinator.sandbox.preflight import task_refusal
from gyre.coordinator.tasks import Task

log = logging.getLogger("gyre.coordinator")


class TaskImages:
    def __init__(self, pool: HostPool, spec):
        self.pool = pool
        self.backend = pool.hosts[0].backend  # the run's one kind (needs_image, name)
        self.spec = spec  # the launcher's LaunchSpec: its preset, solution mode, internet
        self._images: dict[tuple[str, str], asyncio.Future] = {}  # (task id, host) -> its image (or the error)
        self._image_errors: dict[str, BaseException] = {}  # task id -> the build's error (the task's own fault)
        self._agent: asyncio.Future | None = None  # the preset's sandbox_pip folder on this host, installed once
        self._warned_down = -1e9

    def state(self, task: Task) -> str:
        """"ready" (an up host under its cap holds the task's image), "building" (wait: a build
        runs, every host is at its cap, or none is up) or "failed" (the image cannot be made:
        the execution ends aborted_infra). The first ask starts a build."""
        if task.id in self._image_errors:
            return "failed"
        try:
            self.check(task)
        except SandboxError as e:  # this run cannot run it anywhere
            self._image_errors[task.id] = e
            return "failed"
        up = self.pool.up
        if not up:  # wait for one to answer again (each failing at once would churn through groups)
            now = time.monotonic()
            if now - self._warned_down > 30:
                self._warned_down = now
                log.warning("no sandbox host is up (%s): executions wait",
                            "; ".join(f"{h.name}: {h.why}" for h in self.pool.hosts))
            return "building"
        ready = self.ready_hosts(task)
        if any(not h.full for h in up if h.name in ready):
            return "ready"
        if any(not self._images[(task.id, h.name)].done() for h in up if (task.id, h.name) in self._images):
            return "building"
        host = self.pool.choose()
        if host is None:
            return "building"  # every up host is at its cap: wait for a slot there
        self._build(task, host)
        return "failed" if task.id in self._image_errors else "building" if not self._images[
            (task.id, host.name)].done() else "ready"

    def ready_hosts(self, task: Task) -> set[str]:
        """The hosts that hold the task's image."""
        return {name for (tid, name), fut in self._images.items()
                if tid == task.id and fut.done() and fut.exception() is None}

    def _build(self, task: Task, host: SandboxHost) -> asyncio.Future:
        key = (task.id, host.name)
        fut = self._images.get(key)
        if fut is None or (fut.done() and fut.exception() is not None and task.id not in self._image_errors):
            fut = self._images[key] = asyncio.ensure_future(self._prepare(task, host))
            fut.add_done_callback(lambda f: self._built(task, host, f))
        return fut

    def _built(self, task: Task, host: SandboxHost, fut: asyncio.Future) -> None:
        err = None if fut.cancelled() else fut.exception()
        if (isinstance(err, ImageBuildError) and host.state == "up") or (
                err is not None and not isinstance(err, SandboxError)):
            self._image_errors.setdefault(task.id, err)  # the recipe's fault: no host will do better

    async def prepare(self, task: Task, host: SandboxHost | None = None) -> str | None:
        """The task's image on `host` (default: the first up host), built (or pulled) once per
        task and host; SandboxError if it cannot be."""
        host = host or (self.pool.up or self.pool.hosts)[0]
        if task.id in self._image_errors:
            raise self._image_errors[task.id]
        self.check(task)
        return await asyncio.shield(self._build(task, host))

    async def _prepare(self, task: Task, host: SandboxHost) -> str | None:
        env = task.environment
        self.check(task)
        if not self.backend.needs_image:
            return None
        await self.agent_dir()  # before the slot too; its failure fails every task (no host does better)
        if env is None:
            return None
        host.building += 1
        try:
            return await host.backend.prepare(env.build_dir, image=env.image, dockerfile=env.dockerfile,
                                              timeout_s=env.build_timeout_s, name=task.id)
        finally:
            host.building -= 1

    async def agent_dir(self) -> str | None:
        """The host folder the preset's sandbox_pip is installed into (sandbox/agentdir.py), once
        per run and per spec on this host; None when it has none."""
        preset = self.spec.preset
        if not preset.sandbox_pip or self.spec.solution:
            return None
        if self._agent is None:
            from gyre.coordinator.sandbox.agentdir import agent_dir

            self._agent = asyncio.ensure_future(asyncio.to_thread(
                agent_dir, preset.name, preset.sandbox_pip, preset.sandbox_python))
        return str(await asyncio.shield(self._agent))

    def check(self, task: Task) -> None:
        """SandboxError where this run cannot run `task` anywhere (sandbox/preflight.py)."""
        why = task_refusal(task, backend=self.backend.name, needs_image=self.backend.needs_image,
                           internet=self.spec.allow_internet)
        if why is not None:
            raise SandboxError(why)
